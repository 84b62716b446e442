"""The suite's fixtures: plugin modules of tests/fixtures/, loaded for every test package.

Tests share fixtures only through these plugins (and helpers through the modules' plain
functions), never by importing a conftest or another test module.
"""

pytest_plugins = [
    "tests.fixtures.stack",
    "tests.fixtures.namespaces",
    "tests.fixtures.processes",
    "tests.fixtures.runs",
    "tests.fixtures.gateway",
    "tests.fixtures.model_server",
    "tests.fixtures.ops",
    "tests.fixtures.streams",
]

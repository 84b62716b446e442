"""Files koda ships beside its code, and the source checkout it may run from.

The package carries what its commands read at run time as package data
(``koda_runtime.deploy``: the local Kafka's pom, jar lock and logging config, and the
alert rules; the JSON Schemas; the migrations), so an installed wheel needs no
checkout. Commands that *write* project files (``koda schemas write``,
``python -m koda_runtime.localstack.jars relock``) write into the source checkout,
or into a path the user gives, and never into an installed package.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from koda_runtime.errors import PrerequisiteError

DISTRIBUTION = "koda-runtime"


def deploy_path(*parts: str) -> Path:
    """A file or folder of the shipped ``deploy/`` data (``deploy_path("local")``)."""
    node = files("koda_runtime.deploy")
    for part in parts:
        node = node / part
    path = Path(str(node))
    if not path.exists():
        raise PrerequisiteError(
            f"{path} is missing from the installed package: reinstall {DISTRIBUTION}"
        )
    return path


def checkout_root() -> Path | None:
    """The source checkout this package runs from, or None when it runs installed.

    An editable install links each file to the checkout, so the real path of this
    module is inside it; a wheel's copy is not."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and f'name = "{DISTRIBUTION}"' in pyproject.read_text():
        return root
    return None


def checkout_path(*parts: str, what: str) -> Path:
    """A path inside the source checkout, for commands that write project files."""
    root = checkout_root()
    if root is None:
        raise PrerequisiteError(
            f"{what} writes into a source checkout of koda, and this one runs from an "
            "installed package; run it from a checkout"
        )
    return root.joinpath(*parts)

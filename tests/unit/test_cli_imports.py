"""The command line's gateway clients, and the scheduler, load no server code (FastAPI,
uvicorn, the app): they use the gateway's stores and producer, never its HTTP side."""

from __future__ import annotations

import subprocess
import sys

SERVER_MODULES = (
    "fastapi",
    "starlette",
    "uvicorn",
    "koda_runtime.gateway.app",
    "koda_runtime.gateway.bootstrap",
)


def _loaded_after(statements: str) -> list[str]:
    code = (
        f"import sys\n{statements}\n"
        f"print(','.join(m for m in {SERVER_MODULES!r} if m in sys.modules))"
    )
    done = subprocess.run(  # noqa: S603 - our own interpreter, a fixed program
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return [m for m in done.stdout.strip().split(",") if m]


def test_the_gateway_clients_import_no_server_module() -> None:
    assert (
        _loaded_after(
            "import koda_runtime.cli.runs, koda_runtime.cli.schedules, koda_runtime.cli.memories"
        )
        == []
    )


def test_the_koda_command_with_its_subcommands_imports_no_server_module() -> None:
    assert _loaded_after("import koda_runtime.cli\nkoda_runtime.cli._add_optional_apps()") == []


def test_the_scheduler_imports_no_server_module() -> None:
    assert _loaded_after("import koda_runtime.scheduler.bootstrap") == []


def test_the_probe_sees_a_server_import() -> None:
    # Without this, a probe that never saw anything would pass the two tests above.
    assert "koda_runtime.gateway.app" in _loaded_after("import koda_runtime.gateway.server")

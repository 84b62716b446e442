"""koda as a user installs it: the built wheel in a fresh venv, run outside the checkout.

``pip wheel`` builds the wheel from a copy of the checkout's files, a new venv installs
it (``--no-deps``), and the venv reaches the dependencies by path from the development
venv (one ``.pth`` line: no download, and no editable link to the checkout, since a path
line does not run the development venv's own ``.pth`` files). ``pip check`` then proves
that the wheel's requirements are met. From an empty directory, the installed ``koda``
starts the local stack from the data the wheel ships (``koda dev``: Kafka from the
packaged pom and jar lock, PostgreSQL, migrations, topics, a gateway, a worker and a
scheduler) and runs a run to ``done``. Any file the package reads from the checkout
instead of its own data fails here.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from koda_runtime.localstack.procs import free_port
from tests.fixtures.processes import ROOT
from tests.support import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def run(
    argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(  # noqa: S603 - our own interpreter and wheel
        argv, capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )
    assert done.returncode == 0, f"{argv}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def venv() -> Iterator[Path]:
    """A fresh venv with the wheel installed, and its dependencies by path."""
    work = Path(tempfile.mkdtemp(prefix="koda-wheel-", dir="/tmp"))
    try:
        # Built from a copy of the files git would commit: pip builds a local folder in
        # place, and a stale build/lib of the checkout would put deleted modules into
        # the wheel (and the build would write into the checkout).
        source = work / "source"
        listed = run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT).stdout
        for name in listed.splitlines():
            if (ROOT / name).is_file():
                (source / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, source / name)
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work), str(source)])
        (wheel,) = work.glob("koda_runtime-*.whl")
        target = work / "venv"
        run([sys.executable, "-m", "venv", str(target)])
        python = target / "bin" / "python"
        site = run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
        Path(site, "koda-dev-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)])
        yield target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bare_env(**extra: str) -> dict[str, str]:
    """No koda setting from the suite: the installed koda finds its own stack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KODA_") and k != "APP_ENV"}
    env.pop("PYTHONPATH", None)
    return env | extra


def test_the_wheel_installs_as_koda_runtime_and_needs_nothing_from_the_checkout(
    venv: Path,
) -> None:
    python = str(venv / "bin" / "python")
    check = run([python, "-m", "pip", "check"], env=bare_env())
    assert "No broken requirements" in check.stdout, check.stdout
    where = run(
        [python, "-c", "import koda_runtime, sys; print(koda_runtime.__file__)"],
        cwd="/tmp",
        env=bare_env(),
    ).stdout.strip()
    assert where.startswith(str(venv)), where
    # One import name: none of the checkout's folder names is installed on its own.
    names = run(
        [
            python,
            "-c",
            "import importlib.util as u; print([n for n in ('koda', 'cli', 'gateway', 'processors',"
            " 'scheduler', 'topics', 'schemas') if u.find_spec(n)])",
        ],
        cwd="/tmp",
        env=bare_env(),
    ).stdout.strip()
    assert names == "[]", names


def test_the_installed_cli_refuses_to_write_into_site_packages(venv: Path, tmp_path: Path) -> None:
    koda = str(venv / "bin" / "koda")
    assert "services" in run([koda, "--help"], cwd=tmp_path, env=bare_env()).stdout
    assert (
        "match" in run([koda, "schemas", "write", "--check"], cwd=tmp_path, env=bare_env()).stdout
    )
    refused = subprocess.run(  # noqa: S603
        [koda, "schemas", "write"], cwd=tmp_path, env=bare_env(), capture_output=True, text=True
    )
    assert refused.returncode == 2 and "source checkout" in refused.stderr, refused.stderr
    out = tmp_path / "json"
    run([koda, "schemas", "write", "--out", str(out)], cwd=tmp_path, env=bare_env())
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in (ROOT / "topics" / "records" / "json").iterdir()
    )


def test_koda_dev_from_the_wheel_starts_the_stack_and_runs_a_run(venv: Path) -> None:
    home = Path(tempfile.mkdtemp(prefix="koda-wheel-dev-", dir="/tmp"))
    home.chmod(0o711)  # PostgreSQL runs as its own user, who must enter the state dir
    port = free_port()
    env = bare_env(
        APP_ENV="dev",
        KODA_GATEWAY_PORT=str(port),
        KODA_WORKER_PORT=str(free_port()),
    )
    log = home / "dev.log"
    with log.open("wb") as out:
        dev = subprocess.Popen(  # noqa: S603
            [
                str(venv / "bin" / "koda"),
                "dev",
                "--state-dir",
                str(home / "state"),
                "--workers",
                "1",
            ],
            cwd=home,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer dev:wheel"}
    try:

        def ready() -> bool:
            assert dev.poll() is None, log.read_text(errors="replace")[-4000:]
            try:
                return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=180, interval=0.5, what="koda dev's gateway ready")
        body = {"input": {"text": "from a wheel", "demo": {"tokens": 4, "delay_ms": 1}}}
        accepted = httpx.post(f"{base}/v1/runs", json=body, headers=auth, timeout=10)
        assert accepted.status_code == 202, accepted.text
        run_id = accepted.json()["run_id"]

        def finished() -> dict[str, object] | None:
            detail = httpx.get(f"{base}/v1/runs/{run_id}", headers=auth, timeout=5).json()
            return detail if detail["status"] in ("done", "failed", "cancelled") else None

        detail = wait_until(finished, timeout=90, interval=0.3, what="the run finished")
        assert detail["status"] == "done" and detail["output"], detail
    finally:
        if dev.poll() is None:
            os.killpg(dev.pid, signal.SIGINT)
        try:
            dev.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(dev.pid, signal.SIGKILL)
            dev.wait()
        text = log.read_text(errors="replace")
        shutil.rmtree(home, ignore_errors=True)
    assert dev.returncode == 0, text[-4000:]
    assert "koda dev: stopped" in text

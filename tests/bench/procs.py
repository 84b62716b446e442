"""Child processes of the benchmarks: koda's own (tests/workers.py) and the rivals'."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from koda.settings import Settings
from tests.workers import ROOT
from topics.catalogue import RUN_CHUNKS, RUN_EVENTS, RUNS

QUIX_PYTHON = ROOT / ".venv-quix" / "bin" / "python"


@dataclass
class ChildProcess:
    """``python -m <module> <args>`` with its output in a temp file."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def start(self) -> ChildProcess:
        fd, path = tempfile.mkstemp(prefix=f"koda-bench-{self.name}-", suffix=".log")
        self.log_path = Path(path)
        env = dict(self.env)
        env["PYTHONPATH"] = str(ROOT)
        self.proc = subprocess.Popen(  # noqa: S603
            self.argv, env=env, cwd=ROOT, stdout=fd, stderr=fd, start_new_session=True
        )
        os.close(fd)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> None:
        if not self.alive():
            raise AssertionError(f"{self.name} exited:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self, timeout: float = 30.0) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


RIVALS = {
    "ceiling": (sys.executable, "tests.bench.ceiling"),
    "naive": (sys.executable, "tests.bench.naive"),
    "quix": (str(QUIX_PYTHON), "tests.bench.quix"),
}


def rival(kind: str, settings: Settings, index: int, group: str) -> ChildProcess:
    """One process of a rival pipeline, reading ``settings``' topics and schema."""
    python, module = RIVALS[kind]
    names = settings.names
    argv = [
        python,
        "-m",
        module,
        "--bootstrap",
        settings.kafka_bootstrap,
        "--dsn",
        settings.database_url,
        "--schema",
        names.pg_schema(),
        "--runs-topic",
        names.topic(RUNS),
        "--chunks-topic",
        names.topic(RUN_CHUNKS),
        "--events-topic",
        names.topic(RUN_EVENTS),
        "--group",
        group,
        "--worker",
        f"{kind}-{index}",
        "--inflight",
        str(settings.max_inflight),
    ]
    return ChildProcess(f"{kind}-{index}", argv)

"""The rival pipelines' processes, launched as tests/fixtures/processes.py launches koda's."""

from __future__ import annotations

import os
import sys

from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, RUN_EVENTS, RUNS
from tests.fixtures.processes import ROOT, ChildProcess

QUIX_PYTHON = ROOT / ".venv-quix" / "bin" / "python"


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
    # The Quix venv has no editable install of this tree: it imports koda from ROOT.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return ChildProcess(f"bench-{kind}-{index}", argv, env)

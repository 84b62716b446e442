"""Session fixtures shared by every test package."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from koda.localstack import StackInfo, down, up


@pytest.fixture(scope="session")
def stack() -> Iterator[StackInfo]:
    """Real Kafka and PostgreSQL for the whole session.

    Uses KODA_KAFKA_BOOTSTRAP and KODA_DATABASE_URL when both are set (services started
    elsewhere, e.g. by `koda services up`); otherwise starts a private single-node stack
    in a temporary dir under /tmp, so a running `make dev` is never touched, and stops
    it when the session ends.
    """
    bootstrap = os.environ.get("KODA_KAFKA_BOOTSTRAP")
    database_url = os.environ.get("KODA_DATABASE_URL")
    if bootstrap and database_url:
        yield StackInfo(bootstrap, database_url, brokers=len(bootstrap.split(",")))
        return
    state_dir = Path(tempfile.mkdtemp(prefix="koda-test-stack-", dir="/tmp"))
    try:
        yield up(state_dir)
    finally:
        try:
            down(state_dir)
        finally:
            shutil.rmtree(state_dir, ignore_errors=True)

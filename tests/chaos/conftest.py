"""A private stack for the fault tests: they stop and kill its Kafka and PostgreSQL and
cut or slow each process's links to them (Toxiproxy).

Shared by every test of this package (one start-up), never by the rest of the suite.
After each test both services are started again if the test left one down.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from koda_runtime.localstack import kafka_node_start, pg_start
from tests.chaos.cluster import Stack, proxied_stack


@pytest.fixture(scope="package")
def fault_stack() -> Iterator[Stack]:
    """One broker and PostgreSQL, each process's links through its own Toxiproxy slot."""
    state = Path(tempfile.mkdtemp(prefix="koda-faults-", dir="/tmp"))
    try:
        with proxied_stack(state, brokers=1) as stack:
            yield stack
    finally:
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def stack_restored(fault_stack: Stack) -> Iterator[Stack]:
    """``fault_stack``, with every service running again after the test."""
    yield fault_stack
    if fault_stack.network is not None:
        fault_stack.network.heal()
    pg_start(fault_stack.state_dir)
    for node in range(1, fault_stack.info.brokers + 1):
        kafka_node_start(fault_stack.state_dir, node)

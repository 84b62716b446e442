"""The chunk topic as a replay log: compaction, and rebuilding outputs from offset 0."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from confluent_kafka import Producer
from sqlalchemy import text

from koda_runtime.kafka import producer_config
from koda_runtime.lifecycle.chunks import chunk_key, final_key, visible_output
from koda_runtime.processors.compactor import ChunkCompactor
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS
from koda_runtime.topics.chunklog import read_chunk_log
from koda_runtime.topics.records.codec import chunk_value
from tests.fixtures.processes import ROOT, GatewayProcess, WorkerProcess, settings_env
from tests.fixtures.runs import Submitter, read_topic
from tests.sse_client import bearer, contents, read_stream
from tests.support import wait_until

END = {"done": "done", "failed": "error", "cancelled": "cancelled"}


@pytest.fixture
def worker(env: Settings) -> Iterator[WorkerProcess]:
    w = WorkerProcess(env, "w1").start()
    yield w
    w.stop()


def run_inputs(tag: str) -> list[dict[str, Any]]:
    return [
        {"text": f"{tag} plain", "demo": {"tokens": 6, "delay_ms": 1}},
        {"text": f"{tag} retried", "demo": {"tokens": 6, "delay_ms": 1, "fail_attempts": 1}},
        {"text": f"{tag} broken", "demo": {"tokens": 4, "delay_ms": 1, "fail_attempts": 99}},
    ]


def submit_all(sub: Submitter, tag: str) -> dict[str, dict[str, Any]]:
    runs = {sub.submit(f"{tag}-user-{i}", inp): inp for i, inp in enumerate(run_inputs(tag))}
    wait_until(lambda: sub.all_terminal(list(runs)), timeout=90, what=f"{tag} runs terminal")
    return runs


def assert_rebuilt_exactly(env: Settings, sub: Submitter, run_ids: list[str]) -> dict[str, Any]:
    """Every run's output and end, rebuilt from the topic alone, equal Postgres's."""
    log = read_chunk_log(env)
    for run_id in run_ids:
        rows = sub.messages(run_id)
        status = sub.statuses([run_id])[run_id]
        rebuilt = log.runs[run_id]
        assert rebuilt.output == visible_output((r.seq, r.kind, r.content) for r in rows)
        assert rebuilt.end == END[status]
    return log.runs


def test_compaction_keeps_every_output_rebuildable_from_the_topic(
    env: Settings, submitter: Submitter, worker: WorkerProcess
) -> None:
    old = submit_all(submitter, "old")
    # A redelivered duplicate (same key, same value) collapses into the original.
    dup_run = next(iter(old))
    first = submitter.messages(dup_run)[0]
    producer = Producer(producer_config(env, "test"))
    producer.produce(
        env.names.topic(RUN_CHUNKS),
        key=chunk_key(dup_run, first.seq).encode(),
        value=chunk_value(dup_run, first.seq, first.kind, first.content, first.attempt),
    )
    assert producer.flush(10) == 0
    old_messages = {r: submitter.messages(r) for r in old}

    compactor = ChunkCompactor(env)
    try:
        assert compactor.compact_once(older_than_s=3600).runs == 0  # too young
        report = compactor.compact_once(older_than_s=0)
    finally:
        compactor.close()
    assert report.runs == len(old)
    assert report.tombstones == sum(len(rows) for rows in old_messages.values())
    new = submit_all(submitter, "new")  # finished after the pass: not compacted
    everything = [*old, *new]
    runs = assert_rebuilt_exactly(env, submitter, everything)
    assert {r for r in everything if runs[r].compacted} == set(old)
    for run_id, inp in {**old, **new}.items():
        if "broken" not in inp["text"]:
            assert runs[run_id].output == "".join(demo_tokens(inp))
    # Postgres keeps every message; the topic has one final record per compacted run.
    assert {r: submitter.messages(r) for r in old} == old_messages
    records = read_topic(env, env.names.topic(RUN_CHUNKS))
    finals = [m for m in records if m.key().decode().endswith(":final")]
    assert sorted(m.key().decode() for m in finals) == sorted(final_key(r) for r in old)
    tombstones = {m.key().decode() for m in records if m.value() is None}
    for run_id in old:
        assert {chunk_key(run_id, r.seq) for r in submitter.messages(run_id)} <= tombstones

    # The command, again: only the new runs; then nothing; a run marked back is redone.
    def compact_cli() -> str:
        done = subprocess.run(  # noqa: S603
            [sys.executable, "-m", "koda_runtime.cli", "chunks", "compact", "--older-than", "0"],
            env=settings_env(env),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert compact_cli().startswith(f"compacted {len(new)} runs")
    assert compact_cli().startswith("compacted 0 runs")
    with submitter.engine.begin() as conn:
        conn.execute(text("UPDATE runs SET compacted_at = NULL WHERE id = :r"), {"r": dup_run})
    assert compact_cli().startswith("compacted 1 runs")
    runs = assert_rebuilt_exactly(env, submitter, everything)
    assert all(runs[r].compacted for r in everything)

    # A compacted run is still served over SSE, from Postgres, in full.
    gateway = GatewayProcess(env).start()
    try:
        retried = next(r for r, inp in old.items() if "retried" in inp["text"])
        user = submitter.query("SELECT user_id FROM runs WHERE id = :r", r=retried)[0].user_id

        async def stream() -> Any:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as c:
                return await read_stream(c, retried, headers=bearer(user))

        s = asyncio.run(stream())
        rows = submitter.messages(retried)
        assert s.closed_by_server
        assert contents(s.events) == [(r.seq, r.kind, r.content) for r in rows]
    finally:
        gateway.stop()

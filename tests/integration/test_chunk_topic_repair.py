"""The chunk topic holds every chunk Postgres holds, whatever died between the two.

Provoked here, against the real broker and database, with worker processes killed by
SIGKILL at the exact point between a Postgres commit and the produce that follows it
(``KODA_TEST_FAULT``, processors/faults.py):

* after the *finish* commit (last chunks and ``done`` together): the run is terminal
  and its end is in Postgres only; the successor, which would skip the run, first
  produces it again. The topic's answer equals Postgres's, `koda replay` into DuckDB
  shows it before any compaction, and `koda chunks verify` goes from 1 to 0;
* after a *streaming* batch's commit: the successor resumes the run and produces the
  earlier output again before its own, so on the topic every chunk precedes ``done``;
* a gap made on purpose (runs whose worker died and that no worker meets again):
  `koda chunks verify` names the missing seqs and exits 1; `koda chunks repair` (the
  compactor's completeness pass) leaves runs inside ``KODA_REPAIR_AFTER`` alone and
  fills the others, after which verify exits 0; the scheduled compactor job does the
  same in each of its rounds.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import httpx
from confluent_kafka import Producer
from sqlalchemy import text
from typer.testing import CliRunner

from koda_runtime import cli
from koda_runtime.kafka import producer_config
from koda_runtime.lifecycle.chunks import chunk_key, visible_output
from koda_runtime.processors.compactor import ChunkCompactor
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, partition_for_key
from koda_runtime.topics.chunklog import RunLog, read_chunk_log
from koda_runtime.topics.records.codec import RUN_CHUNK, chunk_value, headers_for
from tests.fixtures.processes import ROOT, WorkerProcess, free_port, settings_env
from tests.fixtures.runs import Submitter, read_topic
from tests.support import wait_until


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str


def koda(settings: Settings, *args: str, **env: str) -> Done:
    """``koda ARGS`` with the environment an operator's shell would give it, in this
    process (Python's start-up, paid once per command, would dominate this module's
    time); the exit status is the caller's to check."""
    result = CliRunner().invoke(cli.app, list(args), env=settings_env(settings, **env))
    return Done(result.exit_code, result.stdout, result.stderr)


def killed_at_fault(settings: Settings, fault: str, sub: Submitter, inp: dict[str, Any]) -> str:
    """Submit one run to a worker that SIGKILLs itself at ``fault``; the run's id."""
    doomed = WorkerProcess(settings, "w-doomed", {"KODA_TEST_FAULT": fault}).start()
    try:
        run_id = sub.submit("alice", inp)
        wait_until(lambda: not doomed.alive(), timeout=90, what=f"the worker to die at {fault}")
        assert doomed.proc is not None and doomed.proc.returncode == -signal.SIGKILL
        assert f"test fault {fault}: SIGKILL after the commit" in doomed.log()
        return run_id
    finally:
        doomed.kill()


def pg_events(sub: Submitter, run_id: str) -> dict[int, tuple[str, str, int]]:
    return {m.seq: (m.kind, m.content, m.attempt) for m in sub.messages(run_id)}


def topic_events(run: RunLog) -> dict[int, tuple[str, str, int]]:
    return {seq: (e.kind, e.content, e.attempt) for seq, e in run.events.items()}


def whole_on_topic(settings: Settings, run_id: str) -> RunLog | None:
    run = read_chunk_log(settings).runs.get(run_id)
    return run if run is not None and run.complete else None


def republished(port: int, by: str) -> float:
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    line = next(
        (
            x
            for x in body.splitlines()
            if x.startswith(f'koda_chunks_republished_total{{by="{by}"}}')
        ),
        None,
    )
    return float(line.split()[-1]) if line else 0.0


def test_a_worker_killed_between_the_finish_commit_and_the_produce(
    env: Settings, tmp_path: Path
) -> None:
    sub = Submitter(env)
    inp = {"text": "killed after the finish", "demo": {"tokens": 40, "delay_ms": 2}}
    try:
        run_id = killed_at_fault(env, "kill-after-finish-commit", sub, inp)
        assert sub.statuses([run_id]) == {run_id: "done"}
        truth = pg_events(sub, run_id)
        last = max(truth)
        assert truth[last][0] == "done"
        # The gap: the end is in Postgres only, and no reader takes the run as ended.
        before = read_chunk_log(env).runs.get(run_id)
        assert before is None or (last not in before.events and before.end is None)
        verify = koda(env, "chunks", "verify")
        assert verify.returncode == 1, verify.stdout + verify.stderr
        assert f"run {run_id}: missing seqs" in verify.stdout

        port = free_port()
        successor = WorkerProcess(env, "w-successor", {"KODA_WORKER_PORT": str(port)}).start()
        try:
            run = wait_until(lambda: whole_on_topic(env, run_id), timeout=90, what="whole topic")
            assert topic_events(run) == truth
            assert run.output == "".join(demo_tokens(inp))
            assert run.output == visible_output((s, k, c) for s, (k, c, _) in truth.items())
            # The worker met the terminal run again: it produced all of it, then marked it.
            wait_until(
                lambda: (
                    sub.query("SELECT published_seq FROM runs WHERE id = :r", r=run_id)[0][0]
                    == last
                ),
                what="published_seq",
            )
            assert republished(port, "skip") == len(truth)
        finally:
            assert successor.stop() == 0, successor.log()[-3000:]

        # A warehouse replayed from the topics, before any compaction, has the whole answer.
        path = tmp_path / "warehouse.duckdb"
        replay = subprocess.run(  # noqa: S603 - as a data team runs it
            [
                sys.executable,
                "-m",
                "koda_runtime.cli",
                "replay",
                "--quiet",
                "--to",
                f"duckdb:///{path}",
            ],
            env=settings_env(env),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert replay.returncode == 0, replay.stdout + replay.stderr
        conn = duckdb.connect(str(path), read_only=True)
        try:
            row = conn.execute(
                "SELECT output, end_kind, last_seq, compacted FROM outputs WHERE run_id = ?",
                [run_id],
            ).fetchone()
            chunks = conn.execute(
                "SELECT count(*) FROM chunks WHERE run_id = ?", [run_id]
            ).fetchone()
        finally:
            conn.close()
        assert row == ("".join(demo_tokens(inp)), "done", last, False)
        assert chunks == (len(truth),)
        verify = koda(env, "chunks", "verify")
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert "0 runs with gaps, 0 chunks missing" in verify.stdout
    finally:
        sub.close()


def test_a_worker_killed_between_a_chunk_commit_and_the_produce(env: Settings) -> None:
    sub = Submitter(env)
    inp = {"text": "killed while streaming", "demo": {"tokens": 30, "delay_ms": 20}}
    try:
        run_id = killed_at_fault(env, "kill-after-chunks-commit", sub, inp)
        assert sub.statuses([run_id])[run_id] in ("running", "streaming")
        earlier = pg_events(sub, run_id)
        assert earlier, "the killed worker committed a chunk batch"

        port = free_port()
        successor = WorkerProcess(env, "w-successor", {"KODA_WORKER_PORT": str(port)}).start()
        try:
            run = wait_until(lambda: whole_on_topic(env, run_id), timeout=90, what="whole topic")
            assert republished(port, "resume") == len(earlier)
        finally:
            assert successor.stop() == 0, successor.log()[-3000:]
        truth = pg_events(sub, run_id)
        assert topic_events(run) == truth
        assert run.output == "".join(demo_tokens(inp))
        kinds = [k for _, (k, _, _) in sorted(truth.items())]
        assert kinds[len(earlier)] == "reset" and kinds[-1] == "done"
        # On the topic every chunk comes before the run's terminal event.
        first: dict[int, int] = {}
        for rec in read_topic(env, env.names.topic(RUN_CHUNKS)):
            seq = int(rec.key().decode().rpartition(":")[2])
            if rec.key().decode().startswith(run_id):
                first.setdefault(seq, rec.offset())
        assert set(first) == set(truth)
        assert max(first.values()) == first[max(truth)]
    finally:
        sub.close()


def test_verify_finds_a_gap_made_on_purpose_and_the_completeness_pass_fills_it(
    env: Settings,
) -> None:
    """Runs a dead worker left behind and that no worker meets again: Postgres has all of
    each, the topic part. One finished an hour ago, one just now (inside the delay)."""
    sub = Submitter(env)
    producer = Producer(producer_config(env, "test"))
    try:
        old = left_behind(sub, producer, "an hour ago", finished_s_ago=3600, hole=(5, 8))
        new = left_behind(sub, producer, "just now", finished_s_ago=0, hole=(2, 3))
        outputs = koda(env, "chunks", "outputs")
        assert outputs.returncode == 0, outputs.stderr
        lines = {row["run_id"]: row for row in map(json.loads, outputs.stdout.splitlines())}
        assert (lines[old]["end"], lines[old]["missing"]) == (None, [5, 6, 7])

        verify = koda(env, "chunks", "verify")
        assert verify.returncode == 1
        assert f"run {old}: missing seqs 5-7 (3 of 11 absent)" in verify.stdout
        assert f"run {new}: missing seqs 2 (1 of 11 absent)" in verify.stdout
        assert "2 runs with gaps, 4 chunks missing on the topic" in verify.stdout
        # --since leaves out runs that finished before it.
        recent = koda(env, "chunks", "verify", "--since", "-30m")
        assert recent.returncode == 1 and old not in recent.stdout and new in recent.stdout
        bad = koda(env, "chunks", "verify", "--since", "yesterday-ish")
        assert bad.returncode == 2 and "--since 'yesterday-ish' is not a time" in bad.stderr

        repair = koda(env, "chunks", "repair", KODA_REPAIR_AFTER="600")
        assert repair.stdout.strip() == "completed 1 runs (11 chunk records produced)"
        verify = koda(env, "chunks", "verify")
        assert verify.returncode == 1 and old not in verify.stdout and new in verify.stdout
        repair = koda(env, "chunks", "repair", "--older-than", "0")
        assert repair.stdout.strip() == "completed 1 runs (11 chunk records produced)"
        verify = koda(env, "chunks", "verify")
        assert verify.returncode == 0, verify.stdout
        assert koda(env, "chunks", "repair", "--older-than", "0").stdout.startswith(
            "completed 0 runs"
        )
        marks = sub.query("SELECT id, published_seq FROM runs WHERE id IN (:a, :b)", a=old, b=new)
        assert dict(marks) == {old: 10, new: 10}
        for run_id in (old, new):
            run = read_chunk_log(env).runs[run_id]
            assert topic_events(run) == pg_events(sub, run_id) and run.end == "done"
    finally:
        producer.flush(10)
        sub.close()


def left_behind(
    sub: Submitter, producer: Producer, text_: str, *, finished_s_ago: float, hole: tuple[int, int]
) -> str:
    """A done run with chunks 0..9 and ``done`` at 10 in Postgres; the topic lacks ``hole``."""
    run_id = sub.submit("bob", {"text": text_}, publish=False)
    events = [(seq, "chunk", f"t{seq} ") for seq in range(10)] + [(10, "done", "{}")]
    with sub.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE runs SET status = 'done', attempt = 1,"
                " started_at = now() - 2 * CAST(:ago AS interval),"
                " finished_at = now() - CAST(:ago AS interval) WHERE id = :r"
            ),
            {"r": run_id, "ago": f"{finished_s_ago} seconds"},
        )
        for seq, kind, content in events:
            conn.execute(
                text(
                    "INSERT INTO messages (run_id, seq, kind, content, attempt)"
                    " VALUES (:r, :s, :k, :c, 1)"
                ),
                {"r": run_id, "s": seq, "k": kind, "c": content},
            )
    topic = sub.settings.names.topic(RUN_CHUNKS)
    partition = partition_for_key(b"bob", sub.settings.partitions)
    for seq, kind, content in events:
        if not hole[0] <= seq < hole[1]:
            producer.produce(
                topic,
                key=chunk_key(run_id, seq).encode(),
                value=chunk_value(run_id, seq, kind, content, 1),
                partition=partition,
                headers=list(headers_for(RUN_CHUNK)),
            )
    assert producer.flush(30) == 0
    return run_id


def test_the_scheduled_compactor_fills_gaps_in_each_round(env: Settings) -> None:
    """`koda chunks compact --every S` is the job operators schedule: each of its rounds
    runs the completeness pass before compacting, so the delay is bounded by
    KODA_REPAIR_AFTER plus S."""
    sub = Submitter(env)
    producer = Producer(producer_config(env, "test"))
    stop = threading.Event()
    compactor = ChunkCompactor(env.with_(repair_after_s=0))
    loop = threading.Thread(
        target=compactor.run_forever, args=(1.0,), kwargs={"should_stop": stop.is_set}
    )
    try:
        run_id = left_behind(sub, producer, "left for the job", finished_s_ago=0, hole=(0, 4))
        loop.start()

        def marked() -> bool:  # the pass marks a run once its records are delivered
            row = sub.query("SELECT published_seq FROM runs WHERE id = :r", r=run_id)[0]
            return bool(row.published_seq == 10)

        wait_until(marked, timeout=30, what="the job to fill the gap and mark the run")
        run = read_chunk_log(env).runs[run_id]
        assert run.complete and topic_events(run) == pg_events(sub, run_id)
        left = sub.query("SELECT compacted_at FROM runs WHERE id = :r", r=run_id)
        assert left[0].compacted_at is None  # filled, not compacted (that waits 24 h)
    finally:
        stop.set()
        loop.join(30)
        compactor.close()
        producer.flush(10)
        sub.close()

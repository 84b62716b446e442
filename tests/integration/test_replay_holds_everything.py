"""A replay into DuckDB holds what each run was asked, the message merged into a run, the
schedules and the memories (exported from koda's Postgres, topics/replay/export.py), by
value; and once a user is erased, a fresh replay holds nothing of that user and
everything it held of the other (topics/replay/erased.py).

Real worker processes run the runs, so the topics hold every kind of record; the merge,
the schedule and the memories are written in Postgres as the gateway writes them. The
erasure is a receipt inserted in ``erasures`` (what an erasure records first, before it
deletes anything): Postgres still holds the user's rows and the topics all their
records, so every one of them must be dropped by the replay itself."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pytest
from sqlalchemy import text

from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.schemas.erasures import pseudonym, user_digest
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.replay import ReplayOptions, run_replay
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.errors import SourceError
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter
from tests.support import wait_until

USERS = ("alice", "bob")
MERGED = {"text": "and one more thing"}
VECTOR = "[" + ",".join(["0.0625"] * 256) + "]"


@dataclass
class World:
    settings: Settings
    sub: Submitter
    tmp: Path
    runs: dict[str, list[str]] = field(default_factory=dict)  # user -> run ids
    merged_run: str = ""

    def replay(self, name: str) -> dict[str, list[dict[str, Any]]]:
        """A one-shot replay of every topic (and the export) into a fresh DuckDB file."""
        path = self.tmp / f"{name}.duckdb"
        summary = run_replay(self.settings, ReplayOptions(sink_url=f"duckdb:///{path}"))
        assert summary.records > 0
        self.summaries[name] = summary.erased
        return tables(path)

    summaries: dict[str, int] = field(default_factory=dict)


def tables(path: Path) -> dict[str, list[dict[str, Any]]]:
    conn = duckdb.connect(str(path), read_only=True)
    try:
        return {
            x.name: [
                dict(zip(x.names, r, strict=True))
                for r in conn.execute(f"SELECT {', '.join(x.names)} FROM {x.name}").fetchall()
            ]
            for x in t.TABLES
        }
    finally:
        conn.close()


@pytest.fixture(scope="module")
def world(stack: Any) -> Iterator[World]:
    settings = make_settings(stack, max_inflight=8)
    upgrade(settings)
    apply_topics(settings)
    tmp = Path(tempfile.mkdtemp(prefix="koda-replay-all-", dir="/tmp"))
    sub = Submitter(settings)
    worker = WorkerProcess(settings, "hw0").start()
    w = World(settings, sub, tmp)
    try:
        for user in USERS:
            w.runs[user] = [
                sub.submit(user, {"text": f"{user} asks {i}", "demo": {"tokens": 3, "delay_ms": 0}})
                for i in range(3)
            ]
        every = [r for runs in w.runs.values() for r in runs]

        def done() -> bool:
            assert worker.alive(), worker.log()[-3000:]
            return sub.all_terminal(every)

        wait_until(done, timeout=120, interval=0.2, what="every run terminal")
        # A record of bob's on the runs topic that does not decode: kept raw until erased.
        sub.produce_raw(b"bob", b"\x00 not a record of bob")
        w.merged_run = w.runs["alice"][0]
        with sub.engine.begin() as conn:
            # A merge, as schemas/runs/control.py writes it: the message, and the run's
            # input and version moved on.
            conn.execute(
                text(
                    "INSERT INTO run_merges (idempotency_key, run_id, user_id, input_version,"
                    " input) VALUES (:k, :r, 'alice', 1, CAST(:inp AS jsonb))"
                ),
                {"k": f"merge-{uuid7()}", "r": w.merged_run, "inp": json.dumps(MERGED)},
            )
            conn.execute(
                text(
                    "UPDATE runs SET input = input || CAST(:extra AS jsonb), input_version = 1"
                    " WHERE id = :r"
                ),
                {"r": w.merged_run, "extra": json.dumps({"merged": [MERGED]})},
            )
            for user in USERS:
                conn.execute(
                    text(
                        "INSERT INTO schedules (id, user_id, cron, timezone, input, daily_cap)"
                        " VALUES (:id, :u, '0 9 * * 1-5', 'Europe/Paris', CAST(:inp AS jsonb), 3)"
                    ),
                    {"id": f"sch-{user}", "u": user, "inp": json.dumps({"text": f"{user} daily"})},
                )
                conn.execute(
                    text(
                        "INSERT INTO memories (id, user_id, text, content_hash, embedding,"
                        " embedder, run_id) VALUES (:id, :u, :txt, :h,"
                        " CAST(:v AS public.vector), 'test-embedder', :r)"
                    ),
                    {
                        "id": f"mem-{user}",
                        "u": user,
                        "txt": f"{user} likes tea",
                        "h": f"h-{user}",
                        "v": VECTOR,
                        "r": w.runs[user][1],
                    },
                )
        yield w
    finally:
        worker.stop()
        sub.close()
        delete_topics(settings)
        drop_schema(settings)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def before(world: World) -> dict[str, list[dict[str, Any]]]:
    return world.replay("before")


def test_the_warehouse_holds_inputs_merges_schedules_and_memories(
    world: World, before: dict[str, list[dict[str, Any]]]
) -> None:
    w = world
    truth = {
        r.id: r
        for r in w.sub.query(
            "SELECT id, user_id, session_id, input, COALESCE(input_version, 0) AS v,"
            " created_at FROM runs"
        )
    }
    inputs = {r["run_id"]: r for r in before["run_inputs"]}
    assert set(inputs) == set(truth) == {r for runs in w.runs.values() for r in runs}
    for run_id, row in truth.items():
        got = inputs[run_id]
        assert json.loads(got["input"]) == row.input, run_id
        assert (got["user_id"], got["session_id"]) == (row.user_id, row.session_id)
        assert (got["input_version"], got["created_at"]) == (row.v, row.created_at)
    merged = json.loads(inputs[w.merged_run]["input"])
    assert merged["merged"] == [MERGED] and merged["text"] == "alice asks 0"
    assert inputs[w.merged_run]["input_version"] == 1

    (merge,) = before["run_merges"]
    assert (merge["run_id"], merge["input_version"], merge["user_id"]) == (
        w.merged_run,
        1,
        "alice",
    )
    assert json.loads(merge["input"]) == MERGED

    schedules = {s["schedule_id"]: s for s in before["schedules"]}
    assert set(schedules) == {"sch-alice", "sch-bob"}
    s = schedules["sch-alice"]
    assert (s["user_id"], s["cron"], s["timezone"], s["daily_cap"], s["enabled"]) == (
        "alice",
        "0 9 * * 1-5",
        "Europe/Paris",
        3,
        True,
    )
    assert json.loads(s["input"]) == {"text": "alice daily"}

    memories = {m["memory_id"]: m for m in before["memories"]}
    got = {k: (m["user_id"], m["text"], m["embedder"], m["run_id"]) for k, m in memories.items()}
    assert got == {f"mem-{u}": (u, f"{u} likes tea", "test-embedder", w.runs[u][1]) for u in USERS}
    # The topics' tables too: every run ended, with its output and its calls.
    runs = {r["run_id"]: r for r in before["runs"]}
    assert set(runs) == set(truth) and {r["status"] for r in runs.values()} == {"done"}
    assert {o["run_id"] for o in before["outputs"]} == set(truth)
    assert {c["user_id"] for c in before["ledger"]} == set(USERS)
    assert [r["record_key"] for r in before["raw_records"]] == [b"bob"]
    assert world.summaries["before"] == 0


def _mentions(row: dict[str, Any], user: str, runs: set[str]) -> bool:
    """Whether a row names ``user`` or one of ``runs`` anywhere (keys, text, JSON, bytes)."""
    for value in row.values():
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, str) and (value == user or f"{user} " in value or value in runs):
            return True
        if isinstance(value, str) and any(r in value for r in runs):
            return True
    return False


def test_after_erasing_a_user_a_fresh_replay_holds_nothing_of_them_and_all_of_the_other(
    world: World, before: dict[str, list[dict[str, Any]]]
) -> None:
    w = world
    bob_runs = set(w.runs["bob"])
    assert any(_mentions(r, "bob", bob_runs) for rows in before.values() for r in rows)
    with w.sub.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO erasures (id, user_digest, pseudonym, requested_by, completed_at)"
                " VALUES (:id, :d, :p, 'test', now())"
            ),
            {"id": uuid7(), "d": user_digest("bob"), "p": pseudonym("bob")},
        )
    after = w.replay("after")
    for name, rows in after.items():
        if name == t.LEDGER.name:
            continue
        left = [r for r in rows if _mentions(r, "bob", bob_runs)]
        assert not left, (name, left)
    # The ledger keeps bob's calls, under the pseudonym, as koda's ledger does.
    kept = [c for c in after["ledger"] if c["run_id"] in bob_runs]
    assert kept and {c["user_id"] for c in kept} == {pseudonym("bob")}
    assert len(kept) == len([c for c in before["ledger"] if c["run_id"] in bob_runs])
    assert not any(_mentions(c, "bob", set()) for c in after["ledger"])
    # Everything of alice's is there, unchanged.
    for name, rows in before.items():
        keep = [r for r in rows if not _mentions(r, "bob", bob_runs)]
        if name == t.LEDGER.name:
            keep = [r for r in rows if r["run_id"] not in bob_runs]
            rows_after = [r for r in after[name] if r["run_id"] not in bob_runs]
        else:
            rows_after = after[name]
        assert sorted(map(repr, rows_after)) == sorted(map(repr, keep)), name
        assert keep or name in ("raw_records", "dead_letters"), name
    assert w.summaries["after"] > 0


def test_a_replay_that_cannot_read_the_erasures_writes_nothing(world: World) -> None:
    w = world
    blind = dataclasses.replace(
        w.settings, database_url="postgresql://koda@127.0.0.1:9/koda?connect_timeout=2"
    )
    path = w.tmp / "blind.duckdb"
    with pytest.raises(SourceError, match="cannot read koda's erasures"):
        run_replay(blind, ReplayOptions(sink_url=f"duckdb:///{path}"))
    assert all(not rows for rows in tables(path).values())

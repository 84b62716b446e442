"""Admission's group commit against the real Postgres and Kafka.

Requests that arrive while a transaction is in flight are admitted together by the
next one (gateway/admission.py, ``AdmissionQueue``). A batch is held together here by
a table lock from a second connection: the first transaction waits on it, the
requests behind it queue, and the lock's release lets them through as one batch.
Each request must still get its own answer, and a batch that fails must leave
nothing half-written.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from sqlalchemy import Connection, text

from koda_runtime import metrics
from koda_runtime.errors import DatabaseError, SessionNotOwned
from koda_runtime.gateway.bootstrap import Components, build_components
from koda_runtime.gateway.intake import RunRequest
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.lifecycle.ledger import OverBudget
from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.runs.admission import AdmittedRun
from koda_runtime.settings import Settings
from koda_runtime.topics.kafka.publisher import RunPublisher
from tests.fixtures.gateway import db_rows, dead_publisher, read_runs_topic, rows_of
from tests.fixtures.runs import payload
from tests.support import async_wait_until


@asynccontextmanager
async def gateway(
    settings: Settings, publisher: RunPublisher | None = None
) -> AsyncIterator[Components]:
    gw = build_components(settings, publisher=publisher)
    await gw.publisher.start()
    try:
        yield gw
    finally:
        await gw.admissions.drain(5.0)
        await gw.publisher.stop(timeout_s=0 if publisher is not None else 5.0)
        await gw.engine.dispose()


@contextmanager
def locked(settings: Settings, table: str, mode: str) -> Iterator[Connection]:
    """``LOCK TABLE`` held by another connection until the block exits."""
    engine = sync_engine(settings)
    try:
        with engine.connect() as conn:
            conn.execute(text(f"LOCK TABLE {table} IN {mode} MODE"))
            yield conn
            conn.rollback()
    finally:
        engine.dispose()


def holder_pid(conn: Connection) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def blocked_by(settings: Settings, pid: int, statement: str) -> list[int]:
    """Backends waiting on ``pid``'s lock while running a statement starting ``statement``."""
    rows = db_rows(
        settings,
        "SELECT pid FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"
        " AND position(:stmt in query) > 0",
        pid=pid,
        stmt=statement,
    )
    return [r.pid for r in rows]


def batches() -> tuple[float, float]:
    """(transactions, requests) admitted so far, from ``koda_admission_batch_runs``."""
    get = metrics.REGISTRY.get_sample_value
    return get("koda_admission_batch_runs_count") or 0.0, get(
        "koda_admission_batch_runs_sum"
    ) or 0.0


def spend_budget(settings: Settings, user: str) -> None:
    db_rows(settings, "INSERT INTO budgets (user_id, monthly_usd) VALUES (:u, 1)", u=user)
    db_rows(
        settings,
        "INSERT INTO spend_periods (user_id, period, starts_at, spend_usd, calls)"
        " VALUES (:u, 'month', date_trunc('month', now(), 'UTC'), 2, 1)",
        u=user,
    )


def req(text_: str, session_id: str | None = None) -> RunRequest:
    # A client message id named by the body: the same body is the same run, and a key
    # derived without one would cost each request a lookup of the previous dedup
    # window before it joins a batch (tests/integration/test_repeated_messages.py).
    mid = hashlib.sha256(f"{session_id}|{text_}".encode()).hexdigest()[:32]
    return RunRequest(input={"text": text_}, session_id=session_id, client_message_id=mid)


async def test_one_transaction_answers_each_request_of_its_batch_on_its_own(
    module_env: Settings,
) -> None:
    s = module_env
    user, other, broke = (f"{who}-{uuid7()}" for who in ("batch", "owner", "broke"))
    async with gateway(s) as gw:
        submit = gw.admissions.submit
        earlier = await submit(user, req("earlier"), "k-earlier")
        theirs = await submit(other, req("theirs"), None)
        broke_earlier = await submit(broke, req("before the budget"), "k-broke")
        spend_budget(s, broke)
        sessions_before = rows_of(s, user)[0]
        with locked(s, "sessions", "EXCLUSIVE") as conn:
            first = asyncio.create_task(submit(user, req("first"), None))
            pid = holder_pid(conn)

            async def first_waits() -> bool:
                return bool(blocked_by(s, pid, "INSERT INTO sessions"))

            await async_wait_until(first_waits, what="the first transaction waiting")
            requests: list[tuple[str, RunRequest, str | None]] = [
                (user, req("fresh"), None),
                (user, req("twice"), "k-twice"),
                (user, req("twice"), "k-twice"),
                (user, req("again"), "k-earlier"),
                (user, req("not mine", theirs.session_id), None),
                (broke, req("over budget"), None),
                (broke, req("before the budget"), "k-broke"),
            ]
            tasks = [asyncio.create_task(submit(*r)) for r in requests]

            async def all_queued() -> bool:
                return gw.admissions.queue.waiting == len(requests)

            await async_wait_until(all_queued, what="the batch queued behind the first")
            count0, sum0 = batches()
        assert isinstance(await first, AdmittedRun)
        fresh, twice, twice_again, again, not_mine, over, broke_again = await asyncio.gather(
            *tasks, return_exceptions=True
        )
    # The first transaction, then one for all seven requests.
    assert batches() == (count0 + 1, sum0 + len(requests))
    assert isinstance(fresh, AdmittedRun) and fresh.created
    assert isinstance(twice, AdmittedRun) and isinstance(twice_again, AdmittedRun)
    assert twice.run_id == twice_again.run_id
    assert sorted([twice.created, twice_again.created]) == [False, True]
    assert isinstance(again, AdmittedRun) and not again.created
    assert again.run_id == earlier.run_id
    assert isinstance(not_mine, SessionNotOwned)
    assert isinstance(over, OverBudget) and over.over.period.value == "month"
    assert isinstance(broke_again, AdmittedRun) and broke_again.run_id == broke_earlier.run_id
    # Sessions: the first's, fresh's and one of the twins'; the replays kept none of theirs.
    assert rows_of(s, user) == (sessions_before + 3, 4)
    assert rows_of(s, broke) == (1, 1)
    (owner,) = db_rows(s, "SELECT user_id FROM sessions WHERE id = :id", id=theirs.session_id)
    assert owner.user_id == other


async def test_a_request_postgres_cannot_store_fails_alone(module_env: Settings) -> None:
    s = module_env
    user = f"poison-{uuid7()}"
    async with gateway(s) as gw:
        count0, sum0 = batches()
        good, poison, also_good = await asyncio.gather(
            gw.admissions.submit(user, req("good"), None),
            # NUL: jsonb refuses it. Intake refuses it first (422); this reaches the
            # store only to stand for any row the database turns down.
            gw.admissions.submit(user, req("nul \x00 inside"), None),
            gw.admissions.submit(user, req("also good"), None),
            return_exceptions=True,
        )
    assert isinstance(good, AdmittedRun) and good.created
    assert isinstance(also_good, AdmittedRun) and also_good.created
    assert isinstance(poison, DatabaseError)
    # One batch of three failed on the poison row, then each request was tried alone.
    assert batches() == (count0 + 4, sum0 + 6)
    assert rows_of(s, user) == (2, 2)


async def test_a_database_failure_mid_batch_fails_every_request_and_writes_nothing(
    module_env: Settings,
) -> None:
    s = module_env
    user = f"mid-{uuid7()}"
    async with gateway(s) as gw:
        count0, _ = batches()
        with locked(s, "runs", "EXCLUSIVE") as conn:
            pid = holder_pid(conn)
            tasks = [
                asyncio.create_task(gw.admissions.submit(user, req(f"r{i}"), None))
                for i in range(5)
            ]

            async def inserting() -> list[int]:
                # The sessions are written; the runs' INSERT waits on the lock.
                return blocked_by(s, pid, "INSERT INTO runs")

            (victim,) = await async_wait_until(inserting, what="the batch's INSERT waiting")
            db_rows(s, "SELECT pg_terminate_backend(:pid)", pid=victim)
            answers = await asyncio.gather(*tasks, return_exceptions=True)
        assert [type(a) for a in answers] == [DatabaseError] * 5
        assert batches()[0] == count0 + 1  # a lost connection is not tried again run by run
        assert rows_of(s, user) == (0, 0)
        # The pool replaces the dead connection: the next request is admitted.
        after = await gw.admissions.submit(user, req("after"), None)
    assert after.created and rows_of(s, user) == (1, 1)


def test_a_batch_whose_publish_fails_is_published_by_the_sweeper(module_env: Settings) -> None:
    s = module_env
    user = f"lost-{uuid7()}"

    async def admit() -> list[AdmittedRun]:
        async with gateway(s, dead_publisher(s)) as gw:
            count0, sum0 = batches()
            runs = await asyncio.gather(
                *(gw.admissions.submit(user, req(f"lost {i}"), None) for i in range(4))
            )
            assert batches() == (count0 + 1, sum0 + 4)
            return list(runs)

    def on_topic() -> list[str]:
        records = read_runs_topic(s)
        return [json.loads(payload(m))["run_id"] for m in records if m.key() == user.encode()]

    runs = asyncio.run(admit())
    assert all(r.created for r in runs)
    rows = db_rows(s, "SELECT published_at FROM runs WHERE user_id = :u", u=user)
    assert [r.published_at for r in rows] == [None] * 4
    assert on_topic() == []

    async def sweep() -> int:
        async with gateway(s.with_(sweep_after_s=0.1)) as gw:
            return await gw.sweeper.sweep_once()

    # At least ours: a run of an earlier test whose ack came after its drain is swept too.
    assert asyncio.run(sweep()) >= 4
    assert sorted(on_topic()) == sorted(r.run_id for r in runs)
    rows = db_rows(s, "SELECT published_at FROM runs WHERE user_id = :u", u=user)
    assert all(r.published_at is not None for r in rows)


async def test_a_batch_publishes_its_runs_in_admission_order(module_env: Settings) -> None:
    s = module_env
    user = f"order-{uuid7()}"
    async with gateway(s) as gw:
        count0, sum0 = batches()
        runs = await asyncio.gather(
            *(gw.admissions.submit(user, req(f"in order {i}"), None) for i in range(20))
        )
        assert batches() == (count0 + 1, sum0 + 20)
    ids = [r.run_id for r in runs]
    on_topic = [
        json.loads(payload(m))["run_id"] for m in read_runs_topic(s) if m.key() == user.encode()
    ]
    assert on_topic == ids

"""Per-user erasure end to end (gateway/erasure.py): a gateway in this process, a worker
process with the demo handler, the real broker and Postgres, one namespace for the module.

Users are made through the API the way a client makes them: runs (one with a merged
message), a schedule, a memory (the demo handler distils "I ..." sentences), a budget,
ledger rows (one model call per chunk) and chunk records on the topic. Erasing one is
checked store by store (every table of the schema with a ``user_id`` or ``run_id``
column, the chunk topic read to its end and again after the broker's log cleaner
compacted it, the API, the console's API); the other user is untouched.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
)
from sqlalchemy import text
from typer.testing import CliRunner

from koda_runtime.cli.users import users_app
from koda_runtime.gateway.app import create_app
from koda_runtime.kafka import producer_config
from koda_runtime.lifecycle.chunks import split_chunk_key
from koda_runtime.localstack import StackInfo
from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.erasures import erased_digests, pseudonym, user_digest
from koda_runtime.schemas.tables import erasures
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, RUNS_DLQ
from tests.fixtures.gateway import serve_app
from tests.fixtures.namespaces import make_settings, prepared_namespace
from tests.fixtures.processes import WorkerProcess, settings_env
from tests.fixtures.runs import Submitter, read_topic
from tests.sse_client import bearer
from tests.support import wait_until

ANSWERED = "I like green tea. Tell me something."


@dataclass
class World:
    settings: Settings
    url: str  # the gateway that waits KODA_ERASURE_WAIT_S (30 s) for runs to end
    impatient_url: str  # the same namespace's gateway with KODA_ERASURE_WAIT_S=0
    worker: WorkerProcess
    sub: Submitter

    def call(self, method: str, path: str, user: str | None = None, **kw: Any) -> httpx.Response:
        headers = bearer(user) if user is not None else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=60, **kw)

    def post_run(
        self, user: str, inp: dict[str, Any], session: str | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"input": inp, "client_message_id": uuid.uuid4().hex}
        if session is not None:
            body["session_id"] = session
        r = self.call("POST", "/v1/runs", user, json=body)
        assert r.status_code == 202, r.text
        answer: dict[str, Any] = r.json()
        return answer

    def erase(self, user: str, *, url: str | None = None) -> httpx.Response:
        return httpx.post(
            f"{url or self.url}/admin/users/{user}/erase",
            params={"requested_by": "the erasure test"},
            timeout=90,
        )

    def kinds(self, run_id: str) -> list[str]:
        return [m.kind for m in self.sub.messages(run_id)]

    def status(self, run_id: str) -> str | None:
        return self.sub.statuses([run_id]).get(run_id)

    def ended(self, run_ids: list[str]) -> bool:
        return self.sub.all_terminal(run_ids)

    def run_ids(self, user: str) -> list[str]:
        return [r.id for r in self.sub.query("SELECT id FROM runs WHERE user_id = :u", u=user)]


@pytest.fixture(scope="module")
def world(stack: StackInfo) -> Iterator[World]:
    settings = make_settings(stack, rate_per_s=1000.0, rate_burst=1000)
    with prepared_namespace(settings):
        _compact_soon(settings)
        worker = WorkerProcess(settings, "w-erasure").start()
        sub = Submitter(settings)
        try:
            with (
                serve_app(create_app(settings)) as url,
                serve_app(create_app(settings.with_(erasure_wait_s=0.0))) as impatient,
            ):

                def assigned() -> bool:
                    worker.check()
                    held = sub.query("SELECT count(*) AS n FROM partition_epochs")
                    return int(held[0].n) == settings.partitions

                wait_until(assigned, timeout=60, what="the worker holds every partition")
                yield World(settings, url, impatient, worker, sub)
        finally:
            worker.stop()
            sub.close()


def _compact_soon(settings: Settings) -> None:
    """This namespace's chunk topic: a segment rolls after a second and is cleaned as
    soon as the broker's cleaner looks (tombstones stay their day, as in production)."""
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    topic = settings.names.topic(RUN_CHUNKS)
    entries = [
        ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
        for name, value in (
            ("segment.ms", "1000"),
            ("min.compaction.lag.ms", "0"),
            ("min.cleanable.dirty.ratio", "0.01"),
        )
    ]
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=entries)
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(30)


def _user(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def populate(w: World, user: str, *, merge: bool) -> list[str]:
    """Give ``user`` runs (one merged into when ``merge``), a schedule, a memory, a
    budget and ledger rows, all through the API; their run ids once all ended."""
    session = f"s-{user}"
    first = w.post_run(
        user,
        {"text": ANSWERED, "demo": {"tokens": 6, "delay_ms": 1, "usage_each": True}},
        session,
    )["run_id"]
    runs = [first]
    wait_until(lambda: w.status(first) == "done", timeout=60, what="the first run done")
    if merge:
        slow = {"text": "count slowly", "demo": {"tokens": 150, "delay_ms": 20}}
        slow_id = w.post_run(user, slow, session)["run_id"]
        wait_until(lambda: "chunk" in w.kinds(slow_id), timeout=30, what="the slow run streams")
        merged = w.post_run(user, {"text": "and add this"}, session)
        assert merged["merged"] is True and merged["run_id"] == slow_id
        runs.append(slow_id)
    schedule = w.call(
        "POST",
        "/v1/schedules",
        user,
        json={"cron": "0 0 1 1 *", "timezone": "UTC", "input": {"text": "yearly"}},
    )
    assert schedule.status_code == 201, schedule.text
    hook = w.call("POST", "/v1/webhooks", user, json={"url": "http://127.0.0.1:9/hook"})
    assert hook.status_code == 201, hook.text
    budget = w.call("PUT", f"/admin/budgets/{user}", json={"monthly_usd": "100"})
    assert budget.status_code == 200, budget.text
    wait_until(lambda: w.ended(runs), timeout=60, what=f"{user}'s runs ended")
    return runs


def table_counts(w: World, user: str, run_ids: list[str]) -> dict[str, int]:
    """Rows naming ``user`` or one of ``run_ids`` in every table of the schema that has a
    ``user_id`` or ``run_id`` column (``runs`` by its id; the ledger by user only), and the
    ledger's rows under the user's pseudonym."""
    columns = w.sub.query(
        "SELECT table_name, column_name FROM information_schema.columns"
        " WHERE table_schema = :s AND column_name IN ('user_id', 'run_id')",
        s=w.settings.names.pg_schema(),
    )
    by_table: dict[str, set[str]] = {}
    for c in columns:
        by_table.setdefault(c.table_name, set()).add(c.column_name)
    by_table.setdefault("runs", set()).add("id")
    counts: dict[str, int] = {}
    for table, cols in sorted(by_table.items()):
        where = []
        if "user_id" in cols:
            where.append("user_id = :u")
        # The ledger keeps its rows' run ids for finance (their runs are gone): only
        # the user id is replaced.
        if "run_id" in cols and table != "ledger":
            where.append("run_id = ANY(:ids)")
        if table == "runs":
            where.append("id = ANY(:ids)")
        sql = f'SELECT count(*) AS n FROM "{table}" WHERE ' + " OR ".join(where)  # noqa: S608
        counts[table] = int(w.sub.query(sql, u=user, ids=run_ids)[0].n)
    counts["ledger under the pseudonym"] = int(
        w.sub.query("SELECT count(*) AS n FROM ledger WHERE user_id = :p", p=pseudonym(user))[0].n
    )
    counts["erasure receipts"] = int(
        w.sub.query(
            "SELECT count(*) AS n FROM erasures WHERE user_digest = :d", d=user_digest(user)
        )[0].n
    )
    return counts


def latest_by_key(w: World, run_ids: list[str]) -> dict[str, bytes | None]:
    """The chunk topic read to its end: the latest value of every key of ``run_ids``."""
    wanted = set(run_ids)
    latest: dict[str, bytes | None] = {}
    for msg in read_topic(w.settings, w.settings.names.topic(RUN_CHUNKS), timeout=30):
        key = (msg.key() or b"").decode()
        try:
            run_id, _seq = split_chunk_key(key)
        except ValueError:
            continue
        if run_id in wanted:
            latest[key] = msg.value()
    return latest


def values_in_log(w: World, run_ids: list[str]) -> list[str]:
    """Keys of ``run_ids`` that still have a record with a value anywhere in the log."""
    wanted = set(run_ids)
    found = []
    for msg in read_topic(w.settings, w.settings.names.topic(RUN_CHUNKS), timeout=30):
        key = (msg.key() or b"").decode()
        if key.rpartition(":")[0] in wanted and msg.value() is not None:
            found.append(key)
    return found


def print_table(title: str, before: dict[str, int], after: dict[str, int]) -> None:
    width = max(len(k) for k in before)
    print(f"\n{title}\n{'store':<{width}}  before  after")
    for store in before:
        print(f"{store:<{width}}  {before[store]:>6}  {after[store]:>5}")


def test_an_erased_user_is_gone_from_every_store_and_the_other_user_is_untouched(
    world: World,
) -> None:
    w = world
    erased, kept = _user("erased"), _user("kept")
    erased_runs = populate(w, erased, merge=True)
    kept_runs = populate(w, kept, merge=False)
    wait_until(
        lambda: table_counts(w, erased, erased_runs)["memories"] > 0,
        timeout=30,
        what="the erased user's memory",
    )
    before = table_counts(w, erased, erased_runs)
    kept_before = table_counts(w, kept, kept_runs)
    for store in ("sessions", "runs", "run_merges", "messages", "usage", "memories"):
        assert before[store] > 0, (store, before)
    for store in ("schedules", "webhooks", "budgets", "spend_periods", "ledger"):
        assert before[store] > 0, (store, before)
    assert before["ledger under the pseudonym"] == before["erasure receipts"] == 0
    keys_before = latest_by_key(w, erased_runs)
    assert keys_before and all(v is not None for v in keys_before.values())
    values_before = len(values_in_log(w, erased_runs))
    kept_keys = latest_by_key(w, kept_runs)
    kept_budget = w.sub.query("SELECT * FROM budgets WHERE user_id = :u", u=kept)

    answer = w.erase(erased)
    assert answer.status_code == 200, answer.text
    receipt = answer.json()
    counts = receipt["counts"]
    assert receipt["user_digest"] == user_digest(erased) and erased not in answer.text
    assert receipt["pseudonym"] == pseudonym(erased)
    assert receipt["requested_by"] == "the erasure test"
    for store in ("runs", "run_merges", "messages", "usage", "sessions", "memories"):
        assert counts[store] == before[store], (store, counts, before)
    assert counts["schedules"] == before["schedules"] and counts["budgets"] == 1
    assert counts["spend_periods"] == before["spend_periods"]
    assert counts["ledger_pseudonymized"] == before["ledger"]
    assert counts["runs_cancelled"] == 0  # every run had ended
    assert counts["chunk_tombstones"] >= len(keys_before)

    after = table_counts(w, erased, erased_runs)
    keys_after = latest_by_key(w, erased_runs)
    live = "chunk topic: keys whose latest record has a value"
    before[live] = len(keys_before)
    after[live] = len([k for k, v in keys_after.items() if v is not None])
    print_table(f"user {erased} (erased), Postgres and the chunk topic", before, after)
    for store, n in after.items():
        if store == "ledger under the pseudonym":
            assert n == before["ledger"], "finance keeps every ledger row"
        elif store == "erasure receipts":
            assert n == 1
        elif store != live:
            assert n == 0, f"{store} still holds {n} rows of the erased user"
    receipt_row = w.sub.query(
        "SELECT * FROM erasures WHERE user_digest = :d", d=user_digest(erased)
    )[0]
    assert receipt_row.completed_at is not None and receipt_row.counts == counts
    assert set(receipt_row._fields) == {c.name for c in erasures.columns}  # tables.py in step
    assert erased not in str(tuple(receipt_row))

    # The chunk topic read to its end: the latest record of every key is a tombstone.
    assert set(keys_after) >= set(keys_before)
    assert [k for k, v in keys_after.items() if v is not None] == []

    # The other user: every row, record and budget as it was.
    assert table_counts(w, kept, kept_runs) == kept_before
    assert latest_by_key(w, kept_runs) == kept_keys
    assert w.sub.query("SELECT * FROM budgets WHERE user_id = :u", u=kept) == kept_budget

    # The API and the console's API, with a login of the erased user: nothing.
    session = f"s-{erased}"
    assert w.call("GET", "/v1/runs", erased).json()["runs"] == []
    for run_id in erased_runs:
        for method, path in (
            ("GET", f"/v1/runs/{run_id}"),
            ("GET", f"/v1/runs/{run_id}/events"),
            ("GET", f"/v1/runs/{run_id}/timeline"),
            ("POST", f"/v1/runs/{run_id}/stream-ticket"),
            ("POST", f"/v1/runs/{run_id}/cancel"),
        ):
            r = w.call(method, path, erased)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
    for path in (f"/v1/sessions/{session}/runs", f"/v1/sessions/{session}/turns"):
        assert w.call("GET", path, erased).status_code == 404, path
    assert w.call("GET", "/v1/memories", erased).json()["memories"] == []
    assert w.call("GET", "/v1/schedules", erased).json()["schedules"] == []
    usage = w.call("GET", "/v1/usage", erased, params={"group_by": "day"})
    assert usage.status_code == 200 and usage.json()["rows"] == [], usage.text
    assert w.call("GET", "/admin/runs", params={"user_id": erased}).json()["runs"] == []
    budgets = w.call("GET", "/admin/budgets").json()["budgets"]
    assert erased not in {b["user_id"] for b in budgets} and kept in {b["user_id"] for b in budgets}
    by_user = w.call("GET", "/admin/usage", params={"group_by": "user"}).json()["rows"]
    assert pseudonym(erased) in {r["user_id"] for r in by_user}
    assert erased not in {r["user_id"] for r in by_user}
    # ... while the other user's run is still there, console included.
    assert w.call("GET", f"/v1/runs/{kept_runs[0]}/timeline", kept).status_code == 200

    # Erasing again: a second receipt, nothing left to count.
    again = w.erase(erased)
    assert again.status_code == 200, again.text
    assert set(again.json()["counts"].values()) == {0}
    assert again.json()["erasure_id"] != receipt["erasure_id"]
    engine = sync_engine(w.settings)
    try:
        with engine.connect() as conn:
            digests = erased_digests(conn)
    finally:
        engine.dispose()
    assert user_digest(erased) in digests and user_digest(kept) not in digests
    assert table_counts(w, erased, erased_runs)["erasure receipts"] == 2

    # After the broker's log cleaner ran: no record of the erased user holds a value.
    producer = Producer(producer_config(w.settings, "test"))

    def compacted() -> bool:
        for p in range(w.settings.partitions):
            # A record after segment.ms rolls the segment holding the tombstones.
            producer.produce(
                w.settings.names.topic(RUN_CHUNKS), key=b"roll:final", value=None, partition=p
            )
        assert producer.flush(10) == 0
        return values_in_log(w, erased_runs) == []

    wait_until(compacted, timeout=120, interval=2.0, what="the cleaner compacted the tombstones")
    stored = "chunk topic: records with a value, from offset 0"
    title = f"user {erased} (erased), after log compaction"
    print_table(title, {stored: values_before}, {stored: 0})
    assert values_in_log(w, kept_runs), "the other user's records are kept"


def test_a_running_run_is_cancelled_then_erased_and_its_trigger_never_brings_it_back(
    world: World,
) -> None:
    w = world
    user = _user("running")
    run_id = w.post_run(user, {"text": "long", "demo": {"tokens": 300, "delay_ms": 20}})["run_id"]
    wait_until(lambda: "chunk" in w.kinds(run_id), timeout=30, what="the run streams")
    answer = w.erase(user)
    assert answer.status_code == 200, answer.text
    counts = answer.json()["counts"]
    assert counts["runs_cancelled"] == 1 and counts["runs"] == 1
    assert counts["messages"] >= 2  # some chunks and the cancelled event
    assert w.run_ids(user) == []
    assert [k for k, v in latest_by_key(w, [run_id]).items() if v is not None] == []

    # The run's trigger met again (a redelivery, a rewind): skipped, nothing made again,
    # no dead letter holding the user's id.
    w.sub.publish(run_id, user)
    wait_until(
        lambda: f"skip erased run_id={run_id}" in w.worker.log(), timeout=30, what="the skip"
    )
    assert w.run_ids(user) == []
    assert w.sub.query("SELECT count(*) AS n FROM sessions WHERE user_id = :u", u=user)[0].n == 0
    letters = read_topic(w.settings, w.settings.names.topic(RUNS_DLQ), timeout=10)
    assert [m for m in letters if m.key() == user.encode()] == []
    assert [k for k, v in latest_by_key(w, [run_id]).items() if v is not None] == []


def test_a_run_that_does_not_end_in_time_is_named_in_a_409_and_nothing_is_deleted(
    world: World,
) -> None:
    w = world
    user = _user("busy")
    run_id = w.post_run(user, {"text": "long", "demo": {"tokens": 400, "delay_ms": 20}})["run_id"]
    wait_until(lambda: "chunk" in w.kinds(run_id), timeout=30, what="the run streams")
    refused = w.erase(user, url=w.impatient_url)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "runs_still_open" and error["field"] == "user_id"
    assert run_id in error["message"] and "erase again" in error["message"]
    # Nothing deleted, no receipt; the cancel stays and the run ends cancelled.
    assert w.run_ids(user) == [run_id]
    assert table_counts(w, user, [run_id])["erasure receipts"] == 0
    wait_until(lambda: w.status(run_id) == "cancelled", timeout=30, what="the run cancelled")
    answer = w.erase(user)
    assert answer.status_code == 200, answer.text
    assert answer.json()["counts"]["runs"] == 1 and answer.json()["counts"]["runs_cancelled"] == 0
    assert w.run_ids(user) == []


def test_koda_users_erase_asks_checks_the_user_id_and_prints_the_receipt(world: World) -> None:
    w = world
    user = _user("cli")
    run_id = w.post_run(user, {"text": "hi", "demo": {"tokens": 3, "delay_ms": 1}})["run_id"]
    wait_until(lambda: w.ended([run_id]), timeout=60, what="the run ended")
    cli = CliRunner()
    env = settings_env(w.settings)
    declined = cli.invoke(users_app, ["erase", user], input="n\n", env=env)
    assert declined.exit_code == 1 and "Erase user" in declined.output
    assert w.run_ids(user) == [run_id]
    bad = cli.invoke(users_app, ["erase", "no spaces", "--yes"], env=env)
    assert bad.exit_code == 2 and "USER must be" in bad.output
    prod_env = {**env, "APP_ENV": "prod", "KODA_HANDLER": "openai"}
    prod = cli.invoke(users_app, ["erase", user, "--yes"], env=prod_env)
    assert prod.exit_code == 2 and "needs --confirm-prod" in prod.output, prod.output
    assert w.run_ids(user) == [run_id]
    done = cli.invoke(users_app, ["erase", user, "--yes", "--by", "ops"], env=env)
    assert done.exit_code == 0, done.output
    assert '"runs": 1' in done.output and '"requested_by": "ops"' in done.output
    assert w.run_ids(user) == []


def test_an_ended_run_never_marked_whole_is_settled_by_the_erasure_after_a_grace(
    world: World,
) -> None:
    """The worker's whole-mark skips a row another transaction holds, and only the
    compactor's completeness pass (not running here) would set it later: an erasure
    that waited for the mark alone would answer 409 for a run long over."""
    w = world
    user = _user("unmarked")
    run_id = w.post_run(user, {"text": "hi", "demo": {"tokens": 3, "delay_ms": 1}})["run_id"]
    wait_until(lambda: w.ended([run_id]), timeout=60, what="the run ended")
    wait_until(
        lambda: (
            w.sub.query("SELECT published_seq FROM runs WHERE id = :r", r=run_id)[0].published_seq
            is not None
        ),
        timeout=30,
        what="the worker's mark",
    )
    with w.sub.engine.begin() as conn:  # the mark the worker skipped, just after the end
        conn.execute(
            text("UPDATE runs SET published_seq = NULL, finished_at = now() WHERE id = :r"),
            {"r": run_id},
        )
    refused = w.erase(user, url=w.impatient_url)
    assert refused.status_code == 409 and run_id in refused.text, refused.text
    with w.sub.engine.begin() as conn:  # ... and the same run, ended a minute ago
        conn.execute(
            text("UPDATE runs SET finished_at = now() - interval '1 minute' WHERE id = :r"),
            {"r": run_id},
        )
    answer = w.erase(user, url=w.impatient_url)
    assert answer.status_code == 200, answer.text
    assert answer.json()["counts"]["runs"] == 1 and w.run_ids(user) == []
    assert [k for k, v in latest_by_key(w, [run_id]).items() if v is not None] == []

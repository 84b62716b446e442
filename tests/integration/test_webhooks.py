"""Webhooks against the real stack: a worker, the in-process gateway, and `koda webhooks
dispatch` as a process, calling receivers this test serves and checking signatures.

Failure modes provoked: a receiver that refuses connections and comes back later; a
receiver that holds its requests (it must delay neither the run nor other receivers);
a dispatcher killed while its POST is in flight (the delivery must still arrive); a
schedule naming its own webhook (its run must go there alone); a private address in
prod (refused at creation, naming the rule).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from koda_runtime.gateway.app import create_app
from koda_runtime.localstack import StackInfo
from koda_runtime.naming import AppEnv
from koda_runtime.scheduler.service import Scheduler
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.migrate import downgrade, upgrade
from koda_runtime.schemas.runs.admission import RunAdmission
from koda_runtime.schemas.schedules import ScheduleStore
from koda_runtime.settings import Settings
from koda_runtime.topics.kafka.publisher import RunPublisher
from koda_runtime.webhooks import verify
from tests.fixtures.gateway import db_rows, serve_app
from tests.fixtures.namespaces import drop_schema, make_settings, prepared_namespace
from tests.fixtures.processes import (
    ChildProcess,
    WorkerProcess,
    free_port,
    koda_argv,
    settings_env,
)
from tests.sse_client import bearer
from tests.support import wait_until

FAST = {"demo": {"tokens": 3, "delay_ms": 1}}
# The dispatcher's timings in this module: a short timeout (so a lease, timeout + 5 s,
# ends soon after a kill) and short backoff (a receiver that comes back is called
# again within a second).
DISPATCH_ENV = {
    "KODA_WEBHOOK_TIMEOUT": "3",
    "KODA_WEBHOOK_RETRY_FIRST": "0.2",
    "KODA_WEBHOOK_RETRY_MAX": "1",
    "KODA_WEBHOOK_PER_ENDPOINT": "2",
}


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    def signed_by(self, secret: str) -> bool:
        h = self.headers
        return verify(
            secret, h["webhook-id"], int(h["webhook-timestamp"]), self.body, h["webhook-signature"]
        )


class Receiver:
    """An HTTP server recording every POST; ``hold`` makes each request wait for
    :meth:`release` before it is answered (a slow receiver, without a timed sleep)."""

    def __init__(self, port: int = 0, *, hold: bool = False) -> None:
        self.port = port
        self.hold = hold
        self.received: list[Received] = []
        self.holding = 0
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver.lock:
                    receiver.received.append(
                        Received({k.lower(): v for k, v in self.headers.items()}, body)
                    )
                    receiver.holding += receiver.hold
                if receiver.hold:
                    receiver.released.wait(60)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def of_run(self, run_id: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.json["data"]["run_id"] == run_id]

    def release(self) -> None:
        self.released.set()

    def stop(self) -> None:
        self.release()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class Dispatcher(ChildProcess):
    def __init__(self, settings: Settings, port: int) -> None:
        env = settings_env(settings, **DISPATCH_ENV, KODA_WEBHOOK_PORT=str(port))
        super().__init__("webhooks", [*koda_argv("webhooks"), "dispatch"], env)
        self.port = port

    def start(self) -> Dispatcher:
        super().start()
        return self


@dataclass
class Stack:
    settings: Settings
    url: str
    dispatcher: Dispatcher
    worker: WorkerProcess

    def wait(self, condition: Any, *, timeout: float = 30.0, what: str = "") -> Any:
        """wait_until, failing at once with its log when the worker or dispatcher died."""

        def check() -> Any:
            self.worker.check()
            self.dispatcher.check()
            return condition()

        return wait_until(check, timeout=timeout, what=what)

    def client(self, user: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=bearer(user), timeout=30)


@pytest.fixture(scope="module")
def stack_(module_env: Settings) -> Iterator[Stack]:
    worker = WorkerProcess(module_env, "wh-worker").start()
    dispatcher = Dispatcher(module_env, free_port()).start()
    state = Stack(module_env, "", dispatcher, worker)
    try:
        with serve_app(create_app(module_env)) as url:
            state.url = url
            yield state
    finally:
        worker.stop()
        state.dispatcher.stop()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        r.stop()


def user() -> str:
    return f"wh-{uuid.uuid4().hex[:10]}"


def add_webhook(c: httpx.Client, url: str, **fields: Any) -> dict[str, Any]:
    r = c.post("/v1/webhooks", json={"url": url, **fields})
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def submit(c: httpx.Client, **inp: Any) -> str:
    r = c.post("/v1/runs", json={"input": {"text": "hello", **FAST, **inp}})
    assert r.status_code == 202, r.text
    run_id: str = r.json()["run_id"]
    return run_id


def status_of(settings: Settings, run_id: str) -> str | None:
    rows = db_rows(settings, "SELECT status FROM runs WHERE id = :r", r=run_id)
    return rows[0][0] if rows else None


def deliveries(c: httpx.Client, webhook_id: str) -> list[dict[str, Any]]:
    r = c.get(f"/v1/webhooks/{webhook_id}/deliveries")
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()["deliveries"]
    return found


def output_of(settings: Settings, run_id: str) -> str:
    rows = db_rows(
        settings,
        "SELECT seq, kind, content FROM messages WHERE run_id = :r ORDER BY seq",
        r=run_id,
    )
    return "".join(r.content for r in rows if r.kind == "chunk")


def test_an_ended_run_arrives_once_signed_with_its_facts(
    stack_: Stack, receivers: list[Receiver]
) -> None:
    receiver = Receiver().start()
    receivers.append(receiver)
    who = user()
    with stack_.client(who) as c:
        hook = add_webhook(c, receiver.url, description="mine")
        assert hook["secret"].startswith("whsec_")
        listed = c.get("/v1/webhooks").json()["webhooks"]
        assert [w["id"] for w in listed] == [hook["id"]]
        assert (
            "secret" not in listed[0] and "secret" not in c.get(f"/v1/webhooks/{hook['id']}").json()
        )
        run_id = submit(c)
        stack_.wait(lambda: receiver.of_run(run_id), timeout=60, what="the webhook call")
        stack_.wait(
            lambda: [d for d in deliveries(c, hook["id"]) if d["status"] == "delivered"],
            what="the delivery marked delivered",
        )
        (got,) = receiver.of_run(run_id)
        assert got.signed_by(hook["secret"])
        assert not got.signed_by("whsec_" + "A" * 44)
        (delivery,) = deliveries(c, hook["id"])
        assert got.headers["webhook-id"] == delivery["id"]
        assert got.headers["content-type"] == "application/json"
        assert delivery["attempts"] == 1 and len(delivery["tries"]) == 1
        assert delivery["tries"][0]["status_code"] == 200
        data = got.json["data"]
        (run,) = db_rows(
            stack_.settings,
            "SELECT session_id, (SELECT sum(cost_usd) FROM ledger WHERE run_id = :r) AS cost"
            " FROM runs WHERE id = :r",
            r=run_id,
        )
        assert got.json["type"] == "run.ended"
        assert data["run_id"] == run_id and data["user_id"] == who
        assert data["session_id"] == run.session_id
        assert data["status"] == "done", data
        assert data["output"] == output_of(stack_.settings, run_id) != ""
        assert data["cost_usd"] == (None if run.cost is None else str(run.cost))
        assert data["schedule_id"] is None and data["error"] is None
        # Another user sees none of it.
        with stack_.client(user()) as other:
            assert other.get(f"/v1/webhooks/{hook['id']}/deliveries").status_code == 404
            assert other.delete(f"/v1/webhooks/{hook['id']}").status_code == 404
        # A cancelled run ends too: its delivery says so.
        cancelled = submit(c, demo={"hang": True})
        stack_.wait(lambda: status_of(stack_.settings, cancelled) in ("running", "streaming"))
        assert c.post(f"/v1/runs/{cancelled}/cancel").status_code in (200, 202)
        stack_.wait(lambda: receiver.of_run(cancelled), timeout=60, what="the cancelled run's call")
        assert receiver.of_run(cancelled)[0].json["data"]["status"] == "cancelled"
        assert len(receiver.of_run(run_id)) == 1
        assert c.delete(f"/v1/webhooks/{hook['id']}").status_code == 204
        assert c.get("/v1/webhooks").json()["webhooks"] == []


def test_a_receiver_down_then_up_gets_the_delivery_when_it_comes_back(
    stack_: Stack, receivers: list[Receiver]
) -> None:
    port = free_port()  # nothing listens there yet: every connection is refused
    who = user()
    with stack_.client(who) as c:
        hook = add_webhook(c, f"http://127.0.0.1:{port}/hook")
        run_id = submit(c)

        def failed_twice() -> bool:
            found = deliveries(c, hook["id"])
            return bool(found) and len([t for t in found[0]["tries"] if t["error"]]) >= 2

        stack_.wait(failed_twice, timeout=60, what="two refused attempts")
        (pending,) = deliveries(c, hook["id"])
        assert pending["status"] == "pending" and pending["last_status_code"] is None
        assert "Connect" in pending["last_error"] or "refused" in pending["last_error"]
        receiver = Receiver(port).start()
        receivers.append(receiver)
        stack_.wait(lambda: receiver.of_run(run_id), timeout=30, what="the call after the return")
        stack_.wait(lambda: deliveries(c, hook["id"])[0]["status"] == "delivered")
        (done,) = deliveries(c, hook["id"])
        assert receiver.of_run(run_id)[0].headers["webhook-id"] == done["id"]
        assert receiver.of_run(run_id)[0].signed_by(hook["secret"])
        assert done["tries"][-1]["status_code"] == 200
        assert [t["attempt"] for t in done["tries"]] == list(range(1, done["attempts"] + 1))


def test_a_slow_receiver_delays_neither_runs_nor_other_receivers(
    stack_: Stack, receivers: list[Receiver]
) -> None:
    slow, fast = Receiver(hold=True).start(), Receiver().start()
    receivers += [slow, fast]
    a, b = user(), user()
    with stack_.client(a) as ca, stack_.client(b) as cb:
        add_webhook(ca, slow.url)
        add_webhook(cb, fast.url)
        first = submit(ca)
        stack_.wait(lambda: slow.holding >= 1, timeout=60, what="the slow receiver holding a call")
        later = [submit(ca) for _ in range(3)]
        other = submit(cb)
        stack_.wait(
            lambda: all(status_of(stack_.settings, r) == "done" for r in [*later, other]),
            timeout=60,
            what="the later runs done",
        )
        stack_.wait(lambda: fast.of_run(other), timeout=30, what="the other user's call")
        # Both came while the slow receiver still held its first request.
        assert not slow.released.is_set() and slow.of_run(first)
        slow.release()
        for run_id in [first, *later]:
            stack_.wait(lambda r=run_id: slow.of_run(r), timeout=60, what="every slow call")


def test_a_dispatcher_killed_mid_delivery_loses_nothing(
    stack_: Stack, receivers: list[Receiver]
) -> None:
    receiver = Receiver(hold=True).start()
    receivers.append(receiver)
    who = user()
    with stack_.client(who) as c:
        hook = add_webhook(c, receiver.url)
        run_id = submit(c)
        stack_.wait(lambda: receiver.holding >= 1, timeout=60, what="the POST in flight")
        stack_.dispatcher.kill()  # mid-delivery: the receiver holds the request
        assert deliveries(c, hook["id"])[0]["status"] == "pending"
        receiver.release()  # the killed dispatcher never hears this answer
        stack_.dispatcher = Dispatcher(stack_.settings, stack_.dispatcher.port).start()
        stack_.wait(lambda: len(receiver.of_run(run_id)) >= 2, timeout=60, what="the redelivery")
        stack_.wait(lambda: deliveries(c, hook["id"])[0]["status"] == "delivered", timeout=30)
        ids = {r.headers["webhook-id"] for r in receiver.of_run(run_id)}
        assert ids == {deliveries(c, hook["id"])[0]["id"]}  # the same message, at least once
    # The restarted role serves its probes and metrics.
    base = f"http://127.0.0.1:{stack_.dispatcher.port}"
    stack_.wait(lambda: _get(f"{base}/readyz") == 200, what="the dispatcher ready")
    assert _get(f"{base}/livez") == 200
    exposition = httpx.get(f"{base}/metrics").text
    assert 'koda_webhook_deliveries_total{outcome="delivered"}' in exposition
    assert "koda_webhook_oldest_pending_seconds" in exposition
    assert "koda_webhook_attempt_seconds_bucket" in exposition


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


async def test_a_scheduled_runs_answer_arrives_at_its_own_webhook(
    stack_: Stack, receivers: list[Receiver]
) -> None:
    own, general = Receiver().start(), Receiver().start()
    receivers += [own, general]
    who = user()
    settings = stack_.settings
    with stack_.client(who) as c:
        every = add_webhook(c, general.url)
        mine = add_webhook(c, own.url, all_runs=False)
        body = {"cron": "* * * * *", "timezone": "UTC", "input": {"text": "ping", **FAST}}
        with stack_.client(user()) as stranger:
            r = stranger.post("/v1/schedules", json={**body, "webhook_id": mine["id"]})
            assert r.status_code == 422 and r.json()["error"]["field"] == "webhook_id"
        r = c.post("/v1/schedules", json={**body, "webhook_id": mine["id"]})
        assert r.status_code == 201, r.text
        schedule = r.json()
        assert schedule["webhook_id"] == mine["id"]
        assert c.get(f"/v1/schedules/{schedule['id']}").json()["webhook_id"] == mine["id"]
        path = f"/v1/schedules/{schedule['id']}"
        r = c.patch(path, json={"webhook_id": "wh_nope"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "webhook_id"
        assert c.patch(path, json={"webhook_id": None}).json()["webhook_id"] is None
        assert c.patch(path, json={"webhook_id": mine["id"]}).json()["webhook_id"] == mine["id"]
    # Fire it with the scheduler's own pass: the schedule is due a minute ago.
    engine = async_engine(settings, pool_size=2)
    publisher = RunPublisher(settings)
    await publisher.start()
    try:
        minute = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=1)
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE schedules SET next_fire_at = :m WHERE id = :s"),
                {"m": minute, "s": schedule["id"]},
            )
        scheduler = Scheduler(
            ScheduleStore(engine), RunAdmission(engine), publisher, partitions=settings.partitions
        )
        await scheduler.run_pass()
    finally:
        await publisher.stop(5)
        await engine.dispose()
    (run_id,) = (
        r[0]
        for r in db_rows(
            settings,
            "SELECT id FROM runs WHERE schedule_id = :s AND scheduled_for = :m",
            s=schedule["id"],
            m=minute,
        )
    )
    stack_.wait(lambda: own.of_run(run_id), timeout=60, what="the scheduled run's call")
    (got,) = own.of_run(run_id)
    assert got.signed_by(mine["secret"])
    data = got.json["data"]
    assert data["schedule_id"] == schedule["id"] and data["status"] == "done"
    assert datetime.fromisoformat(data["scheduled_for"]) == minute
    assert data["output"] == output_of(settings, run_id)
    # The schedule's own webhook overrides the owner's: the other one gets no call.
    with stack_.client(who) as c:
        assert deliveries(c, every["id"]) == []


ALICE = "alice-token-" + "k3Xq9vT2mZ8wR4pL7nB1cY6dF0gH5jS"


@pytest.fixture(scope="module")
def prod_url(stack: StackInfo) -> Iterator[str]:
    settings = make_settings(
        stack, app_env=AppEnv.PROD, handler="openai", prod_tokens={ALICE: "alice"}
    )
    with prepared_namespace(settings), serve_app(create_app(settings)) as url:
        yield url


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("https://127.0.0.1/hook", "webhook_address_refused"),
        ("https://10.1.2.3/hook", "webhook_address_refused"),
        ("https://169.254.169.254/latest", "webhook_address_refused"),
        ("https://[::1]:8443/hook", "webhook_address_refused"),
        ("https://localhost/hook", "webhook_address_refused"),
        ("http://example.com/hook", "webhook_url_refused"),
        ("ftp://example.com/hook", "webhook_url_refused"),
        ("https://user:pw@example.com/hook", "webhook_url_refused"),
    ],
)
def test_prod_refuses_private_addresses_and_plain_http_at_creation(
    prod_url: str, url: str, code: str
) -> None:
    headers = {"Authorization": f"Bearer {ALICE}"}
    r = httpx.post(f"{prod_url}/v1/webhooks", json={"url": url}, headers=headers)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "url" and error["code"] == code
    assert ("non-public" in error["message"]) == (code == "webhook_address_refused")
    assert httpx.get(f"{prod_url}/v1/webhooks", headers=headers).json()["webhooks"] == []


def test_prod_accepts_a_public_https_url(prod_url: str) -> None:
    headers = {"Authorization": f"Bearer {ALICE}"}
    r = httpx.post(
        f"{prod_url}/v1/webhooks", json={"url": "https://hooks.example.com/koda"}, headers=headers
    )
    assert r.status_code == 201, r.text
    assert r.json()["url"] == "https://hooks.example.com/koda"


def test_migration_0015_cascades_and_downgrades_and_upgrades_again(stack: StackInfo) -> None:
    settings = make_settings(stack)
    tables = "SELECT tablename FROM pg_tables WHERE schemaname = :s AND tablename LIKE 'webhook%'"
    schema = settings.names.pg_schema()
    try:
        upgrade(settings)
        db_rows(
            settings,
            "INSERT INTO sessions (id, user_id) VALUES ('s1', 'u');"
            " INSERT INTO runs (id, session_id, user_id, idempotency_key, input, status)"
            " VALUES ('r1', 's1', 'u', 'k1', '{}', 'done');"
            " INSERT INTO webhooks (id, user_id, url, secret) VALUES ('w1', 'u', 'https://a', 'x');"
            " INSERT INTO webhook_deliveries (id, webhook_id, run_id, user_id)"
            " VALUES ('d1', 'w1', 'r1', 'u');"
            " INSERT INTO webhook_attempts (delivery_id, attempt, started_at, duration_ms)"
            " VALUES ('d1', 1, now(), 5);"
            " INSERT INTO schedules (id, user_id, cron, timezone, input, webhook_id)"
            " VALUES ('sc1', 'u', '* * * * *', 'UTC', '{}', 'w1')",
        )
        with pytest.raises(IntegrityError):  # one delivery per (webhook, run)
            db_rows(
                settings,
                "INSERT INTO webhook_deliveries (id, webhook_id, run_id, user_id)"
                " VALUES ('d2', 'w1', 'r1', 'u')",
            )
        db_rows(settings, "DELETE FROM webhooks WHERE id = 'w1'")
        assert db_rows(settings, "SELECT webhook_id FROM schedules")[0][0] is None
        counts = (
            "SELECT (SELECT count(*) FROM webhook_deliveries),"
            " (SELECT count(*) FROM webhook_attempts)"
        )
        assert tuple(db_rows(settings, counts)[0]) == (0, 0)
        downgrade(settings, "0014")
        assert db_rows(settings, tables, s=schema) == []
        upgrade(settings)
        assert {r[0] for r in db_rows(settings, tables, s=schema)} == {
            "webhooks",
            "webhook_deliveries",
            "webhook_attempts",
        }
    finally:
        drop_schema(settings)

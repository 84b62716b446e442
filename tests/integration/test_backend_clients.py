"""Backends submit for their users (issue 38, item 3), against the real stack.

* A prod gateway (in this process) with a service token: runs submitted, read and
  cancelled on behalf of a user; a missing scope, a missing ``X-Koda-User``, and a user
  token naming another user are refused by name; ``runs.created_by`` is recorded and
  shown; ``POST /v1/runs/batch`` answers each item on its own and the same runs again.
* A dev gateway and a worker (child processes): :mod:`koda_runtime.client`, sync and
  async, submits and follows runs to the end, resumes a stream across a gateway killed
  and restarted mid-run, cancels, batches; ``koda runs submit`` with a service token.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from koda_runtime.cli.runs import runs_app
from koda_runtime.client import ApiError, AsyncClient, BatchItem, Client, Event
from koda_runtime.gateway.app import create_app
from koda_runtime.naming import AppEnv
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.settings import ServiceToken, Settings
from tests.fixtures.gateway import db_rows, serve_app
from tests.fixtures.namespaces import make_settings, prepared_namespace
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.support import wait_until

SERVICE = "svc-" + uuid.uuid4().hex + "-all"
READER = "svc-" + uuid.uuid4().hex + "-read"
OWN = "usr-" + uuid.uuid4().hex + "-own"  # u1's own token
SERVICES = {
    SERVICE: ServiceToken("billing", frozenset({"submit", "read", "cancel"})),
    READER: ServiceToken("reporting", frozenset({"read"})),
}
SERVICES_ENV = f"{SERVICE}:billing:submit+read+cancel,{READER}:reporting:read"
GATEWAY_ENV = {
    "KODA_SERVICE_TOKENS": SERVICES_ENV,
    "KODA_SSE_KEEPALIVE": "0.5",
    "KODA_SSE_RETRY_MS": "200",
    "KODA_RATE_PER_S": "1000",
    "KODA_RATE_BURST": "1000",
}


def as_service(user: str | None, token: str = SERVICE) -> dict[str, str]:
    found = {"Authorization": f"Bearer {token}"}
    if user is not None:
        found["X-Koda-User"] = user
    return found


@dataclass
class Prod:
    settings: Settings
    url: str

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)


@dataclass
class Dev:
    settings: Settings
    gateway: GatewayProcess


@pytest.fixture(scope="module")
def dev_env(stack: Any) -> Iterator[Settings]:
    settings = make_settings(stack, rate_per_s=1000.0, rate_burst=1000)
    with prepared_namespace(settings):
        yield settings


@pytest.fixture(scope="module")
def prod(dev_env: Settings) -> Iterator[Prod]:
    settings = dev_env.with_(
        app_env=AppEnv.PROD,
        handler="openai",
        prod_tokens={OWN: "u1"},
        service_tokens=SERVICES,
        batch_max_runs=5,
    )
    with prepared_namespace(settings), serve_app(create_app(settings)) as url:
        yield Prod(settings, url)


@pytest.fixture(scope="module")
def dev(dev_env: Settings) -> Iterator[Dev]:
    gateway = GatewayProcess(dev_env, GATEWAY_ENV)
    worker = WorkerProcess(dev_env, "clients-w1")
    try:
        gateway.start()
        worker.start()
        with Client(gateway.url, SERVICE, on_behalf_of="warm") as client:
            warm = client.submit({"text": "warm", "demo": {"tokens": 1, "delay_ms": 0}})
            wait_until(
                lambda: client.get(warm.run_id)["status"] == "done",
                timeout=90,
                what="the warm-up run",
            )
        yield Dev(dev_env, gateway)
    finally:
        worker.stop()
        gateway.stop()


def created_by(settings: Settings, run_id: str) -> str:
    ((by,),) = db_rows(settings, "SELECT created_by FROM runs WHERE id = :id", id=run_id)
    return str(by)


# --- the prod gateway: service tokens ---------------------------------------------------


def test_a_service_token_submits_reads_and_cancels_for_a_user(prod: Prod) -> None:
    with prod.http() as http:
        r = http.post("/v1/runs", headers=as_service("u1"), json={"input": "for u1"})
        assert r.status_code == 202, r.text
        run_id = r.json()["run_id"]
        assert created_by(prod.settings, run_id) == "service:billing"
        detail = http.get(f"/v1/runs/{run_id}", headers=as_service("u1"))
        assert detail.status_code == 200 and detail.json()["created_by"] == "service:billing"
        # the user's own token sees the run the service made for it, and vice versa
        mine = http.get(f"/v1/runs/{run_id}", headers={"Authorization": f"Bearer {OWN}"})
        assert mine.status_code == 200 and mine.json()["created_by"] == "service:billing"
        own = http.post("/v1/runs", headers={"Authorization": f"Bearer {OWN}"}, json={"input": "x"})
        assert own.status_code == 202, own.text
        own_id = own.json()["run_id"]
        assert http.get(f"/v1/runs/{own_id}", headers=as_service("u1")).json()["created_by"] == (
            "user:u1"
        )
        # acting for another user, the run is not there
        assert http.get(f"/v1/runs/{run_id}", headers=as_service("u2")).status_code == 404
        listed = http.get("/v1/runs", headers=as_service("u1")).json()["runs"]
        assert {run_id, own_id} <= {r["run_id"] for r in listed}
        # SSE viewers: a ticket the service asks for opens the user's run
        issued = http.post(f"/v1/runs/{run_id}/stream-ticket", headers=as_service("u1"))
        assert issued.status_code == 200, issued.text
        with http.stream("GET", issued.json()["events_url"]) as stream:
            assert stream.status_code == 200
        with http.stream(
            "GET", f"/v1/runs/{run_id}/events", headers=as_service("u1", READER)
        ) as stream:
            assert stream.status_code == 200
        cancelled = http.post(
            f"/v1/runs/{run_id}/cancel", headers=as_service("u1"), json={"reason": "no"}
        )
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"


def test_a_missing_scope_is_403_naming_it(prod: Prod) -> None:
    with prod.http() as http:
        r = http.post("/v1/runs", headers=as_service("u1", READER), json={"input": "x"})
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "missing_scope"
        assert "'submit' scope" in r.json()["error"]["message"]
        made = http.post("/v1/runs", headers=as_service("u1"), json={"input": "y"}).json()
        r = http.post(f"/v1/runs/{made['run_id']}/cancel", headers=as_service("u1", READER))
        assert r.status_code == 403 and "'cancel' scope" in r.json()["error"]["message"]
        # reading is in its scopes
        assert http.get(f"/v1/runs/{made['run_id']}", headers=as_service("u1", READER)).is_success


def test_a_service_token_without_x_koda_user_is_400_naming_the_header(prod: Prod) -> None:
    with prod.http() as http:
        for method, path in (("POST", "/v1/runs"), ("GET", "/v1/runs")):
            r = http.request(method, path, headers=as_service(None), json={"input": "x"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["field"] == "X-Koda-User"
            assert "missing X-Koda-User" in r.json()["error"]["message"]
        r = http.get("/v1/runs", headers=as_service("not/a/user"))
        assert r.status_code == 400 and r.json()["error"]["field"] == "X-Koda-User"


def test_a_user_token_naming_another_user_is_403_and_itself_is_fine(prod: Prod) -> None:
    with prod.http() as http:
        own = {"Authorization": f"Bearer {OWN}"}
        r = http.post("/v1/runs", headers=own | {"X-Koda-User": "u2"}, json={"input": "x"})
        assert r.status_code == 403, r.text
        assert r.json()["error"]["field"] == "X-Koda-User"
        r = http.post("/v1/runs", headers=own | {"X-Koda-User": "u1"}, json={"input": "x"})
        assert r.status_code == 202, r.text
        assert created_by(prod.settings, r.json()["run_id"]) == "user:u1"


def test_a_batch_answers_each_item_and_the_same_runs_again(prod: Prod) -> None:
    tag = uuid.uuid4().hex[:8]
    batch = {
        "runs": [
            {"idempotency_key": f"{tag}-a", "user": "u1", "input": "first"},
            {"idempotency_key": f"{tag}-b", "user": "u2", "input": {"text": "second"}},
            {"idempotency_key": f"{tag}-c", "user": "u1", "input": 7},
        ]
    }
    with prod.http() as http:
        r = http.post("/v1/runs/batch", headers=as_service(None), json=batch)
        assert r.status_code == 200, r.text
        first = r.json()["runs"]
        assert [i["status"] for i in first] == [202, 202, 422]
        assert first[2]["error"]["field"] == "runs[2].input"
        ids = [i["run"]["run_id"] for i in first[:2]]
        owners = db_rows(
            prod.settings,
            "SELECT id, user_id, created_by FROM runs WHERE id = ANY(:ids) ORDER BY user_id",
            ids=ids,
        )
        assert [tuple(o) for o in owners] == [
            (ids[0], "u1", "service:billing"),
            (ids[1], "u2", "service:billing"),
        ]
        again = http.post("/v1/runs/batch", headers=as_service(None), json=batch).json()["runs"]
        assert [i["run"]["run_id"] for i in again[:2]] == ids and again[2]["status"] == 422
        # an item naming no user, without the header, fails alone
        r = http.post(
            "/v1/runs/batch",
            headers=as_service(None),
            json={"runs": [{"idempotency_key": f"{tag}-d", "input": "x"}, batch["runs"][0]]},
        )
        assert [i["status"] for i in r.json()["runs"]] == [400, 202]
        assert r.json()["runs"][0]["error"]["field"] == "runs[0].user"
        # a user's own token: its own items only
        r = http.post(
            "/v1/runs/batch",
            headers={"Authorization": f"Bearer {OWN}"},
            json={
                "runs": [
                    {"idempotency_key": f"{tag}-e", "input": "mine"},
                    {"idempotency_key": f"{tag}-f", "user": "u2", "input": "theirs"},
                ]
            },
        )
        assert [i["status"] for i in r.json()["runs"]] == [202, 403]


def test_a_batch_over_the_limit_is_refused_naming_it(prod: Prod) -> None:
    runs = [{"idempotency_key": f"k{i}", "user": "u1", "input": "x"} for i in range(6)]
    with prod.http() as http:
        r = http.post("/v1/runs/batch", headers=as_service(None), json={"runs": runs})
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "batch_too_large"
        assert "KODA_BATCH_MAX_RUNS allows at most 5" in r.json()["error"]["message"]
        r = http.post("/v1/runs/batch", headers=as_service("u1", READER), json={"runs": runs[:1]})
        assert r.status_code == 403 and r.json()["error"]["code"] == "missing_scope"


def test_koda_runs_submit_and_show_with_a_service_token(prod: Prod) -> None:
    runner = CliRunner()
    base = ["--token", SERVICE, "--user", "u1", "--gateway", prod.url]
    result = runner.invoke(runs_app, ["submit", "from the cli", *base])
    assert result.exit_code == 0, result.output
    run_id = result.stdout.strip()
    assert created_by(prod.settings, run_id) == "service:billing"
    shown = runner.invoke(
        runs_app,
        ["show", run_id, "--gateway", prod.url],
        env={"KODA_TOKEN": SERVICE, "KODA_USER": "u1"},
    )
    assert shown.exit_code == 0, shown.output
    assert '"created_by": "service:billing"' in shown.stdout
    refused = runner.invoke(runs_app, ["submit", "x", "--token", SERVICE, "--gateway", prod.url])
    assert refused.exit_code == 2 and "X-Koda-User" in refused.stderr


# --- the dev gateway and a worker: the Python client -----------------------------------


def chunks(events: list[Event]) -> str:
    return "".join(e.json()["content"] for e in events if e.event == "chunk")


def test_the_client_submits_and_follows_a_run_to_its_end(dev: Dev) -> None:
    inp = {"text": "sync " + uuid.uuid4().hex, "demo": {"tokens": 6, "delay_ms": 5}}
    with Client(dev.gateway.url, SERVICE, on_behalf_of="c-sync") as client:
        run = client.submit(inp, idempotency_key="sync-1")
        assert client.submit(inp, idempotency_key="sync-1").run_id == run.run_id
        events = list(client.follow(run.run_id))
        assert events[-1].event == "done"
        assert chunks(events) == "".join(demo_tokens(inp))
        assert client.get(run.run_id)["created_by"] == "service:billing"
        page = client.history(client.get(run.run_id)["session_id"])
        assert [r["run_id"] for r in page["runs"]] == [run.run_id]
        with pytest.raises(ApiError) as refused:
            client.get(run.run_id, user="someone-else")
        assert refused.value.status == 404


async def test_the_async_client_submits_and_follows_a_run_to_its_end(dev: Dev) -> None:
    inp = {"text": "async " + uuid.uuid4().hex, "demo": {"tokens": 6, "delay_ms": 5}}
    async with AsyncClient(dev.gateway.url, SERVICE, on_behalf_of="c-async") as client:
        run = await client.submit(inp)
        events = [e async for e in client.follow(run.run_id)]
        assert events[-1].event == "done"
        assert chunks(events) == "".join(demo_tokens(inp))
        results = await client.submit_batch(
            [BatchItem("one", "ab-1"), BatchItem("two", "ab-2", user="c-async-2")]
        )
        assert all(r.ok for r in results)
        assert (await client.get(results[1].run.run_id, user="c-async-2"))["status"]  # type: ignore[union-attr]
        assert (await client.history())["runs"]


def test_the_client_cancels_a_running_run_and_follow_ends_cancelled(dev: Dev) -> None:
    inp = {"text": "long " + uuid.uuid4().hex, "demo": {"tokens": 400, "delay_ms": 50}}
    with Client(dev.gateway.url, SERVICE, on_behalf_of="c-cancel") as client:
        run = client.submit(inp)
        seen: list[Event] = []
        for event in client.follow(run.run_id):
            seen.append(event)
            if event.event == "chunk" and len(seen) == 3:
                assert client.cancel(run.run_id, reason="enough")["cancel_requested"]
        assert seen[-1].event == "cancelled"
        assert client.get(run.run_id)["status"] == "cancelled"


def test_follow_resumes_across_a_gateway_killed_and_restarted_mid_run(dev: Dev) -> None:
    """Its own gateway, killed with SIGKILL after a few chunks and started again on the
    same port: the client reconnects with Last-Event-ID and reads the rest exactly."""
    gateway = GatewayProcess(dev.settings, GATEWAY_ENV).start()
    inp = {"text": "resume " + uuid.uuid4().hex, "demo": {"tokens": 60, "delay_ms": 60}}
    lost: list[int | None] = []
    try:
        with Client(gateway.url, SERVICE, on_behalf_of="c-resume") as client:
            run = client.submit(inp)
            events: list[Event] = []
            for event in client.follow(run.run_id, on_retry=lambda _e, last: lost.append(last)):
                events.append(event)
                if len(events) == 5:
                    gateway.kill()
                    gateway = GatewayProcess(dev.settings, GATEWAY_ENV, port=gateway.port).start()
    finally:
        gateway.stop()
    assert lost and lost[0] is not None
    seqs = [e.seq for e in events]
    assert seqs == list(range(len(events))), seqs  # no gap, no repeat
    assert events[-1].event == "done"
    assert chunks(events) == "".join(demo_tokens(inp))

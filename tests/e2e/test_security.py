"""Security basics against real processes: secrets and prompts stay out of the logs, and
one user can never read, stream or fetch another user's run."""

from __future__ import annotations

import uuid

import httpx

from koda_runtime.naming import AppEnv
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from tests.fixtures.namespaces import delete_topics, drop_schema
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter
from tests.support import wait_until


def read_some(url: str, path: str, **kw: object) -> tuple[int, bytes]:
    """Open a stream, read its first bytes (or the whole refusal), close it."""
    with httpx.stream("GET", url + path, timeout=10, **kw) as r:  # type: ignore[arg-type]
        for chunk in r.iter_bytes():
            return r.status_code, chunk
        return r.status_code, b""


def test_tokens_and_prompts_never_reach_the_logs(env: Settings) -> None:
    tag = uuid.uuid4().hex[:10]
    prompt = f"PROMPT-{tag} the launch code is 0000 and my diagnosis is private"
    user = f"sec-{tag}"
    dev_token = f"dev:{user}"
    forged = f"sk-live-FORGED{tag}"
    # A prod gateway (real tokens) beside the dev pipeline, in the same namespace's DB.
    secret = f"tok-SECRET{tag}-{uuid.uuid4().hex}"
    prod = env.with_(
        app_env=AppEnv.PROD,
        handler="openai",
        prod_tokens={secret: user},
    )
    upgrade(prod)
    apply_topics(prod)
    sub = Submitter(env)
    gateway = GatewayProcess(env).start()
    worker = WorkerProcess(env, "sec").start()
    prod_gw = GatewayProcess(prod, {"KODA_API_TOKENS": f"{secret}:{user}"}).start()
    try:
        auth = {"Authorization": f"Bearer {dev_token}"}
        ok = httpx.post(f"{gateway.url}/v1/runs", headers=auth, json={"input": {"text": prompt}})
        assert ok.status_code == 202, ok.text
        run_id = ok.json()["run_id"]
        bad = httpx.post(
            f"{gateway.url}/v1/runs",
            headers=auth,
            json={"input": {"text": prompt + " again", "demo": {"tokens": 2, "fail_attempts": 9}}},
        )
        assert bad.status_code == 202
        wait_until(
            lambda: sub.all_terminal([run_id, bad.json()["run_id"]]),
            timeout=60,
            what="runs terminal",
        )
        status, _ = read_some(
            gateway.url, f"/v1/runs/{run_id}/events", params={"access_token": dev_token}
        )
        assert status in (200, 204)
        assert httpx.get(f"{gateway.url}/v1/runs/{run_id}", headers=auth).status_code == 200
        assert (
            httpx.post(
                f"{gateway.url}/v1/runs",
                json={"input": prompt},
                headers={"Authorization": f"Bearer {forged}"},
            ).status_code
            == 401
        )

        p_auth = {"Authorization": f"Bearer {secret}"}
        accepted = httpx.post(
            f"{prod_gw.url}/v1/runs", headers=p_auth, json={"input": {"text": prompt}}
        )
        assert accepted.status_code == 202, accepted.text
        prod_run = accepted.json()["run_id"]
        assert httpx.get(f"{prod_gw.url}/v1/runs/{prod_run}", headers=p_auth).status_code == 200
        # A browser streams with a 60 s ticket of the run; the token in a URL opens nothing.
        issued = httpx.post(f"{prod_gw.url}/v1/runs/{prod_run}/stream-ticket", headers=p_auth)
        assert issued.status_code == 200, issued.text
        ticket = issued.json()["ticket"]
        status, first = read_some(prod_gw.url, issued.json()["events_url"])
        assert status == 200, first
        for path in (f"/v1/runs/{prod_run}/events", f"/v1/runs/{prod_run}"):
            status, refusal = read_some(prod_gw.url, path, params={"access_token": secret})
            assert status == 401 and secret.encode() not in refusal, path
        for wrong in (forged, f"dev:{user}", secret + "x"):
            r = httpx.get(
                f"{prod_gw.url}/v1/runs/{prod_run}", headers={"Authorization": f"Bearer {wrong}"}
            )
            assert r.status_code == 401 and wrong not in r.text
    finally:
        worker.stop()
        gateway.stop()
        prod_gw.stop()
        sub.close()
        delete_topics(prod)
        drop_schema(prod)
    logs = {"gateway": gateway.log(), "worker": worker.log(), "prod gateway": prod_gw.log()}
    assert user in logs["gateway"]  # the logs are there, and they do name the user
    for name, text in logs.items():
        for needle in (secret, forged, dev_token, ticket, f"PROMPT-{tag}", "launch code"):
            assert needle not in text, f"{needle!r} found in the {name} log"


def test_a_user_cannot_read_stream_or_fetch_another_users_run(env: Settings) -> None:
    gateway = GatewayProcess(env).start()
    try:
        alice = {"Authorization": "Bearer dev:alice-owner"}
        bob = {"Authorization": "Bearer dev:bob-other"}
        r = httpx.post(f"{gateway.url}/v1/runs", headers=alice, json={"input": "alice only"})
        run_id = r.json()["run_id"]
        session = httpx.get(f"{gateway.url}/v1/runs/{run_id}", headers=alice).json()["session_id"]
        unknown = "01a00000-0000-7000-8000-000000000000"
        for path in (f"/v1/runs/{run_id}", f"/v1/runs/{run_id}/events"):
            theirs = httpx.get(gateway.url + path, headers=bob)
            nobody = httpx.get(gateway.url + path.replace(run_id, unknown), headers=bob)
            assert theirs.status_code == nobody.status_code == 404
            assert theirs.json()["error"]["code"] == nobody.json()["error"]["code"]
            assert "alice only" not in theirs.text
        by_query = httpx.get(
            f"{gateway.url}/v1/runs/{run_id}/events", params={"access_token": "dev:bob-other"}
        )
        assert by_query.status_code == 404
        # Bob may not append to Alice's session either (it looks unknown to him).
        steal = httpx.post(
            f"{gateway.url}/v1/runs", headers=bob, json={"input": "x", "session_id": session}
        )
        assert steal.status_code == 404
        assert httpx.get(f"{gateway.url}/v1/runs/{run_id}", headers=alice).status_code == 200
    finally:
        gateway.stop()

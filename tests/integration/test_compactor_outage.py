"""The compactor role rides out PostgreSQL going away, at start-up and mid-life.

Its failure mode: a round's database error was not caught, so the process exited with
the first statement that met PostgreSQL down. Here the role connects through a
Toxiproxy (tests/fixtures/pgproxy.py) that the test disables, so only this process loses
PostgreSQL. Meanwhile it stays alive and live, answers 503 on /readyz naming the cause,
counts ``koda_chunk_upkeep_failures_total{cause="postgres"}``; once the proxy is back it
completes rounds again and compacts what finished during the outage, each run once.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
from sqlalchemy import text

from koda_runtime.lifecycle.chunks import final_key
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS
from tests.fixtures.pgproxy import pg_proxy
from tests.fixtures.processes import ChildProcess, free_port, koda_argv, settings_env
from tests.fixtures.runs import Submitter, read_topic
from tests.support import wait_until


def finished_run(sub: Submitter, user: str, words: list[str]) -> str:
    """A run that ended a second ago with ``words`` as its chunks, straight into Postgres."""
    run_id = sub.submit(user, {"text": user}, publish=False)
    events = [("chunk", w) for w in words] + [("done", "")]
    with sub.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE runs SET status = 'done', attempt = 1, started_at = now() - interval"
                " '2 seconds', finished_at = now() - interval '1 second' WHERE id = :r"
            ),
            {"r": run_id},
        )
        for seq, (kind, content) in enumerate(events):
            conn.execute(
                text(
                    "INSERT INTO messages (run_id, seq, kind, content, attempt)"
                    " VALUES (:r, :s, :k, :c, 1)"
                ),
                {"r": run_id, "s": seq, "k": kind, "c": content},
            )
    return run_id


def sample(body: str, name: str, labels: str = "") -> float:
    for line in body.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.split()[1])
    return 0.0


def test_the_compactor_survives_postgres_away_and_resumes(env: Settings) -> None:
    sub = Submitter(env)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with pg_proxy(env.database_url) as proxy:
        argv = [
            *koda_argv("chunks"),
            *("compact", "--every", "1", "--older-than", "0", "--port", str(port)),
        ]
        proxy.cut()  # away from the start
        compactor = ChildProcess(
            "compactor-outage", argv, settings_env(env, KODA_DATABASE_URL=proxy.url)
        ).start()
        try:

            def get(path: str) -> httpx.Response | None:
                compactor.check()  # alive, whatever happens to Postgres
                try:
                    return httpx.get(f"{base}{path}", timeout=2)
                except httpx.HTTPError:
                    return None

            def failures() -> float:
                r = get("/metrics")
                body = r.text if r is not None else ""
                return sample(body, "koda_chunk_upkeep_failures_total", '{cause="postgres"}')

            def readiness(status: int) -> Callable[[], dict[str, object] | None]:
                def check() -> dict[str, object] | None:
                    r = get("/readyz")
                    return r.json() if r is not None and r.status_code == status else None

                return check

            down = wait_until(
                lambda: (r := readiness(503)()) and "postgres" in str(r.get("reason")) and r,
                timeout=60,
                interval=0.2,
                what="/readyz naming postgres while it is away at start-up",
            )
            assert down["rounds"] == 0
            wait_until(lambda: failures() >= 2, timeout=30, interval=0.2, what="failed rounds")
            live = get("/livez")
            assert live is not None and live.status_code == 200

            before = finished_run(sub, "outage-before", ["a", "b"])
            proxy.restore()
            wait_until(readiness(200), timeout=30, interval=0.2, what="a round after restore")
            wait_until(lambda: compacted(sub, [before]), timeout=30, interval=0.2)

            proxy.cut()  # away mid-life
            counted = failures()
            during = finished_run(sub, "outage-during", ["c", "d", "e"])
            wait_until(
                lambda: (r := readiness(503)()) and "postgres" in str(r.get("reason")) and r,
                timeout=30,
                interval=0.2,
                what="/readyz failing once Postgres is away again",
            )
            wait_until(lambda: failures() > counted, timeout=30, interval=0.2)
            live = get("/livez")
            assert live is not None and live.status_code == 200
            assert not compacted(sub, [during])

            proxy.restore()
            wait_until(lambda: compacted(sub, [during]), timeout=30, interval=0.2)
            wait_until(readiness(200), timeout=30, interval=0.2, what="ready after the outage")
            scraped = get("/metrics")
            assert scraped is not None
            assert sample(scraped.text, "koda_chunk_runs_compacted_total") == 2
            assert "event=chunk_upkeep_failed cause=postgres" in compactor.log()
            assert "event=chunk_upkeep_resumed" in compactor.log()
        finally:
            status = compactor.stop(30)
    assert status == 0, compactor.log()
    # Each run compacted once: one final record each, with its whole text.
    finals = [
        json.loads(r.value())
        for r in read_topic(env, env.names.topic(RUN_CHUNKS))
        if r.value() is not None and r.key().decode() in {final_key(before), final_key(during)}
    ]
    assert sorted(f["content"] for f in finals) == ["ab", "cde"]
    sub.close()


def compacted(sub: Submitter, run_ids: list[str]) -> bool:
    rows = sub.query(
        "SELECT count(*) AS n FROM runs WHERE id = ANY(:ids) AND compacted_at IS NOT NULL",
        ids=run_ids,
    )
    return rows[0].n == len(run_ids)

"""A dev and a prod worker on one broker and one database never see each other's runs.

Same namespace string, different APP_ENV: every topic, group and Postgres schema name
differs only through the naming function. prod runs the openai handler against a local
fake (prod refuses the demo handler); no client ever auto-creates a topic.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from koda_runtime.naming import AppEnv
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ, WORKER_GROUP, WORKERS
from tests.fixtures.model_server import PIECES
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings, new_namespace
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter, committed_offsets, read_topic
from tests.support import wait_until


@pytest.fixture
def envs(stack, fake_completions: str) -> Iterator[tuple[Settings, Settings]]:
    namespace = new_namespace()
    dev = make_settings(stack, namespace=namespace)
    prod = dev.with_(
        app_env=AppEnv.PROD,
        handler="openai",
        openai_base_url=fake_completions,
    )
    for s in (dev, prod):
        apply_topics(s)
        upgrade(s)
    yield dev, prod
    for s in (dev, prod):
        delete_topics(s)
        drop_schema(s)


def output(sub: Submitter, run_id: str) -> str:
    return "".join(r.content for r in sub.messages(run_id) if r.kind == "chunk")


def test_dev_and_prod_workers_on_one_broker_stay_apart(envs, fake_completions: str) -> None:
    dev, prod = envs
    assert dev.namespace == prod.namespace
    assert dev.names.topic(RUNS) != prod.names.topic(RUNS)
    fast = {"KODA_BEAT_INTERVAL": "0.5", "KODA_BEAT_STALE_AFTER": "2"}
    workers = [
        WorkerProcess(dev, "iso-dev", fast).start(),
        WorkerProcess(
            prod,
            "iso-prod",
            {**fast, "KODA_OPENAI_BASE_URL": fake_completions},
        ).start(),
    ]
    subs = Submitter(dev), Submitter(prod)
    try:
        users = [f"iso-user-{i}" for i in range(4)]  # the same users in both environments
        dev_runs = [
            subs[0].submit(u, {"text": u, "demo": {"tokens": 3, "delay_ms": 1}}) for u in users
        ]
        prod_runs = [subs[1].submit(u, {"text": u}) for u in users]

        def all_done() -> bool:
            for w in workers:
                assert w.alive(), w.log()[-3000:]
            return subs[0].all_terminal(dev_runs) and subs[1].all_terminal(prod_runs)

        wait_until(all_done, timeout=90, interval=0.2, what="dev and prod runs terminal")
        for sub, run_ids, worker_id in (
            (subs[0], dev_runs, "iso-dev"),
            (subs[1], prod_runs, "iso-prod"),
        ):
            rows = sub.query("SELECT id, status, worker_id, attempt FROM runs")
            assert sorted(r.id for r in rows) == sorted(run_ids)  # no row from the other env
            assert {(r.status, r.worker_id, r.attempt) for r in rows} == {("done", worker_id, 1)}
        for user, run_id in zip(users, dev_runs, strict=True):
            expected = "".join(demo_tokens({"text": user, "demo": {"tokens": 3, "delay_ms": 1}}))
            assert output(subs[0], run_id) == expected
        for run_id in prod_runs:
            assert output(subs[1], run_id) == "".join(PIECES)

        # Neither worker read the other's records: they would have been dead-lettered
        # (unknown_run), and the groups committed only their own environment's topic.
        for s in (dev, prod):
            assert read_topic(s, s.names.topic(RUNS_DLQ), timeout=2) == []
        for mine, other in ((dev, prod), (prod, dev)):
            group = mine.names.group(WORKER_GROUP)
            assert all(
                o < 0 for o in committed_offsets(mine, group, other.names.topic(RUNS)).values()
            )

            def committed_own(m: Settings = mine, g: str = group) -> bool:
                offsets = committed_offsets(m, g, m.names.topic(RUNS)).values()
                return sum(max(o, 0) for o in offsets) == len(users)

            wait_until(
                committed_own,
                timeout=20,
                what=f"{mine.app_env.value} group committed its own runs",
            )
        beats = {
            s.app_env: {m.key().decode() for m in read_topic(s, s.names.topic(WORKERS))}
            for s in (dev, prod)
        }
        assert beats == {AppEnv.DEV: {"iso-dev"}, AppEnv.PROD: {"iso-prod"}}
    finally:
        for w in workers:
            if w.alive():
                w.stop()
        for sub in subs:
            sub.close()

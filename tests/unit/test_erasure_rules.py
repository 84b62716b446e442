"""Per-user erasure, the pure parts: the digest and pseudonym of schemas/erasures.py, the
409 message, and the worker's rule for a trigger whose run an erasure deleted
(processors/runner.py over in-memory ports). The whole erasure against the real stack
is tests/e2e/test_erasure.py."""

from __future__ import annotations

import hashlib

from koda_runtime.gateway.erasure import RunsStillOpen
from koda_runtime.lifecycle.handler import CancelToken
from koda_runtime.naming import AppEnv
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.processors.runner import Record, RunExecutor
from koda_runtime.schemas.erasures import pseudonym, user_digest
from koda_runtime.settings import USER_ID, Settings
from koda_runtime.topics.records.codec import RUN_REQUESTED, RunRequested, headers_for
from tests.unit.worker_fakes import TOPIC, FakeOutput, FakeStore, ScriptedHandler

SETTINGS = Settings(app_env=AppEnv.DEV, worker_id="w-unit")


def test_the_digest_is_the_sha256_of_the_user_id() -> None:
    assert user_digest("alice") == hashlib.sha256(b"alice").hexdigest()
    assert len(user_digest("bob")) == 64 and user_digest("bob") != user_digest("alice")
    # A forged record's id with a lone surrogate still has a digest: nothing raises.
    assert len(user_digest("a\ud800b")) == 64


def test_the_pseudonym_is_stable_apart_from_the_digest_and_never_a_user_id() -> None:
    alias = pseudonym("alice")
    assert alias == pseudonym("alice")  # finance can sum an erased user's rows
    assert alias.startswith("erased:") and len(alias) == len("erased:") + 16
    assert alias != pseudonym("alice2")
    assert alias[len("erased:") :] not in user_digest("alice")
    assert USER_ID.fullmatch(alias) is None  # no token can ever log in as it


def test_runs_still_open_names_the_runs_and_how_many_more() -> None:
    runs = [(f"r{i}", "running") for i in range(7)]
    message = str(RunsStillOpen(runs, 30.0))
    assert "7 runs" in message and "r0 (running)" in message and "r4 (running)" in message
    assert "r5" not in message and "and 2 more" in message and "30 s" in message


def _record(run_id: str, user_id: str) -> Record:
    value = RunRequested(run_id, user_id, "s", "2026-01-01T00:00:00Z").encode()
    return Record(TOPIC, 0, 3, user_id.encode(), value, headers_for(RUN_REQUESTED))


async def test_a_trigger_of_an_erased_users_deleted_run_is_skipped_without_a_dead_letter() -> None:
    store = FakeStore()
    out = FakeOutput(store)
    writer = GroupWriter(store, fault=SETTINGS.test_fault)
    executor = RunExecutor(SETTINGS, store, out, ScriptedHandler(["never"]), writer)
    fence = store.own(0)
    store.erased_users.add("gone")
    try:
        await executor.process(_record("r-erased", "gone"), fence, CancelToken())
        assert out.letters() == [] and store.runs == {}  # nothing made, nothing kept
        # A run nobody erased that Postgres does not have is still a dead letter.
        await executor.process(_record("r-unknown", "someone"), fence, CancelToken())
        assert [letter["reason"] for letter in out.letters()] == ["unknown_run"]
        assert store.runs == {}
    finally:
        await executor.writer.close()

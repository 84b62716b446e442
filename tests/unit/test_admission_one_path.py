"""Admission's one path, without services: the single-run admit is a batch of one, the
scheduler's fires are a batch too, and the cancel writes its statuses along an edge of
the state machine. The statements themselves run against Postgres in
tests/integration/test_admission_batch.py, test_active_run_cap.py and test_schedules.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from koda_runtime.errors import DatabaseError, Refused, SessionNotOwned, TooManyActiveRuns
from koda_runtime.lifecycle.states import RunStatus, edge
from koda_runtime.schemas.runs import control
from koda_runtime.schemas.runs.admission import (
    ADMIT_ATTEMPTS,
    AdmittedRun,
    NewRun,
    RunAdmission,
)
from koda_runtime.topics.scheduled import admit_fires

AT = datetime(2030, 1, 1, tzinfo=UTC)


def new(key: str) -> NewRun:
    return NewRun(f"run-{key}", "alice", f"s-{key}", True, key, {"text": key}, None, 0)


def run(key: str, *, created: bool) -> AdmittedRun:
    return AdmittedRun(f"run-{key}", "alice", f"s-{key}", "pending", AT, created)


class Scripted(RunAdmission):
    """Answers each admit_batch call with the next scripted answers; records the calls."""

    def __init__(self, *answers: list[Any]) -> None:
        super().__init__(engine=None)  # type: ignore[arg-type]
        self.answers = list(answers)
        self.calls: list[tuple[list[NewRun], bool, int]] = []

    async def admit_batch(
        self, batch: list[NewRun], *, budgets: bool = True, max_active: int = 0
    ) -> list[Any]:
        self.calls.append((batch, budgets, max_active))
        return self.answers.pop(0)


async def test_a_single_admit_is_a_batch_of_one_with_the_same_rules() -> None:
    store = Scripted([run("k", created=True)])
    answer = await store.admit(new("k"), budgets=False, max_active=3)
    assert answer.created and answer.run_id == "run-k"
    ((batch, budgets, max_active),) = store.calls
    assert [r.idempotency_key for r in batch] == ["k"] and (budgets, max_active) == (False, 3)


@pytest.mark.parametrize(
    "refusal",
    [SessionNotOwned("session not found"), TooManyActiveRuns("alice", 2, 2)],
    ids=["session", "cap"],
)
async def test_a_single_admit_raises_its_batch_answer_refusal(refusal: Refused) -> None:
    with pytest.raises(type(refusal)):
        await Scripted([refusal]).admit(new("k"))


async def test_a_key_whose_run_keeps_vanishing_fails_after_bounded_tries() -> None:
    """Failure mode: a key conflicting with a run deleted since, again and again, must
    not loop: the admit gives up with a DatabaseError naming the tries."""
    store = Scripted(*([None] for _ in range(ADMIT_ATTEMPTS)))
    with pytest.raises(DatabaseError, match=f"after {ADMIT_ATTEMPTS} tries"):
        await store.admit(new("k"))
    assert len(store.calls) == ADMIT_ATTEMPTS


async def test_a_vanished_key_is_tried_again_and_then_answers() -> None:
    store = Scripted([None], [run("k", created=False)])
    assert (await store.admit(new("k"))).run_id == "run-k"
    assert len(store.calls) == 2


async def test_fires_are_one_batch_without_budgets_or_cap_and_keep_only_created_runs() -> None:
    """A fire whose key had a run (a replay) or that was refused is None: only the
    replica that created a run publishes it."""
    store = Scripted(
        [run("a", created=True), run("b", created=False), SessionNotOwned("gone"), None]
    )
    fired = await admit_fires(store, [new("a"), new("b"), new("c"), new("d")])
    assert [f is not None and f.run_id for f in fired] == ["run-a", False, False, False]
    ((_, budgets, max_active),) = store.calls
    assert (budgets, max_active) == (False, 0)


def test_the_cancel_of_a_pending_run_takes_the_state_machines_edge() -> None:
    assert control._CANCEL_NOW == (RunStatus.PENDING, RunStatus.CANCELLED)
    # The cancel requests the worker acts on: every other status with an edge into cancelled.
    assert control._CANCELLABLE == {RunStatus.RUNNING, RunStatus.STREAMING, RunStatus.WAITING}
    assert ":target" in str(control._CANCEL_PENDING) and ":source" in str(control._CANCEL_PENDING)


def test_an_edge_the_state_machine_lacks_is_refused_by_name() -> None:
    """Failure mode: a status write given a step the machine forbids (a terminal run
    cancelled) must not get as far as SQL."""
    with pytest.raises(ValueError, match="no edge done → cancelled"):
        edge(RunStatus.DONE, RunStatus.CANCELLED)

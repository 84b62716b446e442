"""A scheduled minute becomes a run: admitted through admission's one path, then published.

:func:`fire` turns a (schedule, minute) into a run with
:meth:`~koda_runtime.schemas.runs.admission.RunAdmission.admit`, the very insert
``POST /v1/runs`` makes (a batch of one), under the idempotency key
``sched:<schedule_id>:<UTC minute>`` (:func:`~koda_runtime.schemas.schedules.fire_key`):
``ON CONFLICT DO NOTHING`` is the arbiter, so any number of schedulers firing the same
minute create one run, and only the one that created it publishes it (keyed by user, like
the gateway). :func:`fire_many` does the same for a scheduler's batch with
:meth:`~koda_runtime.schemas.runs.admission.RunAdmission.admit_batch`, one transaction.

The cap on a user's active runs (KODA_MAX_ACTIVE_RUNS_PER_USER) refuses ``run-now``, a
person's request answered 429 like ``POST /v1/runs`` (which also takes a token of the
user's rate and checks the schedule's ``daily_cap``, gateway/schedules.py), but never
the scheduler's fires: the scheduler advances ``next_fire_at`` past every minute it
fired, so a refused fire would be lost. A cron fire is bounded by its schedule's own
policies instead (one minute at most, ``overlap`` skip by default, ``daily_cap``), and
its runs count toward the owner's cap for everything else the owner submits. Nor do the
scheduler's fires read budgets here: the scheduler skips a spent owner's minutes while
planning (:meth:`~koda_runtime.schemas.schedules.ScheduleStore.over_budget`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from koda_runtime import tracing
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.schemas.runs.admission import AdmittedRun, NewRun, RunAdmission
from koda_runtime.schemas.schedules import ScheduleRow, fire_key
from koda_runtime.topics.catalogue import partition_for_key
from koda_runtime.topics.kafka.publisher import Delivery, RunPublisher
from koda_runtime.topics.records.codec import RunRequested

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fired:
    """A fire's run; ``delivery`` is set when this call created and published it."""

    run: AdmittedRun
    delivery: asyncio.Future[Delivery] | None


def scheduled_run(
    schedule: ScheduleRow, minute: datetime, *, partitions: int, key: str | None = None
) -> NewRun:
    """The run a (schedule, minute) fires: the schedule's owner, input and session policy."""
    return NewRun(
        run_id=uuid7(),
        user_id=schedule.user_id,
        session_id=schedule.session_id or uuid7(),
        create_session=schedule.session_id is None,
        idempotency_key=key or fire_key(schedule.id, minute),
        input=schedule.input,
        metadata=None,
        partition=partition_for_key(schedule.user_id.encode(), partitions),
        schedule_id=schedule.id,
        scheduled_for=minute,
        traceparent=tracing.traceparent(),  # the scheduler's fire span, when tracing
    )


def publish_scheduled(
    publisher: RunPublisher, run: AdmittedRun, new: NewRun
) -> asyncio.Future[Delivery]:
    """Produce the run's ``run.requested`` record, keyed by user, with its schedule fields."""
    assert new.scheduled_for is not None
    return publisher.publish(
        RunRequested(
            run_id=run.run_id,
            user_id=run.user_id,
            session_id=run.session_id,
            created_at=run.created_at.isoformat(),
            schedule_id=new.schedule_id,
            scheduled_for=new.scheduled_for.astimezone(UTC).isoformat(),
        ),
        traceparent=new.traceparent,
    )


async def admit_fires(store: RunAdmission, batch: list[NewRun]) -> list[AdmittedRun | None]:
    """Admit a scheduler's fires in one transaction (no budget read, no cap): the i-th
    answer is ``batch[i]``'s created run, or None when its key had a run already (nothing
    of that fire is kept, not even its new session)."""
    answers = await store.admit_batch(batch, budgets=False)
    created: list[AdmittedRun | None] = []
    for answer, new in zip(answers, batch, strict=True):
        if isinstance(answer, AdmittedRun) and answer.created:
            created.append(answer)
            continue
        if answer is not None and not isinstance(answer, AdmittedRun):
            # A fixed session no longer the owner's: nothing was written for this minute.
            log.warning(
                "event=schedule_fire_refused schedule_id=%s scheduled_for=%s error=%s",
                new.schedule_id,
                None if new.scheduled_for is None else new.scheduled_for.isoformat(),
                answer,
            )
        created.append(None)
    return created


async def fire_many(
    store: RunAdmission, publisher: RunPublisher, batch: list[NewRun]
) -> list[Fired | None]:
    """:func:`fire` for many runs: :func:`admit_fires`, then a publish per created run in
    ``batch`` order (a user's minutes oldest first); None where the key had a run."""
    admitted = await admit_fires(store, batch)
    return [
        None if run is None else Fired(run, publish_scheduled(publisher, run, new))
        for run, new in zip(admitted, batch, strict=True)
    ]


async def fire(
    store: RunAdmission,
    publisher: RunPublisher,
    schedule: ScheduleRow,
    minute: datetime,
    *,
    partitions: int,
    key: str | None = None,
    budgets: bool = True,
    max_active: int = 0,
) -> Fired:
    """Create the run of ``schedule`` for ``minute`` (once, whoever else tries) and publish it.

    ``key`` defaults to :func:`fire_key`. Raises DatabaseError when Postgres fails,
    OverBudget when the owner's budget is spent and TooManyActiveRuns when the owner has
    ``max_active`` runs not yet ended (0: no cap); then nothing was written. A failed
    publish leaves the run pending for the sweeper.
    """
    new = scheduled_run(schedule, minute, partitions=partitions, key=key)
    run = await store.admit(new, budgets=budgets, max_active=max_active)
    if not run.created:
        return Fired(run, None)
    return Fired(run, publish_scheduled(publisher, run, new))

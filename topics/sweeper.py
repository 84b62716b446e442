"""Publish again the runs whose first publish was lost.

A run is written before it is produced. If the gateway dies in between, or the
broker does not acknowledge, the run stays ``pending`` with ``published_at``
NULL. Every ``sweep_interval_s`` each gateway claims a batch of such runs older
than ``sweep_after_s`` (``FOR UPDATE SKIP LOCKED``, so gateways never claim the
same run twice at once), produces them again, and releases the claim of those
that failed. A duplicate record is harmless: the worker's claim is a
conditional update on the run's status in Postgres. A scheduled run's record
carries its schedule and minute, as the scheduler's own publish does: the
warehouse replay reads them from whichever record reaches the topic. Every gateway and
every scheduler replica runs one.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC

from koda_runtime import metrics
from koda_runtime.errors import KodaError
from koda_runtime.schemas.runs.admission import RunAdmission
from koda_runtime.topics.kafka.publisher import RunPublisher
from koda_runtime.topics.records.codec import RunRequested

log = logging.getLogger(__name__)

BATCH = 500


class Sweeper:
    """Republishes stale unpublished pending runs; :meth:`sweep_once` is one pass."""

    def __init__(
        self,
        store: RunAdmission,
        publisher: RunPublisher,
        *,
        after_s: float,
        interval_s: float,
        batch: int = BATCH,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.after_s = after_s
        self.interval_s = interval_s
        self.batch = batch

    async def sweep_once(self) -> int:
        """Claim, publish and settle one batch; returns how many runs were delivered."""
        claimed = await self.store.claim_unpublished(self.after_s, self.batch)
        if not claimed:
            return 0
        futures = [
            self.publisher.publish(
                RunRequested(
                    run_id=run.run_id,
                    user_id=run.user_id,
                    session_id=run.session_id,
                    created_at=run.created_at.isoformat(),
                    schedule_id=run.schedule_id,
                    scheduled_for=(
                        None
                        if run.scheduled_for is None
                        else run.scheduled_for.astimezone(UTC).isoformat()
                    ),
                ),
                traceparent=run.traceparent,  # the run's trace goes on (koda/tracing.py)
            )
            for run in claimed
        ]
        delivered: list[str] = []
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
            for run, result in zip(claimed, results, strict=True):
                if isinstance(result, BaseException):
                    log.warning(
                        "event=republish_failed run_id=%s user_id=%s error=%s",
                        run.run_id,
                        run.user_id,
                        result,
                    )
                else:
                    delivered.append(run.run_id)
                    log.info(
                        "event=run_republished run_id=%s user_id=%s partition=%d offset=%d",
                        run.run_id,
                        run.user_id,
                        result.partition,
                        result.offset,
                    )
            await self.store.mark_published(delivered)
        finally:
            # Whatever was not acknowledged (failure, cancellation) must be swept again.
            done = set(delivered)
            failed = [run.run_id for run in claimed if run.run_id not in done]
            if failed:
                await asyncio.shield(self.store.release(failed))
        metrics.SWEEPER_REPUBLISHED.inc(len(delivered))
        return len(delivered)

    async def run_forever(self) -> None:
        """Sweep every ``interval_s`` until cancelled; a failed pass is logged, not fatal."""
        while True:
            try:
                count = await self.sweep_once()
                if count:
                    log.info("event=sweep_done republished=%d", count)
                    if count >= self.batch:
                        continue  # a full batch: there may be more right now
            except KodaError as exc:
                log.warning("event=sweep_failed error=%s", exc)
            except Exception:
                log.exception("event=sweep_failed")
            await asyncio.sleep(self.interval_s)

"""A background reader of ``<env>.koda.workers``, the heartbeat topic.

Both sides of the heartbeat read it: every gateway builds its worker table from the
beginning (``GET /admin/workers``), and every worker watches, from the end, for beats
under its own id that another process sent. Both read through the no-group tail
(topics/kafka/tail.py): neither joins a consumer group or commits, and the tail keeps
its position across a lost connection, so a record is handed over once per reader.
``apply`` gets the record's key, value and offset on the event loop (offsets order the
records of one key: the topic keeps a key on one partition).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import WORKERS
from koda_runtime.topics.kafka.tail import TailEvents, TopicTail

ApplyFn = Callable[[bytes | None, bytes | None, int], None]
Record = tuple[bytes | None, bytes | None, int]

EVENTS = TailEvents(
    error="workers_tail_failed",
    restart="workers_tail_failed",
    not_ready="workers_tail_not_ready",
    partitions_added="workers_tail_partitions_added",
)
# The workers topic has few partitions and rarely grows.
DISCOVERY_INTERVAL_S = 30.0


def worker_log_tail(
    settings: Settings,
    role: str,
    apply: ApplyFn,
    *,
    start: Literal["beginning", "end"],
) -> TopicTail[Record]:
    """A tail of the workers topic handing every record to ``apply``, from ``start``:
    ``"beginning"`` (everything the compacted topic still holds) or ``"end"`` (only
    records produced from now on). Start it with ``.start()``, stop it with
    ``await .stop()``."""

    def route(messages: list[Any]) -> list[Record]:
        return [(m.key(), m.value(), m.offset()) for m in messages]

    def deliver(records: list[Record]) -> None:
        for key, value, offset in records:
            apply(key, value, offset)

    return TopicTail(
        settings,
        f"{role}-workers-tail",
        settings.names.topic(WORKERS),
        start=start,
        route=route,
        deliver=deliver,
        events=EVENTS,
        discovery_interval_s=DISCOVERY_INTERVAL_S,
    )

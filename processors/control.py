"""Steering runs in flight: the control board and the run-control listener.

The gateway makes a cancel request or a merge durable in Postgres first, then
produces a ``run.control`` record (key user_id) to ``<env>.koda.run-control``. Every
worker tails every partition of that topic *without a consumer group* (from its end
at start-up) and acts only on runs it is executing right now: the volume is one
record per cancel or merge, so reading all partitions costs nothing, and no
assignment has to follow the runs topic's through a rebalance (a second topic in the
group would be co-partitioned only by an assignor that Faust does not use here).

A run that waits for a person (``waiting``, processors/tools/) executes nowhere; the
worker holding its partition parks its record (:meth:`ControlBoard.park`) and any
control record of the run wakes it to look at the row again: the gateway's approve and
reject send a ``merge`` record with the run's unchanged input version (a no-op for a
run in flight), a cancel its ``cancel`` record.

The record is only a wake-up. A worker that misses it (it was draining, the
partition moved, the worker died) is covered by Postgres: every chunk write tells
the board what the row says (``RunStore.observer``), the finish refuses to end a
run that was cancelled or whose input changed, and the next claim sees the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from koda_runtime import tracing
from koda_runtime.lifecycle.control import CANCEL, MERGE, ControlRecord, decode_control
from koda_runtime.lifecycle.handler import CancelToken
from koda_runtime.schemas.runs.worker import RunSteer
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CONTROL
from koda_runtime.topics.kafka.tail import TailEvents, TopicTail
from koda_runtime.topics.records.codec import header_value

log = logging.getLogger("koda.worker")

EVENTS = TailEvents(
    error="run_control_tail_error",
    restart="run_control_tail_restart",
    not_ready="run_control_tail_not_ready",
    partitions_added="run_control_partitions_added",
)
# value, partition, offset, and the traceparent header (koda/tracing.py) or None
Record = tuple[bytes | None, int, int, bytes | None]
# The catalogue fixes run-control's partition count (`koda topics check` verifies it).
DISCOVERY_INTERVAL_S = 30.0


@dataclass
class RunControl:
    """The steering state of one run this worker executes.

    ``token`` is the current attempt's (handed to the handler); a stop fires it and
    every ``on_stop`` callback once. ``cancel_reason`` set: end the run cancelled.
    ``input_version`` above the attempt's: run again on the merged input.
    """

    run_id: str
    attempt_version: int = 0
    input_version: int = 0
    cancel_requested: bool = False
    cancel_reason: str | None = None
    token: CancelToken = field(default_factory=CancelToken)
    _callbacks: list[Callable[[], None]] = field(default_factory=list)

    @property
    def stopping(self) -> bool:
        return self.cancel_requested or self.input_version > self.attempt_version

    def begin(self, input_version: int) -> CancelToken:
        """A new attempt on ``input_version``: a fresh token, no callbacks."""
        self.attempt_version = input_version
        self.input_version = max(self.input_version, input_version)
        self.token = CancelToken()
        self._callbacks = []
        return self.token

    def on_stop(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)
        if self.stopping:
            callback()

    def cancel(self, reason: str | None) -> None:
        if self.cancel_requested:
            return
        self.cancel_requested = True
        self.cancel_reason = reason
        self._stop("cancelled")

    def merged(self, version: int) -> None:
        if version <= self.input_version:
            return
        self.input_version = version
        if not self.cancel_requested:
            self._stop("merged")

    def _stop(self, why: str) -> None:
        self.token.cancel(why)
        for callback in self._callbacks:
            callback()


class ControlBoard:
    """The runs this worker executes, by id, for the listener and the store observer."""

    def __init__(self) -> None:
        self.runs: dict[str, RunControl] = {}
        self.delivered = 0  # control records acted on (tests and metrics read it)
        # Runs waiting for a person whose record this worker holds: set to wake them.
        self.parked: dict[str, asyncio.Event] = {}

    def park(self, run_id: str) -> asyncio.Event:
        """The event a control record of ``run_id`` sets (until :meth:`unpark`)."""
        event = self.parked.get(run_id)
        if event is None:
            event = self.parked[run_id] = asyncio.Event()
        return event

    def unpark(self, run_id: str, event: asyncio.Event) -> None:
        if self.parked.get(run_id) is event:
            del self.parked[run_id]

    def open(self, run_id: str) -> RunControl:
        control = self.runs.get(run_id)
        if control is None:
            control = self.runs[run_id] = RunControl(run_id)
        return control

    def close(self, run_id: str) -> None:
        self.runs.pop(run_id, None)

    def deliver(self, record: ControlRecord) -> bool:
        """Act on ``record`` if the run executes (or waits) here; True if it did."""
        waiting = self.parked.get(record.run_id)
        if waiting is not None:
            waiting.set()
            self.delivered += 1
            return True
        control = self.runs.get(record.run_id)
        if control is None:
            return False
        self.delivered += 1
        if record.action == CANCEL:
            control.cancel(record.reason)
        elif record.action == MERGE:
            control.merged(record.input_version)
        return True

    def observe(self, run_id: str, steer: RunSteer) -> None:
        """A fenced write saw the row: the fallback for a control record never read."""
        control = self.runs.get(run_id)
        if control is None:
            return
        if steer.cancel_requested:
            control.cancel(steer.cancel_reason)
        else:
            control.merged(steer.input_version)


class ControlListener:
    """Tails every partition of the run-control topic (the no-group tail, from its end)
    and hands records to the board, on the event loop."""

    def __init__(self, settings: Settings, board: ControlBoard) -> None:
        self.board = board
        self.topic = settings.names.topic(RUN_CONTROL)
        self._tail: TopicTail[Record] = TopicTail(
            settings,
            "control-tail",
            self.topic,
            start="end",
            route=lambda messages: [
                (m.value(), m.partition(), m.offset(), header_value(m.headers(), tracing.HEADER))
                for m in messages
            ],
            deliver=self._deliver,
            events=EVENTS,
            discovery_interval_s=DISCOVERY_INTERVAL_S,
            on_ready=self._ready,
        )

    async def start(self) -> None:
        self._tail.start()

    async def stop(self) -> None:
        await self._tail.stop()

    @staticmethod
    def _ready(partitions: int) -> None:
        # Positioned at the end: records from here on are acted on.
        log.info("run-control tail started partitions=%d", partitions)

    def _deliver(self, records: list[Record]) -> None:
        for value, partition, offset, trace in records:
            with tracing.span("koda.control", parent=trace) as span:
                self._handle(value, partition, offset)
                if span.is_recording():
                    span.set_attributes({"messaging.kafka.offset": offset})

    def _handle(self, value: bytes | None, partition: int, offset: int) -> None:
        record = decode_control(value)
        if record is None:
            log.warning(
                "run-control record ignored: not a control record partition=%d offset=%d",
                partition,
                offset,
            )
            return
        if self.board.deliver(record):
            log.info("run-control %s run_id=%s", record.action, record.run_id)

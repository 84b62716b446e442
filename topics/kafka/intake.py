"""The runs topic's group consumer: librdkafka on an incremental rebalance protocol.

aiokafka (and Faust over it) speaks only Kafka's eager protocol: every rebalance revokes
every partition from every member, so every run in flight anywhere is drained and cut
at every join or leave. This consumer joins the workers' group through librdkafka with
either

* ``consumer``: the consumer group protocol of KIP-848 (Kafka 4.0+). The broker computes
  the assignment (its ``uniform`` assignor is sticky) and tells each member only what it
  gains or loses; a member that keeps its partitions is never interrupted. Or
* ``classic``: the classic protocol with the ``cooperative-sticky`` assignor (KIP-429),
  for older brokers: also incremental, with one extra rebalance round per change.

Threading: librdkafka runs in a thread of its own (``koda-intake``) that polls and hands
batches of records to the event loop. Every call on the consumer runs in that thread:
confluent-kafka serialises a consumer's calls, and a call from another thread waits
behind the polling loop's, unfairly, for as long as the loop keeps polling (seen here:
``position()`` from the event loop blocked for good). The loop's side queues its calls
(commit, seek, pause, resume, position) and the thread runs them between polls, and
while it waits for a rebalance hook, so a hook can commit.

Rebalance callbacks are served in that thread; each runs its coroutine on the loop and
*waits* for it, so a revoke returns to librdkafka only after the hook has drained and
committed the partitions: the next owner
is given a partition only once its old owner let it go. Records fetched before a
callback are delivered to the loop before the callback's coroutine runs (both go
through ``call_soon_threadsafe``, in order).

Offset commits: a commit from the loop is handed to librdkafka asynchronously and its
answer comes back through ``on_commit``, served by the polls; the loop waits for it at
most :data:`COMMIT_ANSWER_S`. librdkafka holds a commit for as long as the group has no
coordinator (a broker restarting, a network cut), and a synchronous one would hold the
polling thread with it: past ``max.poll.interval.ms`` the member leaves the group, and
every later call from the loop (the final commit of a SIGTERM among them) waits for
good. Only inside a rebalance callback is a commit synchronous, because the partition
must not move before it is done; a callback starting answers every commit still
waiting with "not confirmed", and their offsets are sent again, after them: librdkafka
sends a group's commits in the order they were made.

Every record carries its partition's *assignment number* at the time it was fetched: a
counter bumped each time the partition is assigned to this consumer, so the loop can
tell a record of the current assignment from one of an earlier one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from itertools import count
from typing import Any, Protocol

from confluent_kafka import (
    OFFSET_INVALID,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from koda_runtime import metrics
from koda_runtime.errors import KodaError
from koda_runtime.kafka import runs_consumer_config
from koda_runtime.settings import Settings
from koda_runtime.topics.kafka.tail import LoopFeed

log = logging.getLogger("koda.worker")

# How long a poll waits for a first record; it returns at once when one is there.
POLL_S = 0.1
MAX_BATCH = 200
# Batches handed to the loop and not yet taken: above this the thread waits.
MAX_PENDING_BATCHES = 8
RESTART_BACKOFF_MAX_S = 10.0
ERROR_LOG_INTERVAL_S = 10.0
# How often the thread looks for queued calls while a rebalance hook runs.
HOOK_WAIT_S = 0.005
# How long the loop waits for the broker's answer to an offset commit; past it the
# commit counts as not confirmed and the next flush sends the offsets again.
COMMIT_ANSWER_S = 5.0
# librdkafka's statistics: the group state (readiness of an idle member) and whether
# any broker connection is up (a member that reaches none for long is rebuilt).
STATS_INTERVAL_MS = 5_000
# A member none of whose broker connections has been up for this long is closed and
# built again (see RunsIntake): longer than the group's session timeout, so the group
# has already let it go, and than a broker's usual restart.
REBUILD_AFTER_S = 30.0

Call = Callable[[Consumer], Any]
Offsets = tuple[tuple[int, int], ...]


class MemberStalled(KodaError, RuntimeError):
    """The runs consumer has had no broker connection up for ``rebuild_after_s``."""


class CommitAbandoned(KodaError):
    """A commit whose answer the loop stopped waiting for: a rebalance callback began
    (the callback's own commit sends the offsets again) or the consumer closed."""


@dataclass(frozen=True)
class Fetched:
    """One record of the runs topic as fetched: ``generation`` is its partition's
    assignment number at fetch time."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Any
    generation: int
    # When the record was written (unix seconds; 0.0 when the broker gave no timestamp).
    created: float = 0.0


class RebalanceHooks(Protocol):
    """What the worker does when partitions come and go; each runs on the event loop."""

    async def assigned(self, partitions: list[int]) -> None: ...

    async def revoked(self, partitions: list[int]) -> None: ...

    async def lost(self, partitions: list[int]) -> None: ...


class RunsIntake:
    """The worker's member of the workers' group on the runs topic.

    ``deliver(batch)`` runs on the loop for every fetched batch; ``hooks`` follow the
    assignment. :meth:`commit`, :meth:`seek`, :meth:`pause`, :meth:`resume` and
    :meth:`position` are for the loop's side.

    **A member that lost every broker is rebuilt.** After a restart of the only broker,
    a chaos run left two workers' runs consumers without a single connection attempt
    for minutes (librdkafka logged nothing more for them, and their commits waited for
    a coordinator for ever) while every other client of the same processes reconnected
    at once. librdkafka's statistics (every ``STATS_INTERVAL_MS``) name the brokers and
    the state of each connection; once none has been up for ``rebuild_after_s`` the
    member is closed (its partitions go through the revoke hook, as on any close) and
    built again, to rejoin the group. The group had let it go long before (the session
    timeout is shorter), so nothing is taken from a live member.
    ``rebuilds`` counts them.
    """

    def __init__(
        self,
        settings: Settings,
        topic: str,
        group: str,
        *,
        deliver: Callable[[list[Fetched]], None],
        hooks: RebalanceHooks,
        on_joined: Callable[[], None] | None = None,
        config: dict[str, Any] | None = None,
        rebuild_after_s: float = REBUILD_AFTER_S,
        poll_s: float = POLL_S,
    ) -> None:
        self.topic = topic
        self.poll_s = poll_s
        self.rebuild_after_s = rebuild_after_s
        self.rebuilds = 0
        # Thread-only: consecutive statistics reports that showed no broker connection up
        # (counted in reports, not in time: a thread held by a long rebalance hook serves
        # no statistics, and must not mistake that for an outage).
        self._unconnected_reports = 0
        self.group = group
        self.protocol = settings.group_protocol
        self._config = runs_consumer_config(settings, group) | (config or {})
        self._stats_interval_ms = int(self._config.get("statistics.interval.ms", STATS_INTERVAL_MS))
        self._hooks = hooks
        self._hook_timeout_s = settings.rebalance_timeout_s + 30.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stopped = asyncio.Event()
        self._consumer: Consumer | None = None  # the thread's own
        self._calls: queue.SimpleQueue[tuple[Call, concurrent.futures.Future[Any] | None]] = (
            queue.SimpleQueue()
        )
        self._feed = LoopFeed(deliver, MAX_PENDING_BATCHES, self._stopping)
        self._numbers = count(1)
        # Written by the thread inside the rebalance callbacks (while the loop runs the
        # hook and the thread waits for it), read by the loop.
        self.generations: dict[int, int] = {}
        self._last_error_log = 0.0
        # Thread-only: asynchronous commits waiting for ``on_commit``, by their offsets,
        # and whether a rebalance callback is running (its commits are synchronous).
        self._answers: dict[Offsets, deque[concurrent.futures.Future[Any]]] = {}
        self._in_callback = False
        self._on_joined = on_joined
        self._subscribed_at: float | None = None
        # A member the group gives nothing is never called back (no assign of an empty
        # list): it counts as joined once librdkafka reports the group coordinator up
        # for longer than two heartbeats since it subscribed (``_on_stats``).
        self._joined_after_s = 2 * settings.heartbeat_interval_s
        self.joined = threading.Event()

    # --- the event loop's side ----------------------------------------------------

    def start(self) -> None:
        """Start the thread; it connects and joins the group in the background."""
        if self._thread is not None:
            return
        self._loop = self._feed.loop = asyncio.get_running_loop()
        self._stopping.clear()
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name="koda-intake", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float = 60.0) -> None:
        """Leave the group (the revoke hook runs for what is still assigned), close."""
        self._stopping.set()
        self._feed.release()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        # The thread's last callbacks run their hooks on this loop: never block it.
        try:
            await asyncio.wait_for(self._stopped.wait(), timeout_s)
        except TimeoutError:
            log.warning("event=intake_close_timeout waited_s=%.0f", timeout_s)

    def generation(self, partition: int) -> int | None:
        """The partition's current assignment number; None if it is not assigned."""
        return self.generations.get(partition)

    async def _call(self, fn: Call) -> Any:
        """Run ``fn(consumer)`` in the intake's thread and wait for its result."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((fn, future))
        return await asyncio.wrap_future(future)

    def _send(self, fn: Call) -> None:
        """Run ``fn(consumer)`` in the intake's thread; nobody waits for it."""
        self._calls.put((fn, None))

    async def commit(self, offsets: dict[int, int], metadata: dict[int, str] | None = None) -> bool:
        """Commit ``offsets`` (partition → next offset to read), each with its
        ``metadata`` string if given, and wait for the broker's answer; False (logged)
        if it refused (e.g. the partition was taken away), or did not answer within
        :data:`COMMIT_ANSWER_S`. In a rebalance callback's hook the commit is
        synchronous: it is done when this returns."""
        if not offsets:
            return True
        md = metadata or {}
        tps = [
            TopicPartition(self.topic, p, o, metadata=md[p])
            if md.get(p)
            else TopicPartition(self.topic, p, o)
            for p, o in sorted(offsets.items())
        ]
        try:
            sent = await self._call(lambda c: self._send_commit(c, tps))
            if isinstance(sent, concurrent.futures.Future):
                result = await asyncio.wait_for(asyncio.wrap_future(sent), COMMIT_ANSWER_S)
            else:
                result = sent
        except TimeoutError:
            log.warning(
                "event=commit_unanswered offsets=%s waited_s=%.0f", offsets, COMMIT_ANSWER_S
            )
            return False
        except Exception as exc:  # noqa: BLE001 - the work is durable; a later commit covers it
            log.warning("event=commit_failed offsets=%s error=%s", offsets, exc)
            return False
        failed = [tp for tp in result or [] if tp.error is not None]
        if failed:
            log.warning(
                "event=commit_failed partitions=%s error=%s",
                [tp.partition for tp in failed],
                failed[0].error,
            )
            return False
        return True

    async def seek(self, partition: int, offset: int) -> None:
        tp = TopicPartition(self.topic, partition, offset)
        await self._call(lambda c: c.seek(tp))

    def pause(self, partition: int) -> None:
        """Stop fetching ``partition`` for its current assignment only.

        librdkafka keeps an application's pause on a partition after it is revoked, and
        a later assignment of it to this member would start paused, with nothing left
        to resume it: its runs would wait for good. So a pause that reaches the thread
        after its assignment ended is dropped, and every partition leaving this member
        is resumed on its way out (:meth:`_let_go`)."""
        tp = TopicPartition(self.topic, partition)
        generation = self.generations.get(partition)

        def pause(c: Consumer) -> None:
            if generation is not None and self.generations.get(partition) == generation:
                c.pause([tp])

        self._send(pause)

    def resume(self, partition: int) -> None:
        tp = TopicPartition(self.topic, partition)
        self._send(lambda c: c.resume([tp]))

    async def positions(self, partitions: list[int]) -> dict[int, int | None]:
        """The offsets the consumer fetches next for ``partitions`` (None: not known)."""
        tps = [TopicPartition(self.topic, p) for p in partitions]
        found = await self._call(lambda c: c.position(tps))
        return {
            tp.partition: None if tp.offset == OFFSET_INVALID or tp.offset < 0 else int(tp.offset)
            for tp in found
        }

    # --- the intake's thread --------------------------------------------------------

    def _send_commit(
        self, consumer: Consumer, tps: list[TopicPartition]
    ) -> list[TopicPartition] | concurrent.futures.Future[Any]:
        """In a rebalance callback: commit synchronously, the result. Elsewhere: hand the
        commit to librdkafka, a future of its answer (see :meth:`_on_commit`)."""
        if self._in_callback:
            return consumer.commit(offsets=tps, asynchronous=False)
        key = _offsets(tps)
        answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
        waiting = self._answers.setdefault(key, deque())
        waiting.append(answer)
        try:
            consumer.commit(offsets=tps, asynchronous=True)
        except Exception:
            waiting.remove(answer)
            if not waiting:
                del self._answers[key]
            raise
        return answer

    def _on_commit(self, err: Any, tps: list[TopicPartition]) -> None:
        """librdkafka's answer to a commit (served by a poll): to the oldest commit of
        the same offsets still waiting. Answers nobody waits for are dropped."""
        key = _offsets(tps)
        waiting = self._answers.get(key)
        while waiting:
            answer = waiting.popleft()
            try:
                if err is not None:
                    answer.set_exception(KafkaException(err))
                else:
                    answer.set_result(tps)
            except concurrent.futures.InvalidStateError:
                continue  # the loop stopped waiting for this one
            break
        if waiting is not None and not waiting:
            del self._answers[key]

    def _abandon_commits(self, why: str) -> None:
        """Answer every commit still waiting with :class:`CommitAbandoned`."""
        answers, self._answers = self._answers, {}
        for waiting in answers.values():
            for answer in waiting:
                try:
                    answer.set_exception(CommitAbandoned(why))
                except concurrent.futures.InvalidStateError:
                    pass

    def _run(self) -> None:
        backoff = 0.5
        try:
            while not self._stopping.is_set():
                try:
                    self._member()
                    backoff = 0.5
                except Exception as exc:  # noqa: BLE001 - the member must outlive any error
                    log.warning("event=intake_restart error=%s", exc)
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
        finally:
            self._signal_stopped()

    def _run_calls(self, consumer: Consumer | None) -> None:
        """Run the loop's queued calls (in this thread); without a consumer, fail them."""
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                if consumer is None:
                    raise RuntimeError("the runs consumer is not running")
                result = fn(consumer)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                if future is None:
                    log.warning("event=intake_call_failed error=%s", exc)
                else:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(result)

    def _member(self) -> None:
        consumer = Consumer(
            self._config
            | {"error_cb": self._on_error, "stats_cb": self._on_stats}
            | {"on_commit": self._on_commit}
            | {"statistics.interval.ms": self._stats_interval_ms}
        )
        self._consumer = consumer
        self._subscribed_at = time.monotonic()
        self._unconnected_reports = 0
        try:
            consumer.subscribe(
                [self.topic],
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            log.info(
                "event=intake_subscribed topic=%s group=%s protocol=%s",
                self.topic,
                self.group,
                self.protocol,
            )
            while not self._stopping.is_set():
                self._run_calls(consumer)
                unconnected_s = self._unconnected_reports * self._stats_interval_ms / 1000
                if unconnected_s >= self.rebuild_after_s:
                    self.rebuilds += 1
                    metrics.KAFKA_CLIENTS_REBUILT.labels(client="runs").inc()
                    raise MemberStalled(
                        f"no broker connection up for {self.rebuild_after_s:.0f} s: "
                        "closing the runs consumer to build it again"
                    )
                # poll() returns at the first record; what else is queued is taken with
                # it. consume(n, timeout) waits out its whole timeout unless n records
                # arrive, which held every run of a quiet partition up to POLL_S before
                # it started (half of a lone run's time to first chunk, measured).
                first = consumer.poll(self.poll_s)
                messages = [] if first is None else [first, *consumer.consume(MAX_BATCH - 1, 0)]
                batch = []
                for m in messages:
                    err = m.error()
                    if err is not None:
                        self._on_error(err)
                        continue
                    partition = m.partition() or 0
                    batch.append(
                        Fetched(
                            self.topic,
                            partition,
                            m.offset() or 0,
                            m.key(),
                            m.value(),
                            m.headers(),
                            self.generations.get(partition, 0),
                            _created(m),
                        )
                    )
                if batch:
                    self._feed.hand_over(batch)
        finally:
            # Leaving the group runs the revoke callback (and its hook) for what is left.
            try:
                consumer.close()
            except Exception as exc:  # noqa: BLE001 - closing a broken consumer
                log.warning("event=intake_close_error error=%s", exc)
            self._consumer = None
            self.generations.clear()
            self._abandon_commits("the runs consumer closed")
            self._run_calls(None)

    def _partitions(self, tps: list[TopicPartition]) -> list[int]:
        return sorted(tp.partition for tp in tps if tp.topic == self.topic)

    def _on_assign(self, consumer: Consumer, tps: list[TopicPartition]) -> None:
        partitions = self._partitions(tps)
        for p in partitions:
            self.generations[p] = next(self._numbers)
        self._joined()
        self._call_hook(self._hooks.assigned, partitions)

    def _joined(self) -> None:
        if self.joined.is_set():
            return
        self.joined.set()
        loop = self._loop
        if self._on_joined is None or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_joined)
        except RuntimeError:
            pass  # the loop closed under us: the owner is stopping

    def _on_stats(self, raw: str) -> None:
        try:
            stats = json.loads(raw)
        except ValueError:
            return
        self._unconnected_reports = 0 if broker_up(stats) else self._unconnected_reports + 1
        if self.joined.is_set() or self._subscribed_at is None:
            return
        state = stats.get("cgrp", {}).get("state")
        if state == "up" and time.monotonic() - self._subscribed_at > self._joined_after_s:
            self._joined()

    def _on_revoke(self, consumer: Consumer, tps: list[TopicPartition]) -> None:
        self._let_go(consumer, self._hooks.revoked, tps)

    def _on_lost(self, consumer: Consumer, tps: list[TopicPartition]) -> None:
        self._let_go(consumer, self._hooks.lost, tps)

    def _let_go(
        self,
        consumer: Consumer,
        hook: Callable[[list[int]], Awaitable[None]],
        tps: list[TopicPartition],
    ) -> None:
        """Partitions leaving this member (revoked or lost): the hook, then forget them."""
        partitions = self._partitions(tps)
        try:
            self._call_hook(hook, partitions)
        finally:
            for p in partitions:
                self.generations.pop(p, None)
            self._unpause(consumer, tps)

    def _unpause(self, consumer: Consumer, tps: list[TopicPartition]) -> None:
        """Clear any pause of partitions leaving this member (see :meth:`pause`)."""
        mine = [TopicPartition(self.topic, tp.partition) for tp in tps if tp.topic == self.topic]
        if not mine:
            return
        try:
            consumer.resume(mine)
        except Exception as exc:  # noqa: BLE001 - a partition librdkafka no longer knows
            log.warning(
                "event=intake_unpause_failed partitions=%s error=%s",
                [tp.partition for tp in mine],
                exc,
            )

    def _call_hook(
        self, hook: Callable[[list[int]], Awaitable[None]], partitions: list[int]
    ) -> None:
        """Run ``hook(partitions)`` on the loop and wait for it (in the thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        async def call() -> None:
            await hook(partitions)

        # No poll serves a commit's answer before the callback returns: the hook's
        # commits are synchronous, and those still unanswered count as not confirmed
        # (sent again: by the hook's own commit for what it lets go, by the next flush
        # for the rest).
        self._in_callback = True
        self._abandon_commits("a rebalance began")
        coro: Coroutine[Any, Any, None] = call()
        try:
            future = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:
            coro.close()
            self._in_callback = False
            return  # the loop is gone: the process is ending
        deadline = time.monotonic() + self._hook_timeout_s
        try:
            while True:
                # The hook may commit or seek: its calls run here, in this thread.
                self._run_calls(self._consumer)
                try:
                    future.result(HOOK_WAIT_S)
                    return
                except concurrent.futures.TimeoutError:
                    if time.monotonic() > deadline:
                        raise
        except Exception:  # noqa: BLE001 - librdkafka must get its callback back
            log.exception("event=rebalance_hook_failed partitions=%s", partitions)
        finally:
            self._in_callback = False

    def _signal_stopped(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._stopped.set)
        except RuntimeError:
            pass

    def _on_error(self, err: Any) -> None:
        if isinstance(err, KafkaError) and err.fatal():
            raise RuntimeError(f"fatal consumer error: {err.str()}")
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            text = err.str() if isinstance(err, KafkaError) else str(err)
            log.warning("event=intake_error topic=%s error=%s", self.topic, text)


def _created(m: Any) -> float:
    """A message's timestamp in unix seconds, 0.0 when it has none."""
    kind, ms = m.timestamp()
    return ms / 1000.0 if kind != TIMESTAMP_NOT_AVAILABLE and ms > 0 else 0.0


def _offsets(tps: list[TopicPartition]) -> Offsets:
    return tuple(sorted((tp.partition, int(tp.offset)) for tp in tps))


def broker_up(stats: dict[str, Any]) -> bool:
    """Whether librdkafka's statistics show a broker connection in state UP (the
    client's internal pseudo-broker does not count)."""
    return any(
        isinstance(b, dict)
        and b.get("state") == "UP"
        and not str(b.get("name", "")).endswith("/internal")
        for b in (stats.get("brokers") or {}).values()
    )

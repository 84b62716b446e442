"""The bounded reader's poll (topics/kafka/bounded.py) over a scripted consumer.

A poll whose records all lie inside open partitions, below their ends, is taken whole
without a look at each record; anything else (an error, a partition's end, a record at
or past the end, a partition already done) goes through the per-record loop. Both ways
must leave the same records and the same positions. Failure mode: the whole-poll check
letting through a record past the end, or of a partition already closed.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, Message, TopicPartition

from koda_runtime.topics.kafka.bounded import TP, BoundedReader

A, B = ("t", 0), ("t", 1)


class ScriptedConsumer:
    """Hands out the scripted polls in turn; remembers what was paused."""

    def __init__(self, polls: list[list[Message]]) -> None:
        self.polls = polls
        self.paused: list[TP] = []

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        return self.polls.pop(0) if self.polls else []

    def assign(self, partitions: list[TopicPartition]) -> None:
        pass

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused += [(p.topic, p.partition) for p in partitions]


def reader(polls: list[list[Message]], starts: dict[TP, int], ends: Any) -> BoundedReader:
    r = BoundedReader.__new__(BoundedReader)
    r.read_error_event, r.bootstrap, r.group, r.timeout_s = "read_error", "scripted", "g", 1.0
    r.consumer = ScriptedConsumer(polls)  # type: ignore[assignment]
    r.assign(starts, ends)
    return r


def rec(tp: TP, offset: int) -> Message:
    return Message(topic=tp[0], partition=tp[1], offset=offset, key=b"k", value=b"v")


def eof(tp: TP, offset: int) -> Message:
    return Message(
        topic=tp[0], partition=tp[1], offset=offset, error=KafkaError(KafkaError._PARTITION_EOF)
    )


def offsets(msgs: list[Message]) -> list[tuple[object, object]]:
    return [((m.topic(), m.partition()), m.offset()) for m in msgs]


def test_a_poll_inside_the_bounds_is_taken_whole_and_moves_the_positions() -> None:
    poll = [rec(A, 0), rec(B, 5), rec(A, 1), rec(B, 6)]
    r = reader([poll], {A: 0, B: 5}, {A: 10, B: 10})
    got = r.poll(100, 0.1)
    assert got is poll  # the consumer's own list, nothing copied
    assert r.positions == {A: 2, B: 7} and r.open == {A, B}


@pytest.mark.parametrize(
    ("poll", "kept", "positions", "still_open"),
    [
        # the last record before the end closes the partition
        ([rec(A, 0), rec(A, 1), rec(B, 0)], [(A, 0), (A, 1), (B, 0)], {A: 2, B: 1}, {B}),
        # a record at the end (fetched ahead) is dropped, and closes the partition
        ([rec(A, 1), rec(A, 2), rec(B, 0)], [(A, 1), (B, 0)], {A: 2, B: 1}, {B}),
        # the partition's end reported by the consumer
        ([rec(B, 0), eof(A, 2)], [(B, 0)], {A: 2, B: 1}, {B}),
    ],
)
def test_records_at_the_end_or_an_error_go_through_the_per_record_loop(
    poll: list[Message], kept: list[tuple[TP, int]], positions: dict[TP, int], still_open: set[TP]
) -> None:
    r = reader([poll], {A: 0, B: 0}, {A: 2, B: 10})
    assert offsets(r.poll(100, 0.1)) == kept
    assert r.positions == positions and r.open == still_open
    assert A in r.consumer.paused  # type: ignore[attr-defined]


def test_an_error_in_a_poll_is_never_handed_out_as_a_record() -> None:
    broken = Message(
        topic=A[0], partition=A[1], offset=-1001, error=KafkaError(KafkaError._TRANSPORT)
    )
    r = reader([[rec(A, 0), broken, rec(A, 1)]], {A: 0}, {A: 10})
    assert offsets(r.poll(100, 0.1)) == [(A, 0), (A, 1)]  # the error is logged, not kept
    assert r.positions == {A: 2}


def test_a_partition_already_done_gets_nothing_more() -> None:
    r = reader([[rec(A, 0), rec(A, 1)], [rec(A, 1), rec(B, 3)]], {A: 0, B: 3}, {A: 2, B: 9})
    assert offsets(r.poll(100, 0.1)) == [(A, 0), (A, 1)]
    assert r.open == {B}
    assert offsets(r.poll(100, 0.1)) == [(B, 3)]  # A's record fetched before it closed
    assert r.positions == {A: 2, B: 4}


def test_an_unbounded_read_takes_every_record() -> None:
    poll = [rec(A, 100), rec(A, 101)]
    r = reader([poll], {A: 100}, None)
    assert r.poll(100, 0.1) is poll and r.positions == {A: 102} and r.open == {A}

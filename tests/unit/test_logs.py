"""Repeated Kafka client lines are held back; everything else passes untouched."""

from __future__ import annotations

import logging

from koda_runtime.logs import RepeatFilter


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def record(name: str, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


def test_a_reconnect_storm_becomes_one_line_per_window() -> None:
    clock = Clock()
    f = RepeatFilter(("aiokafka",), window_s=10.0, clock=clock)
    template = "Unable connect to node with id %s: %s"
    passed = []
    for i in range(100):  # ten a second for ten seconds
        clock.now = i / 10
        r = record("aiokafka.conn", template, 1, f"refused {i}")
        if f.filter(r):
            passed.append(r.getMessage())
    clock.now = 10.5
    r = record("aiokafka.conn", template, 1, "refused again")
    assert f.filter(r)
    passed.append(r.getMessage())
    assert passed == [
        "Unable connect to node with id 1: refused 0",
        "Unable connect to node with id 1: refused again (99 similar lines held back)",
    ]


def test_other_templates_and_loggers_pass() -> None:
    clock = Clock()
    f = RepeatFilter(("aiokafka",), clock=clock)
    assert f.filter(record("aiokafka.conn", "a %s", 1))
    assert f.filter(record("aiokafka.conn", "b %s", 1))  # another template
    assert not f.filter(record("aiokafka.conn", "a %s", 2))
    for _ in range(5):
        assert f.filter(record("koda.worker", "run done run_id=%s", "r"))

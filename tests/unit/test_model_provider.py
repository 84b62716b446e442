"""The rules of a model provider's faults (processors/handlers/provider.py): which
status is retried, what a 429 asks to wait, what an error may say, and the breaker
that sends calls to the fallback model. Pure code: a fake clock, no server."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime

import pytest

from koda_runtime.lifecycle.handler import Usage
from koda_runtime.processors.handlers.openai import usage_of
from koda_runtime.processors.handlers.provider import (
    Breaker,
    CallOutcome,
    CallPolicy,
    classify,
    error_excerpt,
    retry_after_s,
)


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, CallOutcome.OK),
        (429, CallOutcome.RATE_LIMITED),
        (500, CallOutcome.SERVER_ERROR),
        (502, CallOutcome.SERVER_ERROR),
        (503, CallOutcome.SERVER_ERROR),
        (408, CallOutcome.SERVER_ERROR),
        (409, CallOutcome.SERVER_ERROR),
        (400, CallOutcome.REFUSED),
        (401, CallOutcome.REFUSED),
        (403, CallOutcome.REFUSED),
        (404, CallOutcome.REFUSED),
        (422, CallOutcome.REFUSED),
        (413, CallOutcome.REFUSED),
    ],
)
def test_statuses_are_classified(status: int, outcome: CallOutcome) -> None:
    assert classify(status) is outcome
    assert outcome.retried == (outcome in {
        CallOutcome.RATE_LIMITED, CallOutcome.SERVER_ERROR})  # fmt: skip


def test_an_openai_error_body_gives_its_message_and_code() -> None:
    body = {
        "error": {
            "message": "Incorrect API key provided: sk-proj-abcdef123456. You can find it",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    text = error_excerpt(json.dumps(body).encode())
    assert text.startswith("Incorrect API key provided: [redacted]")
    assert text.endswith("(invalid_api_key)")
    assert "sk-proj" not in text and "abcdef" not in text


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"", "(no message)"),
        (b"upstream connect error\r\nreset", "upstream connect error reset"),
        (b'{"error": "boom"}', "boom"),
        (b'{"message": "Too Many Requests"}', "Too Many Requests"),
        (b"Authorization: Bearer abc.def leaked", "Authorization: [redacted] leaked"),
    ],
)
def test_other_error_bodies_are_excerpted_safely(body: bytes, expected: str) -> None:
    assert error_excerpt(body) == expected


def test_a_long_error_is_cut_short() -> None:
    text = error_excerpt(("x" * 5000).encode())
    assert len(text) == 200 and text.endswith("…")


def test_retry_after_in_seconds_milliseconds_or_a_date() -> None:
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert retry_after_s({"retry-after": "2"}) == 2.0
    assert retry_after_s({"retry-after": "0.5"}) == 0.5
    assert retry_after_s({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    date = "Thu, 01 Jan 2026 12:00:07 GMT"
    assert retry_after_s({"retry-after": date}, now) == 7.0
    assert retry_after_s({"retry-after": "Thu, 01 Jan 2026 11:00:00 GMT"}, now) == 0.0
    assert retry_after_s({"retry-after": "-3"}) == 0.0
    assert retry_after_s({"retry-after": "soon"}) is None
    assert retry_after_s({"retry-after-ms": "x"}) is None
    assert retry_after_s({}) is None


def test_a_429_waits_as_asked_up_to_the_cap_else_backs_off() -> None:
    policy = CallPolicy(base_s=0.5, cap_s=8.0, retry_after_cap_s=30.0)
    assert policy.wait_s(CallOutcome.RATE_LIMITED, 1, 2.0) == 2.0
    assert policy.wait_s(CallOutcome.RATE_LIMITED, 1, 600.0) == 30.0
    rng = random.Random(7)
    assert 0.25 <= policy.wait_s(CallOutcome.RATE_LIMITED, 1, None, rng) <= 0.5
    # A 5xx's Retry-After is not what decides its wait.
    assert policy.wait_s(CallOutcome.SERVER_ERROR, 1, 20.0, rng) <= 0.5


def test_backoff_doubles_with_jitter_and_is_capped() -> None:
    policy = CallPolicy(base_s=0.5, cap_s=8.0)
    rng = random.Random(1)
    for tries, top in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (9, 8.0), (500, 8.0)]:
        waits = [policy.backoff_s(tries, rng) for _ in range(50)]
        assert all(top / 2 <= w <= top for w in waits), (tries, min(waits), max(waits))
        assert len(set(waits)) > 1  # jittered


def test_default_backoff_outlives_a_20_second_outage_within_the_window() -> None:
    """The worst case: every wait at its longest; the tries still reach past 20 s
    before the 30 s window ends, so an outage of 20 s is survived."""
    policy = CallPolicy()
    at, failed = 0.0, 0  # the time of the next try, the tries failed so far
    while at < 20.0:
        failed += 1
        at += min(policy.cap_s, policy.base_s * 2 ** (failed - 1))
    assert at < policy.window_s, at


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(failures: int = 3, open_s: float = 30.0, fallback: str | None = "m-b") -> tuple:
    clock = Clock()
    policy = CallPolicy(breaker_failures=failures, breaker_open_s=open_s)
    return Breaker("m-a", fallback, policy, clock), clock


def test_the_breaker_opens_after_failures_in_a_row_and_sends_calls_to_the_fallback() -> None:
    b, _ = breaker(failures=3)
    for outcome in (CallOutcome.SERVER_ERROR, CallOutcome.RATE_LIMITED):
        b.record(b.route(), outcome)
    assert b.route().model == "m-a" and not b.open
    b.record(b.route(), CallOutcome.CONNECTION_ERROR)
    assert b.open
    route = b.route()
    assert (route.model, route.primary) == ("m-b", False)
    assert b.current_model() == "m-b"


def test_a_success_resets_the_count_and_a_refusal_does_not_count() -> None:
    b, _ = breaker(failures=2)
    b.record(b.route(), CallOutcome.SERVER_ERROR)
    b.record(b.route(), CallOutcome.OK)
    b.record(b.route(), CallOutcome.SERVER_ERROR)
    b.record(b.route(), CallOutcome.REFUSED)
    b.record(b.route(), CallOutcome.CANCELLED)
    assert not b.open
    b.record(b.route(), CallOutcome.CUT)
    assert b.open


def test_after_the_open_time_one_call_probes_the_primary_and_its_success_closes() -> None:
    b, clock = breaker(failures=1, open_s=30.0)
    b.record(b.route(), CallOutcome.SERVER_ERROR)
    clock.now += 29.9
    assert b.route().model == "m-b"
    clock.now += 0.2
    probe = b.route()
    assert (probe.model, probe.probe) == ("m-a", True)
    assert b.route().model == "m-b"  # the others keep to the fallback meanwhile
    b.record(probe, CallOutcome.OK)
    assert not b.open and b.route().model == "m-a"


def test_a_failed_probe_opens_the_breaker_again() -> None:
    b, clock = breaker(failures=1, open_s=10.0)
    b.record(b.route(), CallOutcome.SERVER_ERROR)
    clock.now += 10
    probe = b.route()
    b.record(probe, CallOutcome.RATE_LIMITED)
    assert b.open and b.route().model == "m-b"
    clock.now += 9
    assert b.route().model == "m-b"
    clock.now += 1
    assert b.route().probe


def test_a_probe_that_ends_without_a_verdict_lets_the_next_call_probe() -> None:
    b, clock = breaker(failures=1, open_s=1.0)
    b.record(b.route(), CallOutcome.SERVER_ERROR)
    clock.now += 1
    b.record(b.route(), CallOutcome.CANCELLED)
    assert b.route().probe


def test_fallback_results_never_move_the_breaker() -> None:
    b, _ = breaker(failures=1)
    b.record(b.route(), CallOutcome.SERVER_ERROR)
    fallback = b.route()
    b.record(fallback, CallOutcome.OK)
    assert b.open


def test_without_a_fallback_every_call_goes_to_the_primary() -> None:
    b, _ = breaker(failures=1, fallback=None)
    for _ in range(5):
        b.record(b.route(), CallOutcome.SERVER_ERROR)
    assert not b.open and b.route().model == "m-a"


def test_usage_keeps_cached_and_reasoning_parts() -> None:
    usage = {
        "prompt_tokens": 2006,
        "completion_tokens": 300,
        "prompt_tokens_details": {"cached_tokens": 1920},
        "completion_tokens_details": {"reasoning_tokens": 128},
    }
    assert usage_of(usage, "m") == Usage("m", 2006, 300, cached_tokens=1920, reasoning_tokens=128)


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": None},
        {"prompt_tokens": 5, "completion_tokens": 3, "completion_tokens_details": "x"},
        {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": -1},
        },
    ],
)
def test_missing_or_malformed_parts_are_zero(usage: dict) -> None:
    assert usage_of(usage, "m") == Usage("m", 5, 3)


def test_a_part_is_never_more_than_its_total() -> None:
    usage = {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 50},
        "completion_tokens_details": {"reasoning_tokens": 9},
    }
    assert usage_of(usage, "m") == Usage("m", 5, 3, cached_tokens=5, reasoning_tokens=3)
    with pytest.raises(ValueError, match="cached_tokens"):
        Usage("m", 5, 3, cached_tokens=6)
    with pytest.raises(ValueError, match="reasoning_tokens"):
        Usage("m", 5, 3, reasoning_tokens=4)

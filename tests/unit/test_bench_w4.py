"""W4's pure parts: the Poisson arrivals, the model server's timing and wire format
(its generator, without sockets), what a viewer counts, the "sustained" rule, the
search and the W4 goals."""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import AsyncIterator, Callable
from typing import cast

import aiohttp

from koda_runtime.lifecycle.handler import Usage
from koda_runtime.processors.handlers.openai import parse_event
from tests.bench import w4_load
from tests.bench.goals import GOALS
from tests.bench.model_timing import WARM, Lateness, Plan, Shape, completion, plan_for
from tests.bench.w4_load import Arrival, Meter, Offered, poisson_arrivals, search, summarise

EPOCH = 1_700_000_000.0  # the fake wall clock's zero: stamps have ten integer digits


# ---------------------------------------------------------------- arrivals


def test_poisson_arrivals_have_the_rate_and_exponential_gaps() -> None:
    times = poisson_arrivals(50.0, 200.0, seed=3)
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 200.0
    assert abs(len(times) - 10_000) < 400  # 4 standard deviations of a Poisson count
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert abs(statistics.mean(gaps) - 0.02) < 0.001
    # Exponential gaps: their standard deviation equals their mean (a steady schedule
    # would have none).
    assert 0.9 < statistics.stdev(gaps) / statistics.mean(gaps) < 1.1


def test_the_same_seed_and_rate_give_the_same_arrivals_to_both_systems() -> None:
    assert poisson_arrivals(7.0, 30.0, 1) == poisson_arrivals(7.0, 30.0, 1)
    assert poisson_arrivals(7.0, 30.0, 1) != poisson_arrivals(7.0, 30.0, 2)
    assert poisson_arrivals(0.0, 30.0, 1) == []


# ---------------------------------------------------------------- the model's timing


def test_plans_are_drawn_over_the_model_ranges() -> None:
    plans = [plan_for(f"q plan={i}", 1) for i in range(3000)]
    ttft = [p.ttft_s for p in plans]
    rates = [p.tokens_per_s for p in plans]
    tokens = [p.tokens for p in plans]
    assert 0.3 <= min(ttft) < 0.32 and 0.78 < max(ttft) <= 0.8
    assert 30 <= min(rates) < 31 and 59 < max(rates) <= 60
    assert 200 <= min(tokens) < 205 and 795 < max(tokens) <= 800
    assert abs(statistics.mean(tokens) - 500) < 15


def test_a_plan_depends_on_the_seed_and_the_plan_key_only() -> None:
    a = plan_for("Tell me. plan=2.0.7 ask=abc.7", 5)
    assert plan_for("Other words plan=2.0.7 ask=xyz.7", 5) == a  # same key, other nonce
    assert plan_for("Tell me. plan=2.0.7 ask=abc.7", 6) != a
    assert plan_for("Tell me. plan=2.0.8 ask=abc.8", 5) != a
    assert plan_for(f"{WARM} 3", 5).tokens == 1


def test_plan_offsets_and_duration() -> None:
    p = Plan(0.5, 40.0, 201)
    assert p.offset(0) == 0.5 and p.offset(40) == 1.5
    assert math.isclose(p.duration_s, 5.5)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        return EPOCH + self.t

    async def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


async def collect(events: AsyncIterator[bytes]) -> list[bytes]:
    return [e async for e in events]


def stream(plan: Plan, include_usage: bool, clock: FakeClock, late: Lateness) -> list[bytes]:
    return asyncio.run(
        collect(
            completion(
                plan,
                "m-1",
                prompt_tokens=9,
                include_usage=include_usage,
                now=clock.now,
                wall=clock.wall,
                sleep=clock.sleep,
                lateness=late,
            )
        )
    )


def test_the_model_streams_each_token_when_its_plan_says_in_the_openai_wire_format() -> None:
    plan = Plan(0.4, 50.0, 25)
    clock, late = FakeClock(), Lateness()
    events = stream(plan, True, clock, late)
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    assert events[-1] == b"data: [DONE]\n\n"
    # What koda's openai handler makes of the stream: the tokens, then one usage.
    items = [item for e in events[:-1] for item in parse_event(e[6:].decode(), "x")]
    texts = [i for i in items if isinstance(i, str)]
    assert len(texts) == 25
    assert items[-1] == Usage("m-1", 9, 25)
    stamps = [float(t.split(" ", 1)[0]) - EPOCH for t in texts]
    assert all(math.isclose(s, plan.offset(k), abs_tol=1e-6) for k, s in enumerate(stamps)), stamps[
        :3
    ]
    assert math.isclose(clock.t, plan.duration_s)
    assert late.tokens == 25 and late.late_10ms == 0


def test_no_usage_chunk_unless_asked_and_a_late_token_is_counted() -> None:
    clock, late = FakeClock(), Lateness()
    events = stream(Plan(0.3, 30.0, 3), False, clock, late)
    assert not any(b'"usage"' in e for e in events)
    assert len(events) == 3 + 2  # the tokens, the finish chunk, [DONE]

    class Slow(FakeClock):
        async def sleep(self, s: float) -> None:
            self.t += s + 0.05  # a loop that wakes 50 ms late

    slow, late = Slow(), Lateness()
    stream(Plan(0.3, 30.0, 3), False, slow, late)
    assert late.late_10ms == 3 and math.isclose(late.worst_s, 0.05, abs_tol=1e-9)


def test_shape_is_the_brief_model() -> None:
    assert Shape() == Shape((0.3, 0.8), (30.0, 60.0), (200, 800))


# ---------------------------------------------------------------- what a viewer counts


class FakeContent:
    def __init__(self, reads: list[tuple[float, bytes]], clock: list[float]) -> None:
        self.reads = reads
        self.clock = clock

    async def iter_any(self) -> AsyncIterator[bytes]:
        for at, data in self.reads:
            self.clock[0] = at
            yield data


class FakeResponse:
    def __init__(self, reads: list[tuple[float, bytes]], clock: list[float]) -> None:
        self.content = FakeContent(reads, clock)


def read(reads: list[tuple[float, bytes]], a: Arrival, meter: Meter) -> None:
    """``reads`` (seconds after EPOCH, bytes) through the viewer's stream reader."""
    now = [0.0]
    resp = cast(aiohttp.ClientResponse, FakeResponse(reads, now))
    asyncio.run(w4_load.read_stream(resp, a, meter, lambda: EPOCH + now[0]))


def arrival(**kw: object) -> Arrival:
    a = Arrival(0.0, "u", "p", Plan(0.5, 40.0, 10), measured=True)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_a_viewer_counts_tokens_in_the_hold_window_and_reads_the_frames() -> None:
    chunk = b'event: chunk\ndata: {"content":"%s w "}\n\n'
    reads = [
        (1.0, b'event: started\ndata: {"queue_s":0.012}\n\n' + chunk % b"1700000000.990000"),
        (10.5, chunk % b"1700000010.400000"),  # split across two reads:
        (10.6, b'event: chunk\ndata: {"content":"1700000010.500000 a 1700000010.550000 b "'),
        (10.7, b"}\n\nevent: done\ndata: {}\n\n"),
    ]
    meter = Meter((EPOCH + 10.0, EPOCH + 20.0))
    a = arrival()
    read(reads, a, meter)
    assert a.tokens == 4 and a.first == EPOCH + 1.0 and a.ended and a.error is None
    assert a.queue_s == 0.012
    assert meter.delivered == 3 and meter.open == 0  # the first token came before the window
    assert [round(x, 3) for x in meter.lat] == [0.1, 0.2, 0.15]


def test_a_stream_ending_in_error_marks_the_arrival() -> None:
    a = arrival()
    reads = [(1.0, b'event: error\ndata: {"message":"boom"}\n\n')]
    read(reads, a, Meter((0, 1)))
    assert a.ended and a.error is not None and a.tokens == 0


# ---------------------------------------------------------------- sustained, and the search


def offered(lat_ms: float, queue_ms: float, failed: bool = False) -> Offered:
    meter = Meter((0.0, 10.0), lat=[lat_ms / 1000] * 100, delivered=100, samples=[40, 60])
    ok = [arrival(sent=1.0, first=2.0, tokens=10, queue_s=queue_ms / 1000) for _ in range(50)]
    if failed:
        ok.append(arrival(error="POST -> 503"))
    cpu = [
        {"system": 1.0, "model": 0.0, "generator": 0.0},
        {"system": 3.0, "model": 1.0, "generator": 2.0},
    ]
    return Offered(ok, meter, cpu, 10.0)


def test_a_step_is_sustained_under_both_p99_limits_with_no_failure() -> None:
    s = summarise(4.0, offered(150, 250))
    assert s.sustained
    assert s.streams_mean == 50 and s.streams_max == 60 and s.tokens_s == 10
    assert math.isclose(s.cpu_per_token, 2.0 / 100) and s.cores["system"] == 0.2
    assert math.isclose(s.added_ttfc[0], 0.5)  # 1 s to the first token, 0.5 s the model's
    assert not summarise(4.0, offered(151, 250)).sustained
    assert not summarise(4.0, offered(150, 251)).sustained
    assert not summarise(4.0, offered(10, 10, failed=True)).sustained


def test_a_run_never_started_has_waited_forever() -> None:
    got = offered(10, 10)
    got.arrivals[0].queue_s = math.nan
    s = summarise(4.0, got)
    assert math.inf in s.queue and not s.sustained


class FakeStep:
    def __init__(self, rate: float, ok: bool) -> None:
        self.rate, self.sustained = rate, ok


def machine(capacity: float) -> tuple[list[float], Callable[[float], FakeStep]]:
    tried: list[float] = []

    def step(rate: float) -> FakeStep:
        tried.append(rate)
        return FakeStep(rate, rate <= capacity)

    return tried, step


def test_search_grows_then_bisects_to_the_highest_sustained_rate() -> None:
    tried, step = machine(11.0)
    found, steps = search(step, 4.0, 2.0, 2, 128.0, 0.5)
    assert tried == [4.0, 8.0, 16.0, 12.0, 10.0]
    assert found == 10.0 and len(steps) == 5


def test_search_goes_down_to_the_floor_and_may_find_nothing() -> None:
    tried, step = machine(1.2)
    found, _ = search(step, 4.0, 2.0, 0, 128.0, 0.5)
    assert tried == [4.0, 2.0, 1.0] and found == 1.0
    tried, step = machine(0.1)
    found, _ = search(step, 4.0, 2.0, 3, 128.0, 0.5)
    assert tried == [4.0, 2.0, 1.0, 0.5] and found == 0.0


def test_search_stops_at_the_cap() -> None:
    tried, step = machine(1e9)
    found, _ = search(step, 4.0, 2.0, 2, 20.0, 0.5)
    assert tried == [4.0, 8.0, 16.0, 20.0] and found == 20.0


def test_the_w4_goals() -> None:
    w4 = {g.figure: g for g in GOALS if g.workload == "W4"}
    assert (w4["w4_streams_ratio"].op, w4["w4_streams_ratio"].target) == (">=", 0.5)
    assert (w4["w4_ttfc_added50"].op, w4["w4_ttfc_added50"].target) == ("<=", 50)
    assert (w4["w4_ttfc_added99"].op, w4["w4_ttfc_added99"].target) == ("<=", 150)
    figures = {"w4_streams_ratio": [0.4], "w4_ttfc_added50": [30.0], "w4_ttfc_added99": []}
    assert w4["w4_streams_ratio"].judge(figures)[1] == "NOT MET"
    assert w4["w4_ttfc_added50"].judge(figures)[1] == "met"
    assert w4["w4_ttfc_added99"].judge(figures)[1] == "not measured"

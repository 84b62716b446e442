"""W2's offered load: runs arriving at a steady rate, and the search for the knee.

A *step* offers ``rate`` chunks/s for ``warm_s + hold_s`` seconds, open loop: runs of
``chunks`` chunks ``spacing_ms`` apart are POSTed at ``rate / chunks`` runs/s on a
fixed schedule (a slow pipeline does not slow the arrivals), each watched by
``viewers`` SSE connections. Only the runs POSTed in the hold window are measured.

*Lag* of a run: how far behind the offered schedule its last token reaches a viewer,
``receipt - (POST sent + chunks * spacing)``. Every run of a step has the same schedule,
so at a rate the pipeline sustains the lag stays flat from run to run; past the knee
work piles up somewhere (the gateway's admission, the runs topic, a worker's event
loop, the chunk topic, the gateway's feed) and each run's lag is larger than the one
POSTed before it, as long as the step lasts.

A step is **sustainable** when all three hold (:data:`SLOPE_LIMIT`, :data:`LAG_LIMIT_S`,
:data:`DRAIN_S`):

* the least-squares slope of the runs' lag against their POST time, over every viewer
  of the runs POSTed in the hold window, is at most 0.02 s per s (the backlog grows
  by at most 2 % of the elapsed time: the pipeline keeps up with at least 98 % of the
  offered rate);
* the median lag of the first and of the last quarter of those runs is at most
  1 s. Every step starts drained (w2_latency's ``settle``), so a lag above that was
  built by this step's own warm-up: a backlog that grew and then, at best, shrinks.
  Without it a step whose lag fell from 9 s to 6.5 s over its hold window (its slope
  negative) counted as sustainable, and 80 % of such a "knee" measured an overload;
* every run of the step has reached its terminal event at all its viewers within
  ``DRAIN_S`` seconds after the last POST's schedule ended, with no failed request.

The knee is the highest sustainable rate :func:`search` finds: rates grow by
``factor`` from ``start`` until a step fails, then ``bisections`` halvings of the
bracket between the last sustainable and the first failed rate.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from tests.bench import ssewatch
from tests.bench.common import demo_input, percentile
from tests.bench.ssewatch import TERMINAL

SLOPE_LIMIT = 0.02  # s of lag per s of step: at most 2 % of the offered rate not kept up
LAG_LIMIT_S = 1.0  # a step's runs may fall at most this far behind the offered schedule
DRAIN_S = 15.0  # a run must end this long after its schedule, at the latest
# Every token's yield stamp: a chunk record may carry several tokens (the worker may
# coalesce the tokens of one batching window into one record).
_STAMP = re.compile(rb"(\d{10}\.\d{6}) ")
# Inputs are unique across every step of the process: the gateway derives a run's
# idempotency key from its input, and a repeated one would answer an old run.
SERIAL = itertools.count()


@dataclass
class Seen:
    """What one SSE connection saw: per token (receipt, yield stamp, index k from 1)."""

    chunks: list[tuple[float, float, int]] = field(default_factory=list)
    terminal: bool = False
    cut: bool = False


async def watch(session: aiohttp.ClientSession, run_id: str, user: str) -> Seen:
    """Read the run's events to its end; stamp each network read on arrival."""
    seen = Seen()
    async for now, kind, frame in ssewatch.events(session, run_id, user):
        if kind == b"chunk":
            for stamp in _STAMP.findall(frame):
                seen.chunks.append((now, float(stamp), len(seen.chunks) + 1))
        elif kind == b"reconnect":
            seen.cut = True
        elif kind in TERMINAL:
            seen.terminal = True
    return seen


@dataclass
class RunSeen:
    posted: float  # wall clock when the POST was sent
    viewers: list[Seen]


@dataclass
class Step:
    """One offered rate's outcome."""

    rate: float  # offered chunks/s
    slope: float  # lag growth, s per s
    lag_start_ms: float  # median lag of the first quarter of the measured runs
    lag_end_ms: float  # median lag of the last quarter
    unfinished: int  # runs (of the whole step) not ended within DRAIN_S, or failed
    runs: int  # runs POSTed in the hold window
    lat: list[float]  # yield -> viewer receipt, s, every chunk of the measured runs
    ttfc: list[float]  # POST -> first chunk at the viewer, s, every measured viewer
    delivered: float  # tokens/s received per viewer, first to last receipt
    gen_cores: float = 0.0  # load generator (this process) CPU s per s
    sut_cores: float = 0.0  # gateway + workers CPU s per s
    load1: float = 0.0  # 1-minute load average at the step's end

    @property
    def sustainable(self) -> bool:
        return (
            self.unfinished == 0
            and self.slope <= SLOPE_LIMIT
            and max(self.lag_start_ms, self.lag_end_ms) <= LAG_LIMIT_S * 1000
        )

    def line(self) -> str:
        return (
            f"{self.rate:.0f} chunks/s offered: lag {self.lag_start_ms:.0f} -> "
            f"{self.lag_end_ms:.0f} ms, slope {self.slope * 1000:.1f} ms/s, "
            f"unfinished {self.unfinished}, {self.runs} runs, yield->viewer p50 "
            f"{percentile(self.lat, 0.5) * 1000:.0f} p99 {percentile(self.lat, 0.99) * 1000:.0f} "
            f"ms, TTFC p50 {percentile(self.ttfc, 0.5) * 1000:.0f} p99 "
            f"{percentile(self.ttfc, 0.99) * 1000:.0f} ms, generator {self.gen_cores:.2f} cores, "
            f"koda {self.sut_cores:.2f} cores, load {self.load1:.1f} -> "
            + ("sustainable" if self.sustainable else "NOT sustainable")
        )


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x; 0 for fewer than two distinct x."""
    if len(points) < 2:
        return 0.0
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in points) / sxx


@dataclass
class Offer:
    """The shape of the offered load (the rate is the step's)."""

    url: str
    users: list[str]  # one per partition; runs take them in turn
    chunks: int = 100
    spacing_ms: int = 20
    viewers: int = 2
    warm_s: float = 4.0
    hold_s: float = 15.0


async def post_and_watch(session: aiohttp.ClientSession, o: Offer, user: str) -> RunSeen:
    """POST one run of ``o``'s shape as ``user``, then follow it with ``o.viewers`` streams."""
    body = {"input": demo_input(next(SERIAL), o.chunks, o.spacing_ms, stamp=True)}
    sent = time.time()
    async with session.post(
        "/v1/runs", json=body, headers={"Authorization": f"Bearer dev:{user}"}
    ) as r:
        got = await r.json()
        if r.status != 202:
            raise AssertionError(f"POST -> {r.status}: {got}")
    seen = await asyncio.gather(*(watch(session, got["run_id"], user) for _ in range(o.viewers)))
    return RunSeen(sent, list(seen))


async def offer(o: Offer, rate: float) -> tuple[list[RunSeen], int]:
    """POST runs at ``rate / o.chunks`` runs/s; (runs POSTed in the hold window,
    unfinished or failed runs of the whole step)."""
    every = o.chunks / rate
    total = max(1, int((o.warm_s + o.hold_s) / every))
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    measured: list[RunSeen] = []
    async with aiohttp.ClientSession(base_url=o.url, connector=conn, timeout=timeout) as session:
        t0 = time.monotonic()
        tasks: list[tuple[bool, asyncio.Task[RunSeen]]] = []
        for i in range(total):
            due = t0 + i * every
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            in_hold = i * every >= o.warm_s
            tasks.append(
                (
                    in_hold,
                    asyncio.create_task(post_and_watch(session, o, o.users[i % len(o.users)])),
                )
            )
        # The last run's schedule ends chunks * spacing after its POST; then DRAIN_S.
        deadline = time.monotonic() + o.chunks * o.spacing_ms / 1000 + DRAIN_S
        await asyncio.wait([t for _, t in tasks], timeout=max(0.0, deadline - time.monotonic()))
        unfinished = 0
        for in_hold, task in tasks:
            if not task.done():
                task.cancel()
                unfinished += 1
            elif task.cancelled() or task.exception() is not None:
                unfinished += 1
            else:
                seen = task.result()
                unfinished += not all(v.terminal for v in seen.viewers)
                if in_hold:
                    measured.append(seen)
        await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
    return measured, unfinished


def summarise(o: Offer, rate: float, measured: list[RunSeen], unfinished: int) -> Step:
    spacing = o.spacing_ms / 1000
    points: list[tuple[float, float]] = []  # (POST sent, the run's lag at one viewer)
    lat: list[float] = []
    ttfc: list[float] = []
    tokens = 0
    first, last = math.inf, 0.0
    for run in measured:
        for v in run.viewers:
            if not v.chunks:
                continue
            ttfc.append(v.chunks[0][0] - run.posted)
            lat += [receipt - stamp for receipt, stamp, _ in v.chunks]
            points.append((run.posted, v.chunks[-1][0] - (run.posted + o.chunks * spacing)))
            tokens += len(v.chunks)
            first, last = min(first, v.chunks[0][0]), max(last, v.chunks[-1][0])
    points.sort()
    quarter = max(1, len(points) // 4)
    lags = [y for _, y in points]
    return Step(
        rate=rate,
        slope=slope(points),
        lag_start_ms=percentile(lags[:quarter], 0.5) * 1000,
        lag_end_ms=percentile(lags[-quarter:], 0.5) * 1000,
        unfinished=unfinished,
        runs=len(measured),
        lat=lat,
        ttfc=ttfc,
        delivered=tokens / o.viewers / (last - first) if last > first else math.nan,
    )


def run_step(o: Offer, rate: float, cpu_of_sut: Callable[[], float]) -> Step:
    """One step at ``rate`` chunks/s, with the CPU each side used and the load average."""
    gen0, sut0, t0 = time.process_time(), cpu_of_sut(), time.monotonic()
    measured, unfinished = asyncio.run(offer(o, rate))
    wall = time.monotonic() - t0
    step = summarise(o, rate, measured, unfinished)
    step.gen_cores = (time.process_time() - gen0) / wall
    step.sut_cores = (cpu_of_sut() - sut0) / wall
    step.load1 = os.getloadavg()[0]
    return step


def search(
    step: Callable[[float], Step], start: float, factor: float, bisections: int, cap: float
) -> tuple[float, list[Step]]:
    """The highest sustainable rate found (0 if none) and every step taken, in order.

    From ``start``, multiply by ``factor`` while sustainable (up to ``cap``), or divide
    while not; then bisect the bracket ``bisections`` times.
    """
    steps: list[Step] = []
    lo, hi = 0.0, math.inf
    rate = start
    while True:
        s = step(rate)
        steps.append(s)
        if s.sustainable:
            lo = rate
            if hi < math.inf or rate >= cap:
                break
            rate = min(cap, rate * factor)
        else:
            hi = rate
            if lo > 0 or rate < 50:
                break
            rate = rate / factor
    if hi == math.inf:
        return lo, steps
    for _ in range(bisections):
        if lo == 0:
            break
        rate = round((lo + hi) / 2, -1)
        if rate in (lo, hi):
            break
        s = step(rate)
        steps.append(s)
        if s.sustainable:
            lo = rate
        else:
            hi = rate
    return lo, steps

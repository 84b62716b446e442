"""W4's offered load: users arriving as a Poisson process, each submitting one run and
reading its answer's stream to the end; what one step measures, what "sustains"
means, and the search for the highest rate sustained.

A *step* offers ``rate`` arrivals/s for ``warm_s + hold_s`` seconds, open loop: the
arrival times are drawn once per (seed, rate) (:func:`poisson_arrivals`), so koda and
the direct rival get the very same arrivals, with the same prompts and so the same
answer timings from the model server (tests/bench/model_timing.py). Every arrival is
a user of its own. Figures:

* yield -> viewer: every token received in the hold window, its receipt (wall clock,
  at the network read) minus the stamp the model server wrote into its text;
* queue wait: for koda the run's ``started_at - created_at`` (Postgres), for the direct
  app request received -> model call started (its ``started`` frame);
* added time to first chunk: POST sent -> first token at the viewer, minus the model's
  own time to first token for that prompt (:func:`~tests.bench.model_timing.plan_for`);
  both of the arrivals in the hold window;
* streams held: the open answer streams, sampled every 100 ms over the hold window;
* tokens/s delivered and CPU per token: tokens received in the hold window, and the
  CPU the system used over the same window.

A step is **sustained** (:attr:`Step.sustained`) when, of the arrivals in its hold
window, none failed or went without a first token, yield -> viewer p99 is at most
:data:`LAT_P99_S` and queue wait p99 at most :data:`QUEUE_P99_S`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import aiohttp

from tests.bench.common import percentile
from tests.bench.model_timing import Plan

LAT_P99_S = 0.150  # yield -> viewer p99 a sustained step keeps to
QUEUE_P99_S = 0.250  # queue wait p99 a sustained step keeps to
FIRST_TOKEN_WAIT_S = 15.0  # after the last arrival, for the hold window's first tokens
SAMPLE_S = 0.1  # how often the open streams are counted
# The stamp the model server starts every token with (a chunk may carry several).
_STAMP = re.compile(rb"(\d{10}\.\d{6}) ")
_EVENT = re.compile(rb"event: ?(\w+)")
_DATA = re.compile(rb"^data: ?(.*)$", re.M)
ENDS = {b"done", b"error", b"cancelled"}


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times (s from the step's start, ascending) of a Poisson process of
    ``rate`` per second over ``duration_s``; the same for the same arguments."""
    if rate <= 0:
        return []
    rng = random.Random(f"w4:{seed}:{rate!r}")  # noqa: S311 - a benchmark's schedule
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass
class Arrival:
    """One user's run as the load generator saw it."""

    due: float  # s after the step's start
    user: str
    prompt: str
    plan: Plan
    measured: bool  # arrived in the hold window
    sent: float = math.nan  # wall clock when the POST was sent
    first: float = math.nan  # wall clock of the first token's receipt
    queue_s: float = math.nan
    tokens: int = 0
    run_id: str | None = None
    ended: bool = False
    error: str | None = None

    @property
    def added_ttfc_s(self) -> float:
        """Time to first chunk minus the model's own time to first token."""
        return self.first - self.sent - self.plan.ttft_s


@dataclass
class Meter:
    """What the viewers of one step saw, counted as it happens."""

    hold: tuple[float, float]  # the hold window, wall clock
    lat: list[float] = field(default_factory=list)  # s, tokens received in the window
    delivered: int = 0  # tokens received in the window
    open: int = 0  # answer streams open now
    samples: list[int] = field(default_factory=list)

    def token(self, a: Arrival, now: float, stamp: float) -> None:
        if a.tokens == 0:
            a.first = now
        a.tokens += 1
        if self.hold[0] <= now < self.hold[1]:
            self.lat.append(now - stamp)
            self.delivered += 1


async def read_stream(
    resp: aiohttp.ClientResponse,
    a: Arrival,
    meter: Meter,
    clock: Callable[[], float] = time.time,
) -> None:
    """Read an answer's SSE stream to its end, stamping every network read on arrival
    with ``clock`` (the wall clock the model server stamps its tokens with)."""
    buf = b""
    meter.open += 1
    try:
        async for data in resp.content.iter_any():
            now = clock()
            buf += data
            *frames, buf = buf.split(b"\n\n")
            for fr in frames:
                m = _EVENT.search(fr)
                kind = m.group(1) if m else b""
                if kind == b"chunk":
                    for stamp in _STAMP.findall(fr):
                        meter.token(a, now, float(stamp))
                elif kind == b"started":
                    payload = _DATA.search(fr)
                    if payload is not None:
                        a.queue_s = float(json.loads(payload.group(1))["queue_s"])
                elif kind in ENDS:
                    a.ended = True
                    if kind != b"done":
                        a.error = f"the stream ended with {kind.decode()}"
                elif kind == b"reconnect":
                    a.error = "the gateway cut the stream"
    finally:
        meter.open -= 1


class Target(Protocol):
    """A system under test, as the load generator submits to it."""

    name: str

    async def arrive(self, session: aiohttp.ClientSession, a: Arrival, meter: Meter) -> None:
        """Submit ``a``'s prompt as ``a.user`` and read the answer to its end."""
        ...

    async def wind_down(self, session: aiohttp.ClientSession, left: list[Arrival]) -> None:
        """Stop the work of the arrivals whose streams the step closed early."""
        ...


async def _sampler(meter: Meter, t0: float, warm_s: float, hold_s: float) -> None:
    await asyncio.sleep(max(0.0, t0 + warm_s - time.monotonic()))
    end = t0 + warm_s + hold_s
    while time.monotonic() < end:
        meter.samples.append(meter.open)
        await asyncio.sleep(SAMPLE_S)


@dataclass
class Offered:
    """A step's raw outcome, before :func:`summarise`."""

    arrivals: list[Arrival]
    meter: Meter
    cpu: list[dict[str, float]]  # the CPU snapshots at the hold window's start and end
    hold_s: float


async def offer(
    target: Target,
    arrivals: list[Arrival],
    warm_s: float,
    hold_s: float,
    cpu: Callable[[], dict[str, float]],
) -> Offered:
    """Submit ``arrivals`` at their due times; return once the hold window's arrivals
    have their first token (or :data:`FIRST_TOKEN_WAIT_S` passed), closing the streams
    still open. ``cpu`` is read at the hold window's start and end."""
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
    t0, wall0 = time.monotonic(), time.time()
    meter = Meter((wall0 + warm_s, wall0 + warm_s + hold_s))
    snapshots: list[dict[str, float]] = []

    async def clock() -> None:
        await asyncio.sleep(max(0.0, t0 + warm_s - time.monotonic()))
        snapshots.append(cpu())
        await asyncio.sleep(max(0.0, t0 + warm_s + hold_s - time.monotonic()))
        snapshots.append(cpu())

    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        watch = [
            asyncio.create_task(clock()),
            asyncio.create_task(_sampler(meter, t0, warm_s, hold_s)),
        ]
        tasks: list[asyncio.Task[None]] = []

        async def one(a: Arrival) -> None:
            try:
                await target.arrive(session, a, meter)
            except Exception as exc:  # noqa: BLE001 - any failure is this arrival's outcome
                a.error = f"{type(exc).__name__}: {exc}"[:300]

        for a in arrivals:
            await asyncio.sleep(max(0.0, t0 + a.due - time.monotonic()))
            tasks.append(asyncio.create_task(one(a)))
        await asyncio.gather(*watch)
        deadline = time.monotonic() + FIRST_TOKEN_WAIT_S
        while time.monotonic() < deadline and any(
            a.measured and a.tokens == 0 and not a.ended and a.error is None for a in arrivals
        ):
            await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await target.wind_down(session, [a for a in arrivals if not a.ended])
    return Offered(arrivals, meter, snapshots, hold_s)


@dataclass
class Step:
    """One offered rate's figures (durations in s, CPU in s)."""

    rate: float  # arrivals/s offered
    arrivals: int  # in the hold window
    failed: int  # of those: an error, or no first token
    lat: list[float]  # yield -> viewer, every token received in the hold window
    queue: list[float]  # queue wait, each arrival of the hold window
    added_ttfc: list[float]  # each arrival of the hold window with a first token
    streams_mean: float
    streams_max: int
    tokens_s: float  # delivered to viewers over the hold window
    cpu_per_token: float  # the system's CPU s per delivered token
    cores: dict[str, float]  # CPU s per s over the hold window: system, model, generator
    model_late: str = ""  # the model server's own lateness over the step
    load1: float = 0.0

    @property
    def sustained(self) -> bool:
        return (
            self.arrivals > 0
            and self.failed == 0
            and percentile(self.lat, 0.99) <= LAT_P99_S
            and percentile(self.queue, 0.99) <= QUEUE_P99_S
        )

    def line(self) -> str:
        def ms(values: list[float], q: float) -> str:
            return f"{percentile(values, q) * 1000:.0f}"

        return (
            f"{self.rate:g} arrivals/s: {self.arrivals} runs ({self.failed} failed), streams "
            f"{self.streams_mean:.0f} mean {self.streams_max} max, {self.tokens_s:.0f} tokens/s, "
            f"yield->viewer p50 {ms(self.lat, 0.5)} p99 {ms(self.lat, 0.99)} ms, queue p99 "
            f"{ms(self.queue, 0.99)} ms, added TTFC p50 {ms(self.added_ttfc, 0.5)} p99 "
            f"{ms(self.added_ttfc, 0.99)} ms, {self.cpu_per_token * 1e6:.0f} CPU us/token, cores "
            + " ".join(f"{k} {v:.2f}" for k, v in self.cores.items())
            + f", model {self.model_late}, load {self.load1:.1f} -> "
            + ("sustained" if self.sustained else "NOT sustained")
        )


def summarise(rate: float, got: Offered) -> Step:
    """The step's figures from what its viewers saw and the CPU snapshots."""
    measured = [a for a in got.arrivals if a.measured]
    failed = [a for a in measured if a.error is not None or a.tokens == 0]
    m = got.meter
    cores: dict[str, float] = {}
    if len(got.cpu) == 2:
        before, after = got.cpu
        cores = {k: (after[k] - before[k]) / got.hold_s for k in after}
    system = cores.get("system", math.nan) * got.hold_s
    return Step(
        rate=rate,
        arrivals=len(measured),
        failed=len(failed),
        lat=m.lat,
        # A run never started has waited forever as far as the viewer is concerned.
        queue=[a.queue_s if not math.isnan(a.queue_s) else math.inf for a in measured],
        added_ttfc=[a.added_ttfc_s for a in measured if a.tokens],
        streams_mean=sum(m.samples) / len(m.samples) if m.samples else 0.0,
        streams_max=max(m.samples, default=0),
        tokens_s=m.delivered / got.hold_s,
        cpu_per_token=system / m.delivered if m.delivered else math.nan,
        cores=cores,
    )


class Judged(Protocol):
    @property
    def sustained(self) -> bool: ...


S = TypeVar("S", bound=Judged)


def search(
    step: Callable[[float], S],
    start: float,
    factor: float,
    bisections: int,
    cap: float,
    floor: float,
) -> tuple[float, list[S]]:
    """The highest sustained rate found (0 if none) and every step taken, in order.

    From ``start``, multiply by ``factor`` while sustained (up to ``cap``), or divide
    while not (down to ``floor``); then bisect the bracket ``bisections`` times
    (rates rounded to 0.1/s).
    """
    steps: list[S] = []
    lo, hi = 0.0, math.inf
    rate = start
    while True:
        s = step(rate)
        steps.append(s)
        if s.sustained:
            lo = rate
            if hi < math.inf or rate >= cap:
                break
            rate = min(cap, rate * factor)
        else:
            hi = rate
            if lo > 0 or rate / factor < floor:
                break
            rate = rate / factor
    if hi == math.inf or lo == 0:
        return lo, steps
    for _ in range(bisections):
        rate = round((lo + hi) / 2, 1)
        if rate in (lo, hi):
            break
        s = step(rate)
        steps.append(s)
        if s.sustained:
            lo = rate
        else:
            hi = rate
    return lo, steps

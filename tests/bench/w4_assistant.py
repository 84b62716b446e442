"""W4, assistant load: users asking a model for answers, through koda and without it.

Each repetition starts a model server with a model's timing (tests/bench/model_timing.py,
in a process of its own) and measures two systems against it, one after the other
(koda first in odd repetitions, the direct app first in even ones):

* **koda**: a gateway and 2 workers on a fresh namespace (256 partitions), the
  ``openai`` handler pointed at the model server, ``KODA_MAX_INFLIGHT`` 512, long-term
  memory off (the rival has none). A user POSTs ``/v1/runs`` and reads
  ``/v1/runs/<id>/events`` to the end;
* **direct**: the FastAPI app a developer would write instead (tests/bench/direct_app.py):
  one ``POST /v1/chat`` whose response is the answer's SSE stream, the model called
  with httpx, no Kafka, no Postgres.

For each, the search of tests/bench/w4_load.py finds the highest arrival rate it
sustains (yield -> viewer p99 <= 150 ms, queue wait p99 <= 250 ms, no arrival failed),
from ``--start`` arrivals/s, x ``--factor`` up (or down), then ``--bisections``
halvings of the bracket; both systems get the same Poisson arrivals at a given rate.
The table prints, at each one's sustained rate, the streams held, the tokens/s
delivered, the CPU per delivered token (koda: gateway + workers; direct: the app; the
model server and the load generator apart) and the added time to first chunk, with
koda / direct of the same repetition.

    python -m tests.bench --only w4 --quick          # a check that it runs
    python -m tests.bench --only w4                  # 3 repetitions, the reported figures
    python -m tests.bench.w4_assistant --repeat 1    # W4's table alone
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from koda_runtime.localstack import StackInfo
from tests.bench import w4_load
from tests.bench.common import (
    TERMINAL,
    Loader,
    Table,
    cpu_seconds,
    fmt,
    namespace,
    percentile,
    services,
    users_on_distinct_partitions,
    wait_group,
)
from tests.bench.model_timing import WARM, Shape, plan_for
from tests.bench.profile import print_profiles, spy_on, stop_spies
from tests.bench.w4_load import Arrival, Meter, Step, read_stream
from tests.fixtures.processes import (
    ChildProcess,
    GatewayProcess,
    WorkerProcess,
    free_port,
)
from tests.support import wait_until

PARTITIONS = 256
WORKERS = 2
MODEL = "w4-model"
SYSTEMS = ("koda", "direct")


# ---------------------------------------------------------------- the systems


@dataclass
class Koda:
    """koda's gateway: POST the run, then follow its events."""

    url: str
    name: str = "koda"

    async def arrive(self, session: aiohttp.ClientSession, a: Arrival, meter: Meter) -> None:
        auth = {"Authorization": f"Bearer dev:{a.user}"}
        a.sent = time.time()
        async with session.post(
            f"{self.url}/v1/runs", json={"input": {"text": a.prompt}}, headers=auth
        ) as r:
            got = await r.json()
            if r.status != 202:
                raise AssertionError(f"POST /v1/runs -> {r.status}: {got}")
        a.run_id = str(got["run_id"])
        async with session.get(f"{self.url}/v1/runs/{a.run_id}/events", headers=auth) as r:
            if r.status != 200:
                raise AssertionError(f"GET events -> {r.status}: {await r.text()}")
            await read_stream(r, a, meter)

    async def wind_down(self, session: aiohttp.ClientSession, left: list[Arrival]) -> None:
        """Cancel the runs whose streams the step closed, so the next step starts idle."""
        gate = asyncio.Semaphore(32)

        async def cancel(a: Arrival) -> None:
            async with gate:
                try:
                    async with session.post(
                        f"{self.url}/v1/runs/{a.run_id}/cancel",
                        headers={"Authorization": f"Bearer dev:{a.user}"},
                    ) as r:
                        await r.read()
                except aiohttp.ClientError:
                    return  # the settle that follows waits for it instead

        await asyncio.gather(*(cancel(a) for a in left if a.run_id))


@dataclass
class Direct:
    """The direct app: one POST whose response is the answer's stream."""

    url: str
    name: str = "direct"

    async def arrive(self, session: aiohttp.ClientSession, a: Arrival, meter: Meter) -> None:
        a.sent = time.time()
        async with session.post(f"{self.url}/v1/chat", json={"text": a.prompt}) as r:
            if r.status != 200:
                raise AssertionError(f"POST /v1/chat -> {r.status}: {await r.text()}")
            await read_stream(r, a, meter)

    async def wind_down(self, session: aiohttp.ClientSession, left: list[Arrival]) -> None:
        return  # a closed stream ends the app's model call


def python_child(name: str, module: str, *args: str) -> ChildProcess:
    return ChildProcess(name, [sys.executable, "-m", module, *args])


def wait_http(child: ChildProcess, url: str) -> None:
    def up() -> bool:
        child.check()
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=60, what=url)


def model_stats(model_url: str, reset: bool = False) -> dict[str, float]:
    got = httpx.get(f"{model_url}/stats", params={"reset": "1"} if reset else {}, timeout=10)
    return dict(got.json())


# ---------------------------------------------------------------- one system's search


@dataclass
class Found:
    """One system's search in one repetition."""

    rate: float
    steps: list[Step]

    @property
    def best(self) -> Step | None:
        """The step at the sustained rate (the highest sustained one)."""
        ok = [s for s in self.steps if s.sustained]
        return max(ok, key=lambda s: s.rate) if ok else None


@dataclass
class Bench:
    """What every step of a repetition shares."""

    args: argparse.Namespace
    rep: int
    model_url: str
    model_pid: int
    shape: Shape = field(default_factory=Shape)

    @property
    def seed(self) -> int:
        return int(self.args.seed) + self.rep

    def arrivals(self, system: str, rate: float) -> list[Arrival]:
        """The step's arrivals: the same times and answer plans for both systems at
        ``rate``; users and prompts new each step (koda's idempotency keys)."""
        warm, hold = self.args.warm_s, self.args.hold_s
        nonce = uuid.uuid4().hex[:10]
        out = []
        for i, t in enumerate(w4_load.poisson_arrivals(rate, warm + hold, self.seed)):
            prompt = f"Tell me about things. plan={rate!r}.{i} ask={nonce}.{i}"
            out.append(
                Arrival(
                    due=t,
                    user=f"w4-{system}-{nonce}-{i}",
                    prompt=prompt,
                    plan=plan_for(prompt, self.seed, self.shape),
                    measured=t >= warm,
                )
            )
        return out

    def search(
        self,
        target: w4_load.Target,
        system_pids: list[int],
        settle: Callable[[], None],
        fill_queue: Callable[[list[Arrival]], None],
        check: Callable[[], None],
    ) -> Found:
        args = self.args

        def cpu() -> dict[str, float]:
            return {
                "system": sum(cpu_seconds(p) for p in system_pids),
                "model": cpu_seconds(self.model_pid),
                "generator": time.process_time(),
            }

        def step(rate: float) -> Step:
            check()
            settle()
            model_stats(self.model_url, reset=True)
            arrivals = self.arrivals(target.name, rate)
            got = asyncio.run(w4_load.offer(target, arrivals, args.warm_s, args.hold_s, cpu))
            fill_queue(got.arrivals)
            s = w4_load.summarise(rate, got)
            late = model_stats(self.model_url)
            s.model_late = (
                f"{late['late_10ms']:.0f}/{late['tokens']:.0f} tokens > 10 ms late, worst "
                f"{late['worst_late_ms']:.0f} ms"
            )
            s.load1 = os.getloadavg()[0]
            print(f"  w4 rep {self.rep + 1} {target.name} {s.line()}", flush=True)
            return s

        rate, steps = w4_load.search(
            step, args.start, args.factor, args.bisections, args.cap, args.floor
        )
        settle()
        return Found(rate, steps)

    def settle_model(self, timeout: float = 180.0) -> None:
        """Until the model server streams no answer: the previous step's work is over."""
        wait_until(
            lambda: model_stats(self.model_url)["open"] == 0,
            timeout=timeout,
            interval=0.5,
            what="the model server's streams to end",
        )


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of ``pid``, summed by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def measure_koda(stack: StackInfo, b: Bench) -> Found:
    args = b.args
    with namespace(
        stack,
        partitions=PARTITIONS,
        chunk_batch_ms=args.window_ms,
        max_inflight=args.max_inflight,
        handler="openai",
    ) as settings:
        env = {
            "KODA_OPENAI_BASE_URL": b.model_url,
            "KODA_OPENAI_MODEL": MODEL,
            "KODA_MEMORY": "false",
            # A window's tokens as one chunk (one row, record and SSE event), as the
            # README advises for model output; --w4-window-ms 20 --w4-no-coalesce is
            # the token-per-chunk configuration.
            "KODA_CHUNK_COALESCE": "true" if args.coalesce else "false",
        }
        loader = Loader(settings)
        gw = GatewayProcess(
            settings, {**env, "KODA_RATE_PER_S": "1000000", "KODA_RATE_BURST": "1000000"}
        )
        workers = [WorkerProcess(settings, f"w4w{i}", env) for i in range(WORKERS)]
        try:
            gw.start()
            for w in workers:
                w.start()
            wait_group(settings, settings.names.group(settings.worker_group), WORKERS, 300)
            # One one-token run per partition: every chain and connection is warm.
            warm = loader.insert(
                PARTITIONS,
                users_on_distinct_partitions(PARTITIONS, PARTITIONS, f"w4warm{b.rep}"),
                lambda i: {"text": f"{WARM} {i}"},
            )
            loader.publish(warm)
            loader.wait_terminal(warm.run_ids, 180, "w4 warm-up")

            def check() -> None:
                gw.check()
                for w in workers:
                    w.check()

            def settle() -> None:
                wait_until(
                    lambda: (
                        loader.query(
                            "SELECT count(*) AS n FROM runs WHERE NOT status = ANY(:t)",
                            t=list(TERMINAL),
                        )[0].n
                        == 0
                    ),
                    timeout=300,
                    interval=0.5,
                    what="koda's runs of the previous step to end",
                )
                b.settle_model()

            def fill_queue(arrivals: list[Arrival]) -> None:
                ids = [a.run_id for a in arrivals if a.run_id]
                rows = loader.query(
                    "SELECT id, extract(epoch FROM started_at - created_at) AS q"
                    " FROM runs WHERE id = ANY(:ids)",
                    ids=ids,
                )
                waits = {r.id: r.q for r in rows}
                for a in arrivals:
                    q = waits.get(a.run_id)
                    a.queue_s = float(q) if q is not None else math.nan

            pids = [gw.pid] + [w.pid for w in workers]
            if not getattr(args, "profile", None):
                return b.search(Koda(gw.url), pids, settle, fill_queue, check)
            # The same search with py-spy on the gateway and every worker; with
            # --start = --cap = --floor it is one step at that rate.
            out = Path(args.profile)
            out.mkdir(parents=True, exist_ok=True)
            names = ["gateway"] + [f"worker{i}" for i in range(len(workers))]
            spies = spy_on(list(zip(names, pids, strict=True)), out, 100, gil=True)
            before = {p: thread_cpu(p) for p in pids}
            try:
                return b.search(Koda(gw.url), pids, settle, fill_queue, check)
            finally:
                after = {p: thread_cpu(p) for p in pids}
                stop_spies(spies)
                for name, p in zip(names, pids, strict=True):
                    spent = {
                        t: after[p][t] - before[p].get(t, 0.0)
                        for t in after[p]
                        if after[p][t] - before[p].get(t, 0.0) > 0.05
                    }
                    print(
                        f"== {name}: CPU s by thread name: "
                        + ", ".join(
                            f"{t} {v:.1f}" for t, v in sorted(spent.items(), key=lambda x: -x[1])
                        )
                    )
                print_profiles(out, names)
        finally:
            for w in workers:
                w.stop()
            gw.stop()
            loader.close()


def measure_direct(b: Bench) -> Found:
    port = free_port()
    app = python_child(
        "bench-w4-direct",
        "tests.bench.direct_app",
        "--port",
        str(port),
        "--model-url",
        b.model_url,
    ).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(app, f"{url}/openapi.json")
        for i in range(20):  # warm: the app's first requests build its pool
            httpx.post(
                f"{url}/v1/chat", json={"text": f"{WARM} {i}"}, timeout=30
            ).raise_for_status()
        return b.search(Direct(url), [app.pid], b.settle_model, lambda _: None, app.check)
    finally:
        app.stop()


def one_rep(stack: StackInfo, args: argparse.Namespace, rep: int) -> dict[str, Found]:
    port = free_port()
    model = python_child(
        "bench-w4-model",
        "tests.bench.model_timing",
        "--port",
        str(port),
        "--seed",
        str(int(args.seed) + rep),
    ).start()
    model_url = f"http://127.0.0.1:{port}"
    try:
        wait_http(model, f"{model_url}/stats")
        b = Bench(args, rep, model_url, model.pid)
        only = getattr(args, "only", None)
        both = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        order = [x for x in both if not only or x == only]
        out: dict[str, Found] = {}
        for system in order:
            out[system] = measure_koda(stack, b) if system == "koda" else measure_direct(b)
        return out
    finally:
        model.stop()


# ---------------------------------------------------------------- the table


def ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1000


def pair(values: list[tuple[float, float]], digits: int = 0) -> str:
    """``a / b``, each the median [min-max] over the repetitions."""
    if not values:
        return "-"
    return f"{fmt([a for a, _ in values], digits)} / {fmt([b for _, b in values], digits)}"


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


# A row: its label, the figure of a step, the digits.
ROWS: list[tuple[str, Callable[[Step], float], int]] = [
    ("arrivals/s", lambda s: s.rate, 1),
    ("streams held, mean", lambda s: s.streams_mean, 0),
    ("streams held, max", lambda s: float(s.streams_max), 0),
    ("tokens/s delivered to viewers", lambda s: s.tokens_s, 0),
    ("CPU us per delivered token (system)", lambda s: s.cpu_per_token * 1e6, 1),
    ("system cores", lambda s: s.cores.get("system", math.nan), 2),
]
PAIRS: list[tuple[str, Callable[[Step], list[float]]]] = [
    ("yield->viewer p50 / p99 ms", lambda s: s.lat),
    ("queue wait p50 / p99 ms", lambda s: s.queue),
    ("added TTFC p50 / p99 ms", lambda s: s.added_ttfc),
]
APART: list[tuple[str, Callable[[Step], float], int]] = [
    ("model server cores (apart)", lambda s: s.cores.get("model", math.nan), 2),
    ("load generator cores (apart)", lambda s: s.cores.get("generator", math.nan), 2),
    ("load average, 1 min, at the step's end", lambda s: s.load1, 1),
]


def run_w4(stack: StackInfo, args: argparse.Namespace) -> Table:
    reps = [one_rep(stack, args, rep) for rep in range(args.repeat)]
    table = Table(
        f"W4 assistant load: Poisson arrivals, a user each; the model's first token after "
        f"300-800 ms, then 30-60 tokens/s, 200-800 tokens. koda (gateway + {WORKERS} "
        f"workers, openai handler, KODA_MAX_INFLIGHT={args.max_inflight}) and direct "
        "(FastAPI + httpx, no Kafka, no Postgres), each at the highest arrival rate it "
        f"sustains; steps of {args.warm_s:g} + {args.hold_s:g} s, {args.repeat} "
        "repetitions (median [min-max])",
        ["at each one's sustained rate", "koda", "direct", "koda / direct"],
    )
    both = [(r["koda"].best, r["direct"].best) for r in reps]
    paired = [(k, d) for k, d in both if k is not None and d is not None]
    for label, get, digits in ROWS:
        koda = [get(s) for s, _ in both if s is not None]
        direct = [get(s) for _, s in both if s is not None]
        ratios = [ratio(get(k), get(d)) for k, d in paired]
        table.add(label, fmt(koda, digits), fmt(direct, digits), fmt(ratios, 2) if ratios else "-")
    for label, values in PAIRS:
        cells = []
        for side in (0, 1):
            got = [x[side] for x in both if x[side] is not None]
            cells.append(pair([(ms(values(s), 0.5), ms(values(s), 0.99)) for s in got if s]))
        within = [
            (
                ratio(ms(values(k), 0.5), ms(values(d), 0.5)),
                ratio(ms(values(k), 0.99), ms(values(d), 0.99)),
            )
            for k, d in paired
        ]
        table.add(label, *cells, pair(within, 2))
    for label, get, digits in APART:
        koda = [get(s) for s, _ in both if s is not None]
        direct = [get(s) for _, s in both if s is not None]
        table.add(label, fmt(koda, digits), fmt(direct, digits), "")
    # A koda that sustains no rate holds no streams: a ratio of 0, not a missing figure.
    streams_ratio = [
        ratio(k.streams_mean, d.streams_mean) if k is not None else 0.0
        for k, d in both
        if d is not None
    ]
    koda_best = [k for k, _ in both if k is not None]
    table.figures = {
        "w4_koda_rate": [r["koda"].rate for r in reps],
        "w4_direct_rate": [r["direct"].rate for r in reps],
        "w4_streams_ratio": streams_ratio,
        "w4_ttfc_added50": [ms(s.added_ttfc, 0.5) for s in koda_best],
        "w4_ttfc_added99": [ms(s.added_ttfc, 0.99) for s in koda_best],
        "w4_cpu_token_ratio": [ratio(k.cpu_per_token, d.cpu_per_token) for k, d in paired],
    }
    table.notes.append(
        f"sustained: of the arrivals in the hold window none failed and each got its first "
        f"token, yield->viewer p99 <= {w4_load.LAT_P99_S * 1000:.0f} ms (every token received "
        f"in the window: receipt minus the model server's stamp in its text) and queue wait "
        f"p99 <= {w4_load.QUEUE_P99_S * 1000:.0f} ms (koda: runs.started_at - created_at; "
        "direct: request received -> model call started)"
    )
    table.notes.append(
        "added TTFC: POST sent -> first token at the viewer, minus the model's own time to "
        "first token for that prompt; streams held: open answer streams sampled every "
        f"{w4_load.SAMPLE_S * 1000:.0f} ms over the hold window; CPU: koda's gateway + "
        "workers, the direct app's process (Kafka, Postgres, the model server and the load "
        "generator not counted)"
    )
    table.notes.append(
        f"koda: KODA_CHUNK_BATCH_MS={args.window_ms}, KODA_CHUNK_COALESCE="
        f"{'true' if args.coalesce else 'false'}, KODA_MAX_INFLIGHT={args.max_inflight}"
    )
    for i, r in enumerate(reps):
        for system in SYSTEMS:
            found = r[system]
            table.notes.append(
                f"rep {i + 1} {system} search: "
                + ", ".join(
                    f"{s.rate:g} {'ok' if s.sustained else 'NO'} (p99 {ms(s.lat, 0.99):.0f}/"
                    f"{ms(s.queue, 0.99):.0f} ms, {s.failed} failed)"
                    for s in found.steps
                )
                + f" -> {found.rate:g}/s"
                + (" (the cap: it sustains at least that)" if found.rate >= args.cap else "")
            )
            best = found.best
            if best is not None:
                table.notes.append(f"rep {i + 1} {system} model server: {best.model_late}")
    table.notes.append(
        "koda: KODA_MEMORY=false (the direct app has no memory), "
        f"{PARTITIONS} partitions; the model server and load generator are unpinned on the "
        f"same {os.cpu_count()} cores"
    )
    return table


def add_args(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    ap.add_argument(f"--{prefix}start", type=float, default=4.0, help="first rate, arrivals/s")
    ap.add_argument(f"--{prefix}factor", type=float, default=2.0)
    ap.add_argument(f"--{prefix}cap", type=float, default=128.0, help="highest rate tried")
    ap.add_argument(f"--{prefix}floor", type=float, default=0.5, help="lowest rate tried")
    ap.add_argument(f"--{prefix}bisections", type=int, default=2)
    ap.add_argument(f"--{prefix}warm-s", type=float, default=20.0)
    ap.add_argument(f"--{prefix}hold-s", type=float, default=20.0)
    ap.add_argument(f"--{prefix}seed", type=int, default=1)
    ap.add_argument(f"--{prefix}max-inflight", type=int, default=512)
    ap.add_argument(f"--{prefix}window-ms", type=int, default=50, help="koda's KODA_CHUNK_BATCH_MS")
    ap.add_argument(
        f"--{prefix}coalesce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="koda's KODA_CHUNK_COALESCE",
    )


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.w4_assistant")
    add_args(ap)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=SYSTEMS, help="measure one system (no ratios)")
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="py-spy koda's gateway and workers during their search; raw stacks into DIR "
        "(profile one rate: --start R --cap R --floor R --only koda --repeat 1)",
    )
    args = ap.parse_args()
    with services() as stack:
        if args.only:  # each step's line is printed as it ends; no table of one side
            for rep in range(args.repeat):
                one_rep(stack, args, rep)
            return
        print(run_w4(stack, args).render())


if __name__ == "__main__":
    main()

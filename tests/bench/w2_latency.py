"""W2, latency: concurrent streamed runs, each watched by SSE viewers.

``--runs`` runs (default 200) of ``--chunks`` chunks (100) at ``--spacing-ms``
(20 ms) are submitted at once through the gateway, each by its own user on its
own partition (256 partitions, ``KODA_MAX_INFLIGHT`` high enough that every run
executes at once: a partition is a sequential chain, so runs sharing one would
queue). Each run has ``--viewers`` (2) connections to ``GET /v1/runs/{id}/events``.

* time to first chunk: POST sent -> first ``chunk`` event at the viewer;
* chunk latency: the handler's yield -> the viewer's receipt. The demo handler's
  ``stamp`` option prefixes each chunk with the wall clock at yield; the viewer
  stamps each network read on arrival (same machine, same clock).

    python -m tests.bench.w2_latency --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from dataclasses import dataclass, field

import aiohttp

from koda_runtime.localstack import StackInfo
from koda_runtime.topics.catalogue import RUN_CHUNKS
from tests.bench.common import (
    Loader,
    Table,
    demo_input,
    fmt,
    namespace,
    percentile,
    services,
    users_on_distinct_partitions,
    wait_group,
)
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import read_topic

PARTITIONS = 256
TERMINAL = {b"done", b"error", b"cancelled"}
_EVENT = re.compile(rb"event: ?(\w+)")
_ID = re.compile(rb"(?m)^id: ?(\d+)")
_STAMP = re.compile(rb'"content":"(\d+\.\d+) ')


@dataclass
class Viewer:
    """What one SSE connection saw."""

    first_chunk_at: float | None = None
    latencies: list[float] = field(default_factory=list)
    events: int = 0
    terminal: bool = False
    resets: int = 0
    repeated: int = 0  # events whose seq this connection had already received
    reconnect: bool = False


async def watch(session: aiohttp.ClientSession, run_id: str, user: str) -> Viewer:
    """Read the run's events to the end; stamp each network read on arrival."""
    seen = Viewer()
    buf = b""
    seqs: set[int] = set()
    async with session.get(
        f"/v1/runs/{run_id}/events", headers={"Authorization": f"Bearer dev:{user}"}
    ) as r:
        if r.status != 200:
            raise AssertionError(f"SSE {run_id}: HTTP {r.status}: {await r.text()}")
        async for data in r.content.iter_any():
            now = time.time()
            buf += data
            *frames, buf = buf.split(b"\n\n")
            for frame in frames:
                m = _EVENT.search(frame)
                if m is None:
                    continue  # keep-alive comment or retry hint
                seen.events += 1
                kind = m.group(1)
                sid = _ID.search(frame)
                if sid is not None:
                    seq = int(sid.group(1))
                    seen.repeated += seq in seqs
                    seqs.add(seq)
                if kind == b"reset":
                    seen.resets += 1
                elif kind == b"reconnect":
                    seen.reconnect = True
                if kind == b"chunk":
                    stamp = _STAMP.search(frame)
                    if stamp is not None:
                        seen.latencies.append(now - float(stamp.group(1)))
                    if seen.first_chunk_at is None:
                        seen.first_chunk_at = now
                elif kind in TERMINAL:
                    seen.terminal = True
    return seen


async def one_round(
    url: str, users: list[str], chunks: int, spacing_ms: int, viewers: int
) -> tuple[list[float], list[float], dict[str, int]]:
    """Submit every run at once, follow each with ``viewers`` streams."""
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(base_url=url, connector=conn, timeout=timeout) as session:

        async def run(i: int, user: str) -> list[tuple[float, Viewer]]:
            body = {"input": demo_input(i, chunks, spacing_ms, stamp=True)}
            sent = time.time()
            async with session.post(
                "/v1/runs", json=body, headers={"Authorization": f"Bearer dev:{user}"}
            ) as r:
                got = await r.json()
                if r.status != 202:
                    raise AssertionError(f"POST -> {r.status}: {got}")
            seen = await asyncio.gather(
                *(watch(session, got["run_id"], user) for _ in range(viewers))
            )
            return [(sent, v) for v in seen]

        results = await asyncio.gather(*(run(i, u) for i, u in enumerate(users)))
    ttfc: list[float] = []
    lat: list[float] = []
    counts = {"incomplete": 0, "resets": 0, "repeated": 0, "cut": 0}
    for per_run in results:
        for sent, v in per_run:
            if v.first_chunk_at is not None:
                ttfc.append(v.first_chunk_at - sent)
            lat += v.latencies
            counts["incomplete"] += not v.terminal
            counts["resets"] += v.resets
            counts["repeated"] += v.repeated
            counts["cut"] += v.reconnect
    return ttfc, lat, counts


def produce_delays(settings) -> list[float]:
    """Handler yield -> the chunk record's create timestamp, for every stamped chunk."""
    out = []
    for msg in read_topic(settings, settings.names.topic(RUN_CHUNKS), timeout=60):
        stamp = _STAMP.search(msg.value() or b"")
        if stamp is not None:
            out.append(msg.timestamp()[1] / 1000 - float(stamp.group(1)))
    return out


def run_w2(stack: StackInfo, args: argparse.Namespace) -> Table:
    rounds: list[dict[str, float]] = []
    for rep in range(args.repeat):
        with namespace(
            stack, partitions=PARTITIONS, chunk_batch_ms=20, max_inflight=args.max_inflight
        ) as settings:
            loader = Loader(settings)
            gw = GatewayProcess(
                settings, {"KODA_RATE_PER_S": "1000000", "KODA_RATE_BURST": "1000000"}
            )
            workers = [WorkerProcess(settings, f"w{i}") for i in range(args.workers)]
            try:
                gw.start()
                for w in workers:
                    w.start()
                wait_group(settings, settings.names.group(settings.worker_group), args.workers)
                warm_users = users_on_distinct_partitions(PARTITIONS, PARTITIONS, "warm")
                warm = loader.insert(PARTITIONS, warm_users, lambda i: demo_input(i, 1))
                loader.publish(warm)
                loader.wait_terminal(warm.run_ids, 180, "warm-up")
                users = users_on_distinct_partitions(PARTITIONS, args.runs, f"lat{rep}")
                t = time.monotonic()
                ttfc, lat, counts = asyncio.run(
                    one_round(gw.url, users, args.chunks, args.spacing_ms, args.viewers)
                )
                produced = produce_delays(settings)
                r = {
                    "prod50": percentile(produced, 0.5) * 1000,
                    "prod99": percentile(produced, 0.99) * 1000,
                    "ttfc50": percentile(ttfc, 0.5) * 1000,
                    "ttfc99": percentile(ttfc, 0.99) * 1000,
                    "lat50": percentile(lat, 0.5) * 1000,
                    "lat99": percentile(lat, 0.99) * 1000,
                    "samples": len(lat),
                    **counts,
                    "wall": time.monotonic() - t,
                }
                rounds.append(r)
                print(
                    f"  w2 rep {rep + 1}/{args.repeat}: ttfc p50 {r['ttfc50']:.0f} ms "
                    f"p99 {r['ttfc99']:.0f} ms, chunk p50 {r['lat50']:.1f} ms "
                    f"p99 {r['lat99']:.1f} ms (yield -> produced p50 {r['prod50']:.1f} "
                    f"p99 {r['prod99']:.1f} ms), {len(lat)} samples, "
                    f"streams cut {counts['cut']}, unfinished {counts['incomplete']}, "
                    f"resets {counts['resets']}, repeated seqs {counts['repeated']}, "
                    f"{r['wall']:.1f} s",
                    flush=True,
                )
            finally:
                for w in workers:
                    w.stop()
                gw.stop()
                loader.close()
    table = Table(
        f"W2 latency: {args.runs} concurrent runs x {args.chunks} chunks every "
        f"{args.spacing_ms} ms, {args.viewers} SSE viewers each, {args.workers} workers, "
        f"{args.repeat} repetitions (median [min-max])",
        ["figure", "p50 ms", "p99 ms", "goal", "met"],
    )
    table.add(
        "time to first chunk (POST -> first chunk at viewer)",
        fmt([r["ttfc50"] for r in rounds]),
        fmt([r["ttfc99"] for r in rounds]),
        "-",
        "-",
    )
    p99 = sorted(r["lat99"] for r in rounds)[len(rounds) // 2]
    table.add(
        "chunk latency (handler yield -> viewer receipt)",
        fmt([r["lat50"] for r in rounds], 1),
        fmt([r["lat99"] for r in rounds], 1),
        "p99 <= 50",
        "yes" if p99 <= 50 else "NO",
    )
    table.add(
        "  of which: yield -> chunk record created by the worker's producer",
        fmt([r["prod50"] for r in rounds], 1),
        fmt([r["prod99"] for r in rounds], 1),
        "-",
        "-",
    )
    table.notes.append(
        "per repetition: chunk receipts / streams the gateway cut (told to reconnect) / "
        "resets seen / repeated seqs: "
        + "; ".join(
            f"{int(r['samples'])}/{int(r['cut'])}/{int(r['resets'])}/{int(r['repeated'])}"
            for r in rounds
        )
    )
    table.notes.append(
        "a viewer cut off by the gateway does not reconnect here: its latencies stop at the cut"
    )
    table.notes.append(
        f"KODA_CHUNK_BATCH_MS=20 (the default batching window), "
        f"KODA_MAX_INFLIGHT={args.max_inflight} per worker"
    )
    return table


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=100)
    ap.add_argument("--spacing-ms", type=int, default=20)
    ap.add_argument("--viewers", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-inflight", type=int, default=110)
    ap.add_argument("--repeat", type=int, default=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_args(ap)
    args = ap.parse_args()
    with services() as stack:
        print(run_w2(stack, args).render())


if __name__ == "__main__":
    main()

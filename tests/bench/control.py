"""Run control latency: cancel and merge while 200 runs stream on 2 workers.

Per repetition, ``--runs`` long runs (default 200, each on its own partition and
user, 1,000 chunks every 20 ms) are submitted through one gateway and watched by one
SSE viewer each. Once every viewer has its first chunk, ``--cancels`` of them are
cancelled and ``--merges`` others get a second message, one request every
``--spacing-ms``, while the rest keep streaming. Measured:

* cancel -> handler stopped: POST sent -> the worker's ``attempt stopped`` log line
  (its millisecond timestamp; same machine, same clock);
* cancel -> viewer: POST sent -> the ``cancelled`` event at the run's viewer;
* merge -> reset: POST sent -> the ``reset`` event at the run's viewer.

    python -m tests.bench.control --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from datetime import datetime

import aiohttp

from koda_runtime.localstack import StackInfo
from tests.bench import ssewatch
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
from tests.bench.ssewatch import TERMINAL
from tests.fixtures.processes import GatewayProcess, WorkerProcess

PARTITIONS = 256
_STAMP = re.compile(rb'"content":"(\d+\.\d+) ')
_STOPPED = re.compile(r"ts=(\S+ \S+) .*attempt stopped run_id=(\S+) by=(\w+)")


@dataclass
class Viewer:
    first_chunk: asyncio.Event
    reset_at: float | None = None
    cancelled_at: float | None = None
    ended: bool = False
    # (receipt time, handler yield -> receipt) of every stamped chunk
    lags: list[tuple[float, float]] = field(default_factory=list)


async def watch(session: aiohttp.ClientSession, run_id: str, user: str, v: Viewer) -> None:
    stream = ssewatch.events(session, run_id, user)
    async with contextlib.aclosing(stream):
        async for now, kind, frame in stream:
            if kind == b"chunk":
                v.first_chunk.set()
                stamp = _STAMP.search(frame)
                if stamp is not None:
                    v.lags.append((now, now - float(stamp.group(1))))
            elif kind == b"reset" and v.reset_at is None:
                v.reset_at = now
            elif kind in TERMINAL:
                if kind == b"cancelled":
                    v.cancelled_at = now
                v.ended = True
                return


async def one_round(
    url: str, users: list[str], args: argparse.Namespace
) -> tuple[dict[str, float], dict[str, float], dict[str, float], int, list[float]]:
    """Returns POST sent times of cancels and merges, viewer times, and unfinished count."""
    # uvicorn closes a connection idle for 5 s; a client that kept it longer could pick
    # it for a request at that moment and fail writing ("closing transport"). Idle ones
    # are dropped here first.
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
    timeout = aiohttp.ClientTimeout(total=900)
    cancel_sent: dict[str, float] = {}
    merge_sent: dict[str, float] = {}
    async with aiohttp.ClientSession(base_url=url, connector=conn, timeout=timeout) as session:

        async def submit(i: int, user: str) -> tuple[str, str, str]:
            body = {"input": demo_input(i, args.chunks, args.spacing_chunk_ms, stamp=True)}
            async with session.post(
                "/v1/runs", json=body, headers={"Authorization": f"Bearer dev:{user}"}
            ) as r:
                got = await r.json()
                if r.status != 202:
                    raise AssertionError(f"POST -> {r.status}: {got}")
            return got["run_id"], user, ""

        runs = list(await asyncio.gather(*(submit(i, u) for i, u in enumerate(users))))
        viewers = {rid: Viewer(asyncio.Event()) for rid, _, _ in runs}
        tasks = [
            asyncio.create_task(watch(session, rid, user, viewers[rid])) for rid, user, _ in runs
        ]
        await asyncio.wait_for(
            asyncio.gather(*(v.first_chunk.wait() for v in viewers.values())), 120
        )
        sessions = {}
        for rid, user, _ in runs:
            async with session.get(
                f"/v1/runs/{rid}", headers={"Authorization": f"Bearer dev:{user}"}
            ) as r:
                sessions[rid] = (await r.json())["session_id"]
        to_cancel = runs[: args.cancels]
        to_merge = runs[args.cancels : args.cancels + args.merges]

        async def cancel(rid: str, user: str) -> None:
            cancel_sent[rid] = time.time()
            async with session.post(
                f"/v1/runs/{rid}/cancel",
                json={"reason": "bench"},
                headers={"Authorization": f"Bearer dev:{user}"},
            ) as r:
                if r.status not in (200, 202):
                    raise AssertionError(f"cancel -> {r.status}: {await r.text()}")

        async def merge(rid: str, user: str) -> None:
            merge_sent[rid] = time.time()
            body = {"session_id": sessions[rid], "input": {"text": "and also this"}}
            async with session.post(
                "/v1/runs", json=body, headers={"Authorization": f"Bearer dev:{user}"}
            ) as r:
                got = await r.json()
                if r.status != 202 or not got.get("merged"):
                    raise AssertionError(f"merge -> {r.status}: {got}")

        window_start = time.time()
        ops = []
        pairs = list(zip(to_cancel, to_merge, strict=False))
        for (crid, cuser, _), (mrid, muser, _) in pairs:
            ops.append(asyncio.create_task(cancel(crid, cuser)))
            await asyncio.sleep(args.spacing_ms / 1000)
            ops.append(asyncio.create_task(merge(mrid, muser)))
            await asyncio.sleep(args.spacing_ms / 1000)
        await asyncio.gather(*ops)

        def seen() -> bool:
            return all(viewers[rid].cancelled_at is not None for rid, _, _ in to_cancel) and all(
                viewers[rid].reset_at is not None for rid, _, _ in to_merge
            )

        deadline = time.monotonic() + 60
        while not seen() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        window_end = time.time()
        # End every run (not measured) so the round finishes quickly.
        cancelled = {rid for rid, _, _ in to_cancel}
        await asyncio.gather(*(cancel(rid, user) for rid, user, _ in runs if rid not in cancelled))
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
    to_viewer = {
        rid: viewers[rid].cancelled_at - cancel_sent[rid]  # type: ignore[operator]
        for rid, _, _ in to_cancel
        if viewers[rid].cancelled_at is not None
    }
    to_reset = {
        rid: viewers[rid].reset_at - merge_sent[rid]  # type: ignore[operator]
        for rid, _, _ in to_merge
        if viewers[rid].reset_at is not None
    }
    missing = len(to_cancel) - len(to_viewer) + len(to_merge) - len(to_reset)
    # How far behind the output pipeline was while the requests were measured.
    lags = [lag for v in viewers.values() for at, lag in v.lags if window_start <= at <= window_end]
    return cancel_sent, to_viewer, to_reset, missing, lags


def stop_times(logs: str) -> dict[str, float]:
    """run_id -> wall time of the first ``attempt stopped ... by=cancelled`` line."""
    out: dict[str, float] = {}
    for m in _STOPPED.finditer(logs):
        if m.group(3) != "cancelled" or m.group(2) in out:
            continue
        out[m.group(2)] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return out


def run_control(stack: StackInfo, args: argparse.Namespace) -> Table:
    rounds: list[dict[str, float]] = []
    for rep in range(args.repeat):
        with namespace(
            stack, partitions=PARTITIONS, chunk_batch_ms=20, max_inflight=args.max_inflight
        ) as settings:
            loader = Loader(settings)
            # The window only decides whether a message merges; the set-up of 200
            # streaming runs can outlast the default 30 s on a loaded machine.
            gw = GatewayProcess(
                settings,
                {
                    "KODA_RATE_PER_S": "1000000",
                    "KODA_RATE_BURST": "1000000",
                    "KODA_MAX_ACTIVE_RUNS_PER_USER": "1000000",
                    "KODA_MERGE_WINDOW_S": "600",
                },
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
                users = users_on_distinct_partitions(PARTITIONS, args.runs, f"ctl{rep}")
                t = time.monotonic()
                sent, to_viewer, to_reset, missing, lags = asyncio.run(
                    one_round(gw.url, users, args)
                )
                stopped = stop_times("".join(w.log() for w in workers))
                to_stop = [stopped[r] - sent[r] for r in to_viewer if r in stopped]
                viewer = list(to_viewer.values())
                reset = list(to_reset.values())
                r = {
                    "stop50": percentile(to_stop, 0.5) * 1000,
                    "stop99": percentile(to_stop, 0.99) * 1000,
                    "view50": percentile(viewer, 0.5) * 1000,
                    "view99": percentile(viewer, 0.99) * 1000,
                    "reset50": percentile(reset, 0.5) * 1000,
                    "reset99": percentile(reset, 0.99) * 1000,
                    "lag50": percentile(lags, 0.5) * 1000,
                    "lag99": percentile(lags, 0.99) * 1000,
                    "missing": missing,
                    "samples": len(viewer) + len(reset),
                    "wall": time.monotonic() - t,
                }
                rounds.append(r)
                print(
                    f"  control rep {rep + 1}/{args.repeat}: cancel->stop p50 "
                    f"{r['stop50']:.0f} p99 {r['stop99']:.0f} ms, cancel->viewer p50 "
                    f"{r['view50']:.0f} p99 {r['view99']:.0f} ms, merge->reset p50 "
                    f"{r['reset50']:.0f} p99 {r['reset99']:.0f} ms, chunk lag meanwhile p50 "
                    f"{r['lag50']:.0f} p99 {r['lag99']:.0f} ms, "
                    f"{int(r['samples'])} samples, {missing} never seen, {r['wall']:.1f} s",
                    flush=True,
                )
            finally:
                for w in workers:
                    w.stop()
                gw.stop()
                loader.close()
    table = Table(
        f"Run control: {args.runs} runs streaming on {args.workers} workers; "
        f"{args.cancels} cancels and {args.merges} merges, one request every "
        f"{args.spacing_ms} ms; {args.repeat} repetitions (median [min-max])",
        ["figure", "p50 ms", "p99 ms", "goal", "met"],
    )

    def row(name: str, key: str, goal: float | None) -> None:
        p99 = sorted(r[f"{key}99"] for r in rounds)[len(rounds) // 2]
        table.add(
            name,
            fmt([r[f"{key}50"] for r in rounds]),
            fmt([r[f"{key}99"] for r in rounds]),
            "-" if goal is None else f"p99 <= {goal:.0f}",
            "-" if goal is None else ("yes" if p99 <= goal else "NO"),
        )

    row("cancel: POST -> handler stopped (worker log)", "stop", None)
    row("cancel: POST -> `cancelled` event at the viewer", "view", 250)
    row("merge: POST -> `reset` event at the viewer", "reset", 500)
    row("meanwhile, any chunk: handler yield -> viewer (pipeline lag)", "lag", None)
    table.notes.append(
        "requests never seen by their viewer, per repetition: "
        + ", ".join(str(int(r["missing"])) for r in rounds)
    )
    table.notes.append(
        f"KODA_CHUNK_BATCH_MS=20, KODA_MERGE_WINDOW_S=600, "
        f"KODA_MAX_INFLIGHT={args.max_inflight} per worker, "
        f"{args.chunks} chunks every {args.spacing_chunk_ms} ms per run"
    )
    return table


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=1000)
    ap.add_argument("--spacing-chunk-ms", type=int, default=20)
    ap.add_argument("--cancels", type=int, default=50)
    ap.add_argument("--merges", type=int, default=50)
    ap.add_argument("--spacing-ms", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-inflight", type=int, default=110)
    ap.add_argument("--repeat", type=int, default=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_args(ap)
    args = ap.parse_args()
    with services() as stack:
        print(run_control(stack, args).render())


if __name__ == "__main__":
    main()

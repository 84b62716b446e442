"""Profile koda under W1 with py-spy: where the worker's (and gateway's) time goes.

Starts the W1 setup (``--through gateway`` or straight to the topic), attaches
``py-spy record`` to every koda process for the measured runs, and prints each
process's top frames by inclusive share of samples (collapsed stacks are kept in
``--out`` for flame graphs: ``py-spy`` format ``raw``).

    python -m tests.bench.profile --runs 3000 --workers 2 --through topic
    python -m tests.bench.profile --runs 3000 --workers 2 --through gateway

``--through w3`` profiles the gateway alone under W3's load: no workers, ``--runs``
POSTs at ``--concurrency`` (the runs stay pending).

    python -m tests.bench.profile --through w3 --runs 4000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

from tests.bench.common import (
    Loader,
    demo_input,
    namespace,
    services,
    users_on_distinct_partitions,
    wait_group,
)
from tests.bench.w1_throughput import PARTITIONS, TOKENS, post_runs
from tests.fixtures.processes import GatewayProcess, WorkerProcess


def pyspy() -> str:
    found = shutil.which("py-spy") or str(Path(__import__("sys").executable).parent / "py-spy")
    return found


def top_frames(raw: Path, n: int = 25, own: bool = False) -> list[tuple[float, str]]:
    """Frames by share of samples: inclusive (default) or self (``own``)."""
    total = 0
    counts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, num = line.rpartition(" ")
        if not num.isdigit():
            continue
        k = int(num)
        total += k
        frames = stack.split(";")
        if own:
            counts[frames[-1]] += k
        else:
            for f in set(frames):
                counts[f] += k
    return [(100.0 * c / max(1, total), f) for f, c in counts.most_common(n)]


def spy_on(
    targets: list[tuple[str, int]], out: Path, rate: int, gil: bool = False, threads: bool = False
) -> list[subprocess.Popen[bytes]]:
    """``py-spy record`` attached to each (name, pid), raw stacks into ``out/<name>.txt``;
    returns once they have (about a second)."""
    spies = []
    for name, pid in targets:
        argv = [pyspy(), "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate)]
        argv += ["--nonblocking", "-o", str(out / f"{name}.txt")]
        argv += (["--gil"] if gil else []) + (["--threads"] if threads else [])
        spies.append(
            subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: S603
        )
    # py-spy gives no sign once it has attached: a second is its start-up, and a
    # profile missing the load's first second loses nothing.
    time.sleep(1)
    return spies


def stop_spies(spies: list[subprocess.Popen[bytes]]) -> None:
    """SIGINT each py-spy (it writes its file then) and wait for it."""
    for spy in spies:
        spy.send_signal(2)
    for spy in spies:
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.kill()


def print_profiles(out: Path, names: list[str]) -> None:
    """Each recorded process's top frames, inclusive and self."""
    for name in names:
        raw = out / f"{name}.txt"
        if not raw.exists():
            continue
        print(f"\n== {name}: top frames, inclusive % of samples ({raw})")
        for pct, frame in top_frames(raw):
            print(f"{pct:6.1f}  {frame[:150]}")
        print(f"== {name}: top frames, self %")
        for pct, frame in top_frames(raw, 15, own=True):
            print(f"{pct:6.1f}  {frame[:150]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--through", choices=["topic", "gateway", "w3"], default="topic")
    ap.add_argument("--concurrency", type=int, default=64, help="POSTs in flight (gateway, w3)")
    ap.add_argument("--out", default="/tmp/koda-profile")
    ap.add_argument(
        "--ledger-off", action="store_true", help="KODA_COST_LEDGER=false: no ledger rows"
    )
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--gil", action="store_true", help="sample only the thread holding the GIL")
    ap.add_argument("--threads", action="store_true", help="keep thread ids in the stacks")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with services() as stack, namespace(stack, partitions=PARTITIONS, chunk_batch_ms=20) as st:
        loader = Loader(st)
        w3 = args.through == "w3"
        off = {"KODA_COST_LEDGER": "false"} if args.ledger_off else {}
        workers = (
            [] if w3 else [WorkerProcess(st, f"w{i}", off).start() for i in range(args.workers)]
        )
        gw = None
        if args.through in ("gateway", "w3"):
            gw = GatewayProcess(
                st,
                {
                    "KODA_RATE_PER_S": "1000000",
                    "KODA_RATE_BURST": "1000000",
                    "KODA_MAX_ACTIVE_RUNS_PER_USER": "1000000",
                    **off,
                },
            ).start()
        spies: list[subprocess.Popen[bytes]] = []
        try:
            if w3:
                assert gw is not None
                asyncio.run(post_runs(gw.url, ["warm"] * 100, [{"text": "w"}] * 100, 8))
            else:
                wait_group(st, st.names.group(st.worker_group), args.workers)
                warm = loader.insert(
                    PARTITIONS,
                    users_on_distinct_partitions(PARTITIONS, PARTITIONS, "warm"),
                    lambda i: demo_input(i, 1),
                )
                loader.publish(warm)
                loader.wait_terminal(warm.run_ids, 120, "warm-up")
            targets = [(str(w.worker_id), w.pid) for w in workers]
            if gw is not None:
                assert gw.proc is not None
                targets.append(("gateway", gw.proc.pid))
            spies = spy_on(targets, out, args.rate, args.gil, args.threads)
            t0 = time.time()
            if gw is not None:
                inputs = [demo_input(i, TOKENS) for i in range(args.runs)]
                who = [f"u-{i % args.users}" for i in range(args.runs)]
                ids, _ = asyncio.run(post_runs(gw.url, who, inputs, args.concurrency))
                if w3:
                    wall = time.time() - t0
                    print(
                        f"profiled {args.runs} POSTs at {args.concurrency}: {len(ids) / wall:.0f}/s"
                    )
            else:
                loaded = loader.insert(args.runs, args.users, lambda i: demo_input(i, TOKENS), "u")
                t0 = time.time()
                loader.publish(loaded)
                ids = loaded.run_ids
            if not w3:
                loader.wait_terminal(ids, 1800, "profiled runs")
                res = loader.outcome(ids, t0)
                print(
                    f"profiled {args.runs} runs through {args.through}, {args.workers} workers: "
                    f"{res['runs_s']:.0f} runs/s, {res['chunks_s']:.0f} chunks/s"
                )
        finally:
            stop_spies(spies)
            for w in workers:
                w.stop()
            if gw is not None:
                gw.stop()
            loader.close()
        print_profiles(out, [name for name, _ in targets])


if __name__ == "__main__":
    main()

"""Handoff benchmark: planned (SIGTERM) versus crash (kill -9), and what a rebalance
does to long runs in flight.

*Handoff*: for each of a worker's partitions a 3-second run is in flight and a short
run waits behind it. The worker is stopped; we measure how long the successor takes
to start the waiting runs. Median, min and max over the repetitions.

*Rebalances* (tests/bench/rebalance.py says how each figure is taken): a join (3
workers + 1), a leave (SIGTERM 1 of 3), a rolling restart of 3 workers and a kill -9
of 1 of 3, each with 24 users' 40-second runs streaming. One table.

    make bench-handoff                                   # everything
    make bench-handoff BENCH_ARGS="--only join kill --save /tmp/after.json"
    python -m tests.bench.handoff --compare /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from koda_runtime.localstack import StackInfo
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import partition_for_key
from tests.bench.common import Table, namespace, services
from tests.bench.rebalance import LABELS, SCENARIOS, Config, run_scenarios
from tests.fixtures.processes import ROOT, WorkerProcess
from tests.fixtures.runs import Submitter
from tests.support import wait_until

STOPS = ("sigterm", "kill -9")


# ---------------------------------------------------------------- planned vs crash


def owners(sub: Submitter) -> dict[int, str]:
    return {
        r.partition: r.worker_id
        for r in sub.query("SELECT partition, worker_id FROM partition_epochs")
    }


def one_round(
    settings: Settings, sub: Submitter, victim: WorkerProcess, how: str, tag: str
) -> tuple[float, float]:
    held = sorted(p for p, w in owners(sub).items() if w == victim.worker_id)
    users = {}
    for i in range(10_000):
        u = f"{tag}-{i}"
        p = partition_for_key(u.encode(), settings.partitions)
        if p in held and p not in users:
            users[p] = u
        if len(users) == len(held):
            break
    long_ids = [
        sub.submit(u, {"text": "long", "demo": {"tokens": 15, "delay_ms": 200}})
        for u in users.values()
    ]
    wait_until(lambda: all(s == "streaming" for s in sub.statuses(long_ids).values()), timeout=60)
    next_ids = [
        sub.submit(u, {"text": "next", "demo": {"tokens": 1, "delay_ms": 1}})
        for u in users.values()
    ]
    t0 = time.time()
    victim.signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    assert victim.proc is not None
    victim.proc.wait(60)
    t_exit = time.time()
    wait_until(lambda: sub.all_terminal(next_ids), timeout=120)
    started = sub.query(
        "SELECT max(extract(epoch FROM started_at)) AS latest FROM runs WHERE id = ANY(:i)",
        i=next_ids,
    )[0].latest
    return t_exit - t0, float(started) - t_exit


def run_handoff(stack: StackInfo, repeat: int) -> dict[str, Any]:
    """Drain and successor-start seconds per stop, ``repeat`` rounds of each."""
    results: dict[str, dict[str, list[float]]] = {h: {"drain": [], "start": []} for h in STOPS}
    with namespace(stack) as settings:
        sub = Submitter(settings)
        survivor = WorkerProcess(settings, "survivor").start()
        try:
            for n, how in enumerate(STOPS * repeat, start=1):
                victim = WorkerProcess(settings, f"victim-{n}").start()
                expected = {"survivor", victim.worker_id}

                def owned_by(e: set[str | None] = expected) -> bool:
                    return set(owners(sub).values()) == e

                wait_until(owned_by, timeout=90)
                drain, start = one_round(settings, sub, victim, how, f"r{n}")
                results[how]["drain"].append(drain)
                results[how]["start"].append(start)
        finally:
            survivor.stop()
            sub.close()
        return {"settings": knobs(settings), "stops": results}


def handoff_table(data: dict[str, Any]) -> Table:
    k = data["settings"]
    table = Table(
        f"Handoff: session timeout {k['session_timeout_s']:.0f} s, heartbeat "
        f"{k['heartbeat_interval_s']:.0f} s, ceiling {k['handoff_ceiling_s']:.0f} s, "
        "3 s runs in flight (median [min-max])",
        ["stop", "drain (stop->exit) s", "successor starts after exit s"],
    )
    for how in STOPS:
        rows = data["stops"][how]
        table.add(how, spread(rows["drain"]), spread(rows["start"]))
    return table


# ---------------------------------------------------------------- tables


def spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (
        f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"
        if len(values) > 1
        else f"{values[0]:.2f}"
    )


COLUMNS: list[tuple[str, Any]] = [
    ("runs in flight", lambda r: str(r["in_flight"])),
    ("partitions moved", lambda r: str(r["partitions_moved"])),
    ("re-fenced, stayed", lambda r: str(r["partitions_refenced"])),
    ("runs cut", lambda r: str(r["cut"])),
    ("cut: staying", lambda r: str(r["cut_staying"])),
    ("cut: moved", lambda r: str(r["cut_moved"])),
    ("started again", lambda r: f"{r['restarted']} ({100 * r['restarted_share']:.0f}%)"),
    ("pause staying max s", lambda r: seconds(r["pause_staying_max_s"])),
    ("pause staying p50 s", lambda r: seconds(r["pause_staying_p50_s"])),
    ("moved resume max s", lambda r: seconds(r["resume_moved_max_s"])),
    ("stopped worker's resume max s", lambda r: seconds(r.get("victim_resume_max_s"))),
]


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def scenario_title(meta: dict[str, Any]) -> str:
    c = meta["rebalance"]
    return (
        f"Rebalances: {c['workers']} workers, {c['users']} users on distinct partitions of "
        f"{c['partitions']}, runs of {c['tokens']} chunks x {c['delay_ms']} ms "
        f"({c['tokens'] * c['delay_ms'] / 1000:.0f} s), ceiling {c['handoff_ceiling_s']:.0f} s, "
        f"session timeout {c['session_timeout_s']:.0f} s"
    )


def scenario_notes(table: Table, meta: dict[str, Any]) -> None:
    c = meta["rebalance"]
    table.notes += [
        "pauses and resumes from Postgres messages.created_at (the group commit of each "
        f"chunk), holders from partition_epochs sampled every 0.2 s; chunks are "
        f"{c['delay_ms']} ms apart when nothing pauses",
        "staying = the partition's holder did not change during the step; moved resume = "
        "step's action -> first message of the run's next attempt; stopped worker's "
        "resume: the same over the partitions the stopped or killed worker held",
        f"kill -9 target: dead worker's partitions resume within session timeout + 3 s = "
        f"{c['session_timeout_s'] + 3:.0f} s",
    ]


def scenario_table(saved: dict[str, Any]) -> Table:
    table = Table(scenario_title(saved["meta"]), ["scenario", *(c for c, _ in COLUMNS)])
    for name, r in saved["scenarios"].items():
        table.add(LABELS[name], *(cell(r) for _, cell in COLUMNS))
    scenario_notes(table, saved["meta"])
    return table


def compare_tables(before: dict[str, Any], after: dict[str, Any]) -> list[Table]:
    """Before/after of two saved results: one row per scenario, cells ``before -> after``."""
    tables = []
    mb, ma = before["meta"], after["meta"]
    names = [n for n in SCENARIOS if n in before["scenarios"] and n in after["scenarios"]]
    if names:
        table = Table(
            f"{scenario_title(ma)}; before -> after",
            ["scenario", *(c for c, _ in COLUMNS)],
        )
        for name in names:
            b, a = before["scenarios"][name], after["scenarios"][name]
            table.add(LABELS[name], *(f"{cell(b)} -> {cell(a)}" for _, cell in COLUMNS))
        scenario_notes(table, ma)
        if mb["rebalance"] != ma["rebalance"]:
            table.notes.append(f"before's configuration differs: {scenario_title(mb)}")
        tables.append(table)
    if before.get("handoff") and after.get("handoff"):
        table = Table(
            "Handoff, 3 s runs in flight (median [min-max]); before -> after",
            ["stop", "drain (stop->exit) s", "successor starts after exit s"],
        )
        for how in STOPS:
            b, a = before["handoff"]["stops"][how], after["handoff"]["stops"][how]
            table.add(
                how,
                f"{spread(b['drain'])} -> {spread(a['drain'])}",
                f"{spread(b['start'])} -> {spread(a['start'])}",
            )
        tables.append(table)
    for table in tables:
        table.notes += [f"before: {describe(mb)}", f"after: {describe(ma)}"]
    return tables


def describe(meta: dict[str, Any]) -> str:
    return f"{meta['commit']} ({meta['subject']}), {meta['at']}"


# ---------------------------------------------------------------- running


def knobs(settings: Settings) -> dict[str, Any]:
    return {
        "partitions": settings.partitions,
        "handoff_ceiling_s": settings.handoff_ceiling_s,
        "session_timeout_s": settings.session_timeout_s,
        "heartbeat_interval_s": settings.heartbeat_interval_s,
        "rebalance_timeout_s": settings.rebalance_timeout_s,
    }


def git(*args: str) -> str:
    return subprocess.run(  # noqa: S603
        ["git", "-C", str(ROOT), *args],  # noqa: S607
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.handoff")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of each stop (handoff)")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=["handoff", *SCENARIOS],
        default=["handoff", *SCENARIOS],
    )
    ap.add_argument("--save", type=Path, help="also write the figures as JSON to this file")
    ap.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("BEFORE", "AFTER"),
        help="print before/after tables from two saved files (runs nothing)",
    )
    ap.add_argument("--partitions", type=int, default=32)
    ap.add_argument(
        "--static",
        action="store_true",
        help="the scenarios' workers join with static membership (KODA_STATIC_MEMBERSHIP)",
    )
    ap.add_argument(
        "--session-timeout",
        type=float,
        default=6.0,
        help="KODA_SESSION_TIMEOUT for the scenarios, s",
    )
    ap.add_argument("--ceiling", type=float, default=20.0, help="KODA_HANDOFF_CEILING, s")
    ap.add_argument("--users", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--delay-ms", type=int, default=100)
    ap.add_argument("--lead", type=float, default=5.0, help="s the runs stream before a step")
    return ap.parse_args()


def main() -> None:
    args = parse()
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        for table in compare_tables(before, after):
            print()
            print(table.render())
        return
    config = Config(users=args.users, tokens=args.tokens, delay_ms=args.delay_ms, lead_s=args.lead)
    # Every worker must be able to hold all the runs it gets after a leave or a kill.
    overrides = {
        "partitions": args.partitions,
        "handoff_ceiling_s": args.ceiling,
        "max_inflight": max(8, args.users),
        "static_membership": args.static,
        "session_timeout_s": args.session_timeout,
    }
    started = time.monotonic()
    load0 = os.getloadavg()
    saved: dict[str, Any] = {"handoff": None, "scenarios": {}}
    with services() as stack:
        if "handoff" in args.only:
            saved["handoff"] = run_handoff(stack, args.repeat)
        names = [n for n in SCENARIOS if n in args.only]
        if names:
            saved["scenarios"] = run_scenarios(stack, names, config, overrides)
        probe = next(iter(saved["scenarios"].values()), None)
    saved["meta"] = {
        "commit": git("rev-parse", "--short", "HEAD"),
        "subject": git("log", "-1", "--format=%s"),
        "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "load": [load0, os.getloadavg()],
        "minutes": (time.monotonic() - started) / 60,
        "rebalance": {
            "workers": config.workers,
            "users": config.users,
            "tokens": config.tokens,
            "delay_ms": config.delay_ms,
            "lead_s": config.lead_s,
            "partitions": args.partitions,
            "handoff_ceiling_s": args.ceiling,
            "session_timeout_s": probe["session_timeout_s"] if probe else float("nan"),
        },
    }
    print(
        f"\nhandoff bench: {describe(saved['meta'])}, cores={os.cpu_count()}, "
        f"{saved['meta']['minutes']:.1f} min, load average at start "
        f"{'/'.join(f'{x:.1f}' for x in load0)}, at end "
        f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    if saved["handoff"]:
        print()
        print(handoff_table(saved["handoff"]).render())
    if saved["scenarios"]:
        print()
        print(scenario_table(saved).render())
    if args.save:
        args.save.write_text(json.dumps(saved, indent=2) + "\n")
        print(f"\nsaved to {args.save}")


if __name__ == "__main__":
    main()

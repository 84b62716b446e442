"""Rebalances move only what must move: real worker processes, long runs, joins, leaves,
a rolling restart and a storm.

What the tests read from Postgres:

* A run is **cut** when a handoff stopped it before it ended: the partition's next
  owner claimed it again (``runs.attempt`` + 1) and emitted a ``reset`` before new
  output. The demo handler never fails here, so ``attempt - 1`` is the number of cuts.
* Across a rebalance a partition **stays** when its ``partition_epochs`` row (epoch,
  worker_id) is unchanged: nobody revoked it. It **moves** when its worker_id changed.
  The same worker with a new epoch means the partition was revoked and given back,
  the stop-the-world handoff these tests rule out.

One namespace (32 partitions; a test's 24 users have one each) and one pool of workers
serve the whole module: each test starts from the workers the previous one left, and
every run the module submitted is in one ledger, which the storm's checks read.
"""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import pytest

from koda_runtime.localstack import StackInfo
from koda_runtime.processors.compactor import ChunkCompactor
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.settings import Settings
from tests.chaos.checks import OffsetAuditor, check_all, wait_all_committed
from tests.chaos.cluster import CommitMonitor, Postgres
from tests.chaos.load import PlannedRun
from tests.fixtures.namespaces import make_settings, prepared_namespace
from tests.fixtures.ops import scrape, value, worker_url
from tests.fixtures.processes import WorkerPool, WorkerProcess, free_port
from tests.fixtures.runs import Submitter, users_by_partition, wait_terminal
from tests.support import wait_until

PARTITIONS = 32  # a power of two, as koda demands; 24 users keep one each
USERS = 24
CEILING_S = 3.0  # KODA_HANDOFF_CEILING: every long run below outlives it many times over
TERMINAL = ("done", "failed", "cancelled")
MOVED = "koda_partitions_moved_total"

Epochs = dict[int, tuple[int, str]]


@pytest.fixture(scope="module")
def env(stack: StackInfo) -> Iterator[Settings]:
    settings = make_settings(
        stack, partitions=PARTITIONS, handoff_ceiling_s=CEILING_S, max_inflight=32
    )
    with prepared_namespace(settings) as ready:
        yield ready


@dataclass
class Ledger:
    """Every run the module submitted, per user in submission order."""

    sub: Submitter
    plan: dict[str, list[PlannedRun]] = field(default_factory=dict)

    def submit(self, user: str, inp: dict[str, Any]) -> str:
        run_id = self.sub.submit(user, inp)
        runs = self.plan.setdefault(user, [])
        runs.append(PlannedRun(user, len(runs), f"test:{run_id}", inp, run_id=run_id))
        return run_id

    def input_of(self, run_id: str) -> dict[str, Any]:
        return next(r.input for runs in self.plan.values() for r in runs if r.run_id == run_id)


@pytest.fixture(scope="module")
def ledger(env: Settings) -> Iterator[Ledger]:
    sub = Submitter(env)
    yield Ledger(sub)
    sub.close()


class Group:
    """The module's workers: who is a member, who was asked to leave."""

    def __init__(self, pool: WorkerPool, sub: Submitter) -> None:
        self.pool = pool
        self.sub = sub
        self.leaving: list[WorkerProcess] = []
        self._next = 0

    def members(self) -> list[WorkerProcess]:
        return [w for w in self.pool if w.alive() and w not in self.leaving]

    def ids(self) -> set[str]:
        return {str(w.worker_id) for w in self.members()}

    def join(self) -> WorkerProcess:
        self._next += 1
        return self.pool.start(f"w{self._next}", KODA_WORKER_PORT=str(free_port()))

    def leave(self, worker: WorkerProcess) -> datetime:
        """SIGTERM ``worker``; the database's clock just before."""
        at = db_now(self.sub)
        self.leaving.append(worker)
        worker.signal(signal.SIGTERM)
        return at

    def ensure(self, size: int) -> Epochs:
        """At least ``size`` members, settled."""
        while len(self.members()) < size:
            self.join()
        return wait_settled(self.sub, self.ids())


@pytest.fixture(scope="module")
def group(env: Settings, ledger: Ledger) -> Iterator[Group]:
    with WorkerPool(env) as pool:
        yield Group(pool, ledger.sub)
        for w in pool:  # every drain at once; the pool then waits for each exit
            if w.alive():
                w.signal(signal.SIGTERM)


def moved_count(workers: list[WorkerProcess], direction: str) -> dict[str, float]:
    """Each worker's ``koda_partitions_moved_total`` in ``direction``."""
    return {
        str(w.worker_id): value(scrape(worker_url(w)), MOVED, direction=direction) for w in workers
    }


def db_now(sub: Submitter) -> datetime:
    stamp: datetime = sub.query("SELECT clock_timestamp() AS at")[0].at
    return stamp


def epochs(sub: Submitter) -> Epochs:
    rows = sub.query("SELECT partition, epoch, worker_id FROM partition_epochs")
    return {r.partition: (r.epoch, r.worker_id) for r in rows}


def balanced(sub: Submitter, members: set[str]) -> Epochs | None:
    """The epochs if every partition is owned by ``members``, evenly; else None."""
    now = epochs(sub)
    load = Counter(w for _, w in now.values())
    if len(now) != PARTITIONS or set(load) != members:
        return None
    return now if max(load.values()) - min(load.values()) <= 1 else None


def wait_settled(sub: Submitter, members: set[str], timeout: float = 90.0) -> Epochs:
    """The epochs once the group has settled on ``members``: every partition owned by one
    of them, evenly, and every run in flight streaming again under its current claim
    (a message of its current attempt written after the assignment was seen)."""
    seen: list[tuple[Epochs, datetime]] = []

    def settled() -> Epochs | None:
        now = balanced(sub, members)
        if now is None:
            seen.clear()
            return None
        if not seen or seen[-1][0] != now:
            seen[:] = [(now, db_now(sub))]
            return None
        idle = sub.query(
            "SELECT count(*) AS n FROM runs r WHERE r.status NOT IN ('done','failed','cancelled')"
            " AND NOT EXISTS (SELECT 1 FROM messages m WHERE m.run_id = r.id"
            " AND m.attempt = r.attempt AND m.created_at > :at)",
            at=seen[-1][1],
        )
        return now if idle[0].n == 0 else None

    return wait_until(settled, timeout=timeout, interval=0.25, what=f"group settled on {members}")


def changes(before: Epochs, after: Epochs) -> tuple[set[int], set[int]]:
    """(partitions that moved to another worker, partitions revoked and given back)."""
    moved = {p for p in after if after[p][1] != before[p][1]}
    retaken = {p for p in after if after[p][1] == before[p][1] and after[p][0] != before[p][0]}
    return moved, retaken


def attempts(sub: Submitter, run_ids: list[str]) -> dict[str, int]:
    rows = sub.query("SELECT id, attempt FROM runs WHERE id = ANY(:ids)", ids=run_ids)
    return {r.id: r.attempt for r in rows}


def owners_of(sub: Submitter, run_ids: list[str]) -> list[Any]:
    return sub.query("SELECT id, worker_id FROM runs WHERE id = ANY(:ids)", ids=run_ids)


def in_flight(sub: Submitter, run_ids: list[str]) -> set[str]:
    return {r for r, s in sub.statuses(run_ids).items() if s not in TERMINAL}


def wait_streaming(sub: Submitter, run_ids: list[str]) -> None:
    def streaming() -> bool:
        rows = sub.query(
            "SELECT count(*) AS n FROM runs WHERE id = ANY(:ids) AND status = 'streaming'",
            ids=run_ids,
        )
        return int(rows[0].n) == len(run_ids)

    wait_until(streaming, timeout=60, what=f"{len(run_ids)} runs streaming")


def whole(sub: Submitter, run_id: str, inp: dict[str, Any]) -> str | None:
    """What is wrong with a run that should have ended ``done``; None if nothing."""
    row = sub.query("SELECT status, attempt FROM runs WHERE id = :r", r=run_id)[0]
    msgs = sub.messages(run_id)
    kinds = [m.kind for m in msgs]
    if row.status != "done" or kinds[-1:] != ["done"]:
        return f"ended {row.status}, last message {kinds[-1:]}"
    if [m.seq for m in msgs] != list(range(len(msgs))):
        return f"seqs are not 0..n: {[m.seq for m in msgs]}"
    if kinds.count("reset") != row.attempt - 1:
        return f"{kinds.count('reset')} resets for attempt {row.attempt}"
    if sub.output(run_id) != "".join(demo_tokens(inp)):
        return "output differs from the demo model's"
    return None


def test_a_join_and_a_leave_cut_only_the_runs_whose_partition_moved(
    group: Group, ledger: Ledger
) -> None:
    sub = ledger.sub
    group.ensure(3)
    inp = {"text": "forty seconds", "demo": {"tokens": 40, "delay_ms": 1000}}
    users = sorted(users_by_partition("join", PARTITIONS).items())[:USERS]
    runs = {p: ledger.submit(u, inp) for p, u in users}
    wait_streaming(sub, list(runs.values()))

    before = epochs(sub)
    old = group.members()
    out_before = moved_count(old, "out")
    joiner = group.join()
    after_join = wait_settled(sub, group.ids())
    out_by_join = sum(moved_count(old, "out").values()) - sum(out_before.values())
    in_by_join = moved_count([joiner], "in")[str(joiner.worker_id)]
    moved_by_join, retaken_by_join = changes(before, after_join)
    joiner_holds = {p for p, (_, w) in after_join.items() if w == joiner.worker_id}

    leaver = next(w for w in group.members() if w is not joiner)
    leaver_holds = {p for p, (_, w) in after_join.items() if w == leaver.worker_id}
    survivors = [w for w in group.members() if w is not leaver]
    in_before = moved_count(survivors, "in")
    termed_at = group.leave(leaver)
    assert leaver.proc is not None and leaver.proc.wait(40) == 0, leaver.log()[-3000:]
    after_leave = wait_settled(sub, group.ids())
    moved_by_leave, retaken_by_leave = changes(after_join, after_leave)
    in_by_leave = sum(moved_count(survivors, "in").values()) - sum(in_before.values())

    wait_terminal(sub, list(runs.values()), 150, *group.members())
    tried = attempts(sub, list(runs.values()))
    cuts = {p: tried[r] - 1 for p, r in runs.items()}
    # Every run was in flight at both rebalances, far from its end: a run is cut once per
    # move of its partition, and never otherwise.
    should = {p: int(p in moved_by_join) + int(p in leaver_holds) for p in runs}
    stayed = set(runs) - moved_by_join - leaver_holds
    assert {
        "runs cut on partitions that stayed": sorted(p for p in stayed if cuts[p]),
        "partitions revoked and given back": sorted(retaken_by_join | retaken_by_leave),
        "partitions whose cuts differ from their moves (cuts, moves)": {
            p: (cuts[p], should[p]) for p in runs if cuts[p] != should[p]
        },
        "the join moved what the joiner holds": moved_by_join == joiner_holds,
        "the joiner holds its share": len(joiner_holds) == PARTITIONS // 4,
        "the leave moved only the leaver's partitions": moved_by_leave == leaver_holds,
        f"{MOVED} out, in at the join; in at the leave": (out_by_join, in_by_join, in_by_leave),
    } == {
        "runs cut on partitions that stayed": [],
        "partitions revoked and given back": [],
        "partitions whose cuts differ from their moves (cuts, moves)": {},
        "the join moved what the joiner holds": True,
        "the joiner holds its share": True,
        "the leave moved only the leaver's partitions": True,
        f"{MOVED} out, in at the join; in at the leave": (
            len(moved_by_join),
            len(moved_by_join),
            len(leaver_holds),
        ),
    }, f"moved by the join {sorted(moved_by_join)}, leaver held {sorted(leaver_holds)}"

    # The leaver's runs went on through its drain, and their next owner took them after it.
    drain_end = termed_at + timedelta(seconds=CEILING_S)
    for p in leaver_holds & set(runs):
        msgs = sub.query(
            "SELECT kind, attempt, created_at FROM messages WHERE run_id = :r ORDER BY seq",
            r=runs[p],
        )
        cut_attempt = 1 + int(p in moved_by_join)
        last_of_cut = max(m.created_at for m in msgs if m.attempt == cut_attempt)
        reset_at = next(m.created_at for m in msgs if m.kind == "reset" and m.attempt > cut_attempt)
        assert last_of_cut >= drain_end - timedelta(seconds=1.5), (p, last_of_cut, termed_at)
        assert reset_at >= drain_end - timedelta(seconds=0.2), (p, reset_at, termed_at)

    ran_on = {r.id: r.worker_id for r in owners_of(sub, list(runs.values()))}
    problems = {p: whole(sub, r, inp) for p, r in runs.items()}
    assert {p: w for p, w in problems.items() if w} == {}
    assert {p: ran_on[r] for p, r in runs.items()} == {p: after_leave[p][1] for p in runs}


def test_a_rebalance_storm_keeps_order_fencing_and_commits(
    env: Settings, group: Group, ledger: Ledger
) -> None:
    sub = ledger.sub
    group.ensure(3)
    db = Postgres(env)
    monitor = CommitMonitor(env)
    auditor = OffsetAuditor(env, db, monitor)
    monitor.start()
    auditor.start()
    rng = random.Random(20)
    users = [f"storm-{i}" for i in range(16)]
    runs: list[str] = []
    events = ["join", "leave"] * 5  # 5 joins and 5 leaves, one every 3 s
    try:
        started = time.monotonic()
        done_at = started + 3.0 * len(events)
        next_event, next_run, next_audit = started, started, started
        while time.monotonic() < done_at:
            now = time.monotonic()
            if events and now >= next_event:
                if events.pop(0) == "join":
                    group.join()
                else:
                    group.leave(min(group.members(), key=lambda w: group.pool.index(w)))
                next_event += 3.0
            if now >= next_run:
                inp = {
                    "text": f"storm {len(runs)}",
                    "demo": {"tokens": rng.randint(4, 12), "delay_ms": rng.randint(100, 250)},
                }
                runs.append(ledger.submit(users[len(runs) % len(users)], inp))
                next_run += 0.4
            if now >= next_audit:
                auditor.audit()
                next_audit += 1.0
            time.sleep(0.05)  # the loop's tick: events, submissions and audits fall due

        def terminal() -> bool:
            auditor.audit()
            return sub.all_terminal(runs)

        wait_until(terminal, timeout=120, interval=0.5, what=f"{len(runs)} storm runs terminal")
        for w in group.leaving:
            assert w.proc is not None and w.proc.wait(40) == 0, w.log()[-3000:]
        behind = wait_all_committed(env, monitor, timeout=60)
        auditor.audit()
    finally:
        auditor.stop()
        monitor.stop()
    compactor = ChunkCompactor(env)
    try:
        compactor.repair_once(older_than_s=0)
    finally:
        compactor.close()
    found = check_all(env, db, ledger.plan, [], [], auditor)
    db.close()
    assert {
        "duplicate chunks": found.duplicate_chunks_db,
        "order violations": found.order_violations,
        "offsets ahead of work": found.offsets_ahead,
        "runs lost": found.lost,
        "violations": found.violations[:20],
        "partitions committed behind their end": behind,
    } == {
        "duplicate chunks": 0,
        "order violations": 0,
        "offsets ahead of work": 0,
        "runs lost": 0,
        "violations": [],
        "partitions committed behind their end": [],
    }
    assert found.offset_audits > 0 and found.done == found.accepted


@dataclass
class Step:
    """One rebalance of the rolling restart and what it did to the runs."""

    name: str
    moved: set[int]
    retaken: set[int]
    held: set[int]  # the partitions the leaver held before, or the joiner holds after
    predicted: set[str]  # runs in flight on a moved partition that outlive the drain
    cut: set[str]


def test_a_rolling_restart_cuts_exactly_the_runs_whose_partition_moves(
    group: Group, ledger: Ledger
) -> None:
    # Each worker in turn leaves (SIGTERM) and a new one takes its place: six rebalances.
    # A leave moves the leaver's partitions; the replacement's join then takes its share
    # from the survivors, and the runs in flight there are handed off too (nothing in
    # either protocol gives a newcomer only partitions without runs). So the exact set
    # of cut runs is computed per rebalance from what moved, and compared.
    sub = ledger.sub
    start = group.ensure(3)
    # Long runs on 24 of the 32 partitions, each far longer than the whole restart, so
    # every one in flight on a moving partition outlives the drain; the other partitions
    # stay free for the short runs each leaver finishes inside its drain.
    inp = {"text": "long", "demo": {"tokens": 60, "delay_ms": 1000}}
    names = users_by_partition("roll", PARTITIONS)
    long_parts = sorted(names)[:USERS]
    long_runs = {ledger.submit(names[p], inp): p for p in long_parts}
    wait_streaming(sub, list(long_runs))
    partition_of = dict(long_runs)
    steps: list[Step] = []
    short_runs: dict[str, str] = {}  # run -> the worker whose drain it ended in
    now = start

    def step(name: str, act: Any, held: Any) -> Epochs:
        ids = list(partition_of)
        tried, flying = attempts(sub, ids), in_flight(sub, ids)
        before = epochs(sub)
        worker = act()
        after = wait_settled(sub, group.ids())
        moved, retaken = changes(before, after)
        holds = held(worker, before, after)
        cut = {r for r, a in attempts(sub, ids).items() if a > tried[r]}
        predicted = {r for r in flying if r in long_runs and partition_of[r] in moved}
        steps.append(Step(name, moved, retaken, holds, predicted, cut))
        return after

    pending = [w for w in group.members()]
    while pending:
        free = {p for p in range(PARTITIONS) if p not in long_parts}
        leaver = max(pending, key=lambda w: len(free & holding(now, w)))
        pending.remove(leaver)
        spare = sorted(free & holding(now, leaver))
        if spare:
            short = {"text": "short", "demo": {"tokens": 4, "delay_ms": 300}}
            run_id = ledger.submit(names[spare[0]], short)
            partition_of[run_id] = spare[0]
            short_runs[run_id] = str(leaver.worker_id)
            wait_until(partial(sub.messages, run_id), timeout=30, what="short run streaming")

        def leave(w: WorkerProcess = leaver) -> WorkerProcess:
            group.leave(w)
            assert w.proc is not None and w.proc.wait(40) == 0, w.log()[-3000:]
            return w

        now = step(f"{leaver.worker_id} leaves", leave, lambda w, b, a: holding(b, w))
        now = step(
            f"{leaver.worker_id}'s replacement joins", group.join, lambda w, b, a: holding(a, w)
        )

    assert {
        s.name: {
            "revoked and given back": sorted(s.retaken),
            "moved only what it had to": s.moved == s.held,
            "cut runs not predicted": sorted(partition_of[r] for r in s.cut - s.predicted),
            "predicted runs not cut": sorted(partition_of[r] for r in s.predicted - s.cut),
        }
        for s in steps
    } == {
        s.name: {
            "revoked and given back": [],
            "moved only what it had to": True,
            "cut runs not predicted": [],
            "predicted runs not cut": [],
        }
        for s in steps
    }, [(s.name, sorted(s.moved), sorted(s.held)) for s in steps]
    # Every leave cut exactly the leaver's runs that outlived its drain; the short runs it
    # held ended inside the drain, done on the leaver at their first attempt.
    wait_terminal(sub, list(short_runs), 30)
    rows = sub.query(
        "SELECT id, attempt, worker_id FROM runs WHERE id = ANY(:ids)", ids=list(short_runs)
    )
    assert {r.id: (r.attempt, r.worker_id) for r in rows} == {
        r: (1, w) for r, w in short_runs.items()
    }
    assert short_runs, "no leaver held a free partition: the drain's edge went untested"
    assert {r: whole(sub, r, ledger.input_of(r)) for r in short_runs} == {
        r: None for r in short_runs
    }


def holding(snapshot: Epochs, worker: WorkerProcess) -> set[int]:
    return {p for p, (_, w) in snapshot.items() if w == worker.worker_id}

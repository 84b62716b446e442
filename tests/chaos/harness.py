"""The chaos run: users × runs through the gateway, three workers, viewers, and faults.

    python -m tests.chaos.harness --runs 10000 --users 1000 --brokers 3 --faults 65  # make chaos

Starts a private stack (Kafka with 1 or 3 nodes, PostgreSQL) in a /tmp state dir, a
gateway and a pool of workers with the demo handler, and while users submit runs of
0.1-5 s (a few flaky, a few poison, a few cancelled, a few followed by a second message
that merges into them) and SSE viewers follow a sample of them, injects faults in
rounds, one at a time: kill -9 a worker; SIGTERM a worker and start a replacement;
SIGSTOP a worker past the session timeout, then SIGCONT; restart a Kafka broker; (three
brokers) kill -9 one and bring it back later; restart PostgreSQL (alternately a fast
stop and a crash); kill -9 the gateway and start it again; and the network faults of
tests/chaos/faults.py on one process's own Toxiproxy links (tests/chaos/toxiproxy.py).
Poison records are written straight to the runs topic along the way.

Once every run has ended it runs the compactor's completeness pass (what the scheduled
`koda chunks compact` does each round), then checks, from Postgres, the topics and the viewers, what
``tests/chaos/checks.py`` defines (its docstring states each definition, including what
"per-user order without overlap" means with retries and resumed runs), prints a table,
and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from random import Random
from typing import Any

import httpx

from koda_runtime.naming import AppEnv
from koda_runtime.processors.chunkverify import verify_chunks
from koda_runtime.processors.compactor import ChunkCompactor
from koda_runtime.processors.handlers.demo import MODEL as DEMO_MODEL
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from tests.chaos import faults as fk
from tests.chaos.checks import (
    SCHEDULE_GRACE_S,
    ChaosSchedule,
    Findings,
    OffsetAuditor,
    check_all,
    create_schedules,
    median_max,
    pause_schedules,
    wait_all_committed,
)
from tests.chaos.cluster import CommitMonitor, Pool, Postgres, Stack, proxied_stack
from tests.chaos.load import (
    InjectedPoison,
    LoopLag,
    PlannedRun,
    Viewer,
    client_count,
    follow,
    inject_poison,
    load_client,
    plan_runs,
    user_session,
)
from tests.chaos.stalls import StallWatch
from tests.support import wait_until


@dataclass
class Config:
    """A chaos run's shape; durations in seconds."""

    runs: int = 2000
    users: int = 200
    brokers: int = 3
    workers: int = 3
    min_run_s: float = 0.1
    max_run_s: float = 5.0
    watch_fraction: float = 0.05
    poison_runs: int = 5
    flaky_fraction: float = 0.02
    cancel_fraction: float = 0.02
    merge_fraction: float = 0.02
    memory_fraction: float = 0.05
    schedules: int = 5  # per-minute schedules fired by two schedulers (0: none)
    budget_fraction: float = 0.02  # users with a daily budget of about three runs
    poison_rounds: int = 2
    min_faults: int = 21
    kinds: tuple[str, ...] = ()
    fault_gap_s: float = 6.0
    submit_window_s: float | None = None
    partitions: int = 32
    max_inflight: int = 256
    session_timeout_s: float = 6.0
    handoff_ceiling_s: float = 2.0
    down_s: float = 3.0
    slow_s: float = 8.0  # how long a latency fault (and a gateway feed cut) lasts
    deadline_s: float | None = None  # None: three submission windows plus 10 minutes
    seed: int = 1
    verbose: bool = True
    network: bool = True  # the stack has Toxiproxy slots: network faults apply

    def fault_kinds(self) -> tuple[str, ...]:
        return self.kinds or fk.kinds_for(
            self.brokers, network=self.network, schedulers=self.schedules > 0
        )

    def window_s(self) -> float:
        """How long users keep submitting: about the pool's capacity, and as long as
        the faults need (about 15 s each), so faults hit a loaded system."""
        if self.submit_window_s is not None:
            return self.submit_window_s
        mean = (self.min_run_s + self.max_run_s) / 2
        capacity = min(self.users, self.workers * self.max_inflight) / mean
        return max(self.runs / capacity, self.min_faults * 15.0)

    def run_deadline_s(self) -> float:
        """How long the load and the wait for every run to end may take: three windows
        (the faults cost capacity, so the backlog outlives the window) and ten minutes."""
        if self.deadline_s is not None:
            return self.deadline_s
        return max(1800.0, 3 * self.window_s() + 600.0)


@dataclass
class Report:
    config: Config
    findings: Findings
    faults: list[fk.Fault]
    elapsed_s: float
    violations: list[str] = field(default_factory=list)
    plan: dict[str, list[PlannedRun]] = field(default_factory=dict)
    stalls: StallWatch = field(default_factory=StallWatch)
    # Records on the runs topic (the group's final committed offsets, summed) and rows
    # in ``runs``: what the gateways and sweepers published beyond one record a run.
    runs_records: tuple[int, int] = (0, 0)
    loop_lag: LoopLag = field(default_factory=LoopLag)

    @property
    def ok(self) -> bool:
        return not self.violations

    def cancel_times(self) -> list[float]:
        return [r.cancel.at for rs in self.plan.values() for r in rs if r.cancel is not None]

    def merge_times(self) -> list[float]:
        """When each follow-up was answered merged (the merge is done by then)."""
        return [
            r.accepted_at
            for rs in self.plan.values()
            for r in rs
            if r.merged and r.accepted_at is not None
        ]

    def during_fault(self, times: list[float]) -> int:
        """How many of ``times`` fell inside a fault (from injection until it was over)."""
        spans = [(x.at, x.ended_at or x.at) for x in self.faults]
        return sum(any(a <= t <= b for a, b in spans) for t in times)

    def table(self) -> str:
        f = self.findings
        rows: list[tuple[str, str]] = []
        by_kind = Counter(x.kind for x in self.faults)
        rows.append(("faults injected", str(len(self.faults))))
        for kind in self.config.fault_kinds():
            rows.append((f"  {kind}", str(by_kind.get(kind, 0))))
        rows += [
            ("runs accepted", str(f.accepted)),
            ("  done", str(f.done)),
            ("  failed (all injected poison)", f"{f.failed} (poison runs: {f.poison_runs})"),
            ("  lost", str(f.lost)),
            ("  never accepted", str(f.refused)),
            ("  resumed or retried (had a reset)", str(f.resumed_runs)),
            ("  highest attempt", str(f.max_attempt)),
            (
                "duplicate chunks: Postgres / viewers",
                f"{f.duplicate_chunks_db} / {f.duplicate_chunks_viewers}",
            ),
            ("  chunk topic re-sends (same record twice)", str(f.chunk_resends_topic)),
            (
                "  chunks missing on the topic before the pass / runs it completed",
                f"{f.chunks_left_for_pass} / {f.runs_completed_by_pass}",
            ),
            ("  chunks in Postgres, not on the topic", str(f.chunks_missing_on_topic)),
            ("order violations", str(f.order_violations)),
            ("  runs started beside another user's on their partition", str(f.interleaved_starts)),
            (
                "viewers / mismatches / reconnects",
                f"{f.viewers} / {f.viewer_mismatches} / {f.viewer_reconnects}",
            ),
            ("dead letters (repeats)", f"{f.dead_letters} ({f.dead_letter_repeats})"),
            (
                "cancels: sent / during a fault / took / after the end",
                f"{f.cancels} / {self.during_fault(self.cancel_times())} / {f.cancels_took}"
                f" / {f.cancels_after_end}",
            ),
            ("  cancelled runs not cancelled or run again", str(f.cancel_violations)),
            (
                "follow-ups: sent / during a fault / merged",
                f"{f.follow_ups} / {self.during_fault(self.merge_times())} / {f.merged}",
            ),
            ("  merged messages missing from input or answer", str(f.merge_violations)),
            (
                "schedules / due minutes / runs",
                f"{f.schedules} / {f.schedule_minutes} / {f.scheduled_runs}",
            ),
            ("  due minutes without exactly one run", str(f.schedule_violations)),
            (
                "budget users / runs refused 402 / stopped mid-run / largest day spend, overshoot",
                f"{f.budget_users} / {f.budget_refusals} / {f.budget_stops} /"
                f" ${f.budget_max_spend_usd:.2f}, ${f.budget_overshoot_usd:.2f} (limit $15 a day)",
            ),
            (
                "  admitted past a spent budget, refused or stopped with budget left",
                str(f.budget_violations),
            ),
            ("ledger rows", str(f.ledger_rows)),
            ("  runs with a call billed twice, or done unbilled", str(f.ledger_duplicates)),
            ("  users whose usage report differs from the ledger", str(f.ledger_report_mismatches)),
            (
                "memory runs done / retried before their end",
                f"{f.memory_runs} / {f.memory_runs_retried}",
            ),
            (
                "  memories duplicated / missing",
                f"{f.memory_duplicates} / {f.memory_missing}",
            ),
            ("offset audits / offsets ahead of work", f"{f.offset_audits} / {f.offsets_ahead}"),
            (
                "partition samples / longest wait with nothing moving",
                f"{self.stalls.samples} / {_secs(self.stalls.longest_s())}",
            ),
            (
                f"  partitions stalled over {self.stalls.limit_s:.0f}s",
                str(len(self.stalls.stalls)),
            ),
            (
                "runs-topic records / runs (republished or poison beyond one each)",
                f"{self.runs_records[0]} / {self.runs_records[1]}",
            ),
            (
                "harness event loop: longest late wake-up / wake-ups over 1s late",
                f"{_secs(self.loop_lag.longest_s)} / {self.loop_lag.late}",
            ),
        ]
        handoffs = [x.handoff_s for x in self.faults if x.handoff_s is not None]
        med, mx = median_max(handoffs)
        rows.append(
            (
                "handoff time median / max",
                _secs(med) + " / " + _secs(mx) + f"  ({len(handoffs)} worker faults)",
            )
        )
        for kind in fk.NETWORK_KINDS:
            net = [x for x in self.faults if x.kind == kind]
            if not net:
                continue
            med, mx = median_max([x.recover_s for x in net if x.recover_s is not None])
            unmeasured = sum(x.recover_s is None for x in net)
            tail = f"; {unmeasured} unmeasured" if unmeasured else ""
            rows.append(
                (
                    f"  {kind}",
                    f"{len(net)}; recovered median / max {_secs(med)} / {_secs(mx)}"
                    f" ({fk.RECOVERY_OF[kind]}){tail}",
                )
            )
            # Each fault's notes ("cut 8.1s", "/readyz while cut: 503", ...), the first few.
            for x in net[:3]:
                rows.append((f"    {x.target}", "; ".join(x.notes)))
            if len(net) > 3:
                rows.append(("    ...", f"{len(net) - 3} more in the log"))
        for x in self.faults:
            if x.kind in fk.SERVICE_KINDS or x.kind == fk.GATEWAY_RESTART:
                what = "ready after" if x.kind == fk.GATEWAY_RESTART else "recovered after"
                rows.append(
                    (
                        f"  {x.kind} ({x.target})",
                        f"{what} {_secs(x.recover_s)}; {'; '.join(x.notes)}",
                    )
                )
        rows.append(("violations", str(len(self.violations))))
        rows.append(("elapsed", f"{self.elapsed_s:.0f}s"))
        width = max(len(k) for k, _ in rows) + 2
        lines = [f"{k:<{width}}{v}" for k, v in rows]
        return "\n".join(lines)


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}s"


def chaos_settings(stack: Stack, cfg: Config, namespace: str) -> Settings:
    three = stack.info.brokers >= 3
    return Settings(
        app_env=AppEnv.DEV,
        kafka_bootstrap=stack.info.kafka_bootstrap,
        database_url=stack.info.database_url,
        namespace=namespace,
        partitions=cfg.partitions,
        replication_factor=3 if three else 1,
        min_insync_replicas=2 if three else 1,
        session_timeout_s=cfg.session_timeout_s,
        heartbeat_interval_s=1.0,
        rebalance_timeout_s=30.0,
        handoff_ceiling_s=cfg.handoff_ceiling_s,
        retry_base_s=0.05,
        chunk_batch_ms=5,
        max_inflight=cfg.max_inflight,
        sweep_after_s=3.0,
        sweep_interval_s=1.0,
        publish_timeout_s=30.0,
        rate_per_s=1000.0,
        rate_burst=1000,
        sse_keepalive_s=2.0,
        sse_retry_ms=200,
    )


class Chaos:
    """One chaos run against ``stack`` (which it may stop and start, never tear down)."""

    def __init__(self, cfg: Config, stack: Stack) -> None:
        self.cfg = cfg
        self.stack = stack
        self.rng = Random(cfg.seed)  # noqa: S311 - reproducible schedule, not crypto
        self.settings = chaos_settings(stack, cfg, f"chaos{int(time.time()) % 10**8}")
        if cfg.network and stack.network is None:
            raise ValueError("Config.network is set but the stack has no Toxiproxy slots")
        self.pool = Pool(self.settings, cfg.workers, network=stack.network)
        self.db = Postgres(self.settings)
        self.monitor = CommitMonitor(self.settings)
        self.auditor = OffsetAuditor(self.settings, self.db, self.monitor)
        self.stalls = StallWatch()
        self.loop_lag = LoopLag()
        self.viewers: list[Viewer] = []
        self.viewer_tasks: list[asyncio.Task[None]] = []
        self.poison: list[InjectedPoison] = []
        self.faults: list[fk.Fault] = []
        self.plan: dict[str, list[PlannedRun]] = {}
        self.schedules: list[ChaosSchedule] = []
        self.budgets: dict[str, Decimal] = {}
        self.started = time.monotonic()

    def log(self, msg: str) -> None:
        if self.cfg.verbose:
            print(f"[{time.monotonic() - self.started:7.1f}s] {msg}", flush=True)

    async def run(self) -> Report:
        cfg = self.cfg
        await asyncio.to_thread(upgrade, self.settings)
        await asyncio.to_thread(apply_topics, self.settings)
        try:
            await asyncio.to_thread(self.pool.start)
            await asyncio.to_thread(
                wait_until,
                lambda: len(self.db.epochs()) == cfg.partitions,
                timeout=120,
                what="workers holding every partition",
            )
            if cfg.schedules:
                self.schedules = await asyncio.to_thread(
                    create_schedules, self.db, cfg.schedules, self.settings.namespace or ""
                )
                for _ in range(2):
                    await asyncio.to_thread(self.pool.start_scheduler)
            self.monitor.start()
            self.auditor.start()
            self.log(
                f"{cfg.workers} workers and a gateway up; namespace "
                f"{self.settings.namespace}; submitting for {cfg.window_s():.0f}s"
            )
            report = await self._load_and_faults()
        finally:
            self.monitor.stop()
            self.auditor.stop()
            try:
                await asyncio.to_thread(self.pool.stop_all)
            finally:
                self.pool.kill_all()
                self.db.close()
        return report

    async def _load_and_faults(self) -> Report:
        cfg = self.cfg
        self.plan = plan_runs(
            self.rng,
            runs=cfg.runs,
            users=cfg.users,
            min_s=cfg.min_run_s,
            max_s=cfg.max_run_s,
            poison_runs=cfg.poison_runs,
            flaky_fraction=cfg.flaky_fraction,
            watch_fraction=cfg.watch_fraction,
            cancel_fraction=cfg.cancel_fraction,
            merge_fraction=cfg.merge_fraction,
            memory_fraction=cfg.memory_fraction,
        )
        deadline = time.monotonic() + cfg.run_deadline_s()
        url = f"http://127.0.0.1:{self.pool.gateway_port}"
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(load_client(url))
                for _ in range(client_count(len(self.plan)))
            ]
            await self._set_budgets(clients[0])
            shard_of: dict[str, httpx.AsyncClient] = {}

            def accepted(run: PlannedRun) -> None:
                if run.watch and run.run_id is not None:
                    v = Viewer(run.run_id, run.user)
                    self.viewers.append(v)
                    self.viewer_tasks.append(
                        asyncio.create_task(self._view_later(shard_of[run.user], v, deadline))
                    )

            users = []
            for i, (user, runs) in enumerate(self.plan.items()):
                shard_of[user] = clients[i % len(clients)]
                users.append(
                    asyncio.create_task(
                        user_session(
                            shard_of[user],
                            runs,
                            Random(self.rng.random()),
                            cfg.window_s(),
                            deadline,
                            accepted,
                        )
                    )
                )
            audits = asyncio.create_task(self._audit_loop())
            lag = asyncio.create_task(self.loop_lag.watch(self.log))
            await self._fault_loop(users)
            await asyncio.gather(*users)
            if self.schedules:
                # A due minute counts once it is 20 s older than the pause (the check's
                # grace for the scheduler's tick): a short run whose users were done
                # before the first minute came would check no schedule at all.
                first = min(x.first for x in self.schedules)
                counted = first + timedelta(seconds=SCHEDULE_GRACE_S + 5)
                wait = (counted - datetime.now(UTC)).total_seconds()
                if wait > 0:
                    self.log(f"waiting {wait:.0f}s for the first schedule minute to count")
                    await asyncio.sleep(wait)
                await asyncio.to_thread(pause_schedules, self.db, self.schedules)
            self.log("all submitted; waiting for every run to end")
            await self._wait_terminal(deadline)
            await asyncio.wait(self.viewer_tasks, timeout=120) if self.viewer_tasks else None
            for t in self.viewer_tasks:
                t.cancel()
            audits.cancel()
            lag.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await audits
            with contextlib.suppress(asyncio.CancelledError):
                await lag
        return await asyncio.to_thread(self._verify)

    async def _set_budgets(self, client: httpx.AsyncClient) -> None:
        """Price the demo model ($1 a completion token: a run costs $2-20) and give a
        few users a daily budget of $15, one or two runs' worth."""
        users = sorted(self.plan)[: round(len(self.plan) * self.cfg.budget_fraction)]
        if not users:
            return
        await asyncio.to_thread(
            self.db.query,
            "INSERT INTO prices (model, effective_from, prompt_usd_per_mtok,"
            " completion_usd_per_mtok) VALUES (:m, now(), 0, 1000000) RETURNING id",
            m=DEMO_MODEL,
            commit=True,
        )
        for user in users:
            resp = await client.put(f"/admin/budgets/{user}", json={"daily_usd": "15"})
            resp.raise_for_status()
            self.budgets[user] = Decimal(15)

    async def _view_later(self, client: httpx.AsyncClient, v: Viewer, deadline: float) -> None:
        # Most viewers join at once (live), some late (replay from Postgres, then live).
        if self.rng.random() < 0.3:
            await asyncio.sleep(self.rng.uniform(0.5, 8.0))
        await follow(client, v, deadline)

    async def _audit_loop(self) -> None:
        while True:
            await asyncio.sleep(3.0)
            await asyncio.to_thread(self.auditor.audit)
            self.pool.check_exits()
            try:
                opened = await asyncio.to_thread(self.stalls.look, self.db)
            except Exception:  # noqa: BLE001 - Postgres restarting: the next look sees it
                continue
            for stall in opened:
                self.log(
                    f"  STALL: partition {stall.partition} (held by "
                    f"{', '.join(sorted(stall.owners))}) has runs waiting and nothing"
                    f" started or ended since {stall.since:%H:%M:%S}"
                )

    async def _fault_loop(self, users: list[asyncio.Task[None]]) -> None:
        cfg = self.cfg
        kinds = list(cfg.fault_kinds())
        poison_due = [
            int((i + 1) * cfg.min_faults / (cfg.poison_rounds + 1))
            for i in range(cfg.poison_rounds)
        ]
        await asyncio.sleep(min(5.0, cfg.fault_gap_s))
        rounds = 0
        while len(self.faults) < cfg.min_faults or not all(u.done() for u in users):
            if rounds % len(kinds) == 0:
                self.rng.shuffle(kinds)
            kind = kinds[rounds % len(kinds)]
            rounds += 1
            self.log(f"fault {len(self.faults) + 1}: {kind}")
            fault = await self.injector.inject(kind)
            fault.ended_at = time.time()
            self.faults.append(fault)
            self.log(
                f"  {fault.kind} on {fault.target}: handoff {_secs(fault.handoff_s)} "
                f"{'; '.join(fault.notes)}"
            )
            if len(self.faults) in poison_due:
                self.poison += await asyncio.to_thread(inject_poison, self.settings)
                self.log("  poison records written to the runs topic")
            await asyncio.sleep(cfg.fault_gap_s)
            if len(self.faults) >= cfg.min_faults and all(u.done() for u in users):
                break

    @property
    def injector(self) -> fk.Injector:
        if not hasattr(self, "_injector"):
            self._injector = fk.Injector(
                self.stack,
                self.pool,
                self.db,
                self.rng,
                self.cfg.session_timeout_s,
                down_s=self.cfg.down_s,
                handoff_ceiling_s=self.cfg.handoff_ceiling_s,
                slow_s=self.cfg.slow_s,
                live_viewers=lambda: sum(
                    1 for v in self.viewers if v.connections and not v.finished
                ),
            )
        return self._injector

    async def _wait_terminal(self, deadline: float) -> None:
        # A merged follow-up names the run it joined: count each run once.
        ids = sorted({r.run_id for runs in self.plan.values() for r in runs if r.run_id})
        last_log = 0.0
        while time.monotonic() < deadline:
            try:
                rows = await asyncio.to_thread(
                    self.db.query,
                    "SELECT count(*) FILTER (WHERE id = ANY(:ids) AND status IN"
                    " ('done', 'failed', 'cancelled')) AS n, count(*) FILTER (WHERE"
                    " schedule_id IS NOT NULL AND status NOT IN ('done', 'failed',"
                    " 'cancelled')) AS scheduled FROM runs",
                    ids=ids,
                )
                left = len(ids) - rows[0].n + rows[0].scheduled
            except Exception:  # noqa: BLE001 - keep waiting through a restart
                left = -1
            if left == 0:
                return
            if time.monotonic() - last_log > 15:
                self.log(f"  {left} runs not terminal yet")
                last_log = time.monotonic()
            self.pool.check_exits()
            await asyncio.sleep(1.0)

    def _usage_report(self) -> list[dict[str, Any]]:
        """The gateway's per-user usage report over everything (``/admin``, open in dev)."""
        url = f"http://127.0.0.1:{self.pool.gateway_port}/admin/usage"
        params = {"group_by": "user", "from": "2000-01-01"}
        resp = httpx.get(url, params=params, timeout=30)
        resp.raise_for_status()
        rows: list[dict[str, Any]] = resp.json()["rows"]
        return rows

    def _complete_topic(self, findings: Findings) -> None:
        """The repair delay: what workers left for the pass, then the pass itself."""
        left = verify_chunks(self.settings, datetime.fromtimestamp(0, UTC), timeout_s=300)
        compactor = ChunkCompactor(self.settings)
        try:
            repaired = compactor.repair_once(older_than_s=0)
        finally:
            compactor.close()
        findings.chunks_left_for_pass = left.chunks_missing
        findings.runs_completed_by_pass = repaired.runs
        self.log(
            f"  completeness pass: {left.chunks_missing} chunks were missing on the topic; "
            f"{repaired.runs} runs completed, {repaired.chunks} chunk records produced"
        )

    def _verify(self) -> Report:
        behind = wait_all_committed(self.settings, self.monitor, timeout=60)
        self.auditor.audit()
        pass_findings = Findings()
        self._complete_topic(pass_findings)
        # Memories are distilled after a run is done, off its path: wait for the workers
        # to finish what is pending (a distillation that gave up stays, and the memory
        # check reports its run).
        wait_until(
            lambda: (
                not self.db.query(
                    "SELECT 1 FROM memory_distillations WHERE gave_up_at IS NULL LIMIT 1"
                )
            ),
            timeout=300,
            what="pending memory distillations",
        )
        findings = check_all(
            self.settings,
            self.db,
            self.plan,
            self.viewers,
            self.poison,
            self.auditor,
            usage_report=self._usage_report(),
            schedules=self.schedules,
            budgets=self.budgets,
        )
        findings.chunks_left_for_pass = pass_findings.chunks_left_for_pass
        findings.runs_completed_by_pass = pass_findings.runs_completed_by_pass
        for fault in self.faults:
            if fault.kind in fk.SERVICE_KINDS and fault.back_at is not None:
                fault.recover_s = self.monitor.recovery_after(fault.back_at)
        self.pool.check_exits()
        violations = list(findings.violations) + behind + self.pool.unexpected_exits
        violations += self.stalls.violations()
        violations += [
            f"{x.kind} on {x.target}: {n}"
            for x in self.faults
            for n in x.notes
            if "exit code" in n or "not complete" in n or "not recovered" in n
        ]
        elapsed = time.monotonic() - self.started
        report = Report(self.cfg, findings, self.faults, elapsed, violations, self.plan)
        report.stalls = self.stalls
        report.loop_lag = self.loop_lag
        # Every partition's committed offset reached its end (checked above), so the
        # offsets summed count every record the topic has held.
        records = sum(max(0, c) for c in self.monitor.latest.values())
        report.runs_records = (records, int(self.db.query("SELECT count(*) AS n FROM runs")[0].n))
        return report


def _parse_kinds(arg: str, brokers: int) -> tuple[str, ...]:
    known = fk.kinds_for(brokers, network=True)
    kinds: list[str] = []
    for name in filter(None, (k.strip() for k in arg.split(","))):
        if name == "network":
            kinds += fk.NETWORK_KINDS
        elif name in known:
            kinds.append(name)
        else:
            raise SystemExit(f"--kinds: unknown fault kind {name!r}; known: {', '.join(known)}")
    return tuple(kinds)


def run_on(cfg: Config, stack: Stack) -> Report:
    """Run chaos against an existing stack (the caller owns and tears it down)."""
    return asyncio.run(Chaos(cfg, stack).run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.chaos.harness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--runs", type=int, default=10_000)
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--brokers", type=int, choices=(1, 3), default=3)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--faults", type=int, default=65, help="at least this many faults")
    p.add_argument("--min-run", type=float, default=0.1, help="shortest run, seconds")
    p.add_argument("--max-run", type=float, default=5.0, help="longest run, seconds")
    p.add_argument("--watch", type=float, default=0.05, help="fraction of runs with a viewer")
    p.add_argument("--poison-runs", type=int, default=5)
    p.add_argument("--partitions", type=int, default=32)
    p.add_argument("--max-inflight", type=int, default=256)
    p.add_argument("--window", type=float, default=None, help="submission window, seconds")
    p.add_argument("--gap", type=float, default=6.0, help="seconds between faults")
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds the load and the wait for every run to end may take (a run not"
        " ended by then counts as lost); default: three windows plus 10 minutes",
    )
    p.add_argument(
        "--kinds",
        default="",
        help="only these fault kinds, comma-separated ('network' for every network kind)",
    )
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--state-dir", type=Path, default=None, help="default: a new /tmp dir")
    p.add_argument("--keep", action="store_true", help="leave the state dir for inspection")
    a = p.parse_args(argv)
    cfg = Config(
        runs=a.runs,
        users=a.users,
        brokers=a.brokers,
        workers=a.workers,
        min_faults=a.faults,
        min_run_s=a.min_run,
        max_run_s=a.max_run,
        watch_fraction=a.watch,
        poison_runs=a.poison_runs,
        partitions=a.partitions,
        max_inflight=a.max_inflight,
        submit_window_s=a.window,
        deadline_s=a.deadline,
        fault_gap_s=a.gap,
        seed=a.seed,
        kinds=_parse_kinds(a.kinds, a.brokers),
    )
    state = a.state_dir or Path(tempfile.mkdtemp(prefix="koda-chaos-", dir="/tmp"))
    print(f"chaos: seed {a.seed}, state dir {state}", flush=True)
    try:
        with proxied_stack(state, a.brokers) as stack:
            report = run_on(cfg, stack)
    finally:
        if not a.keep:
            shutil.rmtree(state, ignore_errors=True)
    print()
    print(report.table())
    if report.violations:
        print(f"\n{len(report.violations)} violations:")
        for line in report.violations[:100]:
            print(f"  - {line}")
        return 1
    print("\nno violations")
    return 0


if __name__ == "__main__":
    sys.exit(main())

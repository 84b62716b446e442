"""The chaos run in miniature (about a minute and a half): one broker, every process
fault kind that applies to it (a scheduler kill among them) and one network fault (a
worker's broker links cut past the session timeout); cancels, merges, memory writes,
two schedules and two users at their budget while they happen; every check of
tests/chaos/checks.py. `make chaos` runs the full one."""

from __future__ import annotations

from tests.chaos.cluster import Stack
from tests.chaos.faults import NET_WORKER_KAFKA_CUT, SCHEDULER_KILL, kinds_for
from tests.chaos.harness import Config, run_on


def test_a_short_chaos_run_loses_nothing_and_keeps_order(stack_restored: Stack) -> None:
    kinds = (*kinds_for(1), SCHEDULER_KILL, NET_WORKER_KAFKA_CUT)
    cfg = Config(
        runs=100,
        users=20,
        brokers=1,
        workers=3,
        min_run_s=0.1,
        max_run_s=2.0,
        watch_fraction=0.15,
        poison_runs=3,
        poison_rounds=1,
        cancel_fraction=0.06,
        merge_fraction=0.15,
        memory_fraction=0.1,
        schedules=2,
        budget_fraction=0.1,
        kinds=kinds,
        min_faults=len(kinds),
        fault_gap_s=1.0,
        submit_window_s=25.0,
        partitions=8,
        max_inflight=4,
        down_s=2.0,
        deadline_s=240.0,
        seed=20261130,
    )
    report = run_on(cfg, stack_restored)
    print(report.table())
    assert report.ok, "\n".join(report.violations[:40]) + "\n\n" + report.table()
    assert {f.kind for f in report.faults} == set(kinds)
    f = report.findings
    merged = sum(r.merged for runs in report.plan.values() for r in runs)
    assert f.accepted + merged + f.budget_refusals == cfg.runs
    assert f.failed == cfg.poison_runs and f.lost == 0
    # Cancels and merges happened, at least one of each while a fault was going on.
    assert f.cancels_took >= 1 and report.during_fault(report.cancel_times()) >= 1
    assert f.merged >= 1 and report.during_fault(report.merge_times()) >= 1
    assert f.viewers > 0 and f.offset_audits > 0
    # The other capabilities were exercised, not only left unviolated: a budget spent
    # and refusing, a schedule minute due (and fired once), memories written.
    assert f.budget_refusals >= 1 and f.schedule_minutes >= 1 and f.memory_runs >= 1
    assert report.stalls.samples > 0
    # The worker faults were measured: their partitions moved to another worker.
    assert [x.handoff_s for x in report.faults if x.handoff_s is not None]

"""Every network fault kind once, on a small chaos run (about a minute): each process's
links go through its own Toxiproxy slot, so each fault hits one link of one process.

What koda must do, fault by fault (the harness's checks hold throughout: fencing, no
committed offset ahead of work, viewers end with exactly the rows):

* a worker's broker links cut past the session timeout: its partitions move to the
  others; healed, it rejoins and owns partitions again;
* a worker's PostgreSQL link cut past the handoff ceiling: its writes fail and are
  retried, it keeps its partitions (the broker still hears from it), the runs finish;
* 300 ms ± 100 ms on a worker's PostgreSQL link and on the gateway's broker links:
  slower, nothing lost; the gateway stays ready;
* TCP resets while a worker's group-commit transactions are open (PostgreSQL logs the
  open transactions it lost): the transactions roll back whole and are retried;
* the gateway's broker links cut with viewers on the live feed: /readyz says 503,
  the viewers end with exactly the rows.
"""

from __future__ import annotations

from tests.chaos import faults as fk
from tests.chaos.cluster import Stack
from tests.chaos.harness import Config, run_on


def test_each_network_fault_keeps_every_guarantee(stack_restored: Stack) -> None:
    cfg = Config(
        runs=60,
        users=12,
        brokers=1,
        workers=3,
        min_run_s=0.5,
        max_run_s=3.0,
        watch_fraction=0.3,
        poison_runs=0,
        poison_rounds=0,
        flaky_fraction=0.0,
        kinds=fk.NETWORK_KINDS,
        min_faults=len(fk.NETWORK_KINDS),
        fault_gap_s=0.5,
        submit_window_s=30.0,
        partitions=8,
        max_inflight=4,
        slow_s=4.0,
        schedules=0,
        deadline_s=240.0,
        seed=20261201,
    )
    report = run_on(cfg, stack_restored)
    print(report.table())
    assert report.ok, "\n".join(report.violations[:40]) + "\n\n" + report.table()
    by_kind = {x.kind: x for x in report.faults}
    assert set(by_kind) == set(fk.NETWORK_KINDS)
    assert report.findings.lost == 0 and report.findings.offsets_ahead == 0

    cut = by_kind[fk.NET_WORKER_KAFKA_CUT]
    assert cut.handoff_s is not None, cut.notes  # its partitions moved on
    assert cut.recover_s is not None, cut.notes  # and it got partitions back

    pg_cut = by_kind[fk.NET_WORKER_PG_CUT]
    assert pg_cut.kept is not None and pg_cut.kept[0] == pg_cut.kept[1], pg_cut.notes

    reset = by_kind[fk.NET_PG_RESET]
    assert reset.open_txns_reset > 0, reset.notes

    feed = by_kind[fk.NET_GATEWAY_FEED_CUT]
    assert "/readyz while cut: 503" in feed.notes, feed.notes
    assert feed.viewers > 0, feed.notes
    assert feed.recover_s is not None
    assert "/readyz while slow: 200" in by_kind[fk.NET_GATEWAY_KAFKA_SLOW].notes

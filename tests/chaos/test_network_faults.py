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
        submit_window_s=90.0,  # traffic through the last fault: a reset needs open commits
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
    of: dict[str, list[fk.Fault]] = {}
    for x in report.faults:
        of.setdefault(x.kind, []).append(x)
    assert set(of) == set(fk.NETWORK_KINDS)
    assert report.findings.lost == 0 and report.findings.offsets_ahead == 0
    # What must hold at every fault of a kind is asserted for each; what needs traffic on
    # the victim at that moment (a handoff to time, a transaction open to cut, a viewer
    # on the feed) for at least one, since the load ends before the faults do.

    cuts = of[fk.NET_WORKER_KAFKA_CUT]
    assert any(c.handoff_s is not None for c in cuts), [c.notes for c in cuts]  # moved on
    assert all(c.recover_s is not None for c in cuts), [c.notes for c in cuts]  # came back

    pg_cuts = [c for c in of[fk.NET_WORKER_PG_CUT] if c.kept is not None]
    assert pg_cuts, [c.notes for c in of[fk.NET_WORKER_PG_CUT]]
    assert all(c.kept[0] == c.kept[1] for c in pg_cuts if c.kept), [c.notes for c in pg_cuts]

    resets = of[fk.NET_PG_RESET]
    assert any(r.open_txns_reset > 0 for r in resets), [r.notes for r in resets]

    feeds = of[fk.NET_GATEWAY_FEED_CUT]
    assert all("/readyz while cut: 503" in f.notes for f in feeds), [f.notes for f in feeds]
    assert all(f.recover_s is not None for f in feeds), [f.notes for f in feeds]
    assert any(f.viewers > 0 for f in feeds), [f.notes for f in feeds]
    slows = of[fk.NET_GATEWAY_KAFKA_SLOW]
    assert all("/readyz while slow: 200" in f.notes for f in slows), [f.notes for f in slows]

"""The in-flight bench's pure parts: gauges parsed, probe ticks, host CPU, the verdict."""

from __future__ import annotations

import argparse
import math

from tests.bench import inflight
from tests.bench.inflight import Step, distinct_ticks, host_busy, parse_gauges, verdict


def step(
    n: int, lag_p99_ms: float = 5.0, cpu: float = 40.0, in_flight: float | None = None
) -> Step:
    return Step(
        n=n,
        in_flight=n if in_flight is None else in_flight,
        in_flight_db=n,
        rss_idle_kib=100_000,
        rss_kib=100_000 + 50 * n,
        cpu_pct=cpu,
        loop_cpu_pct=cpu * 0.8,
        runq_pct=3.0,
        lag_ms=[1.0, 2.0, lag_p99_ms],
        chunk_p50_ms=20,
        chunk_p99_ms=60,
        tokens_s=n * 6.5,
        offered_s=n * 6.7,
        run_p50_s=20.1,
        started=n * 2,
        late=1,
        host_pct=50,
        load1=1.0,
    )


def test_parse_gauges_reads_unlabelled_values_only() -> None:
    page = "\n".join(
        [
            "# HELP koda_runs_in_flight Runs this process is executing right now.",
            "# TYPE koda_runs_in_flight gauge",
            "koda_runs_in_flight 212.0",
            'koda_runs_waiting{reason="user_order"} 3.0',
            "koda_event_loop_lag_seconds 0.0375",
            "koda_event_loop_lag_seconds_extra 9",
        ]
    )
    got = parse_gauges(page, ["koda_runs_in_flight", "koda_event_loop_lag_seconds"])
    assert got == {"koda_runs_in_flight": 212.0, "koda_event_loop_lag_seconds": 0.0375}
    assert parse_gauges(page, ["koda_runs_waiting"]) == {}


def test_distinct_ticks_drops_repeats_of_one_wake_up() -> None:
    assert distinct_ticks([0.001, 0.001, 0.004, 0.004, 0.004, 0.001]) == [0.001, 0.004, 0.001]
    assert distinct_ticks([]) == []


def test_host_busy_counts_idle_and_iowait_as_not_busy() -> None:
    before = [100, 0, 50, 800, 50, 0, 0, 0, 0, 0]
    after = [200, 0, 100, 900, 50, 0, 0, 0, 0, 0]  # 150 busy of 250
    assert host_busy(before, after) == 0.6
    assert math.isnan(host_busy(before, before))


def test_memory_per_run_is_the_growth_over_runs_in_flight() -> None:
    s = step(256, in_flight=200)
    assert s.per_run_kib == 50 * 256 / 200


def test_verdict_is_the_largest_size_that_passes_with_all_smaller_ones() -> None:
    steps = [step(64), step(128), step(256, lag_p99_ms=140), step(512)]  # 512: a noisy pass
    n, line = verdict(steps)
    assert n == 128
    assert "at 256" in line and "loop lag p99 140 ms" in line


def test_verdict_fails_on_cpu_and_on_runs_not_reaching_flight() -> None:
    assert verdict([step(64), step(128, cpu=95)])[0] == 64
    assert verdict([step(64), step(128, in_flight=100)])[0] == 64  # below 90 % of N
    assert verdict([step(64, cpu=99)]) == (None, verdict([step(64, cpu=99)])[1])
    assert verdict([step(64), step(128)])[0] == 128
    assert verdict([])[0] is None


def test_table_prints_every_size_and_the_verdict() -> None:
    args = argparse.Namespace(
        partitions=16, run_s=20.0, delay_ms=[100, 200], hold_s=40.0, lag_limit_ms=100, cpu_limit=90
    )
    out = inflight.table([step(128), step(64)], args).render()
    lines = out.splitlines()
    assert lines[3].startswith("64 ") and lines[4].startswith("128 ")
    assert "one worker serves 128 runs in flight" in out

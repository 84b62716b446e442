"""W1's tables when a trial fails: its repetition leaves the ratios, the others stand."""

from __future__ import annotations

import argparse

from tests.bench.goals import goals_table
from tests.bench.w1_throughput import measure_trial, paired, w1_table


def trial(rep: int, runs_s: float, cpu_ms: float) -> dict[str, float]:
    return {
        "rep": rep,
        "runs": 100,
        "runs_s": runs_s,
        "chunks_s": 16 * runs_s,
        "cpu_ms": cpu_ms,
        "gen_cpu_ms": 0.2,
        "load1": 1.0,
        "done": 100,
    }


def args() -> argparse.Namespace:
    return argparse.Namespace(
        runs=100, users=10, repeat=3, workers=[2], rival_procs=2, naive_share=1.0
    )


def test_paired_matches_repetitions_not_positions() -> None:
    koda = [trial(0, 100, 4), trial(1, 200, 4), trial(2, 300, 4)]
    quix = [trial(0, 100, 2), trial(2, 150, 2)]  # repetition 1 failed
    assert [(a["rep"], b["rep"]) for a, b in paired(koda, quix)] == [(0, 0), (2, 2)]


def test_a_failed_rival_leaves_only_its_repetition_out_of_the_goals() -> None:
    results = {
        ("koda worker", 2): [trial(0, 100, 4), trial(1, 200, 4), trial(2, 300, 4)],
        ("ceiling", 2): [trial(0, 100, 2), trial(1, 100, 2), trial(2, 100, 2)],
        ("quix", 2): [trial(1, 100, 2), trial(2, 100, 2)],
    }
    table = w1_table(results, args(), ["quix procs=2 in repetition 1"])
    assert table.figures["w1_worker_ceiling"] == [1.0, 2.0, 3.0]
    assert table.figures["w1_worker_quix"] == [2.0, 3.0]
    assert any("FAILED twice" in note for note in table.notes)
    goals = goals_table([table], None, quick=False).render()
    assert "not measured" in goals  # W2, W3 and replay did not run


def test_measure_trial_runs_a_failed_trial_once_more_then_gives_up() -> None:
    calls: list[int] = []

    def flaky() -> dict[str, float]:
        calls.append(1)
        if len(calls) == 1:
            raise AssertionError("group bench-quix not stable with 2 members")
        return {"runs_s": 1.0}

    assert measure_trial(flaky, "quix") == {"runs_s": 1.0}
    assert len(calls) == 2

    def broken() -> dict[str, float]:
        raise AssertionError("worker w0 exited")

    assert measure_trial(broken, "koda worker") is None

"""The goals ``make bench`` is held to, each judged from the figures it measured.

Every workload's table carries its per-repetition figures by name (``Table.figures``);
a goal takes the median over the repetitions of one of them (ratios are taken within
each repetition first) and compares it with its target. A goal whose workload did not
run, or whose figure is missing, is printed as "not measured", never as met. A goal
measured at a scaled-down size says so beside its figure.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from tests.bench.common import Table, fmt

FULL_W1_RUNS = 20_000


@dataclass(frozen=True)
class Goal:
    workload: str
    what: str
    figure: str  # the name in Table.figures
    op: str  # ">=" or "<="
    target: float
    digits: int = 2

    def judge(self, figures: dict[str, list[float]]) -> tuple[str, str]:
        """(measured, verdict): the repetitions' median [min-max], and met / not met."""
        values = [v for v in figures.get(self.figure, []) if not math.isnan(v)]
        if not values:
            return "-", "not measured"
        med = statistics.median(values)
        met = med >= self.target if self.op == ">=" else med <= self.target
        return fmt(values, self.digits), "met" if met else "NOT MET"


GOALS = (
    Goal(
        "W1",
        "koda e2e / the same with the ledger off, runs/s (ledger + budgets cost <= 5 %)",
        "w1_ledger_overhead",
        ">=",
        0.95,
        3,
    ),
    Goal("W1", "koda worker / ceiling runs/s (2 procs)", "w1_worker_ceiling", ">=", 0.8),
    Goal("W1", "koda worker / Quix Streams runs/s (2 procs)", "w1_worker_quix", ">=", 1.1),
    Goal("W1", "koda worker / ceiling CPU per run", "w1_cpu_ceiling", "<=", 1.3),
    Goal("W2", "yield -> viewer p99 ms at 80 % of the knee", "w2_lat99", "<=", 150, 0),
    Goal("W2", "that p99 / raw producer -> consumer p99", "w2_ratio_raw", "<=", 2.0),
    Goal("W2", "TTFC p50 ms at 80 % of the knee", "w2_ttfc50", "<=", 150, 0),
    Goal("W2", "TTFC p99 ms at 80 % of the knee", "w2_ttfc99", "<=", 500, 0),
    Goal("W3", "gateway POST/s at concurrency 32", "w3_rps_32", ">=", 1500, 0),
    Goal("W3", "gateway / bare handler POST/s at concurrency 32", "w3_ratio_32", ">=", 0.4),
    Goal(
        "replay", "koda replay into DuckDB / raw consume records/s", "replay_ratio", ">=", 0.25, 3
    ),
    Goal(
        "W4",
        "koda concurrent streams / direct, each at its highest sustained arrival rate",
        "w4_streams_ratio",
        ">=",
        0.5,
    ),
    Goal("W4", "koda added TTFC p50 ms at its sustained rate", "w4_ttfc_added50", "<=", 50, 0),
    Goal("W4", "koda added TTFC p99 ms at its sustained rate", "w4_ttfc_added99", "<=", 150, 0),
)


def target(figure: str) -> float:
    """The target of the goal judged on ``figure`` (for a workload's own table)."""
    return next(g.target for g in GOALS if g.figure == figure)


def goals_table(tables: list[Table], w1_runs: int | None, quick: bool) -> Table:
    """Every goal with its measured figure and met / not met."""
    figures: dict[str, list[float]] = {}
    for t in tables:
        figures.update(t.figures)
    out = Table(
        "Goals (median [min-max] of the repetitions; ratios within each repetition)",
        ["workload", "goal", "target", "measured", "verdict"],
    )
    for g in GOALS:
        measured, verdict = g.judge(figures)
        out.add(g.workload, g.what, f"{g.op} {g.target:g}", measured, verdict)
    if w1_runs is not None and w1_runs < FULL_W1_RUNS:
        out.notes.append(
            f"W1 measured at {w1_runs} runs per trial; the goals are set at {FULL_W1_RUNS:,} "
            f"(--runs {FULL_W1_RUNS})"
        )
    if quick:
        out.notes.append("QUICK run: one repetition, short steps; not for reporting")
    met = sum(g.judge(figures)[1] == "met" for g in GOALS)
    out.notes.append(f"{met} of {len(GOALS)} goals met")
    return out

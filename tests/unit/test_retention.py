"""Retention's pure parts: the duration settings and how a run's rows collapse."""

from __future__ import annotations

import json
from collections import namedtuple

import pytest
from typer.testing import CliRunner

from koda_runtime.cli import app
from koda_runtime.errors import ConfigError
from koda_runtime.lifecycle.chunks import visible_output
from koda_runtime.processors.retention import collapse_plan
from koda_runtime.settings import Settings, parse_duration

DEV = {"APP_ENV": "dev"}
Row = namedtuple("Row", "seq kind content attempt")


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        ("30d", 30 * 86400),
        ("12h", 43200),
        ("90m", 5400),
        ("45s", 45),
        ("2w", 14 * 86400),
        ("600", 600),
        ("1.5d", 1.5 * 86400),
        (" 7D ", 7 * 86400),
        ("0", 0),
    ],
)
def test_durations_read_as_seconds(raw: str, seconds: float) -> None:
    assert parse_duration(raw) == seconds


@pytest.mark.parametrize("raw", ["7x", "-1d", "d", "7 days", "1e3", "forever", "7d12h"])
def test_a_bad_duration_is_refused_naming_the_setting(raw: str) -> None:
    for env in ("KODA_CHUNK_RETENTION", "KODA_RUN_RETENTION", "KODA_LEDGER_RETENTION"):
        with pytest.raises(ConfigError) as exc:
            Settings.from_env(DEV | {env: raw})
        assert str(exc.value).startswith(f"{env}={raw!r}: use a duration")


def test_the_defaults_keep_chunks_a_week_and_runs_and_the_ledger_for_ever() -> None:
    s = Settings.from_env(DEV)
    assert (s.chunk_retention_s, s.run_retention_s, s.ledger_retention_s) == (7 * 86400, 0, 0)
    assert Settings.from_env(DEV | {"KODA_CHUNK_RETENTION": "0"}).chunk_retention_s == 0


def test_the_ledger_is_kept_at_least_a_month_unless_for_ever() -> None:
    with pytest.raises(ConfigError, match=r"^KODA_LEDGER_RETENTION=2\.592e\+06s must be 0"):
        Settings.from_env(DEV | {"KODA_LEDGER_RETENTION": "30d"})
    assert Settings.from_env(DEV | {"KODA_LEDGER_RETENTION": "31d"}).ledger_retention_s == (
        31 * 86400
    )


def test_the_cli_refuses_a_bad_value_in_one_line() -> None:
    result = CliRunner().invoke(
        app, ["retention", "sweep", "--dry-run"], env=DEV | {"KODA_RUN_RETENTION": "soon"}
    )
    assert result.exit_code == 2
    assert "KODA_RUN_RETENTION='soon': use a duration" in result.output
    assert "Traceback" not in result.output


def rows(*kinds: str) -> list[Row]:
    return [Row(i, k, f"t{i}" if k == "chunk" else "", 1 + (i >= 4)) for i, k in enumerate(kinds)]


def test_a_run_collapses_to_a_reset_its_output_and_its_terminal_event() -> None:
    run = rows("chunk", "chunk", "reset", "chunk", "tool", "chunk", "chunk", "done")
    plan = collapse_plan("r", run)
    output = visible_output((r.seq, r.kind, r.content) for r in run)
    assert output == "t3t5t6"
    assert plan.output_seq == 6 and plan.through == 5
    assert plan.rows[0] == (6, "chunk", output, 2)
    seq, kind, content, attempt = plan.rows[1]
    assert (seq, kind, attempt) == (5, "reset", 2)
    assert json.loads(content)["reason"] == "expired"
    # What readers see once the rows up to the reset are gone, and before: the output once.
    kept = {r.seq: (r.kind, r.content) for r in run}
    kept |= {s: (k, c) for s, k, c, _ in plan.rows}
    assert visible_output((s, k, c) for s, (k, c) in kept.items()) == output
    assert visible_output((s, k, c) for s, (k, c) in kept.items() if s > 5) == output


def test_a_run_ended_without_a_terminal_event_keeps_its_output_at_its_last_seq() -> None:
    plan = collapse_plan("r", rows("chunk", "chunk", "chunk"))
    assert plan.output_seq == 2 and plan.through == 1
    assert plan.rows[0] == (2, "chunk", "t0t1t2", 1)


@pytest.mark.parametrize(
    ("kinds", "output_seq", "through"),
    [
        ((), None, None),
        (("error",), None, None),
        (("chunk", "done"), 0, None),
        (("chunk",), 0, None),
        (("chunk", "chunk", "done"), 1, 0),
    ],
)
def test_short_runs(kinds: tuple[str, ...], output_seq: int | None, through: int | None) -> None:
    plan = collapse_plan("r", rows(*kinds))
    assert (plan.output_seq, plan.through) == (output_seq, through)
    assert len(plan.rows) == (output_seq is not None) + (through is not None)

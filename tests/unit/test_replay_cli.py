"""`koda replay` options: what they accept and the errors people get (no services: every
one of these fails before Kafka is contacted)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from koda_runtime import cli
from koda_runtime.naming import AppEnv, Names
from koda_runtime.topics.replay.errors import BadTimestampError, OffsetsFileError, UnknownTopicError
from koda_runtime.topics.replay.positions import (
    Earliest,
    FromOffsets,
    FromTimestamp,
    format_offsets,
    parse_offsets_file,
    parse_timestamp,
    select_topics,
    start_spec,
)

runner = CliRunner()
NAMES = Names(AppEnv.DEV, "cli")
# Nothing listens on port 1: anything that reached for Kafka would fail differently.
ENV = {"APP_ENV": "dev", "KODA_NAMESPACE": "cli", "KODA_KAFKA_BOOTSTRAP": "127.0.0.1:1"}


def replay(*args: str) -> tuple[int, str]:
    result = runner.invoke(cli.app, ["replay", "--quiet", *args], env=ENV)
    return result.exit_code, result.stderr


def test_an_unknown_topic_is_named_with_the_valid_ones() -> None:
    code, err = replay("runs", "run-chunk")
    assert code == 2
    assert "unknown topic 'run-chunk': replayable topics are runs, run-events, run-chunks," in err
    assert select_topics(NAMES, ["runs", "dev.koda.cli.runs", "runs-dlq"]) == [
        "dev.koda.cli.runs",
        "dev.koda.cli.runs-dlq",
    ]
    assert len(select_topics(NAMES, [])) == 4
    with pytest.raises(UnknownTopicError, match="'workers'"):
        select_topics(NAMES, ["workers"])  # heartbeats are not replayed


def test_a_bad_timestamp_names_the_value_and_the_formats() -> None:
    code, err = replay("--from-timestamp", "last tuesday")
    assert code == 2
    assert "--from-timestamp 'last tuesday' is not a time: use an ISO 8601 date or time" in err
    assert "unix seconds" in err and "-2h" in err


def test_timestamps_people_write() -> None:
    now = datetime(2025, 1, 31, 12, 0, tzinfo=UTC)
    ms = int(now.timestamp() * 1000)
    assert parse_timestamp("2025-01-31T12:00:00Z") == ms
    assert parse_timestamp("2025-01-31T14:00:00+02:00") == ms
    assert parse_timestamp("2025-01-31T12:00:00") == ms  # no zone: UTC
    assert parse_timestamp("2025-01-31") == ms - 12 * 3600 * 1000
    assert parse_timestamp(str(ms // 1000)) == ms
    assert parse_timestamp(str(ms)) == ms
    assert parse_timestamp("-2h", now=now) == ms - 2 * 3600 * 1000
    assert parse_timestamp("-7d", now=now) == ms - 7 * 86400 * 1000
    for bad in ("", "2025-13-01", "-2w", "yesterday", "12:00"):
        with pytest.raises(BadTimestampError):
            parse_timestamp(bad)


def test_a_malformed_offsets_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "offsets.txt"
    path.write_text("# saved\nruns 0 12\n\nrun-chunks three 4\n")
    code, err = replay("--from-offsets", str(path))
    assert code == 2
    assert f'--from-offsets {path} line 4: expected "<topic> <partition> <offset>"' in err
    assert "'run-chunks three 4'" in err
    path.write_text("runz 0 1\n")
    with pytest.raises(OffsetsFileError, match="line 1: unknown topic 'runz'"):
        parse_offsets_file(path, NAMES)
    with pytest.raises(OffsetsFileError, match="cannot read it"):
        parse_offsets_file(tmp_path / "missing.txt", NAMES)


def test_an_offsets_file_round_trips(tmp_path: Path) -> None:
    positions = {("dev.koda.cli.runs", 0): 12, ("dev.koda.cli.run-chunks", 3): 7}
    path = tmp_path / "offsets.txt"
    path.write_text(format_offsets(positions))
    assert dict(parse_offsets_file(path, NAMES).offsets) == positions
    path.write_text("runs 1 5  # catalogue names work too\n")
    assert dict(parse_offsets_file(path, NAMES).offsets) == {("dev.koda.cli.runs", 1): 5}


def test_an_unreachable_sink_is_named_without_its_password() -> None:
    code, err = replay("--to", "postgresql://analyst:hunter2@127.0.0.1:1/warehouse")
    assert code == 2
    assert "cannot reach postgresql://analyst:***@127.0.0.1:1/warehouse" in err
    assert "hunter2" not in err
    code, err = replay("--to", "duckdb:////nonexistent-dir/warehouse.duckdb")
    assert code == 2 and "cannot open duckdb:////nonexistent-dir/warehouse.duckdb" in err
    code, err = replay("--to", "sqlite:///w.db")
    assert code == 2 and "--to sqlite:///w.db: unknown sink" in err


def test_one_start_only_and_a_known_one() -> None:
    code, err = replay("--from", "earliest", "--from-timestamp", "-1h")
    assert code == 2 and "use one of --from, --from-timestamp, not several" in err
    code, err = replay("--from", "latest")
    assert code == 2 and "--from 'latest': use --from earliest" in err
    assert isinstance(start_spec(NAMES, None, None, None), Earliest)
    assert isinstance(start_spec(NAMES, "earliest", None, None), Earliest)
    assert isinstance(start_spec(NAMES, None, "-1h", None), FromTimestamp)
    assert FromOffsets("f").describe() == "offsets in f"


def test_a_job_name_must_be_a_name_part() -> None:
    code, err = replay("--job", "Nightly Load", "--dry-run")
    assert code == 2 and "'Nightly Load' is not a valid name part" in err
    assert NAMES.replay_group("nightly") == "dev.koda.cli.replay.nightly"
    assert NAMES.replay_group("workers") != NAMES.group("workers")


def test_the_batch_default_the_help_states_is_the_engines() -> None:
    from koda_runtime.topics.replay.engine import BATCH_RECORDS, ReplayOptions

    result = runner.invoke(cli.app, ["replay", "--help"], env=ENV | {"COLUMNS": "200"})
    assert f"(default {BATCH_RECORDS:,})" in " ".join(result.stdout.split())
    assert ReplayOptions().batch_records == BATCH_RECORDS
    code, err = replay("--batch", "0")
    assert code == 2 and "--batch" in err


def test_a_poll_never_takes_more_than_the_batch_or_a_second_of_the_rate_cap() -> None:
    from types import SimpleNamespace

    from koda_runtime.topics.replay.engine import POLL_RECORDS, Replay, ReplayOptions

    def size(batched: int, **opts: object) -> int:
        return Replay._poll_size(SimpleNamespace(options=ReplayOptions(**opts)), batched)  # type: ignore[arg-type]

    assert size(0) == POLL_RECORDS
    assert size(0, batch_records=100) == 100
    assert size(70, batch_records=100) == 30
    assert size(100, batch_records=100) == 1
    assert size(0, batch_records=100, max_rate=40.0) == 40

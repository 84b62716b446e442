"""Which topics a replay reads and where it starts: the parsing of its options.

Start positions (one of):

    --from earliest          the first retained offset of every partition (the default)
    --from-timestamp T       the first record at or after T in every partition
    --from-offsets FILE      the offsets in FILE; partitions it does not list start earliest

An offsets file has one ``<topic> <partition> <offset>`` line per partition (the topic
as its catalogue name, ``runs``, or its full name); blank lines and ``#`` comments are
skipped. ``koda replay --save-offsets FILE`` writes the same format, so a one-shot
replay can continue where the last one stopped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from koda_runtime.naming import Names
from koda_runtime.topics.replay.errors import (
    BadTimestampError,
    OffsetsFileError,
    ReplayOptionError,
    UnknownTopicError,
)
from koda_runtime.topics.replay.rows import REPLAYABLE

TIMESTAMP_FORMATS = (
    "an ISO 8601 date or time (2025-01-31, 2025-01-31T12:00:00Z, 2025-01-31T14:00:00+02:00; "
    "no zone means UTC), unix seconds (1738324800) or milliseconds (1738324800000), "
    "or an age such as -30m, -2h, -7d"
)
_AGE = re.compile(r"^-(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

TopicPartition = tuple[str, int]


@dataclass(frozen=True)
class Earliest:
    def describe(self) -> str:
        return "earliest"


@dataclass(frozen=True)
class FromTimestamp:
    ms: int

    def describe(self) -> str:
        return f"timestamp {datetime.fromtimestamp(self.ms / 1000, UTC).isoformat()}"


@dataclass(frozen=True)
class FromOffsets:
    path: str
    offsets: Mapping[TopicPartition, int] = field(default_factory=dict)

    def describe(self) -> str:
        return f"offsets in {self.path}"


StartSpec = Earliest | FromTimestamp | FromOffsets


def select_topics(names: Names, requested: Sequence[str]) -> list[str]:
    """Full topic names for ``requested`` (catalogue or full names; empty: all four).

    Raises UnknownTopicError naming the topic and listing the replayable ones.
    """
    known = {names.topic(b): names.topic(b) for b in REPLAYABLE}
    known |= {b: names.topic(b) for b in REPLAYABLE}
    out: list[str] = []
    for name in requested or REPLAYABLE:
        full = known.get(name)
        if full is None:
            raise UnknownTopicError(
                f"unknown topic {name!r}: replayable topics are {', '.join(REPLAYABLE)}"
                f" (or their full names, e.g. {names.topic(REPLAYABLE[0])})"
            )
        if full not in out:
            out.append(full)
    return out


def parse_timestamp(text: str, *, now: datetime | None = None) -> int:
    """``text`` as epoch milliseconds; raises BadTimestampError listing the formats."""
    value = text.strip()
    age = _AGE.match(value)
    if age:
        seconds = float(age.group(1)) * _UNITS[age.group(2)]
        return int(((now or datetime.now(UTC)) - timedelta(seconds=seconds)).timestamp() * 1000)
    if re.fullmatch(r"\d{1,16}(\.\d+)?", value):
        number = float(value)
        return int(number if number >= 1e11 else number * 1000)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise BadTimestampError(
            f"--from-timestamp {text!r} is not a time: use {TIMESTAMP_FORMATS}"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def parse_offsets_file(path: Path, names: Names) -> FromOffsets:
    """Read an offsets file; raises OffsetsFileError naming the file and the bad line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise OffsetsFileError(f"--from-offsets {path}: cannot read it: {exc}") from None
    full = {b: names.topic(b) for b in REPLAYABLE} | {
        names.topic(b): names.topic(b) for b in REPLAYABLE
    }
    offsets: dict[TopicPartition, int] = {}
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        where = f"--from-offsets {path} line {number}"
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise OffsetsFileError(
                f'{where}: expected "<topic> <partition> <offset>" with non-negative'
                f" integers, got {line.strip()!r}"
            )
        topic = full.get(parts[0])
        if topic is None:
            raise OffsetsFileError(
                f"{where}: unknown topic {parts[0]!r}; use one of {', '.join(REPLAYABLE)}"
            )
        offsets[(topic, int(parts[1]))] = int(parts[2])
    return FromOffsets(str(path), offsets)


def format_offsets(positions: Mapping[TopicPartition, int]) -> str:
    """An offsets file for ``positions`` (the next offset to read per partition)."""
    lines = ["# koda replay positions: <topic> <partition> <next offset>"]
    lines += [f"{topic} {p} {offset}" for (topic, p), offset in sorted(positions.items())]
    return "\n".join(lines) + "\n"


def start_spec(
    names: Names, start: str | None, timestamp: str | None, offsets_file: Path | None
) -> StartSpec:
    """The one start position the options ask for (default: earliest)."""
    given = [
        o
        for o, v in (
            ("--from", start),
            ("--from-timestamp", timestamp),
            ("--from-offsets", offsets_file),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise ReplayOptionError(f"use one of {', '.join(given)}, not several")
    if timestamp is not None:
        return FromTimestamp(parse_timestamp(timestamp))
    if offsets_file is not None:
        return parse_offsets_file(offsets_file, names)
    if start not in (None, "earliest"):
        raise ReplayOptionError(
            f"--from {start!r}: use --from earliest, --from-timestamp T or --from-offsets FILE"
        )
    return Earliest()

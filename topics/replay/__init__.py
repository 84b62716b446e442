"""``koda replay``: koda's topics into a warehouse (DuckDB, PostgreSQL, Parquet).

Modules: ``positions`` (which topics, where to start), ``reader`` (the confluent-kafka
consumer, one-shot or a named job), ``rows`` (records into rows) and ``batch`` (the rows
of one transaction), ``tables`` (the warehouse tables and their upsert rules), ``sql``
(the SQL text the sinks run), ``prices`` (usage money), ``sinks/`` (one per warehouse
kind), ``progress`` (the progress line and the summary), ``engine`` (the loop),
``errors`` (its branch of the KodaError tree).
"""

from __future__ import annotations

from koda_runtime.topics.replay.engine import ReplayOptions, run_replay
from koda_runtime.topics.replay.errors import (
    BadTimestampError,
    OffsetsFileError,
    ReplayError,
    ReplayOptionError,
    SinkError,
    UnknownTopicError,
)
from koda_runtime.topics.replay.positions import start_spec
from koda_runtime.topics.replay.progress import Progress, ReplaySummary

__all__ = [
    "BadTimestampError",
    "OffsetsFileError",
    "Progress",
    "ReplayError",
    "ReplayOptionError",
    "ReplayOptions",
    "ReplaySummary",
    "SinkError",
    "UnknownTopicError",
    "run_replay",
    "start_spec",
]

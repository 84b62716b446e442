"""The errors of ``koda replay``, a branch of the KodaError tree (koda/errors.py).

    ReplayError                 (koda_runtime.errors)
    ├── ReplayOptionError       an option's value is wrong; nothing was read or written
    │   ├── UnknownTopicError   not one of the replayable topics (the message lists them)
    │   ├── BadTimestampError   --from-timestamp is not a time (the message lists formats)
    │   └── OffsetsFileError    a --from-offsets line is malformed (the message names it)
    ├── SinkError               the warehouse refused a write or cannot be reached; the
    │                           message names the sink URL without its password
    └── SourceError             koda's Postgres cannot be read (the erasures, the export)

Each message says what was wrong and what to do; the CLI prints it and exits 2.
"""

from __future__ import annotations

from koda_runtime.errors import ReplayError

__all__ = [
    "BadTimestampError",
    "OffsetsFileError",
    "ReplayError",
    "ReplayOptionError",
    "SinkError",
    "SourceError",
    "UnknownTopicError",
]


class ReplayOptionError(ReplayError):
    """An option's value is wrong."""


class UnknownTopicError(ReplayOptionError):
    """A topic that is not one of the replayable topics."""


class BadTimestampError(ReplayOptionError):
    """A ``--from-timestamp`` value that is not a time."""


class OffsetsFileError(ReplayOptionError):
    """A ``--from-offsets`` file that cannot be read or has a malformed line."""


class SinkError(ReplayError):
    """The sink cannot be reached or refused a write (the batch was rolled back)."""


class SourceError(ReplayError):
    """koda's Postgres cannot be read: the erasure receipts or the exported tables."""

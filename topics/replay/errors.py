"""The errors of ``koda replay``: the ReplayError branch of the one error tree, drawn
with every other class in koda/errors.py's docstring. Each message says what was wrong
and what to do; the CLI prints it and exits 2.
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

"""The exception tree every koda package raises from.

    KodaError
    ├── ConfigError            a setting is missing or invalid (bad APP_ENV, bad port...)
    ├── ServiceError           a local service (Kafka, PostgreSQL) cannot be set up or reached
    │   └── PrerequisiteError  a required program or download is missing (java, initdb...)
    ├── TopicError             the topic catalogue and the broker disagree, or admin calls failed
    ├── DatabaseError          a Postgres call failed after bounded retries
    ├── RecordError            a Kafka record cannot be decoded or is invalid (goes to the DLQ)
    ├── DeadLetterError        a dead letter id is malformed or not on the DLQ topic
    ├── TransitionRejected     a conditional status write matched zero rows
    ├── HandlerError           the job handler failed (retried, then dead-lettered)
    └── ReplayError            a warehouse replay cannot go on (topics/replay/errors.py
                               draws its branches: bad options, the sink)

Third-party errors are wrapped at the boundary with ``raise ... from exc`` and
translated to HTTP statuses or DLQ reasons only at the edges.
"""

from __future__ import annotations


class KodaError(Exception):
    """Root of every error koda raises on purpose."""


class ConfigError(KodaError):
    """A setting is missing or invalid; the message names it and the accepted values."""


class ServiceError(KodaError):
    """A local service could not be started, stopped or reached."""


class PrerequisiteError(ServiceError):
    """A program or artifact koda needs is not installed; the message says how to get it."""


class TopicError(KodaError):
    """Creating or checking topics failed, or the broker's topics drifted from the catalogue."""


class DatabaseError(KodaError):
    """A database operation failed after its bounded retries."""


class RecordError(KodaError):
    """A record could not be decoded or validated.

    ``reason`` is a short machine-readable code used as the DLQ reason and metric label.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class DeadLetterError(KodaError):
    """A dead letter id is malformed or names no record of the DLQ topic."""


class TransitionRejected(KodaError):
    """A status write matched zero rows: another writer moved first, or the fence is stale."""


class HandlerError(KodaError):
    """The job handler raised; the run is retried in place, then dead-lettered."""


class ReplayError(KodaError):
    """Replaying topics into a warehouse failed; the message names the value or the sink."""

"""The exception tree every koda package raises from: every exception class of the
product, drawn here by inheritance with its module (none: this module). A second base
kept for callers that catch it is named "also". tests/unit/test_error_tree.py finds the
classes by parsing the product's folders and fails when one is missing from this drawing,
drawn under the wrong parent, or not a KodaError without being listed under "Not errors".

    KodaError                 the root: every error koda raises on purpose
    ├── ConfigError           a setting is missing or invalid (bad APP_ENV, bad port...)
    │   └── ToolDeclarationError  processors/tools/registry.py  a @tool koda cannot use
    ├── ServiceError          a local service (Kafka, PostgreSQL) cannot be set up or reached
    │   └── PrerequisiteError  a required program or download is missing (java, initdb...)
    │       └── PgvectorMissing  schemas/migrations/versions/0009_memories.py  no pgvector
    ├── TopicError            the topic catalogue and the broker disagree, or admin calls failed
    ├── DatabaseError         a Postgres call failed after bounded retries
    ├── RecordError           a Kafka record cannot be decoded or is invalid (goes to the DLQ)
    ├── DeadLetterError       a dead letter id is malformed or not on the DLQ topic
    ├── TransitionRejected    a conditional status write matched zero rows
    ├── Refused               a well-formed request that cannot be done; nothing written
    │   ├── SessionNotOwned   the session id names another user's session
    │   ├── TooManyActiveRuns  the user has the most runs not yet ended a user may have
    │   ├── OverBudget        koda/lifecycle/ledger.py  a new run would break a spent budget
    │   └── CapReached        koda/caps.py  a per-user cap (it names the setting)
    ├── PublishError          the broker refused or did not acknowledge a record
    ├── HandlerError          the job handler failed (retried, then dead-lettered)
    │   ├── RunFailed         koda/lifecycle/handler.py  the run ends failed; no retry
    │   │   └── OutputRefused  processors/streaming.py  its output was refused
    │   └── AwaitingApproval  processors/tools/toolbox.py  the run waits for a person
    ├── ReplayError           a warehouse replay cannot go on
    │   ├── ReplayOptionError  topics/replay/errors.py  an option's value is wrong
    │   │   ├── UnknownTopicError  topics/replay/errors.py  not a replayable topic
    │   │   ├── BadTimestampError  topics/replay/errors.py  --from-timestamp is not a time
    │   │   └── OffsetsFileError  topics/replay/errors.py  --from-offsets cannot be read
    │   ├── SinkError         topics/replay/errors.py  the sink is unreachable or refused a write
    │   └── SourceError       topics/replay/errors.py  koda's Postgres cannot be read
    ├── GatewayError          gateway/errors.py  an HTTP refusal: status and code
    │   ├── Unauthorized      gateway/errors.py  401
    │   ├── Forbidden         gateway/errors.py  403
    │   ├── NotFound          gateway/errors.py  404
    │   ├── PayloadTooLarge   gateway/errors.py  413
    │   │   └── BatchTooLarge  gateway/batch.py  413: a batch of too many runs
    │   ├── UnsupportedMediaType  gateway/errors.py  415
    │   ├── BadRequest        gateway/errors.py  400
    │   │   └── ClientGone    gateway/quotas.py  400: the client left before its whole body
    │   ├── InvalidField      gateway/errors.py  422: the field named is invalid
    │   ├── PaymentRequired   gateway/errors.py  402: a spent budget (OverBudget's answer)
    │   ├── RateLimited       gateway/errors.py  429
    │   ├── ActiveRunsCapped  gateway/errors.py  429: TooManyActiveRuns' answer
    │   ├── Unavailable       gateway/errors.py  503: retry shortly
    │   ├── LimitReached      gateway/quotas.py  429: a capped request (CapReached's answer)
    │   ├── RequestTimeout    gateway/quotas.py  408: the body did not arrive in time
    │   ├── Conflict          gateway/approvals.py  409: no approval can be decided now
    │   ├── TooManyFailedLogins  gateway/auth.py  429: too many failed logins
    │   └── ErasureBlocked    gateway/admin.py  409: the user's runs are still open
    ├── RequestError          gateway/responses_wire.py  a refusal in OpenAI's shape
    ├── _Stalled              gateway/sse.py  an SSE viewer stopped reading (the stream is cut)
    ├── _Stalled              gateway/responses.py  a Responses stream's reader stopped reading
    ├── RunsStillOpen         gateway/erasure.py  an erasure's runs did not end or settle
    ├── ClientError           koda/client/_wire.py  every error the Python client raises
    │   ├── GatewayUnreachable  koda/client/_wire.py  the gateway could not be reached
    │   └── ApiError          koda/client/_wire.py  the gateway refused: its status and error
    ├── RetryableStatus       koda/client/_wire.py  a 5xx answer to a followed stream: retry
    ├── ScheduleInvalid       koda/scheduling.py  a schedule field is invalid (it names it)
    ├── TraceNotFound         cli/traces.py  the trace receiver holds no such trace
    ├── WebhookUrlRefused     koda/webhooks.py  a webhook URL breaks the URL rule
    ├── FencedOut             processors/fences.py  the worker lost the partition: do not ack
    ├── CompactionError       processors/compactor.py  a compaction batch was not acknowledged
    ├── RetentionError        processors/retention.py  a retention pass could not finish
    ├── ToolArgumentError     processors/tools/registry.py  bad arguments (also ValueError)
    ├── ToolArgumentError     processors/memory/tool.py  bad arguments (also ValueError)
    ├── PriceRefused          schemas/ledger.py  a price rewriting history (also ValueError)
    ├── TooManyWebhooks       schemas/webhooks.py  the user has the most webhooks a user may have
    ├── RunNotFound           schemas/runs/reads.py  no run has that id (also LookupError)
    ├── LedgerInputError      cli/common.py  a value the ledger commands cannot use
    ├── MemberStalled         topics/kafka/intake.py  no broker (also RuntimeError)
    ├── CommitAbandoned       topics/kafka/intake.py  nobody waits for its answer
    └── ClientStalled         topics/kafka/tail.py  no broker: rebuild (also RuntimeError)

Not errors (control-flow signals caught where they are raised, never a failure):
    Parked       processors/chains.py  the record's run waits for a person: no slot held
    StreamOver   koda/client/_wire.py  a followed stream answered 204: the run is over

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


class Refused(KodaError):
    """A request the domain turns down; the message says what was wrong. Stores and
    services raise it (and its subclasses) in their own terms; the HTTP edge
    (gateway/errors.py) picks each one's status."""


class SessionNotOwned(Refused):
    """The session id belongs to another user (answered exactly like an unknown one)."""


class TooManyActiveRuns(Refused):
    """A new run refused: the user already has ``active`` runs not yet ended (pending,
    running or streaming) and may have at most ``cap``. Nothing was written."""

    def __init__(self, user_id: str, cap: int, active: int) -> None:
        super().__init__(f"user {user_id} has {active} active runs (at most {cap})")
        self.cap = cap
        self.active = active


class PublishError(KodaError):
    """The broker refused or did not acknowledge a record within its delivery timeout."""


class HandlerError(KodaError):
    """The job handler raised; the run is retried in place, then dead-lettered."""


class ReplayError(KodaError):
    """Replaying topics into a warehouse failed; the message names the value or the sink."""

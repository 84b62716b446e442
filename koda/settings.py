"""The one frozen settings object, read from the environment in one place.

Nothing else in koda reads ``os.environ``: entrypoints call :meth:`Settings.from_env`
and pass the result down. In dev, the addresses of a running local stack come from
its ``.koda/services.env`` (found by :mod:`koda_runtime.stackenv`) unless the environment
names them; every setting's origin is kept for error messages.

Each knob is declared once, as a field of :class:`Settings` (or :class:`KafkaSecurity`)
made by :func:`koda_runtime.knobs.knob`: its environment variable, type (the annotation),
default, unit, bounds or choices and a one-line meaning sit together.
:func:`koda_runtime.knobs.load` is the one loop that reads them all, and docs/settings.md's
table is rendered from the same fields (``python -m koda_runtime.settingsdoc``). Cross-field rules
(a power-of-two partition count, the handoff ceiling below the rebalance timeout, prod's
refusals) stay in ``__post_init__``.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from koda_runtime import __version__, stackenv
from koda_runtime.errors import ConfigError
from koda_runtime.knobs import check_choices, knob, load
from koda_runtime.naming import AppEnv, Names

DEFAULT_DATABASE_URL = "postgresql://koda@127.0.0.1:5432/koda"
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

# Where the worker id came from: KODA_WORKER_ID, KODA_POD_NAME, or drawn at start.
WorkerIdSource = Literal["configured", "pod", "generated"]
# What Kafka accepts as a group.instance.id (the broker refuses other characters).
_INSTANCE_ID = re.compile(r"[A-Za-z0-9._-]{1,249}")
_WORKER_ID_MAX = 200
_process_worker_id: tuple[int, str] | None = None


# The user-id rule: the gateway's (dev tokens, admin filters) and prod's KODA_API_TOKENS.
USER_ID = re.compile(r"[A-Za-z0-9._@-]{1,128}")
# Prod refuses shorter tokens (KODA_API_TOKENS, KODA_ADMIN_TOKEN, KODA_STREAM_TICKET_SECRET).
MIN_PROD_TOKEN_CHARS = 32
# Words of example values (deploy/k8s/secret.example.yaml has REPLACE_ME): never a token.
_PLACEHOLDERS = ("REPLACE_ME", "REPLACEME", "CHANGE_ME", "CHANGEME", "PLACEHOLDER", "YOUR_")


def _api_tokens(raw: str) -> dict[str, str]:
    """``token:user,...``; spaces around a token or user are dropped; a token listed
    twice is refused (which user it meant would otherwise be the last one's)."""
    tokens: dict[str, str] = {}
    for n, pair in enumerate(filter(None, (p.strip() for p in raw.split(","))), 1):
        token, sep, user = (part.strip() for part in pair.partition(":"))
        if not sep or not token or not user:
            raise ValueError("expected <token>:<user_id>")
        if token in tokens:
            raise ConfigError(
                f"KODA_API_TOKENS: entry {n} (user {user[:40]!r}) repeats the token of user "
                f"{tokens[token][:40]!r}: give every user a token of its own"
            )
        tokens[token] = user
    return tokens


# Service tokens (KODA_SERVICE_TOKENS): what a backend may do on behalf of users.
SCOPES = ("submit", "read", "cancel")
SERVICE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class ServiceToken:
    """A backend's token: its ``name`` (runs record ``service:<name>``) and ``scopes``."""

    name: str
    scopes: frozenset[str]


def _service_tokens(raw: str) -> dict[str, ServiceToken]:
    """``token:name:scope+scope,...`` (scopes of SCOPES); errors name the entry and the
    service, never the token."""
    tokens: dict[str, ServiceToken] = {}
    names: set[str] = set()
    for n, entry in enumerate(filter(None, (p.strip() for p in raw.split(","))), 1):
        token, name, scopes = (part.strip() for part in (entry.split(":", 2) + ["", ""])[:3])
        where = f"KODA_SERVICE_TOKENS: entry {n}"
        if not token or not name or not scopes:
            raise ConfigError(f"{where} is not <token>:<name>:<scope>+<scope>")
        if not SERVICE_NAME.fullmatch(name):
            raise ConfigError(
                f"{where}: the name {name[:40]!r} is not 1-64 chars of A-Z a-z 0-9 . _ -"
            )
        asked = [s.strip() for s in scopes.split("+")]
        unknown = [s for s in asked if s not in SCOPES]
        if unknown:
            raise ConfigError(
                f"{where} (service {name!r}): unknown scope {unknown[0][:40]!r}: use "
                f"{', '.join(SCOPES)} joined by +"
            )
        if token in tokens:
            raise ConfigError(
                f"{where} (service {name!r}) repeats the token of service "
                f"{tokens[token].name!r}: give every service a token of its own"
            )
        if name in names:
            raise ConfigError(f"{where}: service {name!r} is named twice: one token per name")
        names.add(name)
        tokens[token] = ServiceToken(name, frozenset(asked))
    return tokens


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DURATION_SHAPE = "a duration: a number and s, m, h, d or w (30d, 12h; no unit: seconds); 0: forever"


def parse_duration(raw: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w`` or a bare number of seconds, as seconds."""
    match = _DURATION.fullmatch(raw.strip().lower())
    if match is None:
        raise ValueError(raw)
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def _token_problem(token: str) -> str | None:
    """Why prod refuses ``token`` as a secret, or None; never quotes the token."""
    if len(token) < MIN_PROD_TOKEN_CHARS:
        return (
            f"is {len(token)} characters; prod needs at least {MIN_PROD_TOKEN_CHARS} "
            "(e.g. `openssl rand -hex 32`)"
        )
    upper = token.upper()
    if any(word in upper for word in _PLACEHOLDERS) or "<" in token or ">" in token:
        return "is a placeholder from an example file: generate a real one"
    if len(set(token)) < 6:
        return "repeats fewer than 6 different characters: generate a random one"
    if any(c.isspace() or not c.isprintable() for c in token):
        return "contains spaces or unprintable characters"
    return None


def prod_secret_problems(settings: Settings) -> list[str]:
    """What prod refuses in the tokens of ``settings``, one line each, no token shown."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for token, user in settings.prod_tokens.items():
        if not USER_ID.fullmatch(user):
            problems.append(
                f"KODA_API_TOKENS: user id {user[:40]!r} is not 1-128 chars of A-Z a-z 0-9 . _ @ -"
            )
        why = _token_problem(token)
        if why is not None:
            problems.append(f"KODA_API_TOKENS: the token of user {user[:40]!r} {why}")
        seen[token] = user
    for token, service in settings.service_tokens.items():
        why = _token_problem(token)
        if why is not None:
            problems.append(f"KODA_SERVICE_TOKENS: the token of service {service.name!r} {why}")
        if token in seen:
            problems.append(
                f"KODA_SERVICE_TOKENS: the token of service {service.name!r} is also the "
                f"KODA_API_TOKENS token of user {seen[token][:40]!r}: give it a token of its own"
            )
    admin = settings.admin_token
    if admin is not None and admin in settings.service_tokens:
        problems.append(
            "KODA_ADMIN_TOKEN is also a KODA_SERVICE_TOKENS token: the admin token must be "
            "a token of its own"
        )
    if admin is not None:
        why = _token_problem(admin)
        if why is not None:
            problems.append(f"KODA_ADMIN_TOKEN {why}")
        if admin in seen:
            problems.append(
                f"KODA_ADMIN_TOKEN is also the KODA_API_TOKENS token of user "
                f"{seen[admin][:40]!r}: the admin token must be a token of its own"
            )
    ticket = settings.stream_ticket_secret
    if ticket is not None:
        why = _token_problem(ticket)
        if why is not None:
            problems.append(f"KODA_STREAM_TICKET_SECRET {why}")
    return problems


def generated_worker_id() -> str:
    """This process's default worker id: ``<hostname>-<pid>-<6 hex digits>``.

    Unique per process (two workers on one host differ by pid, and the random suffix
    tells a restarted process from its predecessor even if the pid is reused, as it
    always is for PID 1 in a container) and the same for the whole life of the
    process: it is drawn once per pid, so a forked child draws its own.
    """
    global _process_worker_id
    pid = os.getpid()
    if _process_worker_id is None or _process_worker_id[0] != pid:
        _process_worker_id = (pid, f"{socket.gethostname()}-{pid}-{secrets.token_hex(3)}")
    return _process_worker_id[1]


def _identity(env: Mapping[str, str]) -> tuple[str, WorkerIdSource]:
    """The worker id and its source: KODA_WORKER_ID, else KODA_POD_NAME, else generated."""
    for key, source in (("KODA_WORKER_ID", "configured"), ("KODA_POD_NAME", "pod")):
        raw = env.get(key) or ""
        if not raw:
            continue
        if len(raw) > _WORKER_ID_MAX or not raw.isprintable() or any(c.isspace() for c in raw):
            raise ConfigError(
                f"{key}={raw[:60]!r} is not a worker id: use 1..{_WORKER_ID_MAX} printable "
                "characters without spaces"
            )
        return raw, source  # type: ignore[return-value]
    return generated_worker_id(), "generated"


@dataclass(frozen=True)
class KafkaSecurity:
    """Client security settings, mapped onto librdkafka and aiokafka configs."""

    protocol: str = knob(
        "PLAINTEXT",
        "KODA_KAFKA_SECURITY_PROTOCOL",
        "how every Kafka client connects",
        choices=("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
    )
    sasl_mechanism: str | None = knob(
        None,
        "KODA_KAFKA_SASL_MECHANISM",
        "the SASL mechanism (needed, with the user and password, by SASL_SSL and SASL_PLAINTEXT)",
        choices=("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"),
    )
    sasl_username: str | None = knob(None, "KODA_KAFKA_SASL_USERNAME", "the SASL user")
    sasl_password: str | None = knob(
        None, "KODA_KAFKA_SASL_PASSWORD", "the SASL password", secret=True
    )
    ssl_cafile: str | None = knob(
        None, "KODA_KAFKA_SSL_CAFILE", "CA bundle that verifies the brokers (default: the system's)"
    )
    ssl_certfile: str | None = knob(
        None, "KODA_KAFKA_SSL_CERTFILE", "a client certificate (PEM) for brokers that ask for one"
    )
    ssl_keyfile: str | None = knob(
        None, "KODA_KAFKA_SSL_KEYFILE", "the client certificate's key (PEM, unencrypted)"
    )

    def __post_init__(self) -> None:
        check_choices(self)
        sasl = {
            "KODA_KAFKA_SASL_MECHANISM": self.sasl_mechanism,
            "KODA_KAFKA_SASL_USERNAME": self.sasl_username,
            "KODA_KAFKA_SASL_PASSWORD": self.sasl_password,
        }
        if self.protocol.startswith("SASL_"):
            missing = [key for key, value in sasl.items() if not value]
            if missing:
                raise ConfigError(
                    f"KODA_KAFKA_SECURITY_PROTOCOL={self.protocol} needs {', '.join(missing)}"
                )
        elif any(sasl.values()):
            raise ConfigError(
                f"KODA_KAFKA_SASL_* are set but KODA_KAFKA_SECURITY_PROTOCOL={self.protocol} "
                "does not log in: use SASL_SSL"
            )
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ConfigError(
                "KODA_KAFKA_SSL_CERTFILE and KODA_KAFKA_SSL_KEYFILE go together: set both or none"
            )

    def librdkafka(self) -> dict[str, Any]:
        conf: dict[str, Any] = {"security.protocol": self.protocol}
        if self.sasl_mechanism:
            conf["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username is not None:
            conf["sasl.username"] = self.sasl_username
        if self.sasl_password is not None:
            conf["sasl.password"] = self.sasl_password
        if self.ssl_cafile:
            conf["ssl.ca.location"] = self.ssl_cafile
        if self.ssl_certfile:
            conf["ssl.certificate.location"] = self.ssl_certfile
            conf["ssl.key.location"] = self.ssl_keyfile
        return conf


def _origins(
    env: Mapping[str, str], local: stackenv.StackEnv | None, *, searched: bool
) -> dict[str, str]:
    origins: dict[str, str] = {}
    for key in stackenv.KEYS:
        if key in env:
            origins[key] = f"{key} in the environment"
        elif local is not None and key in local.values:
            origins[key] = str(local.path)
        elif searched:
            origins[key] = f"the default: no {key}, no .koda/{stackenv.ENV_FILE} found"
        else:
            origins[key] = f"the default: {key} is not set"
    return origins


def _with_local_stack(
    env: Mapping[str, str], cwd: Path
) -> tuple[Mapping[str, str], dict[str, str]]:
    """``env`` with a local stack's addresses filled in, and where each address came from.

    Only for dev: with ``APP_ENV`` set to anything but ``dev`` the file is never read,
    so prod is never guessed. With ``APP_ENV`` unset, finding a stack's services.env
    is what makes the command dev. A variable set in ``env`` always wins over the file.
    """
    app_env = env.get("APP_ENV") or None
    searched = app_env in (None, AppEnv.DEV.value)
    local = stackenv.find(env.get("KODA_STATE_DIR") or None, cwd) if searched else None
    origins = _origins(env, local, searched=searched)
    if local is None:
        return env, origins
    merged = {**local.values, **env}
    if app_env is None:
        merged["APP_ENV"] = AppEnv.DEV.value
        origins["APP_ENV"] = str(local.path)
    return merged, origins


# Fault points a test can switch on with KODA_TEST_FAULT (see processors/faults.py);
# prod refuses every one of them.
TEST_FAULTS = (
    "kill-after-chunks-commit",
    "kill-after-finish-commit",
    "fail-before-claim",
    # `koda replay --to iceberg://`: topics/replay/sinks/iceberg.py
    "kill-between-iceberg-tables",
    "kill-after-iceberg-batch",
    # `koda memories reembed`: cli/memories.py
    "kill-after-reembed-batch",
)
# Variables read outside the knob loop (the environment, the worker's identity, the
# local stack's state dir), for the settings table: (variable, default, meaning).
OTHER_VARIABLES = (
    ("APP_ENV", "(required)", "`dev` or `prod`; in dev a found `.koda/services.env` implies dev"),
    ("KODA_WORKER_ID", "(generated)", "this worker's id (`<host>-<pid>-<6 hex>` when unset)"),
    ("KODA_POD_NAME", "", "the worker id when KODA_WORKER_ID is unset (Kubernetes)"),
    ("KODA_STATE_DIR", "`.koda`", "the local stack's state dir, whose services.env dev reads"),
)


@dataclass(frozen=True)
class Settings:
    """Every knob koda has; units are in the field names (``_s`` seconds, ``_ms`` ms)."""

    app_env: AppEnv
    kafka_bootstrap: str = knob(
        DEFAULT_BOOTSTRAP, "KODA_KAFKA_BOOTSTRAP", "Kafka bootstrap servers (host:port,...)"
    )
    database_url: str = knob(
        DEFAULT_DATABASE_URL, "KODA_DATABASE_URL", "PostgreSQL URL", secret=True
    )
    namespace: str | None = knob(
        None, "KODA_NAMESPACE", "isolates topics, groups and the Postgres schema"
    )
    kafka_security: KafkaSecurity = field(default_factory=KafkaSecurity)
    kafka_allow_plaintext: bool = knob(
        False,
        "KODA_KAFKA_ALLOW_PLAINTEXT",
        "let prod talk to Kafka without SASL_SSL (unencrypted or unauthenticated)",
    )
    # topics
    partitions: int = knob(
        32, "KODA_PARTITIONS", "runs topic partitions (a power of two)", lo=1, hi=4096
    )
    replication_factor: int = knob(
        1, "KODA_REPLICATION_FACTOR", "replicas of every topic", lo=1, hi=16
    )
    min_insync_replicas: int = knob(
        1, "KODA_MIN_INSYNC_REPLICAS", "min.insync.replicas of every topic", lo=1, hi=16
    )
    # gateway
    gateway_host: str = knob("127.0.0.1", "KODA_GATEWAY_HOST", "the gateway's bind address")
    gateway_port: int = knob(8080, "KODA_GATEWAY_PORT", "the gateway's port", lo=1, hi=65535)
    body_limit_bytes: int = knob(
        64 * 1024, "KODA_BODY_LIMIT", "largest request body", unit="bytes", lo=1024, hi=16 << 20
    )
    rate_per_s: float = knob(
        20.0, "KODA_RATE_PER_S", "submissions per user per second", lo=0.01, hi=1e6
    )
    rate_burst: int = knob(40, "KODA_RATE_BURST", "a user's burst of submissions", lo=1, hi=1e6)
    max_active_runs_per_user: int = knob(
        32,
        "KODA_MAX_ACTIVE_RUNS_PER_USER",
        "runs a user may have not yet ended (pending, running, streaming); "
        "one more is refused with 429 (0: no cap)",
        lo=0,
        hi=1e6,
    )
    # per-user quotas (gateway/quotas.py): 0 turns a cap off
    max_schedules_per_user: int = knob(
        100,
        "KODA_MAX_SCHEDULES_PER_USER",
        "schedules a user may have; one more is refused with 409 (0: no cap)",
        lo=0,
        hi=1e6,
    )
    max_streams_per_user: int = knob(
        16,
        "KODA_SSE_MAX_STREAMS_PER_USER",
        "SSE streams a user may hold open on one gateway; one more is 429 (0: no cap)",
        lo=0,
        hi=1e6,
    )
    max_streams: int = knob(
        1000,
        "KODA_SSE_MAX_STREAMS",
        "SSE streams one gateway holds open, all users; one more is 429 (0: no cap)",
        lo=0,
        hi=1e6,
    )
    max_memories_per_user: int = knob(
        10_000,
        "KODA_MAX_MEMORIES_PER_USER",
        "long-term memories kept per user; new ones beyond it are not stored (0: no cap)",
        lo=0,
        hi=1e9,
    )
    max_merges_per_run: int = knob(
        8,
        "KODA_MAX_MERGES_PER_RUN",
        "messages merged into one run; one more is refused with 409 (0: no cap)",
        lo=0,
        hi=1000,
    )
    max_merged_input_bytes: int = knob(
        256 * 1024,
        "KODA_MAX_MERGED_INPUT_BYTES",
        "a run's input (JSON) after a merge; a merge past it is refused with 409",
        unit="bytes",
        lo=1024,
        hi=64 << 20,
    )
    # uvicorn (gateway/server.py)
    gateway_limit_concurrency: int = knob(
        4096,
        "KODA_GATEWAY_LIMIT_CONCURRENCY",
        "connections or requests at once; beyond it uvicorn answers 503 (0: no limit)",
        lo=0,
        hi=1e6,
    )
    gateway_keepalive_s: int = knob(
        5,
        "KODA_GATEWAY_KEEPALIVE",
        "an idle keep-alive connection is closed after this",
        unit="s",
        lo=1,
        hi=3600,
    )
    body_read_timeout_s: float = knob(
        30.0,
        "KODA_BODY_READ_TIMEOUT",
        "a request body not received within this is refused with 408",
        unit="s",
        lo=0.1,
        hi=3600,
    )
    sweep_after_s: float = knob(
        30.0,
        "KODA_SWEEP_AFTER",
        "a pending run older than this is published again",
        unit="s",
        lo=0.1,
        hi=86400,
    )
    publish_timeout_s: float = knob(
        30.0, "KODA_PUBLISH_TIMEOUT", "how long a produce may take", unit="s", lo=1, hi=600
    )
    sweep_interval_s: float = knob(
        5.0, "KODA_SWEEP_INTERVAL", "how often the sweeper looks", unit="s", lo=0.1, hi=3600
    )
    prod_tokens: Mapping[str, str] = knob(
        env="KODA_API_TOKENS",
        doc="prod bearer tokens: `token:user,...`",
        factory=dict,
        secret=True,
        parse=_api_tokens,
        shape="a comma-separated list of token:user_id",
    )
    service_tokens: Mapping[str, ServiceToken] = knob(
        env="KODA_SERVICE_TOKENS",
        doc="backends' bearer tokens, acting for the user named in `X-Koda-User`: "
        "`token:name:scope+scope,...`; scopes `submit`, `read`, `cancel` (dev and prod)",
        factory=dict,
        secret=True,
        parse=_service_tokens,
        shape="a comma-separated list of token:name:scope+scope (scopes: submit, read, cancel)",
    )
    batch_max_runs: int = knob(
        100,
        "KODA_BATCH_MAX_RUNS",
        "runs one `POST /v1/runs/batch` may carry; more is refused with 413",
        lo=1,
        hi=1000,
    )
    # failed logins and stream tickets (gateway/auth.py)
    auth_failures: int = knob(
        20,
        "KODA_AUTH_FAILURES",
        "401s a client address may get per KODA_AUTH_FAILURE_WINDOW before it is answered "
        "429 (per gateway replica)",
        lo=1,
        hi=1_000_000,
    )
    auth_failure_window_s: float = knob(
        60.0,
        "KODA_AUTH_FAILURE_WINDOW",
        "the window KODA_AUTH_FAILURES counts in",
        unit="s",
        lo=1,
        hi=86400,
    )
    stream_ticket_secret: str | None = knob(
        None,
        "KODA_STREAM_TICKET_SECRET",
        "signs the 60 s tickets that open a run's events (unset: derived from the tokens "
        "and the database URL, so every replica agrees)",
        secret=True,
    )
    # server-sent events and the live feed (gateway)
    sse_keepalive_s: float = knob(
        15.0,
        "KODA_SSE_KEEPALIVE",
        "a keep-alive comment after this much silence",
        unit="s",
        lo=0.05,
        hi=3600,
    )
    merge_window_s: float = knob(
        30.0,
        "KODA_MERGE_WINDOW_S",
        "a message into a session whose running run is younger than this merges into it",
        unit="s",
        lo=0,
        hi=3600,
    )
    erasure_wait_s: float = knob(
        30.0,
        "KODA_ERASURE_WAIT_S",
        "a user's erasure waits this long for their cancelled runs to end, then answers 409",
        unit="s",
        lo=0,
        hi=3600,
    )
    dedup_window_s: float = knob(
        10.0,
        "KODA_DEDUP_WINDOW_S",
        "a body repeated without Idempotency-Key or client_message_id within this is one run",
        unit="s",
        lo=0.001,
        hi=86400,
    )
    context_tokens: int = knob(
        16000,
        "KODA_CONTEXT_TOKENS",
        "a run's earlier turns and input fit in this; the oldest turns are dropped first",
        unit="tokens",
        lo=0,
        hi=10_000_000,
    )
    sse_retry_ms: int = knob(
        2000, "KODA_SSE_RETRY_MS", "the `retry:` a stream starts with", unit="ms", lo=0, hi=600_000
    )
    sse_queue_bytes: int = knob(
        256 * 1024,
        "KODA_SSE_QUEUE_BYTES",
        "a viewer's queue; beyond it the viewer is cut",
        unit="bytes",
        lo=1024,
        hi=1 << 30,
    )
    sse_write_timeout_s: float = knob(
        10.0,
        "KODA_SSE_WRITE_TIMEOUT",
        "a write to a viewer slower than this cuts it",
        unit="s",
        lo=0.05,
        hi=3600,
    )
    feed_discovery_interval_s: float = knob(
        30.0,
        "KODA_FEED_DISCOVERY_INTERVAL",
        "how often the live feed looks for new partitions",
        unit="s",
        lo=0.1,
        hi=3600,
    )
    # compaction of the chunk topic
    compact_after_s: float = knob(
        24 * 3600.0,
        "KODA_COMPACT_AFTER",
        "runs finished this long ago are compacted",
        unit="s",
        lo=0,
        hi=365 * 86400,
    )
    # retention (processors/retention.py): how long Postgres keeps what a run left
    chunk_retention_s: float = knob(
        7 * 86400.0,
        "KODA_CHUNK_RETENTION",
        "a run's chunk rows are kept this long after it ended (7d), then collapsed into "
        "its final output (not before the run is compacted: KODA_COMPACT_AFTER)",
        unit="s",
        lo=0,
        hi=3650 * 86400,
        parse=parse_duration,
        shape=DURATION_SHAPE,
    )
    run_retention_s: float = knob(
        0.0,
        "KODA_RUN_RETENTION",
        "runs are deleted, with their chunks, merges and usage, this long after they "
        "ended (0: kept for ever; not before the run is compacted)",
        unit="s",
        lo=0,
        hi=3650 * 86400,
        parse=parse_duration,
        shape=DURATION_SHAPE,
    )
    ledger_retention_s: float = knob(
        0.0,
        "KODA_LEDGER_RETENTION",
        "ledger rows are deleted by whole UTC months, once a month ended this long ago "
        "(0: kept for ever; else at least 31d)",
        unit="s",
        lo=0,
        hi=3650 * 86400,
        parse=parse_duration,
        shape=DURATION_SHAPE,
    )
    retention_batch: int = knob(
        1000,
        "KODA_RETENTION_BATCH",
        "rows the retention sweep deletes per statement (each its own transaction)",
        lo=10,
        hi=100_000,
    )
    # worker (the id and its source are read by _identity, not by the knob loop)
    worker_id: str = field(default_factory=generated_worker_id)
    worker_id_source: WorkerIdSource = "generated"
    worker_group: str = knob("workers", "KODA_WORKER_GROUP", "the workers' consumer group")
    static_membership: bool = knob(
        False, "KODA_STATIC_MEMBERSHIP", "join with group.instance.id = the worker id"
    )
    group_protocol: str = knob(
        "consumer",
        "KODA_GROUP_PROTOCOL",
        "the workers' group protocol: consumer (KIP-848) or classic (cooperative-sticky)",
        choices=("consumer", "classic"),
    )
    worker_port: int = knob(
        0, "KODA_WORKER_PORT", "the worker's health and /metrics port (0: none)", lo=0, hi=65535
    )
    max_inflight: int = knob(
        256,
        "KODA_MAX_INFLIGHT",
        "runs a worker executes at once, of any users and partitions",
        lo=1,
        hi=4096,
    )
    max_backlog: int = knob(
        0,
        "KODA_MAX_BACKLOG",
        "records a worker holds not yet started before it pauses fetching (0: 4 x "
        "KODA_MAX_INFLIGHT)",
        lo=0,
        hi=1_000_000,
    )
    db_pool: int = knob(
        8,
        "KODA_DB_POOL",
        "a worker's Postgres connections (group writes and reads; runs hold none)",
        lo=2,
        hi=256,
    )
    model_concurrency: int = knob(
        0,
        "KODA_MODEL_CONCURRENCY",
        "model calls a worker makes at once per model (0: no cap but KODA_MAX_INFLIGHT)",
        lo=0,
        hi=4096,
    )
    event_loop: str = knob(
        "uvloop",
        "KODA_EVENT_LOOP",
        "the worker's event loop: uvloop (libuv, less CPU per run) or asyncio (the standard one)",
        choices=("uvloop", "asyncio"),
    )
    chain_high_water: int = knob(
        64,
        "KODA_CHAIN_HIGH_WATER",
        "a partition's backlog that pauses its fetching",
        lo=2,
        hi=100_000,
    )
    handoff_ceiling_s: float = knob(
        20.0,
        "KODA_HANDOFF_CEILING",
        "how long a revoked partition's runs may finish",
        unit="s",
        lo=0.1,
        hi=600,
    )
    session_timeout_s: float = knob(
        10.0, "KODA_SESSION_TIMEOUT", "the consumer's session.timeout", unit="s", lo=1, hi=300
    )
    heartbeat_interval_s: float = knob(
        3.0, "KODA_KAFKA_HEARTBEAT", "the consumer's heartbeat interval", unit="s", lo=0.1, hi=60
    )
    rebalance_timeout_s: float = knob(
        60.0,
        "KODA_REBALANCE_TIMEOUT",
        "the consumer's rebalance timeout",
        unit="s",
        lo=1,
        hi=3600,
    )
    max_attempts: int = knob(3, "KODA_MAX_ATTEMPTS", "handler attempts per run", lo=1, hi=10)
    record_tries: int = knob(
        5,
        "KODA_RECORD_TRIES",
        "tries of a record that fails before its run is claimed, then it is dead-lettered; "
        "tries count 8 s, 16 s, 32 s ... apart (5: at least 2 minutes)",
        lo=1,
        hi=12,
    )
    retry_base_s: float = knob(
        0.5,
        "KODA_RETRY_BASE",
        "the first retry's backoff (doubling, jittered)",
        unit="s",
        lo=0.0,
        hi=60,
    )
    chunk_batch_size: int = knob(
        32, "KODA_CHUNK_BATCH", "chunks written in one batch at most", lo=1, hi=10_000
    )
    chunk_batch_ms: int = knob(
        20,
        "KODA_CHUNK_BATCH_MS",
        "how long a chunk waits for its batch at most (windows close on the worker's ticks,"
        " every half window)",
        unit="ms",
        lo=0,
        hi=10_000,
    )
    chunk_coalesce: bool = knob(
        False,
        "KODA_CHUNK_COALESCE",
        "the text chunks of one batch window are written as one chunk (one row, one record,"
        " one SSE event)",
    )
    handler: str = knob(
        "demo",
        "KODA_HANDLER",
        "the job: `demo`, `openai` or a name in the `koda_runtime.handlers` entry point group",
    )
    openai_base_url: str = knob(
        "https://api.openai.com", "KODA_OPENAI_BASE_URL", "an OpenAI-compatible API"
    )
    openai_api_key: str | None = knob(
        None, "KODA_OPENAI_API_KEY", "the `openai` handler's API key", secret=True
    )
    openai_model: str = knob("gpt-4o-mini", "KODA_OPENAI_MODEL", "the `openai` handler's model")
    # A model provider's faults (processors/handlers/provider.py,
    # docs/decisions/0020-model-provider-faults.md).
    fallback_model: str | None = knob(
        None,
        "KODA_FALLBACK_MODEL",
        "the model calls go to while the primary's breaker is open (same endpoint and key)",
    )
    model_retry_window_s: float = knob(
        30.0,
        "KODA_MODEL_RETRY_WINDOW",
        "how long one model call retries 5xx, connection errors and 429 before the attempt"
        " fails (an outage of this minus KODA_MODEL_RETRY_CAP is always outlived)",
        unit="s",
        lo=0.0,
        hi=600,
    )
    model_retry_base_s: float = knob(
        0.5,
        "KODA_MODEL_RETRY_BASE",
        "a model call's first retry backoff (doubling, jittered)",
        unit="s",
        lo=0.0,
        hi=60,
    )
    model_retry_cap_s: float = knob(
        8.0,
        "KODA_MODEL_RETRY_CAP",
        "a model call's longest retry backoff",
        unit="s",
        lo=0.0,
        hi=120,
    )
    model_retry_after_cap_s: float = knob(
        30.0,
        "KODA_MODEL_RETRY_AFTER_CAP",
        "the longest wait a 429's Retry-After is obeyed for",
        unit="s",
        lo=0.0,
        hi=600,
    )
    model_breaker_failures: int = knob(
        5,
        "KODA_MODEL_BREAKER_FAILURES",
        "5xx, 429 or connection failures of the primary in a row that open its breaker"
        " (calls go to KODA_FALLBACK_MODEL)",
        lo=1,
        hi=1000,
    )
    model_breaker_open_s: float = knob(
        30.0,
        "KODA_MODEL_BREAKER_OPEN",
        "how long an open breaker sends calls to the fallback before one call probes the primary",
        unit="s",
        lo=0.1,
        hi=3600,
    )
    # operations: heartbeats, health endpoints, admin (docs/design.md §8)
    version: str = knob(__version__, "KODA_VERSION", "the version workers report in heartbeats")
    worker_host: str = knob(
        "127.0.0.1", "KODA_WORKER_HOST", "the worker's and scheduler's bind address"
    )
    beat_interval_s: float = knob(
        5.0, "KODA_BEAT_INTERVAL", "a worker's heartbeat interval", unit="s", lo=0.05, hi=300
    )
    beat_stale_after_s: float = knob(
        15.0,
        "KODA_BEAT_STALE_AFTER",
        "a worker without a beat this long is stale",
        unit="s",
        lo=0.1,
        hi=3600,
    )
    beat_forget_after_s: float = knob(
        3600.0,
        "KODA_BEAT_FORGET_AFTER",
        "a silent worker is forgotten after this",
        unit="s",
        lo=0,
        hi=30 * 86400,
    )
    expected_workers: int = knob(
        1, "KODA_EXPECTED_WORKERS", "fewer alive workers is `degraded`", lo=0, hi=10_000
    )
    admin_token: str | None = knob(
        None,
        "KODA_ADMIN_TOKEN",
        "the bearer token `/admin` needs (unset: open)",
        secret=True,
    )
    loop_stall_s: float = knob(
        10.0,
        "KODA_LOOP_STALL",
        "an event loop blocked this long fails /livez",
        unit="s",
        lo=0.1,
        hi=600,
    )
    lag_interval_s: float = knob(
        10.0,
        "KODA_LAG_INTERVAL",
        "how often workers sample consumer lag",
        unit="s",
        lo=0.1,
        hi=3600,
    )
    # where KODA_KAFKA_BOOTSTRAP, KODA_DATABASE_URL (and a defaulted APP_ENV) came from
    origins: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    # compaction's completeness pass: finished runs not known to be whole on the topic
    repair_after_s: float = knob(
        30.0,
        "KODA_REPAIR_AFTER",
        "runs finished this long ago get the completeness pass",
        unit="s",
        lo=0,
        hi=7 * 86400,
    )
    # a fault point only tests switch on (one of TEST_FAULTS), None in normal operation
    test_fault: str | None = knob(
        None, "KODA_TEST_FAULT", "a fault point for tests; refused in prod", choices=TEST_FAULTS
    )
    # koda scheduler
    scheduler_port: int = knob(
        0,
        "KODA_SCHEDULER_PORT",
        "the scheduler's /livez, /readyz and /metrics port (0: none)",
        lo=0,
        hi=65535,
    )
    scheduler_poll_s: float = knob(
        5.0,
        "KODA_SCHEDULER_POLL",
        "how often a scheduler looks for due schedules",
        unit="s",
        lo=0.05,
        hi=60,
    )
    scheduler_batch: int = knob(
        500, "KODA_SCHEDULER_BATCH", "due schedules fired per batch", lo=1, hi=100_000
    )
    # Webhooks (gateway/webhooks.py, `koda webhooks dispatch`: processors/webhooks.py)
    webhook_allow_private: bool | None = knob(
        None,
        "KODA_WEBHOOK_ALLOW_PRIVATE",
        "webhooks may reach loopback, private and link-local addresses "
        "(unset: yes in dev, no in prod)",
    )
    webhook_timeout_s: float = knob(
        10.0, "KODA_WEBHOOK_TIMEOUT", "each webhook POST's timeout", unit="s", lo=0.1, hi=300
    )
    webhook_concurrency: int = knob(
        32, "KODA_WEBHOOK_CONCURRENCY", "webhook POSTs in flight per dispatcher", lo=1, hi=1024
    )
    webhook_per_endpoint: int = knob(
        4,
        "KODA_WEBHOOK_PER_ENDPOINT",
        "webhook POSTs in flight to one endpoint per dispatcher (a slow receiver holds no more)",
        lo=1,
        hi=1024,
    )
    webhook_retry_first_s: float = knob(
        5.0,
        "KODA_WEBHOOK_RETRY_FIRST",
        "wait after a delivery's first failed attempt; doubles per attempt, with jitter",
        unit="s",
        lo=0.01,
        hi=3600,
    )
    webhook_retry_max_s: float = knob(
        300.0,
        "KODA_WEBHOOK_RETRY_MAX",
        "longest wait between two attempts of a delivery",
        unit="s",
        lo=0.01,
        hi=86400,
    )
    webhook_horizon_s: float = knob(
        86400.0,
        "KODA_WEBHOOK_HORIZON",
        "a delivery not accepted this long after the run ended is given up (`failed`)",
        unit="s",
        lo=1,
        hi=30 * 86400,
    )
    webhook_port: int = knob(
        0,
        "KODA_WEBHOOK_PORT",
        "the webhook dispatcher's /livez, /readyz and /metrics port (0: none)",
        lo=0,
        hi=65535,
    )
    # The cost ledger and budgets. Off only to measure their cost (benchmarks): no ledger
    # rows, no budget checks, as before the ledger existed.
    cost_ledger: bool = knob(
        True, "KODA_COST_LEDGER", "ledger rows and budget checks (off only for benchmarks)"
    )
    # Long-term memory and tools (processors/memory/, processors/handlers/tools.py).
    memory_enabled: bool = knob(True, "KODA_MEMORY", "remember and offer `memory_search`")
    embedder: str = knob(
        "wordllama",
        "KODA_EMBEDDER",
        "`wordllama` (offline, in the wheel) or `openai` (`/v1/embeddings` of "
        "KODA_OPENAI_BASE_URL)",
        choices=("wordllama", "openai"),
    )
    embeddings_model: str = knob(
        "text-embedding-3-small",
        "KODA_EMBEDDINGS_MODEL",
        "the `openai` embedder's model (asked for 256 dimensions)",
    )
    memory_auto_inject: int = knob(
        0,
        "KODA_MEMORY_AUTO_INJECT",
        "0, or 3 to 5: that many relevant memories in the prompt",
        lo=0,
        hi=5,
    )
    memory_distil_lease_s: float = knob(
        120.0,
        "KODA_MEMORY_DISTIL_LEASE_S",
        "seconds a worker holds a finished run's memory distillation before another may "
        "take it (a worker that died holding it)",
        lo=1,
        hi=86400,
    )
    max_tool_turns: int = knob(
        8,
        "KODA_MAX_TOOL_TURNS",
        "model completions per run; reaching it ends the run `failed`",
        lo=1,
        hi=100,
    )
    # Tools users add (processors/tools/): modules whose @tool functions the model is
    # offered, beside the `koda.tools` entry points.
    tools: str = knob(
        "",
        "KODA_TOOLS",
        "comma-separated modules whose `@tool` functions the `openai` handler offers (with "
        "the `koda.tools` entry points); one that does not import stops the worker",
    )
    approval_timeout_s: float = knob(
        3600.0,
        "KODA_APPROVAL_TIMEOUT_S",
        "a run waiting this long for a person's approve or reject of a tool call is "
        "rejected (the model is told nobody approved it)",
        unit="s",
        lo=1,
        hi=30 * 86400,
    )
    # Limits on an admitted run (processors/streaming.py): crossing one ends it `failed`.
    max_run_s: float = knob(
        600.0,
        "KODA_MAX_RUN_S",
        "each attempt of a run may last this long from its claim; past it the run ends "
        "`failed` with reason `deadline`",
        unit="s",
        lo=1,
        hi=86400,
    )
    max_output_tokens: int = knob(
        8192,
        "KODA_MAX_OUTPUT_TOKENS",
        "sent to the model as `max_completion_tokens` with every call (0: not sent)",
        lo=0,
        hi=10_000_000,
    )
    max_output_bytes: int = knob(
        16 << 20,
        "KODA_MAX_OUTPUT_BYTES",
        "an attempt's output (text and tool events, UTF-8) past this ends the run `failed`",
        unit="bytes",
        lo=1024,
        hi=1 << 30,
    )
    # logs and traces (koda/logs.py, koda/tracing.py): OpenTelemetry's own variables
    log_format: str = knob(
        "text",
        "KODA_LOG_FORMAT",
        "log lines as `key=value` text, or one JSON object per line",
        choices=("text", "json"),
    )
    otel_endpoint: str | None = knob(
        None,
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTLP/HTTP receiver of traces, e.g. `http://127.0.0.1:4318` (unset: no tracing)",
    )
    otel_service_name: str | None = knob(
        None, "OTEL_SERVICE_NAME", "the service name of the spans (unset: `koda-<role>`)"
    )
    otel_sampler: str = knob(
        "parentbased_always_on",
        "OTEL_TRACES_SAMPLER",
        "which traces are kept (the SDK's sampler names)",
        choices=(
            "always_on",
            "always_off",
            "traceidratio",
            "parentbased_always_on",
            "parentbased_always_off",
            "parentbased_traceidratio",
        ),
    )
    otel_sampler_arg: float | None = knob(
        None, "OTEL_TRACES_SAMPLER_ARG", "the ratio of a traceidratio sampler", lo=0, hi=1
    )
    otel_sdk_disabled: bool = knob(
        False, "OTEL_SDK_DISABLED", "no tracing even with an endpoint set"
    )

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("admin_token", "stream_ticket_secret"):
            secret = getattr(self, name)  # without the spaces around it (a pasted newline)
            if secret is not None and secret != secret.strip():
                object.__setattr__(self, name, secret.strip() or None)
        if self.partitions & (self.partitions - 1):
            raise ConfigError(f"KODA_PARTITIONS={self.partitions} must be a power of two")
        if self.handoff_ceiling_s >= self.rebalance_timeout_s:
            raise ConfigError(
                f"KODA_HANDOFF_CEILING={self.handoff_ceiling_s}s must be below "
                f"KODA_REBALANCE_TIMEOUT={self.rebalance_timeout_s}s, or a draining worker "
                "is evicted from the group before its runs finish"
            )
        if self.beat_stale_after_s <= self.beat_interval_s:
            raise ConfigError(
                f"KODA_BEAT_STALE_AFTER={self.beat_stale_after_s}s must be above "
                f"KODA_BEAT_INTERVAL={self.beat_interval_s}s (three beats is the usual choice)"
            )
        if self.memory_auto_inject and not 3 <= self.memory_auto_inject <= 5:
            raise ConfigError(
                f"KODA_MEMORY_AUTO_INJECT={self.memory_auto_inject}: 0 (off) or 3 to 5 memories"
            )
        if self.ledger_retention_s and self.ledger_retention_s < 31 * 86400:
            raise ConfigError(
                f"KODA_LEDGER_RETENTION={self.ledger_retention_s:g}s must be 0 (forever) or "
                "at least 31d: finance and the monthly budgets read whole months"
            )
        if not self.handler:
            raise ConfigError("KODA_HANDLER is empty: name a handler (demo, openai or a plugin)")
        if self.gateway_limit_concurrency and self.max_streams >= self.gateway_limit_concurrency:
            raise ConfigError(
                f"KODA_SSE_MAX_STREAMS={self.max_streams} must be below "
                f"KODA_GATEWAY_LIMIT_CONCURRENCY={self.gateway_limit_concurrency}, or open "
                "streams alone would fill the gateway and every other request would get 503"
            )
        if self.app_env is AppEnv.PROD:
            if self.test_fault is not None:
                raise ConfigError(
                    f"KODA_TEST_FAULT={self.test_fault} is refused in prod: it kills the "
                    "worker on purpose; unset it"
                )
            if self.handler == "demo":
                raise ConfigError(
                    "KODA_HANDLER=demo is refused in prod: configure a real handler "
                    "(KODA_HANDLER=openai)"
                )
            problems = prod_secret_problems(self)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise ConfigError(f"refused in prod: {problems[0]}{more}")
            protocol = self.kafka_security.protocol
            if protocol != "SASL_SSL" and not self.kafka_allow_plaintext:
                raise ConfigError(
                    f"KODA_KAFKA_SECURITY_PROTOCOL={protocol} is refused in prod: use SASL_SSL "
                    "(with KODA_KAFKA_SASL_MECHANISM, KODA_KAFKA_SASL_USERNAME, "
                    "KODA_KAFKA_SASL_PASSWORD, KODA_KAFKA_SSL_CAFILE), or set "
                    "KODA_KAFKA_ALLOW_PLAINTEXT=true to accept a broker without it"
                )

    def group_instance_id(self) -> str | None:
        """The consumer's ``group.instance.id``: None unless ``KODA_STATIC_MEMBERSHIP``.

        A static member is known to the group by this id across restarts, so it must
        stay the same when the worker restarts and differ from every other worker's.
        Only an id that was configured (``KODA_WORKER_ID``) or is the pod's name
        (``KODA_POD_NAME``) is both; the generated default changes at every start.
        Raises ConfigError otherwise, or when the id is not a legal Kafka instance id.
        """
        if not self.static_membership:
            return None
        if self.worker_id_source == "generated":
            raise ConfigError(
                "KODA_STATIC_MEMBERSHIP=true needs a worker id that is stable across "
                "restarts and unique to this worker: set KODA_WORKER_ID (one per worker, "
                "kept across restarts) or, in Kubernetes, KODA_POD_NAME from the downward "
                "API (metadata.name, with a StatefulSet). Without one the generated id "
                f"({self.worker_id}) changes at every start, so a restarted worker joins as "
                "a new static member while the old one keeps its partitions unserved "
                "until the session timeout; and the host name alone is shared by every "
                "worker on the host, whose members would fence each other out of the group"
            )
        if not _INSTANCE_ID.fullmatch(self.worker_id):
            source = "KODA_WORKER_ID" if self.worker_id_source == "configured" else "KODA_POD_NAME"
            raise ConfigError(
                f"{source}={self.worker_id!r} cannot be a Kafka group.instance.id "
                "(KODA_STATIC_MEMBERSHIP=true): use 1..249 of A-Z a-z 0-9 . _ -"
            )
        return self.worker_id

    @property
    def names(self) -> Names:
        return Names(self.app_env, self.namespace)

    def origin(self, key: str) -> str:
        """Where setting ``key`` (an environment variable's name) came from, for messages."""
        return self.origins.get(key, "the settings")

    def with_(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, cwd: Path | None = None
    ) -> Settings:
        """Read every setting from ``environ`` (default ``os.environ``).

        Reading the process environment, or given ``cwd``, also looks for a local
        stack's services.env from the working directory up (see
        :func:`_with_local_stack`); an explicit ``environ`` alone is taken as it is.
        """
        env: Mapping[str, str] = os.environ if environ is None else environ
        if environ is None or cwd is not None:
            env, origins = _with_local_stack(env, Path.cwd() if cwd is None else cwd)
        else:
            origins = _origins(env, None, searched=False)
        app_env = AppEnv.parse(env.get("APP_ENV"))
        worker_id, worker_id_source = _identity(env)
        return cls(
            app_env=app_env,
            kafka_security=KafkaSecurity(**load(KafkaSecurity, env)),
            worker_id=worker_id,
            worker_id_source=worker_id_source,
            origins=origins,
            **load(cls, env),
        )

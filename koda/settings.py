"""The one frozen settings object, read from the environment in one place.

Nothing else in koda reads ``os.environ``: entrypoints call :meth:`Settings.from_env`
and pass the result down. In dev, the addresses of a running local stack come from
its ``.koda/services.env`` (found by :mod:`koda.stackenv`) unless the environment
names them; every setting's origin is kept for error messages.
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

from koda import __version__, stackenv
from koda.errors import ConfigError
from koda.naming import AppEnv, Names

DEFAULT_DATABASE_URL = "postgresql://koda@127.0.0.1:5432/koda"
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"

# Where the worker id came from: KODA_WORKER_ID, KODA_POD_NAME, or drawn at start.
WorkerIdSource = Literal["configured", "pod", "generated"]
# What Kafka accepts as a group.instance.id (the broker refuses other characters).
_INSTANCE_ID = re.compile(r"[A-Za-z0-9._-]{1,249}")
_WORKER_ID_MAX = 200
_process_worker_id: tuple[int, str] | None = None


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


def _int(env: Mapping[str, str], key: str, default: int, *, lo: int, hi: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{key}={value} is out of range: use {lo}..{hi}")
    return value


def _float(env: Mapping[str, str], key: str, default: float, *, lo: float, hi: float) -> float:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a number") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{key}={value} is out of range: use {lo}..{hi}")
    return value


def _bool(env: Mapping[str, str], key: str, default: bool) -> bool:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}={raw!r} is not a boolean: use true or false")


@dataclass(frozen=True)
class KafkaSecurity:
    """Client security settings, mapped onto librdkafka and aiokafka configs.

    ``protocol`` is PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.
    """

    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None

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


_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_HANDLERS = ("demo", "openai")
# Fault points a test can switch on with KODA_TEST_FAULT (see processors/faults.py);
# prod refuses every one of them.
TEST_FAULTS = ("kill-after-chunks-commit", "kill-after-finish-commit")
_EMBEDDERS = ("wordllama", "openai")


@dataclass(frozen=True)
class Settings:
    """Every knob koda has; units are in the field names (``_s`` seconds, ``_ms`` ms)."""

    app_env: AppEnv
    kafka_bootstrap: str = DEFAULT_BOOTSTRAP
    database_url: str = field(default=DEFAULT_DATABASE_URL, repr=False)
    namespace: str | None = None
    kafka_security: KafkaSecurity = field(default_factory=KafkaSecurity)
    # topics
    partitions: int = 32
    replication_factor: int = 1
    min_insync_replicas: int = 1
    allow_topic_autocreate: bool = True
    # gateway
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8080
    body_limit_bytes: int = 64 * 1024
    rate_per_s: float = 20.0
    rate_burst: int = 40
    sweep_after_s: float = 30.0
    publish_timeout_s: float = 30.0
    sweep_interval_s: float = 5.0
    prod_tokens: Mapping[str, str] = field(default_factory=dict, repr=False)
    # server-sent events and the live feed (gateway)
    sse_keepalive_s: float = 15.0
    # A second message into a session whose latest run is running or streaming and
    # younger than this is merged into that run (README "Steering a run").
    merge_window_s: float = 30.0
    sse_retry_ms: int = 2000
    sse_queue_bytes: int = 256 * 1024
    sse_write_timeout_s: float = 10.0
    feed_discovery_interval_s: float = 30.0
    # compaction of the chunk topic
    compact_after_s: float = 24 * 3600.0
    # worker
    worker_id: str = field(default_factory=generated_worker_id)
    worker_id_source: WorkerIdSource = "generated"
    worker_group: str = "workers"
    static_membership: bool = False
    worker_port: int = 0
    max_inflight: int = 8
    chain_high_water: int = 64
    handoff_ceiling_s: float = 20.0
    session_timeout_s: float = 10.0
    heartbeat_interval_s: float = 3.0
    rebalance_timeout_s: float = 60.0
    max_attempts: int = 3
    retry_base_s: float = 0.5
    chunk_batch_size: int = 32
    chunk_batch_ms: int = 20
    handler: str = "demo"
    openai_base_url: str = "https://api.openai.com"
    openai_api_key: str | None = field(default=None, repr=False)
    openai_model: str = "gpt-4o-mini"
    metrics_port: int = 0
    # operations: heartbeats, health endpoints, admin (docs/design.md §8)
    version: str = __version__
    worker_host: str = "127.0.0.1"
    beat_interval_s: float = 5.0
    beat_stale_after_s: float = 15.0
    beat_forget_after_s: float = 3600.0
    expected_workers: int = 1
    admin_token: str | None = field(default=None, repr=False)
    loop_stall_s: float = 10.0
    lag_interval_s: float = 10.0
    # where KODA_KAFKA_BOOTSTRAP, KODA_DATABASE_URL (and a defaulted APP_ENV) came from
    origins: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    # compaction's completeness pass: finished runs not known to be whole on the topic
    repair_after_s: float = 30.0
    # a fault point only tests switch on (one of TEST_FAULTS), None in normal operation
    test_fault: str | None = None
    # koda scheduler
    scheduler_port: int = 0
    scheduler_poll_s: float = 5.0
    scheduler_batch: int = 500
    # The cost ledger and budgets. Off only to measure their cost (benchmarks): no ledger
    # rows, no budget checks, as before the ledger existed.
    cost_ledger: bool = True
    # Long-term memory and tools (processors/memory/, processors/handlers/tools.py).
    memory_enabled: bool = True
    embedder: str = "wordllama"
    embeddings_model: str = "text-embedding-3-small"
    memory_auto_inject: int = 0
    max_tool_turns: int = 8

    def __post_init__(self) -> None:
        if self.partitions & (self.partitions - 1):
            raise ConfigError(f"KODA_PARTITIONS={self.partitions} must be a power of two")
        if self.handoff_ceiling_s >= self.rebalance_timeout_s:
            raise ConfigError(
                f"KODA_HANDOFF_CEILING={self.handoff_ceiling_s}s must be below "
                f"KODA_REBALANCE_TIMEOUT={self.rebalance_timeout_s}s, or a draining worker "
                "is evicted from the group before its runs finish"
            )
        if self.kafka_security.protocol not in _PROTOCOLS:
            raise ConfigError(
                f"KODA_KAFKA_SECURITY_PROTOCOL={self.kafka_security.protocol!r}: "
                f"use one of {', '.join(_PROTOCOLS)}"
            )
        if self.beat_stale_after_s <= self.beat_interval_s:
            raise ConfigError(
                f"KODA_BEAT_STALE_AFTER={self.beat_stale_after_s}s must be above "
                f"KODA_BEAT_INTERVAL={self.beat_interval_s}s (three beats is the usual choice)"
            )
        if self.embedder not in _EMBEDDERS:
            raise ConfigError(
                f"KODA_EMBEDDER={self.embedder!r}: use one of {', '.join(_EMBEDDERS)}"
            )
        if self.memory_auto_inject and not 3 <= self.memory_auto_inject <= 5:
            raise ConfigError(
                f"KODA_MEMORY_AUTO_INJECT={self.memory_auto_inject}: 0 (off) or 3 to 5 memories"
            )
        if self.handler not in _HANDLERS:
            raise ConfigError(f"KODA_HANDLER={self.handler!r}: use one of {', '.join(_HANDLERS)}")
        if self.test_fault is not None and self.test_fault not in TEST_FAULTS:
            raise ConfigError(
                f"KODA_TEST_FAULT={self.test_fault!r}: use one of {', '.join(TEST_FAULTS)}"
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
            if self.allow_topic_autocreate:
                raise ConfigError(
                    "topic auto-creation is refused in prod: set KODA_TOPIC_AUTOCREATE=false "
                    "and create topics with `koda topics apply --confirm-prod`"
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
        prod = app_env is AppEnv.PROD
        security = KafkaSecurity(
            protocol=env.get("KODA_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT"),
            sasl_mechanism=env.get("KODA_KAFKA_SASL_MECHANISM") or None,
            sasl_username=env.get("KODA_KAFKA_SASL_USERNAME") or None,
            sasl_password=env.get("KODA_KAFKA_SASL_PASSWORD") or None,
            ssl_cafile=env.get("KODA_KAFKA_SSL_CAFILE") or None,
        )
        tokens: dict[str, str] = {}
        for pair in filter(None, env.get("KODA_API_TOKENS", "").split(",")):
            token, sep, user = pair.partition(":")
            if not sep or not token or not user:
                raise ConfigError(
                    "KODA_API_TOKENS must be a comma-separated list of <token>:<user_id>"
                )
            tokens[token] = user
        ceiling = _float(env, "KODA_HANDOFF_CEILING", 20.0, lo=0.1, hi=600)
        worker_id, worker_id_source = _identity(env)
        return cls(
            app_env=app_env,
            kafka_bootstrap=env.get("KODA_KAFKA_BOOTSTRAP", DEFAULT_BOOTSTRAP),
            database_url=env.get("KODA_DATABASE_URL", DEFAULT_DATABASE_URL),
            namespace=env.get("KODA_NAMESPACE") or None,
            kafka_security=security,
            partitions=_int(env, "KODA_PARTITIONS", 32, lo=1, hi=4096),
            replication_factor=_int(env, "KODA_REPLICATION_FACTOR", 1, lo=1, hi=16),
            min_insync_replicas=_int(env, "KODA_MIN_INSYNC_REPLICAS", 1, lo=1, hi=16),
            allow_topic_autocreate=_bool(env, "KODA_TOPIC_AUTOCREATE", not prod),
            gateway_host=env.get("KODA_GATEWAY_HOST", "127.0.0.1"),
            gateway_port=_int(env, "KODA_GATEWAY_PORT", 8080, lo=1, hi=65535),
            body_limit_bytes=_int(env, "KODA_BODY_LIMIT", 64 * 1024, lo=1024, hi=16 << 20),
            rate_per_s=_float(env, "KODA_RATE_PER_S", 20.0, lo=0.01, hi=1e6),
            rate_burst=_int(env, "KODA_RATE_BURST", 40, lo=1, hi=1_000_000),
            sweep_after_s=_float(env, "KODA_SWEEP_AFTER", 30.0, lo=0.1, hi=86400),
            sweep_interval_s=_float(env, "KODA_SWEEP_INTERVAL", 5.0, lo=0.1, hi=3600),
            publish_timeout_s=_float(env, "KODA_PUBLISH_TIMEOUT", 30.0, lo=1, hi=600),
            prod_tokens=tokens,
            sse_keepalive_s=_float(env, "KODA_SSE_KEEPALIVE", 15.0, lo=0.05, hi=3600),
            merge_window_s=_float(env, "KODA_MERGE_WINDOW_S", 30.0, lo=0, hi=3600),
            sse_retry_ms=_int(env, "KODA_SSE_RETRY_MS", 2000, lo=0, hi=600_000),
            sse_queue_bytes=_int(env, "KODA_SSE_QUEUE_BYTES", 256 * 1024, lo=1024, hi=1 << 30),
            sse_write_timeout_s=_float(env, "KODA_SSE_WRITE_TIMEOUT", 10.0, lo=0.05, hi=3600),
            feed_discovery_interval_s=_float(
                env, "KODA_FEED_DISCOVERY_INTERVAL", 30.0, lo=0.1, hi=3600
            ),
            compact_after_s=_float(env, "KODA_COMPACT_AFTER", 24 * 3600.0, lo=0, hi=365 * 86400),
            worker_id=worker_id,
            worker_id_source=worker_id_source,
            worker_group=env.get("KODA_WORKER_GROUP") or "workers",
            static_membership=_bool(env, "KODA_STATIC_MEMBERSHIP", False),
            worker_port=_int(env, "KODA_WORKER_PORT", 0, lo=0, hi=65535),
            max_inflight=_int(env, "KODA_MAX_INFLIGHT", 8, lo=1, hi=1024),
            chain_high_water=_int(env, "KODA_CHAIN_HIGH_WATER", 64, lo=2, hi=100_000),
            handoff_ceiling_s=ceiling,
            session_timeout_s=_float(env, "KODA_SESSION_TIMEOUT", 10.0, lo=1, hi=300),
            heartbeat_interval_s=_float(env, "KODA_KAFKA_HEARTBEAT", 3.0, lo=0.1, hi=60),
            rebalance_timeout_s=_float(env, "KODA_REBALANCE_TIMEOUT", 60.0, lo=1, hi=3600),
            max_attempts=_int(env, "KODA_MAX_ATTEMPTS", 3, lo=1, hi=10),
            retry_base_s=_float(env, "KODA_RETRY_BASE", 0.5, lo=0.0, hi=60),
            chunk_batch_size=_int(env, "KODA_CHUNK_BATCH", 32, lo=1, hi=10_000),
            chunk_batch_ms=_int(env, "KODA_CHUNK_BATCH_MS", 20, lo=0, hi=10_000),
            handler=env.get("KODA_HANDLER", "demo"),
            openai_base_url=env.get("KODA_OPENAI_BASE_URL", "https://api.openai.com"),
            openai_api_key=env.get("KODA_OPENAI_API_KEY") or None,
            openai_model=env.get("KODA_OPENAI_MODEL", "gpt-4o-mini"),
            metrics_port=_int(env, "KODA_METRICS_PORT", 0, lo=0, hi=65535),
            version=env.get("KODA_VERSION") or __version__,
            worker_host=env.get("KODA_WORKER_HOST", "127.0.0.1"),
            beat_interval_s=_float(env, "KODA_BEAT_INTERVAL", 5.0, lo=0.05, hi=300),
            beat_stale_after_s=_float(env, "KODA_BEAT_STALE_AFTER", 15.0, lo=0.1, hi=3600),
            beat_forget_after_s=_float(env, "KODA_BEAT_FORGET_AFTER", 3600.0, lo=0, hi=30 * 86400),
            expected_workers=_int(env, "KODA_EXPECTED_WORKERS", 1, lo=0, hi=10_000),
            admin_token=env.get("KODA_ADMIN_TOKEN") or None,
            loop_stall_s=_float(env, "KODA_LOOP_STALL", 10.0, lo=0.1, hi=600),
            lag_interval_s=_float(env, "KODA_LAG_INTERVAL", 10.0, lo=0.1, hi=3600),
            origins=origins,
            repair_after_s=_float(env, "KODA_REPAIR_AFTER", 30.0, lo=0, hi=7 * 86400),
            test_fault=env.get("KODA_TEST_FAULT") or None,
            scheduler_port=_int(env, "KODA_SCHEDULER_PORT", 0, lo=0, hi=65535),
            scheduler_poll_s=_float(env, "KODA_SCHEDULER_POLL", 5.0, lo=0.05, hi=60),
            scheduler_batch=_int(env, "KODA_SCHEDULER_BATCH", 500, lo=1, hi=100_000),
            cost_ledger=_bool(env, "KODA_COST_LEDGER", True),
            memory_enabled=_bool(env, "KODA_MEMORY", True),
            embedder=env.get("KODA_EMBEDDER", "wordllama"),
            embeddings_model=env.get("KODA_EMBEDDINGS_MODEL", "text-embedding-3-small"),
            memory_auto_inject=_int(env, "KODA_MEMORY_AUTO_INJECT", 0, lo=0, hi=5),
            max_tool_turns=_int(env, "KODA_MAX_TOOL_TURNS", 8, lo=1, hi=100),
        )

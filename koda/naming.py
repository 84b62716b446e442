"""The one function that builds every Kafka and Postgres name.

Every topic, consumer group, client id, transactional id and Postgres schema
comes from :func:`resource_name`. Nothing else concatenates names: a test
(``tests/unit/test_naming.py``) fails if a name literal appears elsewhere.

Shapes (``ns`` is an optional namespace that isolates tests or tenants):

    topic            dev.koda.runs            dev.koda.ns.runs
    group            dev.koda.workers         dev.koda.ns.workers
    replay job group dev.koda.replay.<job>    dev.koda.ns.replay.<job>
    webhooks group   dev.koda.webhooks        dev.koda.ns.webhooks
    client           dev.koda.gateway.<id>    dev.koda.ns.gateway.<id>
    transactional    dev.koda.tx.<id>
    pg_schema        koda_dev                 koda_dev__ns
    warehouse        koda_dev_warehouse       koda_dev__ns_warehouse
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from koda_runtime.errors import ConfigError

APP = "koda"


class AppEnv(str, Enum):
    """The two environments koda accepts; anything else refuses to start."""

    DEV = "dev"
    PROD = "prod"

    @classmethod
    def parse(cls, value: str | None) -> AppEnv:
        """Parse ``APP_ENV``; raise ConfigError naming the bad value and the accepted ones."""
        if value is None or value == "":
            raise ConfigError("APP_ENV is not set: set APP_ENV=dev or APP_ENV=prod")
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(
                f"APP_ENV={value!r} is not accepted: set APP_ENV=dev or APP_ENV=prod"
            ) from None


class NameKind(str, Enum):
    TOPIC = "topic"
    GROUP = "group"
    CLIENT = "client"
    TRANSACTIONAL = "transactional"
    PG_SCHEMA = "pg_schema"


_PART = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")


def _check_part(what: str, value: str) -> str:
    if not _PART.match(value):
        raise ConfigError(
            f"{what}={value!r} is not a valid name part: use 1-48 of a-z, 0-9, '_' or '-',"
            " starting with a letter or digit"
        )
    return value


def resource_name(kind: NameKind, env: AppEnv, base: str, *, namespace: str | None = None) -> str:
    """Build the name of a Kafka or Postgres resource for ``env``.

    ``base`` is the catalogue name (``runs``, ``workers``, ``gateway.<id>``...); for a
    Postgres schema it is ``koda`` (koda's own tables) or a suffix such as ``warehouse``.
    ``namespace`` isolates a set of resources (tests use one per test).
    """
    if not isinstance(env, AppEnv):
        raise ConfigError(f"environment {env!r} is not an AppEnv")
    for part in base.split("."):
        _check_part("name", part)
    if namespace is not None:
        _check_part("namespace", namespace)
    if kind is NameKind.PG_SCHEMA:
        schema = f"{APP}_{env.value}"
        if namespace:
            schema += "__" + namespace.replace("-", "_")
        if base != APP:
            schema += "_" + base.replace("-", "_")
        return schema
    prefix = f"{env.value}.{APP}"
    if namespace:
        prefix += f".{namespace}"
    if kind is NameKind.TRANSACTIONAL:
        return f"{prefix}.tx.{base}"
    return f"{prefix}.{base}"


@dataclass(frozen=True)
class Names:
    """All names for one environment and namespace; thin sugar over :func:`resource_name`."""

    env: AppEnv
    namespace: str | None = None

    def topic(self, base: str) -> str:
        return resource_name(NameKind.TOPIC, self.env, base, namespace=self.namespace)

    def group(self, base: str) -> str:
        return resource_name(NameKind.GROUP, self.env, base, namespace=self.namespace)

    def client_id(self, role: str, instance: str) -> str:
        return resource_name(
            NameKind.CLIENT, self.env, f"{role}.{instance}", namespace=self.namespace
        )

    def transactional_id(self, base: str) -> str:
        return resource_name(NameKind.TRANSACTIONAL, self.env, base, namespace=self.namespace)

    def pg_schema(self) -> str:
        return resource_name(NameKind.PG_SCHEMA, self.env, APP, namespace=self.namespace)

    def replay_group(self, job: str) -> str:
        """The consumer group of the named replay job ``job``: it holds the job's committed
        offsets and nothing else. Never the workers' group (``replay.`` comes first)."""
        return self.group(f"replay.{job}")

    def webhooks_group(self) -> str:
        """The webhook dispatchers' consumer group on the chunk topic (its offsets say
        which terminal records have their deliveries made); never the workers' group."""
        return self.group("webhooks")

    def warehouse_schema(self) -> str:
        """The default Postgres schema a replay writes its tables into (never koda's own)."""
        return resource_name(NameKind.PG_SCHEMA, self.env, "warehouse", namespace=self.namespace)

"""Factories that give every test its own topics, group and Postgres schema."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka.admin import AdminClient
from sqlalchemy import text

from koda.db import sync_engine
from koda.naming import AppEnv
from koda.settings import Settings
from schemas.migrate import upgrade
from topics.admin import apply_topics
from topics.catalogue import catalogue


def new_namespace() -> str:
    return "t" + uuid.uuid4().hex[:12]


def make_settings(stack, namespace: str | None = None, **overrides) -> Settings:  # type: ignore[no-untyped-def]
    base = Settings(
        app_env=AppEnv.DEV,
        kafka_bootstrap=stack.kafka_bootstrap,
        database_url=stack.database_url,
        namespace=namespace or new_namespace(),
        partitions=8,
        session_timeout_s=6.0,
        heartbeat_interval_s=1.0,
        rebalance_timeout_s=30.0,
        handoff_ceiling_s=10.0,
        retry_base_s=0.05,
        chunk_batch_ms=5,
    )
    return base.with_(**overrides) if overrides else base


def delete_topics(settings: Settings) -> None:
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    names = [s.name for s in catalogue(settings)]
    existing = set(admin.list_topics(timeout=10).topics)
    doomed = [n for n in names if n in existing]
    if doomed:
        for fut in admin.delete_topics(doomed, operation_timeout=30).values():
            fut.result()


def drop_schema(settings: Settings) -> None:
    engine = sync_engine(settings)
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{settings.names.pg_schema()}" CASCADE'))
    engine.dispose()


@pytest.fixture
def settings(stack) -> Settings:  # type: ignore[no-untyped-def]
    """Settings for this test alone: a fresh namespace, nothing created yet."""
    return make_settings(stack)


@pytest.fixture
def kafka_topics(settings: Settings) -> Iterator[Settings]:
    """The catalogue's topics created for this test's namespace, deleted afterwards."""
    apply_topics(settings)
    yield settings
    delete_topics(settings)


@pytest.fixture
def database(settings: Settings) -> Iterator[Settings]:
    """This test's Postgres schema, migrated to head, dropped afterwards."""
    upgrade(settings)
    yield settings
    drop_schema(settings)


@pytest.fixture
def env(kafka_topics: Settings, database: Settings) -> Settings:
    """Topics and database both ready for this test's namespace."""
    return kafka_topics

"""Run Alembic migrations programmatically (``koda db upgrade``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from koda_runtime.errors import DatabaseError
from koda_runtime.schemas.db import sync_engine
from koda_runtime.settings import Settings

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(settings: Settings) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["koda_settings"] = settings
    return cfg


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Create the namespace's schema if missing and migrate it to ``revision``.

    Overlapping upgrades (two deploys' migrate jobs) take turns on a session advisory
    lock held for the whole upgrade: `CREATE ... IF NOT EXISTS` and alembic's version
    check are not safe against a concurrent run, and the second would fail half-way.
    The one that waits finds the schema at head and does nothing."""
    schema = settings.names.pg_schema()
    engine = sync_engine(settings)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            key = {"key": f"koda.migrate:{schema}"}
            conn.execute(text("SELECT pg_advisory_lock(hashtextextended(:key, 0))"), key)
            try:
                conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
                command.upgrade(alembic_config(settings), revision)
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(hashtextextended(:key, 0))"), key)
    except OperationalError as exc:
        raise DatabaseError(
            f"cannot reach PostgreSQL at KODA_DATABASE_URL: {exc.orig}; "
            "is it running (`koda services up`)?"
        ) from exc
    finally:
        engine.dispose()


def downgrade(settings: Settings, revision: str) -> None:
    command.downgrade(alembic_config(settings), revision)

"""Run Alembic migrations programmatically (``koda db upgrade``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from koda.db import sync_engine
from koda.errors import DatabaseError
from koda.settings import Settings

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(settings: Settings) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["koda_settings"] = settings
    return cfg


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Create the namespace's schema if missing and migrate it to ``revision``."""
    schema = settings.names.pg_schema()
    engine = sync_engine(settings)
    try:
        with engine.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    except OperationalError as exc:
        raise DatabaseError(
            f"cannot reach PostgreSQL at KODA_DATABASE_URL: {exc.orig}; "
            "is it running (`koda services up`)?"
        ) from exc
    finally:
        engine.dispose()
    command.upgrade(alembic_config(settings), revision)


def downgrade(settings: Settings, revision: str) -> None:
    command.downgrade(alembic_config(settings), revision)

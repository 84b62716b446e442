"""Alembic environment: the schema and URL come from koda's Settings."""

from __future__ import annotations

from alembic import context

from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.tables import metadata

settings = context.config.attributes["koda_settings"]
schema = settings.names.pg_schema()

engine = sync_engine(settings)
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table_schema=schema,
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
engine.dispose()

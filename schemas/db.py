"""Engines for Postgres: sync (migrations, CLI) and async (gateway, workers), and the
one wrapper that turns a database failure into :class:`~koda_runtime.errors.DatabaseError`.

Every connection's ``search_path`` is the schema named by the naming function,
so one database can hold dev, prod and per-test namespaces side by side.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import Engine, TextClause, create_engine, event
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from koda_runtime.errors import DatabaseError
from koda_runtime.settings import Settings

log = logging.getLogger("koda.db")

Cursor = psycopg.AsyncCursor[Any]
_DRIVER_DIALECT = PGDialect_psycopg()  # type: ignore[no-untyped-call]


def sqlalchemy_url(database_url: str) -> str:
    """Map ``postgresql://`` (what users write) onto the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if database_url.startswith(prefix):
            return "postgresql+psycopg://" + database_url[len(prefix) :]
    return database_url


# ``transaction_timeout`` (PostgreSQL 17 and later).
TRANSACTION_TIMEOUT_SINCE = 170000


def _set_search_path(
    schema: str, idle_in_transaction_s: float | None = None, transaction_s: float | None = None
) -> Any:
    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Runs once per pooled connection; quote_ident via the server, not string pasting.
        cur = dbapi_conn.cursor()
        cur.execute("SELECT set_config('search_path', %s, false)", (f'"{schema}"',))
        if idle_in_transaction_s is not None:
            cur.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
                (f"{int(idle_in_transaction_s * 1000)}ms",),
            )
        if transaction_s is not None:
            cur.execute("SELECT current_setting('server_version_num')::int")
            version = int(cur.fetchone()[0])
            if version >= TRANSACTION_TIMEOUT_SINCE:
                cur.execute(
                    "SELECT set_config('transaction_timeout', %s, false)",
                    (f"{int(transaction_s * 1000)}ms",),
                )
            elif not _warned_old_server:
                _warned_old_server.append(version)
                log.warning(
                    "event=no_transaction_timeout server_version_num=%d: a worker frozen "
                    "inside a group write keeps its row locks until it wakes (PostgreSQL 17 "
                    "ends such a session after KODA_SESSION_TIMEOUT)",
                    version,
                )
        cur.close()
        dbapi_conn.commit()

    return on_connect


_warned_old_server: list[int] = []


def sync_engine(settings: Settings, *, pool_size: int = 2) -> Engine:
    engine = create_engine(
        sqlalchemy_url(settings.database_url), pool_size=pool_size, pool_pre_ping=True
    )
    event.listen(engine, "connect", _set_search_path(settings.names.pg_schema()))
    return engine


def async_engine(
    settings: Settings, *, pool_size: int = 10, pre_ping: bool = True, pipelines: bool = False
) -> AsyncEngine:
    """``pre_ping`` tests each pooled connection with a round trip before lending it.

    Every session is ended by PostgreSQL when it sits idle inside a transaction for
    longer than ``KODA_SESSION_TIMEOUT``: koda's transactions are a few statements
    long, and a process frozen inside one (SIGSTOP, a stalled VM) would otherwise hold
    its row locks for ever. The fenced writes take ``FOR SHARE`` on the partition's
    epoch row, so such a worker blocked its successor's epoch bump, and with it the
    successor's whole rebalance, until it woke up (82 s in a chaos run).

    ``pipelines``: the engine's connections send statements in pipeline mode (the
    worker's group write, schemas/runs/worker.py). A session frozen after sending part of
    a pipeline, before its Sync, is not idle in the server's eyes (it is ``active``,
    waiting on ClientRead), so the idle timeout never ends it: a chaos run's frozen
    worker held its successor's epoch bumps for over 90 s. Such engines also set
    ``transaction_timeout`` to the same bound, which ends any transaction older than
    that whatever the session is doing (PostgreSQL 17 and later; an older server is
    logged once, ``event=no_transaction_timeout``).
    """
    engine = create_async_engine(
        sqlalchemy_url(settings.database_url),
        pool_size=pool_size,
        max_overflow=0,
        pool_pre_ping=pre_ping,
        pool_timeout=30,
    )
    idle_s = max(1.0, settings.session_timeout_s)
    on_connect = _set_search_path(settings.names.pg_schema(), idle_s, idle_s if pipelines else None)
    event.listen(engine.sync_engine, "connect", on_connect)
    return engine


# --- statements sent on the driver connection itself (pipeline mode) ---------------


def for_driver(statement: TextClause) -> str:
    """``statement`` as psycopg takes it (``%(name)s`` placeholders): for the
    statements a store sends on the driver connection itself (pipeline mode)."""
    return str(statement.compile(dialect=_DRIVER_DIALECT))


async def driver_connection(conn: AsyncConnection) -> psycopg.AsyncConnection[Any]:
    """The psycopg connection under ``conn``: the same session and transaction."""
    fairy = await conn.get_raw_connection()
    driver = fairy.driver_connection
    if not isinstance(driver, psycopg.AsyncConnection):
        raise TypeError(f"koda's stores need psycopg's async driver, not {type(driver)}")
    return driver


async def send(raw: psycopg.AsyncConnection[Any], query: str, params: dict[str, Any]) -> Cursor:
    """Queue one statement on ``raw`` (in its pipeline, if one is open); its rows, as
    named tuples, are read once the pipeline has synced (on leaving its block)."""
    cur = raw.cursor(row_factory=namedtuple_row)
    await cur.execute(query, params)
    return cur


@contextmanager
def failing_as(what: str, hint: str | None = None) -> Iterator[None]:
    """The one Postgres-error wrapper: inside it, a SQLAlchemy or psycopg error becomes
    ``DatabaseError("<what> failed: <error class> (<hint>)")``. The class name only: a driver's
    message can hold parameters (a user's input), which never reach a log or a client.

        with failing_as("reading a run"):
            async with engine.connect() as conn:
                ...
    """
    try:
        yield
    except (SQLAlchemyError, psycopg.Error) as exc:
        more = f" ({hint})" if hint else ""
        raise DatabaseError(f"{what} failed: {type(exc).__name__}{more}") from exc

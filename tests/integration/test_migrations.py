from __future__ import annotations

import multiprocessing
from multiprocessing.synchronize import Barrier

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from tests.fixtures.namespaces import drop_schema, make_settings

TABLES = {"sessions", "runs", "messages", "usage", "prices", "partition_epochs", "memories"}


def test_migrations_build_every_table_on_an_empty_schema(settings: Settings) -> None:
    try:
        upgrade(settings)
        upgrade(settings)  # a second upgrade is a no-op
        engine = sync_engine(settings)
        insp = inspect(engine)
        schema = settings.names.pg_schema()
        assert TABLES <= set(insp.get_table_names(schema=schema))
        uniques = {u["name"] for u in insp.get_unique_constraints("runs", schema=schema)}
        assert "uq_runs_idempotency_key" in uniques
        pk = insp.get_pk_constraint("messages", schema=schema)
        assert pk["constrained_columns"] == ["run_id", "seq"]
        engine.dispose()
    finally:
        drop_schema(settings)


def _migrate(settings: Settings, start: Barrier) -> None:
    start.wait(timeout=60)
    upgrade(settings)


def test_upgrades_started_together_on_an_empty_schema_all_succeed(settings: Settings) -> None:
    """Two deploys' migrate jobs may overlap. Without the advisory lock both pass
    `CREATE SCHEMA IF NOT EXISTS` or both create alembic's version table, and one fails
    on a catalogue unique index. Processes, as in production: alembic's context is
    process-global."""
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(4)
    jobs = [spawn.Process(target=_migrate, args=(settings, start)) for _ in range(4)]
    try:
        for job in jobs:
            job.start()
        for job in jobs:
            job.join(timeout=120)
        assert [job.exitcode for job in jobs] == [0, 0, 0, 0]
        engine = sync_engine(settings)
        schema = settings.names.pg_schema()
        assert TABLES <= set(inspect(engine).get_table_names(schema=schema))
        with engine.connect() as conn:
            versions = conn.execute(text(f'SELECT count(*) FROM "{schema}".alembic_version'))
            assert versions.scalar_one() == 1
        engine.dispose()
    finally:
        for job in jobs:
            if job.is_alive():
                job.kill()
        drop_schema(settings)


def _insert_run(conn, run_id: str, key: str) -> None:
    conn.execute(
        text(
            "INSERT INTO runs (id, session_id, user_id, idempotency_key, input)"
            " VALUES (:id, 's1', 'u1', :key, '{}')"
        ),
        {"id": run_id, "key": key},
    )


def test_unique_constraints_reject_duplicates(database: Settings) -> None:
    engine = sync_engine(database)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO sessions (id, user_id) VALUES ('s1', 'u1')"))
        _insert_run(conn, "r1", "k1")
    with pytest.raises(IntegrityError, match="uq_runs_idempotency_key"):
        with engine.begin() as conn:
            _insert_run(conn, "r2", "k1")
    insert_msg = text(
        "INSERT INTO messages (run_id, seq, kind, content, attempt)"
        " VALUES ('r1', 0, 'chunk', 'x', 1)"
    )
    with engine.begin() as conn:
        conn.execute(insert_msg)
    with pytest.raises(IntegrityError, match="pk_messages"):
        with engine.begin() as conn:
            conn.execute(insert_msg)
    insert_usage = text(
        "INSERT INTO usage (run_id, call_index, model, prompt_tokens, completion_tokens,"
        " cost_usd) VALUES ('r1', 0, 'm', 1, 1, 0.1)"
    )
    with engine.begin() as conn:
        conn.execute(insert_usage)
    with pytest.raises(IntegrityError, match="pk_usage"):
        with engine.begin() as conn:
            conn.execute(insert_usage)
    with pytest.raises(IntegrityError, match="ck_runs_status"):
        with engine.begin() as conn:
            conn.execute(text("UPDATE runs SET status = 'exploded' WHERE id = 'r1'"))
    for column in ("prompt", "completion", "cached_prompt", "reasoning"):
        # koda prices set refuses a negative price; the table refuses one written directly.
        values = {"prompt": 1, "completion": 1, "cached_prompt": None, "reasoning": None}
        values[column] = -1
        with pytest.raises(IntegrityError, match="ck_prices_not_negative"):
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO prices (model, effective_from, prompt_usd_per_mtok,"
                        " completion_usd_per_mtok, cached_prompt_usd_per_mtok,"
                        " reasoning_usd_per_mtok) VALUES ('m', now(), :prompt, :completion,"
                        " :cached_prompt, :reasoning)"
                    ),
                    values,
                )
    engine.dispose()


def test_namespaces_are_isolated(database: Settings, stack) -> None:
    other = make_settings(stack)
    try:
        upgrade(other)
        a, b = sync_engine(database), sync_engine(other)
        with a.begin() as conn:
            conn.execute(text("INSERT INTO sessions (id, user_id) VALUES ('s1', 'u1')"))
        with b.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM sessions")).scalar() == 0
        a.dispose()
        b.dispose()
    finally:
        drop_schema(other)

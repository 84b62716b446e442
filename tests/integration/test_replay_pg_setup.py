"""Replays that start together into one new PostgreSQL warehouse schema all set it up.

Failure mode: `CREATE SCHEMA IF NOT EXISTS` and `CREATE TABLE IF NOT EXISTS` are not
safe against each other in PostgreSQL; two sessions creating the same name at once can
both pass the existence check and one fails on the catalogue's unique index
(``pg_namespace_nspname_index``). The sink serialises its set-up on an advisory lock."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg

from koda_runtime.naming import AppEnv, Names
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.sinks.postgres import PostgresSink
from tests.fixtures.namespaces import new_namespace

WRITERS = 6
ROUNDS = 4


def test_replays_starting_together_all_set_up_one_new_schema(stack: Any) -> None:
    url = stack.database_url
    schemas = [Names(AppEnv.DEV, new_namespace()).warehouse_schema() for _ in range(ROUNDS)]
    try:
        for schema in schemas:
            start = threading.Barrier(WRITERS)

            def open_one(schema: str = schema, start: threading.Barrier = start) -> None:
                sink = PostgresSink(url, schema, "warehouse", refuse="koda")
                start.wait(timeout=30)
                sink.open()
                sink.close()

            with ThreadPoolExecutor(WRITERS) as pool:
                for future in [pool.submit(open_one) for _ in range(WRITERS)]:
                    future.result(timeout=60)  # raises the SinkError of a failed set-up
            with psycopg.connect(url) as conn:
                tables = conn.execute(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                    [schema],
                ).fetchall()
            assert sorted(r[0] for r in tables) == sorted(x.name for x in t.TABLES)
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            for schema in schemas:
                conn.execute(
                    psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                        psycopg.sql.Identifier(schema)
                    )
                )

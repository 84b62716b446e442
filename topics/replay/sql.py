"""The SQL text of the SQL sinks, in one place.

Every interpolated part is an identifier from :mod:`koda_runtime.topics.replay.tables` (code
constants: table, column and key names) or a type from a sink's fixed type map, never
input; every value is a bound parameter. tests/unit/test_security_static.py lists these
statements as its documented exceptions.
"""

from __future__ import annotations

from collections.abc import Mapping

from koda_runtime.topics.replay.tables import Table


def create_table(table: Table, types: Mapping[str, str]) -> str:
    """``CREATE TABLE IF NOT EXISTS`` with the natural key as the primary key."""
    cols = ", ".join(f"{c.name} {types[c.type]}" for c in table.columns)
    key = ", ".join(table.key)
    return f"CREATE TABLE IF NOT EXISTS {table.name} ({cols}, PRIMARY KEY ({key}))"


def add_columns(table: Table, types: Mapping[str, str]) -> list[str]:
    """``ALTER TABLE ... ADD COLUMN IF NOT EXISTS`` for every column: a table created by
    an older release gains the columns added since (nullable, so old rows read NULL)."""
    return [
        f"ALTER TABLE {table.name} ADD COLUMN IF NOT EXISTS {c.name} {types[c.type]}"
        for c in table.columns
        if c.name not in table.key
    ]


def upsert(table: Table, source: str) -> str:
    """Upsert every row of the relation ``source`` into ``table`` by its merge rules."""
    cols = ", ".join(table.names)
    key = ", ".join(table.key)
    sets = table.update_sql("cur", "excluded")
    return (
        f"INSERT INTO {table.name} AS cur ({cols}) SELECT {cols} FROM {source}"  # noqa: S608 - names
        f" ON CONFLICT ({key}) DO UPDATE SET {sets}"
    )


def count(table: Table) -> str:
    return f"SELECT count(*) FROM {table.name}"  # noqa: S608 - a table name


def stage_table(table: Table, stage: str) -> str:
    """A PostgreSQL session-local staging table shaped like ``table``, emptied at commit."""
    return (
        f"CREATE TEMP TABLE IF NOT EXISTS {stage} (LIKE {table.name} INCLUDING DEFAULTS)"
        " ON COMMIT DELETE ROWS"
    )


def mark_days(table: Table, source: str) -> str:
    """Record (in ``_dirty``) the days of ``table`` that hold the keys of ``source``."""
    key = ", ".join(table.key)
    return (
        f"INSERT INTO _dirty SELECT DISTINCT '{table.name}', cur.day FROM {table.name} cur"  # noqa: S608
        f" JOIN {source} USING ({key}) WHERE cur.day IS NOT NULL ON CONFLICT DO NOTHING"
    )


def day_rows(table: Table) -> str:
    """One day's rows of ``table`` without the ``day`` column, in key order (``?``: the day)."""
    cols = ", ".join(c for c in table.names if c != "day")
    key = ", ".join(table.key)
    return f"SELECT {cols} FROM {table.name} WHERE day = ? ORDER BY {key}"  # noqa: S608 - names

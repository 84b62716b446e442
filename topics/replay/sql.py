"""The SQL text of the SQL sinks, in one place.

Every interpolated part is an identifier from :mod:`koda_runtime.topics.replay.tables` (code
constants: table, column and key names) or a type from a sink's fixed type map, never
input; every value is a bound parameter. tests/unit/test_security_static.py lists these
statements as its documented exceptions.
"""

from __future__ import annotations

from collections.abc import Mapping

from koda_runtime.lifecycle.chunks import SEQ_WIDTH
from koda_runtime.topics.records import formats as spec
from koda_runtime.topics.records.specs import Field
from koda_runtime.topics.replay.tables import Table


def create_table(table: Table, types: Mapping[str, str], *, primary_key: bool = True) -> str:
    """``CREATE TABLE IF NOT EXISTS`` with the natural key as the primary key, or (with
    ``primary_key`` false) with the key's columns only NOT NULL: a table kept unique by
    :func:`merge` instead of an index."""
    if primary_key:
        cols = ", ".join(f"{c.name} {types[c.type]}" for c in table.columns)
        key = ", ".join(table.key)
        return f"CREATE TABLE IF NOT EXISTS {table.name} ({cols}, PRIMARY KEY ({key}))"
    cols = ", ".join(
        f"{c.name} {types[c.type]}" + (" NOT NULL" if c.name in table.key else "")
        for c in table.columns
    )
    return f"CREATE TABLE IF NOT EXISTS {table.name} ({cols})"


def add_columns(table: Table, types: Mapping[str, str]) -> list[str]:
    """``ALTER TABLE ... ADD COLUMN IF NOT EXISTS`` for every column: a table created by
    an older release gains the columns added since (nullable, so old rows read NULL)."""
    return [statement for _, statement in add_columns_by_name(table, types)]


def add_columns_by_name(table: Table, types: Mapping[str, str]) -> list[tuple[str, str]]:
    """:func:`add_columns` with the column each statement adds."""
    return [
        (c.name, f"ALTER TABLE {table.name} ADD COLUMN IF NOT EXISTS {c.name} {types[c.type]}")
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


def merge(table: Table, source: str) -> str:
    """:func:`upsert` for a table without a primary key (DuckDB's ``MERGE``): the same
    merge rules, matched on the natural key. ``source`` must hold each key once (a key
    twice would be inserted twice): the sinks pass one row per key."""
    cols = ", ".join(table.names)
    on = " AND ".join(f"cur.{k} = excluded.{k}" for k in table.key)
    sets = table.update_sql("cur", "excluded")
    values = ", ".join(f"excluded.{c}" for c in table.names)
    return (
        f"MERGE INTO {table.name} AS cur USING {source} AS excluded ON ({on})"  # noqa: S608 - names
        f" WHEN MATCHED THEN UPDATE SET {sets}"
        f" WHEN NOT MATCHED THEN INSERT ({cols}) VALUES ({values})"
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


def last_rows(table: Table, source: str, order: str) -> str:
    """The rows of ``source``, the last of each key of ``table`` by ``order`` (a list
    of ``source``'s columns, highest first)."""
    cols = ", ".join(table.names)
    key = ", ".join(table.key)
    return (
        f"SELECT {cols} FROM {source}"  # noqa: S608 - names
        f" QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY {order}) = 1"
    )


_SQL_TYPES = {"string": "VARCHAR", "integer": "BIGINT"}


INT32_MAX = 2**31 - 1
LAST_YEAR_MS = 253_402_300_800_000  # 10000-01-01: Python's dates end before it
UUID7 = "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-7[0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}$"


def _rules(f: Field) -> list[str]:
    """SQL conditions for ``f``'s rules (Field.check's), on the parsed column ``p.<name>``."""
    col = f"p.{f.name}"
    out = [f"{col} IS NOT NULL"]
    if f.min_length is not None:
        out.append(f"length({col}) >= {f.min_length}")
    if f.max_length is not None:
        out.append(f"length({col}) <= {f.max_length}")
    if f.minimum is not None:
        out.append(f"{col} >= {f.minimum}")
    if f.type == "integer":
        out.append(f"{col} <= {INT32_MAX}")  # the tables' int columns
    return out


def decode_chunk_poll(poll: str) -> str:
    """A poll of chunk records (``key``, ``value``, ``pos`` in the relation
    ``poll``) as ``chunks`` rows with ``pos`` and ``ok``: the rules of
    topics/replay/chunk_polls.py, each field's generated from the record spec."""
    fields = spec.RUN_CHUNK.fields
    assert [f.name for f in fields] == ["run_id", "seq", "kind", "content", "attempt"]
    assert all(f.type in _SQL_TYPES and f.checked for f in fields)
    shape = "{" + ",".join(f'"{f.name}":"{_SQL_TYPES[f.type]}"' for f in fields) + "}"
    rules = [r for f in fields for r in _rules(f)]
    key = f"p.run_id || ':' || lpad(p.seq::VARCHAR, {SEQ_WIDTH}, '0')"
    uuid_ms = "('0x' || substr(run_id, 1, 8) || substr(run_id, 10, 4))::BIGINT"
    # to_json(p) is what chunk_value writes for the parsed fields: the shape's fields (the
    # spec's, in order), no whitespace, each string as to_json writes one; one call where
    # a concatenation per field cost a fifth more. ``key`` is a string (chunk_polls.py).
    # The run id's form and day are worked out once per run of the poll (a poll holds
    # some 20 records of each run; the regex per record was a fifth of the query).
    # Every interpolated part is a code constant: names, numbers, the spec's rules.
    return f"""
        WITH parsed AS (
            SELECT pos, key, value, json_transform(value, '{shape}') AS p FROM {poll}
        ), runs AS (
            SELECT run_id, CASE WHEN regexp_full_match(run_id, '{UUID7}') THEN {uuid_ms} END AS ms
            FROM (SELECT DISTINCT p.run_id AS run_id FROM parsed)
        ), checked AS (
            SELECT pos, p,
                coalesce(
                    {" AND ".join(rules)}
                    AND p.seq < {10**SEQ_WIDTH}
                    AND key = {key}
                    AND value = to_json(p)::VARCHAR,
                    false
                ) AS ok,
                runs.ms AS ms
            FROM parsed LEFT JOIN runs ON runs.run_id = p.run_id
        )
        SELECT
            p.run_id AS run_id,
            p.seq::INTEGER AS seq,
            epoch_ms(ms)::DATE AS day,
            p.kind AS kind,
            p.content AS content,
            p.attempt::INTEGER AS attempt,
            pos,
            coalesce(ok AND ms < {LAST_YEAR_MS}, false) AS ok
        FROM checked
    """  # noqa: S608

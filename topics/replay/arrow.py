"""Rows as Arrow tables: how DuckDB takes a batch in, and the Parquet files' types.

Money is ``decimal128(18, 8)`` (never a float), timestamps are microseconds in UTC.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from koda_runtime.topics.replay.tables import Table

ARROW_TYPES: dict[str, pa.DataType] = {
    "text": pa.string(),
    "int": pa.int32(),
    "bigint": pa.int64(),
    "bool": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "date": pa.date32(),
    "money": pa.decimal128(18, 8),
    "blob": pa.binary(),
    "json": pa.string(),
}


def arrow_schema(table: Table) -> pa.Schema:
    return pa.schema([pa.field(c.name, ARROW_TYPES[c.type]) for c in table.columns])


def to_arrow(table: Table, rows: list[tuple[Any, ...]]) -> pa.Table:
    """``rows`` (tuples in column order) as an Arrow table of the table's types."""
    schema = arrow_schema(table)
    columns = list(zip(*rows, strict=True)) if rows else [() for _ in table.columns]
    arrays = [pa.array(col, type=f.type) for col, f in zip(columns, schema, strict=True)]
    return pa.Table.from_arrays(arrays, schema=schema)

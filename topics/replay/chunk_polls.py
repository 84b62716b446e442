"""A poll of chunk records decoded by DuckDB, for the sinks that take Arrow tables.

The per-record path (rows.py) parses each value with Python's ``json`` and builds a
tuple per row; for the chunk topic, which is most of what a replay reads, that Python
is most of the replay's time. Here the poll goes to DuckDB as four Arrow columns (key,
value, position) and comes back as the ``chunks`` rows, as an Arrow table
that the sink upserts without the rows ever becoming Python objects.

It must give exactly the rows of the per-record path, so it takes a record only when
that is certain, and otherwise hands the whole poll back (None), as
:func:`~koda_runtime.topics.replay.rows.chunk_columns` does:

* the value must be *canonical*: byte for byte what ``chunk_value`` (schemas/records.py)
  writes for the parsed fields (the spec's fields in order, no whitespace, strings
  escaped as ``json.dumps(ensure_ascii=False)`` escapes them). DuckDB's JSON reader
  is more lenient than Python's (it takes a trailing comma, ``NaN``, duplicate keys);
  a value that is the canonical writing of its own fields is strict JSON, which both
  read alike, so leniency can never admit a record the per-record path refuses;
* each field keeps the spec's rules (lengths in characters, minimums), and the integers
  fit the tables' 32-bit columns;
* the key is ``<run_id>:<seq>`` of those fields, and the run id is a UUIDv7 in the
  canonical 8-4-4-4-12 form, whose day DuckDB reads from its first 48 bits as
  :func:`~koda_runtime.topics.replay.batch.uuid7_day` does. Python's ``uuid.UUID``
  also reads braces, ``urn:uuid:``, missing hyphens and more; any run id but the
  canonical form (every id koda makes) goes to the per-record path, which knows them;
* DuckDB raising on a value (a lone surrogate escape, say) also hands the poll back.

Failure mode: a record the two paths would not decode alike.
``tests/unit/test_replay_columns.py`` sends polls with each such deviation through both
and compares the rows. The SQL is :func:`~koda_runtime.topics.replay.sql.decode_chunk_poll`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from koda_runtime.topics.replay import sql
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.arrow import arrow_schema
from koda_runtime.topics.replay.batch import Message, read_all

POLL = "koda_poll"


class ChunkPolls:
    """Decodes polls of chunk records in an in-memory DuckDB of its own."""

    def __init__(self) -> None:
        self.conn = duckdb.connect(":memory:")
        self.conn.execute("SET TimeZone = 'UTC'")
        self.sql = sql.decode_chunk_poll(POLL)
        self.schema = arrow_schema(t.CHUNKS)

    def decode(self, msgs: Sequence[Message], values: list[Any] | None = None) -> pa.Table | None:
        """The ``chunks`` rows of ``msgs`` (plus ``pos``, each row's place in the poll),
        or None unless every record is one the per-record path decodes to exactly that
        row. The caller has checked that every record is on the chunk topic, has a value
        and has a plain chunk schema header; ``values``: their values, if it read them."""
        if values is None:
            values = read_all(msgs, "value")
        try:
            poll = pa.table(
                {
                    # A key that is not UTF-8 cannot be a chunk key: the poll goes back.
                    "key": pa.array(read_all(msgs, "key"), pa.string()),
                    "value": pa.array(values, pa.string()),
                    "pos": pa.array(range(len(msgs)), pa.int32()),
                }
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            return None  # a value that is not UTF-8, or a key that is not bytes
        self.conn.register(POLL, poll)
        try:
            out = self.conn.sql(self.sql).to_arrow_table()
        except duckdb.Error:
            return None  # a value DuckDB cannot read: the per-record path says why
        finally:
            self.conn.unregister(POLL)
        if out.num_rows != len(msgs) or not pc.all(out["ok"]).as_py():
            return None
        return out.drop_columns(["ok"]).cast(self.schema.append(pa.field("pos", pa.int32())))

    def close(self) -> None:
        self.conn.close()


def runs_and_days(part: pa.Table) -> dict[str, Any]:
    """Each run of a decoded poll with its day (its run id's, so one per run)."""
    runs = part.select(["run_id", "day"]).group_by(["run_id", "day"]).aggregate([])
    return dict(zip(runs["run_id"].to_pylist(), runs["day"].to_pylist(), strict=True))

"""Apache Iceberg tables (``--to iceberg:///warehouse`` or a REST catalog), by pyiceberg.

URL forms (see :func:`catalog_config`):

    iceberg:///warehouse              a SQL catalog in ``warehouse/catalog.db`` (SQLite) and the
                                      tables' files under ``warehouse/`` (relative path; four
                                      slashes for an absolute one: iceberg:////srv/lake)
    iceberg+rest://host:8181/prefix   a REST catalog at http://host:8181/prefix
    iceberg+rests://host/prefix       the same over https; ``client:secret@`` in the
                                      authority is the OAuth ``credential``

Every query parameter but ``namespace`` is passed to the catalog as a property
(``warehouse=...``, ``token=...``, ``s3.endpoint=...``); ``namespace`` names the
Iceberg namespace (default ``Names.warehouse_schema()``, e.g. ``koda_dev_warehouse``).

**How a batch is written: merge on key, copy on write.** Iceberg files are never
updated in place, and the replay's tables are upserts with merge rules (tables.py). So
for every table a batch carries, the sink takes the batch's *region* of it (a filter
on the natural key that holds every key of the batch: the ``run_id`` values and the
ranges of the other key columns; for ``chunks`` and ``outputs`` every row of the
batch's runs, which the outputs rebuild reads), reads the rows the table holds in
that region into an in-memory DuckDB, applies the batch there with the same SQL as the
DuckDB sink (upserts, then the outputs rebuilt), and writes the region back with one
``overwrite(df, overwrite_filter=region)``: one Iceberg transaction per table that
replaces exactly the rows it read. The merge rules are idempotent and order-free, so
applying a batch twice, or a part of one again after a crash, leaves the same rows:
a replay killed at any point (between two tables of a batch, between batches) and run
again gives the tables of a clean replay, with no duplicate key. A job (``--job``)
resumes from its consumer group, whose offsets are committed after every table of the
batch; without one a replay starts over and converges to the same tables.

**Offsets.** Each commit's snapshot summary holds ``koda.replay.offsets``: the next
offset of every partition read when the batch was cut (JSON ``{"topic": {"0": n}}``),
the point up to which that table holds the topics (:func:`snapshot_offsets`).

**Upkeep.** Every commit adds snapshots and a data file. After each commit the sink
expires all but the newest ``KEEP_SNAPSHOTS`` snapshots of the table, keeps at most
``METADATA_VERSIONS`` old metadata files, and rewrites a table into one file once it
has more than ``COMPACT_FILES`` data files (one more transaction, same rows). Files of
expired snapshots stay on disk: remove them with an engine's orphan-file clean-up
(Spark's ``remove_orphan_files``) or replay into a fresh warehouse.

Failure modes: a crash between the tables of a batch (fault ``kill-between-iceberg-tables``)
and between a batch's last commit and the job's offsets (``kill-after-iceberg-batch``);
tests/integration/test_replay_iceberg.py provokes both (``KODA_TEST_FAULT``, never in
prod: the settings refuse it there).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pyarrow as pa
from pyiceberg import expressions
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.expressions import BooleanExpression
from pyiceberg.table import Table as IcebergTable

from koda_runtime.naming import Names
from koda_runtime.topics.replay import sql
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.arrow import arrow_schema
from koda_runtime.topics.replay.errors import ReplayOptionError, SinkError
from koda_runtime.topics.replay.rows import RowBatch
from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink, upsert_sql

log = logging.getLogger("koda.replay")
# pyiceberg's expression classes are pydantic models whose constructors mypy misreads.
_X: Any = expressions

SCHEMES = ("iceberg", "iceberg+rest", "iceberg+rests")
CATALOG_NAME = "koda"
CATALOG_FILE = "catalog.db"
OFFSETS_PROPERTY = "koda.replay.offsets"
KEEP_SNAPSHOTS = 50  # expired down to this many once a table has twice as many
METADATA_VERSIONS = 20
COMPACT_FILES = 64
# Query parameters whose values are secrets: shown as *** in every message.
SECRET_PARAMETERS = ("credential", "token", "password", "secret", "s3.secret-access-key")
_NAMESPACE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
HELD = "koda_held"  # the rows a region holds, registered in the in-memory DuckDB
FAULTS = ("kill-between-iceberg-tables", "kill-after-iceberg-batch")
FAULT_BATCH = 2  # a fault stops in this batch or later: one batch is whole before it


@dataclass(frozen=True)
class CatalogConfig:
    """Which catalog, with which properties, and the namespace of the tables."""

    kind: str  # "sql" or "rest"
    properties: dict[str, str]
    namespace: str
    warehouse_dir: Path | None = None  # the local directory of a SQL catalog
    display: str = ""
    secrets: tuple[str, ...] = field(default=(), repr=False)


def display_url(url: str) -> str:
    """``url`` without its secrets: the authority's password and secret parameters."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    secret = any(k.lower() in SECRET_PARAMETERS for k, _ in pairs)
    if parts.password is None and not secret:
        return url
    if secret:
        pairs = [(k, "***" if k.lower() in SECRET_PARAMETERS else v) for k, v in pairs]
        parts = parts._replace(query=urlencode(pairs, safe="*/:"))
    if parts.password is not None:
        host = parts.hostname or ""
        if parts.port is not None:
            host += f":{parts.port}"
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    return urlunsplit(parts)


def catalog_config(url: str, names: Names) -> CatalogConfig:
    """The catalog ``url`` names; raises ReplayOptionError for a malformed one."""
    shown = display_url(url)
    scheme = urlsplit(url).scheme.lower()
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    props = {k: v for k, v in pairs if k != "namespace"}
    namespace = next((v for k, v in pairs if k == "namespace"), "") or names.warehouse_schema()
    if not _NAMESPACE.match(namespace):
        raise ReplayOptionError(
            f"--to {shown}: namespace={namespace!r} is not a plain identifier"
            " (letters, digits, _; at most 63)"
        )
    if scheme == "iceberg":
        rest = url.split("?", 1)[0][len("iceberg://") :]
        if not rest.startswith("/") or rest == "/" or parts.netloc:
            raise ReplayOptionError(
                f"--to {shown}: write iceberg:///relative/dir or iceberg:////absolute/dir"
                " (a local SQL catalog), or iceberg+rest://HOST:PORT/PATH for a REST catalog"
            )
        unknown = sorted(set(props) - {"warehouse"})
        if unknown:
            raise ReplayOptionError(
                f"--to {shown}: a local catalog takes only ?namespace=, not {', '.join(unknown)}"
            )
        directory = Path(rest[1:]).absolute()
        properties = {
            "uri": f"sqlite:///{directory / CATALOG_FILE}",
            "warehouse": props.get("warehouse") or directory.as_uri(),
        }
        return CatalogConfig("sql", properties, namespace, directory, shown)
    if scheme in ("iceberg+rest", "iceberg+rests"):
        if not parts.hostname:
            raise ReplayOptionError(f"--to {shown}: a REST catalog URL needs a host")
        web = "https" if scheme == "iceberg+rests" else "http"
        host = parts.hostname + (f":{parts.port}" if parts.port is not None else "")
        properties = {"uri": urlunsplit((web, host, parts.path.rstrip("/"), "", "")), **props}
        if parts.username is not None:
            properties.setdefault("credential", f"{parts.username}:{parts.password or ''}")
        secrets = tuple(v for k, v in properties.items() if k.lower() in SECRET_PARAMETERS)
        return CatalogConfig("rest", properties, namespace, None, shown, secrets)
    raise ReplayOptionError(f"--to {shown}: not an Iceberg URL ({', '.join(SCHEMES)})")


def load(config: CatalogConfig) -> Catalog:
    """The catalog of ``config`` (a REST catalog is asked for its config here)."""
    if config.kind == "sql":
        from pyiceberg.catalog.sql import SqlCatalog

        return SqlCatalog(CATALOG_NAME, **config.properties)
    from pyiceberg.catalog.rest import RestCatalog

    return RestCatalog(CATALOG_NAME, **config.properties)


def iceberg_arrow_schema(table: t.Table) -> pa.Schema:
    """The Arrow schema an Iceberg table of ``table`` is made from: the key required."""
    key = set(table.key)
    return pa.schema(
        [f.with_nullable(f.name not in key) for f in arrow_schema(table)],
    )


def snapshot_offsets(table: IcebergTable) -> dict[tuple[str, int], int]:
    """The offsets in the current snapshot of ``table`` (empty before the first batch)."""
    snap = table.current_snapshot()
    summary = None if snap is None else snap.summary
    text = None if summary is None else summary.additional_properties.get(OFFSETS_PROPERTY)
    if not text:
        return {}
    return {
        (topic, int(p)): int(o)
        for topic, parts in json.loads(text).items()
        for p, o in parts.items()
    }


def _offsets_json(positions: Mapping[tuple[str, int], int]) -> str:
    out: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in sorted(positions.items()):
        out.setdefault(topic, {})[str(partition)] = offset
    return json.dumps(out, separators=(",", ":"))


def key_region(table: t.Table, keys: Iterable[tuple[Any, ...]]) -> BooleanExpression | None:
    """A filter holding every key of ``keys`` (None for none): per text key column its
    values, per integer key column the range of them; text columns get their range too,
    so that a data file outside it is skipped by its column statistics. A key column of
    another type is left unconstrained (the filter only has to hold the keys)."""
    columns = [c for c in table.columns if c.merge is t.Merge.KEY]
    values: list[set[Any]] = [set() for _ in columns]
    for key in keys:
        for i, v in enumerate(key):
            values[i].add(v)
    if not values or not values[0]:
        return None
    parts: list[BooleanExpression] = []
    for column, seen in zip(columns, values, strict=True):
        if None in seen or column.type not in _TYPED:
            continue
        low, high = min(seen), max(seen)
        if column.type == "text":
            parts.append(_X.In(column.name, seen))
        if low == high:
            if column.type != "text":
                parts.append(_X.EqualTo(column.name, low))
            continue
        parts += [_X.GreaterThanOrEqual(column.name, low), _X.LessThanOrEqual(column.name, high)]
    region: BooleanExpression = (
        _X.AlwaysTrue() if not parts else parts[0] if len(parts) == 1 else _X.And(*parts)
    )
    return region


_TYPED = ("text", "int", "bigint")


class IcebergSink(DuckDBSink):
    """Iceberg tables in one namespace of a catalog; batches merged in DuckDB in memory."""

    defer_outputs = False  # each snapshot holds its batch's outputs
    key_order = False

    def __init__(self, config: CatalogConfig) -> None:
        super().__init__(Path(":memory:"), config.display)
        self.config = config
        self._catalog: Catalog | None = None
        self._tables: dict[str, IcebergTable] = {}
        self._batches = 0
        self._fault = os.environ.get("KODA_TEST_FAULT") if _test_env() else None

    # -- opening -------------------------------------------------------------------

    def open(self) -> None:
        config = self.config
        if config.warehouse_dir is not None:
            if not config.warehouse_dir.parent.is_dir():
                raise SinkError(
                    f"cannot open {self.display}: directory {config.warehouse_dir.parent}"
                    " does not exist"
                )
            config.warehouse_dir.mkdir(exist_ok=True)
        super().open()  # the in-memory DuckDB the batches are merged in
        try:
            self._catalog = load(config)
            self._catalog.create_namespace_if_not_exists(config.namespace)
            for table in t.TABLES:
                self._tables[table.name] = self._open_table(table)
        except Exception as exc:  # pyiceberg's, its catalog client's (HTTP, SQLAlchemy), OS
            self.close()
            raise SinkError(f"cannot open {self.display}: {self._hide(exc)}") from exc

    def _open_table(self, table: t.Table) -> IcebergTable:
        assert self._catalog is not None
        ident = (self.config.namespace, table.name)
        schema = iceberg_arrow_schema(table)
        try:
            found = self._catalog.load_table(ident)
        except NoSuchTableError:
            found = self._catalog.create_table_if_not_exists(
                ident,
                schema=schema,
                properties={
                    "write.metadata.delete-after-commit.enabled": "true",
                    "write.metadata.previous-versions-max": str(METADATA_VERSIONS),
                },
            )
        names = {f.name for f in found.schema().fields}
        if set(table.names) - names:
            # A column added since the table was made (tables.py): nullable, old rows null.
            with found.update_schema() as update:
                update.union_by_name(schema)
        if set(found.schema().identifier_field_names()) != set(table.key):
            with found.update_schema() as update:
                update.set_identifier_fields(*table.key)
        return found

    # -- writing -------------------------------------------------------------------

    def write(self, batch: RowBatch) -> dict[str, int]:
        """The batch merged in the in-memory DuckDB, inside one DuckDB transaction that
        is rolled back once the regions are written out (so it starts empty each time)."""
        regions = self.regions(batch)
        conn = self.conn
        conn.begin()
        try:
            self._stage(regions)
            written = super().write(batch)
            self._commit(regions, batch.positions)
        except SinkError:
            raise
        except Exception as exc:  # DuckDB's, pyiceberg's, its catalog client's, Arrow's, OS
            raise SinkError(f"writing to {self.display} failed: {self._hide(exc)}") from exc
        finally:
            conn.rollback()
        return written

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Inside :meth:`write`'s DuckDB transaction: nothing to begin or commit here."""
        yield

    def regions(self, batch: RowBatch) -> dict[str, BooleanExpression]:
        """Per table the batch writes, the filter of the rows it reads and replaces.

        A batch that purges an erased user's rows (erased.py) may delete anywhere: it
        reads and replaces every table whole (such batches are rare)."""
        if getattr(batch, "purge_digests", None) or getattr(batch, "purge_runs", None):
            return {table.name: _X.AlwaysTrue() for table in t.TABLES}
        runs = sorted(batch.chunk_runs)
        out_runs = sorted(set(runs) | batch.final_runs | _first(batch.rows[t.OUTPUTS.name]))
        found: dict[str, BooleanExpression] = {}
        for table in t.TABLES:
            if table is t.CHUNKS:  # every chunk of the runs whose outputs are rebuilt
                region = key_region(t.OUTPUTS, [(r,) for r in runs])
            elif table is t.OUTPUTS:
                region = key_region(t.OUTPUTS, [(r,) for r in out_runs])
            else:
                region = key_region(table, batch.rows.get(table.name, {}).keys())
            if region is not None:
                found[table.name] = region
        return found

    def _stage(self, regions: Mapping[str, BooleanExpression]) -> None:
        """The (empty) in-memory tables given what the tables hold in ``regions``."""
        conn = self.conn
        for name, region in regions.items():
            held = self._tables[name].scan(row_filter=region).to_arrow()
            if held.num_rows:
                conn.register(HELD, held)
                try:
                    # Into an empty table, keys unique: the upsert inserts every row.
                    conn.execute(upsert_sql(t.BY_NAME[name], HELD)).fetchall()
                finally:
                    conn.unregister(HELD)

    def _commit(
        self, regions: Mapping[str, BooleanExpression], positions: Mapping[tuple[str, int], int]
    ) -> None:
        """Each table's region written back, one transaction per table, in table order."""
        self._batches += 1
        props = {OFFSETS_PROPERTY: _offsets_json(positions)} if positions else {}
        for other in t.TABLES:
            if other.name not in regions and self._count(other) > 0:
                # A write to a table outside the batch's regions would be lost: refuse it.
                raise SinkError(
                    f"writing to {self.display}: the batch wrote {other.name}"
                    " rows outside the regions it read"
                )
        names = [table.name for table in t.TABLES if table.name in regions]
        for i, name in enumerate(names):
            table = t.BY_NAME[name]
            rows = self._rows(table)
            ice = self._tables[name]
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Delete operation did not match any records")
                with ice.transaction() as txn:
                    txn.overwrite(rows, overwrite_filter=regions[name], snapshot_properties=props)
            self._upkeep(ice, props)
            if i == 0 and len(names) > 1:
                self._maybe_fault("kill-between-iceberg-tables", f"after {name}")
        self._maybe_fault("kill-after-iceberg-batch", "after the batch's last table")

    def _rows(self, table: t.Table) -> pa.Table:
        data = self.conn.table(table.name).to_arrow_table().select(list(table.names))
        data = data.sort_by([(k, "ascending") for k in table.key])
        return data.cast(iceberg_arrow_schema(table))

    def _count(self, table: t.Table) -> int:
        rows = self.conn.execute(sql.count(table)).fetchall()
        return int(rows[0][0]) if rows else 0

    def _upkeep(self, ice: IcebergTable, props: Mapping[str, str]) -> None:
        """Expire old snapshots; compact a table of many files into one."""
        snapshots = sorted(ice.snapshots(), key=lambda s: s.timestamp_ms)
        if len(snapshots) > 2 * KEEP_SNAPSHOTS:
            current = ice.current_snapshot()
            old = [s.snapshot_id for s in snapshots[:-KEEP_SNAPSHOTS]]
            old = [s for s in old if current is None or s != current.snapshot_id]
            ice.maintenance.expire_snapshots().by_ids(old).commit()
        snap = ice.current_snapshot()
        summary = None if snap is None else snap.summary
        files = int((summary.get("total-data-files") if summary else None) or 0)
        if files > COMPACT_FILES:
            data = ice.scan().to_arrow()
            with ice.transaction() as txn:
                txn.overwrite(data, snapshot_properties=dict(props))
            log.info("event=iceberg_compacted table=%s files=%d", ice.name(), files)

    def _maybe_fault(self, fault: str, where: str) -> None:
        """SIGKILL at ``fault``'s point: between the first two tables of the first batch
        from the second on that writes several, or after the second batch's last table."""
        if self._fault != fault or self._batches < FAULT_BATCH:
            return
        if fault == "kill-after-iceberg-batch" and self._batches != FAULT_BATCH:
            return
        log.warning("test fault %s: SIGKILL %s of batch %d", fault, where, self._batches)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def _hide(self, exc: BaseException) -> str:
        first = (str(exc).strip().splitlines() or [""])[0]
        text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        for secret in self.config.secrets:
            if secret:
                text = text.replace(secret, "***")
        return text

    # -- reading -------------------------------------------------------------------

    def table(self, name: str) -> IcebergTable:
        """The Iceberg table ``name`` (refreshed), for readers and tests."""
        found = self._tables.get(name)
        if found is None:
            raise SinkError(f"{self.display} is not open")
        return found.refresh()

    def count(self, table: str) -> int:
        return self.table(table).scan().count()

    def close(self) -> None:
        super().close()
        self._tables.clear()
        self._catalog = None


def _first(rows: Mapping[tuple[Any, ...], Any]) -> set[Any]:
    return {key[0] for key in rows}


def _test_env() -> bool:
    """Faults only where the settings allow them (they refuse KODA_TEST_FAULT in prod)."""
    return os.environ.get("APP_ENV", "dev") != "prod"

"""Where a replay writes: a sink chosen by the ``--to`` URL.

    duckdb:///warehouse.duckdb        a DuckDB file (relative path; four slashes for an
                                      absolute one: duckdb:////srv/warehouse.duckdb)
    postgresql://user@host/db         a PostgreSQL schema (``?schema=NAME``; default
                                      ``Names.warehouse_schema()``, e.g. koda_dev_warehouse)
    parquet:///warehouse              Parquet files partitioned by day under a directory
    iceberg:///warehouse              Iceberg tables: a SQL catalog (SQLite) and files under a
                                      directory; iceberg+rest://host:port/path for a REST
                                      catalog (sinks/iceberg.py has the forms)

Every message shows the URL through :func:`redact` (no password).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from koda_runtime.naming import Names
from koda_runtime.topics.replay.errors import ReplayOptionError
from koda_runtime.topics.replay.sinks.base import Sink

__all__ = ["DEFAULT_URL", "Sink", "open_sink", "redact"]

DEFAULT_URL = "duckdb:///warehouse.duckdb"
SCHEMES = ("duckdb", "postgresql", "postgres", "parquet", "iceberg", "iceberg+rest")
_SCHEMA = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``: the one in the authority and a
    ``password`` query parameter (libpq's form)."""
    parts = urlsplit(url)
    secret_query = any(k.lower() == "password" for k, _ in parse_qsl(parts.query))
    if parts.password is None and not secret_query:
        return url  # unsplit would turn "duckdb:///f" into "duckdb:/f"
    if secret_query:
        query = [
            (k, "***" if k.lower() == "password" else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ]
        parts = parts._replace(query=urlencode(query, safe="*"))
    if parts.password is not None:
        host = parts.hostname or ""
        if parts.port is not None:
            host += f":{parts.port}"
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    return urlunsplit(parts)


WAREHOUSE_EXTRA = "koda-runtime[warehouse]"


def _path(url: str, scheme: str) -> Path:
    rest = url[len(scheme) + len("://") :]
    if not rest.startswith("/") or rest == "/":
        raise ReplayOptionError(
            f"--to {redact(url)}: write {scheme}:///relative/path or {scheme}:////absolute/path"
        )
    return Path(rest[1:])


def open_sink(url: str, names: Names) -> Sink:
    """The sink for ``url``, not yet opened. Raises ReplayOptionError for an unknown scheme."""
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("duckdb", "parquet"):
        try:
            from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink
            from koda_runtime.topics.replay.sinks.parquet import ParquetSink
        except ModuleNotFoundError as exc:
            raise ReplayOptionError(
                f"--to {redact(url)}: the {scheme} sink needs {exc.name}, which comes with "
                f"the warehouse extra: pip install '{WAREHOUSE_EXTRA}' (the postgresql:// "
                "sink needs neither)"
            ) from exc
        if scheme == "duckdb":
            return DuckDBSink(_path(url, "duckdb"), redact(url))
        return ParquetSink(_path(url, "parquet"), redact(url))
    if scheme in ("iceberg", "iceberg+rest", "iceberg+rests"):
        try:
            from koda_runtime.topics.replay.sinks.iceberg import IcebergSink, catalog_config
        except ModuleNotFoundError as exc:
            raise ReplayOptionError(
                f"--to {scheme}://...: the iceberg sink needs {exc.name}, which comes with "
                f"the warehouse extra: pip install '{WAREHOUSE_EXTRA}'"
            ) from exc
        return IcebergSink(catalog_config(url, names))
    if scheme in ("postgresql", "postgres"):
        from koda_runtime.topics.replay.sinks.postgres import PostgresSink

        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        schema = next((v for k, v in query if k == "schema"), "") or names.warehouse_schema()
        if not _SCHEMA.match(schema):
            raise ReplayOptionError(
                f"--to {redact(url)}: schema={schema!r} is not a plain identifier"
                " (letters, digits, _; at most 63)"
            )
        dsn = urlunsplit(
            parts._replace(query=urlencode([(k, v) for k, v in query if k != "schema"]))
        )
        return PostgresSink(dsn, schema, redact(url), refuse=names.pg_schema())
    raise ReplayOptionError(
        f"--to {redact(url)}: unknown sink; use one of {', '.join(s + '://' for s in SCHEMES)}"
        f" (e.g. {DEFAULT_URL})"
    )

"""The Iceberg sink on a local SQL catalog (SQLite and files in a temporary directory):
the same tables as the DuckDB sink, whatever the batching and however often a batch is
applied; a batch applied in part (a crash between tables) and then again; the offsets in
the snapshots; the URL forms (REST mapped to its catalog properties, never connected);
new columns; snapshot expiry and compaction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.expressions.visitors import bind
from pyiceberg.io.pyarrow import expression_to_pyarrow

from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.errors import ReplayOptionError, SinkError
from koda_runtime.topics.replay.sinks import iceberg as ice
from koda_runtime.topics.replay.sinks import open_sink
from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink
from koda_runtime.topics.replay.sinks.iceberg import IcebergSink, catalog_config
from tests.unit.replay_records import NAMES, decode, final
from tests.unit.test_replay_sinks import dump, history

NS = NAMES.warehouse_schema()


def open_iceberg(directory: Path) -> IcebergSink:
    sink = open_sink(f"iceberg:///{directory}", NAMES)
    assert isinstance(sink, IcebergSink)
    sink.open()
    return sink


def tables(sink: IcebergSink) -> dict[str, list[tuple[Any, ...]]]:
    """Every table's rows, sorted, as the DuckDB sink's ``dump`` gives them."""
    out = {}
    for table in t.TABLES:
        data = sink.table(table.name).scan().to_arrow().select(list(table.names))
        out[table.name] = sorted(tuple(r.values()) for r in data.to_pylist())
    return out


def keys_unique(sink: IcebergSink) -> None:
    for table in t.TABLES:
        data = sink.table(table.name).scan().to_arrow()
        keys = list(zip(*(data[k].to_pylist() for k in table.key), strict=True))
        assert len(keys) == len(set(keys)), f"duplicate keys in {table.name}"


@pytest.fixture
def records() -> list[Any]:
    runs = [uuid7(), uuid7(), uuid7()]
    return [m for n, r in enumerate(runs) for m in history(r, n)]


@pytest.fixture
def reference(tmp_path: Path, records: list[Any]) -> dict[str, list[tuple[Any, ...]]]:
    duck = DuckDBSink(tmp_path / "ref.duckdb", "ref")
    duck.open()
    try:
        duck.write(decode(*records))
        return dump(duck)
    finally:
        duck.close()


def test_iceberg_tables_equal_duckdbs_however_the_batches_are_cut_and_repeated(
    tmp_path: Path, records: list[Any], reference: dict[str, list[tuple[Any, ...]]]
) -> None:
    whole = open_iceberg(tmp_path / "whole")
    whole.write(decode(*records))
    assert tables(whole) == reference
    whole.write(decode(*records))  # again: an upsert changes nothing, adds no row
    assert tables(whole) == reference
    keys_unique(whole)
    whole.close()

    split = open_iceberg(tmp_path / "split")
    backwards = records[::-1]
    for i in range(0, len(backwards), 4):  # four records per batch, in reverse
        split.write(decode(*backwards[i : i + 4]))
    assert tables(split) == reference
    split.close()


def test_a_batch_committed_in_some_tables_only_then_again_gives_the_same_tables(
    tmp_path: Path,
    records: list[Any],
    reference: dict[str, list[tuple[Any, ...]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink = open_iceberg(tmp_path / "w")
    half = len(records) // 2
    sink.write(decode(*records[:half]))
    committed: list[str] = []
    real = IcebergSink._upkeep

    def crash_after_two(self: IcebergSink, table: Any, props: Any) -> None:
        real(self, table, props)
        committed.append(table.name())
        if len(committed) == 2:
            raise KeyboardInterrupt("the process dies between two tables")

    monkeypatch.setattr(IcebergSink, "_upkeep", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        sink.write(decode(*records))
    monkeypatch.undo()
    partial = tables(sink)
    assert partial != reference  # some tables hold the batch, the others do not yet
    sink.close()

    again = open_iceberg(tmp_path / "w")  # a restarted replay reads the batch again
    again.write(decode(*records))
    assert tables(again) == reference
    keys_unique(again)


def test_each_commit_records_the_batch_offsets_in_its_snapshot(
    tmp_path: Path, records: list[Any]
) -> None:
    sink = open_iceberg(tmp_path / "w")
    batch = decode(*records)
    batch.positions = {("unit.runs", 0): 7, ("unit.run-chunks", 3): 42}
    sink.write(batch)
    for table in t.TABLES:
        stored = ice.snapshot_offsets(sink.table(table.name))
        if sink.count(table.name):
            assert stored == batch.positions, table.name
        else:
            assert stored == {}, table.name
    snap = sink.table("runs").current_snapshot()
    assert snap is not None and snap.summary is not None
    text = snap.summary.additional_properties[ice.OFFSETS_PROPERTY]
    assert json.loads(text) == {"unit.run-chunks": {"3": 42}, "unit.runs": {"0": 7}}


def test_a_final_record_keeps_the_output_whatever_comes_after(tmp_path: Path) -> None:
    run = uuid7()
    sink = open_iceberg(tmp_path / "w")
    sink.write(decode(*history(run)))
    sink.write(decode(final(99, run, 3, "done", "{}")))
    sink.write(decode(*history(run)))  # chunks read again after the final record
    out = sink.table("outputs").scan().to_arrow().to_pylist()
    assert [(o["run_id"], o["compacted"]) for o in out] == [(run, True)]


def test_a_write_outside_the_regions_read_is_refused(
    tmp_path: Path, records: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = open_iceberg(tmp_path / "w")
    monkeypatch.setattr(IcebergSink, "regions", lambda self, batch: {})
    with pytest.raises(SinkError, match="the batch wrote runs rows outside the regions it read"):
        sink.write(decode(*records))
    monkeypatch.undo()
    assert sink.count("runs") == 0  # nothing half-written


def test_key_region_holds_every_key_of_the_batch_and_not_much_else(tmp_path: Path) -> None:
    region = ice.key_region(t.LEDGER, [("b", 1, 0), ("a", 2, 5)])
    assert region is not None and ice.key_region(t.LEDGER, []) is None
    schema = open_iceberg(tmp_path / "w").table("ledger").schema()
    rows = pa.table(
        {
            "run_id": ["a", "b", "c", "a", "b"],
            "attempt": pa.array([2, 1, 1, 9, 2], pa.int32()),
            "call_index": pa.array([5, 0, 0, 0, 6], pa.int32()),
        }
    )
    # Evaluated by Arrow as a scan evaluates it: the batch's keys in, keys outside the
    # box (another run, a later attempt, a later call) out.
    kept = rows.filter(expression_to_pyarrow(bind(schema, region, case_sensitive=True)))
    assert kept.to_pylist() == [
        {"run_id": "a", "attempt": 2, "call_index": 5},
        {"run_id": "b", "attempt": 1, "call_index": 0},
    ]


def test_url_forms_map_to_catalog_properties(tmp_path: Path) -> None:
    local = catalog_config(f"iceberg:///{tmp_path}/lake", NAMES)
    assert local.kind == "sql" and local.namespace == NS
    assert local.properties == {
        "uri": f"sqlite:///{tmp_path}/lake/catalog.db",
        "warehouse": (tmp_path / "lake").as_uri(),
    }
    rel = catalog_config("iceberg:///lake?namespace=analytics", NAMES)
    assert rel.warehouse_dir == Path("lake").absolute() and rel.namespace == "analytics"

    rest = catalog_config(
        "iceberg+rest://cat.example:8181/api/catalog?warehouse=prod&token=s3cr3t"
        "&s3.endpoint=http://minio:9000",
        NAMES,
    )
    assert rest.kind == "rest" and rest.namespace == NS
    assert rest.properties == {
        "uri": "http://cat.example:8181/api/catalog",
        "warehouse": "prod",
        "token": "s3cr3t",
        "s3.endpoint": "http://minio:9000",
    }
    assert "s3cr3t" not in rest.display and "token=***" in rest.display
    secure = catalog_config("iceberg+rests://client:hush@cat.example/v1/?namespace=k", NAMES)
    assert secure.properties == {"uri": "https://cat.example/v1", "credential": "client:hush"}
    assert secure.namespace == "k" and "hush" not in secure.display
    assert secure.display.startswith("iceberg+rests://client:***@cat.example")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("iceberg://host/lake", "write iceberg:///relative/dir or iceberg:////absolute/dir"),
        ("iceberg:///", "write iceberg:///relative/dir"),
        ("iceberg:///lake?namespace=no-dash", "namespace='no-dash' is not a plain identifier"),
        ("iceberg:///lake?token=x", "a local catalog takes only ?namespace=, not token"),
        ("iceberg+rest:///v1", "a REST catalog URL needs a host"),
    ],
)
def test_a_bad_iceberg_url_says_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ReplayOptionError, match=message.replace("?", r"\?")):
        open_sink(url, NAMES)


def test_an_unreachable_rest_catalog_fails_at_open_without_its_secret() -> None:
    sink = open_sink("iceberg+rest://127.0.0.1:9/v1?token=t0psecret", NAMES)
    with pytest.raises(
        SinkError, match=r"cannot open iceberg\+rest://127.0.0.1:9/v1\?token=\*\*\*"
    ) as err:
        sink.open()
    assert "t0psecret" not in str(err.value)


def test_a_missing_parent_directory_is_named(tmp_path: Path) -> None:
    sink = open_sink(f"iceberg:///{tmp_path}/nowhere/lake", NAMES)
    with pytest.raises(SinkError, match="directory .*nowhere does not exist"):
        sink.open()


def test_a_table_of_an_older_release_gains_the_new_columns(tmp_path: Path) -> None:
    directory = tmp_path / "lake"
    directory.mkdir()
    catalog = SqlCatalog(
        "koda", uri=f"sqlite:///{directory}/catalog.db", warehouse=directory.as_uri()
    )
    catalog.create_namespace(NS)
    old = ice.iceberg_arrow_schema(t.RUN_TRANSITIONS)
    catalog.create_table((NS, "run_transitions"), schema=old.remove(old.get_field_index("reason")))
    sink = open_iceberg(directory)
    table = sink.table("run_transitions")
    assert "reason" in {f.name for f in table.schema().fields}
    assert set(table.schema().identifier_field_names()) == set(t.RUN_TRANSITIONS.key)


def test_old_snapshots_are_expired_and_many_files_compacted(
    tmp_path: Path, records: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ice, "KEEP_SNAPSHOTS", 3)
    monkeypatch.setattr(ice, "COMPACT_FILES", 4)
    sink = open_iceberg(tmp_path / "w")
    for m in records:
        sink.write(decode(m))
    runs = sink.table("runs")
    assert len(runs.snapshots()) <= 2 * 3 + 2  # each commit adds at most two
    snap = runs.current_snapshot()
    assert snap is not None and snap.summary is not None
    assert int(snap.summary.additional_properties["total-data-files"]) <= 4 + 1
    assert sink.count("runs") == 3

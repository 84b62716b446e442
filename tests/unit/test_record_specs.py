"""The record specs: one source for the encoders, the decoders' checks and the JSON Schemas."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from koda_runtime import cli
from koda_runtime.errors import RecordError
from koda_runtime.topics.records import formats as record_specs
from koda_runtime.topics.records.codec import (
    FinalRecord,
    RunRequested,
    chunk_value,
    dead_letter_value,
    decode_chunk_value,
    decode_final_value,
    decode_run_requested,
    event_value,
    headers_for,
)
from koda_runtime.topics.records.events import Transition, UsageEvent, decode_run_event
from koda_runtime.topics.records.heartbeats import Beat
from koda_runtime.topics.records.json_schemas import (
    DIRECTORY,
    drift,
    file_name,
    json_schema,
    render,
    write_all,
)
from koda_runtime.topics.records.specs import RecordSpec


def validator(spec: RecordSpec) -> jsonschema.Draft202012Validator:
    schema = json.loads((DIRECTORY / file_name(spec)).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_committed_json_schemas_match_the_specs() -> None:
    """Fails when a spec changed and `koda schemas write` was not run."""
    assert drift() == [], "run `koda schemas write` and commit topics/records/json/"
    assert sorted(p.name for p in DIRECTORY.glob("*.schema.json")) == sorted(
        file_name(s) for s in record_specs.ALL
    )


def test_drift_sees_a_changed_missing_or_extra_file(tmp_path: Path) -> None:
    assert sorted(drift(tmp_path)) == sorted(file_name(s) for s in record_specs.ALL)
    write_all(tmp_path)
    assert drift(tmp_path) == []
    chunk = tmp_path / file_name(record_specs.RUN_CHUNK)
    chunk.write_text(chunk.read_text().replace('"seq"', '"sequence"'))
    (tmp_path / "old.schema.json").write_text("{}")
    assert drift(tmp_path) == [file_name(record_specs.RUN_CHUNK), "old.schema.json"]
    write_all(tmp_path)
    assert drift(tmp_path) == [] and not (tmp_path / "old.schema.json").exists()


def test_schemas_write_check_exits_1_on_drift(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runner = CliRunner()
    ok = runner.invoke(cli.app, ["schemas", "write", "--check"])
    assert ok.exit_code == 0 and "match" in ok.stdout, ok.output
    bad = runner.invoke(cli.app, ["schemas", "write", "--check", "--out", str(tmp_path)])
    assert bad.exit_code == 1 and "drift:" in bad.stdout
    wrote = runner.invoke(cli.app, ["schemas", "write", "--out", str(tmp_path)])
    assert wrote.exit_code == 0 and drift(tmp_path) == [], wrote.output


def test_schemas_write_refuses_to_write_into_an_installed_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outside a source checkout the files would land in site-packages: it needs --out."""
    monkeypatch.setattr("koda_runtime.resources.checkout_root", lambda: None)
    result = CliRunner().invoke(cli.app, ["schemas", "write"])
    assert result.exit_code == 2
    assert "writes into a source checkout" in result.output, result.output


def test_the_wire_format_is_unchanged() -> None:
    """The specs name the fields; the bytes are what koda wrote before they existed."""
    assert RunRequested("r1", "u1", "s1", "").encode() == (
        b'{"run_id":"r1","user_id":"u1","session_id":"s1","created_at":""}'
    )
    assert chunk_value("r1", 3, "chunk", "h\xe9", 2) == (
        '{"run_id":"r1","seq":3,"kind":"chunk","content":"h\xe9","attempt":2}'.encode()
    )
    assert FinalRecord("r1", 4, "done", "{}", "hi", 1).encode() == (
        b'{"run_id":"r1","kind":"final","last_seq":4,"end":"done","end_content":"{}",'
        b'"content":"hi","attempt":1}'
    )
    event = json.loads(event_value("r1", "transition", to="running", attempt=1, worker_id="w"))
    assert list(event) == ["run_id", "event", "at", "to", "attempt", "worker_id"]
    beat = Beat("w-1", datetime(2025, 1, 1, tzinfo=UTC), 2, "0.1.0", (0, 5), "h").encode()
    assert beat == (
        b'{"worker_id":"w-1","beat_at":"2025-01-01T00:00:00.000+00:00","in_flight":2,'
        b'"version":"0.1.0","partitions":[0,5],"host":"h"}'
    )
    # pid and instance came later: appended, so older readers see what they always saw.
    newer = Beat("w-1", datetime(2025, 1, 1, tzinfo=UTC), 2, "0.1.0", (0, 5), "h", 7, "ab12")
    assert newer.encode() == beat[:-1] + b',"pid":7,"instance":"ab12"}'


def test_an_undeclared_field_is_a_writer_bug() -> None:
    with pytest.raises(ValueError, match="undeclared"):
        event_value("r1", "usage", call_index=0, model="m", prompt_tokens=1, tokens=2)
    with pytest.raises(ValueError, match="missing"):
        event_value("r1", "transition", to="done")


def letter() -> bytes:
    return dead_letter_value(
        key=b"u1",
        value=b"\x00raw",
        headers=headers_for("run.requested"),
        topic="dev.koda.runs",
        partition=3,
        offset=-1,
        attempts=0,
        reason="undecodable",
        error="bad",
    )


def written_records() -> list[tuple[RecordSpec, bytes]]:
    return [
        (
            record_specs.RUN_REQUESTED,
            RunRequested("r1", "u1", "s1", "2025-01-01T00:00:00+00:00").encode(),
        ),
        (record_specs.RUN_CHUNK, chunk_value("r1", 0, "reset", '{"attempt": 2}', 2)),
        (record_specs.RUN_FINAL, FinalRecord("r1", 4, "error", "{}", "", 3).encode()),
        (record_specs.RUN_EVENT, event_value("r1", "transition", to="done", attempt=1)),
        (
            record_specs.RUN_EVENT,
            event_value(
                "r1", "usage", call_index=0, model="m", prompt_tokens=1, completion_tokens=2
            ),
        ),
        (record_specs.DEAD_LETTER, letter()),
        (record_specs.HEARTBEAT, Beat("w", datetime.now(UTC), 0, "v", (), "h").encode()),
        (
            record_specs.HEARTBEAT,
            Beat("w", datetime.now(UTC), 0, "v", (), "h", 4242, "9f2c51d07a3e4b18").encode(),
        ),
    ]


def test_what_the_encoders_write_validates_against_the_json_schemas() -> None:
    for spec, value in written_records():
        errors = list(validator(spec).iter_errors(json.loads(value)))
        assert errors == [], (spec.header, [e.message for e in errors])


@pytest.mark.parametrize(
    ("spec", "value"),
    [
        (record_specs.RUN_REQUESTED, {"run_id": "", "user_id": "u", "session_id": "s"}),
        (
            record_specs.RUN_CHUNK,
            {"run_id": "r", "seq": -1, "kind": "chunk", "content": "", "attempt": 1},
        ),
        (
            record_specs.RUN_CHUNK,
            {"run_id": "r", "seq": 0, "kind": "shout", "content": "", "attempt": 1},
        ),
        (record_specs.RUN_EVENT, {"run_id": "r", "event": "usage", "at": "x", "model": "m"}),
        (record_specs.RUN_EVENT, {"run_id": "r", "event": "teleport", "at": "x"}),
        (record_specs.DEAD_LETTER, json.loads(letter()) | {"original_truncated": "no"}),
    ],
)
def test_the_json_schemas_refuse_what_koda_never_writes(spec: Any, value: dict[str, Any]) -> None:
    assert list(validator(spec).iter_errors(value)) != []


def test_the_decoders_check_with_the_specs() -> None:
    bad_chunk = b'{"run_id":"r","seq":"1","kind":"chunk","content":"","attempt":1}'
    with pytest.raises(RecordError, match="'seq' must be a non-negative integer") as exc:
        decode_chunk_value(bad_chunk)
    assert exc.value.reason == "invalid"
    long_id = json.dumps({"run_id": "r" * 201, "user_id": "u", "session_id": "s"}).encode()
    with pytest.raises(RecordError, match="non-empty string of <=200 chars"):
        decode_run_requested(b"u", long_id, None)
    # Leniency kept: created_at of any type, a final without "kind", unknown fields.
    odd = b'{"run_id":"r","user_id":"u","session_id":"s","created_at":5,"extra":1}'
    assert decode_run_requested(b"u", odd, None).created_at == "5"
    final = b'{"run_id":"r","last_seq":1,"end":"done","end_content":"","content":"x","attempt":1}'
    assert decode_final_value(final).content == "x"


def test_run_events_decode_into_their_variants() -> None:
    t = decode_run_event(event_value("r1", "transition", to="running", attempt=2, worker_id="w"))
    assert isinstance(t, Transition) and (t.to, t.attempt, t.worker_id) == ("running", 2, "w")
    assert t.at.tzinfo is not None
    u = decode_run_event(
        event_value("r1", "usage", call_index=1, model="m", prompt_tokens=3, completion_tokens=4)
    )
    assert isinstance(u, UsageEvent) and (u.call_index, u.cost_usd) == (1, None)
    priced = event_value(
        "r1", "usage", call_index=0, model="m", prompt_tokens=1, completion_tokens=1, cost_usd="0.1"
    )
    assert decode_run_event(priced).cost_usd == Decimal("0.1")  # type: ignore[union-attr]
    with pytest.raises(RecordError) as exc:
        decode_run_event(b'{"run_id":"r","event":"teleport","at":"2025-01-01T00:00:00Z"}')
    assert exc.value.reason == "unknown_event"
    with pytest.raises(RecordError, match="'at'"):
        decode_run_event(b'{"run_id":"r","event":"transition","at":"soon","to":"done","attempt":1}')


def test_a_variant_spec_renders_one_schema_per_variant() -> None:
    schema = json_schema(record_specs.RUN_EVENT)
    assert [v["properties"]["event"]["const"] for v in schema["oneOf"]] == ["transition", "usage"]
    assert render(record_specs.RUN_EVENT).endswith("}\n")
    assert schema["x-koda-topic"] == "run-events"


def test_spec_topics_are_in_the_catalogue() -> None:
    from koda_runtime.naming import AppEnv
    from koda_runtime.settings import Settings
    from koda_runtime.topics.catalogue import catalogue

    bases = {s.base for s in catalogue(Settings(app_env=AppEnv.DEV))}
    assert {s.topic for s in record_specs.ALL} <= bases

"""JSON Schema (draft 2020-12) files for every record koda writes, from the field specs.

The files live in ``topics/records/json/<record>.schema.json``; ``koda schemas write``
regenerates them and ``koda schemas write --check`` (and a unit test) fails when they
differ from what the specs say. ``x-koda-topic`` (the catalogue base name) and
``x-koda-key`` (what the record key holds) are annotations for data teams.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from koda_runtime.topics.records.formats import ALL
from koda_runtime.topics.records.specs import Field, RecordSpec

DIRECTORY = Path(__file__).resolve().parent / "json"
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def field_schema(f: Field) -> dict[str, Any]:
    """One property's schema."""
    out: dict[str, Any] = {"type": [f.type, "null"] if f.nullable else f.type}
    if f.description:
        out["description"] = f.description
    if f.const is not None:
        out["const"] = f.const
    if f.enum is not None:
        out["enum"] = list(f.enum)
    if f.format is not None:
        out["format"] = f.format
    if f.min_length is not None:
        out["minLength"] = f.min_length
    if f.max_length is not None:
        out["maxLength"] = f.max_length
    if f.minimum is not None:
        out["minimum"] = f.minimum
    if f.items is not None:
        out["items"] = dict(f.items)
    return out


def _object(fields: tuple[Field, ...]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f.name: field_schema(f) for f in fields},
        "required": [f.name for f in fields if f.required],
        # Readers ignore fields they do not know, so a writer may add optional ones.
        "additionalProperties": True,
    }


def json_schema(spec: RecordSpec) -> dict[str, Any]:
    """The JSON Schema of one record type's value."""
    head: dict[str, Any] = {
        "$schema": DIALECT,
        "$id": f"urn:koda:schema:{spec.name}:{spec.version}",
        "title": spec.header,
        "description": spec.description,
        "x-koda-topic": spec.topic,
        "x-koda-key": spec.key,
    }
    if not spec.variants:
        return head | _object(spec.fields)
    assert spec.discriminator is not None
    variants = []
    for v in spec.variants:
        body = _object(spec.fields + v.fields)
        body["properties"][spec.discriminator] = body["properties"][spec.discriminator] | {
            "const": v.value
        }
        variants.append({"title": f"{spec.header} {v.value}", "description": v.description} | body)
    return head | {"type": "object", "oneOf": variants}


def file_name(spec: RecordSpec) -> str:
    return f"{spec.name}.schema.json"


def render(spec: RecordSpec) -> str:
    """The file's text: stable key order, two-space indent, a final newline."""
    return json.dumps(json_schema(spec), indent=2, ensure_ascii=False) + "\n"


def drift(directory: Path = DIRECTORY) -> list[str]:
    """File names whose content differs from the specs (missing, stale or extra)."""
    expected = {file_name(s): render(s) for s in ALL}
    out = []
    for name, text in expected.items():
        path = directory / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            out.append(name)
    if directory.exists():
        out += sorted(p.name for p in directory.glob("*.schema.json") if p.name not in expected)
    return out


def write_all(directory: Path = DIRECTORY) -> list[Path]:
    """Write every schema file (and remove stale ones); return the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    expected = {file_name(s): render(s) for s in ALL}
    for name, text in expected.items():
        path = directory / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path)
    for stale in directory.glob("*.schema.json"):
        if stale.name not in expected:
            stale.unlink()
    return written

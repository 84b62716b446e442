"""Field specs of koda's records: the one description of every record's fields.

Three things read these specs, so they cannot disagree: the encoders in
:mod:`.codec` and :mod:`.heartbeats` take their field names from them,
the decoders check values with :meth:`RecordSpec.check`, and
:mod:`.json_schemas` renders them as the JSON Schema files in ``topics/records/json/``
(``koda schemas write``; ``tests/unit/test_record_specs.py`` fails on drift).

A spec describes what koda *writes*. Readers stay lenient where they always were: an
unknown field is ignored (forward compatible), and ``enum`` and ``format`` are
documentation for data teams, not checks a decoder applies.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from koda_runtime.errors import RecordError


@dataclass(frozen=True)
class Field:
    """One field of a record value.

    ``type`` is a JSON type (string, integer, boolean, array). ``min_length`` and
    ``max_length`` count characters; ``minimum`` bounds integers. ``checked=False``
    describes what koda writes without the decoders insisting on it (a field they
    always ignored); ``enum``, ``const`` and ``format`` are never checked by decoders.
    """

    name: str
    type: str
    description: str
    required: bool = True
    nullable: bool = False
    min_length: int | None = None
    max_length: int | None = None
    minimum: int | None = None
    enum: tuple[str, ...] | None = None
    const: str | None = None
    format: str | None = None
    items: Mapping[str, Any] | None = None
    checked: bool = True

    def check(self, obj: Mapping[str, Any]) -> None:
        """Raise RecordError("invalid", ...) when ``obj`` breaks this field's rules."""
        if not self.checked:
            return
        value = obj.get(self.name, _MISSING)
        if value is _MISSING:
            if self.required:
                raise RecordError("invalid", f"field {self.name!r} is missing")
            return
        if value is None and (self.nullable or not self.required):
            return
        # type() rather than isinstance(): True is not an integer here, as in JSON.
        if type(value) not in _PY_TYPES[self.type] or not self._within(value):
            raise RecordError("invalid", f"field {self.name!r} must be {self.rule}")

    def _within(self, value: Any) -> bool:
        if self.min_length is not None and len(value) < self.min_length:
            return False
        if self.max_length is not None and len(value) > self.max_length:
            return False
        return self.minimum is None or value >= self.minimum

    @property
    def rule(self) -> str:
        """The rule in words, for error messages."""
        if self.type == "integer" and self.minimum == 0:
            return "a non-negative integer"
        if self.type == "string" and self.min_length == 1 and self.max_length is not None:
            return f"a non-empty string of <={self.max_length} chars"
        return f"a{'n' if self.type[0] in 'aeiou' else ''} {self.type}"


_MISSING = object()
# What json.loads makes of each JSON type.
_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


@dataclass(frozen=True)
class Variant:
    """One shape of a record whose ``discriminator`` field picks the shape (run.event)."""

    value: str
    description: str
    fields: tuple[Field, ...]


@dataclass(frozen=True)
class RecordSpec:
    """One record type: its schema header, topic, key and fields.

    ``fields`` are common to every record; a spec with ``variants`` adds the fields of
    the variant named by the ``discriminator`` field.
    """

    name: str
    version: int
    description: str
    topic: str
    key: str
    fields: tuple[Field, ...]
    discriminator: str | None = None
    variants: tuple[Variant, ...] = ()

    @property
    def header(self) -> str:
        """The ``schema`` header value, e.g. ``run.chunk/1``."""
        return f"{self.name}/{self.version}"

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The common fields' names in wire order (computed once: every chunk record
        asks for them)."""
        return tuple(f.name for f in self.fields)

    def variant(self, value: str) -> Variant:
        for v in self.variants:
            if v.value == value:
                return v
        raise KeyError(f"{self.name} has no variant {value!r}")

    def all_fields(self, obj: Mapping[str, Any]) -> tuple[Field, ...]:
        """The fields that apply to ``obj``: common ones, plus its variant's if known."""
        if self.discriminator is None:
            return self.fields
        tag = obj.get(self.discriminator)
        for v in self.variants:
            if v.value == tag:
                return self.fields + v.fields
        return self.fields

    def check(self, obj: Any) -> dict[str, Any]:
        """Return ``obj`` when it is an object whose fields keep this spec's rules.

        Raises RecordError (reason ``invalid``) naming the first field that does not.
        A variant record with an unknown tag is checked on the common fields only.
        """
        if not isinstance(obj, dict):
            raise RecordError("invalid", "value is not a JSON object")
        for f in self.all_fields(obj):
            f.check(obj)
        return obj

    def value(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` as a record value, after checking its field names against the spec.

        Keeps the caller's order (the wire format). Raises ValueError for an undeclared
        or a missing required field: that is a bug in the writer, not bad input.
        """
        declared = self.all_fields(values)
        names = {f.name for f in declared}
        unknown = [k for k in values if k not in names]
        missing = [f.name for f in declared if f.required and f.name not in values]
        if unknown or missing:
            raise ValueError(f"{self.header}: undeclared {unknown} or missing {missing} fields")
        return dict(values)

"""Settings declared as dataclass fields: :func:`knob` declares one, :func:`load` reads them.

A knob is a field whose metadata holds a :class:`Knob`: its environment variable,
meaning, unit, bounds or choices; the field holds the default and its annotation the
type (``int``, ``float``, ``bool``, ``str``, each maybe ``| None``, or anything a
``parse`` function returns). :func:`load` is the one loop that reads every knob of a
dataclass from a mapping, and every refusal has one form: the variable, the bad value
(``<hidden>`` for a secret) and what is allowed. koda/settings.py declares koda's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from typing import Any, get_type_hints

from koda_runtime.errors import ConfigError

__all__ = ["KNOB", "Knob", "Parser", "check_choices", "knob", "knobs", "load", "number"]

KNOB = "koda.knob"  # the field metadata key of a knob's declaration
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# A reader for a knob whose value is not one int, float, bool or string: it raises
# ValueError for a value it cannot read.
Parser = Callable[[str], Any]


@dataclass(frozen=True)
class Knob:
    """One setting's declaration: where it is read from and what it may be.

    ``unit`` is said in docs and errors (``s``, ``ms``, ``bytes``); ``lo``/``hi`` bound a
    number (inclusive); ``choices`` list the strings accepted; ``secret`` keeps the value
    out of errors and ``repr``; ``parse`` reads a structured value, ``shape`` says in
    words what it accepts.
    """

    env: str
    doc: str
    unit: str = ""
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    secret: bool = False
    parse: Parser | None = None
    shape: str = ""

    def allowed(self, kind: type) -> str:
        """What a value may be, in words: ``an integer in 1..4096``, ``one of a, b``."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        if self.parse is not None:
            return self.shape
        if kind is bool:
            return "true or false"
        noun = {int: "an integer", float: "a number"}.get(kind, "a string")
        unit = f" ({self.unit})" if self.unit else ""
        if self.lo is None or self.hi is None:
            return noun + unit
        return f"{noun} in {number(self.lo)}..{number(self.hi)}{unit}"

    def read(self, raw: str, kind: type) -> Any:
        """``raw`` as a value of ``kind``; ConfigError naming the variable when it is not one."""
        try:
            value = self._convert(raw, kind)
        except ValueError:
            value = None
        else:
            if self._fits(value):
                return value
        raise self.refusal(raw, kind)

    def refusal(self, value: object, kind: type) -> ConfigError:
        """The one error format: the variable, the bad value (unless secret), what is allowed."""
        shown = "<hidden>" if self.secret else repr(value)
        return ConfigError(f"{self.env}={shown}: use {self.allowed(kind)}")

    def _convert(self, raw: str, kind: type) -> Any:
        if self.parse is not None:
            return self.parse(raw)
        if kind is bool:
            if raw.lower() in _TRUE + _FALSE:
                return raw.lower() in _TRUE
            raise ValueError(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        return raw

    def _fits(self, value: Any) -> bool:
        if self.choices and value not in self.choices:
            return False
        if self.lo is not None and not self.lo <= value:
            return False
        return self.hi is None or bool(value <= self.hi)


def knob(
    default: Any = MISSING,
    env: str = "",
    doc: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    unit: str = "",
    lo: float | None = None,
    hi: float | None = None,
    choices: tuple[str, ...] = (),
    secret: bool = False,
    parse: Parser | None = None,
    shape: str = "",
) -> Any:
    """A dataclass field that is a setting read from ``env`` (see :class:`Knob`).

    An unset or empty variable leaves the field's ``default`` (or ``factory()``).
    """
    spec = Knob(env, doc, unit, lo, hi, choices, secret, parse, shape)
    meta = {KNOB: spec}
    if factory is not None:
        return field(default_factory=factory, repr=not secret, metadata=meta)
    return field(default=default, repr=not secret, metadata=meta)


def number(x: float) -> str:
    """``x`` as a bound is written: ``600``, not ``600.0``; ``0.1`` stays."""
    return str(int(x)) if float(x).is_integer() else str(x)


def knobs(cls: type) -> Iterator[tuple[str, type, Knob]]:
    """``(field name, type, declaration)`` of every knob of dataclass ``cls``, in order."""
    hints = _hints(cls)
    for f in fields(cls):
        spec = f.metadata.get(KNOB)
        if spec is not None:
            yield f.name, hints[f.name], spec


@cache
def _hints(cls: type) -> dict[str, type]:
    """Field types, with ``X | None`` read as ``X`` (None is what an unset knob may be)."""
    out: dict[str, type] = {}
    for name, hint in get_type_hints(cls).items():
        args = [a for a in getattr(hint, "__args__", ()) if a is not type(None)]
        out[name] = args[0] if len(args) == 1 and type(None) in hint.__args__ else hint
    return out


def load(cls: type, env: Mapping[str, str]) -> dict[str, Any]:
    """The one loop: each knob of ``cls`` that ``env`` sets, read and checked by its
    declaration. Unset and empty variables are left out, so the field default applies."""
    values: dict[str, Any] = {}
    for name, kind, spec in knobs(cls):
        raw = env.get(spec.env)
        if raw is not None and raw != "":
            values[name] = spec.read(raw, kind)
    return values


def check_choices(obj: Any) -> None:
    """Refuse a field outside its knob's choices, however the object was built."""
    for name, kind, spec in knobs(type(obj)):
        value = getattr(obj, name)
        if spec.choices and value is not None and value not in spec.choices:
            raise spec.refusal(value, kind)

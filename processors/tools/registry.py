"""Tools users add: the ``@tool`` declaration and where a worker finds tools.

A tool is a Python function (sync or async) whose arguments are described by type
hints, or by one pydantic model parameter; the JSON Schema the model is offered is
pydantic's. A parameter annotated :class:`ToolContext` (or named ``ctx``) is not an
argument of the model's: the worker passes the run id, user id, step and idempotency
key there.

The worker reads tools at start from the ``koda.tools`` entry point group (an entry
point names a module, or one tool) and from ``KODA_TOOLS=package.module[,other]``. A
module that does not import, a bad declaration, a module without tools, or two tools
of one name stop the worker at start with an error naming the module and the tool.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from koda_runtime.errors import ConfigError, KodaError

ENTRY_POINT_GROUP = "koda.tools"
KINDS = ("read", "effect")
Kind = Literal["read", "effect"]
# What the model may call a function (OpenAI's rule for function names).
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Names the worker's own tools take.
RESERVED = frozenset({"memory_search"})
MAX_TIMEOUT_S = 3600.0
MAX_RETRIES = 10
ATTRIBUTE = "__koda_tool__"


class ToolDeclarationError(ConfigError):
    """A ``@tool`` declaration that cannot be used; the message names the tool."""


class ToolArgumentError(KodaError, ValueError):
    """The model's arguments do not fit the tool's schema; the message is the model's."""


@dataclass(frozen=True)
class ToolContext:
    """What a tool is told about the call: ``idempotency_key`` (``<run_id>:<step>``) is
    the same every time the journal calls this step again; pass it downstream.
    A read-only tool is not journaled: its ``step`` is None and its key
    ``<run_id>:a<attempt>``."""

    run_id: str
    user_id: str
    step: int | None
    idempotency_key: str
    attempt: int


@dataclass(frozen=True)
class Tool:
    """One declared tool."""

    name: str
    description: str
    kind: Kind
    timeout_s: float
    retries: int
    approval: bool
    fn: Callable[..., Any]
    arguments: type[BaseModel]  # the model's arguments, validated
    model_param: str | None  # the one pydantic-model parameter, when declared that way
    ctx_param: str | None
    origin: str = ""  # the module it came from

    @property
    def journaled(self) -> bool:
        """Side effects and calls a person approves are journaled; reads run again."""
        return self.kind == "effect" or self.approval

    def definition(self) -> dict[str, Any]:
        """The tool as the chat completions ``tools`` entry."""
        schema = self.arguments.model_json_schema()
        schema.pop("title", None)
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": schema},
        }

    def parse(self, raw: str) -> dict[str, Any]:
        """The model's JSON arguments, validated: the keyword arguments of the call.
        ToolArgumentError with what was wrong, for the model."""
        try:
            data = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError) as exc:
            raise ToolArgumentError(
                f"{self.name} arguments are not valid JSON ({type(exc).__name__}: "
                f"{str(exc)[:120]}); send one JSON object matching the tool's schema"
            ) from exc
        if not isinstance(data, dict):
            raise ToolArgumentError(f"{self.name} arguments must be a JSON object")
        try:
            model = self.arguments.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or '(arguments)'}: {e['msg']}"
                for e in exc.errors(include_url=False)[:10]
            )
            raise ToolArgumentError(f"{self.name} arguments are invalid: {problems}") from None
        if self.model_param is not None:
            return {self.model_param: model}
        return {name: getattr(model, name) for name in type(model).model_fields}


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    kind: str = "read",
    timeout_s: float = 30.0,
    retries: int = 0,
    approval: bool = False,
    description: str | None = None,
) -> Any:
    """Declare ``fn`` a tool: ``@tool`` or ``@tool(kind="effect", timeout_s=10, ...)``.

    ``kind``: ``read`` (no side effect: run again on a rerun) or ``effect`` (journaled:
    called once per step, its result replayed). ``timeout_s``: each call's limit.
    ``retries``: calls made again after a raise or a timeout (same idempotency key).
    ``approval``: the run waits for a person's approve or reject before the call.
    ``description``: what the model is told (default: the docstring).
    The function is returned unchanged, with its declaration attached.
    """

    def declare(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(
            f,
            ATTRIBUTE,
            declared(
                f,
                name=name,
                kind=kind,
                timeout_s=timeout_s,
                retries=retries,
                approval=approval,
                description=description,
            ),
        )
        return f

    return declare(fn) if fn is not None else declare


def declared(
    fn: Callable[..., Any],
    *,
    name: str | None,
    kind: str,
    timeout_s: float,
    retries: int,
    approval: bool,
    description: str | None,
) -> Tool:
    """The :class:`Tool` of ``fn``; ToolDeclarationError naming it when it cannot be one."""
    tool_name = str(name or getattr(fn, "__name__", ""))
    qualname = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    where = f"tool {tool_name!r} ({qualname})"
    if not callable(fn):
        raise ToolDeclarationError(f"{where}: @tool needs a function")
    if not NAME.match(tool_name):
        raise ToolDeclarationError(f"{where}: a tool name is 1 to 64 of A-Z a-z 0-9 _ -")
    if tool_name in RESERVED:
        raise ToolDeclarationError(f"{where}: the name {tool_name!r} is the worker's own tool")
    if kind not in KINDS:
        raise ToolDeclarationError(f"{where}: kind={kind!r} is not one of {', '.join(KINDS)}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise ToolDeclarationError(f"{where}: timeout_s must be a number of seconds")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ToolDeclarationError(
            f"{where}: timeout_s={timeout_s!r} must be above 0 and at most {MAX_TIMEOUT_S:g}"
        )
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        raise ToolDeclarationError(
            f"{where}: retries={retries!r} must be an integer from 0 to {MAX_RETRIES}"
        )
    if not isinstance(approval, bool):
        raise ToolDeclarationError(f"{where}: approval must be True or False")
    text = description if description is not None else inspect.getdoc(fn)
    if not text or not text.strip():
        raise ToolDeclarationError(
            f"{where}: a tool needs a description (a docstring or description=...): it is "
            "what the model is told the tool does"
        )
    try:
        hints = get_type_hints(fn)
    except Exception as exc:  # a hint that does not resolve
        raise ToolDeclarationError(f"{where}: its type hints do not resolve: {exc!r}") from exc
    params = list(inspect.signature(fn).parameters.values())
    ctx_param = None
    fields: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ToolDeclarationError(
                f"{where}: parameter {p.name!r} must be a plain named parameter (no *args, "
                "**kwargs or positional-only)"
            )
        hint = hints.get(p.name)
        if hint is ToolContext or (p.name == "ctx" and hint in (None, ToolContext)):
            ctx_param = p.name
            continue
        if hint is None:
            raise ToolDeclarationError(
                f"{where}: parameter {p.name!r} has no type hint (the model's schema is "
                "made from them)"
            )
        fields[p.name] = (hint, ... if p.default is p.empty else p.default)
    model_param = None
    if len(fields) == 1:
        (only, (hint, default)) = next(iter(fields.items()))
        if inspect.isclass(hint) and issubclass(hint, BaseModel) and default is ...:
            model_param = only
    try:
        if model_param is not None:
            arguments = fields[model_param][0]
        else:
            arguments = create_model(
                f"{tool_name}_arguments",
                __config__=ConfigDict(extra="forbid"),
                **fields,
            )
        arguments.model_json_schema()
    except Exception as exc:
        raise ToolDeclarationError(
            f"{where}: no JSON Schema can be made of its arguments: {exc}"
        ) from exc
    return Tool(
        name=tool_name,
        description=text.strip()[:1024],
        kind=kind,  # type: ignore[arg-type]
        timeout_s=float(timeout_s),
        retries=retries,
        approval=approval,
        fn=fn,
        arguments=arguments,
        model_param=model_param,
        ctx_param=ctx_param,
        origin=getattr(fn, "__module__", ""),
    )


def tools_of(obj: Any) -> list[Tool]:
    """The tools a module declares (in definition order), or ``obj`` itself as one."""
    own = getattr(obj, ATTRIBUTE, None)
    if isinstance(own, Tool):
        return [own]
    if isinstance(obj, ModuleType):
        return [t for v in vars(obj).values() if isinstance(t := getattr(v, ATTRIBUTE, None), Tool)]
    return []


def load_tools(modules: Iterable[str], *, group: str | None = ENTRY_POINT_GROUP) -> dict[str, Tool]:
    """Every tool of the ``group`` entry points and of ``modules``, by name.
    ConfigError naming the module (and the tool) for anything that cannot be used."""
    found: dict[str, Tool] = {}

    def add(source: str, tools: list[Tool]) -> None:
        if not tools:
            raise ConfigError(f"{source} declares no tool (no function with @tool)")
        for t in tools:
            other = found.get(t.name)
            if other is not None and other.fn is not t.fn:
                raise ConfigError(
                    f"tool {t.name!r} is declared twice: in {other.origin} and in {t.origin}"
                )
            found[t.name] = t

    eps: list[EntryPoint] = list(entry_points(group=group)) if group else []
    for ep in eps:
        source = f"entry point {ep.name!r} = {ep.value!r} (group {group!r})"
        try:
            obj = ep.load()
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from exc
        except Exception as exc:
            raise ConfigError(f"{source} does not load: {exc!r}") from exc
        add(source, tools_of(obj))
    for raw in modules:
        module = raw.strip()
        if not module:
            continue
        source = f"KODA_TOOLS module {module!r}"
        try:
            obj = importlib.import_module(module)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from exc
        except Exception as exc:
            raise ConfigError(f"{source} does not import: {exc!r}") from exc
        add(source, tools_of(obj))
    return found


def modules_setting(raw: str) -> list[str]:
    """``KODA_TOOLS``: comma-separated module names."""
    return [m.strip() for m in raw.split(",") if m.strip()]

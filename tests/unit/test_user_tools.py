"""Tools users add: declarations, schemas, argument checks and the call rules
(processors/tools/registry.py, toolbox.py). Pure code; the journal is tested against
Postgres in tests/integration/test_user_tools.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel

from koda_runtime.errors import ConfigError
from koda_runtime.lifecycle.handler import RunContext
from koda_runtime.processors.tools import (
    ToolArgumentError,
    Toolbox,
    ToolContext,
    ToolDeclarationError,
    load_tools,
    tool,
)
from koda_runtime.processors.tools.registry import ATTRIBUTE, Tool
from koda_runtime.processors.tools.toolbox import MAX_RESULT_BYTES, canonical, execute


def spec(fn: object) -> Tool:
    t = getattr(fn, ATTRIBUTE)
    assert isinstance(t, Tool)
    return t


def test_type_hints_make_the_schema_and_ctx_is_not_an_argument() -> None:
    @tool(kind="effect", timeout_s=5, retries=2)
    def book(item: str, seats: int = 2, *, ctx: ToolContext) -> str:
        """Book seats."""
        return item

    t = spec(book)
    d = t.definition()["function"]
    assert d["name"] == "book" and d["description"] == "Book seats."
    assert d["parameters"]["required"] == ["item"]
    assert set(d["parameters"]["properties"]) == {"item", "seats"}
    assert d["parameters"]["additionalProperties"] is False
    assert (t.kind, t.timeout_s, t.retries, t.ctx_param, t.journaled) == (
        "effect", 5.0, 2, "ctx", True,
    )  # fmt: skip
    assert t.parse('{"item": "x"}') == {"item": "x", "seats": 2}


class Args(BaseModel):
    city: str
    days: int = 1


def test_a_pydantic_model_parameter_is_the_schema() -> None:
    @tool
    def weather(args: Args) -> str:
        """Weather."""
        return args.city

    t = spec(weather)
    assert t.definition()["function"]["parameters"]["required"] == ["city"]
    parsed = t.parse('{"city": "Porto"}')
    assert isinstance(parsed["args"], Args) and parsed["args"].city == "Porto"
    assert not t.journaled  # read-only


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("{not json", "are not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"item": 3}', "item: Input should be a valid string"),
        ('{"item": "x", "seats": "many"}', "seats: Input should be a valid integer"),
        ('{"item": "x", "user_id": "vic"}', "user_id: Extra inputs are not permitted"),
        ("{}", "item: Field required"),
    ],
)
def test_arguments_that_do_not_fit_say_what_was_wrong(raw: str, says: str) -> None:
    @tool
    def book(item: str, seats: int = 1) -> str:
        """Book."""
        return item

    with pytest.raises(ToolArgumentError, match=says):
        spec(book).parse(raw)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"kind": "write"}, "kind='write' is not one of read, effect"),
        ({"timeout_s": 0}, "timeout_s=0 must be above 0"),
        ({"retries": -1}, "retries=-1 must be an integer from 0 to 10"),
        ({"name": "memory_search"}, "is the worker's own tool"),
        ({"name": "has space"}, "a tool name is 1 to 64 of"),
    ],
)
def test_a_bad_declaration_names_the_tool(kwargs: dict[str, Any], says: str) -> None:
    def fn(note: str) -> str:
        """Doc."""
        return note

    with pytest.raises(ToolDeclarationError, match=says) as caught:
        tool(**kwargs)(fn)
    assert "tool '" in str(caught.value)


def test_missing_hints_or_docstring_are_refused() -> None:
    def untyped(note):  # noqa: ANN001, ANN202
        """Doc."""

    with pytest.raises(ToolDeclarationError, match="parameter 'note' has no type hint"):
        tool(untyped)

    def undocumented(note: str) -> str:
        return note

    with pytest.raises(ToolDeclarationError, match="needs a description"):
        tool(undocumented)


def test_loading_names_the_module_that_fails() -> None:
    with pytest.raises(ConfigError, match="KODA_TOOLS module 'no_such_module_x' does not import"):
        load_tools(["no_such_module_x"], group=None)
    with pytest.raises(
        ConfigError, match=r"tests\.fixtures\.bad_tools.*tool 'erase'.*kind='write'"
    ):
        load_tools(["tests.fixtures.bad_tools"], group=None)
    with pytest.raises(ConfigError, match="'json' declares no tool"):
        load_tools(["json"], group=None)
    tools = load_tools(["tests.fixtures.tools", " "], group=None)
    assert sorted(tools) == ["book", "broken", "odd", "stuck", "transfer", "weather"]


def context() -> ToolContext:
    return ToolContext("r1", "u1", 1, "r1:1", 1)


def test_a_call_that_raises_hangs_or_returns_no_json_is_an_error_result() -> None:
    tools = load_tools(["tests.fixtures.tools"], group=None)
    broken = asyncio.run(execute(tools["broken"], {"note": "n"}, context()))
    assert broken == "error: tool 'broken' failed: RuntimeError: the backend is down (n)"
    stuck = asyncio.run(execute(tools["stuck"], {"note": "n"}, context()))
    assert stuck == "error: tool 'stuck' did not answer within 0.3 s"
    odd = asyncio.run(execute(tools["odd"], {"note": "n"}, context()))
    assert odd.startswith("error: tool 'odd' returned a value that is not JSON (dict)")


def test_retries_call_again_with_the_same_key_and_big_results_are_refused() -> None:
    keys: list[str] = []

    @tool(retries=2)
    def flaky(note: str, ctx: ToolContext) -> dict[str, str]:
        """Fails twice."""
        keys.append(ctx.idempotency_key)
        if len(keys) < 3:
            raise ConnectionError("reset")
        return {"ok": note}

    assert asyncio.run(execute(spec(flaky), {"note": "n"}, context())) == '{"ok": "n"}'
    assert keys == ["r1:1"] * 3

    @tool(retries=1)
    def always(note: str) -> str:
        """Always fails."""
        raise ValueError("no")

    out = asyncio.run(execute(spec(always), {"note": "n"}, context()))
    assert out == "error: tool 'always' failed: ValueError: no (tried 2 times)"

    @tool
    def huge(note: str) -> str:
        """Too much."""
        return "x" * (MAX_RESULT_BYTES + 1)

    out = asyncio.run(execute(spec(huge), {"note": "n"}, context()))
    assert out.startswith(f"error: tool 'huge' returned {MAX_RESULT_BYTES + 1} bytes")


def test_without_a_journal_effects_run_and_bad_arguments_never_call() -> None:
    calls: list[int | None] = []

    @tool(kind="effect")
    def send(to: str, ctx: ToolContext) -> str:
        """Send."""
        calls.append(ctx.step)
        return "sent"

    box = Toolbox({"send": spec(send)})
    steps = box.attempt(RunContext("r1", "u1", {}, 1))
    bad = asyncio.run(steps.call("send", '{"to": 1}'))
    assert bad.result.startswith("error: send arguments are invalid: to:") and calls == []
    assert asyncio.run(steps.call("send", '{"to": "a"}')).result == "sent"
    assert calls == [None]


def test_arguments_compare_as_canonical_json() -> None:
    assert canonical('{"b": 1, "a": [1, 2]}') == canonical('{ "a": [1,2], "b": 1 }')
    assert json.loads(canonical("")) == {}

"""The openai handler against a local HTTP server speaking the streaming wire format."""

from __future__ import annotations

import pytest

from koda_runtime.errors import HandlerError
from koda_runtime.lifecycle.handler import RunContext, Usage
from koda_runtime.processors.handlers.openai import OpenAIHandler
from koda_runtime.processors.handlers.provider import CallPolicy
from tests.fixtures.model_server import PIECES, FakeCompletions


async def collect(handler: OpenAIHandler, inp: dict) -> list:
    ctx = RunContext("r1", "u1", inp, 1)
    return [item async for item in handler.stream(ctx)]


async def test_streams_chunks_and_usage(fake_completions: str) -> None:
    handler = OpenAIHandler(base_url=fake_completions, api_key="sk-test", model="m-1")
    items = await collect(handler, {"text": "hi"})
    await handler.aclose()
    assert [i for i in items if isinstance(i, str)] == PIECES
    assert [i for i in items if isinstance(i, Usage)] == [Usage("m-1", 7, 5)]
    request = FakeCompletions.seen[-1]
    assert request["auth"] == "Bearer sk-test"
    assert request["body"]["stream"] is True
    assert request["body"]["messages"] == [{"role": "user", "content": "hi"}]


# Retries of 5xx and connection errors end within half a second here
# (tests/integration/test_model_faults.py has the defaults and the other faults).
QUICK = CallPolicy(window_s=0.5, base_s=0.05, cap_s=0.1)


async def test_an_error_status_is_a_handler_error(fake_completions: str) -> None:
    handler = OpenAIHandler(
        base_url=fake_completions, api_key=None, model="broken", call_policy=QUICK
    )
    with pytest.raises(HandlerError, match="still failing after .* server_error: 500: boom"):
        await collect(handler, {"text": "hi"})
    await handler.aclose()


async def test_an_unreachable_endpoint_is_a_handler_error() -> None:
    handler = OpenAIHandler(
        base_url="http://127.0.0.1:9", api_key=None, model="m", call_policy=QUICK
    )
    with pytest.raises(HandlerError, match="model endpoint still failing .* connection_error"):
        await collect(handler, {"text": "hi"})
    await handler.aclose()


@pytest.mark.parametrize("model", ["cut", "cut-clean"])
async def test_a_stream_cut_before_usage_is_billed_estimated_then_fails(
    fake_completions: str, model: str
) -> None:
    """The LiteLLM failure mode: a stream that never reaches its usage chunk must not be
    free. The handler counts what it streamed, says it is an estimate, then fails."""
    handler = OpenAIHandler(base_url=fake_completions, api_key=None, model=model)
    ctx = RunContext("r1", "u1", {"text": "count me please"}, 1)
    items: list = []
    with pytest.raises(HandlerError, match="stopped mid-answer"):
        async for item in handler.stream(ctx):
            items.append(item)
    await handler.aclose()
    assert [i for i in items if isinstance(i, str)] == PIECES[:3]
    # 15 characters of prompt at ~4 per token; one completion token per piece streamed.
    assert items[-1] == Usage(model, 4, 3, estimated=True)

"""The streaming phase of koda_run_phase_seconds: a model call's first token to the end
of its stream, observed by the openai handler for calls that complete, against the local
server speaking the OpenAI wire format (tests/fixtures/model_server.py)."""

from __future__ import annotations

import pytest

from koda_runtime import metrics
from koda_runtime.errors import HandlerError
from koda_runtime.lifecycle.handler import RunContext
from koda_runtime.processors.handlers.openai import OpenAIHandler


def streaming() -> float:
    value = metrics.REGISTRY.get_sample_value(
        "koda_run_phase_seconds_count", {"phase": "streaming"}
    )
    return value or 0.0


async def test_a_completed_call_observes_its_streaming_phase(fake_completions: str) -> None:
    handler = OpenAIHandler(base_url=fake_completions, api_key=None, model="m-1")
    before = streaming()
    items = [item async for item in handler.stream(RunContext("r1", "u1", {"text": "hi"}, 1))]
    await handler.aclose()
    assert any(isinstance(i, str) for i in items)
    assert streaming() == before + 1


async def test_a_call_cut_mid_answer_observes_no_streaming_phase(fake_completions: str) -> None:
    handler = OpenAIHandler(base_url=fake_completions, api_key=None, model="cut")
    before = streaming()
    with pytest.raises(HandlerError, match="stopped mid-answer"):
        async for _ in handler.stream(RunContext("r1", "u1", {"text": "hi"}, 1)):
            pass
    await handler.aclose()
    assert streaming() == before

"""koda_run_phase_seconds: the claim and finish phases end where the group writer answers
a run (processors/groupcommit.py). The streaming phase, observed by the openai handler
against a real wire-format server, is in tests/integration/test_run_phases.py."""

from __future__ import annotations

from collections.abc import Sequence

from koda_runtime import metrics
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.runs.worker import ClaimWrite, FinishWrite, GroupResult, GroupWrite

FENCE = Fence("runs", 0, 1)


class FencedOutStore:
    """Answers every part of every group "fenced out" (None), after seeing it."""

    def __init__(self) -> None:
        self.seen: list[GroupWrite] = []

    async def write_group(self, writes: Sequence[GroupWrite]) -> list[GroupResult]:
        self.seen += writes
        return [None for _ in writes]


def count(phase: str) -> float:
    value = metrics.REGISTRY.get_sample_value("koda_run_phase_seconds_count", {"phase": phase})
    return value or 0.0


async def test_a_claim_and_a_finish_each_observe_their_phase_once() -> None:
    store = FencedOutStore()
    writer = GroupWriter(store)
    claims, finishes = count("claim"), count("finish")
    assert await writer.claim(ClaimWrite(FENCE, "r1", "w1")) is None
    assert (count("claim"), count("finish")) == (claims + 1, finishes)
    assert await writer.finish(FinishWrite(FENCE, "r1", RunStatus.DONE, ())) is None
    assert (count("claim"), count("finish")) == (claims + 1, finishes + 1)
    assert len(store.seen) == 2
    await writer.close()

"""The rules of a run's attempts: when a claim may start, when to give up, what a
failure leads to, when output is a run's first, and how a run's output ends.

Pure decisions; the worker's executor (processors/runner.py) does the I/O they ask
for. The retry budget counts handler failures only: resuming after a handoff or a dead
worker is not the run's fault. Claims have a larger bound of their own, so a run that
takes its worker down every time cannot circulate for ever.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass

from koda_runtime.lifecycle.chunks import END_KIND, Chunk, ChunkKind
from koda_runtime.lifecycle.retry import RetryPolicy
from koda_runtime.lifecycle.states import RunStatus

# A run may be claimed at most max_attempts x this many times (handler failures,
# resumptions and merged reruns together) before it is given up.
MAX_CLAIMS_PER_ATTEMPT = 3


def claim_bound(max_attempts: int) -> int:
    """How many claims a run may have: more, and the claim gives it up."""
    return max_attempts * MAX_CLAIMS_PER_ATTEMPT


# The longest error text an ``error`` event carries, and the longest kept on the run.
ERROR_EVENT_CHARS = 500
ERROR_ROW_CHARS = 2000


@dataclass(frozen=True)
class Start:
    """The claimed attempt runs. ``reset``: earlier output exists, so the attempt's first
    event is ``reset``; ``flush_reset``: it is written at once (a merged rerun's viewers
    drop the answer to the old input now, not with the first token, which can take
    seconds)."""

    reset: bool
    flush_reset: bool


@dataclass(frozen=True)
class Retry:
    """Try again after ``backoff_s`` seconds; the output written so far stays."""

    backoff_s: float


@dataclass(frozen=True)
class GiveUp:
    """End the run ``failed`` after ``attempts`` attempts, dead-lettering its record
    unless the handler said the run cannot succeed (``dead_letter`` False: the record
    is not poison, replaying it would fail the same way, e.g. a provider's 401)."""

    attempts: int
    error: str
    dead_letter: bool = True


def after_claim(
    attempt: int, failures: int, *, had_output: bool, rerun: bool, policy: RetryPolicy
) -> Start | GiveUp:
    """What a claim that made attempt ``attempt`` (1-based) leads to, given the handler
    ``failures`` of earlier attempts and whether the run has output already."""
    if policy.exhausted(failures):
        return GiveUp(attempt - 1, "attempts exhausted")
    if attempt > claim_bound(policy.max_attempts):
        return GiveUp(
            attempt - 1,
            f"claimed {attempt - 1} times without finishing (cut off or its worker died)",
        )
    return Start(reset=had_output, flush_reset=had_output and rerun)


def after_failure(
    attempt: int,
    failures: int,
    error: str,
    *,
    final: bool,
    policy: RetryPolicy,
    rng: random.Random | None = None,
) -> Retry | GiveUp:
    """What a handler failure of attempt ``attempt`` leads to, ``failures`` counting it.
    ``final``: the handler said trying again cannot help (``RunFailed``)."""
    if final:
        return GiveUp(attempt, error, dead_letter=False)
    if policy.exhausted(failures):
        return GiveUp(attempt, error)
    return Retry(policy.backoff_s(failures, rng))


def first_output(streaming: bool, chunks: Iterable[Chunk]) -> bool:
    """Whether writing ``chunks`` shows the run's first output (``→ streaming``): the
    run is not streaming yet and a ``chunk`` is among them (a reset or a tool event is
    not output)."""
    return not streaming and any(c.kind is ChunkKind.CHUNK for c in chunks)


def end_event(
    status: RunStatus, *, reason: str | None = None, error: str = "", attempts: int = 0
) -> tuple[ChunkKind, str]:
    """The kind and content of the event that ends a run's output in ``status``: ``done``;
    ``cancelled`` with the reason; ``error`` with the error and the attempts made."""
    kind = END_KIND.get(status)
    if kind is None:
        raise ValueError(f"{status.value} is not a terminal status: no event ends it")
    content: dict[str, object]
    if status is RunStatus.DONE:
        content = {"status": "done"}
    elif status is RunStatus.CANCELLED:
        content = {"status": "cancelled", "reason": reason}
    else:
        content = {"error": error[:ERROR_EVENT_CHARS], "attempts": attempts}
    return kind, json.dumps(content)

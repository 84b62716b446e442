"""The run state machine of docs/design.md §4.

    pending → running → streaming → done
    failed and cancelled are reachable from any non-terminal state.
    running/streaming → waiting → running (a tool call waits for a person's approval)

``waiting`` (processors/tools/, docs/decisions/0022-tools-journal-and-waiting.md): the
model called a tool
declared ``approval=True``; the attempt ended and the run holds no worker slot until
its approve or reject is recorded (or ``KODA_APPROVAL_TIMEOUT_S`` passes, or a cancel
is requested). It is left by a fenced claim (``→ running``, ``attempt + 1``) of the
worker holding its partition, or ends ``cancelled``/``failed``. It is open: the user's
later runs wait for it.

``running`` is also re-entered from ``running``/``streaming`` by a *claim* with
``attempt + 1``: that is a retry in place or a successor resuming a run whose
owner was lost. The claim is fenced (see schemas/runs/worker.py), so only the
partition's current owner can take that edge.
"""

from __future__ import annotations

from enum import Enum


class RunStatus(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    STREAMING = "streaming"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    WAITING = "waiting"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


# A run in a terminal status has ended: no edge leaves it.
TERMINAL = frozenset({RunStatus.DONE, RunStatus.FAILED, RunStatus.CANCELLED})
# Claimed and owned by a worker (its fence is the claimer's epoch).
ACTIVE = frozenset({RunStatus.RUNNING, RunStatus.STREAMING})
# Not ended yet: the user's later runs wait for it.
OPEN = frozenset(RunStatus) - TERMINAL

ALLOWED: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.PENDING: frozenset({RunStatus.RUNNING, RunStatus.FAILED, RunStatus.CANCELLED}),
    RunStatus.RUNNING: frozenset(
        {
            RunStatus.RUNNING,
            RunStatus.STREAMING,
            RunStatus.DONE,
            RunStatus.FAILED,
            RunStatus.CANCELLED,
            RunStatus.WAITING,
        }
    ),
    RunStatus.STREAMING: frozenset(
        {
            RunStatus.RUNNING,
            RunStatus.DONE,
            RunStatus.FAILED,
            RunStatus.CANCELLED,
            RunStatus.WAITING,
        }
    ),
    RunStatus.WAITING: frozenset({RunStatus.RUNNING, RunStatus.FAILED, RunStatus.CANCELLED}),
    RunStatus.DONE: frozenset(),
    RunStatus.FAILED: frozenset(),
    RunStatus.CANCELLED: frozenset(),
}


def can_transition(current: RunStatus, target: RunStatus) -> bool:
    """Whether the state machine has an edge ``current → target``."""
    return target in ALLOWED[current]


def sources_of(target: RunStatus) -> frozenset[RunStatus]:
    """Every status from which ``target`` may be entered."""
    return frozenset(s for s in RunStatus if can_transition(s, target))


def edge(source: RunStatus, target: RunStatus) -> tuple[RunStatus, RunStatus]:
    """The edge ``source → target``; ValueError when the state machine has none (a status
    write given its statuses by this function cannot take a step the machine forbids)."""
    if not can_transition(source, target):
        raise ValueError(f"the run state machine has no edge {source.value} → {target.value}")
    return source, target

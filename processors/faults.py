"""Fault points that only tests switch on (``KODA_TEST_FAULT``; prod refuses it).

A test needs some faults at an exact point of the worker's path, which no signal sent
from outside can hit reliably. The one here is the window between a Postgres commit
and the produce that follows it:

    kill-after-chunks-commit   SIGKILL right after a group transaction that wrote a
                               streaming chunk batch commits, before anything of it
                               is produced to the chunk topic
    kill-after-finish-commit   the same after a group that wrote a run's finish (its
                               last chunks and the terminal transition)
    fail-before-claim          the records of users whose id begins with ``fault-``
                               fail before their run is claimed, as a lost database
                               connection would (the others run as usual)

The kill faults end the process as a crashed host's would: no handler, no drain, no
commit.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence

from koda_runtime.schemas.runs.worker import ChunkWrite, FinishWrite, GroupWrite

log = logging.getLogger("koda.worker")


def after_commit(fault: str | None, writes: Sequence[GroupWrite]) -> None:
    """Kill this process if ``fault`` names a point that the committed ``writes`` reach."""
    if fault is None:
        return
    hit = (
        fault == "kill-after-chunks-commit" and any(isinstance(w, ChunkWrite) for w in writes)
    ) or (fault == "kill-after-finish-commit" and any(isinstance(w, FinishWrite) for w in writes))
    if hit:
        runs = ",".join(w.run_id for w in writes)
        log.warning("test fault %s: SIGKILL after the commit of runs=%s", fault, runs)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)


FAULT_USER_PREFIX = "fault-"


def before_claim(fault: str | None, user_id: str) -> None:
    """Fail like a lost database connection if ``fault`` is ``fail-before-claim`` and
    ``user_id`` begins with :data:`FAULT_USER_PREFIX`."""
    if fault == "fail-before-claim" and user_id.startswith(FAULT_USER_PREFIX):
        raise ConnectionResetError(
            "test fault fail-before-claim: the connection to the database was lost"
        )

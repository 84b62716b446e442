"""CPython's cyclic garbage collector held back while a replay runs.

A replay reads records faster than anything else koda does, and each one it reads
allocates containers (confluent-kafka builds a list and a tuple per header on the
first ``headers()`` call) while a poll's records stay alive for the whole poll. With
the default thresholds (a young collection every 700 net allocations) those records
are promoted, and the full collections that follow walk every object the process
holds: at a replay's start that is some 125,000 (SQLAlchemy, DuckDB, PyArrow, the
CLI). Measured on 200,000 chunk records: 1,071 collections took 0.91 s of a 4.1 s
replay, 22 % of it.

While :func:`held_back` is entered:

* every object alive at its start is frozen (``gc.freeze``), so no collection walks
  the imported modules again: none of them is garbage;
* the young generation's threshold rises to :data:`YOUNG_THRESHOLD` net allocations,
  more than a poll's worth, so a collection runs only when objects really pile up
  (a reference cycle a poll left behind is still collected, later). A record is at
  least three tracked containers (the message, its header list, a tuple per header),
  so a 20,000-record poll is 60,000 or more: at 50,000 a young collection still ran
  inside every poll and walked its records (7.7 % of a replay's samples).

Both are put back when the outermost ``held_back`` exits, however it exits. A host
that froze objects itself before (a pre-forking server does) keeps them frozen: the
freeze here is taken, and undone, only when nothing was frozen at entry.

Failure mode: a process left with its collector changed after a replay (thresholds
not restored, objects left frozen), or a nested replay restoring it under an outer
one still running. tests/unit/test_replay_quiet_gc.py provokes both.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 500_000

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, int, int] = (700, 10, 10)
_froze = False


@contextmanager
def held_back() -> Iterator[None]:
    """The collector held back (see the module docstring) for the ``with`` body."""
    global _depth, _saved, _froze
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            _froze = gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
            gc.set_threshold(max(YOUNG_THRESHOLD, _saved[0]), *_saved[1:])
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_saved)
                if _froze:
                    gc.unfreeze()

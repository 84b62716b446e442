"""Stopping a long command politely: the first SIGINT or SIGTERM asks it to stop.

``with stop_on_signals() as stop:`` gives a ``threading.Event`` that is set by the first
signal; the command finishes what it holds (a replay writes and commits its batch)
and returns. A second signal raises ``KeyboardInterrupt`` at once. The previous
handlers come back on exit.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    if threading.current_thread() is not threading.main_thread():
        yield stop  # signal handlers can only be set from the main thread
        return
    previous = {sig: signal.signal(sig, on_signal) for sig in _SIGNALS}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

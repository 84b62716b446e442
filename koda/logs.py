"""Structured ``key=value`` logs on stderr; tokens and prompts are never logged."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s pid=%(process)d msg=%(message)s"


def configure_logging(level: int = logging.INFO) -> None:
    """Install one stderr handler on the root logger (idempotent)."""
    root = logging.getLogger()
    if any(getattr(h, "_koda", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler._koda = True  # type: ignore[attr-defined]
    handler.addFilter(RepeatFilter(("aiokafka", "kafka")))
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("aiokafka", "faust", "mode", "kafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class RepeatFilter(logging.Filter):
    """Lets one line per message template through every ``window_s`` seconds (default
    10) for the loggers under ``prefixes``; the next line that passes says how many
    were held back.

    Kafka clients log every reconnect attempt of a broker that is down, about ten
    lines a second per worker for as long as it is away; one line per ten seconds
    says the same and keeps the rest of the log readable.
    """

    def __init__(
        self,
        prefixes: tuple[str, ...],
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._prefixes = prefixes
        self._window_s = window_s
        self._clock = clock
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self._prefixes):
            return True
        key = (record.name, str(record.msg))
        now = self._clock()
        last = self._seen.get(key)
        if last is not None and now - last[0] < self._window_s:
            self._seen[key] = (last[0], last[1] + 1)
            return False
        held = last[1] if last is not None else 0
        self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.getMessage()} ({held} similar lines held back)"
            record.args = None
        if len(self._seen) > 1000:  # templates are few; bound it all the same
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self._window_s}
        return True

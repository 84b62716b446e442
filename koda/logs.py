"""Structured logs on stderr: ``key=value`` text, or one JSON object per line
(``KODA_LOG_FORMAT=json``); tokens and prompts are never logged.

A line written inside a recording span carries its ``trace_id`` and ``span_id``
(koda/tracing.py), so a trace's lines are found by its id in either format.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from koda_runtime import tracing

if TYPE_CHECKING:
    from koda_runtime.settings import Settings

FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s pid=%(process)d msg=%(message)s"
FORMATS = ("text", "json")


class TextFormatter(logging.Formatter):
    """:data:`FORMAT`, then `` trace_id=... span_id=...`` inside a recording span."""

    def __init__(self) -> None:
        super().__init__(FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = getattr(record, "trace_ids", None)
        if ids is None:
            return line
        head, sep, tail = line.partition("\n")  # keep a traceback below the line
        return f"{head} trace_id={ids[0]} span_id={ids[1]}{sep}{tail}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, pid, msg (the ``event=...`` pairs as
    written), trace_id and span_id inside a span, exc with a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        ids = getattr(record, "trace_ids", None)
        if ids is not None:
            line["trace_id"], line["span_id"] = ids
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        return json.dumps(line, ensure_ascii=False, default=str)


class TraceIds(logging.Filter):
    """Puts the current span's ``(trace_id, span_id)`` on each record (``trace_ids``);
    costs one module flag read while tracing is off."""

    def filter(self, record: logging.LogRecord) -> bool:
        if tracing.ON:
            record.trace_ids = tracing.current_ids()
        return True


def formatter_for(fmt: str) -> logging.Formatter:
    """The formatter of KODA_LOG_FORMAT ``fmt`` (``text`` or ``json``)."""
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return TextFormatter()
    raise ValueError(f"KODA_LOG_FORMAT={fmt!r}: use one of {', '.join(FORMATS)}")


def configure_logging(level: int = logging.INFO, fmt: str | None = None) -> None:
    """Install one stderr handler on the root logger (idempotent); ``fmt`` (``text``
    when None on the first call) sets its format, None later keeps the one it has."""
    root = logging.getLogger()
    for h in root.handlers:
        if getattr(h, "_koda", False):
            if fmt is not None:
                h.setFormatter(formatter_for(fmt))
            return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter_for(fmt or "text"))
    handler._koda = True  # type: ignore[attr-defined]
    handler.addFilter(TraceIds())
    # A trace receiver that is down makes the exporter log every retry: held back too.
    handler.addFilter(RepeatFilter(("aiokafka", "kafka", "opentelemetry")))
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


def observe(settings: Settings, role: str) -> None:
    """A long-running process's logs and traces as ``settings`` say: the log format
    (KODA_LOG_FORMAT) and OpenTelemetry (koda/tracing.py; nothing when no endpoint)."""
    configure_logging(fmt=settings.log_format)
    tracing.setup(settings, role)

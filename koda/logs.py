"""Structured ``key=value`` logs on stderr; tokens and prompts are never logged."""

from __future__ import annotations

import logging
import sys

FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s pid=%(process)d msg=%(message)s"


def configure_logging(level: int = logging.INFO) -> None:
    """Install one stderr handler on the root logger (idempotent)."""
    root = logging.getLogger()
    if any(getattr(h, "_koda", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler._koda = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("aiokafka", "faust", "mode", "kafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

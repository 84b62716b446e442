"""The statement that marks a finished run for memory distillation.

Sent by the worker's group write (processors/store.py) after the finishes' transition,
in the same transaction: only a run that is now ``done`` gets a marker, so a finish the
transaction rolls back leaves none. processors/memory/distiller.py takes them.
"""

from __future__ import annotations

from sqlalchemy import text

MARK_DISTIL = text(
    "INSERT INTO memory_distillations (run_id, user_id)"
    " SELECT id, user_id FROM runs WHERE id = ANY(:ids) AND status = 'done'"
    " ON CONFLICT (run_id) DO NOTHING"
)

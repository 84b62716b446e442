"""The per-user caps in the domain's terms: :class:`CapReached` and the settings' names.

In the core, apart from gateway/quotas.py (the HTTP answers, which need the web
framework): the Postgres stores (schemas/) raise CapReached at a cap they check under a
lock, and the scheduler loads no server module.
"""

from __future__ import annotations

from koda_runtime.errors import Refused

SCHEDULES = "KODA_MAX_SCHEDULES_PER_USER"
STREAMS_PER_USER = "KODA_SSE_MAX_STREAMS_PER_USER"
STREAMS = "KODA_SSE_MAX_STREAMS"
MERGES = "KODA_MAX_MERGES_PER_RUN"
MERGED_BYTES = "KODA_MAX_MERGED_INPUT_BYTES"
BODY_READ = "KODA_BODY_READ_TIMEOUT"


class CapReached(Refused):
    """A request refused at a cap: ``quota`` (the metric label), the ``setting`` that
    sets it, its value ``cap`` and the user's ``count`` now. Nothing was written."""

    def __init__(self, quota: str, setting: str, cap: int, count: int, message: str) -> None:
        super().__init__(message)
        self.quota = quota
        self.setting = setting
        self.cap = cap
        self.count = count
        self.message = message

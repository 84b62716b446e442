"""One asyncio task that runs beside a service until the service stops it.

The worker's heartbeat, loop probe and lag sampler each run one loop in the
background beside the Faust app. :class:`BackgroundTask` is their start and stop:
``start`` creates the task (again, if the last one ended), ``stop`` cancels it and
waits until it has unwound, so a stopped service leaves no task behind. A loop that
died of an exception before ``stop`` is logged there, never raised: stopping a
service must not fail its shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class BackgroundTask:
    """Runs ``run()`` as a task named ``name`` between :meth:`start` and :meth:`stop`."""

    def __init__(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._run = run
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Create the task in the running loop; a no-op while it is still running."""
        if not self.running:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Cancel the task and wait until it has finished (no-op when not started)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            owner = asyncio.current_task()
            if owner is not None and owner.cancelling():
                raise  # our caller is being cancelled, not only the task
        except Exception:  # noqa: BLE001 - see the module docstring
            log.exception("event=background_task_failed task=%s", self.name)

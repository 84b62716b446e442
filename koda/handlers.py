"""The handler API: what a job implements to run on koda's workers.

A handler is an object with a ``name``, an async generator ``stream(ctx)`` and
``aclose()`` (:class:`Handler`). For each attempt of a run the worker calls
``stream`` with a :class:`RunContext` and writes what it yields, in order:

* ``str``: a chunk of the answer, streamed to viewers and stored;
* :class:`Usage`: one model or embedding call's token counts, for the cost ledger;
* :class:`ToolActivity`: a ``tool`` chunk (a tool call or its result), for viewers;
* :class:`Status`: a ``status`` chunk (e.g. the model a fallback switched to).

Raising retries the attempt (up to ``KODA_MAX_ATTEMPTS``); raising :class:`RunFailed`
ends the run ``failed`` at once. Between steps a handler checks
``ctx.cancel.cancelled`` (a :class:`CancelToken`) and returns early when it is set: a
user's cancel, a merged message that makes the worker start over, or the handoff
ceiling; the worker also cancels the task then.

Plugging in a handler: publish a factory in the :data:`ENTRY_POINT_GROUP` entry point
group of your distribution and name it in ``KODA_HANDLER``::

    # pyproject.toml of your package
    [project.entry-points."koda_runtime.handlers"]
    echo = "my_package.echo:build"

    # my_package/echo.py
    def build(settings: Settings) -> Handler:
        return EchoHandler()

The worker looks ``KODA_HANDLER`` up among the built-in handlers (``demo``,
``openai``) first, then among the installed entry points, calls the factory once at
start with the worker's :class:`~koda_runtime.settings.Settings`, and refuses to start, naming
the known handlers, when the name is neither.
"""

from __future__ import annotations

from collections.abc import Callable

from koda_runtime.lifecycle.handler import (
    CancelToken,
    Handler,
    Item,
    RunContext,
    RunFailed,
    Status,
    ToolActivity,
    Usage,
)
from koda_runtime.lifecycle.turns import Turn
from koda_runtime.settings import Settings

__all__ = [
    "ENTRY_POINT_GROUP",
    "CancelToken",
    "Handler",
    "HandlerFactory",
    "Item",
    "RunContext",
    "RunFailed",
    "Status",
    "ToolActivity",
    "Turn",
    "Usage",
]

ENTRY_POINT_GROUP = "koda_runtime.handlers"
# What an entry point in ENTRY_POINT_GROUP names: called once per worker process.
HandlerFactory = Callable[[Settings], Handler]

"""Tools users add (docs/decisions/0022-tools-journal-and-waiting.md; docs/memory-and-tools.md).

    from koda_runtime.processors.tools import ToolContext, tool

    @tool(kind="effect", timeout_s=10, retries=2)
    async def book_table(restaurant: str, seats: int, ctx: ToolContext) -> dict:
        \"\"\"Book a table; returns the booking.\"\"\"
        ...  # pass ctx.idempotency_key to the booking service

Found through the ``koda.tools`` entry point group or ``KODA_TOOLS=package.module``.
"""

from __future__ import annotations

from typing import Any

from koda_runtime.processors.tools.registry import (
    ENTRY_POINT_GROUP,
    Tool,
    ToolArgumentError,
    ToolContext,
    ToolDeclarationError,
    load_tools,
    modules_setting,
    tool,
)
from koda_runtime.processors.tools.toolbox import AwaitingApproval, Steps, Toolbox, ToolOutcome
from koda_runtime.settings import Settings

__all__ = [
    "ENTRY_POINT_GROUP",
    "AwaitingApproval",
    "Steps",
    "Tool",
    "ToolArgumentError",
    "ToolContext",
    "ToolDeclarationError",
    "ToolOutcome",
    "Toolbox",
    "build_toolbox",
    "load_tools",
    "modules_setting",
    "tool",
]


def build_toolbox(settings: Settings, store: Any = None) -> Toolbox:
    """The worker's toolbox: the tools of ``KODA_TOOLS`` and the entry points, journaled
    in the database of ``store`` (a store without an ``engine``, the unit tests' fakes,
    journals nothing). ConfigError at start for anything that cannot be used."""
    from sqlalchemy.ext.asyncio import AsyncEngine

    from koda_runtime.processors.tools.journal import Journal

    tools = load_tools(modules_setting(settings.tools))
    engine = getattr(store, "engine", None)
    journal = Journal(engine) if isinstance(engine, AsyncEngine) else None
    return Toolbox(tools, journal, approval_timeout_s=settings.approval_timeout_s)

"""Job handlers: ``demo`` (deterministic, for tests and dev) and ``openai``."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from koda.errors import ConfigError
from koda.lifecycle.handler import Handler
from koda.naming import AppEnv
from koda.settings import Settings
from processors.memory.service import build_memory


def build_handler(settings: Settings, engine: AsyncEngine | None = None) -> Handler:
    """The handler named by ``KODA_HANDLER``; prod refuses ``demo``. With ``engine``
    (the worker's) and ``KODA_MEMORY`` on, the handler remembers and recalls."""
    memory = build_memory(settings, engine)
    if settings.handler == "demo":
        if settings.app_env is AppEnv.PROD:
            raise ConfigError("the demo handler is refused in prod")
        from processors.handlers.demo import DemoHandler

        return DemoHandler(memory)
    if settings.handler == "openai":
        from processors.handlers.openai import OpenAIHandler

        return OpenAIHandler(
            base_url=settings.openai_base_url,
            api_key=settings.openai_api_key,
            model=settings.openai_model,
            memory=memory,
            max_tool_turns=settings.max_tool_turns,
        )
    raise ConfigError(f"unknown handler {settings.handler!r}")

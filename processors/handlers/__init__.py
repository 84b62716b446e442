"""The handler registry: the built-in ``demo`` and ``openai``, then installed plugins.

``KODA_HANDLER`` names the handler. A built-in name wins; any other name is looked up
in the ``koda_runtime.handlers`` entry point group (koda/handlers.py describes the API), and a
name found in neither stops the worker at start with the known names listed.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.errors import ConfigError
from koda_runtime.handlers import ENTRY_POINT_GROUP, Handler
from koda_runtime.processors.memory.service import MemoryService, build_memory
from koda_runtime.settings import Settings


def _demo(settings: Settings, memory: MemoryService | None) -> Handler:
    from koda_runtime.processors.handlers.demo import DemoHandler

    return DemoHandler(memory)


def _openai(settings: Settings, memory: MemoryService | None) -> Handler:
    from koda_runtime.processors.handlers.openai import OpenAIHandler
    from koda_runtime.processors.handlers.provider import CallPolicy

    return OpenAIHandler(
        base_url=settings.openai_base_url,
        api_key=settings.openai_api_key,
        model=settings.openai_model,
        memory=memory,
        max_tool_turns=settings.max_tool_turns,
        max_connections=settings.model_concurrency or settings.max_inflight,
        fallback_model=settings.fallback_model,
        call_policy=CallPolicy(
            window_s=settings.model_retry_window_s,
            base_s=settings.model_retry_base_s,
            cap_s=settings.model_retry_cap_s,
            retry_after_cap_s=settings.model_retry_after_cap_s,
            breaker_failures=settings.model_breaker_failures,
            breaker_open_s=settings.model_breaker_open_s,
        ),
    )


# The built-in handlers, which also get the worker's long-term memory.
BUILT_IN: dict[str, Callable[[Settings, MemoryService | None], Handler]] = {
    "demo": _demo,
    "openai": _openai,
}


def plugins() -> dict[str, list[EntryPoint]]:
    """The installed entry points of the ``koda_runtime.handlers`` group, by name."""
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, []).append(ep)
    return found


def known_handlers() -> list[str]:
    """Every name ``KODA_HANDLER`` may take here: the built-ins, then the plugins."""
    return [*BUILT_IN, *sorted(set(plugins()) - set(BUILT_IN))]


def build_handler(settings: Settings, engine: AsyncEngine | None = None) -> Handler:
    """The handler named by ``KODA_HANDLER`` (prod's refusal of ``demo`` is the
    settings'). With ``engine`` (the worker's) and ``KODA_MEMORY`` on, a built-in
    handler remembers and recalls. ConfigError for an unknown name, a plugin that does
    not load, or a factory that returns no handler."""
    name = settings.handler
    if name in BUILT_IN:
        return BUILT_IN[name](settings, build_memory(settings, engine))
    candidates = plugins().get(name, [])
    if not candidates:
        raise ConfigError(
            f"KODA_HANDLER={name!r} is not a handler: use one of "
            f"{', '.join(known_handlers())} (built in, or installed in the "
            f"{ENTRY_POINT_GROUP!r} entry point group)"
        )
    if len(candidates) > 1:
        raise ConfigError(
            f"KODA_HANDLER={name!r} is registered by more than one distribution: "
            f"{', '.join(sorted(_origin(ep) for ep in candidates))}; uninstall all but one"
        )
    (ep,) = candidates
    try:
        factory = ep.load()
    except Exception as exc:
        raise ConfigError(
            f"KODA_HANDLER={name!r}: entry point {_origin(ep)} does not load: {exc!r}"
        ) from exc
    handler = factory(settings)
    if not all(callable(getattr(handler, m, None)) for m in ("stream", "aclose")):
        raise ConfigError(
            f"KODA_HANDLER={name!r}: entry point {_origin(ep)} returned "
            f"{type(handler).__name__}, not a handler (stream(ctx) and aclose())"
        )
    if not isinstance(getattr(handler, "name", None), str):
        raise ConfigError(
            f"KODA_HANDLER={name!r}: the handler of entry point {_origin(ep)} has no `name` string"
        )
    return handler  # type: ignore[no-any-return]


def _origin(ep: EntryPoint) -> str:
    dist = ep.dist.name if ep.dist is not None else "an unknown distribution"
    return f"{ep.value!r} ({dist})"

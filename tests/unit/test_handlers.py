"""The handler API and its registry: built-ins first, then the ``koda_runtime.handlers`` entry
points, found the way importlib.metadata finds installed distributions."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import koda_runtime.lifecycle.handler as lifecycle
from koda_runtime import handlers as public
from koda_runtime.errors import ConfigError
from koda_runtime.naming import AppEnv
from koda_runtime.processors.handlers import build_handler, known_handlers
from koda_runtime.settings import Settings
from tests.plugins import ECHO_MODULE, echo_output, install

DEV = Settings(app_env=AppEnv.DEV, worker_group="g7", memory_enabled=False)


@pytest.fixture
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path holding the echo plugin's distribution."""
    root = install(
        tmp_path / "site",
        "koda_echo_plugin",
        {
            "echo": "koda_echo_plugin:build",
            "demo": "koda_echo_plugin:build",  # a built-in name: the built-in wins
            "broken": "koda_missing_module:build",
            "nothing": "koda_echo_plugin:not_a_handler",
        },
        ECHO_MODULE,
    )
    monkeypatch.syspath_prepend(str(root))
    yield root
    sys.modules.pop("koda_echo_plugin", None)


def collect(handler: Any, text: str) -> list[Any]:
    async def run() -> list[Any]:
        ctx = public.RunContext("r1", "u1", {"text": text}, 1)
        try:
            return [item async for item in handler.stream(ctx)]
        finally:
            await handler.aclose()

    return asyncio.run(run())


def test_the_api_is_exported_from_one_public_module() -> None:
    for name in ("Handler", "RunContext", "Usage", "CancelToken", "ToolActivity", "RunFailed"):
        assert name in public.__all__
        assert getattr(public, name) is getattr(lifecycle, name)
    assert all(hasattr(public, name) for name in public.__all__)
    assert public.ENTRY_POINT_GROUP == "koda_runtime.handlers"
    assert all(
        getattr(public, n).__doc__ for n in ("Handler", "RunContext", "CancelToken", "Usage")
    )


def test_an_installed_entry_point_is_found_and_runs(plugin_path: Path) -> None:
    assert known_handlers() == ["demo", "openai", "broken", "echo", "nothing"]
    handler = build_handler(DEV.with_(handler="echo"))
    items = collect(handler, "hello plugin world")
    chunks = [i for i in items if isinstance(i, str)]
    assert "".join(chunks) == echo_output("g7", "hello plugin world")
    assert items[-1] == public.Usage("echo-1", 1, 2)


def test_a_built_in_name_wins_over_a_plugin(plugin_path: Path) -> None:
    from koda_runtime.processors.handlers.demo import DemoHandler

    assert isinstance(build_handler(DEV.with_(handler="demo")), DemoHandler)


def test_an_unknown_name_is_refused_naming_it_and_the_known_ones(plugin_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        build_handler(DEV.with_(handler="ecoh"))
    assert str(exc.value).startswith(
        "KODA_HANDLER='ecoh' is not a handler: use one of demo, openai, broken, echo, nothing"
    )


def test_without_plugins_the_known_names_are_the_built_ins() -> None:
    with pytest.raises(ConfigError, match="KODA_HANDLER='echo' is not a handler: use one of "):
        build_handler(DEV.with_(handler="echo"))
    assert known_handlers()[:2] == ["demo", "openai"]
    assert "echo" not in known_handlers()


def test_a_plugin_that_does_not_load_or_returns_no_handler_is_refused(plugin_path: Path) -> None:
    with pytest.raises(ConfigError, match="KODA_HANDLER='broken': entry point .* does not load"):
        build_handler(DEV.with_(handler="broken"))
    with pytest.raises(ConfigError, match="returned object, not a handler"):
        build_handler(DEV.with_(handler="nothing"))


def test_a_name_two_distributions_register_is_refused(
    plugin_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = install(tmp_path / "other", "koda_echo_twin", {"echo": "koda_echo_plugin:build"})
    monkeypatch.syspath_prepend(str(other))
    with pytest.raises(ConfigError, match="more than one distribution: .*koda_echo_plugin.*twin"):
        build_handler(DEV.with_(handler="echo"))


def test_prod_refuses_demo_in_the_settings_and_any_name_loads_there() -> None:
    with pytest.raises(ConfigError, match="KODA_HANDLER=demo is refused in prod"):
        Settings(app_env=AppEnv.PROD)
    prod = Settings(app_env=AppEnv.PROD, handler="echo", kafka_allow_plaintext=True)
    assert prod.handler == "echo"

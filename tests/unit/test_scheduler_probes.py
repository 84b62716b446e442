"""The scheduler's /livez and /readyz answers (pure: a stand-in for the pass loop's state;
the real process is tests/integration/test_scheduler_health.py)."""

from __future__ import annotations

from dataclasses import dataclass

from koda_runtime.scheduler import bootstrap
from koda_runtime.scheduler.bootstrap import STALL_AFTER_S, live, ready


@dataclass
class Loop:
    last_progress: float = 100.0
    passes: int = 0
    last_error: str | None = None


def test_ready_after_a_pass_and_not_while_passes_fail() -> None:
    loop = Loop()
    assert ready(loop) == (False, {"passes": 0, "reason": "no pass has completed yet"})  # type: ignore[arg-type]
    loop.passes = 1
    assert ready(loop) == (True, {"passes": 1})  # type: ignore[arg-type]
    loop.last_error = "a schedules query failed: OperationalError"
    ok, detail = ready(loop)  # type: ignore[arg-type]
    assert not ok
    assert detail["reason"] == "the last pass failed: a schedules query failed: OperationalError"


def test_live_until_the_loop_is_silent_past_the_stall_limit() -> None:
    loop = Loop(last_progress=100.0)
    assert live(loop, lambda: 100.0 + STALL_AFTER_S)[0] is True  # type: ignore[arg-type]
    ok, detail = live(loop, lambda: 101.0 + STALL_AFTER_S)  # type: ignore[arg-type]
    assert not ok and detail == {"silent_s": STALL_AFTER_S + 1, "stall_after_s": STALL_AFTER_S}


def test_the_routes_are_served() -> None:
    routes = {r.resource.canonical for r in bootstrap.health_app(Loop()).router.routes()}  # type: ignore[arg-type, union-attr]
    assert routes == set(bootstrap.ROUTES)

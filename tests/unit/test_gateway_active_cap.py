"""The cap on a user's active runs, without services: the setting, the 429 it answers
(through the ASGI shortcut and through the declared route alike) and the statuses the
count and its index take. The cap itself, against Postgres, is
tests/integration/test_active_run_cap.py's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from koda_runtime.errors import ConfigError, TooManyActiveRuns
from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.bootstrap import Components, build_components
from koda_runtime.gateway.errors import ActiveRunsCapped, http_error
from koda_runtime.gateway.intake import RunRequest
from koda_runtime.gateway.submit import PATH, SubmitShortcut
from koda_runtime.lifecycle.states import OPEN
from koda_runtime.schemas.runs.admission import _ACTIVE_RUNS, AdmittedRun
from koda_runtime.schemas.tables import runs
from koda_runtime.settings import Settings
from tests.unit.test_gateway_http import UNREACHABLE


def test_the_default_cap_is_above_a_burst_of_ten_and_zero_means_none() -> None:
    default = Settings.from_env({"APP_ENV": "dev"})
    assert default.max_active_runs_per_user == 32
    off = Settings.from_env({"APP_ENV": "dev", "KODA_MAX_ACTIVE_RUNS_PER_USER": "0"})
    assert off.max_active_runs_per_user == 0
    with pytest.raises(ConfigError, match="KODA_MAX_ACTIVE_RUNS_PER_USER='-1'"):
        Settings.from_env({"APP_ENV": "dev", "KODA_MAX_ACTIVE_RUNS_PER_USER": "-1"})


def test_the_gateway_hands_the_cap_to_admission() -> None:
    settings = UNREACHABLE.with_(max_active_runs_per_user=7)
    gw = build_components(settings)
    assert gw.admissions.max_active == 7
    assert gw.admissions.queue.max_active == 7


def test_the_refusal_is_a_429_naming_the_setting_its_value_and_the_active_runs() -> None:
    answer = http_error(TooManyActiveRuns("alice", 4, 5))
    assert isinstance(answer, ActiveRunsCapped)
    assert answer.status == 429
    assert answer.headers == {"Retry-After": "5"}
    body = answer.body()["error"]
    assert body["code"] == "too_many_active_runs"
    assert body["active_runs"] == {
        "setting": "KODA_MAX_ACTIVE_RUNS_PER_USER",
        "cap": 4,
        "active": 5,
    }
    assert "KODA_MAX_ACTIVE_RUNS_PER_USER=4" in body["message"]
    assert "5 of your runs are active" in body["message"]


def _open_predicate() -> str:
    return "status IN (" + ", ".join(f"'{s.value}'" for s in sorted(OPEN)) + ")"


def test_the_count_and_its_index_take_exactly_the_statuses_not_yet_ended() -> None:
    assert {s.value for s in OPEN} == {"pending", "running", "streaming", "waiting"}
    assert _open_predicate() in " ".join(_ACTIVE_RUNS.text.split())
    (index,) = [i for i in runs.indexes if i.name == "ix_runs_open_user_id"]
    assert [c.name for c in index.columns] == ["user_id"]
    assert str(index.dialect_options["postgresql"]["where"]) == _open_predicate()


@pytest.fixture
async def apps() -> AsyncIterator[tuple[Components, httpx.AsyncClient, httpx.AsyncClient]]:
    """(components, with the shortcut, without it), admission refusing every run."""
    components = build_components(UNREACHABLE.with_(rate_burst=100))

    async def capped(
        user_id: str, request: RunRequest, client_key: str | None, **_: object
    ) -> AdmittedRun:
        raise TooManyActiveRuns(user_id, 32, 32)

    components.admissions.submit = capped  # type: ignore[method-assign]
    shortcut = create_app(UNREACHABLE, components=components)
    routed = create_app(UNREACHABLE, components=components)
    routed.user_middleware = [
        m
        for m in routed.user_middleware
        if m.cls is not SubmitShortcut  # type: ignore[comparison-overlap]
    ]
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=shortcut), base_url="http://gw") as a,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=routed), base_url="http://gw") as b,
    ):
        yield components, a, b
    await components.engine.dispose()


async def test_the_shortcut_and_the_route_answer_the_cap_alike(
    apps: tuple[Components, httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    _components, shortcut, routed = apps
    answers = [
        await client.post(
            PATH,
            json={"input": "x"},
            headers={"Authorization": f"Bearer dev:{user}", "Content-Type": "application/json"},
        )
        for client, user in ((shortcut, "cap-a"), (routed, "cap-b"))
    ]
    for r in answers:
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == "5"
        assert r.json()["error"]["active_runs"]["cap"] == 32
    assert answers[0].content == answers[1].content

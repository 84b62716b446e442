"""The collector held back during a replay (topics/replay/quiet_gc.py): raised and
frozen inside, exactly as before once the outermost replay ends, however it ends."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings
from koda_runtime.topics.replay.engine import Replay, ReplayOptions
from koda_runtime.topics.replay.errors import SinkError
from koda_runtime.topics.replay.quiet_gc import YOUNG_THRESHOLD, held_back


@pytest.fixture(autouse=True)
def collector() -> Iterator[None]:
    """Every test starts with the default collector and leaves it so."""
    saved = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    yield
    gc.unfreeze()
    gc.set_threshold(*saved)


def test_inside_objects_are_frozen_and_the_young_threshold_is_raised() -> None:
    alive = [object()]
    assert any(o is alive for o in gc.get_objects())
    with held_back():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        assert gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # frozen: never walked
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0
    assert any(o is alive for o in gc.get_objects())


def test_a_failing_body_still_puts_the_collector_back() -> None:
    with pytest.raises(RuntimeError, match="sink down"), held_back():
        raise RuntimeError("sink down")
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0


def test_a_nested_replay_leaves_the_outer_one_held_back() -> None:
    with held_back():
        with held_back():
            pass
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0


def test_a_host_that_froze_its_own_objects_keeps_them_frozen() -> None:
    hosts = [object()]  # a container: tracked by the collector until frozen
    gc.freeze()
    with held_back():
        pass
    assert gc.get_freeze_count() > 0
    assert not any(o is hosts for o in gc.get_objects())


def test_a_higher_threshold_of_the_host_is_not_lowered() -> None:
    gc.set_threshold(YOUNG_THRESHOLD * 2, 10, 10)
    with held_back():
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD * 2
    assert gc.get_threshold() == (YOUNG_THRESHOLD * 2, 10, 10)


def test_a_replay_runs_held_back_and_puts_the_collector_back_when_it_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, int, int]] = []

    def failing_run(self: Replay) -> None:
        seen.append(gc.get_threshold())
        raise SinkError("cannot open duckdb:///x.duckdb")

    monkeypatch.setattr(Replay, "_run", failing_run)
    replay = Replay(
        Settings(app_env=AppEnv.DEV, namespace="unit"),
        ReplayOptions(sink_url=f"duckdb:///{tmp_path / 'x.duckdb'}"),
    )
    with pytest.raises(SinkError):
        replay.run()
    assert seen == [(YOUNG_THRESHOLD, 10, 10)]
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0

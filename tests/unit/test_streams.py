"""The suite's three test processes: which tests run beside the rest."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.streams import ALSO, ALSO_PATHS, BESIDE, BESIDE_PATHS, REST, stream_of

ROOT = Path(__file__).resolve().parents[2]


def test_the_long_waiting_tests_run_beside_the_rest() -> None:
    assert stream_of("tests/chaos/test_chaos_short.py::test_a") == BESIDE
    assert stream_of("tests/e2e/test_scheduler.py::test_x[1]") == BESIDE
    assert stream_of("tests/e2e/test_handoff.py::test_y") == ALSO
    assert stream_of("tests/e2e/test_sse_browser.py::test_y") == REST
    assert stream_of("tests/unit/test_chaos.py::test_z") == REST


def test_every_beside_path_exists() -> None:
    """A renamed or moved file would silently fall back into the other process."""
    missing = [p for p in BESIDE_PATHS + ALSO_PATHS if not (ROOT / p).exists()]
    assert missing == []


def test_no_path_is_in_two_streams() -> None:
    assert set(BESIDE_PATHS).isdisjoint(ALSO_PATHS)

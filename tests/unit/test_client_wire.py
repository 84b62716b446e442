"""The SSE parser (koda/sse.py, the client's and the gateway's) reads what the gateway
writes, in any split; and a followed stream resumes after the last seq seen."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from koda_runtime.client._wire import Resume, batch_results, history_request
from koda_runtime.gateway import eventstream as wire
from koda_runtime.sse import EventParser

FRAMES = (
    wire.retry_frame(200)
    + wire.event_frame(0, "chunk", wire.json_data({"content": "héllo"}))
    + wire.comment("keep-alive")
    + wire.event_frame(1, "tool", b'{"a":1}\r\n{"b":2}')
    + wire.event_frame(None, wire.RECONNECT, b"{}")
    + wire.event_frame(2, "done", b"{}")
)


@given(st.lists(st.integers(min_value=1, max_value=len(FRAMES) - 1), unique=True, max_size=8))
def test_the_parser_reads_what_the_gateway_writes_in_any_split(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(FRAMES)]
    mine = EventParser()
    got = []
    for a, b in zip(points, points[1:], strict=False):
        got += mine.feed(FRAMES[a:b])
    assert [(e.id, e.event, e.data) for e in got] == [
        ("0", "chunk", '{"content":"héllo"}'),
        ("1", "tool", '{"a":1}\n{"b":2}'),
        (None, wire.RECONNECT, "{}"),
        ("2", "done", "{}"),
    ]
    assert [e.seq for e in got] == [0, 1, None, 2]
    assert mine.retry == 200 and got[-1].terminal and not got[0].terminal


def test_resume_sends_the_last_seq_seen_and_hides_reconnects() -> None:
    resume = Resume(None, 10.0)
    assert "Last-Event-ID" not in resume.headers()
    events = EventParser().feed(FRAMES)
    shown = [e.event for e in events if resume.see(e)]
    assert shown == ["chunk", "tool", "done"] and resume.ended
    assert resume.headers()["Last-Event-ID"] == "2"
    assert Resume(4, 10.0).headers()["Last-Event-ID"] == "4"


def test_history_asks_a_session_or_the_users_runs() -> None:
    assert history_request("s 1", None, 5, None) == ("/v1/sessions/s%201/runs", {"limit": "5"})
    assert history_request(None, "done", None, "b") == (
        "/v1/runs",
        {"before": "b", "status": "done"},
    )
    assert history_request("s1", "done", None, None)[1] == {"session_id": "s1", "status": "done"}


def test_batch_results_carry_each_items_run_or_error() -> None:
    ok, bad = batch_results(
        {
            "runs": [
                {"status": 202, "run": {"run_id": "r", "status": "pending", "events_url": "/e"}},
                {"status": 422, "error": {"code": "invalid_field", "message": "m", "field": "f"}},
            ]
        }
    )
    assert ok.ok and ok.run is not None and ok.run.run_id == "r"
    assert not bad.ok and bad.error is not None
    assert str(bad.error) == "HTTP 422 invalid_field (f): m"

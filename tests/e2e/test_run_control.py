"""Steering runs in flight against real processes: cancel, interrupt-merge, history.

One namespace, two gateway processes and two worker processes for the module (the
tests that stop or kill a worker start a replacement). Runs are submitted through the
gateways; Postgres is read directly to check what was written.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from koda_runtime.lifecycle.attempts import claim_bound
from koda_runtime.lifecycle.chunks import chunk_key
from koda_runtime.lifecycle.control import merge_inputs
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUN_CHUNKS, RUN_EVENTS, RUNS
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter, committed_offsets, read_topic
from tests.sse_client import bearer, follow_run
from tests.support import wait_until

MERGE_WINDOW_G2_S = 1.5  # the second gateway's KODA_MERGE_WINDOW_S


@dataclass
class Cluster:
    settings: Settings
    sub: Submitter
    g1: GatewayProcess
    g2: GatewayProcess
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    serial: int = 0

    def start_worker(self, name: str) -> WorkerProcess:
        w = WorkerProcess(self.settings, name).start()
        self.workers[name] = w
        return w

    def owners(self) -> dict[int, str]:
        rows = self.sub.query("SELECT partition, worker_id FROM partition_epochs")
        return {r.partition: r.worker_id for r in rows}

    def settled(self, names: set[str]) -> bool:
        """Every partition held by ``names``, whose run-control tails are positioned (a
        record produced before that is, by design, only found through Postgres)."""
        owners = self.owners()
        tails = all("run-control tail started" in self.workers[n].log() for n in names)
        return len(owners) == self.settings.partitions and set(owners.values()) == names and tails

    def user(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}-{self.serial}-{time.monotonic_ns() % 10**6}"

    def row(self, run_id: str) -> Any:
        return self.sub.query(
            "SELECT status, attempt, worker_id, cancel_reason, cancel_requested_at,"
            " COALESCE(input_version, 0) AS input_version, input FROM runs WHERE id = :r",
            r=run_id,
        )[0]

    def execute(self, sql: str, **params: Any) -> None:
        with self.sub.engine.begin() as conn:
            conn.execute(text(sql), params)

    def kinds(self, run_id: str) -> list[str]:
        return [m.kind for m in self.sub.messages(run_id)]


@pytest.fixture(scope="module")
def cluster(stack) -> Iterator[Cluster]:
    cfg = make_settings(stack, handoff_ceiling_s=10.0)
    apply_topics(cfg)
    upgrade(cfg)
    sub = Submitter(cfg)
    g1 = GatewayProcess(cfg).start()
    g2 = GatewayProcess(cfg, {"KODA_MERGE_WINDOW_S": str(MERGE_WINDOW_G2_S)}).start()
    c = Cluster(cfg, sub, g1, g2)
    try:
        c.start_worker("w1")
        c.start_worker("w2")
        wait_until(lambda: c.settled({"w1", "w2"}), timeout=60, what="both workers assigned")
        yield c
    finally:
        for w in c.workers.values():
            w.kill()
        g1.stop()
        g2.stop()
        sub.close()
        delete_topics(cfg)
        drop_schema(cfg)


def demo(tokens: int, delay_ms: int, text: str = "hello") -> dict[str, Any]:
    return {"text": text, "demo": {"tokens": tokens, "delay_ms": delay_ms}}


def post_run(
    gw: GatewayProcess, user: str, inp: dict[str, Any], session: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"input": inp}
    if session is not None:
        body["session_id"] = session
    r = httpx.post(f"{gw.url}/v1/runs", json=body, headers=bearer(user), timeout=10)
    assert r.status_code == 202, r.text
    answer: dict[str, Any] = r.json()
    return answer


def cancel(gw: GatewayProcess, user: str, run_id: str, reason: str | None = None) -> httpx.Response:
    """The answer may wait for a frozen worker's row lock, which the server ends after
    the session timeout (docs/decisions/0015-cancel-and-merge.md, "A frozen writer")."""
    body = None if reason is None else {"reason": reason}
    return httpx.post(
        f"{gw.url}/v1/runs/{run_id}/cancel",
        json=body,
        headers=bearer(user),
        timeout=gw.settings.session_timeout_s + 15,
    )


def status_is(c: Cluster, run_id: str, *statuses: str) -> bool:
    return bool(c.row(run_id).status in statuses)


def session_of(c: Cluster, run_id: str) -> str:
    return str(c.sub.query("SELECT session_id FROM runs WHERE id = :r", r=run_id)[0].session_id)


def one_terminal(c: Cluster, run_id: str) -> str:
    """The run's one terminal event kind; fails on none or two, or a status mismatch."""
    kinds = c.kinds(run_id)
    ends = [k for k in kinds if k in ("done", "error", "cancelled")]
    assert len(ends) == 1 and kinds[-1] == ends[0], kinds
    status = c.row(run_id).status
    assert {"done": "done", "error": "failed", "cancelled": "cancelled"}[ends[0]] == status
    seqs = [m.seq for m in c.sub.messages(run_id)]
    assert seqs == list(range(len(seqs))), seqs
    return ends[0]


def output_of(c: Cluster, run_id: str) -> str:
    return c.sub.output(run_id)


# --- cancel -------------------------------------------------------------------------


def test_cancel_running_run_through_the_other_gateway(cluster: Cluster) -> None:
    c = cluster
    user = c.user("cancel")
    run_id = post_run(c.g1, user, demo(400, 20))["run_id"]

    async def watch() -> Any:
        async with httpx.AsyncClient(base_url=c.g1.url, timeout=30) as client:
            return await follow_run(client, run_id, headers=bearer(user))

    loop = asyncio.new_event_loop()
    viewer = loop.create_task(watch())
    loop.run_until_complete(asyncio.sleep(0))  # one turn: the viewer starts connecting
    wait_until(lambda: "chunk" in c.kinds(run_id), timeout=30, what="output")
    r = cancel(c.g2, user, run_id, "changed my mind")  # not the gateway that took the run
    assert r.status_code == 202, r.text
    assert r.json()["cancel_requested"] is True and r.json()["status"] in ("running", "streaming")
    followed = loop.run_until_complete(asyncio.wait_for(viewer, 30))
    loop.close()
    last = followed.events[-1]
    assert last.event == "cancelled"
    assert json.loads(last.data)["content"] == json.dumps(
        {"status": "cancelled", "reason": "changed my mind"}
    )
    assert one_terminal(c, run_id) == "cancelled"
    row = c.row(run_id)
    assert row.cancel_reason == "changed my mind" and row.attempt == 1
    assert 0 < len(output_of(c, run_id)) < len("".join(demo_tokens(demo(400, 20))))
    # The trigger's offset is committed: the run is over for the group too.
    part = c.sub.query("SELECT partition FROM runs WHERE id = :r", r=run_id)[0].partition
    group = c.settings.names.group(c.settings.worker_group)
    topic = c.settings.names.topic(RUNS)
    wait_until(
        lambda: committed_offsets(c.settings, group, topic).get(part, -1) > 0,
        timeout=20,
        what="offset committed",
    )
    # A second cancel changes nothing and says so.
    again = cancel(c.g1, user, run_id, "again")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    assert again.json()["cancel_reason"] == "changed my mind"
    assert c.kinds(run_id).count("cancelled") == 1


def test_a_cancelled_run_records_the_usage_it_incurred(cluster: Cluster) -> None:
    c = cluster
    user = c.user("usage")
    inp = {"text": "calls", "demo": {"tokens": 400, "delay_ms": 20, "usage_each": True}}
    run_id = post_run(c.g1, user, inp)["run_id"]
    wait_until(lambda: c.kinds(run_id).count("chunk") >= 5, timeout=30, what="output")
    assert cancel(c.g1, user, run_id).status_code == 202
    wait_until(lambda: status_is(c, run_id, "cancelled"), timeout=30, what="cancelled")
    calls = c.sub.query(
        "SELECT call_index, cost_usd FROM usage WHERE run_id = :r ORDER BY call_index", r=run_id
    )
    shown = c.kinds(run_id).count("chunk")
    # Every call made before the stop is billed, never one that was not made.
    assert shown <= len(calls) < 400
    assert [u.call_index for u in calls] == list(range(len(calls)))


def test_cancel_of_another_users_run_is_an_unknown_run(cluster: Cluster) -> None:
    c = cluster
    owner, other = c.user("owner"), c.user("other")
    run_id = post_run(c.g1, owner, demo(100, 20))["run_id"]
    theirs = cancel(c.g1, other, run_id)
    unknown = cancel(c.g1, other, "0190a000-0000-7000-8000-000000000000")
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json() == unknown.json()
    wait_until(lambda: status_is(c, run_id, "done"), timeout=30, what="run done")
    assert c.row(run_id).cancel_requested_at is None
    done = cancel(c.g1, owner, run_id)
    assert done.status_code == 200 and done.json()["status"] == "done"
    assert done.json()["cancel_requested"] is False
    assert one_terminal(c, run_id) == "done"


def test_cancel_pending_run_is_immediate_and_its_trigger_skipped(cluster: Cluster) -> None:
    c = cluster
    user = c.user("pending")
    first = post_run(c.g1, user, demo(300, 20))["run_id"]
    wait_until(lambda: status_is(c, first, "running", "streaming"), timeout=30, what="first runs")
    queued = post_run(c.g1, user, demo(5, 1, "second"))["run_id"]  # behind first
    assert c.row(queued).status == "pending"
    r = cancel(c.g1, user, queued, "not needed")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert c.kinds(queued) == ["cancelled"]
    published = "SELECT published_seq FROM runs WHERE id = :r"
    assert c.sub.query(published, r=queued)[0].published_seq == 0

    # The viewer of the cancelled run gets its end at once.
    async def watch() -> Any:
        async with httpx.AsyncClient(base_url=c.g2.url, timeout=10) as client:
            return await follow_run(client, queued, headers=bearer(user))

    followed = asyncio.run(watch())
    assert [e.event for e in followed.events] == ["cancelled"]
    assert cancel(c.g1, user, first).status_code == 202
    wait_until(lambda: status_is(c, first, "cancelled"), timeout=30, what="first cancelled")
    # The worker reads the queued run's trigger after the first ends and skips it.
    wait_until(lambda: f"skip terminal run_id={queued}" in _logs(c), timeout=30, what="skip")
    row = c.row(queued)
    assert row.status == "cancelled" and row.attempt == 0 and c.kinds(queued) == ["cancelled"]
    # The gateway's record is the whole run on the chunk topic, and marked so: the
    # worker that skipped the trigger produced nothing again (nor will the pass).
    assert f"republished run_id={queued}" not in _logs(c)
    chunks = read_topic(c.settings, c.settings.names.topic(RUN_CHUNKS))
    mine = [m.key().decode() for m in chunks if m.key().startswith(queued.encode())]
    assert mine == [chunk_key(queued, 0)]


def test_a_cancel_racing_the_claim_is_never_undone(cluster: Cluster) -> None:
    """Cancelled the moment it is accepted, a run is either cancelled while pending (the
    worker's claim then finds no edge out of ``cancelled``) or claimed first (the claim
    or a later write sees the request). Either way it ends ``cancelled`` once, and one
    cancelled while pending never runs."""
    c = cluster
    outcomes = set()
    for i in range(6):
        user = c.user("claimrace")
        run_id = post_run(c.g1 if i % 2 else c.g2, user, demo(20, 10))["run_id"]
        r = cancel(c.g1, user, run_id, "at once")
        assert r.status_code in (200, 202), r.text
        outcomes.add(r.json()["status"])
        wait_until(lambda: status_is(c, run_id, "cancelled"), timeout=30, what="cancelled")  # noqa: B023
        assert one_terminal(c, run_id) == "cancelled"
        row = c.row(run_id)
        assert row.cancel_reason == "at once"
        if r.status_code == 200:  # cancelled while pending: never claimed, never run
            assert r.json()["status"] == "cancelled"
            assert row.attempt == 0 and c.kinds(run_id) == ["cancelled"]
    # Whichever way each race went, the status answered was one the run had then.
    assert outcomes <= {"cancelled", "running", "streaming"}


def _logs(c: Cluster) -> str:
    return "".join(w.log() for w in c.workers.values())


def test_the_control_record_stops_a_run_between_its_writes(cluster: Cluster) -> None:
    """Seconds between chunks: no write of the run can find the request before its next
    chunk, so stopping after one chunk is the control record's doing."""
    c = cluster
    user = c.user("signal")
    run_id = post_run(c.g1, user, demo(3, 3000))["run_id"]
    wait_until(lambda: "chunk" in c.kinds(run_id), timeout=30, what="first chunk")
    assert cancel(c.g2, user, run_id, "signal").status_code == 202
    wait_until(lambda: status_is(c, run_id, "cancelled"), timeout=30, what="cancelled")
    assert c.kinds(run_id) == ["chunk", "cancelled"]
    assert f"run-control cancel run_id={run_id}" in _logs(c)

    merged = post_run(c.g1, user, demo(2, 3000, "m"))["run_id"]
    wait_until(lambda: "chunk" in c.kinds(merged), timeout=30, what="first chunk")
    answer = post_run(c.g1, user, {"text": "n"}, session=session_of(c, merged))
    assert answer["merged"] is True
    wait_until(lambda: "reset" in c.kinds(merged), timeout=30, what="reset")
    assert c.kinds(merged)[:2] == ["chunk", "reset"]
    assert f"run-control merge run_id={merged}" in _logs(c)
    assert cancel(c.g1, user, merged).status_code == 202


def test_a_cancel_whose_signal_is_lost_still_wins(cluster: Cluster) -> None:
    """The request lands in Postgres but no control record is produced: the worker's
    next chunk write sees it and ends the run cancelled."""
    c = cluster
    user = c.user("lost")
    run_id = post_run(c.g1, user, demo(400, 20))["run_id"]
    wait_until(lambda: "chunk" in c.kinds(run_id), timeout=30, what="output")
    c.execute(
        "UPDATE runs SET cancel_requested_at = now(), cancel_reason = 'db only' WHERE id = :r",
        r=run_id,
    )
    wait_until(lambda: status_is(c, run_id, "cancelled"), timeout=10, what="cancelled")
    assert one_terminal(c, run_id) == "cancelled"
    assert c.row(run_id).attempt == 1


@pytest.mark.parametrize("delay_ms", [0, 40, 80, 120, 160])
def test_a_cancel_racing_the_finish_ends_in_one_terminal_state(
    cluster: Cluster, delay_ms: int
) -> None:
    c = cluster
    user = c.user("race")
    run_id = post_run(c.g1, user, demo(6, 15))["run_id"]
    wait_until(lambda: c.row(run_id).status != "pending", timeout=30, interval=0.005)
    time.sleep(delay_ms / 1000)  # the race's timing is the parameter, not a wait
    r = cancel(c.g2, user, run_id, "race")
    assert r.status_code in (200, 202), r.text
    wait_until(lambda: status_is(c, run_id, "done", "cancelled"), timeout=30, what="terminal")
    end = one_terminal(c, run_id)
    if end == "done":
        assert output_of(c, run_id) == "".join(demo_tokens(demo(6, 15)))
        assert r.status_code == 200 and r.json()["status"] == "done" or r.status_code == 202
    else:
        assert c.row(run_id).cancel_reason == "race"


# --- cancel when the signal cannot reach the executing worker -----------------------


def running_on(c: Cluster, user: str, inp: dict[str, Any]) -> tuple[str, WorkerProcess]:
    """Submit a run and return it once it streams, with the worker executing it."""
    for name in ("w1", "w2"):
        w = c.workers.get(name)
        if w is None or not w.alive():
            c.workers[name] = c.start_worker(name)
    wait_until(lambda: c.settled({"w1", "w2"}), timeout=60, what="both workers assigned")
    run_id = post_run(c.g1, user, inp)["run_id"]
    wait_until(lambda: "chunk" in c.kinds(run_id), timeout=30, what="output")
    return run_id, c.workers[c.row(run_id).worker_id]


def never_rerun(c: Cluster, run_id: str) -> None:
    """The successor claimed the run and ended it cancelled without running it again."""
    rows = c.sub.messages(run_id)
    later = [m for m in rows if m.attempt > 1]
    assert [m.kind for m in later] == ["cancelled"], [(m.attempt, m.kind) for m in rows]


def test_cancel_during_a_sigterm_drain(cluster: Cluster) -> None:
    c = cluster
    user = c.user("drain")
    run_id, worker = running_on(c, user, demo(300, 20))  # ~6 s; the drain waits up to 10 s
    worker.signal(signal.SIGTERM)
    assert cancel(c.g2, user, run_id, "drain").status_code == 202
    wait_until(lambda: status_is(c, run_id, "cancelled"), timeout=15, what="cancelled")
    assert worker.proc is not None and worker.proc.wait(30) == 0
    assert one_terminal(c, run_id) == "cancelled"
    assert c.row(run_id).attempt == 1  # ended by the draining worker itself
    assert len(output_of(c, run_id)) < len("".join(demo_tokens(demo(300, 20))))


def test_cancel_while_the_executing_worker_is_frozen_and_its_partition_moves(
    cluster: Cluster,
) -> None:
    c = cluster
    user = c.user("frozen")
    run_id, worker = running_on(c, user, demo(1000, 20))
    worker.signal(signal.SIGSTOP)  # misses the signal; the group evicts it
    try:
        assert cancel(c.g1, user, run_id, "frozen").status_code == 202
        wait_until(lambda: status_is(c, run_id, "cancelled"), timeout=60, what="cancelled")
    finally:
        seen = len(worker.log())
        worker.signal(signal.SIGCONT)
    assert c.row(run_id).worker_id != worker.worker_id
    never_rerun(c, run_id)
    assert one_terminal(c, run_id) == "cancelled"
    # Woken up, the old owner writes nothing more: its epoch is stale (partition lost),
    # or its connection was ended while it was frozen and the retried record finds the
    # run terminal, or its partitions were revoked first.
    before = len(c.sub.messages(run_id))
    markers = ("partition lost", f"skip terminal run_id={run_id}", "revoked partitions")
    wait_until(
        lambda: any(m in worker.log()[seen:] for m in markers) or not worker.alive(),
        timeout=60,
        what="the woken worker to notice",
    )
    assert len(c.sub.messages(run_id)) == before


def test_cancel_right_after_the_executing_worker_is_killed(cluster: Cluster) -> None:
    c = cluster
    user = c.user("killed")
    run_id, worker = running_on(c, user, demo(1000, 20))
    worker.kill()
    assert cancel(c.g2, user, run_id, "killed").status_code == 202
    wait_until(lambda: status_is(c, run_id, "cancelled"), timeout=40, what="cancelled")
    never_rerun(c, run_id)
    assert one_terminal(c, run_id) == "cancelled"
    assert c.row(run_id).cancel_reason == "killed"


def test_a_cancel_seen_only_by_the_finish_ends_the_run_cancelled(cluster: Cluster) -> None:
    """One chunk after a long pause: the only write after the (signal-less) request is
    the finish, which refuses ``done`` and ends the run ``cancelled``."""
    c = cluster
    user = c.user("finish")
    run_id = post_run(c.g1, user, demo(1, 1500))["run_id"]
    wait_until(lambda: status_is(c, run_id, "running"), timeout=30, interval=0.02)
    c.execute(
        "UPDATE runs SET cancel_requested_at = now(), cancel_reason = 'db' WHERE id = :r",
        r=run_id,
    )
    # A message for the session now is not merged into a run that is being cancelled
    # (its answer would end with the cancel): it is a new run, queued behind.
    late = post_run(c.g1, user, {"text": "after the cancel"}, session=session_of(c, run_id))
    assert late["merged"] is False and late["run_id"] != run_id
    wait_until(lambda: status_is(c, run_id, "done", "cancelled"), timeout=30, what="terminal")
    assert one_terminal(c, run_id) == "cancelled"
    assert c.kinds(run_id) == ["chunk", "cancelled"]
    assert c.row(run_id).input_version == 0
    wait_until(lambda: status_is(c, late["run_id"], "done"), timeout=30, what="late run done")
    assert output_of(c, late["run_id"]) == "".join(demo_tokens({"text": "after the cancel"}))


# --- interrupt-merge ------------------------------------------------------------------


def test_merge_inside_the_window_reruns_on_both_messages(cluster: Cluster) -> None:
    c = cluster
    user = c.user("merge")
    first_input = demo(150, 20, "first question")
    accepted = post_run(c.g1, user, first_input)
    run_id = accepted["run_id"]
    session = session_of(c, run_id)

    async def watch() -> Any:
        async with httpx.AsyncClient(base_url=c.g1.url, timeout=30) as client:
            return await follow_run(client, run_id, headers=bearer(user))

    loop = asyncio.new_event_loop()
    viewer = loop.create_task(watch())
    loop.run_until_complete(asyncio.sleep(0))  # one turn: the viewer starts connecting
    wait_until(lambda: "chunk" in c.kinds(run_id), timeout=30, what="output")
    second = {"text": "and in French"}
    merged = post_run(c.g1, user, second, session=session)
    assert merged["run_id"] == run_id and merged["merged"] is True
    assert merged["status"] in ("running", "streaming")
    followed = loop.run_until_complete(asyncio.wait_for(viewer, 60))
    loop.close()
    kinds = [e.event for e in followed.events]
    assert "reset" in kinds and kinds[-1] == "done", kinds
    seqs = [e.seq for e in followed.events]
    assert seqs == list(range(len(seqs)))  # contiguous across the rerun
    answer = "".join(demo_tokens(merge_inputs(first_input, second)))
    after_reset = kinds.index("reset")
    seen = "".join(
        json.loads(e.data)["content"] for e in followed.events[after_reset:] if e.event == "chunk"
    )
    assert seen == answer == output_of(c, run_id)
    row = c.row(run_id)
    assert row.input_version == 1 and row.input["text"] == "first question\n\nand in French"
    assert one_terminal(c, run_id) == "done"
    metrics = httpx.get(f"{c.g1.url}/metrics", timeout=5).text
    assert any(
        line.startswith("koda_runs_merged_total ") and float(line.split()[1]) >= 1
        for line in metrics.splitlines()
    )
    # The rerun is in the run's transitions, for the warehouse.
    events = [
        json.loads(m.value())
        for m in read_topic(c.settings, c.settings.names.topic(RUN_EVENTS))
        if m.key() == run_id.encode()
    ]
    assert any(e.get("reason") == "merged" and e["to"] == "running" for e in events), events


def test_two_merges_in_a_row_make_one_answer(cluster: Cluster) -> None:
    c = cluster
    user = c.user("twice")
    first = demo(200, 20, "a")
    run_id = post_run(c.g1, user, first)["run_id"]
    session = session_of(c, run_id)
    wait_until(lambda: "chunk" in c.kinds(run_id), timeout=30, what="output")
    b, d = {"text": "b"}, {"text": "d"}
    assert post_run(c.g1, user, b, session=session)["run_id"] == run_id
    assert post_run(c.g2, user, d, session=session)["run_id"] == run_id
    wait_until(lambda: status_is(c, run_id, "done"), timeout=60, what="done")
    assert c.row(run_id).input_version == 2
    assert output_of(c, run_id) == "".join(demo_tokens(merge_inputs(merge_inputs(first, b), d)))
    assert one_terminal(c, run_id) == "done"
    assert len(c.sub.query("SELECT 1 FROM runs WHERE session_id = :s", s=session)) == 1


def test_a_merged_run_bills_the_calls_of_both_passes(cluster: Cluster) -> None:
    c = cluster
    user = c.user("mbill")
    first = {"text": "bill", "demo": {"tokens": 60, "delay_ms": 20, "usage_each": True}}
    run_id = post_run(c.g1, user, first)["run_id"]
    wait_until(lambda: c.kinds(run_id).count("chunk") >= 3, timeout=30, what="output")
    assert post_run(c.g1, user, {"text": "more"}, session=session_of(c, run_id))["merged"]
    wait_until(lambda: status_is(c, run_id, "done"), timeout=60, what="done")
    calls = [
        u.call_index
        for u in c.sub.query("SELECT call_index FROM usage WHERE run_id = :r", r=run_id)
    ]
    rows = c.sub.messages(run_id)
    before_reset = [m for m in rows if m.kind == "chunk" and m.attempt == 1]
    assert len(calls) >= 60 + len(before_reset) and sorted(calls) == list(range(len(calls)))


def test_a_merge_whose_signal_is_lost_still_reruns(cluster: Cluster) -> None:
    """The input changes in Postgres with no control record, while the handler pauses
    before its only chunk: the finish refuses the stale answer and the run goes again."""
    c = cluster
    user = c.user("lostmerge")
    first = demo(1, 1500, "x")
    run_id = post_run(c.g1, user, first)["run_id"]
    wait_until(lambda: status_is(c, run_id, "running"), timeout=30, interval=0.02)
    fresh = {**first, "text": "x then y", "demo": {"tokens": 3, "delay_ms": 5}}
    c.execute(
        "UPDATE runs SET input = CAST(:i AS jsonb), input_version = 1 WHERE id = :r",
        i=json.dumps(fresh),
        r=run_id,
    )
    wait_until(lambda: status_is(c, run_id, "done"), timeout=30, what="done")
    assert output_of(c, run_id) == "".join(demo_tokens(fresh))
    assert one_terminal(c, run_id) == "done"


def test_a_merge_right_after_the_executing_worker_is_killed_is_answered(
    cluster: Cluster,
) -> None:
    """No worker hears the signal: the successor's claim reads the merged input, and the
    run's one answer is to both messages."""
    c = cluster
    user = c.user("mkilled")
    first = demo(300, 20, "before the kill")
    run_id, worker = running_on(c, user, first)
    worker.kill()
    second = {"text": "after the kill"}
    merged = post_run(c.g1, user, second, session=session_of(c, run_id))
    assert merged["run_id"] == run_id and merged["merged"] is True
    wait_until(lambda: status_is(c, run_id, "done"), timeout=60, what="done")
    assert c.row(run_id).worker_id != worker.worker_id and c.row(run_id).input_version == 1
    assert output_of(c, run_id) == "".join(demo_tokens(merge_inputs(first, second)))
    assert one_terminal(c, run_id) == "done"
    # The successor's output starts with `reset`: viewers drop the first pass's text.
    later = [m.kind for m in c.sub.messages(run_id) if m.attempt > 1]
    assert later[0] == "reset", later


def test_a_merge_during_a_sigterm_drain_is_answered(cluster: Cluster) -> None:
    """The draining worker still reads run-control: it reruns on the merged input, or,
    cut off by the drain's ceiling, leaves the run to a successor whose claim reads it."""
    c = cluster
    user = c.user("mdrain")
    first = demo(150, 20, "before the drain")
    run_id, worker = running_on(c, user, first)
    worker.signal(signal.SIGTERM)
    second = {"text": "during the drain"}
    merged = post_run(c.g1, user, second, session=session_of(c, run_id))
    assert merged["run_id"] == run_id and merged["merged"] is True
    wait_until(lambda: status_is(c, run_id, "done"), timeout=60, what="done")
    assert worker.proc is not None and worker.proc.wait(30) == 0
    assert c.row(run_id).input_version == 1
    assert output_of(c, run_id) == "".join(demo_tokens(merge_inputs(first, second)))
    assert one_terminal(c, run_id) == "done"


def test_a_run_claimed_as_often_as_it_may_be_takes_no_merge(cluster: Cluster) -> None:
    """Its rerun would be one claim too many, and the run would end ``failed`` with the
    message unanswered: the message is a new run, and the run ends on its own input."""
    c = cluster
    user = c.user("bound")
    first = demo(100, 20, "bounded")
    run_id = post_run(c.g1, user, first)["run_id"]
    wait_until(lambda: "chunk" in c.kinds(run_id), timeout=30, what="output")
    # As if earlier merges, cut-offs and retries had taken every claim but this one.
    bound = claim_bound(c.settings.max_attempts)
    c.execute("UPDATE runs SET attempt = :n WHERE id = :r", n=bound, r=run_id)
    second = {"text": "one message too many"}
    late = post_run(c.g1, user, second, session=session_of(c, run_id))
    assert late["merged"] is False and late["run_id"] != run_id
    wait_until(lambda: c.sub.all_terminal([run_id, late["run_id"]]), timeout=30, what="ends")
    assert one_terminal(c, run_id) == "done" and c.row(run_id).input_version == 0
    assert output_of(c, run_id) == "".join(demo_tokens(first))
    assert one_terminal(c, late["run_id"]) == "done"
    assert output_of(c, late["run_id"]) == "".join(demo_tokens(second))


def test_merge_outside_the_window_is_a_new_run(cluster: Cluster) -> None:
    c = cluster
    user = c.user("late")
    run_id = post_run(c.g2, user, demo(300, 20))["run_id"]
    session = session_of(c, run_id)
    wait_until(lambda: "chunk" in c.kinds(run_id), timeout=30, what="output")
    wait_until(
        lambda: (
            c.sub.query(
                "SELECT created_at < now() - make_interval(secs => :w) AS old FROM runs"
                " WHERE id = :r",
                w=MERGE_WINDOW_G2_S,
                r=run_id,
            )[0].old
        ),
        timeout=10,
        what="run older than the window",
    )
    late = post_run(c.g2, user, {"text": "late"}, session=session)
    assert late["run_id"] != run_id and late["merged"] is False
    assert c.row(run_id).input_version == 0
    assert cancel(c.g2, user, run_id).status_code == 202
    wait_until(lambda: status_is(c, late["run_id"], "done"), timeout=30, what="late run done")


def test_merge_into_a_pending_or_finished_run_is_a_new_run(cluster: Cluster) -> None:
    c = cluster
    user = c.user("nomerge")
    blocker = post_run(c.g1, user, demo(300, 20))["run_id"]
    wait_until(lambda: "chunk" in c.kinds(blocker), timeout=30, what="blocker runs")
    queued = post_run(c.g1, user, demo(3, 1, "queued"))["run_id"]  # a session of its own
    assert c.row(queued).status == "pending"
    into_pending = post_run(c.g1, user, {"text": "more"}, session=session_of(c, queued))
    assert into_pending["run_id"] != queued and into_pending["merged"] is False
    assert c.row(queued).input_version == 0
    assert cancel(c.g1, user, blocker).status_code == 202
    wait_until(lambda: status_is(c, into_pending["run_id"], "done"), timeout=30, what="done")
    assert c.row(queued).status == "done"
    into_done = post_run(c.g1, user, {"text": "after"}, session=session_of(c, queued))
    assert into_done["run_id"] != queued and into_done["merged"] is False
    assert output_of(c, queued) == "".join(demo_tokens(demo(3, 1, "queued")))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(delay_ms=st.integers(min_value=0, max_value=250))
def test_a_merge_racing_the_finish_is_merged_and_rerun_or_a_new_run(
    cluster: Cluster, delay_ms: int
) -> None:
    c = cluster
    user = c.user("mrace")
    first = demo(5, 15, "race")
    run_id = post_run(c.g1, user, first)["run_id"]
    session = session_of(c, run_id)
    wait_until(lambda: c.row(run_id).status != "pending", timeout=30, interval=0.005)
    time.sleep(delay_ms / 1000)  # the race's timing is the drawn value, not a wait
    second = {"text": "race two", "demo": {"tokens": 4, "delay_ms": 5}}
    answer = post_run(c.g1, user, second, session=session)
    ids = sorted({run_id, answer["run_id"]})
    wait_until(lambda: c.sub.all_terminal(ids), timeout=30, what="both messages answered")
    assert one_terminal(c, run_id) == "done"
    if answer["merged"]:
        assert answer["run_id"] == run_id
        assert c.row(run_id).input_version == 1
        assert output_of(c, run_id) == "".join(demo_tokens(merge_inputs(first, second)))
        assert len(c.sub.query("SELECT 1 FROM runs WHERE session_id = :s", s=session)) == 1
    else:
        new = answer["run_id"]
        assert new != run_id and c.row(run_id).input_version == 0
        assert output_of(c, run_id) == "".join(demo_tokens(first))
        assert one_terminal(c, new) == "done"
        assert output_of(c, new) == "".join(demo_tokens(second))


# --- history --------------------------------------------------------------------------


def get(gw: GatewayProcess, user: str, path: str, **params: str) -> httpx.Response:
    return httpx.get(f"{gw.url}{path}", params=params, headers=bearer(user), timeout=10)


def test_a_sessions_runs_newest_first_in_pages_owner_only(cluster: Cluster) -> None:
    c = cluster
    user, other = c.user("hist"), c.user("nosy")
    first = post_run(c.g1, user, demo(1, 1, "one"))["run_id"]
    session = session_of(c, first)
    ids = [first]
    for text_ in ("two", "three"):
        wait_until(lambda: status_is(c, ids[-1], "done"), timeout=30, what="previous done")
        nxt = post_run(c.g1, user, demo(1, 1, text_), session=session)
        assert nxt["merged"] is False
        ids.append(nxt["run_id"])
    wait_until(lambda: status_is(c, ids[-1], "done"), timeout=30, what="last done")
    elsewhere = post_run(c.g1, user, demo(1, 1, "elsewhere"))["run_id"]

    page = get(c.g1, user, f"/v1/sessions/{session}/runs", limit="2")
    assert page.status_code == 200, page.text
    assert [r["run_id"] for r in page.json()["runs"]] == ids[::-1][:2]
    assert page.json()["next_before"] == ids[1]
    rest = get(c.g2, user, f"/v1/sessions/{session}/runs", limit="2", before=ids[1]).json()
    assert [r["run_id"] for r in rest["runs"]] == [ids[0]] and rest["next_before"] is None
    assert rest["runs"][0]["status"] == "done" and rest["runs"][0]["merged_messages"] == 0

    mine = get(c.g1, user, "/v1/runs").json()["runs"]
    assert [r["run_id"] for r in mine] == [elsewhere, *ids[::-1]]
    done = get(c.g1, user, "/v1/runs", status="done", session_id=session).json()["runs"]
    assert [r["run_id"] for r in done] == ids[::-1]
    assert get(c.g1, user, "/v1/runs", status="cancelled").json()["runs"] == []

    # Owner-only: another user's session is unknown, and their listing is their own.
    theirs = get(c.g1, other, f"/v1/sessions/{session}/runs")
    unknown = get(c.g1, other, "/v1/sessions/no-such-session/runs")
    assert theirs.status_code == unknown.status_code == 404 and theirs.json() == unknown.json()
    assert get(c.g1, other, "/v1/runs", session_id=session).json()["runs"] == []
    assert get(c.g1, other, "/v1/runs", before=ids[0]).status_code == 400


@pytest.mark.parametrize(
    ("params", "field_"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"before": "not-a-run"}, "before"),
        ({"status": "finished"}, "status"),
        ({"session_id": "bad session"}, "session_id"),
    ],
)
def test_bad_history_parameters_are_refused_naming_the_field(
    cluster: Cluster, params: dict[str, str], field_: str
) -> None:
    r = get(cluster.g1, "someone", "/v1/runs", **params)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field_


def test_bad_cancel_bodies_are_refused_and_change_nothing(cluster: Cluster) -> None:
    c = cluster
    user = c.user("badcancel")
    run_id = post_run(c.g1, user, demo(1, 1))["run_id"]
    url = f"{c.g1.url}/v1/runs/{run_id}/cancel"
    hdrs = {**bearer(user), "Content-Type": "application/json"}
    cases = [
        (b"{", 400, "body"),
        (b'{"reason": 5}', 422, "reason"),
        (b'{"why": "x"}', 422, "why"),
        (json.dumps({"reason": "x" * 501}).encode(), 422, "reason"),
    ]
    for body, status, field_ in cases:
        r = httpx.post(url, content=body, headers=hdrs, timeout=10)
        assert (r.status_code, r.json()["error"]["field"]) == (status, field_), r.text
    assert httpx.post(url, timeout=10).status_code == 401
    wait_until(lambda: status_is(c, run_id, "done"), timeout=30, what="done")
    assert c.row(run_id).cancel_requested_at is None


def test_openapi_documents_run_control(cluster: Cluster) -> None:
    spec = httpx.get(f"{cluster.g1.url}/openapi.json", timeout=10).json()
    paths = spec["paths"]
    cancel_op = paths["/v1/runs/{run_id}/cancel"]["post"]
    assert {"200", "202", "400", "401", "404", "422", "503"} <= set(cancel_op["responses"])
    assert "reason" in json.dumps(cancel_op["requestBody"])
    listing = paths["/v1/runs"]["get"]
    assert {p["name"] for p in listing["parameters"]} >= {"status", "session_id", "limit", "before"}
    assert {"200", "400", "401"} <= set(listing["responses"])
    session_op = paths["/v1/sessions/{session_id}/runs"]["get"]
    assert {"200", "400", "404"} <= set(session_op["responses"])
    accepted = spec["components"]["schemas"]["RunAccepted"]["properties"]["merged"]
    assert "KODA_MERGE_WINDOW_S" in accepted["description"]


def test_koda_runs_cancel_cancels_through_the_gateway(cluster: Cluster) -> None:
    c = cluster
    user = c.user("cli")
    run_id = post_run(c.g1, user, demo(400, 20))["run_id"]
    wait_until(lambda: "chunk" in c.kinds(run_id), timeout=30, what="output")
    cmd = [sys.executable, "-m", "koda_runtime.cli", "runs", "cancel", run_id, "--user", user]
    out = subprocess.run(  # noqa: S603
        [*cmd, "--reason", "from the shell", "--gateway", c.g2.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["cancel_requested"] is True
    wait_until(lambda: status_is(c, run_id, "cancelled"), timeout=30, what="cancelled")
    assert c.row(run_id).cancel_reason == "from the shell"
    other = subprocess.run(  # noqa: S603
        [sys.executable, "-m", "koda_runtime.cli", "runs", "cancel", run_id, "--user", "intruder"]
        + ["--gateway", c.g2.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert other.returncode == 2 and "404 not_found (run_id)" in other.stderr

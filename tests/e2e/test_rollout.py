"""Bounded-pool drill 3: a rolling deploy with two versions of the worker at once.

The old version is the previous release: the newest one recorded in deploy/releases.txt
(see docs/operations.md "Releases"), extracted with ``git archive`` and run from its own tree with
``python -S`` so nothing of this tree can leak into it through the editable install;
the new one is this tree. The database is migrated first (migration 0003 adds the
nullable ``runs.failures``, which the old code has never heard of and the new code
writes), then the workers roll: two old workers
take traffic, a new one joins, an old one gets SIGTERM, another new one joins, the
last old one gets SIGTERM, while runs keep arriving (every fifth fails once first).
Trigger records come in two shapes at once: from a newer gateway, with a field no
worker knows (``priority``): old and new decoders must ignore it; from an older
gateway, without the optional ``created_at``: new code must not need it.

Afterwards: every run done with its exact output, both versions did runs, no dead
letter, no error in any log, per-user order kept, both SIGTERMs exited 0.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from koda_runtime.kafka import producer_config
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ
from koda_runtime.topics.records.codec import RUN_REQUESTED, headers_for
from tests.fixtures.processes import ROOT, WorkerProcess
from tests.fixtures.runs import Submitter, group_settled, read_topic
from tests.support import wait_until

RELEASES = ROOT / "deploy" / "releases.txt"


def git(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603
        ["git", "-C", str(ROOT), *args],  # noqa: S607
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def releases() -> list[tuple[str, str]]:
    """deploy/releases.txt as (version, commit) pairs, oldest first."""
    pairs = []
    for line in RELEASES.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            version, commit = line.split()
            pairs.append((version, commit))
    return pairs


def previous_release() -> str:
    """The commit of the newest recorded release other than HEAD itself.

    The record is a tracked file, not the tags, because a checkout may carry no tags.
    """
    head = git("rev-parse", "HEAD").stdout.strip()
    version, commit = next((v, c) for v, c in reversed(releases()) if c != head)

    def have() -> bool:
        return git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0

    if not have():
        # A shallow checkout: ask the remote it came from for that one commit.
        git("fetch", "--quiet", "--depth=1", "origin", commit, timeout=300)
    assert have(), (
        f"release {version} ({commit[:10]}, from {RELEASES.name}) is neither in this"
        " checkout nor fetchable from origin"
    )
    return commit


def test_the_release_record_matches_the_tags_that_are_present() -> None:
    for version, commit in releases():
        tagged = git("rev-parse", "--verify", "--quiet", f"refs/tags/{version}^{{commit}}")
        if tagged.returncode == 0:
            assert tagged.stdout.strip() == commit, f"tag {version} is not {commit[:10]}"
        shown = git("show", f"{commit}:pyproject.toml")
        if shown.returncode == 0:
            assert f'version = "{version.removeprefix("v")}"' in shown.stdout, version


@pytest.fixture(scope="module")
def old_tree() -> Iterator[Path]:
    archive = subprocess.run(  # noqa: S603
        ["git", "-C", str(ROOT), "archive", "--format=tar", previous_release()],  # noqa: S607
        capture_output=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory(prefix="koda-old-release-") as d:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(d, filter="data")
        yield Path(d)


class OldWorker(WorkerProcess):
    """A worker of the old release: its own tree first on the import path."""

    def __init__(self, settings: Settings, worker_id: str, tree: Path) -> None:
        super().__init__(settings, worker_id)
        # -S: no site module, so no .pth and no editable-install finder pointing here.
        self.argv = [sys.executable, "-S", "-m", "koda", "worker"]
        self.env["PYTHONPATH"] = f"{tree}:{sysconfig.get_paths()['purelib']}"
        self.cwd = tree


class Traffic:
    """Runs for a few users, one every ~0.15 s, triggers alternating newer/older shape."""

    def __init__(self, env: Settings) -> None:
        self.sub = Submitter(env)
        self.producer = Producer(producer_config(env, "rollout"))
        self.topic = env.names.topic(RUNS)
        self.ids: dict[str, list[str]] = {}
        self.inputs: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.n = 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            user = f"roll-{self.n % 6}"
            inp = {
                "text": f"rollout {self.n}",
                "demo": {"tokens": 5, "delay_ms": 80, "fail_attempts": int(self.n % 5 == 0)},
            }
            run_id = self.sub.submit(user, inp, publish=False)
            record: dict[str, Any] = {"run_id": run_id, "user_id": user, "session_id": f"s-{user}"}
            if self.n % 2 == 0:
                record |= {"created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ"), "priority": 5}
            self.producer.produce(
                self.topic,
                key=user.encode(),
                value=json.dumps(record),
                headers=list(headers_for(RUN_REQUESTED)),
            )
            self.producer.flush(30)
            self.ids.setdefault(user, []).append(run_id)
            self.inputs[run_id] = inp
            self.n += 1
            self._stop.wait(0.15)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def all_ids(self) -> list[str]:
        return [r for ids in self.ids.values() for r in ids]


def settled(env: Settings, members: int) -> None:
    """Until the workers' group has been Stable with ``members`` members, each holding
    partitions, at two checks a second apart.

    A rolling deploy signals an old worker once the new one is in; "assigned partitions"
    in the new worker's log can come before the group's last round (the old members
    still rejoining). The previous release (aiokafka inside Faust) signalled during that
    round commits in its revoke callback, which the broker refuses while the group
    rebalances; it is then dropped from the group after the rebalance timeout and its
    consumer's stop waits as long again: it exits 0, but only after a minute. Signalling
    a settled group tests the handoff, not that release's slow stop.
    """
    admin = AdminClient({"bootstrap.servers": env.kafka_bootstrap})
    group = env.names.group(env.worker_group)

    def stable() -> bool:
        return group_settled(admin, group, members)[0]

    def twice() -> bool:
        if not stable():
            return False
        time.sleep(1.0)  # no round started since: an absence can only be waited out
        return stable()

    wait_until(twice, timeout=90, interval=0.5, what=f"group stable with {members} members")


def test_old_and_new_workers_roll_without_error_or_loss(env: Settings, old_tree: Path) -> None:
    procs: list[WorkerProcess] = []

    def start(w: WorkerProcess) -> WorkerProcess:
        procs.append(w.start())
        return w

    def assigned(w: WorkerProcess) -> bool:
        assert w.alive(), w.log()[-3000:]
        return "assigned partitions" in w.log()

    try:
        o1 = start(OldWorker(env, "old-1", tree=old_tree))
        o2 = start(OldWorker(env, "old-2", tree=old_tree))
        wait_until(lambda: assigned(o1) and assigned(o2), timeout=60, what="old workers up")
        with Traffic(env) as traffic:

            def more_runs(k: int) -> None:
                goal = traffic.n + k
                wait_until(lambda: traffic.n >= goal, timeout=30, what=f"{k} more runs")

            more_runs(15)
            n1 = start(WorkerProcess(env, "new-1"))
            wait_until(lambda: assigned(n1), timeout=60, what="new-1 joined")
            settled(env, 3)
            o1.signal(15)
            assert o1.proc is not None and o1.proc.wait(40) == 0, o1.log()[-3000:]
            n2 = start(WorkerProcess(env, "new-2"))
            wait_until(lambda: assigned(n2), timeout=60, what="new-2 joined")
            more_runs(10)
            settled(env, 3)
            o2.signal(15)
            assert o2.proc is not None and o2.proc.wait(40) == 0, o2.log()[-3000:]
            more_runs(10)
        ids = traffic.all_ids()
        sub = traffic.sub
        wait_until(lambda: sub.all_terminal(ids), timeout=90, what="every run terminal")
        rows = {
            r.id: r
            for r in sub.query(
                "SELECT id, user_id, status, worker_id, started_at, finished_at FROM runs"
                " WHERE id = ANY(:ids)",
                ids=ids,
            )
        }
        assert {r.status for r in rows.values()} == {"done"}
        workers = {r.worker_id for r in rows.values()}
        assert workers & {"old-1", "old-2"} and workers & {"new-1", "new-2"}, workers
        for run_id in ids:
            msgs = sub.messages(run_id)
            assert [m.seq for m in msgs] == list(range(len(msgs)))
            last_reset = max((m.seq for m in msgs if m.kind == "reset"), default=-1)
            text = "".join(m.content for m in msgs if m.kind == "chunk" and m.seq > last_reset)
            assert text == "".join(demo_tokens(traffic.inputs[run_id]))
        for user_ids in traffic.ids.values():
            seq = [rows[r] for r in user_ids]
            for prev, nxt in zip(seq, seq[1:], strict=False):
                assert prev.started_at < nxt.started_at and prev.finished_at <= nxt.started_at
        assert read_topic(env, env.names.topic(RUNS_DLQ), timeout=10) == []
        for w in procs:
            for bad in ("Traceback", "Crashed", "dead-letter"):
                assert bad not in w.log(), f"{w.worker_id}:\n{w.log()[-3000:]}"
        traffic.sub.close()
    finally:
        for w in procs:
            if w.alive():
                w.stop()

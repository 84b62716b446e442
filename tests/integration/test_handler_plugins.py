"""A handler plugged in through an entry point runs real runs in a real worker process.

The plugin is a distribution on the worker's PYTHONPATH (a module and its dist-info),
found the way an installed package is; its factory gets the settings the worker read
from its environment. A worker whose KODA_HANDLER or other setting is wrong stops at
start, naming it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from koda_runtime.localstack import StackInfo
from koda_runtime.settings import Settings
from tests.fixtures.namespaces import make_settings, prepared_namespace
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter
from tests.plugins import ECHO_MODULE, echo_output, install
from tests.support import wait_until

GROUP = "plugin-workers"


@pytest.fixture(scope="module")
def space(stack: StackInfo) -> Iterator[Settings]:
    with prepared_namespace(make_settings(stack, worker_group=GROUP, handler="echo")) as s:
        yield s


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = install(
        tmp_path_factory.mktemp("plugin"),
        "koda_echo_plugin",
        {"echo": "koda_echo_plugin:build"},
        ECHO_MODULE,
    )
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "KODA_WORKER_GROUP": GROUP}


def exited(worker: WorkerProcess, timeout: float = 60.0) -> str:
    """The log of a worker that stopped by itself with status 2."""
    wait_until(lambda: not worker.alive(), timeout=timeout, what="the worker to exit")
    assert worker.proc is not None and worker.proc.returncode == 2, worker.log()[-3000:]
    return worker.log()


def test_a_plugin_handler_runs_runs_in_a_worker(
    space: Settings, plugin_env: dict[str, str]
) -> None:
    submitter = Submitter(space)
    worker = WorkerProcess(space, "plugin-w1", plugin_env).start()
    try:
        texts = ["hello plugin world", "kafka keeps order"]
        ids = [submitter.submit(f"plug-{i}", {"text": t}) for i, t in enumerate(texts)]

        def terminal() -> bool:
            assert worker.alive(), worker.log()[-3000:]
            return submitter.all_terminal(ids)

        wait_until(terminal, timeout=90, interval=0.2, what="the plugin's runs terminal")
        assert set(submitter.statuses(ids).values()) == {"done"}, worker.log()[-3000:]
        for run_id, text in zip(ids, texts, strict=True):
            rows = submitter.messages(run_id)
            # The prefix is KODA_WORKER_GROUP as the worker process read it.
            assert "".join(r.content for r in rows if r.kind == "chunk") == echo_output(GROUP, text)
            assert rows[-1].kind == "done"
            usage = submitter.query(
                "SELECT model, prompt_tokens, completion_tokens FROM usage WHERE run_id = :r",
                r=run_id,
            )
            assert [tuple(u) for u in usage] == [("echo-1", 1, 2)]
    finally:
        worker.stop()
        submitter.close()


def test_a_worker_refuses_an_unknown_handler_and_a_bad_setting_at_start(
    space: Settings, plugin_env: dict[str, str]
) -> None:
    unknown = WorkerProcess(space, "plugin-w2", {**plugin_env, "KODA_HANDLER": "ecoh"}).start()
    log = exited(unknown)
    assert "koda: KODA_HANDLER='ecoh' is not a handler: use one of demo, openai, echo" in log
    bad = WorkerProcess(space, "plugin-w3", {**plugin_env, "KODA_MAX_INFLIGHT": "0"}).start()
    assert "koda: KODA_MAX_INFLIGHT='0': use an integer in 1..4096" in exited(bad)

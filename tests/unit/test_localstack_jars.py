"""The jar lock file and the checked download path (a file:// repository, no network)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from koda_runtime.errors import PrerequisiteError, ServiceError
from koda_runtime.localstack import jars
from koda_runtime.localstack.jars import LockedJar

SHA = "a" * 64


def test_parse_lock_reads_coordinates_and_skips_comments() -> None:
    text = (
        f"# header\n\norg.example:lib:1.2 {SHA}  # trailing\ncom.x:y_2.13:3.0.0-1 {SHA.upper()}\n"
    )
    assert jars.parse_lock(text) == [
        LockedJar("org.example", "lib", "1.2", SHA),
        LockedJar("com.x", "y_2.13", "3.0.0-1", SHA),
    ]


@pytest.mark.parametrize(
    "line",
    ["org.example:lib 1.2", f"org.example:lib:1.2 {SHA[:-1]}", f"a:b:c:d {SHA}", f"a:b:1 {SHA} x"],
)
def test_parse_lock_names_the_bad_line(line: str) -> None:
    with pytest.raises(ServiceError, match=r"lock:2: expected 'group:artifact:version <sha256>'"):
        jars.parse_lock(f"# ok\n{line}\n", source="lock")


def test_parse_lock_refuses_duplicates_and_empty_files() -> None:
    with pytest.raises(ServiceError, match="listed twice"):
        jars.parse_lock(f"a:b:1 {SHA}\na:b:2 {SHA}\n")
    with pytest.raises(ServiceError, match="lists no jars"):
        jars.parse_lock("# nothing\n")


def test_render_lock_roundtrips() -> None:
    entries = [LockedJar("org.example", "lib", "1.2", SHA), LockedJar("b", "c", "3", "b" * 64)]
    assert jars.parse_lock(jars.render_lock(entries)) == entries


def test_the_repository_lock_pins_kafka_and_a_logging_backend() -> None:
    entries = jars.load_lock()
    assert jars.kafka_version(entries) == "4.1.1"
    names = {e.artifact for e in entries}
    assert {"kafka_2.13", "kafka-clients", "slf4j-api", "log4j-core", "log4j-slf4j2-impl"} <= names
    assert "kafka-tools" not in names


def test_url_follows_the_maven_layout() -> None:
    jar = LockedJar("org.apache.kafka", "kafka_2.13", "4.1.1", SHA)
    assert jar.url() == (
        "https://repo1.maven.org/maven2/org/apache/kafka/kafka_2.13/4.1.1/kafka_2.13-4.1.1.jar"
    )


def test_parse_dependency_list_hashes_each_jar(tmp_path: Path) -> None:
    jar = tmp_path / "lib-1.0.jar"
    jar.write_bytes(b"bytes")
    listing = (
        "\nThe following files have been resolved:\n"
        f"   org.example:lib:jar:1.0:runtime:{jar} -- module lib (auto)\n"
    )
    assert jars.parse_dependency_list(listing) == [
        LockedJar("org.example", "lib", "1.0", hashlib.sha256(b"bytes").hexdigest())
    ]


def _repo_with(tmp_path: Path, content: bytes, pinned: bytes) -> tuple[Path, str]:
    jar = LockedJar("org.apache.kafka", "kafka_2.13", "9.9.9", hashlib.sha256(pinned).hexdigest())
    repo = tmp_path / "repo"
    target = repo / "org/apache/kafka/kafka_2.13/9.9.9/kafka_2.13-9.9.9.jar"
    target.parent.mkdir(parents=True)
    target.write_bytes(content)
    lock = tmp_path / "kafka-jars.lock"
    lock.write_text(jars.render_lock([jar]))
    return lock, f"file://{repo}"


def test_ensure_jars_downloads_checks_and_caches(tmp_path: Path) -> None:
    lock, repo = _repo_with(tmp_path, b"jar", pinned=b"jar")
    cache = tmp_path / "cache"
    cp = jars.ensure_jars(lock=lock, cache_root=cache, repository=repo, use_maven=False)
    assert cp == [cache / "kafka-9.9.9" / "lib" / "kafka_2.13-9.9.9.jar"]
    assert cp[0].read_bytes() == b"jar"
    # Cached: a second call needs no repository at all.
    assert jars.ensure_jars(lock=lock, cache_root=cache, repository="file:///nowhere") == cp


def test_ensure_jars_rejects_a_checksum_mismatch_and_caches_nothing(tmp_path: Path) -> None:
    lock, repo = _repo_with(tmp_path, b"tampered", pinned=b"jar")
    cache = tmp_path / "cache"
    with pytest.raises(ServiceError, match="kafka_2.13-9.9.9.jar has sha256"):
        jars.ensure_jars(lock=lock, cache_root=cache, repository=repo, use_maven=False)
    assert list((cache / "kafka-9.9.9" / "lib").iterdir()) == []
    assert [p.name for p in (cache / "kafka-9.9.9").iterdir()] == ["lib"]


def test_unreachable_repository_says_what_to_do(tmp_path: Path) -> None:
    lock, _ = _repo_with(tmp_path, b"jar", pinned=b"jar")
    with pytest.raises(PrerequisiteError, match="unreachable.*HTTPS_PROXY.*apt-get install maven"):
        jars.ensure_jars(
            lock=lock, cache_root=tmp_path, repository="https://127.0.0.1:9", use_maven=False
        )

"""The pinned jars of the local Kafka broker: lock file, cache and fetching.

``deploy/local/kafka-jars.lock`` lists every jar as ``group:artifact:version sha256``.
The jars are cached outside the work tree in ``~/.cache/koda/kafka-<version>/lib``.
When some are missing they are resolved with Maven (``deploy/local/pom.xml``) if
``mvn`` is installed, and whatever is still missing is downloaded from Maven Central
over HTTPS; every new jar must match its sha256 before it enters the cache.

Regenerate the lock after changing the pom: ``python -m koda_runtime.localstack.jars relock``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from koda_runtime import resources
from koda_runtime.errors import PrerequisiteError, ServiceError
from koda_runtime.localstack.procs import disk_error, write_text

log = logging.getLogger(__name__)

MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
KAFKA_ARTIFACT = ("org.apache.kafka", "kafka_2.13")
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.6.1"
LOCK_NAME = "kafka-jars.lock"

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COORD = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class LockedJar:
    """One jar of the lock file: Maven coordinates and the sha256 of its bytes."""

    group: str
    artifact: str
    version: str
    sha256: str

    @property
    def coordinates(self) -> str:
        return f"{self.group}:{self.artifact}:{self.version}"

    @property
    def filename(self) -> str:
        return f"{self.artifact}-{self.version}.jar"

    def url(self, repository: str = MAVEN_CENTRAL) -> str:
        """Where the jar lives in a Maven 2 layout repository."""
        group_path = self.group.replace(".", "/")
        return f"{repository}/{group_path}/{self.artifact}/{self.version}/{self.filename}"


def deploy_dir() -> Path:
    """``deploy/local`` as shipped in the package: the Kafka pom, jar lock and logging config."""
    return resources.deploy_path("local")


def parse_lock(text: str, *, source: str = LOCK_NAME) -> list[LockedJar]:
    """Parse lock file text; blank lines and ``#`` comments are ignored.

    Raises ServiceError naming the line when one is malformed or repeated.
    """
    jars: list[LockedJar] = []
    seen: set[tuple[str, str]] = set()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        coords = fields[0].split(":")
        valid = (
            len(fields) == 2
            and len(coords) == 3
            and all(_COORD.match(part) for part in coords)
            and _SHA256.match(fields[1].lower()) is not None
        )
        if not valid:
            raise ServiceError(
                f"{source}:{lineno}: expected 'group:artifact:version <sha256>', got {raw!r}"
            )
        group, artifact, version = coords
        if (group, artifact) in seen:
            raise ServiceError(f"{source}:{lineno}: {group}:{artifact} is listed twice")
        seen.add((group, artifact))
        jars.append(LockedJar(group, artifact, version, fields[1].lower()))
    if not jars:
        raise ServiceError(f"{source} lists no jars")
    return jars


def render_lock(jars: Iterable[LockedJar]) -> str:
    """The lock file text for ``jars`` (inverse of :func:`parse_lock`)."""
    lines = [
        "# Jars of the local Kafka broker, resolved from deploy/local/pom.xml (runtime scope).",
        "# group:artifact:version sha256 -- regenerate with: "
        "python -m koda_runtime.localstack.jars relock",
    ]
    lines += [f"{jar.coordinates} {jar.sha256}" for jar in jars]
    return "\n".join(lines) + "\n"


def load_lock(path: Path | None = None) -> list[LockedJar]:
    """Read and parse the lock file (default ``deploy/local/kafka-jars.lock``)."""
    path = path or deploy_dir() / LOCK_NAME
    try:
        text = path.read_text()
    except OSError as exc:
        raise PrerequisiteError(f"cannot read the jar lock file {path}: {exc.strerror}") from exc
    return parse_lock(text, source=str(path))


def kafka_version(jars: Sequence[LockedJar]) -> str:
    """The broker version pinned by the lock (the version of ``kafka_2.13``)."""
    for jar in jars:
        if (jar.group, jar.artifact) == KAFKA_ARTIFACT:
            return jar.version
    raise ServiceError(f"the jar lock does not list {':'.join(KAFKA_ARTIFACT)}")


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "koda"


def lib_dir(version: str, cache_root: Path | None = None) -> Path:
    """The jar cache of one Kafka version: ``~/.cache/koda/kafka-<version>/lib``."""
    return (cache_root or default_cache_root()) / f"kafka-{version}" / "lib"


def missing_jars(lib: Path, jars: Iterable[LockedJar]) -> list[LockedJar]:
    """The jars of ``jars`` that ``lib`` lacks (absent or empty)."""
    out = []
    for jar in jars:
        path = lib / jar.filename
        if not path.is_file() or path.stat().st_size == 0:
            out.append(jar)
    return out


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ensure_jars(
    *,
    lock: Path | None = None,
    cache_root: Path | None = None,
    repository: str = MAVEN_CENTRAL,
    use_maven: bool = True,
) -> list[Path]:
    """Make sure every locked jar is cached; return the classpath (one path per jar).

    Missing jars are resolved with ``mvn`` (if on PATH and ``use_maven``), then
    downloaded from ``repository``. Raises PrerequisiteError when they cannot be
    fetched and ServiceError when a checksum does not match.
    """
    jars = load_lock(lock)
    lib = lib_dir(kafka_version(jars), cache_root)
    missing = missing_jars(lib, jars)
    if missing:
        log.info("fetching kafka jars missing=%d cache=%s", len(missing), lib)
        _fetch(missing, lib, repository=repository, use_maven=use_maven)
    return [lib / jar.filename for jar in jars]


def _fetch(missing: list[LockedJar], lib: Path, *, repository: str, use_maven: bool) -> None:
    try:
        lib.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=lib.parent))
    except OSError as exc:
        raise disk_error(exc, lib) from exc
    try:
        mvn = shutil.which("mvn") if use_maven else None
        if mvn:
            try:
                _copy_with_maven(mvn, staging)
            except ServiceError as exc:
                log.warning("maven could not resolve the kafka jars, downloading them: %s", exc)
        for jar in missing:
            target = staging / jar.filename
            if not target.is_file():
                _download(jar, target, repository)
            actual = sha256_file(target)
            if actual != jar.sha256:
                raise ServiceError(
                    f"{jar.filename} has sha256 {actual}, but {LOCK_NAME} pins {jar.sha256}: "
                    "the download is corrupt or deploy/local/pom.xml and the lock disagree "
                    "(regenerate the lock with `python -m koda_runtime.localstack.jars relock`)"
                )
        for jar in missing:
            os.replace(staging / jar.filename, lib / jar.filename)
    except OSError as exc:
        raise disk_error(exc, lib) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _copy_with_maven(mvn: str, dest: Path) -> None:
    pom = deploy_dir() / "pom.xml"
    argv = [
        mvn, "-B", "-q", "-f", str(pom),
        f"{DEPENDENCY_PLUGIN}:copy-dependencies",
        "-DincludeScope=runtime", f"-DoutputDirectory={dest}",
    ]  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)  # noqa: S603
    except subprocess.TimeoutExpired as exc:
        raise ServiceError("mvn copy-dependencies did not finish in 15 minutes") from exc
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise ServiceError(f"mvn copy-dependencies failed: {' | '.join(output)}")


def _download(jar: LockedJar, target: Path, repository: str) -> None:
    url = jar.url(repository)
    if not url.startswith(("https://", "file://")):
        raise ServiceError(f"refusing to download {url}: only https:// repositories are used")
    log.info("downloading url=%s", url)
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, target.open("wb") as out:  # noqa: S310 - scheme checked above
            shutil.copyfileobj(resp, out, 1 << 20)
    except urllib.error.HTTPError as exc:
        raise PrerequisiteError(
            f"Maven Central answered HTTP {exc.code} for {url}: the lock pins an artifact "
            "the repository does not serve; fix deploy/local/pom.xml and relock"
        ) from exc
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PrerequisiteError(
            f"cannot download {url} ({reason}): Maven Central is unreachable; check the "
            "network or set HTTPS_PROXY, or install Maven (apt-get install maven), then retry"
        ) from exc
    except OSError as exc:
        raise disk_error(exc, target) from exc


def relock(pom: Path | None = None, lock: Path | None = None) -> list[LockedJar]:
    """Resolve ``pom`` with Maven and rewrite ``lock`` with each jar's coordinates and sha256."""
    pom = pom or resources.checkout_path("deploy", "local", "pom.xml", what="relock")
    lock = lock or resources.checkout_path("deploy", "local", LOCK_NAME, what="relock")
    mvn = shutil.which("mvn")
    if mvn is None:
        raise PrerequisiteError("relocking needs Maven: apt-get install maven")
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "deps.txt"
        argv = [
            mvn, "-B", "-q", "-f", str(pom), f"{DEPENDENCY_PLUGIN}:list",
            "-DincludeScope=runtime", "-DoutputAbsoluteArtifactFilename=true",
            f"-DoutputFile={listing}",
        ]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True)  # noqa: S603
        if done.returncode != 0:
            raise ServiceError(f"mvn dependency:list failed: {done.stdout[-2000:]}")
        jars = parse_dependency_list(listing.read_text())
    write_text(lock, render_lock(jars))
    return jars


def parse_dependency_list(text: str) -> list[LockedJar]:
    """Turn ``mvn dependency:list -DoutputAbsoluteArtifactFilename`` output into lock entries."""
    jars = []
    for line in text.splitlines():
        head, sep, tail = line.strip().partition(":/")
        if not sep:
            continue
        fields = head.split(":")
        if len(fields) != 5 or fields[2] != "jar":
            raise ServiceError(f"unsupported dependency (classifier or type): {line.strip()}")
        group, artifact, _, version, _scope = fields
        path = Path("/" + tail.split()[0])
        jars.append(LockedJar(group, artifact, version, sha256_file(path)))
    return jars


if __name__ == "__main__":
    if sys.argv[1:] != ["relock"]:
        sys.exit("usage: python -m koda_runtime.localstack.jars relock")
    for entry in relock():
        print(entry.coordinates)

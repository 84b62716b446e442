"""Finding the local stack's ``services.env``, so a second terminal needs no exports.

``koda services up`` and ``make dev`` write the addresses of the local Kafka and
PostgreSQL into ``<state dir>/services.env`` (``.koda/`` by default) and delete it
again on ``koda services down``. :func:`find` looks for that file the way git looks
for ``.git``: in ``$KODA_STATE_DIR`` when it is set, otherwise in ``.koda/`` of the
working directory and each of its parents. Only :mod:`koda_runtime.settings` calls it; the
rules for what the file may change (never prod, never an explicit variable) live
there.

Pure file reading: no network, no ``os.environ``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from koda_runtime.errors import ConfigError

ENV_FILE = "services.env"
DEFAULT_STATE_DIR = ".koda"
# The keys a services.env may set; anything else in the file is refused, so the file
# can never switch on a behaviour behind the user's back. The OTLP endpoint is there
# only after `koda services up --with-tracing` (traces to the local Jaeger).
KEYS = ("KODA_KAFKA_BOOTSTRAP", "KODA_DATABASE_URL", "OTEL_EXPORTER_OTLP_ENDPOINT")


@dataclass(frozen=True)
class StackEnv:
    """The addresses of one local stack, and the file they came from."""

    path: Path
    values: Mapping[str, str]


def find(state_dir: str | None, cwd: Path) -> StackEnv | None:
    """The ``services.env`` of ``state_dir`` (relative to ``cwd``) or, when it is None,
    of the nearest ``.koda/`` at or above ``cwd``; None when there is none."""
    if state_dir:
        candidates = [cwd / state_dir]
    else:
        candidates = [d / DEFAULT_STATE_DIR for d in (cwd, *cwd.parents)]
    for directory in candidates:
        path = directory / ENV_FILE
        if path.is_file():
            return StackEnv(path.resolve(), parse(path))
    return None


def parse(path: Path) -> dict[str, str]:
    """The ``KEY=VALUE`` lines of ``path``; ConfigError names the file and the bad line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or key not in KEYS or not value:
            raise ConfigError(
                f"{path}:{number}: expected KEY=VALUE with KEY one of {', '.join(KEYS)}; "
                "rewrite it with `koda services up`"
            )
        values[key] = value
    return values

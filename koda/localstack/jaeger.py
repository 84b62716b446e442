"""Local Jaeger (``koda services up --with-tracing``, the trace tests): the all-in-one
binary ``make install`` builds into ``build/jaeger-<version>/``, in-memory storage, an
OTLP/HTTP receiver for koda's traces and the UI and query API (``/api/traces``).

Jaeger v1.75 is the v2 binary (an OpenTelemetry Collector distribution): its ports are
set in a YAML config, which :func:`render_config` writes (JSON is YAML). Every port is
on the loopback and chosen free, so a test's Jaeger never meets a developer's.

Layout under ``<state_dir>/jaeger``::

    service.json   the ports, chosen once and reused
    jaeger.yaml    the generated config, rewritten at every start
    jaeger.log, jaeger.pid
"""

from __future__ import annotations

import json
import logging
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from koda_runtime.errors import PrerequisiteError, ServiceError
from koda_runtime.localstack import procs

log = logging.getLogger(__name__)

# The Makefile reads this line to build the same version.
JAEGER_VERSION = "v1.75.0"
PREFERRED_OTLP_PORT = 4318
PREFERRED_UI_PORT = 16686
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
MAX_TRACES = 100_000
_CHECKOUT = Path(__file__).resolve().parents[2]


def binary_path(root: Path = _CHECKOUT) -> Path:
    """Where ``make install`` puts the binary in a checkout."""
    return root / "build" / f"jaeger-{JAEGER_VERSION}" / "jaeger"


def find_binary() -> str:
    """The checkout's built binary, else a ``jaeger`` on PATH; PrerequisiteError if none."""
    built = binary_path()
    if built.is_file():
        return str(built)
    exe = shutil.which("jaeger")
    if exe is None:
        raise PrerequisiteError(
            f"{built} is missing: `make install` builds Jaeger {JAEGER_VERSION} with Go "
            "(about 5 minutes, once), or put a jaeger binary on PATH"
        )
    return exe


@dataclass(frozen=True)
class Ports:
    """Jaeger's loopback ports: OTLP/HTTP in, the UI/query API and its gRPC out, and the
    collector's own metrics (Jaeger's default, 8888, would clash between two)."""

    otlp: int
    ui: int
    query_grpc: int
    metrics: int

    @classmethod
    def free(cls, *, preferred: bool = False) -> Ports:
        otlp, ui, query_grpc, metrics = procs.free_ports(4)
        if preferred and procs.port_is_free(PREFERRED_OTLP_PORT):
            otlp = PREFERRED_OTLP_PORT
        if preferred and procs.port_is_free(PREFERRED_UI_PORT):
            ui = PREFERRED_UI_PORT
        return cls(otlp, ui, query_grpc, metrics)

    @property
    def endpoint(self) -> str:
        """The value of OTEL_EXPORTER_OTLP_ENDPOINT for koda's processes."""
        return f"http://127.0.0.1:{self.otlp}"

    @property
    def url(self) -> str:
        """The UI; its query API is under ``/api``."""
        return f"http://127.0.0.1:{self.ui}"


def render_config(ports: Ports) -> str:
    """Jaeger's config: OTLP/HTTP receiver, in-memory storage, query API, no other port."""
    config: dict[str, Any] = {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query"],
            "pipelines": {
                "traces": {
                    "receivers": ["otlp"],
                    "processors": ["batch"],
                    "exporters": ["jaeger_storage_exporter"],
                }
            },
            "telemetry": {
                "resource": {"service.name": "jaeger"},
                "metrics": {
                    "level": "basic",
                    "readers": [
                        {
                            "pull": {
                                "exporter": {
                                    "prometheus": {"host": "127.0.0.1", "port": ports.metrics}
                                }
                            }
                        }
                    ],
                },
                "logs": {"level": "warn"},
            },
        },
        "extensions": {
            "jaeger_query": {
                "storage": {"traces": "memstore"},
                # No traces of its own (its default): it would export them to
                # 127.0.0.1:4317, where nothing listens, and wait 10 s at every stop.
                "enable_tracing": False,
                "http": {"endpoint": f"127.0.0.1:{ports.ui}"},
                "grpc": {"endpoint": f"127.0.0.1:{ports.query_grpc}"},
            },
            "jaeger_storage": {"backends": {"memstore": {"memory": {"max_traces": MAX_TRACES}}}},
        },
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"127.0.0.1:{ports.otlp}"}}}},
        # Short batches: a test waits for its spans through the query API.
        "processors": {"batch": {"timeout": "200ms"}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memstore"}},
    }
    return json.dumps(config, indent=2) + "\n"


def ready(ports: Ports) -> bool:
    """The query API answers (the receiver starts before it)."""
    try:
        with urllib.request.urlopen(f"{ports.url}/api/services", timeout=1) as response:  # noqa: S310 - loopback
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def argv(exe: str, config: Path) -> list[str]:
    return [exe, f"--config=file:{config}"]


@dataclass(frozen=True)
class JaegerPaths:
    root: Path

    @classmethod
    def of(cls, state_dir: Path) -> JaegerPaths:
        return cls(state_dir / "jaeger")

    @property
    def service(self) -> Path:
        return self.root / "service.json"

    @property
    def config(self) -> Path:
        return self.root / "jaeger.yaml"

    @property
    def log(self) -> Path:
        return self.root / "jaeger.log"

    @property
    def pid(self) -> Path:
        return self.root / "jaeger.pid"


def load_ports(state_dir: Path) -> Ports | None:
    try:
        return Ports(**json.loads(JaegerPaths.of(state_dir).service.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise ServiceError(
            f"{JaegerPaths.of(state_dir).service} is unreadable ({exc}): delete it to pick "
            "new ports"
        ) from exc


def running_pid(state_dir: Path) -> int | None:
    paths = JaegerPaths.of(state_dir)
    return procs.running_pid(paths.pid, str(paths.config))


def start(state_dir: Path, *, preferred: bool = True) -> Ports:
    """Start Jaeger (no-op if it runs); its ports once the query API answers. The first
    start chooses the ports: Jaeger's own (4318, 16686) when ``preferred`` and free.

    Raises PrerequisiteError when the binary is missing and ServiceError when it does
    not start (with its log's tail)."""
    state_dir = state_dir.resolve()
    exe = find_binary()
    paths = JaegerPaths.of(state_dir)
    ports = load_ports(state_dir)
    if ports is None:
        ports = Ports.free(preferred=preferred)
        procs.write_text(paths.service, json.dumps(ports.__dict__) + "\n")
    if running_pid(state_dir) is None:
        procs.require_free_port(ports.otlp, "Jaeger (OTLP)", state_dir)
        procs.require_free_port(ports.ui, "Jaeger (UI)", state_dir)
        procs.write_text(paths.config, render_config(ports))
        pid = procs.spawn_detached(argv(exe, paths.config), output=paths.log, cwd=paths.root)
        procs.write_text(paths.pid, f"{pid}\n")
        log.info("jaeger started pid=%d otlp=%d ui=%d", pid, ports.otlp, ports.ui)
    if not procs.wait_until(lambda: ready(ports), timeout_s=READY_TIMEOUT_S):
        tail = procs.tail(paths.log)
        raise ServiceError(
            f"Jaeger is not ready on {ports.url} after {READY_TIMEOUT_S:.0f}s "
            f"(log: {paths.log})\n{tail}"
        )
    return ports


def env_lines(state_dir: Path) -> list[str]:
    """The services.env line that makes koda's processes trace to this state dir's
    Jaeger while it runs; none otherwise."""
    ports = load_ports(state_dir.resolve())
    if ports is None or running_pid(state_dir.resolve()) is None:
        return []
    return [f"OTEL_EXPORTER_OTLP_ENDPOINT={ports.endpoint}"]


def stop(state_dir: Path, *, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM Jaeger and wait (its traces are in memory: they go with it)."""
    state_dir = state_dir.resolve()
    pid = running_pid(state_dir)
    paths = JaegerPaths.of(state_dir)
    if pid is not None:
        procs.terminate(pid, name="Jaeger", timeout_s=timeout_s, log_file=paths.log)
    paths.pid.unlink(missing_ok=True)


def status(state_dir: Path) -> dict[str, Any] | None:
    """``{url, endpoint, pid, running}``, or None if Jaeger was never started here."""
    state_dir = state_dir.resolve()
    ports = load_ports(state_dir)
    if ports is None:
        return None
    pid = running_pid(state_dir)
    return {
        "url": ports.url,
        "endpoint": ports.endpoint,
        "pid": pid,
        "running": pid is not None and ready(ports),
    }

"""Local Prometheus (``koda services up --with-prometheus``): the system's binary, its
own data under the state dir, scraping what ``make dev`` runs and loading the alerts.

Layout under ``<state_dir>/prometheus``::

    service.json       the port (9090 when free the first time), chosen once and reused
    prometheus.yml     the generated config, rewritten at every start
    targets/*.json     scrape targets (file_sd): ``koda dev`` writes dev.json with its
                       gateway and workers and removes it when it stops
    data/              the TSDB
    prometheus.log, prometheus.pid

Targets are files rather than a fixed list because the worker count and ports are
only known to ``koda dev`` (``--workers``, KODA_WORKER_PORT, KODA_GATEWAY_PORT);
Prometheus re-reads them on change, so it may start before or after ``make dev``.
The rules are deploy/prometheus/alerts.yml, shipped in the package.
"""

from __future__ import annotations

import json
import logging
import shutil
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from koda_runtime import resources
from koda_runtime.errors import PrerequisiteError, ServiceError
from koda_runtime.localstack import procs

log = logging.getLogger(__name__)

PREFERRED_PORT = 9090
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
SCRAPE_INTERVAL_S = 5  # local: a panel or an alert moves within seconds
GATEWAY_JOB = "koda-gateway"
WORKER_JOB = "koda-worker"
DEV_TARGETS = "dev.json"


@dataclass(frozen=True)
class PromPaths:
    root: Path

    @classmethod
    def of(cls, state_dir: Path) -> PromPaths:
        return cls(state_dir / "prometheus")

    @property
    def service(self) -> Path:
        return self.root / "service.json"

    @property
    def config(self) -> Path:
        return self.root / "prometheus.yml"

    @property
    def targets(self) -> Path:
        return self.root / "targets"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "prometheus.log"

    @property
    def pid(self) -> Path:
        return self.root / "prometheus.pid"


def alerts_file() -> Path:
    """deploy/prometheus/alerts.yml as shipped in the package."""
    return resources.deploy_path("prometheus", "alerts.yml")


def find_binary() -> str:
    exe = shutil.which("prometheus")
    if exe is None:
        raise PrerequisiteError(
            "prometheus not found: run `make install` (it installs Debian's prometheus "
            "package) or `apt-get install prometheus`"
        )
    return exe


def render_config(targets_dir: Path, alerts: Path) -> str:
    """The config: both koda jobs from file_sd target files, and the alert rules.

    JSON is YAML, so the config is written with ``json.dumps`` (no YAML writer needed).
    """

    def job(name: str) -> dict[str, Any]:
        return {
            "job_name": name,
            "metrics_path": "/metrics",
            "file_sd_configs": [{"files": [str(targets_dir / "*.json")], "refresh_interval": "5s"}],
            # each target file holds both jobs; keep only this job's targets
            "relabel_configs": [
                {"source_labels": ["koda_job"], "regex": name, "action": "keep"},
                {"regex": "koda_job", "action": "labeldrop"},
            ],
        }

    config = {
        "global": {
            "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
            "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
        },
        "rule_files": [str(alerts)],
        "scrape_configs": [job(GATEWAY_JOB), job(WORKER_JOB)],
    }
    return json.dumps(config, indent=2) + "\n"


def target_groups(gateway: Sequence[str], workers: Sequence[str]) -> list[dict[str, Any]]:
    """file_sd groups for ``host:port`` gateways and workers."""
    return [
        {"targets": list(gateway), "labels": {"koda_job": GATEWAY_JOB}},
        {"targets": list(workers), "labels": {"koda_job": WORKER_JOB}},
    ]


def write_targets(
    state_dir: Path, name: str, gateway: Sequence[str], workers: Sequence[str]
) -> Path:
    """Write (atomically) the target file ``name`` that a running Prometheus picks up."""
    path = PromPaths.of(state_dir.resolve()).targets / name
    procs.write_text(path, json.dumps(target_groups(gateway, workers), indent=2) + "\n")
    return path


def remove_targets(state_dir: Path, name: str) -> None:
    (PromPaths.of(state_dir.resolve()).targets / name).unlink(missing_ok=True)


def load_port(state_dir: Path) -> int | None:
    try:
        return int(json.loads(PromPaths.of(state_dir).service.read_text())["port"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ServiceError(
            f"{PromPaths.of(state_dir).service} is unreadable ({exc}): delete it to pick a new port"
        ) from exc


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def running_pid(state_dir: Path) -> int | None:
    paths = PromPaths.of(state_dir)
    return procs.running_pid(paths.pid, str(paths.config))


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"{url(port)}/-/ready", timeout=1) as response:  # noqa: S310 - loopback
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start(state_dir: Path) -> str:
    """Start Prometheus (no-op if it runs); return its URL once ``/-/ready`` answers.

    Raises PrerequisiteError when the binary or the alert rules are missing and
    ServiceError when it does not start (with the reason from its log).
    """
    state_dir = state_dir.resolve()
    exe = find_binary()
    paths = PromPaths.of(state_dir)
    alerts = alerts_file()
    port = load_port(state_dir)
    if port is None:
        port = PREFERRED_PORT if procs.port_is_free(PREFERRED_PORT) else procs.free_port()
        procs.write_text(paths.service, json.dumps({"port": port}) + "\n")
    if running_pid(state_dir) is None:
        procs.require_free_port(port, "Prometheus", state_dir)
        paths.targets.mkdir(parents=True, exist_ok=True)
        paths.data.mkdir(parents=True, exist_ok=True)
        procs.write_text(paths.config, render_config(paths.targets, alerts))
        pid = procs.spawn_detached(
            [exe, f"--config.file={paths.config}", f"--storage.tsdb.path={paths.data}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=7d"],
            output=paths.log, cwd=paths.root,
        )  # fmt: skip
        procs.write_text(paths.pid, f"{pid}\n")
        log.info("prometheus started pid=%d port=%d", pid, port)
    if not procs.wait_until(lambda: _ready(port), timeout_s=READY_TIMEOUT_S):
        tail = procs.tail(paths.log)
        reason = _last_error(tail) or "no reason in its log"
        raise ServiceError(
            f"Prometheus on port {port} is not ready after {READY_TIMEOUT_S:.0f}s: {reason} "
            f"(log: {paths.log})\n{tail}"
        )
    return url(port)


def _last_error(text: str) -> str:
    """The last ``level=error`` line of Prometheus's log (logfmt), trimmed."""
    for line in reversed(text.splitlines()):
        if "level=error" in line or "level=fatal" in line:
            return line.strip()[:300]
    return procs.last_failure(text)


def stop(state_dir: Path, *, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM Prometheus (it flushes its head block) and wait; SIGKILL after ``timeout_s``."""
    state_dir = state_dir.resolve()
    pid = running_pid(state_dir)
    paths = PromPaths.of(state_dir)
    if pid is not None:
        procs.terminate(pid, name="Prometheus", timeout_s=timeout_s, log_file=paths.log)
    paths.pid.unlink(missing_ok=True)


def status(state_dir: Path) -> dict[str, Any] | None:
    """``{port, url, pid, running}``, or None if Prometheus was never started here."""
    state_dir = state_dir.resolve()
    port = load_port(state_dir)
    if port is None:
        return None
    pid = running_pid(state_dir)
    return {"port": port, "url": url(port), "pid": pid, "running": pid is not None and _ready(port)}

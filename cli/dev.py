"""``koda dev``: the whole system on the local stack, in the foreground.

Starts Kafka and PostgreSQL (``koda services up``), applies migrations and
topics, then runs one gateway, two workers with the demo handler, one scheduler and
the chunk-topic upkeep (``koda chunks compact --every 60``, the compactor role) and the
webhook dispatcher (``koda webhooks dispatch``) as child processes. Each child's output
is printed line by line behind its name (``worker-1  | ...``). Ctrl-C (or SIGTERM) stops
the children gracefully, then the services.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from koda_runtime.localstack import down, env_lines, prometheus, up
from koda_runtime.settings import Settings

CHILD_GRACE_S = 25.0
DEV_WORKER_PORT = 9101  # worker i serves /livez, /readyz, /metrics on DEV_WORKER_PORT + i
# The compactor's round interval, as ROLE=compactor runs it (cli/processes.py's is the same).
DEV_COMPACTOR_EVERY_S = 60
PREFIX_WIDTH = 10  # "scheduler" and "compactor" fit, then " | "


@dataclass(frozen=True)
class ChildSpec:
    """One process of ``koda dev``: its name (the prefix of its lines), argv and env."""

    name: str
    argv: list[str]
    env: dict[str, str]


def child_specs(
    koda: list[str], env: Mapping[str, str], *, workers: int, base_port: int
) -> list[ChildSpec]:
    """The gateway, the scheduler, the compactor, the webhook dispatcher and ``workers``
    workers. Worker i serves its probes on ``base_port + i``, the compactor on the port
    after the last worker's, the dispatcher on the one after that."""
    compactor_port = base_port + workers
    specs = [
        ChildSpec("gateway", [*koda, "gateway"], dict(env)),
        ChildSpec("scheduler", [*koda, "scheduler"], dict(env)),
        ChildSpec(
            "compactor",
            [
                *koda,
                *("chunks", "compact", "--every", str(DEV_COMPACTOR_EVERY_S)),
                *("--port", str(compactor_port)),
            ],
            dict(env),
        ),
        # The webhook dispatcher, on the port after the compactor's.
        ChildSpec(
            "webhooks",
            [*koda, "webhooks", "dispatch", "--port", str(compactor_port + 1)],
            dict(env),
        ),
    ]
    for i in range(workers):
        worker_env = {
            **env,
            "KODA_WORKER_ID": f"dev-worker-{i + 1}",
            "KODA_WORKER_PORT": str(base_port + i),
        }
        specs.append(ChildSpec(f"worker-{i + 1}", [*koda, "worker"], worker_env))
    return specs


_print_lock = threading.Lock()


def pump(name: str, source: IO[bytes], sink: IO[str]) -> None:
    """Copy ``source``'s lines to ``sink``, each behind ``name`` (until end of file)."""
    prefix = f"{name:<{PREFIX_WIDTH}}| "
    for raw in iter(source.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        with _print_lock:
            sink.write(prefix + line + "\n")
            sink.flush()


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    printer: threading.Thread


def _spawn(spec: ChildSpec) -> Child:
    proc = subprocess.Popen(  # noqa: S603 - our own executable
        spec.argv, env=spec.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert proc.stdout is not None
    printer = threading.Thread(
        target=pump, args=(spec.name, proc.stdout, sys.stdout), name=f"dev-{spec.name}"
    )
    printer.daemon = True
    printer.start()
    return Child(spec, proc, printer)


def run_dev(state_dir: Path, environ: Mapping[str, str], *, workers: int = 2) -> int:
    """Run until interrupted; return the exit status."""
    info = up(state_dir)
    env = dict(environ)
    env.update(line.split("=", 1) for line in env_lines(info))  # type: ignore[misc]
    env.setdefault("APP_ENV", "dev")
    settings = Settings.from_env(env)

    from koda_runtime.schemas.migrate import upgrade
    from koda_runtime.topics.admin import apply_topics, check_topics

    upgrade(settings)
    apply_topics(settings)
    drifts = check_topics(settings)
    if drifts:
        print("koda: topic drift: " + "; ".join(map(str, drifts)), file=sys.stderr)
        return 1
    koda = [sys.executable, "-m", "koda_runtime.cli"]
    env.setdefault("KODA_EXPECTED_WORKERS", str(workers))
    base_port = settings.worker_port or DEV_WORKER_PORT
    specs = child_specs(koda, env, workers=workers, base_port=base_port)
    children = [_spawn(spec) for spec in specs]
    port = settings.gateway_port
    # What a Prometheus of `koda services up --with-prometheus` scrapes (it may start later).
    prometheus.write_targets(
        state_dir,
        prometheus.DEV_TARGETS,
        [f"127.0.0.1:{port}"],
        [f"127.0.0.1:{base_port + i}" for i in range(workers)],
    )
    print("\n".join(env_lines(info)))
    print(
        f"koda dev: gateway on http://127.0.0.1:{port}, {workers} workers, a scheduler,"
        " the compactor; Ctrl-C stops all"
    )
    print(f"console: http://127.0.0.1:{port}/console (sign in with the token dev:alice)")
    print(
        f"workers: http://127.0.0.1:{base_port}..{base_port + workers - 1}/metrics"
        f" (/livez, /readyz); heartbeats: http://127.0.0.1:{port}/admin/workers"
    )
    print(f"compactor: http://127.0.0.1:{base_port + workers}/readyz (/livez, /metrics)")
    print(f"webhooks: http://127.0.0.1:{base_port + workers + 1}/readyz (/livez, /metrics)")
    print(
        f"try: curl -s -X POST http://127.0.0.1:{port}/v1/runs "
        "-H 'Authorization: Bearer dev:alice' -H 'Content-Type: application/json' "
        """-d '{"input": {"text": "hello koda"}}'"""
    )
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    try:
        while not stopping:
            for child in children:
                if child.proc.poll() is not None:
                    code = child.proc.returncode
                    print(f"koda dev: {child.spec.name} exited with {code}", file=sys.stderr)
                    stopping, status = True, 1
            time.sleep(0.5)
    finally:
        for child in children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + CHILD_GRACE_S
        for child in children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            child.printer.join(5)  # its last lines
        prometheus.remove_targets(state_dir, prometheus.DEV_TARGETS)
        down(state_dir)
        print("koda dev: stopped")
    return status


def main() -> None:
    sys.exit(run_dev(Path(os.environ.get("KODA_STATE_DIR", ".koda")), os.environ))

"""``koda dev``: the whole system on the local stack, in the foreground.

Starts Kafka and PostgreSQL (``koda services up``), applies migrations and
topics, then runs one gateway, two workers with the demo handler and one scheduler
as child processes. Ctrl-C (or SIGTERM) stops the children gracefully, then the services.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import cast

from koda_runtime.localstack import down, env_lines, prometheus, up
from koda_runtime.settings import Settings

CHILD_GRACE_S = 25.0
DEV_WORKER_PORT = 9101  # worker i serves /livez, /readyz, /metrics on DEV_WORKER_PORT + i


def _spawn(argv: list[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=dict(env))  # noqa: S603 - our own executable


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
    koda = [sys.executable, "-m", "koda_runtime"]
    env.setdefault("KODA_EXPECTED_WORKERS", str(workers))
    children = [_spawn([*koda, "gateway"], env), _spawn([*koda, "scheduler"], env)]
    base_port = settings.worker_port or DEV_WORKER_PORT
    for i in range(workers):
        children.append(
            _spawn(
                [*koda, "worker"],
                {
                    **env,
                    "KODA_WORKER_ID": f"dev-worker-{i + 1}",
                    "KODA_WORKER_PORT": str(base_port + i),
                },
            )
        )
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
        f"koda dev: gateway on http://127.0.0.1:{port}, {workers} workers, a scheduler;"
        " Ctrl-C stops all"
    )
    print(f"console: http://127.0.0.1:{port}/console (sign in with the token dev:alice)")
    print(
        f"workers: http://127.0.0.1:{base_port}..{base_port + workers - 1}/metrics"
        f" (/livez, /readyz); heartbeats: http://127.0.0.1:{port}/admin/workers"
    )
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
                if child.poll() is not None:
                    name = " ".join(str(a) for a in cast(list[str], child.args)[3:4])
                    print(f"koda dev: {name} exited with {child.returncode}", file=sys.stderr)
                    stopping, status = True, 1
            time.sleep(0.5)
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + CHILD_GRACE_S
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        prometheus.remove_targets(state_dir, prometheus.DEV_TARGETS)
        down(state_dir)
        print("koda dev: stopped")
    return status


def main() -> None:
    sys.exit(run_dev(Path(os.environ.get("KODA_STATE_DIR", ".koda")), os.environ))

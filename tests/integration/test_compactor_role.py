"""The compactor role for real: `koda chunks compact --every 1 --port P` against the local
Kafka and Postgres completes rounds, says so on /readyz and in
koda_chunk_upkeep_last_pass_timestamp_seconds (what KodaChunkUpkeepLate watches), keeps
completing them, and stops on SIGTERM with status 0."""

from __future__ import annotations

import httpx

from koda_runtime.settings import Settings
from tests.fixtures.processes import ChildProcess, free_port, koda_argv, settings_env
from tests.support import wait_until


def sample(body: str, name: str) -> float | None:
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_the_compactor_serves_probes_and_its_last_round(env: Settings) -> None:
    port = free_port()
    argv = [*koda_argv("chunks"), "compact", "--every", "1", "--port", str(port)]
    compactor = ChildProcess("compactor", argv, settings_env(env)).start()
    base = f"http://127.0.0.1:{port}"
    try:

        def answered(path: str) -> httpx.Response | None:
            compactor.check()
            try:
                return httpx.get(f"{base}{path}", timeout=2)
            except httpx.HTTPError:
                return None

        ready = wait_until(
            lambda: (r := answered("/readyz")) is not None and r.status_code == 200 and r,
            timeout=60,
            interval=0.2,
            what="the compactor's first completed round",
        )
        assert ready.json()["ok"] is True and ready.json()["rounds"] >= 1
        live = answered("/livez")
        assert live is not None and live.status_code == 200

        def last_pass() -> float | None:
            response = answered("/metrics")
            if response is None:
                return None
            return sample(response.text, "koda_chunk_upkeep_last_pass_timestamp_seconds")

        first = wait_until(lambda: (v := last_pass()) and v > 0 and v, timeout=30, interval=0.2)
        later = wait_until(
            lambda: (v := last_pass()) and v > first and v,
            timeout=30,
            interval=0.2,
            what="a later round",
        )
        assert later > first
        metrics = answered("/metrics")
        assert metrics is not None
        assert sample(metrics.text, "koda_chunk_upkeep_interval_seconds") == 1.0
    finally:
        status = compactor.stop(30)
    assert status == 0, compactor.log()

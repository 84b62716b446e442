"""Toxiproxy for the chaos stack: the server process, a client of its HTTP API, and the
per-process network (every process's own proxies to each Kafka node and to PostgreSQL).

The server is built by ``make install`` from the Go module proxy into
``build/toxiproxy-<version>/``; this module only starts it. Its API (v2):
``POST /proxies`` creates a proxy, ``POST /proxies/<name>`` with ``{"enabled": false}``
disables it (closing its connections and refusing new ones), toxics are added with
``POST /proxies/<name>/toxics`` and removed with ``DELETE .../toxics/<toxic>``, and
``POST /reset`` enables every proxy and removes every toxic.

**Slots.** A process of the chaos stack runs in a *slot* (``w1``.. for workers, ``gw``
for the gateway). Every Kafka node has a listener per slot whose advertised address is
that slot's proxy to the node (``koda_runtime.localstack.kafka_cluster.SlotListener``),
so a process that bootstraps through its slot's proxies makes every broker connection
through them; its PostgreSQL URL points at its slot's proxy to PostgreSQL. A fault on
a slot's proxies hits that one process and nothing else.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.engine import make_url

from koda_runtime.localstack.kafka_cluster import ClusterSpec
from tests.fixtures.processes import ROOT, free_port

# The Makefile reads this line to build the same version.
TOXIPROXY_VERSION = "v2.5.0"
BINARY = ROOT / "build" / f"toxiproxy-{TOXIPROXY_VERSION}" / "toxiproxy-server"

# Workers take a free worker slot when they start (a SIGTERM'd worker still drains while
# its replacement starts, so there are more slots than workers); the gateway has its own.
WORKER_SLOTS = ("w1", "w2", "w3", "w4", "w5")
GATEWAY_SLOT = "gw"
SLOTS = (*WORKER_SLOTS, GATEWAY_SLOT)


class ToxiproxyError(RuntimeError):
    """The Toxiproxy server is missing, did not start, or refused a request."""


class Toxiproxy:
    """A client of one Toxiproxy server's HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=10.0)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        resp = self.http.request(method, path, json=body)
        if resp.status_code >= 300:
            raise ToxiproxyError(f"{method} {path} -> HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json() if resp.content else None

    def version(self) -> str:
        return self.http.get("/version").text.strip()

    def create(self, name: str, listen: str, upstream: str) -> None:
        self._call("POST", "/proxies", {"name": name, "listen": listen, "upstream": upstream})

    def proxies(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/proxies")
        return result

    def set_enabled(self, name: str, enabled: bool) -> None:
        self._call("POST", f"/proxies/{name}", {"enabled": enabled})

    def add_toxic(
        self,
        proxy: str,
        name: str,
        kind: str,
        attributes: dict[str, int],
        stream: str = "downstream",
    ) -> None:
        body = {"name": name, "type": kind, "stream": stream, "attributes": attributes}
        self._call("POST", f"/proxies/{proxy}/toxics", body)

    def remove_toxic(self, proxy: str, name: str) -> None:
        self._call("DELETE", f"/proxies/{proxy}/toxics/{name}")

    def reset(self) -> None:
        self._call("POST", "/reset")

    def close(self) -> None:
        self.http.close()


@dataclass
class ToxiproxyServer:
    """The ``toxiproxy-server`` process, on a free port, its log in ``log_path``."""

    log_path: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 15.0) -> Toxiproxy:
        if not BINARY.is_file():
            raise ToxiproxyError(
                f"{BINARY} is missing: `make install` builds it (Go {TOXIPROXY_VERSION} "
                "module from the Go module proxy)"
            )
        self.port = free_port()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(  # noqa: S603
                [str(BINARY), "-host", "127.0.0.1", "-port", str(self.port)],
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        client = Toxiproxy(f"http://127.0.0.1:{self.port}")
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise ToxiproxyError(f"toxiproxy-server exited ({code}); log {self.log_path}")
            try:
                client.version()
                return client
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise ToxiproxyError(
                        f"toxiproxy-server not answering after {timeout_s:.0f}s; "
                        f"log {self.log_path}"
                    ) from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Slot:
    """One process's proxies: one per Kafka node, one to PostgreSQL."""

    name: str
    kafka_proxies: list[str]
    pg_proxy: str
    kafka_bootstrap: str
    database_url: str

    @property
    def proxies(self) -> list[str]:
        return [*self.kafka_proxies, self.pg_proxy]


@dataclass
class Network:
    """Every slot's proxies on one Toxiproxy server, and the faults on them."""

    api: Toxiproxy
    slots: dict[str, Slot] = field(default_factory=dict)

    @classmethod
    def build(cls, api: Toxiproxy, cluster: ClusterSpec, database_url: str) -> Network:
        """A proxy per (slot, Kafka node) on the node's advertised slot port, and a proxy
        per slot to PostgreSQL on a free port."""
        net = cls(api)
        pg = make_url(database_url)
        for slot in cluster.slots:
            kafka = []
            for node in cluster.nodes:
                s = node.slot(slot)
                name = f"{slot}-kafka{node.node_id}"
                api.create(name, f"127.0.0.1:{s.advertised_port}", f"127.0.0.1:{s.port}")
                kafka.append(name)
            pg_port = free_port()
            api.create(f"{slot}-pg", f"127.0.0.1:{pg_port}", f"{pg.host}:{pg.port}")
            url = pg.set(host="127.0.0.1", port=pg_port).render_as_string(hide_password=False)
            net.slots[slot] = Slot(slot, kafka, f"{slot}-pg", cluster.slot_bootstrap(slot), url)
        return net

    def env(self, slot: str) -> dict[str, str]:
        """The environment that makes a process connect through ``slot``'s proxies."""
        s = self.slots[slot]
        return {"KODA_KAFKA_BOOTSTRAP": s.kafka_bootstrap, "KODA_DATABASE_URL": s.database_url}

    def cut_kafka(self, slot: str, cut: bool = True) -> None:
        for name in self.slots[slot].kafka_proxies:
            self.api.set_enabled(name, not cut)

    def cut_pg(self, slot: str, cut: bool = True) -> None:
        self.api.set_enabled(self.slots[slot].pg_proxy, not cut)

    def latency(self, proxies: list[str], ms: int, jitter_ms: int) -> None:
        """``ms`` ± ``jitter_ms`` on every packet both ways through ``proxies``."""
        for name in proxies:
            for stream in ("downstream", "upstream"):
                attrs = {"latency": ms, "jitter": jitter_ms}
                self.api.add_toxic(name, f"latency-{stream}", "latency", attrs, stream)

    def reset_peer(self, proxy: str) -> None:
        """Reset (TCP RST) every connection through ``proxy``, and new ones, until healed."""
        self.api.add_toxic(proxy, "reset", "reset_peer", {"timeout": 0})

    def heal(self) -> None:
        """Every proxy enabled, every toxic removed."""
        self.api.reset()

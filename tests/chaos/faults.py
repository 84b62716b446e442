"""The fault kinds of the chaos run; each injects one fault and waits until it is over.

Every fault returns a :class:`Fault` with what it measured:

* ``handoff_s`` (worker faults): from the signal until every partition the victim held
  is owned by another worker (a new epoch in ``partition_epochs``). kill -9 and SIGSTOP
  wait out the session timeout; SIGTERM drains up to the handoff ceiling and leaves.
* ``back_at`` (broker, database, gateway faults): when the service was up again;
  ``recover_s`` is filled in later from the commit monitor (first growth of the
  group's committed offsets after ``back_at``) or, for the gateway, is the time to
  ``/readyz`` 200.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from random import Random

import httpx

from koda_runtime.localstack import (
    kafka_node_kill,
    kafka_node_start,
    kafka_node_stop,
    pg_kill,
    pg_start,
    pg_stop,
)
from tests.chaos.cluster import Pool, Postgres, Stack
from tests.fixtures.processes import WorkerProcess

WORKER_KILL9 = "worker kill -9"
WORKER_SIGTERM = "worker SIGTERM + replacement"
WORKER_SIGSTOP = "worker SIGSTOP/SIGCONT"
BROKER_RESTART = "broker restart"
BROKER_KILL = "broker kill -9 + start"
PG_RESTART = "postgres restart"
GATEWAY_RESTART = "gateway kill -9 + start"

WORKER_KINDS = (WORKER_KILL9, WORKER_SIGTERM, WORKER_SIGSTOP)
SERVICE_KINDS = (BROKER_RESTART, BROKER_KILL, PG_RESTART)


def kinds_for(brokers: int) -> tuple[str, ...]:
    """Every kind that applies to a cluster of ``brokers`` (kill one of three needs three)."""
    kinds = [
        WORKER_KILL9,
        WORKER_SIGTERM,
        WORKER_SIGSTOP,
        BROKER_RESTART,
        PG_RESTART,
        GATEWAY_RESTART,
    ]
    if brokers >= 3:
        kinds.insert(4, BROKER_KILL)
    return tuple(kinds)


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    back_at: float | None = None
    handoff_s: float | None = None
    recover_s: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Injector:
    """Injects faults into ``pool`` and ``stack``; ``db`` reads partition ownership."""

    stack: Stack
    pool: Pool
    db: Postgres
    rng: Random
    session_timeout_s: float
    down_s: float = 3.0
    handoff_timeout_s: float = 90.0
    _broker_turn: int = 0
    _pg_turn: int = 0

    async def inject(self, kind: str) -> Fault:
        fn: dict[str, Callable[[], Awaitable[Fault]]] = {
            WORKER_KILL9: self.worker_kill9,
            WORKER_SIGTERM: self.worker_sigterm,
            WORKER_SIGSTOP: self.worker_sigstop,
            BROKER_RESTART: self.broker_restart,
            BROKER_KILL: self.broker_kill,
            PG_RESTART: self.pg_restart,
            GATEWAY_RESTART: self.gateway_restart,
        }
        return await fn[kind]()

    # -- workers ---------------------------------------------------------------------

    async def _victim(self) -> WorkerProcess:
        """A live worker, preferably one that holds partitions (so the fault hits work)."""
        alive = self.pool.alive()
        assert alive, "no worker alive to inject a fault into"
        owners = {w for _, w in (await asyncio.to_thread(self._epochs_or_empty)).values()}
        holding = [w for w in alive if w.worker_id in owners]
        return self.rng.choice(holding or alive)

    async def _held_by(self, worker_id: str) -> dict[int, int]:
        epochs = await asyncio.to_thread(self._epochs_or_empty)
        return {p: e for p, (e, w) in epochs.items() if w == worker_id}

    def _epochs_or_empty(self) -> dict[int, tuple[int, str]]:
        try:
            return self.db.epochs()
        except Exception:  # noqa: BLE001 - a probe; Postgres may be the thing that is down
            return {}

    async def _wait_handoff(self, fault: Fault, victim: str, held: dict[int, int]) -> None:
        if not held:
            fault.notes.append("victim held no partition")
            return
        deadline = fault.at + self.handoff_timeout_s
        moved: list[int] = []
        while time.time() < deadline:
            epochs = await asyncio.to_thread(self._epochs_or_empty)
            moved = [
                p
                for p, e in held.items()
                if p in epochs and epochs[p][0] > e and epochs[p][1] != victim
            ]
            if len(moved) == len(held):
                fault.handoff_s = time.time() - fault.at
                return
            await asyncio.sleep(0.2)
        # A new owner whose epoch bump at assignment failed (say, on a connection the
        # last PostgreSQL restart killed) takes the epoch with the partition's next
        # record: a partition without traffic then looks unmoved. Only waiting work is
        # a stalled handoff.
        unmoved = sorted(set(held) - set(moved))
        waiting = await asyncio.to_thread(self._waiting_runs, unmoved)
        if waiting:
            fault.notes.append(
                f"handoff not complete after {self.handoff_timeout_s:.0f}s: {waiting} runs "
                f"waiting on partitions {unmoved}"
            )
        else:
            fault.notes.append(f"handoff unmeasured: partitions {unmoved} had no traffic")

    def _waiting_runs(self, partitions: list[int]) -> int:
        try:
            rows = self.db.query(
                "SELECT count(*) AS n FROM runs WHERE partition = ANY(:ps)"
                " AND status IN ('pending', 'running', 'streaming')",
                ps=partitions,
            )
        except Exception:  # noqa: BLE001 - Postgres may be down: count it as waiting
            return -1
        return int(rows[0].n)

    async def worker_kill9(self) -> Fault:
        w = await self._victim()
        held = await self._held_by(w.name)
        fault = Fault(WORKER_KILL9, w.name, time.time())
        self.pool.retire(w)
        await asyncio.to_thread(w.kill)
        await self._wait_handoff(fault, w.name, held)
        await asyncio.to_thread(self.pool.start_worker)
        return fault

    async def worker_sigterm(self) -> Fault:
        w = await self._victim()
        held = await self._held_by(w.name)
        fault = Fault(WORKER_SIGTERM, w.name, time.time())
        self.pool.retire(w)
        w.signal(signal.SIGTERM)
        replacement = await asyncio.to_thread(self.pool.start_worker)
        fault.notes.append(f"replacement {replacement.worker_id}")
        await self._wait_handoff(fault, w.name, held)
        assert w.proc is not None
        try:
            code = await asyncio.to_thread(w.proc.wait, 45)
        except Exception:  # noqa: BLE001 - TimeoutExpired: it ignored SIGTERM
            code = -999
            await asyncio.to_thread(w.kill)
        self.pool.sigterm_exit_codes.append(code)
        if code != 0:
            fault.notes.append(f"exit code {code} after SIGTERM")
        return fault

    async def worker_sigstop(self) -> Fault:
        w = await self._victim()
        held = await self._held_by(w.name)
        fault = Fault(WORKER_SIGSTOP, w.name, time.time())
        w.signal(signal.SIGSTOP)
        try:
            await self._wait_handoff(fault, w.name, held)
            # Past the session timeout in any case: the group must have moved on.
            rest = fault.at + self.session_timeout_s + 2.0 - time.time()
            if rest > 0:
                await asyncio.sleep(rest)
        finally:
            w.signal(signal.SIGCONT)
        fault.notes.append(f"stopped {time.time() - fault.at:.1f}s")
        return fault

    # -- services --------------------------------------------------------------------

    def _next_node(self) -> int:
        brokers = self.stack.info.brokers
        self._broker_turn += 1
        return (self._broker_turn - 1) % brokers + 1

    async def broker_restart(self) -> Fault:
        node = self._next_node()
        fault = Fault(BROKER_RESTART, f"kafka node {node}", time.time())
        await asyncio.to_thread(kafka_node_stop, self.stack.state_dir, node)
        await asyncio.sleep(self.down_s)
        await asyncio.to_thread(kafka_node_start, self.stack.state_dir, node)
        fault.back_at = time.time()
        fault.notes.append(f"down {fault.back_at - fault.at:.1f}s")
        return fault

    async def broker_kill(self) -> Fault:
        node = self._next_node()
        fault = Fault(BROKER_KILL, f"kafka node {node}", time.time())
        await asyncio.to_thread(kafka_node_kill, self.stack.state_dir, node)
        await asyncio.sleep(max(self.down_s, 8.0))
        await asyncio.to_thread(kafka_node_start, self.stack.state_dir, node)
        fault.back_at = time.time()
        fault.notes.append(f"down {fault.back_at - fault.at:.1f}s")
        return fault

    async def pg_restart(self) -> Fault:
        self._pg_turn += 1
        crash = self._pg_turn % 2 == 0
        fault = Fault(
            PG_RESTART, "postgres (crash)" if crash else "postgres (fast stop)", time.time()
        )
        await asyncio.to_thread(pg_kill if crash else pg_stop, self.stack.state_dir)
        await asyncio.sleep(self.down_s)
        await asyncio.to_thread(pg_start, self.stack.state_dir)
        fault.back_at = time.time()
        fault.notes.append(f"down {fault.back_at - fault.at:.1f}s")
        return fault

    async def gateway_restart(self) -> Fault:
        fault = Fault(GATEWAY_RESTART, "gateway", time.time())
        await asyncio.to_thread(self.pool.kill_gateway)
        await asyncio.sleep(1.0)  # the fault itself: no gateway for a second
        gw = await asyncio.to_thread(self.pool.start_gateway)
        fault.back_at = time.time()
        async with httpx.AsyncClient(base_url=gw.url, timeout=3) as client:
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    if (await client.get("/readyz")).status_code == 200:
                        fault.recover_s = time.time() - fault.back_at
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        return fault

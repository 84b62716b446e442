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
import contextlib
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
from koda_runtime.localstack.postgres import PgPaths
from tests.chaos.cluster import Pool, Postgres, Stack
from tests.chaos.toxiproxy import GATEWAY_SLOT, Network
from tests.fixtures.processes import WorkerProcess

WORKER_KILL9 = "worker kill -9"
WORKER_SIGTERM = "worker SIGTERM + replacement"
WORKER_SIGSTOP = "worker SIGSTOP/SIGCONT"
BROKER_RESTART = "broker restart"
BROKER_KILL = "broker kill -9 + start"
PG_RESTART = "postgres restart"
GATEWAY_RESTART = "gateway kill -9 + start"
SCHEDULER_KILL = "scheduler kill -9 + start"
# Network faults, on one process's own Toxiproxy slot (tests/chaos/toxiproxy.py).
NET_WORKER_KAFKA_CUT = "cut worker-broker"
NET_WORKER_PG_CUT = "cut worker-postgres"
NET_WORKER_PG_SLOW = "latency worker-postgres"
NET_GATEWAY_KAFKA_SLOW = "latency gateway-broker"
NET_PG_RESET = "reset in a group commit"
NET_GATEWAY_FEED_CUT = "cut gateway-broker (live feed)"

WORKER_KINDS = (WORKER_KILL9, WORKER_SIGTERM, WORKER_SIGSTOP)
SERVICE_KINDS = (BROKER_RESTART, BROKER_KILL, PG_RESTART)
NETWORK_KINDS = (
    NET_WORKER_KAFKA_CUT,
    NET_WORKER_PG_CUT,
    NET_WORKER_PG_SLOW,
    NET_GATEWAY_KAFKA_SLOW,
    NET_PG_RESET,
    NET_GATEWAY_FEED_CUT,
)
# What a network fault's recover_s measures, for the table.
RECOVERY_OF = {
    NET_WORKER_KAFKA_CUT: "heal -> victim owns a partition again",
    NET_WORKER_PG_CUT: "heal -> first write on the victim's partitions",
    NET_WORKER_PG_SLOW: "heal -> first write on the victim's partitions",
    NET_PG_RESET: "reset -> first write on the victim's partitions",
    NET_GATEWAY_KAFKA_SLOW: "heal -> /readyz 200",
    NET_GATEWAY_FEED_CUT: "heal -> /readyz 200",
}

LATENCY_MS, JITTER_MS = 300, 100
# PostgreSQL's line for a client gone while its transaction was open.
# How long the reset fault waits for a worker with a run in flight before it resets one.
BUSY_WAIT_S = 20.0
OPEN_TXN_EOF = "unexpected EOF on client connection with an open transaction"


def kinds_for(brokers: int, network: bool = False, schedulers: bool = False) -> tuple[str, ...]:
    """Every kind that applies to a cluster of ``brokers`` (kill one of three needs three),
    with ``network`` (a stack with Toxiproxy slots) the network faults too, with
    ``schedulers`` (two of them running) the scheduler kill."""
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
    if schedulers:
        kinds.append(SCHEDULER_KILL)
    if network:
        kinds += NETWORK_KINDS
    return tuple(kinds)


# A broker killed with -9 recovers its logs before it serves again: with 1,000 users'
# runs in flight on 2 cores that took more than the local stack's 60 s once. The time is
# the fault's recovery, reported in the table, not a reason to abandon the run.
BROKER_START_TIMEOUT_S = 180.0


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    back_at: float | None = None
    ended_at: float | None = None  # the injector returned: the fault is over
    handoff_s: float | None = None
    recover_s: float | None = None
    notes: list[str] = field(default_factory=list)
    # What a network fault saw: partitions the victim kept (of those it held), open
    # transactions reset, viewers on the live feed.
    kept: tuple[int, int] | None = None
    open_txns_reset: int = 0
    viewers: int = 0


@dataclass
class Injector:
    """Injects faults into ``pool`` and ``stack``; ``db`` reads partition ownership."""

    stack: Stack
    pool: Pool
    db: Postgres
    rng: Random
    session_timeout_s: float
    down_s: float = 3.0
    handoff_ceiling_s: float = 2.0
    slow_s: float = 8.0
    live_viewers: Callable[[], int] = lambda: 0
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
            SCHEDULER_KILL: self.scheduler_kill,
            NET_WORKER_KAFKA_CUT: self.worker_kafka_cut,
            NET_WORKER_PG_CUT: self.worker_pg_cut,
            NET_WORKER_PG_SLOW: self.worker_pg_slow,
            NET_GATEWAY_KAFKA_SLOW: self.gateway_kafka_slow,
            NET_PG_RESET: self.pg_reset_in_commit,
            NET_GATEWAY_FEED_CUT: self.gateway_feed_cut,
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
        # Past the session timeout, partitions without waiting work cannot show a new
        # epoch (see below): stop waiting for them then, checked every few seconds.
        idle_check = fault.at + self.session_timeout_s + 3.0
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
            if time.time() > idle_check:
                unmoved = sorted(set(held) - set(moved))
                if await asyncio.to_thread(self._waiting_runs, unmoved) == 0:
                    break
                idle_check = time.time() + 3.0
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

    async def _handoff_past_session(self, fault: Fault, victim: str, held: dict[int, int]) -> None:
        """The handoff of a silent victim, and past the session timeout in any case: the
        group must have moved on before the victim speaks again."""
        await self._wait_handoff(fault, victim, held)
        rest = fault.at + self.session_timeout_s + 2.0 - time.time()
        if rest > 0:
            await asyncio.sleep(rest)

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
        started = await asyncio.to_thread(self.pool.start_worker)
        await asyncio.to_thread(self.pool.wait_started, started)
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
        await asyncio.to_thread(self.pool.wait_started, replacement)
        return fault

    async def worker_sigstop(self) -> Fault:
        w = await self._victim()
        held = await self._held_by(w.name)
        fault = Fault(WORKER_SIGSTOP, w.name, time.time())
        w.signal(signal.SIGSTOP)
        try:
            await self._handoff_past_session(fault, w.name, held)
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
        await asyncio.to_thread(
            kafka_node_start, self.stack.state_dir, node, timeout_s=BROKER_START_TIMEOUT_S
        )
        fault.back_at = time.time()
        fault.notes.append(f"down {fault.back_at - fault.at:.1f}s")
        return fault

    async def broker_kill(self) -> Fault:
        node = self._next_node()
        fault = Fault(BROKER_KILL, f"kafka node {node}", time.time())
        await asyncio.to_thread(kafka_node_kill, self.stack.state_dir, node)
        await asyncio.sleep(max(self.down_s, 8.0))
        await asyncio.to_thread(
            kafka_node_start, self.stack.state_dir, node, timeout_s=BROKER_START_TIMEOUT_S
        )
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

    async def scheduler_kill(self) -> Fault:
        """kill -9 one of the two schedulers (at a random second, so sometimes inside a
        minute's firing), and start it again 3 s later; the other goes on firing."""
        assert self.pool.schedulers, "no scheduler running"
        victim = self.rng.choice(self.pool.schedulers)
        fault = Fault(SCHEDULER_KILL, victim.name, time.time())
        await asyncio.to_thread(self.pool.kill_scheduler, victim)
        await asyncio.sleep(3.0)
        started = await asyncio.to_thread(self.pool.start_scheduler)
        fault.back_at = time.time()
        fault.notes.append(f"replacement {started.name}")
        return fault

    # -- network (one process's own proxies) ------------------------------------------

    @property
    def net(self) -> Network:
        assert self.stack.network is not None, "network faults need a stack with slots"
        return self.stack.network

    def _slot(self, w: WorkerProcess) -> str:
        slot = self.pool.slot_of.get(w.name)
        assert slot is not None, f"{w.name} runs outside the network"
        return slot

    async def _first_write_after(self, partitions: list[int], t: float) -> float | None:
        """Seconds from ``t`` to the first message written on ``partitions`` after it
        (None after 20 s: no traffic left there, say at the end of the run)."""
        deadline = time.time() + 20
        while time.time() < deadline and partitions:
            try:
                rows = await asyncio.to_thread(
                    self.db.query,
                    "SELECT min(m.created_at) AS at FROM messages m JOIN runs r"
                    " ON r.id = m.run_id WHERE r.partition = ANY(:ps)"
                    " AND m.created_at > to_timestamp(:t)",
                    ps=partitions,
                    t=t,
                )
            except Exception:  # noqa: BLE001 - a probe
                rows = []
            if rows and rows[0].at is not None:
                return float(rows[0].at.timestamp() - t)
            await asyncio.sleep(0.2)
        return None

    async def _wait_owns(self, worker_id: str, t: float, timeout_s: float = 60) -> float | None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if await self._held_by(worker_id):
                return time.time() - t
            await asyncio.sleep(0.2)
        return None

    async def _readyz_after(self, t: float, timeout_s: float = 60) -> float | None:
        url = f"http://127.0.0.1:{self.pool.gateway_port}"
        async with httpx.AsyncClient(base_url=url, timeout=3) as client:
            deadline = time.time() + timeout_s
            while time.time() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/readyz")).status_code == 200:
                        return time.time() - t
                await asyncio.sleep(0.2)
        return None

    async def _readyz_status(self) -> int | None:
        url = f"http://127.0.0.1:{self.pool.gateway_port}/readyz"
        try:
            async with httpx.AsyncClient(timeout=6) as client:
                return (await client.get(url)).status_code
        except httpx.HTTPError:
            return None

    async def worker_kafka_cut(self) -> Fault:
        """The victim's broker links cut past the session timeout while it still reaches
        PostgreSQL: the group hands its partitions on; the new owners' epoch bumps fence
        whatever the victim still writes; healed, it rejoins and gets partitions again."""
        w = await self._victim()
        slot = self._slot(w)
        held = await self._held_by(w.name)
        fault = Fault(NET_WORKER_KAFKA_CUT, f"{w.name} ({slot})", time.time())
        await asyncio.to_thread(self.net.cut_kafka, slot)
        try:
            await self._handoff_past_session(fault, w.name, held)
        finally:
            await asyncio.to_thread(self.net.cut_kafka, slot, False)
        fault.back_at = time.time()
        fault.notes.append(f"cut {fault.back_at - fault.at:.1f}s")
        fault.recover_s = await self._wait_owns(w.name, fault.back_at)
        if fault.recover_s is None:
            fault.notes.append("not recovered: the victim owns no partition 60s after the heal")
        return fault

    async def worker_pg_cut(self) -> Fault:
        """The victim's PostgreSQL link cut, longer than the handoff ceiling, while the
        broker stays reachable: it keeps its partitions (its heartbeats go on), every
        write fails and is retried with backoff; nothing is committed past it."""
        w = await self._victim()
        slot = self._slot(w)
        held = sorted(await self._held_by(w.name))
        fault = Fault(NET_WORKER_PG_CUT, f"{w.name} ({slot})", time.time())
        await asyncio.to_thread(self.net.cut_pg, slot)
        try:
            await asyncio.sleep(self.handoff_ceiling_s + 4.0)
        finally:
            await asyncio.to_thread(self.net.cut_pg, slot, False)
        fault.back_at = time.time()
        kept = set(held) & set(await self._held_by(w.name))
        fault.kept = (len(kept), len(held))
        fault.notes.append(
            f"cut {fault.back_at - fault.at:.1f}s; kept {len(kept)} of {len(held)} partitions"
        )
        fault.recover_s = await self._first_write_after(held, fault.back_at)
        return fault

    async def worker_pg_slow(self) -> Fault:
        """300 ms ± 100 ms each way on the victim's PostgreSQL link for ``slow_s``."""
        w = await self._victim()
        slot = self._slot(w)
        held = sorted(await self._held_by(w.name))
        fault = Fault(NET_WORKER_PG_SLOW, f"{w.name} ({slot})", time.time())
        proxy = self.net.slots[slot].pg_proxy
        await asyncio.to_thread(self.net.latency, [proxy], LATENCY_MS, JITTER_MS)
        try:
            await asyncio.sleep(self.slow_s)
            during = await self._first_write_after(held, fault.at)
        finally:
            await asyncio.to_thread(self.net.heal)
        fault.back_at = time.time()
        fault.notes.append(
            "no write while slow" if during is None else f"first write while slow {during:.1f}s"
        )
        fault.recover_s = await self._first_write_after(held, fault.back_at)
        return fault

    async def gateway_kafka_slow(self) -> Fault:
        """300 ms ± 100 ms each way on every gateway-broker link for ``slow_s``."""
        fault = Fault(NET_GATEWAY_KAFKA_SLOW, "gateway (gw)", time.time())
        proxies = self.net.slots[GATEWAY_SLOT].kafka_proxies
        await asyncio.to_thread(self.net.latency, proxies, LATENCY_MS, JITTER_MS)
        try:
            await asyncio.sleep(self.slow_s / 2)
            fault.notes.append(f"/readyz while slow: {await self._readyz_status()}")
            await asyncio.sleep(self.slow_s / 2)
        finally:
            await asyncio.to_thread(self.net.heal)
        fault.back_at = time.time()
        fault.recover_s = await self._readyz_after(fault.back_at)
        if fault.recover_s is None:
            fault.notes.append("not recovered: /readyz not 200 60s after the heal")
        return fault

    def _open_txn_eofs(self) -> int:
        log = PgPaths.of(self.stack.state_dir.resolve()).log
        try:
            return log.read_text(errors="replace").count(OPEN_TXN_EOF)
        except OSError:
            return 0

    async def pg_reset_in_commit(self) -> Fault:
        """TCP resets on the victim's PostgreSQL connections while its group-commit
        transactions are open. The link is slowed first (100 ms a packet) so that its
        transactions stay open long enough to be cut; PostgreSQL logs each open one it
        lost, which is the proof the reset hit a transaction. Each attempt waits (up to
        ``BUSY_WAIT_S``) for a worker with a run in flight and resets that one, since only a
        worker that is writing has a transaction to lose; tried up to five times."""
        w = await self._busy_victim()
        slot = self._slot(w)
        held = sorted(await self._held_by(w.name))
        fault = Fault(NET_PG_RESET, f"{w.name} ({slot})", time.time())
        before = await asyncio.to_thread(self._open_txn_eofs)
        hit = 0
        for attempt in range(1, 6):
            if attempt > 1:
                w = await self._busy_victim()
                slot = self._slot(w)
                held = sorted(set(held) | set(await self._held_by(w.name)))
            proxy = self.net.slots[slot].pg_proxy
            await asyncio.to_thread(self.net.latency, [proxy], 100, 0)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(self.net.reset_peer, proxy)
            await asyncio.sleep(0.5)
            await asyncio.to_thread(self.net.heal)
            fault.back_at = time.time()
            deadline = time.time() + 5
            while time.time() < deadline:
                hit = await asyncio.to_thread(self._open_txn_eofs) - before
                if hit:
                    break
                await asyncio.sleep(0.2)
            if hit:
                fault.open_txns_reset = hit
                fault.notes.append(f"{hit} open transactions reset (attempt {attempt})")
                break
        else:
            fault.notes.append("no transaction was open at any of 5 resets")
        assert fault.back_at is not None
        fault.recover_s = await self._first_write_after(held, fault.back_at)
        return fault

    async def _busy_victim(self) -> WorkerProcess:
        """A live worker with a run in flight (``running`` under its id), waited for up to
        ``BUSY_WAIT_S``; any victim (:meth:`_victim`) when none turns up in time."""
        deadline = time.time() + BUSY_WAIT_S
        while time.time() < deadline:
            alive = {w.name: w for w in self.pool.alive()}
            try:
                rows = await asyncio.to_thread(
                    self.db.query,
                    "SELECT DISTINCT worker_id FROM runs WHERE status = 'running'"
                    " AND worker_id = ANY(:ids)",
                    ids=list(alive),
                )
            except Exception:  # noqa: BLE001 - a probe; Postgres may be the thing that is down
                rows = []
            busy = sorted(r.worker_id for r in rows)
            if busy:
                return alive[self.rng.choice(busy)]
            await asyncio.sleep(0.2)
        return await self._victim()

    async def gateway_feed_cut(self) -> Fault:
        """Every gateway-broker link cut for ``slow_s`` while viewers follow runs: the live
        feed loses the broker; viewers keep their streams (keepalives) or reconnect with
        Last-Event-ID, and end with exactly the rows."""
        deadline = time.time() + 15
        while self.live_viewers() == 0 and time.time() < deadline:
            await asyncio.sleep(0.2)  # a feed with nobody on it proves little: wait a bit
        fault = Fault(NET_GATEWAY_FEED_CUT, "gateway (gw)", time.time())
        fault.viewers = self.live_viewers()
        fault.notes.append(f"{fault.viewers} viewers following")
        await asyncio.to_thread(self.net.cut_kafka, GATEWAY_SLOT)
        try:
            await asyncio.sleep(self.slow_s / 2)
            fault.notes.append(f"/readyz while cut: {await self._readyz_status()}")
            await asyncio.sleep(self.slow_s / 2)
        finally:
            await asyncio.to_thread(self.net.cut_kafka, GATEWAY_SLOT, False)
        fault.back_at = time.time()
        fault.recover_s = await self._readyz_after(fault.back_at)
        if fault.recover_s is None:
            fault.notes.append("not recovered: /readyz not 200 60s after the heal")
        return fault

"""Where the load generator runs beside the system it measures.

The load generator is the bench process itself (the aiohttp clients that POST and
read SSE, the raw baseline's producer and consumer); the system under test is the
gateway and the workers (and the broker and Postgres, which no bench pins). With
``--pin`` the generator gets the last core and the gateway and workers the others,
every thread of each (``taskset -a -p``'s effect, through ``sched_setaffinity`` on each
task), so neither steals the other's core. On a 2-core machine that leaves the
gateway and two workers one core between them: the knee then measures a one-core
koda, so by default nothing is pinned there and the generator's CPU is printed
beside every figure instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def pin_all_threads(pid: int, cpus: set[int]) -> None:
    """Every current thread of ``pid`` onto ``cpus`` (threads started later inherit)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, PermissionError):
            continue  # a thread that ended meanwhile


def place(pin: bool, system_pids: Iterable[int]) -> str:
    """Pin (or not) the generator and the system; the sentence that says which and why."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin:
        return (
            f"not pinned: {len(cores)} cores shared by the load generator (this process), "
            "the gateway, 2 workers, Kafka and Postgres; pinning the generator to a core of "
            "its own would leave koda one core and measure a different machine "
            "(--pin does it); the generator's CPU is printed beside each figure"
        )
    if len(cores) < 2:
        return "not pinned: one core only"
    generator, system = {cores[-1]}, set(cores[:-1])
    pin_all_threads(os.getpid(), generator)
    for pid in system_pids:
        pin_all_threads(pid, system)
    return (
        f"pinned with sched_setaffinity (taskset -a): load generator on core {cores[-1]}, "
        f"gateway and workers on {','.join(map(str, sorted(system)))}; Kafka and Postgres "
        "unpinned"
    )

"""Put back on the chunk topic what Postgres holds and the topic may not.

A worker commits a chunk batch to Postgres and only then produces it to
``<env>.koda.run-chunks``. A worker that dies in between (or whose delivery fails)
leaves chunks in Postgres that never reach the topic. Its trigger record was not
acked, so the partition's next owner meets the run again, in one of two states:

* **still active** (the commit was a streaming batch): the successor claims it and
  resumes. Before it writes anything of its own it produces every message the
  earlier attempts left (seq below the claim's next seq), so on the topic every
  chunk precedes the run's terminal event;
* **terminal** (the commit was the finish: last chunks and the terminal transition
  together): the successor would skip it. Unless ``runs.published_seq`` says the
  run is whole on the topic, it first produces the run's messages and waits for
  their delivery; only then is the record acked.

Whoever has seen every message 0..terminal acknowledged writes ``published_seq``
(through the group writer, waiting for nothing). The compactor's completeness pass
(:mod:`koda_runtime.processors.compactor`) catches what no worker meets again: runs finished
``KODA_REPAIR_AFTER`` ago and still not known to be whole.

The records are keyed ``<run_id>:<seq>`` with the same bytes as the first time, so
producing one twice changes nothing for any reader (the compacted topic, the
replay, the live feed) beyond a counted re-send.

A message the producer or the broker refuses for itself (too large: only rows written
before chunks were capped can be) is passed over with an error log
(``event=chunk_refused``), never tried again in place: the run is then not marked
whole, and the partition goes on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from koda_runtime.lifecycle.chunks import Chunk
from koda_runtime.metrics import CHUNKS_REPUBLISHED
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.processors.ports import RunOutput, WorkerStore
from koda_runtime.processors.streaming import refusal
from koda_runtime.schemas.runs.worker import RunRow

log = logging.getLogger("koda.worker")


class ChunkRepair:
    """The worker's half of keeping the chunk topic whole (see the module docstring)."""

    def __init__(self, store: WorkerStore, emitter: RunOutput, writer: GroupWriter) -> None:
        self.store, self.emitter, self.writer = store, emitter, writer
        # Runs with a message the producer refused when sent again: never marked whole.
        self._holes: set[str] = set()

    async def terminal(self, run: RunRow, partition: int) -> None:
        """A terminal run met again: make the topic hold all of it, unless known to."""
        if run.published_seq is not None:
            return
        messages = await self.store.messages(run.id)
        if messages:
            futures = await self._produce(run.id, partition, messages)
            for failure in await asyncio.gather(*futures, return_exceptions=True):
                if isinstance(failure, BaseException):
                    if (cause := refusal(failure)) is None:
                        raise failure
                    log.error("event=chunk_refused run_id=%s by=skip: %s", run.id, cause)
                    self._holes.add(run.id)
            CHUNKS_REPUBLISHED.labels(by="skip").inc(len(messages))
            log.info(
                "republished run_id=%s messages=%d by=skip partition=%d",
                run.id,
                len(messages),
                partition,
            )
        self.published(run.id, messages[-1].seq if messages else -1)

    async def resumed(self, run_id: str, partition: int, next_seq: int) -> list[Any]:
        """A run resumed at ``next_seq``: produce the earlier attempts' messages again.

        Returns their delivery futures; the run awaits them with its own before it acks.
        """
        if next_seq <= 0:
            return []
        messages = await self.store.messages(run_id, below=next_seq)
        futures = await self._produce(run_id, partition, messages)
        CHUNKS_REPUBLISHED.labels(by="resume").inc(len(messages))
        log.info(
            "republished run_id=%s messages=%d by=resume partition=%d",
            run_id,
            len(messages),
            partition,
        )
        return futures

    def published(self, run_id: str, last_seq: int, *, whole: bool = True) -> None:
        """The terminal run's messages 0..``last_seq`` were all sent: mark it whole on the
        topic, unless ``whole`` is False or one was refused when sent again."""
        if run_id in self._holes:
            self._holes.discard(run_id)
        elif whole:
            self.writer.published(run_id, last_seq)

    async def _produce(
        self, run_id: str, partition: int, messages: list[Chunk]
    ) -> list[asyncio.Future[Any]]:
        """Send ``messages`` again; one the producer refuses is passed over (logged)."""
        futures: list[asyncio.Future[Any]] = []
        for message in messages:
            try:
                futures += await self.emitter.chunks(partition, [message])
            except Exception as exc:
                if (cause := refusal(exc)) is None:
                    raise
                log.error("event=chunk_refused run_id=%s seq=%d: %s", run_id, message.seq, cause)
                self._holes.add(run_id)
        return futures

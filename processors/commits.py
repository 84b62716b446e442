"""The offset commits on the runs topic: acks in, commits out (:class:`OffsetCommits`).

The partition cursors (processors/cursor.py) decide what may be committed; the commit
itself goes through the runs topic's group member (topics/kafka/intake.py), whose
librdkafka consumer sends it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from koda_runtime.background import BackgroundTask
from koda_runtime.processors.cursor import PartitionCursors, encode_done
from koda_runtime.topics.kafka.intake import Fetched

log = logging.getLogger("koda.worker")

COMMIT_INTERVAL_S = 1.0


class OffsetCommits:
    """Acks in, commits out: the partition cursors decide what may be committed (from
    the first unacked offset, never over a hole), ``commit`` sends it.

    Commits are serialised: a periodic commit finishing after a revoke's would move the
    group's offset back.

    A commit the broker refused (a coordinator moving, a broker restarting) is sent
    again by the next flush, for the partitions still held: the commit cursor has
    already moved past those offsets, so without it a partition that receives no
    further record would keep its old committed offset until it is revoked, and its
    next owner would read those records again (a chaos run's last check caught one).
    """

    def __init__(
        self,
        cursors: PartitionCursors,
        commit: Callable[[dict[int, int], dict[int, str]], Awaitable[bool]],
        *,
        interval_s: float = COMMIT_INTERVAL_S,
    ) -> None:
        self.cursors = cursors
        self._commit = commit
        self.interval_s = interval_s
        self.acked: dict[int, list[int]] = {}
        self.unconfirmed: dict[int, int] = {}  # offsets whose commit failed, to send again
        self.sent_done: dict[int, str] = {}  # the metadata last sent per partition
        self._lock = asyncio.Lock()
        self.task = BackgroundTask("offset-commits", self._every_interval)

    def ack(self, item: Fetched) -> None:
        self.acked.setdefault(item.partition, []).append(item.offset)

    async def flush(self, partitions: list[int] | None = None) -> None:
        """Commit what the acks of ``partitions`` (default: all) allow, and wait."""
        async with self._lock:
            wanted = set(self.acked) | set(self.unconfirmed)
            due: dict[int, int] = {}
            for p in sorted(wanted) if partitions is None else partitions:
                retry = self.unconfirmed.pop(p, None)
                if retry is not None and self.cursors.holds(p):
                    due[p] = retry
                acked = self.acked.get(p)
                if not acked:
                    continue
                acked.sort()
                offset = self.cursors.take_commit(p, acked)
                if offset is not None:
                    due[p] = offset  # past any retried offset: the cursor only moves on
                elif acked and self.sent_done.get(p, "") != self._done(p, acked):
                    # Records above the low-water mark ended since the last commit: the
                    # same offset again, with the metadata that names them.
                    current = self.cursors.commit_offset(p)
                    if current is not None:
                        due[p] = current
            if not due:
                return
            metadata = {p: self._done(p, self.acked.get(p, [])) for p in due}
            ok = False
            try:
                ok = await self._commit(due, metadata)
            finally:
                if ok:
                    self.sent_done.update(metadata)
                else:
                    self.unconfirmed.update(due)  # each p's earlier entry was taken above

    def _done(self, partition: int, acked: list[int]) -> str:
        """The commit metadata naming ``acked`` (what ended above the low-water mark)."""
        commit = self.cursors.commit_offset(partition)
        if commit is None:
            return ""
        return encode_done(commit, sorted(o for o in acked if o >= commit))

    def forget(self, partitions: list[int]) -> None:
        for p in partitions:
            self.acked.pop(p, None)
            self.unconfirmed.pop(p, None)
            self.sent_done.pop(p, None)

    async def _every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - retried at the next interval
                log.exception("event=commit_failed")

"""The ceiling: a minimal hand-written pipeline doing a run's work.

confluent-kafka consumer -> the rows koda writes, with koda's batching (three
transactions per run) -> confluent-kafka producer. Partitions run concurrently
(at most ``--inflight`` runs at once, like koda's ``KODA_MAX_INFLIGHT``), each
partition in order; offsets are committed after a poll batch's records are in
Postgres and acknowledged by the broker. No Faust, no fencing, no state machine,
no retries: the practical limit of the machine for this work.

    python -m tests.bench.ceiling --bootstrap H:P --dsn URL --schema S \\
        --runs-topic T --chunks-topic T --events-topic T --group G --worker W
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections import defaultdict
from typing import Any

from confluent_kafka import Consumer, Producer

from tests.bench.rivals import Out, aconnect, arun_batched


def cli() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    for name in (
        "bootstrap",
        "dsn",
        "schema",
        "runs-topic",
        "chunks-topic",
        "events-topic",
        "group",
        "worker",
    ):
        ap.add_argument(f"--{name}", required=True)
    ap.add_argument("--inflight", type=int, default=8)
    return ap.parse_args()


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": args.group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
            "session.timeout.ms": 10000,
        }
    )
    producer = Producer(
        {
            "bootstrap.servers": args.bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 2,
            "compression.type": "lz4",
        }
    )
    consumer.subscribe([args.runs_topic])
    pool: asyncio.Queue[Any] = asyncio.Queue()
    for _ in range(args.inflight):
        pool.put_nowait(await aconnect(args.dsn, args.schema))

    def emit_to(partition: int) -> Any:
        def emit(out: Out) -> None:
            topic = args.chunks_topic if out[0] == "chunk" else args.events_topic
            producer.produce(topic, key=out[1], value=out[2], partition=partition)
            producer.poll(0)

        return emit

    async def chain(partition: int, msgs: list[Any]) -> None:
        for msg in msgs:
            run_id = json.loads(msg.value())["run_id"]
            conn = await pool.get()
            try:
                await arun_batched(conn, run_id, partition, args.worker, emit_to(partition))
            finally:
                pool.put_nowait(conn)

    print("ceiling ready", flush=True)
    while not stop.is_set():
        msgs = await loop.run_in_executor(None, consumer.consume, 500, 0.2)
        msgs = [m for m in msgs if m.error() is None]
        if not msgs:
            continue
        by_part: dict[int, list[Any]] = defaultdict(list)
        for m in msgs:
            partition = m.partition()
            assert partition is not None
            by_part[partition].append(m)
        await asyncio.gather(*(chain(p, ms) for p, ms in by_part.items()))
        # Commit only after the batch's output is in Postgres and on the broker.
        left = await loop.run_in_executor(None, producer.flush, 30)
        if left:
            sys.exit("ceiling: undelivered records")
        consumer.commit(asynchronous=True)
    consumer.close()
    producer.flush(10)


if __name__ == "__main__":
    asyncio.run(main(cli()))

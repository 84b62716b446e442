"""The same work with Quix Streams: the library a user would pick instead of Faust.

A StreamingDataFrame over the runs topic; ``apply(expand=True)`` does the run's
Postgres work (koda's three transactions, tests/bench/rivals.py) and returns its
output records, which ``to_topic`` produces. Quix Streams commits a checkpoint
only after the producer flushed, so offsets follow the work (at-least-once).

Runs from its own virtualenv (``make bench`` builds ``.venv-quix``): Quix Streams
pins an older confluent-kafka than koda.

    .venv-quix/bin/python -m tests.bench.quix --bootstrap H:P --dsn URL --schema S \\
        --runs-topic T --chunks-topic T --events-topic T --group G --worker W
"""

from __future__ import annotations

import argparse
import logging
import warnings
from typing import Any

warnings.simplefilter("ignore")

from quixstreams import Application, message_context  # noqa: E402
from quixstreams.models.serializers import Serializer  # noqa: E402

from tests.bench.rivals import Out, connect, run_batched  # noqa: E402


class RecordBytes(Serializer):  # type: ignore[misc]  # quixstreams ships no types
    """Output values arrive as ``(kind, key, value bytes)``: write the bytes."""

    def __call__(self, value: Out, ctx: Any) -> bytes:
        return value[2]


def main() -> None:
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
    ap.add_argument("--inflight", type=int, default=1)  # unused: Quix is one record at a time
    args = ap.parse_args()
    app = Application(
        broker_address=args.bootstrap,
        consumer_group=args.group,
        auto_offset_reset="earliest",
        commit_interval=1.0,
        auto_create_topics=False,
        use_changelog_topics=False,
        loglevel=logging.WARNING,
        processing_guarantee="at-least-once",
        producer_extra_config={
            "linger.ms": 2,
            "compression.type": "lz4",
            "acks": "all",
            "enable.idempotence": True,
        },
    )
    runs = app.topic(args.runs_topic, value_deserializer="json", key_deserializer="bytes")
    chunks = app.topic(args.chunks_topic, value_serializer=RecordBytes(), key_serializer="bytes")
    events = app.topic(args.events_topic, value_serializer=RecordBytes(), key_serializer="bytes")
    conn = connect(args.dsn, args.schema)

    def work(value: dict[str, Any]) -> list[Out]:
        outs: list[Out] = []
        run_batched(conn, value["run_id"], message_context().partition, args.worker, outs.append)
        return outs

    sdf = app.dataframe(runs).apply(work, expand=True)
    sdf.to_topic(lambda v, k, t, h: chunks if v[0] == "chunk" else events, key=lambda v: v[1])
    print("quix ready", flush=True)
    app.run()


if __name__ == "__main__":
    main()

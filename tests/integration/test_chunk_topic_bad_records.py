"""Records on the chunk topic that do not decode, under the keys of a run being watched,
on the real broker: the gateway's live feed drops and counts each one, a viewer still
gets every event of the run exactly as Postgres has it, and the chunk log (the topic
read as a replay log) skips and counts them and rebuilds the run whole.

Only the decoding path is exercised here: values that are not UTF-8, not JSON, nested
past the depth limit, or JSON that is not a chunk record. (What a decodable chunk of
another run or kind does is the live feed's own tests'.)
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter

import httpx
from confluent_kafka import Producer

from koda_runtime.kafka import producer_config
from koda_runtime.lifecycle.chunks import chunk_key
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, partition_for_key
from koda_runtime.topics.chunklog import read_chunk_log
from koda_runtime.topics.records.codec import MAX_JSON_DEPTH, chunk_value
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter
from tests.sse_client import bearer, contents, follow_run
from tests.support import async_wait_until, wait_until

GATEWAY_ENV = {"KODA_SSE_KEEPALIVE": "0.5", "KODA_RATE_PER_S": "1000", "KODA_RATE_BURST": "1000"}
# Slow enough that the bad records arrive while the run streams and is watched.
SLOW = {"text": "watched while poisoned", "demo": {"tokens": 80, "delay_ms": 60}}


def bad_values(run_id: str) -> list[tuple[str, bytes]]:
    """``(reason, value)``: values for a key of ``run_id`` that do not decode as chunks."""
    seq = 0
    good = json.loads(chunk_value(run_id, seq, "chunk", "forged", 1))
    deep = b"[" * 5000 + b"]" * 5000
    return [
        ("too_deep", deep),
        ("too_deep", b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1)),
        ("too_deep", b"[" * 500_000),  # 500 KB, never closed
        ("undecodable", b"\xff\xfe not a record \x00"),
        ("undecodable", chunk_value(run_id, seq, "chunk", "utf-16", 1).decode().encode("utf-16")),
        ("undecodable", b"\xef\xbb\xbf" + chunk_value(run_id, seq, "chunk", "bom", 1)),
        ("undecodable", b""),
        ("undecodable", b'{"run_id": "' + run_id.encode() + b'", "seq": '),
        ("invalid", b"[1, 2, 3]"),
        ("invalid", json.dumps({k: v for k, v in good.items() if k != "content"}).encode()),
        ("invalid", json.dumps(good | {"seq": str(seq)}).encode()),
        ("invalid", json.dumps(good | {"attempt": -1}).encode()),
    ]


class Metrics:
    def __init__(self, url: str) -> None:
        self.url = url

    def value(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        total = 0.0
        for line in text.splitlines():
            series, _, value = line.rpartition(" ")
            metric, _, label_text = series.partition("{")
            if metric == name and all(w in label_text for w in wanted):
                total += float(value)
        return total


async def test_bad_chunk_records_are_dropped_counted_and_the_viewer_gets_every_event(
    env: Settings,
) -> None:
    sub = Submitter(env)
    worker = WorkerProcess(env, "chunks-w1").start()
    gateway = GatewayProcess(env, dict(GATEWAY_ENV)).start()
    metrics = Metrics(gateway.url)
    user = "chunk-" + uuid.uuid4().hex[:6]
    producer = Producer(producer_config(env, "chunk-poison") | {"message.max.bytes": 3 << 20})
    try:
        warm = sub.submit(user, {"text": "warm", "demo": {"tokens": 1, "delay_ms": 0}})
        wait_until(lambda: sub.all_terminal([warm]), timeout=90, what="the warm-up run")
        run_id = sub.submit(user, SLOW)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            viewer = asyncio.create_task(follow_run(client, run_id, headers=bearer(user)))
            # The viewer is subscribed to the live feed once a live event reached it.
            await async_wait_until(
                lambda: asyncio.sleep(0, metrics.value("koda_sse_events_total", source="live")),
                timeout=30,
                what="a live event at the viewer",
            )
            # Under the keys of seqs the run has not written yet, and of some it never will.
            rows = sub.messages(run_id)
            next_seq = max((r.seq for r in rows), default=-1) + 1
            partition = partition_for_key(user.encode(), env.partitions)
            topic = env.names.topic(RUN_CHUNKS)
            bad: list[str] = []
            for i, (reason, value) in enumerate(bad_values(run_id)):
                seq = next_seq + i if i % 2 else 1_000_000 + i
                key = chunk_key(run_id, seq).encode()
                producer.produce(topic, key=key, value=value, partition=partition)
                bad.append(reason)
            assert producer.flush(30) == 0
            followed = await asyncio.wait_for(viewer, 90)
        wait_until(lambda: sub.all_terminal([run_id]), timeout=30, what="the run's end")
        assert sub.statuses([run_id]) == {run_id: "done"}
        # The viewer got every event once, in order, as Postgres has them.
        rows = sub.messages(run_id)
        assert contents(followed.events) == [(r.seq, r.kind, r.content) for r in rows]
        assert [r.seq for r in rows] == list(range(len(rows))) and rows[-1].kind == "done"
        text = sub.output(run_id)
        assert text == "".join(demo_tokens(SLOW))
        assert "forged" not in json.dumps(contents(followed.events))

        # The feed dropped and counted each bad record, and never raised out of its thread.
        def dropped() -> float:
            return metrics.value("koda_records_skipped_total", reason="bad_chunk_record")

        wait_until(lambda: dropped() >= len(bad), timeout=30, what="the feed's bad-record count")
        assert dropped() == len(bad)
        log = gateway.log()
        assert "event=live_feed_bad_record" in log, log[-3000:]
        assert "Traceback" not in log and gateway.alive(), log[-3000:]
        # The chunk log skips them by reason and rebuilds the run whole.
        fold = read_chunk_log(env)
        assert fold.skip_reasons == dict(Counter(bad)), fold.skip_reasons
        assert fold.skipped == len(bad)
        run = fold.runs[run_id]
        assert run.complete and run.end == "done" and run.output == text
        assert sorted(run.events) == [r.seq for r in rows]
    finally:
        producer.flush(10)
        gateway.stop()
        worker.stop()
        sub.close()

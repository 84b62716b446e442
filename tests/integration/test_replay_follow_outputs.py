"""A following replay into DuckDB rebuilds the outputs rows it deferred while it idles.

Failure mode: the DuckDB sink defers the outputs rebuild (sinks/duckdb.py), so a
``--follow`` replay that only rebuilt at its end would leave ``outputs`` empty for as
long as it runs. The records here arrive, the replay keeps running, and the outputs
rows must appear (every ``OUTPUTS_S`` seconds, from a batch written for it alone).
"""

from __future__ import annotations

import threading
from pathlib import Path

import duckdb
from confluent_kafka import Producer

from koda_runtime.kafka import producer_config
from koda_runtime.lifecycle.chunks import chunk_key
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, partition_for_key
from koda_runtime.topics.records.codec import RUN_CHUNK, chunk_value, headers_for
from koda_runtime.topics.replay import ReplayOptions, run_replay
from koda_runtime.topics.replay.progress import ReplaySummary
from tests.support import wait_until


def produce_runs(settings: Settings, runs: list[str]) -> None:
    topic = settings.names.topic(RUN_CHUNKS)
    producer = Producer(producer_config(settings, "test"))
    for run_id in runs:
        partition = partition_for_key(run_id.encode(), settings.partitions)
        for seq, (kind, content) in enumerate(
            [("chunk", "hello "), ("chunk", run_id), ("done", "{}")]
        ):
            producer.produce(
                topic,
                key=chunk_key(run_id, seq).encode(),
                value=chunk_value(run_id, seq, kind, content, 1),
                headers=list(headers_for(RUN_CHUNK)),
                partition=partition,
            )
    assert producer.flush(30) == 0


def test_a_following_replay_rebuilds_deferred_outputs_while_it_runs(
    env: Settings, tmp_path: Path
) -> None:
    path = tmp_path / "follow.duckdb"
    stop = threading.Event()
    options = ReplayOptions(topics=(RUN_CHUNKS,), sink_url=f"duckdb:///{path}", follow=True)
    done: list[ReplaySummary | BaseException] = []

    def replay() -> None:
        try:
            done.append(run_replay(env, options, stop=stop))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            done.append(exc)

    thread = threading.Thread(target=replay, name="follow-replay")
    thread.start()
    try:
        runs = [uuid7(), uuid7()]
        produce_runs(env, runs)

        def outputs() -> list[tuple[str, str, str | None]] | None:
            assert not done, done  # the replay must still be running
            if not path.exists():
                return None
            with duckdb.connect(str(path)) as conn:
                tables = {r[0] for r in conn.execute("SHOW TABLES").fetchall()}
                if "outputs" not in tables:
                    return None
                rows = conn.execute(
                    "SELECT run_id, output, end_kind FROM outputs ORDER BY run_id"
                ).fetchall()
            return rows if len(rows) == len(runs) else None

        rows = wait_until(outputs, timeout=30, what="the outputs rows of a following replay")
        assert rows == [(r, f"hello {r}", "done") for r in sorted(runs)]
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert isinstance(done[0], ReplaySummary), done

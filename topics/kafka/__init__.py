"""koda's Kafka clients, in one place (their configurations are koda/kafka.py's).

* :mod:`koda_runtime.topics.kafka.tail`: the no-group tail, every partition of one topic read in a
  thread and handed to the event loop (the live feed, the worker table, the twin
  watch, the run-control listener).
* :mod:`koda_runtime.topics.kafka.bounded`: the bounded reader, from a start to the end offsets
  seen at the start (chunk-log folds, dead letters, ``koda replay``).
* :mod:`koda_runtime.topics.kafka.offsets`: the offsets reader, a group's committed offsets and the
  partitions' watermarks (partition cursors, the lag gauge, ``GET /admin/lag``).
* :mod:`koda_runtime.topics.kafka.publisher`: the producer of ``run.requested`` records
  (the gateway's, the scheduler's and the sweeper's), over the asyncio producer bridge
  (:mod:`koda_runtime.topics.kafka.producer`).

The workers consume the runs topic through :mod:`koda_runtime.topics.kafka.intake` (their
group member, librdkafka); their producer is Faust's (processors/faust_app.py).
"""

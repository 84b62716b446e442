"""Local real services for development and tests: Apache Kafka (KRaft) and PostgreSQL.

    from koda_runtime.localstack import up, down
    info = up(Path(".koda"), brokers=3)   # StackInfo(kafka_bootstrap, database_url, brokers)
    down(Path(".koda"))

Fault tests stop, kill and restart single processes with ``kafka_node_stop``,
``kafka_node_kill``, ``kafka_node_start``, ``pg_stop``, ``pg_kill`` and ``pg_start``.
"""

from koda_runtime.localstack.kafka import (
    kafka_node_kill,
    kafka_node_pid,
    kafka_node_start,
    kafka_node_stop,
)
from koda_runtime.localstack.stack import (
    StackInfo,
    down,
    env_lines,
    pg_kill,
    pg_pid,
    pg_start,
    pg_stop,
    read_info,
    status,
    up,
)

__all__ = [
    "StackInfo",
    "down",
    "env_lines",
    "kafka_node_kill",
    "kafka_node_pid",
    "kafka_node_start",
    "kafka_node_stop",
    "pg_kill",
    "pg_pid",
    "pg_start",
    "pg_stop",
    "read_info",
    "status",
    "up",
]

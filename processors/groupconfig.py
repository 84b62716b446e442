"""The workers' group's own configuration on the broker, under the consumer protocol.

With KIP-848 the broker owns a member's session timeout and heartbeat interval: they are
the group's configuration (``consumer.session.timeout.ms``,
``consumer.heartbeat.interval.ms``), bounded by the broker's
``group.consumer.min/max.session.timeout.ms`` and ``…heartbeat.interval.ms``, and the
member's own ``session.timeout.ms`` is not used. So that ``KODA_SESSION_TIMEOUT`` and
``KODA_KAFKA_HEARTBEAT`` keep meaning what they say, every worker sets them on its group
before it joins (an incremental alter: idempotent, and nothing else of the group's
configuration changes).

Failure mode: a broker that refuses (the values outside its bounds, no ALTER_CONFIGS
permission on the group, a broker older than 4.0) leaves the group on the broker's
defaults (45 s session). The worker starts anyway and logs ``event=group_config_refused``
naming the broker settings that bound them.
"""

from __future__ import annotations

import asyncio
import logging

# confluent-kafka's stubs do not list these in admin's __all__; they are its public API.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from koda_runtime.kafka import group_config
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import admin_client

log = logging.getLogger("koda.worker")

REQUEST_TIMEOUT_S = 10.0


def _alter(settings: Settings, group: str) -> None:
    admin = admin_client(settings)
    entries = [
        ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
        for name, value in group_config(settings).items()
    ]
    resource = ConfigResource(ResourceType.GROUP, group, incremental_configs=entries)
    futures = admin.incremental_alter_configs([resource], request_timeout=REQUEST_TIMEOUT_S)
    for future in futures.values():
        future.result(REQUEST_TIMEOUT_S + 5)


async def apply_group_config(settings: Settings, group: str) -> bool:
    """Set the group's session timeout and heartbeat interval (consumer protocol only);
    False, logged, when the broker refused."""
    if settings.group_protocol != "consumer":
        return True
    try:
        await asyncio.to_thread(_alter, settings, group)
    except Exception as exc:  # noqa: BLE001 - the worker runs on the broker's defaults
        log.warning(
            "event=group_config_refused group=%s config=%s error=%s hint=the broker bounds"
            " these with group.consumer.min/max.session.timeout.ms and"
            " group.consumer.min/max.heartbeat.interval.ms",
            group,
            group_config(settings),
            exc,
        )
        return False
    log.info("event=group_config_set group=%s config=%s", group, group_config(settings))
    return True

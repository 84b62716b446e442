"""`koda topics check` reads the real broker's group settings (describe_configs on each
broker) and reports one that refuses the workers' session timeout.

The local broker widens the consumer protocol's bounds (1 s-300 s), so koda's defaults
pass. The failing case needs no broker reconfiguration (which would disturb every other
test on the shared broker): under the classic protocol the local broker keeps Kafka's
default minimum, 6 s, and a 5 s KODA_SESSION_TIMEOUT is below it, as a worker joining
with it would learn (INVALID_SESSION_TIMEOUT).
"""

from __future__ import annotations

from dataclasses import replace

from typer.testing import CliRunner

from koda_runtime import cli
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import admin_client, broker_configs, check_broker, check_topics
from tests.fixtures.processes import settings_env
from tests.support import wait_until


def test_the_read_finds_every_broker_and_its_group_bounds(kafka_topics: Settings) -> None:
    configs = broker_configs(admin_client(kafka_topics))
    assert configs and all(
        c.get("group.min.session.timeout.ms") == "6000" for c in configs.values()
    )
    assert all(c.get("group.consumer.min.session.timeout.ms") for c in configs.values())
    assert check_broker(kafka_topics) == ([], [])


def test_a_session_timeout_below_the_brokers_minimum_is_reported(kafka_topics: Settings) -> None:
    short = replace(kafka_topics, group_protocol="classic", session_timeout_s=5.0)
    refusals, unchecked = check_broker(short)
    assert unchecked == []
    (refusal,) = refusals
    assert (refusal.config, refusal.value, refusal.timing.ms) == (
        "group.min.session.timeout.ms",
        6000,
        5000,
    )


def test_topics_check_exits_1_naming_the_broker_setting(kafka_topics: Settings) -> None:
    # Freshly created topics reach every broker's metadata a moment later.
    wait_until(lambda: check_topics(kafka_topics) == [], what="the new topics in metadata")
    runner = CliRunner()
    env = settings_env(kafka_topics)
    ok = runner.invoke(cli.app, ["topics", "check"], env=env)
    assert ok.exit_code == 0, ok.output
    assert "the brokers allow the workers' group timings" in ok.stdout
    env |= {"KODA_GROUP_PROTOCOL": "classic", "KODA_SESSION_TIMEOUT": "5"}
    refused = runner.invoke(cli.app, ["topics", "check"], env=env)
    assert refused.exit_code == 1, refused.output
    assert "refused: broker " in refused.stdout
    assert "group.min.session.timeout.ms=6000 is above KODA_SESSION_TIMEOUT (5000 ms)" in (
        refused.stdout
    )
    assert "drift:" not in refused.stdout

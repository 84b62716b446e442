"""`koda topics check`'s broker half: which broker settings refuse the workers' group
timings (topics/admin.py ``refused_timings``). Pure code over config maps; the read from
a real broker is tests/integration/test_broker_timings.py."""

from __future__ import annotations

from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import group_timings, refused_timings

# Kafka 4's defaults for the bounds (a broker nobody tuned).
KAFKA_DEFAULTS = {
    "group.consumer.min.session.timeout.ms": "45000",
    "group.consumer.max.session.timeout.ms": "60000",
    "group.consumer.min.heartbeat.interval.ms": "5000",
    "group.consumer.max.heartbeat.interval.ms": "15000",
    "group.min.session.timeout.ms": "6000",
    "group.max.session.timeout.ms": "1800000",
}
# What deploy/compose.yaml and the local stack set.
WIDENED = {
    **KAFKA_DEFAULTS,
    "group.consumer.min.session.timeout.ms": "1000",
    "group.consumer.max.session.timeout.ms": "300000",
    "group.consumer.min.heartbeat.interval.ms": "100",
    "group.consumer.max.heartbeat.interval.ms": "60000",
}


def settings(**overrides: object) -> Settings:
    return Settings(app_env=AppEnv.DEV, **overrides)  # type: ignore[arg-type]


def test_kafkas_defaults_refuse_the_consumer_protocols_10_s_and_3_s() -> None:
    refusals, unchecked = refused_timings(
        group_timings(settings()), {"1": KAFKA_DEFAULTS, "2": KAFKA_DEFAULTS}
    )
    assert unchecked == []
    assert [str(r) for r in refusals] == [
        "broker 1,2: group.consumer.min.session.timeout.ms=45000 is above KODA_SESSION_TIMEOUT"
        " (10000 ms), which the broker refuses for the workers' group: lower it to at most"
        " 10000, or change KODA_SESSION_TIMEOUT",
        "broker 1,2: group.consumer.min.heartbeat.interval.ms=5000 is above"
        " KODA_KAFKA_HEARTBEAT (3000 ms), which the broker refuses for the workers' group:"
        " lower it to at most 3000, or change KODA_KAFKA_HEARTBEAT",
    ]


def test_widened_bounds_allow_them() -> None:
    assert refused_timings(group_timings(settings()), {"1": WIDENED}) == ([], [])


def test_a_maximum_below_the_setting_is_refused_too() -> None:
    timings = group_timings(settings(session_timeout_s=120.0))
    capped = {**WIDENED, "group.consumer.max.session.timeout.ms": "60000"}
    (refusal,) = refused_timings(timings, {"1": WIDENED, "2": capped})[0]
    assert str(refusal).startswith(
        "broker 2: group.consumer.max.session.timeout.ms=60000 is below KODA_SESSION_TIMEOUT"
        " (120000 ms)"
    )
    assert "raise it to at least 120000" in str(refusal)


def test_the_classic_protocol_is_bounded_by_the_classic_settings() -> None:
    classic = group_timings(settings(group_protocol="classic"))
    assert [(t.low, t.high) for t in classic] == [
        ("group.min.session.timeout.ms", "group.max.session.timeout.ms")
    ]
    # The classic default minimum (6 s) allows 10 s, whatever the consumer bounds say.
    assert refused_timings(classic, {"1": KAFKA_DEFAULTS}) == ([], [])
    short = group_timings(settings(group_protocol="classic", session_timeout_s=5.0))
    (refusal,) = refused_timings(short, {"1": KAFKA_DEFAULTS})[0]
    assert (refusal.config, refusal.value, refusal.brokers) == (
        "group.min.session.timeout.ms",
        6000,
        ("1",),
    )


def test_bounds_a_broker_does_not_describe_are_named_as_unchecked() -> None:
    hidden = {"1": {}, "2": {"group.consumer.min.session.timeout.ms": "1000"}}
    refusals, unchecked = refused_timings(group_timings(settings()), hidden)
    assert refusals == []
    assert unchecked == [
        "group.consumer.max.heartbeat.interval.ms",
        "group.consumer.max.session.timeout.ms",
        "group.consumer.min.heartbeat.interval.ms",
        "group.consumer.min.session.timeout.ms",
    ]

"""The pure webhook rules (koda/webhooks.py): signatures, the URL and address rules, backoff."""

from __future__ import annotations

import base64
import random

import pytest

from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings
from koda_runtime.webhooks import (
    UrlPolicy,
    WebhookUrlRefused,
    address_refused,
    check_url,
    new_secret,
    resolve_checked,
    retry_delay,
    sign,
    verify,
)

PROD = UrlPolicy(allow_http=False, allow_private=False)
DEV = UrlPolicy(allow_http=True, allow_private=True)


def test_signatures_match_the_standard_webhooks_test_vector() -> None:
    # The specification's published example: any Standard Webhooks library verifies koda.
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    expected = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == expected
    assert verify(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body, f"v1,x {expected}")
    assert not verify(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265331, body, expected)
    assert not verify(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body + b" ", expected)


def test_new_secrets_are_whsec_and_32_random_bytes() -> None:
    a, b = new_secret(), new_secret()
    assert a != b and a.startswith("whsec_")
    assert len(base64.b64decode(a[len("whsec_") :])) == 32
    with pytest.raises(ValueError, match="whsec_"):
        sign("not-a-secret", "m", 1, b"")


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",  # noqa: S104 - an address under test
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fd00::1",
        "::ffff:127.0.0.1",
    ],
)
def test_non_public_addresses_are_refused(address: str) -> None:
    assert address_refused(address)


@pytest.mark.parametrize("address", ["93.184.215.14", "2606:4700::1111", "8.8.8.8"])
def test_public_addresses_pass(address: str) -> None:
    assert not address_refused(address)


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("http://example.com/h", "url"),
        ("example.com/h", "url"),
        ("https:///h", "url"),
        ("https://u:p@example.com/h", "url"),
        ("https://example.com:0/h", "url"),
        ("https://example.com:99999/h", "url"),
        ("https://exa mple.com/h", "url"),
        ("https://example.com/" + "x" * 2048, "url"),
        ("https://127.0.0.1/h", "address"),
        ("https://[::1]/h", "address"),
        ("https://localhost:8443/h", "address"),
        ("https://api.localhost/h", "address"),
    ],
)
def test_prod_refuses_each_broken_rule_and_names_it(url: str, rule: str) -> None:
    with pytest.raises(WebhookUrlRefused) as refused:
        check_url(url, PROD)
    assert refused.value.rule == rule
    assert ("non-public" in refused.value.message) == (rule == "address")


@pytest.mark.parametrize("bad", [None, 3, "", ["https://example.com"]])
def test_a_url_that_is_no_string_is_refused(bad: object) -> None:
    with pytest.raises(WebhookUrlRefused, match="url must be"):
        check_url(bad, PROD)


def test_dev_allows_http_and_loopback_and_prod_allows_public_https() -> None:
    assert check_url("http://127.0.0.1:9000/h", DEV) == "http://127.0.0.1:9000/h"
    assert check_url("https://hooks.example.com/x?a=1", PROD) == "https://hooks.example.com/x?a=1"
    with pytest.raises(WebhookUrlRefused):
        check_url("ftp://example.com", DEV)


def test_the_policy_follows_the_environment_and_the_setting() -> None:
    dev = Settings(app_env=AppEnv.DEV)
    assert UrlPolicy.of(dev) == UrlPolicy(allow_http=True, allow_private=True)
    assert UrlPolicy.of(dev.with_(webhook_allow_private=False)).allow_private is False
    prod = Settings(app_env=AppEnv.PROD, handler="openai", kafka_allow_plaintext=True)
    assert UrlPolicy.of(prod) == UrlPolicy(allow_http=False, allow_private=False)
    allowed = prod.with_(webhook_allow_private=True)
    assert UrlPolicy.of(allowed) == UrlPolicy(allow_http=False, allow_private=True)


def test_resolution_refuses_a_name_with_any_private_address() -> None:
    with pytest.raises(WebhookUrlRefused, match="non-public"):
        resolve_checked("localhost", 443, PROD)
    assert resolve_checked("127.0.0.1", 443, DEV) == ["127.0.0.1"]


def test_backoff_doubles_with_jitter_up_to_the_cap() -> None:
    rand = random.Random(7)
    for attempt, whole in ((1, 5.0), (2, 10.0), (3, 20.0), (8, 300.0), (400, 300.0)):
        for _ in range(50):
            delay = retry_delay(attempt, 5.0, 300.0, rand)
            assert whole / 2 <= delay <= whole


async def test_the_dispatchers_resolver_refuses_a_name_that_now_points_inside() -> None:
    # DNS rebinding: the name is checked at every connection, not only at creation.
    from koda_runtime.processors.webhooks import GuardedResolver

    guarded = GuardedResolver(PROD)
    try:
        with pytest.raises(WebhookUrlRefused, match="localhost resolves to"):
            await guarded.resolve("localhost", 443)
    finally:
        await guarded.close()
    open_ = GuardedResolver(DEV)
    try:
        assert {r["host"] for r in await open_.resolve("localhost", 443)} <= {"127.0.0.1", "::1"}
    finally:
        await open_.close()


def test_only_terminal_records_name_ended_runs() -> None:
    from koda_runtime.processors.webhooks import terminal_runs
    from koda_runtime.topics.records.codec import FinalRecord, chunk_value

    class Msg:
        def __init__(self, key: bytes | None, value: bytes | None) -> None:
            self._key, self._value = key, value

        def key(self) -> bytes | None:
            return self._key

        def value(self) -> bytes | None:
            return self._value

        def error(self) -> None:
            return None

    def chunk(run: str, seq: int, kind: str) -> Msg:
        value = chunk_value(run, seq, kind, "x", 1)
        return Msg(f"{run}:{seq:010d}".encode(), value)

    final = FinalRecord("r4", last_seq=3, end="done", end_content="", content="a", attempt=1)
    records = [
        chunk("r1", 0, "chunk"),
        chunk("r1", 1, "done"),
        chunk("r2", 0, "error"),
        chunk("r3", 0, "cancelled"),
        chunk("r5", 0, "reset"),
        Msg(b"r4:final", final.encode()),
        Msg(b"r6:0000000001", None),  # a tombstone
        Msg(b"junk", b"{}"),
        Msg(b"r7:0000000000", b"not json"),
        Msg(b"r8:0000000000", chunk("other", 0, "done").value()),  # not its key's
    ]
    assert terminal_runs(records) == {"r1", "r2", "r3", "r4"}  # type: ignore[arg-type]

from __future__ import annotations

import pytest

from koda_runtime.gateway.auth import Authenticator, valid_user_id
from koda_runtime.gateway.errors import Unauthorized
from koda_runtime.naming import AppEnv


def dev() -> Authenticator:
    return Authenticator(AppEnv.DEV, {})


def prod() -> Authenticator:
    return Authenticator(AppEnv.PROD, {"tok-alice-0123456789": "alice", "tok-bob": "bob"})


def test_dev_token_authenticates_as_its_user() -> None:
    assert dev().authenticate("Bearer dev:alice") == "alice"
    assert dev().authenticate("bearer dev:a.b_c-d@e") == "a.b_c-d@e"
    assert dev().authenticate("Bearer " + "dev:" + "x" * 128) == "x" * 128


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic dev:alice",
        "dev:alice",
        "Bearer alice",
        "Bearer dev:",
        "Bearer dev:" + "x" * 129,
        "Bearer dev:al ice",
        "Bearer dev:al/ice",
        "Bearer dev:ålice",
        "Bearer dev:alice\x00",
    ],
)
def test_dev_refuses_missing_or_malformed_tokens(header: str | None) -> None:
    with pytest.raises(Unauthorized):
        dev().authenticate(header)


def test_prod_refuses_dev_tokens_even_for_a_configured_user() -> None:
    with pytest.raises(Unauthorized, match="dev tokens are refused in prod"):
        prod().authenticate("Bearer dev:alice")


def test_prod_maps_configured_tokens_to_users() -> None:
    assert prod().authenticate("Bearer tok-alice-0123456789") == "alice"
    assert prod().authenticate("Bearer tok-bob") == "bob"


@pytest.mark.parametrize(
    "token", ["tok-alice", "tok-alice-01234567890", "TOK-BOB", "tok-böb", "x" * 5000]
)
def test_prod_refuses_unknown_tokens(token: str) -> None:
    with pytest.raises(Unauthorized):
        prod().authenticate(f"Bearer {token}")


def test_error_messages_never_echo_the_token() -> None:
    secret = "sup3r-s3cret-token-value"
    with pytest.raises(Unauthorized) as info:
        prod().authenticate(f"Bearer {secret}")
    assert secret not in str(info.value)
    assert secret not in repr(info.value.body())


def test_user_id_rule() -> None:
    assert valid_user_id("a")
    assert not valid_user_id("")
    assert not valid_user_id("a:b")

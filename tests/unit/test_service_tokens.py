"""Service tokens, pure parts: KODA_SERVICE_TOKENS' syntax and prod's refusals, the
principal a request resolves to, and the scope each route needs."""

from __future__ import annotations

import pytest

from koda_runtime.errors import ConfigError
from koda_runtime.gateway.auth import Authenticator
from koda_runtime.gateway.errors import BadRequest, Forbidden, Unauthorized
from koda_runtime.gateway.principal import CANCEL, READ, SUBMIT, scope_for
from koda_runtime.naming import AppEnv
from koda_runtime.settings import ServiceToken, Settings

SERVICE = "svc-" + "a1b2c3d4e5f6" * 3
USER_TOKEN = "usr-" + "f6e5d4c3b2a1" * 3
PROD = {"APP_ENV": "prod", "KODA_HANDLER": "openai", "KODA_KAFKA_ALLOW_PLAINTEXT": "true"}


def parsed(raw: str) -> dict[str, ServiceToken]:
    return dict(Settings.from_env({"APP_ENV": "dev", "KODA_SERVICE_TOKENS": raw}).service_tokens)


def test_service_tokens_are_token_name_and_scopes_joined_by_plus() -> None:
    assert parsed(" t1 : billing : submit+read , t2:ops:cancel ") == {
        "t1": ServiceToken("billing", frozenset({"submit", "read"})),
        "t2": ServiceToken("ops", frozenset({"cancel"})),
    }


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ("t1:billing", "entry 1 is not <token>:<name>:<scope>+<scope>"),
        ("t1:billing:submit,t2:ops:write", "entry 2 (service 'ops'): unknown scope 'write'"),
        ("t1:bad/name:read", "entry 1: the name 'bad/name' is not 1-64 chars"),
        ("t1:a:read,t1:b:read", "entry 2 (service 'b') repeats the token of service 'a'"),
        ("t1:a:read,t2:a:submit", "entry 2: service 'a' is named twice"),
    ],
)
def test_a_bad_entry_is_refused_naming_it_and_never_the_token(raw: str, said: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parsed(raw)
    assert said in str(refused.value)
    assert "t1" not in str(refused.value).replace("entry 1", "")


def test_prod_refuses_weak_service_tokens_and_one_shared_with_a_user() -> None:
    with pytest.raises(ConfigError, match="the token of service 'billing' is 5 characters"):
        Settings.from_env(PROD | {"KODA_SERVICE_TOKENS": "short:billing:read"})
    with pytest.raises(ConfigError, match="also the KODA_API_TOKENS token of user 'u1'"):
        Settings.from_env(
            PROD
            | {
                "KODA_SERVICE_TOKENS": f"{USER_TOKEN}:billing:read",
                "KODA_API_TOKENS": f"{USER_TOKEN}:u1",
            }
        )
    fine = Settings.from_env(PROD | {"KODA_SERVICE_TOKENS": f"{SERVICE}:billing:read"})
    assert SERVICE not in repr(fine)


def auth(env: AppEnv = AppEnv.PROD, scopes: str = "submit+read+cancel") -> Authenticator:
    return Authenticator(
        env,
        {USER_TOKEN: "u1"},
        service_tokens={SERVICE: ServiceToken("billing", frozenset(scopes.split("+")))},
    )


def test_a_service_token_acts_for_the_user_its_header_names() -> None:
    p = auth().principal(f"Bearer {SERVICE}", ["u7"], SUBMIT)
    assert (p.user_id, p.created_by) == ("u7", "service:billing")
    # in dev too, beside the dev tokens
    assert auth(AppEnv.DEV).principal(f"Bearer {SERVICE}", ["u7"], READ).user_id == "u7"
    assert auth(AppEnv.DEV).principal("Bearer dev:u8", [], READ).created_by == "user:u8"


def test_a_service_token_without_the_header_or_with_a_bad_one_is_400_naming_it() -> None:
    for header, said in (([], "missing X-Koda-User"), (["a/b"], "must be a user id")):
        with pytest.raises(BadRequest, match=said) as refused:
            auth().principal(f"Bearer {SERVICE}", header, SUBMIT)
        assert refused.value.field == "X-Koda-User"
    with pytest.raises(BadRequest, match="more than once"):
        auth().principal(f"Bearer {SERVICE}", ["u1", "u2"], SUBMIT)


def test_a_missing_scope_is_403_naming_it() -> None:
    with pytest.raises(Forbidden, match="lacks the 'cancel' scope") as refused:
        auth(scopes="submit+read").principal(f"Bearer {SERVICE}", ["u1"], CANCEL)
    assert refused.value.code == "missing_scope"


def test_a_user_token_may_name_itself_only() -> None:
    assert auth().principal(f"Bearer {USER_TOKEN}", ["u1"], CANCEL).user_id == "u1"
    assert auth().principal(f"Bearer {USER_TOKEN}", [], CANCEL).user_id == "u1"
    with pytest.raises(Forbidden, match="names another user") as refused:
        auth().principal(f"Bearer {USER_TOKEN}", ["u2"], READ)
    assert refused.value.field == "X-Koda-User"


def test_a_wrong_token_is_still_401_and_a_service_token_names_no_user_by_itself() -> None:
    with pytest.raises(Unauthorized):
        auth().principal(f"Bearer {SERVICE}x", ["u1"], READ)
    with pytest.raises(Unauthorized, match="send X-Koda-User"):
        auth().authenticate(f"Bearer {SERVICE}")


@pytest.mark.parametrize(
    ("method", "path", "scope"),
    [
        ("POST", "/v1/runs", SUBMIT),
        ("POST", "/v1/runs/batch", SUBMIT),
        ("POST", "/v1/chat", SUBMIT),
        ("POST", "/v1/responses", SUBMIT),
        ("PUT", "/v1/schedules/s1", SUBMIT),
        ("GET", "/v1/runs/r1", READ),
        ("GET", "/v1/runs/r1/events", READ),
        ("GET", "/v1/sessions/s1/runs", READ),
        ("POST", "/v1/runs/r1/stream-ticket", READ),
        ("POST", "/v1/runs/r1/cancel", CANCEL),
        ("POST", "/v1/responses/resp_1/cancel", CANCEL),
        ("DELETE", "/v1/chat/c1/stream", CANCEL),
    ],
)
def test_each_route_needs_its_scope(method: str, path: str, scope: str) -> None:
    assert scope_for(method, path) == scope

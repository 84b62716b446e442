"""Bearer tokens to user ids (docs/design.md §11), and who may open ``/admin``.

* ``dev``: a token ``dev:<user_id>`` authenticates as ``<user_id>``.
* ``prod``: dev tokens are refused; a token must be one of ``settings.prod_tokens``
  (token -> user_id), compared in constant time.
* ``/admin``: see :func:`check_admin`.

Tokens never appear in logs or error messages. The FastAPI dependencies that apply
these checks to a request are in gateway/dependencies.py.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping

from fastapi import Request
from fastapi.security import HTTPBearer

from koda_runtime.gateway.errors import Forbidden, Unauthorized
from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings

# The schemes as OpenAPI declares them; the checks themselves are below.
BEARER = HTTPBearer(auto_error=False, description="dev: 'dev:<user_id>'; prod: an API token")
ADMIN_BEARER = HTTPBearer(
    auto_error=False, scheme_name="AdminToken", description="KODA_ADMIN_TOKEN (prod: required)"
)

DEV_PREFIX = "dev:"
USER_ID = re.compile(r"[A-Za-z0-9._@-]{1,128}")
MAX_TOKEN_CHARS = 4096


def valid_user_id(user_id: str) -> bool:
    """1-128 chars of ``[A-Za-z0-9._@-]``."""
    return USER_ID.fullmatch(user_id) is not None


class Authenticator:
    """Turns an ``Authorization`` header into a user id, or raises :class:`Unauthorized`."""

    def __init__(self, app_env: AppEnv, prod_tokens: Mapping[str, str]) -> None:
        self._env = app_env
        # Compare bytes so a non-ASCII token cannot make compare_digest raise.
        self._tokens = [(t.encode(), u) for t, u in prod_tokens.items()]

    @classmethod
    def from_settings(cls, settings: Settings) -> Authenticator:
        return cls(settings.app_env, settings.prod_tokens)

    def authenticate(self, authorization: str | None) -> str:
        """The user id of a ``Bearer <token>`` header value."""
        if not authorization:
            raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("malformed Authorization header: use 'Bearer <token>'")
        if len(token) > MAX_TOKEN_CHARS:
            raise Unauthorized("invalid bearer token")
        if self._env is AppEnv.DEV:
            return self._dev_user(token)
        return self._prod_user(token)

    def _dev_user(self, token: str) -> str:
        if not token.startswith(DEV_PREFIX):
            raise Unauthorized("invalid bearer token: in dev use 'dev:<user_id>'")
        user_id = token[len(DEV_PREFIX) :]
        if not valid_user_id(user_id):
            raise Unauthorized(
                "invalid dev token: the user id must be 1-128 chars of A-Z a-z 0-9 . _ @ -"
            )
        return user_id

    def _prod_user(self, token: str) -> str:
        if token.startswith(DEV_PREFIX):
            raise Unauthorized("dev tokens are refused in prod: use a configured API token")
        presented = token.encode()
        found: str | None = None
        # Visit every configured token so timing does not reveal which one matched.
        for candidate, user_id in self._tokens:
            if hmac.compare_digest(candidate, presented):
                found = user_id
        if found is None:
            raise Unauthorized("invalid bearer token")
        return found


def authenticate_request(
    request: Request, auth: Authenticator, access_token: str | None = None
) -> str:
    """The user id of the request's bearer token; noted on the request for its log line.

    ``access_token`` (the events endpoint's query parameter, for clients that cannot
    set headers) counts only when there is no ``Authorization`` header.
    """
    authorization = request.headers.get("authorization")
    if not authorization and access_token:
        authorization = f"Bearer {access_token}"
    user_id = auth.authenticate(authorization)
    request.state.user_id = user_id
    return user_id


def check_admin(authorization: str | None, settings: Settings) -> None:
    """Raise unless this ``Authorization`` header may open ``/admin``.

    * ``KODA_ADMIN_TOKEN`` set: the header must be ``Bearer <that token>`` (compared in
      constant time), in any environment.
    * not set: open in ``dev``; in ``prod`` refused with 403 until a token is configured.

    The admin token is not a user token: ``dev:<user>`` and ``KODA_API_TOKENS`` never
    open ``/admin``.
    """
    token = settings.admin_token
    if token is None:
        if settings.app_env is AppEnv.PROD:
            raise Forbidden("/admin is closed in prod until KODA_ADMIN_TOKEN is configured")
        return
    scheme, _, presented = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        presented.strip().encode(), token.encode()
    ):
        raise Unauthorized("/admin needs 'Authorization: Bearer <KODA_ADMIN_TOKEN>'")

"""Bearer tokens to user ids (docs/design.md §11).

* ``dev``: a token ``dev:<user_id>`` authenticates as ``<user_id>``.
* ``prod``: dev tokens are refused; a token must be one of ``settings.prod_tokens``
  (token -> user_id), compared in constant time.

Tokens never appear in logs or error messages.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping

from gateway.errors import Unauthorized
from koda.naming import AppEnv
from koda.settings import Settings

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

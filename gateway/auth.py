"""Bearer tokens to user ids (docs/design.md §11), and who may open ``/admin``.

* ``dev``: a token ``dev:<user_id>`` authenticates as ``<user_id>``.
* ``prod``: dev tokens are refused; a token must be one of ``settings.prod_tokens``
  (token -> user_id), compared in constant time.
* ``/admin``: see :func:`check_admin`.
* **Failed logins** (every 401 of a token, a ticket or the admin token) are counted per
  client address (:class:`FailedLogins`): past ``KODA_AUTH_FAILURES`` in
  ``KODA_AUTH_FAILURE_WINDOW`` the address is answered 429 with ``Retry-After``, before
  any token is looked at. The count is in this process's memory, per gateway replica.
* **Stream tickets** (:class:`StreamTickets`): a browser's ``EventSource`` cannot send a
  header, so the owner of a run asks for a ticket (``POST /v1/runs/{id}/stream-ticket``)
  and opens ``/v1/runs/{id}/events?ticket=...``. A ticket is an HMAC over the run id, the
  user and its expiry (60 s): it opens that run's events only, for that user only.

Tokens never appear in logs or error messages. The FastAPI dependencies that apply
these checks to a request are in gateway/dependencies.py.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fastapi import Request
from fastapi.security import HTTPBearer

from koda_runtime.gateway.errors import Forbidden, GatewayError, Unauthorized
from koda_runtime.naming import AppEnv
from koda_runtime.settings import USER_ID, Settings

# The schemes as OpenAPI declares them; the checks themselves are below.
BEARER = HTTPBearer(auto_error=False, description="dev: 'dev:<user_id>'; prod: an API token")
ADMIN_BEARER = HTTPBearer(
    auto_error=False, scheme_name="AdminToken", description="KODA_ADMIN_TOKEN (prod: required)"
)

DEV_PREFIX = "dev:"
MAX_TOKEN_CHARS = 4096
TICKET_TTL_S = 60
MAX_TICKET_CHARS = 512
_TICKET_VERSION = "t1"


def valid_user_id(user_id: str) -> bool:
    """1-128 chars of ``[A-Za-z0-9._@-]``."""
    return USER_ID.fullmatch(user_id) is not None


class TooManyFailedLogins(GatewayError):
    status = 429
    code = "too_many_failed_logins"

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(
            f"too many failed logins from this address: retry after {retry_after_s} s",
            headers={"Retry-After": str(retry_after_s)},
        )
        self.retry_after_s = retry_after_s


@dataclass
class _Failures:
    allowance: float  # failures this address may still have before it is refused
    updated: float


class FailedLogins:
    """Failed logins per client address: ``limit`` per ``window_s``, then 429.

    A token bucket per address: each failure spends one of ``limit``, which come back
    at ``limit / window_s`` a second. While an address has less than one left, every
    request from it is refused before its token is checked (so a correct guess looks
    the same as a wrong one). Kept for at most ``max_addresses`` recent addresses
    (least recently failed forgotten first), in this process only.
    """

    def __init__(
        self,
        limit: int,
        window_s: float,
        *,
        max_addresses: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 1 or window_s <= 0:
            raise ValueError("limit must be >= 1 and window_s > 0")
        self.limit = limit
        self.rate_per_s = limit / window_s
        self._max = max_addresses
        self._clock = clock
        self._seen: OrderedDict[str, _Failures] = OrderedDict()

    def _refilled(self, address: str, now: float) -> _Failures | None:
        entry = self._seen.get(address)
        if entry is not None:
            elapsed = max(0.0, now - entry.updated)
            entry.allowance = min(float(self.limit), entry.allowance + elapsed * self.rate_per_s)
            entry.updated = now
            if entry.allowance >= self.limit:
                del self._seen[address]  # back to a clean slate: nothing to remember
                return None
        return entry

    def check(self, address: str) -> None:
        """Raise :class:`TooManyFailedLogins` while ``address`` may not try."""
        entry = self._refilled(address, self._clock())
        if entry is not None and entry.allowance < 1.0:
            wait_s = (1.0 - entry.allowance) / self.rate_per_s
            raise TooManyFailedLogins(max(1, math.ceil(wait_s)))

    def failed(self, address: str) -> None:
        """Count one failed login of ``address``."""
        now = self._clock()
        entry = self._refilled(address, now)
        if entry is None:
            entry = _Failures(float(self.limit), now)
        else:
            self._seen.move_to_end(address)
        entry.allowance = max(0.0, entry.allowance - 1.0)
        self._seen[address] = entry
        if len(self._seen) > self._max:
            self._seen.popitem(last=False)

    @property
    def addresses(self) -> int:
        """How many addresses have failures remembered."""
        return len(self._seen)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def ticket_secret(settings: Settings) -> bytes:
    """The key stream tickets are signed with: ``KODA_STREAM_TICKET_SECRET``, else derived.

    Derived from what every replica of one deployment shares (the API tokens, the admin
    token and the database URL), so a ticket one gateway issues opens the stream on
    another. A prod without any token has nothing secret to derive from: it draws a key
    per process (tickets then open streams on the issuing gateway only).
    """
    if settings.stream_ticket_secret:
        return hashlib.sha256(settings.stream_ticket_secret.encode()).digest()
    has_secret = bool(settings.prod_tokens) or settings.admin_token is not None
    if settings.app_env is AppEnv.PROD and not has_secret:
        return secrets.token_bytes(32)
    parts = [
        settings.app_env.value,
        settings.namespace or "",
        settings.database_url,
        settings.admin_token or "",
        *sorted(f"{t}:{u}" for t, u in settings.prod_tokens.items()),
    ]
    return hmac.new(b"koda stream tickets", "\0".join(parts).encode(), hashlib.sha256).digest()


class StreamTickets:
    """Short-lived, run-scoped tickets that open one run's events for one user.

    A ticket is ``t1.<expiry>.<user, base64url>.<HMAC-SHA256, base64url>``; the MAC covers
    the run id (which the ticket does not carry: the URL names it), the user and the
    expiry (Unix seconds). Anyone holding it may open that run's events until it
    expires; it opens nothing else.
    """

    def __init__(
        self, key: bytes, *, ttl_s: int = TICKET_TTL_S, clock: Callable[[], float] = time.time
    ) -> None:
        self._key = key
        self.ttl_s = ttl_s
        self._clock = clock

    def _mac(self, run_id: str, user_id: str, expires: int) -> bytes:
        message = f"{_TICKET_VERSION}\n{run_id}\n{user_id}\n{expires}".encode()
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def issue(self, run_id: str, user_id: str, *, now: float | None = None) -> tuple[str, int]:
        """A ticket for ``run_id`` and ``user_id``, and when it expires (Unix seconds)."""
        expires = int(self._clock() if now is None else now) + self.ttl_s
        mac = self._mac(run_id, user_id, expires)
        ticket = f"{_TICKET_VERSION}.{expires}.{_b64(user_id.encode())}.{_b64(mac)}"
        return ticket, expires

    def user_of(self, ticket: str, run_id: str) -> str:
        """The user a ticket for ``run_id`` was issued to; :class:`Unauthorized` otherwise."""
        invalid = Unauthorized(
            "invalid stream ticket: ask POST /v1/runs/{run_id}/stream-ticket for one"
        )
        parts = ticket.split(".") if len(ticket) <= MAX_TICKET_CHARS else []
        if len(parts) != 4 or parts[0] != _TICKET_VERSION or not parts[1].isdigit():
            raise invalid
        try:
            user_id = _unb64(parts[2]).decode()
            mac = _unb64(parts[3])
        except (binascii.Error, ValueError):
            raise invalid from None
        expires = int(parts[1])
        if not valid_user_id(user_id) or not hmac.compare_digest(
            mac, self._mac(run_id, user_id, expires)
        ):
            raise invalid
        if self._clock() >= expires:
            raise Unauthorized(
                "stream ticket expired: ask POST /v1/runs/{run_id}/stream-ticket for a new one"
            )
        return user_id


class Authenticator:
    """Turns an ``Authorization`` header into a user id, or raises :class:`Unauthorized`.

    Holds the gateway's :class:`FailedLogins` (``failures``) and :class:`StreamTickets`
    (``tickets``) too, so every check of a request goes through one object.
    """

    def __init__(
        self,
        app_env: AppEnv,
        prod_tokens: Mapping[str, str],
        *,
        failures: FailedLogins | None = None,
        tickets: StreamTickets | None = None,
    ) -> None:
        self._env = app_env
        # Compare bytes so a non-ASCII token cannot make compare_digest raise.
        self._tokens = [(t.encode(), u) for t, u in prod_tokens.items()]
        self.failures = failures if failures is not None else FailedLogins(20, 60.0)
        self.tickets = tickets if tickets is not None else StreamTickets(secrets.token_bytes(32))

    @property
    def app_env(self) -> AppEnv:
        return self._env

    @classmethod
    def from_settings(cls, settings: Settings) -> Authenticator:
        return cls(
            settings.app_env,
            settings.prod_tokens,
            failures=FailedLogins(settings.auth_failures, settings.auth_failure_window_s),
            tickets=StreamTickets(ticket_secret(settings)),
        )

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


def client_address(request: Request) -> str:
    """The address failed logins are counted under: the peer uvicorn reports (behind a
    proxy, the client's only when uvicorn trusts the proxy's X-Forwarded-For)."""
    client = request.client
    return client.host if client is not None and client.host else "-"


def authenticate_request(request: Request, auth: Authenticator) -> str:
    """The user id of the request's bearer token; noted on the request for its log line.

    429 while the client's address has too many failed logins; a 401 counts as one.
    """
    return _counted(request, auth, lambda: auth.authenticate(request.headers.get("authorization")))


def authenticate_stream(
    request: Request,
    auth: Authenticator,
    run_id: str,
    ticket: str | None,
    access_token: str | None,
) -> str:
    """The user of a request for ``run_id``'s events.

    In order: an ``Authorization`` header; else ``?ticket=`` (a :class:`StreamTickets`
    ticket for this run); else, in dev only, ``?access_token=`` (a dev token names a
    user and holds no secret; in prod it is refused, so no long-lived token is put in
    a URL). Counted like every login.
    """

    def check() -> str:
        authorization = request.headers.get("authorization")
        if authorization or (not ticket and not access_token):
            return auth.authenticate(authorization)
        if ticket:
            return auth.tickets.user_of(ticket, run_id)
        if auth.app_env is AppEnv.PROD:
            raise Unauthorized(
                "?access_token= is refused in prod: open the stream with ?ticket= from "
                "POST /v1/runs/{run_id}/stream-ticket, or send an Authorization header"
            )
        return auth.authenticate(f"Bearer {access_token}")

    return _counted(request, auth, check)


def _counted(request: Request, auth: Authenticator, check: Callable[[], str]) -> str:
    address = client_address(request)
    auth.failures.check(address)
    try:
        user_id = check()
    except Unauthorized:
        auth.failures.failed(address)
        raise
    request.state.user_id = user_id
    return user_id


def admit_admin(request: Request, auth: Authenticator, settings: Settings) -> None:
    """:func:`check_admin` of a request, its 401s counted as failed logins."""
    address = client_address(request)
    auth.failures.check(address)
    try:
        check_admin(request.headers.get("authorization"), settings)
    except Unauthorized:
        auth.failures.failed(address)
        raise


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

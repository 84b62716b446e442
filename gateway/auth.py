"""Bearer tokens to user ids (docs/design.md §11), and who may open ``/admin``.

* ``dev``: a token ``dev:<user_id>`` authenticates as ``<user_id>``.
* ``prod``: dev tokens are refused; a token must be one of ``settings.prod_tokens``
  (token -> user_id), compared in constant time.
* **Service tokens** (``KODA_SERVICE_TOKENS``, dev and prod): a backend's token, with a
  name and scopes, acting for the user its ``X-Koda-User`` header names (400 without
  it; 403 when the request needs a scope the token lacks, gateway/principal.py). A
  user's token may send the header naming itself only (403 otherwise). Every request's
  :class:`~koda_runtime.gateway.principal.Principal` is resolved here, once.
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

from koda_runtime.gateway.errors import BadRequest, Forbidden, GatewayError, Unauthorized
from koda_runtime.gateway.principal import (
    CURRENT,
    ON_BEHALF_HEADER,
    READ,
    Principal,
    scope_for,
)
from koda_runtime.naming import AppEnv
from koda_runtime.settings import USER_ID, ServiceToken, Settings

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
    has_secret = (
        bool(settings.prod_tokens)
        or bool(settings.service_tokens)
        or settings.admin_token is not None
    )
    if settings.app_env is AppEnv.PROD and not has_secret:
        return secrets.token_bytes(32)
    parts = [
        settings.app_env.value,
        settings.namespace or "",
        settings.database_url,
        settings.admin_token or "",
        *sorted(f"{t}:{u}" for t, u in settings.prod_tokens.items()),
        # Only when configured, so that adding none leaves existing tickets valid.
        *sorted(f"service {t}:{s.name}" for t, s in settings.service_tokens.items()),
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
        service_tokens: Mapping[str, ServiceToken] | None = None,
    ) -> None:
        self._env = app_env
        # Compare bytes so a non-ASCII token cannot make compare_digest raise.
        self._tokens = [(t.encode(), u) for t, u in prod_tokens.items()]
        self._services = [(t.encode(), s) for t, s in (service_tokens or {}).items()]
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
            service_tokens=settings.service_tokens,
        )

    def authenticate(self, authorization: str | None) -> str:
        """The user id of a user's ``Bearer <token>`` header value (401 for a service
        token, which names no user by itself: see :meth:`principal`)."""
        caller = self.identify(authorization)
        if caller.kind != "user":
            raise Unauthorized(
                f"a service token acts for a user: send {ON_BEHALF_HEADER} with the user id"
            )
        return caller.user_id

    def principal(
        self,
        authorization: str | None,
        on_behalf: list[str],
        scope: str,
        *,
        require_user: bool = True,
    ) -> Principal:
        """The caller of a request needing ``scope``, acting for the user ``on_behalf``
        (the ``X-Koda-User`` header's values) names.

        401 for a bad token; 400 for a service token without the header (unless
        ``require_user`` is False: then its ``user_id`` is empty) or a header that is not
        one valid user id; 403 for a user token naming another user, or a service token
        without ``scope``.
        """
        caller = self.identify(authorization)
        if len(on_behalf) > 1:
            raise BadRequest(
                f"{ON_BEHALF_HEADER} header sent more than once: name one user",
                field=ON_BEHALF_HEADER,
                code="invalid_header",
            )
        named = on_behalf[0].strip() if on_behalf else None
        if named is not None and not valid_user_id(named):
            raise BadRequest(
                f"{ON_BEHALF_HEADER} must be a user id: 1-128 chars of A-Z a-z 0-9 . _ @ -",
                field=ON_BEHALF_HEADER,
                code="invalid_header",
            )
        if caller.kind == "user":
            if named is not None and named != caller.user_id:
                raise Forbidden(
                    f"{ON_BEHALF_HEADER} names another user: a user's token acts for its "
                    "own user only (a backend acting for users needs a service token)",
                    field=ON_BEHALF_HEADER,
                )
            return caller
        if not caller.allows(scope):
            held = ", ".join(sorted(caller.scopes or ())) or "none"
            raise Forbidden(
                f"service token {caller.name!r} lacks the {scope!r} scope this request needs "
                f"(it has: {held}); add it in KODA_SERVICE_TOKENS",
                field="scope",
                code="missing_scope",
            )
        if named is None:
            if require_user:
                raise BadRequest(
                    f"missing {ON_BEHALF_HEADER} header: a service token acts for the user "
                    "this header names",
                    field=ON_BEHALF_HEADER,
                    code="missing_header",
                )
            return caller
        return caller.acting_for(named)

    def identify(self, authorization: str | None) -> Principal:
        """The caller a ``Bearer <token>`` header value names: a user (``user_id`` its
        own) or a service (``user_id`` empty until a request names the user)."""
        if not authorization:
            raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("malformed Authorization header: use 'Bearer <token>'")
        if len(token) > MAX_TOKEN_CHARS:
            raise Unauthorized("invalid bearer token")
        service = self._service(token)
        if service is not None:
            return Principal("service", service.name, "", service.scopes)
        if self._env is AppEnv.DEV:
            user_id = self._dev_user(token)
        else:
            user_id = self._prod_user(token)
        return Principal("user", user_id, user_id)

    def _service(self, token: str) -> ServiceToken | None:
        """The service token ``token`` is, compared in constant time with every one."""
        presented = token.encode()
        found: ServiceToken | None = None
        for candidate, service in self._services:
            if hmac.compare_digest(candidate, presented):
                found = service
        return found

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
    """The user the request acts for: its token's own user, or the user a service
    token's ``X-Koda-User`` names (:meth:`Authenticator.principal`, with the scope
    :func:`~koda_runtime.gateway.principal.scope_for` the request's method and path).
    The principal is noted on the request (for its log line) and in
    :data:`~koda_runtime.gateway.principal.CURRENT` (for the runs it creates).

    429 while the client's address has too many failed logins; a 401 counts as one.
    """
    return request_principal(request, auth).user_id


def request_principal(
    request: Request, auth: Authenticator, *, require_user: bool = True
) -> Principal:
    """:func:`authenticate_request`'s principal; with ``require_user`` False a service
    token may omit ``X-Koda-User`` (its ``user_id`` is then empty: a batch whose items
    name their users)."""
    scope = scope_for(request.method, _route_path(request))
    return _counted(
        request,
        auth,
        lambda: auth.principal(
            request.headers.get("authorization"),
            request.headers.getlist(ON_BEHALF_HEADER),
            scope,
            require_user=require_user,
        ),
    )


def _route_path(request: Request) -> str:
    path: str = request.scope["path"]
    root: str = request.scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


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

    def check() -> Principal:
        authorization = request.headers.get("authorization")
        if authorization or (not ticket and not access_token):
            on_behalf = request.headers.getlist(ON_BEHALF_HEADER)
            return auth.principal(authorization, on_behalf, READ)
        if ticket:
            user_id = auth.tickets.user_of(ticket, run_id)
            return Principal("user", user_id, user_id)
        if auth.app_env is AppEnv.PROD:
            raise Unauthorized(
                "?access_token= is refused in prod: open the stream with ?ticket= from "
                "POST /v1/runs/{run_id}/stream-ticket, or send an Authorization header"
            )
        user_id = auth.authenticate(f"Bearer {access_token}")
        return Principal("user", user_id, user_id)

    return _counted(request, auth, check).user_id


def _counted(request: Request, auth: Authenticator, check: Callable[[], Principal]) -> Principal:
    address = client_address(request)
    auth.failures.check(address)
    try:
        principal = check()
    except Unauthorized:
        auth.failures.failed(address)
        raise
    request.state.user_id = principal.user_id or "-"
    request.state.principal = principal.created_by
    CURRENT.set(principal)
    return principal


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

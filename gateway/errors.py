"""Errors the gateway answers with, the one JSON shape they all take, and the mapping
of domain errors (koda_runtime.errors' Refused branch) to them.

    KodaError
    ├── GatewayError               an HTTP request is refused; carries status and code
    │   ├── Unauthorized           401 missing, malformed or unknown bearer token
    │   ├── Forbidden              403 the endpoint is closed (admin without KODA_ADMIN_TOKEN
    │   │                              in prod)
    │   ├── NotFound               404 unknown run or session, or another user's
    │   ├── PayloadTooLarge        413 body over the limit (Content-Length or streamed)
    │   ├── UnsupportedMediaType   415 body is not application/json
    │   ├── BadRequest             400 undecodable body or bad header
    │   ├── InvalidField           422 a field of the body is missing or wrong
    │   ├── PaymentRequired        402 over a budget; names the budget, spend and reset
    │   ├── RateLimited            429 over the per-user quota; carries Retry-After
    │   ├── ActiveRunsCapped       429 the user has KODA_MAX_ACTIVE_RUNS_PER_USER runs not
    │   │                              yet ended; names the cap; carries Retry-After
    │   └── Unavailable            503 Postgres could not answer; carries Retry-After
    └── (domain errors)            see koda/errors.py; :func:`http_error` maps
                                   DatabaseError to 503, SessionNotOwned to 404,
                                   OverBudget to 402 and TooManyActiveRuns to 429

Every error body is ``{"error": {"code", "message", "field"}}``; ``field`` names
the body field or header at fault, or is null. Errors raised by FastAPI itself
(unknown route, wrong method, bad path parameter) are rendered in the same shape
by :func:`install_error_handlers`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from koda_runtime.errors import DatabaseError, KodaError, SessionNotOwned, TooManyActiveRuns
from koda_runtime.lifecycle.ledger import OverBudget
from koda_runtime.schemas.ledger import money

log = logging.getLogger(__name__)


class GatewayError(KodaError):
    """A refused request: ``status`` and ``code`` are what the client sees."""

    status = 400
    code = "bad_request"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.code, self.message, self.field)


class Unauthorized(GatewayError):
    status = 401
    code = "unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="koda"'})


class Forbidden(GatewayError):
    status = 403
    code = "forbidden"


class NotFound(GatewayError):
    status = 404
    code = "not_found"


class PayloadTooLarge(GatewayError):
    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(GatewayError):
    status = 415
    code = "unsupported_media_type"


class BadRequest(GatewayError):
    status = 400
    code = "bad_request"


class InvalidField(GatewayError):
    status = 422
    code = "invalid_field"


class PaymentRequired(GatewayError):
    """A new run over the user's budget: the body's ``error.budget`` names the period,
    the limit, the spend so far and when the period resets (money as decimal strings)."""

    status = 402
    code = "budget_exceeded"

    def __init__(self, message: str, budget: dict[str, str]) -> None:
        super().__init__(message)
        self.budget = budget

    def body(self) -> dict[str, Any]:
        out = super().body()
        out["error"]["budget"] = self.budget
        return out


class RateLimited(GatewayError):
    status = 429
    code = "rate_limited"

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(
            f"too many runs submitted: retry after {retry_after_s} s",
            headers={"Retry-After": str(retry_after_s)},
        )
        self.retry_after_s = retry_after_s


# Retry-After of a refusal for too many active runs. When a slot frees is not known (a
# run ends when its handler does): a few seconds lets a client that retries resume soon
# after one of its runs ends without asking many times a second meanwhile.
ACTIVE_RUNS_RETRY_AFTER_S = 5
ACTIVE_RUNS_SETTING = "KODA_MAX_ACTIVE_RUNS_PER_USER"


class ActiveRunsCapped(GatewayError):
    """A new run of a user who has the most runs not yet ended a user may have: the
    body's ``error.active_runs`` names the setting, its value and the runs active."""

    status = 429
    code = "too_many_active_runs"

    def __init__(self, cap: int, active: int) -> None:
        super().__init__(
            f"{active} of your runs are active (pending, running or streaming) and "
            f"{ACTIVE_RUNS_SETTING}={cap} allows no more: retry after "
            f"{ACTIVE_RUNS_RETRY_AFTER_S} s, or once one of them has ended",
            headers={"Retry-After": str(ACTIVE_RUNS_RETRY_AFTER_S)},
        )
        self.cap = cap
        self.active = active

    def body(self) -> dict[str, Any]:
        out = super().body()
        out["error"]["active_runs"] = {
            "setting": ACTIVE_RUNS_SETTING,
            "cap": self.cap,
            "active": self.active,
        }
        return out


class Unavailable(GatewayError):
    status = 503
    code = "unavailable"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


def payment_required(exc: OverBudget) -> PaymentRequired:
    """The 402 answer to a run a spent budget refused: the budget, the spend, the reset."""
    over = exc.over
    return PaymentRequired(
        f"the {over.period.value}ly budget of {money(over.limit_usd)} USD is spent "
        f"({money(over.spend_usd)} USD so far); it resets at {over.resets_at.isoformat()}",
        {
            "period": over.period.value,
            "limit_usd": money(over.limit_usd) or "",
            "spend_usd": money(over.spend_usd) or "",
            "resets_at": over.resets_at.isoformat(),
        },
    )


DOMAIN_ERRORS: tuple[type[KodaError], ...] = (
    DatabaseError,
    SessionNotOwned,
    OverBudget,
    TooManyActiveRuns,
)


def http_error(exc: KodaError) -> GatewayError:
    """The answer to ``exc``: a GatewayError as it is, a domain error as its HTTP refusal.

    Raises TypeError for an error no answer is defined for (it stays a 500).
    """
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, DatabaseError):
        return Unavailable("the database is unavailable; retry shortly")
    if isinstance(exc, SessionNotOwned):
        return NotFound(str(exc), field="session_id")
    if isinstance(exc, OverBudget):
        return payment_required(exc)
    if isinstance(exc, TooManyActiveRuns):
        return ActiveRunsCapped(exc.cap, exc.active)
    raise TypeError(f"no HTTP answer is defined for {type(exc).__name__}")


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "field": field}}


def error_response(exc: GatewayError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_field",
    429: "rate_limited",
}


def _field_of(loc: tuple[Any, ...] | list[Any]) -> str | None:
    # FastAPI locations look like ("path", "run_id") or ("body", "input", 0).
    parts = list(loc)
    if parts and parts[0] in ("path", "query", "header", "body"):
        parts = parts[1:]
    return ".".join(str(p) for p in parts) or None


async def answer_error(request: Request, exc: Exception) -> JSONResponse:
    """The answer the installed handlers give to a GatewayError or a domain error (the
    request is named in the log line of a database outage)."""
    if isinstance(exc, GatewayError):
        return error_response(exc)
    return await _on_domain_error(request, exc)


async def _on_gateway_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GatewayError)
    return error_response(exc)


async def _on_domain_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DOMAIN_ERRORS)
    if isinstance(exc, DatabaseError):
        log.warning(
            "event=database_unavailable method=%s path=%s error=%s",
            request.method,
            request.url.path,
            exc,
        )
    return error_response(http_error(exc))


async def _on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    field = _field_of(first.get("loc", ()))
    message = str(first.get("msg", "invalid request"))
    if field:
        message = f"{field}: {message}"
    return JSONResponse(error_body("invalid_field", message, field), status_code=422)


async def _on_http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "error")
    detail = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
    return JSONResponse(error_body(code, detail), status_code=exc.status_code, headers=exc.headers)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error(
        "event=unhandled_error method=%s path=%s error=%s",
        request.method,
        request.url.path,
        type(exc).__name__,
        exc_info=exc,
    )
    return JSONResponse(
        error_body("internal", "the gateway failed to handle this request; retry later"),
        status_code=500,
    )


def install_error_handlers(app: FastAPI) -> None:
    """Render every error, ours and FastAPI's, as ``{"error": {...}}``."""
    app.add_exception_handler(GatewayError, _on_gateway_error)
    for domain_error in DOMAIN_ERRORS:
        app.add_exception_handler(domain_error, _on_domain_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)

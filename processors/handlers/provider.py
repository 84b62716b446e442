"""A model provider's faults: what one model call does about each, and the breaker
that sends calls to a fallback model while the primary keeps failing.

Pure rules and a little per-worker state, free of I/O; the openai handler
(processors/handlers/openai.py) makes the calls. Within one attempt of a run:

* **429** (rate limited): wait as ``retry-after-ms`` / ``Retry-After`` says (seconds or
  an HTTP date), at most ``KODA_MODEL_RETRY_AFTER_CAP``; without the header, back off
  as for a 5xx. Then call again.
* **5xx, 408, 409, a connection error, a stream that stops before its first token**:
  retry with exponential backoff and full jitter (``KODA_MODEL_RETRY_BASE`` doubling to
  ``KODA_MODEL_RETRY_CAP``, each wait drawn in [0.5, 1] of that) for up to
  ``KODA_MODEL_RETRY_WINDOW`` seconds from the call's first try; then the attempt fails
  (and the run's own retry budget, ``KODA_MAX_ATTEMPTS``, takes over).
* **Any other 4xx** (400, 401, 403, 404, 422, 413 ...): the request or the key is wrong
  and trying again cannot help: the run fails at once (``RunFailed``) naming the status
  and a short excerpt of the provider's message; no retry, no rerun, no dead letter.
* **A stream that stops mid-answer** (after a token, a tool-call fragment or the usage):
  the tokens already sent are the run's output and cannot be taken back, and calling
  again would send the answer's start twice. So the call is not repeated inside the
  attempt: its usage is billed (estimated when the provider did not report it) and
  the attempt fails; the run's next attempt starts with ``reset`` (viewers drop the
  partial answer) and a fresh call, as for any failed attempt.

The breaker (one per worker, for the primary model): ``KODA_MODEL_BREAKER_FAILURES``
429/5xx/connection failures of the primary in a row open it; while open, calls go to
``KODA_FALLBACK_MODEL``. After ``KODA_MODEL_BREAKER_OPEN`` seconds one call probes the
primary (the others keep using the fallback): a success closes the breaker, a failure
opens it again. Without a fallback model there is no breaker.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from enum import StrEnum

from koda_runtime.metrics import MODEL_BREAKER_OPEN


class CallOutcome(StrEnum):
    """What one try of a model call came to (the ``outcome`` of koda_model_calls_total)."""

    OK = "ok"
    RATE_LIMITED = "rate_limited"
    SERVER_ERROR = "server_error"
    CONNECTION_ERROR = "connection_error"
    REFUSED = "refused"
    CUT = "cut"
    CANCELLED = "cancelled"

    @property
    def retried(self) -> bool:
        """Whether the call is tried again within the attempt."""
        return self in RETRIED

    @property
    def provider_failure(self) -> bool:
        """Whether it counts against the primary in the breaker."""
        return self in RETRIED or self is CallOutcome.CUT


RETRIED = frozenset(
    {CallOutcome.RATE_LIMITED, CallOutcome.SERVER_ERROR, CallOutcome.CONNECTION_ERROR}
)
# Statuses below 500 that are worth another try: a request timeout, a conflict (the
# provider's own concurrency) and a rate limit. Every other 4xx is final.
_RETRIED_4XX = {
    408: CallOutcome.SERVER_ERROR,
    409: CallOutcome.SERVER_ERROR,
    429: CallOutcome.RATE_LIMITED,
}


def classify(status: int) -> CallOutcome:
    """The outcome of a response with HTTP ``status`` (200 is ``ok``; another 2xx or a
    3xx is a server error: an OpenAI-compatible endpoint answers a call 200 or fails)."""
    if status == 200:
        return CallOutcome.OK
    if status in _RETRIED_4XX:
        return _RETRIED_4XX[status]
    if 400 <= status < 500:
        return CallOutcome.REFUSED
    return CallOutcome.SERVER_ERROR


EXCERPT_CHARS = 200
# API keys as providers spell them (sk-..., sk-proj-...), and bearer tokens: never
# copied into a run's error, a log line or an event, whatever the provider echoes.
_SECRETS = re.compile(r"(sk-[A-Za-z0-9_*-]{3,}|Bearer\s+\S+)", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def error_excerpt(body: bytes, limit: int = EXCERPT_CHARS) -> str:
    """A short, safe excerpt of an error response: the OpenAI error body's
    ``error.message`` (with its ``code`` or ``type``), else the start of the text;
    keys redacted, control characters folded, at most ``limit`` characters."""
    text = body[:4096].decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            message = str(err.get("message") or "").strip()
            code = err.get("code") or err.get("type")
            if message:
                text = f"{message} ({code})" if code else message
        elif isinstance(err, str) and err.strip():
            text = err
    text = _CONTROL.sub(" ", _SECRETS.sub("[redacted]", text)).strip()
    if not text:
        return "(no message)"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def retry_after_s(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """The wait a response asks for: ``retry-after-ms`` (milliseconds, as OpenAI sends
    it), else ``Retry-After`` in seconds or as an HTTP date; None when absent or not
    readable. Never negative."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            ms = float(raw_ms)
        except ValueError:
            ms = math.nan
        if math.isfinite(ms):
            return max(0.0, ms / 1000.0)
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        try:
            at = parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        return max(0.0, (at - (now or datetime.now(UTC))).total_seconds())
    return max(0.0, seconds) if math.isfinite(seconds) else None


@dataclass(frozen=True)
class CallPolicy:
    """How long and how one model call is retried (the ``KODA_MODEL_*`` settings)."""

    window_s: float = 30.0
    base_s: float = 0.5
    cap_s: float = 8.0
    retry_after_cap_s: float = 30.0
    breaker_failures: int = 5
    breaker_open_s: float = 30.0

    def backoff_s(self, tries: int, rng: random.Random | None = None) -> float:
        """The wait after the ``tries``-th failed try (1-based): ``base_s`` doubling,
        capped at ``cap_s``, with full jitter in [0.5, 1.0] of it."""
        r = rng or random
        raw = min(self.cap_s, self.base_s * (2 ** min(max(0, tries - 1), 30)))
        return float(raw * (0.5 + r.random() * 0.5))  # noqa: S311 - jitter, not crypto

    def wait_s(
        self,
        outcome: CallOutcome,
        tries: int,
        retry_after: float | None,
        rng: random.Random | None = None,
    ) -> float:
        """The wait before the next try: a 429's ``Retry-After`` (capped), else backoff."""
        if outcome is CallOutcome.RATE_LIMITED and retry_after is not None:
            return min(retry_after, self.retry_after_cap_s)
        return self.backoff_s(tries, rng)


@dataclass(frozen=True)
class Route:
    """Where one try goes: its model, whether that is the primary, whether it probes."""

    model: str
    primary: bool
    probe: bool = False


class Breaker:
    """The per-worker breaker of the primary model (see the module docstring).

    Single-threaded (one event loop), so no lock. ``clock`` is monotonic seconds.
    """

    def __init__(
        self,
        primary: str,
        fallback: str | None,
        policy: CallPolicy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.primary, self.fallback, self.policy, self._clock = primary, fallback, policy, clock
        self._failures = 0
        self._open_until: float | None = None
        self._probing = False
        MODEL_BREAKER_OPEN.labels(model=primary).set(0)

    @property
    def open(self) -> bool:
        return self._open_until is not None

    def current_model(self) -> str:
        """The model calls go to now (no probe): the fallback while open."""
        return self.fallback if self.fallback is not None and self.open else self.primary

    def route(self) -> Route:
        """The model the next try goes to."""
        if self.fallback is None or self._open_until is None:
            return Route(self.primary, primary=True)
        if not self._probing and self._clock() >= self._open_until:
            self._probing = True
            return Route(self.primary, primary=True, probe=True)
        return Route(self.fallback, primary=False)

    def record(self, route: Route, outcome: CallOutcome) -> None:
        """What a try of ``route`` came to."""
        if route.probe:
            self._probing = False
        if not route.primary or self.fallback is None:
            return
        if outcome is CallOutcome.OK:
            self._failures = 0
            self._set_open(None)
        elif outcome.provider_failure:
            self._failures += 1
            if route.probe or (
                self._open_until is None and self._failures >= self.policy.breaker_failures
            ):
                self._set_open(self._clock() + self.policy.breaker_open_s)

    def _set_open(self, until: float | None) -> None:
        self._open_until = until
        MODEL_BREAKER_OPEN.labels(model=self.primary).set(0 if until is None else 1)

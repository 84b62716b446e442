"""What the gateway's stores, producer and services raise, in their own terms (no HTTP).

    KodaError
    ├── DatabaseError          (koda_runtime.errors) Postgres could not answer
    ├── Refused                the request is well formed but cannot be done; nothing
    │   │                      was written
    │   ├── SessionNotOwned    the session id names another user's session
    │   ├── OverBudget         a new run would break a spent budget (``over`` says which)
    │   └── TooManyActiveRuns  the user has the most runs not yet ended that a user may have
    └── PublishError           the broker refused or did not acknowledge a record (the
                               sweeper publishes the run again later)

The HTTP layer (:func:`koda_runtime.gateway.errors.http_error`) decides the status and the body
of each; nothing below it knows about status codes.
"""

from __future__ import annotations

from koda_runtime.errors import KodaError
from koda_runtime.lifecycle.ledger import Exceeded


class Refused(KodaError):
    """A request the domain turns down; the message says what was wrong."""


class SessionNotOwned(Refused):
    """The session id belongs to another user (answered exactly like an unknown one)."""


class OverBudget(Refused):
    """A new run refused: ``over`` is the budget it would break. Nothing was written."""

    def __init__(self, user_id: str, over: Exceeded) -> None:
        super().__init__(f"user {user_id} is over the {over.period.value}ly budget")
        self.over = over


class PublishError(KodaError):
    """The broker refused or did not acknowledge a record within its delivery timeout."""


class TooManyActiveRuns(Refused):
    """A new run refused: the user already has ``active`` runs not yet ended (pending,
    running or streaming) and may have at most ``cap``. Nothing was written."""

    def __init__(self, user_id: str, cap: int, active: int) -> None:
        super().__init__(f"user {user_id} has {active} active runs (at most {cap})")
        self.cap = cap
        self.active = active

"""Who makes a request, for which user, and which scope the request needs.

A request's :class:`Principal` is a user's own token (``user:<id>``) or a service token
(``service:<name>``, KODA_SERVICE_TOKENS) acting for the user its ``X-Koda-User``
header names. gateway/auth.py resolves it, once per request; every route then works
for ``principal.user_id`` as it would for that user's own token.

The scope a request needs follows from its method and path (:func:`scope_for`), so
that every route, present and future, is covered at the one place that authenticates:

* ``cancel``: ``POST .../cancel`` and ``DELETE /v1/chat/{id}/stream`` (useChat's stop);
* ``read``: ``GET`` and ``HEAD``, and ``POST .../stream-ticket`` (it opens a read);
* ``submit``: every other write (runs, batches, chat, responses, schedules, memories).

A user's own token holds every scope. The principal that created a run is recorded in
``runs.created_by``: admission reads it from :data:`CURRENT` (set by the
authentication of the request being served), so no route passes it along.

Pure: no FastAPI, so admission (which the scheduler imports) may use it.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

SUBMIT = "submit"
READ = "read"
CANCEL = "cancel"
# The header naming the user a service token acts for.
ON_BEHALF_HEADER = "X-Koda-User"


@dataclass(frozen=True)
class Principal:
    """The caller: ``kind`` ``user`` or ``service``, its ``name``, and ``user_id``, the
    user it acts for (a user's own id for a user token). ``scopes`` None: all."""

    kind: str
    name: str
    user_id: str
    scopes: frozenset[str] | None = None

    @property
    def created_by(self) -> str:
        """What ``runs.created_by`` records: ``user:<id>`` or ``service:<name>``."""
        return f"{self.kind}:{self.name}"

    def allows(self, scope: str) -> bool:
        return self.scopes is None or scope in self.scopes

    def acting_for(self, user_id: str) -> Principal:
        """The same caller acting for ``user_id`` (a batch item naming its user)."""
        return Principal(self.kind, self.name, user_id, self.scopes)


# The principal of the request being served (set by gateway/auth.py), for admission.
CURRENT: ContextVar[Principal | None] = ContextVar("koda_principal", default=None)


def created_by(user_id: str) -> str:
    """``runs.created_by`` of a run of ``user_id`` admitted now: the current request's
    principal when it acts for that user, else the user itself."""
    current = CURRENT.get()
    if current is not None and current.user_id == user_id:
        return current.created_by
    return f"user:{user_id}"


def scope_for(method: str, path: str) -> str:
    """The scope a request needs (see the module's docstring)."""
    method = method.upper()
    path = path.rstrip("/")
    if (method == "POST" and path.endswith("/cancel")) or (
        method == "DELETE" and path.startswith("/v1/chat/") and path.endswith("/stream")
    ):
        return CANCEL
    if method in ("GET", "HEAD") or (method == "POST" and path.endswith("/stream-ticket")):
        return READ
    return SUBMIT

"""An erased user stays erased in a fresh replay: which records the replay drops.

An erasure (schemas/erasures.py) deletes a user's rows from Postgres and tombstones the
user's chunk records, but the other topics keep their records until retention ends
them: the runs topic (keyed by user id), run-events (usage records name the user),
the dead letters. Before it reads a record, the replay learns who was erased:

* the ``erasures`` receipts: the SHA-256 digests of the erased user ids (read again
  every :data:`REFRESH_S` while it follows);
* the *erased runs*: the runs of the ledger rows koda kept under an erasure's
  pseudonym (every run that made a billable call), and the runs of the runs topic's
  records whose key (the user id) has an erased digest (a pre-pass over that topic,
  keys first: only an erased user's records are decoded). The topics are read side
  by side, so a run's chunks can come before its trigger: the erased runs must be
  known first.

Then it drops every record of an erased user: a ``run.requested`` or usage record whose
user has an erased digest (its run joins the erased runs), every record of an erased
run (transitions, chunks, final records, usage, dead letters, raw records keyed by it),
and the rows exported from Postgres (export.py) of an erased user. The ledger row of
an erased user's call is kept, as koda's ledger keeps it, under the pseudonym.

Limits (docs/data-dictionary.md): a warehouse written before an erasure keeps what it
holds (replay into a fresh one); a run of an erased user that made no billable call and
whose trigger has left the runs topic is not known, so its chunk records, until the
broker compacts their tombstones away, and its transitions reach the warehouse.

A replay that cannot read the receipts fails before it reads a record: writing without
them could put an erased user back.

Failure mode: a record of an erased user written to the warehouse.
tests/unit/test_replay_erased.py and tests/integration/test_replay_holds_everything.py
provoke it.
"""

from __future__ import annotations

import json

from sqlalchemy.exc import SQLAlchemyError

from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.erasures import (
    erased_digests,
    erased_ledger_runs,
    pseudonym,
    user_digest,
)
from koda_runtime.settings import Settings
from koda_runtime.topics.replay.errors import SourceError

REFRESH_S = 60.0  # how often a following replay reads the receipts again
_CACHE = 100_000  # user ids whose answer is remembered


class Erased:
    """The erased digests, the erased runs, and how many records were dropped."""

    def __init__(self, digests: frozenset[str] = frozenset(), runs: set[str] | None = None):
        self.digests = digests
        self.runs: set[str] = set(runs or ())
        self.dropped = 0
        self._users: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self.digests)

    def update(self, digests: frozenset[str], runs: set[str]) -> None:
        """Take the receipts (and the ledger's erased runs) read again."""
        if digests != self.digests:
            self.digests = digests
            self._users.clear()
        self.runs |= runs

    def user(self, user_id: str | None) -> bool:
        """Whether ``user_id`` was erased."""
        if not self.digests or user_id is None:
            return False
        known = self._users.get(user_id)
        if known is None:
            if len(self._users) >= _CACHE:
                self._users.clear()
            known = self._users[user_id] = user_digest(user_id) in self.digests
        return known

    def add_run(self, run_id: str) -> None:
        """``run_id`` belongs to an erased user: its records are dropped from now on."""
        self.runs.add(run_id)

    def runs_record(self, key: bytes | None, value: bytes | None) -> None:
        """The pre-pass over the runs topic: a record keyed by an erased user names an
        erased run (a value that does not say which is left to the decoder)."""
        if key is None or value is None:
            return
        if not self.user(key.decode("utf-8", "replace")):
            return
        try:
            run_id = json.loads(value).get("run_id")
        except (UnicodeDecodeError, ValueError, AttributeError):
            return
        if isinstance(run_id, str):
            self.add_run(run_id)


def read_erased(settings: Settings) -> tuple[frozenset[str], set[str]]:
    """The digests of every erased user, and the runs the ledger keeps under their
    pseudonyms; SourceError when koda's Postgres cannot say."""
    engine = sync_engine(settings, pool_size=1)
    try:
        with engine.connect() as conn:
            digests = frozenset(erased_digests(conn))
            runs = erased_ledger_runs(conn) if digests else set()
            return digests, runs
    except SQLAlchemyError as exc:
        raise SourceError(
            f"cannot read koda's erasures from Postgres ({type(exc).__name__}): a replay "
            "without them could write an erased user's data; check KODA_DATABASE_URL and "
            "that `koda db upgrade` has run"
        ) from None
    finally:
        engine.dispose()


def ledger_user(user_id: str | None, erased: Erased) -> str | None:
    """The ledger's ``user_id`` for a call of ``user_id``: its pseudonym once erased."""
    return pseudonym(user_id) if user_id is not None and erased.user(user_id) else user_id

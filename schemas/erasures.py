"""Who was erased, without keeping who: the digests and pseudonyms of per-user erasure.

An erasure (gateway/erasure.py, ``koda users erase``) deletes a user's rows and records
a receipt in ``erasures`` (migration 0013) that names the user only by
:func:`user_digest`, the SHA-256 of the user id. Whoever still holds the id (a record on
a topic, a warehouse replayed from the topics) can recompute the digest and tell that
its user was erased; the receipt alone does not give the id back.

:func:`pseudonym` is what the ledger keeps in place of an erased user's id: stable (the
same user always gets the same one, so finance can still sum an erased user's spend,
and a second erasure of the same user changes nothing), and never a valid user id (it
holds a ``:``). It is a pseudonym, not anonymity: anyone who knows a user id can
recompute it.
"""

from __future__ import annotations

import hashlib

from sqlalchemy import Connection, text

PSEUDONYM_PREFIX = "erased:"
# Keeps the pseudonym apart from the digest: a ledger export does not hand out the
# digest a replay filters on.
_PSEUDONYM_DOMAIN = b"koda.erasure.pseudonym\x00"
_DIGESTS = text("SELECT DISTINCT user_digest FROM erasures")


def user_digest(user_id: str) -> str:
    """The SHA-256 of ``user_id`` (UTF-8), 64 lowercase hex digits. Never raises: a lone
    surrogate (only a forged record's id can hold one) is encoded as it stands."""
    return hashlib.sha256(_utf8(user_id)).hexdigest()


def pseudonym(user_id: str) -> str:
    """The id the ledger keeps for the erased ``user_id``: ``erased:`` + 16 hex digits."""
    digest = hashlib.sha256(_PSEUDONYM_DOMAIN + _utf8(user_id)).hexdigest()
    return PSEUDONYM_PREFIX + digest[:16]


def erased_digests(conn: Connection) -> set[str]:
    """The :func:`user_digest` of every user an erasure was recorded for (receipts of
    erasures still under way included: their deletions have begun)."""
    return {str(row[0]) for row in conn.execute(_DIGESTS)}


def _utf8(user_id: str) -> bytes:
    return user_id.encode("utf-8", "surrogatepass")

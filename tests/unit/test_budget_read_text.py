"""Admission's budget read is written out twice (schemas/ledger.py: the one-run insert
and the batch read); both must read the same columns with the same rule."""

from __future__ import annotations

from koda_runtime.schemas.ledger import _ADMIT_RUN, _BUDGETS_OF


def test_the_batch_and_the_single_admission_read_budgets_with_one_text() -> None:
    read = str(_BUDGETS_OF).split("WHERE b.user_id = ANY")[0].strip()
    assert read.startswith("SELECT b.user_id") and "spend_periods d" in read
    assert read in str(_ADMIT_RUN)

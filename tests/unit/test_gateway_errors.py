"""Domain errors to HTTP answers: one mapping, the bodies clients already rely on."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from koda_runtime.errors import DatabaseError, PublishError, SessionNotOwned
from koda_runtime.gateway.errors import BadRequest, http_error
from koda_runtime.lifecycle.ledger import Exceeded, OverBudget, Period


def test_a_session_of_another_user_answers_404_naming_the_field() -> None:
    answer = http_error(SessionNotOwned("session not found: omit session_id"))
    assert answer.status == 404
    assert answer.body() == {
        "error": {
            "code": "not_found",
            "message": "session not found: omit session_id",
            "field": "session_id",
        }
    }


def test_a_spent_budget_answers_402_with_the_budget_spend_and_reset() -> None:
    resets = datetime(2026, 1, 1, tzinfo=UTC)
    over = Exceeded(Period.MONTH, Decimal("10"), Decimal("10.5"), resets)
    answer = http_error(OverBudget("alice", over))
    assert answer.status == 402
    error = answer.body()["error"]
    assert error["code"] == "budget_exceeded" and error["field"] is None
    assert error["budget"] == {
        "period": "month",
        "limit_usd": "10.00000000",
        "spend_usd": "10.50000000",
        "resets_at": resets.isoformat(),
    }
    assert "monthly budget of 10.00000000 USD is spent" in error["message"]


def test_postgres_down_answers_503_with_retry_after() -> None:
    answer = http_error(DatabaseError("postgres is unreachable: OSError"))
    assert (answer.status, answer.code) == (503, "unavailable")
    assert answer.headers == {"Retry-After": "1"}
    # The cause stays in the log, never in the answer.
    assert "OSError" not in answer.message


def test_an_http_error_is_its_own_answer_and_an_unmapped_one_is_refused() -> None:
    refusal = BadRequest("bad", field="x")
    assert http_error(refusal) is refusal
    with pytest.raises(TypeError, match="PublishError"):
        http_error(PublishError("not acknowledged"))

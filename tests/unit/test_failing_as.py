"""The one Postgres-error wrapper (schemas/db.py ``failing_as``)."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy.exc import OperationalError

from koda_runtime.errors import DatabaseError
from koda_runtime.schemas.db import failing_as


def test_a_driver_error_becomes_a_database_error_naming_what_failed_not_its_text() -> None:
    secret = "password=hunter2 user input"
    with pytest.raises(DatabaseError) as caught, failing_as("reading a run"):
        raise OperationalError("SELECT 1", {"p": secret}, Exception(secret))
    assert str(caught.value) == "reading a run failed: OperationalError"
    assert secret not in str(caught.value)
    assert isinstance(caught.value.__cause__, OperationalError)


def test_a_psycopg_error_is_wrapped_too_with_its_hint() -> None:
    with pytest.raises(DatabaseError, match=r"^postgres failed: OperationalError \(is it up\?\)$"):
        with failing_as("postgres", "is it up?"):
            raise psycopg.OperationalError("connection refused")


def test_other_errors_pass_through_untouched() -> None:
    with pytest.raises(KeyError), failing_as("reading a run"):
        raise KeyError("not a database error")

"""``sslmode`` is part of KODA_DATABASE_URL and reaches psycopg in every engine.

The local PostgreSQL has TLS off, so ``sslmode=require`` must fail with psycopg's own
"SSL" refusal (proof the parameter got there) and ``sslmode=disable`` must work, for
the sync engine (migrations, CLI) and the async one (gateway, workers) alike.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from koda_runtime.schemas.db import async_engine, sqlalchemy_url, sync_engine
from tests.fixtures.namespaces import make_settings


def with_sslmode(url: str, mode: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}sslmode={mode}"


def test_the_url_keeps_its_query() -> None:
    url = "postgresql://koda@db:5432/koda?sslmode=verify-full&sslrootcert=/ca.pem"
    assert sqlalchemy_url(url).endswith("?sslmode=verify-full&sslrootcert=/ca.pem")


def test_sslmode_reaches_psycopg(stack) -> None:
    required = make_settings(stack, database_url=with_sslmode(stack.database_url, "require"))
    disabled = make_settings(stack, database_url=with_sslmode(stack.database_url, "disable"))

    engine = sync_engine(required)
    with pytest.raises(OperationalError, match="SSL"):
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    engine.dispose()
    engine = sync_engine(disabled)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar() == 1
    engine.dispose()

    async def probe(settings) -> int:
        aengine = async_engine(settings)
        try:
            async with aengine.connect() as conn:
                return int((await conn.execute(text("SELECT 1"))).scalar_one())
        finally:
            await aengine.dispose()

    with pytest.raises(OperationalError, match="SSL"):
        asyncio.run(probe(required))
    assert asyncio.run(probe(disabled)) == 1

"""Hostile checks of the PostgreSQL engine's committed reads and point index (issue 22's review).

Failures that end a transaction inside its function (a statement timeout, a round trip past its
deadline) are the caller's answer as they are, retryable by its client; serializable conflicts
through the hash index's bucket locks are still detected; the placeholder rows that size the
index are never seen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import psycopg
import pytest

from fs3.common.errors import Timeout, TxnConflict
from fs3.kv.api import Transaction
from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine
from fs3.kv.txn import run_transaction

T = TypeVar("T")


def libpq(url: str) -> str:
    """The fixture's SQLAlchemy-style URL as libpq takes it."""
    return "postgresql://" + url.partition("://")[2]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_a_statement_timeout_inside_the_function_is_a_timeout_not_invalid_argument(postgres_url: str) -> None:
    """A read that runs past statement_timeout ends the transaction (Timeout, retryable by the
    client, which can fail over to another meta server); committing that ended transaction's
    reads as if the Timeout were an answer raised "already committed or abandoned" instead."""
    async def body() -> None:
        engine = await PostgresTxnEngine.open(PostgresConfig(postgres_url, statement_timeout_ms=300))
        locker = await psycopg.AsyncConnection.connect(libpq(postgres_url), autocommit=True)
        try:
            await locker.execute("BEGIN")
            await locker.execute("LOCK TABLE fs3_kv IN ACCESS EXCLUSIVE MODE")

            async def read(txn: Transaction) -> bytes | None:
                return await txn.get(b"key")

            with pytest.raises(Timeout):
                await run_transaction(engine, read, retry_max=1)
            await locker.execute("ROLLBACK")
            assert await run_transaction(engine, read) is None  # the pool is whole
        finally:
            await locker.close()
            engine.terminate()

    run(body())

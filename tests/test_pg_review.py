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


@pytest.mark.parametrize("present", [False, True], ids=["absent", "present"])
@pytest.mark.parametrize("many", [False, True], ids=["get", "get_many"])
def test_write_skew_through_point_reads_of_the_hash_index_is_a_conflict(postgres_url: str, present: bool,
                                                                        many: bool) -> None:
    """Each transaction reads the key the other writes (through the point index: one key, or
    several keys by a bitmap scan) and writes its own from what it read: no serial order has both
    read the old value, so SSI must refuse the second commit. Absent keys are locked by their hash
    bucket, present ones by their row too; the keys' buckets differ from the writers' own keys."""
    async def body() -> None:
        engine = await PostgresTxnEngine.open(PostgresConfig(postgres_url))
        try:
            a, b = b"DENT-skew-a", b"DENT-skew-b"
            if present:
                setup = engine.begin()
                setup.put(a, b"0")
                setup.put(b, b"0")
                await setup.commit()
            t1, t2 = engine.begin(), engine.begin()
            if many:
                t1.prefetch([b, b"DENT-other-1"])
                t2.prefetch([a, b"DENT-other-2"])
            before = (await t1.get(b), await t2.get(a))
            assert before == ((b"0", b"0") if present else (None, None))
            t1.put(a, b"1")
            t2.put(b, b"1")
            await t1.commit()
            with pytest.raises(TxnConflict):
                await t2.commit()
        finally:
            engine.terminate()

    run(body())


def test_a_point_read_then_a_delete_by_another_is_a_rw_conflict(postgres_url: str) -> None:
    """A delete through the point index against a reader that then writes what the deleter read."""
    async def body() -> None:
        engine = await PostgresTxnEngine.open(PostgresConfig(postgres_url))
        try:
            setup = engine.begin()
            setup.put(b"k1", b"0")
            setup.put(b"k2", b"0")
            await setup.commit()
            t1, t2 = engine.begin(), engine.begin()
            assert await t1.get(b"k1") == b"0"
            assert await t2.get(b"k2") == b"0"
            t1.delete(b"k2")
            t2.delete(b"k1")
            await t1.commit()
            with pytest.raises(TxnConflict):
                await t2.commit()
        finally:
            engine.terminate()

    run(body())

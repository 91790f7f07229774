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


def test_a_bucket_lock_follows_its_keys_when_the_hash_index_splits_the_bucket(postgres_url: str) -> None:
    """A point read of an absent key locks its hash bucket's page; when inserts grow the index
    past its fill factor that bucket splits and the key's entries move to the new bucket. The read
    must still conflict with a later insert of the key there (PostgreSQL moves the predicate lock
    with the split): the same write skew as above, with a split between the reads and the writes.

    The key is chosen to move: ``hashtext`` hashes a deterministic text's bytes as the bytea hash
    opclass hashes ``k || ''``, and the bucket the next split creates is the metapage's
    ``maxbucket + 1`` (pageinspect, a contrib module of Debian's server package)."""
    url = libpq(postgres_url)

    async def body() -> None:
        engine = await PostgresTxnEngine.open(PostgresConfig(postgres_url))
        admin = await psycopg.AsyncConnection.connect(url, autocommit=True)
        try:
            try:
                await admin.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
            except psycopg.Error as exc:
                pytest.skip(f"pageinspect unavailable: {exc}")

            async def metapage() -> tuple[int, int, int, float]:
                cur = await admin.execute("SELECT maxbucket, highmask, ffactor, ntuples "
                                          "FROM hash_metapage_info(get_raw_page('fs3_kv_point', 0))")
                row = await cur.fetchone()
                assert row is not None
                return int(row[0]), int(row[1]), int(row[2]), float(row[3])

            async def key_in_bucket(prefix: str, highmask: int, bucket: int) -> bytes:
                cur = await admin.execute("SELECT %s || g FROM generate_series(1, 1000000) AS g "
                                          "WHERE (hashtext(%s || g) & %s) = %s LIMIT 1",
                                          (prefix, prefix, highmask, bucket))
                row = await cur.fetchone()
                assert row is not None
                return str(row[0]).encode()

            max_bucket, highmask, fill_factor, tuples = await metapage()
            moving = await key_in_bucket("K", highmask, max_bucket + 1)  # in the bucket that splits next
            other = await key_in_bucket("Y", highmask, 7)
            t1, t2 = engine.begin(), engine.begin()
            assert await t1.get(moving) is None
            assert await t2.get(other) is None
            # A statement of its own ends each read's index scan (its pin on the bucket would
            # otherwise keep the bucket from splitting while the transaction is open).
            await t1.scan(b"A", b"B")
            await t2.scan(b"A", b"B")
            grow = int(fill_factor * (max_bucket + 1) - tuples) + 20_000
            await admin.execute("INSERT INTO fs3_kv SELECT 'F'::bytea || int4send(g), 'v'::bytea "
                                "FROM generate_series(1, %s) AS g", (grow,))
            assert (await metapage())[0] > max_bucket + 1  # the key's bucket split
            t1.put(other, b"1")
            t2.put(moving, b"1")
            await t1.commit()
            with pytest.raises(TxnConflict):
                await t2.commit()
        finally:
            await admin.close()
            engine.terminate()

    run(body())


def test_servers_starting_together_on_an_older_database_wait_for_the_one_building_the_index(
        postgres_url: str) -> None:
    """Several meta servers starting at once on a database made before the point index: one takes
    the schema lock and builds the index (which waits for writers in flight, then reads the whole
    table), the others wait for that lock. The wait is the schema check's, bounded by its own
    timeout, not by a request's ``statement_timeout_ms``: the others used to fail to start with a
    statement timeout whenever the build took longer than that."""
    url = libpq(postgres_url)

    async def body() -> None:
        engine = await PostgresTxnEngine.open(PostgresConfig(postgres_url))
        engine.terminate()
        admin = await psycopg.AsyncConnection.connect(url, autocommit=True)
        writer = await psycopg.AsyncConnection.connect(url, autocommit=True)
        try:
            await admin.execute("DROP INDEX fs3_kv_point")
            await writer.execute("BEGIN")
            await writer.execute("INSERT INTO fs3_kv (k, v) VALUES ('in flight', 'v')")  # the build waits for it
            config = PostgresConfig(postgres_url, statement_timeout_ms=300)
            first = asyncio.create_task(PostgresTxnEngine.open(config))
            for _ in range(500):  # until the first holds the schema lock (bounded: 5 s)
                cur = await admin.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted")
                row = await cur.fetchone()
                if row is not None and row[0]:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the first server never took the schema lock")
            second = asyncio.create_task(PostgresTxnEngine.open(config))
            await asyncio.sleep(1.0)  # past the second's statement timeout, waiting for the lock
            assert not first.done() and not second.done()
            await writer.execute("ROLLBACK")
            for engine in await asyncio.gather(first, second):
                assert await engine.begin().get(b"in flight") is None
                engine.terminate()
            cur = await admin.execute("SELECT to_regclass('fs3_kv_point') IS NOT NULL")
            assert await cur.fetchone() == (True,)
        finally:
            await writer.close()
            await admin.close()

    run(body())

"""The PostgreSQL engine's own behaviour: round trips, bad URLs and databases, conflicts PostgreSQL
must detect, lost connections at commit, dead pooled connections, statement timeouts, the pool bound."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import psycopg
import pytest

from fs3.common.errors import InvalidArgument, MaybeCommitted, Timeout, TxnConflict, Unavailable
from fs3.kv.api import Transaction
from fs3.kv.postgres import SCHEMA_VERSION, PostgresConfig, PostgresTxnEngine, redact_url
from fs3.kv.txn import run_transaction
from tests.postgres import CutRelay, PostgresServer

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _sql(url: str, *statements: str) -> list[tuple[Any, ...]]:
    """Run statements as the superuser on the test's database; the last one's rows."""
    conninfo = "postgresql://" + url.split("://", 1)[1]
    rows: list[tuple[Any, ...]] = []
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for statement in statements:
            cur = conn.execute(statement.encode())
            rows = cur.fetchall() if cur.description else []
    return rows


async def _open(url: str, **options: Any) -> PostgresTxnEngine:
    return await PostgresTxnEngine.open(PostgresConfig(url, **options))


def test_round_trips_per_transaction_shape(postgres_url: str) -> None:
    """BEGIN rides with the first read, buffered writes with the COMMIT: each shape's count."""
    async def body() -> None:
        engine = await _open(postgres_url)
        try:
            def spent(before: int) -> int:
                return engine.round_trips - before

            start = engine.round_trips
            txn = engine.begin()
            txn.put(b"a", b"1")
            txn.put(b"b", b"2")
            txn.delete(b"c")
            await txn.commit()
            assert spent(start) == 1  # BEGIN + upsert + delete + COMMIT: one flush
            start = engine.round_trips
            txn = engine.begin()
            assert await txn.get(b"a") == b"1"  # BEGIN with it
            assert await txn.scan(b"", limit=5) == [(b"a", b"1"), (b"b", b"2")]
            txn.put(b"d", b"4")
            txn.delete(b"a")
            await txn.commit()
            assert spent(start) == 3
            start = engine.round_trips
            txn = engine.begin()
            assert await txn.get(b"d") == b"4"
            await txn.commit()  # read-only: the COMMIT alone
            assert spent(start) == 2
            start = engine.round_trips
            await engine.begin().commit()  # nothing read, nothing written
            dropped = engine.begin()
            assert await dropped.get(b"b") == b"2"
            del dropped  # never committed: rolled back at once, off its caller's path
            while engine._pool.rollbacks == 0:
                await asyncio.sleep(0.01)
            txn = engine.begin()
            assert await txn.get(b"b") == b"2"
            assert spent(start) == 3
            await txn.commit()
            assert len(_sql(postgres_url, "SELECT pid FROM pg_stat_activity WHERE application_name = 'fs3-meta' "
                                          "AND state = 'idle in transaction'")) == 0
        finally:
            engine.terminate()
    run(body())


def test_an_announced_scan_rides_with_the_next_read_and_own_writes_still_count(postgres_url: str) -> None:
    """prefetch_scan: the scan travels with the next get (one round trip for both) and answers
    the scan from its rows, merged with the transaction's writes made since; a scan whose own
    deletes changed how many rows it needs is run afresh, right."""
    async def body() -> None:
        engine = await _open(postgres_url)
        try:
            seed = engine.begin()
            for key in (b"s1", b"s2", b"s3", b"x"):
                seed.put(key, key)
            await seed.commit()
            txn = engine.begin()
            start = engine.round_trips
            txn.prefetch_scan(b"s", b"t", limit=2)
            txn.prefetch_scan(b"s", b"t")
            assert await txn.get(b"x") == b"x"
            txn.put(b"s0", b"new")
            assert await txn.scan(b"s", b"t", limit=2) == [(b"s0", b"new"), (b"s1", b"s1")]
            assert await txn.scan(b"s", b"t") == [(b"s0", b"new"), (b"s1", b"s1"), (b"s2", b"s2"), (b"s3", b"s3")]
            assert engine.round_trips - start == 1
            txn.prefetch_scan(b"s", b"t", limit=1)
            txn.delete(b"s0")
            txn.delete(b"s1")  # the announced shape no longer fits: scanned again
            assert await txn.scan(b"s", b"t", limit=1) == [(b"s2", b"s2")]
            assert engine.round_trips - start == 2
            await txn.commit()
        finally:
            engine.terminate()

    asyncio.run(body())


def test_write_skew_between_two_transactions_is_a_conflict(postgres_url: str) -> None:
    """Two on-call doctors each see the other on call and go off: PostgreSQL's SSI must refuse one."""
    async def body() -> None:
        engine = await _open(postgres_url)
        try:
            setup = engine.begin()
            setup.put(b"oncall/alice", b"1")
            setup.put(b"oncall/bob", b"1")
            await setup.commit()
            t1, t2 = engine.begin(), engine.begin()
            assert len(await t1.scan(b"oncall/", b"oncall0")) == 2
            assert len(await t2.scan(b"oncall/", b"oncall0")) == 2
            t1.delete(b"oncall/alice")
            t2.delete(b"oncall/bob")
            await t1.commit()
            with pytest.raises(TxnConflict, match="40001"):
                await t2.commit()
            assert engine.conflicts == 1
            assert await engine.begin().scan(b"oncall/", b"oncall0") == [(b"oncall/bob", b"1")]
        finally:
            engine.terminate()
    run(body())


def test_connection_killed_at_commit_is_maybe_committed_and_the_retry_answers_the_same(postgres_url: str) -> None:
    async def body() -> None:
        engine = await _open(postgres_url)
        try:
            txn = engine.begin()
            assert await txn.get(b"entry") is None
            pid = txn.backend_pid
            _sql(postgres_url, f"SELECT pg_terminate_backend({pid})")
            txn.put(b"entry", b"inode-7")
            with pytest.raises(MaybeCommitted):
                await txn.commit()
            assert engine.maybe_committed == 1

            kills = 0

            async def create_once(txn: Transaction) -> bytes:
                nonlocal kills
                existing = await txn.get(b"entry")
                if existing is not None:
                    return existing
                if kills == 0:  # the first try's connection dies before its commit arrives
                    kills += 1
                    pid = txn.backend_pid  # type: ignore[attr-defined]
                    _sql(postgres_url, f"SELECT pg_terminate_backend({pid})")
                txn.put(b"entry", b"inode-7")
                return b"inode-7"

            assert await run_transaction(engine, create_once, backoff_ms=0) == b"inode-7"
            assert await run_transaction(engine, create_once, backoff_ms=0) == b"inode-7"
            assert engine.maybe_committed == 2 and kills == 1
        finally:
            engine.terminate()
    run(body())


def test_pooled_connections_killed_while_idle_are_replaced_unseen(postgres_url: str) -> None:
    """A server restart (or a DBA's terminate) ends every idle session: the next transactions
    open new ones without an error reaching their callers."""
    async def body() -> None:
        engine = await _open(postgres_url, pool_size_max=4)
        try:
            async def put(txn: Transaction) -> None:
                txn.put(b"k", b"v")

            await asyncio.gather(*(run_transaction(engine, put) for _ in range(4)))
            _sql(postgres_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE application_name = 'fs3-meta'")
            await asyncio.sleep(0.2)
            txn = engine.begin()
            assert await txn.get(b"k") == b"v"
            await txn.commit()
            assert engine.maybe_committed == 0
        finally:
            engine.terminate()
    run(body())


def test_a_statement_past_its_timeout_is_a_timeout_error(postgres_url: str) -> None:
    async def body() -> None:
        engine = await _open(postgres_url, statement_timeout_ms=200)
        conninfo = "postgresql://" + postgres_url.split("://", 1)[1]
        locker = await psycopg.AsyncConnection.connect(conninfo)
        try:
            await locker.execute(b"LOCK TABLE fs3_kv IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(Timeout, match="statement_timeout"):
                await engine.begin().get(b"k")
        finally:
            await locker.close()
            engine.terminate()
    run(body())


def test_the_pool_is_bounded_and_a_wait_for_it_is_bounded_too(postgres_url: str) -> None:
    async def body() -> None:
        engine = await _open(postgres_url, pool_size_max=2, acquire_timeout_ms=300)
        try:
            held = [engine.begin(), engine.begin()]
            for txn in held:
                await txn.get(b"x")
            with pytest.raises(Unavailable, match="no PostgreSQL connection free"):
                await engine.begin().get(b"x")
            waiting = asyncio.create_task(engine.begin().get(b"x"))
            await asyncio.sleep(0.05)
            await held[0].commit()  # frees a connection for the waiter
            assert await waiting is None
            assert len(_sql(postgres_url, "SELECT pid FROM pg_stat_activity WHERE application_name = 'fs3-meta'")) <= 2
        finally:
            engine.terminate()
    run(body())


@pytest.mark.parametrize("url, message", [
    ("mysql://u:p@127.0.0.1/db", "expected postgresql://"),
    ("not a url", "expected postgresql://"),
])
def test_a_malformed_url_is_refused(url: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        run(_open(url))


def test_an_unreachable_server_or_a_wrong_password_is_a_clear_error(postgres_server: PostgresServer) -> None:
    closed = f"postgresql://fs3_test:x@127.0.0.1:{_closed_port()}/postgres"
    with pytest.raises(Unavailable, match=r"cannot connect to PostgreSQL at .*:\*\*\*@") as info:
        run(_open(closed, connect_timeout_ms=2_000))
    assert ":x@" not in str(info.value)  # the password is never printed
    wrong = postgres_server.url().replace(postgres_server.password, "wrong")
    with pytest.raises(Unavailable, match="password authentication failed"):
        run(_open(wrong))
    missing = postgres_server.url("no_such_database")
    with pytest.raises(Unavailable, match="does not exist"):
        run(_open(missing))


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_another_schema_version_or_cluster_is_refused_and_nothing_is_written(postgres_url: str) -> None:
    run(_open(postgres_url, cluster_id="alpha"))  # creates the schema
    assert dict(_sql(postgres_url, "SELECT name, value FROM fs3_info WHERE name <> 'created_at'")) == {
        "schema_version": str(SCHEMA_VERSION), "cluster_id": "alpha"}
    with pytest.raises(InvalidArgument, match="belongs to cluster 'alpha', not 'beta'"):
        run(_open(postgres_url, cluster_id="beta"))
    _sql(postgres_url, "UPDATE fs3_info SET value = '999' WHERE name = 'schema_version'")
    before = _sql(postgres_url, "SELECT name, value FROM fs3_info ORDER BY name")
    with pytest.raises(InvalidArgument, match="schema version 999; this fs3 needs version"):
        run(_open(postgres_url, cluster_id="alpha"))
    assert _sql(postgres_url, "SELECT name, value FROM fs3_info ORDER BY name") == before
    assert _sql(postgres_url, "SELECT count(*) FROM fs3_kv") == [(0,)]


def test_a_database_with_half_a_schema_is_refused(postgres_url: str) -> None:
    _sql(postgres_url, "CREATE TABLE fs3_kv (k bytea PRIMARY KEY, v bytea NOT NULL)")
    with pytest.raises(InvalidArgument, match="partial fs3 schema"):
        run(_open(postgres_url))
    assert _sql(postgres_url, "SELECT to_regclass('fs3_info') IS NULL") == [(True,)]


def test_servers_starting_together_create_the_schema_once(postgres_url: str) -> None:
    async def body() -> None:
        engines = await asyncio.gather(*(_open(postgres_url) for _ in range(4)))
        for engine in engines:
            engine.terminate()
    run(body())
    assert _sql(postgres_url, "SELECT count(*) FROM fs3_info WHERE name = 'schema_version'") == [(1,)]


def test_neighbouring_keys_of_different_clients_do_not_conflict(postgres_url: str) -> None:
    """Each transaction reads a key of its own that is absent (a saved answer, a new name) and then
    writes it, all overlapping: nothing conflicts. With SERIALIZABLE's page-granular locks on the
    primary key's btree, the reads lock the page the others insert into and most of them would be
    aborted; point reads lock hash buckets of the point index instead."""
    async def body() -> None:
        engine = await _open(postgres_url)
        try:
            keys = [b"IDEM" + bytes([i]) * 16 + b"\x00" * 8 for i in range(16)]
            txns = [engine.begin() for _ in keys]
            for txn, key in zip(txns, keys, strict=True):
                assert await txn.get(key) is None
            for txn, key in zip(txns, keys, strict=True):
                txn.put(key, b"answer")
            for txn in txns:
                await txn.commit()
            assert engine.conflicts == 0
            check = engine.begin()
            check.prefetch(keys)
            assert [await check.get(key) for key in keys] == [b"answer"] * len(keys)
        finally:
            await engine.close()
    run(body())


def test_a_database_made_before_the_point_index_gets_it_at_open(postgres_url: str) -> None:
    async def body() -> None:
        engine = await _open(postgres_url)
        txn = engine.begin()
        txn.put(b"kept", b"1")
        await txn.commit()
        await engine.close()
        _sql(postgres_url, "DROP INDEX fs3_kv_point")
        engine = await _open(postgres_url)
        try:
            assert await engine.begin().get(b"kept") == b"1"
        finally:
            await engine.close()
    run(body())
    assert _sql(postgres_url, "SELECT to_regclass('fs3_kv_point') IS NOT NULL") == [(True,)]
    assert _sql(postgres_url, "SELECT count(*) FROM fs3_kv") == [(1,)]  # no placeholder left


def test_the_password_is_redacted() -> None:
    assert redact_url("postgresql://u:secret@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert redact_url("postgresql://h/db") == "postgresql://h/db"


def _hot_increments(engine: PostgresTxnEngine, clients: int, retry_max: int) -> list[BaseException | None]:
    """``clients`` transactions that each read a counter, dwell, and write it back + 1: every
    first attempt overlaps every other (the dwell outlasts any retry wait)."""
    async def increment(txn: Transaction) -> None:
        value = int((await txn.get(b"n")) or b"0")
        await asyncio.sleep(0.05)
        txn.put(b"n", str(value + 1).encode())

    async def one() -> BaseException | None:
        try:
            await run_transaction(engine, increment, retry_max=retry_max)
        except TxnConflict as exc:
            return exc
        return None

    async def body() -> list[BaseException | None]:
        return list(await asyncio.gather(*(one() for _ in range(clients))))

    return asyncio.get_event_loop().run_until_complete(body())


def test_retries_under_contention_run_alone_and_all_finish(postgres_url: str) -> None:
    """16 transactions on one hot key, two retries each: behind the contention gate every one
    commits (its retry runs alone); without it, most give up — the gate is what saves them."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        engine = loop.run_until_complete(_open(postgres_url, pool_size_max=16))
        assert _hot_increments(engine, 16, retry_max=2) == [None] * 16
        assert loop.run_until_complete(engine.begin().get(b"n")) == b"16"
        assert engine.contention_gate.exclusive_runs >= 8  # the retries (a first attempt may start late)
        engine.contention_gate = None  # type: ignore[assignment]
        outcomes = _hot_increments(engine, 16, retry_max=2)
        assert sum(1 for exc in outcomes if exc is not None) >= 8
        assert all("gave up after 2 retries" in str(exc) for exc in outcomes if exc is not None)
        engine.terminate()
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def test_a_round_trip_cut_off_by_the_network_ends_at_its_deadline_and_closes_the_connection(
        postgres_url: str) -> None:
    """No answer within round_trip_timeout_ms: a read is Unavailable, a commit MaybeCommitted, both
    at the deadline (not after the driver's own attempts to cancel over the dead path); each closes
    its connection (never pooled mid-flush), so after the heal every transaction runs on a fresh one."""
    async def body() -> None:
        proxy = CutRelay(postgres_url)
        url = await proxy.start()
        engine = await _open(url, statement_timeout_ms=200, round_trip_timeout_ms=600, pool_size_max=2)
        try:
            txn = engine.begin()
            txn.put(b"k", b"1")
            await txn.commit()
            reader, writer = engine.begin(), engine.begin()
            assert await reader.get(b"k") == await writer.get(b"k") == b"1"  # each holds a connection
            proxy.cut.set()
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(Unavailable, match="no answer from PostgreSQL within 600 ms"):
                await reader.get(b"j")
            writer.put(b"k", b"2")
            with pytest.raises(MaybeCommitted, match="within 600 ms"):
                await writer.commit()
            assert loop.time() - started < 4  # two deadlines, not the driver's 10 s cancel attempts
            assert engine.maybe_committed == 1
            proxy.cut.clear()

            async def bump(txn: Transaction) -> None:
                assert await txn.get(b"k") in (b"1", b"2", b"3")  # the cut commit may land or not
                txn.put(b"k", b"3")

            for _ in range(3):  # the pool's two slots were freed, not held by dead connections
                # The relay delivers the cut COMMIT after the heal, as TCP would: it may land now,
                # concurrently with this one (a serialization failure, retried).
                await run_transaction(engine, bump)
        finally:
            await engine.close()
            await proxy.close()

    run(body())


def test_a_round_trip_deadline_below_the_statement_timeout_is_refused(postgres_url: str) -> None:
    with pytest.raises(InvalidArgument, match="round_trip_timeout_ms must exceed statement_timeout_ms"):
        PostgresConfig(postgres_url, statement_timeout_ms=5_000, round_trip_timeout_ms=4_000).validate()

"""Read-only transactions on PostgreSQL are only serializable once they commit.

PostgreSQL's SSI keeps the predicate locks of a read-only transaction that committed until every
transaction overlapping it has ended, and aborts a writer that would make its reads part of a cycle;
a transaction that rolls back is treated as if it never ran, its reads constrain nobody. The
classic read-only anomaly (Fekete, O'Neil, O'Neil 2004; the PostgreSQL wiki's SSI page, "Deposit
Report") then shows: the batch transaction T2 reads X and Y, the deposit T1 writes X and commits,
the report T3 reads X and Y (sees T1, not T2), and T2 writes Y from what it read. T2 precedes T1
(it did not see T1's X), T1 precedes T3 (T3 saw it), T3 precedes T2 (it did not see T2's Y): no
serial order explains T3's answer. With T3 committed, T2's write is refused; with T3 rolled back,
T2 commits and T3's answer was a state that never existed. Meta's reads therefore commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from fs3.common.errors import NotFound, TxnConflict
from fs3.kv.api import Transaction
from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine
from fs3.kv.txn import run_transaction

T = TypeVar("T")

def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def _anomaly(url: str, report_commits: bool) -> tuple[tuple[bytes | None, bytes | None], bool]:
    """Run the three transactions; T3's (X, Y) and whether T2 committed."""
    engine = await PostgresTxnEngine.open(PostgresConfig(url))
    try:
        setup = engine.begin()
        setup.put(b"x", b"0")
        setup.put(b"y", b"0")
        await setup.commit()
        t2 = engine.begin()  # the batch: reads both, later writes Y from what it read
        assert (await t2.get(b"x"), await t2.get(b"y")) == (b"0", b"0")
        t1 = engine.begin()  # the deposit: X changes and commits first
        assert await t1.get(b"x") == b"0"
        t1.put(b"x", b"1")
        await t1.commit()
        t3 = engine.begin()  # the report
        seen = (await t3.get(b"x"), await t3.get(b"y"))
        if report_commits:
            await t3.commit()
        else:
            rollbacks = engine.stats()["round_trips"]
            del t3  # dropped, as a read-only request's transaction used to be: rolled back
            while engine.stats()["round_trips"] == rollbacks:
                await asyncio.sleep(0.01)
        t2.put(b"y", b"1")
        try:
            await t2.commit()
        except TxnConflict:
            return seen, False
        return seen, True
    finally:
        engine.terminate()


def test_a_rolled_back_read_only_transaction_can_see_a_state_no_serial_order_explains(postgres_url: str) -> None:
    """The anomaly itself: why dropping a read-only transaction is not enough."""
    seen, t2_committed = run(_anomaly(postgres_url, report_commits=False))
    assert seen == (b"1", b"0")  # T1's X without T2's Y ...
    assert t2_committed  # ... and T2, which precedes T1, committed: T3 saw the impossible


def test_a_committed_read_only_transaction_makes_the_anomaly_impossible(postgres_url: str) -> None:
    """The same schedule with the report committed: PostgreSQL refuses the batch's write."""
    seen, t2_committed = run(_anomaly(postgres_url, report_commits=True))
    assert seen == (b"1", b"0")
    assert not t2_committed


@pytest.mark.parametrize("error", [NotFound, ValueError])
def test_a_transaction_whose_function_failed_gives_its_connection_back_at_once(postgres_url: str,
                                                                               error: type[Exception]) -> None:
    """The error (and its traceback, which holds the transaction) outlives the call, as it does
    in a reference cycle until the garbage collector runs: the connection must not wait for that.
    With one connection in the pool, each next transaction would otherwise wait and give up. An
    error that is an answer commits what it read; any other error abandons the transaction."""
    async def body() -> list[Exception]:
        engine = await PostgresTxnEngine.open(PostgresConfig(postgres_url, pool_size_max=1, acquire_timeout_ms=1_000))
        kept: list[Exception] = []

        async def absent(txn: Transaction) -> None:
            await txn.get(b"absent")
            txn.put(b"absent", b"never written")
            raise error("'absent' does not exist")

        try:
            for _ in range(3):
                try:
                    await run_transaction(engine, absent)
                except error as exc:
                    kept.append(exc)
            assert await engine.begin().get(b"absent") is None
        finally:
            engine.terminate()
        return kept

    assert len(run(body())) == 3

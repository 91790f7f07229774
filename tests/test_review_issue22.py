"""Hostile review of issue 22 (PostgreSQL engine, claims, mgmtd HA): findings as tests.

Each test failed before its fix.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from fs3.common.clock import ManualClock
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine
from fs3.meta.claims import ClaimTable


def test_claim_epoch_reused_after_release_is_taken_over_while_live() -> None:
    async def main() -> None:
        engine = OptimisticTxnEngine(MemKVStore(), sync=False)
        clock = ManualClock(1_000)
        ttl = 1_000
        a = ClaimTable(engine, b"server-a", clock, ttl)
        b = ClaimTable(engine, b"server-b", clock, ttl)
        name = b"I" + (7).to_bytes(8, "big")
        held_a = await a.try_claim(name)  # A holds (a, 1)
        assert held_a is not None
        assert await b.try_claim(name) is None  # B sees (a, 1) at t=1000 and remembers it
        await a.release(held_a)  # A's job was quick: record deleted
        clock.advance(2 * ttl)  # much later...
        held_a2 = await a.try_claim(name)  # ...A claims the inode again: (a, 1) once more, fresh
        assert held_a2 is not None and held_a2.valid()
        # B tries a moment later: A's claim is a few ms old and valid, B must not get it.
        held_b = await b.try_claim(name)
        assert held_b is None, "B took over A's live claim (both now work on the inode)"

    asyncio.run(main())


def test_claim_renewal_after_maybe_committed_is_not_a_takeover() -> None:
    from fs3.kv.txn import TxnFaults

    async def main() -> None:
        faults = TxnFaults()
        engine = OptimisticTxnEngine(MemKVStore(), sync=False, faults=faults)
        table = ClaimTable(engine, b"server-a", ManualClock(0), 1_000)
        held = await table.try_claim(b"I" + (9).to_bytes(8, "big"))
        assert held is not None
        faults.maybe_committed = 1  # the bump lands, its caller hears "maybe committed" and retries
        renewed = await table.renew(held)
        assert renewed and not held.lost, "this server's own renewal was taken for another server's takeover"

    asyncio.run(main())


def test_the_database_password_never_appears_in_messages() -> None:
    from fs3.common.errors import InvalidArgument
    from fs3.kv.postgres import PostgresConfig, redact_url

    assert "s3cret" not in redact_url("postgresql://u:s3cret@h:5432/db")  # the case that works
    assert "s3cret" not in repr(PostgresConfig("postgresql://u:s3cret@h:5432/db")), "repr(config) shows it"
    assert "s3cret" not in redact_url("postgresql://u@h:5432/db?password=s3cret"), "libpq's ?password= shown"
    with pytest.raises(InvalidArgument) as err:  # a typo in the scheme separator
        PostgresConfig("postgresql:/u:s3cret@h:5432/db").validate()
    assert "s3cret" not in str(err.value), "the malformed URL's error prints the password"


def test_pool_cancel_racing_a_handover_is_neither_swallowed_nor_leaks(postgres_url: str) -> None:
    """A pool of one connection: a transaction waits for it and is cancelled right after the
    holder's commit handed the connection over. Whether the cancel came first or the waiter had
    already run, the connection must be back in the pool (a later transaction gets it)."""
    from fs3.common.errors import Unavailable
    from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine

    async def main() -> None:
        engine = await PostgresTxnEngine.open(PostgresConfig(postgres_url, pool_size_max=1,
                                                             acquire_timeout_ms=3_000))
        try:
            holder = engine.begin()
            holder.put(b"k", b"v")
            await holder.get(b"k")  # holds the pool's one connection
            waiting = asyncio.create_task(engine.begin().get(b"k"))
            await asyncio.sleep(0.05)  # queued for the connection
            await holder.commit()  # gives the connection back: handed to the waiter...
            waiting.cancel()  # ...as its request is cancelled, before it ran again
            with contextlib.suppress(asyncio.CancelledError):
                assert await waiting in (b"v", None)
            try:
                assert await engine.begin().get(b"k") == b"v"  # the connection came back to the pool
            except Unavailable:
                pytest.fail("the connection handed to the cancelled waiter was lost: the pool's slot leaked")
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_cancel_while_holding_waits_for_its_renewer_is_not_swallowed() -> None:
    async def main() -> None:
        engine = OptimisticTxnEngine(MemKVStore(), sync=False)
        table = ClaimTable(engine, b"server-a", ManualClock(0), 1_000)
        held = await table.try_claim(b"C" + b"client-1")
        assert held is not None

        async def slow_renewer(held: object) -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                # a renewal in flight ends a moment after its cancel (psycopg cancels the query and
                # waits for the server's answer; a retry waits for the contention gate)
                await asyncio.sleep(0.05)
                raise

        table._keep_renewed = slow_renewer  # type: ignore[method-assign]

        async def job() -> None:
            async with table.holding(held):
                await asyncio.sleep(0.005)  # the job's work under the claim (its renewer has started)
            await asyncio.sleep(3600)  # the job's next step

        task = asyncio.create_task(job())
        await asyncio.sleep(0.02)  # the job is waiting for its renewer to end
        task.cancel()  # the service stops
        await asyncio.sleep(0.2)
        done = task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert done, "the job swallowed its cancellation and went on"

    asyncio.run(main())

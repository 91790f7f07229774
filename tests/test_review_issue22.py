"""Hostile review of issue 22 (PostgreSQL engine, claims, mgmtd HA): findings as tests.

Each xfail(strict=True) test shows a real bug; it passes once the bug is fixed (then drop the mark).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from fs3.common.clock import ManualClock
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine
from fs3.meta.claims import ClaimTable


@pytest.mark.xfail(strict=True, reason="claims restart at epoch 1 after a release, so another server's old "
                   "observation of (owner, 1) makes a fresh, live claim look lapsed: two servers hold it")
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


@pytest.mark.xfail(strict=True, reason="a renewal whose first commit landed but was reported MaybeCommitted is "
                   "retried, reads its own bumped epoch, and declares the claim taken over (held.lost)")
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


@pytest.mark.xfail(strict=True, reason="redact_url only hides a password in the user-info part: one given as "
                   "?password=, or in a URL missing a slash, is printed in error messages; PostgresConfig's "
                   "repr carries the URL")
def test_the_database_password_never_appears_in_messages() -> None:
    from fs3.common.errors import InvalidArgument
    from fs3.kv.postgres import PostgresConfig, redact_url

    assert "s3cret" not in redact_url("postgresql://u:s3cret@h:5432/db")  # the case that works
    assert "s3cret" not in repr(PostgresConfig("postgresql://u:s3cret@h:5432/db")), "repr(config) shows it"
    assert "s3cret" not in redact_url("postgresql://u@h:5432/db?password=s3cret"), "libpq's ?password= shown"
    with pytest.raises(InvalidArgument) as err:  # a typo in the scheme separator
        PostgresConfig("postgresql:/u:s3cret@h:5432/db").validate()
    assert "s3cret" not in str(err.value), "the malformed URL's error prints the password"


@pytest.mark.xfail(strict=True, reason="_Pool.acquire waits with asyncio.wait_for: a cancel arriving as a "
                   "connection is handed over is swallowed on 3.11 (the caller keeps running) and on 3.12+ "
                   "drops the handed connection (the pool slot leaks for good)")
def test_pool_cancel_racing_a_handover_is_neither_swallowed_nor_leaks() -> None:
    from types import SimpleNamespace

    from psycopg.pq import TransactionStatus

    from fs3.kv.postgres import PostgresConfig, _Conn, _Pool

    async def main() -> None:
        pool = _Pool(PostgresConfig("postgresql://u@h/db", pool_size_max=1, acquire_timeout_ms=5_000))
        fake_pg = SimpleNamespace(closed=False, broken=False,
                                  info=SimpleNamespace(transaction_status=TransactionStatus.IDLE))
        conn = _Conn(fake_pg)  # type: ignore[arg-type]
        pool._open = 1  # the pool's one connection is busy elsewhere
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)  # queued for a connection
        pool.release(conn)  # handed to the waiter...
        waiter.cancel()  # ...as its request is cancelled
        with contextlib.suppress(asyncio.CancelledError):
            got = await waiter
            pool.release(got)  # what a caller that went on would do in the end
        assert waiter.cancelled(), "the cancellation was swallowed: the cancelled request went on"
        assert conn in pool._idle, "the connection handed to the cancelled waiter is lost: its slot leaks"

    asyncio.run(main())


@pytest.mark.xfail(strict=True, reason="ClaimTable.holding awaits its cancelled renewer under "
                   "contextlib.suppress(BaseException): a cancel of the caller arriving then is swallowed, "
                   "so a background job being stopped keeps running (stop() waits for ever)")
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

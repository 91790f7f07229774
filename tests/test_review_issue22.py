"""Hostile review of issue 22 (PostgreSQL engine, claims, mgmtd HA): findings as tests.

Each xfail(strict=True) test shows a real bug; it passes once the bug is fixed (then drop the mark).
"""

from __future__ import annotations

import asyncio

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

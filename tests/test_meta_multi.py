"""Several meta servers on one store: claims, background jobs, retries that land on another server.

Each server here is a :class:`MetaService` of its own (its own claim id, locks, caches), and all
of them share ONE :class:`OptimisticTxnEngine`: the engine assumes nothing about who else writes,
so it stands in for the one database several ``fs3 meta`` processes share. Storage is a dict of
chunks in the test, so a job's every removal is counted.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3 import storage_pb2 as spb
from fs3.client.routing import RoutingCache
from fs3.common.errors import Unavailable
from fs3.common.ids import chunk_id, parse_chunk_id
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine, run_transaction
from fs3.meta import schema
from fs3.meta.claims import ClaimRecord, ClaimTable, claim_key, inode_claim
from fs3.meta.service import MetaService, MetaServiceConfig
from tests.conftest import wait_until

CHUNK = 4096
CHAINS = [11, 12]
TTL_MS = 300


class Chunks:
    """The chunks on storage, shared by every server: (chain, chunk id) -> removals applied."""

    def __init__(self) -> None:
        self.stored: set[tuple[int, bytes]] = set()
        self.removed: Counter[tuple[int, bytes]] = Counter()
        self.hang: asyncio.Event | None = None  # removals wait for it while set
        self.hanging = asyncio.Event()

    def put_file(self, inode_id: int, chunks: int) -> None:
        for index in range(chunks):
            self.stored.add((CHAINS[index % len(CHAINS)], chunk_id(inode_id, index)))


class FakeStorage:
    def __init__(self, chunks: Chunks) -> None:
        self.chunks = chunks

    async def remove(self, chain_id: int, cid: bytes, chunk_size: int, *args: Any, **kwargs: Any) -> spb.UpdateRsp:
        if self.chunks.hang is not None:
            self.chunks.hanging.set()
            await self.chunks.hang.wait()
        await asyncio.sleep(0)
        if (chain_id, cid) in self.chunks.stored:
            self.chunks.stored.discard((chain_id, cid))
            self.chunks.removed[(chain_id, cid)] += 1
        return spb.UpdateRsp()


class ListedMeta(MetaService):
    """Meta whose chunk listings read the test's chunks."""

    chunks: Chunks

    async def _list_inode_chunks(self, chain_id: int, inode_id: int, index: int,
                                 head_first: bool) -> tuple[list[spb.ChunkMeta], bool]:
        found = sorted(cid for chain, cid in self.chunks.stored
                       if chain == chain_id and parse_chunk_id(cid)[0] == inode_id and parse_chunk_id(cid)[1] >= index)
        page = found[:self.config.chunk_page]
        return [spb.ChunkMeta(chunk_id=cid) for cid in page], len(found) > len(page)


class _NoChannels:
    def node_address(self, framed: str, grpc: str) -> str:
        return framed


def servers(count: int, chunks: Chunks, engine: OptimisticTxnEngine | None = None,
            chunk_page: int = 256) -> list[ListedMeta]:
    engine = engine or OptimisticTxnEngine(MemKVStore(), sync=False)
    made = []
    for n in range(count):
        routing = RoutingCache(["mgmtd"], _NoChannels())  # type: ignore[arg-type]
        routing._install(cpb.RoutingInfo(chain_tables=[cpb.ChainTable(table_id=1, chain_ids=CHAINS)]))
        config = MetaServiceConfig(chunk_size_bytes=CHUNK, root_mode=0o777, claim_ttl_ms=TTL_MS,
                                   chunk_page=chunk_page)
        meta = ListedMeta(engine, routing, FakeStorage(chunks), config,  # type: ignore[arg-type]
                          server_id=f"meta-{n}".encode())
        meta.chunks = chunks
        made.append(meta)
    return made


async def queue_gc(engine: OptimisticTxnEngine, chunks: Chunks, inode_ids: list[int], per_file: int) -> None:
    layout = mpb.Layout(table_id=1, chunk_size=CHUNK, chains=CHAINS)
    for inode_id in inode_ids:
        chunks.put_file(inode_id, per_file)

    async def queue(txn: Any) -> None:
        for inode_id in inode_ids:
            txn.put(schema.gc_key(inode_id), schema.GcJob(layout, 0, per_file * CHUNK).encode())

    await run_transaction(engine, queue)


async def queued(engine: OptimisticTxnEngine) -> int:
    prefix = schema.gc_prefix()
    return len(await engine.begin().scan(prefix, prefix + b"\xff"))


def test_two_servers_collect_every_queued_file_exactly_once() -> None:
    """Both servers scan one GC queue at once: each file is collected by one of them, each chunk
    removed once, and every claim is released after."""
    async def main() -> None:
        chunks = Chunks()
        a, b = servers(2, chunks, chunk_page=2)
        files = list(range(100, 140))
        await queue_gc(a.engine, chunks, files, per_file=5)  # type: ignore[arg-type]
        total = len(chunks.stored)
        finished = list(await asyncio.gather(a.run_gc_once(limit=8), b.run_gc_once(limit=8)))
        # A file one server skipped (the other held it) is left for the next round.
        while await queued(a.engine) and sum(finished) < len(files):  # type: ignore[arg-type]
            finished += await asyncio.gather(a.run_gc_once(), b.run_gc_once())
        assert sum(finished) == len(files)
        assert await queued(a.engine) == 0  # type: ignore[arg-type]
        assert not chunks.stored and len(chunks.removed) == total
        assert set(chunks.removed.values()) == {1}
        assert not await a.engine.begin().scan(claim_key(b""), claim_key(b"\xff"))  # all released
        assert finished[0] > 0 and finished[1] > 0, "both servers took part"

    asyncio.run(main())


def test_a_server_frozen_mid_job_is_taken_over_once_its_claim_lapses() -> None:
    """Server A holds a file's claim and hangs in a removal, renewing nothing (a frozen or cut-off
    process). B passes the file over while A's claim stands, takes it over a claim's time to live
    after A's last renewal, and finishes it; A, woken, finds its claim no longer sure and stops
    before its next page."""
    async def main() -> None:
        chunks = Chunks()
        a, b = servers(2, chunks, chunk_page=1)
        await queue_gc(a.engine, chunks, [7], per_file=4)  # type: ignore[arg-type]
        frozen = asyncio.Event()

        async def never(held: Any) -> bool:
            await frozen.wait()
            return False

        a.claims.renew = never  # type: ignore[method-assign]
        chunks.hang = asyncio.Event()
        a_job = asyncio.create_task(a.run_gc_once())
        await asyncio.wait_for(chunks.hanging.wait(), 10)
        assert await b.run_gc_once() == 0, "B ran the file A holds"
        hang, chunks.hang = chunks.hang, None
        finished = 0

        async def b_finishes() -> bool:
            nonlocal finished
            finished += await b.run_gc_once()
            return finished == 1

        await wait_until(b_finishes, timeout_s=30, what="B takes the file over")
        assert b.claims.taken_over == 1
        assert not chunks.stored and await queued(a.engine) == 0  # type: ignore[arg-type]
        hang.set()  # A wakes: its removal lands (on nothing), then its claim check stops it
        assert await asyncio.wait_for(a_job, 10) == 0
        assert sum(chunks.removed.values()) == 4

    asyncio.run(main())


def test_a_request_waits_for_another_servers_claim_on_the_inode() -> None:
    """A truncate job run by a request on B waits while A holds the inode; it runs once A releases."""
    async def main() -> None:
        chunks = Chunks()
        a, b = servers(2, chunks)
        entered = asyncio.Event()
        leave = asyncio.Event()

        async def hold() -> None:
            async with a._inode_lock(9):
                entered.set()
                await leave.wait()

        holder = asyncio.create_task(hold())
        await entered.wait()
        waiter = asyncio.create_task(b._finish_truncate(9))
        await asyncio.sleep(TTL_MS / 1000)  # A renews meanwhile: B must still wait
        assert not waiter.done()
        leave.set()
        await asyncio.wait_for(asyncio.gather(holder, waiter), 10)
        assert b.claims.taken_over == 0

    asyncio.run(main())


def test_a_claim_is_taken_over_only_after_a_ttl_unchanged() -> None:
    async def main() -> None:
        engine = OptimisticTxnEngine(MemKVStore(), sync=False)
        clock_a, clock_b = _Clock(), _Clock()
        a = ClaimTable(engine, b"a", clock_a, ttl_ms=1_000)
        b = ClaimTable(engine, b"b", clock_b, ttl_ms=1_000)
        held = await a.try_claim(inode_claim(1))
        assert held is not None and held.valid()
        assert await b.try_claim(inode_claim(1)) is None  # first seen now
        clock_b.now += 900
        assert await b.try_claim(inode_claim(1)) is None
        assert await a.renew(held)  # a renewal resets B's count
        clock_b.now += 900
        assert await b.try_claim(inode_claim(1)) is None
        clock_a.now += 600
        assert not held.valid(), "the holder trusts its claim for half a ttl after its last renewal"
        with pytest.raises(Unavailable):
            held.check()
        clock_b.now += 1_001
        taken = await b.try_claim(inode_claim(1))
        assert taken is not None and b.taken_over == 1
        assert not await a.renew(held) and held.lost
        await a.release(held)  # a lost claim is not A's to drop
        raw = await engine.begin().get(claim_key(inode_claim(1)))
        assert raw is not None and ClaimRecord.decode(raw).owner == b"b"
        await b.release(taken)
        assert await engine.begin().get(claim_key(inode_claim(1))) is None

    asyncio.run(main())


class _Clock:
    def __init__(self) -> None:
        self.now = 0

    def now_ms(self) -> int:
        return self.now


def test_a_retry_on_another_server_gets_the_first_answer() -> None:
    """The same request id sent to A, then to B (A's reply lost), and to both at once: one
    directory is made, every attempt answered with the same inode."""
    async def main() -> None:
        chunks = Chunks()
        a, b, c = servers(3, chunks)
        for meta in (a, b, c):
            await meta.start(background=False)
        ctx = mpb.ReqCtx(user=mpb.User(), client_id=b"client-one-xxxxx", request_id=1)
        req = mpb.MakeNodeReq(ctx=ctx, target=mpb.PathRef(path=b"/d"), type=mpb.DIRECTORY, mode=0o755)
        first, _ = await a.make_node(req, memoryview(b""))
        again, _ = await b.make_node(req, memoryview(b""))
        assert again.inode.inode_id == first.inode.inode_id
        ctx2 = mpb.ReqCtx(user=mpb.User(), client_id=b"client-one-xxxxx", request_id=2)
        req2 = mpb.MakeNodeReq(ctx=ctx2, target=mpb.PathRef(path=b"/e"), type=mpb.DIRECTORY, mode=0o755)
        answers = await asyncio.gather(*(m.make_node(req2, memoryview(b"")) for m in (a, b, c)))
        assert len({rsp.inode.inode_id for rsp, _ in answers}) == 1
        listing, _ = await c.read_dir(mpb.ReadDirReq(ctx=ctx, dir=mpb.PathRef(path=b"/"), limit=10),
                                      memoryview(b""))
        assert sorted(e.name for e in listing.entries) == [b"d", b"e"]

    asyncio.run(main())


def test_a_store_no_other_server_can_open_grants_claims_without_a_transaction() -> None:
    """The embedded RocksDB is opened by one meta process only: its claims cost no commit, and
    hold until released whatever the clock does."""
    from fs3.common.clock import ManualClock
    from fs3.kv.store import MemKVStore
    from fs3.kv.txn import OptimisticTxnEngine
    from fs3.meta.claims import ClaimTable, claim_key, inode_claim

    async def main() -> None:
        engine = OptimisticTxnEngine(MemKVStore())
        clock = ManualClock()
        table = ClaimTable(engine, b"only", clock, ttl_ms=1_000, exclusive=True)
        held = await table.claim(inode_claim(7), wait_ms=0)
        async with table.holding(held):
            clock.advance(60_000)  # no renewal needed, none made
            held.check()
            assert await engine.begin().get(claim_key(inode_claim(7))) is None
        assert not held.valid() and not table.held

    asyncio.run(main())

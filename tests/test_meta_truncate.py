"""Truncation, chunk GC and a file's length on storage: races with writers, storage errors, sparse
files, jobs interrupted and merged, a length probe racing a truncate, and a 1 PB file.

Every test runs an in-process cluster with meta; storage errors are injected into meta's own
storage client, and the interleavings are staged by hooks that wait for events, not for time.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import random
import resource
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fs3.aio
from fs3 import meta_pb2 as mpb
from fs3 import storage_pb2 as spb
from fs3.client.fs import AsyncFileSystem
from fs3.client.storage_client import CapabilitySource
from fs3.common.errors import InvalidArgument, IoError
from fs3.common.ids import chunk_id, parse_chunk_id
from fs3.common.posix import Caller
from fs3.kv.api import Transaction, prefix_end
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine, run_transaction
from fs3.meta import schema
from fs3.meta.fsck import run_fsck
from fs3.meta.ops import Namespace, OpEnv
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.dispatch import Buffer
from fs3.rpc.storage_calls import list_chunk_range
from tests.conftest import wait_until
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # in-process clusters

CHUNK = 65536
MIB = 1 << 20
PB = 1 << 50


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def with_cluster(tmp_path: Path, body: Callable[[InProcessCluster, AsyncFileSystem], Awaitable[None]],
                 chunk_size: int = CHUNK, **meta_config: Any) -> None:
    """A 3-chain cluster with meta; ``/t`` holds files of ``chunk_size`` striped over every chain."""
    async def main() -> None:
        settings: dict[str, Any] = {"root_mode": 0o777, "prune_interval_ms": 100, "gc_interval_ms": 100}
        settings.update(meta_config)
        async with InProcessCluster(tmp_path, targets_per_node=3, with_meta=True,
                                    meta_config=MetaServiceConfig(**settings)) as cluster:
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            try:
                await fs.makedirs("/t")
                await fs.set_layout("/t", chunk_size=chunk_size, stripe=3)
                await body(cluster, fs)
            finally:
                await fs.close()

    run(main())


def meta_of(cluster: InProcessCluster) -> MetaService:
    assert cluster.meta is not None
    return cluster.meta


def chunks_of(cluster: InProcessCluster, inode_id: int) -> set[int]:
    """Indexes of the inode's chunks on any storage target."""
    found: set[int] = set()
    for node in cluster.nodes.values():
        for engine in node.engines.values():
            found.update(parse_chunk_id(cid)[1] for cid in engine.states() if parse_chunk_id(cid)[0] == inode_id)
    return found


async def connect(cluster: InProcessCluster, **options: Any) -> AsyncFileSystem:
    return await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token, **options)


async def write_file(fs: AsyncFileSystem, path: str, pieces: dict[int, bytes]) -> int:
    """Create ``path`` with ``pieces`` (offset -> bytes) and close it; returns the inode id."""
    async with await fs.open(path, "wb") as f:
        for offset, data in sorted(pieces.items()):
            await f.pwrite(offset, data)
    return (await fs.stat(path)).st_ino


async def gc_all(meta: MetaService) -> None:
    while await meta.run_gc_once() > 0:
        pass


class StorageFaults:
    """Makes meta's chunk removals and trims fail while ``failing`` is set, and calls ``before``
    (once) ahead of the first removal or trim that is let through."""

    def __init__(self, meta: MetaService) -> None:
        self.failing = False
        self.before: Callable[[], Awaitable[None]] | None = None
        self._hook_done = asyncio.Event()
        self._hook_done.set()
        original = meta.storage.update

        async def update(chain_id: int, chunk_id: bytes, update_type: int, *args: Any, **kwargs: Any
                         ) -> spb.UpdateRsp:
            if update_type in (spb.REMOVE, spb.TRUNCATE):
                if self.failing:
                    raise IoError("injected storage error")
                hook, self.before = self.before, None
                if hook is not None:
                    self._hook_done.clear()
                    try:
                        await hook()
                    finally:
                        self._hook_done.set()
                await self._hook_done.wait()  # removals running beside the hook's wait for it
            return await original(chain_id, chunk_id, update_type, *args, **kwargs)

        meta.storage.update = update  # type: ignore[method-assign]


class MutateWatch:
    """Sets ``refused`` when one of meta's transactions raises (e.g. an open told to wait for a
    truncate job): a hook can wait for "the other client finished, or meta made it wait"."""

    def __init__(self, meta: MetaService) -> None:
        self.refused = asyncio.Event()
        original = meta._mutate

        async def mutate(*args: Any, **kwargs: Any) -> Any:
            try:
                return await original(*args, **kwargs)
            except BaseException:
                self.refused.set()
                raise

        meta._mutate = mutate  # type: ignore[method-assign]


async def finished_or_refused(task: asyncio.Task[None], watch: MutateWatch) -> None:
    waiter = asyncio.create_task(watch.refused.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


# -- a truncate never removes data written after it (item: truncate job vs later writers) -------------


@pytest.mark.parametrize("how", ["boundary", "mid-chunk", "o_trunc"])
def test_a_truncate_never_removes_what_another_client_wrote_after_it(tmp_path: Path, how: str) -> None:
    """Client A truncates; while meta removes the chunks, client B opens the file, writes past the
    new end and closes. B's acknowledged bytes must survive the truncate's removal."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        meta = meta_of(cluster)
        inode = await write_file(fs, "/t/f", {0: b"x" * (5 * CHUNK)})
        size = {"boundary": CHUNK, "mid-chunk": CHUNK + 100, "o_trunc": 0}[how]
        offset = {"boundary": 3 * CHUNK + 10, "mid-chunk": CHUNK + 200, "o_trunc": 2 * CHUNK}[how]
        b = await connect(cluster)
        faults, watch = StorageFaults(meta), MutateWatch(meta)

        async def writer_b() -> None:
            async with await b.open("/t/f", "r+b") as g:
                await g.pwrite(offset, b"B" * 50)

        b_task: list[asyncio.Task[None]] = []

        async def while_removing() -> None:
            watch.refused.clear()
            b_task.append(asyncio.create_task(writer_b()))
            await finished_or_refused(b_task[0], watch)

        faults.before = while_removing
        if how == "o_trunc":
            async with await fs.open("/t/f", "wb"):
                pass
        else:
            await fs.truncate("/t/f", size)
        await b_task[0]
        await b.close()
        await meta.run_truncates_once()
        st = await fs.stat("/t/f")
        assert st.st_size == offset + 50
        data = await fs.read_bytes("/t/f")
        assert data[offset:] == b"B" * 50, "B's acknowledged write was removed by the earlier truncate"
        assert data[:size] == b"x" * size
        assert data[size:offset] == bytes(offset - size)
        assert chunks_of(cluster, inode) <= set(range(offset // CHUNK + 1))

    with_cluster(tmp_path / "c", body)


def test_a_postponed_truncate_never_removes_data_written_after_it_failed(tmp_path: Path) -> None:
    """A storage error postpones A's truncate job. B then opens, writes past the new end and
    closes; when the job runs again it must not remove B's acknowledged bytes."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        meta = meta_of(cluster)
        await write_file(fs, "/t/f", {0: b"x" * (5 * CHUNK)})
        faults = StorageFaults(meta)
        a = await connect(cluster, retry_total_ms=300)
        faults.failing = True
        with pytest.raises(OSError):
            await a.truncate("/t/f", CHUNK)
        await a.close()
        faults.failing = False
        b = await connect(cluster)
        async with await b.open("/t/f", "r+b") as g:
            await g.pwrite(3 * CHUNK, b"B" * 50)
        await b.close()
        await meta.run_truncates_once()  # the maintenance loop's pass over unfinished jobs
        data = await fs.read_bytes("/t/f")
        assert len(data) == 3 * CHUNK + 50
        assert data[3 * CHUNK:] == b"B" * 50, "the re-run truncate job removed B's acknowledged write"
        assert data[:CHUNK] == b"x" * CHUNK and data[CHUNK:3 * CHUNK] == bytes(2 * CHUNK)

    with_cluster(tmp_path / "c", body)


def test_a_handle_opened_before_a_truncate_keeps_what_it_writes_after_it(tmp_path: Path) -> None:
    """A handle open across a truncate writes into the truncated range after the truncate
    returned: its bytes and its length stand (they come after the truncate)."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        await write_file(fs, "/t/f", {0: b"x" * (5 * CHUNK)})
        b = await connect(cluster)
        g = await b.open("/t/f", "r+b")
        await fs.truncate("/t/f", CHUNK)
        await g.pwrite(3 * CHUNK, b"B" * 50)
        await g.close()
        await b.close()
        data = await fs.read_bytes("/t/f")
        assert len(data) == 3 * CHUNK + 50 and data[3 * CHUNK:] == b"B" * 50
        assert data[:CHUNK] == b"x" * CHUNK and data[CHUNK:3 * CHUNK] == bytes(2 * CHUNK)

    with_cluster(tmp_path / "c", body)


# -- one handle: truncate, then write again ---------------------------------------------------------


def test_one_handle_truncates_then_rewrites_across_chunks(tmp_path: Path) -> None:
    """open(O_CREAT|O_RDWR|O_TRUNC); pwrite 10 MiB; ftruncate 1 MiB; pwrite 5 MiB; close: the
    size is 5 MiB + 1 (the chunk past the truncate must not come back with the length)."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        await fs.makedirs("/big")
        await fs.set_layout("/big", chunk_size=4 * MIB, stripe=3)
        async with await fs.open("/big/f", "w+b") as f:
            await f.pwrite(10 * MIB, b"a")
            await f.truncate(MIB)
            await f.pwrite(5 * MIB, b"b")
        assert (await fs.stat("/big/f")).st_size == 5 * MIB + 1
        async with await fs.open("/big/f", "rb") as f:
            assert await f.pread(5 * MIB - 10, 100) == bytes(10) + b"b"

    with_cluster(tmp_path / "c", body)


# -- sparse files: chunks past a gap ----------------------------------------------------------------


def test_truncating_an_open_file_removes_a_chunk_past_a_gap(tmp_path: Path) -> None:
    """A writer published chunk 0, then wrote chunk 4 (a gap between). A truncate to 1 byte must
    remove chunk 4 too, or the writer's close brings the old length back."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        w = await connect(cluster)
        f = await w.open("/t/f", "wb")
        await f.pwrite(0, b"a" * CHUNK)
        await f.fsync()
        await f.pwrite(4 * CHUNK + 5, b"z" * 10)
        await f.flush()
        await fs.truncate("/t/f", 1)
        await f.close()
        await w.close()
        assert (await fs.stat("/t/f")).st_size == 1
        assert await fs.read_bytes("/t/f") == b"a"
        assert chunks_of(cluster, (await fs.stat("/t/f")).st_ino) == {0}

    with_cluster(tmp_path / "c", body)


def test_a_dead_clients_sparse_write_counts_and_is_collected(tmp_path: Path) -> None:
    """A client writes chunks 0 and 3 and dies without closing. Pruning it must find chunk 3 for
    the length, and unlinking the file must remove both chunks."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        meta = meta_of(cluster)
        dead = await connect(cluster)
        f = await dead.open("/t/f", "wb")
        await f.pwrite(0, b"a" * 100)
        await f.pwrite(3 * CHUNK, b"d" * 100)
        await f.flush()
        inode = f.inode.inode_id
        await dead.meta.stop()  # no more lease renewals: meta prunes it

        async def pruned() -> bool:
            prefix = schema.session_prefix(inode)
            return not await meta.engine.begin().scan(prefix, prefix_end(prefix), limit=1)

        await wait_until(pruned, what="dead client pruned")
        assert (await fs.stat("/t/f")).st_size == 3 * CHUNK + 100
        await fs.remove("/t/f")
        await gc_all(meta)
        assert chunks_of(cluster, inode) == set(), "a chunk past a gap was orphaned"
        await dead.close()

    with_cluster(tmp_path / "c", body, client_lease_ms=600)


# -- unfinished truncate jobs: merging and unlinking ------------------------------------------------


def test_an_extension_never_narrows_an_unfinished_shrink(tmp_path: Path) -> None:
    """A truncate to 0 fails on storage; an ftruncate extension through an open handle follows.
    What the extension exposes must read as zeros, never the old contents."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        meta = meta_of(cluster)
        await write_file(fs, "/t/f", {0: b"x" * (3 * CHUNK)})
        h = await fs.open("/t/f", "r+b")
        faults = StorageFaults(meta)
        a = await connect(cluster, retry_total_ms=300)
        faults.failing = True
        with pytest.raises(OSError):
            await a.truncate("/t/f", 0)
        await a.close()
        faults.failing = False
        await h.truncate(CHUNK // 2)
        await h.close()
        await meta.run_truncates_once()
        assert await fs.read_bytes("/t/f") == bytes(CHUNK // 2), "old contents reappeared after the extension"

    with_cluster(tmp_path / "c", body)


def test_unlinking_a_file_with_an_unfinished_truncate_collects_every_chunk(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        meta = meta_of(cluster)
        inode = await write_file(fs, "/t/f", {0: b"x" * 100, 3 * CHUNK: b"y" * 100})
        faults = StorageFaults(meta)
        a = await connect(cluster, retry_total_ms=300)
        faults.failing = True
        with pytest.raises(OSError):
            await a.truncate("/t/f", 0)
        await a.close()
        await fs.remove("/t/f")
        faults.failing = False
        await meta.run_truncates_once()
        await gc_all(meta)
        assert chunks_of(cluster, inode) == set(), "chunks of an unlinked file leaked"

    with_cluster(tmp_path / "c", body)


def test_a_truncate_that_reports_an_error_has_not_changed_the_size_yet(tmp_path: Path) -> None:
    """The truncating client's error is honest: the size it asked for is not visible until the
    chunks past it are gone; the recorded job then completes it."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        meta = meta_of(cluster)
        await write_file(fs, "/t/f", {0: b"x" * (3 * CHUNK)})
        faults = StorageFaults(meta)
        a = await connect(cluster, retry_total_ms=300)
        a_reader = await connect(cluster, retry_total_ms=300)
        faults.failing = True
        with pytest.raises(OSError) as failed:
            await a.truncate("/t/f", CHUNK)
        await a.close()
        assert (await fs.stat("/t/f")).st_size == 3 * CHUNK
        assert "complete" in str(failed.value)  # the message says the truncate is still to happen
        # Until it completes the file is not opened (a new handle could write where chunks are
        # still to be removed): the open fails with the same explanation, it never reads zeros.
        with pytest.raises(OSError, match="complete"):
            await a_reader.open("/t/f", "rb")
        faults.failing = False
        await meta.run_truncates_once()
        assert (await fs.stat("/t/f")).st_size == CHUNK
        assert await fs.read_bytes("/t/f") == b"x" * CHUNK
        await a_reader.close()

    with_cluster(tmp_path / "c", body)


# -- a length probe racing a truncate -----------------------------------------------------------------


class SecondMeta:
    """Another meta server on the same store (the per-process lock does not reach it): it
    truncates the file just before some of the first server's length transactions.

    It records its claims under the first server's id, so the inode's claim (fs3.meta.claims),
    which would make it wait for the first server, does not keep it out: what is tested is the
    second line of defence, the size generation a probe's length is applied under."""

    def __init__(self, meta: MetaService, inode_id: int, size: int) -> None:
        self.other = MetaService(meta.engine, meta.routing, meta.storage, meta.config, server_id=meta.server_id)
        self.inode_id, self.size = inode_id, size
        self.calls = 0
        self.fire_on: Callable[[int], bool] = lambda call: False
        self.request = 0
        original = meta._mutate

        async def mutate(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.fire_on(self.calls):
                await self.truncate()
            return await original(*args, **kwargs)

        meta._mutate = mutate  # type: ignore[method-assign]

    async def truncate(self) -> None:
        self.request += 1
        ctx = mpb.ReqCtx(user=mpb.User(), client_id=b"second-meta-cli\x00", request_id=self.request)
        await self.other.set_attr(mpb.SetAttrReq(ctx=ctx, target=mpb.PathRef(inode_id=self.inode_id),
                                                 mask=mpb.SET_SIZE, size=self.size), memoryview(b""))


@pytest.mark.parametrize("every_probe", [False, True])
def test_a_truncate_to_the_same_size_during_a_length_probe_is_noticed(tmp_path: Path, every_probe: bool) -> None:
    """A writer (flagged by an earlier truncate) closes; meta probes storage for its length; a
    truncate to the same size commits before the length does and removes what the probe saw.
    The probe is stale though the size is unchanged; and after several stale probes the writer's
    raw hint must not be applied either (either would undo the truncate)."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        meta = meta_of(cluster)
        w = await connect(cluster)
        f = await w.open("/t/f", "wb")
        inode = f.inode.inode_id
        await fs.truncate("/t/f", 0)  # flags the writer: its lengths are checked against storage
        await f.pwrite(0, b"w" * (3 * CHUNK))
        await f.flush()
        second = SecondMeta(meta, inode, 0)
        second.fire_on = (lambda call: call >= 2) if every_probe else (lambda call: call == 2)
        await f.close()
        second.fire_on = lambda call: False
        await w.close()
        st = await fs.stat("/t/f")
        data = await fs.read_bytes("/t/f")
        assert st.st_size == 0 and data == b"", f"the truncate was undone: {st.st_size} bytes"
        # Every attempt but the first (acknowledged hint, refused) probed and met a truncate; with
        # ``every_probe`` the last attempt is the last resort.
        assert second.request == (4 if every_probe else 1)

    with_cluster(tmp_path / "c", body)


# -- jobs in pages: interrupted and resumed, listing bounds --------------------------------------------


class CountedRemovals:
    """Counts the chunk removals meta sends; the ones after the first ``succeed`` fail while set."""

    def __init__(self, meta: MetaService) -> None:
        self.done = 0
        self.succeed: int | None = None
        original = meta.storage.update

        async def update(chain_id: int, chunk_id: bytes, update_type: int, offset: int, length: int,
                         chunk_size: int, data: Buffer = b"", capability: CapabilitySource | None = None
                         ) -> spb.UpdateRsp:
            if update_type == spb.REMOVE:
                if self.succeed is not None and self.done >= self.succeed:
                    raise IoError("injected: storage went away")
                self.done += 1
            return await original(chain_id, chunk_id, update_type, offset, length, chunk_size, data, capability)

        meta.storage.update = update  # type: ignore[method-assign]


@pytest.mark.parametrize("job", ["gc", "truncate"])
def test_an_interrupted_job_resumes_where_storage_says_it_stopped(tmp_path: Path, job: str) -> None:
    """40 chunks, listed 8 at a time per chain; storage fails after 20 removals. Run again, the
    job removes the 20 that are left — not the whole range again — and nothing is left."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        meta = meta_of(cluster)
        await meta.stop()  # no background GC or maintenance pass: the test runs the jobs itself
        await fs.makedirs("/small")
        await fs.set_layout("/small", chunk_size=4096, stripe=3)
        inode = await write_file(fs, "/small/f", {i * 4096: b"c" for i in range(40)})
        assert len(chunks_of(cluster, inode)) == 40
        removals = CountedRemovals(meta)
        removals.succeed = 20
        if job == "gc":
            await fs.remove("/small/f")
            assert await meta.run_gc_once() == 0  # postponed
        else:
            a = await connect(cluster, retry_total_ms=300)
            with pytest.raises(OSError, match="complete"):
                await a.truncate("/small/f", 0)
            await a.close()
        assert len(chunks_of(cluster, inode)) == 20
        removals.succeed, removals.done = None, 0
        if job == "gc":
            await gc_all(meta)
        else:
            await meta.run_truncates_once()
            assert (await fs.stat("/small/f")).st_size == 0
        assert removals.done == 20
        assert chunks_of(cluster, inode) == set()

    with_cluster(tmp_path / "c", body, chunk_page=8)


def test_a_chunk_listing_stays_inside_its_range(tmp_path: Path) -> None:
    """``DumpChunkMeta`` with ``end_before``: one file's chunks, paged, never its neighbour's; a
    reversed or empty range lists nothing; an oversized page is refused."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        first = await write_file(fs, "/t/a", {i * CHUNK: b"a" for i in range(0, 12, 3)})  # all on one chain
        second = await write_file(fs, "/t/b", {i * CHUNK: b"b" for i in range(0, 12, 3)})
        layout = await fs.layout("/t/a")
        chain_id = layout.chains[0]
        _, members = await meta_of(cluster).routing.chain(chain_id)
        channel = cluster.channels.get(members[0].address)
        target = members[0].target_id
        prefix = first.to_bytes(8, "big")
        end = prefix_end(prefix) or b""

        async def listing(start_after: bytes, end_before: bytes, limit: int) -> tuple[list[int], bool]:
            page, more = await list_chunk_range(channel, chain_id, target, start_after, end_before, limit, 5_000)
            assert all(parse_chunk_id(m.chunk_id)[0] == first for m in page)
            return [parse_chunk_id(m.chunk_id)[1] for m in page], more

        assert second > first
        assert await listing(prefix, end, 100) == ([0, 3, 6, 9], False)
        assert await listing(prefix, end, 2) == ([0, 3], True)
        assert await listing(chunk_id(first, 3), end, 2) == ([6, 9], False)
        assert await listing(chunk_id(first, 9), end, 2) == ([], False)
        assert await listing(end, prefix, 10) == ([], False)  # reversed: nothing
        with pytest.raises(InvalidArgument):
            await listing(prefix, end, 10_001)

    with_cluster(tmp_path / "c", body)


# -- bounded reads of the metadata store ---------------------------------------------------------------


class CountingStore(MemKVStore):
    def __init__(self) -> None:
        super().__init__()
        self.read = 0

    def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        for pair in super().scan(start, end, limit):
            self.read += 1
            yield pair


def test_a_limited_transaction_scan_reads_only_what_it_returns() -> None:
    """Meta scans queues and sessions with small limits (GC and truncate jobs, "does this file have
    a handle"); the transaction must not read the whole range from the store to answer."""
    store = CountingStore()
    engine = OptimisticTxnEngine(store)

    async def main() -> None:
        async def fill(txn: Transaction) -> None:
            for i in range(5_000):
                txn.put(b"Q" + i.to_bytes(4, "big"), b"job")

        await run_transaction(engine, fill)
        store.read = 0
        txn = engine.begin()
        assert [k for k, _ in await txn.scan(b"Q", b"R", limit=3)] == [b"Q" + i.to_bytes(4, "big") for i in range(3)]
        assert store.read <= 3
        # The transaction's own deletes and puts are still merged in.
        txn.delete(b"Q" + (0).to_bytes(4, "big"))
        txn.delete(b"Q" + (2).to_bytes(4, "big"))
        txn.put(b"Q" + (1).to_bytes(4, "big") + b"x", b"new")
        got = [k for k, _ in await txn.scan(b"Q", b"R", limit=3)]
        key = [b"Q" + i.to_bytes(4, "big") for i in range(4)]
        assert got == [key[1], key[1] + b"x", key[3]]
        assert len(await txn.scan(b"Q", b"R")) == 5_000 - 2 + 1

    run(main())


def test_a_limited_transaction_scan_answers_as_the_full_scan_does() -> None:
    """Random stores and random own writes: a limited scan is the full scan's beginning."""
    rng = random.Random(14)

    async def main() -> None:
        for _ in range(200):
            engine = OptimisticTxnEngine(MemKVStore())
            setup = engine.begin()
            for _ in range(rng.randrange(0, 30)):
                setup.put(bytes([rng.randrange(20)]), b"s")
            await setup.commit()
            txn = engine.begin()
            for _ in range(rng.randrange(0, 15)):
                key = bytes([rng.randrange(20)])
                if rng.random() < 0.5:
                    txn.delete(key)
                else:
                    txn.put(key, b"t")
            start, end = bytes([rng.randrange(10)]), bytes([rng.randrange(10, 21)])
            full = await txn.scan(start, end)
            limit = rng.randrange(1, 12)
            assert await txn.scan(start, end, limit=limit) == full[:limit]

    run(main())


def test_fsck_reports_a_truncate_job_or_size_generation_of_a_missing_inode() -> None:
    engine = OptimisticTxnEngine(MemKVStore())
    layout = mpb.Layout(table_id=1, chunk_size=65536)

    async def main() -> list[str]:
        async def setup(txn: Transaction) -> None:
            await Namespace(txn, OpEnv(now_ns=1, caller=Caller(0, 0))).ensure_root(0, 0, 0o755, layout)
            txn.put(schema.truncate_key(77), schema.TruncateJob(layout, 0, 0, 1).encode())
            txn.put(schema.size_gen_key(78), schema.encode_u64(1))

        await run_transaction(engine, setup)
        return list((await run_fsck(engine.begin())).problems)

    assert sorted(run(main())) == ["size generation of missing inode 78", "truncate of missing inode 77"]


# -- a 1 PB sparse file -------------------------------------------------------------------------------


@contextlib.contextmanager
def address_space_limit(extra_bytes: int) -> Iterator[None]:
    """Fail allocations beyond ``extra_bytes`` more address space (a runaway fails fast, with
    MemoryError, instead of taking the machine's memory)."""
    with open("/proc/self/status") as status:
        vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm_kib * 1024 + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.asynccontextmanager
async def traced() -> AsyncIterator[list[int]]:
    """Python memory allocated inside the block: ``[peak above the start]`` once it ends."""
    out: list[int] = []
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        yield out
        out.append(tracemalloc.get_traced_memory()[1] - start)
    finally:
        tracemalloc.stop()


# Meta must truncate and collect a 1 PB file within this much Python memory (the bound covers the
# whole in-process cluster: meta, storage and client; about 0.4 MiB is used). Nothing in it may
# grow with the length: the old code built every chunk index of the range (2^28 of them).
PB_FILE_MEMORY_BOUND_BYTES = 8 * MIB
# No transaction of a truncate, an unlink or a GC job may grow with the length either.
TXN_WRITES_BOUND = 16


def test_a_1_pb_sparse_file_is_truncated_and_removed_in_bounded_memory(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        meta = meta_of(cluster)
        await fs.makedirs("/big")
        await fs.set_layout("/big", chunk_size=4 * MIB, stripe=3)
        async with await fs.open("/big/f", "wb") as f:
            await f.truncate(PB)
            for offset in (0, 7 * 4 * MIB + 5, PB // 2, PB - 1):
                await f.pwrite(offset, b"s")
        inode = (await fs.stat("/big/f")).st_ino
        assert (await fs.stat("/big/f")).st_size == PB
        assert len(chunks_of(cluster, inode)) == 4
        with pytest.raises(OSError) as too_big:  # past the largest file of 4 MiB chunks: refused, nothing lost
            await fs.truncate("/big/f", (4 * MIB << 32) + 1)
        assert too_big.value.errno == errno.EFBIG
        assert (await fs.stat("/big/f")).st_size == PB and len(chunks_of(cluster, inode)) == 4
        largest_txn = [0]
        engine = meta.engine
        assert isinstance(engine, OptimisticTxnEngine)
        original_commit = engine.commit

        async def commit(txn: Any) -> None:
            largest_txn[0] = max(largest_txn[0], len(txn.writes))
            await original_commit(txn)

        engine.commit = commit  # type: ignore[method-assign]
        with address_space_limit(2 << 30):
            async with traced() as peak:
                await fs.truncate("/big/f", MIB)
                assert (await fs.stat("/big/f")).st_size == MIB
                assert chunks_of(cluster, inode) == {0}
                await fs.truncate("/big/f", PB)  # and up again: the old chunks must not come back
                async with await fs.open("/big/f", "rb") as f:
                    assert await f.pread(PB - 10, 10) == bytes(10)
                await fs.remove("/big/f")
                await gc_all(meta)
        assert chunks_of(cluster, inode) == set()
        assert peak[0] < PB_FILE_MEMORY_BOUND_BYTES, f"{peak[0]} bytes for a 1 PB file"
        assert largest_txn[0] <= TXN_WRITES_BOUND

    with_cluster(tmp_path / "c", body)


# -- a truncate whose request is cancelled ------------------------------------------------------------


def test_a_cancelled_truncate_holds_the_inode_until_its_storage_calls_end(tmp_path: Path) -> None:
    """A truncate's handler is cancelled (its client's connection dropped) while one of its chunk
    removals is still on its way to storage. Meta must not let the inode go — another run of the
    job, an open, a write — before that removal has ended: landing later, it would remove what
    client B wrote after the truncate completed."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        meta = meta_of(cluster)
        inode = await write_file(fs, "/t/f", {0: b"x" * (3 * CHUNK)})
        started, release = asyncio.Event(), asyncio.Event()
        delayed: list[int] = []
        original = meta.storage.update

        async def update(chain_id: int, chunk_id: bytes, update_type: int, offset: int, length: int,
                         chunk_size: int, data: Buffer = b"", capability: CapabilitySource | None = None
                         ) -> spb.UpdateRsp:
            if update_type != spb.REMOVE or delayed:
                return await original(chain_id, chunk_id, update_type, offset, length, chunk_size, data, capability)
            delayed.append(parse_chunk_id(chunk_id)[1])

            async def on_storage() -> spb.UpdateRsp:
                await release.wait()  # the request is sent; storage acts on it later
                return await original(chain_id, chunk_id, update_type, offset, length, chunk_size, data)

            call = asyncio.ensure_future(on_storage())
            started.set()
            return await asyncio.shield(call)  # a cancelled caller does not take it back

        meta.storage.update = update  # type: ignore[method-assign]
        ctx = mpb.ReqCtx(user=mpb.User(), client_id=b"cancelled-client", request_id=1)
        a = asyncio.create_task(meta.set_attr(mpb.SetAttrReq(ctx=ctx, target=mpb.PathRef(path=b"/t/f"),
                                                             mask=mpb.SET_SIZE, size=0), memoryview(b"")))
        await started.wait()
        a.cancel()
        b = await connect(cluster)
        offset = delayed[0] * CHUNK

        async def writer_b() -> None:
            async with await b.open("/t/f", "r+b") as g:
                await g.pwrite(offset, b"B" * 50)

        b_task = asyncio.create_task(writer_b())

        async def b_done_or_waiting() -> bool:
            entry = meta._truncate_locks.get(inode)
            return b_task.done() or (entry is not None and entry.users >= 2)

        await wait_until(b_done_or_waiting, interval_s=0.01, what="B done or waiting for the inode")
        release.set()
        with contextlib.suppress(asyncio.CancelledError):
            await a
        await b_task
        await b.close()
        await meta.run_truncates_once()
        data = await fs.read_bytes("/t/f")
        assert len(data) == offset + 50
        assert data[offset:] == b"B" * 50, "a removal of the cancelled truncate landed after B's write"
        assert data[:offset] == bytes(offset)

    with_cluster(tmp_path / "c", body)


def test_a_size_past_64_bits_is_efbig_from_the_library_and_changes_nothing(tmp_path: Path) -> None:
    """``truncate`` with a size no file can have is EFBIG (an ``OSError``), by path and by handle,
    as a size that fits in 64 bits but not in the layout is; the file is untouched."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        await write_file(fs, "/t/f", {0: b"abc"})
        for size in (1 << 64, 1 << 70):
            with pytest.raises(OSError) as by_path:
                await fs.truncate("/t/f", size)
            assert by_path.value.errno == errno.EFBIG
            async with await fs.open("/t/f", "r+b") as f:
                await f.pwrite(3, b"d")
                with pytest.raises(OSError) as by_handle:
                    await f.truncate(size)
                assert by_handle.value.errno == errno.EFBIG
        assert await fs.read_bytes("/t/f") == b"abcd"

    with_cluster(tmp_path / "c", body)


# -- a truncate's trim racing the file's removal ------------------------------------------------------


def test_a_trim_racing_the_files_removal_leaves_no_orphan_chunk(tmp_path: Path) -> None:
    """A truncate has read the chunk holding its new end and is about to trim it when the file
    is unlinked and GC collects every chunk. A trim of a chunk that is gone creates it afresh
    (storage extends with zeros), so landing after GC it would leave a chunk no inode and no GC
    job accounts for: GC must wait for the truncate job that is running on the inode."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        meta = meta_of(cluster)
        inode = await write_file(fs, "/t/f", {0: b"x" * (2 * CHUNK)})
        other = await connect(cluster)
        gc: list[asyncio.Task[None]] = []
        original = meta.storage.update

        async def update(chain_id: int, chunk_id: bytes, update_type: int, *args: Any, **kwargs: Any
                         ) -> spb.UpdateRsp:
            if update_type == spb.TRUNCATE and not gc:
                await other.remove("/t/f")  # no handle keeps it: deleted, its chunks queued for GC
                gc.append(asyncio.create_task(gc_all(meta)))

                async def collected_or_waiting() -> bool:
                    entry = meta._truncate_locks.get(inode)
                    return gc[0].done() or (entry is not None and entry.users >= 2)

                await wait_until(collected_or_waiting, interval_s=0.01, what="GC done or waiting for the inode")
            return await original(chain_id, chunk_id, update_type, *args, **kwargs)

        meta.storage.update = update  # type: ignore[method-assign]
        await fs.truncate("/t/f", CHUNK // 2)
        assert gc, "the truncate never trimmed a chunk"
        await gc[0]
        await gc_all(meta)
        await other.close()
        assert chunks_of(cluster, inode) == set(), "the trim recreated a chunk of a collected file"
        assert not (await meta.fsck(mpb.FsckReq(check_chunks=True), memoryview(b"")))[0].problems

    with_cluster(tmp_path / "c", body)

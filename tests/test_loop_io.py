"""Chunk reads and a commit's blob work on the I/O pool: what may change under them.

A pool read runs while commits go on; it must never hand out bytes of a version that changed under
it, nor report a file a commit deleted as a disk error. A commit's patch rewrites the committed
file in place: readers wait for it, and a cancellation never separates the blob work from the
metadata that names it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fs3 import storage_pb2 as spb
from fs3.common.checksum import crc32c
from fs3.common.errors import FS3Error, InvalidArgument, IoError
from fs3.common.ids import chunk_id
from fs3.common.target_state import PublicState
from fs3.kv.store import MemKVStore
from fs3.storage.blobs import FileBlobStore, MemBlobStore
from fs3.storage.chain_view import ChainMember, ChainView
from fs3.storage.chunk_engine import ChunkEngine
from fs3.storage.replica import ReplicaConfig, TargetReplica

T = TypeVar("T")
CHUNK = 16 * 1024
CID = chunk_id(9, 0)


class GatedHost:
    """A one-target chain whose I/O pool holds calls of the named engine methods until released
    (a slow disk), and — as the node's pool — never returns before the call has run."""

    def __init__(self, gated: str) -> None:
        self.gated = gated
        self.gate = asyncio.Event()
        self.held = 0
        self.pool_calls: list[str] = []  # names of the engine methods run on the pool
        self._view = ChainView(1, 1, 1, 1, (ChainMember(1, 1, PublicState.SERVING, "a"),))

    def view(self, chain_id: int, target_id: int) -> ChainView:
        return self._view

    def lease_valid(self) -> bool:
        return True

    def now_ms(self) -> int:
        return 1_000

    def request_routing_refresh(self) -> None:
        pass

    def update_finished(self, target_id: int, error: BaseException | None) -> None:
        pass

    def fail_target(self, target_id: int, exc: FS3Error) -> None:
        raise AssertionError(f"target {target_id} failed: {exc}")

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        self.pool_calls.append(getattr(fn, "__name__", ""))
        cancelled = False
        if getattr(fn, "__name__", "") == self.gated:
            self.held += 1
            while not self.gate.is_set():
                try:
                    await self.gate.wait()
                except asyncio.CancelledError:
                    cancelled = True
        result = fn(*args)
        if cancelled:
            raise asyncio.CancelledError
        return result


def _replica(host: GatedHost, **config: int) -> tuple[TargetReplica, ChunkEngine]:
    engine = ChunkEngine(MemKVStore(), MemBlobStore())  # every version a file (no inline records)
    return TargetReplica(1, engine, host, ReplicaConfig(**config)), engine  # type: ignore[arg-type]


def _write(offset: int, data: bytes) -> spb.UpdateReq:
    return spb.UpdateReq(chain_id=1, chunk_id=CID, chain_version=1, type=spb.WRITE, offset=offset,
                         length=len(data), chunk_size=CHUNK, checksum=crc32c(data))


def _read() -> spb.ReadReq:
    return spb.ReadReq(chain_id=1, chunk_id=CID, offset=0, length=CHUNK)


async def _spin(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_a_pool_read_of_a_version_replaced_under_it_is_read_again() -> None:
    async def main() -> None:
        host = GatedHost("read")
        replica, engine = _replica(host, offload_read_min_bytes=0, offload_write_min_bytes=1 << 30)
        first, second = b"1" * CHUNK, b"2" * CHUNK
        await replica.update(_write(0, first), first)
        reading = asyncio.create_task(replica.read(_read()))
        await _spin()
        assert host.held == 1 and not reading.done()
        await replica.update(_write(0, second), second)  # commits; its log sync deletes the old file
        with pytest.raises(IoError):
            engine.read(CID, 1, 0, CHUNK)  # what the held read will find: a disk error if believed
        host.gate.set()
        rsp, data = await reading
        assert data == second and rsp.version == engine.get(CID).commit_version  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_pool_read_that_fails_on_an_unchanged_chunk_is_a_disk_error() -> None:
    """Known bad for the check above: a failure with nothing changed is not retried away."""
    async def main() -> None:
        host = GatedHost("read")
        replica, engine = _replica(host, offload_read_min_bytes=0)
        data = b"x" * CHUNK
        await replica.update(_write(0, data), data)
        state = engine.get(CID)
        assert state is not None
        engine.files.delete(CID, state.commit_blob)
        host.gate.set()
        with pytest.raises(IoError):
            await replica.read(_read())

    asyncio.run(main())


def test_readers_wait_for_a_patch_on_the_pool_and_a_cancelled_commit_still_completes() -> None:
    async def main() -> None:
        host = GatedHost("blob_work")  # the commit's blob work (engine.prepare_commit) on the pool
        replica, engine = _replica(host, offload_write_min_bytes=0, offload_read_min_bytes=1 << 30)
        base = bytes(CHUNK)
        await replica.update(_write(0, base), base)
        patch = b"p" * 4096
        writing = asyncio.create_task(replica.update(_write(4096, patch), patch))
        await _spin()
        assert host.held == 1 and replica.rewriting(CID)
        state = engine.get(CID)
        assert state is not None and state.pending_patch
        reading = asyncio.create_task(replica.read(_read()))
        stopping = asyncio.create_task(replica.stop())  # cancels the update mid-commit
        await _spin()
        # The blob work has not run: the chunk stays locked, marked, and unread.
        assert not reading.done() and not stopping.done() and replica.locks.held(CID) and replica.rewriting(CID)
        host.gate.set()
        await stopping
        with pytest.raises(asyncio.CancelledError):
            await writing  # its request was answered by nothing: the update was cancelled
        after = engine.get(CID)
        assert after is not None and after.commit_version == state.pending_version and not after.pending_version
        expected = base[:4096] + patch + base[8192:]
        _, data = await reading
        assert data == expected and engine.read(CID, after.commit_version, 0, CHUNK) == expected
        assert not replica.locks.held(CID) and not replica.rewriting(CID)

    asyncio.run(main())


class DyingPoolHost(GatedHost):
    """Its I/O pool dies before running the commit's blob work (the node's process is gone): the
    call ends cancelled and the work never ran."""

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        if getattr(fn, "__name__", "") == self.gated:
            raise asyncio.CancelledError
        return fn(*args)


def test_a_commit_whose_blob_work_never_ran_writes_no_metadata() -> None:
    """Metadata naming a blob the disk never got would be a committed chunk with no bytes (found
    by simulator seed 5137: a node killed while its commit waited for the pool)."""

    async def main() -> None:
        host = DyingPoolHost("blob_work")
        replica, engine = _replica(host, offload_write_min_bytes=0, offload_read_min_bytes=1 << 30)
        base = bytes(CHUNK)
        host.gated = ""  # the first write commits normally
        await replica.update(_write(0, base), base)
        committed = engine.get(CID)
        assert committed is not None
        host.gated = "blob_work"
        patch = b"p" * 4096
        with pytest.raises(asyncio.CancelledError):
            await replica.update(_write(4096, patch), patch)
        after = engine.get(CID)
        assert after is not None and after.commit_version == committed.commit_version
        assert after.commit_blob == committed.commit_blob and after.pending_version  # still to be done
        assert engine.read(CID, after.commit_version, 0, CHUNK) == base
        assert not replica.rewriting(CID)

    asyncio.run(main())


# -- small reads: on the loop from the page cache, else on the pool ---------------------------

SMALL = 4096


def _file_replica(host: GatedHost, root: Path, **config: Any) -> tuple[TargetReplica, ChunkEngine]:
    engine = ChunkEngine(MemKVStore(), FileBlobStore(root, fsync=True))  # every version a file
    return TargetReplica(1, engine, host, ReplicaConfig(**config)), engine  # type: ignore[arg-type]


def _evict(root: Path) -> None:
    """Drop every blob's pages from the page cache (they are clean once synced), or skip the test
    where the filesystem keeps them (tmpfs) or cannot tell. The probe reads a scratch file: a
    RWF_NOWAIT read that misses starts readahead, which would bring the pages it probed back."""
    scratch = root.parent / "scratch"
    scratch.write_bytes(os.urandom(4 * SMALL))
    for path in [scratch, *(path for path in root.rglob("*") if path.is_file())]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if path == scratch:
                try:
                    os.preadv(fd, [bytearray(SMALL)], 0, os.RWF_NOWAIT)
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                pytest.skip("this filesystem keeps evicted pages (or cannot tell): no cold reads to test")
        finally:
            os.close(fd)


def _small_read(offset: int) -> spb.ReadReq:
    return spb.ReadReq(chain_id=1, chunk_id=CID, offset=offset, length=SMALL)


def test_a_cold_small_read_goes_to_the_pool_and_a_cached_one_does_not(tmp_path: Path) -> None:
    """Without polling (the readahead a miss starts might land within the polls on a fast disk)."""
    async def main() -> None:
        host = GatedHost("")
        host.gate.set()
        replica, _ = _file_replica(host, tmp_path / "chunks", small_read_polls=0)
        data = os.urandom(CHUNK)
        await replica.update(_write(0, data), data)
        host.pool_calls.clear()
        _, got = await replica.read(_small_read(SMALL))  # just written: in the page cache
        assert got == data[SMALL : 2 * SMALL] and host.pool_calls == []
        _evict(tmp_path / "chunks")
        _, got = await replica.read(_small_read(SMALL))
        assert got == data[SMALL : 2 * SMALL] and host.pool_calls == ["read"]
        _, got = await replica.read(_small_read(SMALL))  # the pool's read brought the page in
        assert got == data[SMALL : 2 * SMALL] and host.pool_calls == ["read"]

    asyncio.run(main())


def test_with_nowait_off_a_cold_small_read_stays_on_the_loop(tmp_path: Path) -> None:
    """The placement before (kept as a switch for comparisons): every small read on the loop."""
    async def main() -> None:
        host = GatedHost("")
        host.gate.set()
        replica, _ = _file_replica(host, tmp_path / "chunks", small_read_nowait=False)
        data = os.urandom(CHUNK)
        await replica.update(_write(0, data), data)
        _evict(tmp_path / "chunks")
        host.pool_calls.clear()
        _, got = await replica.read(_small_read(0))
        assert got == data[:SMALL] and host.pool_calls == []

    asyncio.run(main())


@pytest.mark.parametrize("rewrite", ["replace", "patch"])
def test_a_cold_small_read_racing_a_commit_returns_the_new_bytes(tmp_path: Path, rewrite: str) -> None:
    """The cold read waits on the pool while a commit replaces the chunk's file (a new blob, the
    old one deleted) or patches it in place (the file renamed to the next blob): the read must not
    hand out the old bytes nor call the vanished file a disk error."""
    async def main() -> None:
        host = GatedHost("read")
        replica, engine = _file_replica(host, tmp_path / "chunks", small_read_polls=0)
        old = os.urandom(CHUNK)
        await replica.update(_write(0, old), old)
        _evict(tmp_path / "chunks")
        reading = asyncio.create_task(replica.read(_small_read(0)))
        await _spin()
        assert host.held == 1 and not reading.done()  # cold: on the pool
        if rewrite == "replace":
            new = os.urandom(CHUNK)
            await replica.update(_write(0, new), new)
        else:
            patch = os.urandom(SMALL)
            await replica.update(_write(0, patch), patch)
            new = patch + old[SMALL:]
        state = engine.get(CID)
        assert state is not None and state.commit_version > 1 and not state.pending_version
        host.gate.set()
        rsp, data = await reading
        assert data == new[:SMALL] and rsp.version == state.commit_version

    asyncio.run(main())


class SlowCache(MemBlobStore):
    """Blobs whose reads miss the cache the first ``misses`` times (a readahead on its way)."""

    def __init__(self, misses: int) -> None:
        super().__init__()
        self.misses = misses
        self.probes = 0

    def read_cached(self, chunk_id: bytes, blob: int, offset: int, length: int) -> bytes | None:
        self.probes += 1
        if self.probes <= self.misses:
            return None
        return self.read(chunk_id, blob, offset, length)


def _slow_replica(host: GatedHost, misses: int, polls: int) -> tuple[TargetReplica, ChunkEngine, SlowCache]:
    store = SlowCache(misses)
    engine = ChunkEngine(MemKVStore(), store)
    return TargetReplica(1, engine, host, ReplicaConfig(small_read_polls=polls)), engine, store  # type: ignore[arg-type]


@pytest.mark.parametrize(("misses", "pool_calls"), [(3, []), (50, ["read"])])
def test_a_cold_small_read_polls_the_cache_then_goes_to_the_pool(misses: int, pool_calls: list[str]) -> None:
    async def main() -> None:
        host = GatedHost("")
        host.gate.set()
        replica, _, store = _slow_replica(host, misses, polls=8)
        data = os.urandom(CHUNK)
        await replica.update(_write(0, data), data)
        host.pool_calls.clear()
        _, got = await replica.read(_small_read(SMALL))
        assert got == data[SMALL : 2 * SMALL] and host.pool_calls == pool_calls
        assert store.probes == min(misses + 1, 9)

    asyncio.run(main())


def test_a_small_read_polling_while_a_commit_replaces_the_chunk_returns_the_new_bytes() -> None:
    async def main() -> None:
        host = GatedHost("")
        host.gate.set()
        replica, engine, store = _slow_replica(host, misses=1 << 30, polls=1000)
        old, new = os.urandom(CHUNK), os.urandom(CHUNK)
        await replica.update(_write(0, old), old)
        reading = asyncio.create_task(replica.read(_small_read(0)))
        await _spin()
        assert not reading.done() and store.probes > 1  # polling
        await replica.update(_write(0, new), new)
        store.misses = 0  # the new version is in the cache
        rsp, data = await reading
        state = engine.get(CID)
        assert state is not None and data == new[:SMALL] and rsp.version == state.commit_version

    asyncio.run(main())


def test_small_read_polls_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="small_read_polls"):
        ReplicaConfig(small_read_polls=-1).validate()
    ReplicaConfig(small_read_polls=0).validate()

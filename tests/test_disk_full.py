"""A full disk on a storage target: writes refused with NO_SPACE, reads served, writes back once
space returns — RocksDB's write-ahead log included (the chaos ``disk-full`` scenario, in seconds).

The root cause these reproduce: chunks of up to 128 KiB live in the target's RocksDB, so a full
disk is first a full write-ahead log. RocksDB that hits ENOSPC there refuses every later write
for good (its own recovery waits for a memtable's worth of free space, 64 MiB, which a small disk
never has), the error surfaced as IO_ERROR, and the target was marked failed until restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fs3.common.errors import FS3Error, IoError, NoSpace, StatusCode
from fs3.common.ids import chunk_id
from fs3.common.target_state import PublicState
from fs3.kv.store import RocksKVStore, WriteBatch
from tests.conftest import wait_until
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # in-process clusters

CHUNK = 64 * 1024


def _mount_tmpfs(path: Path, size_bytes: int) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "fs3-test", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


@contextlib.contextmanager
def small_disk(path: Path, size_bytes: int) -> Iterator[Path]:
    _mount_tmpfs(path, size_bytes)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill_file(path: Path) -> None:
    """Take every free byte of the file system (as another program would)."""
    with path.open("wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(64 * 1024))
            f.flush()


def _code(exc: BaseException) -> StatusCode | None:
    return getattr(exc, "code", None)


def test_rocksdb_out_of_space_refuses_writes_keeps_reads_and_reopens(tmp_path: Path) -> None:
    """RocksDB itself hits ENOSPC in its log (here with no headroom, the disk filled by another
    file): writes raise NoSpace, a log sync IoError, reads go on, and maintain() reopens the
    database once the space is back, with every write that succeeded still there."""
    with small_disk(tmp_path / "disk", 8 << 20) as disk:
        store = RocksKVStore(disk / "kv")
        try:
            for i in range(8):
                batch = WriteBatch()
                batch.put(b"k%03d" % i, bytes([i]) * 60_000)
                store.write(batch, sync=False)
            _fill_file(disk / "ballast")
            with pytest.raises(NoSpace):
                for i in range(8, 1000):
                    batch = WriteBatch()
                    batch.put(b"k%03d" % i, bytes([i % 256]) * 60_000)
                    store.write(batch, sync=False)
            assert store.space_error is not None
            with pytest.raises(NoSpace):  # refused before RocksDB sees it
                small = WriteBatch()
                small.delete(b"k000")
                store.write(small)
            with pytest.raises(IoError):  # what earlier unsynced writes got is uncertain: not NoSpace
                store.sync_wal()
            assert store.get(b"k003") == bytes([3]) * 60_000
            store.maintain()  # no room yet: nothing happens
            assert store.space_error is not None
            (disk / "ballast").unlink()
            store.maintain()
            assert store.space_error is None
            batch = WriteBatch()
            batch.put(b"after", b"space is back")
            store.write(batch)
            store.sync_wal()
            assert store.get(b"after") == b"space is back"
            assert all(store.get(b"k%03d" % i) == bytes([i]) * 60_000 for i in range(8))
        finally:
            store.close()


def test_headroom_keeps_rocksdb_from_running_out_and_compaction_gives_space_back(tmp_path: Path) -> None:
    """With headroom, RocksDB never sees ENOSPC: big batches stop at the headroom, small ones (the
    deletes that free space) at half of it, and after maintain() flushed the tombstones RocksDB
    compacts the deleted values away."""
    with small_disk(tmp_path / "disk", 16 << 20) as disk:
        store = RocksKVStore(disk / "kv", headroom_bytes=RocksKVStore.default_headroom(disk))
        try:
            written = 0
            with pytest.raises(NoSpace):
                for i in range(1000):
                    batch = WriteBatch()
                    batch.put(b"k%04d" % i, os.urandom(60_000))
                    store.write(batch, sync=False)
                    written += 1
            assert store.space_error is None  # refused by the guard, not by RocksDB
            assert store.free_bytes() >= store.headroom_bytes // 2
            for i in range(written):
                batch = WriteBatch()
                batch.delete(b"k%04d" % i)
                store.write(batch, sync=False)
            before = store.free_bytes()
            for _ in range(100):  # the flush is at once, the compaction of the tombstones follows
                store.maintain(low_space_bytes=16 << 20)
                if store.free_bytes() > before + 4 * 60_000 * written // 5:
                    break
                time.sleep(0.1)
            assert store.free_bytes() > before + 4 * 60_000 * written // 5, (before, store.free_bytes())
            batch = WriteBatch()
            batch.put(b"again", os.urandom(60_000))
            store.write(batch)
        finally:
            store.close()


async def _chain_and_nodes(cluster: InProcessCluster) -> tuple[int, list[int]]:
    chain = cluster.chain_ids[0]
    routing = await cluster.admin().routing()
    return chain, list(next(c for c in routing.chains if c.chain_id == chain).target_ids)


async def _state(cluster: InProcessCluster, target_id: int) -> int:
    return {t.target_id: t.public_state for t in (await cluster.admin().chains()).targets}[target_id]


def test_full_target_refuses_writes_serves_reads_and_takes_writes_when_space_returns(tmp_path: Path) -> None:
    """A chain whose tail-or-other target sits on a 12 MiB disk: chunk writes stop with NO_SPACE
    before RocksDB runs out (the target stays serving, nothing torn), reads and removals go on,
    and once removals have freed the space new writes succeed again."""
    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_fsync=True) as cluster:
            client = cluster.client(retry_total_ms=5_000)
            chain, _ = await _chain_and_nodes(cluster)
            small = 301
            cluster.nodes[small // 100].config.maintenance_interval_ms = 100
            keep = {chunk_id(1, i): bytes([i + 1]) * CHUNK for i in range(3)}
            for cid, data in keep.items():
                await client.write(chain, cid, 0, data, CHUNK)
            filled: list[bytes] = []
            with pytest.raises(FS3Error) as refused:
                for i in range(400):
                    cid = chunk_id(2, i)
                    await client.write(chain, cid, 0, os.urandom(CHUNK), CHUNK)  # incompressible
                    filled.append(cid)
            assert _code(refused.value) is StatusCode.NO_SPACE, refused.value
            assert len(filled) > 20
            engine = cluster.nodes[small // 100].engines[small]
            # Small overwrites inside a chunk (patches: committed in place, or stored anew when the
            # chunk is inline) are refused too once the disk is at its reserve — before anything
            # changed, never after the successors committed.
            expected = bytearray(keep[chunk_id(1, 0)])
            patch_refused: FS3Error | None = None
            for i in range(200):
                patch = os.urandom(4096)
                try:
                    await client.write(chain, chunk_id(1, 0), 4096 * (i % 8), patch, CHUNK)
                except FS3Error as exc:
                    patch_refused = exc
                    break
                expected[4096 * (i % 8) : 4096 * (i % 8 + 1)] = patch
            assert patch_refused is not None and _code(patch_refused) is StatusCode.NO_SPACE, patch_refused
            keep[chunk_id(1, 0)] = bytes(expected)
            assert await _state(cluster, small) == PublicState.SERVING
            assert not cluster.nodes[small // 100].failed_targets
            for node in cluster.nodes.values():
                for tid, eng in node.engines.items():
                    assert not eng.pending_chunks(), f"target {tid} kept a pending version"
            for _ in range(3):  # reads rotate over the replicas, the full one included
                for cid, data in keep.items():
                    assert (await client.read(chain, cid, 0, CHUNK))[0] == data
            assert (await cluster.admin().verify()).ok
            # Space returns: removals go through on the full target, compaction frees their bytes.
            for cid in filled:
                await client.remove(chain, cid, CHUNK)

            async def writable() -> bool:
                try:
                    await client.write(chain, chunk_id(3, 0), 0, os.urandom(CHUNK), CHUNK)
                    await client.write(chain, chunk_id(1, 0), 4096, b"p" * 4096, CHUNK)
                    return True
                except FS3Error as exc:
                    assert _code(exc) is StatusCode.NO_SPACE, exc
                    return False

            await wait_until(writable, timeout_s=20, interval_s=0.3, what="writes accepted again")

            async def space_back() -> bool:
                return engine.files.free_bytes() > engine.reserve_bytes + len(filled) * CHUNK // 2

            await wait_until(space_back, timeout_s=20, interval_s=0.3, what="most of the removed chunks' space back")
            assert (await client.read(chain, chunk_id(1, 0), 4096, 4096))[0] == b"p" * 4096
            assert await _state(cluster, small) == PublicState.SERVING
            assert (await cluster.admin().verify()).ok

    with small_disk(tmp_path / "n3" / "t1", 12 << 20):
        asyncio.run(body())


def test_target_out_of_space_with_uncertain_writes_comes_back_by_itself(tmp_path: Path) -> None:
    """When RocksDB itself ran out (another program filled the disk) and a log sync failed, the
    target leaves its chain like a failed disk — but only until the space is back: then it reopens
    its database, resyncs and serves again, without a restart."""
    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_fsync=True) as cluster:
            client = cluster.client(retry_total_ms=10_000)
            chain, _ = await _chain_and_nodes(cluster)
            small = 301
            node = cluster.nodes[small // 100]
            node.config.maintenance_interval_ms = 100
            engine = node.engines[small]
            kv = engine.kv
            assert isinstance(kv, RocksKVStore)
            for i in range(4):
                await client.write(chain, chunk_id(5, i), 0, bytes([i + 1]) * CHUNK, CHUNK)
            # Something else takes the disk; the target's own guards are off so that RocksDB itself
            # hits ENOSPC (as on main, or when the disk fills between a check and the write).
            kv.headroom_bytes, engine.reserve_bytes = 0, -(1 << 40)
            ballast = tmp_path / "n3" / "t1" / "ballast"
            _fill_file(ballast)
            with pytest.raises(FS3Error) as refused:
                for i in range(50):
                    await client.write(chain, chunk_id(6, i), 0, os.urandom(CHUNK), CHUNK)
            assert _code(refused.value) is StatusCode.NO_SPACE
            assert kv.space_error is not None
            # A commit's group log sync fails now (the log writer keeps RocksDB's error): the
            # outcome of the writes it covered is uncertain, so the target goes offline ...
            with pytest.raises(IoError) as sync_failed:
                kv.sync_wal()
            node.fail_target(small, sync_failed.value)
            await wait_until(lambda: _not_serving(cluster, small), what="the target leaves its chain")
            for i in range(4):  # the chain goes on without it
                await client.write(chain, chunk_id(5, i), 0, bytes([i + 11]) * CHUNK, CHUNK)
            # ... and comes back by itself once the space is back.
            ballast.unlink()
            await wait_until(cluster.all_serving, timeout_s=30, what="the target serving again")
            assert kv.space_error is None and not node.failed_targets
            for i in range(4):
                for _ in range(3):
                    assert (await client.read(chain, chunk_id(5, i), 0, CHUNK))[0] == bytes([i + 11]) * CHUNK
            await client.write(chain, chunk_id(6, 0), 0, b"x" * CHUNK, CHUNK)
            report = await cluster.admin().verify()
            assert report.ok, report.as_dict()

    with small_disk(tmp_path / "n3" / "t1", 12 << 20):
        asyncio.run(body())


async def _not_serving(cluster: InProcessCluster, target_id: int) -> bool:
    return await _state(cluster, target_id) != PublicState.SERVING


def test_rocksdb_enospc_is_no_space_not_a_failed_disk(tmp_path: Path) -> None:
    """Without root (no small disk to mount): the ENOSPC RocksDB reports for a write is injected.
    The target answers NO_SPACE and stays in its chain; writes work again after maintain()."""
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            client = cluster.client(retry_total_ms=5_000)
            chain, targets = await _chain_and_nodes(cluster)
            victim = targets[-1]
            node = cluster.nodes[victim // 100]
            kv = node.engines[victim].kv
            assert isinstance(kv, RocksKVStore)
            await client.write(chain, chunk_id(8, 0), 0, b"a" * CHUNK, CHUNK)
            real_db = kv._db
            log_dir = kv._path

            class FullDisk:
                def __getattr__(self, name: str) -> object:
                    return getattr(real_db, name)

                def write(self, *_args: object) -> None:
                    raise Exception(f"IO error: No space left on device: While appending to file: "
                                    f"{log_dir}/000004.log: No space left on device")

            kv._db = FullDisk()
            with pytest.raises(FS3Error) as refused:
                await client.write(chain, chunk_id(8, 1), 0, b"b" * CHUNK, CHUNK)
            assert _code(refused.value) is StatusCode.NO_SPACE
            assert kv.space_error is not None and victim not in node.failed_targets
            for _ in range(3):
                assert (await client.read(chain, chunk_id(8, 0), 0, CHUNK))[0] == b"a" * CHUNK
            kv._db = real_db
            await asyncio.get_running_loop().run_in_executor(None, kv.maintain)
            assert kv.space_error is None
            await client.write(chain, chunk_id(8, 1), 0, b"b" * CHUNK, CHUNK)
            assert (await client.read(chain, chunk_id(8, 1), 0, CHUNK))[0] == b"b" * CHUNK
            assert await _state(cluster, victim) == PublicState.SERVING
            assert (await cluster.admin().verify()).ok

    asyncio.run(body())

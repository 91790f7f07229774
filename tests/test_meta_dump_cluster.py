"""Dump and restore of a running cluster's metadata (an in-process cluster, meta on RocksDB).

A namespace of every kind of inode is dumped, changed (a file's name reused by a new file),
restored into a new, empty store; the restored cluster passes fsck, serves the dumped files byte
for byte and shows the dumped file under the reused name. A dump taken while a task creates,
renames and removes files is one consistent namespace.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

import fs3.aio
from fs3 import meta_pb2 as mpb
from fs3.client.fs import AsyncFileSystem
from fs3.kv.api import SnapshotReader
from fs3.kv.store import RocksKVStore
from fs3.kv.txn import OptimisticTxnEngine
from fs3.meta import schema
from fs3.meta.backup import INODE_ID_GAP, dump_to_file, load_dump
from fs3.meta.dump import DumpReader
from fs3.meta.service import MetaServiceConfig
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # in-process clusters

CHUNK = 64 << 10


async def _connect(cluster: InProcessCluster) -> AsyncFileSystem:
    return await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)


class SlowReader:
    """A snapshot whose every page waits a little: other tasks commit between the pages."""

    def __init__(self, inner: SnapshotReader) -> None:
        self.inner = inner

    async def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        await asyncio.sleep(0.005)
        return await self.inner.scan(start, end, limit)

    async def close(self) -> None:
        await self.inner.close()


async def _dump(cluster: InProcessCluster, path: Path, page_records: int = 1000) -> None:
    assert cluster.meta_engine is not None
    await dump_to_file(SlowReader(await cluster.meta_engine.snapshot()), path, "test", page_records)


async def _restore(cluster: InProcessCluster, path: Path, store_dir: Path) -> None:
    """Stop meta, load the dump into a new RocksDB store, start meta on it."""
    await cluster.stop_meta()
    fresh = RocksKVStore(store_dir)
    await load_dump(OptimisticTxnEngine(fresh), path, batch_records=7)
    cluster.meta_kv = fresh  # type: ignore[assignment]
    await cluster.start_meta()


def _records(path: Path) -> list[tuple[str, bytes, bytes]]:
    with open(path, "rb") as f:
        return list(DumpReader().records(f))


def test_restore_serves_the_dumped_namespace(tmp_path: Path) -> None:
    rng = random.Random(24)
    files = {"/d/a": rng.randbytes(3 * CHUNK + 17), "/d/sub/b": rng.randbytes(100), "/d/empty": b"",
             "/reused": rng.randbytes(CHUNK + 5)}
    removed = rng.randbytes(CHUNK + 9)

    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777)
        async with InProcessCluster(tmp_path / "c", targets_per_node=2, with_meta=True, meta_config=config,
                                    meta_kv=RocksKVStore(tmp_path / "meta1")) as cluster:  # type: ignore[arg-type]
            fs = await _connect(cluster)
            await fs.makedirs("/d/sub")
            await fs.set_layout("/d", chunk_size=CHUNK, stripe=2)
            for path, data in files.items():
                await fs.write_bytes(path, data)
            await fs.symlink("a", "/d/link")
            await fs.link("/d/a", "/d/sub/hard")
            await fs.setxattr("/d/a", "user.tag", b"\x00\xffvalue")
            await fs.chmod("/d/sub/b", 0o640)
            await fs.write_bytes("/gone", removed)
            reused_ino = (await fs.stat("/reused")).st_ino
            gone_ino = (await fs.stat("/gone")).st_ino
            dump = tmp_path / "meta.dump"
            await _dump(cluster, dump, page_records=3)
            # After the dump, both names are reused by new files (new inodes, new chunks): /reused's
            # file was renamed away (its chunks stay), /gone's removed (GC removes its chunks).
            await fs.rename("/reused", "/moved-away")
            await fs.write_bytes("/reused", rng.randbytes(2 * CHUNK))
            await fs.remove("/gone")
            await fs.write_bytes("/gone", rng.randbytes(CHUNK))
            later_inos = {(await fs.stat(p)).st_ino for p in ("/reused", "/gone")}
            assert cluster.meta is not None
            while await cluster.meta.run_gc_once() > 0:
                pass
            await fs.close()

            await _restore(cluster, dump, tmp_path / "meta2")
            fs = await _connect(cluster)
            try:
                for path, data in files.items():
                    assert await fs.read_bytes(path) == data, path
                assert (await fs.stat("/reused")).st_ino == reused_ino  # the dumped file, not the later one
                assert not await fs.exists("/moved-away")
                # The removed file's metadata is back, but GC removed its chunks: it reads as a hole.
                assert (await fs.stat("/gone")).st_ino == gone_ino
                assert await fs.read_bytes("/gone") == bytes(len(removed))
                assert await fs.readlink("/d/link") == "a"
                assert await fs.read_bytes("/d/link") == files["/d/a"]
                assert (await fs.stat("/d/sub/hard")).st_ino == (await fs.stat("/d/a")).st_ino
                assert (await fs.stat("/d/a")).st_nlink == 2
                assert await fs.getxattr("/d/a", "user.tag") == b"\x00\xffvalue"
                assert (await fs.stat("/d/sub/b")).st_mode & 0o7777 == 0o640
                report = await fs.fsck(True)
                # The later file's chunks have no inode in the restored namespace: fsck names them
                # as orphans, and nothing else.
                orphans = {int(p.split("of inode ")[1].split()[0]) for p in report.problems if "(orphan)" in p}
                assert orphans == later_inos and all("(orphan)" in p for p in report.problems), list(report.problems)
                # A new file never gets an id the old cluster may have handed out after the dump.
                await fs.write_bytes("/new", b"fresh")
                assert (await fs.stat("/new")).st_ino > max(later_inos) + INODE_ID_GAP // 2
                assert await fs.read_bytes("/new") == b"fresh"
            finally:
                await fs.close()

    asyncio.run(main())


async def _churn(fs: AsyncFileSystem, stop: asyncio.Event, rng: random.Random, done: list[int]) -> int:
    """Creates, renames and removes files (and directories) until ``stop``; returns its steps
    (``done[0]``: the steps so far)."""
    steps = 0
    live: list[str] = []
    while not stop.is_set():
        choice = rng.random()
        if choice < 0.45 or len(live) < 3:
            path = f"/churn/f{steps}"
            await fs.write_bytes(path, rng.randbytes(rng.randrange(1, 300)))
            live.append(path)
        elif choice < 0.6:
            path = f"/churn/d{steps}"
            await fs.mkdir(path)
            await fs.rename(live.pop(rng.randrange(len(live))), f"{path}/moved")
            live.append(f"{path}/moved")
        elif choice < 0.8:
            old = live.pop(rng.randrange(len(live)))
            new = f"/churn/r{steps}"
            await fs.rename(old, new)
            live.append(new)
        else:
            await fs.remove(live.pop(rng.randrange(len(live))))
        steps += 1
        done[0] = steps
    return steps


def test_dump_under_concurrent_changes_is_consistent(tmp_path: Path) -> None:
    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777)
        async with InProcessCluster(tmp_path / "c", targets_per_node=2, with_meta=True, meta_config=config,
                                    meta_kv=RocksKVStore(tmp_path / "meta1")) as cluster:  # type: ignore[arg-type]
            fs = await _connect(cluster)
            await fs.mkdir("/churn")
            stop = asyncio.Event()
            done = [0]
            task = asyncio.create_task(_churn(fs, stop, random.Random(7), done))
            dump = tmp_path / "meta.dump"
            try:
                while len(await fs.listdir("/churn")) < 20:
                    await asyncio.sleep(0.01)
                before = done[0]
                await _dump(cluster, dump, page_records=4)
                assert done[0] > before + 3, "the churn should commit while the dump pages"
                await asyncio.sleep(0.2)
            finally:
                stop.set()
                steps = await task
            assert steps > 20
            records = _records(dump)
            inodes = {schema.parse_inode_key(k): mpb.Inode.FromString(v) for kind, k, v in records if kind == "inode"}
            names: dict[int, int] = {}
            for kind, key, value in records:
                if kind == "dentry":
                    parent, _ = schema.parse_dentry_key(key)
                    entry = mpb.DirEntry.FromString(value)
                    assert parent in inodes and entry.inode_id in inodes, "an entry of an inode not in the dump"
                    names[entry.inode_id] = names.get(entry.inode_id, 0) + 1
            for inode_id, inode in inodes.items():
                if inode.type == mpb.FILE:
                    assert inode.nlink == names.get(inode_id, 0), inode_id
            await fs.close()
            await _restore(cluster, dump, tmp_path / "meta2")
            fs = await _connect(cluster)
            try:
                report = await fs.fsck(False)
                assert list(report.problems) == [] and report.inodes == len(inodes)
            finally:
                await fs.close()

    asyncio.run(main())



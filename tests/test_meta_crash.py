"""Crash tests with real processes: SIGKILL meta during namespace changes, a storage node during a big write.

Every acknowledged operation must survive, the namespace must check clean with fsck, and a file
written through a storage-node crash must read back byte-exact.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import fs3.aio
from fs3.client.fs import AsyncFileSystem
from tests.harness import ProcessCluster

pytestmark = pytest.mark.slow


def _content(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (1 + i % 5)


def _run_on_cluster(tmp_path: Path, body: Callable[[ProcessCluster, AsyncFileSystem], Awaitable[None]]) -> None:
    """A 3-node, 3-replica cluster of real processes and one client with a long retry budget."""
    cluster = ProcessCluster(tmp_path / "c", storage_nodes=3, targets_per_node=1, token="t")

    async def main() -> None:
        fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token, retry_total_ms=60_000)
        try:
            await body(cluster, fs)
        finally:
            await fs.close()

    try:
        cluster.start_all()
        asyncio.run(cluster.ensure_chains(3))
        asyncio.run(main())
    finally:
        cluster.stop_all()


def test_sigkill_meta_during_creates_and_renames(tmp_path: Path) -> None:
    _run_on_cluster(tmp_path, _meta_crash)


async def _meta_crash(cluster: ProcessCluster, fs: AsyncFileSystem) -> None:
    await fs.mkdir("/s")
    expected: dict[str, bytes] = {}
    kill_at = 40
    restart: asyncio.Future[None] | None = None
    for i in range(120):
        if i == kill_at:
            cluster.kill("meta")
            # Back a moment later; meanwhile requests fail over to retries with the same ids.
            restart = asyncio.get_running_loop().run_in_executor(None, cluster.start, "meta")
        await fs.write_bytes(f"/s/f{i}", _content(i))  # create + write + close
        expected[f"f{i}"] = _content(i)
        if i % 3 == 0:
            await fs.rename(f"/s/f{i}", f"/s/r{i}")
            expected[f"r{i}"] = expected.pop(f"f{i}")
        if i % 7 == 0 and i:
            victim = sorted(expected)[0]
            await fs.remove(f"/s/{victim}")
            del expected[victim]
    assert restart is not None
    await restart
    # A second crash with nothing in flight: everything acknowledged is on disk.
    cluster.kill("meta")
    cluster.start("meta")
    assert sorted(await fs.listdir("/s")) == sorted(expected)
    for name, data in expected.items():
        assert await fs.read_bytes(f"/s/{name}") == data, name
    assert list((await fs.fsck()).problems) == []


def test_sigkill_storage_node_during_a_large_write(tmp_path: Path) -> None:
    _run_on_cluster(tmp_path, _storage_crash)


async def _storage_crash(cluster: ProcessCluster, fs: AsyncFileSystem) -> None:
    await fs.mkdir("/big")
    await fs.set_layout("/big", chunk_size=1 << 20)
    data = os.urandom(48 << 20)
    piece = 1 << 20
    async with await fs.open("/big/file", "wb") as f:
        for offset in range(0, len(data), piece):
            if offset == 12 * piece:
                cluster.kill("storage-2")
            if offset == 36 * piece:
                await asyncio.get_running_loop().run_in_executor(None, cluster.start, "storage-2")
            await f.write(data[offset:offset + piece])
    assert (await fs.stat("/big/file")).st_size == len(data)
    assert await fs.read_bytes("/big/file") == data
    assert list((await fs.fsck()).problems) == []

"""Crash tests with real processes: SIGKILL meta during namespace changes, a storage node during a big write.

Every acknowledged operation must survive, the namespace must check clean with fsck, and a file
written through a storage-node crash must read back byte-exact.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

import fs3.aio
from tests.harness import ProcessCluster

pytestmark = pytest.mark.slow


def _content(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (1 + i % 5)


def test_sigkill_meta_during_creates_and_renames(tmp_path: Path) -> None:
    cluster = ProcessCluster(tmp_path / "c", storage_nodes=3, targets_per_node=1, token="t")
    try:
        cluster.start_all()
        asyncio.run(cluster.ensure_chains(3))
        asyncio.run(_meta_crash(cluster))
    finally:
        cluster.stop_all()


async def _meta_crash(cluster: ProcessCluster) -> None:
    fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token, retry_total_ms=60_000)
    try:
        await fs.mkdir("/s")
        expected: dict[str, bytes] = {}
        kill_at, restarted = 40, False
        for i in range(120):
            if i == kill_at:
                cluster.kill("meta")
                restart = asyncio.get_running_loop().run_in_executor(None, cluster.start, "meta")
            if i == kill_at + 5:
                await restart
                restarted = True
            await fs.write_bytes(f"/s/f{i}", _content(i))  # create + write + close
            expected[f"f{i}"] = _content(i)
            if i % 3 == 0:
                await fs.rename(f"/s/f{i}", f"/s/r{i}")
                expected[f"r{i}"] = expected.pop(f"f{i}")
            if i % 7 == 0 and i:
                victim = next(iter(sorted(expected)))
                await fs.remove(f"/s/{victim}")
                del expected[victim]
        assert restarted
        # A second crash with nothing in flight: everything acknowledged is on disk.
        cluster.kill("meta")
        cluster.start("meta")
        assert sorted(await fs.listdir("/s")) == sorted(expected)
        for name, data in expected.items():
            assert await fs.read_bytes(f"/s/{name}") == data, name
        report = await fs.fsck()
        assert list(report.problems) == []
    finally:
        await fs.close()


def test_sigkill_storage_node_during_a_large_write(tmp_path: Path) -> None:
    cluster = ProcessCluster(tmp_path / "c", storage_nodes=3, targets_per_node=1, token="t")
    try:
        cluster.start_all()
        asyncio.run(cluster.ensure_chains(3))
        asyncio.run(_storage_crash(cluster))
    finally:
        cluster.stop_all()


async def _storage_crash(cluster: ProcessCluster) -> None:
    fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token, retry_total_ms=60_000)
    try:
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
        back = await fs.read_bytes("/big/file")
        assert back == data
        assert list((await fs.fsck()).problems) == []
    finally:
        await fs.close()

"""The trash on an in-process cluster: bytes come back on restore, chunks stay on storage while a
file is in the trash and go once it is purged or expired, and ``fs3 trash`` drives it."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

import fs3.aio
from fs3.cli.trash import trash_command
from fs3.client.fs import AsyncFileSystem
from fs3.client.meta import path_ref
from fs3.common.errors import AlreadyExists, NotPermitted
from fs3.common.ids import parse_chunk_id
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.meta.trash import NS_PER_DAY
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # an in-process cluster

CHUNK = 65536


def chunks_of(cluster: InProcessCluster, inode_id: int) -> set[int]:
    """Indexes of the inode's chunks on any storage target."""
    found: set[int] = set()
    for node in cluster.nodes.values():
        for engine in node.engines.values():
            found.update(parse_chunk_id(cid)[1] for cid in engine.states() if parse_chunk_id(cid)[0] == inode_id)
    return found


async def gc_all(meta: MetaService) -> None:
    while await meta.run_gc_once() > 0:
        pass


def args(command: str, **more: Any) -> argparse.Namespace:
    return argparse.Namespace(trash_command=command, json=True, **more)


def test_trash_keeps_chunks_until_purge_or_expiry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wall = [time.time_ns()]

    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777, prune_interval_ms=600_000, gc_interval_ms=600_000, trash_days=1)
        async with InProcessCluster(tmp_path, targets_per_node=3, with_meta=True, meta_config=config,
                                    meta_wall_ns=lambda: wall[0]) as cluster:
            meta = cluster.meta
            assert meta is not None
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            try:
                await body(cluster, meta, fs)
            finally:
                await fs.close()

    async def body(cluster: InProcessCluster, meta: MetaService, fs: AsyncFileSystem) -> None:
        await fs.makedirs("/t")
        await fs.set_layout("/t", chunk_size=CHUNK, stripe=3)
        data = os.urandom(3 * CHUNK + 123)
        await fs.write_bytes("/t/f", data)
        inode_id = (await fs.stat("/t/f")).st_ino
        await fs.remove("/t/f")
        await gc_all(meta)
        assert chunks_of(cluster, inode_id) == {0, 1, 2, 3}, "GC freed a trashed file's chunks"
        assert await fs.listdir("/t") == [] and await fs.listdir("/") == ["t"]
        assert list((await fs.metadata.fsck(True)).problems) == []

        capsys.readouterr()
        assert await trash_command(fs.metadata, args("list")) == 0
        [listed] = json.loads(capsys.readouterr().out)
        assert (listed["id"], listed["path"], listed["size"]) == (inode_id, "/t/f", len(data))

        await fs.write_bytes("/t/f", b"new")  # the name is taken again
        with pytest.raises(AlreadyExists):
            await trash_command(fs.metadata, args("restore", id=inode_id, to=None))
        assert await trash_command(fs.metadata, args("restore", id=inode_id, to="/t/f.restored")) == 0
        assert await fs.read_bytes("/t/f.restored") == data
        assert await fs.read_bytes("/t/f") == b"new"

        # Purged by hand: GC frees the chunks.
        await fs.remove("/t/f.restored")
        assert await trash_command(fs.metadata, args("purge", id=inode_id, all=False, expired=False)) == 0
        await gc_all(meta)
        assert chunks_of(cluster, inode_id) == set()

        # Expired: the background job purges, then GC frees the chunks.
        other = (await fs.stat("/t/f")).st_ino
        await fs.remove("/t/f")
        assert await meta.run_trash_expiry_once() == 0
        await gc_all(meta)
        assert chunks_of(cluster, other) == {0}
        wall[0] += NS_PER_DAY + 1
        assert await meta.run_trash_expiry_once() == 1
        await gc_all(meta)
        assert chunks_of(cluster, other) == set()
        assert list((await fs.metadata.fsck(True)).problems) == []

    asyncio.run(main())


def test_user_tokens_see_and_touch_only_their_own_entries(tmp_path: Path) -> None:
    """Through the identity gate: a user token's requests run as its uid, so bob neither sees nor
    restores nor purges what alice removed; alice restores it, root (cluster token) sees all."""
    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777, trash_days=1)
        async with InProcessCluster(tmp_path, targets_per_node=1, with_meta=True, meta_config=config) as cluster:
            root = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token, uid=0, gid=0, groups=[])
            try:
                alice_token = (await root.metadata.add_user("alice", 1000, 1000)).token
                bob_token = (await root.metadata.add_user("bob", 2000, 2000)).token
                alice = await fs3.aio.connect(cluster.mgmtd_address, token=alice_token)
                bob = await fs3.aio.connect(cluster.mgmtd_address, token=bob_token)
                try:
                    await alice.write_bytes("/a", b"alice's")
                    inode_id = (await alice.stat("/a")).st_ino
                    await alice.remove("/a")
                    assert [e.id for e in (await alice.metadata.trash_list()).entries] == [inode_id]
                    assert list((await bob.metadata.trash_list()).entries) == []
                    with pytest.raises(NotPermitted):
                        await bob.metadata.trash_restore(inode_id, path_ref(b"/mine"))
                    with pytest.raises(NotPermitted):
                        await bob.metadata.trash_purge(inode_id)
                    assert (await bob.metadata.trash_purge(all_entries=True)).purged == 0
                    assert [e.uid for e in (await root.metadata.trash_list()).entries] == [1000]
                    await alice.metadata.trash_restore(inode_id)
                    assert await alice.read_bytes("/a") == b"alice's"
                finally:
                    await alice.close()
                    await bob.close()
            finally:
                await root.close()

    asyncio.run(main())


def test_two_meta_servers_expire_each_entry_once(tmp_path: Path) -> None:
    """Both servers run the expiry at once on one store: one holds the trash's claim, or their
    purges conflict and run again; either way every entry is purged once and GC frees it."""
    wall = [time.time_ns()]

    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777, prune_interval_ms=600_000, gc_interval_ms=600_000,
                                   trash_days=0.01)
        async with InProcessCluster(tmp_path, targets_per_node=1, with_meta=True, meta_config=config, meta_servers=2,
                                    meta_wall_ns=lambda: wall[0]) as cluster:
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            try:
                ids = []
                for i in range(40):
                    await fs.write_bytes(f"/f{i}", b"x" * 100)
                    ids.append((await fs.stat(f"/f{i}")).st_ino)
                    await fs.remove(f"/f{i}")
                wall[0] += NS_PER_DAY
                first, second = cluster.metas[0], cluster.metas[1]
                counts: list[int] = []
                for _ in range(2):
                    counts += await asyncio.gather(first.run_trash_expiry_once(), second.run_trash_expiry_once())
                assert sum(counts) == len(ids), counts
                assert list((await fs.metadata.trash_list()).entries) == []
                await gc_all(first)
                assert all(chunks_of(cluster, i) == set() for i in ids)
                assert list((await fs.metadata.fsck(True)).problems) == []
            finally:
                await fs.close()

    asyncio.run(main())

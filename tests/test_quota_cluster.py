"""Quotas through the client on an in-process cluster: EDQUOT as ``OSError`` from creates, fsync
and truncate, a quota'd directory's size in ``statvfs``, and ``fs3 quota`` driving it."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
from pathlib import Path
from typing import Any

import pytest

import fs3.aio
from fs3.cli.quota import quota_command
from fs3.client.fs import AsyncFileSystem
from fs3.client.meta import path_ref
from fs3.meta.service import MetaServiceConfig
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # an in-process cluster


def args(command: str, **more: Any) -> argparse.Namespace:
    return argparse.Namespace(quota_command=command, json=True, **more)


def test_quotas_through_the_client_and_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777, prune_interval_ms=600_000, gc_interval_ms=600_000)
        async with InProcessCluster(tmp_path, targets_per_node=3, with_meta=True, meta_config=config) as cluster:
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            try:
                await body(fs)
            finally:
                await fs.close()

    async def body(fs: AsyncFileSystem) -> None:
        await fs.makedirs("/q/sub")
        await fs.write_bytes("/q/old", b"x" * 1000)
        capsys.readouterr()
        assert await quota_command(fs.metadata, args("set", path="/q", bytes=4096, inodes=5)) == 0
        shown = json.loads(capsys.readouterr().out)
        assert (shown["bytes_used"], shown["inodes_used"]) == (1000, 2)  # the existing tree, counted

        # Bytes: an fsync that would publish past the limit is refused, as is a truncate up.
        f = await fs.open("/q/big", "wb")
        await f.write(b"y" * 3000)
        await f.fsync()
        await f.write(b"z" * 200)
        with pytest.raises(OSError) as refused:
            await f.fsync()
        assert refused.value.errno == errno.EDQUOT
        await f.close()  # a close is never refused (its bytes are on storage): the tree is over
        assert (await fs.metadata.quota_get(path_ref(b"/q"))).bytes_used == 4200
        await fs.truncate("/q/big", 3000)  # shrinking is always allowed
        with pytest.raises(OSError) as refused:
            await fs.truncate("/q/old", 2000)
        assert refused.value.errno == errno.EDQUOT
        assert (await fs.metadata.quota_get(path_ref(b"/q"))).bytes_used == 4000

        # Inodes: two more fit, the sixth entry does not.
        await fs.mkdir("/q/sub/a")
        await fs.write_bytes("/q/sub/b", b"")
        with pytest.raises(OSError) as refused:
            await fs.write_bytes("/q/sub/c", b"")
        assert refused.value.errno == errno.EDQUOT

        # df inside the quota'd tree shows the quota.
        stats = await fs.statvfs("/q/sub")
        assert (stats.f_blocks, stats.f_bfree) == (4096 // 4096, (4096 - 4000) // 4096)
        assert (stats.f_files, stats.f_ffree) == (5, 0)

        assert await quota_command(fs.metadata, args("check", repair=False)) == 0
        assert json.loads(capsys.readouterr().out)["problems"] == []
        assert list((await fs.metadata.fsck(True)).problems) == []
        assert await quota_command(fs.metadata, args("unset", path="/q")) == 0
        await fs.write_bytes("/q/sub/c", b"free again")
        capsys.readouterr()
        assert await quota_command(fs.metadata, args("list")) == 0
        assert json.loads(capsys.readouterr().out) == []

    asyncio.run(main())


def test_two_clients_racing_for_the_last_bytes_never_pass_the_limit(tmp_path: Path) -> None:
    """Two client connections append and fsync at once under one quota: what fsync acknowledged
    adds up to at most the limit, and meta's usage is exactly the files' lengths (a close is
    charged what its refused fsync left on storage: the documented overshoot)."""
    limit = 64 * 1024

    async def main() -> None:
        async with InProcessCluster(tmp_path, targets_per_node=3, with_meta=True,
                                    meta_config=MetaServiceConfig(root_mode=0o777)) as cluster:
            one = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            two = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            try:
                await one.makedirs("/q")
                await one.metadata.quota_set(path_ref(b"/q"), bytes_limit=limit)
                acked = await asyncio.gather(writer(one, "/q/one", 3000), writer(two, "/q/two", 1700))
                assert sum(acked) <= limit
                assert sum(acked) > limit - 2 * 3000  # both kept going until the quota was full
                used = (await one.metadata.quota_get(path_ref(b"/q"))).bytes_used
                sizes = [(await one.stat(p)).st_size for p in ("/q/one", "/q/two")]
                assert used == sum(sizes)
                assert list((await one.metadata.fsck(True)).problems) == []
            finally:
                await one.close()
                await two.close()

    async def writer(fs: AsyncFileSystem, path: str, step: int) -> int:
        f = await fs.open(path, "wb")
        size = 0
        try:
            for _ in range(40):
                await f.write(b"w" * step)
                try:
                    await f.fsync()
                except OSError as exc:
                    assert exc.errno == errno.EDQUOT
                    break
                size += step
        finally:
            await f.close()
        return size

    asyncio.run(main())

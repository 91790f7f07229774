"""Quotas through the client on an in-process cluster: EDQUOT as ``OSError`` from creates, fsync
and truncate, a quota'd directory's size in ``statvfs``, and ``fs3 quota`` driving it."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

import fs3.aio
from fs3.cli.quota import quota_command
from fs3.client.fs import AsyncFileSystem
from fs3.client.meta import Meta, path_ref
from fs3.common.errors import UnknownMethod
from fs3.meta import quota
from fs3.meta.service import MetaServiceConfig
from tests.inproc import InProcessCluster
from tests.test_meta_leases import Lapsing, with_lapsing

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

        # Bytes: a write past what the quota has room for is refused before it reaches storage
        # (the handle's byte credit), as is a truncate up.
        f = await fs.open("/q/big", "wb")
        await f.write(b"y" * 3000)
        await f.fsync()
        with pytest.raises(OSError) as refused:
            await f.write(b"z" * 200)
        assert refused.value.errno == errno.EDQUOT
        await f.close()
        assert (await fs.metadata.quota_get(path_ref(b"/q"))).bytes_used == 4000
        assert (await fs.stat("/q/big")).st_size == 3000
        await fs.truncate("/q/big", 3000)  # shrinking (or staying) is always allowed
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

        # No quota anywhere: a handle is told so at its open and never asks for a byte credit. A
        # quota set later then refuses its fsync; its ftruncate still works (its refused length
        # is left to the close, the truncate clears storage past the new size).
        await fs.makedirs("/late")
        f = await fs.open("/late/f", "wb")
        await fs.metadata.quota_set(path_ref(b"/late"), bytes_limit=1000)
        await f.write(b"b" * 2000)
        with pytest.raises(OSError) as refused:
            await f.fsync()
        assert refused.value.errno == errno.EDQUOT
        await f.truncate(500)
        await f.close()
        assert (await fs.stat("/late/f")).st_size == 500
        assert (await fs.metadata.quota_get(path_ref(b"/late"))).bytes_used == 500
        assert list((await fs.metadata.fsck(True)).problems) == []

        # A credit is bytes past the file's length: after a truncate down, the handle asks again
        # before writing past the new length, so what it wrote stays accounted.
        await fs.makedirs("/t")
        await fs.metadata.quota_set(path_ref(b"/t"), bytes_limit=10_000)
        async with await fs.open("/t/f", "wb") as t:
            await t.write(b"d" * 4000)
            await t.truncate(0)
            await t.pwrite(0, b"e" * 5000)
            assert (await fs.metadata.quota_get(path_ref(b"/t"))).bytes_used >= 5000
        assert (await fs.metadata.quota_get(path_ref(b"/t"))).bytes_used == 5000

        # A file no quota counts, moved under one while open for writing: its handle's credit,
        # charged nowhere until then, is charged there; past it the handle asks again, refused.
        await fs.makedirs("/m")
        await fs.metadata.quota_set(path_ref(b"/m"), bytes_limit=8000)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(quota, "RESERVE_STEP_BYTES", 4096)
            async with await fs.open("/moving", "wb") as moving:
                await moving.write(b"m" * 100)
                await fs.rename("/moving", "/m/f")
                await moving.write(b"m" * 5000)
                with pytest.raises(OSError) as refused:
                    await moving.write(b"m" * 4000)
                assert refused.value.errno == errno.EDQUOT
        assert (await fs.metadata.quota_get(path_ref(b"/m"))).bytes_used == 5100

        # A meta older than byte credits (a rolling upgrade) does not know QuotaReserve: the client
        # writes on and the bytes are charged at the close, as before credits.
        async def unknown(*_: Any, **__: Any) -> None:
            raise UnknownMethod("no method QuotaReserve")

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Meta, "quota_reserve", unknown)
            async with await fs.open("/late/g", "wb") as g:
                await g.write(b"c" * 700)
        assert (await fs.metadata.quota_get(path_ref(b"/late"))).bytes_used == 1200

    asyncio.run(main())


def test_two_clients_writing_at_once_never_pass_the_limit(tmp_path: Path) -> None:
    """Two clients (two connections, two client ids and leases) write into one quota'd directory
    at once, without fsync: each write past what meta granted its handle asks for a byte credit
    first, so what both wrote never adds up past the limit; one of them gets EDQUOT, and after
    both close the usage is exactly the files' lengths. ``FS3_QUOTA_RACES`` rounds (``make
    quota-long`` runs more), each with its own limit and write sizes."""
    rounds = int(os.environ.get("FS3_QUOTA_RACES", "1"))

    async def main() -> None:
        async with InProcessCluster(tmp_path, targets_per_node=3, with_meta=True,
                                    meta_config=MetaServiceConfig(root_mode=0o777)) as cluster:
            one = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            two = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            try:
                for index in range(rounds):
                    rng = random.Random(index)
                    steps = (3000, 1700) if index == 0 else (rng.randrange(1000, 9000), rng.randrange(1000, 9000))
                    limit = 256 * 1024 if index == 0 else rng.randrange(16, 512) * 1024
                    await race(one, two, f"/q{index}", limit, steps)
                assert list((await one.metadata.fsck(True)).problems) == []
            finally:
                await one.close()
                await two.close()

    async def race(one: AsyncFileSystem, two: AsyncFileSystem, directory: str, limit: int,
                   steps: tuple[int, int]) -> None:
        await one.makedirs(directory)
        await one.metadata.quota_set(path_ref(directory.encode()), bytes_limit=limit)
        paths = [f"{directory}/one", f"{directory}/two"]
        files = [await one.open(paths[0], "wb"), await two.open(paths[1], "wb")]
        written = [0, 0]
        refused = [False, False]

        async def writer(index: int) -> None:
            for _ in range(1000):
                try:
                    await files[index].pwrite(written[index], b"w" * steps[index])
                except OSError as exc:
                    assert exc.errno == errno.EDQUOT
                    refused[index] = True
                    return
                written[index] += steps[index]
                used = (await one.metadata.quota_get(path_ref(directory.encode()))).bytes_used
                assert used <= limit and sum(written) <= limit  # accounted and written

        await asyncio.gather(writer(0), writer(1))
        assert any(refused) and sum(written) <= limit
        assert sum(written) > limit - 2 * max(steps)  # both kept going until the quota was full
        for f in files:
            await f.close()
        sizes = [(await one.stat(p)).st_size for p in paths]
        assert sizes == written
        assert (await one.metadata.quota_get(path_ref(directory.encode()))).bytes_used == sum(sizes) <= limit

    asyncio.run(main())


def test_a_dead_writers_credit_comes_back_when_its_lease_lapses(tmp_path: Path) -> None:
    """A client dies holding a byte credit and unpublished bytes on storage: once its lease
    lapses, meta closes its session (probing storage for the length), which gives the credit
    back and charges what it wrote; the other client then has the rest of the quota."""
    limit = 1 << 20

    async def body(env: Lapsing) -> None:
        await env.b.makedirs("/t/q")
        await env.b.metadata.quota_set(path_ref(b"/t/q"), bytes_limit=limit)
        f = await env.a.open("/t/q/dead", "wb")
        await f.write(b"a" * 5000)
        await f.flush()  # on storage, acknowledged; the length not sent
        held = (await env.b.metadata.quota_get(path_ref(b"/t/q"))).bytes_used
        assert held >= 5000  # the credit
        async with await env.b.open("/t/q/live", "wb") as g:  # B gets what is left beside it
            with pytest.raises(OSError) as refused:
                await g.write(b"b" * (limit - held + 1))
            assert refused.value.errno == errno.EDQUOT
        await env.lapse()
        assert (await env.b.stat("/t/q/dead")).st_size == 5000
        assert (await env.b.metadata.quota_get(path_ref(b"/t/q"))).bytes_used == 5000
        await env.b.write_bytes("/t/q/live", b"b" * (limit - 5000))  # the rest is free again
        assert list((await env.b.metadata.fsck(True)).problems) == []

    with_lapsing(tmp_path, body)

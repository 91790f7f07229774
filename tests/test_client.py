"""The client library against a real (in-process) cluster: files, errors, sessions, GC, fsck, restarts."""

from __future__ import annotations

import asyncio
import errno
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import fs3.aio
from fs3 import meta_pb2 as mpb
from fs3.client.fs import AsyncFileSystem, ClientConfig
from fs3.common.ids import parse_chunk_id
from fs3.meta import schema
from fs3.meta.service import MetaServiceConfig
from tests.conftest import wait_until
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # in-process clusters and meta restarts

CHUNK = 65536


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def with_cluster(tmp_path: Path, body: Callable[[InProcessCluster, AsyncFileSystem], Awaitable[None]],
                 transport: str = "framed", **meta_config: Any) -> None:
    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777, prune_interval_ms=100, gc_interval_ms=100, **meta_config)
        async with InProcessCluster(tmp_path, transport=transport, targets_per_node=3, with_meta=True,
                                    meta_config=config) as cluster:
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token, transport=transport)
            try:
                await fs.makedirs("/t")
                await fs.set_layout("/t", chunk_size=CHUNK, stripe=3)
                await body(cluster, fs)
            finally:
                await fs.close()

    run(main())


def chunks_of(cluster: InProcessCluster, inode_id: int) -> int:
    """Distinct chunks of an inode on storage (each is on every replica of its chain)."""
    found: set[bytes] = set()
    for node in cluster.nodes.values():
        for engine in node.engines.values():
            found.update(cid for cid in engine.states() if parse_chunk_id(cid)[0] == inode_id)
    return len(found)


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_random_writes_and_reads_across_chunks_match_a_local_model(tmp_path: Path, transport: str) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        rng = random.Random(7)
        model = bytearray()
        async with await fs.open("/t/f", "w+b") as f:
            for _ in range(25):
                offset = rng.randrange(0, 5 * CHUNK)
                data = rng.randbytes(rng.randrange(1, 2 * CHUNK))
                f.seek(offset)
                await f.write(data)
                if len(model) < offset:
                    model += bytes(offset - len(model))
                model[offset:offset + len(data)] = data
                if rng.random() < 0.3:
                    f.seek(rng.randrange(0, len(model)))
                    pos, size = f.tell(), rng.randrange(1, 3 * CHUNK)
                    assert await f.read(size) == bytes(model[pos:pos + size])
            f.seek(0)
            assert await f.read() == bytes(model)
        assert (await fs.stat("/t/f")).st_size == len(model)
        assert await fs.read_bytes("/t/f") == bytes(model)
        layout = await fs.layout("/t/f")
        assert layout.chunk_size == CHUNK and len(set(layout.chains)) == 3

    with_cluster(tmp_path / "c", body, transport)


def test_sequential_small_reads_holes_append_and_truncate(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        data = os.urandom(3 * CHUNK + 123)
        await fs.write_bytes("/t/seq", data)
        async with await fs.open("/t/seq", "rb") as f:
            parts = []
            while piece := await f.read(1000):
                parts.append(piece)
        assert b"".join(parts) == data
        # A hole: bytes never written read as zeros.
        async with await fs.open("/t/holes", "wb") as f:
            f.seek(2 * CHUNK + 5)
            await f.write(b"end")
        assert await fs.read_bytes("/t/holes") == bytes(2 * CHUNK + 5) + b"end"
        # Append always writes at the end.
        async with await fs.open("/t/seq", "ab") as f:
            await f.write(b"tail")
        assert await fs.read_bytes("/t/seq") == data + b"tail"
        # Shrink, then extend: the extension reads as zeros, not as the old bytes.
        await fs.truncate("/t/seq", CHUNK + 10)
        assert await fs.read_bytes("/t/seq") == data[:CHUNK + 10]
        await fs.truncate("/t/seq", 3 * CHUNK)
        assert await fs.read_bytes("/t/seq") == data[:CHUNK + 10] + bytes(2 * CHUNK - 10)
        async with await fs.open("/t/seq", "r+b") as f:
            await f.truncate(5)
            f.seek(0)
            assert await f.read() == data[:5]
        # O_TRUNC empties the file and its chunks.
        inode = (await fs.stat("/t/seq")).st_ino
        await fs.write_bytes("/t/seq", b"new")
        assert await fs.read_bytes("/t/seq") == b"new"
        assert chunks_of(cluster, inode) == 1

    with_cluster(tmp_path / "c", body)


def test_close_to_open_consistency_between_two_clients(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        other = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
        try:
            for round_ in range(3):
                payload = os.urandom(CHUNK + round_ * 1000)
                async with await fs.open("/t/shared", "wb") as f:
                    await f.write(payload)
                async with await other.open("/t/shared", "rb") as g:
                    assert await g.read() == payload
            assert sorted(await other.listdir("/t")) == ["shared"]
        finally:
            await other.close()

    with_cluster(tmp_path / "c", body)


def test_unlinked_open_file_stays_readable_then_its_chunks_are_collected(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        data = os.urandom(4 * CHUNK)
        await fs.write_bytes("/t/doomed", data)
        inode = (await fs.stat("/t/doomed")).st_ino
        assert chunks_of(cluster, inode) == 4
        f = await fs.open("/t/doomed", "rb")
        await fs.remove("/t/doomed")
        assert not await fs.exists("/t/doomed")
        assert await f.read() == data
        await asyncio.sleep(0.3)
        assert chunks_of(cluster, inode) == 4  # still open: nothing collected
        await f.close()
        await wait_until(lambda: _async(chunks_of(cluster, inode) == 0), timeout_s=10, what="chunks collected")
        report = await fs.fsck()
        assert not report.problems and report.gc_pending == 0

    with_cluster(tmp_path / "c", body)


async def _async(value: Any) -> Any:
    return value


def test_chunk_gc_survives_a_meta_restart(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        await fs.write_bytes("/t/big", os.urandom(5 * CHUNK))
        inode = (await fs.stat("/t/big")).st_ino
        assert cluster.meta is not None
        # Keep this meta's GC from running: the job must wait in the store for the next one.
        cluster.meta.config.gc_interval_ms = 600_000
        for task in cluster.meta._tasks:
            task.cancel()
        await fs.remove("/t/big")
        assert chunks_of(cluster, inode) == 5
        await cluster.stop_meta()
        cluster.meta_config = MetaServiceConfig(root_mode=0o777, prune_interval_ms=100, gc_interval_ms=100)
        await cluster.start_meta()
        await wait_until(lambda: _async(chunks_of(cluster, inode) == 0), timeout_s=10, what="chunks collected")
        assert (await fs.fsck()).gc_pending == 0

    with_cluster(tmp_path / "c", body)


def test_sessions_of_a_dead_client_are_pruned_and_its_length_made_exact(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        dying = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
        f = await dying.open("/t/partial", "wb")
        await f.write(os.urandom(2 * CHUNK + 77))
        await f.flush()  # data on storage, but the client dies before close
        await dying.meta.stop()  # no more lease renewals
        await dying.channels.close()
        assert cluster.meta is not None and cluster.meta_kv is not None

        async def pruned() -> bool:
            return not list(cluster.meta_kv.scan(schema.sessions_prefix(), b"SEST"))  # type: ignore[union-attr]

        await wait_until(pruned, timeout_s=15, what="sessions pruned")
        assert (await fs.stat("/t/partial")).st_size == 2 * CHUNK + 77

    with_cluster(tmp_path / "c", body, client_lease_ms=1_000)


def test_errors_are_os_errors_with_the_right_errno(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        await fs.mkdir("/t/d")
        await fs.write_bytes("/t/d/f", b"x")
        cases: list[tuple[Awaitable[Any], type[OSError], int]] = [
            (fs.stat("/t/missing"), FileNotFoundError, errno.ENOENT),
            (fs.open("/t/d", "wb"), IsADirectoryError, errno.EISDIR),
            (fs.open("/t/d/f", "xb"), FileExistsError, errno.EEXIST),
            (fs.listdir("/t/d/f"), NotADirectoryError, errno.ENOTDIR),
            (fs.rmdir("/t/d"), OSError, errno.ENOTEMPTY),
            (fs.getxattr("/t/d/f", "user.none"), OSError, errno.ENODATA),
            (fs.mkdir("/t/" + "n" * 300), OSError, errno.ENAMETOOLONG),
            (fs.set_layout("/t/d", chunk_size=CHUNK + 1), OSError, errno.EINVAL),
        ]
        for call, kind, code in cases:
            with pytest.raises(kind) as info:
                await call
            assert info.value.errno == code
        stranger = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token,
                                         config=None, uid=4242, gid=4242, groups=[])
        try:
            await fs.chmod("/t/d", 0o700)
            with pytest.raises(PermissionError):
                await stranger.listdir("/t/d")
            with pytest.raises(PermissionError):
                await stranger.write_bytes("/t/d/g", b"no")
            with pytest.raises(PermissionError) as info:
                await stranger.chmod("/t/d", 0o777)
            assert info.value.errno == errno.EPERM
        finally:
            await stranger.close()
        assert await fs.listdir("/t/d") == ["f"]  # nothing changed

    with_cluster(tmp_path / "c", body)


def test_bad_file_operations_fail_cleanly_and_change_nothing(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        await fs.write_bytes("/t/f", b"0123456789")
        async with await fs.open("/t/f", "rb") as f:
            with pytest.raises(OSError) as info:
                f.seek(-1)
            assert info.value.errno == errno.EINVAL
            with pytest.raises(OSError) as info:
                await f.write(b"x")
            assert info.value.errno == errno.EBADF
        async with await fs.open("/t/f", "r+b") as f:
            with pytest.raises(OSError) as info:
                await f.truncate(-5)
            assert info.value.errno == errno.EINVAL
        with pytest.raises(OSError):
            await fs.truncate("/t/f", -1)
        with pytest.raises(ValueError):
            await fs.open("/t/f", "rw")
        with pytest.raises(ValueError):
            await fs.stat("/t/a\x00b")
        closed = await fs.open("/t/f", "rb")
        await closed.close()
        with pytest.raises(OSError) as info:
            await closed.read()
        assert info.value.errno == errno.EBADF
        assert await fs.read_bytes("/t/f") == b"0123456789"

    with_cluster(tmp_path / "c", body)


def test_fsck_reports_damage(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        await fs.write_bytes("/t/a", b"a" * 100)
        await fs.write_bytes("/t/b", b"b" * 100)
        assert not (await fs.fsck()).problems
        # An orphan chunk (no inode) and a dentry whose inode vanished.
        storage = cluster.client(b"fsck-test")
        layout = await fs.layout("/t/a")
        from fs3.common.ids import chunk_id

        await storage.write(layout.chains[0], chunk_id(999_999, 0), 0, b"orphan", CHUNK)
        b_inode = (await fs.stat("/t/b")).st_ino
        assert cluster.meta_kv is not None
        from fs3.kv.store import WriteBatch

        batch = WriteBatch()
        batch.delete(schema.inode_key(b_inode))
        cluster.meta_kv.write(batch)
        problems = list((await fs.fsck()).problems)
        assert any("999999" in p and "orphan" in p for p in problems), problems
        assert any(f"missing inode {b_inode}" in p for p in problems), problems

    with_cluster(tmp_path / "c", body)


def test_meta_restart_keeps_the_namespace_and_clients_carry_on(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        for i in range(10):
            await fs.write_bytes(f"/t/f{i}", f"file {i}".encode())
        f = await fs.open("/t/f3", "ab")
        await cluster.stop_meta()
        restart = asyncio.create_task(_restart_later(cluster))
        names = await fs.listdir("/t")  # retried until meta is back
        await restart
        assert sorted(names) == sorted(f"f{i}" for i in range(10))
        await f.write(b" appended")
        await f.close()  # the session survived the restart
        assert await fs.read_bytes("/t/f3") == b"file 3 appended"
        assert not (await fs.fsck()).problems

    with_cluster(tmp_path / "c", body)


async def _restart_later(cluster: InProcessCluster) -> None:
    await asyncio.sleep(0.5)
    await cluster.start_meta()


def test_statvfs_and_sync_api_basics(tmp_path: Path) -> None:
    """The blocking API (own loop thread) over the same cluster."""

    async def body(cluster: InProcessCluster, afs: AsyncFileSystem) -> None:
        def blocking() -> None:
            fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
            try:
                with fs.open("/t/text.txt", "w") as f:
                    f.write("line one\nline two\n")
                with fs.open("/t/text.txt") as f:
                    assert f.readlines() == ["line one\n", "line two\n"]
                with fs.open("/t/bin", "wb") as f:
                    f.write(b"abc")
                    f.fsync()
                assert fs.stat("/t/bin").st_size == 3
                with fs.open("/t/bin", "r+b") as f:
                    f.seek(1)
                    f.write(b"Z")
                    f.seek(0)
                    assert f.read() == b"aZc"
                    f.truncate(2)
                assert fs.read_bytes("/t/bin") == b"aZ"
                fs.symlink("bin", "/t/link")
                assert fs.readlink("/t/link") == "bin" and fs.islink("/t/link")
                fs.setxattr("/t/bin", "user.k", b"v")
                assert fs.listxattr("/t/bin") == ["user.k"] and fs.getxattr("/t/bin", "user.k") == b"v"
                fs.utime("/t/bin", ns=(1_000_000_000, 2_000_000_000))
                assert fs.stat("/t/bin").st_mtime_ns == 2_000_000_000
                assert sorted(w[0] for w in fs.walk("/")) == ["/", "/t"]
                vfs = fs.statvfs()
                assert vfs.f_blocks > 0 and vfs.f_namemax == 255
                with pytest.raises(FileNotFoundError):
                    fs.open("/t/none")
            finally:
                fs.close()

        await asyncio.get_running_loop().run_in_executor(None, blocking)

    with_cluster(tmp_path / "c", body)


def test_client_options_are_checked() -> None:
    with pytest.raises(TypeError, match="unknown client options"):
        run(fs3.aio.connect("127.0.0.1:1", colour="blue"))
    assert ClientConfig().transport == "framed"
    assert mpb.RENAME_NOREPLACE == 1


def test_a_close_after_a_truncate_does_not_bring_the_old_length_back(tmp_path: Path) -> None:
    """FUSE releases files asynchronously: a writer's close may reach meta after a later truncate.
    Its stale length hint must not undo the truncate (the chunks past it are gone)."""
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem) -> None:
        data = os.urandom(5 * CHUNK + 123)
        f = await fs.open("/t/f", "wb")
        await f.write(data)
        await f.flush()
        await fs.truncate("/t/f", 2 * CHUNK + 7)
        await f.close()
        assert (await fs.stat("/t/f")).st_size == 2 * CHUNK + 7
        async with await fs.open("/t/f", "rb") as g:
            assert await g.read() == data[:2 * CHUNK + 7]
    with_cluster(tmp_path / "c", body)


def test_a_cluster_that_cannot_be_reached_is_an_os_error_at_connect() -> None:
    """``connect`` is a public edge like every other call of the API: what goes wrong reaches
    the caller (and fsspec, which is built on it) as the ``OSError`` a local file system raises,
    never as an fs3-internal error class."""
    with pytest.raises(OSError) as by_aio:
        run(fs3.aio.connect("127.0.0.1:1", rpc_timeout_ms=500, retry_total_ms=500))
    assert by_aio.value.errno is not None
    with pytest.raises(OSError):
        fs3.connect("127.0.0.1:1", rpc_timeout_ms=500, retry_total_ms=500)

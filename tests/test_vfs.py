"""The FUSE-agnostic VFS layer on an in-process cluster, without mounting anything."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import fs3.aio
from fs3 import meta_pb2 as mpb
from fs3.common.errors import BadHandle, NotFound, PermissionDenied
from fs3.meta.ops import O_APPEND, O_RDONLY, O_RDWR, O_WRONLY
from fs3.meta.service import MetaServiceConfig
from fs3.vfs import Vfs
from tests.inproc import InProcessCluster

ROOT = 1
ME = mpb.User(uid=0, gid=0)
ALICE = mpb.User(uid=1000, gid=1000, groups=[1000])
CHUNK = 65536


def with_vfs(tmp_path: Path, body: Callable[[Vfs], Awaitable[None]]) -> None:
    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o755)
        async with InProcessCluster(tmp_path, targets_per_node=2, with_meta=True, meta_config=config) as cluster:
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            await fs.set_layout("/", chunk_size=CHUNK)
            vfs = Vfs(fs)
            try:
                await body(vfs)
            finally:
                await vfs.close()
                await fs.close()

    asyncio.run(main())


def test_names_attributes_and_directory_listing(tmp_path: Path) -> None:
    async def body(vfs: Vfs) -> None:
        d = await vfs.mkdir(ROOT, b"d", 0o755, ME)
        assert (await vfs.lookup(ROOT, b"d", ME)).inode_id == d.inode_id
        for i in range(1500):  # more than one page of the listing
            await vfs.mknod(d.inode_id, b"f%04d" % i, stat.S_IFREG | 0o644, 0, ME)
        dh = await vfs.opendir(d.inode_id, ME)
        seen: list[bytes] = []
        position = 0
        while True:
            batch = await vfs.readdir(dh, position)
            if not batch:
                break
            take = batch[:700]  # the kernel may stop early and resume at the next position
            seen += [e.name for _, e in take]
            position = take[-1][0]
            if position == 700:
                await vfs.unlink(d.inode_id, b"f0000", ME)  # changes while listing do not break offsets
        vfs.releasedir(dh)
        assert seen == [b"f%04d" % i for i in range(1500)]
        link = await vfs.symlink(d.inode_id, b"s", b"f0001", ME)
        assert await vfs.readlink(link.inode_id, ME) == b"f0001"
        hard = await vfs.link((await vfs.lookup(d.inode_id, b"f0002", ME)).inode_id, ROOT, b"h", ME)
        assert hard.nlink == 2
        await vfs.rename(d.inode_id, b"f0003", ROOT, b"moved", 0, ME)
        assert (await vfs.lookup(ROOT, b"moved", ME)).type == mpb.FILE
        with pytest.raises(NotFound):
            await vfs.lookup(d.inode_id, b"f0003", ME)
        await vfs.setxattr(hard.inode_id, b"user.k", b"v", 0, ME)
        assert await vfs.listxattr(hard.inode_id, ME) == [b"user.k"]
        assert await vfs.getxattr(hard.inode_id, b"user.k", ME) == b"v"
        await vfs.removexattr(hard.inode_id, b"user.k", ME)
        assert (await vfs.statfs(ME)).name_max == 255

    with_vfs(tmp_path / "c", body)


def test_handles_positional_io_and_lengths(tmp_path: Path) -> None:
    async def body(vfs: Vfs) -> None:
        fh, inode = await vfs.create(ROOT, b"f", 0o644, O_RDWR, ME)
        data = os.urandom(3 * CHUNK + 10)
        # Writes arrive out of order and concurrently, as the kernel may send them.
        pieces = [(o, data[o:o + 40_000]) for o in range(0, len(data), 40_000)]
        await asyncio.gather(*(vfs.write(fh, o, p) for o, p in reversed(pieces)))
        # getattr already reports what this mount wrote, before meta knows it.
        assert (await vfs.getattr(inode.inode_id, ME)).size == len(data)
        reader, _ = await vfs.open(inode.inode_id, O_RDONLY, ME)
        assert await vfs.read(reader, 0, len(data)) == data  # sees the other handle's unflushed writes
        reads = await asyncio.gather(*(vfs.read(reader, o, 5000) for o in range(0, len(data), 5000)))
        assert b"".join(reads) == data
        await vfs.flush(fh)
        await vfs.release(fh)
        await vfs.release(reader)
        assert (await vfs.getattr(inode.inode_id, ME)).size == len(data)
        # Truncate through a handle, then through the inode.
        fh, _ = await vfs.open(inode.inode_id, O_WRONLY, ME)
        await vfs.setattr(inode.inode_id, ME, size=CHUNK + 1, fh=fh)
        assert (await vfs.getattr(inode.inode_id, ME)).size == CHUNK + 1
        await vfs.release(fh)
        await vfs.setattr(inode.inode_id, ME, size=5)
        reader, _ = await vfs.open(inode.inode_id, O_RDONLY, ME)
        assert await vfs.read(reader, 0, 100) == data[:5]
        await vfs.release(reader)
        # O_APPEND writes go to the end whatever offset they carry.
        fh, _ = await vfs.open(inode.inode_id, O_WRONLY | O_APPEND, ME)
        await vfs.write(fh, 0, b"tail")
        await vfs.release(fh)
        reader, _ = await vfs.open(inode.inode_id, O_RDONLY, ME)
        assert await vfs.read(reader, 0, 100) == data[:5] + b"tail"
        with pytest.raises(OSError) as info:
            await vfs.write(reader, 0, b"x")
        assert info.value.errno == errno.EBADF  # not open for writing
        await vfs.release(reader)
        with pytest.raises(BadHandle):
            await vfs.read(reader, 0, 1)
        big, _ = await vfs.create(ROOT, b"big", 0o644, O_WRONLY, ME)
        with pytest.raises(OSError) as info:
            await vfs.write(big, CHUNK << 32, b"x")
        assert info.value.errno == errno.EFBIG
        await vfs.release(big)

    with_vfs(tmp_path / "c", body)


def test_every_call_acts_for_its_caller(tmp_path: Path) -> None:
    async def body(vfs: Vfs) -> None:
        private = await vfs.mkdir(ROOT, b"private", 0o700, ME)
        with pytest.raises(PermissionDenied):
            await vfs.lookup(private.inode_id, b"x", ALICE)
        with pytest.raises(PermissionDenied):
            await vfs.create(ROOT, b"by-alice", 0o644, O_WRONLY, ALICE)  # / is 0755, owned by root
        assert not await vfs.access(private.inode_id, 4, ALICE) and await vfs.access(private.inode_id, 4, ME)
        shared = await vfs.mkdir(ROOT, b"shared", 0o777, ME)
        fh, inode = await vfs.create(shared.inode_id, b"hers", 0o600, O_WRONLY, ALICE)
        await vfs.release(fh)
        assert inode.uid == 1000 and inode.gid == 1000
        with pytest.raises(PermissionDenied):
            await vfs.open(inode.inode_id, O_RDONLY, mpb.User(uid=2000, gid=2000))

    with_vfs(tmp_path / "c", body)


def count_meta_calls(vfs: Vfs) -> list[str]:
    """The names of the meta methods ``vfs`` calls from now on (it still calls them)."""
    calls: list[str] = []
    real_call = vfs.fs.meta.call

    async def counting(method: str, *args: object, **kwargs: object) -> object:
        calls.append(method)
        return await real_call(method, *args, **kwargs)  # type: ignore[arg-type]

    vfs.fs.meta.call = counting  # type: ignore[method-assign]
    return calls


def test_missing_capability_xattr_is_remembered_until_this_mount_changes_xattrs(tmp_path: Path) -> None:
    from fs3.common.errors import NoXattr

    async def body(vfs: Vfs) -> None:
        f = await vfs.mknod(ROOT, b"f", stat.S_IFREG | 0o644, 0, ME)
        calls = count_meta_calls(vfs)
        for _ in range(5):  # the kernel asks before every write
            with pytest.raises(NoXattr):
                await vfs.getxattr(f.inode_id, b"security.capability", ME)
        assert calls == ["GetXattr"]
        with pytest.raises(NoXattr):  # other names are never answered from memory
            await vfs.getxattr(f.inode_id, b"user.x", ME)
        assert calls == ["GetXattr", "GetXattr"]
        await vfs.setxattr(f.inode_id, b"security.capability", b"\x01\x00\x00\x02" + bytes(16), 0, ME)
        assert await vfs.getxattr(f.inode_id, b"security.capability", ME) == b"\x01\x00\x00\x02" + bytes(16)
        calls.clear()
        fh, created = await vfs.create(ROOT, b"new", stat.S_IFREG | 0o644, os.O_WRONLY, ME)
        with pytest.raises(NoXattr):  # a file this mount just created has no attributes to ask for
            await vfs.getxattr(created.inode_id, b"security.capability", ME)
        assert calls == ["Open"]
        await vfs.release(fh)
    with_vfs(tmp_path, body)


def test_attributes_are_answered_from_memory_until_this_mount_changes_them(tmp_path: Path) -> None:
    """The kernel asks for attributes again after every read and write; what meta told this mount
    within the attribute timeout answers that, and a change made through this mount is seen at once."""
    async def body(vfs: Vfs) -> None:
        fh, inode = await vfs.create(ROOT, b"f", stat.S_IFREG | 0o644, os.O_WRONLY, ME)
        await vfs.write(fh, 0, b"x" * 5000)
        await vfs.flush(fh)
        await vfs.release(fh)
        calls = count_meta_calls(vfs)
        for _ in range(3):
            assert (await vfs.getattr(inode.inode_id, ME)).size == 5000  # the published length
        assert calls == []
        await vfs.setattr(inode.inode_id, ME, mode=0o600)
        assert stat.S_IMODE((await vfs.getattr(inode.inode_id, ME)).mode) == 0o600
        await vfs.link(inode.inode_id, ROOT, b"g", ME)
        assert (await vfs.getattr(inode.inode_id, ME)).nlink == 2
        await vfs.unlink(ROOT, b"g", ME)
        assert (await vfs.getattr(inode.inode_id, ME)).nlink == 1
        calls.clear()
        await asyncio.sleep(vfs.config.attr_timeout_s + 0.1)  # then meta is asked again
        await vfs.getattr(inode.inode_id, ME)
        assert calls == ["BatchStat"]
    with_vfs(tmp_path, body)


def test_a_fuse_request_whose_handler_meets_a_cancelled_task_is_still_answered() -> None:
    """Unanswered, a read request holds the kernel's page locks for good (every later write to
    those pages hangs); a cancellation that is not the request's own is answered EIO."""
    pyfuse3 = pytest.importorskip("pyfuse3", reason="the fuse extra is not installed")
    from fs3.fuse.ops import _errors

    @_errors
    async def handler() -> None:
        piece = asyncio.get_running_loop().create_future()
        piece.cancel()
        await piece

    with pytest.raises(pyfuse3.FUSEError) as raised:
        asyncio.run(handler())
    assert raised.value.errno == errno.EIO

    async def cancelled_request() -> None:
        task = asyncio.create_task(_errors(asyncio.sleep)(10))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_request())

"""The FUSE-agnostic VFS layer on an in-process cluster, without mounting anything."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
from google.protobuf.message import Message

import fs3.aio
from fs3 import meta_pb2 as mpb
from fs3.common.errors import BadHandle, NotFound, PermissionDenied
from fs3.common.posix import O_APPEND, O_RDONLY, O_RDWR, O_WRONLY
from fs3.meta.service import MetaServiceConfig
from fs3.vfs import Vfs
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # in-process clusters

M = TypeVar("M", bound=Message)

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

    async def counting(name: str, req: Message, rsp_type: type[M], user: mpb.User | None = None) -> M:
        calls.append(name)
        return await real_call(name, req, rsp_type, user)

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
        await vfs.fs.session_closes.drain()  # the release's session end, sent in a batch
        calls.clear()
        await asyncio.sleep(vfs.config.attr_timeout_s + 0.1)  # then meta is asked again
        await vfs.getattr(inode.inode_id, ME)
        assert calls == ["BatchStat"]
    with_vfs(tmp_path, body)


def with_two_mounts(tmp_path: Path, body: Callable[[Vfs, Vfs], Awaitable[None]]) -> None:
    """Two mounts (two clients) of one in-process cluster."""
    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777)
        async with InProcessCluster(tmp_path, targets_per_node=2, with_meta=True, meta_config=config) as cluster:
            fs_a = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            fs_b = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            await fs_a.set_layout("/", chunk_size=CHUNK)
            dropped: list[tuple[int, bytes]] = []
            a, b = Vfs(fs_a), Vfs(fs_b, drop_entry=lambda parent, name: dropped.append((parent, name)))
            b.dropped = dropped  # type: ignore[attr-defined]
            try:
                await body(a, b)
            finally:
                await a.close()
                await b.close()
                await fs_a.close()
                await fs_b.close()

    asyncio.run(main())


async def write_file(vfs: Vfs, parent: int, name: bytes, data: bytes) -> mpb.Inode:
    fh, inode = await vfs.create(parent, name, 0o644, O_WRONLY, ME)
    await vfs.write(fh, 0, data)
    await vfs.flush(fh)
    await vfs.release(fh)
    return inode


async def read_file(vfs: Vfs, inode_id: int) -> bytes:
    fh, _ = await vfs.open(inode_id, O_RDONLY, ME)
    try:
        return await vfs.read(fh, 0, 1 << 20)
    finally:
        await vfs.release(fh)


def stale(exc: pytest.ExceptionInfo[OSError]) -> bool:
    return exc.value.errno == errno.ESTALE


def test_an_open_through_a_name_another_mount_replaced_is_estale(tmp_path: Path) -> None:
    """Write-temporary-then-rename on mount A; mount B's kernel still maps the name to the old inode
    and opens that inode: B answers ESTALE (the kernel then looks the name up again), whether the
    old inode is gone or still held open, and opens nothing through the stale name."""
    async def body(a: Vfs, b: Vfs) -> None:
        old = await write_file(a, ROOT, b"ckpt", b"old")
        assert (await b.lookup(ROOT, b"ckpt", ME)).inode_id == old.inode_id  # B's kernel caches the name
        assert await read_file(b, old.inode_id) == b"old"
        new = await write_file(a, ROOT, b"ckpt.tmp", b"new")
        await a.rename(ROOT, b"ckpt.tmp", ROOT, b"ckpt", 0, ME)
        with pytest.raises(OSError) as info:  # the old inode is gone
            await b.open(old.inode_id, O_RDONLY, ME)
        assert stale(info)
        assert b.dropped == [(ROOT, b"ckpt")]  # type: ignore[attr-defined]
        # The kernel's second try looks the name up again and opens the new file.
        assert (await b.lookup(ROOT, b"ckpt", ME)).inode_id == new.inode_id
        assert await read_file(b, new.inode_id) == b"new"

        # The old file still held open (here by B itself): it exists, but the name is not its own.
        held, _ = await b.open(new.inode_id, O_RDONLY, ME)
        newer = await write_file(a, ROOT, b"ckpt.tmp", b"newer")
        await a.rename(ROOT, b"ckpt.tmp", ROOT, b"ckpt", 0, ME)
        with pytest.raises(OSError) as info:
            await b.open(new.inode_id, O_RDWR | os.O_TRUNC, ME)
        assert stale(info)
        assert await b.read(held, 0, 100) == b"new"  # neither truncated nor lost for its holder
        # A file with no name the kernel could have used (reopened through /proc/self/fd) opens by inode.
        reopened, _ = await b.open(new.inode_id, O_RDONLY, ME)
        assert await b.read(reopened, 0, 100) == b"new"
        await b.release(reopened)
        await b.release(held)
        assert (await b.lookup(ROOT, b"ckpt", ME)).inode_id == newer.inode_id
        assert await read_file(b, newer.inode_id) == b"newer"

        # Renamed away, or removed: ESTALE, then the kernel's lookup finds nothing (ENOENT).
        await a.rename(ROOT, b"ckpt", ROOT, b"elsewhere", 0, ME)
        with pytest.raises(OSError) as info:
            await b.open(newer.inode_id, O_RDONLY, ME)
        assert stale(info)
        with pytest.raises(NotFound):
            await b.lookup(ROOT, b"ckpt", ME)
        # An inode that is gone is ESTALE for every inode-addressed call, never ENOENT.
        await a.unlink(ROOT, b"elsewhere", ME)
        gone = await write_file(a, ROOT, b"gone", b"")
        await a.unlink(ROOT, b"gone", ME)
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: b.getattr(gone.inode_id, ME), lambda: b.setattr(newer.inode_id, ME, mode=0o600),
            lambda: b.listxattr(newer.inode_id, ME), lambda: b.open(newer.inode_id, O_RDONLY, ME)]
        for call in calls:
            with pytest.raises(OSError) as info:
                await call()
            assert stale(info)

    with_two_mounts(tmp_path, body)


def test_hard_links_and_this_mounts_own_renames_keep_opens_working(tmp_path: Path) -> None:
    async def body(a: Vfs, b: Vfs) -> None:
        d = await a.mkdir(ROOT, b"d", 0o777, ME)
        f = await write_file(a, ROOT, b"f", b"data")
        await a.link(f.inode_id, d.inode_id, b"g", ME)
        assert (await b.lookup(ROOT, b"f", ME)).inode_id == f.inode_id
        assert (await b.lookup(d.inode_id, b"g", ME)).inode_id == f.inode_id
        assert await read_file(b, f.inode_id) == b"data"  # both names checked, both good
        await a.unlink(ROOT, b"f", ME)  # one name gone: the kernel may have come by it
        with pytest.raises(OSError) as info:
            await b.open(f.inode_id, O_RDONLY, ME)
        assert stale(info)
        assert await read_file(b, f.inode_id) == b"data"  # its retry comes by the other name
        # This mount's own renames move its names as the kernel moves its entries.
        await b.rename(d.inode_id, b"g", ROOT, b"h", 0, ME)
        assert await read_file(b, f.inode_id) == b"data"
        e = await write_file(b, ROOT, b"e", b"other")
        await b.rename(ROOT, b"e", ROOT, b"h", mpb.RENAME_EXCHANGE, ME)
        assert await read_file(b, f.inode_id) == b"data" and await read_file(b, e.inode_id) == b"other"
        assert b.names.of(e.inode_id) == [(ROOT, b"h")] and b.names.of(f.inode_id) == [(ROOT, b"e")]
        # A name the opener cannot search is not the one it came by.
        private = await b.mkdir(ROOT, b"private", 0o700, ME)
        await b.link(f.inode_id, private.inode_id, b"p", ME)
        await b.setattr(f.inode_id, ME, mode=0o644)
        fh, _ = await b.open(f.inode_id, O_RDONLY, ALICE)
        await b.release(fh)
        b.forget([(f.inode_id, 1_000)])  # every lookup the kernel made
        assert b.names.of(f.inode_id) == []
        # Every name of a file held open removed elsewhere: one ESTALE drops them all, so the
        # kernel's one retry (here a reopen through /proc/self/fd, by no name) opens the file.
        k = await write_file(a, ROOT, b"k", b"kept")
        await a.link(k.inode_id, ROOT, b"k2", ME)
        for name in (b"k", b"k2"):
            await b.lookup(ROOT, name, ME)
        held, _ = await b.open(k.inode_id, O_RDONLY, ME)
        await a.unlink(ROOT, b"k", ME)
        await a.unlink(ROOT, b"k2", ME)
        with pytest.raises(OSError) as info:
            await b.open(k.inode_id, O_RDONLY, ME)
        assert stale(info)
        assert await read_file(b, k.inode_id) == b"kept"
        await b.release(held)

    with_two_mounts(tmp_path, body)


def test_kernel_names_are_bounded_and_a_young_name_dropped_leaves_the_kernel_too() -> None:
    from fs3.vfs import KernelNames

    async def main() -> None:
        dropped: list[tuple[int, bytes]] = []
        names = KernelNames(1.0, lambda parent, name: dropped.append((parent, name)), names_max=3,
                            per_inode_max=2)
        for i in range(5):
            names.saw(ROOT, b"f%d" % i, mpb.Inode(inode_id=100 + i, type=mpb.FILE))
        assert len(names) == 3 and dropped == [(ROOT, b"f0"), (ROOT, b"f1")]
        for i in range(3):
            names.saw(ROOT, b"h%d" % i, mpb.Inode(inode_id=7, type=mpb.FILE))
        assert names.of(7) == [(ROOT, b"h2"), (ROOT, b"h1")] and (ROOT, b"h0") in dropped
        names.saw(ROOT, b"h2", mpb.Inode(inode_id=8, type=mpb.DIRECTORY))  # now a directory: not kept
        assert names.of(7) == [(ROOT, b"h1")] and names.inode_at(ROOT, b"h2") == 0

    asyncio.run(main())


def test_a_write_by_anyone_but_root_drops_setuid_and_setgid(tmp_path: Path) -> None:
    """The client library asks meta before a handle's first write (the kernel does the same
    through a mount); root's writes keep the bits, as CAP_FSETID does on Linux."""
    async def body(vfs: Vfs) -> None:
        fh, inode = await vfs.create(ROOT, b"tool", 0o755, O_WRONLY, ME)
        await vfs.release(fh)
        for writer, kept in ((ME, True), (ALICE, False)):
            await vfs.setattr(inode.inode_id, ME, mode=0o6777)
            fh, _ = await vfs.open(inode.inode_id, O_WRONLY, writer)
            assert stat.S_IMODE((await vfs.getattr(inode.inode_id, ME)).mode) == 0o6777  # opening changes nothing
            await vfs.write(fh, 0, b"x")
            await vfs.write(fh, 1, b"y")
            await vfs.release(fh)
            assert stat.S_IMODE((await vfs.getattr(inode.inode_id, ME)).mode) == (0o6777 if kept else 0o0777)

    with_vfs(tmp_path, body)


def test_a_fuse_request_whose_handler_meets_a_cancelled_task_is_still_answered() -> None:
    """Unanswered, a read request holds the kernel's page locks for good (every later write to
    those pages hangs); a cancellation that is not the request's own is answered EIO."""
    pyfuse3 = pytest.importorskip("pyfuse3", reason="the fuse extra is not installed")
    from fs3.fuse.ops import answer_errors

    @answer_errors
    async def handler() -> None:
        piece = asyncio.get_running_loop().create_future()
        piece.cancel()
        await piece

    with pytest.raises(pyfuse3.FUSEError) as raised:
        asyncio.run(handler())
    assert raised.value.errno == errno.EIO

    async def cancelled_request() -> None:
        task = asyncio.create_task(answer_errors(asyncio.sleep)(10))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_request())


def test_a_forget_takes_back_only_its_own_lookups() -> None:
    """The kernel revalidating a name that now leads to another inode looks that inode up, finds
    it is not the one its entry has, and sends FORGET(1) for it — while its fresh lookup of the same
    inode stands. Dropping every name at any FORGET left the kernel's entry unchecked: the next
    open went by inode alone and opened an old, replaced file held open elsewhere."""
    from fs3.vfs.core import KernelNames

    async def main() -> None:
        names = KernelNames(entry_timeout_s=600)
        new = mpb.Inode(inode_id=77, type=mpb.FILE)
        names.saw(ROOT, b"ckpt", new)  # the revalidation's lookup
        names.saw(ROOT, b"ckpt", new)  # the fresh lookup the kernel keeps
        names.forget(77, 1)  # the revalidation's lookup taken back
        assert names.of(77) == [(ROOT, b"ckpt")]
        names.forget(77, 1)  # the kernel is done with the inode
        assert names.of(77) == []
        names.saw(ROOT, b"other", new)
        names.forget(77, 5)  # more than it was told: gone, as before
        assert names.of(77) == []

    asyncio.run(main())

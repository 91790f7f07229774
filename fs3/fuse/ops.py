"""pyfuse3 ``Operations`` for fs3: translates FUSE requests to :class:`~fs3.vfs.Vfs` calls and back.

Nothing here decides semantics. Each handler builds the caller's identity from the request
context (uid, gid and the supplementary groups of the calling process), calls the VFS, and turns
inodes into ``EntryAttributes`` and fs3 errors into ``FUSEError(errno)``.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import pyfuse3

from fs3 import meta_pb2 as mpb
from fs3.client.fs import TYPE_BITS
from fs3.common.errors import FS3Error
from fs3.common.metrics import MountMetrics
from fs3.vfs import Vfs

__all__ = ["FS3Operations", "answer_errors"]

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

_NOW_SLACK_NS = 1_000_000_000  # a time this close to now came from UTIME_NOW (pyfuse3 resolves it)


def answer_errors(fn: F) -> F:
    """fs3 errors become the errno FUSE answers; anything unexpected is logged and answered EIO.

    Every request must be answered: the kernel waits for the answer, with the pages of a read
    locked until it comes. Each answer is counted in the mount's metrics (the handler's name is
    the ``op`` label; an error answer also by its errno's name).
    """
    op = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        metrics: MountMetrics | None = getattr(args[0], "metrics", None) if args else None
        start = time.perf_counter()
        try:
            return await _answer(fn, *args, **kwargs)
        except pyfuse3.FUSEError as exc:
            if metrics is not None:
                metrics.errors.labels(op, errno.errorcode.get(exc.errno, str(exc.errno))).inc()
            raise
        finally:
            if metrics is not None:
                counter, histogram = metrics.op(op)
                counter.inc()
                histogram.observe(time.perf_counter() - start)

    return cast(F, wrapper)


async def _answer(fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
    try:
        return await fn(*args, **kwargs)
    except pyfuse3.FUSEError:
        raise
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this request itself is cancelled: the mount is going away
        # Something the handler awaited was cancelled under it. Unanswered, the request would
        # hold the kernel's page locks for good; the caller gets EIO instead.
        log.exception("%s failed", fn.__name__)
        raise pyfuse3.FUSEError(errno.EIO) from None
    except FS3Error as exc:
        raise pyfuse3.FUSEError(exc.errno) from None
    except OSError as exc:
        raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
    except Exception:
        log.exception("%s failed", fn.__name__)
        raise pyfuse3.FUSEError(errno.EIO) from None


# (pid, uid, gid) -> (monotonic deadline, supplementary groups). Reading /proc/PID/status for
# every request was a tenth of the mount's time on small writes; a process's groups are read again
# after a second, the same staleness the kernel's attribute cache allows.
_GROUPS_TTL_S = 1.0
_groups_cache: dict[tuple[int, int, int], tuple[float, list[int]]] = {}


def _user(ctx: Any) -> mpb.User:
    key = (ctx.pid, ctx.uid, ctx.gid)
    now = time.monotonic()
    cached = _groups_cache.get(key)
    if cached is not None and cached[0] > now:
        groups = cached[1]
    else:
        try:
            groups = sorted(pyfuse3.get_sup_groups(ctx.pid))
        except (OSError, ValueError, RuntimeError):
            groups = []  # the calling process is gone; its primary group still applies
        if len(_groups_cache) > 4096:
            _groups_cache.clear()
        _groups_cache[key] = (now + _GROUPS_TTL_S, groups)
    return mpb.User(uid=ctx.uid, gid=ctx.gid, groups=groups)


class FS3Operations(pyfuse3.Operations):
    # The kernel's writeback cache breaks close-to-open across mounts (it keeps its own size of a
    # cached file): measured and not kept, see docs/decisions.md.
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, vfs: Vfs, after_init: Callable[[], object] | None = None,
                 metrics: MountMetrics | None = None) -> None:
        """``metrics``: where each answered request is counted (None: nowhere)."""
        super().__init__()
        self.vfs = vfs
        self.metrics = metrics
        self._told: dict[int, tuple[int, int]] = {}  # inode -> (size, mtime) last given to the kernel
        self._after_init = after_init

    def init(self) -> None:
        """The kernel's INIT request: what must follow its reply (the kernel sets the mount's
        read-ahead from that reply) runs once the reply is sent."""
        if self._after_init is not None:
            asyncio.get_running_loop().call_soon(self._after_init)

    def attributes(self, inode: mpb.Inode) -> pyfuse3.EntryAttributes:
        self._told[inode.inode_id] = (inode.size, inode.mtime_ns)
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode.inode_id
        attr.generation = 0
        attr.entry_timeout = self.vfs.config.entry_timeout_s
        attr.attr_timeout = self.vfs.config.attr_timeout_s
        attr.st_mode = TYPE_BITS.get(inode.type, 0) | inode.mode
        attr.st_nlink = inode.nlink
        attr.st_uid = inode.uid
        attr.st_gid = inode.gid
        attr.st_rdev = inode.rdev
        attr.st_size = inode.size
        attr.st_blksize = 128 * 1024
        attr.st_blocks = -(-inode.size // 512)
        attr.st_atime_ns = inode.atime_ns
        attr.st_mtime_ns = inode.mtime_ns
        attr.st_ctime_ns = inode.ctime_ns
        return attr

    # -- names and attributes --------------------------------------------------------------------

    @answer_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        return self.attributes(await self.vfs.lookup(parent_inode, name, _user(ctx)))

    async def forget(self, inode_list: Any) -> None:
        # Inodes live in meta; nothing is pinned by lookups here. Drop what we told the kernel
        # (attributes, and the names the Vfs checks opens against).
        for inode, _ in inode_list:
            self._told.pop(inode, None)
        self.vfs.forget([(inode, nlookup) for inode, nlookup in inode_list])

    @answer_errors
    async def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        return self.attributes(await self.vfs.getattr(inode, _user(ctx)))

    @answer_errors
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: int | None, ctx: Any) -> pyfuse3.EntryAttributes:
        now = time.time_ns()
        kwargs: dict[str, Any] = {}
        if fields.update_mode:
            kwargs["mode"] = attr.st_mode
        if fields.update_uid:
            kwargs["uid"] = attr.st_uid
        if fields.update_gid:
            kwargs["gid"] = attr.st_gid
        if fields.update_size:
            kwargs["size"] = attr.st_size
        if fields.update_atime:
            if abs(attr.st_atime_ns - now) < _NOW_SLACK_NS:
                kwargs["atime_now"] = True
            else:
                kwargs["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            if abs(attr.st_mtime_ns - now) < _NOW_SLACK_NS:
                kwargs["mtime_now"] = True
            else:
                kwargs["mtime_ns"] = attr.st_mtime_ns
        return self.attributes(await self.vfs.setattr(inode, _user(ctx), fh=fh, **kwargs))

    @answer_errors
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return await self.vfs.readlink(inode, _user(ctx))

    @answer_errors
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        rsp = await self.vfs.statfs(_user(ctx))
        data = pyfuse3.StatvfsData()
        block = 4096
        data.f_bsize = block
        data.f_frsize = block
        data.f_blocks = rsp.capacity_bytes // block
        data.f_bfree = rsp.free_bytes // block
        data.f_bavail = rsp.free_bytes // block
        data.f_files = 1 << 40
        data.f_ffree = (1 << 40) - rsp.inodes_allocated
        if rsp.inodes_limit:  # a quota on the mount's root bounds the inodes too
            data.f_files = rsp.inodes_limit
            data.f_ffree = max(0, rsp.inodes_limit - rsp.inodes_used)
        data.f_favail = data.f_ffree
        data.f_namemax = rsp.name_max or 255
        return data

    @answer_errors
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        return await self.vfs.access(inode, mode, _user(ctx))

    # -- names -----------------------------------------------------------------------------------

    @answer_errors
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> pyfuse3.EntryAttributes:
        return self.attributes(await self.vfs.mknod(parent_inode, name, mode, rdev, _user(ctx)))

    @answer_errors
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        return self.attributes(await self.vfs.mkdir(parent_inode, name, mode, _user(ctx)))

    @answer_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.vfs.unlink(parent_inode, name, _user(ctx))

    @answer_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.vfs.rmdir(parent_inode, name, _user(ctx))

    @answer_errors
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        return self.attributes(await self.vfs.symlink(parent_inode, name, target, _user(ctx)))

    @answer_errors
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: Any) -> None:
        wire = (mpb.RENAME_NOREPLACE if flags & pyfuse3.RENAME_NOREPLACE else 0) | \
            (mpb.RENAME_EXCHANGE if flags & pyfuse3.RENAME_EXCHANGE else 0)
        await self.vfs.rename(parent_inode_old, name_old, parent_inode_new, name_new, wire, _user(ctx))

    @answer_errors
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        return self.attributes(await self.vfs.link(inode, new_parent_inode, new_name, _user(ctx)))

    # -- files -----------------------------------------------------------------------------------

    @answer_errors
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        fh, fresh = await self.vfs.open(inode, flags, _user(ctx))
        told = self._told.get(inode)
        if told is not None and told != (fresh.size, fresh.mtime_ns):
            # Close-to-open: another client changed the file since the kernel cached its
            # attributes; make it ask again before it reads (no writeback cache: cannot block).
            self._told.pop(inode, None)
            try:
                pyfuse3.invalidate_inode(inode, attr_only=True)
            except OSError as exc:
                log.debug("invalidating inode %d: %s", inode, exc)
        return pyfuse3.FileInfo(fh=fh, keep_cache=False)

    @answer_errors
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        fh, inode = await self.vfs.create(parent_inode, name, mode, flags, _user(ctx))
        attr = self.attributes(inode)
        attr.entry_timeout = self.vfs.config.created_entry_timeout_s  # see VfsConfig
        return pyfuse3.FileInfo(fh=fh, keep_cache=False), attr

    @answer_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        data = await self.vfs.read(fh, off, size)
        if self.metrics is not None:
            self.metrics.read_bytes.inc(len(data))
        return data

    @answer_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        written = await self.vfs.write(fh, off, buf)
        if self.metrics is not None:
            self.metrics.written_bytes.inc(written)
        return written

    @answer_errors
    async def flush(self, fh: int) -> None:
        await self.vfs.flush(fh)

    @answer_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.vfs.fsync(fh)

    @answer_errors
    async def release(self, fh: int) -> None:
        await self.vfs.release(fh)

    # -- directories -----------------------------------------------------------------------------

    @answer_errors
    async def opendir(self, inode: int, ctx: Any) -> int:
        return await self.vfs.opendir(inode, _user(ctx))

    @answer_errors
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        for next_id, entry in await self.vfs.readdir(fh, start_id):
            if not entry.attrs.inode_id:
                continue  # removed between the listing and the attribute read
            if not pyfuse3.readdir_reply(token, bytes(entry.name), self.attributes(entry.attrs), next_id):
                return

    async def releasedir(self, fh: int) -> None:
        self.vfs.releasedir(fh)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None  # directory changes are durable when meta acknowledges them

    # -- xattrs ----------------------------------------------------------------------------------

    @answer_errors
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        await self.vfs.setxattr(inode, name, value, 0, _user(ctx))

    @answer_errors
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        return await self.vfs.getxattr(inode, name, _user(ctx))

    @answer_errors
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        return await self.vfs.listxattr(inode, _user(ctx))

    @answer_errors
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        await self.vfs.removexattr(inode, name, _user(ctx))


"""The file system as the kernel sees it: inodes, names, handles. No FUSE types here.

:class:`Vfs` turns inode-based requests (lookup a name in a directory inode, read from an open
handle...) into metadata calls made for the calling user and into chunk I/O through
:class:`~fs3.client.files.AsyncFile`, so the semantics are unit-tested without a mount and the
FUSE adapter (:mod:`fs3.fuse.ops`) only translates types.

* Every metadata call carries the caller's uid, gid and groups: meta enforces permissions.
* Open handles are numbered; each has a lock, because the kernel may send several reads or
  writes for one handle at once and a handle's buffers and read-ahead are sequential state.
* ``getattr`` of a file this client is writing reports the larger of meta's length and the
  length the open handles know (meta learns it at flush, fsync and close).
* Handles of one file see each other's writes and size changes, as descriptors of a local file
  do (the client library keeps them together: :meth:`AsyncFileSystem.open_files`); a size change
  (truncate, ``O_TRUNC``) first lands every handle's writes and publishes their length.
* Directory listings are read in pages and remembered per open directory handle, so offsets
  handed to the kernel stay valid while the directory changes.
* The kernel caches name -> inode answers and opens files by inode. Every name this mount gave
  the kernel for a file is remembered, and an open checks, in the same meta transaction, that
  the name still leads to that inode: when another client replaced or removed it, the open is
  answered ``ESTALE`` and the kernel looks the path up again (see :class:`KernelNames`). An
  inode-addressed request for an inode that is gone is ``ESTALE`` too, never ``ENOENT``.
* Metadata goes through the client's typed :class:`~fs3.client.meta.Meta` only (``self.meta``),
  each call made for the calling user.
* Errors are :class:`~fs3.common.errors.FS3Error` (metadata, from :class:`~fs3.client.meta.Meta`)
  or ``OSError`` (file I/O through the client library's public file API, and ``ESTALE`` for an
  inode the kernel knows but meta no longer has); both carry the errno the adapter answers with.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import logging
import stat as stat_mod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from fs3 import meta_pb2 as mpb
from fs3.client.files import AsyncFile
from fs3.client.fs import KIND_OF_MODE, AsyncFileSystem
from fs3.client.meta import Meta, name_ref
from fs3.common.errors import (
    BadHandle,
    InvalidArgument,
    IsADirectory,
    NotADirectory,
    NotFound,
    NoXattr,
    PermissionDenied,
)
from fs3.common.posix import O_ACCMODE, O_APPEND, O_CREAT, O_RDONLY, O_RDWR, O_TRUNC, O_WRONLY, Caller, may

__all__ = ["DirHandle", "KernelNames", "Vfs", "VfsConfig"]

log = logging.getLogger(__name__)

_READDIR_PAGE = 1000
# The kernel reads this before every write to a file (to drop file capabilities if set).
_CAPABILITY_XATTR = b"security.capability"


@dataclass(frozen=True)
class VfsConfig:
    attr_timeout_s: float = 1.0     # how long the kernel may cache attributes
    entry_timeout_s: float = 1.0    # how long the kernel may cache a name -> inode answer
    # ... for a file this mount created: its next open, stat or unlink here skips the lookup. A
    # name another mount replaces or removes meanwhile is still right where it matters: an open
    # checks the name (KernelNames), a stat or unlink of a file that is gone is ESTALE, on which
    # the kernel looks the name up again; only the attributes of a file replaced while still held
    # (open, or hard-linked elsewhere) can be shown this long.
    created_entry_timeout_s: float = 30.0
    # Sessions of released handles with nothing left to publish are ended in batches
    # (fs3.client.closes); False: each release waits for its own Close.
    gather_session_ends: bool = True
    inflight_per_file: int = 8      # chunk requests in flight per open file (bounds its memory)


# A name the kernel learned this long ago (beyond its entry timeout) has been looked up again
# before any use: the margin covers the time between our answer and the kernel receiving it.
_ENTRY_MARGIN_S = 1.0
_NAMES_MAX = 200_000        # names remembered in all (each about 200 bytes)
_NAMES_PER_INODE_MAX = 4    # hard links of one file remembered (each costs an open a lookup)


class KernelNames:
    """Which names this mount gave the kernel for each regular file, so an open can check them.

    The kernel keeps a name -> inode answer for the entry timeout and, within it, opens the file
    by inode without asking. When another client replaces the name (write a temporary file, rename
    it over: every editor, ``git`` and checkpoint writer), the kernel would open the old inode —
    gone (``ENOENT``), or, if someone holds it open, with the old contents. So an open of a file
    goes by one of its remembered names *and* its inode, and meta refuses when the name now leads
    elsewhere; the open is then answered ``ESTALE``, on which the kernel redoes the path lookup
    (``LOOKUP_REVAL``) and opens what the name names now. A file with no remembered name (one
    opened through ``/proc/self/fd``, or whose names the kernel let go) is opened by inode.

    Memory is bounded: at most ``names_max`` names in all and ``per_inode_max`` per file; a name
    dropped while the kernel may still be using it (younger than the entry timeout) is dropped
    from the kernel too (``drop_entry``), so it cannot be used unchecked.
    """

    def __init__(self, entry_timeout_s: float, drop_entry: Callable[[int, bytes], None] | None = None,
                 names_max: int = _NAMES_MAX, per_inode_max: int = _NAMES_PER_INODE_MAX) -> None:
        self.entry_timeout_s = entry_timeout_s
        self.drop_entry = drop_entry
        self.names_max = names_max
        self.per_inode_max = per_inode_max
        # (parent, name) -> (inode, loop time it was given to the kernel); oldest first.
        self._by_name: OrderedDict[tuple[int, bytes], tuple[int, float]] = OrderedDict()
        self._by_inode: dict[int, list[tuple[int, bytes]]] = {}
        # inode -> entries given to the kernel for it (FUSE's lookup count): a FORGET takes back
        # its count, and the kernel is done with the inode only when none are left. (It sends
        # FORGET(n) for an inode it looked up but did not keep — a revalidation that found another
        # inode — while a later lookup of the same inode stands.)
        self._lookups: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def saw(self, parent: int, name: bytes, inode: mpb.Inode) -> None:
        """The kernel was told that ``parent``/``name`` is ``inode`` (lookup, create, readdir...)."""
        key = (parent, bytes(name))
        lookups = self._lookups.get(inode.inode_id, 0)  # (the unlink below may drop the count)
        self._unlink(key)
        if inode.type != mpb.FILE or not inode.inode_id:
            return  # only regular files are opened by inode through a name
        self._lookups[inode.inode_id] = lookups + 1
        names = self._by_inode.setdefault(inode.inode_id, [])
        names.append(key)
        self._by_name[key] = (inode.inode_id, self._now())
        if len(names) > self.per_inode_max:
            self._evict(names[0])
        while len(self._by_name) > self.names_max:
            self._evict(next(iter(self._by_name)))

    def gone(self, parent: int, name: bytes) -> None:
        """``parent``/``name`` no longer names what the kernel was told (this mount removed it)."""
        self._unlink((parent, bytes(name)))

    def stale(self, parent: int, name: bytes) -> None:
        """Meta says ``parent``/``name`` leads elsewhere now: forget it here and in the kernel."""
        self._unlink((parent, bytes(name)))
        self._drop_from_kernel(parent, bytes(name))

    def inode_at(self, parent: int, name: bytes) -> int:
        found = self._by_name.get((parent, bytes(name)))
        return found[0] if found is not None else 0

    def of(self, inode_id: int) -> list[tuple[int, bytes]]:
        """The names the kernel may use for ``inode_id``, newest first."""
        return list(reversed(self._by_inode.get(inode_id, ())))

    def forget(self, inode_id: int, nlookup: int) -> None:
        """The kernel took back ``nlookup`` of its lookups of the inode; at none left it forgot the
        inode, and with it every name it had for it."""
        left = self._lookups.pop(inode_id, 0) - nlookup
        if left > 0 and inode_id in self._by_inode:
            self._lookups[inode_id] = left
            return
        for key in self._by_inode.pop(inode_id, ()):
            self._by_name.pop(key, None)

    def _unlink(self, key: tuple[int, bytes]) -> None:
        found = self._by_name.pop(key, None)
        if found is None:
            return
        names = self._by_inode.get(found[0])
        if names is not None:
            with contextlib.suppress(ValueError):
                names.remove(key)
            if not names:
                del self._by_inode[found[0]]
                self._lookups.pop(found[0], None)  # bounded with the names (a count lost is a forget early)

    def _evict(self, key: tuple[int, bytes]) -> None:
        found = self._by_name.get(key)
        self._unlink(key)
        if found is not None and self._now() - found[1] < self.entry_timeout_s + _ENTRY_MARGIN_S:
            self._drop_from_kernel(*key)  # the kernel may still use it without asking

    def _drop_from_kernel(self, parent: int, name: bytes) -> None:
        if self.drop_entry is not None:
            try:
                self.drop_entry(parent, name)
            except Exception as exc:  # best effort: the open's check still stands
                log.debug("dropping kernel entry %d/%r: %s", parent, name, exc)


def _stale(what: str) -> OSError:
    return OSError(errno.ESTALE, what)


@contextlib.contextmanager
def _stale_if_gone(inode_id: int) -> Iterator[None]:
    """An inode the kernel still knows but meta no longer has: ``ESTALE``, so that a path-based
    call looks the path up again (``ENOENT`` would tell the caller the name does not exist)."""
    try:
        yield
    except NotFound:
        raise _stale(f"inode {inode_id} no longer exists") from None


@dataclass
class _Handle:
    file: AsyncFile
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class DirHandle:
    inode_id: int
    user: mpb.User
    entries: list[mpb.DirEntry] = field(default_factory=list)
    more: bool = True


class Vfs:
    """Inode-based operations on one fs3 cluster, for one mount."""

    def __init__(self, fs: AsyncFileSystem, config: VfsConfig | None = None,
                 drop_entry: Callable[[int, bytes], None] | None = None) -> None:
        """``drop_entry(parent, name)`` makes the kernel forget a name (the FUSE adapter's)."""
        self.fs = fs
        self.meta: Meta = fs.metadata
        self.config = config or VfsConfig()
        self.names = KernelNames(max(self.config.entry_timeout_s, self.config.created_entry_timeout_s), drop_entry)
        self._handles: dict[int, _Handle] = {}
        self._dirs: dict[int, DirHandle] = {}
        self._ids = itertools.count(1)
        # inode -> loop time until which "no security.capability" may be answered from memory.
        self._no_capability_until: dict[int, float] = {}
        # inode -> (loop time until which it may be answered from memory, attributes from meta).
        self._attrs: dict[int, tuple[float, mpb.Inode]] = {}
        self._attr_changes = 0  # counts forgets: an answer that raced with one is not kept

    # -- the attribute cache ---------------------------------------------------------------------
    #
    # The kernel drops a FUSE inode's attributes after every read (atime) and write, and asks
    # again at the next stat: a meta round trip per stat of a file just read. Attributes meta sent
    # this mount (open, lookup, getattr, readdir, a published length) are kept for the attribute
    # timeout — the staleness the kernel's own cache already allows other clients' changes — and
    # dropped when this mount changes the inode, so this mount always sees its own changes.

    def _remember(self, inode: mpb.Inode, asked_at: int) -> None:
        """Keep ``inode`` unless this mount changed something since the request (``asked_at``)."""
        if asked_at != self._attr_changes:
            return
        if len(self._attrs) > 100_000:
            self._attrs.clear()
        self._attrs[inode.inode_id] = (asyncio.get_running_loop().time() + self.config.attr_timeout_s, inode)

    def _remember_change(self, inode: mpb.Inode, asked_at: int) -> None:
        """Keep ``inode`` as a change this mount made left it, unless another change was made
        meanwhile; then forget it: the two answers may have come back in either order, and one
        kept from before this one committed would hide this change."""
        if asked_at == self._attr_changes:
            self._remember(inode, asked_at)
        else:
            self._forget(inode.inode_id)

    def _forget(self, *inode_ids: int) -> None:
        self._attr_changes += 1
        for inode_id in inode_ids:
            self._attrs.pop(inode_id, None)

    def _forget_all(self) -> None:
        """After a change whose victims are unknown here (unlink, rename: the target's nlink)."""
        self._attr_changes += 1
        self._attrs.clear()

    def _with_local_length(self, inode: mpb.Inode) -> mpb.Inode:
        return self.fs.with_local_length(inode)

    # -- names and attributes --------------------------------------------------------------------

    async def lookup(self, parent: int, name: bytes, user: mpb.User) -> mpb.Inode:
        asked_at = self._attr_changes
        try:
            inode = await self.meta.lookup(name_ref(parent, name), user=user)
        except NotFound:
            self.names.gone(parent, name)
            raise
        self._remember(inode, asked_at)
        self.names.saw(parent, name, inode)
        return self._with_local_length(inode)

    def forget(self, inodes: list[tuple[int, int]]) -> None:
        """The kernel took back lookups of these inodes (``(inode, nlookup)`` each); one with none
        left is dropped, with every name it had for it."""
        for inode_id, nlookup in inodes:
            self.names.forget(inode_id, nlookup)

    async def getattr(self, inode_id: int, user: mpb.User) -> mpb.Inode:
        cached = self._attrs.get(inode_id)
        hit = cached is not None and cached[0] > asyncio.get_running_loop().time()
        self.fs.metrics.cache("attr", hit)
        if hit and cached is not None:
            return self._with_local_length(cached[1])
        await self.fs.session_closes.settle(inode_id)
        asked_at = self._attr_changes
        inode = (await self.meta.batch_stat([inode_id], user))[0]
        if inode.inode_id == 0:
            self._forget(inode_id)
            raise _stale(f"inode {inode_id} no longer exists")
        self._remember(inode, asked_at)
        return self._with_local_length(inode)

    async def setattr(self, inode_id: int, user: mpb.User, *, mode: int | None = None, uid: int | None = None,
                      gid: int | None = None, size: int | None = None, atime_ns: int | None = None,
                      mtime_ns: int | None = None, atime_now: bool = False, mtime_now: bool = False,
                      fh: int | None = None) -> mpb.Inode:
        self._forget(inode_id)
        mask = 0
        if mode is not None:
            mask |= mpb.SET_MODE
        if uid is not None:
            mask |= mpb.SET_UID
        if gid is not None:
            mask |= mpb.SET_GID
        if atime_now:
            mask |= mpb.SET_ATIME_NOW
        elif atime_ns is not None:
            mask |= mpb.SET_ATIME
        if mtime_now:
            mask |= mpb.SET_MTIME_NOW
        elif mtime_ns is not None:
            mask |= mpb.SET_MTIME
        new_size = 0
        if size is not None:
            if size < 0:
                raise InvalidArgument("negative size")
            handle = self._handles.get(fh) if fh is not None else None
            if handle is not None and handle.file.writable:
                # ftruncate(2) (and O_TRUNC, where the kernel sends it as a truncate of the new handle).
                async with handle.lock:
                    await handle.file.truncate(size)
            else:
                # Writes this mount's handles made must land, and be known to meta, before the
                # truncate: bytes landing after it would bring the old length back.
                await self.fs.settle_writers(inode_id)
                mask |= mpb.SET_SIZE
                new_size = size
        if not mask:
            return await self.getattr(inode_id, user)
        asked_at = self._attr_changes
        with _stale_if_gone(inode_id):
            inode = await self.meta.set_attr(
                inode_id, mask, mode=stat_mod.S_IMODE(mode or 0), uid=uid or 0, gid=gid or 0, size=new_size,
                atime_ns=atime_ns if mask & mpb.SET_ATIME and atime_ns is not None else 0,
                mtime_ns=mtime_ns if mask & mpb.SET_MTIME and mtime_ns is not None else 0, user=user)
        if inode.nlink == 0 and self.fs.session_closes.pending(inode_id):
            # Removed, and perhaps alive only by a session end queued here: once that is sent,
            # a file that is gone is ESTALE, as it would have been without the queue. (Not
            # sent before the call: tar, cp -p and rsync set times right after each close.)
            await self.fs.session_closes.settle(inode_id)
            if not (await self.meta.batch_stat([inode_id], user))[0].inode_id:
                self._forget(inode_id)
                raise _stale(f"inode {inode_id} no longer exists")
        if mask & mpb.SET_SIZE:
            self.fs.size_changed(inode_id, new_size)
        self._remember_change(inode, asked_at)
        return self._with_local_length(inode)

    async def readlink(self, inode_id: int, user: mpb.User) -> bytes:
        with _stale_if_gone(inode_id):
            target = await self.meta.read_link(inode_id, user)
        return bytes(target)

    async def statfs(self, user: mpb.User) -> mpb.StatFsRsp:
        return await self.meta.statfs(user)

    async def access(self, inode_id: int, mode: int, user: mpb.User) -> bool:
        """``access(2)``: whether ``user`` may read/write/execute (mode bits 4/2/1) the inode."""
        inode = await self.getattr(inode_id, user)
        return may(inode, Caller.from_pb(user), mode & 7) if mode & 7 else True

    # -- creating and removing names -------------------------------------------------------------

    async def _make(self, parent: int, name: bytes, kind: mpb.InodeType, mode: int, user: mpb.User, rdev: int = 0,
                    target: bytes = b"") -> mpb.Inode:
        self._forget(parent)
        inode = await self.meta.make_node(name_ref(parent, name), kind, mode=stat_mod.S_IMODE(mode), rdev=rdev,
                                          symlink_target=target, user=user)
        self.names.saw(parent, name, inode)
        return inode

    async def mkdir(self, parent: int, name: bytes, mode: int, user: mpb.User) -> mpb.Inode:
        return await self._make(parent, name, mpb.DIRECTORY, mode, user)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, user: mpb.User) -> mpb.Inode:
        kind = KIND_OF_MODE.get(stat_mod.S_IFMT(mode))
        if kind is None:
            raise InvalidArgument(f"mknod of file type {stat_mod.S_IFMT(mode):o}")
        return await self._make(parent, name, kind, mode, user, rdev=rdev)

    async def symlink(self, parent: int, name: bytes, target: bytes, user: mpb.User) -> mpb.Inode:
        return await self._make(parent, name, mpb.SYMLINK, 0o777, user, target=target)

    async def link(self, inode_id: int, new_parent: int, new_name: bytes, user: mpb.User) -> mpb.Inode:
        self._forget(inode_id, new_parent)
        inode = await self.meta.link(inode_id, name_ref(new_parent, new_name), user)
        self.names.saw(new_parent, new_name, inode)
        return self._with_local_length(inode)

    async def unlink(self, parent: int, name: bytes, user: mpb.User) -> None:
        await self._remove(parent, name, False, user)

    async def rmdir(self, parent: int, name: bytes, user: mpb.User) -> None:
        await self._remove(parent, name, True, user)

    async def _remove(self, parent: int, name: bytes, directory: bool, user: mpb.User) -> None:
        self._forget_all()
        asked_at = self._attr_changes
        rsp = await self.meta.remove_entry(name_ref(parent, name), directory=directory, user=user)
        self.names.gone(parent, name)
        # A file this mount closed a moment ago still has its session's end queued: sent now, so
        # that the file is gone for everyone once the unlink returns (not kept for the batch).
        await self.fs.session_closes.settle(rsp.inode_id)
        if rsp.HasField("parent"):
            # The kernel drops the directory's attributes after a removal and asks at its next
            # look into it (every path walk checks search permission): answered from here.
            self._remember_change(rsp.parent, asked_at)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int,
                     user: mpb.User) -> None:
        self._forget_all()
        replaced = self.names.inode_at(new_parent, new_name)
        moved = await self.meta.rename(name_ref(old_parent, old_name), name_ref(new_parent, new_name), flags=flags,
                                       user=user)
        # The kernel moves its entries the same way.
        self.names.gone(old_parent, old_name)
        if flags & mpb.RENAME_EXCHANGE and replaced:
            self.names.saw(old_parent, old_name, mpb.Inode(inode_id=replaced, type=mpb.FILE))
        self.names.saw(new_parent, new_name, moved)
        if replaced and not flags & mpb.RENAME_EXCHANGE:
            await self.fs.session_closes.settle(replaced)  # as in unlink

    # -- files -----------------------------------------------------------------------------------

    def _register(self, rsp: mpb.OpenRsp, flags: int, path: str, asked_at: int, user: mpb.User,
                  here: bool = False) -> int:
        """A handle for meta's open answer ``rsp``; ``here``: its file lives in this process even on a
        mount with data workers (usrbio reads a file's chunks itself, straight into shared memory)."""
        access = flags & O_ACCMODE
        readable = access in (O_RDONLY, O_RDWR)
        writable = access in (O_WRONLY, O_RDWR)
        make = functools.partial(Vfs._new_file, self) if here else self._new_file
        afile = make(path, rsp, readable, writable, bool(flags & O_APPEND), user)
        fh = next(self._ids)
        self._handles[fh] = _Handle(afile)
        self._remember(rsp.inode, asked_at)
        if flags & O_TRUNC and not rsp.created:
            self.fs.size_changed(rsp.inode.inode_id, 0)
        return fh

    async def _open_at_meta(self, target: int | mpb.PathRef, flags: int, user: mpb.User,
                            mode: int = 0) -> mpb.OpenRsp:
        """Meta's open (a mount with data workers opens in the worker that will hold the file)."""
        return await self.meta.open(target, flags, mode=mode, user=user)

    def _new_file(self, path: str, rsp: mpb.OpenRsp, readable: bool, writable: bool, append: bool,
                  user: mpb.User) -> AsyncFile:
        """The handle's file, made of meta's answer to :meth:`_open_at_meta`."""
        return AsyncFile(self.fs, path, rsp, readable, writable, append, self.config.inflight_per_file, user)

    async def open(self, inode_id: int, flags: int, user: mpb.User) -> tuple[int, mpb.Inode]:
        """Open a file the kernel found by name; ``ESTALE`` when that name now leads elsewhere.

        The open goes by the newest name this mount gave the kernel for the inode, checked by meta
        in the open's own transaction (nothing is opened or truncated through a stale name); older
        names of a hard-linked file are checked by lookups first. See :class:`KernelNames`.
        """
        names = self.names.of(inode_id)
        if not names:
            # Opened by inode alone: a file removed elsewhere must be gone once this mount closed
            # it, not kept by a session end still queued here. (By name, meta checks the name.)
            await self.fs.session_closes.settle(inode_id)
        if len(names) > 1:
            stale = [n for n in names[1:] if not await self._still_names(*n, inode_id, user)]
            if stale:
                if not await self._still_names(*names[0], inode_id, user):
                    stale.append(names[0])
                for parent, name in stale:  # all of them: the kernel tries once more, by any name
                    self.names.stale(parent, name)
                raise _stale(f"{len(stale)} of the names of inode {inode_id} lead elsewhere now")
        if flags & O_TRUNC:
            # O_TRUNC comes with the open when the kernel does atomic O_TRUNC (libfuse's default).
            self._forget(inode_id)
            await self.fs.settle_writers(inode_id)
        asked_at = self._attr_changes
        flags_sent = flags & ~O_CREAT
        # By the newest name and the inode together: meta checks the name still leads to it.
        by_name = mpb.PathRef(parent=names[0][0], path=names[0][1], inode_id=inode_id) if names else None
        try:
            try:
                rsp = await self._open_at_meta(by_name if by_name is not None else inode_id, flags_sent, user)
            except PermissionDenied:
                if by_name is None:
                    raise
                # No search permission on that name's directory (then the caller came by another
                # name), or no permission on the file (then opening by inode says so again).
                by_name = None
                rsp = await self._open_at_meta(inode_id, flags_sent, user)
        except NotFound:
            if names and by_name is not None and by_name.path:
                self.names.stale(*names[0])
            raise _stale(f"inode {inode_id} is no longer where the kernel found it") from None
        if rsp.inode.type == mpb.DIRECTORY:
            raise IsADirectory(f"inode {inode_id} is a directory")
        return self._register(rsp, flags, f"inode:{inode_id}", asked_at, user), rsp.inode

    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     user: mpb.User) -> tuple[int, mpb.Inode]:
        self._forget(parent)
        asked_at = self._attr_changes
        rsp = await self._open_at_meta(name_ref(parent, name), flags | O_CREAT, user, mode=stat_mod.S_IMODE(mode))
        if rsp.created:  # a new file has no xattrs: its first write need not ask meta for a capability
            self._remember_no_capability(rsp.inode.inode_id)
        if rsp.HasField("parent"):
            # The directory as the create left it: the kernel asks for it right after (as after
            # an unlink), and this mount must see its own change without a round trip to meta.
            self._remember_change(rsp.parent, asked_at)
        self.names.saw(parent, name, rsp.inode)
        return self._register(rsp, flags, name.decode(errors="replace"), asked_at, user), rsp.inode

    async def open_inode(self, inode_id: int, flags: int, user: mpb.User) -> tuple[int, mpb.Inode]:
        """Open a file by its inode alone, for a caller that holds it open already.

        For a usrbio registration (:mod:`fs3.fuse.usrbio_server`): the process passed a descriptor
        of this mount, so the kernel resolved its path (and checked it) when it was opened; meta
        checks ``user``'s permission on the file itself here, as for every open. Only the access
        mode of ``flags`` counts: whatever else the descriptor's open did (create, truncate) is done.
        """
        asked_at = self._attr_changes
        access = flags & O_ACCMODE
        with _stale_if_gone(inode_id):
            rsp = await self.meta.open(inode_id, access, user=user)
        if rsp.inode.type == mpb.DIRECTORY:
            raise IsADirectory(f"inode {inode_id} is a directory")
        return self._register(rsp, access, f"inode:{inode_id}", asked_at, user, here=True), rsp.inode

    def file(self, fh: int) -> AsyncFile:
        """The open file behind handle ``fh`` (``BadHandle`` when there is none)."""
        return self._handle(fh).file

    @property
    def open_handles(self) -> int:
        """Open file handles of this mount (the kernel's and usrbio's)."""
        return len(self._handles)

    async def _still_names(self, parent: int, name: bytes, inode_id: int, user: mpb.User) -> bool:
        """Whether ``parent``/``name`` still leads to ``inode_id`` (True when the caller cannot
        search ``parent``: then it did not come by that name)."""
        try:
            found = await self.meta.lookup(name_ref(parent, name), user=user)
        except PermissionDenied:
            return True
        except NotFound:
            return False
        return found.inode_id == inode_id

    def _handle(self, fh: int) -> _Handle:
        handle = self._handles.get(fh)
        if handle is None:
            raise BadHandle(f"no open file handle {fh}")
        return handle

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._handle(fh)
        # Reads see what other handles of this mount wrote (the client library sees to it).
        async with handle.lock:
            return await handle.file.pread(offset, size)

    async def write(self, fh: int, offset: int, data: bytes | memoryview) -> int:
        handle = self._handle(fh)
        self._forget(handle.file.inode.inode_id)  # mtime and ctime change
        async with handle.lock:
            if handle.file.append:
                offset = handle.file.end_of_file()
            return await handle.file.pwrite(offset, data)

    async def flush(self, fh: int) -> None:
        """``close(2)`` of a descriptor: data to storage and the length to meta, before close returns.

        (The kernel sends ``release`` later, without waiting; an ``open`` right after ``close``
        must already see the new length: close-to-open consistency.)
        """
        handle = self._handle(fh)
        async with handle.lock:
            asked_at = self._attr_changes
            published = await handle.file.publish_length()
        if published is not None:
            self._remember(published, asked_at)

    async def fsync(self, fh: int) -> None:
        handle = self._handle(fh)
        self._forget(handle.file.inode.inode_id)
        async with handle.lock:
            await handle.file.fsync()

    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is None:
            return
        if handle.file.has_unpublished_writes:
            self._forget(handle.file.inode.inode_id)
        async with handle.lock:
            # The kernel sends release once close(2) has returned: the length went with the flush,
            # and the end of the session can go with others (see SessionCloses).
            await handle.file.close(gather_session_end=self.config.gather_session_ends)

    # -- directories -----------------------------------------------------------------------------

    async def opendir(self, inode_id: int, user: mpb.User) -> int:
        inode = await self.getattr(inode_id, user)
        if inode.type != mpb.DIRECTORY:
            raise NotADirectory(f"inode {inode_id} is not a directory")
        dh = next(self._ids)
        self._dirs[dh] = DirHandle(inode_id, user)
        return dh

    async def readdir(self, dh: int, index: int) -> list[tuple[int, mpb.DirEntry]]:
        """Entries from position ``index`` on, each with the position that follows it."""
        handle = self._dirs.get(dh)
        if handle is None:
            raise BadHandle(f"no open directory handle {dh}")
        if index >= len(handle.entries) and handle.more:
            start_after = handle.entries[-1].name if handle.entries else b""
            asked_at = self._attr_changes
            page = await self.meta.read_dir(handle.inode_id, start_after=start_after, limit=_READDIR_PAGE,
                                            with_attrs=True, user=handle.user)
            handle.entries.extend(page.entries)
            for entry in page.entries:
                if entry.attrs.inode_id:
                    self._remember(mpb.Inode.FromString(entry.attrs.SerializeToString()), asked_at)
                    self.names.saw(handle.inode_id, entry.name, entry.attrs)  # the kernel reads entries "plus"
            handle.more = page.more and bool(page.entries)
        for entry in handle.entries[index:]:
            if entry.attrs.inode_id:
                entry.attrs.CopyFrom(self._with_local_length(entry.attrs))
        return [(i + 1, handle.entries[i]) for i in range(index, len(handle.entries))]

    def releasedir(self, dh: int) -> None:
        self._dirs.pop(dh, None)

    # -- xattrs ----------------------------------------------------------------------------------

    async def getxattr(self, inode_id: int, name: bytes, user: mpb.User) -> bytes:
        """Get one attribute; a recent "no capability" answer is reused for the attribute cache's time.

        The kernel asks for ``security.capability`` before every write; a meta round trip per
        4 KiB write was an eighth of the mount's time on random writes. The answer is kept as long
        as the kernel keeps attributes, and dropped when this mount changes the inode's xattrs.
        """
        capability = name == _CAPABILITY_XATTR
        now = asyncio.get_running_loop().time()
        if capability:
            remembered = self._no_capability_until.get(inode_id, 0.0) > now
            self.fs.metrics.cache("xattr", remembered)
            if remembered:
                raise NoXattr("no such attribute")
        await self.fs.session_closes.settle(inode_id)
        try:
            with _stale_if_gone(inode_id):
                value = await self.meta.get_xattr(inode_id, name, user=user)
        except NoXattr:
            if capability:
                self._remember_no_capability(inode_id)
            raise
        return bytes(value)

    def _remember_no_capability(self, inode_id: int) -> None:
        if len(self._no_capability_until) > 100_000:
            self._no_capability_until.clear()
        self._no_capability_until[inode_id] = asyncio.get_running_loop().time() + self.config.attr_timeout_s

    async def setxattr(self, inode_id: int, name: bytes, value: bytes, flags: int, user: mpb.User) -> None:
        self._no_capability_until.pop(inode_id, None)
        self._forget(inode_id)
        await self.fs.session_closes.settle(inode_id)
        with _stale_if_gone(inode_id):
            await self.meta.set_xattr(inode_id, name, value, flags=flags, user=user)

    async def listxattr(self, inode_id: int, user: mpb.User) -> list[bytes]:
        await self.fs.session_closes.settle(inode_id)
        with _stale_if_gone(inode_id):
            names = await self.meta.list_xattr(inode_id, user=user)
        return [bytes(n) for n in names]

    async def removexattr(self, inode_id: int, name: bytes, user: mpb.User) -> None:
        self._no_capability_until.pop(inode_id, None)
        self._forget(inode_id)
        await self.fs.session_closes.settle(inode_id)
        with _stale_if_gone(inode_id):
            await self.meta.remove_xattr(inode_id, name, user=user)

    async def close(self) -> None:
        """Release every handle (unmount)."""
        for fh in list(self._handles):
            try:
                await self.release(fh)
            except Exception:  # keep releasing the rest; meta prunes what is left with the lease
                continue
        self._dirs.clear()


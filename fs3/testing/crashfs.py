"""CrashFS: a FUSE file system that forgets what was never synced, for power-loss tests.

A process killed with SIGKILL loses nothing the kernel already has — the page cache survives it —
so a crash test that only kills processes cannot see a missing fsync. CrashFS (in the manner of
Jepsen's LazyFS) sits over a backing directory and keeps, next to the file system as it is, the
file system a power loss would leave: on a *power cut* everything written after the last sync is
dropped, file contents and directory entries alike. RocksDB and the chunk files run on it
unmodified, so a crash test can kill its processes, cut the power and restart them on what a real
disk would have kept.

The model is strict POSIX (a real file system may keep more, never less):

* a file's bytes and size are durable as of its last ``fsync``/``fdatasync``;
* a directory's entries (name -> inode) are durable as of its last ``fsync`` of the directory; a
  new directory has no durable entries; a file or directory that no durable entry reaches from
  the root is gone after a power cut — created, renamed and unlinked names whose directory was
  not synced are rolled back, an unlinked file coming back with its durable contents;
* attributes other than the size (mode, owner, times) count as durable at once.

How: file contents live in backing files named by inode number, written through. Before a write
or a truncate changes bytes of a file's durable contents, those bytes are saved (each at most once
per sync interval), so a power cut restores the durable contents by truncating the backing file to
the durable size and writing the saved ranges back. The namespace lives in memory, two entry maps
per directory (now, durable). Every request handler is synchronous on one event loop, so each
request, and the power cut itself, is atomic. Caches in the kernel are off (zero entry and
attribute timeouts, direct I/O), so what a process sees after a power cut is what CrashFS has.

Run it as a child process: ``python -m fs3.testing.crashfs BACKING MOUNTPOINT``. It prints one
JSON line once mounted and then answers one JSON line per command read from stdin: ``crash`` (cut
the power), ``sync`` (everything durable, as ``sync(2)``), ``reset`` (empty again), ``stats``,
``quit``. Kill every process that uses the mount before a ``crash``: the
power cut makes every open file handle fail with EIO. :class:`CrashDisk` drives it from a test.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import errno
import json
import logging
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["CrashDisk", "CrashFS"]

log = logging.getLogger("fs3.crashfs")

ROOT_INODE = 1
_ATTR_TIMEOUT_S = 0.0
_NAME_MAX = 255


@dataclass
class _Node:
    ino: int
    mode: int  # with the type bits
    uid: int
    gid: int
    rdev: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    links: int = 0  # entries naming it now
    durable_refs: int = 0  # durable entries naming it (in any directory, reachable or not)
    lookups: int = 0  # the kernel's lookup count
    opens: int = 0
    # Directories: entries now, and as a power cut would leave them; the parent now.
    entries: dict[bytes, int] = field(default_factory=dict)
    durable: dict[bytes, int] = field(default_factory=dict)
    parent: int = 0
    # Regular files: size now and durable; the durable bytes saved before they were changed, as
    # sorted, disjoint (offset, bytes) ranges; the backing file's descriptor while open.
    size: int = 0
    durable_size: int = 0
    saved: list[tuple[int, bytes]] = field(default_factory=list)
    fd: int = -1
    target: bytes = b""  # symbolic links

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.mode)


class _Error(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(os.strerror(code))
        self.errno = code


class CrashFS:
    """The file system itself, without FUSE: every operation is a plain synchronous method.

    :class:`_Operations` adapts it to pyfuse3; keeping the model apart lets it be read (and
    reasoned about) on its own. Errors are raised as :class:`_Error` with an errno.
    """

    def __init__(self, backing: Path) -> None:
        self.backing = backing
        backing.mkdir(parents=True, exist_ok=True)
        for leftover in backing.iterdir():  # a previous run's files: this run starts empty
            leftover.unlink()
        now = time.time_ns()
        root = _Node(ROOT_INODE, stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), atime_ns=now, mtime_ns=now,
                     ctime_ns=now, links=1, durable_refs=1, parent=ROOT_INODE)
        self.nodes: dict[int, _Node] = {ROOT_INODE: root}
        self._next_ino = ROOT_INODE + 1
        self._handles: dict[int, tuple[int, int]] = {}  # handle -> (inode, power-cut epoch)
        self._dir_handles: dict[int, tuple[int, list[tuple[bytes, int]], int]] = {}  # inode, listing, epoch
        self._next_handle = 1
        self.epoch = 0
        self.power_cuts = 0
        self.file_syncs = 0
        self.dir_syncs = 0

    # -- helpers ---------------------------------------------------------------------------------

    def node(self, ino: int) -> _Node:
        node = self.nodes.get(ino)
        if node is None:
            raise _Error(errno.ESTALE)
        return node

    def _dir(self, ino: int) -> _Node:
        node = self.node(ino)
        if not node.is_dir:
            raise _Error(errno.ENOTDIR)
        return node

    def _path(self, ino: int) -> Path:
        return self.backing / str(ino)

    def _new_node(self, mode: int, uid: int, gid: int, rdev: int = 0) -> _Node:
        now = time.time_ns()
        node = _Node(self._next_ino, mode, uid, gid, rdev, now, now, now)
        self._next_ino += 1
        self.nodes[node.ino] = node
        if node.is_file:
            self._path(node.ino).touch()
        return node

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > _NAME_MAX:
            raise _Error(errno.ENAMETOOLONG)
        if not name or b"/" in name or name in (b".", b".."):
            raise _Error(errno.EINVAL)

    def _link(self, parent: _Node, name: bytes, node: _Node) -> None:
        parent.entries[name] = node.ino
        node.links += 1
        if node.is_dir:
            node.parent = parent.ino
        parent.mtime_ns = parent.ctime_ns = time.time_ns()

    def _unlink(self, parent: _Node, name: bytes) -> _Node:
        node = self.nodes[parent.entries.pop(name)]
        node.links -= 1
        node.ctime_ns = parent.mtime_ns = parent.ctime_ns = time.time_ns()
        self._collect(node)
        return node

    def _collect(self, node: _Node) -> None:
        """Free what nothing can reach again: no entry now, none a power cut would bring back,
        not open. The node itself stays while the kernel still knows it (its lookup count)."""
        if node.ino == ROOT_INODE or node.links or node.durable_refs or node.opens:
            return
        if node.is_file and node.ino in self.nodes:
            with contextlib.suppress(FileNotFoundError):
                self._path(node.ino).unlink()
        if node.is_dir:
            durable, node.durable = node.durable, {}
            for child in durable.values():
                self._drop_durable_ref(child)
        if not node.lookups:
            self.nodes.pop(node.ino, None)

    def _drop_durable_ref(self, ino: int) -> None:
        child = self.nodes.get(ino)
        if child is not None:
            child.durable_refs -= 1
            self._collect(child)

    def _save_durable(self, node: _Node, start: int, end: int) -> None:
        """Keep the durable bytes in [start, end) that a write or truncate is about to change
        (only those not kept already: the first copy is the durable one)."""
        end = min(end, node.durable_size)
        if start >= end:
            return
        saved = node.saved
        index = bisect.bisect_left(saved, (start, b""))
        if index and saved[index - 1][0] + len(saved[index - 1][1]) > start:
            index -= 1
        gaps: list[tuple[int, int]] = []
        cursor = start
        while cursor < end and index < len(saved):
            offset, data = saved[index]
            if offset >= end:
                break
            if offset > cursor:
                gaps.append((cursor, offset))
            cursor = max(cursor, offset + len(data))
            index += 1
        if cursor < end:
            gaps.append((cursor, end))
        if not gaps:
            return
        fd = os.open(self._path(node.ino), os.O_RDONLY)
        try:
            for gap_start, gap_end in gaps:
                data = os.pread(fd, gap_end - gap_start, gap_start)
                data += bytes(gap_end - gap_start - len(data))  # (past the end now: zeros)
                bisect.insort(saved, (gap_start, data))
        finally:
            os.close(fd)

    # -- namespace -------------------------------------------------------------------------------

    def lookup(self, parent_ino: int, name: bytes) -> _Node:
        parent = self._dir(parent_ino)
        if name == b".":
            node = parent
        elif name == b"..":
            node = self.node(parent.parent)
        else:
            ino = parent.entries.get(name)
            if ino is None:
                raise _Error(errno.ENOENT)
            node = self.nodes[ino]
        node.lookups += 1
        return node

    def forget(self, ino: int, count: int) -> None:
        node = self.nodes.get(ino)
        if node is None:
            return
        node.lookups = max(0, node.lookups - count)
        if not node.lookups and not node.links and not node.durable_refs and not node.opens \
                and node.ino != ROOT_INODE:
            self.nodes.pop(ino, None)

    def make(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0,
             target: bytes = b"") -> _Node:
        parent = self._dir(parent_ino)
        self._check_name(name)
        if name in parent.entries:
            raise _Error(errno.EEXIST)
        kind = stat.S_IFMT(mode)
        if kind not in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK):
            raise _Error(errno.EPERM)  # devices, fifos and sockets: not needed by what runs here
        node = self._new_node(mode, uid, gid, rdev)
        node.target = target
        self._link(parent, name, node)
        node.lookups += 1
        return node

    def create(self, parent_ino: int, name: bytes, mode: int, flags: int, uid: int, gid: int) -> tuple[_Node, int]:
        """``open(O_CREAT)``: a new file, or the existing one unless ``O_EXCL``; a handle to it."""
        existing = self._dir(parent_ino).entries.get(name)
        if existing is None:
            node = self.make(parent_ino, name, stat.S_IFREG | stat.S_IMODE(mode), uid, gid)
        elif flags & os.O_EXCL:
            raise _Error(errno.EEXIST)
        else:
            node = self.lookup(parent_ino, name)
        handle = self.open(node.ino)
        if existing is not None and flags & os.O_TRUNC:
            self.truncate(node.ino, 0)
        return node, handle

    def link(self, ino: int, parent_ino: int, name: bytes) -> _Node:
        node = self.node(ino)
        parent = self._dir(parent_ino)
        self._check_name(name)
        if node.is_dir:
            raise _Error(errno.EPERM)
        if name in parent.entries:
            raise _Error(errno.EEXIST)
        self._link(parent, name, node)
        node.lookups += 1
        return node

    def unlink(self, parent_ino: int, name: bytes) -> None:
        parent = self._dir(parent_ino)
        ino = parent.entries.get(name)
        if ino is None:
            raise _Error(errno.ENOENT)
        if self.nodes[ino].is_dir:
            raise _Error(errno.EISDIR)
        self._unlink(parent, name)

    def rmdir(self, parent_ino: int, name: bytes) -> None:
        parent = self._dir(parent_ino)
        ino = parent.entries.get(name)
        if ino is None:
            raise _Error(errno.ENOENT)
        node = self.nodes[ino]
        if not node.is_dir:
            raise _Error(errno.ENOTDIR)
        if node.entries:
            raise _Error(errno.ENOTEMPTY)
        self._unlink(parent, name)

    def rename(self, old_parent_ino: int, old_name: bytes, new_parent_ino: int, new_name: bytes,
               noreplace: bool = False, exchange: bool = False) -> None:
        old_parent, new_parent = self._dir(old_parent_ino), self._dir(new_parent_ino)
        self._check_name(new_name)
        ino = old_parent.entries.get(old_name)
        if ino is None:
            raise _Error(errno.ENOENT)
        node = self.nodes[ino]
        other_ino = new_parent.entries.get(new_name)
        if exchange:
            if other_ino is None:
                raise _Error(errno.ENOENT)
            other = self.nodes[other_ino]
            old_parent.entries[old_name], new_parent.entries[new_name] = other_ino, ino
            if node.is_dir:
                node.parent = new_parent.ino
            if other.is_dir:
                other.parent = old_parent.ino
            return
        if other_ino == ino:
            return
        if node.is_dir:
            cursor = new_parent
            while cursor.ino != ROOT_INODE:  # into its own subtree
                if cursor.ino == ino:
                    raise _Error(errno.EINVAL)
                cursor = self.nodes[cursor.parent]
        if other_ino is not None:
            if noreplace:
                raise _Error(errno.EEXIST)
            other = self.nodes[other_ino]
            if other.is_dir and not node.is_dir:
                raise _Error(errno.EISDIR)
            if node.is_dir and not other.is_dir:
                raise _Error(errno.ENOTDIR)
            if other.is_dir and other.entries:
                raise _Error(errno.ENOTEMPTY)
            self._unlink(new_parent, new_name)
        del old_parent.entries[old_name]
        node.links -= 1
        self._link(new_parent, new_name, node)

    def list_dir(self, ino: int) -> list[tuple[bytes, int]]:
        return sorted(self._dir(ino).entries.items())

    # -- files -----------------------------------------------------------------------------------

    def open(self, ino: int) -> int:
        node = self.node(ino)
        if node.is_dir:
            raise _Error(errno.EISDIR)
        if not node.is_file:
            raise _Error(errno.EINVAL)
        if node.fd < 0:
            node.fd = os.open(self._path(ino), os.O_RDWR)
        node.opens += 1
        handle = self._next_handle
        self._next_handle += 1
        self._handles[handle] = (ino, self.epoch)
        return handle

    def _open_node(self, handle: int) -> _Node:
        entry = self._handles.get(handle)
        if entry is None or entry[1] != self.epoch:
            raise _Error(errno.EIO)  # opened before a power cut
        return self.nodes[entry[0]]

    def release(self, handle: int) -> None:
        entry = self._handles.pop(handle, None)
        if entry is None or entry[1] != self.epoch:
            return
        node = self.nodes[entry[0]]
        node.opens -= 1
        if not node.opens and node.fd >= 0:
            os.close(node.fd)
            node.fd = -1
        self._collect(node)

    def read(self, handle: int, offset: int, size: int) -> bytes:
        node = self._open_node(handle)
        return os.pread(node.fd, size, offset)

    def write(self, handle: int, offset: int, data: bytes) -> int:
        node = self._open_node(handle)
        self._save_durable(node, offset, offset + len(data))
        written = os.pwrite(node.fd, data, offset)
        node.size = max(node.size, offset + written)
        node.mtime_ns = node.ctime_ns = time.time_ns()
        return written

    def truncate(self, ino: int, size: int) -> None:
        node = self.node(ino)
        if not node.is_file:
            raise _Error(errno.EISDIR if node.is_dir else errno.EINVAL)
        if size < node.size:
            self._save_durable(node, size, node.size)
        os.truncate(self._path(ino), size)
        node.size = size
        node.mtime_ns = node.ctime_ns = time.time_ns()

    def sync_file(self, handle: int) -> None:
        node = self._open_node(handle)
        node.durable_size = node.size
        node.saved = []
        self.file_syncs += 1

    def sync_dir(self, ino: int) -> None:
        node = self._dir(ino)
        old, node.durable = node.durable, dict(node.entries)
        for child in node.durable.values():
            self.nodes[child].durable_refs += 1
        for child in old.values():
            self._drop_durable_ref(child)
        self.dir_syncs += 1

    # -- the power cut ---------------------------------------------------------------------------

    def power_cut(self) -> dict[str, int]:
        """Leave only what was synced: contents, sizes and directory entries; free the rest."""
        self.power_cuts += 1
        self.epoch += 1
        self._handles.clear()
        self._dir_handles.clear()
        restored_bytes = 0
        for node in self.nodes.values():
            if node.fd >= 0:
                os.close(node.fd)
                node.fd = -1
            node.opens = 0
            if node.is_file and self._path(node.ino).exists():
                if node.size != node.durable_size or node.saved:
                    os.truncate(self._path(node.ino), node.durable_size)
                    fd = os.open(self._path(node.ino), os.O_WRONLY)
                    try:
                        for offset, data in node.saved:
                            os.pwrite(fd, data, offset)
                            restored_bytes += len(data)
                    finally:
                        os.close(fd)
                node.size, node.saved = node.durable_size, []
            if node.is_dir:
                node.entries = dict(node.durable)
            node.links = 0
        # What the root still reaches, through durable entries only.
        reachable = {ROOT_INODE}
        stack = [self.nodes[ROOT_INODE]]
        self.nodes[ROOT_INODE].links = 1
        while stack:
            directory = stack.pop()
            for ino in directory.entries.values():
                child = self.nodes[ino]
                child.links += 1
                if ino not in reachable:
                    reachable.add(ino)
                    if child.is_dir:
                        child.parent = directory.ino
                        stack.append(child)
        lost = 0
        for ino in list(self.nodes):
            if ino in reachable:
                continue
            lost += 1
            node = self.nodes.pop(ino)
            if node.is_file:
                with contextlib.suppress(FileNotFoundError):
                    self._path(ino).unlink()
        # Only reachable directories' durable entries count from now on.
        for node in self.nodes.values():
            node.durable_refs = 0
        self.nodes[ROOT_INODE].durable_refs = 1
        for node in self.nodes.values():
            for ino in node.durable.values():
                self.nodes[ino].durable_refs += 1
        # The kernel still knows inodes by number; those gone answer ESTALE, the rest start afresh.
        for node in self.nodes.values():
            node.lookups = 0
        return {"power_cuts": self.power_cuts, "lost_inodes": lost, "restored_bytes": restored_bytes}

    def reset(self) -> dict[str, int]:
        """Start over with an empty, synced file system (one mount shared by many tests)."""
        self.epoch += 1
        self._handles.clear()
        self._dir_handles.clear()
        for node in self.nodes.values():
            if node.fd >= 0:
                os.close(node.fd)
            if node.is_file:
                with contextlib.suppress(FileNotFoundError):
                    self._path(node.ino).unlink()
        root = self.nodes[ROOT_INODE]
        root.entries, root.durable = {}, {}
        self.nodes = {ROOT_INODE: root}
        self.power_cuts = self.file_syncs = self.dir_syncs = 0
        return self.stats()

    def sync_all(self) -> dict[str, int]:
        """``sync(2)``: everything written so far becomes durable (a test's quiescent setup)."""
        for node in list(self.nodes.values()):
            if node.is_file:
                node.durable_size, node.saved = node.size, []
            if node.is_dir and node.entries != node.durable:
                self.sync_dir(node.ino)
        return self.stats()

    def stats(self) -> dict[str, int]:
        return {"power_cuts": self.power_cuts, "inodes": len(self.nodes), "file_syncs": self.file_syncs,
                "dir_syncs": self.dir_syncs,
                "unsynced_files": sum(1 for n in self.nodes.values()
                                      if n.is_file and (n.size != n.durable_size or n.saved)),
                "unsynced_dirs": sum(1 for n in self.nodes.values() if n.is_dir and n.entries != n.durable)}

    # -- directory handles -----------------------------------------------------------------------

    def opendir(self, ino: int) -> int:
        listing = self.list_dir(ino)
        handle = self._next_handle
        self._next_handle += 1
        self._dir_handles[handle] = (ino, listing, self.epoch)
        return handle

    def _dir_handle(self, handle: int) -> tuple[int, list[tuple[bytes, int]]]:
        entry = self._dir_handles.get(handle)
        if entry is None or entry[2] != self.epoch:
            raise _Error(errno.EIO)  # opened before a power cut
        return entry[0], entry[1]

    def dir_listing(self, handle: int) -> list[tuple[bytes, int]]:
        """The entries as they were when the directory was opened (a stable listing to page through)."""
        return self._dir_handle(handle)[1]

    def sync_dir_handle(self, handle: int) -> None:
        self.sync_dir(self._dir_handle(handle)[0])

    def releasedir(self, handle: int) -> None:
        self._dir_handles.pop(handle, None)


def _operations(fs: CrashFS) -> Any:
    """pyfuse3 ``Operations`` over ``fs`` (built here so that importing this module needs no pyfuse3)."""
    import pyfuse3

    def attributes(node: _Node) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = node.ino
        attr.generation = 0
        attr.entry_timeout = _ATTR_TIMEOUT_S
        attr.attr_timeout = _ATTR_TIMEOUT_S
        attr.st_mode = node.mode
        attr.st_nlink = 2 if node.is_dir else max(node.links, 0)
        attr.st_uid = node.uid
        attr.st_gid = node.gid
        attr.st_rdev = node.rdev
        attr.st_size = node.size if node.is_file else len(node.target) if stat.S_ISLNK(node.mode) else 0
        attr.st_blksize = 4096
        attr.st_blocks = -(-attr.st_size // 512)
        attr.st_atime_ns = node.atime_ns
        attr.st_mtime_ns = node.mtime_ns
        attr.st_ctime_ns = node.ctime_ns
        return attr

    def fuse_errors(fn: Any) -> Any:
        async def wrapper(*args: Any) -> Any:
            try:
                return fn(*args)
            except _Error as exc:
                raise pyfuse3.FUSEError(exc.errno) from None
            except OSError as exc:
                log.warning("%s: %s", fn.__name__, exc)
                raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None

        wrapper.__name__ = fn.__name__
        return wrapper

    class Operations(pyfuse3.Operations):
        enable_writeback_cache = False

        @fuse_errors
        def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
            return attributes(fs.lookup(parent_inode, name))

        async def forget(self, inode_list: Any) -> None:
            for ino, count in inode_list:
                fs.forget(ino, count)

        @fuse_errors
        def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
            return attributes(fs.node(inode))

        @fuse_errors
        def setattr(self, inode: int, attr: Any, fields: Any, fh: int | None, ctx: Any) -> pyfuse3.EntryAttributes:
            node = fs.node(inode)
            if fields.update_size:
                fs.truncate(inode, attr.st_size)
            if fields.update_mode:
                node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
            if fields.update_uid:
                node.uid = attr.st_uid
            if fields.update_gid:
                node.gid = attr.st_gid
            if fields.update_atime:
                node.atime_ns = attr.st_atime_ns
            if fields.update_mtime:
                node.mtime_ns = attr.st_mtime_ns
            node.ctime_ns = time.time_ns()
            return attributes(node)

        @fuse_errors
        def readlink(self, inode: int, ctx: Any) -> bytes:
            return fs.node(inode).target

        @fuse_errors
        def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> pyfuse3.EntryAttributes:
            return attributes(fs.make(parent_inode, name, mode, ctx.uid, ctx.gid, rdev))

        @fuse_errors
        def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
            return attributes(fs.make(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode), ctx.uid, ctx.gid))

        @fuse_errors
        def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
            return attributes(fs.make(parent_inode, name, stat.S_IFLNK | 0o777, ctx.uid, ctx.gid, target=target))

        @fuse_errors
        def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
            return attributes(fs.link(inode, new_parent_inode, new_name))

        @fuse_errors
        def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
            fs.unlink(parent_inode, name)

        @fuse_errors
        def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
            fs.rmdir(parent_inode, name)

        @fuse_errors
        def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                   flags: int, ctx: Any) -> None:
            fs.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                      noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE), exchange=bool(flags & pyfuse3.RENAME_EXCHANGE))

        @fuse_errors
        def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
            handle = fs.open(inode)
            if flags & os.O_TRUNC:
                fs.truncate(inode, 0)
            return pyfuse3.FileInfo(fh=handle, direct_io=True, keep_cache=False)

        @fuse_errors
        def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                   ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
            node, handle = fs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
            return pyfuse3.FileInfo(fh=handle, direct_io=True, keep_cache=False), attributes(node)

        @fuse_errors
        def read(self, fh: int, off: int, size: int) -> bytes:
            return fs.read(fh, off, size)

        @fuse_errors
        def write(self, fh: int, off: int, buf: bytes) -> int:
            return fs.write(fh, off, buf)

        async def flush(self, fh: int) -> None:
            return None

        @fuse_errors
        def fsync(self, fh: int, datasync: bool) -> None:
            fs.sync_file(fh)

        async def release(self, fh: int) -> None:
            fs.release(fh)

        @fuse_errors
        def opendir(self, inode: int, ctx: Any) -> int:
            return fs.opendir(inode)

        @fuse_errors
        def readdir(self, fh: int, start_id: int, token: Any) -> None:
            listing = fs.dir_listing(fh)
            for index in range(start_id, len(listing)):
                name, ino = listing[index]
                node = fs.nodes.get(ino)
                if node is None:
                    continue
                if not pyfuse3.readdir_reply(token, name, attributes(node), index + 1):
                    return
                node.lookups += 1

        async def releasedir(self, fh: int) -> None:
            fs.releasedir(fh)

        @fuse_errors
        def fsyncdir(self, fh: int, datasync: bool) -> None:
            fs.sync_dir_handle(fh)

        @fuse_errors
        def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
            backing = os.statvfs(fs.backing)
            data = pyfuse3.StatvfsData()
            for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
                         "f_favail"):
                setattr(data, name, getattr(backing, name))
            data.f_namemax = _NAME_MAX
            return data

    return Operations()


async def _serve(backing: Path, mountpoint: Path) -> None:
    import pyfuse3

    fs = CrashFS(backing)
    ops = _operations(fs)
    options = set(pyfuse3.default_options) | {"fsname=crashfs", "subtype=crashfs"}
    options.discard("default_permissions")  # one user: no permission checks at all
    pyfuse3.init(ops, str(mountpoint), options)
    loop = asyncio.get_running_loop()
    default_handler = loop.default_exception_handler

    def quiet_shutdown(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # pyfuse3's asyncio layer completes a read future twice when the session ends: harmless.
        if not isinstance(context.get("exception"), asyncio.InvalidStateError):
            default_handler(context)

    loop.set_exception_handler(quiet_shutdown)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def answer(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    async def control() -> None:
        while True:
            line = (await reader.readline()).decode().strip()
            if not line or line == "quit":
                break
            if line == "crash":
                answer(fs.power_cut())
            elif line == "reset":
                answer(fs.reset())
            elif line == "sync":
                answer(fs.sync_all())
            elif line == "stats":
                answer(fs.stats())
            else:
                answer({"error": f"unknown command {line!r} (known: crash, sync, reset, stats, quit)"})
        pyfuse3.terminate()

    answer({"ready": True, "pid": os.getpid(), "mountpoint": str(mountpoint)})
    commands = asyncio.create_task(control())
    try:
        await pyfuse3.main(max_tasks=16)
    finally:
        commands.cancel()
        pyfuse3.close(unmount=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fs3.testing.crashfs", description=__doc__.split("\n")[0])
    parser.add_argument("backing", type=Path, help="directory that holds the file contents (emptied)")
    parser.add_argument("mountpoint", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import pyfuse3.asyncio as pyfuse3_asyncio

    pyfuse3_asyncio.enable()
    asyncio.run(_serve(args.backing.resolve(), args.mountpoint.resolve()))
    return 0


class CrashDisk:
    """A CrashFS mount driven from a test: ``with CrashDisk(tmp) as disk: ... disk.power_cut()``.

    ``disk.path`` is the mount point. The daemon runs as a child process; :meth:`power_cut` sends
    it ``crash`` and returns its report once the file system is rolled back.
    """

    def __init__(self, root: Path, start_timeout_s: float = 30.0) -> None:
        self.root = root.resolve()
        self.path = self.root / "mnt"
        self.backing = self.root / "backing"
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._stdin: IO[bytes] | None = None
        self._stdout: IO[bytes] | None = None

    def __enter__(self) -> CrashDisk:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        log_path = self.root / "crashfs.log"
        with log_path.open("ab") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "fs3.testing.crashfs", str(self.backing), str(self.path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin, self._stdout = self._proc.stdin, self._proc.stdout
        ready = self._read_answer()
        if not ready.get("ready"):
            raise RuntimeError(f"crashfs did not start: {ready}")

    def _read_answer(self) -> dict[str, Any]:
        assert self._stdout is not None and self._proc is not None
        line = self._stdout.readline()
        if not line:
            self._proc.wait(timeout=self.start_timeout_s)
            tail = (self.root / "crashfs.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"crashfs exited with {self._proc.returncode}:\n{tail}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _command(self, command: str) -> dict[str, Any]:
        if self._stdin is None:
            raise RuntimeError("crashfs is not running")
        self._stdin.write(command.encode() + b"\n")
        self._stdin.flush()
        answer = self._read_answer()
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def power_cut(self) -> dict[str, Any]:
        """Drop everything not synced. Every process using the mount must be dead (killed and
        reaped) first: a request a live process has in flight would land after the cut."""
        return self._command("crash")

    def sync(self) -> dict[str, Any]:
        """Make everything written so far durable, as ``sync(2)`` would."""
        return self._command("sync")

    def reset(self) -> dict[str, Any]:
        """Empty the file system (every process using it must be gone, as for a power cut)."""
        return self._command("reset")

    def stats(self) -> dict[str, Any]:
        return self._command("stats")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert self._stdin is not None
            self._stdin.write(b"quit\n")
            self._stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if self._stdout is not None:
            self._stdout.close()
        if os.path.ismount(self.path) or _dead_mount(self.path):
            subprocess.run(["fusermount3", "-uz", str(self.path)], check=False, capture_output=True)


def _dead_mount(path: Path) -> bool:
    try:
        os.stat(path)
        return False
    except OSError as exc:
        return exc.errno == errno.ENOTCONN


if __name__ == "__main__":
    sys.exit(main())

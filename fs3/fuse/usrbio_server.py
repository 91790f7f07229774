"""The mount daemon's side of :mod:`fs3.usrbio`: rings and shared buffers served beside FUSE.

One Unix socket per mount (``SOCK_SEQPACKET``, under ``/run/fs3`` for a root daemon, named by
the mount's device: see :func:`fs3.usrbio.socket_candidates`); one connection per
:class:`~fs3.usrbio.IoRing`. The kernel says who connected (``SO_PEERCRED``: pid, uid, gid; the
supplementary groups come from ``/proc/<pid>/status`` at once), and every file the connection
registers is a descriptor of this mount passed with ``SCM_RIGHTS``: its inode and access mode
are read from the descriptor (the kernel resolved and checked its path), and the file is opened
again through the :class:`~fs3.vfs.Vfs` *as that user* — meta checks the permission as for a
FUSE open, so a ring never reads or writes what its user could not.

A submit doorbell hands over a batch: entries are checked one by one (a bad one completes with
``-errno``, see :func:`check_entry`), writes go through the handle's ``pwrite`` in order and the
file's length is published before they complete (an ``open`` afterwards sees it, as after a
``close``), and all reads of the batch are cut into chunk pieces and fetched with
:meth:`~fs3.client.storage_client.StorageClient.read_pieces` — one ``BatchRead`` per storage
node — whose answers are copied once, straight into the shared buffer. Completions go to the
completion queue, then one doorbell wakes the application.

Everything is bounded: rings per process and in all, entries per ring (the application cannot
have more in flight than its ring holds, or the connection is dropped), buffers and files per
ring, bytes per storage call. A connection that closes — the process exited or died — has its
batches cancelled, its files closed and its mappings dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import itertools
import json
import logging
import mmap
import os
import socket
import stat
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from fs3 import meta_pb2 as mpb
from fs3.client.read_many import plan_pieces
from fs3.client.storage_client import PieceRead
from fs3.common.errors import FS3Error
from fs3.usrbio import (
    CQ_HEAD_AT,
    CQ_TAIL_AT,
    CQE,
    DOORBELL_COMPLETE,
    DOORBELL_SUBMIT,
    FILES_PER_RING_MAX,
    HEADER_BYTES,
    INDEX_MASK,
    IOV_BYTES_MAX,
    IOVS_PER_RING_MAX,
    OP_READ,
    OP_WRITE,
    RING_ENTRIES_MAX,
    SQ_HEAD_AT,
    SQ_TAIL_AT,
    SQE,
    Sqe,
    ring_bytes,
    socket_name,
)
from fs3.vfs import Vfs

__all__ = ["RegisteredFile", "UsrbioLimits", "UsrbioServer", "check_entry", "default_socket_dir", "peer_credentials"]

log = logging.getLogger(__name__)

_U32 = struct.Struct("<I")
_MESSAGE_BYTES_MAX = 4096
_FDS_PER_MESSAGE_MAX = 4
_MESSAGES_PER_WAKEUP_MAX = 256   # one connection cannot hold the event loop for longer
_CONTROLS_PENDING_MAX = 4
_FD_THREADS = 4
# Where a file offset may reach (the largest file any layout allows is far below).
FILE_OFFSET_MAX = 1 << 62


@dataclass(frozen=True)
class UsrbioLimits:
    rings_per_process: int = 64
    rings_max: int = 1024
    # Bytes of reads handed to storage in one call; a larger batch is served in several.
    batch_bytes_max: int = 256 << 20


@dataclass(frozen=True, slots=True)
class RegisteredFile:
    fh: int
    inode_id: int
    readable: bool
    writable: bool


def check_entry(entry: Sqe, files: Mapping[int, RegisteredFile], iov_sizes: Mapping[int, int]) -> int:
    """0 when ``entry`` can be served, else the errno it completes with (nothing else is hurt).

    ``EINVAL``: an unknown op, a negative offset, length or buffer offset, a range past the
    largest file offset; ``EBADF``: a file id not registered, or registered without the access
    the op needs; ``EFAULT``: a buffer id not registered, or a range outside its buffer.
    """
    if entry.op not in (OP_READ, OP_WRITE):
        return errno.EINVAL
    if entry.offset < 0 or entry.length < 0 or entry.iov_offset < 0:
        return errno.EINVAL
    if entry.offset + entry.length > FILE_OFFSET_MAX:
        return errno.EFBIG if entry.op == OP_WRITE else errno.EINVAL
    registered = files.get(entry.file_id)
    if registered is None:
        return errno.EBADF
    if not (registered.readable if entry.op == OP_READ else registered.writable):
        return errno.EBADF
    size = iov_sizes.get(entry.iov_id)
    if size is None or entry.iov_offset + entry.length > size:
        return errno.EFAULT
    return 0


def default_socket_dir() -> Path:
    """``/run/fs3`` for a root daemon; ``/tmp/fs3-usrbio-<uid>`` (0700) otherwise."""
    return Path("/run/fs3") if os.geteuid() == 0 else Path(f"/tmp/fs3-usrbio-{os.geteuid()}")


def _groups_of(pid: int, uid: int) -> list[int]:
    """The supplementary groups of ``pid`` (``Groups:`` in /proc/<pid>/status) while its effective
    uid is still ``uid``; [] when it is gone or is another user's process now (a reused pid)."""
    try:
        groups: list[int] = []
        euid = None
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                groups = sorted(int(g) for g in line.split()[1:])
            elif line.startswith("Uid:"):
                euid = int(line.split()[2])
        return groups if euid == uid else []
    except (OSError, ValueError, IndexError):
        return []


_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13
_GID = struct.Struct("=I")


def peer_credentials(sock: socket.socket) -> tuple[int, mpb.User]:
    """The pid and the user of the process that connected ``sock``, as the kernel saw them at
    ``connect``: uid and gid from ``SO_PEERCRED``, supplementary groups from ``SO_PEERGROUPS``.

    Not /proc/<pid>/status at accept: by then the process may have changed its groups, or
    exited and its pid gone to another process (whose groups the ring would have used). More
    groups than one getsockopt carries (256) fall back to /proc, checked against the uid.
    """
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)
        groups = sorted(g for (g,) in _GID.iter_unpack(raw[:len(raw) - len(raw) % _GID.size]))
    except OSError:  # ERANGE: more groups than the buffer (or a kernel without SO_PEERGROUPS)
        groups = _groups_of(pid, uid)
    return pid, mpb.User(uid=uid, gid=gid, groups=groups)


def _errno_of(exc: BaseException) -> int:
    if isinstance(exc, FS3Error):
        return exc.errno
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO


def _is_memfd(fd: int) -> bool:
    """Whether ``fd`` is a memfd (or another sealable shmem file): ``F_GET_SEALS`` is answered by
    the kernel alone, never by a file system's daemon."""
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return True


def _check_memfd(fd: int, size_bytes: int) -> None:
    """A buffer the daemon may map: a regular file of at least ``size_bytes``, sealed against
    shrinking (else the process could truncate it and turn the daemon's access into SIGBUS).

    The seals first: ``fstat`` of a descriptor of a FUSE file system (this very mount
    included) is a request its daemon answers, and this runs on the event loop that answers it.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise OSError(errno.EPERM, "a shared buffer must be a memfd sealed with F_SEAL_SHRINK")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < size_bytes:
        raise OSError(errno.EINVAL, f"a shared buffer must be a file of {size_bytes} bytes")


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.rings = Gauge("fs3_usrbio_rings", "usrbio rings connected", registry=registry)
        self.files = Gauge("fs3_usrbio_files", "Files registered on usrbio rings", registry=registry)
        self.mapped_bytes = Gauge("fs3_usrbio_mapped_bytes", "Shared buffers mapped for usrbio rings",
                                  registry=registry)
        self.ios = Counter("fs3_usrbio_ios", "usrbio I/Os completed", ["op"], registry=registry)
        self.bytes = Counter("fs3_usrbio_bytes", "Bytes moved by usrbio I/Os", ["op"], registry=registry)
        self.errors = Counter("fs3_usrbio_io_errors", "usrbio I/Os completed with an error", registry=registry)
        self.batches = Counter("fs3_usrbio_batches", "usrbio submit doorbells served", registry=registry)
        self._read = (self.ios.labels("read"), self.bytes.labels("read"))
        self._write = (self.ios.labels("write"), self.bytes.labels("write"))

    def count(self, reads: list[int], writes: list[int], errors: int) -> None:
        """One batch's I/Os: ``[count, bytes]`` of its reads and of its writes, and its errors."""
        for (ios, moved), (n, size) in ((self._read, reads), (self._write, writes)):
            if n:
                ios.inc(n)
                moved.inc(size)
        if errors:
            self.errors.inc(errors)


class _Fatal(Exception):
    """The application broke the protocol: its connection is dropped (nothing else is hurt)."""


@dataclass
class _Mapped:
    mm: mmap.mmap
    view: memoryview
    size_bytes: int

    def release(self) -> None:
        with contextlib.suppress(BufferError):  # a cancelled I/O still held a slice: GC unmaps
            self.view.release()
            self.mm.close()


@dataclass(eq=False)  # one per socket: hashed by identity
class _Connection:
    server: UsrbioServer
    sock: socket.socket
    pid: int
    user: mpb.User
    ring: _Mapped | None = None
    entries: int = 0
    sq_head: int = 0
    cq_tail: int = 0
    accepted: int = 0    # entries taken from the SQ whose completions are not written yet
    iovs: dict[int, _Mapped] = field(default_factory=dict)
    files: dict[int, RegisteredFile] = field(default_factory=dict)
    deregistering: dict[int, RegisteredFile] = field(default_factory=dict)  # off the ring, not closed yet
    batches: set[asyncio.Task[None]] = field(default_factory=set)
    controls: set[asyncio.Task[None]] = field(default_factory=set)
    closing: bool = False
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    # -- messages --------------------------------------------------------------------------------

    def on_readable(self) -> None:
        for _ in range(_MESSAGES_PER_WAKEUP_MAX):
            if self.closing:
                return
            try:
                message, fds, flags, _ = socket.recv_fds(self.sock, _MESSAGE_BYTES_MAX, _FDS_PER_MESSAGE_MAX)
            except BlockingIOError:
                return
            except OSError:
                self.server.drop(self)
                return
            try:
                if not message:
                    self.server.drop(self)
                    return
                if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                    raise _Fatal("a message or its descriptors were cut short")
                self._dispatch(message, fds)
                fds = []  # taken
            except _Fatal as exc:
                self.fatal(str(exc))
                return
            finally:
                self.server.close_fds(fds)

    def _dispatch(self, message: bytes, fds: list[int]) -> None:
        if message[:1] == DOORBELL_SUBMIT:
            if fds:
                raise _Fatal("descriptors sent with a submit")
            self._submit()
            return
        if message[:1] != b"{":
            raise _Fatal(f"unknown message {message[:1]!r}")
        try:
            request = json.loads(message)
            op = str(request["op"])
        except (ValueError, KeyError, TypeError):
            raise _Fatal("a control message is not a JSON object with an op") from None
        if len(self.controls) >= _CONTROLS_PENDING_MAX:
            raise _Fatal("too many control requests at once")
        task = asyncio.get_running_loop().create_task(self._control(op, request, list(fds)))
        fds.clear()  # the task owns them now
        self.controls.add(task)
        task.add_done_callback(self.controls.discard)

    async def _reply(self, reply: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # gone: the reader notices
            await asyncio.get_running_loop().sock_sendall(self.sock, json.dumps(reply).encode())

    def fatal(self, why: str) -> None:
        log.warning("usrbio: dropping the ring of pid %d (uid %d): %s", self.pid, self.user.uid, why)
        with contextlib.suppress(OSError):
            self.sock.send(json.dumps({"fatal": why}).encode(), socket.MSG_DONTWAIT)
        self.server.drop(self)

    # -- control requests ------------------------------------------------------------------------

    async def _control(self, op: str, request: dict[str, Any], fds: list[int]) -> None:
        try:
            handler = {"ring": self._map_ring, "iov": self._map_iov, "register": self._register,
                       "deregister": self._deregister, "stats": self._stats}.get(op)
            if handler is None:
                raise OSError(errno.EINVAL, f"unknown request {op!r}")
            wants_fd = op in ("ring", "iov", "register")
            if len(fds) != (1 if wants_fd else 0):
                raise OSError(errno.EINVAL, f"{op!r} takes {'one descriptor' if wants_fd else 'no descriptor'}")
            reply = await handler(request, fds)
        except (OSError, FS3Error) as exc:
            reply = {"errno": _errno_of(exc), "error": f"{op}: {exc}"}
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"errno": errno.EINVAL, "error": f"{op}: bad request: {exc}"}
        finally:
            # What the handler did not take (a ring's and a buffer's are mapped by now).
            self.server.close_fds(fds)
        if not self.closing:
            await self._reply(reply)

    def _map(self, fd: int, size_bytes: int) -> _Mapped:
        _check_memfd(fd, size_bytes)
        mm = mmap.mmap(fd, size_bytes)
        return _Mapped(mm, memoryview(mm), size_bytes)

    async def _map_ring(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        entries = int(request["entries"])
        if self.ring is not None:
            raise OSError(errno.EBUSY, "this connection has its ring already")
        if not 0 < entries <= RING_ENTRIES_MAX or entries & (entries - 1):
            # A power of two: slots of wrapping 32-bit counters stay in order (see ring_slots).
            raise OSError(errno.EINVAL, f"a ring has a power of two of 1 to {RING_ENTRIES_MAX} entries, not {entries}")
        self.ring = self._map(fds[0], ring_bytes(entries))
        self.entries = entries
        self.sq_head = _U32.unpack_from(self.ring.mm, SQ_TAIL_AT)[0]
        self.cq_tail = _U32.unpack_from(self.ring.mm, CQ_HEAD_AT)[0]
        _U32.pack_into(self.ring.mm, SQ_HEAD_AT, self.sq_head)
        _U32.pack_into(self.ring.mm, CQ_TAIL_AT, self.cq_tail)
        self.server.metrics.mapped_bytes.inc(self.ring.size_bytes)
        return {"entries": entries}

    async def _map_iov(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        size = int(request["size"])
        if not 0 < size <= IOV_BYTES_MAX:
            raise OSError(errno.EINVAL, f"an Iov holds 1 to {IOV_BYTES_MAX} bytes, not {size}")
        if len(self.iovs) >= IOVS_PER_RING_MAX:
            raise OSError(errno.ENOSPC, f"a ring takes at most {IOVS_PER_RING_MAX} Iovs")
        iov_id = len(self.iovs) + 1
        self.iovs[iov_id] = self._map(fds[0], size)
        self.server.metrics.mapped_bytes.inc(size)
        return {"iov": iov_id}

    async def _register(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        access = int(request["flags"]) & os.O_ACCMODE
        if access not in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):
            raise OSError(errno.EINVAL, "the access mode is O_RDONLY, O_WRONLY or O_RDWR")
        if len(self.files) >= FILES_PER_RING_MAX:
            raise OSError(errno.EMFILE, f"a ring takes at most {FILES_PER_RING_MAX} files")
        fd = fds.pop()

        def inspect() -> tuple[os.stat_result, int]:
            # In a thread: fstat and close of a descriptor of this very mount are FUSE requests
            # this daemon's event loop has to answer.
            try:
                return os.fstat(fd), fcntl.fcntl(fd, fcntl.F_GETFL)
            finally:
                os.close(fd)

        st, fd_flags = await asyncio.get_running_loop().run_in_executor(self.server.fd_executor, inspect)
        if f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}" != self.server.device:
            raise OSError(errno.EXDEV, f"the descriptor is not of the fs3 mount at {self.server.mountpoint}")
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL, "not a regular file")
        fd_access = fd_flags & os.O_ACCMODE
        if fd_access != os.O_RDWR and fd_access != access:
            raise OSError(errno.EBADF, "the descriptor is not open for the access asked")
        fh, _ = await self.server.vfs.open_inode(st.st_ino, access, self.user)
        if self.closing:
            await self.server.vfs.release(fh)
            raise OSError(errno.ENOTCONN, "the ring closed")
        file_id = next(self.ids)
        self.files[file_id] = RegisteredFile(fh, st.st_ino, access in (os.O_RDONLY, os.O_RDWR),
                                             access in (os.O_WRONLY, os.O_RDWR))
        self.server.metrics.files.inc()
        return {"file": file_id}

    async def _deregister(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        file_id = int(request["file"])
        registered = self.files.pop(file_id, None)  # a batch submitted from now on finds no such file
        if registered is None:
            raise OSError(errno.EBADF, f"no registered file {file_id}")
        # Until its handle is released: a ring closed while this waits cancels the wait, and
        # its release closes these too (a file only taken off the ring leaked its handle).
        self.deregistering[file_id] = registered
        if self.batches:  # submitted I/Os on it finish first
            await asyncio.gather(*list(self.batches), return_exceptions=True)
        del self.deregistering[file_id]
        self.server.metrics.files.dec()
        # Shielded: a ring closed now must not leave the handle half released.
        await asyncio.shield(self.server.vfs.release(registered.fh))
        return {}

    async def _stats(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        return self.server.stats()

    # -- batches ---------------------------------------------------------------------------------

    def _submit(self) -> None:
        ring = self.ring
        if ring is None:
            raise _Fatal("a submit before the ring was set up")
        tail = _U32.unpack_from(ring.mm, SQ_TAIL_AT)[0]
        count = (tail - self.sq_head) & INDEX_MASK
        if not count:
            return
        unreaped = (self.cq_tail - _U32.unpack_from(ring.mm, CQ_HEAD_AT)[0]) & INDEX_MASK
        if unreaped > self.entries or count + self.accepted + unreaped > self.entries:
            raise _Fatal(f"{count} entries submitted with {self.accepted} in flight and {unreaped} unreaped "
                         f"on a ring of {self.entries}")
        entries = []
        for index in range(self.sq_head, self.sq_head + count):
            entries.append(Sqe.unpack_from(ring.mm, HEADER_BYTES + (index % self.entries) * SQE.size))
        self.sq_head = tail
        _U32.pack_into(ring.mm, SQ_HEAD_AT, tail)
        self.accepted += count
        self.server.metrics.batches.inc()
        task = asyncio.get_running_loop().create_task(self._batch(entries))
        self.batches.add(task)
        task.add_done_callback(self.batches.discard)

    async def _batch(self, entries: list[Sqe]) -> None:
        try:
            results = await self._serve(entries)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("usrbio batch of %d entries failed", len(entries))
            results = [-errno.EIO] * len(entries)
        self._complete(entries, results)

    def _complete(self, entries: list[Sqe], results: list[int]) -> None:
        ring = self.ring
        if self.closing or ring is None:
            return
        base = HEADER_BYTES + self.entries * SQE.size
        # [ios, bytes] per op, counted once per batch (a labelled child's lookup per entry was
        # a visible share of a batch of 4 KiB reads).
        counts = {OP_READ: [0, 0], OP_WRITE: [0, 0]}
        errors = 0
        for entry, result in zip(entries, results, strict=True):
            CQE.pack_into(ring.mm, base + (self.cq_tail % self.entries) * CQE.size, entry.userdata, result)
            self.cq_tail = (self.cq_tail + 1) & INDEX_MASK
            if result < 0:
                errors += 1
            else:
                count = counts[entry.op]
                count[0] += 1
                count[1] += result
        _U32.pack_into(ring.mm, CQ_TAIL_AT, self.cq_tail)
        self.server.metrics.count(counts[OP_READ], counts[OP_WRITE], errors)
        self.accepted -= len(entries)
        try:
            self.sock.send(DOORBELL_COMPLETE + _U32.pack(len(entries)), socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass  # doorbells are queued unread: the application wakes on those and reads the CQ
        except OSError:
            self.server.drop(self)

    async def _serve(self, entries: list[Sqe]) -> list[int]:
        results = [0] * len(entries)
        iov_sizes = {iov_id: mapped.size_bytes for iov_id, mapped in self.iovs.items()}
        reads: list[tuple[int, RegisteredFile]] = []
        writes: list[tuple[int, RegisteredFile]] = []
        for index, entry in enumerate(entries):
            error = check_entry(entry, self.files, iov_sizes)
            if error:
                results[index] = -error
            elif entry.length:
                (reads if entry.op == OP_READ else writes).append((index, self.files[entry.file_id]))
        if writes:
            await self._write(entries, writes, results)
        if reads:
            await self._read(entries, reads, results)
        return results

    async def _write(self, entries: list[Sqe], writes: list[tuple[int, RegisteredFile]], results: list[int]) -> None:
        vfs = self.server.vfs
        written: dict[int, list[int]] = {}
        for index, registered in writes:
            entry = entries[index]
            data = self.iovs[entry.iov_id].view[entry.iov_offset:entry.iov_offset + entry.length]
            try:
                results[index] = await vfs.write(registered.fh, entry.offset, data)
                written.setdefault(registered.fh, []).append(index)
            except (OSError, FS3Error) as exc:
                results[index] = -_errno_of(exc)
        for fh, indexes in written.items():
            try:  # what a close would publish: an open after the completion sees the new length
                await vfs.flush(fh)
            except (OSError, FS3Error) as exc:
                for index in indexes:
                    results[index] = -_errno_of(exc)
        drop = self.server.drop_kernel_cache
        if drop is not None:
            # Before the completions: a FUSE descriptor read after them sees the ring's bytes.
            for inode_id in sorted({registered.inode_id for _, registered in writes}):
                await asyncio.to_thread(drop, inode_id)

    async def _read(self, entries: list[Sqe], reads: list[tuple[int, RegisteredFile]], results: list[int]) -> None:
        vfs = self.server.vfs
        lengths: dict[int, int] = {}
        for index, registered in reads:
            if registered.fh in lengths or results[index] < 0:
                continue
            try:
                lengths[registered.fh] = await vfs.file(registered.fh).readable_length()
            except (OSError, FS3Error) as exc:
                lengths[registered.fh] = -_errno_of(exc)
        # (iov id) -> [(entry index, handle, its pieces)], each group at most batch_bytes_max.
        groups: dict[int, list[list[tuple[int, int, list[PieceRead]]]]] = {}
        group_bytes: dict[int, int] = {}
        for index, registered in reads:
            length = lengths[registered.fh]
            if length < 0:
                results[index] = length
                continue
            entry = entries[index]
            size = max(0, min(entry.offset + entry.length, length) - entry.offset)
            results[index] = size
            if not size:
                continue
            pieces = plan_pieces(vfs.file(registered.fh), entry.offset, size, entry.iov_offset)
            batches = groups.setdefault(entry.iov_id, [[]])
            if group_bytes.get(entry.iov_id, 0) + size > self.server.limits.batch_bytes_max and batches[-1]:
                batches.append([])
                group_bytes[entry.iov_id] = 0
            batches[-1].append((index, registered.fh, pieces))
            group_bytes[entry.iov_id] = group_bytes.get(entry.iov_id, 0) + size
        for iov_id, batches in groups.items():
            for batch in batches:
                await self._fetch(self.iovs[iov_id].view, batch, results)

    async def _fetch(self, out: memoryview, batch: list[tuple[int, int, list[PieceRead]]],
                     results: list[int]) -> None:
        vfs = self.server.vfs
        pieces = [piece for _, _, entry_pieces in batch for piece in entry_pieces]
        try:
            got, _ = await vfs.fs.storage.read_pieces(pieces, out)
            at = 0
            for index, fh, entry_pieces in batch:
                short = False
                for piece in entry_pieces:
                    n = got[at]
                    at += 1
                    if n < piece.length:  # a hole (or a chunk not written yet): zeros
                        out[piece.dst + n:piece.dst + piece.length] = bytes(piece.length - n)
                        short = True
                if short:
                    try:
                        await vfs.file(fh).confirm_zeros()
                    except (OSError, FS3Error) as exc:
                        results[index] = -_errno_of(exc)
        except (OSError, FS3Error) as exc:
            for index, _, _ in batch:
                results[index] = -_errno_of(exc)
        vfs.fs.metrics.read_bytes.inc(sum(max(0, results[index]) for index, _, _ in batch))

    # -- closing ---------------------------------------------------------------------------------

    async def release(self) -> None:
        """Cancel what is in flight, close the files, drop the mappings."""
        for task in [*self.batches, *self.controls]:
            task.cancel()
        await asyncio.gather(*self.batches, *self.controls, return_exceptions=True)
        metrics = self.server.metrics
        for registered in [*self.files.values(), *self.deregistering.values()]:
            try:
                await self.server.vfs.release(registered.fh)
            except Exception as exc:  # keep releasing the rest; meta prunes the session with the lease
                log.warning("usrbio: closing inode %d of pid %d: %s", registered.inode_id, self.pid, exc)
            metrics.files.dec()
        self.files.clear()
        self.deregistering.clear()
        for mapped in [*self.iovs.values(), *([self.ring] if self.ring is not None else [])]:
            metrics.mapped_bytes.dec(mapped.size_bytes)
            mapped.release()
        self.iovs.clear()
        self.ring = None


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _remove_dead_sockets(directory: Path, limit: int = 256) -> None:
    """Remove the sockets daemons that died (SIGKILL, crash) left behind: nothing answers them.

    A live daemon's socket accepts the probe (and sees it close at once); a dead one refuses it.
    """
    for path in itertools.islice(directory.glob("usrbio-*.sock"), limit):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                path.unlink()
                log.info("usrbio: removed %s, left by a daemon that is gone", path)
        except OSError:
            pass
        finally:
            probe.close()


class UsrbioServer:
    """The usrbio socket of one mount, served on the mount daemon's event loop."""

    def __init__(self, vfs: Vfs, device: str, mountpoint: str, socket_dir: Path | None = None,
                 limits: UsrbioLimits | None = None, registry: CollectorRegistry | None = None,
                 drop_kernel_cache: Callable[[int], None] | None = None) -> None:
        self.vfs = vfs
        # Ring writes bypass the kernel: pages and attributes it cached for a FUSE descriptor
        # opened before them would stay stale until that file is opened again. This drops them
        # (the mount's ``invalidate_inode``); it may wait on FUSE reads this loop serves, so it
        # runs in a thread.
        self.drop_kernel_cache = drop_kernel_cache
        self.device = device
        self.mountpoint = mountpoint
        self.socket_dir = socket_dir or default_socket_dir()
        self.path = self.socket_dir / socket_name(device)
        self.limits = limits or UsrbioLimits()
        self.metrics = _Metrics(registry)
        self.connections: set[_Connection] = set()
        self._releasing: set[asyncio.Task[None]] = set()
        self._listener: socket.socket | None = None
        # Calls on descriptors applications pass (fstat, close: FUSE requests when the file is of
        # a FUSE mount, this one included) run here, never on the event loop; a descriptor of a
        # file system whose daemon never answers holds one of these threads, not the mount.
        self.fd_executor = concurrent.futures.ThreadPoolExecutor(_FD_THREADS, thread_name_prefix="usrbio-fd")

    def close_fds(self, fds: list[int]) -> None:
        """Close descriptors an application passed: memfds at once, anything else in a thread
        (closing a FUSE file is a flush request; one of this mount's would wait on this loop)."""
        for fd in fds:
            if _is_memfd(fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
            else:
                try:
                    self.fd_executor.submit(_close_quietly, fd)
                except RuntimeError:  # shut down: the mount is going away
                    _close_quietly(fd)
        fds.clear()

    def start(self) -> Path:
        """Listen (replacing a socket a dead daemon left); returns the socket's path."""
        root = os.geteuid() == 0
        self.socket_dir.mkdir(mode=0o755 if root else 0o700, parents=True, exist_ok=True)
        st = self.socket_dir.stat()
        if root and st.st_uid == 0:
            os.chmod(self.socket_dir, 0o755)  # every user looks for the socket here (mkdir obeys the umask)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise OSError(errno.EPERM, f"{self.socket_dir} is not this user's alone: usrbio stays off")
        _remove_dead_sockets(self.socket_dir)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        listener.bind(str(self.path))
        # Anyone on the machine may connect (a root daemon serves every user of an allow_other
        # mount); what each connection may do is its user's permissions, checked per file.
        os.chmod(self.path, 0o666 if root else 0o600)
        listener.listen(128)
        self._listener = listener
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept)
        log.info("usrbio: serving %s at %s", self.mountpoint, self.path)
        return self.path

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("usrbio: accept: %s", exc)
                return
            sock.setblocking(False)
            pid, user = peer_credentials(sock)
            conn = _Connection(self, sock, pid, user)
            same_process = sum(1 for c in self.connections if c.pid == pid)
            if len(self.connections) >= self.limits.rings_max:
                conn.fatal(f"the mount serves {self.limits.rings_max} rings already")
                continue
            if same_process >= self.limits.rings_per_process:
                conn.fatal(f"a process may hold {self.limits.rings_per_process} rings")
                continue
            self.connections.add(conn)
            self.metrics.rings.inc()
            asyncio.get_running_loop().add_reader(sock.fileno(), conn.on_readable)

    def drop(self, conn: _Connection) -> None:
        """Close a connection and release what it held (in the background)."""
        if conn.closing:
            return
        conn.closing = True
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(conn.sock.fileno())
        conn.sock.close()
        if conn in self.connections:
            self.connections.discard(conn)
            self.metrics.rings.dec()
        task = asyncio.get_running_loop().create_task(conn.release())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def stats(self) -> dict[str, int]:
        return {"rings": len(self.connections),
                "files": sum(len(c.files) for c in self.connections),
                "iovs": sum(len(c.iovs) for c in self.connections),
                "releasing": len(self._releasing),
                "open_handles": self.vfs.open_handles}

    async def close(self) -> None:
        """Stop listening, drop every connection and wait until each has released its files."""
        if self._listener is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                self.path.unlink()
        for conn in list(self.connections):
            self.drop(conn)
        if self._releasing:
            await asyncio.gather(*list(self._releasing), return_exceptions=True)
        self.fd_executor.shutdown(wait=False)  # a thread stuck on another file system's descriptor stays behind

"""``fs3.usrbio``: zero-copy batched I/O against an fs3 FUSE mount, modelled on 3FS's USRBIO.

A data loader reading thousands of small records a second pays, through FUSE, one kernel round
trip and one Python request in the mount daemon per record. Here the application and the mount
daemon share memory instead: an :class:`Iov` (a sealed ``memfd`` both map) receives the bytes,
and an :class:`IoRing` (a submission and a completion queue in another shared ``memfd``) carries
the requests. A batch of reads costs one doorbell message on a Unix socket and, in the daemon,
one ``BatchRead`` call per storage node; the bytes land in the shared buffer straight from the
storage answers, readable at once as a numpy array or a torch tensor, no copy, no GIL of the
application held while the daemon works::

    from fs3.usrbio import Iov, IoRing

    iov = Iov(64 << 20)                               # shared buffer (64 MiB)
    with IoRing("/mnt/fs3", entries=128) as ring:     # any path inside the mount
        fd = ring.register("/mnt/fs3/data/shard-0")   # opened as this process's user
        for i in range(64):
            ring.prep_io(iov, fd, offset=i * 4096, length=4096, iov_offset=i * 4096, userdata=i)
        ring.submit()
        for c in ring.wait(min_results=64):
            c.check()                                 # raises OSError for a -errno result
        batch = iov.numpy()[:64 * 4096]               # or iov.torch()

3FS's names map one to one: ``hf3fs_iovcreate`` is :class:`Iov`, ``hf3fs_iorcreate`` is
:class:`IoRing`, ``hf3fs_reg_fd`` :meth:`IoRing.register`, ``hf3fs_prep_io``
:meth:`IoRing.prep_io`, ``hf3fs_submit_ios`` :meth:`IoRing.submit`, ``hf3fs_wait_for_ios``
:meth:`IoRing.wait`. See docs/usrbio.md.

Security: the daemon learns who is on the other end of the socket from the kernel
(``SO_PEERCRED``), and a file is registered by passing an open descriptor of the mount
(``SCM_RIGHTS``): the kernel already checked the path, and the daemon opens the file again *as
that user*, so meta checks the user's permission as for any open — a ring never reads what its
user could not. Buffers are ``memfd``\\ s sealed against shrinking, so a process cannot pull the
daemon's mapping from under it.

This module talks only to the daemon: it imports nothing of fs3's client.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import select
import socket
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import numpy
    import torch

__all__ = [
    "CQE",
    "HEADER_BYTES",
    "IOVS_PER_RING_MAX",
    "IOV_BYTES_MAX",
    "OP_READ",
    "OP_WRITE",
    "RING_ENTRIES_MAX",
    "SQE",
    "Completion",
    "IoRing",
    "Iov",
    "MountGone",
    "Sqe",
    "ring_bytes",
    "ring_slots",
    "server_socket",
    "socket_candidates",
    "socket_name",
]

# -- the shared-memory layout (the daemon reads the same definitions) ----------------------------
#
# A ring's memfd: a 64-byte header, then ``entries`` submission entries, then ``entries``
# completion entries. Indexes are free-running 32-bit counters (slot = index % entries, and
# ``entries`` is a power of two, so the slot runs on smoothly where a counter wraps); each side
# writes only its own: the application ``sq_tail`` and ``cq_head``, the daemon ``sq_head`` and
# ``cq_tail``. The doorbell messages on the socket order them (a send and a receive are barriers).

MAGIC = 0x52335346  # "FS3R"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<IIIIIIII")  # magic, version, entries, sq_tail, sq_head, cq_tail, cq_head, 0
SQ_TAIL_AT, SQ_HEAD_AT, CQ_TAIL_AT, CQ_HEAD_AT = 12, 16, 20, 24
_U32 = struct.Struct("<I")
# op (u8), 0 (u8), iov id (u16), file id (u32), file offset, length, iov offset (i64), userdata (u64)
SQE = struct.Struct("<BBHIqqqQ")
CQE = struct.Struct("<Qq")  # userdata, result (bytes, or -errno)
OP_READ, OP_WRITE = 1, 2
INDEX_MASK = 0xFFFF_FFFF

RING_ENTRIES_MAX = 4096        # a batch's bound: entries of one ring
IOV_BYTES_MAX = 1 << 36        # 64 GiB: one shared buffer
IOVS_PER_RING_MAX = 64
FILES_PER_RING_MAX = 4096
USERDATA_MAX = (1 << 64) - 1

# Messages on the socket (SOCK_SEQPACKET: one message each): the doorbells are one byte plus a
# count; control requests and their replies are JSON objects (one outstanding at a time).
DOORBELL_SUBMIT = b"S"
DOORBELL_COMPLETE = b"C"
_MESSAGE_BYTES_MAX = 4096


def ring_slots(entries: int) -> int:
    """The slots a ring of ``entries`` has: the power of two at or above it. A 32-bit counter's
    ``index % slots`` then moves on by one where the counter wraps (with 3 slots, index 2**32 - 1
    and index 0 would both be slot 0: the entry still pending there was overwritten)."""
    return 1 << (entries - 1).bit_length()


def ring_bytes(entries: int) -> int:
    """Size of a ring's shared memory with ``entries`` entries."""
    return HEADER_BYTES + entries * (SQE.size + CQE.size)


def socket_name(device: str) -> str:
    """The daemon's socket file name for the mount whose device is ``major:minor``."""
    major, minor = device.split(":")
    return f"usrbio-{int(major)}-{int(minor)}.sock"


def socket_candidates(device: str) -> list[Path]:
    """Where the daemon of the mount with device ``major:minor`` listens, most likely first.

    A daemon running as root publishes under ``/run/fs3`` (root-owned, so no other user can put a
    socket there); one running as another user under ``/tmp/fs3-usrbio-<uid>`` (mode 0700).
    ``$FS3_USRBIO_DIR`` overrides both (the daemon's ``--usrbio-dir``).
    """
    name = socket_name(device)
    dirs = [os.environ.get("FS3_USRBIO_DIR", ""), "/run/fs3", f"/tmp/fs3-usrbio-{os.geteuid()}"]
    return [Path(d) / name for d in dirs if d]


def server_socket(path: str | os.PathLike[str]) -> Path | None:
    """The usrbio socket serving the fs3 mount ``path`` lies in, or None (not an fs3 mount, or
    one without usrbio): a ``stat`` of ``path`` and of the socket, no connection."""
    try:
        device = _device_of(path)
    except OSError:
        return None
    for candidate in socket_candidates(device):
        try:
            if stat.S_ISSOCK(os.stat(candidate).st_mode):
                return candidate
        except OSError:
            continue
    return None


class MountGone(ConnectionError):
    """The mount daemon went away (killed, unmounted): the ring is dead, its I/Os in flight are
    lost (reads left the buffer partly filled, writes may or may not have landed). Remount, make
    a new :class:`IoRing` and register the files again; every :class:`Iov` stays usable."""


class Completion(NamedTuple):
    """One finished I/O: the ``userdata`` given to :meth:`IoRing.prep_io` and its ``result``,
    the bytes moved (``pread``'s and ``pwrite``'s count: short at the end of a file) or ``-errno``."""

    userdata: int
    result: int

    def check(self) -> int:
        """The byte count; an ``OSError`` for an error result."""
        if self.result < 0:
            raise OSError(-self.result, f"usrbio I/O {self.userdata}: {os.strerror(-self.result)}")
        return self.result


@dataclass(frozen=True, slots=True)
class Sqe:
    """One submission entry, as both sides decode it."""

    op: int
    iov_id: int
    file_id: int
    offset: int
    length: int
    iov_offset: int
    userdata: int

    def pack_into(self, buffer: Any, at: int) -> None:
        SQE.pack_into(buffer, at, self.op, 0, self.iov_id, self.file_id, self.offset, self.length, self.iov_offset,
                      self.userdata)

    @classmethod
    def unpack_from(cls, buffer: Any, at: int) -> Sqe:
        op, _, iov_id, file_id, offset, length, iov_offset, userdata = SQE.unpack_from(buffer, at)
        return cls(op, iov_id, file_id, offset, length, iov_offset, userdata)


def _sealed_memfd(name: str, size_bytes: int) -> int:
    """A memfd of ``size_bytes`` that can never shrink or grow (the daemon maps it: a shrink would
    turn its reads of the mapping into SIGBUS)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Iov:
    """A shared-memory buffer I/Os land in (reads) or come from (writes): ``hf3fs_iovcreate``.

    Independent of any mount: the same ``Iov`` serves several rings, and outlives a mount daemon
    that dies (register it with a new ring after the remount). Its memory is the process's own
    (``memfd``), released when the ``Iov`` is closed and no view of it is left.
    """

    def __init__(self, size_bytes: int, name: str = "fs3-usrbio-iov") -> None:
        if not 0 < size_bytes <= IOV_BYTES_MAX:
            raise ValueError(f"an Iov holds 1 to {IOV_BYTES_MAX} bytes, not {size_bytes}")
        self.size_bytes = size_bytes
        self.fd = _sealed_memfd(name, size_bytes)
        self._mmap = mmap.mmap(self.fd, size_bytes)
        self.view = memoryview(self._mmap)
        self.closed = False

    def numpy(self, dtype: Any = "uint8", offset: int = 0, count: int = -1) -> numpy.ndarray[Any, Any]:
        """A numpy array over the buffer (no copy): what a read lands in shows in it at once."""
        import numpy as np

        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=offset)

    def torch(self, dtype: Any = None, offset: int = 0, count: int = -1) -> torch.Tensor:
        """A torch tensor over the buffer (no copy; ``uint8`` unless ``dtype``)."""
        import torch

        return torch.frombuffer(self._mmap, dtype=dtype or torch.uint8, count=count, offset=offset)

    def close(self) -> None:
        """Unmap and close; views still held keep the memory until they go."""
        if self.closed:
            return
        self.closed = True
        self.view.release()
        with contextlib.suppress(BufferError):  # numpy/torch views still alive: it goes with the last
            self._mmap.close()
        os.close(self.fd)

    def __enter__(self) -> Iov:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to tell
                self.close()


def _device_of(path: str | os.PathLike[str]) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


class IoRing:
    """A submission and a completion queue shared with the mount daemon: ``hf3fs_iorcreate``.

    ``path`` is the mount point or any path inside the mount. At most ``entries`` I/Os are
    prepared, submitted or unreaped at once (:meth:`prep_io` refuses more with ``EAGAIN``). One
    ring serves one thread at a time; use a ring per thread or process. Within one
    :meth:`submit`, writes are done before reads, each in the order prepared; I/Os of different
    submits run concurrently. Errors of one I/O (a bad file id, a range outside its ``Iov``,
    a negative length) complete that I/O with ``-errno`` and leave the others alone; only the
    daemon going away fails the ring (:class:`MountGone`).
    """

    def __init__(self, path: str | os.PathLike[str], entries: int = 64, connect_timeout_s: float = 10.0) -> None:
        if not 0 < entries <= RING_ENTRIES_MAX:
            raise ValueError(f"a ring has 1 to {RING_ENTRIES_MAX} entries, not {entries}")
        self.mountpoint = os.fspath(path)
        self.entries = entries
        self._slots = ring_slots(entries)  # the shared queues' size; at most ``entries`` in use
        self.timeout_s = connect_timeout_s
        self.closed = True
        self._pid = os.getpid()
        device = _device_of(path)
        self._sock = self._connect(device, connect_timeout_s)
        self.closed = False
        self._ring_fd = _sealed_memfd("fs3-usrbio-ring", ring_bytes(self._slots))
        self._ring = mmap.mmap(self._ring_fd, ring_bytes(self._slots))
        _HEADER.pack_into(self._ring, 0, MAGIC, VERSION, self._slots, 0, 0, 0, 0, 0)
        self._sq_tail = 0      # the application's: what was submitted
        self._prepped = 0      # prepared since the last submit
        self._cq_head = 0      # the application's: what was reaped
        self._outstanding = 0  # submitted and not reaped
        self._iov_ids: dict[int, tuple[Iov, int]] = {}
        self._files: set[int] = set()
        self._control({"op": "ring", "entries": self._slots}, [self._ring_fd])

    # -- connecting ------------------------------------------------------------------------------

    def _connect(self, device: str, timeout_s: float) -> socket.socket:
        tried: list[str] = []
        for candidate in socket_candidates(device):
            try:
                st = os.lstat(candidate)
            except OSError:
                continue
            if not stat.S_ISSOCK(st.st_mode):
                continue
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            sock.settimeout(timeout_s)
            try:
                sock.connect(str(candidate))
            except OSError as exc:
                sock.close()
                tried.append(f"{candidate}: {exc.strerror}")
                continue
            _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid not in (0, os.geteuid()):
                sock.close()  # a socket some other user put there: never hand it our buffers
                tried.append(f"{candidate}: served by uid {uid}, neither root nor this user")
                continue
            sock.settimeout(None)
            return sock
        detail = "; ".join(tried) or "no socket at " + ", ".join(str(c) for c in socket_candidates(device))
        raise MountGone(errno.ENOTCONN, f"no fs3 usrbio server for the mount at {self.mountpoint} "
                                        f"(device {device}; the mount is not fs3, not running, or runs with "
                                        f"--no-usrbio): {detail}")

    def _gone(self, why: str) -> MountGone:
        return MountGone(errno.ENOTCONN, f"the fs3 mount daemon of {self.mountpoint} went away ({why}) with "
                                         f"{self._outstanding} I/Os in flight; remount, then make a new IoRing "
                                         "and register the files again (Iovs stay usable)")

    def _send(self, message: bytes, fds: list[int] | None = None) -> None:
        self._check_open()
        try:
            if fds:
                socket.send_fds(self._sock, [message], fds)
            else:
                self._sock.send(message)
        except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError) as exc:
            raise self._gone(exc.strerror or type(exc).__name__) from None

    def _receive(self, timeout_s: float | None) -> bytes | None:
        """One message from the daemon; None when ``timeout_s`` passed without one."""
        if timeout_s is not None:
            poller = select.poll()
            poller.register(self._sock, select.POLLIN)
            if not poller.poll(max(0, int(timeout_s * 1000))):
                return None
        try:
            message = self._sock.recv(_MESSAGE_BYTES_MAX)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise self._gone(exc.strerror or type(exc).__name__) from None
        if not message:
            raise self._gone("its end of the socket closed")
        if message[:1] == b"{":
            reply = json.loads(message)
            if "fatal" in reply:
                self.close()
                raise ConnectionError(errno.EPROTO, f"the fs3 mount daemon of {self.mountpoint} closed the ring: "
                                                    f"{reply['fatal']}")
        return message

    def _control(self, request: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        """Send one control request and return its reply; an error reply raises ``OSError``."""
        self._send(json.dumps(request).encode(), fds)
        deadline = time.monotonic() + max(self.timeout_s, 60.0)
        while True:
            message = self._receive(max(0.0, deadline - time.monotonic()))
            if message is None:
                raise TimeoutError(errno.ETIMEDOUT, f"the fs3 mount daemon of {self.mountpoint} did not answer "
                                                    f"{request['op']!r}")
            if message[:1] == b"{":
                reply: dict[str, Any] = json.loads(message)
                if "errno" in reply:
                    raise OSError(reply["errno"], reply.get("error") or os.strerror(reply["errno"]))
                return reply
            # a completion doorbell: the completion queue itself says what finished

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O on a closed IoRing")
        if self._pid != os.getpid():
            # Parent and child would race on one queue: the daemon cannot tell their entries apart.
            raise ValueError("an IoRing does not cross fork: make a new one in this process")

    # -- files and buffers -----------------------------------------------------------------------

    def register(self, file: str | os.PathLike[str] | int, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
        """Register a file of the mount for I/O on this ring (``hf3fs_reg_fd``); returns its id.

        ``file`` is a path (opened here with ``flags``, as ``os.open`` would, then passed on) or an
        open descriptor of the mount. The daemon opens the file again as this process's user with
        the access mode of ``flags`` (which the descriptor must allow): a file the user may not read
        is ``PermissionError`` even through a descriptor someone else opened. Like an open
        descriptor, a registered file stays readable after it is unlinked.
        """
        if flags & os.O_APPEND:
            raise OSError(errno.EINVAL, "usrbio writes are positional: O_APPEND cannot be registered")
        if isinstance(file, int):
            fd, own = file, False
        else:
            fd, own = os.open(file, flags | os.O_CLOEXEC, mode), True
        try:
            reply = self._control({"op": "register", "flags": flags & os.O_ACCMODE}, [fd])
        finally:
            if own:
                os.close(fd)
        file_id = int(reply["file"])
        self._files.add(file_id)
        return file_id

    def deregister(self, file_id: int) -> None:
        """Close a registered file in the daemon (I/Os already submitted on it complete first)."""
        self._control({"op": "deregister", "file": file_id})
        self._files.discard(file_id)

    def _iov_id(self, iov: Iov) -> int:
        known = self._iov_ids.get(id(iov))
        if known is not None and known[0] is iov:
            return known[1]
        if iov.closed:
            raise ValueError("the Iov is closed")
        if len(self._iov_ids) >= IOVS_PER_RING_MAX:
            raise OSError(errno.ENOSPC, f"a ring takes at most {IOVS_PER_RING_MAX} Iovs")
        reply = self._control({"op": "iov", "size": iov.size_bytes}, [iov.fd])
        self._iov_ids[id(iov)] = (iov, int(reply["iov"]))
        return int(reply["iov"])

    # -- I/O -------------------------------------------------------------------------------------

    def prep_io(self, iov: Iov, file_id: int, offset: int, length: int, iov_offset: int = 0,
                userdata: int = 0, write: bool = False) -> int:
        """Queue one I/O (``hf3fs_prep_io``): ``length`` bytes at ``offset`` of the file, into (or
        from) ``iov`` at ``iov_offset``; returns its slot. Ranges are checked by the daemon (a bad
        one completes with ``-errno``); a full ring is ``BlockingIOError`` (wait first)."""
        self._check_open()
        if self._outstanding + self._prepped >= self.entries:
            raise BlockingIOError(errno.EAGAIN, f"the ring's {self.entries} entries are all in use: wait for "
                                                "completions first")
        if not 0 <= file_id <= INDEX_MASK:  # masked to the entry's 32 bits, it named another file
            raise ValueError(f"no registered file can have the id {file_id}")
        if not 0 <= userdata <= USERDATA_MAX:
            raise ValueError(f"userdata is an unsigned 64-bit number, not {userdata}")
        iov_id = self._iov_id(iov)
        index = (self._sq_tail + self._prepped) & INDEX_MASK
        slot = index % self._slots
        entry = Sqe(OP_WRITE if write else OP_READ, iov_id, file_id, _i64(offset), _i64(length),
                    _i64(iov_offset), userdata)
        entry.pack_into(self._ring, HEADER_BYTES + slot * SQE.size)
        self._prepped += 1
        return slot

    def submit(self) -> int:
        """Hand the prepared I/Os to the daemon (``hf3fs_submit_ios``); returns how many."""
        count = self._prepped
        if not count:
            return 0
        self._sq_tail = (self._sq_tail + count) & INDEX_MASK
        _U32.pack_into(self._ring, SQ_TAIL_AT, self._sq_tail)
        self._prepped = 0
        self._outstanding += count
        self._send(DOORBELL_SUBMIT + _U32.pack(count))
        return count

    def wait(self, min_results: int = 1, timeout_s: float | None = None, max_results: int | None = None) -> \
            list[Completion]:
        """Reap finished I/Os (``hf3fs_wait_for_ios``): waits until ``min_results`` are done (at
        most the I/Os outstanding) or ``timeout_s`` passed, then returns those done (up to
        ``max_results``), in the order they finished."""
        self._check_open()
        want = min(min_results, self._outstanding)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._ready() < want:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            self._receive(remaining)
            self._drain()
        return self._reap(max_results)

    def _ready(self) -> int:
        ready = int(_U32.unpack_from(self._ring, CQ_TAIL_AT)[0] - self._cq_head) & INDEX_MASK
        if ready > self._outstanding:
            raise ConnectionError(errno.EPROTO, f"the fs3 mount daemon of {self.mountpoint} reported {ready} "
                                                f"completions for {self._outstanding} I/Os")
        return ready

    def _drain(self) -> None:
        """Read the doorbells already queued (non-blocking): they only wake the waiter."""
        while True:
            try:
                message = self._sock.recv(_MESSAGE_BYTES_MAX, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except (ConnectionResetError, BrokenPipeError) as exc:
                if self._ready():
                    return  # reap what finished first; the next wait reports the loss
                raise self._gone(exc.strerror or type(exc).__name__) from None
            if not message:
                if self._ready():
                    return
                raise self._gone("its end of the socket closed")

    def _reap(self, max_results: int | None) -> list[Completion]:
        count = self._ready()
        if max_results is not None:
            count = min(count, max_results)
        base = HEADER_BYTES + self._slots * SQE.size
        done = []
        for _ in range(count):
            slot = self._cq_head % self._slots
            userdata, result = CQE.unpack_from(self._ring, base + slot * CQE.size)
            done.append(Completion(userdata, result))
            self._cq_head = (self._cq_head + 1) & INDEX_MASK
        if count:
            _U32.pack_into(self._ring, CQ_HEAD_AT, self._cq_head)
            self._outstanding -= count
        return done

    @property
    def outstanding(self) -> int:
        """I/Os submitted and not reaped yet."""
        return self._outstanding

    def server_stats(self) -> dict[str, int]:
        """The daemon's usrbio counts (connections, registered files, mapped bytes, open handles of
        the whole mount): for diagnostics and tests."""
        reply = self._control({"op": "stats"})
        return {key: int(value) for key, value in reply.items()}

    def close(self) -> None:
        """Close the connection: the daemon closes the ring's files and unmaps its buffers."""
        if self.closed:
            return
        self.closed = True
        self._sock.close()
        with contextlib.suppress(BufferError):
            self._ring.close()
        os.close(self._ring_fd)
        self._iov_ids.clear()

    def __enter__(self) -> IoRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _i64(value: int) -> int:
    """Clamp to the entry's signed 64-bit field (the daemon refuses what is out of range)."""
    return max(-(1 << 63), min((1 << 63) - 1, int(value)))

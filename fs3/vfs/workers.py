"""Data-path worker processes for one mount (``fs3 mount --workers N``).

One Python process serves every request of a mount. About half of its work on reads is the data
path (chunk reads and writes, read-ahead, protobuf and socket work to storage), which parallelises
by file; the rest is pyfuse3's request loop, which one FUSE session keeps in one process (see
docs/decisions.md). So the mount keeps ONE front process that owns the FUSE session and all
namespace state exactly as with one worker (names given to the kernel, the attribute cache,
directory handles, handle numbers), and moves the open files themselves to ``N`` data workers:

* each worker is a fresh interpreter (never a fork: no socket or loop crosses processes) with its
  own fs3 client, so meta sessions of the files it opens are its own and are closed by it: a
  write session stays exactly-once, opened and closed by the one process that holds its buffers;
* every handle of one inode lives on the same worker while any is open (the front keeps the
  owner of each open inode), so handles of one file see each other's writes as before and
  ``O_APPEND`` picks its offset where the file's writes are ordered;
* each reply carries the handle's length, whether it has unpublished writes and whether its
  session lapsed, so the front answers ``getattr`` of a file being written with the writers'
  length as before (:meth:`AsyncFileSystem.with_local_length` sees :class:`RemoteFile` objects
  in the front client's table of open files);
* read data lands in a shared-memory area per worker (a ``memfd`` both map), which the front
  replies from: one copy out of the worker, one into the reply; written data and everything else
  travels over a Unix socket per worker;
* a worker that dies fails its open files with ``EIO`` (the session lapses at meta with its
  lease), new opens go to the workers left, and a new worker takes its place (at most one start
  per place every few seconds); the mount itself never waits on a dead worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from typing import Any, cast

from fs3 import meta_pb2 as mpb
from fs3.client.files import AsyncFile
from fs3.client.fs import AsyncFileSystem
from fs3.common.errors import FS3Error, error_for
from fs3.common.posix import O_ACCMODE, O_APPEND, O_CREAT, O_EXCL, O_RDONLY, O_RDWR, O_TRUNC, O_WRONLY
from fs3.vfs.core import Vfs, VfsConfig

__all__ = ["DataWorker", "DataWorkers", "ReadSlots", "RemoteFile", "WorkerSettings", "WorkerVfs", "error_from_worker",
           "worker_error", "worker_for_inode", "worker_for_name"]

log = logging.getLogger("fs3.vfs.workers")  # also when run as __main__

_HEADER = struct.Struct("!I")
_FRAME_MAX_BYTES = 64 << 20          # far above a FUSE request (1 MiB at most)
_START_TIMEOUT_S = 60.0
# Shared read buffers per worker: slots of the largest FUSE read (1 MiB); a read finding no free
# slot goes over the socket instead.
_SLOT_BYTES = 1 << 20
_SLOTS = 16
_RESTART_INTERVAL_S = 5.0   # a worker that keeps dying is started again at most this often
# A worker is asked to answer a ping this often; one that has not answered within its settings'
# ping_timeout_s (stopped, wedged) is killed, so its files answer EIO instead of hanging the
# callers (a close(2) would otherwise wait until unmount) and a new worker takes its place.
_PING_INTERVAL_S = 2.0
# (length, has unpublished writes, stale): a handle's state as of a reply.
_State = tuple[int, bool, bool]


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > _FRAME_MAX_BYTES:
        raise ConnectionError(f"frame of {size} bytes from a data worker link")
    # Both ends are this package in processes of one mount (a socketpair): pickle is not a trust boundary.
    return pickle.loads(await reader.readexactly(size))


def _frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


class _Sender:
    """Frames for one link, written together once per loop iteration: with many requests in
    flight, one send (and one wake-up of the other process) carries several (a send per frame
    was a fifth of the front's time). Unbounded on purpose: what is queued is bounded by the
    requests in flight, which the kernel bounds for the mount."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._frames: list[bytes] = []

    def send(self, obj: Any) -> None:
        if self.writer.is_closing():
            raise ConnectionResetError("the data worker link is closed")
        if not self._frames:
            asyncio.get_running_loop().call_soon(self._flush)
        self._frames.append(_frame(obj))

    def _flush(self) -> None:
        frames, self._frames = self._frames, []
        if not self.writer.is_closing():
            self.writer.write(b"".join(frames) if len(frames) > 1 else frames[0])


def worker_error(exc: BaseException) -> tuple[bool, int, str]:
    """A worker's failure as sent to the front: (is an fs3 error, its status code or errno, message).

    An fs3 error keeps its type across the process boundary (:func:`error_from_worker`): the VFS decides by
    type — a ``NotFound`` from an open by a stale name becomes ``ESTALE``, so the kernel looks the
    name up again, where a bare ``ENOENT`` would tell the caller the file does not exist."""
    if isinstance(exc, FS3Error):
        return True, int(exc.code), exc.message
    if isinstance(exc, OSError):
        return False, exc.errno or errno.EIO, exc.strerror or str(exc)
    return False, errno.EIO, f"{type(exc).__name__}: {exc}"


def error_from_worker(value: tuple[bool, int, str]) -> Exception:
    """The exception a worker's failure reply stands for, of the type the worker raised."""
    typed, code, message = value
    return error_for(code, message) if typed else OSError(code, message)


# -- the front's side ------------------------------------------------------------------------------


class ReadSlots:
    """A shared-memory area a worker reads file data into and the front replies from."""

    def __init__(self, fd: int, slots: int = _SLOTS, slot_bytes: int = _SLOT_BYTES) -> None:
        self.fd = fd
        self.slot_bytes = slot_bytes
        self._map = mmap.mmap(fd, slots * slot_bytes)
        self._free = list(range(slots))
        self._closed = False

    @classmethod
    def create(cls, slots: int = _SLOTS, slot_bytes: int = _SLOT_BYTES) -> ReadSlots:
        fd = os.memfd_create("fs3-read-slots")
        os.ftruncate(fd, slots * slot_bytes)
        return cls(fd, slots, slot_bytes)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        if not self._closed:
            self._free.append(slot)

    def read(self, slot: int, size: int) -> bytes:
        start = slot * self.slot_bytes
        return self._map[start:start + size]

    def fill(self, slot: int, data: bytes) -> None:
        start = slot * self.slot_bytes
        self._map[start:start + len(data)] = data

    def close(self) -> None:
        if self._closed:
            return  # the fd number may belong to another file by now
        self._closed = True
        self._free = []
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class DataWorker:
    """One worker process and the link to it, as the front sees it."""

    def __init__(self, index: int, proc: subprocess.Popen[bytes], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, slots: ReadSlots | None = None) -> None:
        self.index = index
        self.slots = slots
        self.proc = proc
        self._reader = reader
        self._writer = writer
        self._sender = _Sender(writer)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = 0
        self.alive = True
        self._closing = False
        self.on_exit: Callable[[DataWorker], None] | None = None  # once, when the link ends
        self._reads: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start_reading(self, ping_timeout_s: float = 0.0) -> None:
        """Take the worker's answers from now on; ``ping_timeout_s`` > 0 also watches that it answers."""
        loop = asyncio.get_running_loop()
        self._reads = loop.create_task(self._read_loop())
        if ping_timeout_s > 0:
            self._watchdog = loop.create_task(self._watch(ping_timeout_s))

    async def _watch(self, ping_timeout_s: float) -> None:
        """Kill the worker once it stops answering: the link then ends, its callers get EIO, and
        the pool starts another (a stopped process never closes its link by itself)."""
        while self.alive and not self._closing:
            await asyncio.sleep(_PING_INTERVAL_S)
            if not self.alive or self._closing:
                return
            try:
                await asyncio.wait_for(self.request("ping"), ping_timeout_s)
            except TimeoutError:
                if self.alive and not self._closing:
                    log.error("data worker %d (pid %d) did not answer for %.0f s: killed; its open files answer "
                              "EIO", self.index, self.proc.pid, ping_timeout_s)
                    with contextlib.suppress(OSError):
                        self.proc.kill()
                return
            except OSError:
                return  # the link ended: the read loop has failed everything already

    async def _read_loop(self) -> None:
        try:
            while True:
                req_id, ok, value = await _read_frame(self._reader)
                future = self._pending.pop(req_id, None)
                if future is None or future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(error_from_worker(value))
        except (ConnectionError, asyncio.IncompleteReadError, OSError, pickle.UnpicklingError, ValueError) as exc:
            if self.alive and not self._closing:
                log.error("data worker %d (pid %d) is gone: %s; its open files answer EIO", self.index,
                          self.proc.pid, exc or "end of stream")
        finally:
            self._fail_all()

    def _fail_all(self) -> None:
        was_alive, self.alive = self.alive, False
        self.proc.poll()  # reaped if it has exited
        if self.slots is not None:
            # Nothing writes into them any more. After the wake-ups already scheduled: a read
            # whose answer came just before the end still takes its data out.
            asyncio.get_running_loop().call_soon(self.slots.close)
        if was_alive and self.on_exit is not None:
            self.on_exit(self)
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(OSError(errno.EIO, f"data worker {self.index} exited"))

    def _dead(self) -> OSError:
        return OSError(errno.EIO, f"data worker {self.index} exited")

    async def request(self, op: str, *args: Any) -> Any:
        if not self.alive:
            raise self._dead()
        self._ids += 1
        req_id = self._ids
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = future
        try:
            self._sender.send((req_id, op, args))
        except (ConnectionError, OSError):
            self._pending.pop(req_id, None)
            self._fail_all()
            raise self._dead() from None
        try:
            return await future
        finally:
            self._pending.pop(req_id, None)

    def tell(self, op: str, *args: Any) -> None:
        """A call whose answer nobody waits for (applied in order with the calls around it)."""
        if not self.alive:
            return
        try:
            self._sender.send((0, op, args))
        except (ConnectionError, OSError):
            self._fail_all()

    async def close(self, timeout_s: float) -> None:
        """End of stream to the worker: it closes what it still holds, its client, and exits."""
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        with contextlib.suppress(ConnectionError, OSError):
            self._writer.close()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.proc.poll() is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self.proc.poll() is None:
            log.warning("data worker %d (pid %d) did not exit within %.0fs: killed", self.index, self.proc.pid,
                        timeout_s)
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        self.alive = False
        if self.slots is not None:
            self.slots.close()
        if self._reads is not None:
            self._reads.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reads


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What a worker needs to connect its own client (sent over its link, never in argv or env)."""

    mgmtd: str
    token: str | None
    transport: str
    tls: dict[str, str] | None
    log_level: str
    inflight_per_file: int = 8
    ping_timeout_s: float = 30.0    # a worker silent this long is killed and replaced (0: never)


def worker_for_inode(inode_id: int, count: int) -> int:
    """Which of ``count`` live workers opens ``inode_id`` when none holds a handle of it."""
    return inode_id % count


def worker_for_name(parent: int, name: bytes, count: int) -> int:
    """Which of ``count`` live workers creates ``parent``/``name`` (its inode is not known yet)."""
    return zlib.crc32(name, parent & 0xFFFFFFFF) % count


class DataWorkers:
    """The mount's data workers and which one holds the open handles of each inode."""

    def __init__(self, workers: list[DataWorker], settings: WorkerSettings | None = None,
                 start_timeout_s: float = _START_TIMEOUT_S) -> None:
        """``settings``: how to start a worker in the place of one that died (None: never)."""
        self.workers = workers
        # inode -> (worker, handles open or being opened there)
        self._owners: dict[int, tuple[DataWorker, int]] = {}
        self._settings = settings
        self._start_timeout_s = start_timeout_s
        self._closing = False
        self._restarts: set[asyncio.Task[None]] = set()
        self._last_start: dict[int, float] = {}
        for worker in workers:
            worker.on_exit = self._exited

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    @classmethod
    async def start(cls, count: int, settings: WorkerSettings, timeout_s: float = _START_TIMEOUT_S) -> DataWorkers:
        if count < 1:
            raise ValueError("at least one data worker")
        started: list[DataWorker] = []
        try:
            for index in range(count):
                started.append(await cls._spawn(index, settings))
            for worker in started:
                await cls._ready(worker, timeout_s, settings.ping_timeout_s)
        except BaseException:
            for worker in started:
                await worker.close(timeout_s=2.0)
            raise
        return cls(started, settings, timeout_s)

    @staticmethod
    async def _ready(worker: DataWorker, timeout_s: float, ping_timeout_s: float) -> None:
        ready = await asyncio.wait_for(_read_frame(worker._reader), timeout_s)
        if ready != "ready":
            raise OSError(errno.EIO, f"data worker {worker.index} failed to start: {ready}")
        worker.start_reading(ping_timeout_s)

    def _exited(self, worker: DataWorker) -> None:
        if self._closing or self._settings is None or self.workers[worker.index] is not worker:
            return
        task = asyncio.get_running_loop().create_task(self._restart(worker.index))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, index: int) -> None:
        """A new worker in the place of one that died (its files stay failed: their buffers and
        sessions died with it)."""
        loop = asyncio.get_running_loop()
        wait_s = self._last_start.get(index, -_RESTART_INTERVAL_S) + _RESTART_INTERVAL_S - loop.time()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        self._last_start[index] = loop.time()
        assert self._settings is not None
        try:
            worker = await self._spawn(index, self._settings)
        except OSError as exc:
            log.error("data worker %d could not be started again: %s", index, exc)
            self._exited(self.workers[index])  # tried again after the interval
            return
        try:
            await self._ready(worker, self._start_timeout_s, self._settings.ping_timeout_s)
        except (OSError, asyncio.IncompleteReadError, pickle.UnpicklingError) as exc:  # OSError: timeouts too
            log.error("data worker %d could not be started again: %s", index, exc)
            await worker.close(timeout_s=2.0)
            self._exited(self.workers[index])
            return
        if self._closing:
            await worker.close(timeout_s=5.0)
            return
        worker.on_exit = self._exited
        self.workers[index] = worker
        log.warning("data worker %d started again (pid %d)", index, worker.pid)

    @staticmethod
    async def _spawn(index: int, settings: WorkerSettings) -> DataWorker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        slots = ReadSlots.create()
        try:
            proc = subprocess.Popen([sys.executable, "-P", "-m", "fs3.vfs.workers", str(theirs.fileno()), str(index),
                                     str(slots.fd)], pass_fds=(theirs.fileno(), slots.fd), stdin=subprocess.DEVNULL)
        except BaseException:
            slots.close()
            raise
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=_FRAME_MAX_BYTES)
        writer.write(_frame(dataclasses.asdict(settings)))
        await writer.drain()
        return DataWorker(index, proc, reader, writer, slots)

    def _alive(self) -> list[DataWorker]:
        alive = [w for w in self.workers if w.alive]
        if not alive:
            raise OSError(errno.EIO, "every data worker of this mount has exited")
        return alive

    def owner(self, inode_id: int) -> DataWorker | None:
        found = self._owners.get(inode_id)
        if found is None:
            return None
        return found[0] if found[0].alive else None

    def claim(self, inode_id: int, worker: DataWorker | None = None) -> DataWorker:
        """The worker that holds (or will hold) the handles of ``inode_id``; one more handle there."""
        current = self.owner(inode_id)
        if current is None:
            if worker is None:
                alive = self._alive()
                worker = alive[worker_for_inode(inode_id, len(alive))]
            self._owners[inode_id] = (worker, 1)
            return worker
        self._owners[inode_id] = (current, self._owners[inode_id][1] + 1)
        return current

    def release(self, inode_id: int, worker: DataWorker) -> None:
        found = self._owners.get(inode_id)
        if found is None or found[0] is not worker:
            return  # the inode moved on after its worker died
        if found[1] <= 1:
            del self._owners[inode_id]
        else:
            self._owners[inode_id] = (found[0], found[1] - 1)

    def for_name(self, parent: int, name: bytes) -> DataWorker:
        alive = self._alive()
        return alive[worker_for_name(parent, name, len(alive))]

    async def close(self, timeout_s: float = 30.0) -> None:
        self._closing = True
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)
        await asyncio.gather(*(w.close(timeout_s) for w in self.workers))


class RemoteFile:
    """An open file held by a data worker: the members of :class:`AsyncFile` that :class:`Vfs` and
    the client's table of open files use, each a call to the worker (or its state as of the last)."""

    def __init__(self, fs: AsyncFileSystem, pool: DataWorkers, worker: DataWorker, hid: int, rsp: mpb.OpenRsp,
                 path: str, readable: bool, writable: bool, append: bool) -> None:
        self.fs = fs
        self.name = path
        self.inode = rsp.inode
        self.readable = readable
        self.writable = writable
        self.append = append
        self.closed = False
        self._pool = pool
        self._worker = worker
        self._hid = hid
        self._state: _State = (rsp.inode.size, False, False)
        fs.track_file(cast(AsyncFile, self))

    @property
    def length(self) -> int:
        return self._state[0]

    @property
    def has_unpublished_writes(self) -> bool:
        return self._state[1]

    @property
    def stale(self) -> bool:
        return self._state[2] or not self._worker.alive

    async def _call(self, op: str, *args: Any) -> Any:
        if self.closed:
            raise OSError(errno.EBADF, "I/O on a closed file")
        value, self._state = await self._worker.request(op, self._hid, *args)
        return value

    def end_of_file(self) -> int:
        """-1: the worker writes at the end as it knows it (where every handle's writes meet)."""
        return -1

    async def pread(self, offset: int, size: int) -> bytes:
        slots = self._worker.slots
        slot = slots.take() if slots is not None and size <= slots.slot_bytes else None
        if slots is None or slot is None:
            return cast(bytes, await self._call("pread", offset, size))
        # Shielded: a cancelled read (the kernel's FUSE_INTERRUPT) leaves the worker writing into
        # the slot, which goes back to the free list only once the worker has answered (or died).
        answer = asyncio.ensure_future(self._call("pread_into", offset, size, slot))
        try:
            got = cast(int, await asyncio.shield(answer))
        except asyncio.CancelledError:
            def give_back(done: asyncio.Future[Any]) -> None:
                if not done.cancelled():
                    done.exception()  # retrieved: nobody awaits this answer any more
                slots.give(slot)

            answer.add_done_callback(give_back)
            raise
        except BaseException:
            slots.give(slot)
            raise
        data = slots.read(slot, got)
        slots.give(slot)
        return data

    async def pwrite(self, offset: int, data: bytes) -> int:
        return cast(int, await self._call("pwrite", offset, bytes(data)))

    async def publish_length(self) -> mpb.Inode | None:
        if not self._worker.alive and not self.has_unpublished_writes:
            return None  # nothing of this handle's was lost with its worker: a reader's close succeeds
        raw = await self._call("publish")
        return None if raw is None else mpb.Inode.FromString(raw)

    async def fsync(self) -> None:
        await self._call("fsync")

    async def truncate(self, size: int | None = None) -> int:
        done = cast(int, await self._call("truncate", size))
        for sibling in self._siblings():  # the worker told its own handles; these are their copies here
            sibling._state = (done, sibling._state[1], sibling._state[2])
        return done

    def _siblings(self) -> list[RemoteFile]:
        """The front's copies of this file's other handles (all on the same worker)."""
        found: list[object] = list(self.fs.open_files(self.inode.inode_id))
        return [f for f in found if isinstance(f, RemoteFile) and f is not self]

    async def settle(self) -> None:
        await self._call("settle")

    def set_known_length(self, size: int) -> None:
        self._state = (size, self._state[1], self._state[2])
        self._worker.tell("set_known_length", self._hid, size)

    def extend_known_length(self, size: int) -> None:
        if size > self._state[0]:
            self._state = (size, self._state[1], self._state[2])

    async def close(self, *, gather_session_end: bool = False) -> None:
        """As :meth:`AsyncFile.close`; ``gather_session_end`` is the worker's to honour (its client
        holds the session and batches the ends of its own sessions)."""
        if self.closed:
            return
        self.closed = True
        self.fs.untrack_file(cast(AsyncFile, self))
        for sibling in self._siblings():  # what this handle wrote stays readable (as AsyncFile.close)
            sibling.extend_known_length(self.length)
        try:
            if self._worker.alive:
                await self._worker.request("close", self._hid, gather_session_end)
        finally:
            # Only now: an open of the file while the worker still closes this handle (its last
            # writes landing, its length published) must go to the same worker and see them.
            self._pool.release(self.inode.inode_id, self._worker)


class WorkerVfs(Vfs):
    """The mount's :class:`Vfs` with open files held by data workers (everything else unchanged)."""

    def __init__(self, fs: AsyncFileSystem, pool: DataWorkers, config: VfsConfig | None = None,
                 drop_entry: Callable[[int, bytes], None] | None = None) -> None:
        super().__init__(fs, config, drop_entry)
        self.pool = pool
        # id(answer) -> (answer, worker, handle there), from the meta open to the handle made of it.
        self._opened: dict[int, tuple[mpb.OpenRsp, DataWorker, int]] = {}

    async def _open_at_meta(self, target: int | mpb.PathRef, flags: int, user: mpb.User,
                            mode: int = 0) -> mpb.OpenRsp:
        inode_id = target if isinstance(target, int) else target.inode_id
        wire = target if isinstance(target, int) else target.SerializeToString()
        if inode_id:
            worker = self.pool.claim(inode_id)
            try:
                raw, hid = await worker.request("open", wire, flags, mode, user.SerializeToString())
            except BaseException:
                self.pool.release(inode_id, worker)
                raise
            rsp = mpb.OpenRsp.FromString(raw)
        else:  # a create: the inode is known once meta answers
            assert isinstance(target, mpb.PathRef)
            worker = self.pool.for_name(target.parent, bytes(target.path))
            raw, hid = await worker.request("open", wire, flags, mode, user.SerializeToString())
            rsp = mpb.OpenRsp.FromString(raw)
            owner = self.pool.owner(rsp.inode.inode_id)
            if hid and owner is not None and owner is not worker:
                # Another worker holds handles of this file (an O_CREAT open of an existing file):
                # the new handle must be with them. Meta already did the create and truncate.
                await worker.request("close", hid)
                created = rsp.created
                raw, hid = await owner.request("open", rsp.inode.inode_id, flags & ~(O_CREAT | O_EXCL | O_TRUNC), 0,
                                            user.SerializeToString())
                rsp = mpb.OpenRsp.FromString(raw)
                rsp.created = created
                worker = owner
            if hid:
                self.pool.claim(rsp.inode.inode_id, worker)
        if hid:
            self._opened[id(rsp)] = (rsp, worker, hid)
        elif inode_id:
            self.pool.release(inode_id, worker)
        return rsp

    def _new_file(self, path: str, rsp: mpb.OpenRsp, readable: bool, writable: bool, append: bool,
                  user: mpb.User) -> AsyncFile:
        _, worker, hid = self._opened.pop(id(rsp))
        # Duck-typed: RemoteFile has every member of AsyncFile that Vfs and the client's table of
        # open files use (see its docstring).
        return cast(AsyncFile, RemoteFile(self.fs, self.pool, worker, hid, rsp, path, readable, writable, append))


# -- the worker's side -----------------------------------------------------------------------------


class _Server:
    """The open files of one worker process; each request names its handle."""

    def __init__(self, fs: AsyncFileSystem, inflight_per_file: int, slots: ReadSlots | None = None) -> None:
        self.fs = fs
        self.slots = slots
        self.inflight_per_file = inflight_per_file
        self.files: dict[int, AsyncFile] = {}
        self._ids = 0

    def _file(self, hid: int) -> AsyncFile:
        afile = self.files.get(hid)
        if afile is None:
            raise OSError(errno.EBADF, f"no open file handle {hid} in this data worker")
        return afile

    @staticmethod
    def _state(afile: AsyncFile) -> _State:
        return afile.length, afile.has_unpublished_writes, afile.stale

    async def open(self, wire: int | bytes, flags: int, mode: int, user_raw: bytes) -> tuple[bytes, int]:
        user = mpb.User.FromString(user_raw)
        target: int | mpb.PathRef = wire if isinstance(wire, int) else mpb.PathRef.FromString(wire)
        rsp = await self.fs.metadata.open(target, flags, mode=mode, user=user)
        if rsp.inode.type == mpb.DIRECTORY:
            return rsp.SerializeToString(), 0
        access = flags & O_ACCMODE
        afile = AsyncFile(self.fs, f"inode:{rsp.inode.inode_id}", rsp, access in (O_RDONLY, O_RDWR),
                          access in (O_WRONLY, O_RDWR), bool(flags & O_APPEND), self.inflight_per_file, user)
        self._ids += 1
        self.files[self._ids] = afile
        return rsp.SerializeToString(), self._ids

    async def call(self, op: str, args: tuple[Any, ...]) -> Any:
        if op == "ping":
            return None  # answered by the event loop: the worker is neither stopped nor wedged
        if op == "open":
            return await self.open(*args)
        hid = args[0]
        if op == "close":
            afile = self.files.pop(hid, None)
            if afile is not None:
                await afile.close(gather_session_end=bool(args[1]) if len(args) > 1 else False)
            return None
        afile = self._file(hid)
        value: Any = None
        if op == "pread":
            value = await afile.pread(args[1], args[2])
        elif op == "pread_into":
            data = await afile.pread(args[1], args[2])
            if self.slots is None:
                raise OSError(errno.EIO, "this data worker has no shared read buffers")
            self.slots.fill(args[3], data)
            value = len(data)
        elif op == "pwrite":
            offset = args[1] if args[1] >= 0 else afile.end_of_file()
            value = await afile.pwrite(offset, args[2])
        elif op == "publish":
            inode = await afile.publish_length()
            value = None if inode is None else inode.SerializeToString()
        elif op == "fsync":
            await afile.fsync()
        elif op == "truncate":
            value = await afile.truncate(args[1])
        elif op == "settle":
            await afile.settle()
        else:
            raise OSError(errno.ENOSYS, f"unknown data worker call {op!r}")
        return value, self._state(afile)

    def tell(self, op: str, args: tuple[Any, ...]) -> None:
        if op == "set_known_length":
            afile = self.files.get(args[0])
            if afile is not None:
                afile.set_known_length(args[1])

    async def close(self) -> None:
        for hid in list(self.files):
            afile = self.files.pop(hid)
            with contextlib.suppress(Exception):
                await afile.close()


async def _serve(sock: socket.socket, index: int, slots: ReadSlots | None) -> None:
    import fs3.aio
    from fs3.common.logging import setup_logging
    from fs3.rpc.tls import TlsConfig

    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=_FRAME_MAX_BYTES)
    settings = WorkerSettings(**await _read_frame(reader))
    setup_logging(f"mount-worker-{index}", settings.log_level)
    try:
        fs = await fs3.aio.connect(settings.mgmtd, token=settings.token, transport=settings.transport,
                                   tls=TlsConfig(**settings.tls) if settings.tls else None)
    except BaseException as exc:
        writer.write(_frame(f"cannot connect: {exc}"))
        await writer.drain()
        raise
    server = _Server(fs, settings.inflight_per_file, slots)
    tasks: set[asyncio.Task[None]] = set()
    sender = _Sender(writer)

    async def answer(req_id: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            reply = (req_id, True, await server.call(op, args))
        except Exception as exc:
            if not isinstance(exc, OSError | FS3Error):
                log.exception("%s failed", op)
            reply = (req_id, False, worker_error(exc))
        with contextlib.suppress(ConnectionError, OSError):
            sender.send(reply)

    writer.write(_frame("ready"))
    await writer.drain()
    log.info("data worker %d serving (pid %d)", index, os.getpid())
    try:
        while True:
            try:
                req_id, op, args = await _read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break  # the front closed the link (unmount) or died
            if req_id == 0:
                server.tell(op, args)
                continue
            task = asyncio.get_running_loop().create_task(answer(req_id, op, args))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        await server.close()
        await fs.close()
        log.info("data worker %d done", index)


def main(argv: list[str]) -> int:
    """``python -m fs3.vfs.workers FD INDEX [SLOTS_FD]``: serve the front on the inherited socket
    ``FD``, reading file data into the shared read buffers of ``SLOTS_FD`` when given."""
    # Signals to the mount's process group are the front's to act on: it unmounts, releases every
    # handle through us, then closes the link, which ends this process.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    slots = ReadSlots(int(argv[2])) if len(argv) > 2 else None
    try:
        import uvloop

        uvloop.run(_serve(sock, int(argv[1]), slots))
    except (ConnectionError, OSError) as exc:
        print(f"fs3 data worker: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

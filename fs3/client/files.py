"""Open files of the asyncio client: chunked, parallel, buffered I/O straight to storage.

A file's bytes live in chunks on chains (``fs3.common.layout``); meta only knows the length. Writes
are cut at chunk boundaries, gathered into one buffer per chunk piece, and sent to the chunk's
chain head in the background with a bounded number in flight (so memory per open file is
bounded); errors surface at the next write, ``flush``, ``fsync`` or ``close``. Reads fan out over
the chunks they cover in parallel; sequential small reads grow a read-ahead window. Holes and
short chunks read as zeros up to the file's length.

A handle belongs to a session on meta, which lives as long as the client's lease. Once meta has
expired the lease, it closes the session: an unlinked file's chunks may be collected (reads would
see zeros) and the length is set without later writes. So every read and write must finish while
the lease surely holds (:meth:`~fs3.client.meta.Meta.lease_current`, free while renewals are on
time; past it the client renews first); a handle of a lapsed lease fails every call with ESTALE
(:class:`~fs3.common.errors.StaleClient`) instead of returning zeros or dropping writes.

Handles of one client on one file see each other as a local file system's descriptors do (the
client keeps them in :meth:`AsyncFileSystem.open_files`): a read first sends the other handles'
buffered bytes and learns how far they wrote, a write drops the other handles' read-ahead, an
append goes to the end any of them knows, and a size change (truncate, ``O_TRUNC``) first makes
every handle's writes land and their length known to meta, then tells every handle the new size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from fs3 import meta_pb2 as mpb
from fs3.client.capability import FileCapability
from fs3.client.oserrors import os_errors
from fs3.common.buffers import Buffer
from fs3.common.errors import BadHandle, FileTooLarge, FS3Error, InvalidArgument, StaleClient, UnknownMethod
from fs3.common.ids import CLIENT_ID_BYTES
from fs3.common.layout import chunk_location, max_file_size
from fs3.common.posix import S_ISGID, S_ISUID, S_IXGRP

if TYPE_CHECKING:
    from fs3.client.fs import AsyncFileSystem

__all__ = ["AsyncFile"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_READAHEAD_MIN_BYTES = 128 * 1024
_HINT_INTERVAL_S = 1.0


class AsyncFile:
    """A binary file open on fs3 (``await fs.open(path, "rb")``)."""

    def __init__(self, fs: AsyncFileSystem, path: str, rsp: mpb.OpenRsp, readable: bool, writable: bool,
                 append: bool, inflight_max: int = 8, user: mpb.User | None = None) -> None:
        """``user``: who opened the file (default: the client's identity)."""
        self.fs = fs
        self.user = user if user is not None else fs.metadata.default_user()
        self.name = path
        self.inode = rsp.inode
        self.session_id = rsp.session_id
        # A session id starts with the id of the client that opened it (see fs3.common.ids).
        self._client_id = rsp.session_id[:CLIENT_ID_BYTES] if rsp.session_id else fs.metadata.client_id
        self.readable = readable
        self.writable = writable
        self.append = append
        # What lets this handle reach the file's chunks on storage (meta signed it at the open).
        access = (mpb.CAPABILITY_READ if readable else 0) | (mpb.CAPABILITY_WRITE if writable else 0)
        self.capability = FileCapability(fs.metadata, fs.storage.clock, rsp.inode.inode_id, rsp.session_id,
                                         access or mpb.CAPABILITY_READ, self.user, rsp.capability,
                                         rsp.capability_ttl_ms)
        self.closed = False
        self.layout = rsp.inode.layout
        self.chunk_size = self.layout.chunk_size
        self._pos = 0
        self._length = rsp.inode.size
        self._wrote = False
        # How far this handle may write before meta must grant it a byte credit for the quotas
        # above the file (fs3.meta.quota.reserve); None: no quota exists, it never asks.
        self._credit_end: int | None = None if rsp.quota_free or not writable else rsp.inode.size
        # A write by anyone but root drops setuid (and group-executable setgid) first, as on Linux.
        mode = rsp.inode.mode
        self._drop_privileges = writable and self.user.uid != 0 and rsp.inode.type == mpb.FILE and bool(
            mode & S_ISUID or (mode & S_ISGID and mode & S_IXGRP))
        self._written_end = 0
        # Writes made, and how many of them meta has an exact length for (after a flush): a close
        # with nothing new to publish spares meta a probe of storage.
        self._writes = 0
        self._published_writes = 0
        self._buf_offset = 0
        self._buf = bytearray()
        self._slots = asyncio.Semaphore(inflight_max)
        # Chunk writes in flight and the file range each covers: a write never overtakes an
        # earlier one (of any handle of this client) over the same bytes.
        self._inflight: dict[asyncio.Task[None], tuple[int, int]] = {}
        self._error: BaseException | None = None
        self._last_hint = time.monotonic()
        self._hint_task: asyncio.Task[None] | None = None
        self._ra_window = _READAHEAD_MIN_BYTES
        # Sequential reads keep up to one chunk per in-flight slot fetched ahead of the reader.
        self._readahead_max = max(_READAHEAD_MIN_BYTES, inflight_max * self.chunk_size)
        self._ahead: deque[tuple[int, int, asyncio.Task[bytes]]] = deque()
        self._last_read_end = -1
        self._readahead_stale = False
        self._forked = False
        fs.track_file(self)

    # -- position --------------------------------------------------------------------------------

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        with os_errors(self.name):
            return self._seek(offset, whence)

    def _seek(self, offset: int, whence: int) -> int:
        self._check_open()
        if whence == 0:
            new = offset
        elif whence == 1:
            new = self._pos + offset
        elif whence == 2:
            new = self._length + offset
        else:
            raise InvalidArgument(f"invalid whence {whence}")
        if new < 0:
            raise InvalidArgument("negative seek position")
        if new != self._pos:
            self._cancel_readahead()
        self._pos = new
        return new

    @property
    def length(self) -> int:
        """The file's length as this handle knows it (its own writes included)."""
        return self._length

    def set_known_length(self, size: int) -> None:
        """The file was truncated elsewhere (another handle, a path): forget the old end."""
        self._length = size
        self._written_end = min(self._written_end, size)
        if self._credit_end is not None:  # a credit is bytes past the length: it ends lower now
            self._credit_end = min(self._credit_end, size)
        self._invalidate_readahead()

    def extend_known_length(self, size: int) -> None:
        """Another handle of this client wrote up to ``size``: reads may go that far."""
        if size > self._length:
            self._length = size

    def _siblings(self) -> list[AsyncFile]:
        """This client's other open handles on the same file, of this kind: on a mount with data
        workers the table also holds the front's stand-ins for the workers' handles, whose buffers
        live in the worker (a read sees their writes through :meth:`_see_siblings`, which settles them)."""
        return [f for f in self.fs.open_files(self.inode.inode_id) if f is not self and isinstance(f, AsyncFile)]

    def end_of_file(self) -> int:
        """Where an append lands: the furthest end any of this client's handles on the file knows."""
        return max([self._length] + [f.length for f in self._siblings()])

    async def settle(self) -> None:
        """Make this handle's writes count for a size change or a sync made through another handle.

        Buffered bytes are sent and acknowledged, and meta learns the length they reach: a
        truncate's chunk removal then covers them (bytes still buffered would land after the
        truncate, past the new end), and meta's size is the file's before it changes. A write
        that failed is not published and its error stays with this handle, for its own next call.
        A handle of a lapsed lease has nothing that can count: its own next call reports ESTALE.
        """
        if self.closed or self.stale:
            return
        await self._send_buffer()
        landing = list(self._inflight)
        if landing:
            await asyncio.gather(*landing, return_exceptions=True)
        if self._error is None:
            await self.publish_length()

    @property
    def stale(self) -> bool:
        """Whether the client's lease lapsed since this handle opened (every call on it fails)."""
        return self._forked or self._client_id != self.fs.metadata.client_id

    def forked(self) -> None:
        """This process is a child forked while the handle was open: the handle, its session and
        its unsent bytes are the parent's. From now on every call here fails (``EBADF``) and close
        releases nothing; the parent's loop tasks are dropped, never awaited in this process."""
        self._forked = True
        self._buf = bytearray()
        self._inflight = {}
        self._ahead = deque()
        self._hint_task = None

    @property
    def has_unflushed(self) -> bool:
        return bool(self._buf or self._inflight)

    @property
    def has_unpublished_writes(self) -> bool:
        """Whether this handle wrote since it last told meta its length (close will tell it)."""
        return self._wrote and self._writes != self._published_writes

    async def publish_length(self) -> mpb.Inode | None:
        """Tell meta how far this handle wrote (after ``flush``), so a new open sees it at once.

        Returns the inode as meta has it after the change (None when there was nothing to publish).
        """
        with os_errors(self.name):
            await self._fence()
            if self._wrote and self.session_id and self._writes != self._published_writes:
                # Taken before the flush: every write below it is acknowledged once the flush returns.
                writes, end = self._writes, self._written_end
                await self._flush()
                inode = await self._call_meta(lambda: self.fs.metadata.sync(
                    self.inode.inode_id, self.session_id, length_hint=end, wrote=True, acked=True))
                self._published_writes = writes
                return inode
            return None

    def _check_open(self) -> None:
        if self.closed:
            raise BadHandle("I/O on a closed file")
        self._check_stale()

    def _check_stale(self) -> None:
        if self._forked:
            raise BadHandle(f"{self.name}: opened before os.fork() in the parent process; a file handle does "
                            "not cross fork: open the file again in this process")
        if self.stale:
            raise StaleClient(f"{self.name}: the client's lease lapsed while the file was open: its handle is gone")

    async def _fence(self) -> None:
        """Fail with ``StaleClient`` unless meta surely still holds this handle's session.

        Called when a read or write starts (every call on a lapsed handle fails), before each
        chunk write is sent and after it is acknowledged (a write acknowledged after the session
        closed is not in the length meta set then), and after a chunk read that came back short
        (zeros are the file's only while the session holds its chunks). Free while the lease
        renews on time; past that, a renewal answers it (meta must be reachable).
        """
        self._check_stale()
        meta = self.fs.metadata
        if not meta.lease_current():
            with contextlib.suppress(StaleClient):  # the client has a new id: the check below fails
                await meta.ensure_lease()
        self._check_stale()

    async def _call_meta(self, call: Callable[[], Awaitable[T]]) -> T:
        """A meta call about this handle's session: a lapsed session answers ESTALE, not EBADF."""
        self._check_stale()
        try:
            return await call()
        except (BadHandle, StaleClient):
            self._check_stale()
            raise

    def _raise_background_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- writing ---------------------------------------------------------------------------------

    async def write(self, data: Buffer) -> int:
        with os_errors(self.name):
            written = await self._write(data)
        self.fs.metrics.written_bytes.inc(written)
        return written

    async def pwrite(self, offset: int, data: Buffer) -> int:
        """Write at ``offset`` without moving the file position (FUSE writes)."""
        with os_errors(self.name):
            if offset < 0:
                raise InvalidArgument("negative offset")
            written = await self._write_at(offset, data)
        self.fs.metrics.written_bytes.inc(written)
        return written

    async def _write(self, data: Buffer) -> int:
        if self.append:
            self._pos = self.end_of_file()
        written = await self._write_at(self._pos, data)
        self._pos += written
        return written

    async def _write_at(self, pos: int, data: Buffer) -> int:
        self._check_open()
        if not self.writable:
            raise BadHandle("file not open for writing")
        await self._fence()
        self._raise_background_error()
        view = memoryview(data).cast("B")
        total = len(view)
        if pos + total > max_file_size(self.layout):
            raise FileTooLarge(f"writing past {max_file_size(self.layout)} bytes, the largest file this layout allows")
        if total and self._credit_end is not None and pos + total > self._credit_end:
            await self._reserve(pos + total)  # before any byte leaves: EDQUOT writes nothing
        if total and self._drop_privileges:
            await self.fs.metadata.set_attr(self.inode.inode_id, mpb.SET_DROP_PRIVILEGES, session_id=self.session_id,
                                            user=self.user)
            self._drop_privileges = False
        for sibling in self.fs.open_writers(self.inode.inode_id):
            # Another handle's buffered bytes here are older than this write: they go first.
            if sibling is not self and isinstance(sibling, AsyncFile) and sibling._buf \
                    and sibling._buf_offset < pos + total and pos < sibling._buf_offset + len(sibling._buf):
                await sibling._send_buffer()
        offset = 0
        chunk_size = self.chunk_size
        while offset < total:
            room = chunk_size - pos % chunk_size
            piece = view[offset:offset + room]
            if self._buf and pos == self._buf_offset + len(self._buf) and pos % chunk_size != 0:
                self._buf += piece
            else:
                await self._send_buffer()
                self._buf_offset = pos
                self._buf = bytearray(piece)
            pos += len(piece)
            offset += len(piece)
            if pos % chunk_size == 0:
                await self._send_buffer()
        if total:
            self._wrote = True
            self._writes += 1
            self._invalidate_readahead()
            for sibling in self._siblings():
                sibling._invalidate_readahead()  # what it fetched ahead may predate this write
            self._written_end = max(self._written_end, pos)
            self._length = max(self._length, pos)
            self._maybe_hint()
        return total

    async def _reserve(self, end: int) -> None:
        """Get a byte credit from meta up to at least ``end`` (``QuotaExceeded``: none). A meta
        older than byte credits (a rolling upgrade) counts the bytes at fsync and close only."""
        try:
            rsp = await self._call_meta(lambda: self.fs.metadata.quota_reserve(self.inode.inode_id, self.session_id,
                                                                                end, user=self.user))
        except UnknownMethod:
            self._credit_end = None
            return
        # Past granted_end the handle asks again even when no quota counts the file now (a rename
        # may bring it under one); an older meta's "unlimited" without an end holds for good.
        self._credit_end = None if rsp.unlimited and not rsp.granted_end else rsp.granted_end

    async def _send_buffer(self) -> None:
        if not self._buf:
            return
        data, offset = bytes(self._buf), self._buf_offset
        self._buf = bytearray()
        end = offset + len(data)
        # Two writes of the same bytes in flight at once may reach storage in either order.
        earlier = [task for f in [*self._siblings(), self]
                   for task, (start, stop) in list(f._inflight.items()) if start < end and offset < stop]
        if earlier:
            await asyncio.gather(*earlier, return_exceptions=True)
        await self._slots.acquire()
        task = asyncio.create_task(self._write_piece(offset, data))
        self._inflight[task] = (offset, end)
        task.add_done_callback(self._write_done)

    def _write_done(self, task: asyncio.Task[None]) -> None:
        self._inflight.pop(task, None)

    async def _write_piece(self, offset: int, data: bytes) -> None:
        try:
            index = offset // self.chunk_size
            chain_id, cid = chunk_location(self.layout, self.inode.inode_id, index)
            await self._fence()
            await self.fs.storage.write(chain_id, cid, offset % self.chunk_size, data, self.chunk_size,
                                        self.capability)
            await self._fence()  # acknowledged after the session closed: not in the length meta set
        except BaseException as exc:  # kept for the caller's next call
            if self._error is None:
                self._error = exc
        finally:
            self._slots.release()

    def _maybe_hint(self) -> None:
        now = time.monotonic()
        if now - self._last_hint < _HINT_INTERVAL_S or (self._hint_task and not self._hint_task.done()):
            return
        self._last_hint = now
        self._hint_task = asyncio.create_task(self._send_hint())

    async def _send_hint(self) -> None:
        try:
            await self.fs.metadata.sync(self.inode.inode_id, self.session_id, length_hint=self._written_end,
                                        wrote=True)
        except FS3Error as exc:
            log.debug("length hint for %s failed: %s", self.name, exc)

    async def flush(self) -> None:
        with os_errors(self.name):
            return await self._flush()

    async def _flush(self) -> None:
        """Send buffered bytes and wait until every write this handle made is acknowledged."""
        if self._forked:
            self._check_stale()
        await self._send_buffer()
        while self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        self._raise_background_error()

    async def fsync(self) -> None:
        with os_errors(self.name):
            return await self._fsync()

    async def _fsync(self) -> None:
        self._check_open()
        # fsync(2) covers the file, whichever descriptor wrote it.
        for sibling in self._siblings():
            await sibling.settle()
        writes, end = self._writes, self._written_end
        await self._flush()
        inode = await self._call_meta(lambda: self.fs.metadata.sync(
            self.inode.inode_id, self.session_id, length_hint=end, wrote=self._wrote, acked=True))
        self._published_writes = writes
        self._length = max(self._length, inode.size) if self._wrote else inode.size

    async def truncate(self, size: int | None = None) -> int:
        with os_errors(self.name):
            return await self._truncate(size)

    async def _truncate(self, size: int | None = None) -> int:
        self._check_open()
        if not self.writable:
            raise BadHandle("file not open for writing")
        size = self._pos if size is None else size
        if size < 0:
            raise InvalidArgument("negative size")
        if size > max_file_size(self.layout):
            raise FileTooLarge(f"size {size} exceeds {max_file_size(self.layout)}, the largest file this layout allows")
        await self._flush()
        await self.fs.settle_writers(self.inode.inode_id)
        await self._call_meta(lambda: self.fs.metadata.set_attr(self.inode.inode_id, mpb.SET_SIZE, size=size,
                                                                session_id=self.session_id))
        self.fs.size_changed(self.inode.inode_id, size)
        return size

    # -- reading ---------------------------------------------------------------------------------

    def _invalidate_readahead(self) -> None:
        """What was fetched ahead may predate a write or a size change: the next read drops it.

        Only marked here: another handle calls this at any time, and a read in progress may be
        waiting for one of those pieces (cancelled under it, the read would fail, and on the mount
        the kernel's request would go unanswered for good).
        """
        self._readahead_stale = True

    def _drop_stale_readahead(self) -> None:
        if self._readahead_stale:
            self._readahead_stale = False
            self._last_read_end = -1
            self._cancel_readahead()

    def _cancel_readahead(self) -> None:
        for _, _, task in self._ahead:
            task.cancel()
        self._ahead.clear()
        self._ra_window = _READAHEAD_MIN_BYTES

    def _fetch_task(self, offset: int, length: int) -> asyncio.Task[bytes]:
        return asyncio.create_task(self._fetch_piece(offset, length))

    async def _fetch_piece(self, offset: int, length: int) -> bytes:
        """One piece within one chunk, padded with zeros past the chunk's end (a hole)."""
        chunk_size = self.chunk_size
        async with self._slots:
            chain_id, cid = chunk_location(self.layout, self.inode.inode_id, offset // chunk_size)
            data, _ = await self.fs.storage.read(chain_id, cid, offset % chunk_size, length,
                                                 capability=self.capability)
        if len(data) == length:
            return data  # bytes of this file: valid whenever read (a collected chunk has none)
        # A hole, or a chunk meta collected once this handle's session was closed: zeros are
        # right only if the session was still open when storage answered.
        await self._fence()
        return data + bytes(length - len(data))

    def _top_up(self, start: int, want_end: int) -> None:
        """Keep pieces in flight from ``start`` to the read-ahead window (and at least ``want_end``)."""
        queued_end = self._ahead[-1][0] + self._ahead[-1][1] if self._ahead else start
        target = min(self._length, max(want_end, start + self._ra_window))
        while queued_end < target:
            piece = min(self.chunk_size - queued_end % self.chunk_size, target - queued_end)
            self._ahead.append((queued_end, piece, self._fetch_task(queued_end, piece)))
            queued_end += piece

    async def _read_sequential(self, start: int, end: int) -> bytes:
        """Serve ``[start, end)`` from the read-ahead queue, keeping it full as it drains."""
        if self._ahead and not self._ahead[0][0] <= start < self._ahead[0][0] + self._ahead[0][1]:
            self._cancel_readahead()
        self._top_up(start, end)
        parts: list[bytes] = []
        pos = start
        while pos < end:
            offset, length, task = self._ahead[0]
            # A hit: the piece was fetched before the reader asked for it (a miss waits for storage).
            self.fs.metrics.cache("readahead", task.done())
            data = await task
            take_end = min(end, offset + length)
            whole = pos == offset and take_end == offset + length
            parts.append(data if whole else data[pos - offset:take_end - offset])
            pos = take_end
            if pos == offset + length:
                self._ahead.popleft()
            # Grow the window while the reader keeps reading sequentially, and refill it.
            self._top_up(pos, end)
        self._ra_window = min(self._ra_window * 2, self._readahead_max)
        self._top_up(end, end)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read(self, size: int = -1) -> bytes:
        with os_errors(self.name):
            data = await self._read(size)
        self.fs.metrics.read_bytes.inc(len(data))
        return data

    async def pread(self, offset: int, size: int, readahead: bool = True) -> bytes:
        """Read at ``offset`` without moving the file position (FUSE reads).

        ``readahead=False`` always asks storage (nothing served from earlier fetches): a read
        that must observe the latest committed data, as consistency checkers need.
        """
        with os_errors(self.name):
            if offset < 0:
                raise InvalidArgument("negative offset")
            if not readahead:
                self._check_open()
                await self._fence()
                await self._see_siblings()
                end = min(offset + size, self._length)
                data = await self._read_range(offset, end - offset) if end > offset else b""
            else:
                data = await self._read_at(offset, size)
        self.fs.metrics.read_bytes.inc(len(data))
        return data

    async def _read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            self._check_open()
            await self._see_siblings()
            size = max(0, self._length - self._pos)
        data = await self._read_at(self._pos, size)
        self._pos += len(data)
        return data

    def check_readable(self) -> None:
        """Fail as a read of this handle would before it starts: closed, lapsed, or not open for reading."""
        self._check_open()
        if not self.readable:
            raise BadHandle("file not open for reading")

    async def readable_length(self) -> int:
        """What every read does before it reads, and how far it may read: the handle's own writes
        and this client's other handles' writes land first (read-your-writes), and the length is
        the furthest any of them knows. A batched read (``read_many``) calls it once per handle."""
        self.check_readable()
        await self._fence()
        if self._buf or self._inflight:
            await self._flush()
        await self._see_siblings()
        return self._length

    async def confirm_zeros(self) -> None:
        """A chunk read came back short: the zeros it stands for are the file's only while this
        handle's session surely held (see :meth:`_fence`); raises ``StaleClient`` otherwise."""
        await self._fence()

    async def _read_at(self, start: int, size: int) -> bytes:
        await self.readable_length()
        self._drop_stale_readahead()
        end = min(start + size, self._length)
        if end <= start:
            return b""
        sequential = start == self._last_read_end or (start == 0 and self._last_read_end < 0)
        if sequential:
            data = await self._read_sequential(start, end)
        else:
            self._cancel_readahead()
            data = await self._read_range(start, end - start)
        self._last_read_end = end
        return data

    async def _see_siblings(self) -> None:
        """Reads see this client's other handles' writes: their buffered bytes go to storage
        first (an error stays with the handle that wrote), and the length grows to theirs.

        Only the writes made before the read began are waited for: a handle written without a
        pause must not hold up another handle's reads for as long as it keeps writing.
        """
        for sibling in self.fs.open_writers(self.inode.inode_id):
            if sibling is self:
                continue
            if isinstance(sibling, AsyncFile):
                if sibling.has_unflushed:
                    await sibling._send_buffer()
                    landing = list(sibling._inflight)
                    if landing:
                        await asyncio.gather(*landing, return_exceptions=True)
            elif sibling.has_unpublished_writes and not sibling.stale:
                # A data worker's handle (fs3.vfs.workers.RemoteFile), seen by a usrbio read in the
                # front: its bytes sit in the worker. Its length alone made this read report that
                # range as read, with the old bytes in it; they land first, or its length does not count.
                try:
                    await sibling.settle()
                except (OSError, FS3Error):
                    continue  # the error stays with that handle (the worker reports it there)
            self.extend_known_length(sibling.length)

    async def readinto(self, buffer: Buffer) -> int:
        view = memoryview(buffer).cast("B")
        data = await self.read(len(view))
        view[:len(data)] = data
        return len(data)

    async def _read_range(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the file, chunks fetched in parallel; holes are zeros."""
        chunk_size = self.chunk_size
        pieces = []
        pos = offset
        while pos < offset + length:
            piece = min(chunk_size - pos % chunk_size, offset + length - pos)
            pieces.append((pos, piece))
            pos += piece
        if len(pieces) == 1:
            return await self._fetch_piece(offset, length)
        # One copy into the result: each chunk's bytes are joined in place.
        return b"".join(await asyncio.gather(*(self._fetch_piece(p, n) for p, n in pieces)))

    # -- closing ---------------------------------------------------------------------------------

    async def close(self, *, gather_session_end: bool = False) -> None:
        """Close the handle: its writes land and its length is published before this returns.

        ``gather_session_end``: when meta already knows the length (a flush published it, or the
        handle never wrote), the end of the session is queued and sent with others
        (:class:`~fs3.client.closes.SessionCloses`) instead of waited for: for closes nobody waits
        on (a FUSE release).
        """
        with os_errors(self.name):
            return await self._close(gather_session_end)

    async def _close(self, gather_session_end: bool = False) -> None:
        if self.closed:
            return
        if self._forked:  # the parent's handle: closing this process's copy sends nothing
            self.closed = True
            return
        error: BaseException | None = None
        end = self._written_end
        try:
            await self._flush()
        except BaseException as exc:
            error = exc
        self.closed = True
        self.fs.untrack_file(self)
        for sibling in self._siblings():
            sibling.extend_known_length(self._length)  # what this handle wrote stays readable
        # Acknowledged: the flush succeeded and no write slipped in while it ran.
        acked = error is None and self._written_end == end
        self._cancel_readahead()
        if self._hint_task is not None and not self._hint_task.done():
            self._hint_task.cancel()
        await self.capability.close()
        if self.stale:
            # Meta closed the session when the lease lapsed; writes since may not be in the length.
            error = error if isinstance(error, StaleClient) else StaleClient(
                f"{self.name}: the client's lease lapsed while the file was open: its session was closed")
        elif self.session_id and gather_session_end and error is None and acked and not self.has_unpublished_writes:
            await self.fs.session_closes.close_later(self.inode.inode_id, self.session_id)
        elif self.session_id:
            await self._call_meta(lambda: self.fs.metadata.close(
                self.inode.inode_id, self.session_id, length_hint=self._written_end,
                wrote=self._wrote and self._writes != self._published_writes, acked=acked))
        if error is not None:
            raise error

    async def __aenter__(self) -> AsyncFile:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

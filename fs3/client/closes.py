"""Session closes gathered into batches: one meta call ends the sessions of many handles.

A handle whose length is already known to meta (a flush published it, or it never wrote) has
nothing left to tell meta at close but "the session is over". On a FUSE mount that message comes
with the kernel's ``release``, which the kernel sends after ``close(2)`` has returned: nobody waits
for it. So such closes are queued here and sent together (``CloseSessions``), at most
:data:`BATCH_MAX` a call, a short while after the first one queued: a process creating or reading
small files one after another then pays one meta call per batch instead of one per file.

What waits: only the end of the session on meta. While it waits, meta still counts the handle as
open: an unlinked file's chunks are kept a little longer and an append-open by another client may
probe storage for a writer that is done. Lengths are never held back (they went with the flush).
A batch that fails (meta unreachable, the lease lapsed) is dropped: meta ends a client's sessions
when its lease lapses, and a client that closes drains the queue first (:meth:`drain`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

from fs3.client.meta import Meta
from fs3.common.errors import FS3Error

__all__ = ["BATCH_MAX", "SessionCloses"]

log = logging.getLogger(__name__)

BATCH_MAX = 128            # sessions per call (meta accepts up to 256)
PENDING_MAX = 4096         # queued at most; past this a close waits for a batch to go out
GATHER_S = 0.05            # how long the first close of a batch waits for others


class SessionCloses:
    """The queue of one client connection (its client id: a new connection starts a new queue)."""

    def __init__(self, meta: Meta, gather_s: float = GATHER_S) -> None:
        self.meta = meta
        self.gather_s = gather_s
        self._pending: list[tuple[int, bytes]] = []
        self._pending_inodes: Counter[int] = Counter()  # queued or being sent, per inode
        self._sender: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()  # send what is queued now, without waiting for more
        self.sent_batches = 0  # calls made (tests and benchmarks read it)

    def __len__(self) -> int:
        return len(self._pending)

    async def close_later(self, inode_id: int, session_id: bytes) -> None:
        """Queue the end of a session that has no length left to publish."""
        while len(self._pending) >= PENDING_MAX:
            self._hurry.set()
            await self._wait_sender()
        self._pending.append((inode_id, session_id))
        self._pending_inodes[inode_id] += 1
        self._start()

    def pending(self, inode_id: int) -> bool:
        """Whether an end of a session on ``inode_id`` is queued (or being sent)."""
        return bool(self._pending_inodes.get(inode_id))

    async def settle(self, inode_id: int) -> None:
        """Before a call about ``inode_id`` whose answer depends on its open sessions (a stat or
        change of a file another client may have removed): the queued ends of its sessions go
        first, so the call sees the file as it is with those handles closed."""
        if self._pending_inodes.get(inode_id):
            await self.drain()

    async def drain(self) -> None:
        """Send everything queued now (the client is closing, or a call must see it done)."""
        while self._pending or (self._sender is not None and not self._sender.done()):
            self._hurry.set()
            self._start()
            await self._wait_sender()

    def _start(self) -> None:
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send())

    async def _wait_sender(self) -> None:
        if self._sender is not None:
            # Never raises what ended the sender: what is still queued goes with the next one.
            await asyncio.wait([self._sender])

    async def _send(self) -> None:
        if not self._hurry.is_set():
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: 3.11's wait_for can swallow a cancel
                async with asyncio.timeout(self.gather_s):
                    await self._hurry.wait()
        self._hurry.clear()
        while self._pending:
            batch, self._pending = self._pending[:BATCH_MAX], self._pending[BATCH_MAX:]
            try:
                await self.meta.close_sessions(batch)
                self.sent_batches += 1
            except (FS3Error, OSError) as exc:
                # Dropped, not retried: every batch taken from the queue is done with, so a drain
                # ends even when meta cannot be reached; the lease's expiry ends these sessions.
                log.warning("ending %d sessions failed (their lease's expiry ends them): %s", len(batch), exc)
            finally:
                for inode_id, _ in batch:
                    self._pending_inodes[inode_id] -= 1
                    if self._pending_inodes[inode_id] <= 0:
                        del self._pending_inodes[inode_id]

"""Group commit: one log fsync shared by every write made before it started.

Writers write unsynced, take a ticket with :meth:`GroupSync.written`, and :meth:`GroupSync.wait`
until a sync that began after their write has finished. While one sync runs, later writes queue
for the next, so N concurrent writers cost a few fsyncs instead of N. The meta service's
transaction engine and every storage target's log use it; the sync function decides whether the
fsync runs on a thread (a real disk) or inline (the simulator).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

__all__ = ["GroupSync"]


class GroupSync:
    def __init__(self, sync: Callable[[], Awaitable[object]]) -> None:
        self._sync = sync
        self._written = 0
        self._durable = 0
        self._task: asyncio.Future[None] | None = None
        self.syncs = 0  # fsyncs made (for tests and metrics)

    @property
    def last_ticket(self) -> int:
        return self._written

    def written(self) -> int:
        """Note one unsynced write that must become durable, start a sync if none runs; its ticket."""
        self._written += 1
        self._start()
        return self._written

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
            # A failed sync reaches every waiter; nobody else needs to read its exception.
            self._task.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _run(self) -> None:
        while self._durable < self._written:
            target = self._written
            await self._sync()
            self.syncs += 1
            self._durable = target

    async def wait(self, ticket: int) -> None:
        """Return once every write up to ``ticket`` is durable (raises what a failed sync raised)."""
        while self._durable < ticket:
            self._start()
            assert self._task is not None
            await asyncio.shield(self._task)

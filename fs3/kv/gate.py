"""A gate that lets transactions run side by side until they conflict, then one at a time.

A networked engine's transactions overlap for several round trips, and under contention (creates
in one directory all stamp its inode) the ones that conflicted retry into new overlaps and conflict
again: random waits only make that rarer, and a transaction can lose every time until its retry
budget is gone. Behind a :class:`ContentionGate`, first attempts pass together (shared), while a
retry waits for the transactions in flight to end and then runs alone (exclusive); first attempts
that arrive while a retry waits queue behind it (first come, first served). Under contention the
process runs its transactions one after the other, so they stop conflicting with each other and
every one finishes; without contention nothing waits. Conflicts with other processes (other meta
servers) remain, and are retried as before.

While conflicts are frequent — more than ``conflict_share_max`` of the last ``window`` attempts —
first attempts run alone too: PostgreSQL's predicate locks are page-granular (a read of an absent
key locks its index page), so transactions of unrelated directories conflict as well, and a burst
of them side by side costs more retries than running them one by one saves. Rare conflicts leave
first attempts side by side (a single conflict must not serialize a workload that gains from
running in parallel). docs/decisions.md has the measurements.

A transaction run inside another one's function (on the same task) passes through: it would
otherwise wait for the gate its caller holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import deque
from collections.abc import AsyncIterator

__all__ = ["ContentionGate"]

_held: contextvars.ContextVar[bool] = contextvars.ContextVar("fs3_kv_gate_held", default=False)


class ContentionGate:
    """Shared for first attempts, exclusive for retries, first come first served."""

    def __init__(self, window: int = 64, conflict_share_max: float = 0.2) -> None:
        self.conflict_share_max = conflict_share_max
        self._outcomes: deque[bool] = deque(maxlen=window)  # the last attempts: True = conflicted
        self._conflicts = 0  # how many of them conflicted
        self._shared = 0
        self._exclusive = False
        self._queue: deque[tuple[bool, asyncio.Future[None]]] = deque()
        self.exclusive_runs = 0  # retries that ran alone (a sign of contention)

    def _free_for(self, exclusive: bool) -> bool:
        return not self._exclusive and (self._shared == 0 if exclusive else True)

    def _take(self, exclusive: bool) -> None:
        if exclusive:
            self._exclusive = True
            self.exclusive_runs += 1
        else:
            self._shared += 1

    def _release(self, exclusive: bool) -> None:
        if exclusive:
            self._exclusive = False
        else:
            self._shared -= 1
        self._wake()

    def _wake(self) -> None:
        while self._queue and self._free_for(self._queue[0][0]):
            exclusive, future = self._queue.popleft()
            if future.done():  # its waiter was cancelled
                continue
            self._take(exclusive)
            future.set_result(None)

    async def _acquire(self, exclusive: bool) -> None:
        if not self._queue and self._free_for(exclusive):
            self._take(exclusive)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((exclusive, future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release(exclusive)  # granted as it was cancelled: hand it on
            else:
                future.cancel()
                self._wake()
            raise

    def record(self, conflicted: bool) -> None:
        """The outcome of one attempt (a commit, or a conflict or unknown outcome to retry)."""
        if len(self._outcomes) == self._outcomes.maxlen and self._outcomes[0]:
            self._conflicts -= 1
        self._outcomes.append(conflicted)
        self._conflicts += conflicted

    @property
    def contended(self) -> bool:
        """Whether conflicts are frequent enough that every transaction runs alone."""
        return bool(self._outcomes) and self._conflicts > self.conflict_share_max * len(self._outcomes)

    @contextlib.asynccontextmanager
    async def hold(self, exclusive: bool) -> AsyncIterator[None]:
        """Hold the gate (exclusively for a retry, or while contended) for one attempt of a transaction."""
        if _held.get():
            yield
            return
        exclusive = exclusive or self.contended
        await self._acquire(exclusive)
        token = _held.set(True)
        try:
            yield
        finally:
            _held.reset(token)
            self._release(exclusive)

"""Awaiting work that must finish even when its caller is cancelled.

Cancellation is a fault like any other: a request cancelled while it holds a lock must not
release the lock while I/O started under it still runs (a thread still writing a chunk, a
storage removal still in flight), or the next holder interleaves with it. Every such wait in
fs3 goes through ``finish_despite_cancel`` so that there is one definition of the rule.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def finish_despite_cancel(work: Awaitable[T]) -> T:
    """Await ``work`` (a coroutine, task or future) to its end even if the caller is cancelled
    meanwhile. A caller cancelled while waiting still waits for the work, then gets the
    ``CancelledError``; the work's own result or error is dropped then (read, so that an error
    nobody waits for is not reported as lost)."""
    future = asyncio.ensure_future(work)
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not future.cancelled():
            future.exception()
        raise asyncio.CancelledError
    return future.result()

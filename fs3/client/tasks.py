"""Running a batch of coroutines as one: the client's fan-outs (a batched read's calls and opens)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any

__all__ = ["run_all"]


async def run_all(coroutines: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run the coroutines concurrently to the end.

    Unlike ``asyncio.gather``, the first failure cancels the others (none keeps running, or keeps
    writing into a buffer the caller was told is finished with), and a cancelled caller leaves none
    running either; the failure is raised as itself, not wrapped in an exception group, so the
    client's error mapping (``os_errors``) sees the ``FS3Error`` it knows.
    """
    try:
        async with asyncio.TaskGroup() as group:
            for coroutine in coroutines:
                group.create_task(coroutine)
    except BaseExceptionGroup as failed:
        first: BaseException = failed
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None

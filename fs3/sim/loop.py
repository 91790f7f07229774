"""An asyncio event loop on virtual time.

Timers fire in order without waiting: when nothing is ready, the loop jumps its clock to the
next timer. With no real I/O and FIFO callbacks, a run is a pure function of its seed.
A task factory tags every task with the simulated process that created it (a context
variable), so crashing a process cancels exactly its tasks.
"""

from __future__ import annotations

import asyncio
import contextvars
import selectors
from collections.abc import Callable, Coroutine, Generator
from typing import Any

__all__ = ["SimProcess", "VirtualTimeLoop", "current_process"]


class _VirtualSelector(selectors.BaseSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop
        self._map: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        self._map.pop(fileobj, None)
        return self.register(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise RuntimeError("simulation deadlock: nothing is ready and no timer is pending")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def get_map(self) -> Any:
        return self._map

    def close(self) -> None:
        self._map.clear()


class SimProcess:
    """A group of tasks that live and die together (one simulated process)."""

    def __init__(self, name: str) -> None:
        self.name = name
        # A dict, not a set: cancellation order must not depend on object addresses.
        self.tasks: dict[asyncio.Task[Any], None] = {}
        self.alive = True

    def kill(self) -> None:
        self.alive = False
        for task in list(self.tasks):
            task.cancel()
        self.tasks.clear()

    def run(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Start ``coro`` as a task of this process."""
        ctx = contextvars.copy_context()
        ctx.run(current_process.set, self)
        return asyncio.get_running_loop().create_task(coro, context=ctx)


current_process: contextvars.ContextVar[SimProcess | None] = contextvars.ContextVar("sim_process", default=None)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._virtual_now = 0.0
        super().__init__(_VirtualSelector(self))
        self.set_task_factory(self._make_task)
        self.on_iteration: Callable[[], None] | None = None

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds

    @staticmethod
    def _make_task(loop: asyncio.AbstractEventLoop, coro: Generator[Any, None, Any] | Coroutine[Any, Any, Any],
                      **kwargs: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, **kwargs)
        context = kwargs.get("context")
        process = context.get(current_process) if context is not None else current_process.get()
        if process is not None:
            if not process.alive:
                task.cancel()
            else:
                process.tasks[task] = None
                task.add_done_callback(lambda t: process.tasks.pop(t, None))
        return task

    def _run_once(self) -> None:
        super()._run_once()  # type: ignore[misc]
        if self.on_iteration is not None:
            self.on_iteration()

"""Injectable clocks.

Cores never read the time themselves; services get a :class:`Clock`. :class:`LoopClock` reads the
running event loop's clock: monotonic in production, virtual in the simulator. Unit tests use a
:class:`ManualClock`.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Clock", "LoopClock", "ManualClock"]


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds on a monotonic clock (arbitrary origin)."""
        ...



class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start_ms: int = 0) -> None:
        self._now_ms = start_ms

    def now_ms(self) -> int:
        return self._now_ms

    def advance(self, delta_ms: int) -> None:
        if delta_ms < 0:
            raise ValueError("clocks do not go backwards")
        self._now_ms += delta_ms


class LoopClock:
    """The running asyncio loop's clock.

    Services use this so that the simulator's virtual-time loop drives every timeout and
    heartbeat deterministically, while production gets the loop's monotonic clock.
    """

    def now_ms(self) -> int:
        import asyncio

        return int(asyncio.get_running_loop().time() * 1000)

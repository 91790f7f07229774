"""The retry policy every retry loop in fs3 follows.

A loop that retries decides three things: which failures are worth another try (the table
``fs3.common.errors.RETRYABLE``, by status code), how long to wait between tries, and when to stop.
The last two are a :class:`RetryPolicy`: at most ``attempts_max`` tries, none started after the
deadline, the n-th retry waiting a linear or doubling backoff capped at ``backoff_max_ms``, with an
optional random share (jitter) so that clients failed together do not retry together.

:class:`Attempts` runs one request's tries under a policy. Its clock and its random source are
injected, and a policy without jitter draws nothing, so the simulator replays every seed exactly.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fs3.common.clock import Clock

__all__ = ["Attempts", "Backoff", "RetryPolicy"]

# A doubling backoff stops growing after this many doublings (the cap is reached long before).
_DOUBLINGS_MAX = 30


class Backoff(enum.Enum):
    CONSTANT = "constant"  # every retry waits backoff_base_ms
    LINEAR = "linear"  # the n-th retry waits n x backoff_base_ms
    EXPONENTIAL = "exponential"  # the n-th retry waits 2^(n-1) x backoff_base_ms


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long one request is tried. Pure data: loops read it through :class:`Attempts`."""

    backoff_base_ms: float
    backoff_max_ms: float
    backoff: Backoff = Backoff.EXPONENTIAL
    attempts_max: int = 0  # tries in all, the first included (0: no limit but the deadline)
    deadline_ms: int | None = None  # no retry starts this long after the first try (None: no limit)
    jitter: float = 0.0  # the share of each wait drawn at random: wait x (1 - jitter x U[0, 1))

    def __post_init__(self) -> None:
        if not 0 <= self.backoff_base_ms <= self.backoff_max_ms:
            raise ValueError(f"backoff {self.backoff_base_ms} ms must be within [0, {self.backoff_max_ms}] ms")
        if self.attempts_max < 0 or (self.deadline_ms is not None and self.deadline_ms < 0):
            raise ValueError("attempts_max and deadline_ms must not be negative")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter {self.jitter} outside [0, 1]")

    def backoff_ms(self, retry: int, random: Callable[[], float] | None = None) -> float:
        """The wait before retry number ``retry`` (1 for the first retry).

        With jitter, ``random`` (values in [0, 1)) takes off up to ``jitter`` of the wait: the wait
        never exceeds the un-jittered one, so the cap and the deadline arithmetic hold either way.
        """
        if retry < 1:
            raise ValueError("retries are numbered from 1")
        if self.backoff is Backoff.CONSTANT:
            wait = self.backoff_base_ms
        elif self.backoff is Backoff.LINEAR:
            wait = self.backoff_base_ms * retry
        else:
            wait = self.backoff_base_ms * 2 ** min(retry - 1, _DOUBLINGS_MAX)
        wait = min(wait, self.backoff_max_ms)
        if self.jitter:
            if random is None:
                raise ValueError("a policy with jitter needs a random source")
            wait *= 1.0 - self.jitter * random()
        return wait


class Attempts:
    """The tries of one request under ``policy``.

    ``budget_ms`` replaces the policy's deadline for this request (a caller whose server bounds how
    long it may retry cuts its own budget to that). The deadline counts from construction on
    ``clock``; a policy with a deadline needs one.
    """

    def __init__(self, policy: RetryPolicy, clock: Clock | None = None, *, budget_ms: int | None = None,
                 random: Callable[[], float] | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.policy = policy
        self.clock = clock
        self.random = random
        self._sleep = sleep
        budget = policy.deadline_ms if budget_ms is None else budget_ms
        self.deadline_ms: int | None = None
        if budget is not None:
            if clock is None:
                raise ValueError("a retry deadline needs a clock")
            self.deadline_ms = clock.now_ms() + budget
        self.retries = 0  # retries so far (tries made: at least this many plus one)

    def expired(self) -> bool:
        """Whether the deadline has passed: no further try may start."""
        return self.deadline_ms is not None and self.clock is not None and self.clock.now_ms() >= self.deadline_ms

    def exhausted(self) -> bool:
        """Whether the request may not be tried again: out of tries, or past the deadline."""
        return (bool(self.policy.attempts_max) and self.retries + 1 >= self.policy.attempts_max) or self.expired()

    def next_backoff_ms(self) -> float:
        """Count one more retry and return how long to wait before it."""
        self.retries += 1
        return self.policy.backoff_ms(self.retries, self.random)

    async def backoff(self) -> None:
        """Count one more retry and wait for it."""
        await self._sleep(self.next_backoff_ms() / 1000)

"""Faults a test builds into a process through its environment, to prove its checks can fail.

A crash test that passes shows something only if it would fail on broken code. Two switches,
read from the environment that a test gives the processes it starts (never set otherwise):

``FS3_SABOTAGE`` — a comma-separated list of safety mechanisms to turn off:

* ``kv-sync``: key-value stores acknowledge writes without syncing their log;
* ``file-sync``: chunk files are never fsynced (nor their directories);
* ``dir-sync``: chunk files are fsynced, their directory entries are not;
* ``idempotency``: meta never answers a retried request from its saved answer (it runs it again).

``FS3_CRASH_AT`` — ``POINT:N[,POINT:N]``: the process kills itself (SIGKILL) the N-th time it
passes the named point, so a test can crash it at the one moment that matters, deterministically.
Points: ``meta-answer`` (a mutation's commit is durable, its answer not yet sent).

An unknown name or a malformed value is an error, so that a typo cannot make a sabotage run pass
vacuously.
"""

from __future__ import annotations

import os
import signal
from functools import cache

from fs3.common.errors import InvalidArgument

__all__ = ["CRASH_ENV", "CRASH_POINTS", "SABOTAGES", "SABOTAGE_ENV", "CrashPoint", "sabotaged"]

SABOTAGE_ENV = "FS3_SABOTAGE"
SABOTAGES = frozenset({"kv-sync", "file-sync", "dir-sync", "idempotency"})
CRASH_ENV = "FS3_CRASH_AT"
CRASH_POINTS = frozenset({"meta-answer"})


@cache
def _sabotage_set(value: str) -> frozenset[str]:
    names = frozenset(name.strip() for name in value.split(",") if name.strip())
    unknown = sorted(names - SABOTAGES)
    if unknown:
        raise InvalidArgument(f"{SABOTAGE_ENV}: unknown sabotage {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(SABOTAGES))})")
    return names


def sabotaged(name: str) -> bool:
    """Whether the test running this process turned ``name`` off (see the module docstring)."""
    if name not in SABOTAGES:
        raise ValueError(f"no sabotage named {name!r}")
    return name in _sabotage_set(os.environ.get(SABOTAGE_ENV, ""))


def _crash_counts(value: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in value.split(","):
        if not item.strip():
            continue
        name, _, count = item.strip().partition(":")
        if name not in CRASH_POINTS:
            known = ", ".join(sorted(CRASH_POINTS))
            raise InvalidArgument(f"{CRASH_ENV}: unknown crash point {name!r} (known: {known})")
        if not count.isdigit() or int(count) < 1:
            raise InvalidArgument(f"{CRASH_ENV}: {item!r} needs a positive count (POINT:N)")
        counts[name] = int(count)
    return counts


class CrashPoint:
    """A place where a test may have this process die: :meth:`passed` kills it on the N-th pass."""

    def __init__(self, name: str) -> None:
        if name not in CRASH_POINTS:
            raise ValueError(f"no crash point named {name!r}")
        self.name = name
        self._remaining = _crash_counts(os.environ.get(CRASH_ENV, "")).get(name, 0)

    def passed(self) -> None:
        if not self._remaining:
            return
        self._remaining -= 1
        if not self._remaining:
            os.kill(os.getpid(), signal.SIGKILL)

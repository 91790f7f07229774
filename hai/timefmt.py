"""Durations and times as people read them, the same on the dashboard and in ``hai`` (one job's
chain of tasks must read the same in both). Times are UTC, marked ``Z``: the server renders pages
for browsers in any zone, and a CLI line pasted next to a log line or a page must compare."""

from __future__ import annotations

import time

__all__ = ["duration", "when"]


def duration(seconds: float) -> str:
    """``42 s``, ``17 min``, ``5.5 h``, ``3.2 d``; a negative span (a clock step) is ``0 s``."""
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def when(epoch_s: float | None, missing: str = "—") -> str:
    """``2026-12-04 15:58:08Z``; ``missing`` for no time (None, or 0: never set)."""
    if epoch_s is None or epoch_s <= 0:
        return missing
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch_s)) + "Z"

"""Assertions that stay on under ``python -O``.

A broken invariant means the process can no longer vouch for the data it serves; the caller
lets the exception propagate, and services stop rather than serve wrong data.
"""

from __future__ import annotations

from fs3.common.errors import InvariantViolation

__all__ = ["ensure"]


def ensure(condition: bool, message: str) -> None:
    """Raise :class:`InvariantViolation` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise InvariantViolation(message)

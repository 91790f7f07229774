"""The exceptions HFReduce raises: one base class, so callers can catch every collective failure."""

from __future__ import annotations

__all__ = ["HFReduceError", "HFReduceTimeout", "InvalidArgument"]


class HFReduceError(RuntimeError):
    """A collective failed: a rank died or hung, ranks disagreed, or the communicator was shut down.

    After one, the communicator is poisoned (every pending and later operation raises it too), as a
    collective library must: the ranks no longer agree on what was reduced.
    """


class HFReduceTimeout(HFReduceError):
    """No progress from some rank within the communicator's timeout."""


class InvalidArgument(HFReduceError, ValueError):
    """A bad argument on this rank (non-contiguous tensor, unsupported dtype, bad world size...)."""

"""The job-side half of a suspend: what a training script calls to learn that the agent wants it to
stop, and to tell the agent it has saved and is leaving.

The agent that launched the job (:mod:`hai.launcher`) passes each rank a private control
directory in ``$HAI_CONTROL_DIR``. A suspend request is the file ``suspend`` appearing there; an
acknowledgement is the file ``ack-<RANK>`` a rank creates. Both are created whole (written under a
temporary name, then renamed), so a reader never sees half of one. Polling is one ``stat`` of a
local directory, cheap enough to run at every training step, and needs no thread, signal handler or
open connection in the job (see docs/decisions.md, "HAI launch").

A training loop with HaiScale checkpoints::

    import sys
    import hai.client
    from haiscale.checkpoint import CheckpointManager

    manager = CheckpointManager(...)
    for step in range(start, steps):
        train_step(...)
        manager.maybe_save(step, model, optimizer)
        if hai.client.receive_suspend_command():
            manager.on_suspend(step, model, optimizer)  # every rank: returns once published
            hai.client.go_suspend()
            sys.exit(0)

Outside hai (no ``$HAI_CONTROL_DIR``) :func:`receive_suspend_command` is always False and
:func:`go_suspend` does nothing and returns False, so the same script runs by hand unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "ACK_PREFIX",
    "CONTROL_DIR_ENV",
    "SUSPEND_FILE",
    "HaiClientError",
    "control_dir",
    "go_suspend",
    "receive_suspend_command",
]

CONTROL_DIR_ENV = "HAI_CONTROL_DIR"
"""The environment variable through which the agent names the job's control directory."""
SUSPEND_FILE = "suspend"
"""Created by the agent in the control directory to ask the job to suspend."""
ACK_PREFIX = "ack-"
"""``ack-<RANK>``: created by a rank's :func:`go_suspend`."""

# Once seen, a request stays seen: the agent never withdraws one, and a rank that saw it must not
# be told "no" by a later poll racing the agent's cleanup of the directory.
_seen_suspend = False


class HaiClientError(RuntimeError):
    """The control directory the agent named cannot be used (missing, not writable)."""


def control_dir() -> Path | None:
    """The control directory of this job, or None when the process was not started by hai."""
    value = os.environ.get(CONTROL_DIR_ENV)
    return Path(value) if value else None


def receive_suspend_command() -> bool:
    """True once the agent has asked this job to suspend; False outside hai.

    One ``stat`` per call while no request is there, nothing once one was seen, so it can be called
    at every step. Every rank sees the request (the agent delivers it to all ranks of its node).
    """
    global _seen_suspend
    if _seen_suspend:
        return True
    directory = control_dir()
    if directory is None:
        return False
    if os.path.exists(directory / SUSPEND_FILE):
        _seen_suspend = True
    return _seen_suspend


def go_suspend() -> bool:
    """Tell the agent this rank has saved and is about to exit; returns whether an agent was told.

    The agent waits for the acknowledgement of its node's first rank (rank 0 on rank 0's node) for
    its acknowledgement grace, then for the ranks to exit for its finish grace, before it stops them
    by force. Calling it from every rank is harmless (each writes its own file). Outside hai it
    does nothing and returns False: a script run by hand never gets a request to acknowledge.
    Raises :class:`HaiClientError` when the named directory cannot be written — the agent would
    otherwise wait out its grace for an acknowledgement that never comes.
    """
    directory = control_dir()
    if directory is None:
        return False
    rank = os.environ.get("RANK", "0")
    final = directory / f"{ACK_PREFIX}{rank}"
    temporary = directory / f".{ACK_PREFIX}{rank}.{os.getpid()}"
    try:
        temporary.write_bytes(f"{os.getpid()}\n".encode())
        os.replace(temporary, final)
    except OSError as exc:
        raise HaiClientError(f"cannot acknowledge the suspend request in {directory}: {exc}") from exc
    return True

"""Clients that survive ``os.fork()``: what a forked child does with the clients it inherited.

A forked child (a DataLoader worker, a ``multiprocessing`` "fork" process, a plain ``os.fork()``)
gets a copy of every client of its parent, but not the threads behind them: the blocking API's
event-loop thread is gone, and the sockets, sessions, lease and exactly-once channel ids are the
parent's, still in use there. Used as they are, a call waits forever on a loop nobody runs, or
two processes talk over one connection under one client id.

So each live client registers here (weakly), and right after a fork the child resets every one:
the parent's loop thread, connections and lease are dropped (kept referenced, never touched
again: closing them from the child could disturb the parent, and finalizing them would warn), and
the client reconnects lazily on its first call, under a client id of its own. Handles of files
the parent opened are the parent's: in the child every call on them fails at once with a clear
error (``EBADF``), and closing one there releases nothing.

The gRPC transport cannot follow: gRPC's core does not survive a fork while its threads run (the
child crashes or hangs in gRPC's own code). A child of a process that had a gRPC client refuses to
use the gRPC transport with :class:`ForkedGrpcError` rather than hang; the framed transport (the
default) has no such limit, and ``spawn``/``forkserver`` children start clean.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Protocol

from fs3.rpc.channel import Channel, RealChannelFactory

__all__ = ["ForkAware", "ForkedGrpcError", "RefusingChannels", "grpc_inherited", "keep_inherited", "note_grpc",
           "register"]

log = logging.getLogger(__name__)


class ForkAware(Protocol):
    def _after_fork_in_child(self) -> None: ...


_live: weakref.WeakSet[ForkAware] = weakref.WeakSet()
# The parent's loops, connections and tasks, in the child: referenced forever so that no finalizer
# runs on them (a loop "deallocated while running", a task "destroyed but pending").
_inherited: list[object] = []


class ForkedGrpcError(RuntimeError):
    """The gRPC transport in a process forked from one that used it (not an ``OSError``, so that no
    caller mistakes it for a missing file; nothing retries it)."""

    def __init__(self) -> None:
        super().__init__("fs3: the gRPC transport cannot be used in a process forked from one that used it "
                         "(gRPC does not survive fork); use transport='framed' (the default), or start workers "
                         "with the 'spawn' or 'forkserver' method")


class RefusingChannels(RealChannelFactory):
    """The channels of a gRPC client reset in a forked child: every one refused, none made."""

    def get(self, address: str) -> Channel:
        raise ForkedGrpcError()


_grpc_in_parent = False


def note_grpc() -> None:
    """A gRPC client was alive at the fork (called from a client's reset, in the child)."""
    global _grpc_in_parent
    _grpc_in_parent = True


def grpc_inherited() -> bool:
    """Whether an ancestor of this process forked it while it had a gRPC client."""
    return _grpc_in_parent


def register(client: ForkAware) -> None:
    """Reset ``client`` in every child forked from now on (for as long as it is alive)."""
    _live.add(client)


def keep_inherited(*objects: object) -> None:
    """Keep what the parent was using alive, untouched, in the child."""
    _inherited.extend(o for o in objects if o is not None)


def _after_fork_in_child() -> None:
    for client in list(_live):
        try:
            client._after_fork_in_child()
        except Exception:  # one client that fails to reset must not stop the others
            log.exception("fs3: resetting a client after fork failed")


os.register_at_fork(after_in_child=_after_fork_in_child)

"""A storage target's two states, as every component names them. Pure: no transport, clock or randomness.

mgmtd decides the public states (:mod:`fs3.mgmtd.chain_state` holds the transition table),
storage nodes report the local ones, and clients route by the public ones. The names live here,
below all three, so that a client knows what "serving" means without importing mgmtd.
"""

from __future__ import annotations

import enum

__all__ = ["LocalState", "PublicState"]


class PublicState(enum.IntEnum):
    """Mirror of ``fs3.PublicState`` in common.proto."""

    SERVING = 1
    SYNCING = 2
    WAITING = 3
    LASTSRV = 4
    OFFLINE = 5

    @property
    def readable(self) -> bool:
        return self is PublicState.SERVING

    @property
    def writable(self) -> bool:
        """Whether writes are forwarded to a target in this state."""
        return self in (PublicState.SERVING, PublicState.SYNCING)


class LocalState(enum.IntEnum):
    """Mirror of ``fs3.LocalState`` in common.proto (``OFFLINE`` is ``LOCAL_OFFLINE`` there)."""

    UP_TO_DATE = 1
    ONLINE = 2
    OFFLINE = 3

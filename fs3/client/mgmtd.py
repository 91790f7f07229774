"""Calls to mgmtd when there may be several: follow the primary.

Several mgmtd instances share one database and one of them is primary (``fs3.mgmtd.ha``). A
standby refuses a state-changing call with NOT_PRIMARY, naming the primary as far as it knows; a
dead instance does not answer at all. :class:`MgmtdCaller` sends each call to the instance that
last answered, follows a NOT_PRIMARY to the instance it names (or to the next address when it
names none, during a takeover), and moves to the next address when one does not answer. Every
caller of mgmtd (storage nodes' heartbeats, routing refreshes, admin calls) goes through it, so all
of them follow a primary change the same way. With one address it is a plain call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from google.protobuf.message import Message

from fs3.common.errors import FS3Error, InvalidArgument, NotPrimary, StatusCode, Unavailable
from fs3.rpc.channel import ChannelFactory
from fs3.rpc.methods import service_spec

__all__ = ["MgmtdCaller", "parse_mgmtd_addresses"]

log = logging.getLogger(__name__)
_MGMTD = service_spec("Mgmtd")
# Codes after which another instance may answer: this one is dead, unreachable or a standby.
_TRY_ANOTHER = frozenset({StatusCode.UNAVAILABLE, StatusCode.TIMEOUT, StatusCode.NOT_PRIMARY})
# A round of standbys that all name no primary is a takeover in progress: wait this long, growing
# per round, before asking again (the takeover takes up to a lease period; the caller's own retry
# loop covers the rest).
_NO_PRIMARY_WAIT_MS = 50


def parse_mgmtd_addresses(addresses: str | Iterable[str]) -> list[str]:
    """mgmtd addresses from ``"h1:9000,h2:9000"`` or a list of such strings; duplicates dropped,
    order kept (the first is tried first)."""
    items = [addresses] if isinstance(addresses, str) else list(addresses)
    parsed: list[str] = []
    for item in items:
        for part in item.split(","):
            address = part.strip()
            if address and address not in parsed:
                parsed.append(address)
    if not parsed:
        raise InvalidArgument("at least one mgmtd address is needed")
    return parsed


class MgmtdCaller:
    """One logical mgmtd over several addresses (see the module's docstring)."""

    def __init__(self, addresses: str | Iterable[str], channels: ChannelFactory, rpc_timeout_ms: int = 5_000) -> None:
        self.addresses = parse_mgmtd_addresses(addresses)
        self.channels = channels
        self.rpc_timeout_ms = rpc_timeout_ms
        self.current = self.addresses[0]  # the instance that answered last (the primary, most likely)
        self.redirects = 0

    def _after(self, address: str) -> str:
        if address not in self.addresses:
            return self.addresses[0]
        return self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)]

    async def call(self, method: str, request: Message, timeout_ms: int | None = None) -> Message:
        """``method`` of ``fs3.Mgmtd`` on the primary (or, for reads a standby answers, any live
        instance). Tries at most two rounds over the addresses; the last error when none answers."""
        spec = _MGMTD.method(method)
        timeout_ms = timeout_ms or self.rpc_timeout_ms
        address = self.current
        last: FS3Error = Unavailable("no mgmtd reachable")
        rounds = 0
        for _ in range(2 * len(self.addresses) + 1):
            try:
                rsp, _ = await self.channels.get(address).call(spec, request, timeout_ms=timeout_ms)
            except FS3Error as exc:
                if exc.code not in _TRY_ANOTHER:
                    raise
                last = exc
                hint = exc.primary_address if isinstance(exc, NotPrimary) else ""
                following = hint if hint and hint != address else self._after(address)
                log.debug("mgmtd %s: %s; trying %s", address, exc, following)
                self.redirects += 1
                if isinstance(exc, NotPrimary) and not hint and following == self.addresses[0]:
                    rounds += 1  # a whole round named no primary: a takeover is under way
                    await asyncio.sleep(_NO_PRIMARY_WAIT_MS * rounds / 1000)
                address = following
                continue
            self.current = address
            return rsp
        raise last

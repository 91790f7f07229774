"""The data-path capability of one open file, as the client holds it.

Meta signs a capability when a file is opened (see :mod:`fs3.common.capability`); every storage
call of the file's handle carries it. It is valid for a limited time (``capability_ttl_ms``), so the
holder renews it with meta halfway through its life, in the background (a call in flight meanwhile
still carries the old one, which is valid for as long again), and waits for the renewal only when
the old one is close to its end. When storage nevertheless refuses one (a clock far off, a
cluster-token rotation that dropped its key), the storage client asks :meth:`FileCapability.renew`
for a fresh one and retries once.

Expiry is timed on this client's monotonic clock from when the capability arrived: the client's
wall clock may differ from meta's, but a capability received now was issued no later than now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fs3 import meta_pb2 as mpb
from fs3.client.meta import Meta
from fs3.common.clock import Clock
from fs3.common.errors import FS3Error, PermissionDenied, error_for

__all__ = ["FileCapability"]

log = logging.getLogger(__name__)

# After a failed background renewal, the next call tries again no sooner than this.
_RENEW_RETRY_MS = 1_000


class FileCapability:
    """The capability of one open file (one session), renewed as it ages; see the module doc.

    An empty capability with no lifetime (a cluster without a cluster token, where every caller
    is a service and storage asks for none) is sent as is and never renewed.
    """

    def __init__(self, meta: Meta, clock: Clock, inode_id: int, session_id: bytes, access: int,
                 user: mpb.User, capability: bytes, ttl_ms: int) -> None:
        self.meta = meta
        self.clock = clock
        self.inode_id = inode_id
        self.session_id = session_id
        self.access = access
        self.user = user
        self.renewals = 0
        self._token = b""
        self._renew_at_ms: int | None = None
        self._stale_at_ms = 0
        self._renewal: asyncio.Task[None] | None = None
        self._error: FS3Error | None = None
        self._set(capability, ttl_ms)

    def _set(self, capability: bytes, ttl_ms: int) -> None:
        now = self.clock.now_ms()
        self._token = capability
        if capability and ttl_ms:
            self._renew_at_ms = now + ttl_ms // 2
            self._stale_at_ms = now + ttl_ms - ttl_ms // 8
        else:
            self._renew_at_ms = None

    def __repr__(self) -> str:  # the capability itself is a credential: never printed
        return f"FileCapability(inode {self.inode_id}, access {self.access}, renewals {self.renewals})"

    async def current(self) -> bytes:
        """The capability to send now: renewal starts halfway through its life and is waited for
        only once the capability is close to expiring."""
        if self._renew_at_ms is None:
            return self._token
        now = self.clock.now_ms()
        if now < self._renew_at_ms:
            return self._token
        task = self._start_renewal()
        if now >= self._stale_at_ms:
            await asyncio.shield(task)
        return self._token

    async def renew(self, refused: bytes) -> bytes:
        """A fresh capability after storage refused ``refused`` (meta checks again that this
        session may have it); the error meta gave when it refused one."""
        if self._token != refused:
            return self._token  # another call renewed it meanwhile
        await asyncio.shield(self._start_renewal())
        if self._token == refused:
            error = self._error
            if error is None:
                raise PermissionDenied(f"the capability of inode {self.inode_id} was refused and not renewed")
            raise error_for(int(error.code), error.message)
        return self._token

    def _start_renewal(self) -> asyncio.Task[None]:
        """The renewal in flight, or a new one (one at a time: every caller waits for the same)."""
        if self._renewal is None or self._renewal.done():
            self._renewal = asyncio.create_task(self._fetch(), name=f"capability-{self.inode_id}")
        return self._renewal

    async def _fetch(self) -> None:
        try:
            rsp = await self.meta.grant_capability(self.inode_id, self.access, self.session_id, self._token,
                                                   user=self.user)
        except FS3Error as exc:
            self._error = exc
            if self._renew_at_ms is not None:
                self._renew_at_ms = self.clock.now_ms() + _RENEW_RETRY_MS
            log.warning("renewing the capability of inode %d failed: %s", self.inode_id, exc)
            return
        self._error = None
        self.renewals += 1
        self._set(rsp.capability, rsp.capability_ttl_ms)

    async def close(self) -> None:
        """The file was closed: stop a renewal in flight."""
        task, self._renewal = self._renewal, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

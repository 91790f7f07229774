"""Client of the metadata service: finds meta servers through mgmtd, retries safely, keeps a lease.

Every mutating request gets a fresh ``request_id`` and keeps it across retries, so a retry after
a lost reply (or a meta server restart) returns the original answer instead of applying the
operation twice. The lease renewal tells meta the lowest request id still in flight, below which
it may forget answers.

The lease: meta closes the sessions of a client that stops renewing and refuses its id from then
on (``StaleClient``). The client then takes a new id and registers afresh, so new opens work after
a long network blip; handles opened under the old id are stale (``fs3.client.files``). Between
renewals the client knows how long meta cannot have expired it yet (:meth:`MetaClient.lease_current`):
file I/O that finishes inside that window ran while its session was open. A retry is never sent
later than meta remembers answers (meta's ``retry_limit_ms``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import zlib
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import Message

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.client.routing import RoutingCache
from fs3.common.clock import Clock, LoopClock
from fs3.common.errors import FS3Error, RetryCause, StaleClient, Unavailable, is_retryable, may_have_run
from fs3.common.retry import Attempts, Backoff, RetryPolicy
from fs3.rpc.channel import ChannelFactory
from fs3.rpc.methods import MethodSpec, service_spec

__all__ = ["MetaClient"]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
_META = service_spec("Meta")
# What a retry to meta can cure: a lost server or reply, an overloaded server, a commit that
# conflicted or whose outcome is unknown. A retry with the same request id is safe after each (meta
# answers a repeated id with its first answer); storage's routing causes are meta's to handle.
_RETRY_CAUSES = frozenset({RetryCause.TRANSPORT, RetryCause.OVERLOAD, RetryCause.COMMIT})
# One request's retries: a linear backoff, within the client's budget (cut to meta's limit).
_BACKOFF_BASE_MS = 50
_BACKOFF_MAX_MS = 1_000
# Meta expires a lease no sooner than lease_ms after it received the renewal, timed on its own
# monotonic clock; the client trusts it for less than that from when it sent the renewal, leaving
# room for the two clocks' rates to differ.
_LEASE_TRUSTED_FRACTION = 0.75
# A request refused as from a lapsed client is sent under a new id this many times at most.
_RESENDS_MAX = 2


class MetaClient:
    def __init__(self, routing: RoutingCache, channels: ChannelFactory, client_id: bytes,
                 user: Callable[[], mpb.User], rpc_timeout_ms: int = 10_000, retry_total_ms: int = 60_000,
                 clock: Clock | None = None) -> None:
        self.routing = routing
        self.channels = channels
        self.client_id = client_id
        self.user = user
        self.rpc_timeout_ms = rpc_timeout_ms
        self.retry_total_ms = retry_total_ms
        self.clock = clock or LoopClock()
        self._next_request = 1
        self._in_flight: set[int] = set()
        self._preferred = ""             # the meta server requests go to next ("": the first listed)
        self._lease_task: asyncio.Task[None] | None = None
        self._renewing: asyncio.Future[None] | None = None
        self.lease_ms = 30_000
        self.retry_limit_ms = 0          # meta's bound on one request's retries (0: not told yet)
        self._renewals = 0               # the lease's renewal count as meta last answered (0: unregistered)
        self._lease_valid_until_ms = 0   # on self.clock: until then meta cannot have expired the lease
        self.registrations = 1           # client ids this client has used (a lapsed lease takes a new one)
        self._lease_resume = False       # start the lease at the first request (a client reset after fork)

    def ctx(self, user: mpb.User | None = None) -> tuple[mpb.ReqCtx, int]:
        request_id = self._next_request
        self._next_request += 1
        return mpb.ReqCtx(user=user or self.user(), client_id=self.client_id, request_id=request_id), request_id

    def _meta_addresses(self) -> list[str]:
        """The meta servers to try, in order: the live ones first, each client starting at its own
        (chosen by its id), so that clients spread over the servers sharing the namespace; the
        ones mgmtd lists as dead last. A request that fails on one goes on to the next
        (:meth:`_choose`, :meth:`_failed_on`) under the same request id, which any server answers
        with the first answer (the answers are in the store they share)."""
        routing = self.routing.routing
        if routing is None:
            return []
        nodes = sorted((n for n in routing.nodes if n.node_type == cpb.NODE_META), key=lambda n: n.node_id)
        alive = [n for n in nodes if n.alive]
        if alive:
            start = zlib.crc32(self.client_id) % len(alive)
            alive = alive[start:] + alive[:start]
        return [self.channels.node_address(n.framed_address, n.grpc_address)
                for n in alive + [n for n in nodes if not n.alive]]

    def _choose(self, addresses: list[str]) -> str:
        """The server the next request goes to: the preferred one while it is listed, else the first."""
        return self._preferred if self._preferred in addresses else addresses[0]

    def _failed_on(self, address: str, addresses: list[str]) -> None:
        """A request failed on ``address``: later tries go to the server after it in ``addresses``.

        The preference is a server, not a position, and moves only away from the server that
        failed: several requests that fail on one dead server together move it once (a shared
        count moved once per failure could bring them all back to the dead one), and a routing
        refresh that reorders the list (mgmtd now lists the dead one last) cannot turn a move
        into a step back onto it."""
        if self._choose(addresses) == address:
            self._preferred = addresses[(addresses.index(address) + 1) % len(addresses)]

    @property
    def retry(self) -> RetryPolicy:
        """One request's retries: a linear backoff, for at most ``retry_total_ms``."""
        return RetryPolicy(backoff_base_ms=_BACKOFF_BASE_MS, backoff_max_ms=_BACKOFF_MAX_MS, backoff=Backoff.LINEAR,
                           deadline_ms=self.retry_total_ms)

    def _retry_budget_ms(self) -> int:
        """The client's own budget, cut to meta's limit: a retry must reach meta while it still
        remembers the answer (or refuses the id), never after."""
        if self.retry_limit_ms:
            return min(self.retry_total_ms, self.retry_limit_ms)
        return self.retry_total_ms

    async def call(self, name: str, req: Message, rsp_type: type[M], user: mpb.User | None = None) -> M:
        """Call a Meta method; the request's ``ctx`` (if any) is filled in and kept across retries.

        ``user`` overrides the client's identity for this call (the FUSE daemon acts for each caller).
        A request that meta refused because this client's lease lapsed, and that cannot have run
        (no earlier attempt of it went unanswered), is sent again under the client's new id; one
        that may have run fails with ``StaleClient``: running it again could apply it twice. So
        does one on an open file's session (the session died with the lease).
        """
        method = _META.method(name)
        with_ctx = "ctx" in req.DESCRIPTOR.fields_by_name
        if with_ctx:
            await self._registered()
        # A request on an open file's session belongs to the id that opened it: never moved to a new id.
        on_session = bool(getattr(req, "session_id", b""))
        for resend in range(_RESENDS_MAX + 1):
            request_id = 0
            client_id = self.client_id
            if with_ctx:
                ctx, request_id = self.ctx(user)
                req.ctx.CopyFrom(ctx)  # type: ignore[attr-defined]
                self._in_flight.add(request_id)
            outcome_unknown = [False]
            try:
                return await self._attempts(name, method, req, rsp_type, outcome_unknown)
            except StaleClient:
                if not with_ctx:
                    raise
                self._lapsed(client_id)
                if outcome_unknown[0] or on_session or resend == _RESENDS_MAX:
                    raise
                log.info("meta %s: sent again under this client's new id", name)
                await self._registered()
            finally:
                self._in_flight.discard(request_id)
        raise AssertionError("unreachable: the last resend raises")

    async def _attempts(self, name: str, method: MethodSpec, req: Message, rsp_type: type[M],
                        outcome_unknown: list[bool]) -> M:
        """Send ``req`` until it is answered or the retry budget is spent (checked before every
        resend: a client that was frozen mid-retry must not send it late)."""
        attempts = Attempts(self.retry, self.clock, budget_ms=self._retry_budget_ms())
        error: FS3Error = Unavailable("no meta server in the routing information")
        while True:
            if attempts.retries and attempts.exhausted():
                raise Unavailable(f"meta {name} gave up: {error}")
            addresses = self._meta_addresses()
            if not addresses:
                with contextlib.suppress(FS3Error):
                    await self.routing.refresh()
                addresses = self._meta_addresses()
            error = Unavailable("no meta server in the routing information")
            if addresses:
                address = self._choose(addresses)
                try:
                    rsp, _ = await self.channels.get(address).call(method, req, timeout_ms=self.rpc_timeout_ms)
                    assert isinstance(rsp, rsp_type)
                    return rsp
                except FS3Error as exc:
                    if not is_retryable(exc.code, _RETRY_CAUSES):
                        raise
                    error = exc
                    outcome_unknown[0] = outcome_unknown[0] or may_have_run(exc.code)
                    self._failed_on(address, addresses)
            if attempts.exhausted():
                raise Unavailable(f"meta {name} gave up: {error}")
            log.debug("meta %s retry %d: %s", name, attempts.retries + 1, error)
            with contextlib.suppress(FS3Error):
                await self.routing.refresh()
            await attempts.backoff()

    # -- lease -----------------------------------------------------------------------------------

    def lease_current(self) -> bool:
        """Whether meta surely still holds this client's lease (and so every session it opened)."""
        return self.clock.now_ms() < self._lease_valid_until_ms

    async def _registered(self) -> None:
        """Before a request: a client whose last renewal is too old renews first, so that a client
        that was frozen past its lease learns that it lapsed (and registers a new id) before it
        sends anything under the old id, which meta may have forgotten by then."""
        if self._lease_resume:
            self._lease_resume = False
            self.start_lease()
        if self.lease_current():
            return
        try:
            await self.renew()
        except StaleClient:
            await self.renew()  # registers the new id

    async def ensure_lease(self) -> None:
        """Return once meta surely holds the lease, renewing now if the last renewal is too old to
        tell. Raises ``StaleClient`` if it lapsed: the client then has a new id, not yet registered."""
        if not self.lease_current():
            await self.renew()

    async def renew(self) -> None:
        """Renew the lease (registering the client id if new); concurrent callers share one renewal."""
        if self._renewing is None:
            future = asyncio.ensure_future(self._renew_once())
            self._renewing = future

            def done(f: asyncio.Future[None]) -> None:
                self._renewing = None
                if not f.cancelled():
                    f.exception()  # retrieved: a renewal nobody waits for any more must not warn

            future.add_done_callback(done)
        await asyncio.shield(self._renewing)

    async def _renew_once(self) -> None:
        client_id = self.client_id
        sent_ms = self.clock.now_ms()
        completed_below = min(self._in_flight) if self._in_flight else self._next_request
        try:
            rsp = await self.call("RenewClient", mpb.RenewClientReq(
                client_id=client_id, hostname=socket.gethostname(), pid=os.getpid(),
                completed_below=completed_below, renewals=self._renewals), mpb.RenewClientRsp)
        except StaleClient:
            self._lapsed(client_id)
            raise
        if client_id != self.client_id:
            return  # the id was replaced meanwhile: this renewal says nothing about the new one
        self.lease_ms = rsp.lease_ms or self.lease_ms
        self.retry_limit_ms = rsp.retry_limit_ms or self.retry_limit_ms
        self._renewals = rsp.renewals
        self._lease_valid_until_ms = max(self._lease_valid_until_ms,
                                         sent_ms + int(self.lease_ms * _LEASE_TRUSTED_FRACTION))

    def _lapsed(self, client_id: bytes) -> None:
        """Meta refused ``client_id``: its lease lapsed. Take a new id (registered by the next
        renewal); sessions opened under the old one are gone, and their handles stale."""
        if client_id != self.client_id:
            return  # already replaced
        log.warning("fs3 client %s: meta expired its lease; registering afresh", client_id.hex())
        self.client_id = os.urandom(len(client_id))
        self.registrations += 1
        # Request ids keep counting, so an old request's id never names a new one.
        self._in_flight = set()
        self._renewals = 0
        self._lease_valid_until_ms = 0

    @property
    def lease_started(self) -> bool:
        """Whether this client keeps its lease renewed (``start_lease`` was called, not ``stop``)."""
        return self._lease_task is not None or self._lease_resume

    def resume_lease_lazily(self) -> None:
        """Start the lease at the first request that needs it, from inside the loop that sends it
        (a client reset in a forked child, which has no running loop at the moment of the reset)."""
        self._lease_resume = True

    def start_lease(self) -> None:
        if self._lease_task is None:
            self._lease_task = asyncio.create_task(self._lease_loop(), name="fs3-client-lease")

    async def _lease_loop(self) -> None:
        while True:
            try:
                await self.renew()
            except StaleClient:
                await asyncio.sleep(0.1)  # then register the new id
                continue
            except FS3Error as exc:
                log.warning("fs3 client lease renewal failed: %s", exc)
            await asyncio.sleep(max(self.lease_ms / 3, 100) / 1000)

    async def stop(self) -> None:
        self._lease_resume = False
        task, self._lease_task = self._lease_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

"""Client of the metadata service: finds meta servers through mgmtd, retries safely, keeps a lease.

Every mutating request gets a fresh ``request_id`` and keeps it across retries, so a retry after
a lost reply (or a meta server restart) returns the original answer instead of applying the
operation twice. The lease renewal tells meta the lowest request id still in flight, below which
it may forget answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import Message

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.client.routing import RoutingCache
from fs3.common.clock import Clock, LoopClock
from fs3.common.errors import FS3Error, StatusCode, Unavailable
from fs3.rpc.channel import ChannelFactory
from fs3.rpc.methods import service_spec

__all__ = ["MetaClient"]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
_META = service_spec("Meta")
# Transport failures: the request may or may not have run; a retry with the same id is safe.
_RETRY_CODES = frozenset({StatusCode.UNAVAILABLE, StatusCode.TIMEOUT, StatusCode.TXN_CONFLICT,
                          StatusCode.RESOURCE_EXHAUSTED, StatusCode.MAYBE_COMMITTED})


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
        self._preferred = 0
        self._lease_task: asyncio.Task[None] | None = None
        self.lease_ms = 30_000

    def ctx(self, user: mpb.User | None = None) -> tuple[mpb.ReqCtx, int]:
        request_id = self._next_request
        self._next_request += 1
        return mpb.ReqCtx(user=user or self.user(), client_id=self.client_id, request_id=request_id), request_id

    def _meta_addresses(self) -> list[str]:
        routing = self.routing.routing
        if routing is None:
            return []
        nodes = [n for n in routing.nodes if n.node_type == cpb.NODE_META]
        nodes.sort(key=lambda n: (not n.alive, n.node_id))
        return [self.channels.node_address(n.framed_address, n.grpc_address) for n in nodes]

    async def call(self, name: str, req: Message, rsp_type: type[M], user: mpb.User | None = None) -> M:
        """Call a Meta method; the request's ``ctx`` (if any) is filled in and kept across retries.

        ``user`` overrides the client's identity for this call (the FUSE daemon acts for each caller).
        """
        method = _META.method(name)
        request_id = 0
        if "ctx" in req.DESCRIPTOR.fields_by_name:
            ctx, request_id = self.ctx(user)
            req.ctx.CopyFrom(ctx)  # type: ignore[attr-defined]
            self._in_flight.add(request_id)
        deadline_ms = self.clock.now_ms() + self.retry_total_ms
        attempt = 0
        try:
            while True:
                addresses = self._meta_addresses()
                if not addresses:
                    with contextlib.suppress(FS3Error):
                        await self.routing.refresh()
                    addresses = self._meta_addresses()
                error: FS3Error = Unavailable("no meta server in the routing information")
                if addresses:
                    address = addresses[self._preferred % len(addresses)]
                    try:
                        rsp, _ = await self.channels.get(address).call(method, req, timeout_ms=self.rpc_timeout_ms)
                        assert isinstance(rsp, rsp_type)
                        return rsp
                    except FS3Error as exc:
                        if exc.code not in _RETRY_CODES:
                            raise
                        error = exc
                        self._preferred += 1
                attempt += 1
                if self.clock.now_ms() >= deadline_ms:
                    raise Unavailable(f"meta {name} gave up: {error}")
                log.debug("meta %s retry %d: %s", name, attempt, error)
                with contextlib.suppress(FS3Error):
                    await self.routing.refresh()
                await asyncio.sleep(min(0.05 * attempt, 1.0))
        finally:
            self._in_flight.discard(request_id)

    # -- lease -----------------------------------------------------------------------------------

    async def renew(self) -> None:
        completed_below = min(self._in_flight) if self._in_flight else self._next_request
        rsp = await self.call("RenewClient", mpb.RenewClientReq(
            client_id=self.client_id, hostname=socket.gethostname(), pid=os.getpid(),
            completed_below=completed_below), mpb.RenewClientRsp)
        self.lease_ms = rsp.lease_ms or self.lease_ms

    def start_lease(self) -> None:
        if self._lease_task is None:
            self._lease_task = asyncio.create_task(self._lease_loop(), name="fs3-client-lease")

    async def _lease_loop(self) -> None:
        while True:
            try:
                await self.renew()
            except FS3Error as exc:
                log.warning("fs3 client lease renewal failed: %s", exc)
            await asyncio.sleep(max(self.lease_ms / 3, 100) / 1000)

    async def stop(self) -> None:
        task, self._lease_task = self._lease_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

"""A client's cache of mgmtd's routing information, refreshed by version.

With several mgmtd instances, the refresh goes through :class:`~fs3.client.mgmtd.MgmtdCaller`
(primary first, any standby answers too) and never installs a version older than the one held:
versions carry the primary lease's epoch, so an older primary's view always sorts lower.
"""

from __future__ import annotations

import asyncio

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3.client.mgmtd import MgmtdCaller, parse_mgmtd_addresses
from fs3.common.errors import Unavailable
from fs3.common.target_state import PublicState
from fs3.rpc.channel import ChannelFactory

__all__ = ["RoutedTarget", "RoutingCache"]


class RoutedTarget:
    __slots__ = ("address", "node_id", "state", "target_id")

    def __init__(self, target_id: int, node_id: int, state: PublicState, address: str) -> None:
        self.target_id = target_id
        self.node_id = node_id
        self.state = state
        self.address = address


class RoutingCache:
    def __init__(self, mgmtd_addresses: list[str], channels: ChannelFactory, rpc_timeout_ms: int = 5_000) -> None:
        if not mgmtd_addresses:
            raise ValueError("at least one mgmtd address is needed")
        # Each entry may list several instances ("h1:9000,h2:9000"): one config key names them all.
        self.mgmtd_addresses = parse_mgmtd_addresses(mgmtd_addresses)
        self.mgmtd = MgmtdCaller(self.mgmtd_addresses, channels, rpc_timeout_ms)
        self.channels = channels
        self.rpc_timeout_ms = rpc_timeout_ms
        self.routing: cpb.RoutingInfo | None = None
        self._chains: dict[int, tuple[int, list[RoutedTarget]]] = {}
        self._lock = asyncio.Lock()

    @property
    def version(self) -> int:
        return self.routing.routing_version if self.routing else 0

    async def refresh(self) -> cpb.RoutingInfo:
        """Pull a newer routing info if mgmtd has one (one refresh at a time)."""
        known = self.version
        async with self._lock:
            if self.routing is not None and self.version > known:
                return self.routing
            rsp = await self.mgmtd.call("GetRoutingInfo", mpb.GetRoutingInfoReq(known_version=self.version),
                                        timeout_ms=self.rpc_timeout_ms)
            assert isinstance(rsp, mpb.GetRoutingInfoRsp)
            if rsp.changed and rsp.routing.routing_version >= self.version:
                self._install(rsp.routing)
            if self.routing is None:
                raise Unavailable("mgmtd has no routing information to give yet")
            return self.routing

    def _install(self, routing: cpb.RoutingInfo) -> None:
        self.routing = routing
        nodes = {n.node_id: n for n in routing.nodes}
        targets = {t.target_id: t for t in routing.targets}
        self._chains = {}
        for chain in routing.chains:
            members = []
            for tid in chain.target_ids:
                info = targets.get(tid)
                if info is None:
                    continue
                node = nodes.get(info.node_id)
                address = self.channels.node_address(node.framed_address, node.grpc_address) if node else ""
                members.append(RoutedTarget(tid, info.node_id, PublicState(info.public_state or 5), address))
            self._chains[chain.chain_id] = (chain.chain_version, members)

    async def chain(self, chain_id: int) -> tuple[int, list[RoutedTarget]]:
        if self.routing is None:
            await self.refresh()
        entry = self._chains.get(chain_id)
        if entry is None:
            await self.refresh()
            entry = self._chains.get(chain_id)
        if entry is None:
            from fs3.common.errors import NotFound

            raise NotFound(f"unknown chain {chain_id}")
        return entry

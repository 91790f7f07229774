"""Which meta server a client's request goes to when one of several dies: the next try of a request
that failed on a server goes to another one, however many requests failed on it together and
however the routing information reorders the servers meanwhile (scripted servers, no cluster)."""

from __future__ import annotations

import asyncio
from typing import Any

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.client.meta_client import MetaClient
from fs3.common.clock import ManualClock
from fs3.common.errors import Unavailable

ROOT_USER = mpb.User(uid=0, gid=0)
CLIENT = b"c" * 16
ADDRESSES = ("meta-a:1", "meta-b:1")
# Each send moves the client's clock this far: a request's budget is spent after a few tries.
SEND_MS = 200
BUDGET_MS = 1_000


class _Servers:
    """Two meta servers behind one fake routing cache and channel factory. The first server a
    request reaches after ``kill_first()`` is the one that dies: the one this client starts at."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.sends: list[tuple[str, str]] = []
        self.dead: set[str] = set()
        self.killing = False
        self.mark_dead_on_refresh = False
        self.routing = cpb.RoutingInfo(routing_version=1, nodes=[
            cpb.NodeInfo(node_id=i + 1, node_type=cpb.NODE_META, alive=True, framed_address=address)
            for i, address in enumerate(ADDRESSES)])

    def kill_first(self) -> None:
        self.killing = True

    async def refresh(self) -> cpb.RoutingInfo:
        """mgmtd's view: with ``mark_dead_on_refresh``, it has noticed the dead server."""
        if self.mark_dead_on_refresh and self.dead:
            for node in self.routing.nodes:
                node.alive = node.framed_address not in self.dead
        return self.routing

    def node_address(self, framed: str, grpc: str) -> str:
        return framed

    def get(self, address: str) -> _Channel:
        return _Channel(self, address)


class _Channel:
    def __init__(self, servers: _Servers, address: str) -> None:
        self.servers = servers
        self.address = address

    async def call(self, method: Any, req: Any, payload: bytes = b"", timeout_ms: int = 0) -> tuple[Any, bytes]:
        servers = self.servers
        servers.clock.advance(SEND_MS)
        if servers.killing:
            servers.killing = False
            servers.dead.add(self.address)
        servers.sends.append((method.name, self.address))
        await asyncio.sleep(0)  # requests sent together fail together
        if self.address in servers.dead:
            raise Unavailable(f"cannot connect to {self.address}: Connection refused")
        if method.name == "RenewClient":
            return mpb.RenewClientRsp(lease_ms=30_000, renewals=1), b""
        return mpb.InodeRsp(inode=mpb.Inode(inode_id=1)), b""


def _client(servers: _Servers) -> MetaClient:
    return MetaClient(servers, servers, CLIENT, lambda: ROOT_USER, retry_total_ms=BUDGET_MS,  # type: ignore[arg-type]
                      clock=servers.clock)


def _lookup(client: MetaClient) -> Any:
    return client.call("Lookup", mpb.LookupReq(target=mpb.PathRef(parent=1, path=b"f")), mpb.InodeRsp)


def _lookups(servers: _Servers) -> list[str]:
    return [address for name, address in servers.sends if name == "Lookup"]


def test_requests_that_failed_together_on_a_dead_meta_all_go_on_to_the_live_one() -> None:
    """Four requests in flight when their server dies fail on it together; each one's next try
    goes to the live server (one request moving on must not move another back to the dead one)."""
    servers = _Servers(ManualClock())
    client = _client(servers)

    async def main() -> list[Any]:
        await client.renew()
        servers.kill_first()
        return await asyncio.gather(*(_lookup(client) for _ in range(4)))

    answers = asyncio.run(main())
    assert [a.inode.inode_id for a in answers] == [1, 1, 1, 1]
    sends = _lookups(servers)
    (dead,) = servers.dead
    (live,) = set(ADDRESSES) - servers.dead
    assert sends[:4] == [dead] * 4 and sends[4:] == [live] * 4, sends


def test_a_request_does_not_go_back_to_a_dead_meta_when_mgmtd_reorders_the_servers() -> None:
    """Once mgmtd lists the dead server as dead, the servers' order changes (live ones first):
    the request's next try still goes to the live one, not to the dead one at the same place."""
    servers = _Servers(ManualClock())
    servers.mark_dead_on_refresh = True
    client = _client(servers)

    async def main() -> Any:
        await client.renew()
        servers.kill_first()
        first = await _lookup(client)
        return first, await _lookup(client)

    first, second = asyncio.run(main())
    assert first.inode.inode_id == second.inode.inode_id == 1
    (dead,) = servers.dead
    (live,) = set(ADDRESSES) - servers.dead
    assert _lookups(servers) == [dead, live, live]

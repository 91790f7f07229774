"""Admin mark-offline fences a live target before its chain changes, so it never serves a stale read.

The bug this guards: mgmtd used to publish the chain without the marked target at once, while the
target's node, still heartbeating and so still holding a valid lease, kept serving reads from its
old view of the chain until its next routing refresh, after the new chain had acknowledged newer
writes. mgmtd now fences the target first: its node stops serving it and reports it offline, and
only that report changes the chain.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import pytest
from google.protobuf.message import Message

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3 import storage_pb2 as spb
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient, StorageClientConfig
from fs3.common.errors import FS3Error, StatusCode, Timeout, Unavailable
from fs3.common.ids import chunk_id
from fs3.common.target_state import LocalState, PublicState
from fs3.kv.store import MemKVStore
from fs3.mgmtd.service import MgmtdConfig, MgmtdServicer
from fs3.mgmtd.state import MgmtdState
from fs3.rpc.channel import Channel, ChannelFactory
from fs3.rpc.dispatch import Buffer
from fs3.rpc.methods import MethodSpec, service_spec
from fs3.sim.run import run_seed
from fs3.storage.blobs import MemBlobStore
from fs3.storage.chunk_engine import ChunkEngine
from fs3.storage.node import StorageNode, StorageNodeConfig
from tests.conftest import wait_until
from tests.inproc import InProcessCluster

P, L = PublicState, LocalState
STORAGE = service_spec("Storage")
CHUNK = 64 * 1024
TIMEOUT_MS = 1_000
_PB_LOCAL = {L.UP_TO_DATE: cpb.UP_TO_DATE, L.ONLINE: cpb.ONLINE, L.OFFLINE: cpb.LOCAL_OFFLINE}


# -- mgmtd state -------------------------------------------------------------------------------


def _beat(state: MgmtdState, node_id: int, local: LocalState, now_ms: int) -> mpb.HeartbeatRsp:
    """A heartbeat of a node with one target (``node_id * 100 + 1``); returns what mgmtd answers."""
    req = mpb.HeartbeatReq(node_id=node_id, node_type=cpb.NODE_STORAGE, framed_address=f"n{node_id}")
    req.targets.add(target_id=node_id * 100 + 1, local_state=_PB_LOCAL[local], path=f"/t{node_id}")
    state.heartbeat(req, now_ms)
    return mpb.HeartbeatRsp(routing_version=state.routing_version, fenced_target_ids=state.fenced_targets(node_id))


def _public(state: MgmtdState, target_id: int) -> PublicState:
    """A target's public state, read afresh (a helper, so the type checker does not carry one
    assertion's narrowing past the heartbeat that changes the state)."""
    return state.targets[target_id].public_state


def _cluster(kv: MemKVStore | None = None) -> MgmtdState:
    """Three nodes, one chain 101 -> 201 -> 301, every target serving."""
    state = MgmtdState(kv or MemKVStore(), TIMEOUT_MS)
    state.load(0)
    for node_id in (1, 2, 3):
        _beat(state, node_id, L.UP_TO_DATE, 0)
    state.create_chain_table(mpb.CreateChainTableReq(table_id=1, chains=[mpb.ChainSpec(chain_id=1,
                                                                                        target_ids=[101, 201, 301])]))
    assert all(t.public_state is P.SERVING for t in state.targets.values())
    return state


def test_target_on_a_live_node_is_fenced_and_its_chain_waits_for_the_node() -> None:
    state = _cluster()
    chain = state.chains[1]
    version = chain.chain_version
    assert state.mark_target_offline(201, now_ms=10) is False
    # Nothing about the chain changes until the node has stopped serving the target.
    assert chain.chain_version == version and list(chain.target_ids) == [101, 201, 301]
    assert _public(state, 201) is P.SERVING and state.targets[201].info.fenced
    assert state.fence_pending(201) and state.fenced_targets(2) == [201] and state.fenced_targets(1) == []
    assert state.mark_target_offline(201, now_ms=20) is False  # asking again changes nothing
    # Its node has not seen the fence yet: it still reports the target up to date; scans wait.
    rsp = _beat(state, 2, L.UP_TO_DATE, 30)
    assert list(rsp.fenced_target_ids) == [201]
    state.scan(40)
    assert chain.chain_version == version and _public(state, 201) is P.SERVING
    # The node reports it offline: now the chain goes on without it, and the fence is over.
    rsp = _beat(state, 2, L.OFFLINE, 50)
    assert chain.chain_version == version + 1 and list(chain.target_ids) == [101, 301, 201]
    assert _public(state, 201) is P.OFFLINE
    assert not state.targets[201].info.fenced and not state.fence_pending(201)
    assert list(rsp.fenced_target_ids) == []
    # It comes back the normal way: online -> waiting -> syncing behind the serving ones -> serving.
    _beat(state, 2, L.ONLINE, 60)
    assert _public(state, 201) is P.WAITING
    state.scan(65)
    assert _public(state, 201) is P.SYNCING
    _beat(state, 2, L.UP_TO_DATE, 70)
    assert _public(state, 201) is P.SERVING


def test_target_on_a_dead_node_goes_offline_at_once() -> None:
    state = _cluster()
    version = state.chains[1].chain_version
    for node_id in (1, 2):
        _beat(state, node_id, L.UP_TO_DATE, TIMEOUT_MS)
    # Node 3 has been silent for longer than the heartbeat timeout (no scan has noticed yet).
    assert state.mark_target_offline(301, now_ms=TIMEOUT_MS + 1) is True
    assert _public(state, 301) is P.OFFLINE and not state.targets[301].info.fenced
    assert state.chains[1].chain_version == version + 1
    assert state.fenced_targets(3) == []


def test_target_off_the_write_path_goes_at_once() -> None:
    state = _cluster()
    _beat(state, 3, L.OFFLINE, 10)
    _beat(state, 3, L.UP_TO_DATE, 20)  # (a stale report: the target waits for the node to say online)
    assert _public(state, 301) is P.WAITING  # serves nothing: no fence needed
    assert state.mark_target_offline(301, now_ms=30) is True
    assert _public(state, 301) is P.OFFLINE and not state.targets[301].info.fenced


def test_fence_ends_when_the_node_misses_its_heartbeats() -> None:
    state = _cluster()
    assert state.mark_target_offline(101, now_ms=10) is False
    for t in (TIMEOUT_MS // 2, TIMEOUT_MS):
        _beat(state, 2, L.UP_TO_DATE, t)
        _beat(state, 3, L.UP_TO_DATE, t)
    state.scan(TIMEOUT_MS)
    assert state.fence_pending(101) and _public(state, 101) is P.SERVING
    state.scan(TIMEOUT_MS + 1)  # node 1 last spoke at 0: expired
    assert _public(state, 101) is P.OFFLINE and not state.fence_pending(101)
    assert list(state.chains[1].target_ids) == [201, 301, 101]


def test_fence_of_the_last_serving_target_ends_at_lastsrv() -> None:
    state = _cluster()
    _beat(state, 1, L.OFFLINE, 10)
    _beat(state, 2, L.OFFLINE, 10)
    assert _public(state, 301) is P.SERVING
    assert state.mark_target_offline(301, now_ms=20) is False
    _beat(state, 3, L.OFFLINE, 30)
    assert _public(state, 301) is P.LASTSRV and not state.fence_pending(301)


def test_a_pending_fence_survives_a_mgmtd_restart_and_its_end_is_persisted() -> None:
    kv = MemKVStore()
    state = _cluster(kv)
    version = state.chains[1].chain_version
    assert state.mark_target_offline(201, now_ms=10) is False
    restarted = MgmtdState(kv, TIMEOUT_MS)
    restarted.load(100)
    assert restarted.fence_pending(201) and _public(restarted, 201) is P.SERVING
    assert restarted.chains[1].chain_version == version
    rsp = _beat(restarted, 2, L.UP_TO_DATE, 110)
    assert list(rsp.fenced_target_ids) == [201]  # the node learns it from the restarted mgmtd
    assert _public(restarted, 201) is P.SERVING
    _beat(restarted, 2, L.OFFLINE, 120)
    assert _public(restarted, 201) is P.OFFLINE and not restarted.fence_pending(201)
    again = MgmtdState(kv, TIMEOUT_MS)
    again.load(200)
    assert not again.fence_pending(201) and _public(again, 201) is P.OFFLINE


# -- the MarkTargetOffline RPC ---------------------------------------------------------------


async def _servicer() -> MgmtdServicer:
    servicer = MgmtdServicer(MemKVStore(), MgmtdConfig(heartbeat_timeout_ms=400, scan_interval_ms=10,
                                                       kv_engine="mem"))
    servicer.start()
    for node_id in (1, 2, 3):
        await _rpc_beat(servicer, node_id, L.UP_TO_DATE)
    servicer.state.create_chain_table(mpb.CreateChainTableReq(table_id=1, replicas=3))
    return servicer


async def _rpc_beat(servicer: MgmtdServicer, node_id: int, local: LocalState) -> mpb.HeartbeatRsp:
    req = mpb.HeartbeatReq(node_id=node_id, node_type=cpb.NODE_STORAGE, framed_address=f"n{node_id}")
    req.targets.add(target_id=node_id * 100 + 1, local_state=_PB_LOCAL[local], path=f"/t{node_id}")
    rsp, _ = await servicer.heartbeat(req, memoryview(b""))
    return rsp


async def _node_loop(servicer: MgmtdServicer, node_id: int, obey: bool) -> None:
    """A node heartbeating every 20 ms; ``obey``: it reports a fenced target offline."""
    local = L.UP_TO_DATE
    while True:
        rsp = await _rpc_beat(servicer, node_id, local)
        if obey and rsp.fenced_target_ids:
            local = L.OFFLINE
        await asyncio.sleep(0.02)


def test_mark_offline_rpc_returns_once_the_node_has_stopped_serving_the_target() -> None:
    async def body() -> None:
        servicer = await _servicer()
        nodes = [asyncio.create_task(_node_loop(servicer, n, obey=True)) for n in (1, 2, 3)]
        try:
            rsp, _ = await servicer.mark_target_offline(mpb.MarkTargetOfflineReq(target_id=201), memoryview(b""))
            assert rsp.fenced and rsp.public_state == cpb.OFFLINE
            assert servicer.state.targets[201].local_state is L.OFFLINE
            assert 201 not in servicer.state.chains[1].target_ids[:2]
        finally:
            for task in nodes:
                task.cancel()
            await servicer.stop()
    asyncio.run(body())


def test_mark_offline_rpc_times_out_and_keeps_the_fence_when_the_node_never_confirms() -> None:
    async def body() -> None:
        servicer = await _servicer()
        nodes = [asyncio.create_task(_node_loop(servicer, n, obey=False)) for n in (1, 2, 3)]
        try:
            with pytest.raises(Timeout, match="fence stays"):
                await servicer.mark_target_offline(mpb.MarkTargetOfflineReq(target_id=201), memoryview(b""))
            # The node still holds its lease: mgmtd must not take the target out behind its back.
            assert servicer.state.fence_pending(201) and _public(servicer.state, 201) is P.SERVING
        finally:
            for task in nodes:
                task.cancel()
            await servicer.stop()
    asyncio.run(body())


# -- the storage node's fenced set -------------------------------------------------------------


class _NoMgmtd:
    """Channels that reach nobody: the node's prompt heartbeats fail quietly."""

    address = "nowhere"

    def get(self, address: str) -> _NoMgmtd:
        return self

    def node_address(self, framed_address: str, grpc_address: str) -> str:
        return framed_address

    async def call(self, method: MethodSpec, request: Message, payload: Buffer = b"",
                   timeout_ms: int = 10_000) -> tuple[Message, bytes]:
        raise Unavailable("no mgmtd in this test")

    async def close(self) -> None:
        pass


def _routing(version: int, chain_version: int, state_101: int, fenced: bool = False) -> cpb.RoutingInfo:
    """Chain 1 = 101 -> 201 -> 301; target 101 (on node 1) in ``state_101``, the others serving."""
    routing = cpb.RoutingInfo(routing_version=version, heartbeat_timeout_ms=1_000)
    for node_id in (1, 2, 3):
        routing.nodes.add(node_id=node_id, framed_address=f"n{node_id}", alive=True)
        routing.targets.add(target_id=node_id * 100 + 1, node_id=node_id, chain_id=1,
                            public_state=cast(cpb.PublicState, state_101 if node_id == 1 else cpb.SERVING),
                            fenced=fenced and node_id == 1)
    routing.chains.add(chain_id=1, chain_version=chain_version, target_ids=[101, 201, 301])
    return routing


def test_node_stops_serving_a_fenced_target_and_keeps_the_fence_until_its_writes_are_over() -> None:
    async def body() -> None:
        node = StorageNode(StorageNodeConfig(node_id=1, mgmtd_address="mgmtd"),
                           {101: ChunkEngine(MemKVStore(), MemBlobStore())}, _NoMgmtd())
        node._silent_until_offline = False  # as if mgmtd had seen it start
        node._apply_routing(_routing(5, 3, cpb.SERVING))
        view = node.view(1, 101)
        assert view is not None and view.my_state is P.SERVING

        def reported() -> int:
            return next(t.local_state for t in node._heartbeat_req().targets if t.target_id == 101)

        node._fence([101], 6)  # a heartbeat response at routing v6 listed it
        view = node.view(1, 101)
        assert view is not None and view.my_state is P.OFFLINE and reported() == cpb.LOCAL_OFFLINE
        node._apply_routing(_routing(6, 3, cpb.SERVING, fenced=True))  # the routing of the fence itself
        node._apply_routing(_routing(7, 3, cpb.SERVING))  # older news than the fence would not lift it ...
        assert 101 in node.fenced_targets
        finish = asyncio.Event()
        write = node.replicas[101]._start(finish.wait(), 0)  # a write it admitted, still running
        node._apply_routing(_routing(8, 4, cpb.OFFLINE))  # ... nor does mgmtd's "out" while it runs
        view = node.view(1, 101)
        assert 101 in node.fenced_targets and view is not None and view.my_state is P.OFFLINE
        assert reported() == cpb.LOCAL_OFFLINE
        finish.set()
        await write
        await asyncio.sleep(0)  # the write's completion callback
        # The write is over: the target comes back the normal way, reporting online to resync first.
        assert not node.fenced_targets and reported() == cpb.ONLINE
        view = node.view(1, 101)
        assert view is not None and view.my_state is P.OFFLINE  # as mgmtd shows it, until it is back
        await node.stop()
    asyncio.run(body())


# -- a real cluster ----------------------------------------------------------------------------


class _LateRoutingChannel:
    """A channel on which routing news (a changed GetRoutingInfo answer) arrives ``delay_s`` late."""

    def __init__(self, inner: Channel, delay_s: float) -> None:
        self.inner, self.address, self.delay_s = inner, inner.address, delay_s

    async def call(self, method: MethodSpec, request: Message, payload: Buffer = b"",
                   timeout_ms: int = 10_000) -> tuple[Message, bytes]:
        rsp, data = await self.inner.call(method, request, payload, timeout_ms)
        if isinstance(rsp, mpb.GetRoutingInfoRsp) and rsp.changed:
            await asyncio.sleep(self.delay_s)
        return rsp, data

    async def close(self) -> None:
        await self.inner.close()


class _LateRouting:
    """A node's channels with a slow routing refresh: its view of the chains lags mgmtd's."""

    def __init__(self, inner: ChannelFactory, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def get(self, address: str) -> Channel:
        return _LateRoutingChannel(self.inner.get(address), self.delay_s)

    def node_address(self, framed_address: str, grpc_address: str) -> str:
        return self.inner.node_address(framed_address, grpc_address)

    async def close(self) -> None:
        await self.inner.close()


def _stale_client(cluster: InProcessCluster, routing: cpb.RoutingInfo, first: int) -> StorageClient:
    """A client holding ``routing`` (from before the mark) that tries serving replica ``first`` first."""
    cache = RoutingCache([cluster.mgmtd_address], cluster.channels)
    cache._install(routing)
    return StorageClient(cache, cluster.channels, b"stale", StorageClientConfig(rpc_timeout_ms=2_000),
                         pick=lambda n: first)


async def _caught_up(nodes: list[StorageNode], routing_version: int) -> bool:
    return all(n.routing_version >= routing_version for n in nodes)


@pytest.mark.slow  # an in-process cluster
def test_marked_target_never_serves_a_read_older_than_an_acknowledged_write(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chain = cluster.chain_ids[0]
            client = cluster.client()
            cid = chunk_id(31, 0)
            await client.write(chain, cid, 0, b"1" * 4096, CHUNK)
            admin = cluster.admin()
            before = await admin.routing()
            old_chain = next(c for c in before.chains if c.chain_id == chain)
            victim = old_chain.target_ids[-1]  # the tail
            node = cluster.nodes[victim // 100]
            # The victim's node learns new routing late (its heartbeats are on time, so its lease
            # stays valid): the window in which it could serve from its old view of the chain.
            node.channels = _LateRouting(node.channels, 0.6)
            stale_clients = [_stale_client(cluster, before, len(old_chain.target_ids) - 1) for _ in range(10)]

            await admin.mark_target_offline(victim)
            assert cluster.mgmtd is not None
            others = [n for n in cluster.nodes.values() if n is not node]
            await wait_until(lambda: _caught_up(others, cluster.mgmtd.state.routing_version), interval_s=0.01,
                             what="the other nodes on the new chain")
            await client.routing.refresh()
            rsp = await client.write(chain, cid, 0, b"2" * 4096, CHUNK)  # acknowledged by the chain without it
            assert rsp.commit_version == 2

            address = cluster.channels.node_address(node.config.framed_address, node.config.grpc_address)
            channel = cluster.channels.get(address)
            refused: dict[str, int] = {}
            for i in range(200):
                for version in (0, old_chain.chain_version):  # unchecked, and the old chain's
                    try:
                        read, data = await channel.call(STORAGE.method("Read"), spb.ReadReq(
                            chain_id=chain, chunk_id=cid, length=4096, chain_version=version))
                    except FS3Error as exc:
                        assert exc.code in (StatusCode.TARGET_NOT_SERVING, StatusCode.CHAIN_VERSION_MISMATCH,
                                            StatusCode.LEASE_EXPIRED, StatusCode.CHUNK_NOT_COMMITTED), exc
                        refused[exc.code.name] = refused.get(exc.code.name, 0) + 1
                        continue
                    assert isinstance(read, spb.ReadRsp)
                    assert bytes(data) == b"2" * 4096, f"read {i} from target {victim} returned v{read.version}"
                if i < len(stale_clients):
                    data, _ = await stale_clients[i].read(chain, cid, 0, 4096)
                    assert data == b"2" * 4096, "a client with stale routing read the old version"
                await asyncio.sleep(0.005)
            assert refused, "the marked target answered every read: was it ever out of its chain?"

            # It comes back the normal way, with the write it missed.
            await wait_until(cluster.all_serving, what="the marked target back to serving")
            read, data = await channel.call(STORAGE.method("Read"), spb.ReadReq(chain_id=chain, chunk_id=cid,
                                                                                 length=4096))
            assert bytes(data) == b"2" * 4096
            assert not node.fenced_targets
            # A client still on the routing from before sends that chain version: any replica now
            # refuses it (CHAIN_VERSION_MISMATCH) and the client refreshes its routing and reads on.
            late = _stale_client(cluster, before, 0)
            data, _ = await late.read(chain, cid, 0, 4096)
            assert data == b"2" * 4096 and late.routing.version > before.routing_version
            report = await admin.verify()
            assert report.ok, report.as_dict()
    asyncio.run(body())


# -- the simulator -----------------------------------------------------------------------------

# Seeds with admin mark-offline in the fault mix that found acknowledged writes lost or stale reads:
# 13, 34 and 40 before the fence (a head taken out of its chain finished a write it had in flight
# after coming back as syncing), 48 with a fence that ended before such a write had failed.
MARK_OFFLINE_SEEDS = [13, 34, 40, 48]


@pytest.mark.slow  # simulator seeds
@pytest.mark.parametrize("seed", MARK_OFFLINE_SEEDS)
def test_simulated_runs_with_mark_offline_faults(seed: int) -> None:
    result = run_seed(seed, clients=3, ops_per_client=60, fault_intensity=3.0)
    assert result.ok, f"{result.summary()}\n" + "\n".join(result.violations[:5])

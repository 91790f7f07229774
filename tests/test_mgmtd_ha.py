"""Several mgmtd instances on one shared transactional engine, in process, on real framed sockets.

One :class:`OptimisticTxnEngine` over a :class:`MemKVStore` stands in for the shared database
(serializable transactions, as PostgreSQL gives). Storage-node heartbeats come from a workload
that calls through :class:`MgmtdCaller` with every instance's address, as storage nodes do.
Checked: a standby takes over within a lease period plus a heartbeat timeout when the primary
dies, with the chains and public states unchanged and no node expired; a frozen primary's late
writes are refused by the fence and never land; standbys answer routing reads and redirect the
rest to the primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3.client.admin import AdminClient
from fs3.client.mgmtd import MgmtdCaller
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient, StorageClientConfig
from fs3.cluster.services import build_storage_node
from fs3.common.clock import LoopClock
from fs3.common.errors import FS3Error, InvalidArgument, NotPrimary, Unavailable
from fs3.common.target_state import PublicState
from fs3.kv.api import TxnEngine
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine
from fs3.mgmtd import schema
from fs3.mgmtd.ha import (
    PREFIX,
    SharedEngine,
    forget_instances,
    instance_key,
    read_instances,
    write_fenced,
    write_instance,
)
from fs3.mgmtd.lease import LeaseConfig, LeaseRecord, primary_history_violations, routing_epoch
from fs3.mgmtd.presence import PRIMARY, STALE, STANDBY, InstanceRecord, PresenceWatch
from fs3.mgmtd.server import open_shared_engine, shared_setup
from fs3.mgmtd.service import MgmtdConfig, MgmtdServicer
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.framed import FramedServer
from fs3.rpc.methods import service_spec
from fs3.storage.node import StorageNode, StorageNodeConfig
from fs3.storage.server import StorageConfig, TargetConfig, open_engines
from tests.conftest import wait_until

TOKEN = "ha-token"
LEASE = LeaseConfig(lease_ms=1_000, renew_interval_ms=100, drift_margin_ms=100)
HEARTBEAT_TIMEOUT_MS = 2_400  # storage nodes keep serving through a takeover: >= 2 (lease + renewal)
HEARTBEAT_INTERVAL_S = 0.1
NODES = (1, 2, 3)
_NO_PAYLOAD = memoryview(b"")


class FreezableClock:
    """The loop's clock, until frozen: a paused process that still believes its lease is valid."""

    def __init__(self) -> None:
        self.frozen_ms: int | None = None

    def now_ms(self) -> int:
        return self.frozen_ms if self.frozen_ms is not None else LoopClock().now_ms()

    def freeze(self) -> None:
        self.frozen_ms = self.now_ms()


@dataclass
class Instance:
    servicer: MgmtdServicer
    server: FramedServer
    address: str
    clock: FreezableClock


@contextlib.asynccontextmanager
async def instances(engine: TxnEngine, count: int,
                    lease: LeaseConfig = LEASE) -> AsyncIterator[list[Instance]]:
    started: list[Instance] = []
    try:
        for i in range(count):
            dispatcher = Dispatcher(token=TOKEN)
            server = FramedServer(dispatcher)
            address = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
            clock = FreezableClock()
            config = MgmtdConfig(kv_engine="mem", heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS, scan_interval_ms=50)
            servicer = MgmtdServicer(None, config, clock=clock, shared=SharedEngine(engine, f"m{i}", address, lease))
            dispatcher.add_service(service_spec("Mgmtd"), servicer)
            servicer.start()
            started.append(Instance(servicer, server, address, clock))
        yield started
    finally:
        for instance in started:
            await instance.servicer.stop()
            await instance.server.stop()


def _heartbeat(node_id: int) -> mpb.HeartbeatReq:
    req = mpb.HeartbeatReq(node_id=node_id, node_type=cpb.NODE_STORAGE, framed_address=f"h{node_id}:1")
    req.targets.add(target_id=node_id * 100 + 1, local_state=cpb.UP_TO_DATE)
    return req


async def _heartbeats(caller: MgmtdCaller, node_id: int, beats: dict[int, float]) -> None:
    """A storage node's heartbeat loop: every interval, to whichever instance is primary."""
    loop = asyncio.get_running_loop()
    while True:
        with contextlib.suppress(FS3Error):
            await caller.call("Heartbeat", _heartbeat(node_id), timeout_ms=500)
            beats[node_id] = loop.time()
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)


async def _primary(group: list[Instance]) -> Instance | None:
    primaries = [i for i in group if i.servicer.role == "primary"]
    assert len(primaries) <= 1, "two instances act as primary at once"
    return primaries[0] if primaries else None


def _public_view(servicer: MgmtdServicer) -> tuple[dict[int, tuple[list[int], int]], dict[int, PublicState]]:
    chains = {cid: (list(c.target_ids), c.chain_version) for cid, c in servicer.state.chains.items()}
    states = {tid: t.public_state for tid, t in servicer.state.targets.items()}
    return chains, states


@pytest.mark.slow  # serves three mgmtd on sockets for several lease periods
@pytest.mark.parametrize("database", ["memory", "postgresql"])
def test_a_standby_takes_over_from_a_dead_primary_with_the_chains_and_states_unchanged(
        database: str, request: pytest.FixtureRequest) -> None:
    """On one shared in-memory engine, and on a private PostgreSQL (``fs3 mgmtd --kv-engine postgres``)."""
    pg_url = request.getfixturevalue("postgres_url") if database == "postgresql" else ""

    async def body() -> None:
        close: Callable[[], Awaitable[None]] | None = None
        if pg_url:
            engine, close = await open_shared_engine(MgmtdConfig(kv_engine="postgres", pg_url=pg_url))
        else:
            engine = OptimisticTxnEngine(MemKVStore(), sync=False)
        try:
            await _takeover(engine)
        finally:
            if close is not None:
                await close()

    asyncio.run(body())


async def _takeover(engine: TxnEngine) -> None:
    channels = RealChannelFactory(token=TOKEN)
    loop = asyncio.get_running_loop()
    async with instances(engine, 3) as group:
        addresses = [i.address for i in group]
        first = await wait_until(lambda: _primary(group), timeout_s=20, what="a first primary")
        beats: dict[int, float] = {}
        workload = [asyncio.create_task(_heartbeats(MgmtdCaller(addresses, channels), n, beats)) for n in NODES]
        try:
            async def registered() -> bool:
                return len(first.servicer.state.targets) == len(NODES)
            await wait_until(registered, timeout_s=20, what="every node registered")
            admin = MgmtdCaller(list(reversed(addresses)), channels)  # starts at a standby: redirected
            created = await admin.call("CreateChainTable", mpb.CreateChainTableReq(table_id=1, replicas=3))
            assert isinstance(created, mpb.CreateChainTableRsp) and len(created.chains) == 1
            chains, states = _public_view(first.servicer)
            assert set(states.values()) == {PublicState.SERVING}
            version = first.servicer.state.routing_version
            old_epoch = routing_epoch(version)
            assert old_epoch >= 1 and first.servicer.state.epoch == old_epoch

            # Standbys: routing reads from what the primary published, state changes redirected.
            standby = next(i for i in group if i is not first)
            rsp, _ = await channels.get(standby.address).call(service_spec("Mgmtd").method("GetRoutingInfo"),
                                                              mpb.GetRoutingInfoReq())
            assert isinstance(rsp, mpb.GetRoutingInfoRsp) and rsp.routing.routing_version == version
            assert [list(c.target_ids) for c in rsp.routing.chains] == [ids for ids, _ in chains.values()]
            with pytest.raises(NotPrimary) as refused:
                await channels.get(standby.address).call(service_spec("Mgmtd").method("Heartbeat"), _heartbeat(9))
            assert refused.value.primary_address == first.address

            # The primary dies.
            await first.servicer.stop(hand_back=False)  # dead: it hands nothing back
            await first.server.stop()
            died_at = loop.time()
            rest = [i for i in group if i is not first]
            second = await wait_until(lambda: _primary(rest), timeout_s=20, what="a standby taking over")

            async def all_beating() -> bool:
                return all(beats.get(n, 0) > died_at for n in NODES)
            await wait_until(all_beating, timeout_s=20, what="heartbeats reaching the new primary")
            took_ms = (loop.time() - died_at) * 1000
            # Within a lease and a heartbeat timeout (plus slack for a loaded machine).
            assert took_ms < LEASE.lease_ms + HEARTBEAT_TIMEOUT_MS + 5_000, took_ms

            # Nothing lost: the same chains at the same versions, the same public states, and
            # no node expired (each got a heartbeat timeout of grace from the takeover).
            await asyncio.sleep(HEARTBEAT_TIMEOUT_MS / 1000 / 2)
            assert _public_view(second.servicer) == (chains, states)
            assert all(n.alive for n in second.servicer.state.nodes.values())
            new_version = second.servicer.state.routing_version
            assert routing_epoch(new_version) > old_epoch and new_version > version

            # Clients follow: a routing cache over every address gets the new primary's view.
            routing = RoutingCache(addresses, channels)
            info = await routing.refresh()
            assert info.routing_version >= new_version and info.epoch == routing_epoch(new_version)
        finally:
            for task in workload:
                task.cancel()
            await asyncio.gather(*workload, return_exceptions=True)
            await channels.close()  # before the servers stop: they wait for open connections


@pytest.mark.slow  # serves two mgmtd on sockets for more than a lease period
def test_a_frozen_primarys_late_writes_are_refused_and_never_land() -> None:
    async def body() -> None:
        engine = OptimisticTxnEngine(MemKVStore(), sync=False)
        channels = RealChannelFactory(token=TOKEN)
        async with instances(engine, 2) as group:
            addresses = [i.address for i in group]
            old = await wait_until(lambda: _primary(group), timeout_s=20, what="a first primary")
            beats: dict[int, float] = {}
            workload = [asyncio.create_task(_heartbeats(MgmtdCaller(addresses, channels), n, beats)) for n in NODES]
            try:
                async def registered() -> bool:
                    return len(old.servicer.state.nodes) == len(NODES)
                await wait_until(registered, timeout_s=20, what="every node registered")
                await old.servicer.create_chain_table(mpb.CreateChainTableReq(table_id=1, replicas=3), _NO_PAYLOAD)
                chains, states = _public_view(old.servicer)
                old_epoch = old.servicer.state.epoch

                # Cut off from everyone (its lease loop and its server stop) and paused (its clock
                # stands still), so it still believes it is primary, with a write in flight.
                await old.servicer.stop(hand_back=False)
                await old.server.stop()
                old.clock.freeze()
                new = group[1]
                loop = asyncio.get_running_loop()
                await wait_until(lambda: _primary([new]), timeout_s=20, what="the standby taking over")
                took_over_at = loop.time()
                assert old.servicer.is_primary()  # it does not know

                # Its late writes: accepted at its gate, refused by the fence in the database.
                with pytest.raises(NotPrimary) as refused:
                    await old.servicer.heartbeat(_heartbeat(99), _NO_PAYLOAD)
                assert refused.value.primary_address == new.address
                assert old.servicer.role == "standby" and not old.servicer.state.nodes  # it dropped its state
                assert engine.store.get(PREFIX + schema.node_key(99)) is None
                assert 99 not in new.servicer.state.nodes

                # The heartbeat workload followed the redirect; the new primary kept everything.
                async def beating() -> bool:
                    return all(beats.get(n, 0) > took_over_at for n in NODES)
                await wait_until(beating, timeout_s=20, what="heartbeats at the new primary")
                assert _public_view(new.servicer) == (chains, states)
                assert all(new.servicer.state.nodes[n].alive for n in NODES)
                acts = [(0.0, "m0", old_epoch), (1.0, "m1", new.servicer.state.epoch)]
                assert new.servicer.state.epoch > old_epoch and primary_history_violations(acts) == []
            finally:
                for task in workload:
                    task.cancel()
                await asyncio.gather(*workload, return_exceptions=True)
                await channels.close()  # before the servers stop: they wait for open connections
    asyncio.run(body())


class _ScriptedChannels:
    """Channels whose answers are scripted per address: an error to raise, or a response."""

    def __init__(self, answers: dict[str, FS3Error | mpb.HeartbeatRsp]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    def get(self, address: str) -> _ScriptedChannel:
        return _ScriptedChannel(self, address)

    def node_address(self, framed_address: str, grpc_address: str) -> str:
        return framed_address

    async def close(self) -> None:
        return None


@dataclass
class _ScriptedChannel:
    owner: _ScriptedChannels
    address: str

    async def call(self, method: object, request: object, payload: object = b"",
                   timeout_ms: int = 10_000) -> tuple[mpb.HeartbeatRsp, bytes]:
        self.owner.calls.append(self.address)
        answer = self.owner.answers.get(self.address, Unavailable("connection refused"))
        if isinstance(answer, FS3Error):
            raise answer
        return answer, b""

    async def close(self) -> None:
        return None


def test_the_mgmtd_caller_follows_redirects_skips_dead_instances_and_gives_up_in_bounded_tries() -> None:
    async def body() -> None:
        ok = mpb.HeartbeatRsp(routing_version=7)
        channels = _ScriptedChannels({"a:1": Unavailable("refused"), "b:1": NotPrimary.naming("c:1"), "c:1": ok})
        caller = MgmtdCaller("a:1, b:1,c:1,a:1", channels)
        assert caller.addresses == ["a:1", "b:1", "c:1"]
        assert await caller.call("Heartbeat", _heartbeat(1)) == ok
        assert channels.calls == ["a:1", "b:1", "c:1"] and caller.current == "c:1"
        await caller.call("Heartbeat", _heartbeat(1))
        assert channels.calls[-1] == "c:1" and len(channels.calls) == 4  # the primary first, next time

        # A standby naming a primary that is not in the list is followed too.
        channels = _ScriptedChannels({"a:1": NotPrimary.naming("z:9"), "z:9": ok})
        assert await MgmtdCaller("a:1", channels).call("Heartbeat", _heartbeat(1)) == ok

        # An error another instance cannot cure is the answer at once.
        channels = _ScriptedChannels({"a:1": InvalidArgument("bad heartbeat"), "b:1": ok})
        with pytest.raises(InvalidArgument):
            await MgmtdCaller("a:1,b:1", channels).call("Heartbeat", _heartbeat(1))
        assert channels.calls == ["a:1"]

        # Nobody primary (a takeover under way) and nobody alive: bounded rounds, the last error.
        channels = _ScriptedChannels({"a:1": NotPrimary.naming(""), "b:1": NotPrimary.naming("")})
        with pytest.raises(NotPrimary):
            await MgmtdCaller("a:1,b:1", channels).call("Heartbeat", _heartbeat(1))
        assert len(channels.calls) == 5
        with pytest.raises(InvalidArgument):
            MgmtdCaller(" , ", channels)
    asyncio.run(body())


def test_mgmtd_settings_for_a_shared_engine_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="pg_url"):
        MgmtdConfig(kv_engine="postgres").validate()
    with pytest.raises(InvalidArgument, match="renew_interval_ms"):
        MgmtdConfig(kv_engine="postgres", pg_url="postgresql://db/fs3", lease_ms=1_000, lease_drift_margin_ms=100,
                    lease_renew_interval_ms=900).validate()
    MgmtdConfig(lease_ms=1_000, lease_renew_interval_ms=900, scan_interval_ms=5_000).validate()  # single: unused
    with pytest.raises(InvalidArgument, match="heartbeat_timeout_ms"):
        MgmtdConfig(kv_engine="postgres", pg_url="postgresql://db/fs3", heartbeat_timeout_ms=5_000).validate()
    config = MgmtdConfig(kv_engine="postgres", pg_url="postgresql://db/fs3", framed_port=0)
    config.validate()
    engine = OptimisticTxnEngine(MemKVStore(), sync=False)
    with pytest.raises(InvalidArgument, match="advertise_address"):
        shared_setup(config, engine)
    setup = shared_setup(replace(config, framed_port=9000, listen_host="10.0.0.1"), engine)
    assert (setup.name, setup.address) == ("10.0.0.1:9000", "10.0.0.1:9000")
    with pytest.raises(InvalidArgument):
        MgmtdServicer(MemKVStore(), MgmtdConfig(), shared=setup)  # a local store and a shared engine


@pytest.mark.slow  # serves two mgmtd on sockets
def test_a_stopping_primary_hands_the_lease_back_and_a_standby_takes_over_at_once() -> None:
    async def body() -> None:
        engine = OptimisticTxnEngine(MemKVStore(), sync=False)
        slow = LeaseConfig(lease_ms=20_000, renew_interval_ms=100, drift_margin_ms=100)
        async with instances(engine, 2, slow) as group:
            old = await wait_until(lambda: _primary(group), timeout_s=30, what="a first primary")
            await old.servicer.heartbeat(_heartbeat(1), _NO_PAYLOAD)
            epoch = old.servicer.state.epoch
            await old.servicer.stop()
            assert old.servicer.role == "standby"
            new = next(i for i in group if i is not old)
            # Well before the 20 s lease could have run out.
            await wait_until(lambda: _primary([new]), timeout_s=10, what="the standby taking the handed-back lease")
            assert new.servicer.state.epoch == epoch + 1 and 1 in new.servicer.state.nodes
            assert old.servicer.shared is not None
            with pytest.raises(NotPrimary):  # the old one's fence holds after the hand-back too
                await write_fenced(engine, old.servicer.shared.name, epoch, {})
    asyncio.run(body())



@pytest.mark.slow  # three mgmtd and three storage nodes on sockets, through a takeover
def test_storage_nodes_follow_the_primary_and_a_chain_carries_on_through_a_takeover(tmp_path: Path) -> None:
    async def body() -> None:
        engine = OptimisticTxnEngine(MemKVStore(), sync=False)
        async with instances(engine, 3) as group, contextlib.AsyncExitStack() as stack:
            addresses = ",".join(i.address for i in group)
            first = await wait_until(lambda: _primary(group), timeout_s=20, what="a first primary")
            nodes: list[StorageNode] = []
            for node_id in NODES:
                config = StorageConfig(node_id=node_id, fsync=False,
                                       targets=[TargetConfig(node_id * 100 + 1, str(tmp_path / f"n{node_id}"))])
                node_channels = RealChannelFactory(TOKEN)
                parts = build_storage_node(
                    StorageNodeConfig(node_id=node_id, mgmtd_address=addresses, heartbeat_interval_ms=100,
                                      rpc_timeout_ms=1_000),
                    open_engines(config), node_channels, token=TOKEN)
                server = FramedServer(parts.dispatcher)
                parts.node.config.framed_address = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
                await parts.node.start()
                stack.push_async_callback(node_channels.close)
                stack.push_async_callback(server.stop)
                stack.push_async_callback(parts.node.stop)
                nodes.append(parts.node)
            channels = RealChannelFactory(TOKEN)
            stack.push_async_callback(channels.close)

            async def registered() -> bool:
                return len(first.servicer.state.targets) == len(NODES)
            await wait_until(registered, timeout_s=20, what="every target registered")
            table = await AdminClient(addresses, channels).create_chain_table(1, replicas=3)
            chain_id = table.chains[0].chain_id
            client = StorageClient(RoutingCache([addresses], channels), channels, b"c" * 16,
                                   StorageClientConfig(rpc_timeout_ms=1_000, retry_total_ms=30_000))

            async def chain_serving() -> bool:
                return {t.public_state for t in first.servicer.state.targets.values()} == {PublicState.SERVING}
            await wait_until(chain_serving, timeout_s=20, what="the chain serving")
            await client.write(chain_id, b"k" * 8, 0, b"before", 1 << 20)
            chains, states = _public_view(first.servicer)

            await first.servicer.stop(hand_back=False)
            await first.server.stop()
            rest = [i for i in group if i is not first]
            second = await wait_until(lambda: _primary(rest), timeout_s=20, what="a standby taking over")
            new_version = second.servicer.state.routing_version

            async def nodes_follow() -> bool:
                return all(n.routing_version >= new_version and n.lease_valid() for n in nodes)
            await wait_until(nodes_follow, timeout_s=20, what="storage nodes on the new primary's routing")
            await client.write(chain_id, b"k" * 8, 6, b" after", 1 << 20)
            data, _ = await client.read(chain_id, b"k" * 8, 0, 12)
            assert data == b"before after"
            assert _public_view(second.servicer) == (chains, states)
            assert all(n.alive for n in second.servicer.state.nodes.values())
    asyncio.run(body())


# -- every mgmtd with its role: `fs3 admin nodes` --------------------------------------------------


async def _listing(channels: RealChannelFactory, address: str) -> mpb.ListNodesRsp:
    rsp, _ = await channels.get(address).call(service_spec("Mgmtd").method("ListNodes"), cpb.Empty())
    assert isinstance(rsp, mpb.ListNodesRsp)
    return rsp


def _roles(rsp: mpb.ListNodesRsp) -> dict[str, int]:
    return {i.name: i.role for i in rsp.mgmtd_instances}


@pytest.mark.slow  # serves three mgmtd on sockets for a few lease periods
@pytest.mark.parametrize("database", ["memory", "postgresql"])
def test_every_instance_lists_one_primary_and_the_standbys_and_a_dead_primary_turns_stale(
        database: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> None:
    pg_url = request.getfixturevalue("postgres_url") if database == "postgresql" else ""

    async def body() -> None:
        close: Callable[[], Awaitable[None]] | None = None
        if pg_url:
            engine, close = await open_shared_engine(MgmtdConfig(kv_engine="postgres", pg_url=pg_url))
        else:
            engine = OptimisticTxnEngine(MemKVStore(), sync=False)
        channels = RealChannelFactory(token=TOKEN)
        try:
            async with instances(engine, 3) as group:
                first = await wait_until(lambda: _primary(group), timeout_s=20, what="a first primary")
                await first.servicer.heartbeat(_heartbeat(1), _NO_PAYLOAD)
                epoch = first.servicer.state.epoch
                names = {f"m{i}" for i in range(3)}
                expected = {f"m{i}": mpb.MGMTD_ROLE_STANDBY for i in range(3)} | {
                    first.servicer.shared.name if first.servicer.shared else "": mpb.MGMTD_ROLE_PRIMARY}

                async def all_agree() -> bool:
                    listings = [await _listing(channels, i.address) for i in group]
                    return all(_roles(r) == expected and r.lease_epoch == epoch for r in listings)
                await wait_until(all_agree, timeout_s=20, what="every instance listing one primary, two standbys")
                # A standby answers from the database: the nodes the primary published, the
                # instances with their addresses, and itself as the one that answered.
                standby = next(i for i in group if i is not first)
                listed = await _listing(channels, standby.address)
                assert [n.node_id for n in listed.nodes] == [1] and listed.nodes[0].alive
                assert {i.name: i.address for i in listed.mgmtd_instances} == {
                    f"m{n}": group[n].address for n in range(3)}
                assert listed.answered_by == standby.servicer.shared.name if standby.servicer.shared else False
                assert set(_roles(listed)) == names

                # The command line's ROLE column, asked of every address (starting at a standby).
                from fs3.cli.main import build_parser, run_admin
                addresses = ",".join(i.address for i in reversed(group))
                base = ["admin", "--mgmtd", addresses, "--token", TOKEN]
                capsys.readouterr()
                assert await run_admin(build_parser().parse_args([*base, "nodes"])) == 0
                text = capsys.readouterr().out
                header = text.splitlines()[0].split()
                assert header[:4] == ["node", "type", "role", "status"]
                rows = {line.split()[0]: line.split() for line in text.splitlines()[2:-1] if line.split()[1] == "mgmtd"}
                assert {name: row[2] for name, row in rows.items()} == {
                    name: "primary" if role == mpb.MGMTD_ROLE_PRIMARY else "standby" for name, role in expected.items()}
                assert f"lease epoch {epoch}" in text
                assert await run_admin(build_parser().parse_args([*base, "--json", "nodes"])) == 0
                entries = json.loads(capsys.readouterr().out)
                mgmtds = {e["name"]: e for e in entries if e["node_type"] == "mgmtd"}
                assert {n: e["role"] for n, e in mgmtds.items()} == {n: r[2] for n, r in rows.items()}
                assert all(e["alive"] and e["lease_epoch"] == epoch for e in mgmtds.values())
                assert [(e["node_id"], e["role"]) for e in entries if e["node_type"] != "mgmtd"] == [(1, "peer")]

                # The primary dies; a survivor lists the new primary and the old one stale.
                await first.servicer.stop(hand_back=False)
                await first.server.stop()
                rest = [i for i in group if i is not first]
                second = await wait_until(lambda: _primary(rest), timeout_s=20, what="a standby taking over")
                old_name = first.servicer.shared.name if first.servicer.shared else ""
                new_name = second.servicer.shared.name if second.servicer.shared else ""
                survivor = next(i for i in rest if i is not second)

                survivor_name = survivor.servicer.shared.name if survivor.servicer.shared else ""
                after = {old_name: mpb.MGMTD_ROLE_STALE, new_name: mpb.MGMTD_ROLE_PRIMARY,
                         survivor_name: mpb.MGMTD_ROLE_STANDBY}

                async def new_roles() -> mpb.ListNodesRsp | None:
                    rsp = await _listing(channels, survivor.address)
                    # Until the survivor reads the new lease, it may show no primary: never two.
                    assert list(_roles(rsp).values()).count(mpb.MGMTD_ROLE_PRIMARY) <= 1, rsp
                    return rsp if _roles(rsp) == after else None
                listed = await wait_until(new_roles, timeout_s=20, what="the new primary, the dead one stale")
                assert listed.lease_epoch == second.servicer.state.epoch > epoch
        finally:
            await channels.close()
            if close is not None:
                await close()

    asyncio.run(body())


def test_a_single_mgmtd_lists_itself_as_primary_with_no_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    async def body() -> None:
        dispatcher = Dispatcher(token=TOKEN)
        server = FramedServer(dispatcher)
        address = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
        servicer = MgmtdServicer(MemKVStore(), MgmtdConfig(kv_engine="mem"))
        servicer.framed_address = address
        dispatcher.add_service(service_spec("Mgmtd"), servicer)
        servicer.start()
        try:
            meta = mpb.HeartbeatReq(node_id=1001, node_type=cpb.NODE_META, framed_address="h:9010")
            await servicer.heartbeat(meta, _NO_PAYLOAD)
            from fs3.cli.main import build_parser, run_admin
            capsys.readouterr()
            assert await run_admin(build_parser().parse_args(["admin", "--mgmtd", address, "--token", TOKEN,
                                                              "--json", "nodes"])) == 0
            entries = json.loads(capsys.readouterr().out)
            assert [(e["node_type"], e["name"], e["framed_address"], e["role"], e["alive"], e["lease_epoch"])
                    for e in entries] == [("mgmtd", address, address, "primary", True, 0),
                                          ("meta", "", "h:9010", "peer", True, 0)]
        finally:
            await servicer.stop()
            await server.stop()
    asyncio.run(body())


def test_presence_is_judged_by_the_counter_advancing_on_the_readers_clock() -> None:
    watch = PresenceWatch("m0", stale_after_ms=1_000)
    lease = LeaseRecord(epoch=4, holder="m1", address="b:1", renewals=7)
    a, b, c = InstanceRecord("m0", "a:1", 3), InstanceRecord("m1", "b:1", 9), InstanceRecord("m2", "c:1", 2)
    watch.observe([a, b, c], now_ms=10_000)
    assert watch.next_record("a:1") == InstanceRecord("m0", "a:1", 4)  # its own counter, bumped
    # Just seen: presumed up; the renewing holder is primary.
    roles = {r.name: role for r, role in watch.roles(lease, 0, False, "a:1", 10_000)}
    assert roles == {"m0": STANDBY, "m1": PRIMARY, "m2": STANDBY}
    # m1 keeps bumping, m2 stands still for a lease period of this reader's clock.
    watch.observe([a, replace(b, presence=10), c], now_ms=10_900)
    watch.observe([a, replace(b, presence=11), c], now_ms=11_000)
    roles = {r.name: role for r, role in watch.roles(lease, 100, False, "a:1", 11_000)}
    assert roles == {"m0": STANDBY, "m1": PRIMARY, "m2": STALE}
    # The lease stood still for a period: its holder is no longer shown primary, even while its
    # counter still advances; a handed-back lease names no primary either.
    assert {r.name: role for r, role in watch.roles(lease, 1_000, False, "a:1", 11_000)}["m1"] == STANDBY
    released = replace(lease, released=True)
    assert {r.name: role for r, role in watch.roles(released, 0, False, "a:1", 11_000)}["m1"] == STANDBY
    # The reader itself: primary exactly when it may act as one, listed before its first record is read.
    fresh = PresenceWatch("m9", stale_after_ms=1_000)
    assert [(r.name, r.address, role) for r, role in fresh.roles(None, 0, True, "z:1", 0)] == [("m9", "z:1", PRIMARY)]
    # A clock that went backwards restarts every wait; records gone from the database are forgotten.
    watch.observe([a, c], now_ms=5_000)
    assert watch.fresh("m2", 5_500) and not watch.fresh("m1", 5_500)
    assert watch.forgettable(6_000, 1_000) == [c]
    with pytest.raises(InvalidArgument):
        InstanceRecord.decode(b'{"name": "", "address": "a", "presence": 1}')
    assert InstanceRecord.decode(b.encode()) == b


def test_instance_records_are_written_read_and_forgotten_only_while_unchanged() -> None:
    async def body() -> None:
        engine = OptimisticTxnEngine(MemKVStore(), sync=False)
        gone, back = InstanceRecord("old", "o:1", 5), InstanceRecord("back", "b:1", 2)
        for record in (gone, back):
            await write_instance(engine, record)
        junk = engine.begin()
        junk.put(instance_key("junk"), b"not json")  # skipped, not fatal
        await junk.commit()
        assert sorted(r.name for r in await read_instances(engine)) == ["back", "old"]
        await write_instance(engine, replace(back, presence=3))  # it came back meanwhile: kept
        assert await forget_instances(engine, [gone, back]) == 1
        assert [r.name for r in await read_instances(engine)] == ["back"]
    asyncio.run(body())

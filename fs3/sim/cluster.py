"""A whole fs3 storage cluster inside the simulator: mgmtd, storage nodes, clients, faults."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fs3 import mgmtd_pb2 as mpb
from fs3.client.admin import AdminClient
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient, StorageClientConfig
from fs3.cluster.services import build_mgmtd, build_storage_node
from fs3.cluster.topology import MGMTD, Topology
from fs3.common.target_state import LocalState, PublicState
from fs3.kv.store import MemKVStore
from fs3.mgmtd.service import MgmtdConfig, MgmtdServicer
from fs3.sim.loop import SimProcess
from fs3.sim.network import NetworkFaults, SimChannelFactory, SimNetwork
from fs3.storage.blobs import MemBlobStore
from fs3.storage.chunk_engine import ChunkEngine
from fs3.storage.node import IoSubmitter, StorageNode, StorageNodeConfig
from fs3.storage.replica import DirtyReadPolicy, ReplicaConfig

__all__ = ["MGMTD", "ClusterShape", "SimCluster"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterShape:
    """What a seed randomises besides the faults."""

    storage_nodes: int = 3
    targets_per_node: int = 1
    replicas: int = 3
    chunk_size: int = 4096
    heartbeat_timeout_ms: int = 2_000
    heartbeat_interval_ms: int = 200
    dirty_read_policy: str = DirtyReadPolicy.ASK_TAIL
    latency_max_ms: float = 2.0
    offload_write_min_bytes: int = 0
    # Versions up to this size are KV records, larger ones blobs (0: every version is a blob).
    inline_max_bytes: int = 0
    # The I/O thread pool: an offloaded write or sync finishes up to this long after it started
    # (0: blocking I/O runs inline, as without a pool). It keeps running if its caller is cancelled.
    io_delay_max_ms: float = 0.0
    # Chance that a call which timed out also cancels its handler on the server (a deadline that
    # reaches the server, a connection closed by the client).
    cancel_probability: float = 0.0
    # How long a client retries one operation before it gives up (its outcome is then unknown).
    client_retry_ms: int = 30_000

    @classmethod
    def random(cls, rng: random.Random, mix: str = "default") -> ClusterShape:
        replicas = rng.choice((2, 3, 3))
        shape = cls(
            storage_nodes=replicas + rng.randint(0, 2),
            targets_per_node=rng.randint(1, 2),
            replicas=replicas,
            chunk_size=rng.choice((4096, 8192)),
            heartbeat_timeout_ms=rng.choice((1_000, 2_000, 3_000)),
            heartbeat_interval_ms=rng.choice((100, 200)),
            dirty_read_policy=rng.choice((DirtyReadPolicy.ASK_TAIL, DirtyReadPolicy.RETRY)),
            latency_max_ms=rng.choice((0.5, 2.0, 10.0)),
            offload_write_min_bytes=rng.choice((0, 1 << 30)),
        )
        if mix == "legacy":
            return shape  # the shapes of the first mix, drawn exactly as they were
        return replace(shape, inline_max_bytes=rng.choice((0, 512, 2048, 1 << 20)),
                       io_delay_max_ms=rng.choice((0.0, 1.0, 20.0)),
                       cancel_probability=rng.choice((0.0, 0.5, 1.0)),
                       client_retry_ms=rng.choice((2_000, 30_000)))


@dataclass
class _Disk:
    kv: MemKVStore = field(default_factory=MemKVStore)
    blobs: MemBlobStore = field(default_factory=MemBlobStore)


@dataclass
class _StorageSlot:
    node_id: int
    address: str
    disks: dict[int, _Disk]
    process: SimProcess | None = None
    node: StorageNode | None = None


class SimCluster:
    """The cluster a seed draws (:class:`ClusterShape`), its services wired as every cluster's are
    (:mod:`fs3.cluster.services`) but run as simulated processes on the simulated network."""

    def __init__(self, seed: int, shape: ClusterShape | None = None, mix: str = "default") -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.shape = shape or ClusterShape.random(self.rng, mix)
        self.topology = Topology(storage_nodes=self.shape.storage_nodes, targets_per_node=self.shape.targets_per_node,
                                 replicas=self.shape.replicas, with_meta=mix == "meta")
        self.network = SimNetwork(self.rng, NetworkFaults(latency_max_ms=self.shape.latency_max_ms,
                                                          cancel_probability=self.shape.cancel_probability))
        # The I/O pools' delays draw from their own generator, so that a seed's other choices do
        # not depend on how many blocking calls the code happens to make.
        self.io_rng = random.Random(seed ^ 0x10_5EED)
        self.disk_stalls: dict[int, float] = {}  # node id -> virtual time its disks answer again
        self.mgmtd_kv = MemKVStore()
        self.mgmtd_process: SimProcess | None = None
        self.mgmtd: MgmtdServicer | None = None
        self.storage: dict[int, _StorageSlot] = {}
        for node_id in self.topology.node_ids:
            disks = {target_id: _Disk() for target_id in self.topology.target_ids(node_id)}
            self.storage[node_id] = _StorageSlot(node_id, self.topology.storage_name(node_id), disks)
        self._client_count = 0
        self._admin_count = 0

    # -- processes ---------------------------------------------------------------------------

    def start_mgmtd(self) -> None:
        process = SimProcess(MGMTD)
        config = MgmtdConfig(heartbeat_timeout_ms=self.shape.heartbeat_timeout_ms, scan_interval_ms=50,
                             kv_engine="mem")
        parts = build_mgmtd(self.mgmtd_kv, config)
        servicer = parts.servicer
        self.network.bind(MGMTD, process, parts.dispatcher)

        async def boot() -> None:
            servicer.start()
            await asyncio.Event().wait()

        process.run(boot())
        self.mgmtd_process, self.mgmtd = process, servicer

    def kill_mgmtd(self) -> None:
        assert self.mgmtd_process is not None
        self.mgmtd_process.kill()
        self.mgmtd_kv.crash()
        self.network.unbind(MGMTD)
        self.mgmtd_process = self.mgmtd = None

    def start_storage(self, node_id: int) -> None:
        slot = self.storage[node_id]
        process = SimProcess(slot.address)
        engines = {tid: ChunkEngine(disk.kv, disk.blobs, inline_max_bytes=self.shape.inline_max_bytes)
                   for tid, disk in slot.disks.items()}
        config = StorageNodeConfig(
            node_id=node_id, mgmtd_address=MGMTD, framed_address=slot.address, grpc_address=slot.address,
            heartbeat_interval_ms=self.shape.heartbeat_interval_ms, rpc_timeout_ms=1_000,
            replica=ReplicaConfig(forward_timeout_ms=500, forward_retry_total_ms=5_000, routing_wait_ms=50,
                                  dirty_read_policy=self.shape.dirty_read_policy, query_timeout_ms=500,
                                  offload_write_min_bytes=self.shape.offload_write_min_bytes,
                                  offload_read_min_bytes=self.shape.offload_write_min_bytes),
        )
        parts = build_storage_node(config, engines, SimChannelFactory(self.network, slot.address),
                                   io_submitter=self._io_pool(node_id) if self.shape.io_delay_max_ms > 0 else None)
        node = parts.node
        self.network.bind(slot.address, process, parts.dispatcher)

        async def boot() -> None:
            await node.start()
            await asyncio.Event().wait()

        process.run(boot())
        slot.process, slot.node = process, node

    def _io_pool(self, node_id: int) -> IoSubmitter:
        """A model of a node's I/O thread pool: the work runs at a random later time, as a task of
        the node's process (a thread dies with its process) that nothing else cancels — like a
        thread, it goes on when the request that started it is cancelled."""

        def submit(fn: Callable[[], Any]) -> asyncio.Future[Any]:
            loop = asyncio.get_running_loop()
            delay = self.io_rng.uniform(0, self.shape.io_delay_max_ms) / 1000
            delay = max(delay, self.disk_stalls.get(node_id, 0.0) - loop.time())

            async def work() -> Any:
                await asyncio.sleep(delay)
                return fn()

            process = self.storage[node_id].process
            assert process is not None
            return process.run(work())

        return submit

    def stall_disks(self, node_id: int, seconds: float) -> None:
        """The node's disks stop answering for a while (blocking I/O started meanwhile waits)."""
        self.disk_stalls[node_id] = asyncio.get_running_loop().time() + seconds

    def kill_storage(self, node_id: int) -> None:
        slot = self.storage[node_id]
        assert slot.process is not None
        slot.process.kill()
        for disk in slot.disks.values():
            disk.kv.crash()
            disk.blobs.crash()
        self.network.unbind(slot.address)
        slot.process = slot.node = None

    def storage_alive(self, node_id: int) -> bool:
        return self.storage[node_id].process is not None

    def admin(self) -> AdminClient:
        """An admin client (``fs3 admin``) with its own address on the simulated network."""
        self._admin_count += 1
        return AdminClient(MGMTD, SimChannelFactory(self.network, f"admin-{self._admin_count}"), timeout_ms=2_000)

    def new_client(self, pick_rng: random.Random | None = None) -> StorageClient:
        self._client_count += 1
        name = f"client-{self._client_count}"
        channels = SimChannelFactory(self.network, name)
        routing = RoutingCache([MGMTD], channels, rpc_timeout_ms=1_000)
        rng = pick_rng or self.rng
        return StorageClient(routing, channels, name.encode(),
                             StorageClientConfig(rpc_timeout_ms=2_000, retry_total_ms=self.shape.client_retry_ms,
                                                 retry_backoff_ms=10,
                                                 retry_backoff_max_ms=200, channels_max=4),
                             pick=lambda n: rng.randrange(n))

    # -- orchestration -----------------------------------------------------------------------

    async def boot(self) -> list[int]:
        """Start everything, create the chain table; returns the chain ids."""
        self.start_mgmtd()
        for node_id in self.storage:
            self.start_storage(node_id)
        assert self.mgmtd is not None
        expected = self.topology.target_count
        for _ in range(1000):
            await asyncio.sleep(0.05)
            if len(self.mgmtd.state.targets) == expected:
                break
        else:
            raise AssertionError("storage targets never registered")
        rsp = self.mgmtd.state.create_chain_table(mpb.CreateChainTableReq(table_id=self.topology.chain_table_id,
                                                                          replicas=self.topology.replicas))
        chain_ids = [c.chain_id for c in rsp.chains]
        await self.wait_all_serving(30_000)
        return chain_ids

    def public_states(self) -> dict[int, PublicState]:
        assert self.mgmtd is not None
        return {tid: t.public_state for tid, t in self.mgmtd.state.targets.items() if t.info.chain_id}

    def unhealthy_nodes(self) -> set[int]:
        """Nodes that are down, or have a target that is not serving."""
        bad = {n for n in self.storage if not self.storage_alive(n)}
        for node_id, slot in self.storage.items():
            # A restarted node is down for the design until it has resynced, even before mgmtd noticed.
            if slot.node is not None and (slot.node._silent_until_offline or any(
                    state is not LocalState.UP_TO_DATE for state in slot.node.local_states.values())):
                bad.add(node_id)
        if self.mgmtd is None:
            return bad
        for target in self.mgmtd.state.targets.values():
            if target.info.chain_id and target.public_state is not PublicState.SERVING:
                bad.add(target.info.node_id)
        return bad

    async def wait_all_serving(self, timeout_ms: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        while loop.time() < deadline:
            # Every node up and serving in its own eyes too: a node restarted moments ago may still
            # look serving to mgmtd (which has not missed its heartbeats yet) while it waits to resync.
            if self.mgmtd is not None and self.mgmtd.state.chains and not self.unhealthy_nodes():
                # Every node must also have seen it (its routing caught up).
                versions = [s.node.routing_version for s in self.storage.values() if s.node is not None]
                if versions and min(versions) >= self.mgmtd.state.routing_version:
                    return
            await asyncio.sleep(0.05)
        raise AssertionError(f"cluster did not return to all-serving within {timeout_ms} ms: "
                             f"{ {t: s.name for t, s in self.public_states().items()} if self.mgmtd else 'no mgmtd'}")

    def chain_targets(self) -> dict[int, list[int]]:
        assert self.mgmtd is not None
        return {cid: list(c.target_ids) for cid, c in self.mgmtd.state.chains.items()}

    def engine(self, target_id: int) -> ChunkEngine | None:
        slot = self.storage[self.topology.node_of(target_id)]
        if slot.node is None:
            return None
        return slot.node.engines[target_id]

    def unstaged(self, target_id: int) -> frozenset[bytes]:
        """Chunks the target forwarded an update of before a pending version marked them dirty
        (:attr:`fs3.storage.replica.TargetReplica.unstaged`)."""
        slot = self.storage[self.topology.node_of(target_id)]
        if slot.node is None:
            return frozenset()
        return slot.node.replicas[target_id].unstaged

"""An in-process cluster on real sockets: mgmtd and storage nodes in the test's own event loop.

Faster than child processes and lets a test look at every engine directly, while every call
still crosses the real framed or gRPC transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fs3.client.admin import AdminClient
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient, StorageClientConfig
from fs3.cluster.certs import CLIENT, tls_config
from fs3.cluster.services import build_meta, build_mgmtd, build_storage_node
from fs3.cluster.topology import META, META_NODE_ID, MGMTD, Topology
from fs3.common.clock import Clock
from fs3.common.metrics import ServiceMetrics
from fs3.common.target_state import PublicState
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine, TxnFaults
from fs3.meta.server import MetaConfig, heartbeat_loop
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.mgmtd.service import MgmtdConfig, MgmtdServicer
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.server import ServiceRuntime
from fs3.rpc.tls import Tls
from fs3.storage.node import StorageNode, StorageNodeConfig
from fs3.storage.replica import ReplicaConfig
from fs3.storage.scrub import ScrubConfig
from fs3.storage.server import StorageConfig, TargetConfig, open_engines
from tests.conftest import wait_until


@dataclass
class InProcessCluster:
    """The cluster :attr:`topology` describes, each service wired by :mod:`fs3.cluster.services` and
    served by a :class:`ServiceRuntime` on loopback ports in the running event loop."""

    root: Path
    storage_nodes: int = 3
    targets_per_node: int = 1
    replicas: int = 3
    token: str = "tok"
    transport: str = "framed"
    storage_fsync: bool = False  # real fsyncs on storage targets (slow; for durability-path tests)
    io_threads: int = 0  # storage nodes' I/O pools (0: blocking I/O on the event loop)
    channel_expiry_interval_ms: int = 60_000
    replica_config: ReplicaConfig = field(default_factory=lambda: ReplicaConfig(forward_timeout_ms=1_000,
                                                                                forward_retry_total_ms=5_000))
    scrub_config: ScrubConfig = field(default_factory=ScrubConfig)  # every storage node's scrubbers
    runtimes: list[ServiceRuntime] = field(default_factory=list)
    nodes: dict[int, StorageNode] = field(default_factory=dict)
    mgmtd: MgmtdServicer | None = None
    mgmtd_runtime: ServiceRuntime | None = None
    chain_ids: list[int] = field(default_factory=list)
    with_meta: bool = False
    meta_faults: TxnFaults | None = None
    meta_config: MetaServiceConfig = field(default_factory=lambda: MetaServiceConfig(
        root_mode=0o777, client_lease_ms=30_000, prune_interval_ms=200, gc_interval_ms=100))
    # Meta's clocks (None: the real ones): a monotonic clock for leases, a wall clock for inode times.
    meta_clock: Clock | None = None
    meta_wall_ns: Callable[[], int] | None = None
    meta: MetaService | None = None
    meta_kv: MemKVStore | None = None
    # Meta servers on the one store (node ids META_NODE_ID, +1, ...), all on ONE transaction
    # engine: it stands in for the database several meta processes share.
    meta_servers: int = 1
    metas: dict[int, MetaService] = field(default_factory=dict)
    meta_engine: OptimisticTxnEngine | None = None
    _meta_parts: dict[int, tuple[ServiceRuntime, RealChannelFactory, asyncio.Task[None]]] = field(
        default_factory=dict)
    _storage_configs: dict[int, StorageConfig] = field(default_factory=dict)
    # Certificates made by fs3.cluster.certs for every service by name and for "client": mutual TLS.
    tls_dir: Path | None = None
    # Serve every service's /metrics (on free ports, registered with mgmtd as the processes do).
    serve_metrics: bool = False

    def tls(self, name: str) -> Tls | None:
        """The TLS material of service (or ``client``) ``name``; None when the cluster runs in clear."""
        return Tls.load(tls_config(self.tls_dir, name)) if self.tls_dir is not None else None

    @property
    def _metrics_port(self) -> int:
        return 0 if self.serve_metrics else -1

    @property
    def topology(self) -> Topology:
        return Topology(storage_nodes=self.storage_nodes, targets_per_node=self.targets_per_node,
                        replicas=self.replicas, with_meta=self.with_meta)

    async def __aenter__(self) -> InProcessCluster:
        topology = self.topology
        config = MgmtdConfig(heartbeat_timeout_ms=2_000, scan_interval_ms=50, kv_engine="mem", token=self.token)
        metrics = ServiceMetrics("mgmtd")
        mgmtd = build_mgmtd(MemKVStore(), config, token=self.token, metrics=metrics)
        self.mgmtd = mgmtd.servicer
        self.mgmtd_runtime = ServiceRuntime(MGMTD, mgmtd.dispatcher, metrics, tls=self.tls(MGMTD))
        self.mgmtd.start()
        bound = await self.mgmtd_runtime.start("127.0.0.1", 0, 0, self._metrics_port)
        self.mgmtd.metrics_address = bound.metrics
        self.channels = RealChannelFactory(self.token, self.transport, self.tls(CLIENT))  # type: ignore[arg-type]
        for node_id in topology.node_ids:
            storage_config = StorageConfig(
                node_id=node_id, fsync=self.storage_fsync,
                targets=[TargetConfig(topology.target_id(node_id, j), str(self.root / f"n{node_id}" / f"t{j}"))
                         for j in range(1, topology.targets_per_node + 1)])
            engines = open_engines(storage_config)
            self._storage_configs[node_id] = storage_config
            node_tls = self.tls(topology.storage_name(node_id))
            node_channels = RealChannelFactory(self.token, self.transport, node_tls)  # type: ignore[arg-type]
            metrics = ServiceMetrics("storage")
            parts = build_storage_node(
                StorageNodeConfig(node_id=node_id, mgmtd_address=self.mgmtd_address, heartbeat_interval_ms=100,
                                  rpc_timeout_ms=2_000, replica=self.replica_config, io_threads=self.io_threads,
                                  channel_expiry_interval_ms=self.channel_expiry_interval_ms,
                                  scrub=self.scrub_config),
                engines, node_channels, token=self.token, metrics=metrics)
            node = parts.node
            runtime = ServiceRuntime(topology.storage_name(node_id), parts.dispatcher, metrics, tls=node_tls)
            bound = await runtime.start("127.0.0.1", 0, 0, self._metrics_port)
            node.config.framed_address, node.config.grpc_address = bound.framed, bound.grpc
            node.config.metrics_address = bound.metrics
            await node.start()
            self.runtimes.append(runtime)
            self.nodes[node_id] = node
        admin = self.admin()
        expected = topology.target_count
        await wait_until(lambda: self._registered(admin, expected), what="targets registered")
        table = await admin.create_chain_table(topology.chain_table_id, replicas=topology.replicas)
        self.chain_ids = [c.chain_id for c in table.chains]
        await wait_until(self.all_serving, what="chains serving")
        if self.with_meta:
            await self.start_meta()
        return self

    async def start_meta(self) -> MetaService:
        """The meta servers on an in-memory store (kept across restarts of the service), registered
        with mgmtd; returns the first."""
        if self.meta_kv is None:
            self.meta_kv = MemKVStore()
        self.meta_engine = OptimisticTxnEngine(self.meta_kv, faults=self.meta_faults)
        for index in range(self.meta_servers):
            await self.start_meta_server(index)
        assert self.meta is not None
        return self.meta

    async def start_meta_server(self, index: int) -> MetaService:
        """Meta server ``index`` (node ``META_NODE_ID + index``) on the shared engine."""
        assert self.meta_engine is not None and index not in self.metas
        channels = RealChannelFactory(self.token, self.transport, self.tls(META))  # type: ignore[arg-type]
        metrics = ServiceMetrics("meta")
        parts = build_meta(self.meta_engine, channels, self.mgmtd_address, os.urandom(16), self.meta_config,
                           StorageClientConfig(rpc_timeout_ms=2_000), clock=self.meta_clock, wall_ns=self.meta_wall_ns,
                           token=self.token, metrics=metrics, server_id=f"meta-node-{META_NODE_ID + index}".encode())
        await parts.routing.refresh()
        service = parts.service
        runtime = ServiceRuntime(META, parts.dispatcher, metrics, tls=channels.tls)
        bound = await runtime.start("127.0.0.1", 0, 0, self._metrics_port)
        await service.start()
        node_id = META_NODE_ID + index
        config = MetaConfig(node_id=node_id, mgmtd_address=self.mgmtd_address, heartbeat_interval_ms=100)
        heartbeat = asyncio.create_task(heartbeat_loop(config, channels, (bound.framed, bound.grpc, bound.metrics)))
        self.metas[index] = service
        self._meta_parts[index] = (runtime, channels, heartbeat)
        if index == 0 or self.meta is None:
            self.meta = service
        await wait_until(lambda: self._meta_registered(node_id), what=f"meta {node_id} registered")
        return service

    @property
    def _meta_runtime(self) -> ServiceRuntime:
        return self._meta_parts[min(self._meta_parts)][0]

    async def _meta_registered(self, node_id: int = META_NODE_ID) -> bool:
        from fs3 import common_pb2 as cpb

        return any(n.node_type == cpb.NODE_META and n.alive and n.node_id == node_id
                   for n in await self.admin().nodes())

    async def stop_meta_server(self, index: int) -> None:
        """Stop meta server ``index``: it stops heartbeating, serving and running its jobs."""
        runtime, channels, heartbeat = self._meta_parts.pop(index)
        service = self.metas.pop(index)
        heartbeat.cancel()
        with contextlib.suppress(BaseException):
            await heartbeat
        await service.stop()
        runtime.stopping.set()
        await runtime.run_until_stopped()
        await channels.close()
        if self.meta is service:
            self.meta = self.metas[min(self.metas)] if self.metas else None

    async def stop_meta(self) -> None:
        for index in sorted(self.metas):
            await self.stop_meta_server(index)
        self.meta = None

    @property
    def mgmtd_address(self) -> str:
        assert self.mgmtd_runtime is not None
        return self.mgmtd_runtime.bound.grpc if self.transport == "grpc" else self.mgmtd_runtime.bound.framed

    def admin(self) -> AdminClient:
        return AdminClient(self.mgmtd_address, self.channels)

    def client(self, name: bytes = b"c1", **config: int) -> StorageClient:
        routing = RoutingCache([self.mgmtd_address], self.channels)
        return StorageClient(routing, self.channels, name, StorageClientConfig(**config))

    async def _registered(self, admin: AdminClient, expected: int) -> bool:
        return len(await admin.targets()) >= expected

    def replace_disk(self, target_id: int) -> None:
        """The target's disk is swapped for an empty one (its data is gone), as an operator does
        after a disk failure; the node goes on with the new, empty target."""
        import shutil

        from fs3.storage.replica import TargetReplica

        node_id = Topology.node_of(target_id)
        node, config = self.nodes[node_id], self._storage_configs[node_id]
        target = next(t for t in config.targets if t.target_id == target_id)
        node.engines[target_id].close()
        shutil.rmtree(target.path)
        engine = open_engines(StorageConfig(node_id=config.node_id, fsync=config.fsync, targets=[target]))[target_id]
        node.engines[target_id] = engine
        node.replicas[target_id] = TargetReplica(target_id, engine, node, node.config.replica)

    async def all_serving(self) -> bool:
        assert self.mgmtd is not None
        targets = self.mgmtd.state.targets.values()
        if not all(t.public_state is PublicState.SERVING for t in targets if t.info.chain_id):
            return False
        return all(n.routing_version >= self.mgmtd.state.routing_version for n in self.nodes.values())

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_meta()
        for node in self.nodes.values():
            await node.stop()
            await node.channels.close()
            for engine in node.engines.values():
                engine.close()
        for runtime in self.runtimes:
            runtime.stopping.set()
            await runtime.run_until_stopped()
        await self.channels.close()
        if self.mgmtd_runtime is not None and self.mgmtd is not None:
            self.mgmtd_runtime.stopping.set()
            await self.mgmtd_runtime.run_until_stopped(self.mgmtd.stop)


class ClusterThread:
    """An in-process cluster (with meta) on its own event-loop thread, for blocking clients."""

    def __init__(self, root: Path) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="cluster-loop")
        self.thread.start()
        self.cluster = InProcessCluster(root, targets_per_node=2, with_meta=True)
        asyncio.run_coroutine_threadsafe(self.cluster.__aenter__(), self.loop).result(60)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.cluster.__aexit__(None, None, None), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

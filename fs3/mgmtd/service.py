"""The mgmtd service: a thin shell that feeds RPCs and a periodic scan into :class:`MgmtdState`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from prometheus_client import Gauge

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3.common.clock import Clock, LoopClock
from fs3.common.errors import InvalidArgument, Timeout
from fs3.common.metrics import ServiceMetrics, SnapshotCollector
from fs3.kv.store import KVStore
from fs3.mgmtd.metrics import cluster_families
from fs3.mgmtd.state import MgmtdState
from fs3.rpc.dispatch import Buffer
from fs3.rpc.tls import TlsConfig

__all__ = ["MgmtdConfig", "MgmtdServicer"]

log = logging.getLogger(__name__)
_NO_PAYLOAD = b""
# How often the cluster gauges are rebuilt (and at once when the routing changes): a scrape every
# few seconds sees them at most this stale, and a big cluster is not walked on every scan.
_GAUGES_INTERVAL_MS = 1_000


@dataclass
class MgmtdConfig:
    """Settings of one mgmtd process (TOML keys; env ``FS3_MGMTD_<KEY>``)."""

    cluster_id: str = "fs3"
    listen_host: str = "127.0.0.1"
    framed_port: int = 9000
    grpc_port: int = 9001
    metrics_port: int = 9002          # -1: no /metrics endpoint
    data_dir: str = ".fs3/mgmtd"
    kv_engine: str = "rocksdb"
    heartbeat_timeout_ms: int = 10_000
    scan_interval_ms: int = 200
    # The cluster token inline (never printed: not in the repr), or a token file (one token a
    # line, the first presented, all accepted; read again on SIGHUP, so tokens rotate live).
    token: str = field(default="", repr=False)
    token_file: str = ""
    # Trusted-client tokens (mount daemons acting for their callers), one a line; reloaded on SIGHUP.
    trusted_token_file: str = ""
    # Mutual TLS on both transports, incoming and outgoing (the [tls] table; off when empty).
    tls: TlsConfig = field(default_factory=TlsConfig)
    log_level: str = "INFO"

    def validate(self) -> None:
        if self.token and self.token_file:
            raise InvalidArgument("set token or token_file, not both")
        if self.heartbeat_timeout_ms < 100:
            raise InvalidArgument("heartbeat_timeout_ms must be at least 100")
        if not 10 <= self.scan_interval_ms <= self.heartbeat_timeout_ms:
            raise InvalidArgument("scan_interval_ms must be within [10, heartbeat_timeout_ms]")
        if self.kv_engine not in ("rocksdb", "mem"):
            raise InvalidArgument(f"kv_engine {self.kv_engine!r}: expected rocksdb or mem")


class MgmtdServicer:
    """Implements ``fs3.Mgmtd``; all state lives in :class:`MgmtdState`."""

    def __init__(self, kv: KVStore, config: MgmtdConfig, clock: Clock | None = None,
                 metrics: ServiceMetrics | None = None) -> None:
        self.config = config
        self.clock = clock or LoopClock()
        self.state = MgmtdState(kv, config.heartbeat_timeout_ms, config.cluster_id)
        self._scan_task: asyncio.Task[None] | None = None
        self._state_changed = asyncio.Event()
        self._routing_gauge: Gauge | None
        self._alive_gauge: Gauge | None
        # Where mgmtd's own /metrics is served (set once bound): ListNodes tells scrape discovery.
        self.metrics_address = ""
        self._cluster_gauges: SnapshotCollector | None = None
        self._gauges_at: tuple[int, int] = (-_GAUGES_INTERVAL_MS, 0)  # (time, routing version) last published
        if metrics is not None:
            self._routing_gauge = metrics.gauge("fs3_mgmtd_routing_version", "Current routing info version")
            self._alive_gauge = metrics.gauge("fs3_mgmtd_alive_nodes", "Nodes with a recent heartbeat")
            self._cluster_gauges = SnapshotCollector()
            metrics.registry.register(self._cluster_gauges)
        else:
            self._routing_gauge = self._alive_gauge = None

    def start(self) -> None:
        self.state.load(self.clock.now_ms())
        self._scan_task = asyncio.create_task(self._scan_loop())

    async def stop(self) -> None:
        if self._scan_task is not None:
            self._scan_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scan_task
        self.state.kv.close()

    async def _scan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.scan_interval_ms / 1000)
            self.state.scan(self.clock.now_ms())
            self._notify()
            if self._routing_gauge is not None and self._alive_gauge is not None:
                self._routing_gauge.set(self.state.routing_version)
                self._alive_gauge.set(sum(1 for n in self.state.nodes.values() if n.alive))
            self.publish_gauges()

    def publish_gauges(self, force: bool = False) -> None:
        """Rebuild the cluster gauges when a second has passed or the routing changed (``force``: now)."""
        if self._cluster_gauges is None:
            return
        now_ms = self.clock.now_ms()
        at_ms, version = self._gauges_at
        if force or now_ms - at_ms >= _GAUGES_INTERVAL_MS or version != self.state.routing_version:
            self._cluster_gauges.publish(cluster_families(self.state, now_ms))
            self._gauges_at = (now_ms, self.state.routing_version)

    def _notify(self) -> None:
        """Wake the calls waiting for the state to change (a pending fence)."""
        event, self._state_changed = self._state_changed, asyncio.Event()
        event.set()

    # -- RPC handlers ------------------------------------------------------------------------

    async def heartbeat(self, req: mpb.HeartbeatReq, payload: memoryview) -> tuple[mpb.HeartbeatRsp, Buffer]:
        self.state.heartbeat(req, self.clock.now_ms())
        self._notify()
        # Built after the heartbeat was applied: a fence cleared by this very heartbeat is not sent.
        return mpb.HeartbeatRsp(routing_version=self.state.routing_version,
                                heartbeat_timeout_ms=self.config.heartbeat_timeout_ms,
                                fenced_target_ids=self.state.fenced_targets(req.node_id)), _NO_PAYLOAD

    async def get_routing_info(self, req: mpb.GetRoutingInfoReq,
                               payload: memoryview) -> tuple[mpb.GetRoutingInfoRsp, Buffer]:
        if req.known_version and req.known_version == self.state.routing_version:
            return mpb.GetRoutingInfoRsp(changed=False), _NO_PAYLOAD
        return mpb.GetRoutingInfoRsp(changed=True, routing=self.state.routing_info()), _NO_PAYLOAD

    async def list_nodes(self, req: cpb.Empty, payload: memoryview) -> tuple[mpb.ListNodesRsp, Buffer]:
        rsp = mpb.ListNodesRsp(mgmtd_metrics_address=self.metrics_address)
        for record in sorted(self.state.nodes.values(), key=lambda r: r.info.node_id):
            node = rsp.nodes.add()
            node.CopyFrom(record.info)
            node.alive = record.alive
            node.last_heartbeat_ms = record.last_heartbeat_ms
        return rsp, _NO_PAYLOAD

    async def list_targets(self, req: cpb.Empty, payload: memoryview) -> tuple[mpb.ListTargetsRsp, Buffer]:
        rsp = mpb.ListTargetsRsp()
        for tid in sorted(self.state.targets):
            rsp.targets.add().CopyFrom(self.state.targets[tid].info)
        return rsp, _NO_PAYLOAD

    async def list_chains(self, req: cpb.Empty, payload: memoryview) -> tuple[mpb.ListChainsRsp, Buffer]:
        routing = self.state.routing_info()
        rsp = mpb.ListChainsRsp(chains=routing.chains, chain_tables=routing.chain_tables)
        for tid in sorted(self.state.targets):
            rsp.targets.add().CopyFrom(self.state.targets[tid].info)
        return rsp, _NO_PAYLOAD

    async def create_chain_table(self, req: mpb.CreateChainTableReq,
                                 payload: memoryview) -> tuple[mpb.CreateChainTableRsp, Buffer]:
        return self.state.create_chain_table(req), _NO_PAYLOAD

    async def mark_target_offline(self, req: mpb.MarkTargetOfflineReq,
                                  payload: memoryview) -> tuple[mpb.MarkTargetOfflineRsp, Buffer]:
        """Take a target out of its chain and return once it is out (see ``MgmtdState.mark_target_offline``).

        A fenced target is out once its node has reported it offline, which takes about one
        heartbeat interval; a node that dies meanwhile is expired within the heartbeat timeout and
        a scan interval. A node that keeps heartbeating without confirming (it should not exist)
        gets TIMEOUT: the fence stays pending and mgmtd never takes the target out behind its back.
        """
        done = self.state.mark_target_offline(req.target_id, self.clock.now_ms())
        fenced = not done
        if fenced:
            self._notify()
            wait_ms = self.config.heartbeat_timeout_ms + 2 * self.config.scan_interval_ms
            deadline_ms = self.clock.now_ms() + wait_ms
            while self.state.fence_pending(req.target_id):
                remaining_ms = deadline_ms - self.clock.now_ms()
                if remaining_ms <= 0:
                    node_id = self.state.targets[req.target_id].info.node_id
                    raise Timeout(f"target {req.target_id} is fenced but node {node_id} has not reported it "
                                  f"offline within {wait_ms} ms; the fence stays: the target leaves its chain "
                                  f"once the node reports it offline or misses heartbeats")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._state_changed.wait(), remaining_ms / 1000)
        target = self.state.targets[req.target_id]
        return mpb.MarkTargetOfflineRsp(routing_version=self.state.routing_version,
                                        public_state=target.info.public_state or cpb.OFFLINE,
                                        fenced=fenced), _NO_PAYLOAD

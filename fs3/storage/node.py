"""The storage node: the shell around a node's target replicas.

It owns what a replica must not: the routing information pulled from mgmtd, heartbeats and the
lease they renew, the network to chain peers, the rule that a restarted node stays silent until
mgmtd has marked its targets offline, and the resync of a syncing successor. The same class runs
in a real process (:mod:`fs3.storage.server`) and in the simulator, which injects the clock's
loop, the channels and in-memory chunk engines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3 import storage_pb2 as spb
from fs3.client.mgmtd import MgmtdCaller
from fs3.common.clock import Clock, LoopClock
from fs3.common.errors import FS3Error, InvalidArgument, IoError, NotFound, StatusCode, TargetNotServing
from fs3.common.metrics import ServiceMetrics
from fs3.common.retry import Attempts, Backoff, RetryPolicy
from fs3.common.target_state import LocalState, PublicState
from fs3.common.tasks import finish_despite_cancel
from fs3.kv.store import RocksKVStore
from fs3.rpc.channel import ChannelFactory
from fs3.rpc.dispatch import Buffer
from fs3.rpc.methods import service_spec
from fs3.rpc.storage_calls import dump_chunk_meta
from fs3.rpc.versions import stamp_heartbeat
from fs3.storage.chain_view import ChainMember, ChainView
from fs3.storage.chunk_engine import ChunkEngine
from fs3.storage.replica import ReplicaConfig, TargetReplica
from fs3.storage.resync import ResyncPacer, resync_successor
from fs3.storage.scrub import ScrubConfig
from fs3.storage.scrubber import ScrubMetrics, TargetScrubber

__all__ = ["StorageNode", "StorageNodeConfig"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_STORAGE = service_spec("Storage")
_LOCAL_TO_PB = {LocalState.UP_TO_DATE: cpb.UP_TO_DATE, LocalState.ONLINE: cpb.ONLINE,
                LocalState.OFFLINE: cpb.LOCAL_OFFLINE}


@dataclass
class StorageNodeConfig:
    node_id: int
    mgmtd_address: str  # one mgmtd, or several comma-separated (the node follows their primary)
    framed_address: str = ""
    grpc_address: str = ""
    metrics_address: str = ""
    heartbeat_interval_ms: int = 1_000
    rpc_timeout_ms: int = 5_000
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    sync_batch_chunks: int = 256
    # Bytes per second this node's resyncs copy at (0: unlimited); mgmtd's rate (set by
    # `fs3 admin rebalance --rate`, sent with every heartbeat) overrides it while it is set.
    resync_rate_bytes_per_s: int = 0
    io_threads: int = 0  # 0: file I/O runs on the event loop (the simulator); services use a pool
    # How often expired exactly-once records are dropped (see ReplicaConfig.channel_record_ttl_ms).
    channel_expiry_interval_ms: int = 60_000
    # How often each target's RocksDB gets its upkeep (reclaiming space, reopening after ENOSPC).
    maintenance_interval_ms: int = 1_000
    # How far past its expiry a client's data-path capability is still accepted: the clocks of
    # meta (which stamps the expiry) and of this node may differ by this much.
    capability_skew_ms: int = 30_000
    # The background scrubber of every target (off unless a rate is set; docs/operations.md, "Scrubbing").
    scrub: ScrubConfig = field(default_factory=ScrubConfig)

    @property
    def heartbeat_retry(self) -> RetryPolicy:
        """Heartbeats go out every interval, a failed one included: the next one is its retry, and
        never waits longer (mgmtd's lease counts from the last heartbeat that arrived)."""
        return RetryPolicy(backoff_base_ms=self.heartbeat_interval_ms, backoff_max_ms=self.heartbeat_interval_ms,
                           backoff=Backoff.CONSTANT)


# A failed resync of a successor is retried, forever while it is wanted, doubling its wait: the
# chain's routing views converge within a few heartbeats.
RESYNC_RETRY = RetryPolicy(backoff_base_ms=100, backoff_max_ms=2_000, backoff=Backoff.EXPONENTIAL)


# Starts blocking I/O somewhere (a thread pool, or the simulator's model of one); the future
# completes when it has finished.
IoSubmitter = Callable[[Callable[[], Any]], "asyncio.Future[Any]"]


class StorageNode:
    """One storage node hosting several targets."""

    def __init__(self, config: StorageNodeConfig, engines: dict[int, ChunkEngine], channels: ChannelFactory,
                 clock: Clock | None = None, io_submitter: IoSubmitter | None = None,
                 metrics: ServiceMetrics | None = None) -> None:
        """``metrics``: where the node's resync gauges go (None: not kept, as in the simulator)."""
        if not engines:
            raise InvalidArgument("a storage node needs at least one target")
        self.config = config
        self.channels = channels
        self.mgmtd = MgmtdCaller(config.mgmtd_address, channels, config.rpc_timeout_ms)
        self.clock = clock or LoopClock()
        self.engines = engines
        self.replicas = {tid: TargetReplica(tid, engine, self, config.replica) for tid, engine in engines.items()}
        self.routing: cpb.RoutingInfo | None = None
        self.local_states: dict[int, LocalState] = {}
        self.failed_targets: set[int] = set()
        # Targets mgmtd fenced (admin mark-offline): out of service here until mgmtd has taken
        # them out of their chains; the value is the routing version the fence was learnt at.
        self.fenced_targets: dict[int, int] = {}
        # Failed targets whose store ran out of space: they come back (and resync) once it is back.
        self.out_of_space_targets: set[int] = set()
        self._silent_until_offline = True
        self._lease_start_ms: int | None = None
        self._routing_event = asyncio.Event()
        self._refresh_requested = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._sync_tasks: dict[tuple[int, int, int], asyncio.Task[None]] = {}
        self.resync_pacer = ResyncPacer(config.resync_rate_bytes_per_s)
        self._views: dict[tuple[int, int], ChainView] = {}
        self._chain_of_target: dict[int, int] = {}
        self._nodes: dict[int, cpb.NodeInfo] = {}
        self._io_pool = (concurrent.futures.ThreadPoolExecutor(config.io_threads, thread_name_prefix="fs3-io")
                         if config.io_threads > 0 else None)
        self._io_submitter = io_submitter
        self._resync_remaining: Gauge | None = None
        self._resync_sent: Counter | None = None
        if metrics is not None:
            self._resync_remaining = metrics.gauge(
                "fs3_storage_resync_remaining_chunks", "Chunks a running resync has still to compare, by successor",
                ("chain_id", "target_id"))
            self._resync_sent = metrics.counter(
                "fs3_storage_resync_sent_chunks", "Chunks resyncs copied to (or removed from) a successor")
        config.scrub.validate()
        scrub_metrics = ScrubMetrics(metrics) if metrics is not None else None
        self.scrubbers = {tid: TargetScrubber(self, tid, config.scrub, metrics=scrub_metrics) for tid in engines}

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._routing_loop(), name=f"routing-{self.config.node_id}"))
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat-{self.config.node_id}"))
        self._tasks.append(asyncio.create_task(self._expiry_loop(), name=f"channel-expiry-{self.config.node_id}"))
        if self.config.scrub.enabled:
            for tid, scrubber in self.scrubbers.items():
                self._tasks.append(asyncio.create_task(scrubber.run(), name=f"scrub-{tid}"))
        if any(isinstance(engine.kv, RocksKVStore) for engine in self.engines.values()):
            self._tasks.append(asyncio.create_task(self._maintenance_loop(),
                                                   name=f"maintenance-{self.config.node_id}"))

    async def stop(self) -> None:
        for replica in self.replicas.values():
            await replica.stop()
        tasks = self._tasks + list(self._sync_tasks.values())
        self._tasks, self._sync_tasks = [], {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=True)

    # -- routing -----------------------------------------------------------------------------

    @property
    def routing_version(self) -> int:
        return self.routing.routing_version if self.routing else 0

    async def _fetch_routing(self) -> None:
        rsp = await self.mgmtd.call("GetRoutingInfo", mpb.GetRoutingInfoReq(known_version=self.routing_version))
        assert isinstance(rsp, mpb.GetRoutingInfoRsp)
        if rsp.changed and rsp.routing.routing_version >= self.routing_version:
            self._apply_routing(rsp.routing)

    def _apply_routing(self, routing: cpb.RoutingInfo) -> None:
        before = {tid: self._my_public_state(tid) for tid in self.engines}
        self.routing = routing
        self._views.clear()
        self._nodes = {n.node_id: n for n in routing.nodes}
        self._chain_of_target = {t.target_id: t.chain_id for t in routing.targets if t.target_id in self.engines}
        states = {t.target_id: PublicState(t.public_state or PublicState.OFFLINE) for t in routing.targets}
        self._fence([t.target_id for t in routing.targets if t.fenced], routing.routing_version)
        self._lift_fences()
        if self._silent_until_offline:
            in_chain = [tid for tid in self.engines if self._chain_of_target.get(tid)]
            if all(states.get(tid) in (PublicState.OFFLINE, PublicState.LASTSRV) for tid in in_chain):
                self._silent_until_offline = False
                for tid in self.engines:
                    self.local_states[tid] = LocalState.ONLINE if self._chain_of_target.get(tid) \
                        else LocalState.UP_TO_DATE
                log.info("node %d: targets ready to report (%s)", self.config.node_id,
                         ", ".join(f"{t}:{s.name.lower()}" for t, s in self.local_states.items()))
        if not self._silent_until_offline:
            for tid in self.engines:
                public = states.get(tid)
                local = self.local_states.get(tid, LocalState.ONLINE)
                if self._out_of_service(tid):
                    local = LocalState.OFFLINE
                elif public is PublicState.SERVING:
                    local = LocalState.UP_TO_DATE
                elif public in (PublicState.OFFLINE, PublicState.LASTSRV, PublicState.WAITING) \
                        and local is LocalState.UP_TO_DATE and self._chain_of_target.get(tid):
                    log.warning("node %d: target %d is %s: it will resync before serving again",
                                self.config.node_id, tid, public.name.lower())
                    local = LocalState.ONLINE
                self.local_states[tid] = local
        self._forget_channels_before_resync(before)
        self._schedule_resyncs()
        if not self._silent_until_offline:
            for tid, chain_id in self._chain_of_target.items():
                if chain_id and not self._out_of_service(tid):
                    self.replicas[tid].repair_abandoned(chain_id)
        event, self._routing_event = self._routing_event, asyncio.Event()
        event.set()

    def _my_public_state(self, target_id: int) -> PublicState | None:
        """A local target's public state in the routing this node holds (None: not in a chain)."""
        chain_id = self._chain_of_target.get(target_id)
        if not chain_id or self.routing is None:
            return None
        view = self.view(chain_id, target_id)
        return view.my_state if view is not None else None

    def _forget_channels_before_resync(self, before: dict[int, PublicState | None]) -> None:
        """A target about to be resynced drops its exactly-once records first: they may describe
        writes its chain rolled back while it was away, and must not answer a retry once it is
        head. Its predecessor hands over the chain's records as the resync starts (and every write
        from then on reaches it), so nothing it needs is lost. A lastsrv target coming back serves
        again without a resync and keeps its records."""
        for tid in self.engines:
            now, was = self._my_public_state(tid), before.get(tid)
            # A syncing target that falls back to waiting lost its sync source: every serving
            # target failed, and the lastsrv one that serves again may lack writes this target
            # already installed (and recorded) — they are rolled back by the next resync, and a
            # record of one would answer its retry once this target is head.
            if (now is PublicState.WAITING and was is not PublicState.WAITING) or \
                    (now is PublicState.SYNCING and was not in (PublicState.WAITING, PublicState.SYNCING)):
                log.info("node %d: target %d will be resynced; dropping its exactly-once records",
                         self.config.node_id, tid)
                self.replicas[tid].forget_channels()

    def update_finished(self, target_id: int, error: BaseException | None) -> None:
        """A replica's update or forward ended. A disk error fails the target: it reports itself
        offline and mgmtd takes it out of its chain. The last one to end may lift a fence."""
        if isinstance(error, IoError):
            self.fail_target(target_id, error)
        if target_id in self.fenced_targets and not self.replicas[target_id].updates_running:
            self._lift_fences()

    def _out_of_service(self, target_id: int) -> bool:
        """A failed or fenced target: its own view shows it offline and it reports itself offline."""
        return target_id in self.failed_targets or target_id in self.fenced_targets

    def _fence(self, target_ids: list[int], routing_version: int) -> None:
        """Stop serving ``target_ids`` now and tell mgmtd at once, so that it can change their chains.

        From here on the target's own view shows it offline, so it refuses new reads, writes,
        forwards and commit queries, and writes in progress fail at their next step; mgmtd
        publishes a chain without it only after our next heartbeat says so. That order is what
        keeps a removed target from serving a read older than a write the chain without it has
        acknowledged.
        """
        new = [tid for tid in target_ids if tid in self.engines and tid not in self.fenced_targets]
        if not new:
            return
        for tid in new:
            self.fenced_targets[tid] = routing_version
            self.local_states[tid] = LocalState.OFFLINE
        log.warning("node %d: mgmtd fenced target(s) %s: no longer serving them", self.config.node_id,
                    ", ".join(map(str, new)))
        self._views.clear()
        self._schedule_resyncs()  # a fenced target must not keep resyncing a successor either
        if not self._silent_until_offline:  # a restarted node speaks only once mgmtd has seen it go
            self._tasks.append(asyncio.create_task(self._heartbeat_soon()))

    def _lift_fences(self) -> None:
        """End the fences that are over, in the routing we hold.

        A fence ends once mgmtd shows the target off the write path and no longer fenced, in a
        routing newer than the one the fence was learnt with (an older one may predate it), and
        once every update and forward the target admitted has finished: those fail while it is
        fenced, whereas one still in flight when it re-enters its chain as syncing could commit
        and answer as if it still held its old place. The target then comes back the way a
        restarted one does: online, waiting, syncing, serving.
        """
        routing = self.routing
        if routing is None or not self.fenced_targets:
            return
        infos = {t.target_id: t for t in routing.targets if t.target_id in self.fenced_targets}
        lifted = []
        for tid, since in list(self.fenced_targets.items()):
            info = infos.get(tid)
            state = PublicState(info.public_state or PublicState.OFFLINE) if info else PublicState.OFFLINE
            if routing.routing_version > since and not state.writable and not (info and info.fenced) \
                    and not self.replicas[tid].updates_running:
                del self.fenced_targets[tid]
                self.local_states[tid] = LocalState.ONLINE
                lifted.append(tid)
                log.info("node %d: target %d is %s in its chain: fence lifted, it resyncs before serving",
                         self.config.node_id, tid, state.name.lower())
        if lifted:
            self._views.clear()

    def _log_mgmtd_failure(self, what: str, exc: FS3Error, refused: bool) -> bool:
        """Log a failed call to mgmtd; a refused credential (token, certificate) will not heal by
        itself, so the first refusal in a row is a warning and the rest debug. Returns whether
        the calls are being refused."""
        # A protocol refusal (mgmtd cannot talk to this release) will not heal by itself either.
        unauthenticated = exc.code in (StatusCode.UNAUTHENTICATED, StatusCode.PROTOCOL_ERROR)
        log.log(logging.WARNING if unauthenticated and not refused else logging.DEBUG, "node %d: %s failed: %s",
                self.config.node_id, what, exc)
        return unauthenticated

    async def _routing_loop(self) -> None:
        refused = False
        while True:
            try:
                await self._fetch_routing()
                refused = False
            except FS3Error as exc:
                refused = self._log_mgmtd_failure("routing refresh", exc, refused)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._refresh_requested.wait(), self.config.heartbeat_interval_ms / 1000)
            self._refresh_requested.clear()

    def request_routing_refresh(self) -> None:
        self._refresh_requested.set()

    async def wait_routing_change(self, known_routing_version: int, timeout_ms: int) -> None:
        if self.routing_version > known_routing_version:
            return
        self.request_routing_refresh()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._routing_event.wait(), timeout_ms / 1000)

    def view(self, chain_id: int, target_id: int) -> ChainView | None:
        key = (chain_id, target_id)
        cached = self._views.get(key)
        if cached is not None:
            return cached
        if self.routing is None:
            return None
        chain = next((c for c in self.routing.chains if c.chain_id == chain_id), None)
        if chain is None:
            return None
        targets = {t.target_id: t for t in self.routing.targets}
        members = []
        for tid in chain.target_ids:
            info = targets.get(tid)
            if info is None:
                continue
            node = self._nodes.get(info.node_id)
            address = self.channels.node_address(node.framed_address, node.grpc_address) if node else ""
            members.append(ChainMember(tid, info.node_id, PublicState(info.public_state or PublicState.OFFLINE),
                                       address))
        view = ChainView(chain_id, chain.chain_version, self.routing.routing_version, target_id, tuple(members))
        if self._silent_until_offline or self._out_of_service(target_id):
            # Until mgmtd has seen this node restart, its targets must not act on the old chain.
            view = ChainView(chain_id, chain.chain_version, self.routing.routing_version, target_id,
                             tuple(ChainMember(m.target_id, m.node_id, PublicState.OFFLINE, m.address)
                                   if m.target_id == target_id else m for m in members))
        self._views[key] = view
        return view

    # -- heartbeats and lease ----------------------------------------------------------------

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def lease_valid(self) -> bool:
        if self._lease_start_ms is None or self.routing is None:
            return False
        return self.now_ms() - self._lease_start_ms < self.routing.heartbeat_timeout_ms // 2

    def _heartbeat_req(self) -> mpb.HeartbeatReq:
        req = mpb.HeartbeatReq(
            node_id=self.config.node_id, node_type=cpb.NODE_STORAGE, framed_address=self.config.framed_address,
            grpc_address=self.config.grpc_address, hostname=socket.gethostname(), pid=os.getpid(),
            metrics_address=self.config.metrics_address,
        )
        stamp_heartbeat(req)
        for tid, engine in self.engines.items():
            local = LocalState.OFFLINE if self._out_of_service(tid) else self.local_states.get(tid, LocalState.ONLINE)
            try:
                free = engine.files.free_bytes()
                capacity = engine.files.capacity_bytes()
            except OSError:
                free = capacity = 0
            req.targets.add(target_id=tid, local_state=_LOCAL_TO_PB[local], capacity_bytes=capacity,
                            used_bytes=engine.used_bytes, free_bytes=free, chunk_count=engine.chunk_count,
                            path=getattr(engine.files, "root", "") and str(getattr(engine.files, "root", "")))
        return req

    async def heartbeat_once(self) -> None:
        sent_ms = self.now_ms()
        # A lost heartbeat must not hold up the next one: wait at most two intervals for it (per
        # mgmtd instance: with several, a dead one's silence moves the heartbeat to the next).
        timeout_ms = min(self.config.rpc_timeout_ms, 2 * self.config.heartbeat_interval_ms)
        rsp = await self.mgmtd.call("Heartbeat", self._heartbeat_req(), timeout_ms=timeout_ms)
        assert isinstance(rsp, mpb.HeartbeatRsp)
        self.resync_pacer.rate_bytes_per_s = rsp.resync_rate_bytes_per_s or self.config.resync_rate_bytes_per_s
        if rsp.fenced_target_ids and rsp.routing_version >= self.routing_version:
            # An older response may predate the fence's end; the routing we hold then says more.
            self._fence(list(rsp.fenced_target_ids), rsp.routing_version)
        if rsp.routing_version > self.routing_version:
            # The lease only renews on a current view of the chains: a node back from a partition
            # must learn that it was taken out of its chains before it serves anything again.
            await self._fetch_routing()
            if rsp.routing_version > self.routing_version:
                return
        self._lease_start_ms = sent_ms

    async def _heartbeat_loop(self) -> None:
        beats = Attempts(self.config.heartbeat_retry)
        refused = False
        while True:
            if not self._silent_until_offline:
                try:
                    await self.heartbeat_once()
                    refused = False
                except FS3Error as exc:
                    refused = self._log_mgmtd_failure("heartbeat", exc, refused)
            await beats.backoff()

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking file I/O on the pool. Never returns before ``fn`` has finished, even if the
        caller is cancelled meanwhile: the caller holds a chunk lock over the I/O, and releasing it
        while a thread still writes would let the next writer interleave with it."""
        if self._io_submitter is not None:
            future: asyncio.Future[T] = self._io_submitter(lambda: fn(*args))
        elif self._io_pool is not None:
            future = asyncio.get_running_loop().run_in_executor(self._io_pool, fn, *args)
        else:
            return fn(*args)
        return await finish_despite_cancel(future)

    async def _expiry_loop(self) -> None:
        """Drop exactly-once records older than any retry can be (bounded work per pass)."""
        while True:
            await asyncio.sleep(self.config.channel_expiry_interval_ms / 1000)
            for replica in self.replicas.values():
                while replica.expire_channels() > 0:
                    await asyncio.sleep(0)

    # -- failed targets and disk upkeep ------------------------------------------------------

    def fail_target(self, target_id: int, exc: FS3Error) -> None:
        """A target whose disk failed an operation reports itself offline; mgmtd takes it out of its
        chain. Out of space, the failure lasts until the space is back (:meth:`_maintenance_loop`
        then brings it back through a resync); any other disk error lasts until the process restarts.
        """
        kv = self.engines[target_id].kv
        if isinstance(kv, RocksKVStore) and kv.space_error is not None:
            if target_id not in self.out_of_space_targets:
                log.warning("node %d: target %d ran out of space with writes of uncertain outcome; it is "
                            "offline until space is back: %s", self.config.node_id, target_id, exc)
            self.out_of_space_targets.add(target_id)
        elif target_id not in self.failed_targets or target_id in self.out_of_space_targets:
            log.error("node %d: target %d: disk error, reporting the target offline: %s", self.config.node_id,
                      target_id, exc)
            self.out_of_space_targets.discard(target_id)
        self.failed_targets.add(target_id)
        self._views.clear()
        self.request_routing_refresh()

    async def _maintenance_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.maintenance_interval_ms / 1000)
            for tid, engine in self.engines.items():
                kv = engine.kv
                if not isinstance(kv, RocksKVStore):
                    continue
                try:
                    await self.run_blocking(kv.maintain, 2 * engine.reserve_bytes)
                except OSError as exc:  # the disk is gone (unmounted): its I/O errors tell the rest
                    log.warning("node %d: upkeep of target %d failed: %s", self.config.node_id, tid, exc)
                    continue
                except Exception:
                    log.exception("node %d: upkeep of target %d failed", self.config.node_id, tid)
                    continue
                if tid in self.out_of_space_targets and kv.space_error is None:
                    self._space_back(tid)

    def _space_back(self, target_id: int) -> None:
        """An out-of-space target whose store accepts writes again rejoins its chain as a syncing
        target: the predecessor's resync replaces whatever the failure left uncertain."""
        log.info("node %d: target %d has space again; it rejoins its chain after a resync", self.config.node_id,
                 target_id)
        self.out_of_space_targets.discard(target_id)
        self.failed_targets.discard(target_id)
        self.local_states[target_id] = LocalState.ONLINE
        self._views.clear()
        self.request_routing_refresh()
        self._tasks.append(asyncio.create_task(self._heartbeat_soon()))

    # -- peers -------------------------------------------------------------------------------

    async def forward(self, member: ChainMember, req: spb.ForwardReq, payload: Buffer,
                      timeout_ms: int) -> spb.UpdateRsp:
        rsp, _ = await self.channels.get(member.address).call(_STORAGE.method("Forward"), req, payload, timeout_ms)
        assert isinstance(rsp, spb.UpdateRsp)
        return rsp

    async def query_committed(self, member: ChainMember, req: spb.QueryCommittedReq,
                              timeout_ms: int) -> spb.QueryCommittedRsp:
        rsp, _ = await self.channels.get(member.address).call(_STORAGE.method("QueryCommitted"), req,
                                                               timeout_ms=timeout_ms)
        assert isinstance(rsp, spb.QueryCommittedRsp)
        return rsp

    async def dump_chunk_meta(self, member: ChainMember, chain_id: int, batch: int,
                              timeout_ms: int) -> dict[bytes, spb.ChunkMeta]:
        return await dump_chunk_meta(self.channels.get(member.address), chain_id, member.target_id, batch,
                                     timeout_ms)

    async def send_sync_channels(self, member: ChainMember, req: spb.SyncChannelsReq, timeout_ms: int) -> None:
        await self.channels.get(member.address).call(_STORAGE.method("SyncChannels"), req, timeout_ms=timeout_ms)

    async def send_sync_done(self, member: ChainMember, req: spb.SyncDoneReq, timeout_ms: int) -> None:
        await self.channels.get(member.address).call(_STORAGE.method("SyncDone"), req, timeout_ms=timeout_ms)

    # -- resync ------------------------------------------------------------------------------

    def _schedule_resyncs(self) -> None:
        wanted: set[tuple[int, int, int]] = set()
        for tid, chain_id in self._chain_of_target.items():
            view = self.view(chain_id, tid)
            if view is None or view.my_state is not PublicState.SERVING:
                continue
            successor = view.successor()
            if successor is not None and successor.state is PublicState.SYNCING:
                wanted.add((chain_id, successor.target_id, view.chain_version))
        for key in list(self._sync_tasks):
            if key not in wanted:
                self._sync_tasks.pop(key).cancel()
        for key in wanted:
            task = self._sync_tasks.get(key)
            if task is None or task.done():
                chain_id, successor_id, _ = key
                my_target = next(t for t, c in self._chain_of_target.items() if c == chain_id)
                self._sync_tasks[key] = asyncio.create_task(self._run_resync(chain_id, my_target, successor_id))

    async def _run_resync(self, chain_id: int, target_id: int, successor_id: int) -> None:
        attempts = Attempts(RESYNC_RETRY)
        while True:
            try:
                await resync_successor(self, self.replicas[target_id], chain_id, successor_id,
                                       self.config.sync_batch_chunks, self.config.rpc_timeout_ms,
                                       self._resync_progress(chain_id, successor_id), self.resync_pacer.spend)
                return
            except FS3Error as exc:
                # Routing views converge a moment apart; only unexpected failures deserve a warning.
                expected = exc.code in (StatusCode.TARGET_NOT_SERVING, StatusCode.CHAIN_VERSION_MISMATCH)
                log.log(logging.INFO if expected else logging.WARNING,
                        "node %d: resync of target %d (chain %d) failed: %s; retrying", self.config.node_id,
                        successor_id, chain_id, exc)
            await attempts.backoff()

    def _resync_progress(self, chain_id: int, successor_id: int) -> Callable[[int, int], None] | None:
        """The progress callback of one resync attempt: sets its remaining-chunks gauge and counts sends."""
        remaining_gauge, sent_counter = self._resync_remaining, self._resync_sent
        if remaining_gauge is None or sent_counter is None:
            return None
        gauge = remaining_gauge.labels(str(chain_id), str(successor_id))
        counted = 0

        def progress(remaining: int, sent: int) -> None:
            nonlocal counted
            gauge.set(remaining)
            sent_counter.inc(sent - counted)
            counted = sent

        return progress

    # -- RPC handlers (Storage service) ------------------------------------------------------

    def chain_of(self, target_id: int) -> int:
        """The chain a local target belongs to (0: none yet)."""
        return self._chain_of_target.get(target_id, 0)

    def resyncing(self, chain_id: int) -> bool:
        """Whether this node is bringing a syncing successor in ``chain_id`` up to date."""
        return any(key[0] == chain_id and not task.done() for key, task in self._sync_tasks.items())

    def replica_for_chain(self, chain_id: int) -> TargetReplica:
        for tid, cid in self._chain_of_target.items():
            if cid == chain_id:
                return self.replicas[tid]
        if self.routing is None or not any(c.chain_id == chain_id for c in self.routing.chains):
            # The client knows a chain this node does not (yet): our routing may lag behind.
            self.request_routing_refresh()
            raise TargetNotServing(f"chain {chain_id} is unknown on node {self.config.node_id} "
                                   f"(routing v{self.routing_version})")
        raise TargetNotServing(f"node {self.config.node_id} has no target in chain {chain_id}")

    def scrub_status(self) -> spb.ScrubStatusRsp:
        """Every local target's scrubber: its pass, counters and recent findings."""
        rsp = spb.ScrubStatusRsp()
        rsp.targets.extend(self.scrubbers[tid].status() for tid in sorted(self.scrubbers))
        return rsp

    def replica_for_target(self, target_id: int, chain_id: int) -> TargetReplica:
        if target_id:
            replica = self.replicas.get(target_id)
            if replica is None:
                raise NotFound(f"target {target_id} is not on node {self.config.node_id}")
            return replica
        return self.replica_for_chain(chain_id)

    def sync_done(self, req: spb.SyncDoneReq) -> None:
        replica = self.replica_for_target(req.target_id, req.chain_id)
        view = self.view(req.chain_id, replica.target_id)
        if view is None or view.my_state is not PublicState.SYNCING:
            raise TargetNotServing(f"target {replica.target_id} is not syncing")
        if req.chain_version != view.chain_version:
            from fs3.common.errors import ChainVersionMismatch

            raise ChainVersionMismatch(f"sync done for chain v{req.chain_version}, target is at v{view.chain_version}")
        log.info("node %d: target %d is up to date", self.config.node_id, replica.target_id)
        self.local_states[replica.target_id] = LocalState.UP_TO_DATE
        self._tasks.append(asyncio.create_task(self._heartbeat_soon()))

    def sync_channels(self, req: spb.SyncChannelsReq) -> int:
        return self.replica_for_target(req.target_id, req.chain_id).sync_channels(req)

    async def _heartbeat_soon(self) -> None:
        with contextlib.suppress(FS3Error):
            await self.heartbeat_once()

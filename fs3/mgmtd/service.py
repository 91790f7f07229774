"""The mgmtd service: a thin shell that feeds RPCs and a periodic scan into :class:`MgmtdState`.

Alone (a local :class:`~fs3.kv.store.KVStore`) it is always the primary. On a shared engine
(:class:`~fs3.mgmtd.ha.SharedEngine`) several instances run and one holds the primary lease: the
primary loads the state from the engine when it takes the lease and writes every change in a
transaction fenced by its epoch before it answers; a standby answers routing reads from what the
primary published and refuses everything else with :class:`~fs3.common.errors.NotPrimary`,
naming the primary. Calls that act on the state are serialized (:meth:`MgmtdServicer._as_primary`)
so nothing is answered from a change that is not in the database yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from prometheus_client import Gauge

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3.common.clock import Clock, LoopClock
from fs3.common.errors import FS3Error, InvalidArgument, NotPrimary, Timeout
from fs3.common.metrics import ServiceMetrics, SnapshotCollector
from fs3.kv.store import KVStore
from fs3.mgmtd.ha import (
    ROUTING_KEY,
    LeaseLoop,
    SharedEngine,
    read_published_routing,
    read_state_records,
    release_lease,
    write_fenced,
)
from fs3.mgmtd.lease import LeaseConfig
from fs3.mgmtd.metrics import cluster_families
from fs3.mgmtd.presence import PRIMARY, STALE, STANDBY
from fs3.mgmtd.state import MgmtdState
from fs3.rpc.dispatch import Buffer
from fs3.rpc.tls import TlsConfig
from fs3.rpc.versions import RELEASE, VersionRange, advertised_range, negotiate, range_from_wire

__all__ = ["MgmtdConfig", "MgmtdServicer", "check_node_protocol"]

log = logging.getLogger(__name__)
_NO_PAYLOAD = b""
# How often the cluster gauges are rebuilt (and at once when the routing changes): a scrape every
# few seconds sees them at most this stale, and a big cluster is not walked on every scan.
_GAUGES_INTERVAL_MS = 1_000
_ROLES = {PRIMARY: mpb.MGMTD_ROLE_PRIMARY, STANDBY: mpb.MGMTD_ROLE_STANDBY, STALE: mpb.MGMTD_ROLE_STALE}


@dataclass
class MgmtdConfig:
    """Settings of one mgmtd process (TOML keys; env ``FS3_MGMTD_<KEY>``)."""

    cluster_id: str = "fs3"
    listen_host: str = "127.0.0.1"
    framed_port: int = 9000
    grpc_port: int = 9001
    metrics_port: int = 9002          # -1: no /metrics endpoint
    data_dir: str = ".fs3/mgmtd"
    # rocksdb or mem: a single mgmtd on a local store. postgres: one of several mgmtd instances on
    # the database at pg_url, one of them primary (see fs3.mgmtd.ha and docs/operations.md).
    kv_engine: str = "rocksdb"
    pg_url: str = field(default="", repr=False)  # may carry a password: not in the repr
    # With a shared engine: this instance's name (unique among the cluster's mgmtd instances;
    # empty: host:framed port) and the address standbys name in their redirects (empty: the
    # framed address it binds), and the lease timing (see fs3.mgmtd.lease).
    instance_name: str = ""
    advertise_address: str = ""
    lease_ms: int = 3_000
    lease_renew_interval_ms: int = 500
    lease_drift_margin_ms: int = 300
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
    # A store of an older format is migrated when mgmtd starts (fs3.mgmtd.formats); off: the start
    # is refused, and `fs3 admin upgrade --config` migrates it offline (docs/operations.md "Upgrading").
    upgrade_on_start: bool = True
    # Speak at most this protocol (fs3/rpc/versions.py; 0: this release's newest), as
    # $FS3_PROTOCOL_VERSION_MAX: the pin of a rolling upgrade (docs/operations.md "Rolling upgrade").
    protocol_version_max: int = 0
    log_level: str = "INFO"

    def validate(self) -> None:
        if self.token and self.token_file:
            raise InvalidArgument("set token or token_file, not both")
        if self.heartbeat_timeout_ms < 100:
            raise InvalidArgument("heartbeat_timeout_ms must be at least 100")
        if not 10 <= self.scan_interval_ms <= self.heartbeat_timeout_ms:
            raise InvalidArgument("scan_interval_ms must be within [10, heartbeat_timeout_ms]")
        if self.kv_engine not in ("rocksdb", "mem", "postgres"):
            raise InvalidArgument(f"kv_engine {self.kv_engine!r}: expected rocksdb, mem or postgres")
        if self.kv_engine == "postgres":
            self._validate_shared()

    def _validate_shared(self) -> None:
        """The settings that matter only with several mgmtd on a shared database."""
        if not self.pg_url:
            raise InvalidArgument("kv_engine postgres needs pg_url (--pg-url)")
        self.lease_config().validate()
        if self.heartbeat_timeout_ms < 2 * (self.lease_ms + self.lease_renew_interval_ms):
            # Storage nodes stop serving half a heartbeat timeout after their last answered
            # heartbeat: a takeover (up to a lease and a renewal) must fit in that half.
            raise InvalidArgument("with several mgmtd, heartbeat_timeout_ms must be at least 2 * (lease_ms + "
                                  "lease_renew_interval_ms), so that storage keeps serving through a takeover")
        if self.lease_ms < 2 * self.scan_interval_ms:
            raise InvalidArgument("lease_ms must be at least twice scan_interval_ms")

    def lease_config(self) -> LeaseConfig:
        return LeaseConfig(lease_ms=self.lease_ms, renew_interval_ms=self.lease_renew_interval_ms,
                           drift_margin_ms=self.lease_drift_margin_ms)


class MgmtdServicer:
    """Implements ``fs3.Mgmtd``; all state lives in :class:`MgmtdState`.

    Exactly one of ``kv`` (a single mgmtd on a local store) and ``shared`` (one of several on a
    shared transactional engine) is given.
    """

    def __init__(self, kv: KVStore | None, config: MgmtdConfig, clock: Clock | None = None,
                 metrics: ServiceMetrics | None = None, shared: SharedEngine | None = None) -> None:
        if (kv is None) == (shared is None):
            raise InvalidArgument("a mgmtd runs either on a local store or on a shared engine")
        self.config = config
        self.clock = clock or LoopClock()
        self.kv = kv
        self.shared = shared
        self.state = MgmtdState(kv, config.heartbeat_timeout_ms, config.cluster_id)
        # The protocols this mgmtd speaks: a node outside them is refused at its heartbeat.
        self.protocols = advertised_range()
        self.lease = LeaseLoop(shared, self.clock, self._lease_tick) if shared is not None else None
        self._lock = asyncio.Lock()
        self._loaded_epoch = 0  # the epoch the state in memory was loaded for (0: none loaded)
        self._published_version = 0  # the routing version last written to ROUTING_KEY
        self._lease_task: asyncio.Task[None] | None = None
        self._presence_task: asyncio.Task[None] | None = None
        self._scan_task: asyncio.Task[None] | None = None
        self._state_changed = asyncio.Event()
        self._routing_gauge: Gauge | None
        self._alive_gauge: Gauge | None
        self._primary_gauge: Gauge | None
        self._epoch_gauge: Gauge | None
        # Where mgmtd's own /metrics is served (set once bound): ListNodes tells scrape discovery.
        self.metrics_address = ""
        # The framed address this instance serves (set once bound): a single mgmtd lists itself so.
        self.framed_address = ""
        self._cluster_gauges: SnapshotCollector | None = None
        self._gauges_at: tuple[int, int] = (-_GAUGES_INTERVAL_MS, 0)  # (time, routing version) last published
        if metrics is not None:
            self._routing_gauge = metrics.gauge("fs3_mgmtd_routing_version", "Current routing info version")
            self._alive_gauge = metrics.gauge("fs3_mgmtd_alive_nodes", "Nodes with a recent heartbeat")
            self._primary_gauge = metrics.gauge("fs3_mgmtd_primary", "1 while this mgmtd acts on the cluster state "
                                                "(always, for a single mgmtd), 0 while it is a standby")
            self._epoch_gauge = metrics.gauge("fs3_mgmtd_lease_epoch", "The primary lease's epoch this mgmtd holds "
                                              "(0: a single mgmtd, or a standby)")
            self._cluster_gauges = SnapshotCollector()
            metrics.registry.register(self._cluster_gauges)
        else:
            self._routing_gauge = self._alive_gauge = self._primary_gauge = self._epoch_gauge = None

    def start(self) -> None:
        if self.lease is not None:
            self._lease_task = asyncio.create_task(self.lease.run())
            self._presence_task = asyncio.create_task(self.lease.run_presence())
        else:
            self.state.load(self.clock.now_ms())
        self._scan_task = asyncio.create_task(self._scan_loop())

    async def stop(self, hand_back: bool = True) -> None:
        """Stop; a primary on a shared engine hands its lease back (unless ``hand_back`` is
        False: a test's stand-in for a crash), so a standby takes over at once."""
        for task in (self._scan_task, self._lease_task, self._presence_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._scan_task = self._lease_task = self._presence_task = None
        if self.lease is not None and self.shared is not None and hand_back:
            async with self._lock:  # no call is acting on the state while the lease goes back
                released = self.lease.core.release()
                self._drop_state("stopping")
                if released is not None:
                    try:
                        if await release_lease(self.shared.engine, released):
                            log.warning("mgmtd %s handed the lease back (epoch %d)", self.shared.name, released.epoch)
                    except FS3Error as exc:  # a standby takes over after a lease period instead
                        log.warning("mgmtd %s could not hand the lease back: %s", self.shared.name, exc)
        if self.kv is not None:
            self.kv.close()  # a shared engine belongs to whoever made it

    # -- the primary lease (shared engine only) ----------------------------------------------

    @property
    def role(self) -> str:
        """``single`` (a local store), ``primary`` or ``standby``."""
        if self.lease is None:
            return "single"
        return "primary" if self.is_primary() else "standby"

    def is_primary(self) -> bool:
        """Whether this instance may act on the state now: it holds the lease and loaded the state for it."""
        if self.lease is None:
            return True
        return self.lease.core.is_primary(self.clock.now_ms()) and self._loaded_epoch == self.lease.core.epoch

    def _not_primary(self) -> NotPrimary:
        assert self.lease is not None and self.shared is not None
        address = self.lease.core.primary_address
        if address == self.shared.address and not self.is_primary():
            address = ""  # the lease still names this instance, but it stepped down: no one to name yet
        return NotPrimary.naming(address, f"mgmtd {self.shared.name} is a standby")

    async def _lease_tick(self) -> None:
        """After each lease try: load the state on a takeover, drop it on a step-down."""
        assert self.lease is not None
        core = self.lease.core
        if core.is_primary(self.clock.now_ms()):
            if self._loaded_epoch != core.epoch:
                async with self._lock:
                    await self._take_over(core.epoch)
        elif self._loaded_epoch:
            async with self._lock:
                self._drop_state(f"the lease is no longer held (seen: {core.seen})")

    async def _take_over(self, epoch: int) -> None:
        assert self.lease is not None and self.shared is not None
        try:
            records, raw_version = await read_state_records(self.shared.engine, self.shared.name, epoch)
            state = MgmtdState(None, self.config.heartbeat_timeout_ms, self.config.cluster_id)
            # Every node gets a heartbeat timeout of grace from now, as after a restart.
            state.install(records, raw_version, self.clock.now_ms(), epoch)
            self.state, self._loaded_epoch, self._published_version = state, epoch, 0
            await self._flush()
        except FS3Error as exc:
            log.warning("mgmtd %s: could not load the state as primary of epoch %d: %s", self.shared.name, epoch, exc)
            self.lease.core.step_down()
            self._drop_state("the state could not be loaded")
            return
        self._notify()
        log.warning("mgmtd %s is primary (epoch %d): %d nodes, %d targets, %d chains, routing v%#x",
                    self.shared.name, epoch, len(state.nodes), len(state.targets), len(state.chains),
                    state.routing_version)

    def _drop_state(self, why: str) -> None:
        if self._loaded_epoch:
            log.warning("mgmtd %s steps down from epoch %d: %s", self.shared.name if self.shared else "",
                        self._loaded_epoch, why)
        self.state = MgmtdState(None, self.config.heartbeat_timeout_ms, self.config.cluster_id)
        self._loaded_epoch = self._published_version = 0
        self._notify()

    async def _flush(self) -> None:
        """Write what the state changed, and the routing it now publishes, fenced by the lease epoch.

        A failed write leaves memory ahead of the database: the instance steps down and drops its
        state (a primary, this one again or another, reloads it from the database).
        """
        assert self.lease is not None and self.shared is not None
        records = self.state.take_pending()
        if self.state.routing_version != self._published_version:
            records[ROUTING_KEY] = self.state.routing_info().SerializeToString()
        if not records:
            return
        try:
            await write_fenced(self.shared.engine, self.shared.name, self._loaded_epoch, records)
        except FS3Error as exc:
            self.lease.core.step_down()
            self._drop_state(f"a state write failed: {exc}")
            if isinstance(exc, NotPrimary):
                raise
            raise NotPrimary.naming("", f"mgmtd {self.shared.name} stepped down: its state write failed "
                                        f"({exc.code.name})") from exc
        self._published_version = self.state.routing_version

    @contextlib.asynccontextmanager
    async def _as_primary(self) -> AsyncIterator[MgmtdState]:
        """Run the body as the primary, then commit what it changed (fenced) before anyone reads it.

        A single mgmtd just runs the body: its state writes go to the local store synchronously.
        """
        if self.lease is None:
            yield self.state
            return
        async with self._lock:
            if not self.is_primary():
                raise self._not_primary()
            try:
                yield self.state
            finally:
                await self._flush()

    async def _scan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.scan_interval_ms / 1000)
            if self.is_primary():
                try:
                    async with self._as_primary() as state:
                        state.scan(self.clock.now_ms())
                    self._notify()
                except NotPrimary:
                    pass
            # A standby holds no state: it exports its role, and the cluster gauges come only
            # from the primary (no double counting when every instance is scraped).
            if self._routing_gauge is not None and self._alive_gauge is not None:
                self._routing_gauge.set(self.state.routing_version if self.is_primary() else 0)
                self._alive_gauge.set(sum(1 for n in self.state.nodes.values() if n.alive))
            if self._primary_gauge is not None and self._epoch_gauge is not None:
                primary = self.is_primary()
                self._primary_gauge.set(1 if primary else 0)
                self._epoch_gauge.set(self.lease.core.epoch if primary and self.lease is not None else 0)
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
        check_node_protocol(self.protocols, req)
        async with self._as_primary() as state:
            state.heartbeat(req, self.clock.now_ms())
            # Built after the heartbeat was applied: a fence cleared by this very heartbeat is not sent.
            rsp = mpb.HeartbeatRsp(routing_version=state.routing_version,
                                   heartbeat_timeout_ms=self.config.heartbeat_timeout_ms,
                                   fenced_target_ids=state.fenced_targets(req.node_id),
                                   resync_rate_bytes_per_s=state.moves.book.resync_rate_bytes_per_s)
        self._notify()
        return rsp, _NO_PAYLOAD

    async def get_routing_info(self, req: mpb.GetRoutingInfoReq,
                               payload: memoryview) -> tuple[mpb.GetRoutingInfoRsp, Buffer]:
        if self.shared is not None and not self.is_primary():
            # A standby answers from what the primary last published (committed, fenced).
            routing = await read_published_routing(self.shared.engine)
            if routing is None:
                raise self._not_primary()
        else:
            async with self._as_primary() as state:
                routing = state.routing_info()
        if req.known_version and req.known_version == routing.routing_version:
            return mpb.GetRoutingInfoRsp(changed=False), _NO_PAYLOAD
        return mpb.GetRoutingInfoRsp(changed=True, routing=routing), _NO_PAYLOAD

    async def list_nodes(self, req: cpb.Empty, payload: memoryview) -> tuple[mpb.ListNodesRsp, Buffer]:
        """The nodes (storage, meta) and every mgmtd instance with its role.

        The primary answers from its state; a standby answers too, from the database: the nodes
        as the primary last published them (a node's death or return changes the routing, so
        their liveness is as fresh as the routing), the instances from its own watch of their
        records. So an operator sees the roles even while no primary acts (a takeover under way).
        """
        rsp = mpb.ListNodesRsp(mgmtd_metrics_address=self.metrics_address, protocol_version=self.protocols.high,
                               release=RELEASE)
        if self.shared is not None and not self.is_primary():
            routing = await read_published_routing(self.shared.engine)
            rsp.nodes.extend(routing.nodes if routing is not None else [])
        else:
            async with self._as_primary() as state:
                for record in sorted(state.nodes.values(), key=lambda r: r.info.node_id):
                    node = rsp.nodes.add()
                    node.CopyFrom(record.info)
                    node.alive = record.alive
                    node.last_heartbeat_ms = record.last_heartbeat_ms
        self._list_instances(rsp)
        return rsp, _NO_PAYLOAD

    def _list_instances(self, rsp: mpb.ListNodesRsp) -> None:
        if self.lease is None or self.shared is None:  # a single mgmtd: always the primary, no lease
            address = self.framed_address or self.config.advertise_address or \
                f"{self.config.listen_host}:{self.config.framed_port}"
            name = self.config.instance_name or address
            rsp.mgmtd_instances.add(name=name, address=address, role=mpb.MGMTD_ROLE_PRIMARY)
            rsp.answered_by = name
            return
        now_ms = self.clock.now_ms()
        core = self.lease.core
        for record, role in self.lease.presence.roles(core.seen, core.seen_unchanged_ms(now_ms), self.is_primary(),
                                                      self.shared.address, now_ms):
            rsp.mgmtd_instances.add(name=record.name, address=record.address, role=_ROLES[role],
                                    presence=record.presence)
        rsp.lease_epoch = core.seen.epoch if core.seen is not None else 0
        rsp.answered_by = self.shared.name

    async def list_targets(self, req: cpb.Empty, payload: memoryview) -> tuple[mpb.ListTargetsRsp, Buffer]:
        rsp = mpb.ListTargetsRsp()
        async with self._as_primary() as state:
            for tid in sorted(state.targets):
                rsp.targets.add().CopyFrom(state.targets[tid].info)
        return rsp, _NO_PAYLOAD

    async def list_chains(self, req: cpb.Empty, payload: memoryview) -> tuple[mpb.ListChainsRsp, Buffer]:
        async with self._as_primary() as state:
            routing = state.routing_info()
            rsp = mpb.ListChainsRsp(chains=routing.chains, chain_tables=routing.chain_tables)
            for tid in sorted(state.targets):
                rsp.targets.add().CopyFrom(state.targets[tid].info)
        return rsp, _NO_PAYLOAD

    async def create_chain_table(self, req: mpb.CreateChainTableReq,
                                 payload: memoryview) -> tuple[mpb.CreateChainTableRsp, Buffer]:
        async with self._as_primary() as state:
            rsp = state.create_chain_table(req)
        return rsp, _NO_PAYLOAD

    async def mark_target_offline(self, req: mpb.MarkTargetOfflineReq,
                                  payload: memoryview) -> tuple[mpb.MarkTargetOfflineRsp, Buffer]:
        """Take a target out of its chain and return once it is out (see ``MgmtdState.mark_target_offline``).

        A fenced target is out once its node has reported it offline, which takes about one
        heartbeat interval; a node that dies meanwhile is expired within the heartbeat timeout and
        a scan interval. A node that keeps heartbeating without confirming (it should not exist)
        gets TIMEOUT: the fence stays pending and mgmtd never takes the target out behind its back.
        """
        async with self._as_primary() as state:
            done = state.mark_target_offline(req.target_id, self.clock.now_ms())
        fenced = not done
        if fenced:
            self._notify()
            wait_ms = self.config.heartbeat_timeout_ms + 2 * self.config.scan_interval_ms
            deadline_ms = self.clock.now_ms() + wait_ms
            while self.state.fence_pending(req.target_id):
                if self.state is not state:
                    raise self._not_primary()  # this instance stepped down meanwhile: ask the primary
                remaining_ms = deadline_ms - self.clock.now_ms()
                if remaining_ms <= 0:
                    node_id = self.state.targets[req.target_id].info.node_id
                    raise Timeout(f"target {req.target_id} is fenced but node {node_id} has not reported it "
                                  f"offline within {wait_ms} ms; the fence stays: the target leaves its chain "
                                  f"once the node reports it offline or misses heartbeats")
                with contextlib.suppress(TimeoutError):  # asyncio.timeout: 3.11's wait_for can swallow a cancel
                    async with asyncio.timeout(remaining_ms / 1000):
                        await self._state_changed.wait()
        if self.state is not state:
            raise self._not_primary()
        target = state.targets[req.target_id]
        return mpb.MarkTargetOfflineRsp(routing_version=self.state.routing_version,
                                        public_state=target.info.public_state or cpb.OFFLINE,
                                        fenced=fenced), _NO_PAYLOAD

    # -- replica moves (fs3.mgmtd.moves) -----------------------------------------------------

    async def drain(self, req: mpb.DrainReq, payload: memoryview) -> tuple[mpb.MovesRsp, Buffer]:
        async with self._as_primary() as state:
            message = state.moves.drain(state, req.node_ids, req.target_ids, req.force)
            state.scan(self.clock.now_ms())  # persists the book and takes the first steps
            rsp = state.moves.status(message)
        self._notify()
        return rsp, _NO_PAYLOAD

    async def undrain(self, req: mpb.DrainReq, payload: memoryview) -> tuple[mpb.MovesRsp, Buffer]:
        async with self._as_primary() as state:
            message = state.moves.undrain(state, req.node_ids, req.target_ids)
            state.scan(self.clock.now_ms())
            rsp = state.moves.status(message)
        self._notify()
        return rsp, _NO_PAYLOAD

    async def rebalance(self, req: mpb.RebalanceReq, payload: memoryview) -> tuple[mpb.MovesRsp, Buffer]:
        async with self._as_primary() as state:
            planned = state.moves.rebalance(state, req.max_moves, req.rate_bytes_per_s, req.dry_run)
            added = sum(1 for move in planned if not move.source)  # add-only: regrowing a short chain
            what = ("would move" if req.dry_run else "moving") + f" {len(planned) - added} replica(s)"
            message = what + (f" and {'would add' if req.dry_run else 'adding'} {added} to chains left short"
                              if added else "")
            if not req.dry_run:
                state.scan(self.clock.now_ms())
                rsp = state.moves.status(message)
            else:
                rsp = state.moves.status(message, planned)
        self._notify()
        return rsp, _NO_PAYLOAD

    async def list_moves(self, req: cpb.Empty, payload: memoryview) -> tuple[mpb.MovesRsp, Buffer]:
        async with self._as_primary() as state:
            return state.moves.status(), _NO_PAYLOAD


def check_node_protocol(protocols: VersionRange, req: mpb.HeartbeatReq) -> int:
    """The protocol mgmtd and the node of ``req`` share; a node it cannot talk to is refused with a
    :class:`~fs3.common.errors.ProtocolError` naming both ranges and which side to upgrade, and is
    never registered (its targets never enter a chain)."""
    kind = {cpb.NODE_META: "meta", cpb.NODE_STORAGE: "storage"}.get(req.node_type, "unknown")
    try:
        return negotiate(protocols, range_from_wire(req.protocol_version, req.protocol_version_min),
                         f"{kind} node {req.node_id} ({req.framed_address or req.hostname})", local_name="mgmtd",
                         release=req.release)
    except FS3Error as exc:
        log.warning("refused a heartbeat: %s", exc.message)
        raise

"""mgmtd's cluster state: nodes, targets, chains, chain tables and the routing version.

A plain object over a :class:`~fs3.kv.store.KVStore`; callers pass the time in (``now_ms``), so the
same code runs under the real clock, the simulator's virtual one and unit tests. Everything but
local states and heartbeat times is persisted: restarting mgmtd loses no chain and changes no
public state, and every node gets a full heartbeat timeout of grace after the restart.

With ``kv=None`` (several mgmtd instances on a shared transactional engine, :mod:`fs3.mgmtd.ha`)
the same records collect in :attr:`MgmtdState.pending` instead, and the caller writes them in a
transaction fenced by the primary lease before it answers; :meth:`MgmtdState.install` builds the
state from records read back from that engine by a new primary.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3.common.errors import AlreadyExists, InvalidArgument, NotFound
from fs3.common.invariant import ensure
from fs3.common.target_state import LocalState, PublicState
from fs3.kv.store import KVStore, WriteBatch
from fs3.mgmtd import schema
from fs3.mgmtd.chain_state import update_chain
from fs3.mgmtd.lease import next_routing_version
from fs3.mgmtd.limits import CHAIN_REPLICAS_MAX, CHAINS_PER_TABLE_MAX, TARGETS_PER_NODE_MAX
from fs3.mgmtd.moves import MoveDriver

__all__ = ["MgmtdState", "NodeRecord", "TargetRecord"]

log = logging.getLogger(__name__)

_LOCAL_TO_PB = {
    LocalState.UP_TO_DATE: cpb.UP_TO_DATE,
    LocalState.ONLINE: cpb.ONLINE,
    LocalState.OFFLINE: cpb.LOCAL_OFFLINE,
}
_LOCAL_FROM_PB: dict[int, LocalState] = {int(v): k for k, v in _LOCAL_TO_PB.items()}


def _pb_state(state: PublicState) -> cpb.PublicState:
    """The proto enum value of a public state (the numbers are the same by construction)."""
    return cast(cpb.PublicState, int(state))


def local_from_pb(value: int) -> LocalState:
    try:
        return _LOCAL_FROM_PB[value]
    except KeyError:
        raise InvalidArgument(f"unknown local state {value}") from None


@dataclass
class NodeRecord:
    info: cpb.NodeInfo
    last_heartbeat_ms: int
    alive: bool = True


@dataclass
class TargetRecord:
    info: cpb.TargetInfo
    local_state: LocalState = LocalState.OFFLINE

    @property
    def public_state(self) -> PublicState:
        return PublicState(self.info.public_state or PublicState.OFFLINE)


@dataclass
class MgmtdState:
    kv: KVStore | None  # None: writes collect in ``pending`` for the caller to commit
    heartbeat_timeout_ms: int
    cluster_id: str = "fs3"
    epoch: int = 0  # the primary lease's epoch this state is published under (0: a single mgmtd)
    pending: dict[bytes, bytes] = field(default_factory=dict)
    nodes: dict[int, NodeRecord] = field(default_factory=dict)
    targets: dict[int, TargetRecord] = field(default_factory=dict)
    chains: dict[int, cpb.ChainInfo] = field(default_factory=dict)
    tables: dict[int, cpb.ChainTable] = field(default_factory=dict)
    routing_version: int = 1
    _routing_cache: cpb.RoutingInfo | None = None
    moves: MoveDriver = field(default_factory=MoveDriver)  # drains and rebalances (fs3.mgmtd.moves)

    # -- persistence -------------------------------------------------------------------------

    def load(self, now_ms: int) -> None:
        """Read persisted state; every known node gets a heartbeat timeout of grace."""
        ensure(self.kv is not None, "load() reads the local store; a shared engine's state comes in by install()")
        assert self.kv is not None
        kv = self.kv
        records = {prefix: [raw for _, raw in kv.scan(*schema.prefix_range(prefix))]
                   for prefix in (schema.NODE, schema.TARGET, schema.CHAIN, schema.TABLE, schema.MOVES)}
        self.install(records, kv.get(schema.ROUTING_VERSION), now_ms)

    def install(self, records: dict[bytes, list[bytes]], raw_version: bytes | None, now_ms: int,
                epoch: int = 0) -> None:
        """Take the persisted records (by key prefix of :mod:`fs3.mgmtd.schema`) as this state,
        published under ``epoch``; every known node gets a heartbeat timeout of grace."""
        for raw in records.get(schema.NODE, []):
            info = cpb.NodeInfo.FromString(raw)
            self.nodes[info.node_id] = NodeRecord(info, last_heartbeat_ms=now_ms)
        for raw in records.get(schema.TARGET, []):
            tinfo = cpb.TargetInfo.FromString(raw)
            # Pick the local state that keeps the public state where it is until the node speaks.
            local = {
                PublicState.SERVING: LocalState.UP_TO_DATE,
                PublicState.SYNCING: LocalState.ONLINE,
                PublicState.WAITING: LocalState.UP_TO_DATE,
            }.get(PublicState(tinfo.public_state or PublicState.OFFLINE), LocalState.OFFLINE)
            self.targets[tinfo.target_id] = TargetRecord(tinfo, local)
        for raw in records.get(schema.CHAIN, []):
            chain = cpb.ChainInfo.FromString(raw)
            self.chains[chain.chain_id] = chain
        for raw in records.get(schema.TABLE, []):
            table = cpb.ChainTable.FromString(raw)
            self.tables[table.table_id] = table
        self.moves.install(records.get(schema.MOVES, []))
        # A restart (or a new primary) bumps the version so every cached routing is refreshed once;
        # a new primary's versions carry its epoch, so they sort after every older primary's.
        self.epoch = epoch
        self.routing_version = next_routing_version(int(raw_version) if raw_version else 0, epoch)
        self._routing_cache = None
        self._persist(routing=True)
        log.info("mgmtd state loaded: %d nodes, %d targets, %d chains, routing v%d (epoch %d)",
                 len(self.nodes), len(self.targets), len(self.chains), self.routing_version, epoch)

    def _persist(self, nodes: Iterable[int] = (), targets: Iterable[int] = (), chains: Iterable[int] = (),
                 tables: Iterable[int] = (), routing: bool = False) -> None:
        batch = WriteBatch()
        for node_id in nodes:
            batch.put(schema.node_key(node_id), self.nodes[node_id].info.SerializeToString())
        for target_id in targets:
            batch.put(schema.target_key(target_id), self.targets[target_id].info.SerializeToString())
        for chain_id in chains:
            batch.put(schema.chain_key(chain_id), self.chains[chain_id].SerializeToString())
        for table_id in tables:
            batch.put(schema.table_key(table_id), self.tables[table_id].SerializeToString())
        if routing:
            batch.put(schema.ROUTING_VERSION, str(self.routing_version).encode())
        if self.moves.dirty:
            batch.put(schema.MOVE_BOOK, self.moves.encode())
            self.moves.dirty = False
        if not len(batch):
            return
        if self.kv is None:
            self.pending.update((key, value) for key, value in batch.ops if value is not None)
        else:
            self.kv.write(batch, sync=True)

    def take_pending(self) -> dict[bytes, bytes]:
        """The records written since the last call, for the caller to commit (shared-engine mode)."""
        pending, self.pending = self.pending, {}
        return pending

    def touch(self, targets: Iterable[int] = (), chains: Iterable[int] = ()) -> None:
        """Publish and persist a change made outside this class (a replica move, :mod:`fs3.mgmtd.moves`)."""
        self._bump_routing()
        self._persist(targets=targets, chains=chains, routing=True)

    def _bump_routing(self) -> None:
        self.routing_version += 1
        self._routing_cache = None

    # -- heartbeats and scans ----------------------------------------------------------------

    def heartbeat(self, req: mpb.HeartbeatReq, now_ms: int) -> bool:
        """Record a heartbeat; returns whether the routing information changed."""
        if req.node_id == 0:
            raise InvalidArgument("heartbeat without a node id")
        if req.node_type == cpb.NODE_TYPE_UNSPECIFIED:
            raise InvalidArgument("heartbeat without a node type")
        if len(req.targets) > TARGETS_PER_NODE_MAX:
            raise InvalidArgument(f"heartbeat reports {len(req.targets)} targets, more than the "
                                  f"{TARGETS_PER_NODE_MAX} a node may have")
        changed = False
        record = self.nodes.get(req.node_id)
        info = cpb.NodeInfo(
            node_id=req.node_id, node_type=req.node_type, framed_address=req.framed_address,
            grpc_address=req.grpc_address, hostname=req.hostname, pid=req.pid, alive=True,
            metrics_address=req.metrics_address, protocol_version=req.protocol_version,
            protocol_version_min=req.protocol_version_min, release=req.release,
        )
        persisted = record.info if record else None
        if persisted is None or _node_identity(persisted) != _node_identity(info):
            changed = True
        if record is None:
            record = NodeRecord(info, now_ms)
            self.nodes[req.node_id] = record
        else:
            if not record.alive:
                changed = True
            record.info = info
            record.alive = True
            record.last_heartbeat_ms = now_ms
        touched_targets: list[int] = []
        for th in req.targets:
            if th.target_id == 0:
                raise InvalidArgument("target id 0 is reserved")
            target = self.targets.get(th.target_id)
            if target is not None and target.info.node_id != req.node_id:
                raise AlreadyExists(f"target {th.target_id} belongs to node {target.info.node_id}")
            local = local_from_pb(th.local_state)
            if target is None:
                target = TargetRecord(cpb.TargetInfo(target_id=th.target_id, node_id=req.node_id), local)
                self.targets[th.target_id] = target
                touched_targets.append(th.target_id)
                changed = True
            if target.local_state is not local:
                target.local_state = local
                changed = True
            if target.info.path != th.path:
                touched_targets.append(th.target_id)
            target.info.path = th.path
            target.info.capacity_bytes = th.capacity_bytes
            target.info.used_bytes = th.used_bytes
            target.info.free_bytes = th.free_bytes
            target.info.chunk_count = th.chunk_count
            target.info.local_state = _LOCAL_TO_PB[local]
        if changed:
            self._bump_routing()
            self._persist(nodes=[req.node_id], targets=touched_targets, routing=True)
        return self.scan(now_ms) or changed

    def scan(self, now_ms: int) -> bool:
        """Expire silent nodes and run every chain through the state machine."""
        expired = False
        for record in self.nodes.values():
            if record.alive and now_ms - record.last_heartbeat_ms > self.heartbeat_timeout_ms:
                record.alive = False
                expired = True
                log.warning("node %d missed heartbeats for %d ms: marking its targets offline",
                            record.info.node_id, now_ms - record.last_heartbeat_ms)
                for target in self.targets.values():
                    if target.info.node_id == record.info.node_id:
                        target.local_state = LocalState.OFFLINE
                        target.info.local_state = cpb.LOCAL_OFFLINE
        changed_chains: list[int] = []
        changed_targets: list[int] = []
        for chain in self.chains.values():
            ids = list(chain.target_ids)
            result = update_chain(
                ids,
                {t: self.targets[t].public_state for t in ids},
                {t: self.targets[t].local_state for t in ids},
                chain.chain_version,
            )
            if not result.changed:
                continue
            log.info("chain %d v%d -> v%d: %s", chain.chain_id, chain.chain_version, result.chain_version,
                     ", ".join(f"{t}:{result.states[t].name.lower()}" for t in result.target_ids))
            del chain.target_ids[:]
            chain.target_ids.extend(result.target_ids)
            chain.chain_version = result.chain_version
            for t in ids:
                self.targets[t].info.public_state = _pb_state(result.states[t])
            changed_chains.append(chain.chain_id)
            changed_targets.extend(ids)
        # Replica moves act on the chains as just published: a source the fence took off the write
        # path leaves its chain in this same scan, before its node lifts the fence and resyncs it.
        moved_chains, moved_targets = self.moves.advance(self)
        changed_chains.extend(c for c in moved_chains if c not in changed_chains)
        changed_targets.extend(moved_targets)
        for tid, target in self.targets.items():
            # A fence ends once its target is off the write path: the chain no longer needs it.
            if target.info.fenced and not target.public_state.writable:
                log.info("target %d is %s: fence cleared", tid, target.public_state.name.lower())
                target.info.fenced = False
                changed_targets.append(tid)
        if changed_chains or changed_targets or expired or self.moves.dirty:
            self._bump_routing()
            self._persist(targets=set(changed_targets), chains=changed_chains, routing=True)
            return True
        return False

    # -- admin -------------------------------------------------------------------------------

    def create_chain_table(self, req: mpb.CreateChainTableReq) -> mpb.CreateChainTableRsp:
        table_id = req.table_id or 1
        if table_id in self.tables:
            raise AlreadyExists(f"chain table {table_id} exists")
        if req.replicas > CHAIN_REPLICAS_MAX:
            raise InvalidArgument(f"{req.replicas} replicas exceed {CHAIN_REPLICAS_MAX} per chain")
        if len(req.chains) > CHAINS_PER_TABLE_MAX:
            raise InvalidArgument(f"{len(req.chains)} chains exceed {CHAINS_PER_TABLE_MAX} per table")
        specs = [(c.chain_id, list(c.target_ids)) for c in req.chains]
        if not specs:
            if req.replicas == 0:
                raise InvalidArgument("give explicit chains or a replica count")
            specs = self._plan_chains(req.replicas)
        used = {t for c in self.chains.values() for t in c.target_ids}
        seen: set[int] = set()
        next_id = max(self.chains, default=0) + 1
        chains: list[cpb.ChainInfo] = []
        new_ids: set[int] = set()  # (a set: a table of many chains is checked in linear time)
        for chain_id, target_ids in specs:
            if not target_ids:
                raise InvalidArgument("a chain needs at least one target")
            if len(target_ids) > CHAIN_REPLICAS_MAX:
                raise InvalidArgument(f"a chain of {len(target_ids)} targets exceeds {CHAIN_REPLICAS_MAX}")
            chain_id = chain_id or next_id
            next_id = max(next_id, chain_id + 1)
            if chain_id in self.chains or chain_id in new_ids:
                raise AlreadyExists(f"chain {chain_id} exists")
            new_ids.add(chain_id)
            nodes = set()
            for t in target_ids:
                if t not in self.targets:
                    raise NotFound(f"target {t} is not registered")
                if t in used or t in seen:
                    raise AlreadyExists(f"target {t} is already in a chain")
                seen.add(t)
                nodes.add(self.targets[t].info.node_id)
            if len(nodes) != len(target_ids):
                raise InvalidArgument(f"chain {chain_id} puts two replicas on one node")
            chains.append(cpb.ChainInfo(chain_id=chain_id, chain_version=1, target_ids=target_ids, table_id=table_id))
        table = cpb.ChainTable(table_id=table_id, table_version=1, chain_ids=[c.chain_id for c in chains])
        for chain in chains:
            self.chains[chain.chain_id] = chain
            for t in chain.target_ids:
                target = self.targets[t]
                target.info.chain_id = chain.chain_id
                alive = target.local_state is not LocalState.OFFLINE
                target.info.public_state = _pb_state(PublicState.SERVING if alive else PublicState.OFFLINE)
        self.tables[table_id] = table
        self._bump_routing()
        self._persist(targets=seen, chains=[c.chain_id for c in chains], tables=[table_id], routing=True)
        return mpb.CreateChainTableRsp(table=table, chains=chains)

    def _plan_chains(self, replicas: int) -> list[tuple[int, list[int]]]:
        """Chains of ``replicas`` targets on distinct nodes from every unchained target, heads spread."""
        used = {t for c in self.chains.values() for t in c.target_ids}
        free: dict[int, list[int]] = {}
        for tid in sorted(self.targets):
            if tid not in used:
                free.setdefault(self.targets[tid].info.node_id, []).append(tid)
        if len(free) < replicas:
            raise InvalidArgument(f"{replicas} replicas need {replicas} storage nodes with free targets, "
                                  f"found {len(free)}")
        specs: list[tuple[int, list[int]]] = []
        while True:
            candidates = sorted((n for n in free if free[n]), key=lambda n: (-len(free[n]), n))
            if len(candidates) < replicas:
                break
            chosen = [free[n].pop(0) for n in candidates[:replicas]]
            rotate = len(specs) % replicas
            specs.append((0, chosen[rotate:] + chosen[:rotate]))
        ensure(bool(specs), "chain planning produced no chain")
        return specs

    def mark_target_offline(self, target_id: int, now_ms: int) -> bool:
        """Take a target out of its chain; returns True once it is out, False while a fence is pending.

        A target on the write path of a live node is not taken out here: its node still holds a
        valid lease and would keep serving reads from its old view of the chain while the chain
        without it commits newer writes. It is fenced instead (``TargetInfo.fenced``, persisted):
        its node learns it from the next heartbeat response, stops serving it and reports it
        offline, and only that report lets :meth:`scan` publish the chain without it. A node that
        never answers loses the target through the heartbeat timeout, after its lease has run out.
        A target off the write path, or on a node mgmtd already considers dead, goes at once.
        """
        target = self.targets.get(target_id)
        if target is None:
            raise NotFound(f"target {target_id} is not registered")
        self.scan(now_ms)  # a node past its heartbeat timeout counts as dead, not as alive
        node = self.nodes.get(target.info.node_id)
        if target.info.chain_id and target.public_state.writable and node is not None and node.alive:
            if not target.info.fenced:
                log.warning("target %d (node %d): fenced; its chain changes once the node stops serving it",
                            target_id, target.info.node_id)
                target.info.fenced = True
                self._bump_routing()
                self._persist(targets=[target_id], routing=True)
            return False
        target.local_state = LocalState.OFFLINE
        target.info.local_state = cpb.LOCAL_OFFLINE
        self.scan(now_ms)
        return True

    def fence_pending(self, target_id: int) -> bool:
        """Whether ``target_id`` is fenced and still on its chain's write path."""
        target = self.targets.get(target_id)
        return target is not None and target.info.fenced

    def fenced_targets(self, node_id: int) -> list[int]:
        """The node's fenced targets, for its heartbeat response (sent again on every heartbeat)."""
        return sorted(tid for tid, t in self.targets.items() if t.info.node_id == node_id and t.info.fenced)

    # -- routing -----------------------------------------------------------------------------

    def routing_info(self) -> cpb.RoutingInfo:
        if self._routing_cache is None:
            routing = cpb.RoutingInfo(
                routing_version=self.routing_version,
                heartbeat_timeout_ms=self.heartbeat_timeout_ms,
                cluster_id=self.cluster_id,
                epoch=self.epoch,
            )
            for record in sorted(self.nodes.values(), key=lambda r: r.info.node_id):
                node = routing.nodes.add()
                node.CopyFrom(record.info)
                node.alive = record.alive
                node.last_heartbeat_ms = record.last_heartbeat_ms
            for tid in sorted(self.targets):
                routing.targets.add().CopyFrom(self.targets[tid].info)
            for cid in sorted(self.chains):
                routing.chains.add().CopyFrom(self.chains[cid])
            for tab in sorted(self.tables):
                routing.chain_tables.add().CopyFrom(self.tables[tab])
            self._routing_cache = routing
        return self._routing_cache


def _node_identity(info: cpb.NodeInfo) -> tuple[int, str, str, str, int, int, str]:
    # The versions are part of it: a node restarted on a new release is published in the routing
    # (peers and clients gate newer features on it, and operators watch an upgrade progress).
    return (info.node_type, info.framed_address, info.grpc_address, info.metrics_address, info.protocol_version,
            info.protocol_version_min, info.release)

"""Admin operations on a cluster: listings, chain tables, fault drills and replica verification."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2
from fs3 import mgmtd_pb2 as mpb
from fs3 import storage_pb2 as spb
from fs3.client.meta import Meta
from fs3.client.meta_client import MetaClient
from fs3.client.mgmtd import MgmtdCaller
from fs3.client.routing import RoutingCache
from fs3.common.errors import FS3Error
from fs3.common.metrics import file_sd_groups
from fs3.rpc.channel import ChannelFactory
from fs3.rpc.methods import service_spec
from fs3.rpc.storage_calls import ChunkDump, dump_chunks

__all__ = ["AdminClient", "Observation", "Seen", "VerifyReport"]

_SCRUB_STATUS = service_spec("Storage").method("ScrubStatus")



@dataclass
class VerifyReport:
    """What ``verify`` found: per chain, the chunks whose replicas disagree.

    ``mismatches`` are disagreements seen twice in a row (or a replica whose bytes do not match its
    own recorded CRC, or cannot be read); ``busy`` are chunks that kept changing through every
    re-check — being written, so not comparable now, and not counted against ``ok``.
    """

    data: bool = True  # the bytes were read and compared, not only the recorded metadata
    chains_checked: int = 0
    chunks_checked: int = 0
    bytes_read: int = 0  # chunk bytes the storage targets read back, re-checks included
    rechecked: int = 0  # chunks that looked different at first and were looked at again
    mismatches: list[str] = field(default_factory=list)
    mismatch_details: list[dict[str, object]] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    not_serving: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.unreachable

    def as_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "mode": "data" if self.data else "metadata", "chains_checked": self.chains_checked,
                "chunks_checked": self.chunks_checked, "bytes_read": self.bytes_read, "rechecked": self.rechecked,
                "mismatches": self.mismatches, "mismatch_details": self.mismatch_details, "busy": self.busy,
                "unreachable": self.unreachable, "not_serving": self.not_serving}


@dataclass(frozen=True)
class Seen:
    """One replica's answer for one chunk: its committed version (0: none yet) and how it read back."""

    version: int
    length: int
    checksum: int  # recorded
    data_checksum: int | None  # of the bytes read back (None: not read)
    error: str = ""  # the bytes could not be read
    unsettled: bool = False  # a commit replaced the version while it was being read
    pending: bool = False  # a write of the chunk is in flight on this replica

    @classmethod
    def of(cls, meta: spb.ChunkMeta | None, data: bool) -> Seen | None:
        if meta is None:
            return None
        pending = meta.pending_version != 0
        if not data or meta.commit_version == 0:
            return cls(meta.commit_version, meta.length, meta.checksum, None, pending=pending)
        return cls(meta.commit_version, meta.length, meta.checksum,
                   meta.data_checksum if meta.data_checked else None, meta.data_error,
                   not meta.data_checked and not meta.data_error, pending)

    def rotten(self) -> str:
        """Why this replica is wrong on its own, whatever the others hold ('' when it is not)."""
        if self.error:
            return f"unreadable: {self.error}"
        if self.data_checksum is not None and self.data_checksum != self.checksum:
            return "bytes do not match the recorded CRC"
        return ""

    def describe(self) -> str:
        text = f"v{self.version} len {self.length} crc {self.checksum:08x}" if self.version else "no committed version"
        if self.data_checksum is not None:
            text += f" bytes crc {self.data_checksum:08x}"
        if self.unsettled:
            text += " (changed while read)"
        if self.pending:
            text += " (write in flight)"
        if self.rotten():
            text += f" ({self.rotten()})"
        return text


Observation = dict[int, "Seen | None"]  # target id -> what it holds of one chunk


def _key(seen: Seen | None) -> tuple[int, int, int, int | None] | None:
    """What must be equal across replicas: the committed version's metadata and bytes. A replica
    without the chunk and one with only a first write in flight hold the same: no committed bytes."""
    if seen is None or seen.version == 0:
        return None
    return seen.version, seen.length, seen.checksum, seen.data_checksum


def _describe(seen: Observation) -> str:
    return ", ".join(f"{t}: {v.describe() if v else 'missing'}" for t, v in seen.items())


def _clean(seen: Observation) -> bool:
    values = list(seen.values())
    if any(v is not None and (v.unsettled or v.rotten()) for v in values):
        return False
    return len({_key(v) for v in values}) <= 1


def _settled(seen: Observation) -> bool:
    """No write in flight and no read overtaken by one: a disagreement now is not a moment of a write."""
    return not any(v is not None and (v.unsettled or v.pending) for v in seen.values())


def _odd_targets(seen: Observation) -> list[int]:
    """Replicas that are wrong: rotten on their own, or outside the group of equal answers that is
    largest (ties go to the group with no rotten member). With no such group, every replica is named."""
    groups: dict[object, list[int]] = {}
    for tid, v in seen.items():
        groups.setdefault(_key(v), []).append(tid)

    def score(members: list[int]) -> tuple[int, bool]:
        return len(members), not any((v := seen[t]) is not None and v.rotten() for t in members)

    ranked = sorted(groups.values(), key=score, reverse=True)
    good = set(ranked[0]) if len(ranked) == 1 or score(ranked[0]) != score(ranked[1]) else set()
    return [tid for tid, v in seen.items() if tid not in good or (v is not None and v.rotten())]


class AdminClient:
    def __init__(self, mgmtd_address: str, channels: ChannelFactory, timeout_ms: int = 10_000) -> None:
        """``mgmtd_address``: one mgmtd, or several comma-separated (calls follow their primary)."""
        self.mgmtd_address = mgmtd_address
        self.channels = channels
        self.timeout_ms = timeout_ms
        self.mgmtd = MgmtdCaller(mgmtd_address, channels, timeout_ms)

    async def _mgmtd(self, name: str, req: object, timeout_ms: int | None = None) -> object:
        return await self.mgmtd.call(name, req, timeout_ms=timeout_ms or self.timeout_ms)  # type: ignore[arg-type]

    async def metadata(self) -> Meta:
        """The metadata service (found through mgmtd's routing) for admin commands: fsck, layouts.

        It registers a lease once and never renews it, so meta forgets this short-lived client's
        request records when the lease expires. Calls are made as this process's user.
        """
        routing = RoutingCache([self.mgmtd_address], self.channels, self.timeout_ms)
        meta = Meta(MetaClient(routing, self.channels, os.urandom(16),
                               lambda: meta_pb2.User(uid=os.getuid(), gid=os.getgid(), groups=os.getgroups()),
                               rpc_timeout_ms=max(self.timeout_ms, 60_000), retry_total_ms=self.timeout_ms))
        await meta.renew()
        return meta

    async def nodes(self) -> list[cpb.NodeInfo]:
        rsp = await self._mgmtd("ListNodes", cpb.Empty())
        assert isinstance(rsp, mpb.ListNodesRsp)
        return list(rsp.nodes)

    async def node_listing(self) -> mpb.ListNodesRsp:
        """Every node and every mgmtd instance with its role, as the mgmtd that answered sees them
        (a standby answers too, from the database: see ``MgmtdServicer.list_nodes``)."""
        rsp = await self._mgmtd("ListNodes", cpb.Empty())
        assert isinstance(rsp, mpb.ListNodesRsp)
        return rsp

    async def metrics_targets(self) -> list[dict[str, object]]:
        """Prometheus file_sd target groups of every process mgmtd knows (see :func:`file_sd_groups`)."""
        rsp = await self._mgmtd("ListNodes", cpb.Empty())
        assert isinstance(rsp, mpb.ListNodesRsp)
        return file_sd_groups(rsp.nodes, rsp.mgmtd_metrics_address)

    async def targets(self) -> list[cpb.TargetInfo]:
        rsp = await self._mgmtd("ListTargets", cpb.Empty())
        assert isinstance(rsp, mpb.ListTargetsRsp)
        return list(rsp.targets)

    async def chains(self) -> mpb.ListChainsRsp:
        rsp = await self._mgmtd("ListChains", cpb.Empty())
        assert isinstance(rsp, mpb.ListChainsRsp)
        return rsp

    async def routing(self) -> cpb.RoutingInfo:
        rsp = await self._mgmtd("GetRoutingInfo", mpb.GetRoutingInfoReq())
        assert isinstance(rsp, mpb.GetRoutingInfoRsp)
        return rsp.routing

    async def create_chain_table(self, table_id: int, replicas: int = 0,
                                 chains: list[tuple[int, list[int]]] | None = None) -> mpb.CreateChainTableRsp:
        req = mpb.CreateChainTableReq(table_id=table_id, replicas=replicas)
        for chain_id, target_ids in chains or []:
            req.chains.add(chain_id=chain_id, target_ids=target_ids)
        rsp = await self._mgmtd("CreateChainTable", req)
        assert isinstance(rsp, mpb.CreateChainTableRsp)
        return rsp

    async def mark_target_offline(self, target_id: int) -> mpb.MarkTargetOfflineRsp:
        """Take a target out of its chain; returns once it is out (it then resyncs and comes back).

        mgmtd first fences a target whose node is alive and waits for the node to stop serving it
        (about one heartbeat interval), or, if the node dies meanwhile, for the heartbeat timeout
        (plus up to two scan intervals, each at most the timeout): the call waits that long too.
        """
        routing = await self.routing()
        wait_ms = 3 * routing.heartbeat_timeout_ms
        rsp = await self._mgmtd("MarkTargetOffline", mpb.MarkTargetOfflineReq(target_id=target_id),
                                timeout_ms=self.timeout_ms + wait_ms)
        assert isinstance(rsp, mpb.MarkTargetOfflineRsp)
        return rsp

    async def drain(self, node_ids: list[int], target_ids: list[int], force: bool = False) -> mpb.MovesRsp:
        """Start draining nodes or targets (docs/operations.md, "Adding, draining and replacing storage")."""
        req = mpb.DrainReq(node_ids=node_ids, target_ids=target_ids, force=force)
        rsp = await self._mgmtd("Drain", req)
        assert isinstance(rsp, mpb.MovesRsp)
        return rsp

    async def undrain(self, node_ids: list[int], target_ids: list[int]) -> mpb.MovesRsp:
        """Cancel the drain of nodes or targets (none named: every drain)."""
        rsp = await self._mgmtd("Undrain", mpb.DrainReq(node_ids=node_ids, target_ids=target_ids))
        assert isinstance(rsp, mpb.MovesRsp)
        return rsp

    async def rebalance(self, max_moves: int = 0, rate_bytes_per_s: int = 0, dry_run: bool = False) -> mpb.MovesRsp:
        """Move chain replicas onto the least loaded nodes, resyncs copying at ``rate_bytes_per_s``."""
        req = mpb.RebalanceReq(max_moves=max_moves, rate_bytes_per_s=rate_bytes_per_s, dry_run=dry_run)
        rsp = await self._mgmtd("Rebalance", req)
        assert isinstance(rsp, mpb.MovesRsp)
        return rsp

    async def moves(self) -> mpb.MovesRsp:
        """The replica moves mgmtd carries out or finished lately, and what is being drained."""
        rsp = await self._mgmtd("ListMoves", cpb.Empty())
        assert isinstance(rsp, mpb.MovesRsp)
        return rsp

    async def scrub_status(self) -> tuple[list[spb.ScrubTargetStatus], list[str]]:
        """Every storage node's scrubbers (one entry per target, by target id), and the nodes that
        did not answer."""
        routing = await self.routing()
        out: list[spb.ScrubTargetStatus] = []
        unreachable: list[str] = []
        storage = [n for n in routing.nodes if n.node_type == cpb.NODE_STORAGE]

        async def one(node: cpb.NodeInfo) -> spb.ScrubStatusRsp:
            channel = self.channels.get(self.channels.node_address(node.framed_address, node.grpc_address))
            rsp, _ = await channel.call(_SCRUB_STATUS, spb.ScrubStatusReq(), timeout_ms=self.timeout_ms)
            assert isinstance(rsp, spb.ScrubStatusRsp)
            return rsp

        answers = await asyncio.gather(*(one(n) for n in storage), return_exceptions=True)
        for node, answer in zip(storage, answers, strict=True):
            if isinstance(answer, FS3Error):
                unreachable.append(f"node {node.node_id}: {answer}")
            elif isinstance(answer, BaseException):
                raise answer
            else:
                out.extend(answer.targets)
        return sorted(out, key=lambda t: t.target_id), unreachable

    async def verify(self, progress: Callable[[int, int], None] | None = None, *, data: bool = True,
                     rechecks: int = 3, recheck_delay_s: float = 0.2, batch: int = 1000,
                     max_data_bytes: int = 0) -> VerifyReport:
        """Compare every chunk across the serving replicas of its chain.

        With ``data`` (the default) each target reads every committed version back from its disk
        and returns the CRC32C of those bytes: a replica whose bytes rotted under an intact record
        differs from the others, and from its own recorded CRC. Without it only the recorded
        metadata (version, length, CRC) is compared — fast, but blind to what is on disk.

        Chunks written during the check differ for a moment (CRAQ commits at the tail first): each
        chunk that differs is looked at again, alone, up to ``rechecks`` times with growing pauses.
        The same disagreement seen twice in a row is a mismatch; a chunk that changed every time is
        reported as busy. ``progress(done, total)`` is called before each chain.
        """
        routing = await self.routing()
        nodes = {n.node_id: n for n in routing.nodes}
        targets = {t.target_id: t for t in routing.targets}
        report = VerifyReport(data=data)
        for index, chain in enumerate(routing.chains):
            if progress is not None:
                progress(index, len(routing.chains))
            report.chains_checked += 1
            addresses: dict[int, str] = {}
            for tid in chain.target_ids:
                info = targets[tid]
                if info.public_state != cpb.SERVING:
                    report.not_serving.append(f"chain {chain.chain_id}: target {tid} is "
                                              f"{cpb.PublicState.Name(info.public_state).lower()}")
                    continue
                node = nodes.get(info.node_id)
                addresses[tid] = self.channels.node_address(node.framed_address, node.grpc_address) if node else ""
            observed, failed = await self._observe(chain.chain_id, addresses, None, data, batch, max_data_bytes,
                                                   report)
            for tid, error in failed.items():
                report.unreachable.append(f"chain {chain.chain_id}: target {tid}: {error}")
                addresses.pop(tid)  # compare the replicas that answered
            report.chunks_checked += len(observed)
            suspects = {cid: seen for cid, seen in observed.items() if not _clean(seen)}
            report.rechecked += len(suspects)
            recheck_failed = False
            for attempt in range(rechecks):
                if not suspects:
                    break
                await asyncio.sleep(recheck_delay_s * (attempt + 1))
                fresh, failed = await self._observe(chain.chain_id, addresses, list(suspects), data, batch,
                                                    max_data_bytes, report)
                if failed:
                    for tid, error in failed.items():
                        report.unreachable.append(f"chain {chain.chain_id}: target {tid} (re-check): {error}")
                    recheck_failed = True
                    break
                still: dict[bytes, Observation] = {}
                for cid, before in suspects.items():
                    now = fresh[cid]
                    if _clean(now):
                        continue
                    if now == before and _settled(now):
                        self._mismatch(report, chain.chain_id, cid, now)
                    else:
                        still[cid] = now
                suspects = still
            for cid, seen in sorted(suspects.items()):
                if rechecks == 0:
                    self._mismatch(report, chain.chain_id, cid, seen)
                else:
                    why = "not re-checked (a replica stopped answering)" if recheck_failed \
                        else "changed or had a write in flight on every re-check"
                    report.busy.append(f"chain {chain.chain_id} chunk {cid.hex()}: {why}; {_describe(seen)}")
        return report

    async def _observe(self, chain_id: int, addresses: dict[int, str], chunk_ids: list[bytes] | None, data: bool,
                       batch: int, max_data_bytes: int,
                       report: VerifyReport) -> tuple[dict[bytes, Observation], dict[int, str]]:
        """Every replica's view of the chain's chunks (or of ``chunk_ids``), the replicas asked at once."""

        async def one(tid: int) -> ChunkDump:
            return await dump_chunks(self.channels.get(addresses[tid]), chain_id, tid, timeout_ms=self.timeout_ms,
                                     batch=batch, data_checksums=data, chunk_ids=chunk_ids,
                                     max_data_bytes=max_data_bytes)

        tids = list(addresses)
        answers = await asyncio.gather(*(one(tid) for tid in tids), return_exceptions=True)
        dumps: dict[int, ChunkDump] = {}
        failed: dict[int, str] = {}
        for tid, answer in zip(tids, answers, strict=True):
            if isinstance(answer, FS3Error):
                failed[tid] = str(answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                dumps[tid] = answer
                report.bytes_read += answer.data_bytes
        ids = set(chunk_ids) if chunk_ids is not None else set().union(*(d.chunks for d in dumps.values()))
        observed = {cid: {tid: Seen.of(dump.chunks.get(cid), data) for tid, dump in dumps.items()}
                    for cid in sorted(ids)}
        return observed, failed

    @staticmethod
    def _mismatch(report: VerifyReport, chain_id: int, chunk_id: bytes, seen: Observation) -> None:
        odd = _odd_targets(seen)
        report.mismatches.append(f"chain {chain_id} chunk {chunk_id.hex()}: target "
                                 f"{', '.join(str(t) for t in odd) or '?'} differs; {_describe(seen)}")
        report.mismatch_details.append({
            "chain_id": chain_id, "chunk_id": chunk_id.hex(), "targets": odd,
            "replicas": {str(t): (None if v is None else {
                "version": v.version, "length": v.length, "checksum": v.checksum,
                "data_checksum": v.data_checksum, "error": v.error or None, "pending": v.pending,
                "problem": v.rotten() or None}) for t, v in seen.items()},
        })

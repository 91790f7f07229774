"""Admin operations on a cluster: listings, chain tables, fault drills and replica verification."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3 import storage_pb2 as spb
from fs3.common.errors import FS3Error
from fs3.rpc.channel import ChannelFactory
from fs3.rpc.methods import service_spec
from fs3.rpc.storage_calls import dump_chunk_meta

__all__ = ["AdminClient", "VerifyReport"]

_MGMTD = service_spec("Mgmtd")


@dataclass
class VerifyReport:
    """What ``verify`` found: per chain, the chunks whose replicas disagree."""

    chains_checked: int = 0
    chunks_checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    not_serving: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.unreachable

    def as_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "chains_checked": self.chains_checked, "chunks_checked": self.chunks_checked,
                "mismatches": self.mismatches, "unreachable": self.unreachable, "not_serving": self.not_serving}


class AdminClient:
    def __init__(self, mgmtd_address: str, channels: ChannelFactory, timeout_ms: int = 10_000) -> None:
        self.mgmtd_address = mgmtd_address
        self.channels = channels
        self.timeout_ms = timeout_ms

    async def _mgmtd(self, name: str, req: object, timeout_ms: int | None = None) -> object:
        rsp, _ = await self.channels.get(self.mgmtd_address).call(_MGMTD.method(name), req,  # type: ignore[arg-type]
                                                                  timeout_ms=timeout_ms or self.timeout_ms)
        return rsp

    async def nodes(self) -> list[cpb.NodeInfo]:
        rsp = await self._mgmtd("ListNodes", cpb.Empty())
        assert isinstance(rsp, mpb.ListNodesRsp)
        return list(rsp.nodes)

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

    async def verify(self, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """Compare every chunk's committed version, length and CRC32C across the replicas of its chain.

        ``progress(done, total)`` is called after each chain (long on big clusters).
        """
        routing = await self.routing()
        nodes = {n.node_id: n for n in routing.nodes}
        targets = {t.target_id: t for t in routing.targets}
        report = VerifyReport()
        for index, chain in enumerate(routing.chains):
            if progress is not None:
                progress(index, len(routing.chains))
            report.chains_checked += 1
            replicas: dict[int, dict[bytes, spb.ChunkMeta]] = {}
            for tid in chain.target_ids:
                info = targets[tid]
                if info.public_state != cpb.SERVING:
                    report.not_serving.append(f"chain {chain.chain_id}: target {tid} is "
                                              f"{cpb.PublicState.Name(info.public_state).lower()}")
                    continue
                node = nodes.get(info.node_id)
                address = self.channels.node_address(node.framed_address, node.grpc_address) if node else ""
                try:
                    replicas[tid] = await dump_chunk_meta(self.channels.get(address), chain.chain_id, tid, 1000,
                                                          self.timeout_ms)
                except FS3Error as exc:
                    report.unreachable.append(f"chain {chain.chain_id}: target {tid}: {exc}")
            ids = sorted(set().union(*[set(r) for r in replicas.values()])) if replicas else []
            for chunk_id in ids:
                report.chunks_checked += 1
                seen = {}
                for tid, metas in replicas.items():
                    meta = metas.get(chunk_id)
                    seen[tid] = (meta.commit_version, meta.length, meta.checksum) if meta else None
                if len(set(seen.values())) > 1:
                    detail = ", ".join(f"{t}: " + (f"v{v[0]} len {v[1]} crc {v[2]:08x}" if v else "missing")
                                       for t, v in seen.items())
                    report.mismatches.append(f"chain {chain.chain_id} chunk {chunk_id.hex()}: {detail}")
        return report

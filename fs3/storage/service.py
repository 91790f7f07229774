"""``fs3.Storage`` servicer: converts requests and calls the node's replicas. No logic of its own."""

from __future__ import annotations

from collections.abc import Awaitable

from fs3 import storage_pb2 as spb
from fs3.common.errors import InvalidArgument, IoError
from fs3.rpc.dispatch import Buffer
from fs3.storage.node import StorageNode
from fs3.storage.replica import TargetReplica

__all__ = ["StorageServicer"]

_NO_PAYLOAD = b""
_DUMP_LIMIT_MAX = 10_000
_SYNC_RECORDS_MAX = 10_000


class StorageServicer:
    def __init__(self, node: StorageNode) -> None:
        self.node = node

    def _target_failed(self, target_id: int, exc: IoError) -> None:
        """A target whose disk fails I/O reports itself offline; mgmtd takes it out of its chain.

        A refusal for lack of space (:class:`NoSpace`) is not a failure: nothing was written, the
        target keeps serving reads and takes writes again once there is room.
        """
        self.node.fail_target(target_id, exc)

    async def update(self, req: spb.UpdateReq, payload: memoryview) -> tuple[spb.UpdateRsp, Buffer]:
        replica = self.node.replica_for_chain(req.chain_id)
        return await self._writing(replica, replica.update(req, payload)), _NO_PAYLOAD

    async def forward(self, req: spb.ForwardReq, payload: memoryview) -> tuple[spb.UpdateRsp, Buffer]:
        replica = self.node.replica_for_chain(req.update.chain_id)
        return await self._writing(replica, replica.forward(req, payload)), _NO_PAYLOAD

    async def _writing(self, replica: TargetReplica, call: Awaitable[spb.UpdateRsp]) -> spb.UpdateRsp:
        try:
            return await call
        except IoError as exc:
            self._target_failed(replica.target_id, exc)
            raise

    async def read(self, req: spb.ReadReq, payload: memoryview) -> tuple[spb.ReadRsp, Buffer]:
        replica = self.node.replica_for_chain(req.chain_id)
        try:
            return await replica.read(req)
        except IoError as exc:
            # A disk that fails a read fails its target too (the client reads another replica).
            self._target_failed(replica.target_id, exc)
            raise

    async def query_committed(self, req: spb.QueryCommittedReq,
                              payload: memoryview) -> tuple[spb.QueryCommittedRsp, Buffer]:
        return await self.node.replica_for_chain(req.chain_id).query_committed(req), _NO_PAYLOAD

    async def dump_chunk_meta(self, req: spb.DumpChunkMetaReq,
                              payload: memoryview) -> tuple[spb.DumpChunkMetaRsp, Buffer]:
        if req.limit > _DUMP_LIMIT_MAX:
            raise InvalidArgument(f"limit {req.limit} exceeds {_DUMP_LIMIT_MAX}")
        replica = self.node.replica_for_target(req.target_id, req.chain_id)
        limit = req.limit or 1000
        rsp = spb.DumpChunkMetaRsp(target_id=replica.target_id)
        for chunk_id, state in replica.engine.iter_states(req.start_after, limit + 1):
            if len(rsp.chunks) == limit:
                rsp.more = True
                break
            rsp.chunks.add(chunk_id=chunk_id, commit_version=state.commit_version,
                           pending_version=state.pending_version, chain_version=state.chain_version,
                           length=state.length, checksum=state.checksum)
        return rsp, _NO_PAYLOAD

    async def sync_done(self, req: spb.SyncDoneReq, payload: memoryview) -> tuple[spb.SyncDoneRsp, Buffer]:
        self.node.sync_done(req)
        return spb.SyncDoneRsp(), _NO_PAYLOAD

    async def sync_channels(self, req: spb.SyncChannelsReq,
                            payload: memoryview) -> tuple[spb.SyncChannelsRsp, Buffer]:
        if len(req.records) > _SYNC_RECORDS_MAX:
            raise InvalidArgument(f"{len(req.records)} records exceed {_SYNC_RECORDS_MAX} per call")
        return spb.SyncChannelsRsp(merged=self.node.sync_channels(req)), _NO_PAYLOAD

    async def target_stats(self, req: spb.TargetStatsReq, payload: memoryview) -> tuple[spb.TargetStatsRsp, Buffer]:
        rsp = spb.TargetStatsRsp()
        for tid, engine in sorted(self.node.engines.items()):
            local = self.node.local_states.get(tid)
            chain_id = self.node.chain_of(tid)
            rsp.targets.add(target_id=tid, chain_id=chain_id, chunk_count=engine.chunk_count,
                            used_bytes=engine.used_bytes, free_bytes=engine.files.free_bytes(),
                            syncing=self.node.resyncing(chain_id),
                            local_state=local.name.lower() if local else "unknown")
        return rsp, _NO_PAYLOAD

"""Every explicit limit at its edge: exactly at it is accepted, one past is refused with an error
that names the bound, and a refusal changes nothing.

The limits live in one module per service: ``fs3/rpc/limits.py``, ``fs3/storage/limits.py``,
``fs3/mgmtd/limits.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3 import storage_pb2 as spb
from fs3.common.errors import FrameTooLarge, InvalidArgument
from fs3.common.ids import chunk_id
from fs3.kv.store import MemKVStore
from fs3.mgmtd import limits as mgmtd_limits
from fs3.mgmtd.state import MgmtdState
from fs3.rpc import limits as rpc_limits
from fs3.rpc.framed import FramedLimits
from fs3.rpc.framing import FrameKind, pack_header, unpack_header
from fs3.storage import limits as storage_limits
from fs3.storage.blobs import MemBlobStore
from fs3.storage.chunk_engine import ChunkEngine
from fs3.storage.replica import TargetReplica
from fs3.storage.service import StorageServicer

# -- rpc ----------------------------------------------------------------------------------------


def _header(msg_len: int, payload_len: int) -> bytes:
    return pack_header(FrameKind.REQUEST, 0x100, 0, 1, msg_len, payload_len)


def test_frame_message_size_at_its_edge() -> None:
    limit = rpc_limits.FRAME_MSG_MAX_BYTES
    assert unpack_header(_header(limit, 0), limit, rpc_limits.FRAME_PAYLOAD_MAX_BYTES).msg_len == limit
    with pytest.raises(FrameTooLarge, match=str(limit)):
        unpack_header(_header(limit + 1, 0), limit, rpc_limits.FRAME_PAYLOAD_MAX_BYTES)


def test_frame_payload_size_at_its_edge() -> None:
    limit = rpc_limits.FRAME_PAYLOAD_MAX_BYTES
    assert unpack_header(_header(0, limit), rpc_limits.FRAME_MSG_MAX_BYTES, limit).payload_len == limit
    with pytest.raises(FrameTooLarge, match=str(limit)):
        unpack_header(_header(0, limit + 1), rpc_limits.FRAME_MSG_MAX_BYTES, limit)


def test_the_limits_fit_each_other() -> None:
    """The largest chunk fits a frame's payload, the largest payload or message fits a gRPC
    message, and the framed transport's defaults are the ones stated in the limits module."""
    assert storage_limits.CHUNK_SIZE_MAX_BYTES <= rpc_limits.FRAME_PAYLOAD_MAX_BYTES
    assert max(rpc_limits.FRAME_MSG_MAX_BYTES, rpc_limits.FRAME_PAYLOAD_MAX_BYTES) < rpc_limits.GRPC_MESSAGE_MAX_BYTES
    defaults = FramedLimits()
    assert (defaults.msg_max_bytes, defaults.payload_max_bytes, defaults.inflight_requests_max) == (
        rpc_limits.FRAME_MSG_MAX_BYTES, rpc_limits.FRAME_PAYLOAD_MAX_BYTES, rpc_limits.INFLIGHT_REQUESTS_MAX)


# -- storage ------------------------------------------------------------------------------------


def _update(client_id: bytes) -> spb.UpdateReq:
    return spb.UpdateReq(chain_id=1, chunk_id=chunk_id(1, 0), type=spb.REMOVE, chunk_size=4096, client_id=client_id)


def test_client_id_length_at_its_edge() -> None:
    limit = storage_limits.CLIENT_ID_MAX_BYTES
    TargetReplica.validate_update(_update(b"c" * limit), b"")
    with pytest.raises(InvalidArgument, match=str(limit)):
        TargetReplica.validate_update(_update(b"c" * (limit + 1)), b"")


def test_version_at_its_edge() -> None:
    engine = ChunkEngine(MemKVStore(), MemBlobStore())
    limit = storage_limits.VERSION_MAX
    with pytest.raises(InvalidArgument, match=str(limit)):
        engine.observe_version(limit + 1)
    floor = engine.floor
    assert floor < limit  # nothing changed
    engine.observe_version(limit)
    assert engine.floor >= limit and engine.new_version() > limit


class _Node:
    """Just enough of a storage node for the servicer's own checks."""

    def __init__(self) -> None:
        self.engine = ChunkEngine(MemKVStore(), MemBlobStore())
        self.replica = TargetReplica(1, self.engine, self)  # type: ignore[arg-type]
        self.synced: list[int] = []

    def replica_for_target(self, target_id: int, chain_id: int) -> TargetReplica:
        return self.replica

    def sync_channels(self, req: spb.SyncChannelsReq) -> int:
        self.synced.append(len(req.records))
        return len(req.records)


def test_dump_chunk_meta_page_at_its_edge() -> None:
    node = _Node()
    servicer = StorageServicer(node)  # type: ignore[arg-type]
    limit = storage_limits.DUMP_CHUNKS_MAX

    async def main() -> None:
        rsp, _ = await servicer.dump_chunk_meta(spb.DumpChunkMetaReq(target_id=1, limit=limit), memoryview(b""))
        assert not rsp.more
        with pytest.raises(InvalidArgument, match=str(limit)):
            await servicer.dump_chunk_meta(spb.DumpChunkMetaReq(target_id=1, limit=limit + 1), memoryview(b""))
        named = [chunk_id(1, i) for i in range(limit)]
        await servicer.dump_chunk_meta(spb.DumpChunkMetaReq(target_id=1, chunk_ids=named), memoryview(b""))
        with pytest.raises(InvalidArgument, match=str(limit)):
            await servicer.dump_chunk_meta(spb.DumpChunkMetaReq(target_id=1, chunk_ids=[*named, chunk_id(2, 0)]),
                                           memoryview(b""))

    asyncio.run(main())


def test_sync_channels_batch_at_its_edge() -> None:
    node = _Node()
    servicer = StorageServicer(node)  # type: ignore[arg-type]
    limit = storage_limits.SYNC_RECORDS_MAX

    def req(count: int) -> spb.SyncChannelsReq:
        out = spb.SyncChannelsReq(chain_id=1, target_id=1)
        for i in range(count):
            out.records.add(client_id=b"c", channel_id=i, seq=1, commit_version=1, chunk_id=chunk_id(1, i))
        return out

    async def main() -> None:
        rsp, _ = await servicer.sync_channels(req(limit), memoryview(b""))
        assert rsp.merged == limit
        with pytest.raises(InvalidArgument, match=str(limit)):
            await servicer.sync_channels(req(limit + 1), memoryview(b""))
        assert node.synced == [limit]  # the refused batch reached nothing

    asyncio.run(main())


# -- mgmtd --------------------------------------------------------------------------------------


def _state() -> MgmtdState:
    return MgmtdState(MemKVStore(), 10_000, "test")


def _heartbeat(node_id: int, target_ids: list[int]) -> mpb.HeartbeatReq:
    req = mpb.HeartbeatReq(node_id=node_id, node_type=cpb.NODE_STORAGE, framed_address=f"n{node_id}:1")
    for tid in target_ids:
        req.targets.add(target_id=tid, local_state=cpb.UP_TO_DATE)
    return req


def test_targets_per_node_at_its_edge() -> None:
    state = _state()
    limit = mgmtd_limits.TARGETS_PER_NODE_MAX
    with pytest.raises(InvalidArgument, match=str(limit)):
        state.heartbeat(_heartbeat(1, list(range(1, limit + 2))), 0)
    assert not state.nodes and not state.targets  # nothing registered
    state.heartbeat(_heartbeat(1, list(range(1, limit + 1))), 0)
    assert len(state.targets) == limit


def _nodes(state: MgmtdState, count: int) -> None:
    for node_id in range(1, count + 1):
        state.heartbeat(_heartbeat(node_id, [node_id * 100]), 0)


def test_chain_length_at_its_edge() -> None:
    state = _state()
    limit = mgmtd_limits.CHAIN_REPLICAS_MAX
    _nodes(state, limit + 1)
    version = state.routing_version
    with pytest.raises(InvalidArgument, match=str(limit)):
        state.create_chain_table(mpb.CreateChainTableReq(table_id=1, replicas=limit + 1))
    too_long = mpb.CreateChainTableReq(table_id=1)
    too_long.chains.add(target_ids=[n * 100 for n in range(1, limit + 2)])
    with pytest.raises(InvalidArgument, match=str(limit)):
        state.create_chain_table(too_long)
    assert not state.tables and not state.chains and state.routing_version == version
    rsp = state.create_chain_table(mpb.CreateChainTableReq(table_id=1, replicas=limit))
    assert [len(chain.target_ids) for chain in rsp.chains] == [limit]


def test_chains_per_table_at_its_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real bound refuses one chain past it before looking at any; the edge itself is walked
    with the bound shrunk (65,536 registered targets would make a slow test, not a better one)."""
    state = _state()
    over = mpb.CreateChainTableReq(table_id=1)
    for _ in range(mgmtd_limits.CHAINS_PER_TABLE_MAX + 1):
        over.chains.add(target_ids=[1])
    with pytest.raises(InvalidArgument, match=str(mgmtd_limits.CHAINS_PER_TABLE_MAX)):
        state.create_chain_table(over)
    limit = 512
    monkeypatch.setattr("fs3.mgmtd.state.CHAINS_PER_TABLE_MAX", limit)
    _nodes(state, limit + 1)
    version = state.routing_version

    def req(count: int) -> mpb.CreateChainTableReq:
        out = mpb.CreateChainTableReq(table_id=1)
        for node_id in range(1, count + 1):
            out.chains.add(target_ids=[node_id * 100])
        return out

    with pytest.raises(InvalidArgument, match=str(limit)):
        state.create_chain_table(req(limit + 1))
    assert not state.tables and not state.chains and state.routing_version == version
    rsp: Any = state.create_chain_table(req(limit))
    assert len(rsp.chains) == limit

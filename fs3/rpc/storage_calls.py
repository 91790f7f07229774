"""Typed helpers for Storage calls made by more than one caller (resync, admin verify)."""

from __future__ import annotations

from fs3 import storage_pb2 as spb
from fs3.rpc.channel import Channel
from fs3.rpc.methods import service_spec

__all__ = ["dump_chunk_meta"]

_DUMP = service_spec("Storage").method("DumpChunkMeta")


async def dump_chunk_meta(channel: Channel, chain_id: int, target_id: int, batch: int,
                          timeout_ms: int) -> dict[bytes, spb.ChunkMeta]:
    """Every chunk's metadata on one target, fetched in pages of ``batch``."""
    out: dict[bytes, spb.ChunkMeta] = {}
    start_after = b""
    while True:
        rsp, _ = await channel.call(_DUMP, spb.DumpChunkMetaReq(chain_id=chain_id, target_id=target_id,
                                                                 start_after=start_after, limit=batch),
                                    timeout_ms=timeout_ms)
        assert isinstance(rsp, spb.DumpChunkMetaRsp)
        for meta in rsp.chunks:
            out[meta.chunk_id] = meta
        if not rsp.more or not rsp.chunks:
            return out
        start_after = rsp.chunks[-1].chunk_id

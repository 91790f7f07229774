"""Typed helpers for Storage calls made by more than one caller (resync, admin verify, fsck)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fs3 import storage_pb2 as spb
from fs3.rpc.channel import Channel
from fs3.rpc.methods import service_spec

__all__ = ["ChunkDump", "dump_chunk_meta", "dump_chunks", "list_chunk_range"]

_DUMP = service_spec("Storage").method("DumpChunkMeta")


@dataclass
class ChunkDump:
    """One target's chunks as ``dump_chunks`` collected them, with what reading them cost."""

    chunks: dict[bytes, spb.ChunkMeta] = field(default_factory=dict)
    data_bytes: int = 0  # bytes the target read back from disk for data checksums
    pages: int = 0


async def _dump_pages(channel: Channel, req: spb.DumpChunkMetaReq, out: ChunkDump, timeout_ms: int) -> None:
    while True:
        rsp, _ = await channel.call(_DUMP, req, timeout_ms=timeout_ms)
        assert isinstance(rsp, spb.DumpChunkMetaRsp)
        out.pages += 1
        out.data_bytes += rsp.data_bytes
        for meta in rsp.chunks:
            out.chunks[meta.chunk_id] = meta
        if not rsp.more or not rsp.chunks:
            return
        req.start_after = rsp.chunks[-1].chunk_id


async def dump_chunks(channel: Channel, chain_id: int, target_id: int, *, timeout_ms: int, batch: int = 1000,
                      data_checksums: bool = False, chunk_ids: Iterable[bytes] | None = None,
                      max_data_bytes: int = 0) -> ChunkDump:
    """A target's chunk metadata, paged by ``batch`` chunks (and, with ``data_checksums``, by the
    bytes the target reads per page). ``chunk_ids`` narrows it to those chunks (re-checks); ones
    the target does not hold are simply absent from the result."""
    out = ChunkDump()
    base = spb.DumpChunkMetaReq(chain_id=chain_id, target_id=target_id, limit=batch,
                                data_checksums=data_checksums, max_data_bytes=max_data_bytes)
    if chunk_ids is None:
        await _dump_pages(channel, base, out, timeout_ms)
        return out
    wanted = sorted(set(chunk_ids))
    for start in range(0, len(wanted), batch):  # a request carries at most ``batch`` ids
        req = spb.DumpChunkMetaReq()
        req.CopyFrom(base)
        req.chunk_ids.extend(wanted[start : start + batch])
        await _dump_pages(channel, req, out, timeout_ms)
    return out


async def dump_chunk_meta(channel: Channel, chain_id: int, target_id: int, batch: int,
                          timeout_ms: int) -> dict[bytes, spb.ChunkMeta]:
    """Every chunk's metadata on one target, fetched in pages of ``batch``."""
    return (await dump_chunks(channel, chain_id, target_id, timeout_ms=timeout_ms, batch=batch)).chunks


async def list_chunk_range(channel: Channel, chain_id: int, target_id: int, start_after: bytes, end_before: bytes,
                           limit: int, timeout_ms: int) -> tuple[list[spb.ChunkMeta], bool]:
    """One page of a target's chunks with ids in ``(start_after, end_before)``: the chunks, and
    whether more follow. The caller pages on from the last id (memory is one page, whatever the range)."""
    req = spb.DumpChunkMetaReq(chain_id=chain_id, target_id=target_id, start_after=start_after,
                               end_before=end_before, limit=limit)
    rsp, _ = await channel.call(_DUMP, req, timeout_ms=timeout_ms)
    assert isinstance(rsp, spb.DumpChunkMetaRsp)
    return list(rsp.chunks), rsp.more and bool(rsp.chunks)

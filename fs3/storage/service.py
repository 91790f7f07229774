"""``fs3.Storage`` servicer: converts requests and calls the node's replicas. No logic of its own."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from fs3 import storage_pb2 as spb
from fs3.common.capability import Access, check_chunk_access
from fs3.common.checksum import crc32c
from fs3.common.errors import FS3Error, InvalidArgument, InvariantViolation, IoError, PermissionDenied
from fs3.common.ids import parse_chunk_id
from fs3.rpc.auth import Authenticator, Role, current_principal
from fs3.rpc.dispatch import Buffer
from fs3.storage.chunk_engine import ChunkEngine, ChunkState
from fs3.storage.limits import (
    BATCH_READ_BYTES_MAX,
    BATCH_READ_PIECES_MAX,
    DUMP_CHUNKS_MAX,
    DUMP_DATA_BYTES_MAX,
    SYNC_RECORDS_MAX,
)
from fs3.storage.node import StorageNode
from fs3.storage.replica import TargetReplica

__all__ = ["StorageServicer"]

log = logging.getLogger(__name__)

_NO_PAYLOAD = b""
# Reads of a chunk that a commit replaced meanwhile are retried this often before giving up.
_DATA_READ_TRIES = 3
# Pieces of one BatchRead served at once: enough to keep the node's I/O pool busy with one call's
# big pieces, few enough that one call cannot take every pool thread from everybody else's reads.
_BATCH_READ_CONCURRENCY = 16


def _committed(state: ChunkState | None) -> tuple[int, int, int]:
    """What identifies a committed version's bytes (pending writes do not touch them)."""
    return (state.commit_version, state.length, state.checksum) if state is not None else (0, 0, 0)


def _read_crc(engine: ChunkEngine, chunk_id: bytes, version: int, length: int) -> tuple[int, int]:
    """CRC32C and size of a committed version's bytes as the disk returns them (on an I/O thread)."""
    data = engine.read(chunk_id, version, 0, length)
    return crc32c(data), len(data)


def _listing(engine: ChunkEngine, req: spb.DumpChunkMetaReq, limit: int) -> list[tuple[bytes, ChunkState]]:
    """Up to ``limit`` chunks after ``start_after`` (and before ``end_before``, if set), in id order:
    all of them, or those in ``chunk_ids``.

    Taken as a list before any data is read: the engine changes while the reads wait on I/O threads.
    """
    if not req.chunk_ids:
        return list(engine.iter_states(req.start_after, limit, req.end_before))
    out = []
    wanted = {bytes(c) for c in req.chunk_ids if c > req.start_after and (not req.end_before or c < req.end_before)}
    for chunk_id in sorted(wanted):
        state = engine.get(chunk_id)
        if state is not None:
            out.append((chunk_id, state))
            if len(out) == limit:
                break
    return out


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception inside a task group's failure (groups nest)."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class StorageServicer:
    def __init__(self, node: StorageNode, auth: Authenticator | None = None,
                 wall_ms: Callable[[], int] = _wall_ms) -> None:
        """``auth``: the dispatcher's authenticator, whose cluster tokens give the keys that
        client capabilities are checked with (None: no keys, so a caller that is not a service
        is refused every chunk); ``wall_ms`` is the clock capability expiries are read on."""
        self.node = node
        self.auth = auth if auth is not None else Authenticator()
        self.wall_ms = wall_ms

    def _authorize(self, chain_id: int, chunk_id: bytes, need: Access, capability: bytes) -> None:
        """A caller that is not a service reaches a chunk only with meta's capability for it
        (see :mod:`fs3.common.capability`); refused before anything is read or changed."""
        principal = current_principal()
        if principal.role == Role.SERVICE:
            return
        try:
            inode_id, index = parse_chunk_id(chunk_id)
        except InvalidArgument:
            raise PermissionDenied(f"chunk {chunk_id.hex()} is not a file's chunk: only services reach it") from None
        try:
            check_chunk_access(capability, self.auth.capability_keys, need=need, inode_id=inode_id,
                               chunk_index=index, chain_id=chain_id, now_ms=self.wall_ms(),
                               skew_ms=self.node.config.capability_skew_ms)
        except PermissionDenied as exc:
            log.info("refused %s of chunk %d/%d on chain %d to %r: %s", need.name, inode_id, index, chain_id,
                     principal, exc.message)
            raise

    async def update(self, req: spb.UpdateReq, payload: memoryview) -> tuple[spb.UpdateRsp, Buffer]:
        self._authorize(req.chain_id, req.chunk_id, Access.WRITE, req.capability)
        if req.capability:
            req.ClearField("capability")  # checked: the successors (services) are not sent it
        # A disk error inside the update fails its target (the node hears of it from the replica,
        # also when this request was cancelled meanwhile).
        return await self.node.replica_for_chain(req.chain_id).update(req, payload), _NO_PAYLOAD

    async def forward(self, req: spb.ForwardReq, payload: memoryview) -> tuple[spb.UpdateRsp, Buffer]:
        return await self.node.replica_for_chain(req.update.chain_id).forward(req, payload), _NO_PAYLOAD

    async def read(self, req: spb.ReadReq, payload: memoryview) -> tuple[spb.ReadRsp, Buffer]:
        self._authorize(req.chain_id, req.chunk_id, Access.READ, req.capability)
        replica = self.node.replica_for_chain(req.chain_id)
        try:
            return await replica.read(req)
        except IoError as exc:
            # A disk that fails a read fails its target too (the client reads another replica).
            self.node.fail_target(replica.target_id, exc)
            raise

    async def batch_read(self, req: spb.BatchReadReq, payload: memoryview) -> tuple[spb.BatchReadRsp, Buffer]:
        """Many pieces in one call, each checked and served exactly as :meth:`read` serves one.

        Bounds are checked before anything is read. A piece's own failure (a refused capability, a
        chain version this target is not on, a disk error, a chunk still being written) is its
        result, not the call's: the client reads just that piece again with ``Read``, which retries
        and fails over. Pieces are served concurrently, at most ``_BATCH_READ_CONCURRENCY`` at once.
        """
        pieces = req.pieces
        if len(pieces) > BATCH_READ_PIECES_MAX:
            raise InvalidArgument(f"{len(pieces)} pieces exceed {BATCH_READ_PIECES_MAX} per BatchRead")
        asked = sum(p.length for p in pieces)
        if asked > BATCH_READ_BYTES_MAX:
            raise InvalidArgument(f"{asked} bytes asked exceed {BATCH_READ_BYTES_MAX} per BatchRead")
        served: list[tuple[spb.BatchReadResult, Buffer]] = [(spb.BatchReadResult(), _NO_PAYLOAD)] * len(pieces)
        todo = iter(range(len(pieces)))

        async def worker() -> None:
            for index in todo:  # shared by the workers: each piece is taken once
                served[index] = await self._read_piece(req, pieces[index])

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(_BATCH_READ_CONCURRENCY, len(pieces))):
                    group.create_task(worker())
        except BaseExceptionGroup as failed:
            raise _first_leaf(failed) from None  # e.g. an invariant: the dispatcher must see it as it is
        rsp = spb.BatchReadRsp()
        rsp.results.extend(result for result, _ in served)
        return rsp, b"".join(data for _, data in served)

    async def _read_piece(self, batch: spb.BatchReadReq, piece: spb.BatchReadPiece) -> tuple[spb.BatchReadResult,
                                                                                              Buffer]:
        capabilities = batch.capabilities
        req = spb.ReadReq(chain_id=piece.chain_id, chain_version=piece.chain_version, chunk_id=piece.chunk_id,
                          offset=piece.offset, length=piece.length, dirty_policy=batch.dirty_policy,
                          verify_checksum=batch.verify_checksum,
                          capability=capabilities[piece.capability_index]
                          if piece.capability_index < len(capabilities) else b"")
        try:
            rsp, data = await self.read(req, memoryview(_NO_PAYLOAD))
        except InvariantViolation:
            raise  # the node must stop (the dispatcher sees it), not answer
        except FS3Error as exc:
            return spb.BatchReadResult(status=int(exc.code), message=exc.message), _NO_PAYLOAD
        return spb.BatchReadResult(length=rsp.length, version=rsp.version, checksum=rsp.checksum,
                                   chunk_length=rsp.chunk_length), data

    async def query_committed(self, req: spb.QueryCommittedReq,
                              payload: memoryview) -> tuple[spb.QueryCommittedRsp, Buffer]:
        return await self.node.replica_for_chain(req.chain_id).query_committed(req), _NO_PAYLOAD

    async def dump_chunk_meta(self, req: spb.DumpChunkMetaReq,
                              payload: memoryview) -> tuple[spb.DumpChunkMetaRsp, Buffer]:
        """Chunk metadata of one target, a page at a time; with ``data_checksums`` also the CRC32C of
        each committed version's bytes read back from disk (what ``fs3 admin verify`` compares)."""
        if req.limit > DUMP_CHUNKS_MAX:
            raise InvalidArgument(f"limit {req.limit} exceeds {DUMP_CHUNKS_MAX}")
        if len(req.chunk_ids) > DUMP_CHUNKS_MAX:
            raise InvalidArgument(f"{len(req.chunk_ids)} chunk ids exceed {DUMP_CHUNKS_MAX}")
        replica = self.node.replica_for_target(req.target_id, req.chain_id)
        limit = req.limit or 1000
        byte_budget = min(req.max_data_bytes or DUMP_DATA_BYTES_MAX, DUMP_DATA_BYTES_MAX)
        rsp = spb.DumpChunkMetaRsp(target_id=replica.target_id)
        for chunk_id, state in _listing(replica.engine, req, limit + 1):
            if len(rsp.chunks) == limit or (req.data_checksums and rsp.data_bytes >= byte_budget):
                rsp.more = True
                break
            meta = rsp.chunks.add(chunk_id=chunk_id)
            if req.data_checksums:
                state = await self._check_data(replica, chunk_id, state, meta, rsp)
            meta.commit_version, meta.pending_version = state.commit_version, state.pending_version
            meta.chain_version, meta.length, meta.checksum = state.chain_version, state.length, state.checksum
        return rsp, _NO_PAYLOAD

    async def _check_data(self, replica: TargetReplica, chunk_id: bytes, listed: ChunkState, meta: spb.ChunkMeta,
                          rsp: spb.DumpChunkMetaRsp) -> ChunkState:
        """Set ``meta``'s data fields from the committed bytes on disk; return the state they belong to.

        The read runs on the node's I/O pool while commits go on, so it counts only if the chunk's
        committed version is the same after the read as before (a commit may have replaced or
        patched the file under it) and no commit was rewriting the file meanwhile (a patch applied on
        the pool); otherwise it is retried, and finally left unchecked.
        """
        engine = replica.engine
        state = listed
        for _ in range(_DATA_READ_TRIES):
            current = engine.get(chunk_id)
            state = current if current is not None else ChunkState()  # removed since the listing
            if state.commit_version == 0 or state.length == 0:
                meta.data_checksum, meta.data_checked = crc32c(b""), True
                return state
            error = ""
            checksum = 0
            rewriting = replica.rewriting(chunk_id)
            try:
                checksum, size = await self.node.run_blocking(_read_crc, engine, chunk_id, state.commit_version,
                                                              state.length)
                rsp.data_bytes += size
            except FS3Error as exc:
                error = str(exc) or type(exc).__name__
            if _committed(engine.get(chunk_id)) == _committed(state) and not rewriting \
                    and not replica.rewriting(chunk_id):
                meta.data_checksum, meta.data_error, meta.data_checked = checksum, error, not error
                return state
        meta.data_checked = False
        return state

    async def sync_done(self, req: spb.SyncDoneReq, payload: memoryview) -> tuple[spb.SyncDoneRsp, Buffer]:
        self.node.sync_done(req)
        return spb.SyncDoneRsp(), _NO_PAYLOAD

    async def sync_channels(self, req: spb.SyncChannelsReq,
                            payload: memoryview) -> tuple[spb.SyncChannelsRsp, Buffer]:
        if len(req.records) > SYNC_RECORDS_MAX:
            raise InvalidArgument(f"{len(req.records)} records exceed {SYNC_RECORDS_MAX} per call")
        return spb.SyncChannelsRsp(merged=self.node.sync_channels(req)), _NO_PAYLOAD

    async def scrub_status(self, req: spb.ScrubStatusReq, payload: memoryview) -> tuple[spb.ScrubStatusRsp, Buffer]:
        return self.node.scrub_status(), _NO_PAYLOAD

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

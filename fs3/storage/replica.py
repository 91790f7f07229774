"""CRAQ chain replication for one storage target.

The protocol, as in the 3FS design notes:

* Clients write only to the chain head. Every target checks the request's chain version, takes
  the chunk lock, stores the update as pending version ``u = v + 1``, forwards it to its
  successor and commits once the successor answered; the tail commits first, the commit
  travels back as the RPC answers, and the client hears of success only after the whole chain
  committed.
* A successor that is syncing receives full-chunk replacements instead of the update itself.
* When forwarding fails the target waits for a new chain (mgmtd moves failed targets to the
  end and bumps the version) and forwards again to the new successor, within a retry budget.
* A head that finds an abandoned pending version (left by a write that was in flight when the
  previous head failed) first pushes it down the chain as a full-chunk replacement: some
  successor may already have committed it, so it must not be overwritten by another update
  carrying the same version number.
* Reads go to any serving replica. A dirty chunk (pending version present) is answered either
  with ``CHUNK_NOT_COMMITTED`` (3FS: the client retries) or, CRAQ's way, by asking the tail
  which version is committed and serving that one.

This module does no I/O of its own: the chunk engine, the chain view, the lease and the
network to other targets come from the :class:`ReplicaHost` the storage node provides (the
simulator provides another one). It reads no clock and draws no random numbers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fs3 import storage_pb2 as spb
from fs3.common.buffers import Buffer
from fs3.common.checksum import crc32c, crc32c_patch
from fs3.common.errors import (
    ChainVersionMismatch,
    ChannelSeqStale,
    ChecksumMismatch,
    ChunkNotCommitted,
    FS3Error,
    InvalidArgument,
    IoError,
    LeaseExpired,
    NoSpace,
    NotHead,
    StaleUpdate,
    TargetNotServing,
    Unavailable,
)
from fs3.common.ids import validate_chunk_id, validate_chunk_size
from fs3.common.invariant import ensure
from fs3.kv.group_sync import GroupSync
from fs3.mgmtd.chain_state import PublicState
from fs3.storage.chain_view import ChainMember, ChainView
from fs3.storage.chunk_engine import ChunkEngine, ChunkState

__all__ = ["DirtyReadPolicy", "ReplicaConfig", "ReplicaHost", "TargetReplica", "build_content"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class DirtyReadPolicy:
    RETRY = "retry"
    ASK_TAIL = "ask_tail"


@dataclass(frozen=True)
class ReplicaConfig:
    forward_timeout_ms: int = 5_000
    forward_retry_total_ms: int = 30_000
    routing_wait_ms: int = 200
    dirty_read_policy: str = DirtyReadPolicy.ASK_TAIL
    query_timeout_ms: int = 2_000
    # Pending versions at least this large are written by the host's I/O pool, so the event loop
    # keeps serving other requests meanwhile.
    offload_write_min_bytes: int = 64 * 1024
    # A write of at most this many bytes that lands inside a chunk at least twice its size is
    # staged as a patch of the committed version and applied in place at commit, instead of
    # copying the whole chunk into a new version (0: always copy).
    patch_max_bytes: int = 256 * 1024


class ReplicaHost(Protocol):
    """What a replica needs from the storage node around it."""

    def view(self, chain_id: int, target_id: int) -> ChainView | None: ...

    def lease_valid(self) -> bool: ...

    def now_ms(self) -> int: ...

    async def wait_routing_change(self, known_routing_version: int, timeout_ms: int) -> None: ...

    def request_routing_refresh(self) -> None: ...

    async def forward(self, member: ChainMember, req: spb.ForwardReq, payload: Buffer,
                      timeout_ms: int) -> spb.UpdateRsp: ...

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking file I/O; a real node uses a thread pool, the simulator runs it inline."""
        ...

    async def query_committed(self, member: ChainMember, req: spb.QueryCommittedReq,
                              timeout_ms: int) -> spb.QueryCommittedRsp: ...


def build_content(base: bytes | None, update: spb.UpdateReq, payload: Buffer) -> bytes | None:
    """The chunk's bytes after ``update`` (None: the chunk is removed). Pure."""
    if update.type == spb.REMOVE:
        return None
    current = base or b""
    if update.type == spb.TRUNCATE:
        if update.length <= len(current):
            return current[: update.length]
        return current + bytes(update.length - len(current))
    end = update.offset + update.length
    if update.offset == 0 and end >= len(current):
        # The write covers everything there was: no merge, and no copy when the payload owns bytes.
        if isinstance(payload, memoryview) and isinstance(payload.obj, bytes) and len(payload) == len(payload.obj):
            return payload.obj
        return bytes(payload)
    if update.offset == len(current):
        return current + bytes(payload)  # an append
    out = bytearray(max(len(current), end))
    out[: len(current)] = current
    out[update.offset : end] = payload
    return bytes(out)


# A new version's whole content, or how to produce it (a patch builds it only when needed).
ContentSource = bytes | None | Callable[[], bytes | None]

# Failures after which the same forward may succeed once the chain has been updated.
_RETRY_FORWARD = (Unavailable, ChainVersionMismatch, TargetNotServing, LeaseExpired, NotHead)
# Refusals that prove the successor did not apply the update: the pending version can be dropped.
_DEFINITIVE = (NoSpace, IoError, ChecksumMismatch, InvalidArgument)


class _ChunkLocks:
    """One asyncio lock per chunk id, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[bytes, tuple[asyncio.Lock, int]] = {}

    def held(self, chunk_id: bytes) -> bool:
        entry = self._locks.get(chunk_id)
        return entry is not None and entry[0].locked()

    @asynccontextmanager
    async def hold(self, chunk_id: bytes) -> AsyncIterator[None]:
        lock, users = self._locks.get(chunk_id, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[chunk_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[chunk_id]
            if users <= 1:
                del self._locks[chunk_id]
            else:
                self._locks[chunk_id] = (lock, users - 1)


class TargetReplica:
    """The CRAQ logic of one storage target."""

    def __init__(self, target_id: int, engine: ChunkEngine, host: ReplicaHost,
                 config: ReplicaConfig | None = None) -> None:
        self.target_id = target_id
        self.engine = engine
        self.host = host
        self.config = config or ReplicaConfig()
        self.locks = _ChunkLocks()
        self._inflight: dict[tuple[bytes, int], tuple[int, asyncio.Future[spb.UpdateRsp]]] = {}
        self._repairs: dict[bytes, asyncio.Task[None]] = {}
        # Group commit of the target's log: writes on the hot path are made unsynced and share
        # one fsync, off the event loop (a real node's I/O pool; inline in the simulator).
        self._log_sync = GroupSync(lambda: host.run_blocking(engine.kv.sync_wal))

    # -- helpers -----------------------------------------------------------------------------

    def _view(self, chain_id: int) -> ChainView:
        view = self.host.view(chain_id, self.target_id)
        if view is None or view.me is None:
            raise TargetNotServing(f"target {self.target_id} is not in chain {chain_id}")
        return view

    def _check_chain_version(self, view: ChainView, version: int, what: str) -> None:
        """Requests must carry this target's chain version; a newer one means our routing lags."""
        if version != view.chain_version:
            if version > view.chain_version:
                self.host.request_routing_refresh()
            raise ChainVersionMismatch(f"chain {view.chain_id} is at v{view.chain_version} on target "
                                       f"{self.target_id}, {what} has v{version}")

    def _require_lease(self) -> None:
        if not self.host.lease_valid():
            raise LeaseExpired(f"target {self.target_id}: no contact with mgmtd within the lease")

    @staticmethod
    def _rsp(state: ChunkState | None) -> spb.UpdateRsp:
        if state is None:
            return spb.UpdateRsp()
        return spb.UpdateRsp(commit_version=state.commit_version, chunk_length=state.length,
                             chunk_checksum=state.checksum)

    def _base(self, chunk_id: bytes, state: ChunkState | None) -> bytes | None:
        if state is None or state.commit_version == 0:
            return None
        return self.engine.read(chunk_id, state.commit_version, 0, state.length)

    @staticmethod
    def _content_checksum(update: spb.UpdateReq, content: bytes | None) -> int:
        """CRC32C of the new chunk content, reusing the payload's (verified) CRC for whole writes."""
        if content is None:
            return 0
        if update.type == spb.WRITE and update.offset == 0 and len(content) == update.length:
            return int(update.checksum)
        return crc32c(content)

    def _patchable(self, state: ChunkState | None, update: spb.UpdateReq) -> bool:
        """Whether ``update`` can be a patch: a small write inside a committed, larger chunk."""
        return (update.type == spb.WRITE and state is not None and state.commit_version > 0
                and not state.pending_version and 0 < update.length <= self.config.patch_max_bytes
                and update.offset + update.length <= state.length and 2 * update.length <= state.length)

    def _stage_patch(self, chunk_id: bytes, state: ChunkState, version: int, update: spb.UpdateReq, payload: Buffer,
                     chain_version: int) -> tuple[Callable[[], bytes | None], int, int]:
        """Stage the write as a patch; returns how to get the whole new content (only a successor
        being synced needs it), its checksum (derived from the old one without a reread), and the
        ticket of the log sync that makes the patch's undo record durable (started at once, so
        it overlaps the forward to the successor)."""
        new = bytes(payload)
        old = self.engine.read(chunk_id, state.commit_version, update.offset, len(new))
        checksum = crc32c_patch(state.checksum, state.length, update.offset, old, new)
        self.engine.stage_patch(chunk_id, version, update.offset, new, old, checksum, chain_version,
                                defer_sync=True)
        return (lambda: self.engine.read(chunk_id, version, 0, state.length)), checksum, self._log_written()

    async def _commit(self, chain_id: int, chunk_id: bytes, version: int, patch_ticket: int | None,
                      channel: tuple[bytes, int, int] | None) -> ChunkState | None:
        """Commit and make it durable before the caller acknowledges: the log is synced with
        whatever else was written meanwhile (group commit), off the event loop."""
        chain_version = self._view(chain_id).chain_version  # as of the successor's answer
        if patch_ticket is not None:
            await self._log_sync.wait(patch_ticket)
        new = self.engine.commit(chunk_id, version, chain_version, channel, defer_sync=True,
                                 patch_synced=patch_ticket is not None)
        await self._log_sync.wait(self._log_written())
        return new

    def _log_written(self) -> int:
        """A group-sync ticket for a write just made unsynced (0, nothing to wait for, when the
        target does not sync commits at all)."""
        return self._log_sync.written() if self.engine.sync_commits else 0

    @staticmethod
    def validate_update(req: spb.UpdateReq, payload: Buffer, check_crc: bool = True) -> None:
        validate_chunk_id(req.chunk_id)
        validate_chunk_size(req.chunk_size)
        if req.type == spb.WRITE:
            if req.length != len(payload):
                raise InvalidArgument(f"length {req.length} but {len(payload)} payload bytes")
            if req.offset + req.length > req.chunk_size:
                raise InvalidArgument(f"write [{req.offset}, {req.offset + req.length}) past chunk size "
                                      f"{req.chunk_size}")
            if check_crc and crc32c(payload) != req.checksum:
                raise ChecksumMismatch("payload checksum does not match")
        elif req.type == spb.TRUNCATE:
            if req.length > req.chunk_size:
                raise InvalidArgument(f"truncate to {req.length} past chunk size {req.chunk_size}")
            if len(payload):
                raise InvalidArgument("truncate carries no payload")
        elif req.type == spb.REMOVE:
            if len(payload):
                raise InvalidArgument("remove carries no payload")
        else:
            raise InvalidArgument(f"unknown update type {req.type}")

    # -- client writes (head) ----------------------------------------------------------------

    async def update(self, req: spb.UpdateReq, payload: Buffer) -> spb.UpdateRsp:
        self.validate_update(req, payload)
        self._require_lease()
        view = self._view(req.chain_id)
        if view.my_state is not PublicState.SERVING:
            raise TargetNotServing(f"target {self.target_id} is {view.my_state.name.lower()}")
        if not view.is_head:
            raise NotHead(f"target {self.target_id} is not the head of chain {req.chain_id}")
        self._check_chain_version(view, req.chain_version, "request")
        if not req.client_id:
            return await self._update_locked(req, payload, None)
        key = (req.client_id, req.channel_id)
        record = self.engine.channel(req.client_id, req.channel_id)
        if record is not None:
            if record.seq == req.seq:
                return spb.UpdateRsp(commit_version=record.commit_version, chunk_length=record.length,
                                     chunk_checksum=record.checksum)
            if record.seq > req.seq:
                raise ChannelSeqStale(f"channel {req.channel_id} is at seq {record.seq}, request has {req.seq}")
        inflight = self._inflight.get(key)
        if inflight is not None:
            seq, future = inflight
            if seq == req.seq:
                return await asyncio.shield(future)
            if seq > req.seq:
                raise ChannelSeqStale(f"channel {req.channel_id} is at seq {seq}, request has {req.seq}")
        future = asyncio.get_running_loop().create_future()
        self._inflight[key] = (req.seq, future)
        try:
            rsp = await self._update_locked(req, payload, (req.client_id, req.channel_id, req.seq))
            future.set_result(rsp)
            return rsp
        except BaseException as exc:
            future.set_exception(exc if isinstance(exc, Exception) else Unavailable("cancelled"))
            future.exception()  # mark retrieved
            raise
        finally:
            if self._inflight.get(key, (None, None))[1] is future:
                del self._inflight[key]

    async def _update_locked(self, req: spb.UpdateReq, payload: Buffer,
                             channel: tuple[bytes, int, int] | None) -> spb.UpdateRsp:
        async with self.locks.hold(req.chunk_id):
            state = self.engine.get(req.chunk_id)
            if state is not None and state.pending_version:
                state = await self._repair_pending(req.chain_id, req.chunk_id, state)
            if req.type == spb.REMOVE and state is None:
                return spb.UpdateRsp()
            view = self._view(req.chain_id)
            version = (state.commit_version if state else 0) + 1
            source: ContentSource
            patch_ticket: int | None = None
            if state is not None and self._patchable(state, req):
                source, checksum, patch_ticket = self._stage_patch(req.chunk_id, state, version, req, payload,
                                                                   view.chain_version)
            else:
                whole = build_content(self._base(req.chunk_id, state), req, payload)
                checksum = self._content_checksum(req, whole)
                await self._stage(req.chunk_id, version, whole, checksum, view.chain_version)
                source = whole
            fwd = spb.ForwardReq(update=req, update_version=version)
            try:
                await self._propagate(req.chain_id, fwd, payload, source, checksum)
            except _DEFINITIVE:
                self.engine.abort(req.chunk_id, version)
                raise
            except FS3Error:
                # Some successor may have committed it: finish it later, never drop it.
                self.schedule_repair(req.chain_id, req.chunk_id)
                raise
            new = await self._commit(req.chain_id, req.chunk_id, version, patch_ticket, channel)
            return self._rsp(new)

    async def _stage(self, chunk_id: bytes, version: int, content: bytes | None, checksum: int,
                     chain_version: int) -> None:
        """Stage a pending version; large data is written off the event loop (under the chunk lock)."""
        if content is not None and len(content) >= self.config.offload_write_min_bytes:
            self.engine.drop_pending(chunk_id)
            await self.host.run_blocking(self.engine.write_blob, chunk_id, version, content)
            self.engine.stage(chunk_id, version, content, checksum, chain_version, blob_written=True)
        else:
            self.engine.stage(chunk_id, version, content, checksum, chain_version)

    def schedule_repair(self, chain_id: int, chunk_id: bytes) -> None:
        """Complete an abandoned pending version in the background while this target is the head."""
        if chunk_id in self._repairs:
            return
        task = asyncio.get_running_loop().create_task(self._repair_loop(chain_id, chunk_id))
        self._repairs[chunk_id] = task
        task.add_done_callback(lambda _t: self._repairs.pop(chunk_id, None))

    def repair_abandoned(self, chain_id: int) -> None:
        """Called when the chain changes: a new head completes what the old one left in flight."""
        view = self.host.view(chain_id, self.target_id)
        if view is None or not view.is_head:
            return
        for chunk_id in self.engine.pending_chunks():
            if not self.locks.held(chunk_id):
                self.schedule_repair(chain_id, chunk_id)

    async def _repair_loop(self, chain_id: int, chunk_id: bytes) -> None:
        delay_ms = self.config.routing_wait_ms
        while True:
            await asyncio.sleep(delay_ms / 1000)
            view = self.host.view(chain_id, self.target_id)
            if view is None or not view.is_head:
                return
            try:
                async with self.locks.hold(chunk_id):
                    state = self.engine.get(chunk_id)
                    if state is None or not state.pending_version:
                        return
                    self._require_lease()
                    await self._repair_pending(chain_id, chunk_id, state)
                    return
            except _DEFINITIVE as exc:
                log.error("target %d: cannot complete pending version of chunk %s: %s", self.target_id,
                          chunk_id.hex(), exc)
                return
            except FS3Error:
                delay_ms = min(delay_ms * 2, 5_000)

    async def _repair_pending(self, chain_id: int, chunk_id: bytes, state: ChunkState) -> ChunkState | None:
        """Push an abandoned pending version down the chain, then commit it here."""
        log.info("target %d: completing abandoned pending v%d of chunk %s", self.target_id,
                 state.pending_version, chunk_id.hex())
        content = None
        if not state.pending_remove:
            content = self.engine.read(chunk_id, state.pending_version, 0, state.pending_length)
        fwd = spb.ForwardReq(update=spb.UpdateReq(chain_id=chain_id, chunk_id=chunk_id, type=spb.WRITE),
                             update_version=state.pending_version, full_chunk_replace=True)
        await self._propagate(chain_id, fwd, b"", content, state.pending_checksum, force_full=True)
        return self.engine.commit(chunk_id, state.pending_version, self._view(chain_id).chain_version)

    async def _propagate(self, chain_id: int, fwd: spb.ForwardReq, payload: Buffer, content: ContentSource,
                         checksum: int, force_full: bool = False) -> None:
        """Forward an update to the successor until it is committed downstream (or give up)."""
        deadline_ms = self.host.now_ms() + self.config.forward_retry_total_ms
        last_error: FS3Error | None = None
        while True:
            self._require_lease()
            view = self._view(chain_id)
            if not view.my_state.writable:
                raise TargetNotServing(f"target {self.target_id} left the write path of chain {chain_id}")
            successor = view.successor()
            if successor is None:
                return
            req = spb.ForwardReq()
            req.CopyFrom(fwd)
            req.chain_version = view.chain_version
            req.from_target_id = self.target_id
            body: Buffer = payload
            if force_full or successor.state is PublicState.SYNCING:
                whole = content() if callable(content) else content
                req.full_chunk_replace = True
                req.remove = whole is None
                req.chunk_length = len(whole) if whole is not None else 0
                req.chunk_checksum = checksum
                req.chunk_chain_version = view.chain_version
                body = whole or b""
            try:
                await self.host.forward(successor, req, body, self.config.forward_timeout_ms)
                return
            except _RETRY_FORWARD as exc:
                last_error = exc
            except IoError as exc:
                # The successor's disk failed, not ours: it reports its target offline and mgmtd
                # takes it out of the chain, after which the write goes on without it.
                last_error = exc
            except FS3Error as exc:
                if exc.code.name == "TIMEOUT":
                    last_error = exc
                else:
                    raise
            if self.host.now_ms() >= deadline_ms:
                raise Unavailable(f"chain {chain_id}: forwarding to successor failed for "
                                  f"{self.config.forward_retry_total_ms} ms: {last_error}")
            await self.host.wait_routing_change(view.routing_version, self.config.routing_wait_ms)

    # -- chain forwards (non-head) -----------------------------------------------------------

    async def forward(self, req: spb.ForwardReq, payload: Buffer) -> spb.UpdateRsp:
        update = req.update
        validate_chunk_id(update.chunk_id)
        self._require_lease()
        view = self._view(update.chain_id)
        if not view.my_state.writable:
            raise TargetNotServing(f"target {self.target_id} is {view.my_state.name.lower()}")
        self._check_chain_version(view, req.chain_version, "forward")
        predecessor = view.predecessor()
        if predecessor is None or predecessor.target_id != req.from_target_id:
            raise StaleUpdate(f"target {req.from_target_id} is not the predecessor of {self.target_id}")
        if req.full_chunk_replace:
            if req.remove:
                if len(payload):
                    raise InvalidArgument("a removal carries no payload")
            elif len(payload) != req.chunk_length or crc32c(payload) != req.chunk_checksum:
                raise ChecksumMismatch("full-chunk replacement does not match its length or checksum")
        else:
            if update.type == spb.WRITE and crc32c(payload) != update.checksum:
                raise ChecksumMismatch("forwarded payload checksum does not match")
        async with self.locks.hold(update.chunk_id):
            return await self._apply_forward(req, payload)

    async def _apply_forward(self, req: spb.ForwardReq, payload: Buffer) -> spb.UpdateRsp:
        update, version = req.update, req.update_version
        chunk_id = update.chunk_id
        state = self.engine.get(chunk_id)
        committed = state.commit_version if state else 0
        view = self._view(update.chain_id)
        successor = view.successor()
        if req.full_chunk_replace and (req.is_sync or successor is None):
            # End of the write path (a syncing target, or the tail during a repair): install directly.
            content = None if req.remove else bytes(payload)
            if state is not None and content is not None and state.commit_version == version \
                    and not state.pending_version and state.checksum == req.chunk_checksum \
                    and state.length == req.chunk_length:
                return self._rsp(state)
            new = self.engine.replace(chunk_id, version, req.chunk_chain_version or view.chain_version, content,
                                      req.chunk_checksum)
            return self._rsp(new)
        removal = req.remove if req.full_chunk_replace else update.type == spb.REMOVE
        if removal and state is None:
            # Removed here already (or never existed), hence downstream too: a re-forward.
            return spb.UpdateRsp()
        if committed == version:
            # Already committed here, hence downstream too (commits travel tail first): a re-forward.
            return self._rsp(state)
        if committed != version - 1:
            raise StaleUpdate(f"chunk {chunk_id.hex()}: update v{version} on committed v{committed}")
        source: ContentSource
        patch_ticket: int | None = None
        if req.full_chunk_replace:
            source = None if req.remove else bytes(payload)
            checksum = req.chunk_checksum
            await self._stage(chunk_id, version, source, checksum, view.chain_version)
        else:
            self.validate_update(update, payload, check_crc=False)  # forward() verified the CRC
            if state is not None and self._patchable(state, update):
                source, checksum, patch_ticket = self._stage_patch(chunk_id, state, version, update, payload,
                                                                   view.chain_version)
            else:
                whole = build_content(self._base(chunk_id, state), update, payload)
                checksum = self._content_checksum(update, whole)
                await self._stage(chunk_id, version, whole, checksum, view.chain_version)
                source = whole
        fwd = spb.ForwardReq(update=update, update_version=version)
        try:
            await self._propagate(update.chain_id, fwd, payload if not req.full_chunk_replace else b"", source,
                                  checksum, force_full=req.full_chunk_replace)
        except _DEFINITIVE:
            self.engine.abort(chunk_id, version)
            raise
        channel = (update.client_id, update.channel_id, update.seq) if update.client_id else None
        new = await self._commit(update.chain_id, chunk_id, version, patch_ticket, channel)
        return self._rsp(new)

    # -- reads -------------------------------------------------------------------------------

    async def read(self, req: spb.ReadReq) -> tuple[spb.ReadRsp, bytes]:
        validate_chunk_id(req.chunk_id)
        self._require_lease()
        view = self._view(req.chain_id)
        if view.my_state is not PublicState.SERVING:
            raise TargetNotServing(f"target {self.target_id} is {view.my_state.name.lower()}")
        if req.chain_version:
            self._check_chain_version(view, req.chain_version, "read")
        state = self.engine.get(req.chunk_id)
        version, length, checksum = self._readable_version(state)
        if state is not None and state.pending_version:
            version, length, checksum = await self._resolve_dirty(req, view, state)
        if version == 0:
            return spb.ReadRsp(length=0, version=0, checksum=crc32c(b""), chunk_length=0), b""
        if req.verify_checksum:
            whole = self.engine.read(req.chunk_id, version, 0, length)
            if crc32c(whole) != checksum:
                raise ChecksumMismatch(f"chunk {req.chunk_id.hex()} v{version} fails its checksum on target "
                                       f"{self.target_id}")
        data = self.engine.read(req.chunk_id, version, req.offset, min(req.length, max(0, length - req.offset)))
        return spb.ReadRsp(length=len(data), version=version, checksum=crc32c(data), chunk_length=length), data

    @staticmethod
    def _readable_version(state: ChunkState | None) -> tuple[int, int, int]:
        if state is None:
            return 0, 0, 0
        return state.commit_version, state.length, state.checksum

    async def _resolve_dirty(self, req: spb.ReadReq, view: ChainView, state: ChunkState) -> tuple[int, int, int]:
        policy = {
            spb.DIRTY_READ_RETRY: DirtyReadPolicy.RETRY,
            spb.DIRTY_READ_ASK_TAIL: DirtyReadPolicy.ASK_TAIL,
        }.get(req.dirty_policy, self.config.dirty_read_policy)
        if policy == DirtyReadPolicy.RETRY and self.locks.held(req.chunk_id):
            raise ChunkNotCommitted(f"chunk {req.chunk_id.hex()} has a write in flight")
        # The last serving target is the authority: it commits after every target behind it on
        # the write path (a syncing one included) and before every serving target ahead of it.
        serving = view.serving
        if not serving:
            raise ChunkNotCommitted("chain has no serving target")
        tail = serving[-1]
        if tail.target_id == self.target_id:
            # The last serving target with a pending version cannot tell whether a tail that has
            # since failed already committed (and served) it: wait for the write to settle.
            raise ChunkNotCommitted(f"chunk {req.chunk_id.hex()} is being written at the tail")
        rsp = await self.host.query_committed(tail, spb.QueryCommittedReq(chain_id=req.chain_id,
                                                                          chunk_id=req.chunk_id),
                                              self.config.query_timeout_ms)
        if rsp.undecided:
            raise ChunkNotCommitted(f"chunk {req.chunk_id.hex()} is being written at the tail")
        current = self.engine.get(req.chunk_id)
        if current is None:
            return 0, 0, 0
        tail_version = rsp.commit_version if rsp.exists else 0
        if tail_version == current.commit_version:
            return self._readable_version(current)
        if current.pending_version and tail_version == current.pending_version:
            if current.pending_remove:
                return 0, 0, 0
            return current.pending_version, current.pending_length, current.pending_checksum
        if not rsp.exists and current.pending_remove:
            return 0, 0, 0
        raise ChunkNotCommitted(f"chunk {req.chunk_id.hex()} is changing; try again")

    async def query_committed(self, req: spb.QueryCommittedReq) -> spb.QueryCommittedRsp:
        self._require_lease()
        view = self._view(req.chain_id)
        ensure(view.me is not None, "query for a chain this target is not in")
        if not view.my_state.writable:
            raise TargetNotServing(f"target {self.target_id} is {view.my_state.name.lower()}")
        state = self.engine.get(req.chunk_id)
        if state is None:
            return spb.QueryCommittedRsp(exists=False)
        return spb.QueryCommittedRsp(commit_version=state.commit_version, exists=True,
                                     undecided=bool(state.pending_version))

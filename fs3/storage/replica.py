"""CRAQ chain replication for one storage target: the async shell around the update machine.

The protocol, as in the 3FS design notes:

* Clients write only to the chain head. Every target checks the request's chain version, takes
  the chunk lock, stores the update as a pending version, forwards it to its successor and commits
  once the successor answered; the tail commits first, the commit travels back as the RPC
  answers, and the client hears of success only after the whole chain committed.
* A successor that is syncing receives full-chunk replacements instead of the update itself.
* When forwarding fails the target waits for a new chain (mgmtd moves failed targets to the
  end and bumps the version) and forwards again to the new successor, within a retry budget.
* A head that finds an abandoned pending version (left by a write that was in flight when the
  previous head failed) first pushes it down the chain as a full-chunk replacement and commits it,
  with its request's exactly-once record: some successor may already have committed it.
* Reads go to any serving replica. A dirty chunk (pending version present) is answered either
  with ``CHUNK_NOT_COMMITTED`` (3FS: the client retries) or, CRAQ's way, by asking the tail
  which version is committed and serving that one.

What to do with an update is decided by :class:`fs3.storage.craq.UpdateMachine` (pure, shared by
the head and its successors); this module carries out its effects — the chunk engine, the chain
view, the lease and the network to other targets come from the :class:`ReplicaHost` the storage
node provides (the simulator provides another one). It reads no clock and draws no random numbers.

**An update runs to completion.** Its body runs as a task of its own that the request only waits
for: a request cancelled by a deadline or a closed connection never releases the chunk lock while
the update's I/O (a blob written on the I/O pool, a forward in flight) is still running, and never
leaves a pending version half staged. A retry of the same request waits for the same task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
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
    ResourceExhausted,
    StaleUpdate,
    StatusCode,
    TargetNotServing,
    Unavailable,
)
from fs3.common.ids import validate_chunk_id, validate_chunk_size
from fs3.common.invariant import ensure
from fs3.common.retry import Attempts, Backoff, RetryPolicy
from fs3.common.target_state import PublicState
from fs3.kv.group_sync import GroupSync
from fs3.storage.chain_view import ChainMember, ChainView
from fs3.storage.chunk_engine import (
    Channel,
    ChannelRecord,
    ChunkEngine,
    ChunkState,
)
from fs3.storage.craq import (
    Abort,
    AwaitRouting,
    ChunkFacts,
    Commit,
    CompletePending,
    Effect,
    Fail,
    Forward,
    Install,
    Kind,
    Outcome,
    PathFacts,
    Reply,
    Source,
    Stage,
    StageAndForward,
    UpdateMachine,
    UpdateRequest,
    classify,
)
from fs3.storage.limits import CHUNK_SIZE_MAX_BYTES, CLIENT_ID_MAX_BYTES, VERSION_MAX

__all__ = ["DirtyReadPolicy", "ReplicaConfig", "ReplicaHost", "TargetReplica", "build_content"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Reads of a chunk retried because a commit changed it under a read on the I/O pool; past them the
# client is told to try again (CHUNK_NOT_COMMITTED), as for a chunk being written.
_READ_TRIES = 3


# Retries of an abandoned pending version's completion back off up to this.
_REPAIR_BACKOFF_MAX_MS = 5_000


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
    # Pending versions at least this large are written by the host's I/O pool, and their commit's
    # blob work (a patch applied in place, the file's fdatasync) runs there too, so the event loop
    # keeps serving other requests meanwhile.
    offload_write_min_bytes: int = 64 * 1024
    # Reads of file-held versions at least this large run on the host's I/O pool (see
    # docs/decisions.md, "Chunk reads and commit syncs off the event loop", for the measurement).
    offload_read_min_bytes: int = 64 * 1024
    # A smaller read of a file-held version runs on the event loop only when its bytes are in the
    # page cache (RWF_NOWAIT), else on the I/O pool too, so a cold read never stalls the loop
    # (docs/decisions.md, "Small chunk reads: on the loop only from the page cache"). Off: every
    # smaller read on the event loop, cached or not (the placement before; for comparisons).
    small_read_nowait: bool = True
    # Passes of the event loop a cold small read waits for the readahead its miss started before
    # it goes to the I/O pool (0: straight to the pool).
    small_read_polls: int = 16
    # A write of at most this many bytes that lands inside a chunk at least twice its size is
    # staged as a patch of the committed version and applied in place at commit, instead of
    # copying the whole chunk into a new version (0: always copy).
    patch_max_bytes: int = 256 * 1024
    # Updates (client writes, forwards) running on this target at once, and the payload bytes they
    # hold; more are refused with RESOURCE_EXHAUSTED (the client backs off and retries). An update
    # keeps running when its request is cancelled, so these bound what cancelled requests can pile up.
    updates_inflight_max: int = 4096
    updates_inflight_bytes_max: int = 1 << 30
    # Exactly-once records live this long after their request committed. The head refuses a retry
    # sent more than half of it after the request's first attempt, so no retry outlives its record.
    channel_record_ttl_ms: int = 600_000
    # Forward an update to the successor while it is staged here (both end before the commit), so
    # a chain's write takes about one disk write plus the transfers instead of one disk write per
    # replica (docs/performance.md, "Pipelined forwarding"). Off: stage, then forward.
    pipeline_forward: bool = True

    def validate(self) -> None:
        if self.dirty_read_policy not in (DirtyReadPolicy.ASK_TAIL, DirtyReadPolicy.RETRY):
            raise InvalidArgument(f"dirty_read_policy {self.dirty_read_policy!r}: expected ask_tail or retry")
        if self.channel_record_ttl_ms < 4 * self.forward_retry_total_ms:
            raise InvalidArgument("channel_record_ttl_ms must be at least 4 x forward_retry_total_ms "
                                  "(retries within half of it must still find their record)")
        if not 0 <= self.small_read_polls <= 1024:
            raise InvalidArgument("small_read_polls must be within [0, 1024]")
        if self.updates_inflight_max < 1 or self.updates_inflight_bytes_max < 64 << 20:
            raise InvalidArgument("updates_inflight_max must be >= 1 and updates_inflight_bytes_max >= 64 MiB")
        if self.routing_wait_ms < 1 or self.forward_timeout_ms < 1 or self.query_timeout_ms < 1:
            raise InvalidArgument("routing_wait_ms, forward_timeout_ms and query_timeout_ms must be positive")

    @property
    def forward_retry(self) -> RetryPolicy:
        """A forward whose outcome is unknown is sent again once the routing changes (or after the
        routing wait), for at most ``forward_retry_total_ms``."""
        return RetryPolicy(backoff_base_ms=self.routing_wait_ms, backoff_max_ms=self.routing_wait_ms,
                           backoff=Backoff.CONSTANT, deadline_ms=self.forward_retry_total_ms)

    @property
    def repair_retry(self) -> RetryPolicy:
        """A head retries completing an abandoned pending version while it stays the head."""
        return RetryPolicy(backoff_base_ms=self.routing_wait_ms,
                           backoff_max_ms=max(_REPAIR_BACKOFF_MAX_MS, self.routing_wait_ms))


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
        """Run blocking file I/O (a real node: a thread pool). Must not return — not even when the
        caller is cancelled — before ``fn`` has finished: callers hold chunk locks over it."""
        ...

    async def query_committed(self, member: ChainMember, req: spb.QueryCommittedReq,
                              timeout_ms: int) -> spb.QueryCommittedRsp: ...

    def update_finished(self, target_id: int, error: BaseException | None) -> None:
        """An update or forward this target admitted has ended (``error``: how it failed)."""
        ...

    def fail_target(self, target_id: int, exc: FS3Error) -> None:
        """The target's disk failed it (or it cannot hold what its successors committed): it reports
        itself offline, and mgmtd takes it out of its chain until it is resynced."""
        ...


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

_KIND = {spb.WRITE: Kind.WRITE, spb.TRUNCATE: Kind.TRUNCATE, spb.REMOVE: Kind.REMOVE}


@dataclass
class _Op:
    """One update being carried out on this target: what the machine's effects act on."""

    chain_id: int
    chunk_id: bytes
    source: Source
    update: spb.UpdateReq  # what is forwarded (a client's request carries its exactly-once channel)
    payload: Buffer  # the update's bytes, or the whole chunk for a full replace
    channel: Channel | None = None
    content: ContentSource = None  # the new version's whole content, once staged
    checksum: int = 0  # CRC32C of the new content
    remove: bool = False  # a full replace of a chunk that no longer exists
    chunk_chain_version: int = 0  # a full replace: the chain version stored with the chunk
    patch_ticket: int | None = None  # the log sync that makes a staged patch's undo record durable

    def whole(self) -> bytes | None:
        return self.content() if callable(self.content) else self.content


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
        self._updates: set[asyncio.Task[Any]] = set()
        self._updates_bytes = 0
        # Chunks whose committed blob a commit is rewriting on the I/O pool (a patch applied in
        # place): readers wait for the event instead of reading a half-patched or renamed file.
        self._rewriting: dict[bytes, asyncio.Event] = {}
        # Chunks whose update went to the successor before (or without) a pending version here:
        # while one is in this set, this target's committed copy may be older than a successor's,
        # so reads treat the chunk as dirty (see craq.Fail.behind).
        self._unstaged: set[bytes] = set()
        # Group commit of the target's log: writes on the hot path are made unsynced and share
        # one fsync, off the event loop (a real node's I/O pool; inline in the simulator).
        self._log_sync = GroupSync(lambda: host.run_blocking(engine.sync_log))

    async def stop(self) -> None:
        """Cancel running updates and repairs (each still waits for I/O it started)."""
        tasks = [*self._updates, *self._repairs.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

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
        if state is None or not state.commit_version:
            return spb.UpdateRsp()
        return spb.UpdateRsp(commit_version=state.commit_version, chunk_length=state.length,
                             chunk_checksum=state.checksum)

    @staticmethod
    def _record_rsp(record: ChannelRecord) -> spb.UpdateRsp:
        return spb.UpdateRsp(commit_version=record.commit_version, chunk_length=record.length,
                             chunk_checksum=record.checksum)

    def _chunk_facts(self, chunk_id: bytes) -> ChunkFacts:
        state = self.engine.get(chunk_id)
        if state is None:
            return ChunkFacts()
        return ChunkFacts(state.commit_version, state.pending_version, state.length)

    def _path(self, chain_id: int) -> PathFacts:
        view = self.host.view(chain_id, self.target_id)
        if view is None or view.me is None:
            return PathFacts(writable=False, lease_valid=self.host.lease_valid())
        successor = view.successor()
        return PathFacts(writable=view.my_state.writable, head=view.is_head, lease_valid=self.host.lease_valid(),
                         successor=successor.target_id if successor else 0,
                         successor_syncing=successor is not None and successor.state is PublicState.SYNCING,
                         routing_version=view.routing_version)

    def _machine(self, request: UpdateRequest) -> UpdateMachine:
        return UpdateMachine(request, patch_max_bytes=self.config.patch_max_bytes,
                             retry_total_ms=self.config.forward_retry_total_ms,
                             pipeline=self.config.pipeline_forward)

    async def _base(self, chunk_id: bytes, state: ChunkState | None) -> bytes | None:
        if state is None or state.commit_version == 0:
            return None
        if state.commit_inline or state.length < self.config.offload_write_min_bytes:
            return self.engine.read(chunk_id, state.commit_version, 0, state.length)
        return await self.host.run_blocking(self.engine.read, chunk_id, state.commit_version, 0, state.length)

    @staticmethod
    def _content_checksum(update: spb.UpdateReq, content: bytes | None) -> int:
        """CRC32C of the new chunk content, reusing the payload's (verified) CRC for whole writes."""
        if content is None:
            return 0
        if update.type == spb.WRITE and update.offset == 0 and len(content) == update.length:
            return int(update.checksum)
        return crc32c(content)

    def _log_written(self) -> int:
        """A group-sync ticket for a write just made unsynced (0, nothing to wait for, when the
        target does not sync commits at all)."""
        return self._log_sync.written() if self.engine.sync_commits else 0

    async def _durable(self) -> None:
        """Wait until everything written so far is durable."""
        if self.engine.sync_commits:
            await self._log_sync.wait(self._log_sync.last_ticket)

    def _start(self, coro: Coroutine[Any, Any, T], payload_bytes: int) -> asyncio.Task[T]:
        """Run an update body as a task of its own (see the module docstring), within the bounds."""
        if len(self._updates) >= self.config.updates_inflight_max or (
                self._updates and self._updates_bytes + payload_bytes > self.config.updates_inflight_bytes_max):
            coro.close()
            raise ResourceExhausted(f"target {self.target_id} has {len(self._updates)} updates of "
                                    f"{self._updates_bytes} bytes in flight")
        task = asyncio.get_running_loop().create_task(coro)
        self._updates.add(task)
        self._updates_bytes += payload_bytes

        def done(finished: asyncio.Task[T]) -> None:
            self._updates.discard(finished)
            self._updates_bytes -= payload_bytes
            # Each update gives back exactly what it was charged: below zero, the admission bound
            # (updates_inflight_bytes_max) would admit more than it says.
            ensure(self._updates_bytes >= 0, f"target {self.target_id} holds {self._updates_bytes} update bytes")
            error = None if finished.cancelled() else finished.exception()
            self.host.update_finished(self.target_id, error)

        task.add_done_callback(done)
        return task

    @staticmethod
    def _charge(update: spb.UpdateReq, payload: Buffer) -> int:
        """Bytes an update may hold while it runs: its payload, plus — unless it is a removal — two
        whole chunks: a write that cannot be patched in place reads the old one and builds a new one."""
        return len(payload) + (0 if update.type == spb.REMOVE else 2 * update.chunk_size)

    @property
    def unstaged(self) -> frozenset[bytes]:
        """Chunks dirty here without a pending version: their update went to the successor before
        (or without) its stage here succeeding. Reads of them ask the tail, as for a pending version."""
        return frozenset(self._unstaged)

    @property
    def updates_running(self) -> int:
        return len(self._updates)

    @staticmethod
    def validate_update(req: spb.UpdateReq, payload: Buffer, check_crc: bool = True) -> None:
        validate_chunk_id(req.chunk_id)
        validate_chunk_size(req.chunk_size)
        if len(req.client_id) > CLIENT_ID_MAX_BYTES:
            raise InvalidArgument(f"client id of {len(req.client_id)} bytes exceeds {CLIENT_ID_MAX_BYTES}")
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
            task = self._start(self._client_update(req, payload, None), self._charge(req, payload))
            return await asyncio.shield(task)
        if req.retry_age_ms > self.config.channel_record_ttl_ms // 2:
            raise ChannelSeqStale(f"a retry {req.retry_age_ms} ms after its first attempt is older than this "
                                  f"target keeps exactly-once records for")
        key = (req.client_id, req.channel_id)
        inflight = self._inflight.get(key)
        if inflight is not None:
            seq, pending = inflight
            if seq == req.seq:
                return await asyncio.shield(pending)
            if seq > req.seq:
                raise ChannelSeqStale(f"channel {req.channel_id} is at seq {seq}, request has {req.seq}")
        done = await self._answered((req.client_id, req.channel_id, req.seq))
        if done is not None:
            return done
        task = self._start(self._client_update(req, payload, (req.client_id, req.channel_id, req.seq)),
                           self._charge(req, payload))
        future: asyncio.Future[spb.UpdateRsp] = asyncio.get_running_loop().create_future()
        self._inflight[key] = (req.seq, future)

        def settle(done: asyncio.Task[spb.UpdateRsp]) -> None:
            if self._inflight.get(key, (None, None))[1] is future:
                del self._inflight[key]
            if done.cancelled():
                future.set_exception(Unavailable(f"update of chunk {req.chunk_id.hex()} was cancelled"))
            elif done.exception() is not None:
                future.set_exception(done.exception())  # type: ignore[arg-type]
            else:
                future.set_result(done.result())
            future.exception()  # marks it retrieved: a request that gave up waiting need not read it

        task.add_done_callback(settle)
        return await asyncio.shield(future)

    async def _client_update(self, req: spb.UpdateReq, payload: Buffer, channel: Channel | None) -> spb.UpdateRsp:
        async with self.locks.hold(req.chunk_id):
            while True:
                if channel is not None:
                    # Looked up again under the lock: while this request waited for it, whoever
                    # held it may have completed this very request (an earlier attempt's pending
                    # version) — then it is done, and must not be applied a second time.
                    done = await self._answered(channel)
                    if done is not None:
                        return done
                machine = self._machine(UpdateRequest(Source.CLIENT, _KIND[req.type], req.offset, req.length))
                effects = machine.start(self._chunk_facts(req.chunk_id), self._path(req.chain_id),
                                        self.host.now_ms(), self.engine.new_version)
                if isinstance(effects[0], CompletePending):
                    await self._repair_locked(req.chain_id, req.chunk_id)
                    continue  # the chunk is clean now: decide again
                op = _Op(req.chain_id, req.chunk_id, Source.CLIENT, req, payload, channel)
                return await self._drive(machine, effects, op)

    async def _answered(self, channel: Channel) -> spb.UpdateRsp | None:
        """The saved answer if the channel's request ``channel`` already committed (None: it did not)."""
        client_id, channel_id, seq = channel
        record = self.engine.channel(client_id, channel_id)
        if record is None or record.seq < seq:
            return None
        if record.seq > seq:
            raise ChannelSeqStale(f"channel {channel_id} is at seq {record.seq}, request has {seq}")
        await self._durable()  # never acknowledge what a crash could still take back
        return self._record_rsp(record)

    # -- chain forwards (non-head) -----------------------------------------------------------

    async def forward(self, req: spb.ForwardReq, payload: Buffer) -> spb.UpdateRsp:
        update = req.update
        validate_chunk_id(update.chunk_id)
        if len(update.client_id) > CLIENT_ID_MAX_BYTES:
            raise InvalidArgument(f"client id of {len(update.client_id)} bytes exceeds {CLIENT_ID_MAX_BYTES}")
        if req.update_version > VERSION_MAX or req.base_version > VERSION_MAX:
            raise InvalidArgument(f"version v{req.update_version} (base v{req.base_version}) exceeds {VERSION_MAX}")
        if req.update_version == 0 and not (req.full_chunk_replace and req.remove):
            raise InvalidArgument("an update needs a version (only a removal may carry none)")
        self._require_lease()
        view = self._view(update.chain_id)
        if not view.my_state.writable:
            raise TargetNotServing(f"target {self.target_id} is {view.my_state.name.lower()}")
        self._check_chain_version(view, req.chain_version, "forward")
        if req.is_sync and view.my_state is not PublicState.SYNCING:
            # A resync copy replaces whatever is there, older or not: only a target being synced takes one.
            raise TargetNotServing(f"target {self.target_id} is {view.my_state.name.lower()}, not syncing")
        predecessor = view.predecessor()
        if predecessor is None or predecessor.target_id != req.from_target_id:
            raise StaleUpdate(f"target {req.from_target_id} is not the predecessor of {self.target_id}")
        if req.full_chunk_replace:
            if len(payload) > CHUNK_SIZE_MAX_BYTES:
                raise InvalidArgument(f"a full copy of {len(payload)} bytes exceeds the largest chunk")
            if req.remove:
                if len(payload):
                    raise InvalidArgument("a removal carries no payload")
            elif len(payload) != req.chunk_length or crc32c(payload) != req.chunk_checksum:
                raise ChecksumMismatch("full-chunk replacement does not match its length or checksum")
        else:
            if update.type == spb.WRITE and crc32c(payload) != update.checksum:
                raise ChecksumMismatch("forwarded payload checksum does not match")
            self.validate_update(update, payload, check_crc=False)
        if req.update_version <= req.base_version and not req.full_chunk_replace:
            raise InvalidArgument(f"update v{req.update_version} is not above its base v{req.base_version}")
        charge = len(payload) if req.full_chunk_replace else self._charge(req.update, payload)
        return await asyncio.shield(self._start(self._forward_update(req, payload), charge))

    async def _forward_update(self, req: spb.ForwardReq, payload: Buffer) -> spb.UpdateRsp:
        update = req.update
        channel = (update.client_id, update.channel_id, update.seq) if update.client_id else None
        kind = Kind.REPLACE if req.full_chunk_replace else _KIND[update.type]
        request = UpdateRequest(Source.SYNC if req.is_sync else Source.FORWARD, kind, update.offset, update.length,
                                req.update_version, req.base_version, remove=req.remove)
        op = _Op(update.chain_id, update.chunk_id, request.source, update, payload, channel,
                 checksum=req.chunk_checksum if req.full_chunk_replace else 0, remove=req.remove,
                 chunk_chain_version=req.chunk_chain_version)
        async with self.locks.hold(update.chunk_id):
            machine = self._machine(request)
            effects = machine.start(self._chunk_facts(update.chunk_id), self._path(update.chain_id),
                                    self.host.now_ms())
            return await self._drive(machine, effects, op)

    # -- the effect loop ---------------------------------------------------------------------

    async def _drive(self, machine: UpdateMachine, effects: list[Effect], op: _Op) -> spb.UpdateRsp:
        """Carry out the machine's effects, feeding it what happened, until it answers or fails."""
        queue: deque[Effect] = deque(effects)
        while queue:
            effect = queue.popleft()
            if isinstance(effect, Stage):
                try:
                    await self._do_stage(op, effect)
                except FS3Error as exc:
                    queue.extend(machine.stage_failed(exc, self._path(op.chain_id), self.host.now_ms()))
                    continue
                queue.extend(machine.staged(self._path(op.chain_id)))
            elif isinstance(effect, StageAndForward):
                stage_error, outcome, error = await self._stage_and_forward(op, effect)
                queue.extend(machine.staged_and_forwarded(stage_error, outcome, error, self._path(op.chain_id),
                                                          self.host.now_ms()))
            elif isinstance(effect, Forward):
                outcome, error = await self._do_forward(op, effect)
                queue.extend(machine.forwarded(outcome, error, self._path(op.chain_id), self.host.now_ms()))
            elif isinstance(effect, AwaitRouting):
                await self.host.wait_routing_change(effect.routing_version,
                                                    int(self.config.forward_retry.backoff_ms(1)))
                queue.extend(machine.routing_changed(self._path(op.chain_id), self.host.now_ms()))
            elif isinstance(effect, Commit):
                await self._after_successors(op, self._do_commit(op, effect.version))
                queue.extend(machine.committed())
            elif isinstance(effect, Install):
                await self._after_successors(op, self._do_install(op, effect.version))
            elif isinstance(effect, Abort):
                self.engine.abort(op.chunk_id, effect.version)
            elif isinstance(effect, Reply):
                return self._rsp(self.engine.get(op.chunk_id))
            elif isinstance(effect, Fail):
                if effect.behind:
                    # The successors may hold the version this target could not stage: the chunk
                    # stays dirty here, and the outcome is unknown to whoever asked, who retries.
                    ensure(op.chunk_id in self._unstaged, "a chunk left behind is not dirty")
                    if effect.error.code == StatusCode.IO_ERROR:
                        self.host.fail_target(self.target_id, effect.error)
                    raise Unavailable(f"target {self.target_id} could not stage v{machine.version} that its "
                                      f"successor may hold: {effect.error}")
                if effect.pending_kept and op.source is Source.CLIENT:
                    # Some successor may have committed it: finish it later, never drop it.
                    self.schedule_repair(op.chain_id, op.chunk_id)
                raise effect.error
            else:
                ensure(not isinstance(effect, CompletePending), "a pending version to complete mid-update")
        ensure(False, "the update machine stopped without an answer")
        raise AssertionError  # unreachable

    async def _stage_and_forward(self, op: _Op, effect: StageAndForward) -> tuple[FS3Error | None, Outcome,
                                                                                   FS3Error | None]:
        """Stage and forward at once; return when both have ended (how the stage failed, and the
        forward's outcome). The chunk reads as dirty here from before the forward leaves until a
        version is pending (a reader must never get an older copy here after a successor served
        the new one). Cancelled, the forward is cancelled and the stage runs to its end: the chunk
        lock is never released while its I/O still runs."""
        loop = asyncio.get_running_loop()
        self._unstaged.add(op.chunk_id)
        stage = loop.create_task(self._do_stage(op, effect.stage))
        forward = loop.create_task(self._do_forward(op, effect.forward))
        try:
            await asyncio.wait((stage, forward))
        except asyncio.CancelledError:
            forward.cancel()
            while not (stage.done() and forward.done()):
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait((stage, forward))
            if not forward.cancelled():
                forward.exception()  # read: an error nobody waits for is not reported as lost
            if stage.exception() is None:
                self._unstaged.discard(op.chunk_id)  # staged: the pending version marks it dirty
            raise
        stage_exc = stage.exception()
        if stage_exc is None:
            self._unstaged.discard(op.chunk_id)
        forward_exc = forward.exception()
        if stage_exc is not None and not isinstance(stage_exc, FS3Error):
            raise stage_exc
        outcome: Outcome
        error: FS3Error | None
        if isinstance(forward_exc, FS3Error):
            # Raised before anything was sent (this target left the chain meanwhile); an earlier
            # forward of this update may have reached the successor, so the outcome is unknown.
            outcome, error = Outcome.RETRY, forward_exc
        elif forward_exc is not None:
            raise forward_exc
        else:
            outcome, error = forward.result()
        return stage_exc, outcome, error

    async def _after_successors(self, op: _Op, step: Coroutine[Any, Any, None]) -> None:
        """A commit (or install) that runs out of space happens after every target behind this one
        committed: it must not reach the predecessor as a refusal, which would make it drop a
        version that others hold. Its outcome is unknown, and the head completes it later."""
        try:
            await step
        except NoSpace as exc:
            if op.source is Source.CLIENT:
                self.schedule_repair(op.chain_id, op.chunk_id)
            raise Unavailable(f"commit refused for lack of space after the successors committed: {exc}") from None

    async def _do_stage(self, op: _Op, effect: Stage) -> None:
        chunk_id, version = op.chunk_id, effect.version
        chain_version = self._view(op.chain_id).chain_version
        state = self.engine.get(chunk_id)
        if effect.how == "remove":
            self.engine.stage(chunk_id, version, None, 0, chain_version, op.channel)
            op.content, op.checksum = None, 0
        elif effect.how == "patch":
            assert state is not None
            self._stage_patch(op, state, version, chain_version)
        elif effect.how == "replace":
            content = bytes(op.payload)
            await self._stage_bytes(chunk_id, version, content, op.checksum, chain_version, op.channel)
            op.content = content
        else:
            whole = build_content(await self._base(chunk_id, state), op.update, op.payload)
            op.checksum = self._content_checksum(op.update, whole)
            await self._stage_bytes(chunk_id, version, whole, op.checksum, chain_version, op.channel)
            op.content = whole
        self._unstaged.discard(chunk_id)  # a pending version marks the chunk dirty from here on

    def _stage_patch(self, op: _Op, state: ChunkState, version: int, chain_version: int) -> None:
        """Stage the write as a patch. The whole new content is built only if a successor being
        synced needs it; the checksum is derived from the old one without a reread; the log sync
        that makes the patch's undo record durable starts at once, so it overlaps the forward."""
        chunk_id, update = op.chunk_id, op.update
        new = bytes(op.payload)
        old = self.engine.read(chunk_id, state.commit_version, update.offset, len(new))
        op.checksum = crc32c_patch(state.checksum, state.length, update.offset, old, new)
        self.engine.stage_patch(chunk_id, version, update.offset, new, old, op.checksum, chain_version, op.channel,
                                defer_sync=True)
        op.content = lambda: self.engine.read(chunk_id, version, 0, state.length)
        op.patch_ticket = self._log_written()

    async def _stage_bytes(self, chunk_id: bytes, version: int, content: bytes | None, checksum: int,
                           chain_version: int, channel: Channel | None) -> None:
        """Stage a pending version; a large blob is written by the I/O pool (under the chunk lock,
        which the pool call never gives up before the write is done)."""
        if content is not None and not self.engine.stores_inline(len(content)) \
                and len(content) >= self.config.offload_write_min_bytes:
            blob = self.engine.new_blob()
            await self.host.run_blocking(self.engine.write_blob, chunk_id, blob, content)
            self.engine.stage(chunk_id, version, content, checksum, chain_version, channel, written_blob=blob)
        else:
            self.engine.stage(chunk_id, version, content, checksum, chain_version, channel)

    async def _do_forward(self, op: _Op, effect: Forward) -> tuple[Outcome, FS3Error | None]:
        view = self._view(op.chain_id)
        successor = view.successor()
        if successor is None or successor.target_id != effect.successor:
            return Outcome.RETRY, Unavailable(f"target {effect.successor} is no longer the successor")
        # mgmtd never lists a target twice in a chain, so a successor is always another target:
        # forwarding to itself would commit a write on one replica and count it as two.
        ensure(successor.target_id != self.target_id, f"target {self.target_id} is its own successor")
        req = spb.ForwardReq(update=op.update, update_version=effect.version, base_version=effect.base,
                             chain_version=view.chain_version, from_target_id=self.target_id)
        body: Buffer = op.payload
        if effect.full:
            whole = op.whole()
            req.full_chunk_replace = True
            req.remove = whole is None
            req.chunk_length = len(whole) if whole is not None else 0
            req.chunk_checksum = op.checksum
            req.chunk_chain_version = view.chain_version
            body = whole or b""
        try:
            await self.host.forward(successor, req, body, self.config.forward_timeout_ms)
        except FS3Error as exc:
            return classify(exc), exc
        return Outcome.OK, None

    async def _do_commit(self, op: _Op, version: int) -> None:
        """Commit and make it durable before anyone is answered: the log is synced with whatever
        else was written meanwhile (group commit), off the event loop, and so is a file's own
        blob work (a patch applied in place, its fdatasync) when the chunk is large enough."""
        chain_version = self._view(op.chain_id).chain_version  # as of the successor's answer
        if op.patch_ticket is not None:
            await self._log_sync.wait(op.patch_ticket)
        patch_synced = op.patch_ticket is not None
        state = self.engine.get(op.chunk_id)
        if state is not None and self.engine.commit_blob_io(op.chunk_id, version) \
                and state.pending_length >= self.config.offload_write_min_bytes:
            await self._commit_prepared(op.chunk_id, version, chain_version, patch_synced)
        else:
            self.engine.commit(op.chunk_id, version, chain_version, now_ms=self.host.now_ms(), defer_sync=True,
                               patch_synced=patch_synced)
        await self._log_sync.wait(self._log_written())

    async def _commit_prepared(self, chunk_id: bytes, version: int, chain_version: int, patch_synced: bool) -> None:
        """Run the commit's blob work on the I/O pool, then write its metadata. Readers of the
        chunk wait meanwhile (a patch rewrites the committed file in place and renames it). A
        cancellation cannot split the two: ``run_blocking`` returns only once the blob work is
        done, and the metadata follows at once — the blob on disk is already the new version.
        Blob work that never ran (its thread died with the process, or an error stopped it) is
        not followed by the metadata: that would name a blob the disk does not hold."""
        # The chunk lock is held from staging to commit, so two commits of a chunk never overlap.
        ensure(chunk_id not in self._rewriting, f"two commits rewrite chunk {chunk_id.hex()} at once")
        done = asyncio.Event()
        self._rewriting[chunk_id] = done
        cancelled = False
        blob_work_done: list[bool] = []

        def blob_work() -> None:
            self.engine.prepare_commit(chunk_id, version, patch_synced)
            blob_work_done.append(True)

        try:
            try:
                await self.host.run_blocking(blob_work)
            except asyncio.CancelledError:
                cancelled = True
                if not blob_work_done:
                    raise
            committed = self.engine.commit(chunk_id, version, chain_version, now_ms=self.host.now_ms(),
                                           defer_sync=True, prepared=True)
            # Versions only grow: the commit made exactly the staged version current (a removal leaves none).
            ensure(committed is None or committed.commit_version == version,
                   f"commit of v{version} of chunk {chunk_id.hex()} left another version")
        finally:
            del self._rewriting[chunk_id]
            done.set()
        if cancelled:
            raise asyncio.CancelledError

    async def _do_install(self, op: _Op, version: int) -> None:
        """Commit a full copy directly (a syncing target, or the tail during a repair)."""
        content = None if op.remove else bytes(op.payload)
        chain_version = op.chunk_chain_version or self._view(op.chain_id).chain_version
        written = 0
        if content is not None and not self.engine.stores_inline(len(content)) \
                and len(content) >= self.config.offload_write_min_bytes:
            written = self.engine.new_blob()
            await self.host.run_blocking(self.engine.write_blob, op.chunk_id, written, content)
        self.engine.install(op.chunk_id, version, chain_version, content, op.checksum, channel=op.channel,
                            now_ms=self.host.now_ms(), written_blob=written, defer_sync=True)
        self._unstaged.discard(op.chunk_id)  # this target holds the chain's copy again
        await self._log_sync.wait(self._log_written())

    # -- abandoned pending versions ----------------------------------------------------------

    async def _repair_locked(self, chain_id: int, chunk_id: bytes) -> None:
        """Push the chunk's abandoned pending version down the chain, then commit it here with its
        request's exactly-once record (the caller holds the chunk lock)."""
        state = self.engine.get(chunk_id)
        if state is None or not state.pending_version:
            return
        log.info("target %d: completing abandoned pending v%d of chunk %s", self.target_id,
                 state.pending_version, chunk_id.hex())
        channel = state.pending_channel
        update = spb.UpdateReq(chain_id=chain_id, chunk_id=chunk_id, type=spb.WRITE)
        if channel is not None:
            update.client_id, update.channel_id, update.seq = channel
        pending, length = state.pending_version, state.pending_length
        op = _Op(chain_id, chunk_id, Source.REPAIR, update, b"", channel, checksum=state.pending_checksum,
                 remove=state.pending_remove)
        op.content = None if state.pending_remove else (lambda: self.engine.read(chunk_id, pending, 0, length))
        machine = self._machine(UpdateRequest(Source.REPAIR, Kind.REPLACE, version=pending,
                                              remove=state.pending_remove))
        effects = machine.start(self._chunk_facts(chunk_id), self._path(chain_id), self.host.now_ms())
        await self._drive(machine, effects, op)

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
        attempts = Attempts(self.config.repair_retry)
        while True:
            await attempts.backoff()
            view = self.host.view(chain_id, self.target_id)
            if view is None or not view.is_head:
                return
            try:
                async with self.locks.hold(chunk_id):
                    await self._repair_locked(chain_id, chunk_id)
                    return
            except FS3Error as exc:
                log.info("target %d: pending version of chunk %s not completed yet: %s", self.target_id,
                         chunk_id.hex(), exc)

    # -- reads -------------------------------------------------------------------------------

    async def read(self, req: spb.ReadReq) -> tuple[spb.ReadRsp, bytes]:
        validate_chunk_id(req.chunk_id)
        self._require_lease()
        view = self._view(req.chain_id)
        if view.my_state is not PublicState.SERVING:
            raise TargetNotServing(f"target {self.target_id} is {view.my_state.name.lower()}")
        if req.chain_version:
            self._check_chain_version(view, req.chain_version, "read")
        for _ in range(_READ_TRIES):
            rewriting = self._rewriting.get(req.chunk_id)
            if rewriting is not None:
                await rewriting.wait()  # a commit is patching the committed file: read what it becomes
            state = self.engine.get(req.chunk_id)
            version, length, checksum = self._readable_version(state)
            if (state is not None and state.pending_version) or req.chunk_id in self._unstaged:
                version, length, checksum = await self._resolve_dirty(req, view)
            if version == 0:
                return spb.ReadRsp(length=0, version=0, checksum=crc32c(b""), chunk_length=0), b""
            if req.verify_checksum:
                whole = await self._read_bytes(req.chunk_id, version, 0, length)
                if whole is None:
                    continue
                if crc32c(whole) != checksum:
                    raise ChecksumMismatch(f"chunk {req.chunk_id.hex()} v{version} fails its checksum on target "
                                           f"{self.target_id}")
            data = await self._read_bytes(req.chunk_id, version, req.offset,
                                          min(req.length, max(0, length - req.offset)))
            if data is None:
                continue
            return spb.ReadRsp(length=len(data), version=version, checksum=crc32c(data), chunk_length=length), data
        raise ChunkNotCommitted(f"chunk {req.chunk_id.hex()} kept changing while it was read; try again")

    def rewriting(self, chunk_id: bytes) -> bool:
        """Whether a commit is rewriting the chunk's committed file on the I/O pool right now."""
        return chunk_id in self._rewriting

    async def _read_bytes(self, chunk_id: bytes, version: int, offset: int, length: int) -> bytes | None:
        """Bytes of ``version``: on the event loop when held in RocksDB, or small and in the page
        cache; else on the I/O pool. A pool read runs while commits go on, so it counts only if the
        chunk's state is the same object after it as before (every change replaces it; blob numbers
        are never reused) and no commit started rewriting the file meanwhile; otherwise None, and
        the caller reads again — a file a commit deleted or renamed under the read is not a disk error."""
        if chunk_id in self._rewriting:
            return None  # a commit began patching the file while the read waited for the tail
        state = self.engine.get(chunk_id)
        # Only a committed file goes to the pool (a dirty read of a pending version is rare, and a
        # patched one is built from state a commit changes under it).
        committed_file = state is not None and version == state.commit_version and not state.commit_inline
        if not committed_file or length < self.config.offload_read_min_bytes:
            if not committed_file or not self.config.small_read_nowait:
                return self.engine.read(chunk_id, version, offset, length)
            # A warm small read costs less than a pool hop (a third of the rate on the pool), a cold
            # one a disk read that would stall every request of this process: only the first here.
            # A miss has started the kernel's readahead of the range, so the loop serves other
            # requests and looks again a few passes later — a fast disk's read is done by then,
            # and cheaper to pick up here than from a pool thread; a slow one's goes to the pool.
            cached = self.engine.read_cached(chunk_id, version, offset, length)
            for _ in range(self.config.small_read_polls):
                if cached is not None:
                    return cached
                await asyncio.sleep(0)
                if self.engine.get(chunk_id) is not state or chunk_id in self._rewriting:
                    return None  # changed meanwhile: the caller reads again
                cached = self.engine.read_cached(chunk_id, version, offset, length)
            if cached is not None:
                return cached
        try:
            data = await self.host.run_blocking(self.engine.read, chunk_id, version, offset, length)
        except IoError:
            if self.engine.get(chunk_id) is state and chunk_id not in self._rewriting:
                raise
            return None
        if self.engine.get(chunk_id) is not state or chunk_id in self._rewriting:
            return None
        return data

    @staticmethod
    def _readable_version(state: ChunkState | None) -> tuple[int, int, int]:
        if state is None:
            return 0, 0, 0
        return state.commit_version, state.length, state.checksum

    async def _resolve_dirty(self, req: spb.ReadReq, view: ChainView) -> tuple[int, int, int]:
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
        tail_version = rsp.commit_version if rsp.exists else 0
        if current is None or tail_version == current.commit_version:
            if tail_version != (current.commit_version if current is not None else 0):
                raise ChunkNotCommitted(f"chunk {req.chunk_id.hex()} is changing; try again")
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
            return spb.QueryCommittedRsp(exists=False, undecided=req.chunk_id in self._unstaged)
        return spb.QueryCommittedRsp(commit_version=state.commit_version, exists=state.commit_version > 0,
                                     undecided=bool(state.pending_version) or req.chunk_id in self._unstaged)

    # -- resync: what a serving predecessor copies from (fs3.storage.resync.ResyncSource) -----

    @property
    def version_floor(self) -> int:
        """The target's version counter: a resynced successor numbers its versions above it."""
        return self.engine.floor

    def chunk_ids(self) -> list[bytes]:
        """Every chunk this target holds, in id order."""
        return self.engine.all_chunk_ids()

    def chunk_state(self, chunk_id: bytes) -> ChunkState | None:
        return self.engine.get(chunk_id)

    def hold_chunk(self, chunk_id: bytes) -> AbstractAsyncContextManager[None]:
        """The lock updates of ``chunk_id`` take: a resync copies a chunk under it, so its copy
        never interleaves with a write of the same chunk."""
        return self.locks.hold(chunk_id)

    async def read_committed(self, chunk_id: bytes, state: ChunkState) -> bytes:
        """The whole committed version ``state`` describes, read off the event loop."""
        return await self.host.run_blocking(self.engine.read, chunk_id, state.commit_version, 0, state.length)

    def channel_page(self, start_after: bytes, limit: int) -> list[tuple[bytes, ChannelRecord]]:
        """Exactly-once records in key order after ``start_after``, to hand to a resynced successor."""
        return self.engine.channel_page(start_after, limit)

    # -- resync: exactly-once records --------------------------------------------------------

    def sync_channels(self, req: spb.SyncChannelsReq) -> int:
        """Take the predecessor's exactly-once records while this target is being resynced."""
        view = self._view(req.chain_id)
        if view.my_state is not PublicState.SYNCING:
            raise TargetNotServing(f"target {self.target_id} is {view.my_state.name.lower()}, not syncing")
        self._check_chain_version(view, req.chain_version, "record transfer")
        predecessor = view.predecessor()
        if predecessor is None or predecessor.target_id != req.from_target_id:
            raise StaleUpdate(f"target {req.from_target_id} is not the predecessor of {self.target_id}")
        # Everything is checked before anything changes.
        if req.version_floor > VERSION_MAX:
            raise InvalidArgument(f"version floor {req.version_floor} exceeds {VERSION_MAX}")
        records = [(r.client_id, r.channel_id,
                    ChannelRecord(r.seq, r.commit_version, r.chunk_length, r.chunk_checksum, r.chunk_id))
                   for r in req.records]
        for client_id, _, record in records:
            if not client_id or len(client_id) > CLIENT_ID_MAX_BYTES:
                raise InvalidArgument(f"a channel record needs a client id of 1..{CLIENT_ID_MAX_BYTES} bytes")
            if record.commit_version > VERSION_MAX:
                raise InvalidArgument(f"a channel record's version {record.commit_version} exceeds {VERSION_MAX}")
            validate_chunk_id(record.chunk_id)
        if req.begin and records:
            raise InvalidArgument("the first call of a resync session carries no records")
        self.engine.observe_version(req.version_floor)
        if req.begin:
            # A new session: records held from before may describe writes the chain rolled back
            # (a resync installs the predecessor's copies, older ones included). From here on every
            # write reaches this target with its record, and the predecessor's records come after
            # its chunk pass — which waits for every write in flight, so each is in them.
            self.engine.forget_channels()
            return 0
        return self.engine.merge_channels(records, self.host.now_ms())

    def forget_channels(self) -> None:
        """This target left its chain's write path and will be resynced: drop its records, and the
        dirty marks of chunks it fell behind on — the resync makes each the chain's copy (an
        update still running keeps its chunk's mark until it ends)."""
        self.engine.forget_channels()
        self._unstaged = {chunk_id for chunk_id in self._unstaged if self.locks.held(chunk_id)}

    def expire_channels(self) -> int:
        return self.engine.expire_channels(self.host.now_ms(), self.config.channel_record_ttl_ms)

"""Client for chunk storage: writes to chain heads, reads from any serving replica, with retries.

Writes are exactly-once: each write takes one of the client's channels (bounded), increments
its sequence number, and retries with the same ``(client_id, channel_id, seq)`` until the head
answers or the retry budget is spent; a head that already committed it returns the cached
result. Reads rotate across serving replicas and fall back to another replica on failure; they
carry the client's chain version, and a replica on another version sends the client to refresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from fs3 import storage_pb2 as spb
from fs3.client.routing import RoutedTarget, RoutingCache
from fs3.client.tasks import run_all
from fs3.common.buffers import Buffer
from fs3.common.capability import is_capability_denial
from fs3.common.checksum import crc32c
from fs3.common.clock import Clock, LoopClock
from fs3.common.errors import ChecksumMismatch, FS3Error, StatusCode, Unavailable
from fs3.common.retry import Attempts, Backoff, RetryPolicy
from fs3.common.target_state import PublicState
from fs3.rpc.channel import ChannelFactory
from fs3.rpc.methods import service_spec

__all__ = ["BatchReadStats", "CapabilitySource", "PieceRead", "StorageClient", "StorageClientConfig"]

log = logging.getLogger(__name__)
_STORAGE = service_spec("Storage")
_UPDATE = _STORAGE.method("Update")
_READ = _STORAGE.method("Read")
_BATCH_READ = _STORAGE.method("BatchRead")
# A read failing with these condemns the replica's copy, not the request: another replica may serve
# it (the failing target takes itself out of its chain).
_REPLICA_FAULTS = frozenset({StatusCode.CHECKSUM_MISMATCH, StatusCode.IO_ERROR})


class CapabilitySource(Protocol):
    """Where a client that is not a service gets the capability its storage calls for one file
    carry (see :mod:`fs3.common.capability`; the open file holds it)."""

    async def current(self) -> bytes:
        """The capability to send now (renewed first if it is about to expire)."""

    async def renew(self, refused: bytes) -> bytes:
        """A fresh capability from meta after storage refused ``refused``."""


@dataclass(frozen=True)
class StorageClientConfig:
    rpc_timeout_ms: int = 10_000
    retry_total_ms: int = 60_000
    retry_backoff_ms: int = 50  # the backoff unit: the n-th retry waits 2^n units, at most the max
    retry_backoff_max_ms: int = 1_000
    channels_max: int = 64
    dirty_policy: int = spb.DIRTY_READ_DEFAULT
    # Batched reads (read_pieces): pieces and bytes per BatchRead call (within the node's bounds,
    # 4,096 pieces and 64 MiB; a single piece bigger than the byte bound goes alone), and the calls
    # and single-piece fallback reads one batch keeps in flight.
    batch_read_pieces_max: int = 1024
    batch_read_bytes_max: int = 8 << 20
    batch_reads_inflight_max: int = 32

    @property
    def retry(self) -> RetryPolicy:
        """One update's or read's retries: no limit on tries, only the time budget."""
        return RetryPolicy(backoff_base_ms=min(2 * self.retry_backoff_ms, self.retry_backoff_max_ms),
                           backoff_max_ms=self.retry_backoff_max_ms, backoff=Backoff.EXPONENTIAL,
                           deadline_ms=self.retry_total_ms)


@dataclass(frozen=True, slots=True)
class PieceRead:
    """One piece of a batched read: ``length`` bytes at ``offset`` of one chunk, to land at ``dst``
    of the caller's buffer; ``capability``: its file's, as in :meth:`StorageClient.read`."""

    chain_id: int
    chunk_id: bytes
    offset: int
    length: int
    dst: int
    capability: CapabilitySource | None = None


@dataclass
class BatchReadStats:
    """What one :meth:`StorageClient.read_pieces` cost (the client's metrics count it)."""

    rpcs: int = 0                    # BatchRead calls sent
    pieces: int = 0                  # pieces those calls asked for
    fallbacks: int = 0               # pieces read again, one Read each, after their batch failed them


class StorageClient:
    def __init__(self, routing: RoutingCache, channels: ChannelFactory, client_id: bytes,
                 config: StorageClientConfig | None = None, clock: Clock | None = None,
                 pick: Callable[[int], int] | None = None) -> None:
        if not client_id or len(client_id) > 64:
            raise ValueError("client_id must be 1..64 bytes")
        self.routing = routing
        self.channels = channels
        self.client_id = client_id
        self.config = config or StorageClientConfig()
        self.clock = clock or LoopClock()
        self._retry = self.config.retry
        self._free_channels: asyncio.Queue[int] = asyncio.Queue()
        for channel_id in range(1, self.config.channels_max + 1):
            self._free_channels.put_nowait(channel_id)
        self._seq: dict[int, int] = {}
        self._rotation = 0
        self._pick = pick

    @contextlib.asynccontextmanager
    async def _channel(self) -> AsyncIterator[tuple[int, int]]:
        channel_id = await self._free_channels.get()
        seq = self._seq.get(channel_id, 0) + 1
        self._seq[channel_id] = seq
        try:
            yield channel_id, seq
        finally:
            self._free_channels.put_nowait(channel_id)

    async def _before_retry(self, error: FS3Error, attempts: Attempts, what: str) -> None:
        """Give up once the budget is spent; else refresh routing (unless the chunk is just busy) and back off."""
        if attempts.exhausted():
            raise Unavailable(f"{what} gave up: {error}")
        if error.code != StatusCode.CHUNK_NOT_COMMITTED:
            with contextlib.suppress(FS3Error):
                await self.routing.refresh()
        await attempts.backoff()

    async def update(self, chain_id: int, chunk_id: bytes, update_type: int, offset: int, length: int,
                     chunk_size: int, data: Buffer = b"", capability: CapabilitySource | None = None) -> spb.UpdateRsp:
        """One update through the chain head, retried until committed or the budget is spent.

        ``capability``: the file's, for a client that is not a service. A refused one is renewed
        once and the same request (same exactly-once sequence number) sent again.
        """
        renewed = False
        first_ms = self.clock.now_ms()
        attempts = Attempts(self._retry, self.clock)
        async with self._channel() as (channel_id, seq):
            req = spb.UpdateReq(chain_id=chain_id, chunk_id=chunk_id, type=cast(spb.UpdateType, update_type),
                                offset=offset, length=length,
                                chunk_size=chunk_size, checksum=crc32c(data) if update_type == spb.WRITE else 0,
                                client_id=self.client_id, channel_id=channel_id, seq=seq)
            while True:
                chain_version, members = await self.routing.chain(chain_id)
                head = next((m for m in members if m.state.writable), None)
                error: FS3Error
                if head is None or head.state is not PublicState.SERVING:
                    error = Unavailable(f"chain {chain_id} has no serving head")
                else:
                    req.chain_version = chain_version
                    req.retry_age_ms = min(self.clock.now_ms() - first_ms, 0xFFFFFFFF) if attempts.retries else 0
                    if capability is not None:
                        req.capability = await capability.current()
                    try:
                        rsp, _ = await self.channels.get(head.address).call(_UPDATE, req, data,
                                                                             self.config.rpc_timeout_ms)
                        assert isinstance(rsp, spb.UpdateRsp)
                        return rsp
                    except FS3Error as exc:
                        if capability is not None and not renewed and is_capability_denial(exc.code, exc.message):
                            renewed = True
                            await capability.renew(req.capability)
                            continue
                        if not exc.retryable:
                            raise
                        error = exc
                await self._before_retry(error, attempts, f"update of chunk {chunk_id.hex()} on chain {chain_id}")

    async def write(self, chain_id: int, chunk_id: bytes, offset: int, data: Buffer,
                    chunk_size: int, capability: CapabilitySource | None = None) -> spb.UpdateRsp:
        return await self.update(chain_id, chunk_id, spb.WRITE, offset, len(data), chunk_size, data, capability)

    async def truncate(self, chain_id: int, chunk_id: bytes, length: int, chunk_size: int,
                       capability: CapabilitySource | None = None) -> spb.UpdateRsp:
        return await self.update(chain_id, chunk_id, spb.TRUNCATE, 0, length, chunk_size, capability=capability)

    async def remove(self, chain_id: int, chunk_id: bytes, chunk_size: int,
                     capability: CapabilitySource | None = None) -> spb.UpdateRsp:
        return await self.update(chain_id, chunk_id, spb.REMOVE, 0, 0, chunk_size, capability=capability)

    def _order(self, members: list[RoutedTarget]) -> list[RoutedTarget]:
        serving = [m for m in members if m.state is PublicState.SERVING]
        if not serving:
            return []
        if self._pick is not None:
            start = self._pick(len(serving))
        else:
            self._rotation += 1
            start = self._rotation % len(serving)
        return serving[start:] + serving[:start]

    async def read(self, chain_id: int, chunk_id: bytes, offset: int, length: int, verify_checksum: bool = False,
                   capability: CapabilitySource | None = None) -> tuple[bytes, spb.ReadRsp]:
        """Read from a serving replica; ``b""`` past the end of the chunk or for a missing chunk.

        ``capability``: as in :meth:`update` (a refused one is renewed once).
        """
        renewed = False
        attempts = Attempts(self._retry, self.clock)
        req = spb.ReadReq(chain_id=chain_id, chunk_id=chunk_id, offset=offset, length=length,
                          dirty_policy=cast(spb.DirtyReadPolicy, self.config.dirty_policy),
                          verify_checksum=verify_checksum)
        while True:
            chain_version, members = await self.routing.chain(chain_id)
            # The replica refuses a read whose chain version differs from its own: one that has
            # left the chain this client knows of cannot answer from its old view of it.
            req.chain_version = chain_version
            error: FS3Error = Unavailable(f"chain {chain_id} has no serving replica")
            moved = False
            for member in self._order(members):
                if capability is not None:
                    req.capability = await capability.current()
                try:
                    rsp, data = await self.channels.get(member.address).call(_READ, req, b"",
                                                                             self.config.rpc_timeout_ms)
                    assert isinstance(rsp, spb.ReadRsp)
                    if crc32c(data) != rsp.checksum:
                        raise ChecksumMismatch(f"read of chunk {chunk_id.hex()} corrupted in transit")
                    return bytes(data), rsp
                except FS3Error as exc:
                    if capability is not None and not renewed and is_capability_denial(exc.code, exc.message):
                        renewed = True
                        await capability.renew(req.capability)
                        # Not the replica's fault: start over with the fresh capability at once.
                        error, moved = exc, True
                        break
                    # A replica whose copy is corrupt or whose disk fails has not the last word:
                    # try the next one (the failing target takes itself out of its chain).
                    if not exc.retryable and exc.code not in _REPLICA_FAULTS:
                        raise
                    error = exc
                    if exc.code == StatusCode.CHAIN_VERSION_MISMATCH and await self._chain_moved(chain_id,
                                                                                                 chain_version):
                        moved = True  # ours was the stale view: start over on the new chain at once
                        break
            if moved and not attempts.expired():
                continue
            await self._before_retry(error, attempts, f"read of chunk {chunk_id.hex()} on chain {chain_id}")

    async def read_pieces(self, pieces: Sequence[PieceRead], out: memoryview,
                          verify_checksum: bool = False) -> tuple[list[int], BatchReadStats]:
        """Read many chunk pieces; piece ``i``'s bytes land at ``out[dst:dst + n]`` (``n`` is the
        i-th number returned: short past the end of a chunk, 0 for a missing one).

        Each piece goes to one serving replica of its chain (rotated as :meth:`read` rotates them,
        spreading the load); the pieces bound for one node travel in BatchRead calls of at most
        ``batch_read_pieces_max`` pieces and ``batch_read_bytes_max`` bytes, all nodes asked at
        once. A piece its batch did not answer well (the replica refused or failed it, its bytes
        fail their CRC, the whole call failed) is read again with :meth:`read`, whose retries and
        failover are the last word: this is exactly as robust as reading each piece alone. Bytes
        are copied once, from the answer's payload into ``out``.
        """
        got = [0] * len(pieces)
        stats = BatchReadStats()
        retry: list[int] = []
        by_node: dict[str, list[int]] = {}
        versions = [0] * len(pieces)
        for index, piece in enumerate(pieces):
            chain_version, members = await self.routing.chain(piece.chain_id)
            order = self._order(members)
            if not order:
                retry.append(index)  # read waits for a serving replica (refreshing routing)
                continue
            versions[index] = chain_version
            by_node.setdefault(order[0].address, []).append(index)
        # One capability per file and call (pieces of a file share it), fetched once.
        capability_of: dict[int, int] = {}
        capabilities: list[bytes] = []
        for piece in pieces:
            if piece.capability is not None and id(piece.capability) not in capability_of:
                capability_of[id(piece.capability)] = len(capabilities)
                capabilities.append(await piece.capability.current())
        calls = self._batch_calls(pieces, by_node)
        slots = asyncio.Semaphore(max(1, self.config.batch_reads_inflight_max))

        async def call(address: str, indexes: list[int]) -> None:
            async with slots:
                req = spb.BatchReadReq(dirty_policy=cast(spb.DirtyReadPolicy, self.config.dirty_policy),
                                       verify_checksum=verify_checksum, capabilities=capabilities)
                for index in indexes:
                    piece = pieces[index]
                    req.pieces.add(chain_id=piece.chain_id, chain_version=versions[index], chunk_id=piece.chunk_id,
                                   offset=piece.offset, length=piece.length,
                                   capability_index=capability_of.get(id(piece.capability), 0))
                stats.rpcs += 1
                stats.pieces += len(indexes)
                try:
                    rsp, data = await self.channels.get(address).call(_BATCH_READ, req, b"",
                                                                      self.config.rpc_timeout_ms)
                except FS3Error as exc:
                    log.debug("batch read of %d pieces from %s failed, reading them one by one: %s",
                              len(indexes), address, exc)
                    retry.extend(indexes)
                    return
                assert isinstance(rsp, spb.BatchReadRsp)
                retry.extend(self._land(pieces, indexes, rsp, memoryview(data), out, got))

        await run_all((call(address, indexes) for address, indexes in calls))
        stats.fallbacks = len(retry)

        async def again(index: int) -> None:
            piece = pieces[index]
            async with slots:
                data, _ = await self.read(piece.chain_id, piece.chunk_id, piece.offset, piece.length,
                                          verify_checksum, piece.capability)
            out[piece.dst:piece.dst + len(data)] = data
            got[index] = len(data)

        await run_all(again(index) for index in sorted(retry))
        return got, stats

    def _batch_calls(self, pieces: Sequence[PieceRead], by_node: dict[str, list[int]]) -> list[tuple[str, list[int]]]:
        """Each node's pieces cut into calls within the per-call bounds, ordered round-robin over
        the nodes, so that the first calls started (while the in-flight bound holds the rest back)
        reach every node and a slow node holds up no other."""
        per_node: list[list[tuple[str, list[int]]]] = []
        pieces_max = max(1, self.config.batch_read_pieces_max)
        for address, indexes in by_node.items():
            calls: list[tuple[str, list[int]]] = []
            current: list[int] = []
            size = 0
            for index in indexes:
                length = pieces[index].length
                if current and (len(current) == pieces_max or size + length > self.config.batch_read_bytes_max):
                    calls.append((address, current))
                    current, size = [], 0
                current.append(index)
                size += length
            if current:
                calls.append((address, current))
            per_node.append(calls)
        ordered: list[tuple[str, list[int]]] = []
        for round_ in range(max((len(c) for c in per_node), default=0)):
            ordered.extend(calls[round_] for calls in per_node if round_ < len(calls))
        return ordered

    @staticmethod
    def _land(pieces: Sequence[PieceRead], indexes: list[int], rsp: spb.BatchReadRsp, data: memoryview,
              out: memoryview, got: list[int]) -> list[int]:
        """Copy each well-answered piece of one BatchRead into ``out``; the indexes of the others."""
        failed: list[int] = []
        if len(rsp.results) != len(indexes):
            return list(indexes)  # not an answer to this request
        position = 0
        for index, result in zip(indexes, rsp.results, strict=True):
            piece = pieces[index]
            if result.status != StatusCode.OK:
                failed.append(index)
                continue
            length = result.length
            part = data[position:position + length]
            position += length
            if length > piece.length or len(part) != length or crc32c(part) != result.checksum:
                failed.append(index)  # corrupted in transit, or not what was asked: read it again
                continue
            out[piece.dst:piece.dst + length] = part
            got[index] = length
        return failed

    async def _chain_moved(self, chain_id: int, chain_version: int) -> bool:
        """Refresh routing after a chain version mismatch; whether the chain has a newer version now.

        False means the replica was the one behind (it refreshes itself): try the next replica.
        """
        with contextlib.suppress(FS3Error):
            await self.routing.refresh()
        with contextlib.suppress(FS3Error):
            return (await self.routing.chain(chain_id))[0] != chain_version
        return False


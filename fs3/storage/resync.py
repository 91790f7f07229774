"""Resync: the serving predecessor brings a syncing successor up to date.

From the 3FS design notes: normal writes are already forwarded to the syncing successor as
full-chunk replacements (see :mod:`fs3.storage.replica`). In addition the predecessor opens a
session (the successor drops every exactly-once record it holds, and takes the predecessor's
version counter), dumps the successor's chunk metadata, compares it with its own, and sends a
full-chunk replacement of every chunk that differs (and a removal of every chunk it does not
have), each under the local chunk lock so that it cannot interleave with a write of the same
chunk. Then it hands over its records and sends ``SyncDone``; the successor reports itself up to
date to mgmtd, which makes it serving.

Why records go in that order: a resync may roll a chunk back (the predecessor's copy is older than
one the successor committed in a write the chain lost), so records the successor held before the
session may lie. After the session opens, every write reaches the successor with its record; a
write already in flight when it opened holds its chunk's lock on the predecessor, so the chunk
pass waits for it, and its record is in the snapshot taken after the pass. The successor keeps the
newer of two records of one channel.

The resync sees the node and the replica only through two small interfaces, :class:`ResyncHost`
(chain views and the calls to the successor) and :class:`ResyncSource` (the replica's chunks,
locks and records), so it runs against fakes in a unit test as the replica does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol

from fs3 import storage_pb2 as spb
from fs3.common.errors import TargetNotServing
from fs3.common.target_state import PublicState
from fs3.storage.schema import parse_channel_key

if TYPE_CHECKING:
    from fs3.storage.chain_view import ChainMember, ChainView
    from fs3.storage.chunk_engine import ChannelRecord, ChunkState

__all__ = ["ResyncHost", "ResyncPacer", "ResyncSource", "resync_successor"]

log = logging.getLogger(__name__)


class ResyncHost(Protocol):
    """What a resync needs from the storage node around it: its chain views and calls to the successor."""

    def view(self, chain_id: int, target_id: int) -> ChainView | None: ...

    async def forward(self, member: ChainMember, req: spb.ForwardReq, payload: bytes,
                      timeout_ms: int) -> spb.UpdateRsp: ...

    async def dump_chunk_meta(self, member: ChainMember, chain_id: int, batch: int,
                              timeout_ms: int) -> dict[bytes, spb.ChunkMeta]:
        """Every chunk's metadata on ``member``, fetched in pages of ``batch``."""
        ...

    async def send_sync_channels(self, member: ChainMember, req: spb.SyncChannelsReq, timeout_ms: int) -> None: ...

    async def send_sync_done(self, member: ChainMember, req: spb.SyncDoneReq, timeout_ms: int) -> None: ...


class ResyncSource(Protocol):
    """What a resync needs from the serving replica it copies from."""

    @property
    def target_id(self) -> int: ...

    @property
    def version_floor(self) -> int: ...

    def chunk_ids(self) -> list[bytes]: ...

    def chunk_state(self, chunk_id: bytes) -> ChunkState | None: ...

    def hold_chunk(self, chunk_id: bytes) -> AbstractAsyncContextManager[None]: ...

    async def read_committed(self, chunk_id: bytes, state: ChunkState) -> bytes: ...

    def channel_page(self, start_after: bytes, limit: int) -> list[tuple[bytes, ChannelRecord]]: ...


# How often a chunk waiting for the resync rate looks whether the rate changed.
_RATE_CHECK_S = 1.0


class ResyncPacer:
    """The node-wide byte rate resyncs copy at (0: unlimited), so that a rebalance or a drain leaves
    foreground I/O most of the disks and the network. Every resync of the node shares one pacer;
    a chunk is sent when the bytes before it fit the rate, with one second's worth as a burst.
    Time comes from the event loop (the simulator's loop runs on virtual time)."""

    def __init__(self, rate_bytes_per_s: int = 0) -> None:
        self.rate_bytes_per_s = rate_bytes_per_s
        self._free_at_s = 0.0
        self._paced_rate = rate_bytes_per_s  # the rate ``_free_at_s`` was reckoned at

    async def spend(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit the rate. A new rate (mgmtd's heartbeat sets it) applies
        at once: what the old one still owed is forgiven and waiting chunks go, so that a rate set
        far too low by mistake never leaves resyncs stalled for the time it reckoned."""
        rate = self.rate_bytes_per_s
        if rate <= 0 or nbytes <= 0:
            return
        loop = asyncio.get_running_loop()
        now_s = loop.time()
        if rate != self._paced_rate:
            self._paced_rate = rate
            self._free_at_s = min(self._free_at_s, now_s)
        self._free_at_s = max(self._free_at_s, now_s - 1.0) + nbytes / rate
        ready_at_s = self._free_at_s
        while (delay_s := ready_at_s - loop.time()) > 0:
            await asyncio.sleep(min(delay_s, _RATE_CHECK_S))
            if self.rate_bytes_per_s != rate:
                return


def _current(node: ResyncHost, replica: ResyncSource, chain_id: int,
             successor_id: int) -> tuple[ChainView, ChainMember]:
    view = node.view(chain_id, replica.target_id)
    if view is None or view.my_state is not PublicState.SERVING:
        raise TargetNotServing(f"target {replica.target_id} stopped serving chain {chain_id}")
    successor = view.successor()
    if successor is None or successor.target_id != successor_id or successor.state is not PublicState.SYNCING:
        raise TargetNotServing(f"target {successor_id} is no longer the syncing successor in chain {chain_id}")
    return view, successor


def _in_sync(state: ChunkState, theirs: spb.ChunkMeta | None) -> bool:
    """Whether the successor holds the source's committed chunk ``state`` as it is (as seen
    before the chunk's lock: the copy itself decides again under it)."""
    if not state.commit_version:
        return theirs is None or (not theirs.commit_version and not theirs.pending_version)
    return theirs is not None and not theirs.pending_version and theirs.commit_version == state.commit_version \
        and theirs.checksum == state.checksum and theirs.length == state.length


async def resync_successor(node: ResyncHost, replica: ResyncSource, chain_id: int, successor_id: int,
                           batch: int, timeout_ms: int, progress: Callable[[int, int], None] | None = None,
                           pace: Callable[[int], Awaitable[None]] | None = None) -> None:
    """``progress(remaining, sent)``: called with the chunks left to compare and the chunks sent so
    far, once the comparison starts and after each chunk (what the storage node's resync gauges show).
    ``pace(nbytes)``: awaited before each chunk is copied, outside its chunk lock (the rate limit)."""
    view, successor = _current(node, replica, chain_id, successor_id)
    log.info("target %d: resyncing successor %d of chain %d (v%d)", replica.target_id, successor_id, chain_id,
             view.chain_version)
    await _begin_session(node, replica, chain_id, successor_id, timeout_ms)
    remote = await node.dump_chunk_meta(successor, chain_id, batch, timeout_ms)
    sent = removed = 0
    chunk_ids = sorted(set(replica.chunk_ids()) | set(remote))
    for done, chunk_id in enumerate(chunk_ids):
        if progress is not None:
            progress(len(chunk_ids) - done, sent + removed)
        if pace is not None:
            # Only what is copied is paced: a chunk the successor holds already (a replica back
            # from a restart has most of them) costs no disk or network and is not waited for.
            known = replica.chunk_state(chunk_id)
            await pace(0 if known is None or _in_sync(known, remote.get(chunk_id)) else known.length)
        async with replica.hold_chunk(chunk_id):
            view, successor = _current(node, replica, chain_id, successor_id)
            state = replica.chunk_state(chunk_id)
            if state is not None and not state.commit_version:
                state = None  # only a first version in flight: the write itself brings it over
            theirs = remote.get(chunk_id)
            if state is None and (theirs is None or (not theirs.commit_version and not theirs.pending_version)):
                continue
            if state is not None and theirs is not None and not theirs.pending_version \
                    and theirs.commit_version == state.commit_version and theirs.checksum == state.checksum \
                    and theirs.length == state.length:
                continue
            req = spb.ForwardReq(
                update=spb.UpdateReq(chain_id=chain_id, chunk_id=chunk_id, type=spb.WRITE),
                chain_version=view.chain_version, from_target_id=replica.target_id, full_chunk_replace=True,
                is_sync=True,
            )
            payload = b""
            if state is None:
                req.remove = True
                req.update_version = theirs.commit_version if theirs else 0
                removed += 1
            else:
                payload = await replica.read_committed(chunk_id, state)
                req.update_version = state.commit_version
                req.chunk_length = state.length
                req.chunk_checksum = state.checksum
                req.chunk_chain_version = state.chain_version
                sent += 1
            await node.forward(successor, req, payload, timeout_ms)
    if progress is not None:
        progress(0, sent + removed)
    records = await _send_channels(node, replica, chain_id, successor_id, batch, timeout_ms)
    view, successor = _current(node, replica, chain_id, successor_id)
    await node.send_sync_done(
        successor, spb.SyncDoneReq(chain_id=chain_id, chain_version=view.chain_version, target_id=successor_id),
        timeout_ms,
    )
    log.info("target %d: successor %d of chain %d synced (%d records, %d chunks sent, %d removed)",
             replica.target_id, successor_id, chain_id, records, sent, removed)


async def _begin_session(node: ResyncHost, replica: ResyncSource, chain_id: int, successor_id: int,
                         timeout_ms: int) -> None:
    """Open a resync session: the successor drops its records (and takes our version counter)."""
    view, successor = _current(node, replica, chain_id, successor_id)
    req = spb.SyncChannelsReq(chain_id=chain_id, chain_version=view.chain_version, from_target_id=replica.target_id,
                              target_id=successor_id, version_floor=replica.version_floor, begin=True)
    await node.send_sync_channels(successor, req, timeout_ms)


async def _send_channels(node: ResyncHost, replica: ResyncSource, chain_id: int, successor_id: int, batch: int,
                         timeout_ms: int) -> int:
    """Hand every exactly-once record (and the version counter) to the syncing successor, in pages."""
    start_after = b""
    sent = 0
    while True:
        view, successor = _current(node, replica, chain_id, successor_id)
        page = replica.channel_page(start_after, batch)
        req = spb.SyncChannelsReq(chain_id=chain_id, chain_version=view.chain_version,
                                  from_target_id=replica.target_id, target_id=successor_id,
                                  version_floor=replica.version_floor)
        for key, record in page:
            client_id, channel_id = parse_channel_key(key)
            req.records.add(client_id=client_id, channel_id=channel_id, seq=record.seq,
                            commit_version=record.commit_version, chunk_length=record.length,
                            chunk_checksum=record.checksum, chunk_id=record.chunk_id)
        await node.send_sync_channels(successor, req, timeout_ms)
        sent += len(page)
        if len(page) < batch:
            return sent
        start_after = page[-1][0]

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
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fs3 import storage_pb2 as spb
from fs3.common.errors import TargetNotServing
from fs3.mgmtd.chain_state import PublicState
from fs3.rpc.methods import service_spec
from fs3.rpc.storage_calls import dump_chunk_meta
from fs3.storage.schema import parse_channel_key

if TYPE_CHECKING:
    from fs3.storage.chain_view import ChainMember, ChainView
    from fs3.storage.node import StorageNode
    from fs3.storage.replica import TargetReplica

__all__ = ["resync_successor"]
_SYNC_CHANNELS = service_spec("Storage").method("SyncChannels")

log = logging.getLogger(__name__)
_STORAGE = service_spec("Storage")


def _current(node: StorageNode, replica: TargetReplica, chain_id: int,
             successor_id: int) -> tuple[ChainView, ChainMember]:
    view = node.view(chain_id, replica.target_id)
    if view is None or view.my_state is not PublicState.SERVING:
        raise TargetNotServing(f"target {replica.target_id} stopped serving chain {chain_id}")
    successor = view.successor()
    if successor is None or successor.target_id != successor_id or successor.state is not PublicState.SYNCING:
        raise TargetNotServing(f"target {successor_id} is no longer the syncing successor in chain {chain_id}")
    return view, successor


async def resync_successor(node: StorageNode, replica: TargetReplica, chain_id: int, successor_id: int,
                           batch: int, timeout_ms: int) -> None:
    view, successor = _current(node, replica, chain_id, successor_id)
    log.info("target %d: resyncing successor %d of chain %d (v%d)", replica.target_id, successor_id, chain_id,
             view.chain_version)
    await _begin_session(node, replica, chain_id, successor_id, timeout_ms)
    remote = await dump_chunk_meta(node.channels.get(successor.address), chain_id, successor.target_id, batch,
                                   timeout_ms)
    engine = replica.engine
    sent = removed = 0
    for chunk_id in sorted(set(engine.all_chunk_ids()) | set(remote)):
        async with replica.locks.hold(chunk_id):
            view, successor = _current(node, replica, chain_id, successor_id)
            state = engine.get(chunk_id)
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
                payload = await node.run_blocking(engine.read, chunk_id, state.commit_version, 0, state.length)
                req.update_version = state.commit_version
                req.chunk_length = state.length
                req.chunk_checksum = state.checksum
                req.chunk_chain_version = state.chain_version
                sent += 1
            await node.forward(successor, req, payload, timeout_ms)
    records = await _send_channels(node, replica, chain_id, successor_id, batch, timeout_ms)
    view, successor = _current(node, replica, chain_id, successor_id)
    await node.channels.get(successor.address).call(
        _STORAGE.method("SyncDone"),
        spb.SyncDoneReq(chain_id=chain_id, chain_version=view.chain_version, target_id=successor_id),
        timeout_ms=timeout_ms,
    )
    log.info("target %d: successor %d of chain %d synced (%d records, %d chunks sent, %d removed)",
             replica.target_id, successor_id, chain_id, records, sent, removed)


async def _begin_session(node: StorageNode, replica: TargetReplica, chain_id: int, successor_id: int,
                         timeout_ms: int) -> None:
    """Open a resync session: the successor drops its records (and takes our version counter)."""
    view, successor = _current(node, replica, chain_id, successor_id)
    req = spb.SyncChannelsReq(chain_id=chain_id, chain_version=view.chain_version, from_target_id=replica.target_id,
                              target_id=successor_id, version_floor=replica.engine.floor, begin=True)
    await node.channels.get(successor.address).call(_SYNC_CHANNELS, req, timeout_ms=timeout_ms)


async def _send_channels(node: StorageNode, replica: TargetReplica, chain_id: int, successor_id: int, batch: int,
                         timeout_ms: int) -> int:
    """Hand every exactly-once record (and the version counter) to the syncing successor, in pages."""
    engine = replica.engine
    start_after = b""
    sent = 0
    while True:
        view, successor = _current(node, replica, chain_id, successor_id)
        page = engine.channel_page(start_after, batch)
        req = spb.SyncChannelsReq(chain_id=chain_id, chain_version=view.chain_version,
                                  from_target_id=replica.target_id, target_id=successor_id,
                                  version_floor=engine.floor)
        for key, record in page:
            client_id, channel_id = parse_channel_key(key)
            req.records.add(client_id=client_id, channel_id=channel_id, seq=record.seq,
                            commit_version=record.commit_version, chunk_length=record.length,
                            chunk_checksum=record.checksum, chunk_id=record.chunk_id)
        await node.channels.get(successor.address).call(_SYNC_CHANNELS, req, timeout_ms=timeout_ms)
        sent += len(page)
        if len(page) < batch:
            return sent
        start_after = page[-1][0]

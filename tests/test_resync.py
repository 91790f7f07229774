"""Resync against a fake node: what the serving predecessor sends its syncing successor, in what order.

The source is a real :class:`TargetReplica` over an in-memory chunk engine; the node around it is
a fake that records the calls a real node would send over the network (:class:`ResyncHost`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fs3 import storage_pb2 as spb
from fs3.common.checksum import crc32c
from fs3.common.errors import TargetNotServing
from fs3.common.ids import chunk_id as make_chunk_id
from fs3.common.target_state import PublicState
from fs3.kv.store import MemKVStore
from fs3.storage.blobs import MemBlobStore
from fs3.storage.chain_view import ChainMember, ChainView
from fs3.storage.chunk_engine import ChunkEngine
from fs3.storage.replica import TargetReplica
from fs3.storage.resync import ResyncHost, ResyncSource, resync_successor

CHAIN, ME, SUCCESSOR = 7, 101, 201


class FakeNode:
    """A node whose calls to the successor are recorded; ``fail_after`` calls, the chain moves on."""

    def __init__(self, remote: dict[bytes, spb.ChunkMeta], replica: list[TargetReplica]) -> None:
        self.remote = remote
        self.calls: list[tuple[str, Any]] = []
        self.successor_state = PublicState.SYNCING
        self.fail_after: int | None = None
        self._replica = replica  # set once the replica exists (it takes the node as its host)

    def view(self, chain_id: int, target_id: int) -> ChainView | None:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            self.successor_state = PublicState.OFFLINE
        return ChainView(chain_id, 3, 9, target_id, (ChainMember(ME, 1, PublicState.SERVING, "n1"),
                                                     ChainMember(SUCCESSOR, 2, self.successor_state, "n2")))

    # ReplicaHost, for the source replica
    def lease_valid(self) -> bool:
        return True

    def now_ms(self) -> int:
        return 1_000

    def request_routing_refresh(self) -> None:
        pass

    async def run_blocking(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    # ResyncHost
    async def forward(self, member: ChainMember, req: spb.ForwardReq, payload: bytes,
                      timeout_ms: int) -> spb.UpdateRsp:
        assert member.target_id == SUCCESSOR
        # The chunk's lock is held while its copy travels: no write of it can interleave.
        assert self._replica[0].locks.held(req.update.chunk_id)
        self.calls.append(("forward", (req, bytes(payload))))
        return spb.UpdateRsp()

    async def dump_chunk_meta(self, member: ChainMember, chain_id: int, batch: int,
                              timeout_ms: int) -> dict[bytes, spb.ChunkMeta]:
        assert (member.target_id, chain_id) == (SUCCESSOR, CHAIN)
        self.calls.append(("dump", batch))
        return dict(self.remote)

    async def send_sync_channels(self, member: ChainMember, req: spb.SyncChannelsReq, timeout_ms: int) -> None:
        assert member.target_id == SUCCESSOR
        self.calls.append(("channels", req))

    async def send_sync_done(self, member: ChainMember, req: spb.SyncDoneReq, timeout_ms: int) -> None:
        assert member.target_id == SUCCESSOR
        self.calls.append(("done", req))


def _write(engine: ChunkEngine, cid: bytes, data: bytes, channel: tuple[bytes, int, int] | None = None) -> int:
    version = engine.new_version()
    engine.stage(cid, version, data, crc32c(data), 3, channel)
    engine.commit(cid, version, 3)
    return version


def _setup(remote: dict[bytes, spb.ChunkMeta]) -> tuple[FakeNode, TargetReplica, ChunkEngine]:
    holder: list[TargetReplica] = []
    node = FakeNode(remote, holder)
    engine = ChunkEngine(MemKVStore(), MemBlobStore())
    replica = TargetReplica(ME, engine, node)  # type: ignore[arg-type]
    holder.append(replica)
    host: ResyncHost = node  # the fake is a complete host, as the storage node is
    source: ResyncSource = replica
    assert host is node and source is replica
    return node, replica, engine


def test_the_successor_gets_what_differs_then_the_records_then_sync_done() -> None:
    same, stale, extra, absent, mine_only = (make_chunk_id(1, i) for i in range(5))
    node, replica, engine = _setup({})
    v_same = _write(engine, same, b"same", (b"client", 1, 1))
    v_stale = _write(engine, stale, b"newer", (b"client", 2, 1))
    _write(engine, mine_only, b"mine", (b"client", 3, 1))
    node.remote.update({
        same: spb.ChunkMeta(chunk_id=same, commit_version=v_same, checksum=crc32c(b"same"), length=4),
        stale: spb.ChunkMeta(chunk_id=stale, commit_version=v_stale - 1, checksum=1, length=3),
        extra: spb.ChunkMeta(chunk_id=extra, commit_version=99),
        absent: spb.ChunkMeta(chunk_id=absent),  # neither committed nor pending there: nothing to do
    })

    asyncio.run(resync_successor(node, replica, CHAIN, SUCCESSOR, batch=2, timeout_ms=1_000))

    kinds = [kind for kind, _ in node.calls]
    assert kinds == ["channels", "dump", "forward", "forward", "forward", "channels", "channels", "done"]
    begin = node.calls[0][1]
    assert begin.begin and not begin.records and begin.version_floor == engine.floor
    forwards = {call[0].update.chunk_id: call for kind, call in node.calls if kind == "forward"}
    assert set(forwards) == {stale, extra, mine_only}
    req, payload = forwards[stale]
    assert payload == b"newer" and req.update_version == v_stale and req.full_chunk_replace and req.is_sync
    assert (req.chunk_length, req.chunk_checksum, req.chain_version) == (5, crc32c(b"newer"), 3)
    req, payload = forwards[extra]
    assert req.remove and req.update_version == 99 and payload == b""
    assert forwards[mine_only][1] == b"mine"
    pages = [c for k, c in node.calls if k == "channels"][1:]
    assert [len(p.records) for p in pages] == [2, 1]  # three records in pages of two
    assert sorted((r.channel_id, r.seq) for p in pages for r in p.records) == [(1, 1), (2, 1), (3, 1)]
    done = node.calls[-1][1]
    assert (done.chain_id, done.chain_version, done.target_id) == (CHAIN, 3, SUCCESSOR)


def test_only_the_chunks_copied_are_paced() -> None:
    same, stale = make_chunk_id(1, 0), make_chunk_id(1, 1)
    node, replica, engine = _setup({})
    v_same = _write(engine, same, b"same-bytes")
    _write(engine, stale, b"newer")
    node.remote[same] = spb.ChunkMeta(chunk_id=same, commit_version=v_same, checksum=crc32c(b"same-bytes"),
                                      length=10)
    paced: list[int] = []

    async def pace(nbytes: int) -> None:
        paced.append(nbytes)

    asyncio.run(resync_successor(node, replica, CHAIN, SUCCESSOR, batch=10, timeout_ms=1_000, pace=pace))
    assert sorted(paced) == [0, 5]  # the chunk the successor has costs nothing


def test_a_chain_that_moves_on_stops_the_resync_before_sync_done() -> None:
    node, replica, engine = _setup({})
    for i in range(4):
        _write(engine, make_chunk_id(2, i), b"x" * (i + 1))
    node.fail_after = 3  # begin, dump, one chunk: then the successor is no longer syncing
    with pytest.raises(TargetNotServing):
        asyncio.run(resync_successor(node, replica, CHAIN, SUCCESSOR, batch=10, timeout_ms=1_000))
    assert [kind for kind, _ in node.calls] == ["channels", "dump", "forward"]
    assert not any(replica.locks.held(make_chunk_id(2, i)) for i in range(4))

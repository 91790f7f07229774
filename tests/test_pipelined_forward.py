"""Pipelined forwarding (``ReplicaConfig.pipeline_forward``): a target forwards an update to its
successor while it stages it. What can go wrong is the stage failing after the successor already
committed the version — the target then holds less than the targets behind it. These tests fail a
head's stage at exactly that moment, on an in-process cluster (real sockets, real engines, an I/O
pool so that the stage and the forward really overlap), and check that no acknowledged write is
lost, that the head never serves the older copy meanwhile, and that the replicas end up identical.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fs3 import common_pb2 as cpb
from fs3 import storage_pb2 as spb
from fs3.common.checksum import crc32c
from fs3.common.errors import ChunkNotCommitted, IoError, NoSpace
from fs3.common.ids import chunk_id
from fs3.common.target_state import LocalState
from fs3.storage.chunk_engine import ChunkEngine
from fs3.storage.replica import ReplicaConfig
from tests.conftest import wait_until
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # in-process clusters

CHUNK = 1 << 20
OLD = b"o" * (256 << 10)  # kept in a file (past inline_max_bytes), written by the I/O pool
NEW = b"n" * (256 << 10)


async def _targets(cluster: InProcessCluster, chain: int) -> list[int]:
    routing = await cluster.admin().routing()
    return list(next(c for c in routing.chains if c.chain_id == chain).target_ids)


def _engine(cluster: InProcessCluster, target: int) -> ChunkEngine:
    return cluster.nodes[target // 100].engines[target]


def _committed(engine: ChunkEngine, cid: bytes) -> int:
    state = engine.get(cid)
    return state.commit_version if state is not None else 0


def _fail_stage_after(head: ChunkEngine, tail: ChunkEngine, cid: bytes, error: Exception,
                      stalled: threading.Event) -> None:
    """The head's next blob write of ``cid`` waits (on its I/O thread) until the tail committed a
    newer version than it has, signals ``stalled``, waits a little more and fails with ``error``;
    later writes go through."""
    real_write_blob = head.write_blob
    before = _committed(tail, cid)
    armed = [True]

    def write_blob(chunk_id: bytes, blob: int, content: bytes | memoryview) -> None:
        if chunk_id == cid and armed[0]:
            armed[0] = False
            deadline = time.monotonic() + 20
            while _committed(tail, cid) == before and time.monotonic() < deadline:
                time.sleep(0.01)
            stalled.set()
            time.sleep(0.3)  # time for a read of the head while the tail holds the new version
            raise error
        real_write_blob(chunk_id, blob, content)

    head.write_blob = write_blob  # type: ignore[method-assign]


def _set(event: threading.Event) -> Any:
    async def check() -> bool:
        return event.is_set()
    return check


async def _read_at(cluster: InProcessCluster, chain: int, target: int, cid: bytes) -> bytes | None:
    """The chunk as ``target`` serves it (None: it answers that the chunk is being written)."""
    replica = cluster.nodes[target // 100].replicas[target]
    try:
        _, data = await replica.read(spb.ReadReq(chain_id=chain, chunk_id=cid, offset=0, length=CHUNK,
                                                 dirty_policy=spb.DIRTY_READ_ASK_TAIL))
    except ChunkNotCommitted:
        return None
    return data


async def _identical(cluster: InProcessCluster, chain: int, cid: bytes) -> dict[int, tuple[int, bytes]]:
    """Each replica's committed version and bytes (checked against the checksum it records)."""
    out = {}
    for target in await _targets(cluster, chain):
        engine = _engine(cluster, target)
        state = engine.get(cid)
        assert state is not None and state.commit_version, f"target {target} holds no copy"
        assert not state.pending_version, f"target {target} still has a pending version"
        data = engine.read(cid, state.commit_version, 0, state.length)
        assert crc32c(data) == state.checksum, f"target {target}: bytes do not match their checksum"
        out[target] = (state.commit_version, data)
    return out


def _cluster(tmp_path: Path) -> InProcessCluster:
    config = ReplicaConfig(forward_timeout_ms=2_000, forward_retry_total_ms=10_000, routing_wait_ms=100)
    assert config.pipeline_forward
    return InProcessCluster(tmp_path, io_threads=2, replica_config=config)


def test_a_stage_that_runs_out_of_space_after_the_successors_committed_is_staged_again(tmp_path: Path) -> None:
    async def body() -> None:
        async with _cluster(tmp_path) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(1, 0)
            await cluster.client(b"W1").write(chain, cid, 0, OLD, CHUNK)
            targets = await _targets(cluster, chain)
            head, tail = _engine(cluster, targets[0]), _engine(cluster, targets[-1])
            stalled = threading.Event()
            _fail_stage_after(head, tail, cid, NoSpace("disk full (injected)"), stalled)
            write = asyncio.create_task(cluster.client(b"W2").write(chain, cid, 0, NEW, CHUNK))
            await wait_until(_set(stalled), what="the tail committed while the head's stage is stalled")
            assert _committed(tail, cid) > _committed(head, cid)
            # The head holds only the old copy and no pending version: it must not serve it.
            assert await _read_at(cluster, chain, targets[0], cid) in (None, NEW), \
                "the head served the old copy after the tail committed the new one"
            rsp = await write  # acknowledged: the head staged again and committed
            copies = await _identical(cluster, chain, cid)
            assert set(copies.values()) == {(rsp.commit_version, NEW)}, "replicas differ"
            assert await _read_at(cluster, chain, targets[0], cid) == NEW
            data, _ = await cluster.client(b"R").read(chain, cid, 0, CHUNK)
            assert data == NEW
    asyncio.run(body())


def test_a_disk_that_fails_under_a_pipelined_stage_takes_its_target_out_and_loses_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        async with _cluster(tmp_path) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(2, 0)
            await cluster.client(b"W1").write(chain, cid, 0, OLD, CHUNK)
            targets = await _targets(cluster, chain)
            failing = targets[0]
            head, tail = _engine(cluster, failing), _engine(cluster, targets[-1])
            stalled = threading.Event()
            _fail_stage_after(head, tail, cid, IoError("disk failed (injected)"), stalled)
            write = asyncio.create_task(cluster.client(b"W2").write(chain, cid, 0, NEW, CHUNK))
            await wait_until(_set(stalled), what="the tail committed while the head's stage is stalled")
            assert await _read_at(cluster, chain, failing, cid) in (None, NEW), \
                "the head served the old copy after the tail committed the new one"
            rsp = await write  # the client's retry reached the new head, which committed it already
            assert failing not in [t for t in await _targets(cluster, chain)
                                   if {x.target_id: x.public_state for x in await cluster.admin().targets()}[t]
                                   == cpb.SERVING], "the target whose disk failed still serves"
            data, _ = await cluster.client(b"R").read(chain, cid, 0, CHUNK)
            assert data == NEW, "an acknowledged write was lost"
            # The disk is replaced; the target comes back by resync with the chain's copy.
            node = cluster.nodes[failing // 100]
            cluster.replace_disk(failing)
            node.failed_targets.discard(failing)
            node.local_states[failing] = LocalState.ONLINE
            node.request_routing_refresh()
            await wait_until(cluster.all_serving, timeout_s=60, what="the target resynced and serving")
            copies = await _identical(cluster, chain, cid)
            assert {data for _, data in copies.values()} == {NEW}, "replicas differ after the resync"
            assert len({version for version, _ in copies.values()}) == 1
            assert rsp.commit_version == next(iter(copies.values()))[0]
            assert await _read_at(cluster, chain, failing, cid) == NEW, "the resynced target does not serve it"
    asyncio.run(body())


def test_serial_staging_is_still_available(tmp_path: Path) -> None:
    """``pipeline_forward = false``: stage, then forward (what the benchmark compares against)."""
    async def body() -> None:
        config = ReplicaConfig(forward_timeout_ms=2_000, forward_retry_total_ms=10_000, pipeline_forward=False)
        async with InProcessCluster(tmp_path, io_threads=2, replica_config=config) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(3, 0)
            rsp = await cluster.client(b"W").write(chain, cid, 0, NEW, CHUNK)
            copies = await _identical(cluster, chain, cid)
            assert set(copies.values()) == {(rsp.commit_version, NEW)}
    asyncio.run(body())


def test_a_stopped_update_keeps_the_chunk_lock_until_its_stage_has_written(tmp_path: Path) -> None:
    """Cancelling a pipelined update cancels its forward, never the chunk file write under the lock;
    the client's retry then completes the write everywhere."""
    async def body() -> None:
        async with _cluster(tmp_path) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(4, 0)
            await cluster.client(b"W1").write(chain, cid, 0, OLD, CHUNK)
            head = (await _targets(cluster, chain))[0]
            replica = cluster.nodes[head // 100].replicas[head]
            entered, release = threading.Event(), threading.Event()
            real_write_blob = replica.engine.write_blob

            def write_blob(chunk_id: bytes, blob: int, content: bytes | memoryview) -> None:
                if chunk_id == cid and not release.is_set():
                    entered.set()
                    release.wait(20)
                real_write_blob(chunk_id, blob, content)

            replica.engine.write_blob = write_blob  # type: ignore[method-assign]
            write = asyncio.create_task(cluster.client(b"W2").write(chain, cid, 0, NEW, CHUNK))
            await wait_until(_set(entered), what="the head's stage writing")
            stopping = asyncio.create_task(replica.stop())
            await asyncio.sleep(0.3)
            assert replica.locks.held(cid), "the chunk lock was released while the stage's write still ran"
            assert not stopping.done()
            release.set()
            await stopping
            rsp = await write
            copies = await _identical(cluster, chain, cid)
            assert set(copies.values()) == {(rsp.commit_version, NEW)}, "replicas differ"
    asyncio.run(body())

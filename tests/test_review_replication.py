"""Hostile-review regressions for the replication core: each test is a way the reworked
replication once lost or misreported an acknowledged write, or let bad input change state."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import fs3.storage.node as node_mod
from fs3 import storage_pb2 as spb
from fs3.common.checksum import crc32c
from fs3.common.errors import FS3Error
from fs3.common.ids import chunk_id as make_chunk_id
from fs3.common.target_state import PublicState
from fs3.rpc.methods import service_spec
from fs3.sim.cluster import ClusterShape, SimCluster
from fs3.sim.loop import VirtualTimeLoop
from fs3.sim.network import SimChannelFactory

pytestmark = pytest.mark.slow  # in-process clusters

_UPDATE = service_spec("Storage").method("Update")


def _run_sim(scenario: Any, cluster: SimCluster) -> Any:
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(scenario(cluster))
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


async def _until(predicate: Any, what: str, seconds: float = 30.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_write_rolled_back_by_a_lastsrv_head_is_not_answered_from_a_syncing_targets_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Chain [H, S] with S syncing. A client's write W is installed (and recorded) on S, then H
    dies before committing it: H becomes lastsrv, S falls back to waiting. H restarts without W
    (its pending version is gone) and serves again; it resyncs S, which rolls W back on S. If S
    kept its record of W, the client's retry of W — reaching S once H has failed again and S is
    head — would be acknowledged although W is in no replica."""
    gate = asyncio.Event()
    from fs3.storage.resync import resync_successor as real_resync

    async def gated_resync(*args: Any, **kwargs: Any) -> None:
        await gate.wait()
        await real_resync(*args, **kwargs)

    monkeypatch.setattr(node_mod, "resync_successor", gated_resync)

    async def scenario(cluster: SimCluster) -> tuple[spb.UpdateRsp, bytes]:
        gate.set()
        loop = asyncio.get_running_loop()
        chain = (await cluster.boot())[0]
        assert cluster.mgmtd is not None
        state = cluster.mgmtd.state
        head, syncing = state.chains[chain].target_ids
        cid = make_chunk_id(1, 0)
        channels = SimChannelFactory(cluster.network, "raw-client")

        async def send(data: bytes, seq: int, age_ms: int = 0) -> spb.UpdateRsp:
            info = state.chains[chain]
            req = spb.UpdateReq(chain_id=chain, chain_version=info.chain_version, chunk_id=cid, type=spb.WRITE,
                                offset=0, length=len(data), chunk_size=4096, checksum=crc32c(data),
                                client_id=b"client", channel_id=1, seq=seq, retry_age_ms=age_ms)
            rsp, _ = await channels.get(f"storage-{info.target_ids[0] // 100}").call(_UPDATE, req, data, 2000)
            assert isinstance(rsp, spb.UpdateRsp)
            return rsp

        await send(b"ONE" * 10, 1)
        gate.clear()  # S's resync will wait
        cluster.kill_storage(syncing // 100)
        await asyncio.sleep(4)
        cluster.start_storage(syncing // 100)
        await _until(lambda: cluster.public_states()[syncing] is PublicState.SYNCING
                     and cluster.storage[head // 100].node.view(chain, head).successor() is not None,  # type: ignore[union-attr]
                     "S syncing")
        replica = cluster.storage[head // 100].node.replicas[head]  # type: ignore[union-attr]
        real_commit = replica._do_commit

        async def dying_commit(op: Any, version: int) -> None:
            if op.channel and op.channel[2] == 2:  # W: S has installed it; H dies before committing
                loop.call_soon(cluster.kill_storage, head // 100)
                await asyncio.sleep(10)
            await real_commit(op, version)

        replica._do_commit = dying_commit  # type: ignore[method-assign]
        with pytest.raises(FS3Error):
            await send(b"TWO" * 10, 2)
        await _until(lambda: cluster.public_states()[head] is PublicState.LASTSRV, "H lastsrv")
        cluster.start_storage(head // 100)
        await _until(lambda: cluster.public_states()[head] is PublicState.SERVING, "H serving again")
        gate.set()
        await cluster.wait_all_serving(60_000)
        cluster.kill_storage(head // 100)  # H fails again: S is head
        await _until(lambda: state.chains[chain].target_ids[0] == syncing
                     and cluster.storage[syncing // 100].node.view(chain, syncing).is_head,  # type: ignore[union-attr]
                     "S head")
        rsp = await send(b"TWO" * 10, 2, age_ms=15_000)  # the client's retry of W
        engine = cluster.engine(syncing)
        assert engine is not None
        current = engine.get(cid)
        assert current is not None
        return rsp, engine.read(cid, current.commit_version, 0, 100)

    shape = ClusterShape(storage_nodes=2, replicas=2, heartbeat_timeout_ms=1000, heartbeat_interval_ms=100)
    rsp, data = _run_sim(scenario, SimCluster(7, shape))
    assert data == b"TWO" * 10, f"the retry of W was acknowledged (v{rsp.commit_version}) but the chunk is {data!r}"


# -- bad input to the new and changed RPC fields: a typed error, and nothing changes ---------------

def test_sync_channels_checks_everything_before_it_changes_anything() -> None:
    from fs3.common.errors import ChainVersionMismatch, InvalidArgument, StaleUpdate
    from fs3.kv.store import MemKVStore
    from fs3.storage.blobs import MemBlobStore
    from fs3.storage.chain_view import ChainMember, ChainView
    from fs3.storage.chunk_engine import ChunkEngine
    from fs3.storage.replica import TargetReplica

    class Host:
        def view(self, chain_id: int, target_id: int) -> ChainView:
            return ChainView(1, 5, 9, 2, (ChainMember(1, 1, PublicState.SERVING, "a"),
                                          ChainMember(2, 2, PublicState.SYNCING, "b")))

        def now_ms(self) -> int:
            return 1000

        def request_routing_refresh(self) -> None:
            pass

    engine = ChunkEngine(MemKVStore(), MemBlobStore())
    replica = TargetReplica(2, engine, Host())  # type: ignore[arg-type]
    floor = engine.floor
    cid = make_chunk_id(1, 1)

    def req(**fields: Any) -> spb.SyncChannelsReq:
        out = spb.SyncChannelsReq(chain_id=1, chain_version=5, from_target_id=1, target_id=2, version_floor=50)
        for name, value in fields.items():
            setattr(out, name, value)
        return out

    good = dict(client_id=b"c", channel_id=1, seq=3, commit_version=7, chunk_id=cid)
    cases: list[tuple[spb.SyncChannelsReq, type[Exception]]] = []
    r = req(version_floor=2**64 - 1)
    r.records.add(**good)
    cases.append((r, InvalidArgument))
    for bad in ({"client_id": b""}, {"client_id": b"x" * 256}, {"commit_version": 2**64 - 1}, {"chunk_id": b""}):
        r = req()
        r.records.add(**good)
        r.records.add(**{**good, **bad})
        cases.append((r, InvalidArgument))
    r = req(chain_version=4)
    r.records.add(**good)
    cases.append((r, ChainVersionMismatch))
    r = req(from_target_id=3)
    r.records.add(**good)
    cases.append((r, StaleUpdate))
    for bad_req, error in cases:
        with pytest.raises(error):
            replica.sync_channels(bad_req)
        assert engine.floor == floor and engine.channel_count == 0, bad_req
    r = req()
    r.records.add(**good)
    assert replica.sync_channels(r) == 1 and engine.floor >= 50


def test_forwards_with_bad_versions_or_unasked_sync_copies_are_refused_and_change_nothing(tmp_path: Any) -> None:
    from fs3.common.errors import StatusCode
    from tests.inproc import InProcessCluster
    from tests.test_replication_faults import CHUNK, _chain, _replica_bytes, _send

    storage = service_spec("Storage")

    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chain = cluster.chain_ids[0]
            cid = make_chunk_id(1, 7)
            await _send(cluster, chain, cid, spb.WRITE, b"hello" * 10, client=b"c", channel=1, seq=1)
            version, (head, middle, tail), _ = await _chain(cluster, chain)
            before = await _replica_bytes(cluster, chain, cid)
            floors = {t: cluster.nodes[t // 100].engines[t].floor for t in (head, middle, tail)}

            async def call(target: int, method: str, req: Any, payload: bytes = b"") -> StatusCode:
                address = cluster.nodes[target // 100].config.framed_address
                try:
                    await cluster.channels.get(address).call(storage.method(method), req, payload, timeout_ms=5000)
                except FS3Error as exc:
                    return exc.code
                return StatusCode.OK

            data = b"x" * 10
            update = spb.UpdateReq(chain_id=chain, chunk_id=cid, type=spb.WRITE, offset=0, length=10,
                                   chunk_size=CHUNK, checksum=crc32c(data))
            long_client = spb.UpdateReq(chain_id=chain, chain_version=version, chunk_id=cid, type=spb.WRITE,
                                        length=10, chunk_size=CHUNK, checksum=crc32c(data), client_id=b"A" * 300,
                                        channel_id=1, seq=1)
            assert await call(head, "Update", long_client, data) == StatusCode.INVALID_ARGUMENT
            huge = spb.ForwardReq(update=update, update_version=2**64 - 1, base_version=1, chain_version=version,
                                  from_target_id=head)
            assert await call(middle, "Forward", huge, data) == StatusCode.INVALID_ARGUMENT
            old = b"OLD!" * 3
            sync_to_serving = spb.ForwardReq(update=spb.UpdateReq(chain_id=chain, chunk_id=cid, type=spb.WRITE),
                                             update_version=1, chain_version=version, from_target_id=middle,
                                             full_chunk_replace=True, is_sync=True, chunk_length=len(old),
                                             chunk_checksum=crc32c(old))
            assert await call(tail, "Forward", sync_to_serving, old) == StatusCode.TARGET_NOT_SERVING
            other = make_chunk_id(1, 8)
            version_zero = spb.ForwardReq(update=spb.UpdateReq(chain_id=chain, chunk_id=other, type=spb.WRITE),
                                          update_version=0, chain_version=version, from_target_id=middle,
                                          full_chunk_replace=True, chunk_length=len(old), chunk_checksum=crc32c(old))
            assert await call(tail, "Forward", version_zero, old) == StatusCode.INVALID_ARGUMENT
            assert await _replica_bytes(cluster, chain, cid) == before
            assert cluster.nodes[tail // 100].engines[tail].get(other) is None
            assert {t: cluster.nodes[t // 100].engines[t].floor for t in (head, middle, tail)} == floors
            rsp = await _send(cluster, chain, cid, spb.WRITE, b"after", client=b"c", channel=1, seq=2)
            assert rsp.commit_version > 1
            after = await _replica_bytes(cluster, chain, cid)
            assert len(set(after.values())) == 1, after

    asyncio.run(body())


def test_a_power_loss_between_a_commit_and_its_log_sync_keeps_the_acknowledged_version() -> None:
    """One-replica chain: v1 acknowledged, then v2 committed with its log sync still to come when
    the power fails. The commit batch is lost, so the metadata names v1 again — whose blob the
    commit must not have deleted yet (it once did: the chunk read IO_ERROR and v1 was gone)."""

    async def scenario(cluster: SimCluster) -> bytes:
        loop = asyncio.get_running_loop()
        chain = (await cluster.boot())[0]
        assert cluster.mgmtd is not None
        (target,) = cluster.mgmtd.state.chains[chain].target_ids
        cid = make_chunk_id(1, 0)
        client = cluster.new_client()
        await client.write(chain, cid, 0, b"ONE" * 1000, 4096)
        engine = cluster.engine(target)
        assert engine is not None
        real_commit = engine.commit

        def commit_then_power_loss(*args: Any, **kwargs: Any) -> Any:
            out = real_commit(*args, **kwargs)
            loop.call_soon(cluster.kill_storage, target // 100)
            return out

        engine.commit = commit_then_power_loss  # type: ignore[method-assign]
        with pytest.raises((FS3Error, TimeoutError)):
            await asyncio.wait_for(client.write(chain, cid, 0, b"TWO" * 1000, 4096), 5)
        await asyncio.sleep(3)
        cluster.start_storage(target // 100)
        await cluster.wait_all_serving(60_000)
        data, _ = await asyncio.wait_for(cluster.new_client().read(chain, cid, 0, 4096), 20)
        return data

    shape = ClusterShape(storage_nodes=1, replicas=1, inline_max_bytes=0)
    assert _run_sim(scenario, SimCluster(3, shape)) == b"ONE" * 1000

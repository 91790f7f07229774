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
from fs3.mgmtd.chain_state import PublicState
from fs3.rpc.methods import service_spec
from fs3.sim.cluster import ClusterShape, SimCluster
from fs3.sim.loop import VirtualTimeLoop
from fs3.sim.network import SimChannelFactory

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
    real_resync = node_mod.resync_successor

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

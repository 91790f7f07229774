"""Replication under retries, cancellations and failing disks, on an in-process cluster (real
sockets, real engines). Each test is a way an acknowledged write was once lost or corrupted.

A "lost reply" is played by sending the same request (client id, channel, sequence number) twice
on the wire: the first answer is ignored, the second is the retry.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from fs3 import common_pb2 as cpb
from fs3 import storage_pb2 as spb
from fs3.common.checksum import crc32c
from fs3.common.errors import ChannelSeqStale, NoSpace, ResourceExhausted
from fs3.common.ids import chunk_id
from fs3.common.target_state import LocalState
from fs3.rpc.methods import service_spec
from fs3.storage.replica import ReplicaConfig, TargetReplica
from tests.conftest import wait_until
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # in-process clusters

CHUNK = 1 << 20
_UPDATE = service_spec("Storage").method("Update")


def run(coro: Any) -> None:
    asyncio.run(coro)


async def _chain(cluster: InProcessCluster, chain: int) -> tuple[int, list[int], str]:
    """(chain version, target ids in chain order, the head's address)."""
    routing = await cluster.admin().routing()
    info = next(c for c in routing.chains if c.chain_id == chain)
    head = info.target_ids[0]
    node = cluster.nodes[head // 100]
    return info.chain_version, list(info.target_ids), node.config.framed_address


def _replica(cluster: InProcessCluster, target: int) -> TargetReplica:
    return cluster.nodes[target // 100].replicas[target]


def _hold_forwards(replica: TargetReplica) -> tuple[asyncio.Event, asyncio.Event, Any]:
    """Forwards reaching ``replica`` wait until released: (arrived, release, the real handler)."""
    arrived, release = asyncio.Event(), asyncio.Event()
    real_forward = replica.forward

    async def held_forward(req: spb.ForwardReq, payload: Any) -> spb.UpdateRsp:
        arrived.set()
        await release.wait()
        return await real_forward(req, payload)

    replica.forward = held_forward  # type: ignore[method-assign]
    return arrived, release, real_forward


async def _send(cluster: InProcessCluster, chain: int, cid: bytes, kind: int, data: bytes = b"", *,
                client: bytes, channel: int, seq: int, offset: int = 0, retry_age_ms: int = 0) -> spb.UpdateRsp:
    """One Update request on the wire, with an explicit exactly-once identity."""
    version, _, address = await _chain(cluster, chain)
    req = spb.UpdateReq(chain_id=chain, chain_version=version, chunk_id=cid, type=kind,  # type: ignore[arg-type]
                        offset=offset, length=len(data), chunk_size=CHUNK,
                        checksum=crc32c(data) if kind == spb.WRITE else 0, client_id=client, channel_id=channel,
                        seq=seq)
    if retry_age_ms:
        req.retry_age_ms = retry_age_ms
    rsp, _ = await cluster.channels.get(address).call(_UPDATE, req, data, timeout_ms=10_000)
    assert isinstance(rsp, spb.UpdateRsp)
    return rsp


async def _replica_bytes(cluster: InProcessCluster, chain: int, cid: bytes) -> dict[int, bytes | None]:
    """Each replica's committed bytes of the chunk, checked against the checksum it records."""
    _, targets, _ = await _chain(cluster, chain)
    out: dict[int, bytes | None] = {}
    for target in targets:
        engine = cluster.nodes[target // 100].engines[target]
        state = engine.get(cid)
        if state is None or not state.commit_version:
            out[target] = None
            continue
        data = engine.read(cid, state.commit_version, 0, state.length)
        assert crc32c(data) == state.checksum, f"target {target}: bytes do not match their checksum"
        out[target] = data
    return out


def test_a_retried_remove_is_not_applied_again_after_another_clients_write(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(1, 0)
            await _send(cluster, chain, cid, spb.WRITE, b"old", client=b"A", channel=1, seq=1)
            await _send(cluster, chain, cid, spb.REMOVE, client=b"A", channel=1, seq=2)  # the reply is "lost"
            data, _ = await cluster.client(b"R").read(chain, cid, 0, 100)
            assert data == b""
            await cluster.client(b"B").write(chain, cid, 0, b"B's acknowledged write", CHUNK)
            await _send(cluster, chain, cid, spb.REMOVE, client=b"A", channel=1, seq=2)  # A's retry
            data, _ = await cluster.client(b"R").read(chain, cid, 0, 100)
            assert data == b"B's acknowledged write", "a retried remove ran twice"
    run(body())


def test_a_retried_write_does_not_bring_back_a_removed_chunk(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(2, 0)
            await _send(cluster, chain, cid, spb.WRITE, b"A's write", client=b"A", channel=3, seq=7)  # reply "lost"
            await cluster.client(b"B").remove(chain, cid, CHUNK)
            rsp = await _send(cluster, chain, cid, spb.WRITE, b"A's write", client=b"A", channel=3, seq=7)
            assert rsp.chunk_length == len(b"A's write"), "the retry is answered with the first answer"
            data, _ = await cluster.client(b"R").read(chain, cid, 0, 100)
            assert data == b"", "a retried write brought a removed chunk back"
    run(body())


def test_a_retry_after_failovers_is_answered_by_a_resynced_head(tmp_path: Path) -> None:
    """The request's answer reaches a target rebuilt by resync, so a retry is answered once even when
    that target has become the head."""
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(3, 0)
            await _send(cluster, chain, cid, spb.WRITE, b"X", client=b"A", channel=1, seq=1)  # reply "lost"
            _, targets, _ = await _chain(cluster, chain)
            tail = targets[-1]
            await _take_out_and_resync(cluster, tail, replace_disk=True)
            for failed in targets[:2]:  # then the head's and the middle's disks fail
                cluster.nodes[failed // 100].failed_targets.add(failed)
                cluster.nodes[failed // 100].request_routing_refresh()
            await wait_until(lambda: _only_serving(cluster, chain, tail), what="the rebuilt target heads the chain")
            await cluster.client(b"B").write(chain, cid, 0, b"Y", CHUNK)
            await _send(cluster, chain, cid, spb.WRITE, b"X", client=b"A", channel=1, seq=1)  # A's retry
            data, _ = await cluster.client(b"R").read(chain, cid, 0, 10)
            assert data == b"Y", "a retry reaching a resynced head was applied a second time"
    run(body())


async def _only_serving(cluster: InProcessCluster, chain: int, target: int) -> bool:
    _, targets, _ = await _chain(cluster, chain)
    states = {t.target_id: t.public_state for t in await cluster.admin().targets()}
    node = cluster.nodes[target // 100]
    return targets[0] == target and [t for t in targets if states[t] == cpb.SERVING] == [target] \
        and node.routing_version >= (cluster.mgmtd.state.routing_version if cluster.mgmtd else 0)


async def _take_out_and_resync(cluster: InProcessCluster, target: int, replace_disk: bool = False) -> None:
    node = cluster.nodes[target // 100]
    node.failed_targets.add(target)
    node.request_routing_refresh()

    async def out() -> bool:
        targets = {t.target_id: t for t in await cluster.admin().targets()}
        return targets[target].public_state == cpb.OFFLINE

    await wait_until(out, what=f"target {target} out of its chain")
    if replace_disk:
        cluster.replace_disk(target)
    node.failed_targets.discard(target)
    node.local_states[target] = LocalState.ONLINE
    node.request_routing_refresh()
    await wait_until(cluster.all_serving, what=f"target {target} resynced and serving")


def test_a_retry_is_not_answered_before_its_commit_is_durable(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_fsync=True, io_threads=2) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(4, 0)
            await cluster.client(b"W").write(chain, cid, 0, b"warm", CHUNK)
            _, targets, _ = await _chain(cluster, chain)
            head = cluster.nodes[targets[0] // 100].engines[targets[0]]
            release = threading.Event()
            real_sync = head.kv.sync_wal

            def slow_sync() -> None:
                if head.channel(b"A", 1) is not None:  # the commit's sync (not the patch record's)
                    release.wait(10)
                real_sync()

            head.kv.sync_wal = slow_sync  # type: ignore[method-assign]
            first = asyncio.create_task(_send(cluster, chain, cid, spb.WRITE, b"D", client=b"A", channel=1, seq=1))
            await wait_until(lambda: _has_record(head, b"A", 1), what="the commit recorded at the head")
            retry = asyncio.create_task(_send(cluster, chain, cid, spb.WRITE, b"D", client=b"A", channel=1, seq=1))
            await asyncio.sleep(0.3)
            assert not retry.done(), "a retry was acknowledged before the commit was durable"
            release.set()
            assert (await first).commit_version == (await retry).commit_version
    run(body())


async def _has_record(engine: Any, client: bytes, channel: int) -> bool:
    return engine.channel(client, channel) is not None


def test_a_head_cancelled_while_forwarding_completes_and_records_its_write(tmp_path: Path) -> None:
    """The request at the head is cancelled (a deadline, a closed connection) while its forward is
    in flight: the write still completes once, with its exactly-once record, so the client's retry
    after another client's write does not apply it a second time (X, Y, X)."""
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(5, 0)
            version, targets, _ = await _chain(cluster, chain)
            head, middle = _replica(cluster, targets[0]), _replica(cluster, targets[1])
            arrived, release, real_forward = _hold_forwards(middle)
            req = spb.UpdateReq(chain_id=chain, chain_version=version, chunk_id=cid, type=spb.WRITE, offset=0,
                                length=1, chunk_size=CHUNK, checksum=crc32c(b"X"), client_id=b"A", channel_id=1,
                                seq=1)
            task = asyncio.create_task(head.update(req, memoryview(b"X")))
            await arrived.wait()
            task.cancel()
            await asyncio.sleep(0.05)
            release.set()
            middle.forward = real_forward  # type: ignore[method-assign]
            await cluster.client(b"B").write(chain, cid, 0, b"Y", CHUNK)
            data, _ = await cluster.client(b"R").read(chain, cid, 0, 10)
            assert data == b"Y"
            await _send(cluster, chain, cid, spb.WRITE, b"X", client=b"A", channel=1, seq=1)  # A's retry
            data, _ = await cluster.client(b"R").read(chain, cid, 0, 10)
            assert data == b"Y", "the cancelled write was applied a second time"
    run(body())


def test_a_cancelled_large_write_never_mixes_with_the_next_one(tmp_path: Path) -> None:
    """A large version is written by an I/O thread under the chunk lock; cancelling its request must
    not release the lock while the thread still writes, or the next write interleaves with it."""
    async def body() -> None:
        async with InProcessCluster(tmp_path, io_threads=2) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(6, 0)
            version, targets, _ = await _chain(cluster, chain)
            head = _replica(cluster, targets[0])
            started, release = threading.Event(), threading.Event()
            files = head.engine.files
            real_write = files.write
            blocked = [True]

            def slow_write(chunk_id: bytes, blob: int, data: bytes | memoryview) -> None:
                if blocked[0]:
                    blocked[0] = False
                    started.set()
                    release.wait(10)
                real_write(chunk_id, blob, data)

            files.write = slow_write  # type: ignore[method-assign]
            a = b"A" * (256 * 1024)
            req = spb.UpdateReq(chain_id=chain, chain_version=version, chunk_id=cid, type=spb.WRITE, offset=0,
                                length=len(a), chunk_size=CHUNK, checksum=crc32c(a), client_id=b"A", channel_id=1,
                                seq=1)
            task = asyncio.create_task(head.update(req, memoryview(a)))
            await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
            task.cancel()
            b = b"B" * (256 * 1024)
            second = asyncio.create_task(cluster.client(b"B").write(chain, cid, 0, b, CHUNK))
            await asyncio.sleep(0.3)
            release.set()
            await second
            copies = await _replica_bytes(cluster, chain, cid)
            assert set(copies.values()) == {b}, {t: (v[:1], len(v)) if v else None for t, v in copies.items()}
    run(body())


def test_a_read_that_hits_an_io_error_reads_another_replica_and_fails_the_target(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(7, 0)
            data = b"z" * (300 * 1024)  # a file blob, not an inline record
            await cluster.client(b"W").write(chain, cid, 0, data, CHUNK)
            _, targets, _ = await _chain(cluster, chain)
            broken = targets[1]
            engine = cluster.nodes[broken // 100].engines[broken]
            state = engine.get(cid)
            assert state is not None and not state.commit_inline
            for path in (tmp_path / f"n{broken // 100}").rglob(f"{cid.hex()}.*"):
                path.unlink()  # the disk lost the file
            reader = cluster.client(b"R")
            for _ in range(12):
                got, _ = await reader.read(chain, cid, 0, len(data))
                assert got == data

            async def out() -> bool:
                info = {t.target_id: t for t in await cluster.admin().targets()}
                return info[broken].public_state != cpb.SERVING

            await wait_until(out, what="the target that failed a read leaves its chain")
    run(body())


def test_resync_skips_a_chunk_that_has_only_a_pending_first_version(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(8, 0)
            await cluster.client(b"W").write(chain, chunk_id(8, 1), 0, b"data", CHUNK)
            _, targets, _ = await _chain(cluster, chain)
            middle = cluster.nodes[targets[1] // 100].engines[targets[1]]
            # A first version left pending by a write whose head failed (never committed anywhere).
            middle.stage(cid, middle.new_version(), b"p", crc32c(b"p"), 1)
            await _take_out_and_resync(cluster, targets[2])
    run(body())


def test_exactly_once_records_expire_and_stale_retries_are_refused(tmp_path: Path) -> None:
    async def body() -> None:
        config = ReplicaConfig(forward_timeout_ms=1_000, forward_retry_total_ms=5_000, channel_record_ttl_ms=600)
        async with InProcessCluster(tmp_path, replica_config=config, channel_expiry_interval_ms=100) as cluster:
            chain = cluster.chain_ids[0]
            for i in range(20):  # one client id per mount or connect
                await _send(cluster, chain, chunk_id(9, i), spb.WRITE, b"x", client=b"client-%d" % i, channel=1,
                            seq=1)
            _, targets, _ = await _chain(cluster, chain)
            engines = [cluster.nodes[t // 100].engines[t] for t in targets]
            assert all(e.channel_count >= 20 for e in engines)

            async def expired() -> bool:
                return all(e.channel_count == 0 for e in engines)

            await wait_until(expired, timeout_s=10, what="exactly-once records expired")
            with pytest.raises(ChannelSeqStale):
                await _send(cluster, chain, chunk_id(9, 0), spb.WRITE, b"x", client=b"client-0", channel=1, seq=1,
                            retry_age_ms=400)
    run(body())


def test_updates_in_flight_are_bounded(tmp_path: Path) -> None:
    """An update outlives a cancelled request, so a target bounds how many run at once (and the
    bytes they hold): beyond that, requests are refused with RESOURCE_EXHAUSTED, which clients retry."""
    async def body() -> None:
        config = ReplicaConfig(forward_timeout_ms=1_000, forward_retry_total_ms=5_000, updates_inflight_max=1)
        async with InProcessCluster(tmp_path, replica_config=config) as cluster:
            chain = cluster.chain_ids[0]
            version, targets, _ = await _chain(cluster, chain)
            head, middle = _replica(cluster, targets[0]), _replica(cluster, targets[1])
            arrived, release, real_forward = _hold_forwards(middle)

            def request(index: int) -> spb.UpdateReq:
                return spb.UpdateReq(chain_id=chain, chain_version=version, chunk_id=chunk_id(10, index),
                                     type=spb.WRITE, length=1, chunk_size=CHUNK, checksum=crc32c(b"x"))

            first = asyncio.create_task(head.update(request(0), memoryview(b"x")))
            await arrived.wait()
            with pytest.raises(ResourceExhausted):
                await head.update(request(1), memoryview(b"x"))
            release.set()
            await first
            middle.forward = real_forward  # type: ignore[method-assign]
            await cluster.client(b"C").write(chain, chunk_id(10, 1), 0, b"x", CHUNK)
    run(body())


def test_a_commit_out_of_space_after_the_tail_committed_is_not_a_refusal(tmp_path: Path) -> None:
    """The middle runs out of space at its commit, after the tail committed: its predecessor must not
    drop the version as if nobody had applied it (the replicas would diverge); it forwards again."""
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chain, cid = cluster.chain_ids[0], chunk_id(11, 0)
            await cluster.client(b"W").write(chain, cid, 0, b"base", CHUNK)
            _, targets, _ = await _chain(cluster, chain)
            middle = cluster.nodes[targets[1] // 100].engines[targets[1]]
            real_commit = middle.commit
            failures = [1]

            def full_once(*args: Any, **kwargs: Any) -> Any:
                if failures:
                    failures.pop()
                    raise NoSpace("disk full at commit")
                return real_commit(*args, **kwargs)

            middle.commit = full_once  # type: ignore[method-assign]
            writer = cluster.client(b"W2")  # (one client object: a new one with an old id reuses its sequence numbers)
            await writer.write(chain, cid, 0, b"next", CHUNK)
            copies = await _replica_bytes(cluster, chain, cid)
            assert set(copies.values()) == {b"next"}, copies
            await writer.write(chain, cid, 0, b"more", CHUNK)
            assert set((await _replica_bytes(cluster, chain, cid)).values()) == {b"more"}
    run(body())

"""The storage service over both transports: reads, writes, dirty reads and bad input."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fs3 import storage_pb2 as spb
from fs3.common.checksum import crc32c
from fs3.common.errors import (
    ChainVersionMismatch,
    ChecksumMismatch,
    InvalidArgument,
    LeaseExpired,
    NotHead,
    StatusCode,
    TargetNotServing,
    Unauthenticated,
    Unavailable,
)
from fs3.common.ids import chunk_id
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.methods import service_spec
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # in-process clusters

STORAGE = service_spec("Storage")
CHUNK = 64 * 1024

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_write_read_truncate_remove(tmp_path: Path, transport: str) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path, transport=transport) as cluster:
            client = cluster.client()
            chain = cluster.chain_ids[0]
            cid = chunk_id(1, 0)
            rsp = await client.write(chain, cid, 0, b"a" * 1000, CHUNK)
            assert rsp.commit_version == 1 and rsp.chunk_length == 1000
            await client.write(chain, cid, 4096, b"b" * 10, CHUNK)
            data, read_rsp = await client.read(chain, cid, 0, CHUNK)
            assert data == b"a" * 1000 + bytes(3096) + b"b" * 10 and read_rsp.version == 2
            # Every replica answers the same (reads rotate over them).
            for _ in range(6):
                again, _ = await client.read(chain, cid, 990, 20, verify_checksum=True)
                assert again == b"a" * 10 + bytes(10)
            await client.truncate(chain, cid, 500, CHUNK)
            data, _ = await client.read(chain, cid, 0, CHUNK)
            assert data == b"a" * 500
            await client.remove(chain, cid, CHUNK)
            data, read_rsp = await client.read(chain, cid, 0, CHUNK)
            assert data == b"" and read_rsp.version == 0
            report = await cluster.admin().verify()
            assert report.ok, report.as_dict()
            node = cluster.nodes[1]
            address = node.config.grpc_address if transport == "grpc" else node.config.framed_address
            stats, _ = await cluster.channels.get(address).call(STORAGE.method("TargetStats"), spb.TargetStatsReq())
            [target] = stats.targets  # type: ignore[attr-defined]
            assert target.target_id == 101 and target.local_state == "up_to_date" and target.chain_id == chain
    run(body())


def test_retry_is_exactly_once(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chain = cluster.chain_ids[0]
            routing = await cluster.admin().routing()
            head_target = next(c for c in routing.chains if c.chain_id == chain).target_ids[0]
            head = cluster.nodes[head_target // 100]
            req = spb.UpdateReq(chain_id=chain, chain_version=head.view(chain, head_target).chain_version,  # type: ignore[union-attr]
                                chunk_id=chunk_id(3, 0), type=spb.WRITE, offset=0, length=4, chunk_size=CHUNK,
                                checksum=crc32c(b"abcd"), client_id=b"cl", channel_id=1, seq=1)
            channel = cluster.channels.get(head.config.framed_address)
            first, _ = await channel.call(STORAGE.method("Update"), req, b"abcd")
            second, _ = await channel.call(STORAGE.method("Update"), req, b"abcd")
            assert first == second  # the retry got the cached answer, no second version
            assert head.engines[head_target].get(chunk_id(3, 0)).commit_version == 1  # type: ignore[union-attr]
            req.seq = 0
            with pytest.raises(Exception) as stale:
                await channel.call(STORAGE.method("Update"), req, b"abcd")
            assert getattr(stale.value, "code", None) is StatusCode.CHANNEL_SEQ_STALE
    run(body())


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_bad_updates_are_typed_errors_and_change_nothing(tmp_path: Path, transport: str) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path, transport=transport) as cluster:
            client = cluster.client()
            chain = cluster.chain_ids[0]
            cid = chunk_id(9, 0)
            await client.write(chain, cid, 0, b"original", CHUNK)
            routing = await cluster.admin().routing()
            chain_info = next(c for c in routing.chains if c.chain_id == chain)
            head_tid, tail_tid = chain_info.target_ids[0], chain_info.target_ids[-1]
            nodes = {n.node_id: n for n in routing.nodes}
            head_addr = cluster.channels.node_address(nodes[head_tid // 100].framed_address,
                                                      nodes[head_tid // 100].grpc_address)
            tail_addr = cluster.channels.node_address(nodes[tail_tid // 100].framed_address,
                                                      nodes[tail_tid // 100].grpc_address)
            version = chain_info.chain_version

            def update(**changes: object) -> spb.UpdateReq:
                req = spb.UpdateReq(chain_id=chain, chain_version=version, chunk_id=cid, type=spb.WRITE, offset=0,
                                    length=3, chunk_size=CHUNK, checksum=crc32c(b"new"))
                for key, value in changes.items():
                    setattr(req, key, value)
                return req

            cases: list[tuple[spb.UpdateReq, bytes, type[Exception], str]] = [
                (update(chain_id=999), b"new", TargetNotServing, head_addr),
                (update(chain_version=version + 5), b"new", ChainVersionMismatch, head_addr),
                (update(chain_version=version - 1), b"new", ChainVersionMismatch, head_addr),
                (update(offset=CHUNK - 1), b"new", InvalidArgument, head_addr),
                (update(chunk_size=CHUNK + 1), b"new", InvalidArgument, head_addr),
                (update(checksum=123), b"new", ChecksumMismatch, head_addr),
                (update(length=2), b"new", InvalidArgument, head_addr),
                (update(chunk_id=b""), b"new", InvalidArgument, head_addr),
                (update(type=42), b"new", InvalidArgument, head_addr),
                (update(), b"new", NotHead, tail_addr),
            ]
            for req, payload, error, address in cases:
                with pytest.raises(error):
                    await cluster.channels.get(address).call(STORAGE.method("Update"), req, payload)
            for node in cluster.nodes.values():
                for engine in node.engines.values():
                    state = engine.get(cid)
                    if state is not None:
                        assert state.commit_version == 1 and state.pending_version == 0
            data, _ = await client.read(chain, cid, 0, 100)
            assert data == b"original"
            with pytest.raises(InvalidArgument):
                await cluster.channels.get(head_addr).call(
                    STORAGE.method("Read"), spb.ReadReq(chain_id=chain, chunk_id=b"x" * 100, length=1))
            with pytest.raises(InvalidArgument):
                await cluster.channels.get(head_addr).call(STORAGE.method("DumpChunkMeta"),
                                                           spb.DumpChunkMetaReq(chain_id=chain, limit=10**6))
            # Without the cluster token nothing is answered at all.
            anonymous = RealChannelFactory(None, transport)  # type: ignore[arg-type]
            with pytest.raises(Unauthenticated):
                await anonymous.get(head_addr).call(STORAGE.method("Update"), update(), b"new")
            wrong = RealChannelFactory("wrong", transport)  # type: ignore[arg-type]
            with pytest.raises(Unauthenticated):
                await wrong.get(head_addr).call(STORAGE.method("Read"), spb.ReadReq(chain_id=chain, chunk_id=cid))
            await anonymous.close()
            await wrong.close()
            assert (await cluster.admin().verify()).ok
    run(body())


@pytest.mark.parametrize("policy", [spb.DIRTY_READ_RETRY, spb.DIRTY_READ_ASK_TAIL])
def test_dirty_reads_both_policies(tmp_path: Path, policy: int) -> None:
    """A read racing a write answers the old or the new version, never a torn or uncommitted one."""

    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            writer = cluster.client(b"w")
            reader = cluster.client(b"r", retry_backoff_ms=1)
            reader.config = type(reader.config)(dirty_policy=policy, retry_backoff_ms=1)
            chain = cluster.chain_ids[0]
            cid = chunk_id(5, 0)
            await writer.write(chain, cid, 0, bytes([0]) * 8192, CHUNK)
            stop = asyncio.Event()
            latest_acked = [0]

            async def write_loop() -> None:
                for value in range(1, 40):
                    await writer.write(chain, cid, 0, bytes([value]) * 8192, CHUNK)
                    latest_acked[0] = value
                stop.set()

            async def read_loop() -> int:
                reads = 0
                while not stop.is_set():
                    floor = latest_acked[0]
                    data, _ = await reader.read(chain, cid, 0, 8192)
                    assert len(set(data)) == 1, "torn read"
                    assert data[0] >= floor, "read older than an acknowledged write"
                    reads += 1
                return reads

            results = await asyncio.gather(write_loop(), read_loop(), read_loop())
            assert results[1] + results[2] > 10
    run(body())


def test_admin_mark_offline_resyncs_the_target(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            client = cluster.client()
            chain = cluster.chain_ids[0]
            for i in range(8):
                await client.write(chain, chunk_id(11, i), 0, bytes([i]) * 5000, CHUNK)
            routing = await cluster.admin().routing()
            victim = next(c for c in routing.chains if c.chain_id == chain).target_ids[0]
            await cluster.admin().mark_target_offline(victim)
            # Writes go on while the target is out; it must catch up on them through resync.
            for i in range(8, 12):
                await client.write(chain, chunk_id(11, i), 0, bytes([i]) * 5000, CHUNK)
            await client.remove(chain, chunk_id(11, 0), CHUNK)

            async def back() -> bool:
                rsp = await cluster.admin().chains()
                states = {t.target_id: t.public_state for t in rsp.targets}
                return bool(states[victim] == 1) and await cluster.all_serving()

            from tests.conftest import wait_until

            await wait_until(back, what="target back to serving")
            engine = cluster.nodes[victim // 100].engines[victim]
            assert engine.get(chunk_id(11, 0)) is None and engine.get(chunk_id(11, 11)) is not None
            report = await cluster.admin().verify()
            assert report.ok and report.chunks_checked == 11, report.as_dict()
    run(body())


def test_node_without_mgmtd_contact_stops_serving_within_half_the_timeout(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chain = cluster.chain_ids[0]
            client = cluster.client()
            await client.write(chain, chunk_id(12, 0), 0, b"x", CHUNK)
            routing = await cluster.admin().routing()
            head_tid = next(c for c in routing.chains if c.chain_id == chain).target_ids[0]
            head = cluster.nodes[head_tid // 100]
            view = head.view(chain, head_tid)
            assert view is not None and head.lease_valid()

            async def unreachable() -> None:
                raise Unavailable("mgmtd unreachable (test)")

            head.heartbeat_once = unreachable  # type: ignore[method-assign]
            await asyncio.sleep(1.1)  # half of the 2 s heartbeat timeout, and a little more
            assert not head.lease_valid()
            req = spb.UpdateReq(chain_id=chain, chain_version=view.chain_version, chunk_id=chunk_id(12, 0),
                                type=spb.WRITE, offset=0, length=1, chunk_size=CHUNK, checksum=crc32c(b"y"))
            channel = cluster.channels.get(head.config.framed_address)
            with pytest.raises(LeaseExpired):
                await channel.call(STORAGE.method("Update"), req, b"y")
            with pytest.raises(LeaseExpired):
                await channel.call(STORAGE.method("Read"), spb.ReadReq(chain_id=chain, chunk_id=chunk_id(12, 0),
                                                                       length=1))
            # mgmtd then moves the silent node's targets out, and writes go on without it.
            await client.write(chain, chunk_id(12, 0), 0, b"z", CHUNK)
            data, _ = await client.read(chain, chunk_id(12, 0), 0, 1)
            assert data == b"z"
    run(body())


def test_failed_disk_takes_out_only_its_own_target(tmp_path: Path) -> None:
    """A target whose disk turns read-only leaves its chain; its neighbours, which only saw the
    error through a forward, stay in; writes go on with the remaining replicas."""
    from fs3.common.errors import IoError

    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            client = cluster.client()
            chain = cluster.chain_ids[0]
            await client.write(chain, chunk_id(21, 0), 0, b"x" * 5000, CHUNK)
            routing = await cluster.admin().routing()
            head, middle, tail = next(c for c in routing.chains if c.chain_id == chain).target_ids
            engine = cluster.nodes[middle // 100].engines[middle]

            def read_only(*_args: object, **_kwargs: object) -> None:
                raise IoError("chunk write: Read-only file system")

            engine.kv.write = read_only  # type: ignore[method-assign]
            engine.files.write = read_only  # type: ignore[method-assign]
            for i in range(1, 6):
                await client.write(chain, chunk_id(21, i), 0, bytes([i]) * 5000, CHUNK)
            states = {t.target_id: t.public_state for t in (await cluster.admin().chains()).targets}
            assert states[middle] != 1, "the failed target must leave its chain"
            assert states[head] == 1 and states[tail] == 1, f"healthy neighbours must stay serving: {states}"
            for i in range(6):
                data, _ = await client.read(chain, chunk_id(21, i), 0, CHUNK)
                assert data == (bytes([i]) * 5000 if i else b"x" * 5000)
    run(body())


def test_concurrent_writes_share_log_syncs(tmp_path: Path) -> None:
    """Sixteen small overwrites of different chunks in flight at once: each replica makes every
    one durable before it answers, but with fsyncs shared between them (group commit)."""
    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_fsync=True) as cluster:
            client = cluster.client()
            chain = cluster.chain_ids[0]
            chunks = [chunk_id(7, i) for i in range(16)]
            first = [(await client.write(chain, cid, 0, bytes(CHUNK), CHUNK)).commit_version for cid in chunks]
            syncs = 0
            for node in cluster.nodes.values():
                for engine in node.engines.values():
                    real = engine.kv.sync_wal

                    def counting(real=real) -> None:  # type: ignore[no-untyped-def]
                        nonlocal syncs
                        syncs += 1
                        real()

                    engine.kv.sync_wal = counting  # type: ignore[method-assign]
            rsps = await asyncio.gather(*(client.write(chain, cid, 4096, b"p" * 4096, CHUNK) for cid in chunks))
            assert all(rsp.commit_version > v for rsp, v in zip(rsps, first, strict=True))
            # Each write needs its undo record and its commit durable on 3 replicas: 96 fsyncs if
            # each went alone.
            assert 0 < syncs < 48, syncs
            for cid in chunks:
                data, _ = await client.read(chain, cid, 4096, 4096)
                assert data == b"p" * 4096
            report = await cluster.admin().verify()
            assert report.ok, report.as_dict()
    run(body())

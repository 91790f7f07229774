"""``read_many``: many (file, offset, length) ranges in one call, one BatchRead per node.

Every result is compared with what reading each range alone gives (a local model of the files,
``pread`` semantics: short at the end, empty past it, holes as zeros). The batching is counted on
an instrumented channel factory (BatchRead calls per node, and no single Read when nothing fails);
concurrency is proven by a barrier that only opens once every node is serving a batch; failover
by replicas that corrupt or refuse pieces, or a node whose BatchRead fails outright.
"""

from __future__ import annotations

import asyncio
import errno
import math
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from google.protobuf.message import Message

import fs3
import fs3.aio
from fs3 import storage_pb2 as spb
from fs3.client.fs import AsyncFileSystem, ClientConfig
from fs3.client.read_many import READ_MANY_BYTES_MAX, READ_MANY_RANGES_MAX
from fs3.client.storage_client import StorageClientConfig
from fs3.common.errors import ChecksumMismatch, InvalidArgument, StatusCode, Unavailable
from fs3.common.layout import chunk_location
from fs3.meta.service import MetaServiceConfig
from fs3.rpc.channel import Channel, ChannelFactory, RealChannelFactory
from fs3.rpc.dispatch import Buffer
from fs3.rpc.methods import MethodSpec, service_spec
from fs3.storage.limits import BATCH_READ_BYTES_MAX, BATCH_READ_PIECES_MAX
from tests.inproc import ClusterThread, InProcessCluster
from tests.test_data_path_auth import _cluster as data_path_cluster
from tests.test_data_path_auth import _user

CHUNK = 16 * 1024
PIECES_PER_CALL = 8


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


class CountingChannels:
    """The client's channel factory, counting calls per (address, method) and pieces per BatchRead;
    ``fail_batches_to`` makes every BatchRead to those addresses fail as a dead node's would."""

    def __init__(self, inner: ChannelFactory) -> None:
        self.inner = inner
        self.calls: Counter[tuple[str, str]] = Counter()
        self.batch_sizes: list[tuple[str, int]] = []
        self.fail_batches_to: set[str] = set()

    def get(self, address: str) -> Channel:
        return _CountingChannel(self, self.inner.get(address), address)

    def node_address(self, framed_address: str, grpc_address: str) -> str:
        return self.inner.node_address(framed_address, grpc_address)

    async def close(self) -> None:
        await self.inner.close()

    def reset(self) -> None:
        self.calls.clear()
        self.batch_sizes.clear()


class _CountingChannel:
    def __init__(self, owner: CountingChannels, inner: Channel, address: str) -> None:
        self.owner, self.inner, self.address = owner, inner, address

    async def call(self, method: MethodSpec, request: Message, payload: Buffer = b"",
                   timeout_ms: int = 10_000) -> tuple[Message, bytes]:
        self.owner.calls[(self.address, method.name)] += 1
        if isinstance(request, spb.BatchReadReq):
            self.owner.batch_sizes.append((self.address, len(request.pieces)))
            if self.address in self.owner.fail_batches_to:
                raise Unavailable(f"{self.address} is down")
        return await self.inner.call(method, request, payload, timeout_ms)

    async def close(self) -> None:
        await self.inner.close()


def with_cluster(tmp_path: Path, body: Callable[[InProcessCluster, AsyncFileSystem, CountingChannels], Awaitable[None]],
                 transport: str = "framed") -> None:
    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777, prune_interval_ms=100, gc_interval_ms=100)
        async with InProcessCluster(tmp_path, transport=transport, targets_per_node=3, with_meta=True,
                                    meta_config=config) as cluster:
            storage = StorageClientConfig(rpc_timeout_ms=3_000, retry_total_ms=20_000,
                                          batch_read_pieces_max=PIECES_PER_CALL)
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token,
                                       config=ClientConfig(transport=transport, storage=storage))  # type: ignore[arg-type]
            counting = CountingChannels(fs.storage.channels)
            fs.storage.channels = counting
            try:
                await fs.makedirs("/rm")
                await fs.set_layout("/rm", chunk_size=CHUNK, stripe=3)
                await body(cluster, fs, counting)
            finally:
                await fs.close()

    run(main())


async def write_files(fs: AsyncFileSystem, rng: random.Random, count: int = 3) -> dict[str, bytes]:
    """Files of a few chunks with holes (a gap skipped by a seek, a zero tail left by a truncate)."""
    files: dict[str, bytes] = {}
    for n in range(count):
        path = f"/rm/f{n}"
        model = bytearray()
        async with await fs.open(path, "wb") as f:
            for _ in range(4):
                gap = rng.choice([0, 0, CHUNK + 100])  # sometimes a whole chunk never written
                data = rng.randbytes(rng.randrange(1, 2 * CHUNK))
                f.seek(len(model) + gap)
                await f.write(data)
                model += bytes(gap) + data
            await f.truncate(len(model) + 3000)  # a tail of zeros no chunk holds
            model += bytes(3000)
        files[path] = bytes(model)
    return files


def random_ranges(rng: random.Random, files: dict[str, bytes], count: int) -> list[tuple[str, int, int]]:
    out = []
    for _ in range(count):
        path = rng.choice(sorted(files))
        size = len(files[path])
        kind = rng.random()
        if kind < 0.1:
            out.append((path, rng.randrange(0, size), 0))                     # empty
        elif kind < 0.2:
            out.append((path, size + rng.randrange(0, 100), rng.randrange(1, 500)))  # past the end
        elif kind < 0.3:
            out.append((path, size - rng.randrange(1, 200), rng.randrange(200, 2000)))  # across the end
        else:
            offset = rng.randrange(0, size)
            out.append((path, offset, rng.randrange(1, 2 * CHUNK)))          # often across chunks
    return out


def expected(files: dict[str, bytes], ranges: list[tuple[str, int, int]]) -> list[bytes]:
    return [files[path][offset:offset + length] for path, offset, length in ranges]


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_random_ranges_read_as_pread_would_in_few_calls_per_node(tmp_path: Path, transport: str) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem, counting: CountingChannels) -> None:
        rng = random.Random(11)
        files = await write_files(fs, rng)
        handles = {path: await fs.open(path, "rb") for path in files}
        try:
            ranges = random_ranges(rng, files, 120)
            want = expected(files, ranges)
            # Paths, handles, and both mixed in one call.
            as_handles = [(handles[p], o, n) for p, o, n in ranges]
            mixed: list[tuple[Any, int, int]] = [(p if i % 2 else handles[p], o, n)
                                                 for i, (p, o, n) in enumerate(ranges)]
            total = sum(n for _, _, n in ranges)
            metrics = fs.batch_read_metrics
            for call in (ranges, as_handles, mixed):
                counting.reset()
                rpcs, pieces_sent = metrics.rpcs._value.get(), metrics.pieces._value.get()
                views = await fs.read_many(call)
                assert [bytes(v) for v in views] == want
                # The client's metrics count what went over the wire.
                assert metrics.rpcs._value.get() - rpcs == len(counting.batch_sizes)
                assert metrics.pieces._value.get() - pieces_sent == sum(n for _, n in counting.batch_sizes)
                # Nothing failed: no single-piece Read at all, and per node at most
                # ceil(pieces / bound) BatchRead calls, each within the bound.
                assert not any(name == "Read" for _, name in counting.calls)
                per_node = Counter[str]()
                for address, pieces in counting.batch_sizes:
                    assert 0 < pieces <= PIECES_PER_CALL
                    per_node[address] += pieces
                assert len(per_node) == 3  # every node served some
                for address, pieces in per_node.items():
                    assert counting.calls[(address, "BatchRead")] == math.ceil(pieces / PIECES_PER_CALL)
                assert sum(counting.calls.values()) < len(ranges) / 2
            # Into caller buffers: a bytearray, a numpy array, a torch tensor's numpy view; range i
            # starts at the sum of the lengths before it, whatever the file gave.
            buffers: list[Any] = [bytearray(total + 10), np.full(total, 7, dtype=np.uint8),
                                  torch.full((total,), 7, dtype=torch.uint8).numpy()]
            for buffer in buffers:
                views = await fs.read_many(as_handles, buffer)
                flat = memoryview(buffer).cast("B")
                start = 0
                for view, data, (_, _, length) in zip(views, want, ranges, strict=True):
                    assert bytes(view) == data
                    assert bytes(flat[start:start + len(data)]) == data
                    start += length
        finally:
            for f in handles.values():
                await f.close()

    with_cluster(tmp_path, body, transport)


def test_every_node_is_asked_at_once(tmp_path: Path) -> None:
    """A barrier in every node's reads opens only once all three nodes serve a batch: calls sent
    one node after another would never open it (and the read would fail on the barrier's timeout)."""

    async def body(cluster: InProcessCluster, fs: AsyncFileSystem, counting: CountingChannels) -> None:
        rng = random.Random(3)
        files = await write_files(fs, rng, count=2)
        ranges = random_ranges(rng, files, 60)
        arrived: set[int] = set()
        everyone = asyncio.Event()
        for node_id, node in cluster.nodes.items():
            for replica in node.replicas.values():
                original = replica.read

                async def gated(req: spb.ReadReq, original: Any = original, node_id: int = node_id) -> Any:
                    arrived.add(node_id)
                    if len(arrived) == len(cluster.nodes):
                        everyone.set()
                    await asyncio.wait_for(everyone.wait(), 10)
                    return await original(req)

                replica.read = gated  # type: ignore[method-assign]
        views = await fs.read_many(ranges)
        assert everyone.is_set()
        assert [bytes(v) for v in views] == expected(files, ranges)
        assert not any(name == "Read" for _, name in counting.calls)

    with_cluster(tmp_path, body)


def test_pieces_a_replica_corrupts_or_refuses_and_a_failed_batch_are_read_again(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem, counting: CountingChannels) -> None:
        rng = random.Random(5)
        files = await write_files(fs, rng, count=2)
        ranges = random_ranges(rng, files, 80)
        want = expected(files, ranges)
        bad, refusing = cluster.nodes[1], cluster.nodes[2]
        for replica in bad.replicas.values():
            original = replica.read

            async def corrupt(req: spb.ReadReq, original: Any = original) -> Any:
                rsp, data = await original(req)
                if data:  # bytes changed after the checksum was taken: corrupted in transit
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                return rsp, data

            replica.read = corrupt  # type: ignore[method-assign]
        for replica in refusing.replicas.values():
            async def refuse(req: spb.ReadReq) -> Any:
                raise ChecksumMismatch("this replica's copy is bad")

            replica.read = refuse  # type: ignore[method-assign]
        before = fs.batch_read_metrics.fallbacks._value.get()
        views = await fs.read_many(ranges)
        assert [bytes(v) for v in views] == want
        assert fs.batch_read_metrics.fallbacks._value.get() > before
        assert counting.calls[(cluster.nodes[3].config.framed_address, "Read")] > 0  # the good node answered
        # A node whose BatchRead fails outright (a node that went away): its pieces go to Read.
        for node in (bad, refusing):
            for replica in node.replicas.values():
                del replica.read  # the class's own read again
        counting.fail_batches_to = {n.config.framed_address for n in cluster.nodes.values()}
        counting.reset()
        views = await fs.read_many(ranges)
        assert [bytes(v) for v in views] == want
        assert counting.calls[(cluster.nodes[1].config.framed_address, "BatchRead")] >= 1
        assert sum(n for (_, name), n in counting.calls.items() if name == "Read") > 0
        # A node that really stops answering (its servers shut): its pieces come from the others.
        counting.fail_batches_to = set()
        stopped = cluster.runtimes[0]
        stopped.stopping.set()
        await stopped.run_until_stopped()
        counting.reset()
        views = await fs.read_many(ranges)
        assert [bytes(v) for v in views] == want
        assert counting.calls[(cluster.nodes[1].config.framed_address, "BatchRead")] >= 1

    with_cluster(tmp_path, body)


def test_cancelling_a_read_many_leaves_nothing_running(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, fs: AsyncFileSystem, counting: CountingChannels) -> None:
        rng = random.Random(9)
        files = await write_files(fs, rng, count=1)
        ranges = random_ranges(rng, files, 30)
        release = asyncio.Event()
        entered = asyncio.Event()
        for node in cluster.nodes.values():
            for replica in node.replicas.values():
                original = replica.read

                async def stuck(req: spb.ReadReq, original: Any = original) -> Any:
                    entered.set()
                    await release.wait()
                    return await original(req)

                replica.read = stuck  # type: ignore[method-assign]
        mine = {id(t) for t in asyncio.all_tasks()}
        task = asyncio.create_task(fs.read_many(ranges))
        await asyncio.wait_for(entered.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        def client_tasks() -> list[asyncio.Task[Any]]:
            return [t for t in asyncio.all_tasks() if id(t) not in mine and not t.done()
                    and "read_pieces" in getattr(t.get_coro(), "__qualname__", "")]

        assert client_tasks() == []
        release.set()
        views = await fs.read_many(ranges)  # the client is still usable
        assert [bytes(v) for v in views] == expected(files, ranges)

    with_cluster(tmp_path, body)


# -- the blocking API on the shared cluster: bad input, permissions, read-your-writes -----------


def test_bad_input_is_refused_and_reads_nothing(shared_cluster: ClusterThread, tmp_path: Path) -> None:
    cluster = shared_cluster.cluster
    with fs3.connect(cluster.mgmtd_address, token=cluster.token) as fs:
        fs.makedirs("/read-many-bad", exist_ok=True)
        path = "/read-many-bad/f"
        fs.write_bytes(path, bytes(range(256)) * 64)
        f = fs.open(path, "rb", buffering=0)
        writer = fs.open("/read-many-bad/w", "wb")
        closed = fs.open(path, "rb")
        closed.close()
        buffer = bytearray(b"\xaa" * 4096)

        def refused(ranges: list[Any], error: type[BaseException], code: int | None = None,
                    buf: Any = buffer) -> None:
            with pytest.raises(error) as caught:
                fs.read_many(ranges, buf)
            if code is not None:
                assert isinstance(caught.value, OSError) and caught.value.errno == code
            assert buffer == b"\xaa" * 4096, "a refused call wrote into the buffer"

        try:
            refused([(f, 0, 100), (f, -1, 10)], OSError, errno.EINVAL)
            refused([(f, 0, 100), (path, 0, -5)], OSError, errno.EINVAL)
            refused([(f, 0, 100), (closed, 0, 10)], OSError, errno.EBADF)
            refused([(f, 0, 100), (writer, 0, 10)], OSError, errno.EBADF)
            refused([(f, 0, 100), ("/read-many-bad/missing", 0, 10)], FileNotFoundError)
            refused([(f, 0, 4000), (f, 0, 97)], ValueError)                        # buffer too small
            refused([(f, 0, 1)] * (READ_MANY_RANGES_MAX + 1), ValueError)
            refused([(f, 0, READ_MANY_BYTES_MAX), (f, 0, 1)], ValueError)
            refused([(f, 0, 10)], TypeError, buf=bytes(100))                       # read-only buffer
            refused([(f, 0, 10), (object(), 0, 1)], TypeError)
            refused([(f, 0, 10), (f, 1)], TypeError)
            with fs3.connect(cluster.mgmtd_address, token=cluster.token) as other:
                foreign = other.open(path, "rb")
                refused([(f, 0, 10), (foreign, 0, 10)], ValueError)
                foreign.close()
            assert fs.read_many([]) == []
            # Still fine afterwards.
            assert [bytes(v) for v in fs.read_many([(f, 250, 10)], buffer)] == [(bytes(range(256)) * 2)[250:260]]
        finally:
            f.close()
            writer.close()


def test_a_path_the_user_may_not_read_is_refused(shared_cluster: ClusterThread) -> None:
    cluster = shared_cluster.cluster
    with fs3.connect(cluster.mgmtd_address, token=cluster.token, uid=0, gid=0, groups=[]) as root:
        root.makedirs("/read-many-perm", exist_ok=True)
        root.chmod("/read-many-perm", 0o777)
        root.write_bytes("/read-many-perm/secret", b"root only")
        root.chmod("/read-many-perm/secret", 0o600)
        root.write_bytes("/read-many-perm/open", b"anyone")
        root.chmod("/read-many-perm/open", 0o644)
    with fs3.connect(cluster.mgmtd_address, token=cluster.token, uid=1000, gid=1000, groups=[]) as user:
        assert [bytes(v) for v in user.read_many([("/read-many-perm/open", 0, 6)])] == [b"anyone"]
        with pytest.raises(PermissionError):
            user.read_many([("/read-many-perm/open", 0, 6), ("/read-many-perm/secret", 0, 4)])


def test_read_many_sees_this_clients_unflushed_writes(shared_cluster: ClusterThread) -> None:
    cluster = shared_cluster.cluster
    with fs3.connect(cluster.mgmtd_address, token=cluster.token) as fs:
        fs.makedirs("/read-many-ryw", exist_ok=True)
        fs.write_bytes("/read-many-ryw/a", b"0" * 100)
        rw = fs.open("/read-many-ryw/a", "r+b")  # buffered: the bytes sit in Python's buffer
        rw.seek(90)
        rw.write(b"abcdefghijklmnopqrst")  # past meta's length of 100
        grow = fs.open("/read-many-ryw/b", "wb", buffering=0)  # another handle, unflushed chunk bytes
        grow.write(b"xyz" * 10)
        try:
            views = fs.read_many([(rw, 85, 30), ("/read-many-ryw/a", 95, 50), ("/read-many-ryw/b", 3, 6)])
            assert [bytes(v) for v in views] == [b"00000abcdefghijklmnopqrst", b"fghijklmnopqrst", b"xyzxyz"]
        finally:
            rw.close()
            grow.close()


# -- the node's side: capabilities per piece, bounds per call ------------------------------------


def test_batch_read_checks_each_pieces_capability_and_its_bounds(tmp_path: Path) -> None:
    """With user tokens (the USER principal), every piece needs its own file's capability: the
    owner's read_many of several files is served by batches alone (each piece carries the right
    one), while another user's BatchRead of the same chunks is refused piece by piece and gets no
    byte. A call past the node's bounds is refused whole."""

    async def body(cluster: InProcessCluster, owner: AsyncFileSystem) -> None:
        rng = random.Random(21)
        files = {f"/t/u{n}": rng.randbytes(3 * 64 * 1024 + 17) for n in range(3)}
        for path, data in files.items():
            await owner.write_bytes(path, data)
        counting = CountingChannels(owner.storage.channels)
        owner.storage.channels = counting
        ranges = random_ranges(rng, files, 40)
        assert [bytes(v) for v in await owner.read_many(ranges)] == expected(files, ranges)
        assert counting.calls and not any(name == "Read" for _, name in counting.calls)

        attacker = await _user(cluster, "reader", 2000)
        try:
            await attacker.write_bytes("/t/mine", b"attacker's own file")
            mine = await attacker.open("/t/mine", "rb")
            victim = await owner.open("/t/u0", "rb")
            chain, cid = chunk_location(victim.layout, victim.inode.inode_id, 0)
            _, members = await attacker.routing.chain(chain)
            channel = attacker.channels.get(members[0].address)
            req = spb.BatchReadReq(capabilities=[await mine.capability.current()])
            req.pieces.add(chain_id=chain, chunk_id=cid, offset=0, length=100, capability_index=0)
            req.pieces.add(chain_id=chain, chunk_id=cid, offset=100, length=100, capability_index=7)
            rsp, data = await channel.call(service_spec("Storage").method("BatchRead"), req)
            assert isinstance(rsp, spb.BatchReadRsp)
            assert [r.status for r in rsp.results] == [StatusCode.PERMISSION_DENIED] * 2
            assert data == b""
            await mine.close()
            await victim.close()
        finally:
            await attacker.close()

        # Bounds: refused whole, before anything is read (a service's call, so no capability).
        service = RealChannelFactory(cluster.token, "framed")
        try:
            channel = service.get(members[0].address)
            many = spb.BatchReadReq()
            for _ in range(BATCH_READ_PIECES_MAX + 1):
                many.pieces.add(chain_id=chain, chunk_id=cid, offset=0, length=1)
            with pytest.raises(InvalidArgument, match="pieces exceed"):
                await channel.call(service_spec("Storage").method("BatchRead"), many)
            big = spb.BatchReadReq()
            for _ in range(2):
                big.pieces.add(chain_id=chain, chunk_id=cid, offset=0, length=BATCH_READ_BYTES_MAX // 2 + 1)
            with pytest.raises(InvalidArgument, match="bytes asked exceed"):
                await channel.call(service_spec("Storage").method("BatchRead"), big)
            ok = spb.BatchReadReq()
            ok.pieces.add(chain_id=chain, chunk_id=cid, offset=5, length=10)
            rsp, data = await channel.call(service_spec("Storage").method("BatchRead"), ok)
            assert isinstance(rsp, spb.BatchReadRsp) and rsp.results[0].status == StatusCode.OK
            assert data == files["/t/u0"][5:15]
        finally:
            await service.close()

    data_path_cluster(tmp_path, body)

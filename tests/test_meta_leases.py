"""Client leases: timed on meta's monotonic clock, fenced, and never letting a retry run twice.

Meta's clocks are injected (a monotonic one for leases, a wall one for inode times), so a test
moves them together (time passes) or apart (an NTP step of the wall clock). A "lapse" is a client
that stops renewing — a frozen process, a long network cut — until meta expires it; the client's
own clock moves with meta's.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import Message

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.client.fs import AsyncFileSystem
from fs3.client.meta_client import MetaClient
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient
from fs3.common.clock import ManualClock
from fs3.common.config import config_from_mapping
from fs3.common.errors import BadHandle, InvalidArgument, StaleClient, Timeout, Unavailable
from fs3.common.ids import parse_chunk_id
from fs3.common.posix import O_APPEND, O_CREAT, O_RDONLY, O_RDWR, O_WRONLY
from fs3.kv.api import Transaction, prefix_end
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine
from fs3.meta import schema
from fs3.meta.server import MetaConfig
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.channel import Channel, RealChannelFactory
from fs3.rpc.dispatch import Buffer
from fs3.rpc.methods import MethodSpec
from fs3.vfs import Vfs
from tests.inproc import InProcessCluster

LEASE_MS = 30_000
CHUNK = 65536
CLIENT_A = b"a" * 16
CLIENT_B = b"b" * 16
CLIENT_C = b"c" * 16
ROOT_USER = mpb.User(uid=0, gid=0)


class Clocks:
    """Meta's clocks: monotonic (leases) and wall (inode times), moved together or apart."""

    def __init__(self) -> None:
        self.mono = ManualClock(5_000_000)
        self._wall_ns = 1_700_000_000_000_000_000

    def wall_ns(self) -> int:
        return self._wall_ns

    def advance(self, ms: int) -> None:
        """Time passes."""
        self.mono.advance(ms)
        self._wall_ns += ms * 1_000_000

    def step_wall(self, ms: int) -> None:
        """The wall clock is stepped (NTP, an operator), forwards or backwards; no time passes."""
        self._wall_ns += ms * 1_000_000


def ref(path: str) -> mpb.PathRef:
    return mpb.PathRef(path=path.encode())


# -- the service alone (no storage) ----------------------------------------------------------------


class _HookedEngine:
    """The engine, except that one chosen transaction first lets a test act (a racing request)."""

    def __init__(self, inner: OptimisticTxnEngine) -> None:
        self.inner = inner
        self._skip = 0
        self._action: Callable[[], Awaitable[Any]] | None = None

    def arm(self, skip: int, action: Callable[[], Awaitable[Any]]) -> None:
        """Run ``action`` before the first read of the transaction begun after the next ``skip``."""
        self._skip, self._action = skip, action

    def begin(self) -> Any:
        txn = self.inner.begin()
        if self._action is None:
            return txn
        if self._skip > 0:
            self._skip -= 1
            return txn
        action, self._action = self._action, None
        return _ActFirst(txn, action)

    async def wait_durable(self) -> None:
        await self.inner.wait_durable()


class _ActFirst:
    def __init__(self, txn: Transaction, action: Callable[[], Awaitable[Any]]) -> None:
        self.txn = txn
        self._action: Callable[[], Awaitable[Any]] | None = action

    async def _act(self) -> None:
        if self._action is not None:
            action, self._action = self._action, None
            await action()

    async def get(self, key: bytes) -> bytes | None:
        await self._act()
        return await self.txn.get(key)

    async def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        await self._act()
        return await self.txn.scan(start, end, limit)

    def prefetch(self, keys: Sequence[bytes]) -> None:
        self.txn.prefetch(keys)

    def prefetch_scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> None:
        self.txn.prefetch_scan(start, end, limit)

    def put(self, key: bytes, value: bytes) -> None:
        self.txn.put(key, value)

    def delete(self, key: bytes) -> None:
        self.txn.delete(key)

    async def commit(self) -> None:
        await self.txn.commit()


async def _service(clocks: Clocks, store: MemKVStore | None = None,
                   **config: Any) -> tuple[MetaService, MemKVStore, _HookedEngine]:
    store = store if store is not None else MemKVStore()
    channels = RealChannelFactory()
    routing = RoutingCache(["127.0.0.1:1"], channels)
    routing._install(cpb.RoutingInfo(chain_tables=[cpb.ChainTable(table_id=1, chain_ids=[11, 12, 13])]))
    engine = _HookedEngine(OptimisticTxnEngine(store))
    service = MetaService(engine, routing, StorageClient(routing, channels, CLIENT_A),
                          MetaServiceConfig(root_mode=0o777, client_lease_ms=LEASE_MS, **config),
                          wall_ns=clocks.wall_ns, clock=clocks.mono)
    await service.start(background=False)
    return service, store, engine


class Client:
    """One client's requests, made the way the RPC layer calls the handlers."""

    def __init__(self, service: MetaService, client_id: bytes) -> None:
        self.service = service
        self.client_id = client_id
        self.request_id = 0
        self.renewals = 0

    def ctx(self) -> mpb.ReqCtx:
        self.request_id += 1
        return mpb.ReqCtx(user=ROOT_USER, client_id=self.client_id, request_id=self.request_id)

    async def call(self, name: str, req: Any) -> Any:
        rsp, _ = await getattr(self.service, name)(req, memoryview(b""))
        return rsp

    async def renew(self) -> mpb.RenewClientRsp:
        rsp: mpb.RenewClientRsp = await self.call("renew_client", mpb.RenewClientReq(
            client_id=self.client_id, completed_below=self.request_id + 1, renewals=self.renewals))
        self.renewals = rsp.renewals
        return rsp

    async def open(self, path: str, flags: int) -> mpb.OpenRsp:
        rsp: mpb.OpenRsp = await self.call("open", mpb.OpenReq(ctx=self.ctx(), target=ref(path), flags=flags,
                                                               mode=0o644))
        return rsp

    async def create(self, path: str) -> int:
        rsp = await self.open(path, O_CREAT | O_WRONLY)
        await self.call("close", mpb.CloseReq(ctx=self.ctx(), inode_id=rsp.inode.inode_id,
                                              session_id=rsp.session_id))
        return int(rsp.inode.inode_id)

    async def inode_of(self, path: str) -> int:
        rsp = await self.call("lookup", mpb.LookupReq(ctx=self.ctx(), target=ref(path)))
        return int(rsp.inode.inode_id)


def _keys(store: MemKVStore, prefix: bytes) -> list[bytes]:
    return [k for k, _ in store.scan(prefix, prefix_end(prefix))]


def test_a_retry_after_the_lease_lapsed_is_refused_not_run_a_second_time() -> None:
    """A's rename commits and its reply is lost; A is cut off longer than its lease (inside its
    retry budget) and meta expires it; B creates a new x. A's retry must not move B's x."""

    async def main() -> None:
        clocks = Clocks()
        service, store, _ = await _service(clocks)
        a, b = Client(service, CLIENT_A), Client(service, CLIENT_B)
        await a.renew()
        await b.renew()
        await a.create("/x")
        rename = mpb.RenameReq(ctx=a.ctx(), source=ref("/x"), destination=ref("/y"))
        moved = (await a.call("rename", rename)).inode.inode_id  # committed; the reply never reaches A
        await service.prune_clients_once()
        clocks.advance(LEASE_MS + 1)
        await b.renew()
        assert await service.prune_clients_once() == 1  # A stopped renewing
        assert not _keys(store, schema.idem_key(CLIENT_A, 0)[:-8])  # its saved answers are gone
        new_x = await b.create("/x")
        with pytest.raises(StaleClient):
            await a.call("rename", rename)  # A's retry, well inside its 60 s budget
        assert await b.inode_of("/x") == new_x
        assert await b.inode_of("/y") == moved

    asyncio.run(main())


def test_a_lapsed_client_is_refused_until_it_registers_afresh() -> None:
    async def main() -> None:
        clocks = Clocks()
        service, store, _ = await _service(clocks, expired_client_ttl_ms=4 * LEASE_MS)
        a = Client(service, CLIENT_A)
        await a.renew()
        await a.create("/f")
        held = await a.open("/f", O_RDONLY)
        await a.call("remove", mpb.RemoveReq(ctx=a.ctx(), target=ref("/f")))  # kept alive by A's handle
        await service.prune_clients_once()
        clocks.advance(LEASE_MS + 1)
        assert await service.prune_clients_once() == 1
        assert not _keys(store, schema.session_prefix(held.inode.inode_id))  # closed, and the file freed
        assert _keys(store, schema.gc_key(held.inode.inode_id))
        # A was slow, not dead: it is told, and its requests on the old id fail.
        with pytest.raises(StaleClient):
            await a.renew()
        with pytest.raises(StaleClient):
            await a.call("make_node", mpb.MakeNodeReq(ctx=a.ctx(), target=ref("/d"), type=mpb.DIRECTORY))
        with pytest.raises(StaleClient):
            await a.call("close", mpb.CloseReq(ctx=a.ctx(), inode_id=held.inode.inode_id,
                                               session_id=held.session_id))
        # Long after its retries stopped meta forgets the id; a renewal from the old lease is still refused.
        await service.prune_clients_once()
        clocks.advance(4 * LEASE_MS + 1)
        await service.prune_clients_once()
        assert not _keys(store, schema.expired_client_prefix())
        with pytest.raises(StaleClient):
            await a.renew()
        # Registered afresh, the client works again.
        fresh = Client(service, CLIENT_C)
        assert (await fresh.renew()).renewals == 1
        await fresh.call("make_node", mpb.MakeNodeReq(ctx=fresh.ctx(), target=ref("/d"), type=mpb.DIRECTORY))

    asyncio.run(main())


def test_a_wall_clock_step_expires_no_lease() -> None:
    async def main() -> None:
        clocks = Clocks()
        service, store, _ = await _service(clocks)
        a = Client(service, CLIENT_A)
        await a.renew()
        await a.create("/f")
        held = await a.open("/f", O_RDONLY)
        await service.prune_clients_once()
        clocks.step_wall(2 * LEASE_MS)  # NTP steps the clock forward: no time passed
        clocks.advance(1_000)
        assert await service.prune_clients_once() == 0
        clocks.step_wall(-4 * LEASE_MS)  # and back
        await a.renew()
        clocks.advance(1_000)
        assert await service.prune_clients_once() == 0
        assert _keys(store, schema.session_prefix(held.inode.inode_id))
        # Time that does pass still expires a client that stopped renewing.
        await service.prune_clients_once()
        clocks.advance(LEASE_MS + 1)
        assert await service.prune_clients_once() == 1
        assert not _keys(store, schema.session_prefix(held.inode.inode_id))

    asyncio.run(main())


def test_a_restarted_meta_gives_every_client_a_full_lease() -> None:
    async def main() -> None:
        clocks = Clocks()
        service, store, _ = await _service(clocks)
        a = Client(service, CLIENT_A)
        await a.renew()
        await service.prune_clients_once()
        clocks.advance(LEASE_MS - 1_000)
        restarted, _, _ = await _service(clocks, store)
        clocks.advance(2_000)  # past the lease as the first server timed it
        assert await restarted.prune_clients_once() == 0
        clocks.advance(LEASE_MS + 1)
        assert await restarted.prune_clients_once() == 1

    asyncio.run(main())


def test_a_renewal_racing_the_prune_keeps_the_lease() -> None:
    """The pruner judged A's lease stale; A's renewal commits before the expiry does. The expiry
    must see it (one transaction re-reads the lease) and leave A and its sessions alone."""

    async def main() -> None:
        clocks = Clocks()
        service, store, engine = await _service(clocks)
        a = Client(service, CLIENT_A)
        await a.renew()
        await a.create("/f")
        held = await a.open("/f", O_RDONLY)
        await service.prune_clients_once()
        clocks.advance(LEASE_MS + 1)
        engine.arm(1, a.renew)  # after the pruner's scan of the leases, before anything else it does
        assert await service.prune_clients_once() == 0
        assert _keys(store, schema.session_prefix(held.inode.inode_id))
        assert _keys(store, schema.client_key(CLIENT_A))
        await a.renew()
        await a.call("close", mpb.CloseReq(ctx=a.ctx(), inode_id=held.inode.inode_id, session_id=held.session_id))

    asyncio.run(main())


def _stub_probe(service: MetaService, answer: Callable[[], tuple[int | None, int | None]]) -> None:
    """Storage's answer to the length probe of a written session, as the test says."""

    async def probe(inode_id: int, hint: int, wrote: bool, *args: Any,
                    **kwargs: Any) -> tuple[int | None, int | None]:
        return answer() if wrote else (None, None)

    service._exact_length = probe  # type: ignore[method-assign]


def test_a_stale_length_probe_does_not_abort_the_prune_round() -> None:
    """A dead writer's file changes size under every probe (LengthProbeStale); its session is
    still closed, and C, later in the same round, is expired and cleaned up too."""

    async def main() -> None:
        clocks = Clocks()
        service, store, _ = await _service(clocks)
        a, c = Client(service, CLIENT_A), Client(service, CLIENT_C)
        await a.renew()
        await c.renew()
        written = await a.open("/f", O_CREAT | O_RDWR)
        await c.create("/g")
        read = await c.open("/g", O_RDONLY)
        _stub_probe(service, lambda: (100, 1))  # probed from a size the file no longer has
        await service.prune_clients_once()
        clocks.advance(LEASE_MS + 1)
        assert await service.prune_clients_once() == 2
        assert not _keys(store, schema.session_prefix(read.inode.inode_id))
        assert not _keys(store, schema.session_prefix(written.inode.inode_id))
        assert not _keys(store, schema.client_sessions_prefix(CLIENT_A))
        stat = await c.call("lookup", mpb.LookupReq(ctx=c.ctx(), target=ref("/f")))
        assert stat.inode.size == 0  # no probe held: the size meta had stays

    asyncio.run(main())


def test_one_client_whose_clean_up_fails_does_not_stop_the_others() -> None:
    async def main() -> None:
        clocks = Clocks()
        service, store, _ = await _service(clocks)
        a, c = Client(service, CLIENT_A), Client(service, CLIENT_C)
        await a.renew()
        await c.renew()
        written = await a.open("/f", O_CREAT | O_RDWR)
        await c.create("/g")
        read = await c.open("/g", O_RDONLY)

        def broken() -> tuple[int | None, int | None]:
            raise RuntimeError("storage answered nonsense")

        _stub_probe(service, broken)
        await service.prune_clients_once()
        clocks.advance(LEASE_MS + 1)
        await service.prune_clients_once()
        assert not _keys(store, schema.session_prefix(read.inode.inode_id))
        assert _keys(store, schema.session_prefix(written.inode.inode_id))  # A's clean-up waits
        _stub_probe(service, lambda: (None, None))
        await service.prune_clients_once()
        assert not _keys(store, schema.session_prefix(written.inode.inode_id))

    asyncio.run(main())


def test_the_expiry_of_a_lapsed_client_id_must_outlast_client_retries() -> None:
    with pytest.raises(InvalidArgument):
        MetaServiceConfig(client_lease_ms=LEASE_MS, expired_client_ttl_ms=LEASE_MS).validate()
    with pytest.raises(InvalidArgument):
        config_from_mapping(MetaConfig, {"client_lease_ms": 30_000, "expired_client_ttl_ms": 50_000})
    config = config_from_mapping(MetaConfig, {"client_lease_ms": 30_000, "expired_client_ttl_ms": 60_000})
    assert config.service.expired_client_ttl_ms == 60_000
    assert MetaServiceConfig(expired_client_ttl_ms=600_000).client_retry_limit_ms == 300_000


# -- the client's retries, against a scripted meta -------------------------------------------------


class _ScriptedMeta:
    """One meta node whose answers a test scripts; ``clock`` moves as the test says."""

    def __init__(self, clock: ManualClock, answer: Callable[[str], Any], on_refresh: Callable[[], None]) -> None:
        self.sends: list[str] = []
        self.routing = cpb.RoutingInfo(nodes=[cpb.NodeInfo(node_id=1, node_type=cpb.NODE_META, alive=True,
                                                           framed_address="meta:1")])
        self.clock = clock
        self._answer = answer
        self._on_refresh = on_refresh

    async def refresh(self) -> None:
        self._on_refresh()

    def node_address(self, framed: str, grpc: str) -> str:
        return framed

    def get(self, address: str) -> _ScriptedMeta:
        return self

    async def call(self, method: Any, req: Any, payload: bytes = b"", timeout_ms: int = 0) -> tuple[Any, bytes]:
        self.sends.append(method.name)
        return self._answer(method.name), b""


def _scripted_client(clock: ManualClock, meta: _ScriptedMeta, retry_total_ms: int) -> MetaClient:
    return MetaClient(meta, meta, CLIENT_A, lambda: ROOT_USER, retry_total_ms=retry_total_ms,  # type: ignore[arg-type]
                      clock=clock)


def test_a_retry_is_never_sent_past_the_retry_budget() -> None:
    """A client frozen between two attempts must not send the retry when it wakes up late."""
    clock = ManualClock()

    def answer(name: str) -> Any:
        if name == "RenewClient":
            return mpb.RenewClientRsp(lease_ms=LEASE_MS, renewals=1)
        raise Unavailable("meta is down")

    meta = _ScriptedMeta(clock, answer, on_refresh=lambda: clock.advance(10_000))
    client = _scripted_client(clock, meta, retry_total_ms=5_000)

    async def main() -> None:
        await client.renew()
        with pytest.raises(Unavailable):
            await client.call("MakeNode", mpb.MakeNodeReq(target=ref("/d"), type=mpb.DIRECTORY), mpb.InodeRsp)

    asyncio.run(main())
    assert meta.sends == ["RenewClient", "MakeNode"]


def test_a_client_retries_no_longer_than_meta_remembers() -> None:
    clock = ManualClock()

    def answer(name: str) -> Any:
        if name == "RenewClient":
            return mpb.RenewClientRsp(lease_ms=LEASE_MS, renewals=1, retry_limit_ms=500)
        clock.advance(300)
        raise Unavailable("meta is down")

    meta = _ScriptedMeta(clock, answer, on_refresh=lambda: None)
    client = _scripted_client(clock, meta, retry_total_ms=3_000)

    async def main() -> None:
        await client.renew()
        with pytest.raises(Unavailable):
            await client.call("MakeNode", mpb.MakeNodeReq(target=ref("/d"), type=mpb.DIRECTORY), mpb.InodeRsp)

    asyncio.run(main())
    assert meta.sends == ["RenewClient", "MakeNode", "MakeNode"]


# -- clients and the VFS on an in-process cluster --------------------------------------------------


def chunks_of(cluster: InProcessCluster, inode_id: int) -> int:
    found: set[bytes] = set()
    for node in cluster.nodes.values():
        for engine in node.engines.values():
            found.update(cid for cid in engine.states() if parse_chunk_id(cid)[0] == inode_id)
    return len(found)


class Lapsing:
    """An in-process cluster on injected clocks, client A on a clock of its own, and client B."""

    def __init__(self, cluster: InProcessCluster, clocks: Clocks, a: AsyncFileSystem, a_clock: ManualClock,
                 b: AsyncFileSystem) -> None:
        self.cluster, self.clocks, self.a, self.a_clock, self.b = cluster, clocks, a, a_clock, b

    async def lapse(self) -> None:
        """A stops renewing (frozen, cut off) until meta expired it and collected what it freed."""
        meta = self.cluster.meta
        assert meta is not None
        await self.a.meta.stop()  # A's lease loop
        await meta.prune_clients_once()
        self.clocks.advance(LEASE_MS + 1)
        self.a_clock.advance(LEASE_MS + 1)
        await self.b.meta.renew()
        assert await meta.prune_clients_once() == 1
        await meta.run_gc_once()


def with_lapsing(tmp_path: Path, body: Callable[[Lapsing], Awaitable[None]]) -> None:
    async def main() -> None:
        clocks = Clocks()
        config = MetaServiceConfig(root_mode=0o777, client_lease_ms=LEASE_MS, prune_interval_ms=600_000,
                                   gc_interval_ms=100)
        async with InProcessCluster(tmp_path, targets_per_node=1, with_meta=True, meta_config=config,
                                    meta_clock=clocks.mono, meta_wall_ns=clocks.wall_ns) as cluster:
            a_clock = ManualClock()
            a = AsyncFileSystem(cluster.mgmtd_address, cluster.token, clock=a_clock)
            b = AsyncFileSystem(cluster.mgmtd_address, cluster.token)
            try:
                await a.start()
                await b.start()
                await b.makedirs("/t")
                await b.set_layout("/t", chunk_size=CHUNK, stripe=1)
                await body(Lapsing(cluster, clocks, a, a_clock, b))
            finally:
                await a.close()
                await b.close()

    asyncio.run(main())


@pytest.mark.slow  # an in-process cluster
def test_a_read_that_outlives_the_lease_fails_instead_of_returning_zeros(tmp_path: Path) -> None:
    """A holds an unlinked file open; its lease lapses while its read is at storage, and meta
    collects the file's chunks. The read must fail (ESTALE), not return zeros."""

    async def body(env: Lapsing) -> None:
        data = os.urandom(3 * CHUNK)
        await env.b.write_bytes("/t/f", data)
        f = await env.a.open("/t/f", "rb")
        assert await f.pread(0, 100, readahead=False) == data[:100]
        await env.b.remove("/t/f")  # A's handle keeps it alive
        real_read = env.a.storage.read

        async def read_late(*args: Any, **kwargs: Any) -> Any:
            env.a.storage.read = real_read  # type: ignore[method-assign]
            await env.lapse()
            return await real_read(*args, **kwargs)

        env.a.storage.read = read_late  # type: ignore[method-assign]
        with pytest.raises(OSError) as err:
            await f.pread(CHUNK, 100, readahead=False)
        assert err.value.errno == errno.ESTALE
        assert chunks_of(env.cluster, f.inode.inode_id) == 0  # the zeros were real: the chunks are gone
        with pytest.raises(OSError) as err:
            await f.read(10)
        assert err.value.errno == errno.ESTALE
        with pytest.raises(OSError) as err:
            await f.close()
        assert err.value.errno == errno.ESTALE
        # Registered afresh: new opens work.
        await env.a.write_bytes("/t/g", b"new")
        assert await env.a.read_bytes("/t/g") == b"new"

    with_lapsing(tmp_path, body)


@pytest.mark.slow  # an in-process cluster
def test_writes_after_the_lease_lapsed_fail_loudly(tmp_path: Path) -> None:
    async def body(env: Lapsing) -> None:
        f = await env.a.open("/t/w", "wb")
        await f.write(b"a" * 1000)
        await f.flush()
        await env.lapse()  # meta closes A's session: the length is what storage holds
        with pytest.raises(OSError) as err:
            await f.write(b"b" * 1000)
        assert err.value.errno == errno.ESTALE
        with pytest.raises(OSError) as err:
            await f.close()
        assert err.value.errno == errno.ESTALE
        assert (await env.b.stat("/t/w")).st_size == 1000
        assert await env.b.read_bytes("/t/w") == b"a" * 1000
        old_id = f.session_id[:16]
        await env.a.mkdir("/t/after")  # refused under the old id before it ran: sent again under the new one
        assert env.a.meta.client_id != old_id and await env.b.isdir("/t/after")

    with_lapsing(tmp_path, body)


@pytest.mark.slow  # an in-process cluster
def test_a_rename_whose_reply_was_lost_is_not_run_again_after_the_lease_lapsed(tmp_path: Path) -> None:
    async def body(env: Lapsing) -> None:
        await env.a.write_bytes("/t/x", b"A's")
        channels = env.a.meta.channels
        real_get = channels.get
        lost: list[bool] = []

        class LosesRenameReply:
            def __init__(self, channel: Channel) -> None:
                self.channel = channel
                self.address = channel.address

            async def close(self) -> None:
                await self.channel.close()

            async def call(self, method: MethodSpec, req: Message, payload: Buffer = b"",
                           timeout_ms: int = 10_000) -> tuple[Message, bytes]:
                rsp = await self.channel.call(method, req, payload, timeout_ms=timeout_ms)
                if method.name == "Rename" and not lost:
                    lost.append(True)
                    await env.lapse()
                    await env.b.write_bytes("/t/x", b"B's")
                    raise Timeout("the reply was lost")
                return rsp

        channels.get = lambda address: LosesRenameReply(real_get(address))  # type: ignore[method-assign]
        with pytest.raises(OSError) as err:
            await env.a.rename("/t/x", "/t/y")
        assert err.value.errno == errno.ESTALE  # it may have run: the caller is told, nothing runs twice
        assert await env.b.read_bytes("/t/x") == b"B's"
        assert await env.b.read_bytes("/t/y") == b"A's"

    with_lapsing(tmp_path, body)


@pytest.mark.slow  # an in-process cluster
def test_a_mount_keeps_working_after_its_lease_lapsed(tmp_path: Path) -> None:
    """The VFS (what the FUSE mount runs): the lapsed handle fails with ESTALE, new opens work."""

    async def body(env: Lapsing) -> None:
        vfs = Vfs(env.a)
        try:
            t = await vfs.lookup(1, b"t", ROOT_USER)
            fh, v = await vfs.create(t.inode_id, b"v", 0o644, O_RDWR, ROOT_USER)
            await vfs.write(fh, 0, b"before")
            await vfs.flush(fh)
            await vfs.write(fh, 6, b" and unsent")  # buffered in the handle when the lease lapses
            await env.lapse()
            # Another handle of the mount on the same file neither waits on the lapsed one nor sees its bytes.
            reader, _ = await vfs.open(v.inode_id, O_RDONLY, ROOT_USER)
            assert await vfs.read(reader, 0, 100) == b"before"
            assert (await vfs.getattr(v.inode_id, ROOT_USER)).size == 6
            await vfs.release(reader)
            # Size changes settle this mount's writers first: the lapsed one is left out, not waited on.
            writer, _ = await vfs.open(v.inode_id, O_RDWR, ROOT_USER)
            assert (await vfs.setattr(v.inode_id, ROOT_USER, size=5, fh=writer)).size == 5
            assert (await vfs.setattr(v.inode_id, ROOT_USER, size=6)).size == 6
            await vfs.release(writer)
            for call in (vfs.read(fh, 0, 6), vfs.write(fh, 6, b"after"), vfs.flush(fh), vfs.release(fh)):
                with pytest.raises(OSError) as err:
                    await call
                assert err.value.errno == errno.ESTALE
            fh2, _ = await vfs.create(t.inode_id, b"v2", 0o644, O_RDWR, ROOT_USER)
            await vfs.write(fh2, 0, b"works")
            await vfs.release(fh2)
            assert await env.b.read_bytes("/t/v2") == b"works"
            assert await env.b.read_bytes("/t/v") == b"befor\0"
        finally:
            await vfs.close()

    with_lapsing(tmp_path, body)


@pytest.mark.slow  # an in-process cluster
def test_a_client_frozen_past_meta_memory_of_it_registers_before_it_sends(tmp_path: Path) -> None:
    """Meta has forgotten A's lapsed id (its refusal outlived every retry); A wakes up and opens a
    file. It must learn first that its lease lapsed: a session under the forgotten id would have
    no lease to expire it, ever."""

    async def body(env: Lapsing) -> None:
        old_id = env.a.meta.client_id
        await env.lapse()
        meta = env.cluster.meta
        assert meta is not None and env.cluster.meta_kv is not None
        await meta.prune_clients_once()
        env.clocks.advance(meta.config.expired_client_ttl_ms + 1)
        env.a_clock.advance(meta.config.expired_client_ttl_ms + 1)
        await env.b.meta.renew()
        await meta.prune_clients_once()
        f = await env.a.open("/t/late", "wb")
        assert f.session_id[:16] != old_id
        await f.write(b"x")
        await f.close()
        assert not list(env.cluster.meta_kv.scan(schema.expired_client_prefix(),
                                                 prefix_end(schema.expired_client_prefix())))

    with_lapsing(tmp_path, body)


@pytest.mark.slow  # an in-process cluster
def test_a_session_answers_only_the_client_id_that_opened_it(tmp_path: Path) -> None:
    """A handle opened before the lease lapsed, closed after the client registered again under a new
    id: meta refuses the close (and sync, truncate) under the new id, before its clean-up of the
    old id closed the session itself; the length is what the old id's writes reached then."""

    async def body(env: Lapsing) -> None:
        f = await env.a.open("/t/f", "wb")
        await f.write(b"a" * 1000)
        await f.flush()
        await f.write(b"b" * 1000)  # buffered: not in the length
        meta = env.cluster.meta
        assert meta is not None
        await env.a.meta.stop()
        await meta.prune_clients_once()
        env.clocks.advance(LEASE_MS + 1)
        env.a_clock.advance(LEASE_MS + 1)
        await env.b.meta.renew()
        clean_up = meta._clean_up_expired_clients

        async def later() -> None:
            pass

        meta._clean_up_expired_clients = later  # type: ignore[method-assign]
        assert await meta.prune_clients_once() == 1  # the old id is refused; its sessions not yet closed
        assert meta_sessions(env) == 1
        await env.a.mkdir("/t/d")  # A registers again
        inode_id, session_id = f.inode.inode_id, f.session_id
        assert schema.session_owner(session_id) != env.a.meta.client_id
        for name, req in [
            ("Close", mpb.CloseReq(inode_id=inode_id, session_id=session_id, length_hint=2000, wrote=True,
                                   acked=True)),
            ("Sync", mpb.SyncReq(inode_id=inode_id, session_id=session_id, length_hint=2000, wrote=True,
                                 acked=True)),
            ("SetAttr", mpb.SetAttrReq(target=mpb.PathRef(inode_id=inode_id), mask=mpb.SET_SIZE, size=0,
                                       session_id=session_id)),
        ]:
            with pytest.raises(BadHandle, match="another client id"):
                await env.a.meta.call(name, req, mpb.InodeRsp)
        with pytest.raises(OSError) as err:  # through the handle: the lease lapsed under it
            await f.close()
        assert err.value.errno == errno.ESTALE
        assert meta_sessions(env) == 1
        meta._clean_up_expired_clients = clean_up  # type: ignore[method-assign]
        await meta.prune_clients_once()
        assert meta_sessions(env) == 0
        assert await env.b.read_bytes("/t/f") == b"a" * 1000

    with_lapsing(tmp_path, body)


@pytest.mark.slow  # an in-process cluster
def test_an_append_lands_after_what_a_dead_writer_left_on_storage(tmp_path: Path) -> None:
    """A log's writer dies (SIGKILL: no close) with bytes on storage past the published length,
    its session still open; a writer on another client opens the log to append (the agent of a
    restarted job). The append must land after everything the dead writer left on storage:
    neither over its synced bytes nor interleaved with its unpublished ones, and the length meta
    computes once the dead session expires must keep the new writer's bytes."""

    async def body(env: Lapsing) -> None:
        synced = b"".join(b"a%05d synced\n" % i for i in range(100))
        # Unpublished, and across a chunk boundary: the end is in a chunk meta never heard of.
        unsynced = b"".join(b"a%05d on storage, never published\n" % i for i in range(2500))
        f = await env.a.open("/t/log", "ab")
        await f.write(synced)
        await f.fsync()
        await f.write(unsynced)
        await f.flush()  # on storage, acknowledged; the length not sent
        await env.a.meta.stop()  # A dies: its session stays until its lease lapses
        assert (await env.b.stat("/t/log")).st_size == len(synced)  # published lazily
        end = len(synced) + len(unsynced)
        assert end > CHUNK

        g = await env.b.open("/t/log", "ab")
        await g.write(b"b first line\n")
        await g.close()
        expected = synced + unsynced + b"b first line\n"
        assert (await env.b.stat("/t/log")).st_size == len(expected)
        assert await env.b.read_bytes("/t/log") == expected

        await env.lapse()  # meta closes A's session, probing storage for the length
        assert await env.b.read_bytes("/t/log") == expected
        async with await env.b.open("/t/log", "ab") as g:
            await g.write(b"b second line\n")
        assert await env.b.read_bytes("/t/log") == expected + b"b second line\n"

    with_lapsing(tmp_path, body)


@pytest.mark.slow  # an in-process cluster
def test_an_append_open_probes_again_after_a_truncate_under_its_probe(tmp_path: Path) -> None:
    """A truncate between the append open's probe and the length it publishes may have removed
    what the probe saw: the open probes again, and the append lands at the truncated end."""

    async def body(env: Lapsing) -> None:
        f = await env.a.open("/t/log", "ab")
        await f.write(b"a" * 1000)
        await f.fsync()
        await f.write(b"b" * (CHUNK + 500))
        await f.flush()
        await env.a.meta.stop()
        meta = env.cluster.meta
        assert meta is not None
        probe = meta._exact_length
        probed: list[int | None] = []

        async def truncated_after(*args: Any, **kwargs: Any) -> tuple[int | None, int | None]:
            found = await probe(*args, **kwargs)
            probed.append(found[0])
            if len(probed) == 1:
                await env.b.truncate("/t/log", 1200)
            return found

        meta._exact_length = truncated_after  # type: ignore[method-assign]
        async with await env.b.open("/t/log", "ab") as g:
            await g.write(b"c" * 10)
        assert probed == [1000 + CHUNK + 500, 1200]
        assert await env.b.read_bytes("/t/log") == b"a" * 1000 + b"b" * 200 + b"c" * 10

    with_lapsing(tmp_path, body)


@pytest.mark.slow  # an in-process cluster
def test_an_append_open_finds_the_writer_among_pages_of_readers(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Meta reads the file's sessions a page at a time: a writer past the first page counts."""
    monkeypatch.setattr("fs3.meta.lengths.PRUNE_PAGE", 2)

    async def body(env: Lapsing) -> None:
        f = await env.a.open("/t/log", "ab")
        await f.write(b"a" * 100)
        await f.flush()
        await env.a.meta.stop()
        readers = [await env.b.open("/t/log", "rb") for _ in range(5)]
        async with await env.b.open("/t/log", "ab") as g:
            await g.write(b"b")
        for reader in readers:
            await reader.close()
        assert await env.b.read_bytes("/t/log") == b"a" * 100 + b"b"

    with_lapsing(tmp_path, body)


@pytest.mark.slow  # an in-process cluster
def test_an_o_append_open_on_the_mount_lands_after_a_dead_writer(tmp_path: Path) -> None:
    """The same through the VFS (what the FUSE mount runs): an ``O_APPEND`` descriptor's writes go
    to the end of what the dead writer left on storage, whatever offset the kernel sends."""

    async def body(env: Lapsing) -> None:
        f = await env.b.open("/t/m", "ab")
        await f.write(b"x" * 1000)
        await f.fsync()
        await f.write(b"y" * 500)
        await f.flush()
        del f  # B's handle stays open on meta: a writer that never closes
        vfs = Vfs(env.a)
        try:
            t = await vfs.lookup(1, b"t", ROOT_USER)
            m = await vfs.lookup(t.inode_id, b"m", ROOT_USER)
            assert m.size == 1000
            fh, opened = await vfs.open(m.inode_id, O_WRONLY | O_APPEND, ROOT_USER)
            assert opened.size == 1500
            await vfs.write(fh, 1000, b"z" * 10)  # the kernel's offset: its size of the file
            await vfs.release(fh)
        finally:
            await vfs.close()
        assert await env.b.read_bytes("/t/m") == b"x" * 1000 + b"y" * 500 + b"z" * 10

    with_lapsing(tmp_path, body)


def meta_sessions(env: Lapsing) -> int:
    """How many file sessions meta holds (open handles of every client)."""
    assert env.cluster.meta_kv is not None
    return len(list(env.cluster.meta_kv.scan(schema.SESSION, prefix_end(schema.SESSION))))

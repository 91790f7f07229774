"""Linearizability of the namespace with three meta servers on one PostgreSQL database.

Three :class:`MetaService` instances, each with an engine (a connection pool) of its own on ONE
database, as three ``fs3 meta`` processes would be; six clients, each bound to a server of its own
choosing (client ``i`` to server ``i % 3``), run a seeded random mix of namespace operations on a
handful of names, so that they collide: ``mkdir``, creating opens (exclusive or not) and their
closes, renames (over existing names and across directories), ``unlink``, ``rmdir``, ``stat`` and
``readdir``. Every call goes into a history (:class:`fs3.sim.wgl.Call`, the simulator's answers
via :func:`fs3.sim.meta.answer`), which :func:`fs3.sim.meta.check_history` checks for
linearizability against :class:`fs3.sim.namespace.NamespaceModel` — the simulator's checker, here
on the real engine, real time and real concurrency.

Faults, each with the client's failover (the next server in order, the same request id):

* a lost reply — a mutation ran on its server, its answer is dropped, and the client sends the
  request again to another server: that server must answer from the saved answer (exactly once;
  the two answers are compared as well as the history checked);
* one server stopped mid-run — the replies of its requests in flight are lost (they may have run),
  it refuses the rest, and its clients carry on through the others with the same request ids.

After the mix, a fixed epilogue: a stat of ``/c`` on server 1, a ``mkdir /c`` on server 0 whose reply
is lost and which is retried on server 1, a stat of ``/c`` on server 1 by another client (it must
see the directory: the mkdir was acknowledged before), then stats and listings of everything.

The checker must reject what it is meant to reject, on this setting and not only on hand-made
histories (those are in tests/test_namespace_checker.py: a stale read after an acknowledged rename, a
retried rename that ran twice): a server whose reads are answered from a cache that is never
invalidated, and servers that run a retried request again (``FS3_SABOTAGE=idempotency``) are both
refused. The epilogue makes either visible whatever the random mix did.

``FS3_META_LINEARIZABLE_SEEDS=N`` (``make meta-linearizable``) runs N more seeds, and
``FS3_META_LINEARIZABLE_OPS`` sets the operations per client.
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import pytest
from google.protobuf.message import Message

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.client.routing import RoutingCache
from fs3.common.errors import FS3Error, StatusCode
from fs3.common.faults import SABOTAGE_ENV
from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.methods import service_spec
from fs3.sim.meta import answer, check_history, request
from fs3.sim.namespace import tag_mode
from fs3.sim.wgl import Call
from tests.test_meta_model import NoChunks, NoChunksMeta

pytestmark = pytest.mark.slow

SERVERS = 3
CLIENTS = 6
STOPPED = 2  # the server stopped mid-run
OPS_PER_CLIENT = int(os.environ.get("FS3_META_LINEARIZABLE_OPS", "40"))
EXTRA_SEEDS = int(os.environ.get("FS3_META_LINEARIZABLE_SEEDS", "0"))
PATHS = ("/a", "/b", "/a/x", "/b/x")
DIRS = ("/", "/a", "/b")
LOST_REPLY_SHARE = 0.15
HANDLES_MAX = 2
CHUNK = 4096
_META = service_spec("Meta")
# Errors after which a request may or may not have run: the client tries the next server.
_UNKNOWN = frozenset({StatusCode.UNAVAILABLE, StatusCode.TIMEOUT, StatusCode.TXN_CONFLICT,
                      StatusCode.MAYBE_COMMITTED, StatusCode.RESOURCE_EXHAUSTED})
_READS = frozenset({"stat", "readdir"})




class _NoChannels:
    def node_address(self, framed: str, grpc: str) -> str:
        return framed


class ServerStopped(Exception):
    """The server was stopped: this request was refused or cancelled (its outcome unknown)."""


class Server:
    """One meta server: its own engine on the shared database; stoppable, possibly stale."""

    def __init__(self, index: int, service: MetaService, engine: PostgresTxnEngine, stale_reads: bool) -> None:
        self.index = index
        self.service = service
        self.engine = engine
        self.stale_reads = stale_reads  # the sabotage: reads answered from a cache never invalidated
        self.cache: dict[tuple[str, bytes], Any] = {}
        self.stopped = False
        self.in_flight: set[asyncio.Task[Any]] = set()

    async def call(self, method: str, req: Message) -> Any:
        if self.stopped:
            raise ServerStopped(f"meta-{self.index} is stopped")
        cached = None
        if self.stale_reads and method in ("Lookup", "ReadDir"):
            # Keyed without the request's ctx: another client's read of the same path hits it too.
            bare = type(req)()
            bare.CopyFrom(req)
            bare.ClearField("ctx")
            cached = (method, bare.SerializeToString(deterministic=True))
            if cached in self.cache:
                hit = self.cache[cached]
                if isinstance(hit, FS3Error):
                    raise copy.copy(hit)
                return hit
        handler = getattr(self.service, _META.method(method).handler_name)
        task = asyncio.ensure_future(handler(req, memoryview(b"")))
        self.in_flight.add(task)
        try:
            await asyncio.wait([task])
        finally:
            self.in_flight.discard(task)
        if self.stopped:  # it ran (or failed), and its reply is lost with the server
            raise ServerStopped(f"meta-{self.index} stopped while the request ran")
        # The error is raised by task.result(), never held in a local of this frame: an exception
        # whose traceback holds a frame that holds it is a cycle, and the transaction in that
        # traceback would keep its pooled connection until the garbage collector ran.
        try:
            rsp, _ = task.result()
        except FS3Error as exc:
            if cached is not None and exc.code not in _UNKNOWN:
                self.cache[cached] = copy.copy(exc).with_traceback(None)
            raise
        if cached is not None:
            self.cache[cached] = rsp
        return rsp

    async def stop(self) -> None:
        """Stop mid-run: refuse new requests, lose the replies of those in flight (they run to
        their end: a request that died inside its transaction is the engine's case, tested in
        tests/test_kv_postgres.py and by the process failover tests), close the connections."""
        self.stopped = True
        if self.in_flight:
            await asyncio.wait(list(self.in_flight))
        await self.service.stop()
        self.engine.terminate()


@dataclass
class Handle:
    label: Hashable
    inode_id: int
    session_id: bytes


@dataclass
class Client:
    index: int
    home: int
    client_id: bytes
    next_request: int = 1
    handles: list[Handle] = field(default_factory=list)

    def ctx(self) -> mpb.ReqCtx:
        request_id, self.next_request = self.next_request, self.next_request + 1
        return mpb.ReqCtx(user=mpb.User(uid=0, gid=0), client_id=self.client_id, request_id=request_id)


@dataclass
class Run:
    servers: list[Server]
    rng: random.Random
    calls: list[Call] = field(default_factory=list)
    # exactly-once: a mutation's answer from its first server and from the retry elsewhere differ
    answered_twice: list[str] = field(default_factory=list)
    retried_elsewhere: int = 0  # lost replies answered by another server
    refused_stopped: int = 0  # requests the stopped server refused or lost the reply of
    next_tag: int = 0

    def tag(self) -> int:
        self.next_tag += 1
        return tag_mode(self.next_tag)

    def order(self, client: Client, first: int | None = None) -> list[Server]:
        """The servers a client tries, its own (or ``first``) first, then the next ones in turn."""
        start = client.home if first is None else first
        return [self.servers[(start + k) % len(self.servers)] for k in range(len(self.servers))]

    async def issue(self, client: Client, kind: str, args: tuple[Any, ...], handle: Handle | None = None,
                    lose_reply: bool = False, first: int | None = None) -> Call:
        """One call: sent to the client's server, again (same request id) to the next one after a
        lost reply, an unknown outcome or a stopped server. Noted in the history."""
        loop = asyncio.get_running_loop()
        call = Call(kind, args, loop.time(), client=client.index, index=len(self.calls))
        self.calls.append(call)
        method, req, _ = request(kind, args, *((handle.inode_id, handle.session_id) if handle else ()))
        ctx = client.ctx()
        req.ctx.CopyFrom(ctx)  # type: ignore[attr-defined]
        lost: tuple[int, tuple[Any, ...]] | None = None
        rsp: Any = None
        tried: list[str] = []
        order = self.order(client, first)
        for attempt, server in enumerate(order):
            tried.append(f"meta-{server.index}")
            try:
                rsp = await server.call(method, req)
            except ServerStopped:
                self.refused_stopped += 1
                continue
            except FS3Error as exc:
                if exc.code in _UNKNOWN:
                    continue
                result: tuple[Any, ...] = ("err", exc.code.name)
            else:
                result = answer(kind, rsp)
            if lose_reply and lost is None and attempt + 1 < len(order):
                lost = (server.index, result)  # the reply never arrives: try the next server
                continue
            call.result, call.complete = result, loop.time()
            if lost is not None:
                self.retried_elsewhere += 1
                # A saved answer is given again; a request that failed saved none and runs afresh.
                if lost[1][0] == "ok" and lost[1] != call.result:
                    self.answered_twice.append(f"#{call.index} {kind}{args}: meta-{lost[0]} answered {lost[1]}, "
                                               f"the retry on meta-{server.index} {call.result}")
            if kind == "create" and result[0] == "ok" and rsp.session_id:
                client.handles.append(Handle(args[4], rsp.inode.inode_id, bytes(rsp.session_id)))
            break
        call.note = f"request {ctx.request_id} via {', '.join(tried)}"
        return call

    async def one_op(self, client: Client) -> None:
        rng = self.rng
        roll = rng.random()
        path = rng.choice(PATHS)
        lose = rng.random() < LOST_REPLY_SHARE
        if roll < 0.30 and len(client.handles) >= HANDLES_MAX:
            roll = 0.32  # close one first
        if roll < 0.12:
            await self.issue(client, "mkdir", (path, self.tag()), lose_reply=lose)
        elif roll < 0.30:
            await self.issue(client, "create", (path, self.tag(), rng.random() < 0.3, False, len(self.calls)),
                             lose_reply=lose)
        elif roll < 0.40:
            if not client.handles:
                await self.issue(client, "stat", (path,))
                return
            handle = client.handles.pop(rng.randrange(len(client.handles)))
            length = rng.randint(1, 3 * CHUNK) if rng.random() < 0.7 else 0
            await self.issue(client, "close", (handle.label, length), handle, lose_reply=lose)
        elif roll < 0.58:
            await self.issue(client, "rename", (path, rng.choice(PATHS)), lose_reply=lose)
        elif roll < 0.66:
            await self.issue(client, "unlink", (path,), lose_reply=lose)
        elif roll < 0.72:
            await self.issue(client, "rmdir", (path,), lose_reply=lose)
        elif roll < 0.88:
            await self.issue(client, "stat", (path,))
        else:
            await self.issue(client, "readdir", (rng.choice(DIRS),))


async def _start_servers(url: str, stale_server: int | None) -> list[Server]:
    servers = []
    for index in range(SERVERS):
        engine = await PostgresTxnEngine.open(PostgresConfig(url, pool_size_max=4))
        routing = RoutingCache(["mgmtd"], _NoChannels())  # type: ignore[arg-type]
        routing._install(cpb.RoutingInfo(chain_tables=[cpb.ChainTable(table_id=1, chain_ids=[11, 12, 13])]))
        config = MetaServiceConfig(chunk_size_bytes=CHUNK, root_mode=0o777)
        service = NoChunksMeta(engine, routing, NoChunks(), config,  # type: ignore[arg-type]
                               server_id=f"meta-{index}".encode())
        await service.start(background=False)
        servers.append(Server(index, service, engine, stale_reads=index == stale_server))
    return servers


async def run_history(url: str, seed: int, stale_server: int | None = None) -> Run:
    """The mix, the stop, the epilogue; the run with its history."""
    servers = await _start_servers(url, stale_server)
    run = Run(servers, random.Random(seed))
    clients = [Client(i, i % SERVERS, f"lin-{seed}-{i}".encode().ljust(16, b".")) for i in range(CLIENTS)]
    done = 0
    total = CLIENTS * OPS_PER_CLIENT
    halfway = asyncio.Event()

    async def client_loop(client: Client) -> None:
        nonlocal done
        for _ in range(OPS_PER_CLIENT):
            await run.one_op(client)
            done += 1
            if done >= total // 2:
                halfway.set()
            await asyncio.sleep(run.rng.uniform(0, 0.005))
        for handle in list(client.handles):  # close what is still open
            client.handles.remove(handle)
            await run.issue(client, "close", (handle.label, 0), handle)

    async def stopper() -> None:
        await halfway.wait()
        await servers[STOPPED].stop()

    try:
        await asyncio.gather(stopper(), *(client_loop(c) for c in clients))
        first, second = clients[0], clients[1]
        await run.issue(first, "stat", ("/c",), first=1)
        await run.issue(first, "mkdir", ("/c", run.tag()), lose_reply=True, first=0)
        await run.issue(second, "stat", ("/c",), first=1)
        for path in (*PATHS, "/c"):
            await run.issue(first, "stat", (path,), first=0)
        for path in (*DIRS, "/c"):
            await run.issue(first, "readdir", (path,), first=0)
    finally:
        for server in servers:
            if not server.stopped:
                await server.stop()
    return run


def _seeds() -> list[int]:
    return [1, 2, 3, *range(100, 100 + EXTRA_SEEDS)]


@pytest.mark.parametrize("seed", _seeds())
def test_three_servers_on_one_database_are_linearizable(postgres_url: str, seed: int) -> None:
    """Clients on different servers, lost replies retried elsewhere, a server stopped: every
    answer fits one order of the operations within their real times, and every retry was answered
    from the saved answer."""
    run = asyncio.run(run_history(postgres_url, seed))
    assert run.answered_twice == []
    assert run.retried_elsewhere > 0
    assert run.refused_stopped > 0  # the stop was felt, and its clients carried on elsewhere
    answered = sum(1 for c in run.calls if c.completed)
    assert answered >= len(run.calls) * 0.9, f"only {answered} of {len(run.calls)} calls answered"
    verdict, lines = check_history(run.calls)
    assert verdict.status == "ok", "\n".join(lines)


def test_the_checker_rejects_a_server_whose_reads_are_stale(postgres_url: str) -> None:
    """Server 1 answers reads from a cache it never invalidates: the checker must refuse."""
    run = asyncio.run(run_history(postgres_url, seed=1, stale_server=1))
    verdict, lines = check_history(run.calls)
    assert verdict.status == "violation", f"a stale server passed: {verdict.status}: {lines}"


def test_the_checker_rejects_retries_run_twice(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers that run a retried request again instead of answering from the saved answer: the
    answers differ, and the checker refuses the history on its own."""
    monkeypatch.setenv(SABOTAGE_ENV, "idempotency")
    run = asyncio.run(run_history(postgres_url, seed=1))
    assert run.answered_twice
    verdict, _ = check_history(run.calls)
    assert verdict.status == "violation"


def test_a_read_only_request_commits_before_it_answers(postgres_url: str) -> None:
    """A stat on PostgreSQL commits its transaction (tests/test_pg_read_only.py shows why), the
    one that answers "not found" too: that answer was read from the database as well."""
    async def body() -> tuple[int, int]:
        servers = await _start_servers(postgres_url, stale_server=None)
        try:
            meta = servers[0]
            ctx = mpb.ReqCtx(user=mpb.User(uid=0, gid=0), client_id=b"reader".ljust(16, b"."), request_id=1)
            before = meta.engine.stats()["commits"]
            rsp = await meta.call("Lookup", mpb.LookupReq(ctx=ctx, target=mpb.PathRef(path=b"/"), follow=True))
            assert rsp.inode.type == mpb.DIRECTORY
            with pytest.raises(FS3Error, match="NOT_FOUND"):
                await meta.call("Lookup", mpb.LookupReq(ctx=ctx, target=mpb.PathRef(path=b"/nothing"), follow=True))
            return before, meta.engine.stats()["commits"]
        finally:
            for server in servers:
                await server.stop()

    before, after = asyncio.run(body())
    assert after - before == 2  # "not found" is an answer read from the database too

"""Several clients against one MetaService in process, step by step beside the namespace model.

A Hypothesis state machine plays two clients (each a client id, its request ids, its open
handles) against :class:`MetaService` over an in-memory engine (and, with the faults PostgreSQL
can have, over the PostgreSQL engine), and every answer against
:class:`fs3.sim.namespace.NamespaceModel`. Faults are rules:

* a lost reply — the request ran, its answer never arrived; a later rule retries it under the same
  request id and must get the answer meta saved (or, for a request that failed, a fresh run);
* a reply lost before its commit was durable — the handler is cancelled while its group sync is
  held back, so the change is visible and not yet durable;
* a meta restart — everything not synced is lost (the store keeps its durable part);
* a lease expiry — meta's clock jumps past the lease, the other clients renew, meta expires the
  client (closing its sessions; its id is refused from then on, so a retry of a request whose
  answer meta dropped is refused loudly, never run again), which registers under a new id.

The group sync is held back during every request, and released only when the request waits for
it: a request answered without waiting must not depend on anything a crash could take back — its
answer is checked against the model's *durable* state too. After every step the whole store
(entries, inodes, sessions) must equal the model's state.

The faults the machine is run with in ``make test`` are those a state machine meets often within
a fixed number of examples; every fault at once is a long run (``make sim-meta``), and the
scenarios it once found (saved answers forgotten at a lease lapse, answers before durability,
renewals of a lapsed lease) are pinned down as plain tests. Each checker is also shown to reject
sabotaged services.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3 import storage_pb2 as spb
from fs3.client.routing import RoutingCache
from fs3.common.clock import ManualClock
from fs3.common.errors import FS3Error
from fs3.kv.api import TxnEngine
from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine
from fs3.meta import schema
from fs3.meta import service as service_mod
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.methods import service_spec
from fs3.sim.loop import SimProcess, VirtualTimeLoop
from fs3.sim.meta import answer, comparable, request, store_namespace
from fs3.sim.namespace import NAMESPACE_ERRORS, NamespaceModel, NsState, Tree, tag_mode
from fs3.sim.wgl import Call

CHUNK = 4096
LEASE_MS = 30_000
PATHS = ["/a", "/b", "/a/x", "/b/x"]
DIRS = ["/", "/a", "/b"]
CLIENTS = 2
_META = service_spec("Meta")


class Mismatch(AssertionError):
    """The service and the model disagree."""


class NoChunks:
    """Storage that holds no chunk: probes find nothing, removals and trims succeed."""

    async def read(self, chain_id: int, chunk_id: bytes, offset: int, length: int,
                   *args: Any, **kwargs: Any) -> tuple[bytes, spb.ReadRsp]:
        return b"", spb.ReadRsp(version=0, chunk_length=0)

    async def remove(self, *args: Any, **kwargs: Any) -> spb.UpdateRsp:
        return spb.UpdateRsp()

    async def truncate(self, *args: Any, **kwargs: Any) -> spb.UpdateRsp:
        return spb.UpdateRsp()


class NoChunksMeta(MetaService):
    """Meta over storage that holds no chunk: every listing of a file's chunks is empty."""

    async def _list_inode_chunks(self, chain_id: int, inode_id: int, index: int,
                                 head_first: bool) -> tuple[list[spb.ChunkMeta], bool]:
        return [], False


class GatedEngine(OptimisticTxnEngine):
    """A group sync that finishes only while ``gate`` is open: commits wait in between."""

    def __init__(self, store: MemKVStore, gate: asyncio.Event) -> None:
        super().__init__(store, sync=True)
        self.gate = gate

    async def _sync_wal(self) -> None:
        await self.gate.wait()
        self.store.sync_wal()


class _NoChannels:
    def node_address(self, framed: str, grpc: str) -> str:
        return framed


class Meta:
    """One MetaService on a virtual-time loop, restartable over the same store."""

    def __init__(self) -> None:
        self.loop = VirtualTimeLoop()
        self.store = MemKVStore()
        self.now_ms = 1_700_000_000_000  # wall time, for inode times
        self.clock = ManualClock()  # meta's monotonic clock, for leases
        self.gate = asyncio.Event()
        self.gate.set()
        self.process = SimProcess("meta")
        self.service = self._start()

    def _start(self) -> MetaService:
        self.process = SimProcess("meta")
        routing = RoutingCache(["mgmtd"], _NoChannels())  # type: ignore[arg-type]
        routing._install(cpb.RoutingInfo(chain_tables=[cpb.ChainTable(table_id=1, chain_ids=[11, 12, 13])]))
        config = MetaServiceConfig(chunk_size_bytes=CHUNK, root_mode=0o777, client_lease_ms=LEASE_MS)
        # One server on its own store: claims are granted without transactions (fs3.meta.claims), so
        # a request waits for a sync only at its own commits, where the machine loses replies.
        service = NoChunksMeta(self._engine(), routing, NoChunks(),  # type: ignore[arg-type]
                               config, wall_ns=lambda: self.now_ms * 1_000_000, clock=self.clock,
                               server_id=b"meta", exclusive_store=True)
        self.gate.set()
        self.finish(self.spawn(service.start(background=False)))
        return service

    def _engine(self) -> TxnEngine:
        return GatedEngine(self.store, self.gate)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        async def start() -> asyncio.Task[Any]:
            return self.process.run(coro)

        return self.loop.run_until_complete(start())

    def settle(self, task: asyncio.Task[Any]) -> None:
        """Run until ``task`` is done or waits for something only the harness can give (a sync)."""
        self.loop.run_until_complete(asyncio.wait([task], timeout=5.0))

    def finish(self, task: asyncio.Task[Any]) -> bool:
        """Run ``task`` with syncs held back, releasing them only if it waits; True if it had to wait."""
        self.gate.clear()
        self.settle(task)
        waited = not task.done()
        if waited:
            self.sync()
            self.settle(task)
            assert task.done(), "a request still waits with the group sync released"
        return waited

    def sync(self) -> None:
        """Release the group sync: everything committed becomes durable."""
        self.gate.set()
        self.loop.run_until_complete(asyncio.sleep(0.001))

    def call(self, method: str, req: Any, hold: bool = False) -> tuple[bool, Any]:
        """Send one request. Returns (whether it waited for a sync, its answer or error).

        ``hold``: a request that waits for a sync is cancelled instead (its reply is lost before
        its commit is durable); then the answer is None.
        """
        handler = getattr(self.service, _META.method(method).handler_name)
        task = self.spawn(handler(req, memoryview(b"")))
        self.gate.clear()
        self.settle(task)
        if not task.done():
            if hold:
                task.cancel()
                self.settle(task)
                return True, None
            self.sync()
            self.settle(task)
            waited = True
        else:
            waited = False
        assert task.done(), "a request still waits with the group sync released"
        exc = task.exception()
        if exc is not None:
            if isinstance(exc, FS3Error):
                return waited, ("err", exc.code.name)
            raise exc
        rsp, _ = task.result()
        return waited, rsp

    def crash(self) -> None:
        """Kill meta: what was not synced is gone. Then start it again."""
        self.process.kill()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.store.crash()
        self.service = self._start()

    def close(self) -> None:
        self.process.kill()
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()


class _EngineView:
    """Committed state read through an engine, in the shape ``store_namespace`` reads a store."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: TxnEngine) -> None:
        self.loop = loop
        self.engine = engine

    def get(self, key: bytes) -> bytes | None:
        return self.loop.run_until_complete(self.engine.begin().get(key))

    def scan(self, start: bytes, end: bytes | None = None) -> list[tuple[bytes, bytes]]:
        return self.loop.run_until_complete(self.engine.begin().scan(start, end))


class PgMeta(Meta):
    """The same harness over PostgreSQL. A real event loop (the engine waits on sockets, which a
    virtual-time loop would time out at once), the database emptied first (one per test, reused
    by every example); a commit is durable when it returns (``synchronous_commit``), so every
    answer counts as one given after a sync, and a restart loses nothing."""

    def __init__(self, url: str) -> None:  # not Meta.__init__: another loop and engine
        self.loop = asyncio.new_event_loop()  # type: ignore[assignment]  # a real loop: see above
        self.pg = self.loop.run_until_complete(PostgresTxnEngine.open(PostgresConfig(url)))
        self.loop.run_until_complete(_empty(self.pg))
        self.store = _EngineView(self.loop, self.pg)  # type: ignore[assignment]
        self.now_ms = 1_700_000_000_000
        self.clock = ManualClock()
        self.gate = asyncio.Event()
        self.gate.set()
        self.process = SimProcess("meta")
        self.service = self._start()

    def _engine(self) -> TxnEngine:
        return self.pg

    def finish(self, task: asyncio.Task[Any]) -> bool:
        super().finish(task)
        return True

    def call(self, method: str, req: Any, hold: bool = False) -> tuple[bool, Any]:
        _, rsp = super().call(method, req, hold)
        return True, rsp

    def crash(self) -> None:
        self.process.kill()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.service = self._start()

    def close(self) -> None:
        self.pg.terminate()
        super().close()


async def _empty(engine: TxnEngine) -> None:
    txn = engine.begin()
    for key, _ in await txn.scan(b""):
        txn.delete(key)
    await txn.commit()


@dataclass
class Identity:
    """One registration of a client: its id and request ids."""

    number: int
    client_id: bytes
    next_request: int = 1
    in_flight: set[int] = field(default_factory=set)

    def ctx(self) -> mpb.ReqCtx:
        request_id = self.next_request
        self.next_request += 1
        return mpb.ReqCtx(user=mpb.User(uid=0, gid=0), client_id=self.client_id, request_id=request_id)

    def completed_below(self) -> int:
        return min(self.in_flight) if self.in_flight else self.next_request


@dataclass
class Handle:
    label: bytes
    inode_id: int
    session_id: bytes


@dataclass
class Pending:
    """A request whose answer the client never got; it retries it later."""

    identity: Identity
    call: Call
    method: str
    req: Any
    saved: Any  # the answer meta committed with the change (None: nothing was committed)
    volatile: bool = False  # committed but not yet durable
    expired: bool = False  # the client's lease lapsed since


def _saves_answer(call: Call) -> bool:
    """Whether meta committed the call's answer with it (a retry gets it back): every request that
    may change something and succeeded — opening a directory too, which changes nothing. Errors
    commit nothing, and lookups and listings are reads."""
    return call.kind not in ("stat", "readdir") and isinstance(call.result, tuple) and call.result[0] == "ok"


_PATH = st.sampled_from(["/a", "/b", "/a", "/b", "/a/x", "/b/x"])  # top-level names twice as often
_CREATE = st.tuples(st.just("create"), _PATH, st.booleans(), st.booleans())
_RENAME = st.tuples(st.just("rename"), _PATH, _PATH)
_CLOSE = st.tuples(st.just("close"), st.integers(0, 3), st.sampled_from([0, 1000, 5000, 9000]))
# Creations, renames and closes weigh more: they make the states the other calls then explore.
OPS = st.one_of(
    _CREATE, _CREATE, _RENAME, _RENAME, _CLOSE,
    st.tuples(st.just("mkdir"), _PATH),
    st.tuples(st.just("open"), _PATH),
    st.tuples(st.just("unlink"), _PATH),
    st.tuples(st.just("rmdir"), _PATH),
    st.tuples(st.just("truncate"), _PATH, st.sampled_from([0, 100, 5000])),
    st.tuples(st.just("stat"), _PATH),
    st.tuples(st.just("readdir"), st.sampled_from(DIRS)),
)
SLOTS = st.integers(0, CLIENTS - 1)


class MetaModelMachine(RuleBasedStateMachine):
    """The service beside the model. Subclasses choose the faults (see the module docstring)."""

    held_replies = True  # replies lost before the commit is durable
    expire_with_requests_in_flight = True  # a lease may lapse while the client still retries a request

    def __init__(self) -> None:
        super().__init__()
        self.meta = self._meta()
        self.model = NamespaceModel()
        self.visible: NsState = self.model.initial()
        self.durable: NsState = self.visible
        self.numbers = 0
        self.tags = iter(range(1, 2048))
        self.pending: list[Pending] = []
        self.identities = [self._register() for _ in range(CLIENTS)]
        self.handles: list[list[Handle]] = [[] for _ in range(CLIENTS)]
        self.last_retry: Any = None

    def _meta(self) -> Meta:
        return Meta()

    def teardown(self) -> None:
        self.meta.close()

    # -- helpers ---------------------------------------------------------------------------------

    def _register(self) -> Identity:
        self.numbers += 1
        identity = Identity(self.numbers, f"client{self.numbers:03d}".encode().ljust(16, b"."))
        self._renew(identity)
        return identity

    def _renew(self, identity: Identity) -> Any:
        waited, rsp = self.meta.call("RenewClient", mpb.RenewClientReq(
            client_id=identity.client_id, hostname="h", pid=1, completed_below=identity.completed_below()))
        if waited:
            self._synced()
        return rsp

    def _synced(self) -> None:
        """A group sync ran to the end: everything visible is durable (truncates meta finished too)."""
        self._follow_truncates()
        self.durable = self.visible
        for pending in self.pending:
            pending.volatile = False

    def _build(self, slot: int, op: tuple[Any, ...]) -> tuple[Call, str, Any, Handle | None]:
        identity = self.identities[slot]
        ctx = identity.ctx()
        kind = op[0]
        handle = None
        if kind == "close" and not self.handles[slot]:
            kind, op = "stat", ("stat", "/a")
        if kind == "mkdir":
            args: tuple[Any, ...] = (op[1], tag_mode(next(self.tags)))
        elif kind == "create":
            args = (op[1], tag_mode(next(self.tags)), op[2], op[3], schema.session_id_for(ctx.client_id,
                                                                                            ctx.request_id))
        elif kind == "open":
            args = (op[1], schema.session_id_for(ctx.client_id, ctx.request_id))
        elif kind == "close":
            handle = self.handles[slot].pop(op[1] % len(self.handles[slot]))
            args = (handle.label, op[2])
        else:
            args = tuple(op[1:])
        method, req, _ = request(kind, args, *((handle.inode_id, handle.session_id) if handle else ()))
        req.ctx.CopyFrom(ctx)  # type: ignore[attr-defined]  # every meta request has one; Message does not say so
        call = Call(kind, args, 0.0, 1.0, client=identity.number, note=f"request {ctx.request_id}")
        return call, method, req, handle

    def _observed(self, call: Call, rsp: Any) -> Any:
        return rsp if isinstance(rsp, tuple) else answer(call.kind, rsp)

    def _keep_handle(self, slot: int, call: Call, rsp: Any) -> None:
        if call.kind in ("create", "open") and not isinstance(rsp, tuple) and rsp.session_id:
            self.handles[slot].append(Handle(call.args[-1], rsp.inode.inode_id, bytes(rsp.session_id)))

    def _follow_truncates(self) -> None:
        """Apply the model's pending truncates whose job meta has finished (its store no longer
        holds it): meta finishes a file's pending truncate before anything else that needs it."""
        jobs = {(tag, size) for _, tag, size in store_namespace(self.meta.store)[3]}
        tree = Tree(self.visible)
        for label, (tag, size) in sorted(tree.pending.items(), key=lambda kv: repr(kv[0])):
            if (tag, size) not in jobs or tag not in tree.inodes:
                self.visible, _ = self.model.step(self.visible, Call("resize", (label,), 0.0, 1.0))

    def _apply(self, call: Call, observed: Any, waited: bool) -> None:
        """Check an answer the client got, and move the model on."""
        self._follow_truncates()
        call.result = observed
        state, expected = self.model.step(self.visible, call)
        if not self.model.agrees(call, expected):
            raise Mismatch(f"{call.kind}{call.args} answered {observed!r}; the model answers {expected!r} "
                           f"on {self.model.show(self.visible)}")
        if waited:
            self.visible = state
            self._synced()
            return
        # Answered without waiting for a sync: nothing it says may rest on what a crash takes back.
        if state != self.visible:
            raise Mismatch(f"{call.kind}{call.args} answered {observed!r}, a change, before it was durable")
        _, on_durable = self.model.step(self.durable, call)
        if not self.model.agrees(call, on_durable):
            raise Mismatch(f"{call.kind}{call.args} answered {observed!r} from a change not yet durable: "
                           f"after a crash the model answers {on_durable!r} (durable {self.model.show(self.durable)}, "
                           f"visible {self.model.show(self.visible)})")

    # -- rules -----------------------------------------------------------------------------------

    @rule(slot=SLOTS, op=OPS)
    def act(self, slot: int, op: tuple[Any, ...]) -> None:
        call, method, req, _ = self._build(slot, op)
        waited, rsp = self.meta.call(method, req)
        self._apply(call, self._observed(call, rsp), waited)
        self._keep_handle(slot, call, rsp)

    @rule(slot=SLOTS, op=OPS)
    def lose_reply(self, slot: int, op: tuple[Any, ...]) -> None:
        """The request runs; its answer is lost. The client will retry it."""
        identity = self.identities[slot]
        call, method, req, _ = self._build(slot, op)
        identity.in_flight.add(req.ctx.request_id)
        waited, rsp = self.meta.call(method, req)
        observed = self._observed(call, rsp)
        self._apply(call, observed, waited)
        saved = observed if _saves_answer(call) else None
        self.pending.append(Pending(identity, call, method, req, saved))

    @precondition(lambda self: self.held_replies)
    @rule(slot=SLOTS, op=OPS)
    def lose_reply_before_durable(self, slot: int, op: tuple[Any, ...]) -> None:
        """The request commits, and its connection drops while the commit waits for the sync."""
        identity = self.identities[slot]
        call, method, req, _ = self._build(slot, op)
        identity.in_flight.add(req.ctx.request_id)
        waited, rsp = self.meta.call(method, req, hold=True)
        if rsp is not None:  # answered without waiting: an ordinary lost reply
            observed = self._observed(call, rsp)
            self._apply(call, observed, waited)
            self.pending.append(Pending(identity, call, method, req, observed if _saves_answer(call) else None))
            return
        raw = self.meta.store.get(schema.idem_key(req.ctx.client_id, req.ctx.request_id))
        if raw is None:  # cancelled before its commit: nothing happened, the retry runs it afresh
            self.pending.append(Pending(identity, call, method, req, None))
            return
        _, _, rsp_type = request(call.kind, call.args)
        call.result = saved = answer(call.kind, rsp_type.FromString(schema.IdemRecord.decode(raw).response))
        # Cancelled after the commit: a truncate is recorded, its size applied when meta finishes it.
        if call.kind == "truncate":
            call.args = (*call.args, (call.client, call.note))
        elif call.kind == "create" and call.args[3]:
            call.args = (*call.args, True)
        state, expected = self.model.step(self.visible, call)
        if not self.model.agrees(call, expected):
            raise Mismatch(f"{call.kind}{call.args} committed the answer {saved!r}; the model answers {expected!r} "
                           f"on {self.model.show(self.visible)}")
        self.visible = state  # visible now, durable once a sync ends
        self.pending.append(Pending(identity, call, method, req, saved, volatile=True))

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 50))
    def retry(self, index: int) -> None:
        """The client sends a request whose answer it never got again, under the same request id
        (its answer is kept in ``last_retry``)."""
        pending = self.pending.pop(index % len(self.pending))
        call = pending.call
        waited, rsp = self.meta.call(pending.method, pending.req)
        pending.identity.in_flight.discard(pending.req.ctx.request_id)
        observed = self._observed(call, rsp)
        slot = next((i for i, ident in enumerate(self.identities) if ident is pending.identity), None)
        # A client whose lease lapsed may be refused loudly: then nothing more happens.
        fenced = pending.expired and isinstance(observed, tuple) and observed[0] == "err" \
            and observed[1] not in NAMESPACE_ERRORS
        if pending.volatile and not waited:
            raise Mismatch(f"retry of {call.kind}{call.args} answered {observed!r} before its commit was durable")
        if fenced:
            pass
        elif pending.saved is None:  # nothing was committed: this run is the one that counts
            self._apply(call, observed, waited)
        elif observed != pending.saved:
            lapsed = " (the client's lease lapsed in between)" if pending.expired else ""
            raise Mismatch(f"retry of {call.kind}{call.args} ({call.note}) answered {observed!r}, not the saved "
                           f"{pending.saved!r}{lapsed}")
        if waited:
            self._synced()
        if slot is not None:
            self._keep_handle(slot, call, rsp)
        self.last_retry = observed

    @rule()
    def sync(self) -> None:
        self.meta.sync()
        self._synced()

    @rule()
    def restart_meta(self) -> None:
        self.meta.crash()
        self.visible = self.durable
        for pending in self.pending:
            if pending.volatile:  # its commit is gone: the retry runs it for the first time
                pending.saved, pending.volatile, pending.call.result = None, False, None

    @rule(slot=SLOTS)
    def expire_lease(self, slot: int) -> None:
        """The client is cut off longer than its lease: meta closes its sessions and forgets it."""
        target = self.identities[slot]
        if not self.expire_with_requests_in_flight and any(p.identity is target for p in self.pending):
            return
        # Meta times a lease from when it first saw its renewal count: one round to see the counts,
        # a lease's time, the others renew, and a round that finds only the target's count stale.
        waited = self.meta.finish(self.meta.spawn(self.meta.service.prune_clients_once()))
        self.meta.now_ms += LEASE_MS + 1_000
        self.meta.clock.advance(LEASE_MS + 1_000)
        for identity in self.identities:
            if identity is not target:
                self._renew(identity)
        waited = self.meta.finish(self.meta.spawn(self.meta.service.prune_clients_once())) or waited
        tree = Tree(self.visible)
        for label, session in list(tree.sessions.items()):
            if session[1] == target.number:
                tree.end_session(label, 0)
        self.visible = tree.freeze()
        if waited:
            self._synced()
        for pending in self.pending:
            pending.expired = pending.expired or pending.identity is target
        self.identities[slot] = self._register()

    @invariant()
    def store_matches_model(self) -> None:
        self._follow_truncates()
        real = comparable(store_namespace(self.meta.store))
        if real != comparable(self.visible):
            raise Mismatch(f"meta's store holds {real}, the model {comparable(self.visible)}")


class HandledFaults(MetaModelMachine):
    """Lost replies, restarts, and lease expiry of clients with nothing in flight."""

    held_replies = False
    expire_with_requests_in_flight = False


def _settings(examples: int, shrink: bool = True) -> settings:
    phases = tuple(Phase) if shrink else (Phase.explicit, Phase.reuse, Phase.generate)
    return settings(max_examples=examples, stateful_step_count=40, deadline=None, derandomize=True, database=None,
                    phases=phases, suppress_health_check=list(HealthCheck), report_multiple_bugs=False)


def test_clients_match_the_model_under_lost_replies_restarts_and_lease_expiry() -> None:
    run_state_machine_as_test(HandledFaults, settings=_settings(60))


def test_clients_match_the_model_on_postgres(postgres_url: str) -> None:
    """The same machine over the PostgreSQL engine (fewer examples: every step is a few round
    trips to a real server). Held-back syncs do not exist there: a commit returns durable."""

    class OnPostgres(HandledFaults):
        def _meta(self) -> Meta:
            return PgMeta(postgres_url)

    run_state_machine_as_test(OnPostgres, settings=_settings(12))


@pytest.mark.skipif(not os.environ.get("FS3_META_MODEL_EXAMPLES"),
                    reason="a long run: FS3_META_MODEL_EXAMPLES=N (make sim-meta)")
def test_clients_match_the_model_under_every_fault() -> None:
    """Every fault at once, for long runs; the two property tests below cover, in make test, the
    schedules that found the lease-lapse and durability bugs."""
    examples = int(os.environ["FS3_META_MODEL_EXAMPLES"])
    run_state_machine_as_test(MetaModelMachine, settings=_settings(examples))


def _two_clients(setup: list[tuple[Any, ...]]) -> MetaModelMachine:
    machine = MetaModelMachine()
    machine.act(1, ("mkdir", "/b"))  # the first creation reserves inode ids (a commit of its own)
    for op in setup:
        machine.act(1, op)
    return machine


@settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
          report_multiple_bugs=False, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(setup=st.lists(OPS, max_size=3), first=OPS, second=OPS)
def test_nothing_is_answered_from_a_commit_that_is_not_durable(setup: list[tuple[Any, ...]], first: tuple[Any, ...],
                                                               second: tuple[Any, ...]) -> None:
    """Client 0's request commits and waits for the sync; meanwhile client 1 asks something, and
    client 0 retries. Neither may be answered from the commit a crash could still take back."""
    machine = _two_clients(setup)
    try:
        machine.lose_reply_before_durable(0, first)
        machine.act(1, second)
        machine.retry(0)
        machine.restart_meta()
        machine.store_matches_model()
    finally:
        machine.teardown()


@settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
          report_multiple_bugs=False, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(setup=st.lists(OPS, max_size=3), first=OPS, second=OPS)
def test_a_retry_after_a_lease_lapse_is_answered_as_before(setup: list[tuple[Any, ...]], first: tuple[Any, ...],
                                                          second: tuple[Any, ...]) -> None:
    """Client 0's reply is lost, its lease lapses (it is cut off), client 1 changes something, and
    client 0 retries: it gets the answer meta committed, or a loud refusal, never a second run."""
    machine = _two_clients(setup)
    try:
        machine.lose_reply(0, first)
        machine.expire_lease(0)
        machine.act(1, second)
        machine.retry(0)
        machine.store_matches_model()
    finally:
        machine.teardown()


# -- the bugs the machine finds, as plain scenarios ------------------------------------------------


@pytest.fixture
def machine() -> Iterator[MetaModelMachine]:
    m = MetaModelMachine()
    try:
        yield m
    finally:
        m.teardown()


def test_a_retry_after_a_lease_lapse_is_refused_not_run_again(machine: MetaModelMachine) -> None:
    """Once found: meta forgot a lapsed client's saved answers, and the client's retry renamed again
    over another client's new file. Now meta refuses the lapsed id loudly (the client registers
    afresh), and the rename is not run a second time."""
    machine.act(0, ("create", "/a", False, False))
    machine.lose_reply(0, ("rename", "/a", "/b"))
    machine.expire_lease(0)
    machine.act(1, ("create", "/a", False, False))
    machine.retry(0)
    assert machine.last_retry == ("err", "STALE_CLIENT")
    machine.store_matches_model()


def test_an_error_waits_for_the_commit_it_saw_to_be_durable(machine: MetaModelMachine) -> None:
    """Once found: an EEXIST was answered from a mkdir a crash could still take back."""
    machine.act(0, ("mkdir", "/b"))  # the first creation reserves inode ids (a commit of its own)
    machine.lose_reply_before_durable(0, ("mkdir", "/a"))
    machine.act(1, ("mkdir", "/a"))  # EEXIST because of a mkdir a crash may still take back


def test_a_saved_answer_waits_for_durability(machine: MetaModelMachine) -> None:
    """Once found: a retry was answered from its saved answer before that answer was durable."""
    machine.act(0, ("mkdir", "/b"))
    machine.lose_reply_before_durable(0, ("mkdir", "/a"))
    machine.retry(0)


def test_a_renewal_after_the_lease_lapsed_fails(machine: MetaModelMachine) -> None:
    """Once found: a renewal after the lease lapsed was accepted silently."""
    machine.act(0, ("create", "/a", False, False))
    old = machine.identities[0]
    machine.expire_lease(0)
    assert machine._renew(old) == ("err", "STALE_CLIENT")


def test_a_truncate_cancelled_after_its_commit_is_sized_when_meta_finishes_it(machine: MetaModelMachine) -> None:
    """The truncate commits its job and its reply is lost before the sync: the size is not applied
    yet (store and model hold it pending); meta finishes it when it expires the client (closing its
    sessions needs the file's exact length), and that is durable."""
    machine.act(0, ("create", "/a", False, False))
    machine.lose_reply_before_durable(0, ("truncate", "/a", 100))
    machine.store_matches_model()
    assert Tree(machine.visible).pending and Tree(machine.visible).inodes[tag_mode(1)][1] == 0
    machine.expire_lease(0)
    machine.store_matches_model()
    assert not Tree(machine.durable).pending and Tree(machine.durable).inodes[tag_mode(1)][1] == 100
    machine.act(1, ("stat", "/a"))
    machine.retry(0)
    assert machine.last_retry == ("err", "STALE_CLIENT")


def test_a_retried_directory_open_gets_its_saved_answer(machine: MetaModelMachine) -> None:
    """Opening a directory changes nothing, but meta saves its answer like any open's: a retry after
    the directory was removed is answered as the open was, not run again."""
    machine.act(0, ("mkdir", "/a"))
    machine.lose_reply(0, ("open", "/a"))
    machine.act(1, ("rmdir", "/a"))
    machine.retry(0)
    assert machine.last_retry == ("ok", "d", tag_mode(1), 0)
    machine.store_matches_model()


def test_a_lapsed_lease_closes_the_clients_sessions(machine: MetaModelMachine) -> None:
    """What the service already does: meta closes a lapsed client's sessions (an unlinked file it
    held goes), and a later close of such a handle fails loudly instead of succeeding."""
    machine.act(0, ("create", "/a", False, False))
    machine.act(0, ("create", "/b", False, False))
    machine.act(1, ("unlink", "/b"))
    machine.expire_lease(0)
    assert not Tree(machine.visible).sessions
    machine.act(0, ("close", 0, 5000))
    machine.store_matches_model()


# -- the checker rejects sabotaged services --------------------------------------------------------


def _fails(machine: type[RuleBasedStateMachine], examples: int = 100) -> str:
    with pytest.raises(Mismatch) as caught:
        run_state_machine_as_test(machine, settings=_settings(examples, shrink=False))
    return str(caught.value)


def test_it_catches_a_retry_that_runs_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage idempotency (no saved answer is ever found): a retried request runs twice."""
    counter = iter(range(1, 1 << 62))
    monkeypatch.setattr(schema, "idem_key", lambda client_id, request_id: schema.IDEM + client_id
                        + next(counter).to_bytes(8, "big"))
    message = _fails(HandledFaults)
    assert "retry of" in message or "answered" in message


def test_it_catches_an_answer_given_before_durability(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage durability (commits do not wait for the sync): the change is answered too early."""
    original = OptimisticTxnEngine.commit

    async def commit_without_waiting(self: OptimisticTxnEngine, txn: Any) -> None:
        self.sync = False
        try:
            await original(self, txn)
        finally:
            self.sync = True

    monkeypatch.setattr(OptimisticTxnEngine, "commit", commit_without_waiting)
    assert "before it was durable" in _fails(HandledFaults)


def test_it_catches_a_namespace_that_differs_from_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage rename (the source name stays behind): answers and the store leave the model."""
    from fs3.meta.ops import Namespace

    original = Namespace.rename

    async def copy_instead(self: Namespace, source: mpb.PathRef, destination: mpb.PathRef, flags: int) -> mpb.Inode:
        parent, name = await self.resolve_parent(source)
        entry = await self.entry(parent.inode_id, name)
        inode = await original(self, source, destination, flags)
        if entry is not None and entry.type == mpb.FILE:
            self.txn.put(schema.dentry_key(parent.inode_id, name), entry.SerializeToString())
        return inode

    monkeypatch.setattr(Namespace, "rename", copy_instead)
    assert "model" in _fails(HandledFaults)


def test_it_catches_a_lapsed_client_that_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage the fence (meta serves a client id whose lease lapsed): the lapsed client's retry
    runs again once meta has forgotten its answer."""
    async def serve_anyway(txn: Any, client_id: bytes) -> None:
        return None

    monkeypatch.setattr(service_mod, "_refuse_expired", serve_anyway)
    machine = MetaModelMachine()
    try:
        with pytest.raises(Mismatch, match="retry of rename"):
            test_a_retry_after_a_lease_lapse_is_refused_not_run_again(machine)
    finally:
        machine.teardown()

"""The metadata service in the simulator: meta beside mgmtd and storage, several clients, faults.

``python -m fs3.sim --mix meta`` runs it. One meta process serves an in-memory transaction engine
whose durable part is what the last group sync wrote (:class:`SimTxnEngine`: a sync takes a
random while, and a crash keeps only what was synced). Several clients — the real
:class:`~fs3.client.meta_client.MetaClient`, with its retries under one request id and its lease
loop — work on a handful of names at once: ``mkdir``, creating opens (exclusive or truncating),
read opens, closes that publish a length, renames (replacing files and empty directories),
``unlink``, ``rmdir``, ``truncate``, ``stat`` and ``readdir``. Faults: lost messages (requests and
replies alike), meta killed and restarted, clients cut off from meta for up to twice their lease
(new operations wait meanwhile, the ones in flight keep retrying), storage nodes killed.

Every call goes into a history (:class:`fs3.sim.wgl.Call`), which is checked for linearizability
against :class:`fs3.sim.namespace.NamespaceModel`. Two things the server knows make the check
sharper, and both are recorded by the simulator, not by the code under test:

* when the handlers of each request ran (:class:`_HandlerLog`, wrapped around meta's dispatcher):
  a request takes effect only inside one of them, so an unanswered request whose messages were
  all lost is left out, and one that reached meta can act only until its last handler ended;
* when each client id's lease renewals were answered: meta may close a session only at a time
  when no renewal of the id that opened it lies answered within the lease before it, so each
  session gets an optional ``expire`` call over exactly those windows. A session closed at any
  other time is a violation.

A client whose lease lapsed is refused (``StaleClient``) and registers under a new id; a request
refused so is sent again under the new id unless it may have run already. The history records
every id a call was sent under; a close refused so (it is never sent again) is answered as a
stale handle, and any other refusal leaves the outcome unknown. A truncate is recorded while its
request runs and its size applied once storage is cleared, which may come after the request gave
up: each gets a ``resize`` call (:func:`resize_calls`, :mod:`fs3.sim.namespace`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from google.protobuf.message import Message

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3 import mgmtd_pb2 as mgpb
from fs3.client.meta_client import MetaClient
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClientConfig
from fs3.cluster.services import build_meta
from fs3.cluster.topology import META, META_NODE_ID
from fs3.common.buffers import Buffer
from fs3.common.clock import LoopClock
from fs3.common.errors import FS3Error, StaleClient, StatusCode
from fs3.common.posix import O_CREAT, O_EXCL, O_RDONLY, O_TRUNC, O_WRONLY
from fs3.kv.api import prefix_end
from fs3.kv.group_sync import GroupSync
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine, TxnFaults
from fs3.meta import schema
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.auth import Principal
from fs3.rpc.dispatch import Dispatcher, Reply
from fs3.rpc.methods import MethodSpec, method_by_id, service_spec
from fs3.sim.cluster import MGMTD, SimCluster
from fs3.sim.loop import SimProcess
from fs3.sim.namespace import ROOT, NamespaceModel, NsState, tag_mode, tags
from fs3.sim.network import SimChannelFactory
from fs3.sim.wgl import DEFAULT_BUDGET, INF, Call, Verdict, check_calls, shrink

__all__ = ["DIRS", "META", "PATHS", "MetaRun", "MetaShape", "SimMeta", "SimTxnEngine", "answer",
           "check_history", "comparable", "expiry_calls", "lease_windows", "narrow", "request", "resize_calls",
           "run_meta_scenario", "store_namespace"]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
_EPOCH_NS = 1_700_000_000 * 10**9
#: Outcomes that say nothing about whether the request took effect (``StaleClient`` is sorted out
#: in :meth:`MetaRun.perform`).
_UNKNOWN = frozenset({StatusCode.UNAVAILABLE, StatusCode.TIMEOUT, StatusCode.TXN_CONFLICT,
                      StatusCode.MAYBE_COMMITTED, StatusCode.RESOURCE_EXHAUSTED, StatusCode.LEASE_EXPIRED})
TOP_NAMES = ("a", "b", "c")
PATHS = tuple([f"/{n}" for n in TOP_NAMES] + [f"/{n}/x" for n in TOP_NAMES])
DIRS = ("/", *(f"/{n}" for n in TOP_NAMES))
_OPEN_HANDLES_MAX = 2
_CLOCK_SLACK_S = 0.002  # meta keeps leases in whole milliseconds


@dataclass(frozen=True)
class MetaShape:
    """What a meta seed randomises besides the cluster and the faults."""

    client_lease_ms: int = 5_000
    # How long a client retries one request. Longer than the lease, a retry can reach meta after
    # meta expired the client (and forgot its answers); shorter, it never can.
    client_retry_ms: int = 2_500
    client_rpc_timeout_ms: int = 500
    # A group sync takes up to this long: commits are visible before they are durable (0: the sync
    # runs as soon as the event loop gets to it).
    sync_delay_max_ms: float = 0.0
    conflict_probability: float = 0.0
    maybe_committed_probability: float = 0.0
    # The longest a client is cut off from meta, in leases.
    cut_leases_max: float = 2.0
    # How long meta refuses a lapsed client's id (meta's own default, or the least it allows: twice
    # the lease, which caps a client's retries at one lease — shorter than three leases of retries).
    expired_client_ttl_ms: int = 600_000
    # Meta servers on the one store (the database they share). One: a kill loses what the store
    # had not synced, as the embedded engine's process would. Several: they share one engine that
    # outlives any of them, a kill stops one server (its clients go on through the others), and
    # clients spread their requests over the live ones.
    meta_servers: int = 1

    @classmethod
    def random(cls, rng: random.Random, more: random.Random | None = None) -> MetaShape:
        """A shape drawn from ``rng``; ``more`` draws what later versions added, so that ``rng``
        is drawn as before and old seeds keep their schedules."""
        lease = rng.choice((3_000, 5_000))
        shape = cls(client_lease_ms=lease,
                    client_retry_ms=rng.choice((lease // 2, lease * 3)),
                    sync_delay_max_ms=rng.choice((0.0, 5.0, 30.0)),
                    conflict_probability=rng.choice((0.0, 0.05)),
                    maybe_committed_probability=rng.choice((0.0, 0.05)))
        if more is None:
            return shape
        return replace(shape, expired_client_ttl_ms=more.choice((cls.expired_client_ttl_ms, 2 * lease)))

    @classmethod
    def handled(cls) -> MetaShape:
        """The faults the service mostly handles: retries that end within the lease, syncs that end
        at once (a client back from a cut that sends before its renewal lands still meets the lapse:
        seed 33 of this shape)."""
        return cls(client_retry_ms=2_500, sync_delay_max_ms=0.0, conflict_probability=0.05,
                   maybe_committed_probability=0.05)


class SimTxnEngine(OptimisticTxnEngine):
    """The optimistic engine over a :class:`MemKVStore` whose WAL sync takes simulated time.

    A commit is visible from the moment it is applied and durable once a sync that began after
    it has ended; a crash in between (``MemKVStore.crash``) takes it back.
    """

    def __init__(self, store: MemKVStore, rng: random.Random, sync_delay_max_ms: float,
                 faults: TxnFaults | None = None) -> None:
        super().__init__(store, sync=True, faults=faults)
        self.mem = store
        self.delay_rng = rng
        self.sync_delay_max_ms = sync_delay_max_ms
        self.syncing = False  # a sync is under way: what it will make durable is only visible yet

    async def _sync_wal(self) -> None:
        if self.sync_delay_max_ms > 0:
            self.syncing = True
            try:
                await asyncio.sleep(self.delay_rng.uniform(0, self.sync_delay_max_ms) / 1000)
            finally:
                self.syncing = False
        self.mem.sync_wal()


class _HandlerLog:
    """Meta's dispatcher, noting when each request's handlers ran (keyed by client and request id)."""

    def __init__(self, inner: Dispatcher, windows: dict[tuple[bytes, int], list[list[float]]]) -> None:
        self.inner = inner
        self.windows = windows

    async def dispatch(self, method_id: int, message: Buffer, payload: Buffer, principal: Principal | None) -> Reply:
        key = None
        method = method_by_id(method_id)
        if method is not None and "ctx" in method.request_type.DESCRIPTOR.fields_by_name:
            try:
                ctx = method.request_type.FromString(bytes(message)).ctx  # type: ignore[attr-defined]
                key = (bytes(ctx.client_id), int(ctx.request_id))
            except Exception:  # undecodable: the dispatcher answers it
                key = None
        loop = asyncio.get_running_loop()
        window = [loop.time(), INF]
        if key is not None:
            self.windows.setdefault(key, []).append(window)
        try:
            return await self.inner.dispatch(method_id, message, payload, principal)
        finally:
            window[1] = loop.time()


class _DbGroupSync(GroupSync):
    """The group sync of an engine several meta servers share: its task belongs to the database's
    process, so that killing the server whose commit started a sync leaves it running for the
    others' commits."""

    def __init__(self, sync: Callable[[], Awaitable[object]], process: SimProcess) -> None:
        super().__init__(sync)
        self.process = process

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = self.process.run(self._run())
            self._task.add_done_callback(lambda task: task.cancelled() or task.exception())


class SimMeta:
    """The meta servers of a simulated cluster: started, killed (one server losing what was not
    synced, or one of several sharing the store), restarted."""

    def __init__(self, cluster: SimCluster, shape: MetaShape, chains: int) -> None:
        self.cluster = cluster
        self.shape = shape
        self.kv = MemKVStore()
        self.windows: dict[tuple[bytes, int], list[list[float]]] = {}
        self.processes: dict[int, SimProcess] = {}
        self.services: dict[int, MetaService] = {}
        self.engine: SimTxnEngine | None = None
        self.db = SimProcess("meta-db")
        self.incarnation = 0
        self.chains = chains
        seed = cluster.seed
        self.sync_rng = random.Random(seed ^ 0x5_1DE)
        self.txn_rng = random.Random(seed ^ 0x7_7A7)
        self.pick_rng = random.Random(seed ^ 0x3_A11)

    @property
    def shared(self) -> bool:
        return self.shape.meta_servers > 1

    @staticmethod
    def address(index: int) -> str:
        return META if index == 0 else f"{META}-{index + 1}"

    @property
    def addresses(self) -> list[str]:
        return [self.address(i) for i in range(self.shape.meta_servers)]

    @property
    def alive(self) -> bool:
        """Whether every meta server runs."""
        return len(self.processes) == self.shape.meta_servers

    @property
    def process(self) -> SimProcess | None:
        return self.processes.get(0)

    @property
    def service(self) -> MetaService | None:
        return self.services.get(0)

    def config(self) -> MetaServiceConfig:
        lease = self.shape.client_lease_ms
        return MetaServiceConfig(chain_table_id=self.cluster.topology.chain_table_id,
                                 chunk_size_bytes=self.cluster.shape.chunk_size,
                                 stripe_default=self.chains, root_mode=0o777, client_lease_ms=lease,
                                 expired_client_ttl_ms=self.shape.expired_client_ttl_ms,
                                 prune_interval_ms=max(200, lease // 5), gc_interval_ms=500)

    def _engine(self) -> SimTxnEngine:
        faults = TxnFaults(conflict_probability=self.shape.conflict_probability,
                           maybe_committed_probability=self.shape.maybe_committed_probability, rng=self.txn_rng)
        engine = SimTxnEngine(self.kv, self.sync_rng, self.shape.sync_delay_max_ms, faults)
        if self.shared:
            engine._log = _DbGroupSync(engine._sync_wal, self.db)
        return engine

    def start(self, index: int | None = None) -> None:
        """Start server ``index`` (None: every one that is down)."""
        if index is None:
            for i in range(self.shape.meta_servers):
                if i not in self.processes:
                    self.start(i)
            return
        self.incarnation += 1
        name = self.address(index)
        process = SimProcess(name)
        network = self.cluster.network
        if self.engine is None or not self.shared:
            self.engine = self._engine()
        engine = self.engine
        channels = SimChannelFactory(network, name)
        loop = asyncio.get_running_loop()
        parts = build_meta(engine, channels, MGMTD, f"meta-{self.incarnation}".encode(), self.config(),
                           StorageClientConfig(rpc_timeout_ms=1_000, retry_total_ms=3_000, retry_backoff_ms=10,
                                               retry_backoff_max_ms=200, channels_max=4),
                           routing_timeout_ms=500, wall_ns=lambda: _EPOCH_NS + int(loop.time() * 1e9),
                           pick=lambda n: self.pick_rng.randrange(n),
                           server_id=name.encode())
        routing, service, dispatcher = parts.routing, parts.service, parts.dispatcher
        incarnation = self.incarnation

        async def boot() -> None:
            # Serve once the chain tables are known: a create needs them.
            while True:
                try:
                    info = await routing.refresh()
                    if any(t.table_id == self.cluster.topology.chain_table_id and t.chain_ids
                           for t in info.chain_tables):
                        break
                except FS3Error:
                    pass
                await asyncio.sleep(0.05)
            await service.start()
            network.bind(name, process, _HandlerLog(dispatcher, self.windows))  # type: ignore[arg-type]
            heartbeat = service_spec("Mgmtd").method("Heartbeat")
            req = mgpb.HeartbeatReq(node_id=META_NODE_ID + index, node_type=cpb.NODE_META, framed_address=name,
                                    grpc_address=name, hostname=name, pid=incarnation)
            while True:
                with contextlib.suppress(FS3Error):
                    await channels.get(MGMTD).call(heartbeat, req, timeout_ms=500)
                await asyncio.sleep(0.2)

        process.run(boot())
        self.processes[index] = process
        self.services[index] = service

    def kill(self, index: int = 0) -> None:
        """Kill server ``index``. The only server takes the store's unsynced part with it; one of
        several leaves the shared store (and its group sync) running."""
        self.processes.pop(index).kill()
        self.services.pop(index)
        if not self.shared:
            self.kv.crash()
            self.engine = None
        self.cluster.network.unbind(self.address(index))

    async def wait_syncing(self, limit_s: float) -> bool:
        """Wait (up to ``limit_s``) until a group sync is under way: commits visible, not yet durable."""
        loop = asyncio.get_running_loop()
        end = loop.time() + limit_s
        while loop.time() < end:
            if self.engine is not None and self.engine.syncing:
                return True
            await asyncio.sleep(0.002)
        return False


class _Client(MetaClient):
    """A :class:`MetaClient` that tells the simulator its request ids, its lease renewals and
    whether a refused request may have run; a client whose lease lapsed takes a new id that the
    seed decides (the real client draws a random one), so that a run replays exactly."""

    def __init__(self, index: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.index = index
        self.last_request_id = 0
        # (client id, invoke, complete, answered): renewals of each id this client has used.
        self.renewals: list[tuple[bytes, float, float, bool]] = []
        # The (client id, request id) pairs each perform's task sent, and whether its last
        # request may have run before a refusal (see :meth:`MetaClient.call`).
        self.sent: dict[asyncio.Task[Any], list[tuple[bytes, int]]] = {}
        self.outcome_unknown: dict[asyncio.Task[Any], bool] = {}

    def ctx(self, user: mpb.User | None = None) -> tuple[mpb.ReqCtx, int]:
        ctx, request_id = super().ctx(user)
        self.last_request_id = request_id
        task = asyncio.current_task()
        if task is not None and task in self.sent:
            self.sent[task].append((bytes(ctx.client_id), request_id))
        return ctx, request_id

    async def _attempts(self, name: str, method: MethodSpec, req: Message, rsp_type: type[M],
                        outcome_unknown: list[bool]) -> M:
        try:
            return await super()._attempts(name, method, req, rsp_type, outcome_unknown)
        finally:
            task = asyncio.current_task()
            if task is not None and task in self.outcome_unknown:
                self.outcome_unknown[task] = outcome_unknown[0]

    async def _renew_once(self) -> None:
        loop = asyncio.get_running_loop()
        client_id, start = self.client_id, loop.time()
        try:
            await super()._renew_once()
        except FS3Error:
            self.renewals.append((client_id, start, loop.time(), False))
            raise
        self.renewals.append((client_id, start, loop.time(), True))

    def _lapsed(self, client_id: bytes) -> None:
        registrations = self.registrations
        super()._lapsed(client_id)
        if self.registrations != registrations:
            self.client_id = f"mc{self.index:02d}r{self.registrations}".encode().ljust(len(client_id), b".")


@dataclass
class _Handle:
    label: int
    inode_id: int
    session_id: bytes


@dataclass
class MetaRun:
    """One meta scenario: its clients, history and fault state."""

    cluster: SimCluster
    shape: MetaShape
    meta: SimMeta
    calls: list[Call] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    clients: list[_Client] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    connected: list[asyncio.Event] = field(default_factory=list)
    handles: list[list[_Handle]] = field(default_factory=list)
    # call index -> every (client id, request id) it was sent under (a refused request is sent again
    # under the client's new id)
    requests: dict[int, list[tuple[bytes, int]]] = field(default_factory=dict)
    busy: list[bool] = field(default_factory=list)  # a client has a request in flight
    next_tag: int = 0

    def tag(self) -> int:
        self.next_tag += 1
        if self.next_tag not in tags():
            raise ValueError("too many creates for the tags one run has: fewer clients or operations")
        return tag_mode(self.next_tag)

    def add_client(self, index: int, retry_ms: int | None = None) -> _Client:
        name = f"mclient-{index}"
        channels = SimChannelFactory(self.cluster.network, name)
        routing = RoutingCache([MGMTD], channels, rpc_timeout_ms=500)
        client = _Client(index, routing, channels, f"mc{index:02d}".encode().ljust(16, b"."),
                         lambda: mpb.User(uid=0, gid=0),
                         rpc_timeout_ms=self.shape.client_rpc_timeout_ms,
                         retry_total_ms=self.shape.client_retry_ms if retry_ms is None else retry_ms,
                         clock=LoopClock())
        self.clients.append(client)
        self.addresses.append(name)
        event = asyncio.Event()
        event.set()
        self.connected.append(event)
        self.handles.append([])
        self.busy.append(False)
        return client

    async def perform(self, index: int, kind: str, args: tuple[Any, ...], method: str, req: Message,
                      rsp_type: type[Message]) -> tuple[Call, Any]:
        """Send one request and note the call: its answer, its error, or that its outcome is unknown.

        Returns the call and the response (None without one)."""
        client = self.clients[index]
        loop = asyncio.get_running_loop()
        call = Call(kind, args, loop.time(), client=index, index=len(self.calls))
        self.calls.append(call)
        rsp = None
        self.busy[index] = True
        task = asyncio.current_task()
        assert task is not None
        client.sent[task], client.outcome_unknown[task] = [], False
        try:
            rsp = await client.call(method, req, rsp_type)
            call.result = answer(kind, rsp)
            call.complete = loop.time()
        except StaleClient:
            # Refused as from a lapsed lease. A request on a session is never sent again under a
            # new id: refused without an earlier attempt that may have run, it did not run, and its
            # session is gone with the lease. Anything else may have run (or was refused every
            # time it was sent): its outcome is unknown.
            if kind == "close" and not client.outcome_unknown[task]:
                call.result = ("err", StatusCode.STALE_CLIENT.name)
                call.complete = loop.time()
        except FS3Error as exc:
            if exc.code not in _UNKNOWN:
                call.result = ("err", exc.code.name)
                call.complete = loop.time()
        finally:
            self.busy[index] = False
            sent = client.sent.pop(task)
            client.outcome_unknown.pop(task)
        call.note = "request " + ", ".join(f"{c.rstrip(b'.').decode()}/{r}" for c, r in sent)
        self.requests[call.index] = sent
        return call, rsp


def answer(kind: str, rsp: Any) -> tuple[Any, ...]:
    """A call's answer in the model's terms (see :mod:`fs3.sim.namespace`), from meta's response."""
    if kind == "mkdir":
        return ("ok", _tag(rsp.inode))
    if kind == "create":
        return ("ok", bool(rsp.created), _tag(rsp.inode), int(rsp.inode.size))
    if kind in ("open", "stat"):
        size = int(rsp.inode.size) if rsp.inode.type == mpb.FILE else 0
        return ("ok", _kind(rsp.inode), _tag(rsp.inode), size)
    if kind == "close":
        return ("ok", int(rsp.inode.size))
    if kind == "rename":
        return ("ok", _tag(rsp.inode))
    if kind == "readdir":
        return ("ok", tuple(sorted((e.name.decode(), _tag(e.attrs)) for e in rsp.entries)))
    return ("ok",)


def store_namespace(store: MemKVStore) -> NsState:
    """What meta's store holds, in the model's terms: entries, inodes and sessions by tag.

    Sessions are labelled by their session id and carry the client id; reads the store directly,
    committed or not yet durable alike.
    """
    inodes: dict[int, mpb.Inode] = {}
    for key, raw in store.scan(schema.inode_prefix(), prefix_end(schema.inode_prefix())):
        inodes[schema.parse_inode_key(key)] = mpb.Inode.FromString(raw)

    def tag_of(inode_id: int) -> int:
        if inode_id == schema.ROOT_INODE:
            return ROOT
        found = inodes.get(inode_id)
        return _tag(found) if found is not None else -inode_id  # an entry naming no inode: never a tag

    entries = []
    for key, raw in store.scan(schema.dentry_prefix(), prefix_end(schema.dentry_prefix())):
        parent, name = schema.parse_dentry_key(key)
        entries.append((tag_of(parent), name.decode(), tag_of(mpb.DirEntry.FromString(raw).inode_id)))
    nodes = [(ROOT, "d", 0, True)]
    for inode_id, inode in inodes.items():
        if inode_id != schema.ROOT_INODE:
            size = int(inode.size) if inode.type == mpb.FILE else 0
            nodes.append((_tag(inode), _kind(inode), size, inode.type == mpb.DIRECTORY or inode.nlink > 0))
    size_gens = {inode_id: schema.decode_u64(store.get(schema.size_gen_key(inode_id))) for inode_id in inodes}
    pending = {inode_id for inode_id in inodes if store.get(schema.truncate_key(inode_id)) is not None}
    sessions = []
    prefix = schema.sessions_prefix()
    for key, raw in store.scan(prefix, prefix_end(prefix)):
        inode_id = int.from_bytes(key[len(prefix):len(prefix) + 8], "big")
        session = schema.Session.decode(raw)
        # Truncated since it opened: a truncate came after (a newer size generation) or is unfinished.
        truncated = session.size_gen != size_gens.get(inode_id, 0) or inode_id in pending
        sessions.append((key[len(prefix) + 8:], tag_of(inode_id), session.client_id, session.write, truncated))
    # Truncates recorded, their size not yet applied, labelled by inode id (the store does not know
    # the calls that made them).
    truncating = []
    for inode_id in sorted(inodes):
        job_raw = store.get(schema.truncate_key(inode_id))
        job = schema.TruncateJob.decode(job_raw) if job_raw is not None else None
        if job is not None and job.size is not None:
            truncating.append((inode_id, tag_of(inode_id), job.size))
    return (tuple(sorted(entries)), tuple(sorted(nodes)), tuple(sorted(sessions, key=repr)), tuple(truncating))


def comparable(state: NsState) -> tuple[Any, ...]:
    """The parts of a state a client can observe: entries, inodes, each session's file and mode, and
    the sizes of the truncates not yet applied to files that still exist."""
    entries, inodes, sessions, pending = state
    live = {tag for tag, *_ in inodes}
    return (entries, inodes, tuple(sorted(((label, tag, writes) for label, tag, _, writes, _ in sessions), key=repr)),
            tuple(sorted((tag, size) for _, tag, size in pending if tag in live)))


def _kind(inode: mpb.Inode) -> str:
    return "d" if inode.type == mpb.DIRECTORY else "f"


def _tag(inode: mpb.Inode) -> int:
    return int(inode.mode) & 0o7777


async def _client_loop(run: MetaRun, index: int, rng: random.Random, ops: int) -> None:
    chunk = run.cluster.shape.chunk_size
    for _ in range(ops):
        await run.connected[index].wait()
        await _one_op(run, index, rng, chunk)
        await asyncio.sleep(rng.uniform(0, 0.2))


def request(kind: str, args: tuple[Any, ...], inode_id: int = 0, session_id: bytes = b"") -> tuple[str, Message,
                                                                                             type[Message]]:
    """The Meta method, request and response type of a model call (a close names its handle)."""
    path = args[0] if args and isinstance(args[0], str) else ""
    target = mpb.PathRef(path=path.encode())
    if kind == "mkdir":
        return "MakeNode", mpb.MakeNodeReq(target=target, type=mpb.DIRECTORY, mode=args[1]), mpb.InodeRsp
    if kind == "create":
        tag, excl, trunc = args[1:4]
        flags = O_CREAT | O_WRONLY | (O_EXCL if excl else 0) | (O_TRUNC if trunc else 0)
        return "Open", mpb.OpenReq(target=target, flags=flags, mode=tag), mpb.OpenRsp
    if kind == "open":
        return "Open", mpb.OpenReq(target=target, flags=O_RDONLY), mpb.OpenRsp
    if kind == "close":
        length = args[1]
        return "Close", mpb.CloseReq(inode_id=inode_id, session_id=session_id, length_hint=length, wrote=length > 0,
                                     acked=True), mpb.InodeRsp
    if kind == "rename":
        return "Rename", mpb.RenameReq(source=target, destination=mpb.PathRef(path=args[1].encode())), mpb.RenameRsp
    if kind in ("unlink", "rmdir"):
        return "Remove", mpb.RemoveReq(target=target, directory=kind == "rmdir"), mpb.RemoveRsp
    if kind == "truncate":
        return "SetAttr", mpb.SetAttrReq(target=target, follow=True, mask=mpb.SET_SIZE, size=args[1]), mpb.InodeRsp
    if kind == "stat":
        return "Lookup", mpb.LookupReq(target=target, follow=True), mpb.InodeRsp
    if kind == "readdir":
        return "ReadDir", mpb.ReadDirReq(dir=target, limit=1000, with_attrs=True), mpb.ReadDirRsp
    raise ValueError(f"no request for {kind!r}")


async def _issue(run: MetaRun, index: int, kind: str, args: tuple[Any, ...], handle: _Handle | None = None) -> Call:
    method, req, rsp_type = request(kind, args, *((handle.inode_id, handle.session_id) if handle else ()))
    call, rsp = await run.perform(index, kind, args, method, req, rsp_type)
    if kind in ("create", "open") and rsp is not None and rsp.session_id:
        run.handles[index].append(_Handle(_session_label(call), rsp.inode.inode_id, bytes(rsp.session_id)))
    return call


async def _one_op(run: MetaRun, index: int, rng: random.Random, chunk: int) -> None:
    handles = run.handles[index]
    roll = rng.random()
    path = rng.choice(PATHS)
    if roll < 0.30 and len(handles) >= _OPEN_HANDLES_MAX:
        roll = 0.35  # close one first
    if roll < 0.12:
        await _issue(run, index, "mkdir", (path, run.tag()))
    elif roll < 0.30:
        await _issue(run, index, "create", (path, run.tag(), rng.random() < 0.25, rng.random() < 0.25,
                                            len(run.calls), True))
    elif roll < 0.45:
        if not handles:
            await _issue(run, index, "stat", (path,))
            return
        handle = handles.pop(rng.randrange(len(handles)))
        length = rng.randint(1, 3 * chunk) if rng.random() < 0.7 else 0
        await _issue(run, index, "close", (handle.label, length), handle)
    elif roll < 0.50:
        await _issue(run, index, "open", (path, len(run.calls)))
    elif roll < 0.64:
        await _issue(run, index, "rename", (path, rng.choice(PATHS)))
    elif roll < 0.71:
        await _issue(run, index, "unlink", (path,))
    elif roll < 0.76:
        await _issue(run, index, "rmdir", (path,))
    elif roll < 0.83:
        await _issue(run, index, "truncate", (path, rng.randint(0, 3 * chunk), len(run.calls)))
    elif roll < 0.93:
        await _issue(run, index, "stat", (path,))
    else:
        await _issue(run, index, "readdir", (rng.choice(DIRS),))


async def _faults(run: MetaRun, rng: random.Random, intensity: float) -> None:
    cluster = run.cluster
    loop = asyncio.get_running_loop()
    cuts: list[asyncio.Task[None]] = []
    tolerance = cluster.shape.replicas - 1
    try:
        while True:
            await asyncio.sleep(rng.uniform(0.3, 2.0) / max(intensity, 0.01))
            roll = rng.random()
            now = loop.time()
            if roll < 0.25 and run.meta.shared:
                # One of several servers dies mid-workload; a new one takes its place a while later.
                index = rng.randrange(run.meta.shape.meta_servers)
                if index in run.meta.processes:
                    mid_sync = rng.random() < 0.5 and await run.meta.wait_syncing(2.0)
                    run.meta.kill(index)
                    run.faults.append(f"t={loop.time():.4f} kill {run.meta.address(index)}"
                                      + (" during a sync" if mid_sync else ""))
                    await asyncio.sleep(rng.uniform(0.05, 1.0))
                run.meta.start(index)
                run.faults.append(f"t={loop.time():.4f} restart {run.meta.address(index)}")
            elif roll < 0.25:
                if run.meta.alive:
                    # Half the time while a group sync is under way: commits visible, not durable.
                    mid_sync = rng.random() < 0.5 and await run.meta.wait_syncing(2.0)
                    run.meta.kill()
                    run.faults.append(f"t={loop.time():.4f} kill meta{' during a sync' if mid_sync else ''}")
                    await asyncio.sleep(rng.uniform(0.05, 1.0))
                run.meta.start()
                run.faults.append(f"t={loop.time():.4f} restart meta")
            elif roll < 0.45:
                cluster.network.faults.drop_probability = rng.choice((0.0, 0.01, 0.05, 0.1))
                run.faults.append(f"t={now:.2f} drop probability {cluster.network.faults.drop_probability}")
            elif roll < 0.65:
                free = [i for i, event in enumerate(run.connected) if event.is_set()]
                if free:
                    index = rng.choice(free)
                    seconds = rng.uniform(0.1, run.shape.cut_leases_max) * run.shape.client_lease_ms / 1000
                    # Half the time while the client has a request in flight: its reply is lost.
                    in_flight = rng.random() < 0.5
                    delay_ms = rng.uniform(0, cluster.shape.latency_max_ms * 2)
                    cuts.append(asyncio.create_task(_cut(run, index, seconds, in_flight, delay_ms)))
            elif roll < 0.8:
                down = [n for n in cluster.storage if not cluster.storage_alive(n)]
                if down:
                    node = rng.choice(down)
                    cluster.start_storage(node)
                    run.faults.append(f"t={now:.2f} restart storage-{node}")
                elif cluster.mgmtd is not None and len(cluster.unhealthy_nodes()) < tolerance:
                    node = rng.choice(list(cluster.storage))
                    cluster.kill_storage(node)
                    run.faults.append(f"t={now:.2f} kill storage-{node}")
    finally:
        for task in cuts:
            task.cancel()
        await asyncio.gather(*cuts, return_exceptions=True)


async def _cut(run: MetaRun, index: int, seconds: float, in_flight: bool, delay_ms: float) -> None:
    """Client ``index`` cannot reach meta for ``seconds``; it starts nothing new meanwhile.

    ``in_flight``: the cut waits for the client's next request and comes ``delay_ms`` after it."""
    loop = asyncio.get_running_loop()
    pairs = [frozenset((run.addresses[index], meta)) for meta in run.meta.addresses]
    if in_flight:
        for _ in range(1_000):
            if run.busy[index]:
                break
            await asyncio.sleep(0.002)
        await asyncio.sleep(delay_ms / 1000)
    run.connected[index].clear()
    run.cluster.network.faults.partitioned.update(pairs)
    run.faults.append(f"t={loop.time():.4f} cut client {index} off meta for {seconds:.1f}s"
                      + (" (a request in flight)" if in_flight and run.busy[index] else ""))
    try:
        await asyncio.sleep(seconds)
    finally:
        run.cluster.network.faults.partitioned.difference_update(pairs)
        run.connected[index].set()
        run.faults.append(f"t={loop.time():.4f} client {index} reaches meta again")


# -- checking ------------------------------------------------------------------------------------


def lease_windows(renewals: list[tuple[float, float, bool]], lease_s: float) -> list[tuple[float, float]]:
    """When meta may have found a client's lease expired, from the renewals the client saw.

    A renewal answered at ``c`` and sent at ``i`` reached meta within ``[i, c]``, so meta cannot
    have found the lease expired during ``[c, i + lease]``; before the first renewal was sent there
    was no lease to expire. Everything else is a window (the last one open-ended).
    """
    if not renewals:
        return []
    start = min(i for i, _, _ in renewals) + lease_s - _CLOCK_SLACK_S
    blocked = sorted((c, i + lease_s - _CLOCK_SLACK_S) for i, c, ok in renewals if ok and i + lease_s > c)
    windows: list[tuple[float, float]] = []
    cursor = start
    for lo, hi in blocked:
        if hi <= cursor:
            continue
        if lo > cursor:
            windows.append((cursor, lo))
        cursor = max(cursor, hi)
    windows.append((cursor, INF))
    return windows


def expiry_calls(calls: list[Call], windows: dict[Hashable, list[tuple[float, float]]], first_index: int = 0,
                 owners: Callable[[Call], Iterable[Hashable]] | None = None) -> list[Call]:
    """An optional ``expire`` call for every session in every window in which meta may have closed it
    (numbered from ``first_index`` on).

    ``windows`` are keyed by lease holder; ``owners(call)`` names the holders an open may have
    made its session under (by default its client; the simulator's clients take a new id when
    their lease lapses, and an open refused under the old id is sent again under the new one).
    """
    owners = owners or (lambda call: (call.client,))
    closes = {c.args[0]: c for c in calls if c.kind == "close" and c.completed}
    extra: list[Call] = []
    for opened in calls:
        if opened.kind not in ("create", "open") or (
                opened.completed and isinstance(opened.result, tuple) and opened.result[0] != "ok"):
            continue
        label = _session_label(opened)
        closed = closes.get(label)
        for lo, hi in _merged([span for owner in owners(opened) for span in windows.get(owner, [])]):
            if hi <= opened.invoke or (closed is not None and closed.complete <= lo):
                continue
            extra.append(Call("expire", (label,), max(lo, opened.invoke), deadline=hi, client=opened.client,
                              index=first_index + len(extra), note="lease lapsed"))
    return extra


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _session_label(call: Call) -> Any:
    """The label of the session an ``open`` or ``create`` call makes."""
    return call.args[4] if call.kind == "create" else call.args[1]


def resize_calls(calls: list[Call], first_index: int = 0) -> list[Call]:
    """A ``resize`` call for every truncate that records its size as pending (numbered from
    ``first_index`` on): meta applies the size once storage is cleared.

    An answered truncate applied it before it answered; an unanswered one may have had it applied
    at any later time — by a later request on the file or by meta's maintenance — or never.
    """
    extra: list[Call] = []
    for call in calls:
        if call.kind == "truncate" and len(call.args) > 2:
            label = call.args[2]
        elif call.kind == "create" and call.args[3] and len(call.args) > 5 and call.args[5]:
            label = call.args[4]
        else:
            continue
        note = f"size of #{call.index} applied"
        if not call.completed:
            extra.append(Call("resize", (label,), call.invoke, client=call.client, index=first_index + len(extra),
                              note=note))
        elif isinstance(call.result, tuple) and call.result[0] == "ok" and not (call.kind == "create"
                                                                                and call.result[1]):
            extra.append(Call("resize", (label,), call.invoke, call.complete, ("ok",), client=call.client,
                              index=first_index + len(extra), note=note))
    return extra


def narrow(calls: list[Call], requests: dict[int, list[tuple[bytes, int]]],
           windows: dict[tuple[bytes, int], list[list[float]]]) -> list[Call]:
    """Each call confined to the time its requests' handlers ran (see the module docstring)."""
    out: list[Call] = []
    for call in calls:
        runs = [r for key in requests.get(call.index, []) for r in windows.get(key, [])]
        if not runs:
            if call.completed:
                out.append(call)
            continue  # never reached meta: it cannot have taken effect
        start = max(call.invoke, min(r[0] for r in runs))
        end = max(r[1] for r in runs)
        if call.completed:
            out.append(replace(call, invoke=min(start, call.complete), complete=min(call.complete, max(end, start))))
        else:
            out.append(replace(call, invoke=start, deadline=end))
    return out


def check_history(calls: list[Call], budget: int = DEFAULT_BUDGET) -> tuple[Verdict[Any], list[str]]:
    """The verdict on a namespace history, and the lines that explain a failure (with a shrunk history)."""
    model = NamespaceModel()
    for i, call in enumerate(calls):
        call.index = i if call.index < 0 else call.index
    verdict = check_calls(calls, model, budget)
    if verdict.status == "ok":
        return verdict, []
    lines = list(verdict.problems)
    if verdict.status == "violation":
        small = shrink(calls, model)
        answered = sum(1 for c in small if c.completed)
        lines.append(f"  a smaller history that still fails ({answered} answered calls, "
                     f"{len(small) - answered} unanswered):")
        lines.extend(f"    {c.describe()}" for c in small[:40])
        if len(small) > 40:
            lines.append(f"    ... and {len(small) - 40} more")
    return verdict, ["\n".join(lines) if verdict.status == "violation" else f"inconclusive: {lines[0]}"]


# -- the scenario --------------------------------------------------------------------------------


async def _wait_meta_registered(cluster: SimCluster, node_id: int = META_NODE_ID) -> None:
    for _ in range(2_000):
        if cluster.mgmtd is not None and node_id in cluster.mgmtd.state.nodes:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("meta never registered with mgmtd")


async def _final_reads(run: MetaRun) -> None:
    """Pin the end state down: list every directory and look every name up, until answered."""
    index = len(run.clients)
    run.add_client(index, retry_ms=120_000)
    for path in DIRS:
        call = await _issue(run, index, "readdir", (path,))
        if not call.completed:
            raise AssertionError(f"the final readdir of {path} was never answered")
    for path in PATHS:
        call = await _issue(run, index, "stat", (path,))
        if not call.completed:
            raise AssertionError(f"the final stat of {path} was never answered")


async def run_meta_scenario(cluster: SimCluster, shape: MetaShape, clients: int, ops_per_client: int,
                            fault_intensity: float, driver: SimProcess,
                            budget: int = DEFAULT_BUDGET) -> tuple[MetaRun, list[str]]:
    """Boot the cluster and meta, run the clients and faults, heal, read the end state, check.

    Returns the run and its violations (empty: linearizable).
    """
    rng = cluster.rng
    chains = await cluster.boot()
    meta = SimMeta(cluster, shape, len(chains))
    run = MetaRun(cluster, shape, meta)
    meta.start()
    await asyncio.gather(*(_wait_meta_registered(cluster, META_NODE_ID + i) for i in range(shape.meta_servers)))
    seeds = [rng.random() for _ in range(clients)]
    fault_seed = rng.random()
    for index in range(clients):
        run.add_client(index).start_lease()
    loops = [driver.run(_client_loop(run, i, random.Random(seeds[i]), ops_per_client)) for i in range(clients)]
    fault_task = driver.run(_faults(run, random.Random(fault_seed), fault_intensity)) if fault_intensity > 0 else None
    await asyncio.gather(*loops)
    if fault_task is not None:
        fault_task.cancel()
        await asyncio.gather(fault_task, return_exceptions=True)
    cluster.network.faults.drop_probability = 0.0
    cluster.network.heal()
    if not meta.alive:
        meta.start()
        run.faults.append(f"t={asyncio.get_running_loop().time():.2f} restart meta")
    if meta.shared:
        await asyncio.gather(*(_wait_meta_registered(cluster, META_NODE_ID + i)
                               for i in range(shape.meta_servers)))
    for node in cluster.storage:
        if not cluster.storage_alive(node):
            cluster.start_storage(node)
    await _final_reads(run)
    for client in run.clients:
        await client.stop()
    lease_s = shape.client_lease_ms / 1000
    renewals: dict[bytes, list[tuple[float, float, bool]]] = {}
    holder: dict[bytes, int] = {}
    for index, client in enumerate(run.clients[:clients]):
        for client_id, invoke, complete, ok in client.renewals:
            renewals.setdefault(client_id, []).append((invoke, complete, ok))
            holder[client_id] = index
    windows: dict[Hashable, list[tuple[float, float]]] = {}
    end = max((c.complete if c.completed else c.invoke for c in run.calls), default=0.0)
    for client_id, spans in renewals.items():
        windows[client_id] = lease_windows(spans, lease_s)
        name = f"client {holder[client_id]} ({client_id.rstrip(b'.').decode()})"
        run.faults.extend(f"t={lo:.4f} {name}'s lease may lapse (until {hi:.4f})"
                          for lo, hi in windows[client_id] if lo < end)
    calls = narrow(run.calls, run.requests, meta.windows)
    expiries = expiry_calls(calls, windows, first_index=len(run.calls),
                            owners=lambda call: {c for c, _ in run.requests.get(call.index, [])})
    calls += resize_calls(calls, first_index=len(run.calls) + len(expiries)) + expiries
    _, problems = check_history(calls, budget)
    return run, problems

"""The metadata service: runs namespace operations as idempotent transactions, then their side effects.

:class:`MetaService` is the shell around :class:`~fs3.meta.ops.Namespace`. For each request it
fixes the inputs (time, caller, chain tables, a fresh inode id), runs the operation in a
transaction through :func:`~fs3.kv.txn.run_transaction`, and only after commit touches storage.

Idempotency: a mutating request carries ``(client_id, request_id)``. Its transaction first looks
for an answer committed under that pair and returns it; otherwise it runs the operation and
commits the answer with it, atomically. So a retry after an ambiguous commit — the engine's
"maybe committed", or a reply lost with a crashed meta server — returns the original answer.
Records are dropped once the client reports the request complete (its lease renewal carries the
lowest request id still in flight) or when its lease expires; from then on meta refuses that
client id (:class:`~fs3.common.errors.StaleClient`) for longer than any client retries, so a retry
whose answer is gone is refused instead of run a second time.

The service is one object in three parts. This module holds the handlers, one thin shell per
RPC, and the request plumbing; :mod:`fs3.meta.lengths` probes storage for a file's end and
applies a writer's length (``close`` and ``fsync`` of a written file, so the length is exact even
for writers that never sent a hint); :mod:`fs3.meta.jobs` carries out the side effects that
durable records drive — truncate jobs, GC of deleted files' chunks, the expiry of clients that
stopped renewing their lease — and lists chunks for fsck. :class:`~fs3.meta.host.MetaHost` names
what the parts take from one another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import Message

from fs3 import meta_pb2 as mpb
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient
from fs3.common.buffers import Buffer
from fs3.common.capability import Access, Capability, access_for_flags, decode, parse_access, sign
from fs3.common.clock import Clock, LoopClock
from fs3.common.errors import (
    BadHandle,
    FS3Error,
    Internal,
    InvalidArgument,
    NotPermitted,
    PermissionDenied,
    StaleClient,
    Unavailable,
)
from fs3.common.faults import CrashPoint, sabotaged
from fs3.common.layout import DEFAULT_CHUNK_SIZE_BYTES, validate_dir_layout
from fs3.common.metrics import ServiceMetrics
from fs3.common.posix import O_ACCMODE, O_APPEND, O_CREAT, O_EXCL, O_RDWR, O_TRUNC, O_WRONLY, R_OK, W_OK, Caller
from fs3.kv.api import Transaction, TxnEngine
from fs3.kv.formats import end_transaction
from fs3.kv.txn import run_transaction
from fs3.meta import quota, schema, trash
from fs3.meta.claims import ClaimTable, Held, inode_claim
from fs3.meta.formats import open_meta_format
from fs3.meta.fsck import run_fsck
from fs3.meta.hints import PATH_HINTS_MAX_DEFAULT, PathHints
from fs3.meta.jobs import MetaJobs
from fs3.meta.lengths import FileLengths
from fs3.meta.limits import ANCESTRY_ATTEMPTS, BATCH_STAT_MAX, CHUNK_PAGE_MAX, CLOSE_SESSIONS_MAX, TRUNCATE_ATTEMPTS
from fs3.meta.ops import (
    ANCESTOR_WALK_MAX,
    Ancestry,
    AncestryUnknown,
    LengthReport,
    Namespace,
    OpEnv,
    TruncatePending,
    TruncateUnclaimed,
    removal_scans,
)
from fs3.meta.quota_service import QuotaHandlers
from fs3.meta.registration import NodeRegistration
from fs3.rpc.auth import Authenticator, Role, current_principal

__all__ = ["MetaService", "MetaServiceConfig"]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
T = TypeVar("T")
_EMPTY = b""


LOAD_UNFINISHED_MESSAGE = ("this meta store holds part of a dump: an `fs3 admin load` into it did not finish; "
                           "load again into an empty store (docs/operations.md)")

@dataclass
class MetaServiceConfig:
    chain_table_id: int = 1
    chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES
    stripe_default: int = 16
    root_uid: int = 0
    root_gid: int = 0
    root_mode: int = 0o755
    client_lease_ms: int = 30_000
    # How long meta refuses the id of a client whose lease lapsed. Clients retry one request for at
    # most half of it (each renewal tells them), so no retry can arrive after the refusal ends.
    expired_client_ttl_ms: int = 600_000
    prune_interval_ms: int = 5_000
    gc_interval_ms: int = 2_000
    inode_batch: int = 1024
    txn_retry_max: int = 20
    # Chunks listed (and then removed) per storage call of a GC or truncate job or a length probe.
    chunk_page: int = 256
    # A user token bound to uid 0 acts as nobody (65534): a stolen user token is then never root.
    # Off: such a token is root on the file system (services and trusted clients are not affected).
    root_squash: bool = True
    # How long a data-path capability is valid (wall clock); clients renew it halfway through.
    capability_ttl_ms: int = 600_000
    # How long another meta server's claim on an inode's storage side (a truncate job, GC, a
    # length probe) or on an expired client's clean-up stands without renewal before this server
    # takes it over (fs3.meta.claims): the time a dead server's unfinished job waits.
    claim_ttl_ms: int = 5_000
    # Path hints remembered (fs3.meta.hints) on an engine that fetches announced keys together
    # (PostgreSQL): 0 turns them off. They only choose what a request's first read fetches.
    path_hints_max: int = PATH_HINTS_MAX_DEFAULT
    # Days a removed file stays in the trash (fs3.meta.trash), fractions allowed; 0: no trash, a
    # removed file's chunks go to GC at once. Off by default: space comes back when it always did.
    trash_days: float = 0.0
    # A store of an older format is migrated when meta starts (fs3.meta.formats); off: the start is
    # refused, and `fs3 admin upgrade --config` migrates it offline (docs/operations.md "Upgrading").
    upgrade_on_start: bool = True

    def validate(self) -> None:
        if self.client_lease_ms < 1:
            raise InvalidArgument("client_lease_ms must be positive")
        # A client must be able to retry at least as long as a lease lasts (a meta failover, a
        # network blip); its retries are bounded by half the time an expired id stays refused.
        if self.expired_client_ttl_ms < 2 * self.client_lease_ms:
            raise InvalidArgument("expired_client_ttl_ms must be at least twice client_lease_ms")
        if not 1 <= self.chunk_page <= CHUNK_PAGE_MAX:
            raise InvalidArgument(f"chunk_page {self.chunk_page} outside [1, {CHUNK_PAGE_MAX}]")
        if not 100 <= self.capability_ttl_ms <= 86_400_000:
            raise InvalidArgument("capability_ttl_ms must be within [100, 86400000]")
        if not 40 <= self.claim_ttl_ms <= 600_000:
            raise InvalidArgument("claim_ttl_ms must be within [40, 600000]")
        if not 0 <= self.path_hints_max <= 10_000_000:
            raise InvalidArgument("path_hints_max must be within [0, 10000000]")
        trash.keep_ns(self.trash_days)  # refuses a value out of range

    @property
    def client_retry_limit_ms(self) -> int:
        """The longest a client may retry one request: meta forgets a lapsed client's answers, and
        stops refusing its id, only after twice this."""
        return self.expired_client_ttl_ms // 2


@dataclass
class _InodeLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class InodeAllocator:
    """Hands out inode ids from batches reserved by a counter transaction (safe with several servers)."""

    def __init__(self, engine: TxnEngine, batch: int) -> None:
        self.engine = engine
        self.batch = batch
        self._next = 0
        self._end = 0
        self._lock = asyncio.Lock()

    async def next(self) -> int:
        if self._next >= self._end:
            async with self._lock:
                if self._next >= self._end:
                    key = schema.counter_key("next_inode")

                    async def reserve(txn: Transaction) -> int:
                        start = max(schema.decode_u64(await txn.get(key)), schema.ROOT_INODE + 1)
                        txn.put(key, schema.encode_u64(start + self.batch))
                        return start

                    start = await run_transaction(self.engine, reserve)
                    self._next, self._end = start, start + self.batch
        value = self._next
        self._next += 1
        return value

    async def allocated(self) -> int:
        txn = self.engine.begin()
        return schema.decode_u64(await txn.get(schema.counter_key("next_inode")))


class MetaService(FileLengths, MetaJobs, QuotaHandlers):
    """Handlers for every ``fs3.Meta`` method; the file-length logic (:class:`FileLengths`) and the
    background jobs (:class:`MetaJobs`: truncate jobs, GC, pruning, routing) are its other parts."""

    def __init__(self, engine: TxnEngine, routing: RoutingCache, storage: StorageClient,
                 config: MetaServiceConfig | None = None, wall_ns: Callable[[], int] = time.time_ns,
                 clock: Clock | None = None, auth: Authenticator | None = None,
                 metrics: ServiceMetrics | None = None, server_id: bytes | None = None,
                 exclusive_store: bool = False, node_id: int | None = None, store_name: str = "meta store",
                 cluster_id: str = "") -> None:
        """``wall_ns`` stamps inode times and capability expiries; ``clock`` (monotonic) times
        client leases and claims; ``auth`` (the dispatcher's) gives the keys capabilities are
        signed with (None or an open cluster: no capabilities, as every caller is a service);
        ``metrics`` gets the job queues' gauges; ``server_id`` names this server in the claims it
        records (None: a random one; a meta process passes its node id, so that once restarted it
        takes back its own claims; live servers on the same store must use different ids);
        ``exclusive_store``: no other server can open ``engine`` (the embedded RocksDB of a meta
        process), so claims are granted without a transaction (:mod:`fs3.meta.claims`); ``node_id``
        (a shared store only): :meth:`start` first takes this id's registration in the store
        (:mod:`fs3.meta.registration`), refusing to start while another live server holds it, and
        sets :attr:`registration_lost` should another take it over later."""
        self.metrics = metrics
        self.auth = auth if auth is not None else Authenticator()
        self.engine = engine
        self.routing = routing
        self.storage = storage
        self.config = config or MetaServiceConfig()
        self.config.validate()
        self.wall_ns = wall_ns
        self.clock: Clock = clock or LoopClock()
        # client id -> (renewal count, when this server first saw that count, on self.clock): a
        # lease expires once its count has not changed for client_lease_ms of this server's time.
        self._leases_seen: dict[bytes, tuple[int, int]] = {}
        # expired client id -> when this server first saw it cleaned up (its refusal's time to live).
        self._expired_seen: dict[bytes, int] = {}
        self.allocator = InodeAllocator(engine, self.config.inode_batch)
        self._tasks: list[asyncio.Task[None]] = []
        self._gc_wakeup = asyncio.Event()
        self._truncate_locks: dict[int, _InodeLock] = {}
        self.server_id = server_id or os.urandom(16)
        self.claims = ClaimTable(engine, self.server_id, self.clock, self.config.claim_ttl_ms,
                                 exclusive=exclusive_store)
        # One live server per node id on a shared store; the claims' ttl times it too (see there).
        self.registration = (NodeRegistration(engine, node_id, self.clock, self.config.claim_ttl_ms)
                             if node_id is not None and not exclusive_store else None)
        self.registration_lost = asyncio.Event()
        if self.registration is not None:
            # Claims are recorded under the node id: none is taken, renewed or trusted while the
            # registration is not surely this process's (not renewed within half a ttl, or lost).
            self.claims.owner_trusted = self._registration_trusted
        self._inode_claims: dict[int, Held] = {}
        self._tables: dict[int, list[int]] = {}
        self._tables_version = -1
        self.gc_removed_chunks = 0
        # Only an engine that fetches announced keys with its next read (``prefetches``) gains
        # from guessing them; on the embedded engine the hints would be bookkeeping for nothing.
        self._prefetches = bool(getattr(engine, "prefetches", False))
        self.path_hints: PathHints | None = None
        if self.config.path_hints_max and self._prefetches:
            self.path_hints = PathHints(self.config.path_hints_max)
        self._reuse_answers = not sabotaged("idempotency")  # off only to prove crash tests see it
        self._answer_crash = CrashPoint("meta-answer")  # crash tests die here: committed, not answered
        self.store_name = store_name  # how format refusals and migration logs name the store
        self.cluster_id = cluster_id

    # -- lifecycle -------------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return self.wall_ns() // 1_000_000

    async def start(self, background: bool = True) -> None:
        layout = mpb.Layout(table_id=self.config.chain_table_id, chunk_size=self.config.chunk_size_bytes)
        validate_dir_layout(layout)
        # The store's format first: a newer or too old one (or an older one with upgrade_on_start
        # off) is refused before anything is written; an older one is migrated, page by page.
        # A half-done load is refused first of all: it holds part of a dump, and nothing (not even
        # a format record) may be written to it.
        look = self.engine.begin()
        try:
            if await look.get(schema.LOAD_UNFINISHED) is not None:
                raise InvalidArgument(LOAD_UNFINISHED_MESSAGE)
        finally:
            end_transaction(look)
        await open_meta_format(self.engine, self.store_name, upgrade=self.config.upgrade_on_start,
                               cluster_id=self.cluster_id)
        if self.registration is not None:  # before anything is written: a refused start writes nothing
            await self.registration.acquire()
            self._tasks.append(asyncio.create_task(self._keep_registration(), name="meta-registration"))

        async def make_root(txn: Transaction) -> mpb.Inode:
            if await txn.get(schema.LOAD_UNFINISHED) is not None:
                raise InvalidArgument(LOAD_UNFINISHED_MESSAGE)
            return await Namespace(txn, self._env(mpb.User())).ensure_root(
                self.config.root_uid, self.config.root_gid, self.config.root_mode, layout)

        await run_transaction(self.engine, make_root)
        if background:
            self._tasks.append(asyncio.create_task(self._maintenance_loop(), name="meta-maintenance"))
            self._tasks.append(asyncio.create_task(self._gc_loop(), name="meta-gc"))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self.registration is not None and not self.registration_lost.is_set():
            try:
                await self.registration.release()
            except FS3Error as exc:  # it lapses instead: a restart waits one claim ttl
                log.warning("releasing meta node id %d failed: %s", self.registration.node_id, exc)

    def _registration_trusted(self) -> bool:
        held = self.registration.held if self.registration is not None else None
        return held is not None and held.valid() and not self.registration_lost.is_set()

    async def _keep_registration(self) -> None:
        assert self.registration is not None
        await self.registration.keep()
        # Another server has this id now, and with it this one's claims: no more background jobs
        # here, and the owner (serve_meta) stops the server.
        self.registration_lost.set()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()

    # -- plumbing --------------------------------------------------------------------------------

    def _chain_tables(self) -> dict[int, list[int]]:
        routing = self.routing.routing
        if routing is None:
            return {}
        if self._tables_version != routing.routing_version:
            self._tables = {t.table_id: list(t.chain_ids) for t in routing.chain_tables}
            self._tables_version = routing.routing_version
        return self._tables

    def _env(self, user: mpb.User) -> OpEnv:
        return OpEnv(now_ns=self.wall_ns(), caller=Caller.from_pb(user), chain_tables=self._chain_tables(),
                     stripe_default=self.config.stripe_default, trash_keep_ns=trash.keep_ns(self.config.trash_days))

    def _announce(self, txn: Transaction, refs: Sequence[mpb.PathRef], keys: Sequence[bytes],
                  target_keys: bool = False, removing: bool = False) -> None:
        """Announce to ``txn`` what an operation on ``refs`` will read if the path hints are right,
        and ``keys`` (known from the request): they ride with its first read. About the first
        path's hinted target: ``target_keys``, its truncate and size generation (an open reads
        them); ``removing``, the scans removing its last name makes. Nothing is computed on an
        engine that ignores ``prefetch`` (the embedded one)."""
        if not self._prefetches:
            return
        out = list(keys)
        hints = self.path_hints
        if hints is not None:
            for at, ref in enumerate(refs):
                target, kind = hints.keys(ref, out)
                if at or not target:
                    continue
                if target_keys:
                    out += (schema.truncate_key(target), schema.size_gen_key(target))
                if removing and kind:
                    for start, end, limit in removal_scans(target, kind):
                        txn.prefetch_scan(start, end, limit)
                    if kind == mpb.FILE:  # a truncate's reserved growth to refund (quotas)
                        out.append(schema.truncate_key(target))
        if out:
            txn.prefetch(out)

    def _learn(self, ns: Namespace) -> None:
        """Remember what the operation found on its way (whether it succeeded or not)."""
        if self.path_hints is not None and ns.entries_seen:
            self.path_hints.learn(ns.entries_seen.items())

    async def _read(self, ctx: mpb.ReqCtx, fn: Callable[[Namespace], Awaitable[T]],
                    refs: Sequence[mpb.PathRef] = (), keys: Sequence[bytes] = ()) -> T:
        """A read-only operation: reads the latest committed state, writes nothing.

        It answers only once what it read is durable, so no client ever sees a change that a
        crash could still take back (commits become visible before their group fsync ends) —
        errors included: "no such file" may come from a remove whose sync is still running.
        ``refs`` and ``keys``: what it will read (:meth:`_announce`), fetched with its first read.

        On an engine whose read-only transactions are serializable only once committed
        (``reads_commit``: PostgreSQL, where a transaction that rolls back constrains nobody, so a
        dropped reader can have seen a state no serial order contains) the transaction commits
        before the answer, and a conflict runs it again: docs/decisions.md, "Meta on PostgreSQL".
        """
        env = self._env(ctx.user)
        if getattr(self.engine, "reads_commit", False):
            async def body(txn: Transaction) -> T:
                self._announce(txn, refs, keys)
                ns = Namespace(txn, env)
                try:
                    return await fn(ns)
                finally:
                    self._learn(ns)

            return await run_transaction(self.engine, body, retry_max=self.config.txn_retry_max)
        txn = self.engine.begin()
        self._announce(txn, refs, keys)
        ns = Namespace(txn, env)
        try:
            result = await fn(ns)
        except Exception:
            self._learn(ns)
            await self.engine.wait_durable()
            raise
        self._learn(ns)
        await self.engine.wait_durable()
        return result

    async def _mutate(self, ctx: mpb.ReqCtx, rsp_type: type[M], fn: Callable[[Namespace], Awaitable[M]],
                      ancestry: Ancestry | None = None, refs: Sequence[mpb.PathRef] = (),
                      keys: Sequence[bytes] = (), target_keys: bool = False, removing: bool = False) -> M:
        """One idempotent transaction: the answer is committed with the change, keyed by the request.

        Its first read fetches the saved answer, the client's expiry, and what the operation will
        read on ``refs`` and ``keys`` if the path hints are right (:meth:`_announce`): one round
        trip, then the commit, when they are."""
        if ctx.request_id == 0:
            raise InvalidArgument("a mutating request needs a request id")
        key = schema.idem_key(ctx.client_id, ctx.request_id)
        env = self._env(ctx.user)

        async def body(txn: Transaction) -> M:
            txn.prefetch([key, schema.expired_client_key(ctx.client_id)])  # one round trip for all
            quota.announce(txn)  # the quotas settle() reads, fetched with the rest
            self._announce(txn, refs, keys, target_keys, removing)
            raw = await txn.get(key)
            if raw is not None and self._reuse_answers:
                return rsp_type.FromString(schema.IdemRecord.decode(raw).response)
            await _refuse_expired(txn, ctx.client_id)
            ns = Namespace(txn, env, ancestry)
            try:
                rsp = await fn(ns)
                await quota.settle(ns)
            finally:
                self._learn(ns)
            txn.put(key, schema.IdemRecord(env.now_ns // 1_000_000, rsp.SerializeToString()).encode())
            return rsp

        rsp = await run_transaction(self.engine, body, retry_max=self.config.txn_retry_max)
        self._answer_crash.passed()
        return rsp

    async def _mutate_truncating(self, ctx: mpb.ReqCtx, rsp_type: type[M],
                                 fn: Callable[[Namespace, int], Awaitable[M]],
                                 on_failed: Callable[[], Awaitable[None]] | None = None,
                                 refs: Sequence[mpb.PathRef] = (), keys: Sequence[bytes] = (),
                                 target_keys: bool = False) -> M:
        """A mutation that may change a file's size (``fn(namespace, truncating)``); ``refs``,
        ``keys`` and ``target_keys`` as :meth:`_mutate` takes them.

        The first run claims nothing; when it would truncate an inode, it runs again holding that
        inode's lock, and the truncate's storage side (:meth:`_run_truncate_locked`) runs before
        the answer. An inode whose earlier truncate is unfinished has it finished first.
        ``on_failed`` runs, still holding the lock, when the storage side fails after the commit:
        a retry of the request waiting for the lock then sees what it changed.
        """
        truncating = 0
        for _ in range(TRUNCATE_ATTEMPTS):
            try:
                if not truncating:
                    return await self._mutate(ctx, rsp_type, _claiming(fn, 0), None, refs, keys, target_keys)
                async with self._inode_lock(truncating):
                    try:
                        rsp = await self._mutate(ctx, rsp_type, _claiming(fn, truncating), None, refs, keys,
                                                 target_keys)
                    except TruncatePending as exc:
                        if exc.inode_id != truncating:
                            raise
                        await self._run_truncate_locked(truncating)
                        continue
                    try:
                        await self._run_truncate_locked(truncating)
                    except Exception:
                        if on_failed is not None:
                            await on_failed()
                        raise
                    return rsp
            except TruncatePending as exc:
                await self._finish_truncate(exc.inode_id)
            except TruncateUnclaimed as exc:
                truncating = exc.inode_id
        raise Unavailable("the file kept changing under this request; try again")

    async def _ensure_tables(self) -> None:
        """Creating files needs the chain tables: fetch routing if the default table is not known yet."""
        if self.config.chain_table_id not in self._chain_tables():
            with contextlib.suppress(FS3Error):
                await self.routing.refresh()

    # -- handlers (one per fs3.Meta method) ------------------------------------------------------

    async def stat_fs(self, req: mpb.StatFsReq, payload: memoryview) -> tuple[mpb.StatFsRsp, Buffer]:
        routing = self.routing.routing
        rsp = mpb.StatFsRsp(chunk_size=self.config.chunk_size_bytes, name_max=255,
                            inodes_allocated=await self.allocator.allocated())
        if routing is not None:
            chained = {t for c in routing.chains for t in c.target_ids}
            replicas = max(1, max((len(c.target_ids) for c in routing.chains), default=1))
            for target in routing.targets:
                if target.target_id in chained:
                    rsp.capacity_bytes += target.capacity_bytes
                    rsp.used_bytes += target.used_bytes
                    rsp.free_bytes += target.free_bytes
            # Every byte is stored `replicas` times: report what a user can store.
            rsp.capacity_bytes //= replicas
            rsp.used_bytes //= replicas
            rsp.free_bytes //= replicas
        bound = await self._quota_bound(req.inode_id)
        if bound is not None:  # df inside a quota'd tree: the quota is the file system's size
            if bound.bytes_limit:
                free = max(0, bound.bytes_limit - bound.bytes_used)
                rsp.free_bytes = min(rsp.free_bytes, free) if rsp.capacity_bytes else free
                rsp.capacity_bytes = bound.bytes_limit
                rsp.used_bytes = bound.bytes_used
            rsp.inodes_limit, rsp.inodes_used = bound.inodes_limit, bound.inodes_used
        return rsp, _EMPTY

    async def lookup(self, req: mpb.LookupReq, payload: memoryview) -> tuple[mpb.InodeRsp, Buffer]:
        inode = await self._read(req.ctx, lambda ns: ns.lookup(req.target, req.follow), (req.target,))
        return mpb.InodeRsp(inode=inode), _EMPTY

    async def batch_stat(self, req: mpb.BatchStatReq, payload: memoryview) -> tuple[mpb.BatchStatRsp, Buffer]:
        if len(req.inode_ids) > BATCH_STAT_MAX:
            raise InvalidArgument(f"{len(req.inode_ids)} inodes in one batch: at most {BATCH_STAT_MAX}")
        inodes = await self._read(req.ctx, lambda ns: ns.batch_stat(list(req.inode_ids)))
        return mpb.BatchStatRsp(inodes=inodes), _EMPTY

    async def open(self, req: mpb.OpenReq, payload: memoryview) -> tuple[mpb.OpenRsp, Buffer]:
        session_id = schema.session_id_for(req.ctx.client_id, req.ctx.request_id)
        new_id = 0
        if req.flags & O_CREAT:
            await self._ensure_tables()
            new_id = await self.allocator.next()
        now_ms = self._now_ms()

        async def abandon() -> None:
            await self._abandon_open(req.ctx)

        async def run_open(ns: Namespace, truncating: int) -> mpb.OpenRsp:
            return _granting(await ns.open(req.target, req.flags, req.mode, new_id, session_id, req.ctx.client_id,
                                           now_ms, truncating), req.flags)

        created_keys = (schema.inode_key(new_id), schema.size_gen_key(new_id)) if new_id else ()
        rsp = await self._mutate_truncating(req.ctx, mpb.OpenRsp, run_open, abandon if req.flags & O_TRUNC else None,
                                            (req.target,), created_keys, target_keys=True)
        if req.flags & O_TRUNC and rsp.inode.type == mpb.FILE and rsp.session_id and not rsp.created:
            # A retry answered from the saved answer: the attempt that committed it may still be
            # cutting the file, and closes the session if that fails. Both happen under the lock,
            # so the saved answer read again after it says whether the session still stands.
            async with self._inode_lock(rsp.inode.inode_id):
                try:
                    await self._run_truncate_locked(rsp.inode.inode_id)
                except Exception:
                    await self._abandon_open(req.ctx)
                    raise
                rsp = await self._saved_open(req.ctx)
        if req.flags & O_TRUNC and rsp.inode.type == mpb.FILE and not rsp.session_id:
            rsp = await self._reopen_abandoned(req, rsp, session_id, now_ms)
        if req.flags & O_APPEND and (req.flags & O_ACCMODE) in (O_WRONLY, O_RDWR) and rsp.session_id \
                and rsp.inode.type == mpb.FILE:
            # Not part of the saved answer either: a retry learns the end as it is then.
            rsp.inode.CopyFrom(await self._end_for_append(rsp.inode, rsp.session_id))
        if rsp.session_id and rsp.inode.type == mpb.FILE and rsp.capability_access:
            # Not part of the saved answer: a retry answered from it gets a capability of its own,
            # granting what the open that ran allowed (saved with it), never what the retry's flags
            # ask for: a read-only open resent with O_RDWR must not come back able to write.
            # (A saved answer without it was saved by an older release: no capability, so the
            # client asks GrantCapability, which checks the caller's permissions.)
            rsp.capability, rsp.capability_ttl_ms = self._sign_capability(
                rsp.inode, parse_access(rsp.capability_access), rsp.session_id)
        return rsp, _EMPTY

    def _sign_capability(self, inode: mpb.Inode, access: Access, session_id: bytes) -> tuple[bytes, int]:
        """A capability for ``access`` to ``inode``'s chunks, issued to the open ``session_id``, and
        how long it is valid (empty on an open cluster: storage asks none of services, and every
        caller is one there)."""
        keys = self.auth.capability_keys
        if not keys or not inode.layout.chains:
            return b"", 0
        ttl_ms = self.config.capability_ttl_ms
        capability = Capability(inode.inode_id, access, tuple(inode.layout.chains), self._now_ms() + ttl_ms,
                                session_id)
        return sign(capability, keys[0]), ttl_ms

    async def grant_capability(self, req: mpb.GrantCapabilityReq,
                               payload: memoryview) -> tuple[mpb.GrantCapabilityRsp, Buffer]:
        """Renew an open session's data-path capability (see ``GrantCapabilityReq``)."""
        try:
            access = parse_access(req.access)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if not req.session_id:
            raise BadHandle("a capability is granted to an open file's session only")
        _check_session_owner(req.ctx, req.session_id)
        renewing = False
        if req.previous:
            # Signed by a current key: expired or not, it says what this session's open allowed.
            with contextlib.suppress(PermissionDenied):
                previous = decode(req.previous, self.auth.capability_keys)
                renewing = (previous.inode_id == req.inode_id and previous.session_id == req.session_id
                            and not int(access) & ~int(previous.access))
        want = (R_OK if access & Access.READ else 0) | (W_OK if access & Access.WRITE else 0)
        inode = await self._read(req.ctx, lambda ns: ns.capability_file(req.inode_id, req.session_id, want, renewing))
        capability, ttl_ms = self._sign_capability(inode, access, req.session_id)
        return mpb.GrantCapabilityRsp(capability=capability, capability_ttl_ms=ttl_ms), _EMPTY

    async def _saved_open(self, ctx: mpb.ReqCtx) -> mpb.OpenRsp:
        """The answer saved for an open request (its session, or none once abandoned), answered
        only once what it read is durable, like every read (``_read``)."""
        raw = await self.engine.begin().get(schema.idem_key(ctx.client_id, ctx.request_id))
        await self.engine.wait_durable()
        if raw is None:
            raise StaleClient("the saved answer of this open expired: its outcome is unknown")
        return mpb.OpenRsp.FromString(schema.IdemRecord.decode(raw).response)

    async def _abandon_open(self, ctx: mpb.ReqCtx) -> None:
        """End the session of an ``O_TRUNC`` open its caller is told failed; its saved answer stays,
        without the session, to say the request truncated that inode already.

        The open commits its session with its truncate job, and storage is cut after: when that
        fails the caller gets the error, so no handle exists to close the session, and it would
        keep the file (unlinked or not) until the client's lease ends. The truncate stays recorded
        and is finished later (the old size shows until then). A retry of the request must not
        truncate again — the file may have been written since the first truncate finished — nor
        open whatever the path names by then: it opens the inode the answer names, without
        truncating (:meth:`_reopen_abandoned`).
        """
        key = schema.idem_key(ctx.client_id, ctx.request_id)
        closed: list[tuple[int, bytes]] = []

        async def undo(txn: Transaction) -> None:
            closed.clear()
            raw = await txn.get(key)
            if raw is None:
                return  # the open never committed
            record = schema.IdemRecord.decode(raw)
            rsp = mpb.OpenRsp.FromString(record.response)
            inode_id, session_id = rsp.inode.inode_id, rsp.session_id
            if not session_id:
                return  # abandoned already (or a directory: no session)
            if await txn.get(schema.session_key(inode_id, session_id)) is not None:
                await Namespace(txn, self._env(ctx.user)).close(inode_id, session_id)
                closed.append((inode_id, session_id))
            rsp.session_id = b""
            txn.put(key, schema.IdemRecord(record.committed_ms, rsp.SerializeToString()).encode())

        try:
            await run_transaction(self.engine, undo, retry_max=self.config.txn_retry_max)
        except FS3Error as exc:
            log.warning("the session of a failed open stays until its client's lease ends: %s", exc)
        if closed:
            self._gc_wakeup.set()

    async def _reopen_abandoned(self, req: mpb.OpenReq, abandoned: mpb.OpenRsp, session_id: bytes,
                                now_ms: int) -> mpb.OpenRsp:
        """The retry of an ``O_TRUNC`` open whose first attempt truncated and was abandoned (see
        :meth:`_abandon_open`): the truncate that attempt recorded is finished, then the same inode
        is opened again without truncating, and the answer replaces the saved one (so a further
        retry gets this session). The inode may be gone by now: ``NotFound``, as for any open of
        a removed file."""
        key = schema.idem_key(req.ctx.client_id, req.ctx.request_id)
        inode_id = abandoned.inode.inode_id
        flags = req.flags & ~(O_TRUNC | O_CREAT | O_EXCL)
        env = self._env(req.ctx.user)

        async def reopen(txn: Transaction) -> mpb.OpenRsp:
            raw = await txn.get(key)
            if raw is None:
                raise StaleClient("the saved answer of this open expired: its outcome is unknown")
            record = schema.IdemRecord.decode(raw)
            saved = mpb.OpenRsp.FromString(record.response)
            if saved.session_id:
                return saved  # another retry reopened it meanwhile
            await _refuse_expired(txn, req.ctx.client_id)
            rsp = _granting(await Namespace(txn, env).open(mpb.PathRef(inode_id=inode_id), flags, 0, 0, session_id,
                                                           req.ctx.client_id, now_ms), flags)
            rsp.created = saved.created
            txn.put(key, schema.IdemRecord(record.committed_ms, rsp.SerializeToString()).encode())
            return rsp

        for _ in range(TRUNCATE_ATTEMPTS):
            await self._finish_truncate(inode_id)
            try:
                return await run_transaction(self.engine, reopen, retry_max=self.config.txn_retry_max)
            except TruncatePending:
                continue  # truncated again since (another request): finish that too
        raise Unavailable("the file kept changing under this request; try again")

    async def make_node(self, req: mpb.MakeNodeReq, payload: memoryview) -> tuple[mpb.InodeRsp, Buffer]:
        if req.type == mpb.FILE:
            await self._ensure_tables()
        new_id = await self.allocator.next()
        rsp = await self._mutate(req.ctx, mpb.InodeRsp, lambda ns: _inode_rsp(ns.make_node(
            req.target, req.type, req.mode, req.rdev, req.symlink_target, new_id)),
            refs=(req.target,), keys=(schema.inode_key(new_id),))
        return rsp, _EMPTY

    async def read_link(self, req: mpb.ReadLinkReq, payload: memoryview) -> tuple[mpb.ReadLinkRsp, Buffer]:
        target = await self._read(req.ctx, lambda ns: ns.readlink(req.target), (req.target,))
        return mpb.ReadLinkRsp(target=target), _EMPTY

    async def link(self, req: mpb.LinkReq, payload: memoryview) -> tuple[mpb.InodeRsp, Buffer]:
        rsp = await self._mutate(req.ctx, mpb.InodeRsp, lambda ns: _inode_rsp(ns.link(req.source, req.link)),
                                 refs=(req.source, req.link))
        return rsp, _EMPTY

    async def remove(self, req: mpb.RemoveReq, payload: memoryview) -> tuple[mpb.RemoveRsp, Buffer]:
        async def op(ns: Namespace) -> mpb.RemoveRsp:
            inode_id, parent = await ns.remove_entry(req.target, req.directory)
            return mpb.RemoveRsp(inode_id=inode_id, parent=parent)

        rsp = await self._mutate(req.ctx, mpb.RemoveRsp, op, refs=(req.target,), removing=True)
        self._gc_wakeup.set()
        return rsp, _EMPTY

    async def rename(self, req: mpb.RenameReq, payload: memoryview) -> tuple[mpb.RenameRsp, Buffer]:
        async def op(ns: Namespace) -> mpb.RenameRsp:
            return mpb.RenameRsp(inode=await ns.rename(req.source, req.destination, req.flags))

        ancestry: Ancestry | None = None
        for _ in range(ANCESTRY_ATTEMPTS):
            try:
                rsp = await self._mutate(req.ctx, mpb.RenameRsp, op, ancestry, refs=(req.source, req.destination))
                break
            except AncestryUnknown as deep:
                found = await self._walk_ancestry(deep.start, deep.ancestor)
                if found is not None:
                    moves, above = found
                    if ancestry is None or ancestry.moves != moves:
                        ancestry = Ancestry(moves)
                    ancestry.above[(deep.start, deep.ancestor)] = above
        else:
            raise Unavailable("directories kept moving while a rename looked above its destination; try again")
        self._gc_wakeup.set()
        return rsp, _EMPTY

    async def _walk_ancestry(self, start: int, ancestor: int) -> tuple[bytes, bool] | None:
        """Whether ``ancestor`` is directory ``start`` or above it, as ``(moves stamp, answer)``.

        The parent links are followed in read transactions of at most ``ANCESTOR_WALK_MAX``
        inodes each, so neither memory nor any transaction grows with the tree's depth. The
        directory-move stamp is read before the first page and after each one: a rename that
        reparents a directory changes it in the same commit as the link, so an unchanged stamp
        means every link read belongs to one consistent tree. None when a directory moved (or
        one on the way was removed) meanwhile: the caller runs the operation again.
        """
        stamp_key = schema.directory_moves_key()
        stamp = await self.engine.begin().get(stamp_key) or b""
        current = start
        # Brent's cycle detection: parent links that loop (a damaged namespace) end the walk.
        mark, power, steps = start, 1, 0
        while True:
            txn = self.engine.begin()
            for _ in range(ANCESTOR_WALK_MAX):
                if current == ancestor:
                    answer: bool | None = True
                    break
                if current == schema.ROOT_INODE:
                    answer = False
                    break
                raw = await txn.get(schema.inode_key(current))
                if raw is None:
                    return None
                current = mpb.Inode.FromString(raw).parent
                steps += 1
                if current == mark:
                    raise Internal(f"the parent links above directory {start} form a cycle")
                if steps == power:
                    mark, power, steps = current, power * 2, 0
            else:
                answer = None
            if (await self.engine.begin().get(stamp_key) or b"") != stamp:
                return None
            if answer is not None:
                return stamp, answer

    async def read_dir(self, req: mpb.ReadDirReq, payload: memoryview) -> tuple[mpb.ReadDirRsp, Buffer]:
        rsp = await self._read(req.ctx, lambda ns: ns.readdir(req.dir, req.start_after, req.limit, req.with_attrs),
                               (req.dir,))
        return rsp, _EMPTY

    async def set_attr(self, req: mpb.SetAttrReq, payload: memoryview) -> tuple[mpb.InodeRsp, Buffer]:
        _check_session_owner(req.ctx, req.session_id)
        if not req.mask & mpb.SET_SIZE:
            return await self._mutate(req.ctx, mpb.InodeRsp, lambda ns: _inode_rsp(ns.setattr(req)),
                                      refs=(req.target,)), _EMPTY
        rsp = await self._mutate_truncating(req.ctx, mpb.InodeRsp,
                                            lambda ns, truncating: _inode_rsp(ns.setattr(req, truncating)))
        await self._finish_truncate(rsp.inode.inode_id)  # a retry answered from the saved answer
        return rsp, _EMPTY

    async def get_xattr(self, req: mpb.GetXattrReq, payload: memoryview) -> tuple[mpb.GetXattrRsp, Buffer]:
        value = await self._read(req.ctx, lambda ns: ns.get_xattr(req.target, req.follow, req.name), (req.target,))
        return mpb.GetXattrRsp(value=value), _EMPTY

    async def set_xattr(self, req: mpb.SetXattrReq, payload: memoryview) -> tuple[mpb.InodeRsp, Buffer]:
        rsp = await self._mutate(req.ctx, mpb.InodeRsp, lambda ns: _inode_rsp(
            ns.set_xattr(req.target, req.follow, req.name, req.value, req.flags)), refs=(req.target,))
        return rsp, _EMPTY

    async def list_xattr(self, req: mpb.ListXattrReq, payload: memoryview) -> tuple[mpb.ListXattrRsp, Buffer]:
        names = await self._read(req.ctx, lambda ns: ns.list_xattr(req.target, req.follow), (req.target,))
        return mpb.ListXattrRsp(names=names), _EMPTY

    async def remove_xattr(self, req: mpb.RemoveXattrReq, payload: memoryview) -> tuple[mpb.InodeRsp, Buffer]:
        rsp = await self._mutate(req.ctx, mpb.InodeRsp, lambda ns: _inode_rsp(
            ns.remove_xattr(req.target, req.follow, req.name)), refs=(req.target,))
        return rsp, _EMPTY

    async def close(self, req: mpb.CloseReq, payload: memoryview) -> tuple[mpb.InodeRsp, Buffer]:
        async def op(ns: Namespace, length: LengthReport) -> mpb.InodeRsp:
            return mpb.InodeRsp(inode=(await ns.close(req.inode_id, req.session_id, length)).inode)

        _check_session_owner(req.ctx, req.session_id)
        await self._refuse_impossible_length(req.inode_id, req.length_hint)
        rsp = await self._with_exact_length(req.ctx, req.inode_id, _writer_length(req), op,
                                            (schema.session_key(req.inode_id, req.session_id),
                                             schema.inode_key(req.inode_id)))
        if rsp.inode.nlink == 0:  # the last name went before this session: the close may have queued GC
            self._gc_wakeup.set()
        return rsp, _EMPTY

    async def close_sessions(self, req: mpb.CloseSessionsReq,
                             payload: memoryview) -> tuple[mpb.CloseSessionsRsp, Buffer]:
        """End sessions with no length to publish, in one transaction (see the rpc)."""
        if len(req.sessions) > CLOSE_SESSIONS_MAX:
            raise InvalidArgument(f"{len(req.sessions)} sessions in one batch: at most {CLOSE_SESSIONS_MAX}")
        for one in req.sessions:
            _check_session_owner(req.ctx, one.session_id)
            if one.wrote:
                raise InvalidArgument("a session with a length to publish is closed alone (Close)")

        async def op(ns: Namespace) -> mpb.CloseSessionsRsp:
            closed = 0
            for one in req.sessions:
                if await ns.close_if_open(one.inode_id, one.session_id):
                    closed += 1
            return mpb.CloseSessionsRsp(closed=closed)

        rsp = await self._mutate(req.ctx, mpb.CloseSessionsRsp, op)
        self._gc_wakeup.set()
        return rsp, _EMPTY

    async def sync(self, req: mpb.SyncReq, payload: memoryview) -> tuple[mpb.InodeRsp, Buffer]:
        # A hint that is not acknowledged, or comes from a handle whose file was truncated since it
        # opened, only says where to look: a hint sent before a truncate and received after it
        # would otherwise bring back the length the truncate removed.
        _check_session_owner(req.ctx, req.session_id)
        await self._refuse_impossible_length(req.inode_id, req.length_hint)
        rsp = await self._with_exact_length(req.ctx, req.inode_id, _writer_length(req), lambda ns, length: _inode_rsp(
            ns.sync(req.inode_id, req.session_id, length)))
        return rsp, _EMPTY

    async def set_layout(self, req: mpb.SetLayoutReq, payload: memoryview) -> tuple[mpb.InodeRsp, Buffer]:
        await self._ensure_tables()
        rsp = await self._mutate(req.ctx, mpb.InodeRsp, lambda ns: _inode_rsp(ns.set_layout(req.dir, req.layout)),
                                 refs=(req.dir,))
        return rsp, _EMPTY

    async def renew_client(self, req: mpb.RenewClientReq, payload: memoryview) -> tuple[mpb.RenewClientRsp, Buffer]:
        """Count one more renewal of the client's lease (its first one registers the client).

        A client whose lease lapsed is refused (:class:`StaleClient`), in the same transaction
        that would renew it: the pruner's expiry re-reads the count it judged stale, so a renewal
        and an expiry never both succeed. A client that says it renewed before (``renewals``)
        but has no lease any more lapsed too, even once meta no longer remembers it.

        A client id registered with a user token belongs to that token (``ClientLease.owner``):
        no other user token may renew it (nor, see :mod:`fs3.meta.identity`, use it at all).
        """
        key = schema.client_key(req.client_id)
        principal = current_principal()
        user_token = principal.token_id if principal.role == Role.USER else ""

        async def renew(txn: Transaction) -> int:
            await _refuse_expired(txn, req.client_id)
            raw = await txn.get(key)
            if raw is None and req.renewals:
                raise StaleClient("this client's lease lapsed: register afresh")
            lease = None if raw is None else schema.ClientLease.decode(raw)
            if lease is not None and principal.role == Role.USER and lease.owner != user_token:
                log.warning("refused user token %s the renewal of client %s, registered with another credential",
                            user_token, req.client_id.hex())
                raise NotPermitted("this client id was registered with another credential")
            renewals = 1 if lease is None else lease.renewals + 1
            owner = user_token if lease is None else lease.owner
            txn.put(key, schema.ClientLease(renewals, req.hostname, req.pid, owner).encode())
            return renewals

        renewals = await run_transaction(self.engine, renew)
        if req.completed_below > 1:
            # Answers the client will never ask for again, a bounded page per transaction (a
            # crash between pages leaves the rest to the next renewal, which names them again).
            await self._forget_answers(req.client_id, req.completed_below)
        return mpb.RenewClientRsp(lease_ms=self.config.client_lease_ms, renewals=renewals,
                                  retry_limit_ms=self.config.client_retry_limit_ms), _EMPTY

    async def fsck(self, req: mpb.FsckReq, payload: memoryview) -> tuple[mpb.FsckRsp, Buffer]:
        if not req.check_chunks:
            return await run_fsck(self.engine.begin()), _EMPTY
        return await run_fsck(self.engine.begin(), self._list_chunks, self.engine.begin, self._chunk_exists), _EMPTY

    # -- the trash (fs3.meta.trash) ---------------------------------------------------------------

    async def trash_list(self, req: mpb.TrashListReq, payload: memoryview) -> tuple[mpb.TrashListRsp, Buffer]:
        return await self._read(req.ctx, lambda ns: trash.list_page(ns, req.start_after, req.limit)), _EMPTY

    async def trash_restore(self, req: mpb.TrashRestoreReq, payload: memoryview) -> tuple[mpb.InodeRsp, Buffer]:
        to = req.to if req.HasField("to") else None
        rsp = await self._mutate(req.ctx, mpb.InodeRsp, lambda ns: _inode_rsp(trash.restore(ns, req.id, to)))
        return rsp, _EMPTY

    async def trash_purge(self, req: mpb.TrashPurgeReq, payload: memoryview) -> tuple[mpb.TrashPurgeRsp, Buffer]:
        if bool(req.id) + req.all + req.expired != 1:
            raise InvalidArgument("purge one entry (id), all of them, or the expired ones: exactly one")

        async def op(ns: Namespace) -> mpb.TrashPurgeRsp:
            if req.id:
                await trash.purge(ns, req.id)
                return mpb.TrashPurgeRsp(purged=1)
            return await trash.purge_page(ns, req.start_after, req.expired)

        rsp = await self._mutate(req.ctx, mpb.TrashPurgeRsp, op)
        self._gc_wakeup.set()
        return rsp, _EMPTY

    # -- storage side effects --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _inode_lock(self, inode_id: int) -> AsyncIterator[None]:
        """Serializes an inode's truncates, their jobs, its GC and its length probes: within this
        process by a lock, across the meta servers sharing the store by a claim on the inode
        (:mod:`fs3.meta.claims`), waited for while another server holds it."""
        async with self._local_inode_lock(inode_id):
            held = await self.claims.claim(inode_claim(inode_id), wait_ms=3 * self.config.claim_ttl_ms)
            async with self._holding_inode(inode_id, held):
                yield

    @contextlib.asynccontextmanager
    async def _try_inode_lock(self, inode_id: int) -> AsyncIterator[bool]:
        """:meth:`_inode_lock` for background work: yields False at once (and holds nothing) when
        another meta server holds the inode's claim — that server is doing the work."""
        async with self._local_inode_lock(inode_id):
            held = await self.claims.try_claim(inode_claim(inode_id))
            if held is None:
                yield False
                return
            async with self._holding_inode(inode_id, held):
                yield True

    @contextlib.asynccontextmanager
    async def _holding_inode(self, inode_id: int, held: Held) -> AsyncIterator[None]:
        self._inode_claims[inode_id] = held
        try:
            async with self.claims.holding(held):
                yield
        finally:
            self._inode_claims.pop(inode_id, None)

    def _check_inode_claim(self, inode_id: int) -> None:
        held = self._inode_claims.get(inode_id)
        if held is not None:
            held.check()

    @contextlib.asynccontextmanager
    async def _local_inode_lock(self, inode_id: int) -> AsyncIterator[None]:
        entry = self._truncate_locks.get(inode_id)
        if entry is None:
            entry = self._truncate_locks[inode_id] = _InodeLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._truncate_locks[inode_id]


def _granting(rsp: mpb.OpenRsp, flags: int) -> mpb.OpenRsp:
    """The open's answer with the access its capability grants, saved with it (see ``open``)."""
    if rsp.session_id:
        rsp.capability_access = int(access_for_flags(flags))
    return rsp


async def _inode_rsp(inode: Awaitable[mpb.Inode]) -> mpb.InodeRsp:
    return mpb.InodeRsp(inode=await inode)


def _writer_length(req: mpb.CloseReq | mpb.SyncReq) -> LengthReport:
    """The length a close or sync reports, before meta asks storage."""
    return LengthReport(hint=req.length_hint, wrote=req.wrote, acked=req.acked)


def _check_session_owner(ctx: mpb.ReqCtx, session_id: bytes) -> None:
    """A handle belongs to the client id that opened it. A client whose lease lapsed registers
    again under a new id; a close, sync or truncate of a handle it opened before must not be
    accepted under the new one: meta expired the old id's sessions (or is about to), and a length
    taken from such a handle may cover writes made after its lease lapsed."""
    if session_id and schema.session_owner(session_id) != ctx.client_id:
        raise BadHandle("the file session belongs to another client id (opened before the client's lease lapsed)")


async def _refuse_expired(txn: Transaction, client_id: bytes) -> None:
    """Refuse a client whose lease lapsed: its sessions are (being) closed and its saved answers
    dropped, so a request of its could be a retry of one that already ran."""
    if await txn.get(schema.expired_client_key(client_id)) is not None:
        raise StaleClient("this client's lease lapsed (the request may or may not have run): register afresh")


def _claiming(fn: Callable[[Namespace, int], Awaitable[M]], inode_id: int) -> Callable[[Namespace], Awaitable[M]]:
    """``fn`` run with the inode whose truncate the caller claimed (0: none)."""
    return lambda ns: fn(ns, inode_id)

"""Transactions over the ordered KV stores: optimistic, serializable, retried.

The metadata service runs each POSIX operation as one transaction function
``async def op(txn) -> result``. :func:`run_transaction` begins a transaction, runs the function,
commits, and retries on a conflict or an unknown commit outcome; operations are written to be
idempotent, so running one again after a commit that did succeed returns the same answer.

The interface is async and assumes nothing about who else writes: a networked, replicated engine
(several stateless meta servers over one store) can implement :class:`~fs3.kv.api.TxnEngine` later without
any change above it.

:class:`OptimisticTxnEngine` implements it over one embedded :class:`~fs3.kv.store.KVStore` (RocksDB or
memory). Reads see the latest committed data and are recorded (keys and scanned ranges); writes are
buffered. At commit the engine checks that no transaction committed since this one began wrote a
key it read or a key inside a range it scanned, then applies the writes in one atomic batch. Faults
can be injected (conflicts, and "maybe committed" commits that did apply) so that every retry and
idempotency path runs in unit tests, the way the real store can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from fs3.common.errors import FS3Error, InvalidArgument, MaybeCommitted, RetryCause, TxnConflict, is_retryable
from fs3.common.retry import Attempts, Backoff, RetryPolicy
from fs3.kv.api import Transaction, TxnEngine
from fs3.kv.gate import ContentionGate
from fs3.kv.group_sync import GroupSync
from fs3.kv.store import KVStore, WriteBatch

__all__ = ["OptimisticTxnEngine", "StoreSnapshot", "TxnFaults", "run_transaction", "transaction_retry"]

log = logging.getLogger(__name__)
# What running a transaction again can cure: its commit conflicted, or its outcome is unknown.
_COMMIT = frozenset({RetryCause.COMMIT})
T = TypeVar("T")
_DELETED = object()


@dataclass
class TxnFaults:
    """Faults a test can inject into commits: counts first, then probabilities."""

    conflicts: int = 0
    maybe_committed: int = 0
    conflict_probability: float = 0.0
    maybe_committed_probability: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def take(self, kind: str) -> bool:
        """Whether this commit gets the fault ``kind`` (``conflict`` or ``maybe_committed``)."""
        if kind == "conflict":
            if self.conflicts > 0:
                self.conflicts -= 1
                return True
            return self.conflict_probability > 0 and self.rng.random() < self.conflict_probability
        if self.maybe_committed > 0:
            self.maybe_committed -= 1
            return True
        return self.maybe_committed_probability > 0 and self.rng.random() < self.maybe_committed_probability


class _OptimisticTxn:
    def __init__(self, engine: OptimisticTxnEngine, start_seq: int) -> None:
        self._engine = engine
        self.start_seq = start_seq
        self.writes: dict[bytes, object] = {}
        self.read_keys: set[bytes] = set()
        self.read_ranges: list[tuple[bytes, bytes | None]] = []
        self._done = False

    def _check_open(self) -> None:
        if self._done:
            raise InvalidArgument("transaction already committed or abandoned")

    async def get(self, key: bytes) -> bytes | None:
        self._check_open()
        if key in self.writes:
            value = self.writes[key]
            return None if value is _DELETED else value  # type: ignore[return-value]
        self.read_keys.add(key)
        return self._engine.store.get(key)

    async def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        self._check_open()
        if limit is not None and limit <= 0:
            raise InvalidArgument("scan limit must be positive")
        # Read only as many stored pairs as the answer can need: each of this transaction's own
        # deletes in the range can hide one of them. (The whole range would cost memory that grows
        # with what the range holds — every queued job, every handle of a file — for a few keys.)
        fetch = None
        if limit is not None:
            fetch = limit + sum(1 for key, value in self.writes.items()
                                if value is _DELETED and key >= start and (end is None or key < end))
        merged: dict[bytes, bytes] = dict(self._engine.store.scan(start, end, limit=fetch))
        more_stored = fetch is not None and len(merged) == fetch  # the store may hold more past these
        for key, value in self.writes.items():
            if key >= start and (end is None or key < end):
                if value is _DELETED:
                    merged.pop(key, None)
                else:
                    merged[key] = value  # type: ignore[assignment]
        keys = sorted(merged)
        if limit is not None and (len(keys) > limit or more_stored):
            keys = keys[:limit]
            # Only the part of the range actually returned was depended upon.
            self.read_ranges.append((start, keys[-1] + b"\x00"))
        else:
            self.read_ranges.append((start, end))
        return [(k, merged[k]) for k in keys]

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Nothing to gain here: every read is a local lookup."""

    def prefetch_scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> None:
        """Nothing to gain here either."""

    def put(self, key: bytes, value: bytes) -> None:
        self._check_open()
        self.writes[key] = value

    def delete(self, key: bytes) -> None:
        self._check_open()
        self.writes[key] = _DELETED

    async def commit(self) -> None:
        self._check_open()
        self._done = True
        await self._engine.commit(self)


class StoreSnapshot:
    """A :class:`~fs3.kv.api.SnapshotReader` over a store's frozen view (``KVStore.snapshot``)."""

    def __init__(self, view: KVStore) -> None:
        self._view: KVStore | None = view

    async def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        if self._view is None:
            raise InvalidArgument("snapshot already closed")
        if limit is not None and limit <= 0:
            raise InvalidArgument("scan limit must be positive")
        return list(self._view.scan(start, end, limit))

    async def close(self) -> None:
        view, self._view = self._view, None
        if view is not None:
            view.close()


class OptimisticTxnEngine:
    """Serializable optimistic transactions over one embedded store (this process is its only user)."""

    def __init__(self, store: KVStore, sync: bool = True, history_max: int = 10_000,
                 faults: TxnFaults | None = None) -> None:
        self.store = store
        self.sync = sync
        self.faults = faults or TxnFaults()
        self._seq = 0
        self._history: deque[tuple[int, list[bytes]]] = deque(maxlen=history_max)
        self._log = GroupSync(self._sync_wal)
        self._log_ticket = 0  # the group-sync ticket of the last commit with writes
        self.commits = 0
        self.conflicts = 0

    @property
    def wal_syncs(self) -> int:
        return self._log.syncs

    def begin(self) -> _OptimisticTxn:
        return _OptimisticTxn(self, self._seq)

    async def snapshot(self) -> StoreSnapshot:
        """A point-in-time view of the store (:class:`~fs3.kv.api.SnapshotReader`), for reads too
        long for one transaction (a transaction here reads the live store, and its reads are only
        checked at commit). Taken without an await, between two commits: none is half in it."""
        take = getattr(self.store, "snapshot", None)
        if take is None:
            raise InvalidArgument(f"{type(self.store).__name__} cannot take a snapshot")
        return StoreSnapshot(take())

    def _conflicts(self, txn: _OptimisticTxn) -> bool:
        if self._history and self._history[0][0] > txn.start_seq + 1 and self._seq > txn.start_seq:
            return True  # older than the history we keep: cannot prove it is safe
        for seq, keys in reversed(self._history):
            if seq <= txn.start_seq:
                break
            for key in keys:
                if key in txn.read_keys:
                    return True
                for start, end in txn.read_ranges:
                    if key >= start and (end is None or key < end):
                        return True
        return False

    async def commit(self, txn: _OptimisticTxn) -> None:
        """Validate and apply; with ``sync``, return only once the commit is durable.

        Group commit: the write batch goes to the store at once (later transactions read it), and
        durability comes from one WAL sync shared by every commit made while the previous sync
        was running — so many clients share each fsync instead of queueing behind one fsync each.

        A transaction that writes nothing waits too, for every commit made before it: what it
        read may be a batch whose sync is still running, and its caller is about to answer from
        it (a saved answer, "already exists") — an answer a power loss must not take back.
        """
        # Validation and apply contain no await: on one event loop they are atomic without a lock.
        if self.faults.take("conflict") or self._conflicts(txn):
            self.conflicts += 1
            raise TxnConflict("a key this transaction read was changed by another one")
        seq = 0
        if txn.writes:
            batch = WriteBatch()
            for key, value in sorted(txn.writes.items()):
                if value is _DELETED:
                    batch.delete(key)
                else:
                    batch.put(key, value)  # type: ignore[arg-type]
            self.store.write(batch, sync=False)
            self._seq += 1
            seq = self._seq
            self._history.append((self._seq, sorted(txn.writes)))
        self.commits += 1
        if seq and self.sync:
            self._log_ticket = self._log.written()
            await self._log.wait(self._log_ticket)
        elif self.sync:
            await self._log.wait(self._log_ticket)
        if self.faults.take("maybe_committed"):
            raise MaybeCommitted("the commit's outcome is unknown (injected)")

    async def wait_durable(self) -> None:
        if self.sync:
            await self._log.wait(self._log_ticket)

    async def _sync_wal(self) -> None:
        if getattr(self.store, "sync_in_thread", False):
            await asyncio.to_thread(self.store.sync_wal)
        else:
            self.store.sync_wal()


def transaction_retry(retry_max: int = 20, backoff_ms: float = 1.0) -> RetryPolicy:
    """A transaction's retries: ``retry_max`` after the first try, waiting ``backoff_ms`` more each
    time (at most 20 times that): conflicts clear in a few milliseconds, and more waiting only
    delays the request."""
    return RetryPolicy(backoff_base_ms=backoff_ms, backoff_max_ms=backoff_ms * 20, backoff=Backoff.LINEAR,
                       attempts_max=retry_max + 1)


async def run_transaction(engine: TxnEngine, fn: Callable[[Transaction], Awaitable[T]], retry_max: int = 20,
                          backoff_ms: float = 1.0) -> T:
    """Run ``fn`` in a transaction until it commits; ``fn`` must be idempotent (it may run again).

    A commit that conflicted, or whose outcome is unknown, is retried (:func:`transaction_retry`);
    every other error is the answer.

    Whatever comes out — a result or an error ``fn`` raised — comes out only once everything it
    was computed from is durable: an error is an answer too ("already exists" because of a create
    whose sync is still running), and a power loss must not take back what a caller was told.
    """
    policy = transaction_retry(retry_max, backoff_ms)
    tuned = getattr(engine, "conflict_retry", None)  # an engine that knows better (fs3.kv.postgres)
    if tuned is not None:
        policy = tuned(retry_max, backoff_ms)
    attempts = Attempts(policy, random=random.random if policy.jitter else None)
    gate: ContentionGate | None = getattr(engine, "contention_gate", None)  # fs3.kv.gate
    while True:
        async with gate.hold(exclusive=attempts.retries > 0) if gate is not None else contextlib.nullcontext():
            try:
                result = await _attempt(engine, fn)
                if gate is not None:
                    gate.record(conflicted=False)
                return result
            except FS3Error as exc:
                if not is_retryable(exc.code, _COMMIT):
                    raise
                if gate is not None:
                    gate.record(conflicted=True)
                if attempts.exhausted():
                    raise TxnConflict(f"gave up after {retry_max} retries: {exc}") from None
                log.debug("transaction retry %d: %s", attempts.retries + 1, exc)
        await attempts.backoff()


async def _attempt(engine: TxnEngine, fn: Callable[[Transaction], Awaitable[T]]) -> T:
    """One try: run ``fn`` and commit; an answer (error included) only once what it read is durable."""
    txn = engine.begin()
    try:
        result = await fn(txn)
    except BaseException as exc:
        answered = isinstance(exc, FS3Error) and not is_retryable(exc.code, _COMMIT)
        commit_reads = getattr(txn, "commit_reads", None)
        if answered and commit_reads is not None:
            # An error that is an answer ("not found") was read from this transaction's snapshot;
            # where reads are final only once committed (fs3.kv.postgres), they are committed
            # first (its writes dropped), and a conflict there runs the function again.
            await commit_reads()
        else:
            # Give a networked engine's connection back now (fs3.kv.postgres: ``abandon``): left
            # to the transaction's finalizer, it would wait for the garbage collector whenever the
            # error's traceback is part of a reference cycle, and a burst of failing requests
            # would empty the pool.
            abandon = getattr(txn, "abandon", None)
            if abandon is not None:
                abandon()
        if isinstance(exc, Exception) and (answered or not isinstance(exc, FS3Error)):
            await engine.wait_durable()
        raise
    await txn.commit()
    return result

"""What code above the stores may depend on: the transaction interfaces and key arithmetic, no engine.

The metadata operations (:mod:`fs3.meta.ops`) are written against :class:`Transaction` alone, so a
second engine (networked, replicated) replaces :class:`~fs3.kv.txn.OptimisticTxnEngine` without
any change to them. Keeping the interfaces here, apart from every implementation, lets the import
contracts (``[tool.importlinter]`` in pyproject.toml) check that nothing pure reaches an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["SnapshotEngine", "SnapshotReader", "Transaction", "TxnEngine", "prefix_end"]


class Transaction(Protocol):
    async def get(self, key: bytes) -> bytes | None: ...

    async def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        """Pairs with ``start <= key < end`` in key order, this transaction's own writes included."""
        ...

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Keys this transaction is about to read. A networked engine fetches them with its next
        read, in the same round trip, and answers their ``get`` from what it fetched; an embedded
        engine ignores it. The keys may count as read (a conflict on them fails the commit)."""
        ...

    def prefetch_scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> None:
        """A :meth:`scan` this transaction is about to make, with these arguments: as
        :meth:`prefetch`, for a range (a networked engine runs it with its next read)."""
        ...

    def put(self, key: bytes, value: bytes) -> None: ...

    def delete(self, key: bytes) -> None: ...

    async def commit(self) -> None:
        """Commit; returns only once the writes, and everything the transaction read, are durable."""
        ...


class TxnEngine(Protocol):
    """An engine whose transactions fetch announced keys with their next read (``prefetch``: a
    networked one) says so with a class attribute ``prefetches = True``; meta then guesses the
    keys a request will read (:mod:`fs3.meta.hints`). Without it, meta announces only what it knows."""

    def begin(self) -> Transaction: ...

    async def wait_durable(self) -> None:
        """Return once every commit that readers may already have seen is durable."""
        ...


class SnapshotReader(Protocol):
    """Reads of one point-in-time view of the whole store, however long they take: what commits
    after the view was taken is never seen, and every commit before it is seen whole. A dump of
    the namespace (:mod:`fs3.meta.dump`) pages through one, so the pages fit together while the
    cluster keeps writing. :meth:`close` lets the view go (it pins old versions in the engine)."""

    async def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        """Pairs with ``start <= key < end`` in key order, as of the view."""
        ...

    async def close(self) -> None: ...


class SnapshotEngine(Protocol):
    """An engine that can take a :class:`SnapshotReader` (both engines can; a test's stand-in
    engine need not)."""

    async def snapshot(self) -> SnapshotReader: ...


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix`` (None: no bound)."""
    raw = bytearray(prefix)
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return None

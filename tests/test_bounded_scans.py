"""Listing cost is linear: a paged ReadDir of n entries reads O(n) rows from the store.

Rows are counted by a store wrapper, never timed. The same listing against a store that ignores
scan limits (what every engine did before limits were honoured) reads O(n²/page) rows, and the
bound below must catch it — that is the check that the bound means something.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fs3 import meta_pb2 as mpb
from fs3.common.errors import InvariantViolation
from fs3.common.posix import Caller
from fs3.kv.api import Transaction
from fs3.kv.store import KVStore, MemKVStore, RocksKVStore, WriteBatch
from fs3.kv.txn import OptimisticTxnEngine, run_transaction
from fs3.meta.ops import Namespace, OpEnv

_PAGE = 64
_ROWS_PER_ENTRY_MAX = 2  # each entry once, plus one look-ahead row per page (``more``) and slack


class CountingKV:
    """A store that counts the rows its scans hand out (what a listing costs in reads)."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.rows_read = 0

    def get(self, key: bytes) -> bytes | None:
        return self.inner.get(key)

    def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        for pair in self.inner.scan(start, end, limit):
            self.rows_read += 1
            yield pair

    def write(self, batch: WriteBatch, sync: bool = True) -> None:
        self.inner.write(batch, sync)

    def sync_wal(self) -> None:
        self.inner.sync_wal()

    def close(self) -> None:
        self.inner.close()


class UnlimitedKV(CountingKV):
    """Known bad: a store whose scans ignore their limit."""

    def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        return super().scan(start, end, None)


def _env() -> OpEnv:
    return OpEnv(now_ns=1_700_000_000_000_000_000, caller=Caller(0, 0), chain_tables={1: [11, 12, 13]},
                 stripe_default=3)


def _ref(path: str) -> mpb.PathRef:
    return mpb.PathRef(path=path.encode())


async def _fill(engine: OptimisticTxnEngine, n: int) -> None:
    layout = mpb.Layout(table_id=1, chunk_size=65536)

    async def root(txn: Transaction) -> Any:
        return await Namespace(txn, _env()).ensure_root(0, 0, 0o755, layout)

    await run_transaction(engine, root)

    async def mkdir(txn: Transaction) -> Any:
        return await Namespace(txn, _env()).make_node(_ref("/d"), mpb.DIRECTORY, 0o755, 0, b"", 2)

    await run_transaction(engine, mkdir)
    batch = 500
    for first in range(0, n, batch):
        async def files(txn: Transaction, first: int = first) -> None:
            ns = Namespace(txn, _env())
            for i in range(first, min(n, first + batch)):
                await ns.make_node(_ref(f"/d/f{i:06d}"), mpb.FIFO, 0o644, 0, b"", 100 + i)

        await run_transaction(engine, files)


async def _list_paged(engine: OptimisticTxnEngine) -> list[bytes]:
    names: list[bytes] = []
    start = b""
    while True:
        async def page(txn: Transaction, start: bytes = start) -> mpb.ReadDirRsp:
            return await Namespace(txn, _env()).readdir(_ref("/d"), start, _PAGE, False)

        rsp = await run_transaction(engine, page)
        names += [entry.name for entry in rsp.entries]
        if not rsp.more:
            return names
        start = rsp.entries[-1].name


def _listing_cost(store: CountingKV, n: int) -> int:
    engine = OptimisticTxnEngine(store, sync=False)

    async def main() -> int:
        await _fill(engine, n)
        store.rows_read = 0
        names = await _list_paged(engine)
        assert names == [f"f{i:06d}".encode() for i in range(n)]
        return store.rows_read

    return asyncio.run(main())


@pytest.mark.parametrize("n", [1_000, 4_000])
def test_a_paged_listing_reads_linear_rows(n: int) -> None:
    rows = _listing_cost(CountingKV(MemKVStore()), n)
    assert rows <= _ROWS_PER_ENTRY_MAX * n, f"listing {n} entries read {rows} rows"


def test_a_paged_listing_reads_linear_rows_on_rocksdb(tmp_path: Path) -> None:
    store = RocksKVStore(tmp_path / "db")
    try:
        n = 1_000
        rows = _listing_cost(CountingKV(store), n)
        assert rows <= _ROWS_PER_ENTRY_MAX * n, f"listing {n} entries read {rows} rows"
    finally:
        store.close()


@pytest.mark.parametrize("n", [1_000, 4_000])
def test_the_bound_catches_a_store_that_ignores_limits(n: int) -> None:
    """Known bad: the same listing over scans that ignore their limit breaks the bound (and grows
    quadratically: four times the entries, about sixteen times the rows)."""
    rows = _listing_cost(UnlimitedKV(MemKVStore()), n)
    assert rows > _ROWS_PER_ENTRY_MAX * n
    assert rows >= n * n // (2 * _PAGE)


def test_a_limited_scan_merges_own_writes_before_it_cuts() -> None:
    """The transaction's own deletes and puts are merged before the limit applies: a limit applied
    to the store's rows alone would return a page short of rows (deleted ones dropped after the
    cut) or miss a put that sorts inside the page."""
    store = CountingKV(MemKVStore())
    engine = OptimisticTxnEngine(store, sync=False)

    def key(i: int) -> bytes:
        return b"k" + i.to_bytes(4, "big")

    async def main() -> None:
        async def fill(txn: Transaction) -> None:
            for i in range(0, 100, 2):
                txn.put(key(i), b"stored")

        await run_transaction(engine, fill)
        txn = engine.begin()
        for i in (0, 2, 4, 6):
            txn.delete(key(i))
        txn.put(key(9), b"own")
        txn.put(key(1_000), b"own, past the page")
        store.rows_read = 0
        page = await txn.scan(b"k", b"l", limit=3)
        assert page == [(key(8), b"stored"), (key(9), b"own"), (key(10), b"stored")]
        assert store.rows_read <= 3 + 4  # the page, plus one row for each own delete it may hide
        rest = await txn.scan(key(10) + b"\x00", b"l", limit=1_000)
        assert rest[-1] == (key(1_000), b"own, past the page") and len(rest) == 44 + 1

    asyncio.run(main())


class _OverfullScans:
    """Known bad: a transaction whose scans return more rows than their limit."""

    def __init__(self, inner: Transaction) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        return await self.inner.scan(start, end)


def test_readdir_refuses_an_engine_that_ignores_scan_limits() -> None:
    engine = OptimisticTxnEngine(MemKVStore(), sync=False)

    async def main() -> None:
        await _fill(engine, 20)

        async def page(txn: Transaction) -> mpb.ReadDirRsp:
            return await Namespace(_OverfullScans(txn), _env()).readdir(_ref("/d"), b"", 5, False)

        with pytest.raises(InvariantViolation, match="limited to 6 rows returned 20"):
            await run_transaction(engine, page)

    asyncio.run(main())

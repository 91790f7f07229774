"""Transactions: isolation, conflicts (phantoms included), injected faults, retries.

The engine-agnostic tests take ``make_engine`` (tests/txn_engines.py) and run on the optimistic
engine and on PostgreSQL; the durability ones are the embedded engine's own.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fs3.common.errors import InvalidArgument, MaybeCommitted, TxnConflict
from fs3.common.faults import SABOTAGE_ENV
from fs3.kv.api import Transaction
from fs3.kv.gate import ContentionGate
from fs3.kv.store import MemKVStore, RocksKVStore
from fs3.kv.txn import OptimisticTxnEngine, TxnFaults, run_transaction
from tests.txn_engines import EngineFactory

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_reads_see_own_writes_and_scans_merge(make_engine: EngineFactory) -> None:
    async def body() -> None:
        engine = await make_engine()
        setup = engine.begin()
        for key in (b"d/a", b"d/b", b"d/c"):
            setup.put(key, key.upper())
        await setup.commit()
        txn = engine.begin()
        txn.put(b"d/bb", b"new")
        txn.delete(b"d/c")
        assert await txn.get(b"d/bb") == b"new" and await txn.get(b"d/c") is None
        assert [k for k, _ in await txn.scan(b"d/", b"d0")] == [b"d/a", b"d/b", b"d/bb"]
        assert [k for k, _ in await txn.scan(b"d/", b"d0", limit=2)] == [b"d/a", b"d/b"]
        await txn.commit()
        with pytest.raises(InvalidArgument):
            await txn.get(b"d/a")
        check = engine.begin()
        assert [k for k, _ in await check.scan(b"d/", b"d0")] == [b"d/a", b"d/b", b"d/bb"]
    run(body())


def test_write_after_concurrent_change_of_a_read_key_conflicts(make_engine: EngineFactory) -> None:
    async def body() -> None:
        engine = await make_engine()
        t1, t2 = engine.begin(), engine.begin()
        assert await t1.get(b"counter") is None
        t2.put(b"counter", b"1")
        await t2.commit()
        t1.put(b"counter", b"1")
        with pytest.raises(TxnConflict):
            await t1.commit()
    run(body())


def test_phantom_in_a_scanned_range_conflicts_on_both_engines(make_engine: EngineFactory) -> None:
    """Two transactions each check that a range is empty and insert into it (write skew through
    a phantom): both committing would be no serial order, so one of them conflicts."""
    async def body() -> None:
        engine = await make_engine()
        t1, t2 = engine.begin(), engine.begin()
        assert await t1.scan(b"dir1/", b"dir10") == []
        assert await t2.scan(b"dir1/", b"dir10") == []
        t2.put(b"dir1/x", b"1")
        await t2.commit()
        t1.put(b"dir1/y", b"1")
        with pytest.raises(TxnConflict):
            await t1.commit()
        assert [k for k, _ in await engine.begin().scan(b"dir1/", b"dir10")] == [b"dir1/x"]
    run(body())


def test_phantom_in_a_scanned_range_conflicts_but_disjoint_writes_do_not() -> None:
    """The optimistic engine is stricter than serializability needs: any write into a range a
    transaction scanned fails it, even where an order exists (PostgreSQL lets that one commit)."""
    async def body() -> None:
        engine = OptimisticTxnEngine(MemKVStore())
        t1, t2, t3 = engine.begin(), engine.begin(), engine.begin()
        assert await t1.scan(b"dir1/", b"dir10") == []
        t2.put(b"dir1/x", b"1")  # lands inside t1's scanned range
        await t2.commit()
        t1.put(b"dir1/y", b"1")
        with pytest.raises(TxnConflict):
            await t1.commit()
        await t3.get(b"dir2/z")
        t3.put(b"dir2/z", b"1")
        await t3.commit()  # nothing it read changed
    run(body())


def test_limited_scan_depends_only_on_what_it_returned(make_engine: EngineFactory) -> None:
    async def body() -> None:
        engine = await make_engine()
        setup = engine.begin()
        for key in (b"k1", b"k2", b"k3"):
            setup.put(key, b"v")
        await setup.commit()
        reader, writer = engine.begin(), engine.begin()
        assert [k for k, _ in await reader.scan(b"k", limit=1)] == [b"k1"]
        writer.put(b"k9", b"v")
        await writer.commit()
        reader.put(b"other", b"v")
        await reader.commit()
    run(body())


def test_run_transaction_retries_conflicts_and_maybe_committed(make_engine: EngineFactory) -> None:
    async def body() -> None:
        faults = TxnFaults(conflicts=3, maybe_committed=2)
        engine = await make_engine(faults)
        calls = 0

        async def create_once(txn: Transaction) -> str:
            # Idempotent: a retry after a commit that did apply finds the entry and answers the same.
            nonlocal calls
            calls += 1
            existing = await txn.get(b"entry")
            if existing is not None:
                return existing.decode()
            txn.put(b"entry", b"inode-7")
            return "inode-7"

        assert await run_transaction(engine, create_once) == "inode-7"
        assert await run_transaction(engine, create_once) == "inode-7"
        assert calls >= 6 and engine.conflicts == 3
        check = engine.begin()
        assert await check.scan(b"") == [(b"entry", b"inode-7")]
    run(body())


def test_retry_budget_is_bounded(make_engine: EngineFactory) -> None:
    async def body() -> None:
        engine = await make_engine(TxnFaults(conflict_probability=1.0))

        async def op(txn: Transaction) -> None:
            txn.put(b"k", b"v")

        with pytest.raises(TxnConflict, match="gave up"):
            await run_transaction(engine, op, retry_max=3, backoff_ms=0)
    run(body())


def test_concurrent_increments_are_serializable(make_engine: EngineFactory) -> None:
    async def body() -> None:
        engine = await make_engine()

        async def increment(txn: Transaction) -> None:
            value = int((await txn.get(b"n")) or b"0")
            await asyncio.sleep(0)  # let the others interleave
            txn.put(b"n", str(value + 1).encode())

        await asyncio.gather(*(run_transaction(engine, increment, retry_max=100, backoff_ms=0) for _ in range(25)))
        assert await engine.begin().get(b"n") == b"25"
        assert engine.conflicts > 0
    run(body())


def test_maybe_committed_is_visible_to_callers_that_do_not_retry(make_engine: EngineFactory) -> None:
    async def body() -> None:
        engine = await make_engine(TxnFaults(maybe_committed=1))
        txn = engine.begin()
        txn.put(b"k", b"v")
        with pytest.raises(MaybeCommitted):
            await txn.commit()
        assert await engine.begin().get(b"k") == b"v"  # it did apply
    run(body())


_COMMITTER = r"""
import asyncio, sys
from fs3.kv.store import RocksKVStore
from fs3.kv.txn import OptimisticTxnEngine

async def main() -> None:
    engine = OptimisticTxnEngine(RocksKVStore(sys.argv[1]), sync=sys.argv[2] == "sync")
    for i in range(int(sys.argv[3])):
        txn = engine.begin()
        txn.put(b"inode/%04d" % i, b"x" * 100)
        await txn.commit()
        print(i, flush=True)  # acknowledged
    sys.stdin.read()  # killed here, the store still open

asyncio.run(main())
"""


def _acknowledged_then_power_loss(disk: Any, sync: bool, sabotage: str = "", commits: int = 40) -> int:
    """A child process commits through the engine on the crash disk and is killed with its store
    open; the power goes. Returns how many acknowledged commits the reopened store lost."""
    path = disk.path / "db"
    env = {**os.environ, SABOTAGE_ENV: sabotage}
    child = subprocess.Popen([sys.executable, "-c", _COMMITTER, str(path), "sync" if sync else "async", str(commits)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert child.stdout is not None
    acknowledged = [int(child.stdout.readline()) for _ in range(commits)]
    child.kill()
    child.wait()
    disk.power_cut()
    store = RocksKVStore(path)
    try:
        kept = {key for key, _ in store.scan(b"inode/", b"inode0")}
    finally:
        store.close()
    return sum(1 for i in acknowledged if b"inode/%04d" % i not in kept)


def test_rocksdb_engine_keeps_every_acknowledged_commit_through_a_power_loss(crash_disk: Any) -> None:
    """SIGKILL alone never loses the page cache; on the crash disk the power loss drops whatever
    was not synced — and the engine had synced every commit it acknowledged."""
    assert _acknowledged_then_power_loss(crash_disk, sync=True) == 0


@pytest.mark.parametrize("sync, sabotage", [(False, ""), (True, "kv-sync")], ids=["unsynced-engine", "sabotaged-store"])
def test_the_power_loss_check_sees_commits_acknowledged_before_their_sync(crash_disk: Any, sync: bool,
                                                                         sabotage: str) -> None:
    """The check above can fail: an engine without sync, or a store whose log sync is sabotaged,
    loses acknowledged commits on the same disk."""
    assert _acknowledged_then_power_loss(crash_disk, sync=sync, sabotage=sabotage) > 0


def test_group_commit_shares_wal_syncs_and_acknowledges_only_durable_commits(tmp_path: Path) -> None:
    async def body() -> None:
        store = RocksKVStore(tmp_path / "db")
        engine = OptimisticTxnEngine(store, sync=True)

        async def put(i: int) -> None:
            async def fn(txn: Transaction) -> None:
                txn.put(b"k%04d" % i, b"v")

            await run_transaction(engine, fn)

        await asyncio.gather(*(put(i) for i in range(200)))
        assert engine.commits == 200 and 0 < engine.wal_syncs < 200
        store.close()

        mem = MemKVStore()
        durable = OptimisticTxnEngine(mem, sync=True)

        async def fn(txn: Transaction) -> None:
            txn.put(b"acked", b"1")

        await run_transaction(durable, fn)
        mem.crash()  # everything acknowledged survives a crash
        assert mem.get(b"acked") == b"1"
    run(body())


def test_the_contention_gate_runs_retries_alone_in_arrival_order() -> None:
    async def body() -> None:
        gate = ContentionGate()
        events: list[str] = []
        release = asyncio.Event()

        async def attempt(name: str, exclusive: bool, wait: bool = False) -> None:
            async with gate.hold(exclusive):
                events.append(f"+{name}")
                if wait:
                    await release.wait()
                else:
                    await asyncio.sleep(0)
                events.append(f"-{name}")

        first = [asyncio.create_task(attempt(n, False, wait=True)) for n in ("a", "b")]
        await asyncio.sleep(0)
        retry = asyncio.create_task(attempt("r", True))
        await asyncio.sleep(0)
        late = asyncio.create_task(attempt("c", False))  # queues behind the waiting retry
        cancelled = asyncio.create_task(attempt("x", True))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0.01)
        assert events == ["+a", "+b"]  # both first attempts inside; the retry and c wait
        release.set()
        await asyncio.gather(*first, retry, late)
        assert events[2:] == ["-a", "-b", "+r", "-r", "+c", "-c"]
        assert gate.exclusive_runs == 1

        async def nested() -> None:  # a transaction inside another one's function passes through
            async with gate.hold(True), gate.hold(True):
                events.append("nested")

        await asyncio.wait_for(nested(), 5)
        assert events[-1] == "nested"
        for conflicted in (True, False, False, False, False):  # one conflict in five: side by side
            gate.record(conflicted)
        runs = gate.exclusive_runs
        await attempt("d", False)
        assert gate.exclusive_runs == runs and not gate.contended
        gate.record(True)  # two in six: frequent; first attempts run alone too
        await attempt("e", False)
        assert gate.contended and gate.exclusive_runs == runs + 1
        for _ in range(64):  # the window forgets
            gate.record(False)
        assert not gate.contended
    run(body())

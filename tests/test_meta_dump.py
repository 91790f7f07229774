"""The metadata dump format and its load, on stores alone (fs3/meta/dump.py, fs3/meta/backup.py).

A seeded round trip (random stores -> dump -> read back -> the same pairs), every bad input the
loader must refuse with nothing written, paging and batching (a dump larger than a page streams),
snapshots that do not see later commits (both engines, and RocksDB), and the backup rotation.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fs3 import meta_pb2 as mpb
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient
from fs3.common.errors import InvalidArgument, IoError
from fs3.common.formats import FormatRecord
from fs3.kv.api import Transaction, TxnEngine
from fs3.kv.store import MemKVStore, RocksKVStore, WriteBatch
from fs3.kv.txn import OptimisticTxnEngine, run_transaction
from fs3.meta import schema
from fs3.meta.backup import INODE_ID_GAP, TMP_STALE_S, backup_once, dump_to_file, list_backups, load_dump
from fs3.meta.dump import DumpError, DumpReader, dump_snapshot, is_dumped_key
from fs3.meta.formats import META_FORMAT
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.channel import RealChannelFactory
from tests.txn_engines import EngineFactory

# Keys of every kind meta stores, dumped or not (sessions, leases, saved answers are not).
_EXCLUDED = (b"SESS", b"CSES", b"CLNT", b"CEXP", b"IDEM", b"CLAM", b"MREG")


def _inode(inode_id: int, rng: random.Random, kind: mpb.InodeType | None = None, nlink: int | None = None) -> mpb.Inode:
    kind = kind if kind is not None else rng.choice([mpb.FILE, mpb.DIRECTORY, mpb.SYMLINK])
    return mpb.Inode(inode_id=inode_id, type=kind, mode=rng.randrange(0o7777), uid=rng.randrange(2000),
                     gid=rng.randrange(2000), nlink=nlink if nlink is not None else rng.randrange(1, 4),
                     size=rng.randrange(1 << 40), mtime_ns=rng.randrange(1 << 62),
                     symlink_target=rng.randbytes(rng.randrange(8)) if kind == mpb.SYMLINK else b"",
                     layout=mpb.Layout(chunk_size=1 << 20, chains=[rng.randrange(1, 9)]))


def random_store(rng: random.Random, inodes: int) -> dict[bytes, bytes]:
    """A store with every kind of key; names and values of random bytes (any byte may occur)."""
    data: dict[bytes, bytes] = {}
    for inode_id in rng.sample(range(1, 10 * inodes + 2), inodes):
        data[schema.inode_key(inode_id)] = _inode(inode_id, rng).SerializeToString()
        for _ in range(rng.randrange(3)):
            data[schema.dentry_key(inode_id, rng.randbytes(rng.randrange(1, 12)))] = \
                mpb.DirEntry(inode_id=rng.randrange(1, 1 << 63), type=mpb.FILE).SerializeToString()
        for _ in range(rng.randrange(2)):
            data[schema.xattr_key(inode_id, b"user." + rng.randbytes(4))] = rng.randbytes(rng.randrange(20))
        if rng.random() < 0.3:
            data[schema.size_gen_key(inode_id)] = schema.encode_u64(rng.randrange(5))
        if rng.random() < 0.1:
            data[schema.truncate_key(inode_id)] = rng.randbytes(30)
    for _ in range(rng.randrange(4)):
        data[schema.gc_key(rng.randrange(1 << 63))] = rng.randbytes(30)
    data[schema.counter_key("next_inode")] = schema.encode_u64(10 * inodes + 3)
    data[schema.directory_moves_key()] = schema.encode_u64(rng.randrange(100))
    for _ in range(rng.randrange(3)):
        data[schema.user_key(rng.randbytes(8).hex())] = rng.randbytes(40)
    for prefix in _EXCLUDED:
        data[prefix + rng.randbytes(24)] = rng.randbytes(10)
    return data


def engine_with(data: dict[bytes, bytes]) -> OptimisticTxnEngine:
    store = MemKVStore()
    batch = WriteBatch()
    for key, value in data.items():
        batch.put(key, value)
    store.write(batch)
    return OptimisticTxnEngine(store)


async def dump_lines(engine: OptimisticTxnEngine, page_records: int = 7) -> tuple[list[bytes], Any]:
    lines: list[bytes] = []

    async def emit(line: bytes) -> None:
        lines.append(line)

    reader = await engine.snapshot()
    try:
        stats = await dump_snapshot(reader, emit, "test-cluster", 1234, page_records)
    finally:
        await reader.close()
    return lines, stats


def read_back(lines: list[bytes]) -> dict[bytes, bytes]:
    return {key: value for _, key, value in DumpReader().records(lines)}


def stored(engine: OptimisticTxnEngine) -> dict[bytes, bytes]:
    return dict(engine.store.scan(b""))


@pytest.mark.parametrize("seed", range(20))
def test_random_stores_round_trip(seed: int) -> None:
    """Random store -> dump (small pages) -> read back: exactly the dumped kinds' pairs, in order."""
    rng = random.Random(seed)
    data = random_store(rng, rng.randrange(1, 60))
    lines, stats = asyncio.run(dump_lines(engine_with(data), page_records=rng.randrange(1, 10)))
    expected = {k: v for k, v in data.items() if is_dumped_key(k)}
    assert read_back(lines) == expected, f"seed {seed}"
    assert sum(stats.counts.values()) == len(expected)
    header = json.loads(lines[0])
    assert (header["format"], header["version"], header["schema"], header["cluster_id"]) == \
        ("fs3-meta-dump", 1, 1, "test-cluster")


def test_file_removed_while_open_is_dumped_as_its_gc_job() -> None:
    """An inode without names (kept by sessions, which are not dumped) becomes the GC job its last
    close would have queued; its xattrs and size generation are left out with it."""
    rng = random.Random(5)
    orphan = _inode(40, rng, kind=mpb.FILE, nlink=0)
    data = {schema.inode_key(1): _inode(1, rng, kind=mpb.DIRECTORY, nlink=2).SerializeToString(),
            schema.inode_key(40): orphan.SerializeToString(),
            schema.xattr_key(40, b"user.a"): b"x", schema.size_gen_key(40): schema.encode_u64(2),
            schema.gc_key(30): b"job30", schema.gc_key(50): b"job50"}
    lines, stats = asyncio.run(dump_lines(engine_with(data)))
    got = read_back(lines)
    assert stats.open_removed == 1
    assert schema.inode_key(40) not in got and schema.xattr_key(40, b"user.a") not in got
    assert schema.size_gen_key(40) not in got
    job = schema.GcJob.decode(got[schema.gc_key(40)])
    assert (job.first_chunk, job.length, job.layout) == (0, orphan.size, orphan.layout)
    assert [k for k in got if k.startswith(schema.gc_prefix())] == [schema.gc_key(i) for i in (30, 40, 50)]


def _dump_file(tmp_path: Path, data: dict[bytes, bytes], name: str = "d.dump") -> Path:
    path = tmp_path / name

    async def main() -> None:
        await dump_to_file(await engine_with(data).snapshot(), path, "test-cluster", page_records=5)

    asyncio.run(main())
    return path


def _edit(path: Path, change: Any) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(change(lines)))


def _retype(line: bytes, **fields: Any) -> bytes:
    obj = json.loads(line)
    obj.update(fields)
    return json.dumps(obj).encode() + b"\n"


def _inode_b64(inode_id: int) -> str:
    """A well-formed inode record's value (a crafted dump's)."""
    return base64.b64encode(mpb.Inode(inode_id=inode_id, type=mpb.FILE, mode=0o4777).SerializeToString()).decode()


BAD_INPUTS = {
    "checksum": (lambda ls: [ls[0], _retype(ls[1], v=_inode_b64(json.loads(ls[1])["id"])), *ls[2:]],
                 "checksum mismatch"),
    "garbled inode": (lambda ls: [ls[0], _retype(ls[1], v="AAAA"), *ls[2:]], "not a valid Inode"),
    "inode of another id": (lambda ls: [ls[0], _retype(ls[1], v=_inode_b64(json.loads(ls[1])["id"] + 1)), *ls[2:]],
                            "holds inode"),
    "truncated at a line": (lambda ls: ls[:-3], "cut short"),
    "truncated mid-line": (lambda ls: [*ls[:-2], ls[-2][:10]], "cut short"),
    "format version": (lambda ls: [_retype(ls[0], version=2), *ls[1:]], "format version 2"),
    "schema version": (lambda ls: [_retype(ls[0], schema=9), *ls[1:]], "schema version 9"),
    "not a dump": (lambda ls: [b'{"hello": 1}\n', *ls[1:]], "not an fs3 metadata dump"),
    "repeated record": (lambda ls: [*ls[:2], ls[1], *ls[2:]], "out of order or repeated"),
    "counts": (lambda ls: [*ls[:-1], _retype(ls[-1], records=1)], "do not match"),
    "empty": (lambda ls: [], "empty file"),
    "counter length": (lambda ls: [_retype(line, v="AAAA") if b'"t":"counter"' in line else line for line in ls],
                       "counter value of 3 bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_dump_refused_with_nothing_written(tmp_path: Path, case: str) -> None:
    data = random_store(random.Random(1), 30)
    path = _dump_file(tmp_path, data)
    change, message = BAD_INPUTS[case]
    _edit(path, change)
    target = OptimisticTxnEngine(MemKVStore())
    with pytest.raises(DumpError, match=message) as refused:
        asyncio.run(load_dump(target, path, batch_records=4))
    assert refused.value.message.startswith(f"{path}: ")  # the message names the file
    assert stored(target) == {}


def test_load_refuses_a_non_empty_store(tmp_path: Path) -> None:
    path = _dump_file(tmp_path, random_store(random.Random(2), 10))
    target = engine_with({schema.inode_key(1): b"root"})
    with pytest.raises(InvalidArgument, match="not empty"):
        asyncio.run(load_dump(target, path))
    assert stored(target) == {schema.inode_key(1): b"root"}


def test_dump_and_load_larger_than_a_page_stream(tmp_path: Path) -> None:
    """Pages of at most page_records pairs read, batches of batch_records written: neither holds
    the namespace."""
    data = random_store(random.Random(3), 200)
    dumped = {k: v for k, v in data.items() if is_dumped_key(k)}
    _, stats = asyncio.run(dump_lines(engine_with(data), page_records=16))
    assert stats.page_pairs_max == 16 and stats.pages >= len(dumped) // 16
    path = _dump_file(tmp_path, data)
    target = OptimisticTxnEngine(MemKVStore())
    loaded = asyncio.run(load_dump(target, path, batch_records=25, inode_id_gap=0))
    # The marker of an unfinished load rides in the first batch; the last one deletes it.
    assert loaded.batches == (len(dumped) + 1) // 25 + 1 and loaded.records == len(dumped)
    pairs = stored(target)
    assert FormatRecord.decode(pairs.pop(META_FORMAT.record_key), "t").version == 1  # the dump's meta format
    assert pairs == dumped


def test_load_raises_the_next_inode_id(tmp_path: Path) -> None:
    """Ids the dumped cluster may have handed out after the dump are never handed out again."""
    data = random_store(random.Random(8), 20)
    path = _dump_file(tmp_path, data)
    target = OptimisticTxnEngine(MemKVStore())
    asyncio.run(load_dump(target, path))
    dumped_next = schema.decode_u64(data[schema.counter_key("next_inode")])
    assert schema.decode_u64(stored(target)[schema.counter_key("next_inode")]) == dumped_next + INODE_ID_GAP


class FailingEngine:
    """Commits ``good`` transactions, then one commit fails with an I/O error, then all succeed."""

    def __init__(self, inner: OptimisticTxnEngine, good: int) -> None:
        self.inner, self.good = inner, good

    def begin(self) -> Transaction:
        txn = self.inner.begin()
        if self.good == 0:
            async def fail() -> None:
                raise IoError("disk gone (injected)")
            txn.commit = fail  # type: ignore[method-assign]
        self.good -= 1
        return txn

    async def wait_durable(self) -> None:
        await self.inner.wait_durable()


def test_load_failing_midway_is_rolled_back(tmp_path: Path) -> None:
    path = _dump_file(tmp_path, random_store(random.Random(4), 60))
    inner = OptimisticTxnEngine(MemKVStore())
    engine = FailingEngine(inner, good=4)  # the emptiness check, then three batches
    with pytest.raises(IoError):
        asyncio.run(load_dump(engine, path, batch_records=10))
    assert inner.commits >= 4  # three batches were written, and deleted again
    assert stored(inner) == {}


class DyingEngine(FailingEngine):
    """Commits ``good`` transactions, then none: a load killed midway (its roll-back cannot run either)."""

    def begin(self) -> Transaction:
        self.good = max(self.good, 0)
        return super().begin()


def test_load_killed_midway_leaves_no_inode_id_to_reuse(tmp_path: Path) -> None:
    """What a load cut short leaves (kill -9, a lost disk) already holds the raised next inode id: a
    meta server started on it by mistake never hands out a dumped file's id (hence its chunks)."""
    data = random_store(random.Random(12), 60)
    path = _dump_file(tmp_path, data)
    inner = OptimisticTxnEngine(MemKVStore())
    with pytest.raises(IoError):
        asyncio.run(load_dump(DyingEngine(inner, good=2), path, batch_records=10))  # the check, one batch
    left = stored(inner)
    assert 0 < len(left) <= 10 and schema.LOAD_UNFINISHED in left
    inode_max = max(schema.parse_inode_key(k) for k in data if k.startswith(schema.inode_prefix()))
    assert schema.decode_u64(left.get(schema.counter_key("next_inode"))) > inode_max
    with pytest.raises(InvalidArgument, match="interrupted"):
        asyncio.run(load_dump(inner, path))
    # A meta server refuses to start on what is left: it would serve part of the namespace.
    channels = RealChannelFactory()
    routing = RoutingCache(["127.0.0.1:1"], channels)
    service = MetaService(inner, routing, StorageClient(routing, channels, bytes(16)), MetaServiceConfig())
    with pytest.raises(InvalidArgument, match="did not finish"):
        asyncio.run(service.start(background=False))
    assert stored(inner) == left


def test_a_line_without_end_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """A file of one endless line (damaged, or crafted) is refused without being read whole."""
    import tracemalloc

    path = _dump_file(tmp_path, random_store(random.Random(13), 5))
    with open(path, "r+b") as f:  # the header, then a hole up to 256 MiB: zeros, no newline
        f.truncate(len(path.read_bytes().splitlines(keepends=True)[0]))
        f.truncate(256 << 20)
    target = OptimisticTxnEngine(MemKVStore())
    tracemalloc.start()
    try:
        with pytest.raises(DumpError, match="longer than"):
            asyncio.run(load_dump(target, path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 160 << 20
    assert stored(target) == {}


async def _put(engine: TxnEngine, key: bytes, value: bytes) -> None:
    async def put(txn: Transaction) -> None:
        txn.put(key, value)

    await run_transaction(engine, put)


def test_snapshot_sees_no_later_commit(make_engine: EngineFactory) -> None:
    """Both engines: a snapshot keeps answering as of when it was taken, page after page."""
    async def main() -> None:
        engine = await make_engine()
        for i in range(10):
            await _put(engine, b"k%02d" % i, b"old")
        snap = await engine.snapshot()
        try:
            first = await snap.scan(b"k", b"l", limit=5)
            await _put(engine, b"k07", b"new")
            await _put(engine, b"k99", b"added")
            rest = await snap.scan(first[-1][0] + b"\x00", b"l")
            assert first + rest == [(b"k%02d" % i, b"old") for i in range(10)]
        finally:
            await snap.close()
        with pytest.raises(InvalidArgument, match="closed"):
            await snap.scan(b"k")

    asyncio.run(main())


def test_rocksdb_view_is_a_point_in_time(tmp_path: Path) -> None:
    """RocksDB: the read-only view sees unsynced writes made before it, none after."""
    store = RocksKVStore(tmp_path / "kv")
    try:
        for i in range(5):
            batch = WriteBatch()
            batch.put(b"k%d" % i, b"v")
            store.write(batch, sync=False)
        view = store.snapshot()
        later = WriteBatch()
        later.put(b"k9", b"v")
        later.delete(b"k0")
        store.write(later)
        assert [k for k, _ in view.scan(b"")] == [b"k%d" % i for i in range(5)]
        view.close()
    finally:
        store.close()


def test_backups_keep_the_newest(tmp_path: Path) -> None:
    engine = engine_with(random_store(random.Random(6), 10))
    clock = iter(range(1_000_000_000, 10_000_000_000, 1_000_000_000))

    async def main() -> list[Path]:
        made = []
        for _ in range(4):
            path, _removed = await backup_once(engine.snapshot, tmp_path / "b", 2, "c", now_ns=lambda: next(clock))
            made.append(path)
        return made

    made = asyncio.run(main())
    assert list_backups(tmp_path / "b") == made[-2:]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(p.name for p in made[-2:])  # no .tmp left
    for path in made[-2:]:
        assert read_back(path.read_bytes().splitlines(keepends=True))


def test_backup_removes_what_a_killed_backup_left(tmp_path: Path) -> None:
    """A backup killed while writing leaves NAME.dump.tmp (a partial dump, with the user table's hashes):
    the next backup removes it once stale (TMP_STALE_S untouched); a fresh one may be another writer's."""
    engine = engine_with(random_store(random.Random(14), 5))
    stale = tmp_path / "fs3-meta-20000101T000000.000Z.dump.tmp"
    stale.write_bytes(b"partial")
    long_ago_s = time.time() - TMP_STALE_S - 60
    os.utime(stale, (long_ago_s, long_ago_s))
    later = tmp_path / "fs3-meta-29990101T000000.000Z.dump.tmp"
    later.write_bytes(b"another writer's")
    path, _ = asyncio.run(backup_once(engine.snapshot, tmp_path, keep=2, cluster_id="c"))
    assert path.is_file() and not stale.exists() and later.exists()


def test_dump_does_not_follow_a_link_at_its_temporary_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (tmp_path / "out.dump.tmp").symlink_to(victim)
    with pytest.raises(OSError):
        _dump_file(tmp_path, random_store(random.Random(15), 3), name="out.dump")
    assert victim.read_bytes() == b"keep me" and not (tmp_path / "out.dump").exists()


def test_a_dump_that_cannot_make_its_file_lets_the_snapshot_go(tmp_path: Path) -> None:
    """A backup loop into a directory it cannot write must not keep a snapshot open per attempt."""
    closed: list[bool] = []

    class Reader:
        async def scan(self, start: bytes, end: bytes | None = None,
                       limit: int | None = None) -> list[tuple[bytes, bytes]]:
            return []

        async def close(self) -> None:
            closed.append(True)

    with pytest.raises(FileNotFoundError):
        asyncio.run(dump_to_file(Reader(), tmp_path / "missing" / "x.dump", "c"))
    assert closed == [True]


def failing_snapshots(engine: Any) -> Callable[[], Awaitable[Any]]:
    """A snapshot source of ``engine`` whose snapshots fail every read (a dump that breaks midway)."""
    async def broken() -> Any:
        snap = await engine.snapshot()

        async def scan(*args: Any, **kwargs: Any) -> Any:
            raise IoError("read failed (injected)")
        snap.scan = scan
        return snap

    return broken


def test_failed_backup_removes_nothing(tmp_path: Path) -> None:
    engine = engine_with(random_store(random.Random(7), 10))
    broken = failing_snapshots(engine)

    async def main() -> None:
        await backup_once(engine.snapshot, tmp_path, 1, "c", now_ns=lambda: 10**18)
        with pytest.raises(IoError):
            await backup_once(broken, tmp_path, 1, "c", now_ns=lambda: 2 * 10**18)

    asyncio.run(main())
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in list_backups(tmp_path)]
    assert len(list_backups(tmp_path)) == 1


def dangling_entries(lines: list[bytes]) -> list[bytes]:
    """Entries of the dump that name an inode the dump does not hold."""
    records = list(DumpReader().records(lines))
    inodes = {key[len(schema.inode_prefix()):] for kind, key, _ in records if kind == "inode"}
    return [key for kind, key, value in records if kind == "dentry"
            and mpb.DirEntry.FromString(value).inode_id.to_bytes(8, "big") not in inodes]


class CreatingReader:
    """Reads through ``inner``; just before the first page of entries, a file is created (an
    inode and its entry committed in one batch, as a create does)."""

    def __init__(self, inner: Any, store: MemKVStore) -> None:
        self.inner, self.store, self.created = inner, store, False

    async def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        if start.startswith(schema.dentry_prefix()) and not self.created:
            self.created = True
            batch = WriteBatch()
            batch.put(schema.inode_key(999), mpb.Inode(inode_id=999, type=mpb.FILE, nlink=1).SerializeToString())
            batch.put(schema.dentry_key(1, b"new"), mpb.DirEntry(inode_id=999, type=mpb.FILE).SerializeToString())
            self.store.write(batch)
        return await self.inner.scan(start, end, limit)  # type: ignore[no-any-return]

    async def close(self) -> None:
        pass


class LiveReader:
    """Reads the live store page by page: no snapshot (the sabotage the check must catch)."""

    def __init__(self, store: MemKVStore) -> None:
        self.store = store

    async def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        return list(self.store.scan(start, end, limit))

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("snapshot", [True, False])
def test_a_create_during_the_dump_is_all_in_or_all_out(snapshot: bool) -> None:
    """The dump of a snapshot leaves out a file created after it, inode and entry alike; read
    without one (the sabotage), the entry comes without its inode, and the check says so."""
    rng = random.Random(9)
    data = {schema.inode_key(1): _inode(1, rng, kind=mpb.DIRECTORY, nlink=2).SerializeToString()}
    engine = engine_with(data)
    store = engine.store
    assert isinstance(store, MemKVStore)

    async def main() -> list[bytes]:
        lines: list[bytes] = []

        async def emit(line: bytes) -> None:
            lines.append(line)

        inner = await engine.snapshot() if snapshot else LiveReader(store)
        await dump_snapshot(CreatingReader(inner, store), emit, "c", 0, page_records=2)
        return lines

    lines = asyncio.run(main())
    if snapshot:
        assert dangling_entries(lines) == [] and schema.inode_key(999) not in read_back(lines)
    else:
        assert dangling_entries(lines) == [schema.dentry_key(1, b"new")]


def test_load_then_dump_again_on_either_engine(make_engine: EngineFactory, tmp_path: Path) -> None:
    """Load a dump into an empty store of either engine, dump that store: the same records."""
    data = random_store(random.Random(10), 40)
    path = _dump_file(tmp_path, data)

    async def main() -> list[bytes]:
        engine = await make_engine()
        await load_dump(engine, path, batch_records=16, inode_id_gap=0)
        with pytest.raises(InvalidArgument, match="not empty"):
            await load_dump(engine, path)
        again = tmp_path / "again.dump"
        await dump_to_file(await engine.snapshot(), again, "test-cluster", page_records=6)
        return again.read_bytes().splitlines(keepends=True)

    assert read_back(asyncio.run(main())) == {k: v for k, v in data.items() if is_dumped_key(k)}

"""Versioned store formats (fs3.common.formats, fs3.kv.formats): the open/migrate/refuse rule,
migrations interrupted after every page and resumed, servers racing on one shared store, and a
deliberately broken migration runner that the same comparison catches."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from fs3.common.errors import ChecksumMismatch
from fs3.common.formats import (
    FormatRecord,
    FormatRefused,
    Migration,
    Progress,
    StoreFormat,
    plan_page,
    scan_bounds,
)
from fs3.kv.api import TxnEngine
from fs3.kv.formats import open_kv_format, open_txn_format, release
from fs3.kv.store import MemKVStore, WriteBatch
from fs3.kv.txn import OptimisticTxnEngine
from fs3.meta.formats import META_FORMAT, open_meta_format
from fs3.storage import schema
from fs3.storage.blobs import MemBlobStore
from fs3.storage.chunk_engine import ChunkEngine, ChunkState
from fs3.storage.formats import open_target_format
from tests.txn_engines import EngineFactory

U64 = struct.Struct(">Q")


class Killed(Exception):
    """A process killed at this point (the test's stand-in for kill -9)."""


# -- the rule -----------------------------------------------------------------------------------


def test_a_newer_store_is_refused_with_what_to_install_and_nothing_changes() -> None:
    kv = MemKVStore()
    batch = WriteBatch()
    batch.put(schema.FORMAT_RECORD, FormatRecord("storage-target", 9, "7.1.0").encode())
    batch.put(schema.FORMAT, U64.pack(9))
    batch.put(schema.chunk_key(b"x" * 12), b"from the future")
    kv.write(batch)
    before = dict(kv.scan(b""))
    with pytest.raises(FormatRefused) as info:
        ChunkEngine(kv, MemBlobStore(), where="storage target /data/t1")
    message = str(info.value)
    for part in ("/data/t1", "format 9", "fs3 7.1.0", f"this is fs3 {release()}", "install fs3 7.1.0 or newer"):
        assert part in message, (part, message)
    assert dict(kv.scan(b"")) == before


def test_a_too_old_store_is_refused_and_an_older_one_needs_upgrade_when_upgrading_is_off() -> None:
    kv = MemKVStore()
    batch = WriteBatch()
    batch.put(schema.FORMAT, U64.pack(1))  # a release that wrote the bare marker at version 1
    batch.put(schema.chunk_key(b"a" * 12), ChunkState(commit_version=1, length=3).encode_v2())
    kv.write(batch)
    with pytest.raises(FormatRefused, match="format 1 is older than"):
        ChunkEngine(kv, MemBlobStore())
    kv = _v2_target(5)
    before = dict(kv.scan(b""))
    with pytest.raises(FormatRefused, match=r"format 2 needs upgrading to 3 .*fs3 admin upgrade --config"):
        ChunkEngine(kv, MemBlobStore(), upgrade=False)
    assert dict(kv.scan(b"")) == before
    engine = ChunkEngine(kv, MemBlobStore())  # upgrading on: migrated, then opened
    assert engine.chunk_count == 5
    report = open_target_format(kv, "t", check=True)
    assert (report.found, report.pending) == (3, ())


def test_fresh_stores_are_stamped_current_and_a_record_of_another_kind_is_refused() -> None:
    kv = MemKVStore()
    ChunkEngine(kv, MemBlobStore())
    record = FormatRecord.decode(kv.get(schema.FORMAT_RECORD) or b"", "t")
    assert (record.kind, record.version, record.written_by) == ("storage-target", schema.FORMAT_VERSION, release())
    assert kv.get(schema.FORMAT) == U64.pack(schema.FORMAT_VERSION)  # what older releases read
    wrong = MemKVStore()
    batch = WriteBatch()
    batch.put(schema.FORMAT_RECORD, FormatRecord("meta", 2).encode())
    wrong.write(batch)
    with pytest.raises(FormatRefused, match="a meta store, not a storage-target store"):
        ChunkEngine(wrong, MemBlobStore())


def test_a_corrupt_chunk_record_is_reported_not_misread() -> None:
    kv = MemKVStore()
    ChunkEngine(kv, MemBlobStore())
    key = schema.chunk_key(b"k" * 12)
    good = ChunkState(commit_version=4, length=10, checksum=7).encode()
    assert ChunkState.decode(good).commit_version == 4
    bad = bytearray(good)
    bad[0] ^= 1  # commit_version 4 -> 5: still a plausible state, caught only by the CRC
    batch = WriteBatch()
    batch.put(key, bytes(bad))
    kv.write(batch)
    with pytest.raises(ChecksumMismatch, match="fails its CRC32C"):
        ChunkState.decode(bytes(bad))
    reopened = ChunkEngine(kv, MemBlobStore())
    assert reopened.corrupt_records == 1 and kv.get(key) is None and reopened.get(b"k" * 12) is None


# -- interrupted and resumed ----------------------------------------------------------------------


def _v2_target(chunks: int, seed: int = 1) -> MemKVStore:
    """A storage target as format 2 wrote it: ChunkState records without CRC, and other keys."""
    rng = random.Random(seed)
    kv = MemKVStore()
    batch = WriteBatch()
    batch.put(schema.FORMAT, U64.pack(2))
    batch.put(schema.FLOOR, U64.pack(4096))
    for i in range(chunks):
        chunk_id = rng.randbytes(12)
        channel = (b"client", 3, 9) if i % 4 == 1 else None
        state = ChunkState(commit_version=rng.randrange(1, 99), commit_blob=i + 1, chain_version=2,
                           length=rng.randrange(0, 1 << 20), checksum=rng.randrange(1 << 32),
                           flags=4 if i % 3 == 0 else 0, pending_channel=channel)
        batch.put(schema.chunk_key(chunk_id), state.encode_v2())
        if i % 3 == 0:
            batch.put(schema.inline_key(chunk_id, i + 1), rng.randbytes(20))
    kv.write(batch)
    return kv


class DyingKV:
    """A KV store whose write number ``fail_at`` (1-based) never happens: the process died first."""

    def __init__(self, inner: MemKVStore, fail_at: int) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.writes = 0

    def get(self, key: bytes) -> bytes | None:
        return self.inner.get(key)

    def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        return self.inner.scan(start, end, limit)

    def write(self, batch: WriteBatch, sync: bool = True) -> None:
        self.writes += 1
        if self.writes == self.fail_at:
            raise Killed(f"killed before write {self.writes}")
        self.inner.write(batch, sync)

    def sync_wal(self) -> None:
        self.inner.sync_wal()

    def close(self) -> None:
        pass


def _contents(kv: MemKVStore) -> dict[bytes, bytes]:
    return dict(kv.scan(b""))


def test_storage_migration_killed_after_any_page_resumes_to_the_same_store() -> None:
    """10 chunks in pages of 3: 4 pages. Killed before write k+1 (k pages committed, k = 0..3) and
    killed after the last page: the next open ends with exactly the uninterrupted result."""
    expected_kv = _v2_target(10)
    open_target_format(expected_kv, "t", page_records=3)
    expected = _contents(expected_kv)
    assert all(ChunkState.decode(v) for k, v in expected.items() if k.startswith(schema.CHUNK))
    pages = 4
    for k in range(pages + 1):
        kv = _v2_target(10)
        if k < pages:
            with pytest.raises(Killed):
                open_target_format(DyingKV(kv, k + 1), "t", page_records=3)
            progress = kv.get(schema.FORMAT_MIGRATION)
            assert (progress is None) == (k == 0), k
        else:
            def die(migration: Migration, progress: Progress | None) -> None:
                if progress is None:
                    raise Killed("after the last page")
            with pytest.raises(Killed):
                open_target_format(kv, "t", page_records=3, after_page=die)
        report = open_target_format(kv, "t", page_records=3)
        assert report.found == (3 if k == pages else 2)
        assert _contents(kv) == expected, k


# -- a runner that can be broken, to show the comparison catches it -------------------------------

COUNTED = StoreFormat(kind="counted", current=2, oldest_upgradable=1, record_key=b"!format", progress_key=b"!mig",
                      migrations=(Migration(1, "every record gains one mark (not idempotent)", ((b"r/", b"r0"),),
                                            lambda key, value: [(key, value + b"+")]),))


def _counted_store(records: int) -> MemKVStore:
    kv = MemKVStore()
    batch = WriteBatch()
    for i in range(records):
        batch.put(b"r/%04d" % i, b"v%d" % i)
    batch.put(b"zz", b"not migrated")
    kv.write(batch)
    return kv


def broken_run(kv: MemKVStore, fmt: StoreFormat, page_records: int, fail_at: int, flaw: str) -> None:
    """A migration runner with one flaw: its progress is written in a batch of its own, after the
    page (``twice``: a kill between them applies the page again) or before it (``skip``: the
    page is lost). Killed before write ``fail_at``."""
    dying = DyingKV(kv, fail_at)
    migration = fmt.migration(1)
    raw = kv.get(fmt.progress_key)
    progress: Progress | None = Progress.decode(raw, "t") if raw is not None else Progress(1, 2)
    record = FormatRecord(fmt.kind, 2)
    if kv.get(fmt.record_key) is not None:
        return
    while progress is not None:
        start, end = scan_bounds(migration, progress)
        page = plan_page(fmt, migration, progress, list(kv.scan(start, end, page_records)), page_records, record)
        rewrites = WriteBatch()
        book = WriteBatch()
        for key, value in page.writes:
            target = book if key in (fmt.progress_key, fmt.record_key) else rewrites
            target.put(key, value) if value is not None else target.delete(key)
        for batch in ((rewrites, book) if flaw == "twice" else (book, rewrites)):
            dying.write(batch)
        progress = page.next_progress


def _interrupted_results(run: Callable[[MemKVStore, int], None], kills: Sequence[int]) -> list[dict[bytes, bytes]]:
    """For each kill point: a fresh store, a run killed there, a second (complete) run."""
    results = []
    for fail_at in kills:
        kv = _counted_store(7)
        with pytest.raises(Killed):
            run(kv, fail_at)
        run(kv, 0)
        results.append(_contents(kv))
    return results


def test_the_comparison_catches_a_runner_that_applies_a_page_twice_or_skips_one() -> None:
    reference = _counted_store(7)
    open_kv_format(reference, COUNTED, "t", page_records=3)
    expected = _contents(reference)
    assert expected[b"r/0000"] == b"v0+" and expected[b"zz"] == b"not migrated"

    def correct(kv: MemKVStore, fail_at: int) -> None:
        open_kv_format(DyingKV(kv, fail_at), COUNTED, "t", page_records=3)

    assert _interrupted_results(correct, [1, 2, 3]) == [expected] * 3
    for flaw in ("twice", "skip"):
        def flawed(kv: MemKVStore, fail_at: int, flaw: str = flaw) -> None:
            broken_run(kv, COUNTED, 3, fail_at, flaw)

        results = _interrupted_results(flawed, [2, 4])
        assert any(result != expected for result in results), flaw


# -- transactions, and servers racing on one store ------------------------------------------------


async def _all_pairs(engine: TxnEngine) -> dict[bytes, bytes]:
    txn = engine.begin()
    pairs: dict[bytes, bytes] = {}
    start = b""
    while True:
        page = await txn.scan(start, None, limit=500)
        pairs.update(page)
        if len(page) < 500:
            break
        start = page[-1][0] + b"\x00"
    abandon: Any = getattr(txn, "abandon", None)
    if abandon is not None:
        abandon()
    return pairs


async def _fill(engine: TxnEngine, records: int) -> None:
    """The store holds exactly these records (engines of one test may share a database)."""
    txn = engine.begin()
    for key in await _all_pairs(engine):
        txn.delete(key)
    for i in range(records):
        txn.put(b"r/%04d" % i, b"v%d" % i)
    txn.put(b"zz", b"not migrated")
    await txn.commit()


def test_txn_migration_killed_after_page_k_resumes_and_racing_servers_apply_each_page_once(
        make_engine: EngineFactory) -> None:
    async def main() -> None:
        reference = await make_engine()
        await _fill(reference, 10)
        await open_txn_format(reference, COUNTED, "t", page_records=3)
        expected = await _all_pairs(reference)
        assert expected[b"r/0009"] == b"v9+" and json_version(expected[b"!format"]) == 2
        for k in (1, 2, 4):
            engine = await make_engine()
            await _fill(engine, 10)
            done = [0]

            def die(migration: Migration, progress: Progress | None, k: int = k, done: list[int] = done) -> None:
                done[0] += 1
                if done[0] == k:
                    raise Killed(f"after page {k}")

            with pytest.raises(Killed):
                await open_txn_format(engine, COUNTED, "t", page_records=3, after_page=die)
            await open_txn_format(engine, COUNTED, "t", page_records=3)
            assert await _all_pairs(engine) == expected, k
        # Three servers start together on one store: every page is applied exactly once.
        shared = await make_engine()
        await _fill(shared, 10)
        await asyncio.gather(*(open_txn_format(shared, COUNTED, f"server {i}", page_records=2) for i in range(3)))
        assert await _all_pairs(shared) == expected

    asyncio.run(main())


def json_version(raw: bytes) -> int:
    return FormatRecord.decode(raw, "t").version


def test_meta_store_is_stamped_upgrade_off_refuses_an_unstamped_one_and_a_newer_one_is_refused() -> None:
    async def main() -> None:
        engine = OptimisticTxnEngine(MemKVStore())
        txn = engine.begin()
        txn.put(b"INOD" + (1).to_bytes(8, "big"), b"root")
        await txn.commit()
        with pytest.raises(FormatRefused, match="meta format 1 needs upgrading to 2"):
            await open_meta_format(engine, "meta store /m", upgrade=False)
        assert (await open_meta_format(engine, "meta store /m", check=True)).pending
        report = await open_meta_format(engine, "meta store /m")
        assert report.migrated and report.found == 1
        pairs = await _all_pairs(engine)
        assert json_version(pairs[META_FORMAT.record_key]) == META_FORMAT.current
        assert META_FORMAT.progress_key not in pairs
        # A newer meta store: refused by the service's start, with nothing written.
        txn = engine.begin()
        txn.put(META_FORMAT.record_key, FormatRecord("meta", META_FORMAT.current + 1, "9.0.0").encode())
        await txn.commit()
        before = await _all_pairs(engine)
        with pytest.raises(FormatRefused, match=r"meta format 3 was written by fs3 9\.0\.0.*install fs3 9\.0\.0"):
            await _meta_service(engine).start(background=False)
        assert await _all_pairs(engine) == before

    asyncio.run(main())


# -- dumps ----------------------------------------------------------------------------------------


def _meta_service(engine: OptimisticTxnEngine) -> Any:
    from fs3.client.routing import RoutingCache
    from fs3.client.storage_client import StorageClient
    from fs3.meta.service import MetaService, MetaServiceConfig
    from fs3.rpc.channel import RealChannelFactory

    channels = RealChannelFactory()
    routing = RoutingCache(["127.0.0.1:1"], channels)
    return MetaService(engine, routing, StorageClient(routing, channels, bytes(16)), MetaServiceConfig())


def _set_meta_format(path: Path, meta_format: int | None) -> None:
    """The dump's header as another release wrote it (``None``: before format records), its
    trailer's checksum made right again."""
    lines = path.read_bytes().splitlines(keepends=True)
    header = json.loads(lines[0])
    if meta_format is None:
        header.pop("meta_format")
    else:
        header["meta_format"] = meta_format
    lines[0] = json.dumps(header).encode() + b"\n"
    trailer = json.loads(lines[-1])
    trailer["sha256"] = hashlib.sha256(b"".join(lines[:-1])).hexdigest()
    lines[-1] = json.dumps(trailer).encode() + b"\n"
    path.write_bytes(b"".join(lines))


def test_a_dump_of_an_older_meta_format_loads_and_migrates_and_a_newer_one_is_refused(tmp_path: Path) -> None:
    from fs3.meta.backup import dump_to_file, load_dump
    from fs3.meta.dump import DumpError

    async def main() -> None:
        source = OptimisticTxnEngine(MemKVStore())
        await _meta_service(source).start(background=False)  # a root inode, the store stamped
        path = tmp_path / "meta.dump"
        await dump_to_file(await source.snapshot(), path, "test-cluster")
        assert json.loads(path.read_bytes().splitlines()[0])["meta_format"] == META_FORMAT.current
        _set_meta_format(path, None)  # as the release before format records wrote it
        restored = OptimisticTxnEngine(MemKVStore())
        await load_dump(restored, path)
        assert (await open_meta_format(restored, "restored", check=True)).found == 1
        await _meta_service(restored).start(background=False)  # migrates after the load
        pairs = await _all_pairs(restored)
        assert json_version(pairs[META_FORMAT.record_key]) == META_FORMAT.current
        _set_meta_format(path, META_FORMAT.current + 1)
        empty = OptimisticTxnEngine(MemKVStore())
        with pytest.raises(DumpError, match="written by a newer fs3"):
            await load_dump(empty, path)
        assert await _all_pairs(empty) == {}

    asyncio.run(main())

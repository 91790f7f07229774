"""Format upgrades as an operator meets them: `fs3 admin upgrade` pointed at the wrong place,
damaged format and progress records, and migrations cut short."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from fs3.cli.main import main
from fs3.common.formats import FormatRefused
from fs3.kv.store import MemKVStore, WriteBatch
from fs3.storage import schema
from fs3.storage.blobs import MemBlobStore
from fs3.storage.chunk_engine import ChunkEngine, ChunkState
from fs3.storage.formats import open_target_format

U64 = struct.Struct(">Q")


def _storage_config(root: Path, target: Path) -> Path:
    config = root / "storage.toml"
    config.write_text(f'node_id = 1\n\n[[targets]]\ntarget_id = 101\npath = "{target}"\n')
    config.chmod(0o600)
    return config


@pytest.mark.parametrize("check", [False, True])
def test_upgrade_of_a_store_that_is_not_there_fails_and_creates_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], check: bool) -> None:
    """A typo in the config, or a disk that is not mounted: the offline upgrade must not make
    (and stamp) an empty store where the data should be, and must not report success."""
    target = tmp_path / "not-mounted" / "target-1"
    config = _storage_config(tmp_path, target)
    assert main(["admin", "upgrade", "--config", str(config), *(["--check"] if check else [])]) == 1
    err = capsys.readouterr().err
    assert str(target / "meta") in err and "no RocksDB" in err, err
    assert not (tmp_path / "not-mounted").exists()


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe", b"{", b"[]", b'"x"', b"null", b'{"kind": "storage-target"}',
                                 b'{"kind": "storage-target", "version": 2.9}',
                                 b'{"kind": "storage-target", "version": true}',
                                 b'{"kind": "storage-target", "version": "3"}',
                                 b'{"kind": "storage-target", "version": 0}',
                                 b'{"kind": ["storage-target"], "version": 3}',
                                 b"[" * 100_000])
def test_a_garbage_format_record_is_refused_naming_the_store_and_nothing_changes(raw: bytes) -> None:
    kv = MemKVStore()
    batch = WriteBatch()
    batch.put(schema.FORMAT_RECORD, raw)
    batch.put(schema.FORMAT, U64.pack(3))
    kv.write(batch)
    before = dict(kv.scan(b""))
    with pytest.raises(FormatRefused, match="/data/t9"):
        ChunkEngine(kv, MemBlobStore(), where="storage target /data/t9")
    assert dict(kv.scan(b"")) == before


@pytest.mark.parametrize("progress", [
    b'{"from": 2, "to": 3, "range": 1}', b'{"from": 2, "to": 3, "range": -1}',
    b'{"from": 2, "to": 3, "range": 0, "cursor": 7}', b'{"from": 2, "to": 3, "range": 0, "pages": -4}',
    b'{"from": 2.5, "to": 3}', b"\x00garbage"])
def test_a_garbage_migration_progress_is_refused_naming_the_store_and_nothing_changes(progress: bytes) -> None:
    kv = MemKVStore()
    batch = WriteBatch()
    batch.put(schema.FORMAT, U64.pack(2))
    batch.put(schema.chunk_key(b"c" * 12), ChunkState(commit_version=3, length=0).encode_v2())
    batch.put(schema.FORMAT_MIGRATION, progress)
    kv.write(batch)
    before = dict(kv.scan(b""))
    with pytest.raises(FormatRefused, match="/data/t9"):
        ChunkEngine(kv, MemBlobStore(), where="storage target /data/t9")
    assert dict(kv.scan(b"")) == before


def test_a_migration_stopped_by_a_damaged_record_names_the_store_the_step_and_the_record() -> None:
    """Format 2 had no checksum: a truncated record is found by the migration, whose refusal must say
    which store, which step and which record (a bare record key tells an operator of many targets
    nothing), and leave every committed page in place to resume from."""
    kv = MemKVStore()
    batch = WriteBatch()
    batch.put(schema.FORMAT, U64.pack(2))
    for i in range(5):
        batch.put(schema.chunk_key(bytes([i]) * 12), ChunkState(commit_version=3, length=0).encode_v2())
    batch.put(schema.chunk_key(b"\x09" * 12), b"\x01\x02")
    kv.write(batch)
    with pytest.raises(FormatRefused) as info:
        open_target_format(kv, "storage target /data/t9", page_records=2)
    message = str(info.value)
    for part in ("/data/t9", "format 2 -> 3", (b"\x09" * 12).hex()):
        assert part in message, (part, message)
    progress = kv.get(schema.FORMAT_MIGRATION)
    assert progress is not None and b'"pages": 2' in progress  # the pages before it stay committed


def test_meta_and_mgmtd_sharing_one_fresh_database_each_find_their_store_fresh() -> None:
    """mgmtd may share the meta servers' PostgreSQL database (its keys under ``mgmtd/``): each must
    judge its own store by its own keys. Otherwise a new cluster's meta, started after mgmtd, takes
    mgmtd's keys for an unstamped format-1 namespace and, with upgrade_on_start off, refuses to start."""
    from fs3.kv.txn import OptimisticTxnEngine
    from fs3.meta.formats import META_FORMAT_VERSION, MGMTD_SHARED_PREFIX, open_meta_format
    from fs3.mgmtd.formats import MGMTD_FORMAT_VERSION, open_shared_mgmtd_format
    from fs3.mgmtd.ha import PREFIX

    async def main() -> None:
        for first in ("mgmtd", "meta"):
            engine = OptimisticTxnEngine(MemKVStore())
            opened = []
            for service in (first, "meta" if first == "mgmtd" else "mgmtd"):
                if service == "mgmtd":
                    opened.append(await open_shared_mgmtd_format(engine, "mgmtd store", upgrade=False))
                    txn = engine.begin()
                    txn.put(b"mgmtd/state/chains", b"x")  # what a started mgmtd writes
                    await txn.commit()
                else:
                    opened.append(await open_meta_format(engine, "meta store", upgrade=False))
                    txn = engine.begin()
                    txn.put(b"INOD" + (1).to_bytes(8, "big"), b"root")
                    await txn.commit()
            assert [r.found for r in opened] == [None, None], (first, opened)
            assert MGMTD_SHARED_PREFIX == PREFIX
            for report in (await open_shared_mgmtd_format(engine, "mgmtd store", check=True),
                           await open_meta_format(engine, "meta store", check=True)):
                assert report.found in (META_FORMAT_VERSION, MGMTD_FORMAT_VERSION) and not report.pending

    asyncio.run(main())


def test_an_offline_upgrade_of_a_half_loaded_meta_store_is_refused_and_writes_nothing() -> None:
    """A load cut short leaves part of a dump and its marker: meta's start refuses it with nothing
    written, and so must ``fs3 admin upgrade`` (which stamped it and reported it upgraded)."""
    from fs3.common.errors import InvalidArgument
    from fs3.kv.txn import OptimisticTxnEngine
    from fs3.meta.formats import open_meta_format
    from fs3.meta.schema import LOAD_UNFINISHED

    async def main() -> None:
        store = MemKVStore()
        batch = WriteBatch()
        batch.put(LOAD_UNFINISHED, b"")
        batch.put(b"INOD" + (1).to_bytes(8, "big"), b"root")
        store.write(batch)
        before = dict(store.scan(b""))
        for check in (False, True):
            with pytest.raises(InvalidArgument, match=r"meta store /data/meta/kv: .*fs3 admin load.* did not finish"):
                await open_meta_format(OptimisticTxnEngine(store), "meta store /data/meta/kv", check=check)
        assert dict(store.scan(b"")) == before

    asyncio.run(main())


def test_a_target_migrated_halfway_is_refused_by_the_release_before_format_records() -> None:
    """An upgrade killed midway, then the operator goes back to the previous release: it checks only
    ``v/format`` (it opens 2, refuses anything else) and would read the records already rewritten
    with their CRC as format 2. From the first page on, ``v/format`` names the target format, and the
    format record, which today's code reads first, the one the store is still at."""
    kv = MemKVStore()
    batch = WriteBatch()
    batch.put(schema.FORMAT, U64.pack(2))
    for i in range(5):
        batch.put(schema.chunk_key(bytes([i]) * 12), ChunkState(commit_version=3, length=0).encode_v2())
    kv.write(batch)

    class Killed(Exception):
        pass

    def kill(_migration: object, _progress: object) -> None:
        raise Killed

    with pytest.raises(Killed):
        open_target_format(kv, "t", page_records=2, after_page=kill)
    assert kv.get(schema.FORMAT) != U64.pack(2)  # what the previous release opens
    assert open_target_format(kv, "t", check=True).found == 2
    assert open_target_format(kv, "t", page_records=2).migrated
    assert kv.get(schema.FORMAT) == U64.pack(schema.FORMAT_VERSION)
    assert ChunkEngine(kv, MemBlobStore()).chunk_count == 5


def test_upgrade_of_a_config_several_services_could_read_asks_which_and_changes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """meta's node_id has a default, so a meta config may hold only ``data_dir``, as a mgmtd's may:
    guessed as mgmtd, the upgrade opened meta's store as mgmtd's, stamped a mgmtd format record in
    it and reported it upgraded. A config that more than one service reads needs --service."""
    from fs3.kv.store import RocksKVStore

    store = RocksKVStore(tmp_path / "meta" / "kv")
    batch = WriteBatch()
    batch.put(b"INOD" + (1).to_bytes(8, "big"), b"root")  # meta's, from before format records
    store.write(batch)
    store.close()
    config = tmp_path / "meta.toml"
    config.write_text(f'data_dir = "{tmp_path / "meta"}"\n')
    config.chmod(0o600)
    assert main(["admin", "upgrade", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "--service" in err and "mgmtd" in err and "meta" in err, err
    view = RocksKVStore.open_view(tmp_path / "meta" / "kv")
    try:
        assert dict(view.scan(b"")) == {b"INOD" + (1).to_bytes(8, "big"): b"root"}
    finally:
        view.close()
    assert main(["admin", "upgrade", "--config", str(config), "--service", "meta"]) == 0
    assert "meta format 1, current 2 (upgraded)" in capsys.readouterr().out


def test_a_newer_target_known_only_by_its_bare_marker_is_refused_saying_what_to_install() -> None:
    kv = MemKVStore()
    batch = WriteBatch()
    batch.put(schema.FORMAT, U64.pack(9))  # a newer release's v/format, its record unreadable or absent
    batch.put(schema.chunk_key(b"a" * 12), b"from the future")
    kv.write(batch)
    with pytest.raises(FormatRefused) as info:
        ChunkEngine(kv, MemBlobStore(), where="storage target /srv/t1")
    message = str(info.value)
    assert "install a newer fs3 that reads storage-target format 9" in message and "newer or newer" not in message


def test_a_store_stamped_as_another_kind_is_refused_whichever_opener_reads_it() -> None:
    """A data directory pointed at another service's (meta's data_dir at mgmtd's, or --service
    wrong): each kind keeps its record under its own key, so the kind check never saw the other's
    record, and the opener took the store for an unstamped one of its own and stamped it."""
    from fs3.common.formats import RECORD_KEYS
    from fs3.kv.txn import OptimisticTxnEngine
    from fs3.meta.formats import META_FORMAT, open_meta_format
    from fs3.mgmtd.formats import mgmtd_format, open_mgmtd_format

    assert {"storage-target": schema.FORMAT_RECORD, "mgmtd": mgmtd_format().record_key,
                           "meta": META_FORMAT.record_key} == RECORD_KEYS

    async def main() -> None:
        mgmtd_store = MemKVStore()
        open_mgmtd_format(mgmtd_store, "mgmtd store")
        batch = WriteBatch()
        batch.put(b"node/1", b"x")
        mgmtd_store.write(batch)
        before = dict(mgmtd_store.scan(b""))
        with pytest.raises(FormatRefused, match="meta store /m: this is a mgmtd store, not a meta store"):
            await open_meta_format(OptimisticTxnEngine(mgmtd_store), "meta store /m")
        with pytest.raises(FormatRefused, match="this is a mgmtd store, not a storage-target store"):
            open_target_format(mgmtd_store, "storage target /t")
        assert dict(mgmtd_store.scan(b"")) == before

        meta_store = MemKVStore()
        await open_meta_format(OptimisticTxnEngine(meta_store), "meta store")
        with pytest.raises(FormatRefused, match="this is a meta store, not a mgmtd store"):
            open_mgmtd_format(meta_store, "mgmtd store /g")

    asyncio.run(main())

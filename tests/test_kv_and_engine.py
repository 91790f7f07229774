"""KV stores and the chunk engine: atomic commits, crash semantics, space, exactly-once records."""

from __future__ import annotations

from pathlib import Path

import pytest

from fs3.common.checksum import crc32c
from fs3.common.errors import InvariantViolation, NoSpace
from fs3.kv.store import MemKVStore, RocksKVStore, WriteBatch, open_kv, prefix_end
from fs3.storage.blobs import FileBlobStore, MemBlobStore
from fs3.storage.chunk_engine import ChunkEngine


@pytest.fixture(params=["mem", "rocksdb"])
def kv(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    store = open_kv(request.param, tmp_path / "kv")
    yield store
    store.close()


def test_kv_batches_and_scans(kv) -> None:  # type: ignore[no-untyped-def]
    batch = WriteBatch()
    for key in (b"a/2", b"a/1", b"b/1", b"a/3"):
        batch.put(key, key.upper())
    batch.delete(b"a/3")
    kv.write(batch)
    assert list(kv.scan(b"a/", prefix_end(b"a/"))) == [(b"a/1", b"A/1"), (b"a/2", b"A/2")]
    assert list(kv.scan(b"", limit=1)) == [(b"a/1", b"A/1")]
    assert kv.get(b"a/3") is None and kv.get(b"b/1") == b"B/1"


def test_prefix_end() -> None:
    assert prefix_end(b"ab") == b"ac"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") is None


def test_mem_kv_crash_loses_only_unsynced() -> None:
    kv = MemKVStore()
    durable, loose = WriteBatch(), WriteBatch()
    durable.put(b"k1", b"v1")
    kv.write(durable, sync=True)
    loose.put(b"k2", b"v2")
    kv.write(loose, sync=False)
    kv.crash()
    assert kv.get(b"k1") == b"v1" and kv.get(b"k2") is None


def test_rocksdb_persists_across_reopen(tmp_path: Path) -> None:
    kv = RocksKVStore(tmp_path / "db")
    batch = WriteBatch()
    batch.put(b"x", b"1")
    kv.write(batch)
    kv.close()
    again = RocksKVStore(tmp_path / "db")
    assert again.get(b"x") == b"1"
    again.close()


def _engine(tmp_path: Path | None = None, capacity: int = 1 << 30) -> ChunkEngine:
    if tmp_path is None:
        return ChunkEngine(MemKVStore(), MemBlobStore(capacity))
    return ChunkEngine(RocksKVStore(tmp_path / "meta"), FileBlobStore(tmp_path / "chunks", fsync=False))


def test_stage_commit_and_versions(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    cid = b"chunk-1"
    engine.stage(cid, 1, b"hello", crc32c(b"hello"), 3)
    state = engine.get(cid)
    assert state is not None and state.commit_version == 0 and state.pending_version == 1
    engine.commit(cid, 1, 3, channel=(b"client", 7, 1))
    state = engine.get(cid)
    assert state is not None and (state.commit_version, state.pending_version, state.length) == (1, 0, 5)
    assert engine.read(cid, 1, 1, 3) == b"ell"
    record = engine.channel(b"client", 7)
    assert record is not None and record.seq == 1 and record.commit_version == 1
    with pytest.raises(InvariantViolation):
        engine.stage(cid, 5, b"x", 0, 3)  # pending must be committed + 1
    with pytest.raises(InvariantViolation):
        engine.commit(cid, 2, 3)  # nothing pending
    engine.stage(cid, 2, None, 0, 3)
    assert engine.commit(cid, 2, 3) is None
    assert engine.get(cid) is None and engine.chunk_count == 0


def test_restart_drops_pending_and_keeps_commits(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    engine.stage(b"c", 1, b"one", crc32c(b"one"), 1)
    engine.commit(b"c", 1, 1)
    engine.stage(b"c", 2, b"two", crc32c(b"two"), 1)
    engine.stage(b"new", 1, b"n", crc32c(b"n"), 1)
    engine.close()
    reopened = _engine(tmp_path)
    state = reopened.get(b"c")
    assert state is not None and state.commit_version == 1 and state.pending_version == 0
    assert reopened.read(b"c", 1, 0, 10) == b"one"
    assert reopened.get(b"new") is None
    reopened.close()


def test_replace_and_abort() -> None:
    engine = _engine()
    engine.replace(b"c", 9, 4, b"full", crc32c(b"full"))
    state = engine.get(b"c")
    assert state is not None and state.commit_version == 9 and state.chain_version == 4
    engine.stage(b"c", 10, b"next", crc32c(b"next"), 4)
    engine.abort(b"c", 10)
    state = engine.get(b"c")
    assert state is not None and state.pending_version == 0 and engine.read(b"c", 9, 0, 4) == b"full"
    engine.replace(b"c", 9, 5, b"other", crc32c(b"other"))  # same version, new content (resync)
    assert engine.read(b"c", 9, 0, 5) == b"other"


def test_full_target_is_a_clear_error_and_keeps_committed_data() -> None:
    engine = _engine(capacity=100)
    engine.stage(b"c", 1, b"x" * 60, crc32c(b"x" * 60), 1)
    engine.commit(b"c", 1, 1)
    with pytest.raises(NoSpace):
        engine.stage(b"c", 2, b"y" * 60, crc32c(b"y" * 60), 1)
    state = engine.get(b"c")
    assert state is not None and state.commit_version == 1 and state.pending_version == 0
    assert engine.read(b"c", 1, 0, 60) == b"x" * 60


def test_channel_record_invalidated_by_older_replacement() -> None:
    engine = _engine()
    engine.stage(b"c", 1, b"a", crc32c(b"a"), 1)
    engine.commit(b"c", 1, 1)
    engine.stage(b"c", 2, b"b", crc32c(b"b"), 1)
    engine.commit(b"c", 2, 1, channel=(b"cl", 1, 5))
    assert engine.channel(b"cl", 1) is not None
    engine.replace(b"c", 1, 2, b"a", crc32c(b"a"))  # resync rolled the chunk back
    assert engine.channel(b"cl", 1) is None


def test_real_full_disk_is_no_space_and_loses_nothing(tmp_path: Path) -> None:
    """A target on a 1 MiB tmpfs: writes fail with NO_SPACE, earlier chunks stay readable, no debris."""
    import os
    import subprocess

    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        engine = ChunkEngine(MemKVStore(), FileBlobStore(mount_point, fsync=True))
        engine.stage(b"keep", 1, b"k" * 300_000, crc32c(b"k" * 300_000), 1)
        engine.commit(b"keep", 1, 1)
        with pytest.raises(NoSpace):
            for i in range(10):
                data = bytes([i]) * 300_000
                engine.stage(b"c%d" % i, 1, data, crc32c(data), 1)
                engine.commit(b"c%d" % i, 1, 1)
        assert engine.read(b"keep", 1, 0, 300_000) == b"k" * 300_000
        files = sorted(p.name for p in mount_point.rglob("*") if p.is_file())
        committed = {cid.hex() for cid in engine.all_chunk_ids()}
        assert {name.split(".")[0] for name in files} == committed, "a failed write left a partial file"
        assert all(os.path.getsize(p) == 300_000 for p in mount_point.rglob("*") if p.is_file())
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_pending_chunks_are_tracked_without_a_scan() -> None:
    engine = _engine()
    engine.stage(b"a", 1, b"x", crc32c(b"x"), 1)
    engine.stage(b"b", 1, b"y", crc32c(b"y"), 1)
    assert engine.pending_chunks() == [b"a", b"b"]
    engine.commit(b"a", 1, 1)
    engine.abort(b"b", 1)
    assert engine.pending_chunks() == [] and engine.get(b"b") is None
    engine.stage(b"a", 2, None, 0, 1)
    assert engine.pending_chunks() == [b"a"]
    engine.commit(b"a", 2, 1)
    assert engine.pending_chunks() == [] and engine.chunk_count == 0


def test_tiered_blobs_keep_small_versions_in_the_kv_store(tmp_path: Path) -> None:
    """Small versions are KV records, large ones files; restart recovery and reuse of an
    abandoned version number work across both."""
    from fs3.storage.blobs import TieredBlobStore

    def open_engine() -> tuple[ChunkEngine, FileBlobStore]:
        kv = RocksKVStore(tmp_path / "meta")
        files = FileBlobStore(tmp_path / "chunks", fsync=False)
        return ChunkEngine(kv, TieredBlobStore(kv, files, inline_max_bytes=16)), files

    def files_on_disk() -> list[str]:
        return sorted(p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file())

    engine, _ = open_engine()
    engine.stage(b"c", 1, b"small", crc32c(b"small"), 1)
    engine.commit(b"c", 1, 1)
    assert files_on_disk() == [] and engine.read(b"c", 1, 0, 10) == b"small"
    big = b"x" * 100
    engine.stage(b"c", 2, big, crc32c(big), 1)
    engine.commit(b"c", 2, 1)
    assert files_on_disk() == [f"{b'c'.hex()}.2"] and engine.read(b"c", 2, 90, 20) == b"x" * 10
    engine.stage(b"c", 3, b"lost", crc32c(b"lost"), 1)  # pending at the "crash"
    engine.close()
    engine, _ = open_engine()
    state = engine.get(b"c")
    assert state is not None and (state.commit_version, state.pending_version) == (2, 0)
    engine.stage(b"c", 3, b"kept", crc32c(b"kept"), 1)
    engine.commit(b"c", 3, 1)
    assert engine.read(b"c", 3, 0, 10) == b"kept" and files_on_disk() == []
    engine.stage(b"c", 4, None, 0, 1)
    assert engine.commit(b"c", 4, 1) is None and engine.chunk_count == 0
    assert list(engine.kv.scan(b"b/", prefix_end(b"b/"))) == []
    engine.close()


@pytest.mark.parametrize("inline", [False, True])
def test_patches_commit_in_place_and_a_cut_commit_is_undone_at_restart(tmp_path: Path, inline: bool) -> None:
    """A pending patch touches nothing until commit; a commit cut after the blob was patched (and
    renamed) but before the metadata batch leaves the old version intact after a restart."""
    from fs3.common.checksum import crc32c_patch
    from fs3.storage.blobs import TieredBlobStore

    def open_engine() -> ChunkEngine:
        kv = RocksKVStore(tmp_path / "meta")
        files = FileBlobStore(tmp_path / "chunks", fsync=False)
        return ChunkEngine(kv, TieredBlobStore(kv, files, inline_max_bytes=1 << 20 if inline else 0))

    base = bytes(range(256)) * 64  # 16 KiB
    engine = open_engine()
    engine.stage(b"c", 1, base, crc32c(base), 1)
    engine.commit(b"c", 1, 1)
    new = b"N" * 100
    checksum = crc32c_patch(crc32c(base), len(base), 1000, base[1000:1100], new)
    engine.stage_patch(b"c", 2, 1000, new, base[1000:1100], checksum, 1)
    expected = base[:1000] + new + base[1100:]
    assert engine.read(b"c", 1, 0, len(base)) == base  # the committed version is untouched
    assert engine.read(b"c", 2, 990, 20) == expected[990:1010]  # the pending one is the overlay
    state = engine.commit(b"c", 2, 1)
    assert state is not None and state.checksum == crc32c(expected)
    assert engine.read(b"c", 2, 0, len(base)) == expected
    # Now a commit cut short: the blob is patched and renamed, the metadata still says pending.
    newer = b"Z" * 50
    engine.stage_patch(b"c", 3, 5000, newer, expected[5000:5050],
                       crc32c_patch(crc32c(expected), len(expected), 5000, expected[5000:5050], newer), 1)
    engine.blobs.patch(b"c", 2, 3, 5000, newer)
    engine.close()
    engine = open_engine()
    state = engine.get(b"c")
    assert state is not None and (state.commit_version, state.pending_version) == (2, 0)
    assert engine.read(b"c", 2, 0, len(base)) == expected
    assert list(engine.kv.scan(b"p/", prefix_end(b"p/"))) == []
    # An aborted patch leaves nothing behind either.
    engine.stage_patch(b"c", 3, 0, b"Q", expected[:1], 0, 1)
    engine.abort(b"c", 3)
    assert engine.read(b"c", 2, 0, 3) == expected[:3] and list(engine.kv.scan(b"p/", prefix_end(b"p/"))) == []
    engine.close()


def test_a_deferred_patch_is_synced_before_its_blob_changes_and_lost_whole_in_a_crash() -> None:
    """Hot-path patches are staged and committed unsynced (the replica syncs the log for many at
    once); the engine still never modifies a blob before the patch's undo record is durable, and
    a crash before the caller's sync loses the write whole, never half of it."""
    from fs3.common.checksum import crc32c_patch

    kv, blobs = MemKVStore(), MemBlobStore()
    syncs: list[int] = []
    real_sync = kv.sync_wal

    def counting_sync() -> None:
        syncs.append(1)
        real_sync()

    kv.sync_wal = counting_sync  # type: ignore[method-assign]
    engine = ChunkEngine(kv, blobs)
    base = bytes(range(256)) * 64
    engine.stage(b"c", 1, base, crc32c(base), 1)
    engine.commit(b"c", 1, 1)

    def patch(version: int, offset: int, data: bytes, on: bytes) -> bytes:
        checksum = crc32c_patch(crc32c(on), len(on), offset, on[offset:offset + len(data)], data)
        engine.stage_patch(b"c", version, offset, data, on[offset:offset + len(data)], checksum, 1, defer_sync=True)
        return on[:offset] + data + on[offset + len(data):]

    # Not told the undo record is durable: the commit syncs the log itself before patching.
    expected = patch(2, 100, b"A" * 10, base)
    engine.commit(b"c", 2, 1, defer_sync=True)
    assert len(syncs) == 1
    kv.sync_wal()  # the caller's group sync, before it acknowledges
    # Told it is (the caller synced after staging): no sync of its own.
    expected = patch(3, 200, b"B" * 10, expected)
    kv.sync_wal()
    engine.commit(b"c", 3, 1, defer_sync=True, patch_synced=True)
    assert len(syncs) == 3
    # A crash after a deferred commit but before the caller's sync: the write is gone whole.
    patch(4, 300, b"C" * 10, expected)
    engine.commit(b"c", 4, 1, defer_sync=True)  # syncs the undo record, not the commit
    kv.crash()
    blobs.crash()
    engine = ChunkEngine(kv, blobs)
    state = engine.get(b"c")
    assert state is not None and state.commit_version == 3 and not state.pending_version
    assert engine.read(b"c", 3, 0, len(base)) == expected

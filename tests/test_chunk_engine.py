"""The chunk engine: versions never reused, atomic commits, where bytes live, exactly-once records,
crash and full-disk behaviour. Crashes are simulated with stores that lose unsynced writes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fs3.common.checksum import crc32c, crc32c_patch
from fs3.common.errors import InvariantViolation, IoError, NoSpace
from fs3.common.formats import FormatRefused
from fs3.kv.api import prefix_end
from fs3.kv.store import MemKVStore, RocksKVStore, WriteBatch
from fs3.storage.blobs import FileBlobStore, MemBlobStore
from fs3.storage.chunk_engine import ChannelRecord, ChunkEngine


def _engine(tmp_path: Path | None = None, capacity: int = 1 << 30, inline: int = 0) -> ChunkEngine:
    if tmp_path is None:
        return ChunkEngine(MemKVStore(), MemBlobStore(capacity), inline_max_bytes=inline)
    return ChunkEngine(RocksKVStore(tmp_path / "meta"), FileBlobStore(tmp_path / "chunks", fsync=False),
                       inline_max_bytes=inline)


def _write(engine: ChunkEngine, chunk: bytes, data: bytes | None, channel: tuple[bytes, int, int] | None = None,
           now_ms: int = 0) -> int:
    """Stage and commit one version the way a head does; returns its version."""
    version = engine.new_version()
    engine.stage(chunk, version, data, crc32c(data) if data is not None else 0, 1, channel)
    engine.commit(chunk, version, 1, now_ms=now_ms)
    return version


@pytest.mark.parametrize("inline", [0, 1 << 20])
def test_stage_commit_and_versions(tmp_path: Path, inline: int) -> None:
    engine = _engine(tmp_path, inline=inline)
    cid = b"chunk-1"
    v1 = engine.new_version()
    engine.stage(cid, v1, b"hello", crc32c(b"hello"), 3, (b"client", 7, 1))
    state = engine.get(cid)
    assert state is not None and state.commit_version == 0 and state.pending_version == v1
    engine.commit(cid, v1, 3)
    state = engine.get(cid)
    assert state is not None and (state.commit_version, state.pending_version, state.length) == (v1, 0, 5)
    assert state.commit_inline == bool(inline)
    assert engine.read(cid, v1, 1, 3) == b"ell" and engine.read(cid, v1, 3, 100) == b"lo"
    record = engine.channel(b"client", 7)
    assert record is not None and record.seq == 1 and record.commit_version == v1
    with pytest.raises(InvariantViolation):
        engine.stage(cid, v1, b"x", 0, 3)  # a pending version must be newer than the committed one
    with pytest.raises(InvariantViolation):
        engine.commit(cid, v1 + 1, 3)  # nothing pending
    with pytest.raises(IoError):
        engine.read(cid, v1 + 5, 0, 1)  # a version this target does not hold
    v2 = engine.new_version()
    engine.stage(cid, v2, None, 0, 3)
    assert engine.commit(cid, v2, 3) is None
    assert engine.get(cid) is None and engine.chunk_count == 0 and engine.used_bytes == 0
    # A new life of the same chunk id never reuses a number of the old one.
    assert _write(engine, cid, b"again") > v2
    engine.close()


def test_version_numbers_are_never_reused_across_restarts_and_crashes() -> None:
    kv, blobs = MemKVStore(), MemBlobStore()
    engine = ChunkEngine(kv, blobs)
    handed_out = [engine.new_version() for _ in range(3000)]  # crosses several reservation blocks
    engine.stage(b"c", handed_out[-1], b"lost", crc32c(b"lost"), 1)  # pending at the crash, never synced
    kv.crash()
    blobs.crash()
    engine = ChunkEngine(kv, blobs)
    assert engine.new_version() > max(handed_out)
    engine.observe_version(10**9)  # a version that arrived from the chain
    assert engine.new_version() > 10**9


def test_restart_drops_pending_and_keeps_commits(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    v1 = _write(engine, b"c", b"one")
    v2 = engine.new_version()
    engine.stage(b"c", v2, b"two", crc32c(b"two"), 1)
    engine.stage(b"new", engine.new_version(), b"n", crc32c(b"n"), 1)
    engine.close()
    reopened = _engine(tmp_path)
    state = reopened.get(b"c")
    assert state is not None and state.commit_version == v1 and state.pending_version == 0
    assert reopened.read(b"c", v1, 0, 10) == b"one"
    assert reopened.get(b"new") is None
    assert sorted(p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file()) == \
        [f"{b'c'.hex()}.{state.commit_blob}"], "a dropped pending version left its file behind"
    reopened.close()


def test_install_and_abort() -> None:
    engine = _engine()
    engine.install(b"c", 9, 4, b"full", crc32c(b"full"))
    state = engine.get(b"c")
    assert state is not None and state.commit_version == 9 and state.chain_version == 4
    v = engine.new_version()
    assert v > 9, "an installed version raises the counter"
    engine.stage(b"c", v, b"next", crc32c(b"next"), 4)
    engine.abort(b"c", v)
    state = engine.get(b"c")
    assert state is not None and state.pending_version == 0 and engine.read(b"c", 9, 0, 4) == b"full"
    engine.install(b"c", 9, 5, b"other", crc32c(b"other"))  # same version, other content (a resync)
    assert engine.read(b"c", 9, 0, 5) == b"other"
    engine.install(b"c", 10, 5, None, 0)
    assert engine.get(b"c") is None


def test_a_full_disk_is_no_space_and_keeps_committed_data() -> None:
    engine = _engine(capacity=100)
    v1 = _write(engine, b"c", b"x" * 60)
    with pytest.raises(NoSpace):
        engine.stage(b"c", engine.new_version(), b"y" * 60, crc32c(b"y" * 60), 1)
    state = engine.get(b"c")
    assert state is not None and state.commit_version == v1 and state.pending_version == 0
    assert engine.read(b"c", v1, 0, 60) == b"x" * 60


def test_a_full_chunk_replace_on_a_full_disk_keeps_the_committed_copy() -> None:
    """A resync replacing a chunk with another copy of the same version must not delete the copy
    it replaces before the new one is written: out of space in between, the replica would be empty."""
    engine = _engine(capacity=100)
    v1 = _write(engine, b"c", b"x" * 60)
    with pytest.raises(NoSpace):
        engine.install(b"c", v1, 2, b"y" * 60, crc32c(b"y" * 60))
    state = engine.get(b"c")
    assert state is not None and state.commit_version == v1 and engine.read(b"c", v1, 0, 60) == b"x" * 60


def test_exactly_once_records_do_not_depend_on_the_chunk() -> None:
    """A request's answer stays the answer whatever happens to the chunk afterwards: removed,
    written again by someone else, or rolled back by a resync."""
    engine = _engine()
    v1 = _write(engine, b"c", b"a", channel=(b"A", 1, 5))
    _write(engine, b"c", None, channel=(b"B", 1, 1))  # another client removes the chunk
    record = engine.channel(b"A", 1)
    assert record is not None and (record.seq, record.commit_version, record.length) == (5, v1, 1)
    removal = engine.channel(b"B", 1)
    assert removal is not None and removal.seq == 1 and removal.commit_version == 0
    _write(engine, b"c", b"bb", channel=(b"C", 1, 1))  # and a third writes it again
    assert engine.channel(b"B", 1) == removal and engine.channel(b"A", 1) == record


def test_a_late_commit_never_replaces_a_newer_answer() -> None:
    engine = _engine()
    v_old = engine.new_version()
    engine.stage(b"c", v_old, b"old", crc32c(b"old"), 1, (b"A", 1, 5))
    _write(engine, b"d", b"new", channel=(b"A", 1, 6))  # the channel's next request committed first
    engine.commit(b"c", v_old, 1)  # e.g. a head completing the abandoned pending version later
    record = engine.channel(b"A", 1)
    assert record is not None and record.seq == 6 and record.chunk_id == b"d"


def test_records_merge_forget_and_expire(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    _write(engine, b"c", b"a", channel=(b"A", 1, 5), now_ms=1_000)
    _write(engine, b"c", b"b", channel=(b"B", 2, 1), now_ms=2_000)
    # A predecessor's records: the newer of two records of one channel wins.
    merged = engine.merge_channels([(b"A", 1, ChannelRecord(4, 1, 1, 1, b"c")), (b"B", 2, ChannelRecord(3, 9, 1, 1)),
                                    (b"D", 1, ChannelRecord(1, 9, 1, 1))], now_ms=3_000)
    assert merged == 2
    assert engine.channel(b"A", 1).seq == 5 and engine.channel(b"B", 2).seq == 3  # type: ignore[union-attr]
    # Expiry drops what is older than the TTL, oldest first, in bounded steps.
    assert engine.expire_channels(now_ms=1_500 + 10_000, ttl_ms=10_000, limit=1) == 1
    assert engine.channel(b"A", 1) is None and engine.channel(b"B", 2) is not None
    engine.close()
    # Loaded records are aged from the first expiry pass after the restart, never from before it.
    engine = _engine(tmp_path)
    assert engine.channel_count == 2
    assert engine.expire_channels(now_ms=50, ttl_ms=10_000) == 0
    assert engine.expire_channels(now_ms=10_000, ttl_ms=10_000) == 0
    assert engine.expire_channels(now_ms=10_051, ttl_ms=10_000) == 2
    assert engine.channel_count == 0
    engine.close()
    engine = _engine(tmp_path)
    assert engine.channel_count == 0, "expired records came back after a restart"
    _write(engine, b"c", b"x", channel=(b"E", 1, 1))
    engine.forget_channels(page=1)
    assert engine.channel_count == 0 and engine.channel(b"E", 1) is None
    engine.close()


def test_inline_and_file_versions_live_where_the_metadata_says(tmp_path: Path) -> None:
    def open_engine() -> ChunkEngine:
        return ChunkEngine(RocksKVStore(tmp_path / "meta"), FileBlobStore(tmp_path / "chunks", fsync=False),
                           inline_max_bytes=16)

    def files_on_disk() -> list[str]:
        return sorted(p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file())

    engine = open_engine()
    v1 = _write(engine, b"c", b"small")
    assert files_on_disk() == [] and engine.read(b"c", v1, 0, 10) == b"small"
    big = b"x" * 100
    v2 = _write(engine, b"c", big)
    state = engine.get(b"c")
    assert state is not None and not state.commit_inline
    assert files_on_disk() == [f"{b'c'.hex()}.{state.commit_blob}"] and engine.read(b"c", v2, 90, 20) == b"x" * 10
    assert list(engine.kv.scan(b"b/", prefix_end(b"b/"))) == [], "the small version's record outlived it"
    v3 = _write(engine, b"c", b"kept")
    assert engine.read(b"c", v3, 0, 10) == b"kept" and files_on_disk() == []
    _write(engine, b"c", None)
    assert engine.chunk_count == 0 and list(engine.kv.scan(b"b/", prefix_end(b"b/"))) == []
    engine.close()


def test_leftovers_no_metadata_names_are_deleted_at_open(tmp_path: Path) -> None:
    """A crash between writing a version's bytes and the batch that names it leaves an inline
    record or a file behind: deleted at open, and never read as a later version."""
    engine = ChunkEngine(RocksKVStore(tmp_path / "meta"), FileBlobStore(tmp_path / "chunks", fsync=False),
                         inline_max_bytes=16)
    v1 = _write(engine, b"c", b"z" * 100)
    blob = engine.new_blob()
    engine.files.write(b"c", blob, b"stale file")
    stray = WriteBatch()
    stray.put(b"b/" + b"c" + (blob + 1).to_bytes(8, "big"), b"stale record")
    engine.kv.write(stray)
    engine.close()
    engine = ChunkEngine(RocksKVStore(tmp_path / "meta"), FileBlobStore(tmp_path / "chunks", fsync=False),
                         inline_max_bytes=16)
    assert list(engine.kv.scan(b"b/", prefix_end(b"b/"))) == []
    state = engine.get(b"c")
    assert state is not None and [p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file()] == \
        [f"{b'c'.hex()}.{state.commit_blob}"]
    assert engine.new_blob() > blob + 1, "a blob number found on disk is never handed out again"
    v2 = _write(engine, b"c", b"q" * 5)
    assert engine.read(b"c", v2, 0, 10) == b"q" * 5 and v2 > v1
    engine.close()


def test_power_loss_after_a_commit_leaves_no_stale_small_version() -> None:
    """The old inline record goes in the commit batch itself: after a power loss either the old
    version is committed and readable, or the new one — never a record the metadata does not name."""
    kv, blobs = MemKVStore(), MemBlobStore()
    engine = ChunkEngine(kv, blobs, inline_max_bytes=1 << 20)
    v1 = _write(engine, b"c", b"first")
    v2 = engine.new_version()
    engine.stage(b"c", v2, b"second", crc32c(b"second"), 1)
    engine.commit(b"c", v2, 1, defer_sync=True)  # the caller's group sync never ran
    kv.crash()
    blobs.crash()
    engine = ChunkEngine(kv, blobs, inline_max_bytes=1 << 20)
    state = engine.get(b"c")
    assert state is not None and state.commit_version == v1 and engine.read(b"c", v1, 0, 10) == b"first"
    assert len(list(kv.scan(b"b/", prefix_end(b"b/")))) == 1
    # Removed, then written again larger than the inline limit: the new bytes, not a leftover.
    _write(engine, b"c", None)
    engine.inline_max_bytes = 4
    v4 = _write(engine, b"c", b"a larger version")
    assert engine.read(b"c", v4, 0, 100) == b"a larger version"
    assert list(kv.scan(b"b/", prefix_end(b"b/"))) == []


@pytest.mark.parametrize("how", ["commit", "commit_written", "install", "install_written", "remove"])
def test_a_deferred_commit_keeps_the_replaced_blob_until_the_log_is_synced(how: str) -> None:
    """A commit made with ``defer_sync`` (the replica's group commit) may still be lost in a crash
    until the log is synced, and then the metadata names the old version's blob again: that blob
    must not be deleted before the sync. (It once was, at once: a power loss in that window left a
    committed, acknowledged version whose file was gone — IO_ERROR on read.)"""
    kv, blobs = MemKVStore(), MemBlobStore()
    engine = ChunkEngine(kv, blobs)
    v1 = _write(engine, b"c", b"acknowledged" * 10)
    v2 = engine.new_version()
    data = b"in flight" * 10
    blob = 0
    if how.endswith("_written"):
        blob = engine.new_blob()
        engine.write_blob(b"c", blob, data)
    if how.startswith("commit"):
        engine.stage(b"c", v2, data, crc32c(data), 1, written_blob=blob)
        engine.commit(b"c", v2, 1, defer_sync=True)
    elif how == "remove":
        engine.stage(b"c", v2, None, 0, 1)
        engine.commit(b"c", v2, 1, defer_sync=True)
    else:
        engine.install(b"c", v2, 1, data, crc32c(data), written_blob=blob, defer_sync=True)
    kv.crash()  # before the caller's log sync
    blobs.crash()
    engine = ChunkEngine(kv, blobs)
    state = engine.get(b"c")
    assert state is not None and state.commit_version == v1
    assert engine.read(b"c", v1, 0, 1000) == b"acknowledged" * 10
    # With the sync, the replaced blob goes (and only then).
    v3 = engine.new_version()
    engine.stage(b"c", v3, data, crc32c(data), 1)
    engine.commit(b"c", v3, 1, defer_sync=True)
    assert (b"c", state.commit_blob) in set(blobs.list())
    engine.sync_log()
    assert set(blobs.list()) == {(b"c", engine.get(b"c").commit_blob)}  # type: ignore[union-attr]


def test_pending_chunks_are_tracked_without_a_scan() -> None:
    engine = _engine()
    va, vb = engine.new_version(), engine.new_version()
    engine.stage(b"a", va, b"x", crc32c(b"x"), 1)
    engine.stage(b"b", vb, b"y", crc32c(b"y"), 1)
    assert engine.pending_chunks() == [b"a", b"b"]
    engine.commit(b"a", va, 1)
    engine.abort(b"b", vb)
    assert engine.pending_chunks() == [] and engine.get(b"b") is None
    vr = engine.new_version()
    engine.stage(b"a", vr, None, 0, 1)
    assert engine.pending_chunks() == [b"a"]
    engine.commit(b"a", vr, 1)
    assert engine.pending_chunks() == [] and engine.chunk_count == 0


@pytest.mark.parametrize("inline", [False, True])
def test_patches_commit_in_place_and_a_cut_commit_is_undone_at_restart(tmp_path: Path, inline: bool) -> None:
    """A pending patch touches nothing until commit; a file blob's commit cut after the blob was
    patched (and renamed) but before the metadata batch leaves the old version intact after a restart."""
    def open_engine() -> ChunkEngine:
        return ChunkEngine(RocksKVStore(tmp_path / "meta"), FileBlobStore(tmp_path / "chunks", fsync=False),
                           inline_max_bytes=1 << 20 if inline else 0)

    base = bytes(range(256)) * 64  # 16 KiB
    engine = open_engine()
    _write(engine, b"c", base)
    new = b"N" * 100
    checksum = crc32c_patch(crc32c(base), len(base), 1000, base[1000:1100], new)
    v2 = engine.new_version()
    engine.stage_patch(b"c", v2, 1000, new, base[1000:1100], checksum, 1)
    expected = base[:1000] + new + base[1100:]
    state = engine.get(b"c")
    assert state is not None
    assert engine.read(b"c", state.commit_version, 0, len(base)) == base  # the committed version is untouched
    assert engine.read(b"c", v2, 990, 20) == expected[990:1010]  # the pending one is the overlay
    committed = engine.commit(b"c", v2, 1)
    assert committed is not None and committed.checksum == crc32c(expected)
    assert engine.read(b"c", v2, 0, len(base)) == expected
    if not inline:
        assert list(engine.kv.scan(b"p/", prefix_end(b"p/"))) == []
    # Now a commit cut short: the blob is patched and renamed, the metadata still says pending.
    newer = b"Z" * 50
    v3 = engine.new_version()
    engine.stage_patch(b"c", v3, 5000, newer, expected[5000:5050],
                       crc32c_patch(crc32c(expected), len(expected), 5000, expected[5000:5050], newer), 1)
    pending = engine.get(b"c")
    assert pending is not None
    if not inline:
        engine.files.patch(b"c", pending.commit_blob, pending.pending_blob, 5000, newer)
    engine.close()
    engine = open_engine()
    state = engine.get(b"c")
    assert state is not None and (state.commit_version, state.pending_version) == (v2, 0)
    assert engine.read(b"c", v2, 0, len(base)) == expected
    assert list(engine.kv.scan(b"p/", prefix_end(b"p/"))) == []
    # An aborted patch leaves nothing behind either.
    v4 = engine.new_version()
    engine.stage_patch(b"c", v4, 0, b"Q", expected[:1], 0, 1)
    engine.abort(b"c", v4)
    assert engine.read(b"c", v2, 0, 3) == expected[:3] and list(engine.kv.scan(b"p/", prefix_end(b"p/"))) == []
    engine.close()


def test_a_deferred_patch_is_synced_before_its_blob_changes_and_lost_whole_in_a_crash() -> None:
    """Hot-path patches are staged and committed unsynced (the replica syncs the log for many at
    once); the engine still never modifies a blob before the patch's undo record is durable, and
    a crash before the caller's sync loses the write whole, never half of it."""
    kv, blobs = MemKVStore(), MemBlobStore()
    syncs: list[int] = []
    real_sync = kv.sync_wal

    def counting_sync() -> None:
        syncs.append(1)
        real_sync()

    kv.sync_wal = counting_sync  # type: ignore[method-assign]
    engine = ChunkEngine(kv, blobs)
    base = bytes(range(256)) * 64
    _write(engine, b"c", base)

    def patch(offset: int, data: bytes, on: bytes) -> tuple[int, bytes]:
        version = engine.new_version()
        checksum = crc32c_patch(crc32c(on), len(on), offset, on[offset:offset + len(data)], data)
        engine.stage_patch(b"c", version, offset, data, on[offset:offset + len(data)], checksum, 1, defer_sync=True)
        return version, on[:offset] + data + on[offset + len(data):]

    # Not told the undo record is durable: the commit syncs the log itself before patching.
    v2, expected = patch(100, b"A" * 10, base)
    engine.commit(b"c", v2, 1, defer_sync=True)
    assert len(syncs) == 1
    kv.sync_wal()  # the caller's group sync, before it acknowledges
    # Told it is (the caller synced after staging): no sync of its own.
    v3, expected = patch(200, b"B" * 10, expected)
    kv.sync_wal()
    engine.commit(b"c", v3, 1, defer_sync=True, patch_synced=True)
    assert len(syncs) == 3
    # A crash after a deferred commit but before the caller's sync: the write is gone whole.
    v4, _ = patch(300, b"C" * 10, expected)
    engine.commit(b"c", v4, 1, defer_sync=True)  # syncs the undo record, not the commit
    kv.crash()
    blobs.crash()
    engine = ChunkEngine(kv, blobs)
    state = engine.get(b"c")
    assert state is not None and state.commit_version == v3 and not state.pending_version
    assert engine.read(b"c", v3, 0, len(base)) == expected


def test_new_blob_names_are_made_durable_with_their_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Syncing a blob syncs its directory entry too: metadata must never name a file that a power
    loss can take away."""
    synced_dirs: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            synced_dirs.append(path)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store = FileBlobStore(tmp_path / "chunks", fsync=True)
    store.write(b"\x01\x02", 7, b"data")
    store.sync(b"\x01\x02", 7)
    assert str(tmp_path / "chunks" / "02") in synced_dirs


def test_an_old_format_target_is_refused_with_a_clear_error() -> None:
    kv = MemKVStore()
    old = WriteBatch()
    old.put(b"c/" + b"chunk", b"\x00" * 49)
    kv.write(old)
    with pytest.raises(FormatRefused, match="format 1 is older than"):
        ChunkEngine(kv, MemBlobStore())


def test_real_full_disk_is_no_space_and_loses_nothing(tmp_path: Path) -> None:
    """A target on a 1 MiB tmpfs: writes fail with NO_SPACE, earlier chunks stay readable, no debris."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        engine = ChunkEngine(MemKVStore(), FileBlobStore(mount_point, fsync=True))
        keep = _write(engine, b"keep", b"k" * 300_000)
        with pytest.raises(NoSpace):
            for i in range(10):
                _write(engine, b"c%d" % i, bytes([i]) * 300_000)
        assert engine.read(b"keep", keep, 0, 300_000) == b"k" * 300_000
        live = {(cid.hex(), str(state.commit_blob)) for cid, state in engine.states().items()}
        files = {tuple(p.name.split(".")) for p in mount_point.rglob("*") if p.is_file()}
        assert files == live, "a failed write left a partial file"
        assert all(os.path.getsize(p) == 300_000 for p in mount_point.rglob("*") if p.is_file())
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_lost_committed_copy_is_dropped_at_open_not_fatal() -> None:
    """A pending patch whose blobs are both gone cannot be undone: the chunk is forgotten (the
    resync of every restarted target brings it back) instead of the target failing to start."""
    kv, blobs = MemKVStore(), MemBlobStore()
    engine = ChunkEngine(kv, blobs)
    base = b"b" * 4096
    _write(engine, b"c", base)
    _write(engine, b"d", b"kept")
    v = engine.new_version()
    engine.stage_patch(b"c", v, 0, b"X", b"b", crc32c_patch(crc32c(base), len(base), 0, b"b", b"X"), 1)
    state = engine.get(b"c")
    assert state is not None
    blobs.delete(b"c", state.commit_blob)
    engine = ChunkEngine(kv, blobs)
    assert engine.get(b"c") is None and engine.get(b"d") is not None

@pytest.mark.parametrize("inline", [0, 1 << 20])
def test_every_staged_version_keeps_the_reserve_free(inline: int) -> None:
    """``reserve_bytes`` holds for a small file version staged on the event loop too, not only for
    the large ones written by the I/O pool and the inline ones."""
    engine = ChunkEngine(MemKVStore(), MemBlobStore(10_000), inline_max_bytes=inline, reserve_bytes=9_000)
    version = engine.new_version()
    with pytest.raises(NoSpace):
        engine.stage(b"c", version, b"x" * 2_000, crc32c(b"x" * 2_000), 1)
    assert engine.get(b"c") is None

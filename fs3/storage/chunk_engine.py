"""Per-target chunk metadata and data.

Every chunk has a committed version and at most one pending version ``u = v + 1`` (the CRAQ
write in flight). Metadata lives in a KV store (RocksDB on disk), data in a :class:`BlobStore`,
one immutable blob per version. Commit is atomic: the new version's data is synced first, then
one KV write batch switches the metadata (and records the client channel's result for
exactly-once retries), then the old version's blob is deleted. A crash at any point leaves
either the old or the new version committed, never a mix. A cache of all metadata is kept in
memory, as 3FS does.

A small write inside a chunk may instead be staged as a *patch* (:meth:`ChunkEngine.stage_patch`):
the pending version is the committed one with a few bytes overwritten, recorded with the old
bytes. Commit patches the committed blob in place and renames it to the new version before the
metadata batch; a restart with the patch still pending puts the old bytes back.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace

from fs3.common.errors import NoSpace
from fs3.common.invariant import ensure
from fs3.kv.store import KVStore, WriteBatch, prefix_end
from fs3.storage.blobs import BlobStore

__all__ = ["ChannelRecord", "ChunkEngine", "ChunkState", "Patch"]

_META = b"c/"
_CHANNEL = b"h/"
_PATCH = b"p/"  # chunk id -> the pending in-place patch: offset, size, new bytes, old bytes
_PATCH_HEAD = struct.Struct("<QI")
_STATE = struct.Struct("<QQQIIIIQB")
_CHAN = struct.Struct("<QQII")
FLAG_PENDING_REMOVE = 1
FLAG_PENDING_PATCH = 2  # the pending version is the committed one with a few bytes overwritten


@dataclass(frozen=True, slots=True)
class ChunkState:
    """Metadata of one chunk replica. ``pending_version == 0`` means no write in flight."""

    commit_version: int = 0
    pending_version: int = 0
    chain_version: int = 0
    length: int = 0
    checksum: int = 0
    pending_length: int = 0
    pending_checksum: int = 0
    pending_chain_version: int = 0
    flags: int = 0

    @property
    def pending_remove(self) -> bool:
        return bool(self.flags & FLAG_PENDING_REMOVE)

    @property
    def pending_patch(self) -> bool:
        return bool(self.flags & FLAG_PENDING_PATCH)

    def encode(self) -> bytes:
        return _STATE.pack(self.commit_version, self.pending_version, self.chain_version, self.length,
                           self.checksum, self.pending_length, self.pending_checksum, self.pending_chain_version,
                           self.flags)

    @classmethod
    def decode(cls, raw: bytes) -> ChunkState:
        return cls(*_STATE.unpack(raw))


@dataclass(frozen=True, slots=True)
class Patch:
    """A pending version kept as an overwrite of the committed one (redo and undo data)."""

    offset: int
    new: bytes
    old: bytes

    def encode(self) -> bytes:
        return _PATCH_HEAD.pack(self.offset, len(self.new)) + self.new + self.old

    @classmethod
    def decode(cls, raw: bytes) -> Patch:
        offset, size = _PATCH_HEAD.unpack_from(raw)
        body = raw[_PATCH_HEAD.size:]
        return cls(offset, body[:size], body[size : 2 * size])


@dataclass(frozen=True, slots=True)
class ChannelRecord:
    """The outcome of the last update on one client channel (for exactly-once retries)."""

    seq: int
    commit_version: int
    length: int
    checksum: int
    chunk_id: bytes = b""

    def encode(self) -> bytes:
        return _CHAN.pack(self.seq, self.commit_version, self.length, self.checksum) + self.chunk_id

    @classmethod
    def decode(cls, raw: bytes) -> ChannelRecord:
        seq, version, length, checksum = _CHAN.unpack_from(raw)
        return cls(seq, version, length, checksum, raw[_CHAN.size:])


def _channel_key(client_id: bytes, channel_id: int) -> bytes:
    return _CHANNEL + bytes([len(client_id)]) + client_id + struct.pack(">I", channel_id)


class ChunkEngine:
    """Chunk replicas of one storage target."""

    def __init__(self, kv: KVStore, blobs: BlobStore, reserve_bytes: int = 0, sync_commits: bool = True) -> None:
        self.kv = kv
        self.blobs = blobs
        self.reserve_bytes = reserve_bytes
        self.sync_commits = sync_commits
        self._states: dict[bytes, ChunkState] = {}
        self._pending: set[bytes] = set()  # chunks with a pending version (kept so no scan is needed)
        self._channels: dict[bytes, ChannelRecord] = {}
        self._patches: dict[bytes, Patch] = {}  # chunk id -> its pending patch
        # Patches staged with ``defer_sync`` whose record the caller has not yet made durable.
        self._unsynced_patches: set[bytes] = set()
        self.used_bytes = 0
        abandoned = WriteBatch()
        for key, raw in kv.scan(_META, prefix_end(_META)):
            state = ChunkState.decode(raw)
            chunk_id = key[len(_META):]
            if state.pending_version:
                # A pending version from before a restart is dropped: its data was never synced,
                # and a restarted target resyncs from its predecessor before it serves again.
                if state.pending_patch:
                    # The commit may have been cut anywhere inside the patch: put the old bytes back.
                    raw_patch = kv.get(_PATCH + chunk_id)
                    if raw_patch is not None:
                        patch = Patch.decode(raw_patch)
                        blobs.unpatch(chunk_id, state.commit_version, state.pending_version, patch.offset,
                                      patch.old)
                    abandoned.delete(_PATCH + chunk_id)
                elif not state.pending_remove:
                    blobs.delete(chunk_id, state.pending_version)
                state = ChunkState(commit_version=state.commit_version, chain_version=state.chain_version,
                                   length=state.length, checksum=state.checksum)
                if state.commit_version == 0:
                    abandoned.delete(key)
                    continue
                abandoned.put(key, state.encode())
            self._states[chunk_id] = state
            self.used_bytes += state.length
        if len(abandoned):
            kv.write(abandoned, sync=True)
        for key, raw in kv.scan(_CHANNEL, prefix_end(_CHANNEL)):
            self._channels[key] = ChannelRecord.decode(raw)

    # -- queries -----------------------------------------------------------------------------

    def get(self, chunk_id: bytes) -> ChunkState | None:
        return self._states.get(chunk_id)

    @property
    def chunk_count(self) -> int:
        return len(self._states)

    def iter_states(self, start_after: bytes = b"", limit: int = 1000) -> Iterator[tuple[bytes, ChunkState]]:
        """Chunks in id order, after ``start_after``; from the KV store so the order is stable."""
        start = _META + start_after + (b"\x00" if start_after else b"")
        for key, _ in self.kv.scan(start, prefix_end(_META), limit=limit):
            chunk_id = key[len(_META):]
            state = self._states.get(chunk_id)
            if state is not None:
                yield chunk_id, state

    def all_chunk_ids(self) -> list[bytes]:
        return sorted(self._states)

    def states(self) -> dict[bytes, ChunkState]:
        """A snapshot of every chunk's metadata (for checkers and tools; O(chunks))."""
        return dict(self._states)

    def read(self, chunk_id: bytes, version: int, offset: int, length: int) -> bytes:
        state = self._states.get(chunk_id)
        if state is None or not state.pending_patch or version != state.pending_version:
            return self.blobs.read(chunk_id, version, offset, length)
        # The pending version of a patch: the committed bytes with the patch laid over them.
        data = self.blobs.read(chunk_id, state.commit_version, offset, length)
        patch = self._patches[chunk_id]
        start, end = max(offset, patch.offset), min(offset + len(data), patch.offset + len(patch.new))
        if start >= end:
            return data
        out = bytearray(data)
        out[start - offset : end - offset] = patch.new[start - patch.offset : end - patch.offset]
        return bytes(out)

    def channel(self, client_id: bytes, channel_id: int) -> ChannelRecord | None:
        """The channel's last committed update, if the chunk still reflects it.

        A resync may have replaced the chunk with an older copy since (its update was then
        never acknowledged by this chain), so a record only counts while the chunk is at its
        version with its checksum, or has moved past it.
        """
        record = self._channels.get(_channel_key(client_id, channel_id))
        if record is None or not record.chunk_id:
            return record
        state = self._states.get(record.chunk_id)
        if record.commit_version == 0 or state is None:
            return record if state is None and record.length == 0 else None
        if state.commit_version > record.commit_version:
            return record
        if state.commit_version == record.commit_version and state.checksum == record.checksum:
            return record
        return None

    # -- updates -----------------------------------------------------------------------------

    def _set(self, chunk_id: bytes, state: ChunkState | None) -> None:
        """The one place the metadata cache changes."""
        if state is None:
            self._states.pop(chunk_id, None)
            self._pending.discard(chunk_id)
            return
        self._states[chunk_id] = state
        if state.pending_version:
            self._pending.add(chunk_id)
        else:
            self._pending.discard(chunk_id)

    def _check_space(self, needed_bytes: int) -> None:
        if self.blobs.free_bytes() - needed_bytes < self.reserve_bytes:
            raise NoSpace(f"target has {self.blobs.free_bytes()} bytes free, needs {needed_bytes} "
                          f"+ reserve {self.reserve_bytes}")

    def drop_pending(self, chunk_id: bytes) -> None:
        """Forget an abandoned pending version before a new one with the same number is written."""
        old = self._states.get(chunk_id)
        if old is not None and old.pending_version:
            self.abort(chunk_id, old.pending_version)

    def write_blob(self, chunk_id: bytes, version: int, content: bytes | memoryview) -> None:
        """Write a pending version's data. Touches only the file system, so it may run off the loop."""
        self._check_space(len(content))
        self.blobs.write(chunk_id, version, content)

    def stage(self, chunk_id: bytes, version: int, content: bytes | memoryview | None, checksum: int,
              chain_version: int, blob_written: bool = False) -> ChunkState:
        """Store ``content`` as pending version ``version`` (None: a pending removal).

        ``blob_written``: the caller already wrote the data with :meth:`write_blob` (after
        :meth:`drop_pending`), typically on an I/O thread.
        """
        old = self._states.get(chunk_id, ChunkState())
        ensure(version == old.commit_version + 1, f"pending v{version} on committed v{old.commit_version}")
        if old.pending_version and not old.pending_remove and not old.pending_patch and not blob_written:
            self.blobs.delete(chunk_id, old.pending_version)
        if content is not None and not blob_written:
            self.write_blob(chunk_id, version, content)
        state = replace(old, pending_version=version, pending_length=len(content) if content is not None else 0,
                        pending_checksum=checksum, pending_chain_version=chain_version,
                        flags=FLAG_PENDING_REMOVE if content is None else 0)
        batch = WriteBatch()
        self._forget_patch(batch, chunk_id, old)
        batch.put(_META + chunk_id, state.encode())
        self.kv.write(batch, sync=False)  # a lost pending is recovered by resync
        self._set(chunk_id, state)
        return state

    def stage_patch(self, chunk_id: bytes, version: int, offset: int, data: bytes, old_data: bytes, checksum: int,
                    chain_version: int, defer_sync: bool = False) -> ChunkState:
        """Stage pending ``version`` as the committed bytes with ``data`` overwritten at ``offset``.

        Nothing on disk changes until :meth:`commit`, which patches the committed version's blob in
        place. The record kept here holds the old bytes too, so a commit cut short by a crash is
        undone at restart; it is synced (when commits are) before the blob is touched. With
        ``defer_sync`` the record is written unsynced and the caller syncs the log (one fsync for
        many writes) and says so to :meth:`commit`; a commit that is not told syncs it itself.
        """
        old = self._states.get(chunk_id)
        ensure(old is not None and old.commit_version > 0 and version == old.commit_version + 1
               and not old.pending_version, f"patch v{version} needs committed v{version - 1} and nothing pending")
        assert old is not None
        ensure(len(data) == len(old_data) and offset + len(data) <= old.length, "a patch stays inside the chunk")
        patch = Patch(offset, data, old_data)
        state = replace(old, pending_version=version, pending_length=old.length, pending_checksum=checksum,
                        pending_chain_version=chain_version, flags=FLAG_PENDING_PATCH)
        batch = WriteBatch()
        batch.put(_PATCH + chunk_id, patch.encode())
        batch.put(_META + chunk_id, state.encode())
        self.kv.write(batch, sync=self.sync_commits and not defer_sync)
        if defer_sync and self.sync_commits:
            self._unsynced_patches.add(chunk_id)
        self._patches[chunk_id] = patch
        self._set(chunk_id, state)
        return state

    def _forget_patch(self, batch: WriteBatch, chunk_id: bytes, old: ChunkState | None) -> None:
        if old is not None and old.pending_patch:
            batch.delete(_PATCH + chunk_id)
            self._patches.pop(chunk_id, None)
            self._unsynced_patches.discard(chunk_id)

    def abort(self, chunk_id: bytes, version: int) -> None:
        """Drop pending ``version`` (the update was refused further down the chain)."""
        old = self._states.get(chunk_id)
        if old is None or old.pending_version != version:
            return
        if not old.pending_remove and not old.pending_patch:
            self.blobs.delete(chunk_id, version)
        batch = WriteBatch()
        self._forget_patch(batch, chunk_id, old)
        if old.commit_version == 0:
            batch.delete(_META + chunk_id)
            self._set(chunk_id, None)
        else:
            state = replace(old, pending_version=0, pending_length=0, pending_checksum=0, pending_chain_version=0,
                            flags=0)
            batch.put(_META + chunk_id, state.encode())
            self._set(chunk_id, state)
        self.kv.write(batch, sync=False)

    def pending_chunks(self) -> list[bytes]:
        return sorted(self._pending)

    def commit(self, chunk_id: bytes, version: int, chain_version: int,
               channel: tuple[bytes, int, int] | None = None, defer_sync: bool = False,
               patch_synced: bool = False) -> ChunkState | None:
        """Make pending ``version`` the committed one. Returns the new state (None: removed).

        ``defer_sync``: the commit record is written unsynced; the caller must sync the log
        (``kv.sync_wal``) before it acknowledges the write. ``patch_synced``: the caller synced
        the log after staging a deferred patch, so its undo record is durable.
        """
        old = self._states.get(chunk_id)
        ensure(old is not None and old.pending_version == version,
               f"commit of v{version} without that pending version")
        assert old is not None
        batch = WriteBatch()
        if chunk_id in self._unsynced_patches:
            self._unsynced_patches.discard(chunk_id)
            if not patch_synced:
                self.kv.sync_wal()  # the undo record must be durable before the blob changes
        if old.pending_patch:
            patch = self._patches[chunk_id]
            self.blobs.patch(chunk_id, old.commit_version, version, patch.offset, patch.new)
            self._forget_patch(batch, chunk_id, old)
        if old.pending_remove:
            new: ChunkState | None = None
            batch.delete(_META + chunk_id)
        else:
            self.blobs.sync(chunk_id, version)
            new = ChunkState(commit_version=version, chain_version=chain_version, length=old.pending_length,
                             checksum=old.pending_checksum)
            batch.put(_META + chunk_id, new.encode())
        self._record_channel(batch, channel, version, new, chunk_id)
        self.kv.write(batch, sync=self.sync_commits and not defer_sync)
        self._install(chunk_id, old, new)
        return new

    def replace(self, chunk_id: bytes, version: int, chain_version: int, content: bytes | memoryview | None,
                checksum: int, channel: tuple[bytes, int, int] | None = None) -> ChunkState | None:
        """Full-chunk replace: commit ``content`` as ``version`` directly, abandoning any pending one."""
        old = self._states.get(chunk_id)
        batch = WriteBatch()
        self._forget_patch(batch, chunk_id, old)
        if content is None:
            new: ChunkState | None = None
            batch.delete(_META + chunk_id)
        else:
            if old is not None and version in (old.commit_version, old.pending_version):
                # Never overwrite a blob that the current metadata still points at.
                self._drop_blobs(chunk_id, old)
                self._set(chunk_id, None)
                self.used_bytes -= old.length
                drop = WriteBatch()
                drop.delete(_META + chunk_id)
                self.kv.write(drop, sync=self.sync_commits)
                old = None
            self._check_space(len(content))
            self.blobs.write(chunk_id, version, content)
            self.blobs.sync(chunk_id, version)
            new = ChunkState(commit_version=version, chain_version=chain_version, length=len(content),
                             checksum=checksum)
            batch.put(_META + chunk_id, new.encode())
        self._record_channel(batch, channel, version, new, chunk_id)
        self.kv.write(batch, sync=self.sync_commits)
        if old is not None:
            self._install(chunk_id, old, new)
        elif new is not None:
            self._set(chunk_id, new)
            self.used_bytes += new.length
        return new

    def _record_channel(self, batch: WriteBatch, channel: tuple[bytes, int, int] | None, version: int,
                        new: ChunkState | None, chunk_id: bytes) -> None:
        if channel is None or not channel[0]:
            return
        client_id, channel_id, seq = channel
        record = ChannelRecord(seq, version if new else 0, new.length if new else 0, new.checksum if new else 0,
                               chunk_id)
        key = _channel_key(client_id, channel_id)
        batch.put(key, record.encode())
        self._channels[key] = record

    def _install(self, chunk_id: bytes, old: ChunkState, new: ChunkState | None) -> None:
        self.used_bytes -= old.length
        if new is None:
            self._set(chunk_id, None)
            self._drop_blobs(chunk_id, old)
            return
        self.used_bytes += new.length
        self._set(chunk_id, new)
        patched = old.pending_patch and old.pending_version == new.commit_version
        if old.commit_version and old.commit_version != new.commit_version and not patched:
            self.blobs.delete(chunk_id, old.commit_version)  # (a patch renamed it instead)
        if old.pending_version and old.pending_version != new.commit_version and not old.pending_remove \
                and not old.pending_patch:
            self.blobs.delete(chunk_id, old.pending_version)

    def _drop_blobs(self, chunk_id: bytes, state: ChunkState) -> None:
        if state.commit_version:
            self.blobs.delete(chunk_id, state.commit_version)
        if state.pending_version and not state.pending_remove and not state.pending_patch:
            self.blobs.delete(chunk_id, state.pending_version)

    def close(self) -> None:
        self.kv.close()

"""Per-target chunk metadata and data: versions, atomic commits and exactly-once records.

Every chunk has a committed version and at most one pending version (the CRAQ write in flight).
Metadata lives in a KV store (RocksDB on disk), with an in-memory copy of all of it, as 3FS keeps.

**Version numbers are never reused on a target.** New versions (chosen by a chain head) come from
one counter per target, reserved on disk a block at a time and raised past every version the
target receives from its chain. So along a chunk's history versions only grow — across
a removal and a new write of the same chunk id too — and ``(chunk, version)`` names one content:
a delayed message about an older life of a chunk can never pass for a newer one. A pending version
is always greater than the committed one, not necessarily by one.

**The metadata says where every version's bytes are.** A version of at most ``inline_max_bytes``
is a record in the target's KV store (``b/`` + chunk + blob number), written in the batch that
stages it and deleted in the batch that commits its successor, so the store never holds a version
no metadata names. A larger version is a blob of the :class:`~fs3.storage.blobs.BlobStore`. Blob
numbers are fresh for every blob ever written on the target (a counter started above every blob
found at open), and blobs a crash left behind are deleted when the engine opens. Nothing is
found by looking: a read goes where the metadata points, and a full-chunk replace writes the new
copy under a new name before one batch switches to it, so the committed copy stays whole until then.

**Commit is atomic.** A file blob is synced first (bytes and directory entry), then one KV batch
switches the metadata and records the client channel's result, then the old blob is deleted. A
crash at any point leaves either the old or the new version committed, never a mix. A restart
drops pending versions (a restarted target resyncs before it serves).

A small write inside a chunk may be staged as a *patch* (:meth:`ChunkEngine.stage_patch`): the
pending version is the committed one with a few bytes overwritten. An inline chunk's patch is
applied by the commit batch itself; a file blob is patched in place and renamed at commit under an
undo/redo record, which a restart with the patch still pending uses to put the old bytes back.

**Exactly-once records** (client, channel → the last committed request's sequence number and
answer) are written in the batch that commits the request, whatever happens to the chunk later:
a retry is answered from its record even if another client has since removed or rewritten the
chunk. The pending version carries its request's channel, so a version completed by a new head
(after the old one failed mid-write) records it too. A record never replaces a newer one. Records
are replicated state: a resync hands the predecessor's records to the target it brings up to date,
which drops its own first (they may describe writes the chain rolled back). They expire once older
than any retry can be (:meth:`ChunkEngine.expire_channels`).
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from fs3.common.checksum import crc32c
from fs3.common.errors import ChecksumMismatch, InvalidArgument, IoError, NoSpace
from fs3.common.invariant import ensure
from fs3.kv.api import prefix_end
from fs3.kv.store import KVStore, WriteBatch
from fs3.storage import schema
from fs3.storage.blobs import BlobStore
from fs3.storage.formats import open_target_format
from fs3.storage.limits import CLIENT_ID_MAX_BYTES, VERSION_MAX

__all__ = ["CLIENT_ID_MAX_BYTES", "VERSION_MAX", "Channel", "ChannelRecord", "ChunkEngine", "ChunkState", "Patch"]

log = logging.getLogger(__name__)

# A request's exactly-once identity: (client id, channel id, sequence number).
Channel = tuple[bytes, int, int]

_VERSION_BLOCK = 1024  # versions reserved per synced floor write

_STATE = struct.Struct("<QQQIIQQIIQB")
_STATE_CRC = struct.Struct("<I")  # format 3: every ChunkState record ends with the CRC32C of the rest
_CHANNEL_TAIL = struct.Struct("<IQ")
_PATCH_HEAD = struct.Struct("<QI")
_CHAN = struct.Struct("<QQII")

FLAG_PENDING_REMOVE = 1
FLAG_PENDING_PATCH = 2  # the pending version is the committed one with a few bytes overwritten
FLAG_COMMIT_INLINE = 4  # the committed version's bytes are a KV record, not a blob
FLAG_PENDING_INLINE = 8  # likewise for the pending version


def _encode_channel(channel: Channel | None) -> bytes:
    if channel is None:
        return b""
    client_id, channel_id, seq = channel
    return bytes([len(client_id)]) + client_id + _CHANNEL_TAIL.pack(channel_id, seq)


def _decode_channel(raw: bytes) -> Channel | None:
    if not raw:
        return None
    size = raw[0]
    channel_id, seq = _CHANNEL_TAIL.unpack_from(raw, 1 + size)
    return raw[1 : 1 + size], int(channel_id), int(seq)


@dataclass(frozen=True, slots=True)
class ChunkState:
    """Metadata of one chunk replica. ``commit_version == 0``: the chunk does not exist (yet);
    ``pending_version == 0``: no write in flight."""

    commit_version: int = 0
    commit_blob: int = 0
    chain_version: int = 0
    length: int = 0
    checksum: int = 0
    pending_version: int = 0
    pending_blob: int = 0
    pending_length: int = 0
    pending_checksum: int = 0
    pending_chain_version: int = 0
    flags: int = 0
    pending_channel: Channel | None = None

    @property
    def pending_remove(self) -> bool:
        return bool(self.flags & FLAG_PENDING_REMOVE)

    @property
    def pending_patch(self) -> bool:
        return bool(self.flags & FLAG_PENDING_PATCH)

    @property
    def commit_inline(self) -> bool:
        return bool(self.flags & FLAG_COMMIT_INLINE)

    @property
    def pending_inline(self) -> bool:
        return bool(self.flags & FLAG_PENDING_INLINE)

    def without_pending(self) -> ChunkState:
        return ChunkState(commit_version=self.commit_version, commit_blob=self.commit_blob,
                          chain_version=self.chain_version, length=self.length, checksum=self.checksum,
                          flags=self.flags & FLAG_COMMIT_INLINE)

    def encode(self) -> bytes:
        """Target format 3: the fields, then a CRC32C of them (4 bytes, little-endian)."""
        body = self.encode_v2()
        return body + _STATE_CRC.pack(crc32c(body))

    def encode_v2(self) -> bytes:
        """Target format 2 (no CRC): what :mod:`fs3.storage.formats` migrates from."""
        return _STATE.pack(self.commit_version, self.commit_blob, self.chain_version, self.length, self.checksum,
                           self.pending_version, self.pending_blob, self.pending_length, self.pending_checksum,
                           self.pending_chain_version, self.flags) + _encode_channel(self.pending_channel)

    @classmethod
    def decode(cls, raw: bytes) -> ChunkState:
        """A format-3 record; :class:`~fs3.common.errors.ChecksumMismatch` when its CRC does not match
        (a damaged record is reported as such, never read as some other state)."""
        body, tail = raw[:-_STATE_CRC.size], raw[-_STATE_CRC.size:]
        if len(raw) < _STATE.size + _STATE_CRC.size or _STATE_CRC.unpack(tail)[0] != crc32c(body):
            raise ChecksumMismatch(f"chunk metadata record of {len(raw)} bytes fails its CRC32C: it is corrupt")
        return cls.decode_v2(body)

    @classmethod
    def decode_v2(cls, raw: bytes) -> ChunkState:
        """A format-2 record (no CRC)."""
        (commit_version, commit_blob, chain_version, length, checksum, pending_version, pending_blob, pending_length,
         pending_checksum, pending_chain_version, flags) = _STATE.unpack_from(raw)
        return cls(commit_version, commit_blob, chain_version, length, checksum, pending_version, pending_blob,
                   pending_length, pending_checksum, pending_chain_version, flags,
                   _decode_channel(raw[_STATE.size:]))


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

    def overlay(self, data: bytes, offset: int) -> bytes:
        """``data`` (read at ``offset`` of the committed version) with this patch laid over it."""
        start, end = max(offset, self.offset), min(offset + len(data), self.offset + len(self.new))
        if start >= end:
            return data
        out = bytearray(data)
        out[start - offset : end - offset] = self.new[start - self.offset : end - self.offset]
        return bytes(out)


@dataclass(frozen=True, slots=True)
class ChannelRecord:
    """The answer to the last committed request on one client channel (for exactly-once retries).

    ``stamp_ms`` is this target's clock when the record was written (not persisted: a record
    loaded at open has none until the first expiry pass gives it the time then — a restart only
    makes records live longer)."""

    seq: int
    commit_version: int
    length: int
    checksum: int
    chunk_id: bytes = b""
    stamp_ms: int | None = None

    def encode(self) -> bytes:
        return _CHAN.pack(self.seq, self.commit_version, self.length, self.checksum) + self.chunk_id

    @classmethod
    def decode(cls, raw: bytes) -> ChannelRecord:
        seq, version, length, checksum = _CHAN.unpack_from(raw)
        return cls(seq, version, length, checksum, raw[_CHAN.size:])


class ChunkEngine:
    """Chunk replicas of one storage target.

    ``inline_max_bytes``: versions up to this size are KV records (0: every version is a blob).
    ``reserve_bytes``: writes fail with NO_SPACE rather than leave less free space than this.
    ``sync_commits``: commits are made durable (off only in tests that do not need it).
    """

    def __init__(self, kv: KVStore, files: BlobStore, *, inline_max_bytes: int = 0, reserve_bytes: int = 0,
                 sync_commits: bool = True, upgrade: bool = True, where: str = "storage target") -> None:
        """``upgrade``: migrate a target of an older format at open (else refuse it, naming ``fs3
        admin upgrade``); ``where``: how refusals and logs name the target (its directory)."""
        if inline_max_bytes < 0 or reserve_bytes < 0:
            raise InvalidArgument("inline_max_bytes and reserve_bytes must not be negative")
        self.kv = kv
        self.files = files
        self.inline_max_bytes = inline_max_bytes
        self.reserve_bytes = reserve_bytes
        self.sync_commits = sync_commits
        self.upgrade = upgrade
        self.where = where
        self.corrupt_records = 0  # ChunkState records dropped at open for a failed CRC
        self._states: dict[bytes, ChunkState] = {}
        self._pending: set[bytes] = set()  # chunks with a pending version (kept so no scan is needed)
        self._channels: OrderedDict[bytes, ChannelRecord] = OrderedDict()  # oldest stamp first
        self._patches: dict[bytes, Patch] = {}  # chunk id -> its pending patch
        # File-blob patches staged with ``defer_sync`` whose undo record the caller has not yet synced.
        self._unsynced_patches: set[bytes] = set()
        # Chunks whose pending blob was written (and synced) by :meth:`write_blob` on an I/O thread.
        self._synced_pending: set[bytes] = set()
        # Blobs replaced by a commit made with ``defer_sync``: deleted only once the log sync that
        # makes the commit durable has run (:meth:`sync_log`) — until then a crash brings back the
        # metadata that names them. Appended on the event loop, drained by the syncing thread.
        self._obsolete: deque[tuple[bytes, int]] = deque()
        self.used_bytes = 0
        self._floor = 0
        self._reserved = 0
        self._next_blob = 1
        self._unstamped = False
        self._open()

    # -- opening -----------------------------------------------------------------------------

    def _open(self) -> None:
        kv = self.kv
        # The format record first: a fresh target is stamped, an older one migrated (or refused when
        # upgrading is off), a newer or too old one refused — before any record is decoded.
        open_target_format(kv, self.where, upgrade=self.upgrade)
        raw_floor = kv.get(schema.FLOOR)
        floor = schema.U64.unpack(raw_floor)[0] if raw_floor else 0
        batch = WriteBatch()
        for key, raw in kv.scan(*schema.prefix_range(schema.CHUNK)):
            chunk_id = schema.parse_chunk_key(key)
            try:
                state = ChunkState.decode(raw)
            except ChecksumMismatch as exc:
                # Damaged metadata is never guessed at: the chunk is forgotten here, and the resync
                # every restarted target goes through brings it back from its chain.
                log.error("chunk %s: its metadata record is corrupt, dropped at open: %s", chunk_id.hex(), exc)
                self.corrupt_records += 1
                batch.delete(key)
                batch.delete(schema.patch_key(chunk_id))
                continue
            floor = max(floor, state.commit_version, state.pending_version)
            self._next_blob = max(self._next_blob, state.commit_blob + 1, state.pending_blob + 1)
            if state.pending_version:
                # A pending version from before a restart is dropped: its data was never synced,
                # and a restarted target resyncs from its predecessor before it serves again.
                try:
                    self._drop_pending_on_open(batch, chunk_id, state)
                except IoError as exc:
                    # The committed copy cannot be restored (its blob is gone): forget the chunk;
                    # the resync every restarted target goes through brings it back.
                    log.error("chunk %s: dropped at open, its committed copy is lost: %s", chunk_id.hex(), exc)
                    batch.delete(key)
                    batch.delete(schema.patch_key(chunk_id))
                    continue
                state = state.without_pending()
                if state.commit_version == 0:
                    batch.delete(key)
                    continue
                batch.put(key, state.encode())
            self._states[chunk_id] = state
            self.used_bytes += state.length
        self._next_blob = max(self._next_blob, self._delete_leftovers(batch) + 1)
        kv.write(batch, sync=True)
        self._floor = floor
        self._reserve(floor + 1)
        for key, raw in kv.scan(*schema.prefix_range(schema.CHANNEL)):
            self._channels[key] = ChannelRecord.decode(raw)  # unstamped: aged from the first expiry pass
        self._unstamped = bool(self._channels)

    def _drop_pending_on_open(self, batch: WriteBatch, chunk_id: bytes, state: ChunkState) -> None:
        if state.pending_patch and not state.commit_inline:
            # The commit may have been cut anywhere inside the patch: put the old bytes back.
            raw_patch = self.kv.get(schema.patch_key(chunk_id))
            if raw_patch is not None:
                patch = Patch.decode(raw_patch)
                self.files.unpatch(chunk_id, state.commit_blob, state.pending_blob, patch.offset, patch.old)
        elif state.pending_inline:
            batch.delete(schema.inline_key(chunk_id, state.pending_blob))
        elif not state.pending_remove and not state.pending_patch:
            self.files.delete(chunk_id, state.pending_blob)

    def _delete_leftovers(self, batch: WriteBatch) -> int:
        """Delete inline records, patch records and blobs that no metadata names (left by a crash
        between writing them and the batch that would have named them); the largest number seen."""
        highest = 0
        live_inline = {(cid, s.commit_blob) for cid, s in self._states.items() if s.commit_inline}
        for key, _ in self.kv.scan(*schema.prefix_range(schema.INLINE)):
            chunk_id, blob = schema.parse_inline_key(key)
            highest = max(highest, blob)
            if (chunk_id, blob) not in live_inline:
                batch.delete(key)
        for key, _ in self.kv.scan(*schema.prefix_range(schema.PATCH)):
            batch.delete(key)  # every pending version was dropped above
        live_files = {(cid, s.commit_blob) for cid, s in self._states.items() if not s.commit_inline}
        for chunk_id, blob in list(self.files.list()):
            highest = max(highest, blob)
            if (chunk_id, blob) not in live_files:
                self.files.delete(chunk_id, blob)
        return highest

    # -- version numbers ---------------------------------------------------------------------

    @property
    def floor(self) -> int:
        """The highest version used on this target."""
        return self._floor

    def new_version(self) -> int:
        """A version number never used on this target before."""
        self._floor += 1
        self._reserve(self._floor)
        return self._floor

    def new_blob(self) -> int:
        """A blob number never used on this target before (blobs found at open are all below it)."""
        self._next_blob += 1
        return self._next_blob - 1

    def observe_version(self, version: int) -> None:
        """A version arrived from the chain: numbers this target hands out later stay above it."""
        if not 0 <= version <= VERSION_MAX:
            raise InvalidArgument(f"version {version} outside [0, {VERSION_MAX}]")
        if version > self._floor:
            self._floor = version
            self._reserve(version)

    def _reserve(self, number: int) -> None:
        if number <= self._reserved:
            return
        reserved = number + _VERSION_BLOCK
        batch = WriteBatch()
        batch.put(schema.FLOOR, schema.U64.pack(reserved))
        # Synced: after a crash, numbers restart above everything that may have been handed out.
        # Counted as reserved only once written: a write refused (a full disk) reserves nothing.
        self.kv.write(batch, sync=self.sync_commits)
        self._reserved = reserved

    # -- queries -----------------------------------------------------------------------------

    def get(self, chunk_id: bytes) -> ChunkState | None:
        return self._states.get(chunk_id)

    @property
    def chunk_count(self) -> int:
        return len(self._states)

    def iter_states(self, start_after: bytes = b"", limit: int = 1000,
                    end_before: bytes = b"") -> Iterator[tuple[bytes, ChunkState]]:
        """Chunks in id order, after ``start_after`` and (if given) before ``end_before``; from the
        KV store so the order is stable."""
        start = schema.chunk_key(start_after) + (b"\x00" if start_after else b"")
        end = schema.chunk_key(end_before) if end_before else prefix_end(schema.CHUNK)
        for key, _ in self.kv.scan(start, end, limit=limit):
            chunk_id = schema.parse_chunk_key(key)
            state = self._states.get(chunk_id)
            if state is not None:
                yield chunk_id, state

    def all_chunk_ids(self) -> list[bytes]:
        return sorted(self._states)

    def states(self) -> dict[bytes, ChunkState]:
        """A snapshot of every chunk's metadata (for checkers and tools; O(chunks))."""
        return dict(self._states)

    def pending_chunks(self) -> list[bytes]:
        return sorted(self._pending)

    def read(self, chunk_id: bytes, version: int, offset: int, length: int) -> bytes:
        """Bytes of ``version`` (the chunk's committed or pending one), at most to its end."""
        state = self._states.get(chunk_id)
        if state is None or version == 0 or version not in (state.commit_version, state.pending_version):
            raise IoError(f"chunk {chunk_id.hex()} has no version {version} on this target")
        if version == state.commit_version:
            return self._read_blob(chunk_id, state.commit_blob, state.commit_inline, state.length, offset, length)
        if state.pending_remove:
            raise IoError(f"chunk {chunk_id.hex()} v{version} is a removal")
        if state.pending_patch:
            data = self._read_blob(chunk_id, state.commit_blob, state.commit_inline, state.length, offset, length)
            return self._patches[chunk_id].overlay(data, offset)
        return self._read_blob(chunk_id, state.pending_blob, state.pending_inline, state.pending_length, offset,
                               length)

    def read_cached(self, chunk_id: bytes, version: int, offset: int, length: int) -> bytes | None:
        """As :meth:`read` for the committed version, but None where the bytes are not in memory
        (a file blob outside the page cache): an event loop reads with this and sends a None to its
        I/O pool. An inline version is a KV record and always answers."""
        state = self._states.get(chunk_id)
        if state is None or version == 0 or version != state.commit_version:
            raise IoError(f"chunk {chunk_id.hex()} has no committed version {version} on this target")
        if state.commit_inline:
            return self._read_blob(chunk_id, state.commit_blob, True, state.length, offset, length)
        length = max(0, min(length, state.length - offset))
        return self.files.read_cached(chunk_id, state.commit_blob, offset, length)

    def _read_blob(self, chunk_id: bytes, blob: int, inline: bool, size: int, offset: int, length: int) -> bytes:
        length = max(0, min(length, size - offset))
        if not inline:
            return self.files.read(chunk_id, blob, offset, length)
        raw = self.kv.get(schema.inline_key(chunk_id, blob))
        if raw is None:
            raise IoError(f"chunk {chunk_id.hex()}: inline record of blob {blob} is missing")
        return raw[offset : offset + length]

    def channel(self, client_id: bytes, channel_id: int) -> ChannelRecord | None:
        """The answer to the channel's last committed request."""
        return self._channels.get(schema.channel_key(client_id, channel_id))

    @property
    def channel_count(self) -> int:
        return len(self._channels)

    def channel_page(self, start_after: bytes = b"", limit: int = 1000) -> list[tuple[bytes, ChannelRecord]]:
        """Records in key order after ``start_after`` (a key), for handing them to a resynced target."""
        start = start_after + b"\x00" if start_after else schema.CHANNEL
        out = []
        for key, _ in self.kv.scan(start, prefix_end(schema.CHANNEL), limit=limit):
            record = self._channels.get(key)
            if record is not None:
                out.append((key, record))
        return out

    # -- updates -----------------------------------------------------------------------------

    def _set(self, chunk_id: bytes, state: ChunkState | None) -> None:
        """The one place the metadata cache changes."""
        if state is None:
            self._states.pop(chunk_id, None)
            self._pending.discard(chunk_id)
            self._synced_pending.discard(chunk_id)
            return
        self._states[chunk_id] = state
        if not state.pending_version:
            self._synced_pending.discard(chunk_id)
        if state.pending_version:
            self._pending.add(chunk_id)
        else:
            self._pending.discard(chunk_id)

    def _check_space(self, needed_bytes: int) -> None:
        free = self.files.free_bytes()
        if free - needed_bytes < self.reserve_bytes:
            raise NoSpace(f"target has {free} bytes free, needs {needed_bytes} + reserve {self.reserve_bytes}")

    def stores_inline(self, length: int) -> bool:
        """Whether a version of ``length`` bytes is kept as a KV record rather than a blob."""
        return self.inline_max_bytes > 0 and length <= self.inline_max_bytes

    def write_blob(self, chunk_id: bytes, blob: int, content: bytes | memoryview) -> None:
        """Write (and sync) a new blob under a number from :meth:`new_blob`. Touches only the
        blob store, so it may run on an I/O thread while the caller holds the chunk lock."""
        self._check_space(len(content))
        self.files.write(chunk_id, blob, content)
        self.files.sync(chunk_id, blob)

    def _drop_pending(self, batch: WriteBatch, chunk_id: bytes, old: ChunkState | None) -> None:
        """Forget ``old``'s pending version: its inline record and patch go with ``batch``."""
        if old is None or not old.pending_version:
            return
        if old.pending_patch:
            if not old.commit_inline:
                batch.delete(schema.patch_key(chunk_id))
            self._patches.pop(chunk_id, None)
            self._unsynced_patches.discard(chunk_id)
        elif old.pending_inline:
            batch.delete(schema.inline_key(chunk_id, old.pending_blob))
        elif not old.pending_remove:
            self.files.delete(chunk_id, old.pending_blob)

    def stage(self, chunk_id: bytes, version: int, content: bytes | memoryview | None, checksum: int,
              chain_version: int, channel: Channel | None = None, written_blob: int = 0) -> ChunkState:
        """Store ``content`` as pending ``version`` (None: a pending removal), replacing any pending
        version there was. ``written_blob``: the caller already wrote the blob with
        :meth:`write_blob` (typically on an I/O thread)."""
        old = self._states.get(chunk_id, ChunkState())
        ensure(version > old.commit_version, f"pending v{version} on committed v{old.commit_version}")
        batch = WriteBatch()
        self._drop_pending(batch, chunk_id, old)
        flags = old.flags & FLAG_COMMIT_INLINE
        blob = 0
        self._synced_pending.discard(chunk_id)
        if content is None:
            flags |= FLAG_PENDING_REMOVE
        elif written_blob:
            blob = written_blob
            self._synced_pending.add(chunk_id)
        elif self.stores_inline(len(content)):
            self._check_space(len(content))
            blob = self.new_blob()
            batch.put(schema.inline_key(chunk_id, blob), bytes(content))
            flags |= FLAG_PENDING_INLINE
        else:
            self._check_space(len(content))  # as for every other new version's bytes
            blob = self.new_blob()
            self.files.write(chunk_id, blob, content)
        self.observe_version(version)
        state = replace(old, pending_version=version, pending_blob=blob,
                        pending_length=len(content) if content is not None else 0, pending_checksum=checksum,
                        pending_chain_version=chain_version, flags=flags, pending_channel=channel)
        batch.put(schema.chunk_key(chunk_id), state.encode())
        self.kv.write(batch, sync=False)  # a lost pending version is recovered by resync
        self._set(chunk_id, state)
        return state

    def stage_patch(self, chunk_id: bytes, version: int, offset: int, data: bytes, old_data: bytes, checksum: int,
                    chain_version: int, channel: Channel | None = None, defer_sync: bool = False) -> ChunkState:
        """Stage pending ``version`` as the committed bytes with ``data`` overwritten at ``offset``.

        Nothing on disk changes until :meth:`commit`. For a file blob, which the commit patches in
        place, the record kept here holds the old bytes too, so a commit cut short by a crash is
        undone at restart; it is synced (when commits are) before the blob is touched. With
        ``defer_sync`` it is written unsynced and the caller syncs the log (one fsync for many
        writes) and says so to :meth:`commit`; a commit that is not told syncs it itself.
        """
        old = self._states.get(chunk_id)
        ensure(old is not None and old.commit_version > 0 and version > old.commit_version
               and not old.pending_version, f"patch v{version} needs a committed version and nothing pending")
        assert old is not None
        ensure(len(data) == len(old_data) and offset + len(data) <= old.length, "a patch stays inside the chunk")
        inline = old.commit_inline
        # Refused like a new version when short of space: the record holds both byte ranges, and
        # an inline chunk's commit stores the whole chunk anew — which must not fail for lack of
        # space once the successors have committed.
        self._check_space(2 * len(data) + (old.length if inline else 0))
        patch = Patch(offset, data, old_data)
        state = replace(old, pending_version=version, pending_blob=self.new_blob(), pending_length=old.length,
                        pending_checksum=checksum, pending_chain_version=chain_version,
                        flags=FLAG_PENDING_PATCH | (FLAG_COMMIT_INLINE | FLAG_PENDING_INLINE if inline else 0),
                        pending_channel=channel)
        self.observe_version(version)
        batch = WriteBatch()
        batch.put(schema.chunk_key(chunk_id), state.encode())
        if inline:
            self.kv.write(batch, sync=False)  # the commit batch applies it; nothing to undo before that
        else:
            batch.put(schema.patch_key(chunk_id), patch.encode())
            self.kv.write(batch, sync=self.sync_commits and not defer_sync)
            if defer_sync and self.sync_commits:
                self._unsynced_patches.add(chunk_id)
        self._patches[chunk_id] = patch
        self._set(chunk_id, state)
        return state

    def abort(self, chunk_id: bytes, version: int) -> None:
        """Drop pending ``version`` (the update was refused further down the chain)."""
        old = self._states.get(chunk_id)
        if old is None or old.pending_version != version:
            return
        batch = WriteBatch()
        self._drop_pending(batch, chunk_id, old)
        if old.commit_version == 0:
            batch.delete(schema.chunk_key(chunk_id))
            self._set(chunk_id, None)
        else:
            state = old.without_pending()
            batch.put(schema.chunk_key(chunk_id), state.encode())
            self._set(chunk_id, state)
        self.kv.write(batch, sync=False)

    def commit_blob_io(self, chunk_id: bytes, version: int) -> bool:
        """Whether committing pending ``version`` touches the disk beyond the metadata batch: a file
        patch applied in place and synced, or a pending file not synced yet (:meth:`prepare_commit`)."""
        old = self._states.get(chunk_id)
        if old is None or old.pending_version != version or old.pending_remove or old.pending_inline:
            return False
        return old.pending_patch or chunk_id not in self._synced_pending

    def prepare_commit(self, chunk_id: bytes, version: int, patch_synced: bool = False) -> None:
        """The blob work of committing pending ``version`` (a file patch applied in place and
        synced, or the pending file synced), before :meth:`commit` with ``prepared=True`` writes
        the metadata. Touches only the blob store (and the log, for an undo record nobody synced),
        so it may run on an I/O thread under the chunk lock — while nobody reads the committed
        blob: a patch rewrites it in place and renames it (the caller keeps readers off it)."""
        old = self._states.get(chunk_id)
        ensure(old is not None and old.pending_version == version and not old.pending_remove
               and not old.pending_inline, f"blob work for v{version} of a chunk that has none")
        assert old is not None
        if old.pending_patch:
            patch = self._patches[chunk_id]
            if chunk_id in self._unsynced_patches and not patch_synced:
                self.kv.sync_wal()  # the undo record must be durable before the blob changes
            self.files.patch(chunk_id, old.commit_blob, old.pending_blob, patch.offset, patch.new)
        self.files.sync(chunk_id, old.pending_blob)

    def commit(self, chunk_id: bytes, version: int, chain_version: int, *, now_ms: int = 0,
               defer_sync: bool = False, patch_synced: bool = False, prepared: bool = False) -> ChunkState | None:
        """Make pending ``version`` the committed one and record its request's answer. Returns the
        new state (None: removed).

        ``defer_sync``: the commit batch is written unsynced; the caller must sync the log
        (:meth:`sync_log`, which also deletes the replaced blob) before it acknowledges the write.
        ``patch_synced``: the caller synced the log after staging a deferred patch, so its undo
        record is durable. ``prepared``: the caller ran :meth:`prepare_commit` (the blob is patched
        and synced).
        """
        old = self._states.get(chunk_id)
        ensure(old is not None and old.pending_version == version,
               f"commit of v{version} without that pending version")
        assert old is not None
        batch = WriteBatch()
        new: ChunkState | None
        if old.pending_remove:
            new = None
            batch.delete(schema.chunk_key(chunk_id))
        else:
            if old.pending_patch:
                self._apply_patch(batch, chunk_id, old, patch_synced or prepared, prepared)
            elif not old.pending_inline and chunk_id not in self._synced_pending and not prepared:
                self.files.sync(chunk_id, old.pending_blob)
            new = ChunkState(commit_version=version, commit_blob=old.pending_blob, chain_version=chain_version,
                             length=old.pending_length, checksum=old.pending_checksum,
                             flags=FLAG_COMMIT_INLINE if old.pending_inline else 0)
            batch.put(schema.chunk_key(chunk_id), new.encode())
        if old.commit_version and old.commit_inline and not old.pending_patch:
            batch.delete(schema.inline_key(chunk_id, old.commit_blob))
        self._record_channel(batch, old.pending_channel, new, chunk_id, now_ms)
        self.kv.write(batch, sync=self.sync_commits and not defer_sync)
        self.used_bytes += (new.length if new else 0) - old.length
        self._set(chunk_id, new)
        if old.commit_version and not old.commit_inline and not old.pending_patch:
            self._delete_replaced(chunk_id, old.commit_blob, defer_sync)  # (a patch renamed it instead)
        return new

    def _apply_patch(self, batch: WriteBatch, chunk_id: bytes, old: ChunkState, patch_synced: bool,
                     prepared: bool = False) -> None:
        patch = self._patches.pop(chunk_id)
        if old.commit_inline:
            raw = self.kv.get(schema.inline_key(chunk_id, old.commit_blob))
            if raw is None:
                raise IoError(f"chunk {chunk_id.hex()}: inline record of blob {old.commit_blob} is missing")
            batch.delete(schema.inline_key(chunk_id, old.commit_blob))
            batch.put(schema.inline_key(chunk_id, old.pending_blob), patch.overlay(raw, 0))
            return
        if chunk_id in self._unsynced_patches:
            self._unsynced_patches.discard(chunk_id)
            if not patch_synced:
                self.kv.sync_wal()  # the undo record must be durable before the blob changes
        if not prepared:
            self.files.patch(chunk_id, old.commit_blob, old.pending_blob, patch.offset, patch.new)
            self.files.sync(chunk_id, old.pending_blob)
        batch.delete(schema.patch_key(chunk_id))

    def install(self, chunk_id: bytes, version: int, chain_version: int, content: bytes | memoryview | None,
                checksum: int, *, channel: Channel | None = None, now_ms: int = 0,
                written_blob: int = 0, defer_sync: bool = False) -> ChunkState | None:
        """Full-chunk replace: commit ``content`` as ``version`` at once (None: remove the chunk),
        dropping any pending version. The new copy is written under a new name before the batch
        that switches to it, so a failure (a full disk) leaves the old copy committed and whole.
        ``written_blob``: the caller wrote and synced the blob already (:meth:`write_blob`).
        ``defer_sync``: as for :meth:`commit`."""
        old = self._states.get(chunk_id)
        batch = WriteBatch()
        new: ChunkState | None = None
        if content is None:
            batch.delete(schema.chunk_key(chunk_id))
        else:
            if written_blob:
                blob, flags = written_blob, 0
            elif self.stores_inline(len(content)):
                self._check_space(len(content))
                blob, flags = self.new_blob(), FLAG_COMMIT_INLINE
                batch.put(schema.inline_key(chunk_id, blob), bytes(content))
            else:
                blob, flags = self.new_blob(), 0
                self.write_blob(chunk_id, blob, content)
            new = ChunkState(commit_version=version, commit_blob=blob, chain_version=chain_version,
                             length=len(content), checksum=checksum, flags=flags)
            batch.put(schema.chunk_key(chunk_id), new.encode())
        self.observe_version(version)
        self._drop_pending(batch, chunk_id, old)
        if old is not None and old.commit_version and old.commit_inline:
            batch.delete(schema.inline_key(chunk_id, old.commit_blob))
        self._record_channel(batch, channel, new, chunk_id, now_ms)
        self.kv.write(batch, sync=self.sync_commits and not defer_sync)
        self.used_bytes += (new.length if new else 0) - (old.length if old else 0)
        self._set(chunk_id, new)
        if old is not None and old.commit_version and not old.commit_inline:
            self._delete_replaced(chunk_id, old.commit_blob, defer_sync)
        return new

    def _delete_replaced(self, chunk_id: bytes, blob: int, deferred: bool) -> None:
        """Delete the blob of a version a commit replaced — after the commit is durable: a commit
        batch written unsynced may still be lost, and the metadata it replaced names this blob."""
        if deferred and self.sync_commits:
            self._obsolete.append((chunk_id, blob))
        else:
            self.files.delete(chunk_id, blob)

    def sync_log(self) -> None:
        """Make every write so far durable (``kv.sync_wal``: the group sync of commits made with
        ``defer_sync``), then delete the blobs those commits replaced. Safe on an I/O thread."""
        count = len(self._obsolete)  # each was queued after its commit batch was written
        self.kv.sync_wal()
        for _ in range(count):
            chunk_id, blob = self._obsolete.popleft()
            self.files.delete(chunk_id, blob)

    # -- exactly-once records ----------------------------------------------------------------

    def _record_channel(self, batch: WriteBatch, channel: Channel | None, new: ChunkState | None, chunk_id: bytes,
                        now_ms: int) -> None:
        if channel is None or not channel[0]:
            return
        client_id, channel_id, seq = channel
        key = schema.channel_key(client_id, channel_id)
        existing = self._channels.get(key)
        if existing is not None and existing.seq >= seq:
            return  # a late commit never replaces the answer to a newer request
        record = ChannelRecord(seq, new.commit_version if new else 0, new.length if new else 0,
                               new.checksum if new else 0, chunk_id, now_ms)
        batch.put(key, record.encode())
        self._channels[key] = record
        self._channels.move_to_end(key)

    def merge_channels(self, records: Iterable[tuple[bytes, int, ChannelRecord]], now_ms: int) -> int:
        """Take a predecessor's records (client id, channel id, record), keeping whichever of two
        records of one channel is newer. Returns how many changed."""
        batch = WriteBatch()
        changed = 0
        for client_id, channel_id, record in records:
            key = schema.channel_key(client_id, channel_id)
            existing = self._channels.get(key)
            if existing is not None and existing.seq >= record.seq:
                continue
            record = replace(record, stamp_ms=now_ms)
            batch.put(key, record.encode())
            self._channels[key] = record
            self._channels.move_to_end(key)
            changed += 1
        if len(batch):
            self.kv.write(batch, sync=self.sync_commits)
        return changed

    def forget_channels(self, page: int = 1000) -> None:
        """Drop every record: this target is about to be resynced, and records of writes its chain
        may have rolled back must not answer a retry. The predecessor's records follow."""
        while True:
            keys = [key for key, _ in self.kv.scan(*schema.prefix_range(schema.CHANNEL), limit=page)]
            if not keys:
                break
            batch = WriteBatch()
            for key in keys:
                batch.delete(key)
            self.kv.write(batch, sync=self.sync_commits)
        self._channels.clear()

    def expire_channels(self, now_ms: int, ttl_ms: int, limit: int = 1000) -> int:
        """Drop up to ``limit`` records written more than ``ttl_ms`` ago (oldest first). Clients
        never retry a request that long (the head refuses older retries), so none is still needed."""
        if self._unstamped:  # records loaded at open (they lead the order): their age counts from now
            for key in [k for k, record in self._channels.items() if record.stamp_ms is None]:
                self._channels[key] = replace(self._channels[key], stamp_ms=now_ms)
                self._channels.move_to_end(key)
            self._unstamped = False
        batch = WriteBatch()
        while self._channels and len(batch) < limit:
            key, record = next(iter(self._channels.items()))
            if record.stamp_ms is None or now_ms - record.stamp_ms <= ttl_ms:
                break
            del self._channels[key]
            batch.delete(key)
        if len(batch):
            self.kv.write(batch, sync=False)  # a lost deletion only keeps a record a little longer
        return len(batch)

    def close(self) -> None:
        self.kv.close()

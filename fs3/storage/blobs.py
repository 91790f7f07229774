"""Where chunk bytes live: one file per chunk version on a real disk (small versions in the
target's KV store), or memory in the simulator.

A chunk version is written once (copy-on-write), so a committed version is never torn by a failed
or concurrent write. The one exception is :meth:`BlobStore.patch`, which turns a committed version
into the next by overwriting a few bytes in place; the chunk engine calls it only at commit, under
an undo/redo record, and :meth:`BlobStore.unpatch` undoes a patch cut short by a crash. ``sync``
makes a version durable; the simulator's :class:`MemBlobStore` loses unsynced versions (and
unsynced patches) on :meth:`~MemBlobStore.crash`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Protocol

from fs3.common.errors import IoError, NoSpace
from fs3.kv.store import KVStore, WriteBatch

__all__ = ["BlobStore", "FileBlobStore", "MemBlobStore", "TieredBlobStore"]


class BlobStore(Protocol):
    def write(self, chunk_id: bytes, version: int, data: bytes | memoryview) -> None: ...

    def sync(self, chunk_id: bytes, version: int) -> None: ...

    def read(self, chunk_id: bytes, version: int, offset: int, length: int) -> bytes: ...

    def delete(self, chunk_id: bytes, version: int) -> None: ...

    def patch(self, chunk_id: bytes, old_version: int, new_version: int, offset: int, data: bytes) -> None:
        """Turn ``old_version`` into ``new_version`` by overwriting ``data`` at ``offset`` in place."""
        ...

    def unpatch(self, chunk_id: bytes, old_version: int, new_version: int, offset: int, old_data: bytes) -> None:
        """Undo a patch that may have been interrupted anywhere: ``old_version`` exists afterwards,
        with ``old_data`` at ``offset``, and ``new_version`` does not."""
        ...

    def free_bytes(self) -> int: ...

    def capacity_bytes(self) -> int: ...


def _raise_os(exc: OSError, what: str) -> None:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise NoSpace(f"{what}: no space left on the target") from None
    raise IoError(f"{what}: {exc.strerror or exc}") from None


class FileBlobStore:
    """Chunk versions as files ``<root>/<xx>/<chunk-id-hex>.<version>``."""

    def __init__(self, root: str | Path, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        self._dirs: set[Path] = set()

    def _path(self, chunk_id: bytes, version: int) -> Path:
        name = chunk_id.hex()
        return self.root / name[-2:] / f"{name}.{version}"

    def write(self, chunk_id: bytes, version: int, data: bytes | memoryview) -> None:
        path = self._path(chunk_id, version)
        try:
            if path.parent not in self._dirs:
                path.parent.mkdir(exist_ok=True)
                self._dirs.add(path.parent)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            finally:
                os.close(fd)
        except OSError as exc:
            # Never leave a partial version behind: it could be mistaken for data later.
            with contextlib.suppress(OSError):
                path.unlink()
            _raise_os(exc, f"writing {path.name}")

    def sync(self, chunk_id: bytes, version: int) -> None:
        if not self.fsync:
            return
        path = self._path(chunk_id, version)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            _raise_os(exc, f"syncing {path.name}")

    def read(self, chunk_id: bytes, version: int, offset: int, length: int) -> bytes:
        path = self._path(chunk_id, version)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                return os.pread(fd, length, offset)
            finally:
                os.close(fd)
        except FileNotFoundError:
            raise IoError(f"chunk file {path.name} is missing") from None
        except OSError as exc:
            _raise_os(exc, f"reading {path.name}")
            raise

    def delete(self, chunk_id: bytes, version: int) -> None:
        try:
            self._path(chunk_id, version).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            _raise_os(exc, "deleting a chunk version")

    @staticmethod
    def _pwrite_all(path: Path, offset: int, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            view = memoryview(data)
            while view:
                written = os.pwrite(fd, view, offset)
                view = view[written:]
                offset += written
        finally:
            os.close(fd)

    def patch(self, chunk_id: bytes, old_version: int, new_version: int, offset: int, data: bytes) -> None:
        source, target = self._path(chunk_id, old_version), self._path(chunk_id, new_version)
        try:
            self._pwrite_all(source, offset, data)
            os.rename(source, target)
        except OSError as exc:
            _raise_os(exc, f"patching {source.name}")

    def unpatch(self, chunk_id: bytes, old_version: int, new_version: int, offset: int, old_data: bytes) -> None:
        source, target = self._path(chunk_id, old_version), self._path(chunk_id, new_version)
        try:
            if not os.path.exists(source) and os.path.exists(target):
                os.rename(target, source)
            self._pwrite_all(source, offset, old_data)
            self.sync(chunk_id, old_version)
        except FileNotFoundError:
            raise IoError(f"chunk file {source.name} is missing") from None
        except OSError as exc:
            _raise_os(exc, f"restoring {source.name}")

    def free_bytes(self) -> int:
        return int(shutil.disk_usage(self.root).free)

    def capacity_bytes(self) -> int:
        return int(shutil.disk_usage(self.root).total)


_INLINE = b"b/"


class TieredBlobStore:
    """Small chunk versions inline in the target's KV store, larger ones as files.

    Creating, opening and unlinking a file per chunk version costs more than the data itself for
    small chunks (most of a small-file create was spent there). A version of at most
    ``inline_max_bytes`` is one KV put instead — an append to RocksDB's log — and reading it is a
    lookup.

    The store shares the chunk engine's KV, and that is what makes an inline version durable: its
    record is written unsynced, and the engine's commit batch — synced, and after it in the same
    write-ahead log — makes both durable at once (a log keeps its order, so a surviving commit
    implies a surviving version; a version without its commit is dropped or undone at restart).
    One fsync per replica and write instead of two: with three replicas in a chain, the synced
    blob write was half of a small write's latency. :meth:`sync` therefore only syncs file blobs.
    """

    def __init__(self, kv: KVStore, files: FileBlobStore, inline_max_bytes: int) -> None:
        self.kv = kv
        self.files = files
        self.inline_max_bytes = inline_max_bytes
        self.root = files.root

    @staticmethod
    def _key(chunk_id: bytes, version: int) -> bytes:
        return _INLINE + chunk_id + version.to_bytes(8, "big")

    def write(self, chunk_id: bytes, version: int, data: bytes | memoryview) -> None:
        if len(data) > self.inline_max_bytes:
            self.files.write(chunk_id, version, data)
            return
        batch = WriteBatch()
        batch.put(self._key(chunk_id, version), bytes(data))
        self.kv.write(batch, sync=False)  # durable with the engine's commit batch (see the class doc)

    def sync(self, chunk_id: bytes, version: int) -> None:
        if self.kv.get(self._key(chunk_id, version)) is None:
            self.files.sync(chunk_id, version)

    def read(self, chunk_id: bytes, version: int, offset: int, length: int) -> bytes:
        raw = self.kv.get(self._key(chunk_id, version))
        if raw is None:
            return self.files.read(chunk_id, version, offset, length)
        return raw[offset : offset + length]

    def delete(self, chunk_id: bytes, version: int) -> None:
        key = self._key(chunk_id, version)
        if self.kv.get(key) is not None:
            batch = WriteBatch()
            batch.delete(key)
            # Not synced by itself: the engine's next synced write (its metadata batch) makes it durable,
            # and an abandoned version is deleted before its number is used again.
            self.kv.write(batch, sync=False)
        else:
            self.files.delete(chunk_id, version)

    def patch(self, chunk_id: bytes, old_version: int, new_version: int, offset: int, data: bytes) -> None:
        old_key = self._key(chunk_id, old_version)
        raw = self.kv.get(old_key)
        if raw is None:
            self.files.patch(chunk_id, old_version, new_version, offset, data)
            return
        # Unsynced like a new version: the commit batch follows; a crash before it is undone by unpatch.
        self._overlay_and_move(raw, offset, data, old_key, self._key(chunk_id, new_version), False)

    def unpatch(self, chunk_id: bytes, old_version: int, new_version: int, offset: int, old_data: bytes) -> None:
        old_key, new_key = self._key(chunk_id, old_version), self._key(chunk_id, new_version)
        raw = self.kv.get(old_key)
        if raw is None:
            raw = self.kv.get(new_key)
        if raw is None:
            self.files.unpatch(chunk_id, old_version, new_version, offset, old_data)
            return
        self._overlay_and_move(raw, offset, old_data, new_key, old_key, True)

    def _overlay_and_move(self, raw: bytes, offset: int, data: bytes, from_key: bytes, to_key: bytes,
                          sync: bool) -> None:
        """Store ``raw`` with ``data`` laid over it at ``offset`` under ``to_key``, dropping ``from_key``."""
        content = bytearray(raw)
        content[offset : offset + len(data)] = data
        batch = WriteBatch()
        if from_key != to_key:
            batch.delete(from_key)
        batch.put(to_key, bytes(content))
        self.kv.write(batch, sync=sync)

    def free_bytes(self) -> int:
        return self.files.free_bytes()

    def capacity_bytes(self) -> int:
        return self.files.capacity_bytes()


class MemBlobStore:
    """In-memory blobs with crash semantics, and an optional capacity to test full disks."""

    def __init__(self, capacity_bytes: int = 1 << 40) -> None:
        self._blobs: dict[tuple[bytes, int], bytes] = {}
        self._durable: set[tuple[bytes, int]] = set()
        self._unsynced_patches: dict[tuple[bytes, int], tuple[int, bytes, bool]] = {}
        self._capacity = capacity_bytes
        self._used = 0

    def write(self, chunk_id: bytes, version: int, data: bytes | memoryview) -> None:
        key = (chunk_id, version)
        old = self._blobs.get(key)
        if self._used - (len(old) if old else 0) + len(data) > self._capacity:
            raise NoSpace("no space left on the target")
        self._used += len(data) - (len(old) if old else 0)
        self._blobs[key] = bytes(data)
        self._durable.discard(key)

    def sync(self, chunk_id: bytes, version: int) -> None:
        if (chunk_id, version) in self._blobs:
            self._durable.add((chunk_id, version))
            self._unsynced_patches.pop((chunk_id, version), None)

    def read(self, chunk_id: bytes, version: int, offset: int, length: int) -> bytes:
        blob = self._blobs.get((chunk_id, version))
        if blob is None:
            raise IoError(f"chunk {chunk_id.hex()} v{version} is missing")
        return blob[offset : offset + length]

    def delete(self, chunk_id: bytes, version: int) -> None:
        self._unsynced_patches.pop((chunk_id, version), None)
        blob = self._blobs.pop((chunk_id, version), None)
        if blob is not None:
            self._used -= len(blob)
        self._durable.discard((chunk_id, version))

    def patch(self, chunk_id: bytes, old_version: int, new_version: int, offset: int, data: bytes) -> None:
        source = self._blobs.pop((chunk_id, old_version), None)
        if source is None:
            raise IoError(f"chunk {chunk_id.hex()} v{old_version} is missing")
        was_durable = (chunk_id, old_version) in self._durable
        self._durable.discard((chunk_id, old_version))
        content = bytearray(source)
        content[offset : offset + len(data)] = data
        self._blobs[(chunk_id, new_version)] = bytes(content)
        # Until synced, a crash may leave the disk as it was before the patch (renamed back).
        self._unsynced_patches[(chunk_id, new_version)] = (old_version, source, was_durable)

    def unpatch(self, chunk_id: bytes, old_version: int, new_version: int, offset: int, old_data: bytes) -> None:
        if (chunk_id, old_version) not in self._blobs and (chunk_id, new_version) in self._blobs:
            self._blobs[(chunk_id, old_version)] = self._blobs.pop((chunk_id, new_version))
            self._durable.discard((chunk_id, new_version))
            self._unsynced_patches.pop((chunk_id, new_version), None)
        source = self._blobs.get((chunk_id, old_version))
        if source is None:
            raise IoError(f"chunk {chunk_id.hex()} v{old_version} is missing")
        content = bytearray(source)
        content[offset : offset + len(old_data)] = old_data
        self._blobs[(chunk_id, old_version)] = bytes(content)
        self._durable.add((chunk_id, old_version))

    def crash(self) -> None:
        """Drop every version that was never synced."""
        for (chunk_id, new_version), (old_version, source, was_durable) in self._unsynced_patches.items():
            if self._blobs.pop((chunk_id, new_version), None) is not None:
                self._blobs[(chunk_id, old_version)] = source
                if was_durable:
                    self._durable.add((chunk_id, old_version))
        self._unsynced_patches.clear()
        for key in [k for k in self._blobs if k not in self._durable]:
            self._used -= len(self._blobs.pop(key))

    def free_bytes(self) -> int:
        return self._capacity - self._used

    def capacity_bytes(self) -> int:
        return self._capacity

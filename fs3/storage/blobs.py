"""Where chunk versions larger than the inline limit live: one file per blob on a real disk, or
memory in the simulator.

A *blob* is the bytes of one chunk version under a name the chunk engine chose: ``(chunk id, blob
number)``. Blob numbers come from the target's version counter and are never reused, so a blob
left behind by a crash can never be mistaken for a later version; the engine's metadata alone says
which blob holds which version, and the engine deletes what no metadata names when it opens.

A blob is written once (copy-on-write), so a committed version is never torn by a failed or
concurrent write. The one exception is :meth:`BlobStore.patch`, which turns a committed blob into
the next version's blob by overwriting a few bytes in place and renaming it; the chunk engine calls
it only at commit, under an undo/redo record, and :meth:`BlobStore.unpatch` undoes a patch cut
short by a crash. :meth:`BlobStore.sync` makes a blob durable — its bytes and its name (the
directory entry). The simulator's :class:`MemBlobStore` loses what was never synced on
:meth:`~MemBlobStore.crash`.

:meth:`BlobStore.read_cached` reads only what needs no disk access (``RWF_NOWAIT``): a caller on an
event loop serves a small read that is in the page cache at once and sends the rest to its I/O pool
(docs/decisions.md, "Small chunk reads: on the loop only from the page cache").
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from fs3.common.durable import make_dirs_durable, sync_dir
from fs3.common.errors import IoError, NoSpace
from fs3.common.faults import sabotaged
from fs3.storage import schema

__all__ = ["BlobStore", "FileBlobStore", "MemBlobStore"]

# Linux >= 4.14 (0 elsewhere: no cache-only reads, see FileBlobStore.read_cached).
_RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)


class BlobStore(Protocol):
    def write(self, chunk_id: bytes, blob: int, data: bytes | memoryview) -> None: ...

    def sync(self, chunk_id: bytes, blob: int) -> None:
        """Make the blob durable: its bytes and its directory entry."""
        ...

    def read(self, chunk_id: bytes, blob: int, offset: int, length: int) -> bytes: ...

    def read_cached(self, chunk_id: bytes, blob: int, offset: int, length: int) -> bytes | None:
        """As :meth:`read`, but None instead of waiting for the disk: part of the bytes is not in
        memory (the page cache). Never waits for the data on disk, so an event loop may call it (opening
        the file may still read its inode once after the cache was dropped)."""
        ...

    def delete(self, chunk_id: bytes, blob: int) -> None: ...

    def patch(self, chunk_id: bytes, old_blob: int, new_blob: int, offset: int, data: bytes) -> None:
        """Turn ``old_blob`` into ``new_blob`` by overwriting ``data`` at ``offset`` in place."""
        ...

    def unpatch(self, chunk_id: bytes, old_blob: int, new_blob: int, offset: int, old_data: bytes) -> None:
        """Undo a patch that may have been interrupted anywhere: ``old_blob`` exists afterwards,
        with ``old_data`` at ``offset``, and ``new_blob`` does not."""
        ...

    def list(self) -> Iterator[tuple[bytes, int]]:
        """Every blob present, as ``(chunk id, blob number)`` (for the clean-up at open)."""
        ...

    def free_bytes(self) -> int: ...

    def capacity_bytes(self) -> int: ...


def _raise_os(exc: OSError, what: str) -> None:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise NoSpace(f"{what}: no space left on the target") from None
    raise IoError(f"{what}: {exc.strerror or exc}") from None


class FileBlobStore:
    """Blobs as files ``<root>/<xx>/<chunk-id-hex>.<blob>`` (names: :mod:`fs3.storage.schema`)."""

    def __init__(self, root: str | Path, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync and not sabotaged("file-sync")
        self._sync_dirs = self.fsync and not sabotaged("dir-sync")
        make_dirs_durable(self.root)
        self._dirs: set[Path] = set()
        self._nowait = _RWF_NOWAIT != 0  # cleared once the filesystem refuses the flag

    def _path(self, chunk_id: bytes, blob: int) -> Path:
        return self.root / schema.blob_dir_name(chunk_id) / schema.blob_file_name(chunk_id, blob)

    def write(self, chunk_id: bytes, blob: int, data: bytes | memoryview) -> None:
        path = self._path(chunk_id, blob)
        try:
            if path.parent not in self._dirs:
                if not path.parent.is_dir():
                    path.parent.mkdir(mode=0o700, exist_ok=True)
                    # The blob's own sync covers its entry in this directory, not this directory's
                    # entry in the root: without this a power loss could take the directory back.
                    if self._sync_dirs:
                        sync_dir(self.root)
                self._dirs.add(path.parent)
            # 0600: chunk data is for the storage service only, whatever the process umask.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            finally:
                os.close(fd)
        except OSError as exc:
            # Never leave a partial blob behind: it would only take space until the next open.
            with contextlib.suppress(OSError):
                path.unlink()
            _raise_os(exc, f"writing {path.name}")

    def sync(self, chunk_id: bytes, blob: int) -> None:
        if not self.fsync:
            return
        path = self._path(chunk_id, blob)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            # The name too: metadata that names a blob must never outlive its directory entry.
            if self._sync_dirs:
                sync_dir(path.parent)
        except OSError as exc:
            _raise_os(exc, f"syncing {path.name}")

    def read(self, chunk_id: bytes, blob: int, offset: int, length: int) -> bytes:
        path = self._path(chunk_id, blob)
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

    def read_cached(self, chunk_id: bytes, blob: int, offset: int, length: int) -> bytes | None:
        """``preadv(RWF_NOWAIT)``: the kernel copies what the page cache holds and answers EAGAIN
        (or a short count) where it would have to read the disk. A short count is None too — it may
        also be the end of a file cut short, which the blocking :meth:`read` then reports as it is.
        Where the flag is unknown (not Linux, or a filesystem that refuses it) this is a plain read,
        as every small read was before: no worse than that, and no better."""
        if not self._nowait or length <= 0:
            return self.read(chunk_id, blob, offset, length)
        path = self._path(chunk_id, blob)
        buf = bytearray(length)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                count = os.preadv(fd, [buf], offset, _RWF_NOWAIT)
            finally:
                os.close(fd)
        except BlockingIOError:
            return None
        except FileNotFoundError:
            raise IoError(f"chunk file {path.name} is missing") from None
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # the filesystem cannot tell: read as before
                self._nowait = False
                return self.read(chunk_id, blob, offset, length)
            _raise_os(exc, f"reading {path.name}")
            raise
        return bytes(buf) if count == length else None

    def delete(self, chunk_id: bytes, blob: int) -> None:
        try:
            self._path(chunk_id, blob).unlink()
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

    def patch(self, chunk_id: bytes, old_blob: int, new_blob: int, offset: int, data: bytes) -> None:
        source, target = self._path(chunk_id, old_blob), self._path(chunk_id, new_blob)
        try:
            self._pwrite_all(source, offset, data)
            os.rename(source, target)
        except OSError as exc:
            _raise_os(exc, f"patching {source.name}")

    def unpatch(self, chunk_id: bytes, old_blob: int, new_blob: int, offset: int, old_data: bytes) -> None:
        source, target = self._path(chunk_id, old_blob), self._path(chunk_id, new_blob)
        try:
            if not os.path.exists(source) and os.path.exists(target):
                os.rename(target, source)
            self._pwrite_all(source, offset, old_data)
            self.sync(chunk_id, old_blob)
        except FileNotFoundError:
            raise IoError(f"chunk file {source.name} is missing") from None
        except OSError as exc:
            _raise_os(exc, f"restoring {source.name}")

    def list(self) -> Iterator[tuple[bytes, int]]:
        for directory in sorted(self.root.iterdir()):
            if not directory.is_dir():
                continue
            with os.scandir(directory) as entries:
                for entry in entries:
                    blob = schema.parse_blob_file_name(entry.name)
                    if blob is not None:  # else not a blob (an operator's file): left alone
                        yield blob

    def free_bytes(self) -> int:
        return int(shutil.disk_usage(self.root).free)

    def capacity_bytes(self) -> int:
        return int(shutil.disk_usage(self.root).total)


class MemBlobStore:
    """In-memory blobs with crash semantics, and an optional capacity to test full disks."""

    def __init__(self, capacity_bytes: int = 1 << 40) -> None:
        self._blobs: dict[tuple[bytes, int], bytes] = {}
        self._durable: set[tuple[bytes, int]] = set()
        self._unsynced_patches: dict[tuple[bytes, int], tuple[int, bytes, bool]] = {}
        self._capacity = capacity_bytes
        self._used = 0

    def write(self, chunk_id: bytes, blob: int, data: bytes | memoryview) -> None:
        key = (chunk_id, blob)
        old = self._blobs.get(key)
        if self._used - (len(old) if old else 0) + len(data) > self._capacity:
            raise NoSpace("no space left on the target")
        self._used += len(data) - (len(old) if old else 0)
        self._blobs[key] = bytes(data)
        self._durable.discard(key)

    def sync(self, chunk_id: bytes, blob: int) -> None:
        if (chunk_id, blob) in self._blobs:
            self._durable.add((chunk_id, blob))
            self._unsynced_patches.pop((chunk_id, blob), None)

    def read(self, chunk_id: bytes, blob: int, offset: int, length: int) -> bytes:
        data = self._blobs.get((chunk_id, blob))
        if data is None:
            raise IoError(f"chunk {chunk_id.hex()} blob {blob} is missing")
        return data[offset : offset + length]

    def read_cached(self, chunk_id: bytes, blob: int, offset: int, length: int) -> bytes | None:
        """Memory is always cached: the simulator's reads stay inline, as its host runs everything."""
        return self.read(chunk_id, blob, offset, length)

    def delete(self, chunk_id: bytes, blob: int) -> None:
        self._unsynced_patches.pop((chunk_id, blob), None)
        data = self._blobs.pop((chunk_id, blob), None)
        if data is not None:
            self._used -= len(data)
        self._durable.discard((chunk_id, blob))

    def patch(self, chunk_id: bytes, old_blob: int, new_blob: int, offset: int, data: bytes) -> None:
        source = self._blobs.pop((chunk_id, old_blob), None)
        if source is None:
            raise IoError(f"chunk {chunk_id.hex()} blob {old_blob} is missing")
        was_durable = (chunk_id, old_blob) in self._durable
        self._durable.discard((chunk_id, old_blob))
        content = bytearray(source)
        content[offset : offset + len(data)] = data
        self._blobs[(chunk_id, new_blob)] = bytes(content)
        # Until synced, a crash may leave the disk as it was before the patch (renamed back).
        self._unsynced_patches[(chunk_id, new_blob)] = (old_blob, source, was_durable)

    def unpatch(self, chunk_id: bytes, old_blob: int, new_blob: int, offset: int, old_data: bytes) -> None:
        if (chunk_id, old_blob) not in self._blobs and (chunk_id, new_blob) in self._blobs:
            self._blobs[(chunk_id, old_blob)] = self._blobs.pop((chunk_id, new_blob))
            self._durable.discard((chunk_id, new_blob))
            self._unsynced_patches.pop((chunk_id, new_blob), None)
        source = self._blobs.get((chunk_id, old_blob))
        if source is None:
            raise IoError(f"chunk {chunk_id.hex()} blob {old_blob} is missing")
        content = bytearray(source)
        content[offset : offset + len(old_data)] = old_data
        self._blobs[(chunk_id, old_blob)] = bytes(content)
        self._durable.add((chunk_id, old_blob))

    def list(self) -> Iterator[tuple[bytes, int]]:
        yield from sorted(self._blobs)

    def crash(self) -> None:
        """Drop every blob (and blob name) that was never synced."""
        for (chunk_id, new_blob), (old_blob, source, was_durable) in self._unsynced_patches.items():
            if self._blobs.pop((chunk_id, new_blob), None) is not None:
                self._blobs[(chunk_id, old_blob)] = source
                if was_durable:
                    self._durable.add((chunk_id, old_blob))
        self._unsynced_patches.clear()
        for key in [k for k in self._blobs if k not in self._durable]:
            self._used -= len(self._blobs.pop(key))

    def corrupt(self, chunk_id: bytes, blob: int, offset: int) -> None:
        """Flip one byte behind the engine's back (for checker tests)."""
        data = bytearray(self._blobs[(chunk_id, blob)])
        data[offset] ^= 0xFF
        self._blobs[(chunk_id, blob)] = bytes(data)

    def free_bytes(self) -> int:
        return self._capacity - self._used

    def capacity_bytes(self) -> int:
        return self._capacity

"""Where chunk bytes live: one file per chunk version on a real disk, or memory in the simulator.

A chunk version is written once (copy-on-write) and never modified afterwards, so a committed
version is never torn by a failed or concurrent write. ``sync`` makes a version durable; the
simulator's :class:`MemBlobStore` loses unsynced versions on :meth:`~MemBlobStore.crash`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Protocol

from fs3.common.errors import IoError, NoSpace

__all__ = ["BlobStore", "FileBlobStore", "MemBlobStore"]


class BlobStore(Protocol):
    def write(self, chunk_id: bytes, version: int, data: bytes | memoryview) -> None: ...

    def sync(self, chunk_id: bytes, version: int) -> None: ...

    def read(self, chunk_id: bytes, version: int, offset: int, length: int) -> bytes: ...

    def delete(self, chunk_id: bytes, version: int) -> None: ...

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

    def free_bytes(self) -> int:
        return int(shutil.disk_usage(self.root).free)

    def capacity_bytes(self) -> int:
        return int(shutil.disk_usage(self.root).total)


class MemBlobStore:
    """In-memory blobs with crash semantics, and an optional capacity to test full disks."""

    def __init__(self, capacity_bytes: int = 1 << 40) -> None:
        self._blobs: dict[tuple[bytes, int], bytes] = {}
        self._durable: set[tuple[bytes, int]] = set()
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

    def read(self, chunk_id: bytes, version: int, offset: int, length: int) -> bytes:
        blob = self._blobs.get((chunk_id, version))
        if blob is None:
            raise IoError(f"chunk {chunk_id.hex()} v{version} is missing")
        return blob[offset : offset + length]

    def delete(self, chunk_id: bytes, version: int) -> None:
        blob = self._blobs.pop((chunk_id, version), None)
        if blob is not None:
            self._used -= len(blob)
        self._durable.discard((chunk_id, version))

    def crash(self) -> None:
        """Drop every version that was never synced."""
        for key in [k for k in self._blobs if k not in self._durable]:
            self._used -= len(self._blobs.pop(key))

    def free_bytes(self) -> int:
        return self._capacity - self._used

    def capacity_bytes(self) -> int:
        return self._capacity

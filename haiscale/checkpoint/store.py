"""Where checkpoints go: fs3 through its native client, or a local (or mounted) directory.

The manager needs a handful of operations, each of which must mean the same on both: a file written
by :meth:`Store.write_file` is durable when the call returns (fs3: ``fsync``, which returns once
every replica of every chunk's chain acknowledged the bytes and meta holds the length; a local file:
``os.fsync``), and :meth:`Store.rename` of a directory is atomic (fs3's meta renames in one
transaction; POSIX ``rename(2)``).
"""

from __future__ import annotations

import errno
import os
import posixpath
from collections.abc import Iterable
from typing import Any, Protocol

__all__ = ["FS3Store", "LocalStore", "Store"]

_WRITE_PIECE_BYTES = 32 << 20
"""Bytes handed to the client per write call: large, so that each call queues many chunk writes
(the client keeps several per file in flight), bounded, so progress is steady."""
_READ_MANY_BYTES = 256 << 20  # bytes per read_many call: well under the client's bound of one call
_MAX_TREE_DEPTH = 8  # checkpoint directories are two levels deep; removal refuses to wander further


class Store(Protocol):
    """The file operations a checkpoint uses; paths are absolute ``/``-separated strings."""

    def join(self, *parts: str) -> str: ...

    def makedirs(self, path: str) -> None: ...

    def listdir(self, path: str) -> list[str]: ...

    def exists(self, path: str) -> bool: ...

    def size(self, path: str) -> int: ...

    def write_file(self, path: str, pieces: Iterable[memoryview | bytes]) -> None:
        """Create (or replace) ``path`` with the pieces back to back; durable on return."""

    def read_bytes(self, path: str, limit: int) -> bytes:
        """The whole file, refused (``OSError(EFBIG)``) without reading if it holds more than ``limit``."""

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from ``offset``; EOFError if the file ends first."""

    def rename(self, src: str, dst: str) -> None: ...

    def rmtree(self, path: str) -> None: ...

    def remove(self, path: str) -> None:
        """Remove one file."""

    def rmdir(self, path: str) -> None:
        """Remove an empty directory (``OSError`` if it is not empty)."""

    def close(self) -> None: ...


def _pieces(data: memoryview | bytes) -> Iterable[memoryview]:
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _WRITE_PIECE_BYTES):
        yield view[start:start + _WRITE_PIECE_BYTES]


class FS3Store:
    """A checkpoint directory on fs3, through a blocking client (``fs3.connect``). Thread-safe: the
    manager writes several files at once from a pool of threads."""

    def __init__(self, fs: Any, owned: bool) -> None:
        self.fs = fs
        self._owned = owned

    def __repr__(self) -> str:
        return f"FS3Store({self.fs!r})"

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return list(self.fs.listdir(path))

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def size(self, path: str) -> int:
        return int(self.fs.stat(path).st_size)

    def write_file(self, path: str, pieces: Iterable[memoryview | bytes]) -> None:
        # Unbuffered: each large piece goes straight to the handle, which cuts it at chunk boundaries
        # and keeps several chunk writes in flight; fsync waits for all of them and publishes the
        # length.
        with self.fs.open(path, "wb", buffering=0) as f:
            for piece in pieces:
                for part in _pieces(piece):
                    f.write(part)
            f.fsync()

    def read_bytes(self, path: str, limit: int) -> bytes:
        size = self.size(path)
        if size > limit:
            raise OSError(errno.EFBIG, f"{path} holds {size} bytes, more than the {limit} allowed")
        with self.fs.open(path, "rb", buffering=0) as f:
            return bytes(f.readall())

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        # read_many cuts the range into chunk pieces and asks every storage node holding some of
        # them at once, straight into ``buffer`` (a plain read would fetch them a window at a time).
        with self.fs.open(path, "rb", buffering=0) as f:
            for start in range(0, len(buffer), _READ_MANY_BYTES):
                piece = buffer[start:start + _READ_MANY_BYTES]
                (got,) = self.fs.read_many([(f, offset + start, len(piece))], buffer=piece)
                if len(got) < len(piece):
                    raise EOFError(f"{path} ends at byte {offset + start + len(got)}, before the "
                                   f"{offset + len(buffer)} the index promises")

    def rename(self, src: str, dst: str) -> None:
        self.fs.rename(src, dst)

    def rmtree(self, path: str) -> None:
        _rmtree(self, path, 0)

    def remove(self, path: str) -> None:
        self.fs.remove(path)

    def rmdir(self, path: str) -> None:
        self.fs.rmdir(path)

    def _scan(self, path: str) -> list[tuple[str, bool]]:
        return [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in self.fs.scandir(path)]

    def _remove(self, path: str, directory: bool) -> None:
        if directory:
            self.fs.rmdir(path)
        else:
            self.fs.remove(path)

    def close(self) -> None:
        if self._owned:
            self.fs.close()


class LocalStore:
    """A checkpoint directory on a local file system (or a mount of a shared one)."""

    def __repr__(self) -> str:
        return "LocalStore()"

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def write_file(self, path: str, pieces: Iterable[memoryview | bytes]) -> None:
        with open(path, "wb", buffering=0) as f:
            for piece in pieces:
                for part in _pieces(piece):
                    view = part
                    while len(view):
                        view = view[f.write(view) or 0:]
            os.fsync(f.fileno())
        _fsync_dir(os.path.dirname(path))

    def read_bytes(self, path: str, limit: int) -> bytes:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise OSError(errno.EFBIG, f"{path} holds {size} bytes, more than the {limit} allowed")
            return f.read()

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            _fill(f, buffer, path)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)
        _fsync_dir(os.path.dirname(dst))

    def rmtree(self, path: str) -> None:
        _rmtree(self, path, 0)

    def remove(self, path: str) -> None:
        os.remove(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def _scan(self, path: str) -> list[tuple[str, bool]]:
        with os.scandir(path) as entries:
            return [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]

    def _remove(self, path: str, directory: bool) -> None:
        if directory:
            os.rmdir(path)
        else:
            os.remove(path)

    def close(self) -> None:
        pass


def _fill(f: Any, buffer: memoryview, path: str) -> None:
    view = buffer.cast("B")
    while len(view):
        got = f.readinto(view)
        if not got:
            raise EOFError(f"{path} ends {len(view)} bytes short of what its index says it holds")
        view = view[got:]


def _fsync_dir(path: str) -> None:
    """A rename or a new file is durable once its directory is synced."""
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree(store: FS3Store | LocalStore, path: str, depth: int) -> None:
    """Remove ``path`` and everything under it (symlinks are removed, never followed)."""
    if depth > _MAX_TREE_DEPTH:
        raise OSError(errno.ELOOP, f"refusing to remove a tree deeper than {_MAX_TREE_DEPTH}", path)
    for name, is_dir in store._scan(path):
        child = store.join(path, name)
        if is_dir:
            _rmtree(store, child, depth + 1)
        else:
            store._remove(child, directory=False)
    store._remove(path, directory=True)

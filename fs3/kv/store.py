"""Ordered key-value stores with atomic write batches."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fs3.common.errors import IoError

__all__ = ["KVStore", "MemKVStore", "RocksKVStore", "WriteBatch", "open_kv"]


@dataclass
class WriteBatch:
    """Puts and deletes applied atomically by :meth:`KVStore.write`; later operations win."""

    ops: list[tuple[bytes, bytes | None]] = field(default_factory=list)

    def put(self, key: bytes, value: bytes) -> None:
        self.ops.append((key, value))

    def delete(self, key: bytes) -> None:
        self.ops.append((key, None))

    def __len__(self) -> int:
        return len(self.ops)


class KVStore(Protocol):
    def get(self, key: bytes) -> bytes | None: ...

    def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Pairs with ``start <= key < end`` in key order."""
        ...

    def write(self, batch: WriteBatch, sync: bool = True) -> None: ...

    def sync_wal(self) -> None:
        """Make every write so far durable (one fsync for many ``sync=False`` writes: group commit)."""
        ...

    def close(self) -> None: ...


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix`` (None: no bound)."""
    raw = bytearray(prefix)
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return None


class MemKVStore:
    """An in-memory ordered store. ``durable`` holds what survived the last ``sync`` write.

    The simulator uses :meth:`crash` to drop every write made with ``sync=False`` since the last
    synced one, the way a disk loses its page cache.
    """

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._keys: list[bytes] = []
        self._durable: dict[bytes, bytes] = {}
        self._unsynced = False

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        index = bisect.bisect_left(self._keys, start)
        keys = list(self._keys[index:])
        count = 0
        for key in keys:
            if end is not None and key >= end:
                return
            value = self._data.get(key)
            if value is None:
                continue
            yield key, value
            count += 1
            if limit is not None and count >= limit:
                return

    def write(self, batch: WriteBatch, sync: bool = True) -> None:
        for key, value in batch.ops:
            if value is None:
                if key in self._data:
                    del self._data[key]
                    del self._keys[bisect.bisect_left(self._keys, key)]
            else:
                if key not in self._data:
                    bisect.insort(self._keys, key)
                self._data[key] = value
        if sync:
            self._durable = dict(self._data)
            self._unsynced = False
        else:
            self._unsynced = True

    # Syncing copies a dict: cheap, and must not race with writes on the event-loop thread.
    sync_in_thread = False

    def sync_wal(self) -> None:
        self._durable = dict(self._data)
        self._unsynced = False

    def crash(self) -> None:
        """Lose every unsynced write."""
        self._data = dict(self._durable)
        self._keys = sorted(self._data)
        self._unsynced = False

    def close(self) -> None:
        pass


class RocksKVStore:
    """RocksDB through rocksdict: write batches are atomic, ``sync=True`` waits for the WAL fsync."""

    def __init__(self, path: str | Path) -> None:
        from rocksdict import Options, Rdict, WriteOptions

        Path(path).mkdir(parents=True, exist_ok=True)
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        try:
            self._db = Rdict(str(path), options=options)
        except Exception as exc:  # rocksdict raises a bare Exception on lock/corruption errors
            raise IoError(f"cannot open RocksDB at {path}: {exc}") from None
        self._sync_opts = WriteOptions()
        self._sync_opts.sync = True
        self._nosync_opts = WriteOptions()
        self._path = str(path)

    def get(self, key: bytes) -> bytes | None:
        value = self._db.get(key)
        return None if value is None else bytes(value)

    def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        from rocksdict import ReadOptions

        options = ReadOptions()
        if end is not None:
            # Without an upper bound the iterator skips every deleted key past `end` until it finds
            # a live one (deleted sessions, jobs...): a short scan would cost O(tombstones).
            options.set_iterate_upper_bound(end)
        it = self._db.iter(options)
        it.seek(start)
        count = 0
        while it.valid():
            key = bytes(it.key())
            if end is not None and key >= end:
                break
            yield key, bytes(it.value())
            count += 1
            if limit is not None and count >= limit:
                break
            it.next()

    def write(self, batch: WriteBatch, sync: bool = True) -> None:
        from rocksdict import WriteBatch as RocksBatch

        rb = RocksBatch(raw_mode=True)
        for key, value in batch.ops:
            if value is None:
                rb.delete(key)
            else:
                rb.put(key, value)
        try:
            self._db.write(rb, self._sync_opts if sync else self._nosync_opts)
        except Exception as exc:
            raise IoError(f"RocksDB write to {self._path} failed: {exc}") from None

    # An fsync: run it off the event loop so commits keep flowing while it waits for the disk.
    sync_in_thread = True

    def sync_wal(self) -> None:
        try:
            self._db.flush_wal(True)
        except Exception as exc:
            raise IoError(f"RocksDB WAL sync of {self._path} failed: {exc}") from None

    def close(self) -> None:
        self._db.close()


def open_kv(engine: str, path: str | Path | None = None) -> KVStore:
    """Open a store by engine name (``rocksdb`` needs a path)."""
    if engine == "mem":
        return MemKVStore()
    if engine == "rocksdb":
        if path is None:
            raise ValueError("the rocksdb engine needs a path")
        return RocksKVStore(path)
    raise ValueError(f"unknown kv engine {engine!r} (known: rocksdb, mem)")

"""Ordered key-value stores with atomic write batches."""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fs3.common.durable import make_dirs_durable
from fs3.common.errors import IoError, NoSpace
from fs3.common.faults import sabotaged

__all__ = ["KVStore", "MemKVStore", "RocksKVStore", "WriteBatch", "open_kv"]

log = logging.getLogger(__name__)


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
        self._syncs = not sabotaged("kv-sync")

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        index = bisect.bisect_left(self._keys, start)
        stop = len(self._keys) if end is None else bisect.bisect_left(self._keys, end)
        keys = self._keys[index:stop]  # a copy of the range only, not of every key after it
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
        if sync and self._syncs:
            self._durable = dict(self._data)
            self._unsynced = False
        else:
            self._unsynced = True

    # Syncing copies a dict: cheap, and must not race with writes on the event-loop thread.
    sync_in_thread = False

    def sync_wal(self) -> None:
        if self._syncs:
            self._durable = dict(self._data)
            self._unsynced = False

    def snapshot(self) -> MemKVStore:
        """A frozen copy, for reads of one point in time (:meth:`OptimisticTxnEngine.snapshot`).
        It costs a copy of the store: this engine is for tests and the simulator, whose stores
        are small. Taken without an await, so no commit is half in it."""
        view = MemKVStore()
        view._data = dict(self._data)
        view._keys = list(self._keys)
        return view

    def crash(self) -> None:
        """Lose every unsynced write."""
        self._data = dict(self._durable)
        self._keys = sorted(self._data)
        self._unsynced = False

    def close(self) -> None:
        pass


_MIB = 1 << 20
# A batch that writes at most this many bytes of values is metadata (a commit, a removal, a
# tombstone): it may use the lower half of the headroom, so that a full target can still take the
# deletes that will give its space back.
_SMALL_BATCH_BYTES = 4096
_BATCH_OP_OVERHEAD = 32


def _looks_like_no_space(text: str) -> bool:
    return "no space left on device" in text.lower() or "nospace" in text.lower()


class _Gate:
    """Many users at once, or one thread alone to swap the database handle (reopen after an error).

    Users never wait for a swap that is only pending (a thread that holds the gate while a scan is
    open may take it again), and the swapping side waits a bounded time for users to leave.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._users = 0
        self._swapping = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._swapping:
                self._cond.wait()
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                if not self._users:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, timeout_s: float) -> Iterator[bool]:
        with self._cond:
            if not self._cond.wait_for(lambda: not self._users and not self._swapping, timeout_s):
                acquired = False
            else:
                self._swapping = acquired = True
        try:
            yield acquired
        finally:
            if acquired:
                with self._cond:
                    self._swapping = False
                    self._cond.notify_all()


class RocksKVStore:
    """RocksDB through rocksdict: write batches are atomic, ``sync=True`` waits for the WAL fsync.

    A full disk is survivable. RocksDB that runs out of space while appending to its write-ahead
    log stops accepting writes for good (a "hard" background error): its own recovery waits for
    as much free space as a memtable (64 MiB by default), which a small disk never has, and
    rocksdict cannot call ``Resume()``. So:

    * The memtable, hence the log behind it, is at most 1/64 of the disk, so flushes happen (and
      free log space) long before a small disk is full.
    * With ``headroom_bytes`` set, a write is refused with :class:`NoSpace` — before RocksDB sees
      it — when it would leave less than that much free (metadata-sized batches: less than half),
      so that RocksDB always has room to flush a memtable.
    * Should RocksDB hit ENOSPC anyway (something else filled the disk), writes raise
      :class:`NoSpace` (a failed log sync raises :class:`IoError`: what it covered is uncertain),
      :attr:`space_error` says why, reads go on, and :meth:`maintain` reopens the database once the
      space is back.
    * :meth:`maintain` also flushes when space runs low after deletes: a deleted value only gives
      its space back once its tombstone has been compacted with it, and table files that are mostly
      tombstones are compacted soon.
    """

    def __init__(self, path: str | Path, headroom_bytes: int = 0) -> None:
        from rocksdict import WriteOptions

        # RocksDB syncs its own directory, never the one holding it: a new store's directory is
        # synced into its parent here, or a power loss could take the whole store back.
        make_dirs_durable(path)
        self._path = str(path)
        capacity = int(shutil.disk_usage(self._path).total)
        self.write_buffer_bytes = self._write_buffer_for(capacity)
        self.headroom_bytes = headroom_bytes
        self.space_error: str | None = None  # set while RocksDB refuses writes for lack of space
        self._gate = _Gate()
        self._deletes_since_flush = 0
        self._next_flush = 0.0
        try:
            self._db = self._open()
        except Exception as exc:  # rocksdict raises a bare Exception on lock/corruption errors
            raise IoError(f"cannot open RocksDB at {path}: {exc}") from None
        self._nosync_opts = WriteOptions()
        self._syncs = not sabotaged("kv-sync")
        self._sync_opts = WriteOptions()
        self._sync_opts.sync = self._syncs

    @staticmethod
    def _write_buffer_for(capacity: int) -> int:
        return max(256 << 10, min(64 * _MIB, capacity // 64))

    @classmethod
    def default_headroom(cls, path: str | Path) -> int:
        """Free space a store on ``path``'s disk keeps for RocksDB itself: the log of a second
        memtable and the table file a flush writes (2 memtables), a compaction of level 0 into
        level 1 (4 + 4 memtables: see :meth:`_open`), and 1 MiB of slack. About 16% of a small
        disk; 641 MiB on one of 4 GiB or more."""
        make_dirs_durable(path)
        return 10 * cls._write_buffer_for(int(shutil.disk_usage(path).total)) + _MIB

    def _open(self, read_only: bool = False) -> Any:
        from rocksdict import AccessType, Options, Rdict

        options = Options(raw_mode=True)
        options.create_if_missing(True)
        # Sized to the disk so that flushes and compactions need a known, small share of it: level 1
        # holds 4 memtables (as level 0 before it is compacted), files are a memtable each, and the
        # levels do not follow the database's size (with dynamic level sizes a small database is
        # compacted from level 0 straight into its last level, rewriting all of it each time).
        # Big disks get RocksDB's defaults except for the dynamic level sizes.
        options.set_write_buffer_size(self.write_buffer_bytes)
        options.set_target_file_size_base(self.write_buffer_bytes)
        options.set_level_compaction_dynamic_level_bytes(False)
        options.set_max_bytes_for_level_base(4 * self.write_buffer_bytes)
        # A table file with a run of tombstones (48 in any 128 keys) is compacted soon, without
        # waiting for its level to fill, down to the level that holds what they delete: that is how
        # deleted chunks give their space back.
        options.add_compact_on_deletion_collector_factory(128, 48, 0.5)
        if read_only:
            return Rdict(self._path, options=options, access_type=AccessType.read_only())
        return Rdict(self._path, options=options)

    def free_bytes(self) -> int:
        return int(shutil.disk_usage(self._path).free)

    def snapshot(self) -> RocksKVStore:
        """A read-only view of the store as it is now (:meth:`OptimisticTxnEngine.snapshot`):
        see :meth:`open_view`."""
        return self.open_view(self._path)

    @classmethod
    def open_view(cls, path: str | Path) -> RocksKVStore:
        """A read-only view of the store at ``path`` as it is now, which may be open in another
        process (``fs3 admin dump`` beside a running meta): a second, read-only instance on the
        same files. It replays the write-ahead log into its own memtable when it opens, every
        write batch whole or not at all (a batch the writer is still appending is left out), and
        then never changes: a point-in-time view that copies no data. (rocksdict's own
        ``Snapshot`` iterates the live database in raw mode: tried, it sees later writes.) The
        writer may delete table files the view has not opened yet (after a compaction): a read of
        one fails with :class:`IoError`, and a view taken again succeeds."""
        if not Path(path).is_dir():
            raise IoError(f"no RocksDB at {path}")
        view = cls.__new__(cls)
        view._path = str(path)
        view.write_buffer_bytes = cls._write_buffer_for(int(shutil.disk_usage(view._path).total))
        view.headroom_bytes = 0
        view.space_error = "a read-only view"  # refuses writes
        view._gate = _Gate()
        view._deletes_since_flush = 0
        view._next_flush = 0.0
        view._syncs = False
        try:
            view._db = view._open(read_only=True)
        except Exception as exc:  # rocksdict raises a bare Exception
            raise IoError(f"cannot open a read-only view of RocksDB at {path}: {exc}") from None
        return view

    def get(self, key: bytes) -> bytes | None:
        with self._gate.shared():
            value = self._db.get(key)
        return None if value is None else bytes(value)

    def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        from rocksdict import ReadOptions

        options = ReadOptions()
        if end is not None:
            # Without an upper bound the iterator skips every deleted key past `end` until it finds
            # a live one (deleted sessions, jobs...): a short scan would cost O(tombstones).
            options.set_iterate_upper_bound(end)
        with self._gate.shared():
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
            del it  # the iterator keeps the database open: let it go before a reopen

    def write(self, batch: WriteBatch, sync: bool = True) -> None:
        from rocksdict import WriteBatch as RocksBatch

        rb = RocksBatch(raw_mode=True)
        size = value_bytes = deletes = 0
        for key, value in batch.ops:
            size += len(key) + _BATCH_OP_OVERHEAD
            if value is None:
                rb.delete(key)
                deletes += 1
            else:
                rb.put(key, value)
                size += len(value)
                value_bytes += len(value)
        with self._gate.shared():
            self._check_room(size, value_bytes)
            try:
                self._db.write(rb, self._sync_opts if sync else self._nosync_opts)
            except Exception as exc:
                # The batch was not applied (RocksDB writes the log before the memtable).
                if _looks_like_no_space(str(exc)) or self.space_error is not None:
                    self._note_space_error(str(exc))
                    raise NoSpace(f"RocksDB write to {self._path}: {exc}") from None
                raise IoError(f"RocksDB write to {self._path} failed: {exc}") from None
        if deletes:
            self._deletes_since_flush += deletes

    def _check_room(self, size: int, value_bytes: int) -> None:
        if self.space_error is not None:
            raise NoSpace(f"RocksDB at {self._path} ran out of space ({self.space_error}); "
                          "writes resume once space is back")
        if not self.headroom_bytes:
            return
        floor = self.headroom_bytes if value_bytes > _SMALL_BATCH_BYTES else self.headroom_bytes // 2
        free = self.free_bytes()
        if free - size < floor:
            raise NoSpace(f"{self._path}: {free} bytes free, a write of {size} bytes would leave less than the "
                          f"{floor} bytes RocksDB needs to flush")

    def _note_space_error(self, text: str) -> None:
        if self.space_error is None:
            self.space_error = text
            log.warning("RocksDB at %s is out of space, refusing writes until space is back: %s", self._path, text)

    # An fsync: run it off the event loop so commits keep flowing while it waits for the disk.
    sync_in_thread = True

    def sync_wal(self) -> None:
        if not self._syncs:
            return
        with self._gate.shared():
            try:
                self._db.flush_wal(True)
            except Exception as exc:
                # Unsynced writes before this one may or may not be durable: never a NoSpace (which
                # says "nothing happened"). After ENOSPC the log writer only says "Writer has previous
                # error", so a nearly full disk counts as the cause too.
                text = str(exc)
                if _looks_like_no_space(text) or self.space_error is not None \
                        or self.free_bytes() < max(self.headroom_bytes, _MIB):
                    self._note_space_error(text)
                raise IoError(f"RocksDB WAL sync of {self._path} failed: {exc}") from None

    def maintain(self, low_space_bytes: int = 0) -> None:
        """Periodic upkeep, off the event loop (the storage node calls it every second or so).

        After a space error: reopen the database once there is room to replay its log (RocksDB
        flushes the replayed log to a table file on open). Otherwise, when free space is below
        ``low_space_bytes`` (default: twice the headroom) and keys were deleted since the last
        time: flush the memtable, so that the tombstones reach a table file, which RocksDB then
        compacts with the values they delete (see :meth:`_open`) — without it a few deletes sit in
        the memtable indefinitely and a full disk stays full — and compact everything when even
        rewriting every table file would fit. At most once a second.
        """
        if self.space_error is not None:
            self._reopen_if_room()
            return
        low = low_space_bytes or 2 * self.headroom_bytes
        if not self._deletes_since_flush or time.monotonic() < self._next_flush or self.free_bytes() >= low:
            return
        self._deletes_since_flush = 0
        self._next_flush = time.monotonic() + 1.0
        with self._gate.shared():
            try:
                self._db.flush(True)
                # A compaction of everything writes at most every live table file anew before it
                # deletes the old ones: when that fits, do it, rather than wait for RocksDB to pick
                # the files with the tombstones.
                if self.free_bytes() - self.headroom_bytes // 2 >= \
                        self._db.property_int_value("rocksdb.live-sst-files-size"):
                    self._db.compact_range(None, None)
            except Exception as exc:
                log.warning("RocksDB at %s: flush to reclaim deleted space failed: %s", self._path, exc)
                return
        log.debug("RocksDB at %s: flushed deletes to reclaim their space (%d bytes free)", self._path,
                  self.free_bytes())

    def _log_bytes(self) -> int:
        total = 0
        for entry in os.scandir(self._path):
            if entry.name.endswith(".log") and entry.is_file():
                with contextlib.suppress(OSError):
                    total += entry.stat().st_size
        return total

    def _reopen_if_room(self) -> None:
        if self.free_bytes() < self._log_bytes() + max(self.headroom_bytes, _MIB):
            return
        with self._gate.exclusive(timeout_s=5.0) as alone:
            if not alone:
                log.info("RocksDB at %s: still in use, reopen postponed", self._path)
                return
            with contextlib.suppress(Exception):
                self._db.close()  # fails to flush (the log writer has the error) but lets go
            try:
                self._db = self._open()
            except Exception as exc:
                log.warning("RocksDB at %s: reopen after running out of space failed: %s", self._path, exc)
                # Keep serving reads from a read-only handle; the next maintain() tries again.
                try:
                    self._db = self._open(read_only=True)
                except Exception as ro_exc:
                    log.error("RocksDB at %s: cannot even open it read-only: %s", self._path, ro_exc)
                return
            log.info("RocksDB at %s reopened after running out of space (was: %s)", self._path, self.space_error)
            self.space_error = None

    def close(self) -> None:
        try:
            self._db.close()
        except Exception as exc:
            # Closing flushes the memtable; after a space error that fails, and the log still has it.
            if self.space_error is None:
                raise IoError(f"closing RocksDB at {self._path} failed: {exc}") from None
            log.warning("RocksDB at %s closed without a flush (out of space): %s", self._path, exc)


def open_kv(engine: str, path: str | Path | None = None, headroom_bytes: int = 0) -> KVStore:
    """Open a store by engine name (``rocksdb`` needs a path; ``headroom_bytes``: see
    :class:`RocksKVStore`)."""
    if engine == "mem":
        return MemKVStore()
    if engine == "rocksdb":
        if path is None:
            raise ValueError("the rocksdb engine needs a path")
        return RocksKVStore(path, headroom_bytes)
    raise ValueError(f"unknown kv engine {engine!r} (known: rocksdb, mem)")

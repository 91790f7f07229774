"""Metadata backups: write a dump (:mod:`fs3.meta.dump`) to a file, load one into an empty meta,
and keep the newest K of periodic backups in a directory.

* **Dump** reads one :class:`~fs3.kv.api.SnapshotReader` (a RocksDB read-only view, or a
  PostgreSQL ``REPEATABLE READ`` transaction), so the dump is the namespace at one instant while
  the cluster keeps writing. A file is written as ``NAME.tmp``, synced, then renamed: a file
  under its final name is always a whole dump.
* **Load** reads the file twice. The first pass checks all of it (format and schema version,
  order, counts, SHA-256, values meta must decode) and writes nothing; then the target is checked
  empty; the second pass writes the records in transactions of ``batch_records`` pairs. The first
  batch checks, in its own transaction, that the store is still empty (a meta server started
  meanwhile would have made its root), and writes the raised next inode id first and a marker
  (``schema.LOAD_UNFINISHED``) that the last batch deletes: a load killed midway leaves part of
  the namespace, which a meta server refuses to start on, and never a store from which one would
  hand out the ids (hence chunks) of the dumped files. Should the second pass fail (the file changed
  between the passes, the store refused a write), every pair it wrote is deleted again before the
  error is raised.
* **Backups**: :func:`backup_to` writes ``fs3-meta-<UTC time>.dump`` into a :class:`BackupDir` and
  only then removes the oldest beyond ``keep`` (and the temporary files of a backup killed while
  writing). A directory is a local one (:class:`LocalBackupDir`, also one on an fs3 mount) or one
  in an fs3 cluster reached through the client API, no mount needed
  (:class:`fs3.meta.backup_fs3.Fs3BackupDir`). :func:`backup_once` is :func:`backup_to` of a local
  directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from fs3.common.errors import InvalidArgument
from fs3.common.formats import FormatRecord
from fs3.kv.api import SnapshotReader, Transaction, TxnEngine
from fs3.kv.formats import release
from fs3.kv.txn import run_transaction
from fs3.meta.dump import DumpError, DumpReader, DumpStats, dump_snapshot, read_lines
from fs3.meta.formats import META_FORMAT, META_KIND
from fs3.meta.schema import LOAD_UNFINISHED, counter_key, decode_u64, encode_u64, parse_inode_key

__all__ = [
    "BACKUP_PREFIX",
    "BACKUP_SUFFIX",
    "INODE_ID_GAP",
    "TMP_STALE_S",
    "TMP_SUFFIX",
    "TMP_TOUCH_S",
    "BackupDir",
    "LoadStats",
    "LocalBackupDir",
    "backup_name",
    "backup_once",
    "backup_to",
    "dump_to_file",
    "dump_to_stream",
    "is_backup_name",
    "is_temporary_name",
    "list_backups",
    "load_dump",
    "store_is_empty",
    "temporary_name",
]

log = logging.getLogger(__name__)

BACKUP_PREFIX = "fs3-meta-"
# How far a load raises the next inode id above the dump's (load_dump says why): 2^32 ids,
# more than a cluster makes between two backups, a sliver of the 64-bit id space.
INODE_ID_GAP = 1 << 32
BACKUP_SUFFIX = ".dump"
TMP_SUFFIX = ".tmp"  # what a backup is written as until it is whole (NAME.dump.TOKEN.tmp)
# A writer touches its temporary file at least this often (it writes a piece, or syncs) ...
TMP_TOUCH_S = 60
# ... so one untouched for this long, measured against the new backup's time of the same clock
# (the file system's), is what a killed run left: a partial copy of the namespace and the user
# table's hashes, removed by the next backup. A younger one may be another run's, still writing.
TMP_STALE_S = 3600


async def dump_to_stream(reader: SnapshotReader, out: IO[bytes], cluster_id: str, page_records: int = 1000,
                         now_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000) -> DumpStats:
    """Dump what ``reader`` sees into ``out`` (closes the reader)."""
    async def emit(line: bytes) -> None:
        out.write(line)

    try:
        return await dump_snapshot(reader, emit, cluster_id, now_ms(), page_records)
    finally:
        await reader.close()


async def dump_to_file(reader: SnapshotReader, path: Path, cluster_id: str, page_records: int = 1000,
                       tmp_name: str | None = None) -> DumpStats:
    """Dump into ``path`` atomically: a temporary file beside it, synced, renamed over it (mode 0600:
    the dump holds the user table's secret hashes and every name in the namespace). Closes the
    reader, also when the file cannot be made (a backup loop must not pile up open snapshots, each
    pinning the store's old files or a database snapshot).

    ``tmp_name``: a temporary name of this writer's alone (:func:`temporary_name`), made with
    ``O_EXCL``; None: ``path`` + :data:`TMP_SUFFIX`, truncated if there (what ``fs3 admin dump
    --out`` run again after a kill finds)."""
    tmp = path.with_name(path.name + TMP_SUFFIX if tmp_name is None else tmp_name)
    try:
        # O_NOFOLLOW: a link planted under the temporary name must not point the dump (or its truncation) elsewhere.
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if tmp_name is None else os.O_EXCL)
        fd = os.open(tmp, flags, 0o600)
    except BaseException:
        await reader.close()
        raise
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as out:
            stats = await dump_to_stream(reader, out, cluster_id, page_records)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename durable too (a directory on fs3 may not sync)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return stats


def _lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from read_lines(f)


@dataclass
class LoadStats:
    records: int
    batches: int
    counts: dict[str, int]
    cluster_id: str


async def store_is_empty(engine: TxnEngine) -> bool:
    """Whether meta's store holds no key at all (what a load needs: a fresh data directory or
    database, before any meta server started on it)."""
    txn = engine.begin()
    try:
        return not await txn.scan(b"", None, limit=1)
    finally:
        abandon = getattr(txn, "abandon", None)
        if abandon is not None:
            abandon()


async def load_dump(engine: TxnEngine, path: Path, batch_records: int = 500,
                    inode_id_gap: int = INODE_ID_GAP) -> LoadStats:
    """Load the dump at ``path`` into ``engine``'s store, which must be empty (see the module
    docstring: nothing is written when the file or the target is not right).

    The next inode id is raised by ``inode_id_gap`` above the dumped one: the cluster the dump
    was taken of may have made files after it, whose chunks (named by their inode ids) are still
    on storage; a restored meta handing out those ids again would give a new file their bytes."""
    if batch_records <= 0:
        raise InvalidArgument("batch_records must be positive")
    if inode_id_gap < 0:
        raise InvalidArgument("inode_id_gap must not be negative")
    if not path.is_file():
        raise InvalidArgument(f"{path}: no such dump file (load reads a file twice, so not a pipe)")
    next_key, next_inode, inode_max = counter_key("next_inode"), 0, 0
    check = DumpReader()
    try:
        for kind, key, value in check.records(_lines(path)):
            if kind == "inode":
                inode_max = max(inode_max, parse_inode_key(key))
            elif key == next_key:
                next_inode = decode_u64(value)
    except DumpError as exc:  # which file, as the operator named it; nothing was written yet
        raise DumpError(f"{path}: {exc.message}; nothing was written") from None
    next_raised = max(next_inode, inode_max + 1) + inode_id_gap
    if next_raised >= 1 << 64:
        raise InvalidArgument(f"the dump's next inode id {max(next_inode, inode_max + 1)} leaves no room for the "
                              f"gap of {inode_id_gap} ids a load keeps free; nothing was written")
    if not await store_is_empty(engine):
        raise InvalidArgument("the target meta store is not empty: load only into a new data directory "
                              "(or database) before any meta server has started on it (a load that was "
                              "interrupted leaves part of a dump: start again from an empty one); "
                              "nothing was written")
    loaded_format = FormatRecord(META_KIND, int(check.header.get("meta_format", 1)), release(),
                                 str(check.header["cluster_id"]))
    written = 0
    batches = 0
    # The marker and the raised next inode id go first (see the module docstring).
    batch: list[tuple[bytes, bytes]] = [(LOAD_UNFINISHED, b""), (next_key, encode_u64(next_raised))]

    async def flush(last: bool = False) -> None:
        nonlocal written, batches
        pairs, first = list(batch), batches == 0

        async def put(txn: Transaction) -> None:
            if first and await txn.scan(b"", None, limit=1):
                raise InvalidArgument("the target meta store stopped being empty (a meta server started on it?); "
                                      "nothing was written")
            for key, value in pairs:
                txn.put(key, value)
            if last:
                txn.delete(LOAD_UNFINISHED)
                # The records are in the dump's meta format: stamped so, the next start migrates
                # them from that format (unstamped, it would take them for format 1).
                txn.put(META_FORMAT.record_key, loaded_format.encode())

        await run_transaction(engine, put)
        written += len(pairs)
        batches += 1
        batch.clear()

    reader = DumpReader()
    try:
        for _kind, key, value in reader.records(_lines(path)):
            if key == next_key:
                continue  # written first, raised by the gap
            batch.append((key, value))
            if len(batch) >= batch_records:
                await flush()
        await flush(last=True)
    except BaseException:
        if written:
            try:
                await _roll_back(engine, path, written, batch_records)
            except Exception as exc:
                log.error("a failed load could not delete the %d pairs it wrote (%s): the store holds part of "
                          "the dump; load into a new data directory (or database)", written, exc)
        raise
    return LoadStats(sum(reader.counts.values()), batches, dict(reader.counts), str(reader.header["cluster_id"]))


async def _roll_back(engine: TxnEngine, path: Path, written: int, batch_records: int) -> None:
    """Delete what a failed load wrote: the first ``written`` - 2 pairs of the dump, in batches, then
    the next inode id and the marker, so that a roll-back cut short still leaves both."""
    keys: list[bytes] = []

    async def delete(txn: Transaction) -> None:
        for key in keys:
            txn.delete(key)

    reader, left = DumpReader(), written - 2
    with contextlib.suppress(InvalidArgument):  # the file may have changed: its first pairs are what was written
        for _, key, _value in reader.records(_lines(path)):
            if not left:
                break
            if key == counter_key("next_inode"):
                continue  # written first, deleted last
            keys.append(key)
            left -= 1
            if len(keys) >= batch_records or not left:
                await run_transaction(engine, delete)
                keys.clear()
    keys += [counter_key("next_inode"), LOAD_UNFINISHED]
    await run_transaction(engine, delete)


def list_backups(directory: Path) -> list[Path]:
    """The complete backups in ``directory``, oldest first (names sort as their times do)."""
    return sorted(p for p in directory.iterdir()
                  if p.name.startswith(BACKUP_PREFIX) and p.name.endswith(BACKUP_SUFFIX) and p.is_file())


def backup_name(now_ns: int) -> str:
    seconds, rest_ns = divmod(now_ns, 1_000_000_000)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(seconds))
    return f"{BACKUP_PREFIX}{stamp}.{rest_ns // 1_000_000:03d}Z{BACKUP_SUFFIX}"


class BackupDir(Protocol):
    """Where periodic backups go: a directory that can list its files, write one atomically (a
    temporary name, made durable, then renamed) and remove one."""

    def location(self, name: str) -> str:
        """How to name file ``name`` of this directory to a person (a path, a URL)."""
        ...

    async def prepare(self) -> None:
        """Make the directory (and its parents) if it is missing."""
        ...

    async def names(self) -> list[str]:
        """The names of the regular files in the directory."""
        ...

    async def mtime_ns(self, name: str) -> int | None:
        """When file ``name`` was last modified, by the directory's own clock; None: it is gone."""
        ...

    async def write(self, name: str, reader: SnapshotReader, cluster_id: str, page_records: int) -> DumpStats:
        """Dump ``reader`` (closed after, also on failure) into a temporary name of this writer's
        alone (:func:`temporary_name`), touched at least every :data:`TMP_TOUCH_S`, make it
        durable, then rename it to ``name``; the temporary file is removed on failure."""
        ...

    async def remove(self, name: str) -> None:
        """Remove file ``name``; one already gone is no error."""
        ...


class LocalBackupDir:
    """A local directory (or one on an fs3 mount): :func:`dump_to_file` into it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def location(self, name: str) -> str:
        return str(self.directory / name)

    async def prepare(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    async def names(self) -> list[str]:
        return [p.name for p in self.directory.iterdir() if p.is_file()]

    async def mtime_ns(self, name: str) -> int | None:
        try:
            return (self.directory / name).lstat().st_mtime_ns
        except FileNotFoundError:
            return None

    async def write(self, name: str, reader: SnapshotReader, cluster_id: str, page_records: int) -> DumpStats:
        # A writer's file is written every MiB (the buffer), which touches it (TMP_TOUCH_S).
        return await dump_to_file(reader, self.directory / name, cluster_id, page_records, temporary_name(name))

    async def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.directory / name).unlink()


def is_backup_name(name: str) -> bool:
    return name.startswith(BACKUP_PREFIX) and name.endswith(BACKUP_SUFFIX)


def temporary_name(name: str) -> str:
    """The name backup ``name`` is written as until it is whole: ``NAME.TOKEN.tmp``, of this writer
    alone, so that two runs that chose the same ``name`` (the same millisecond, two hosts) never
    write, remove or rename each other's file."""
    return f"{name}.{secrets.token_hex(4)}{TMP_SUFFIX}"


def is_temporary_name(name: str) -> bool:
    """A backup's temporary file (``NAME.TOKEN.tmp``, or ``NAME.tmp`` of older versions)."""
    return name.startswith(BACKUP_PREFIX) and name.endswith(TMP_SUFFIX) and BACKUP_SUFFIX + "." in name


async def backup_to(take: Callable[[], Awaitable[SnapshotReader]], directory: BackupDir, keep: int, cluster_id: str,
                    page_records: int = 1000, now_ns: Callable[[], int] = time.time_ns) -> tuple[str, list[str]]:
    """One backup into ``directory`` from a snapshot ``take`` makes, then the oldest beyond
    ``keep`` removed: returns the new file's name and the removed ones. A failed dump removes
    nothing.

    The new backup is always among those kept, whatever sorts after it (names of a clock set
    back, of another host's clock ahead, files put there by hand): else it would be the oldest,
    removed as soon as written, and no backup of now would be left. Temporary files are removed
    only once stale (:data:`TMP_STALE_S`): a younger one may be another run's, still writing."""
    if keep < 1:
        raise InvalidArgument("keep must be at least 1")
    await directory.prepare()
    name = backup_name(now_ns())
    if name in await directory.names():
        raise InvalidArgument(f"{directory.location(name)} exists already (two backups in the same millisecond?)")
    await directory.write(name, await take(), cluster_id, page_records)
    names = sorted(await directory.names())
    others = [n for n in names if is_backup_name(n) and n != name]  # names sort as their times do
    newer = [n for n in others if n > name]
    if newer:
        log.warning("%d backups in %s are named after the new one (%s): a clock set back, another host's clock "
                    "ahead, or files put there; the new one is kept", len(newer), directory.location(""), newer[-1])
    removed = others[:len(others) - (keep - 1)] if len(others) > keep - 1 else []
    for old in removed:
        await directory.remove(old)
    written_ns = await directory.mtime_ns(name)
    for leftover in names:
        if not is_temporary_name(leftover) or written_ns is None:
            continue
        touched_ns = await directory.mtime_ns(leftover)
        if touched_ns is not None and written_ns - touched_ns > TMP_STALE_S * 1_000_000_000:
            await directory.remove(leftover)
    return name, removed


async def backup_once(take: Callable[[], Awaitable[SnapshotReader]], directory: Path, keep: int, cluster_id: str,
                      page_records: int = 1000, now_ns: Callable[[], int] = time.time_ns) -> tuple[Path, list[Path]]:
    """:func:`backup_to` a local directory: the new file and the removed ones."""
    name, removed = await backup_to(take, LocalBackupDir(directory), keep, cluster_id, page_records, now_ns)
    return directory / name, [directory / old for old in removed]

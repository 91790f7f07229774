"""The record shard: many small samples packed into one file that a reader indexes once and then
reads by record number, in batches, with one scattered read per batch.

Small files are what a distributed file system serves worst: every sample costs a metadata
operation and a round trip. Packing them (as FFRecord does for 3FS) turns a batch of samples into a
batch of byte ranges of a few large files, which the fs3 client reads concurrently in one call
(``read_many``). Layout of a shard (all integers little-endian)::

    header   32 bytes   magic "HSRECORD", version u32, flags u32 (0), count u64,
                        tables CRC32C u32, header CRC32C u32 (of the 28 bytes before it)
    offsets  (count + 1) x u64   record i is bytes [off[i], off[i+1]) of the file;
                                 off[0] is the end of the tables, off[count] the file's size
    crcs     count x u32         CRC32C of each record
    records  back to back

Everything a header claims is checked against the file before anything is sized by it (the count
against the file's size, the offsets against each other and the size), so a corrupt or hostile
file gives an error naming it, never a huge allocation or a read past its end.

A file system here is anything with the ``os``-like calls :class:`RecordFS` lists: the fs3 client
(``fs3.connect``) or :class:`LocalFileSystem`, the same calls on a local directory (tests and
benchmarks compare the two; a FUSE mount of fs3 is a local directory too).
"""

from __future__ import annotations

import os
import posixpath
import secrets
import struct
import tempfile
from collections.abc import Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import IO, Any, Protocol

import crc32c
import numpy as np
import numpy.typing as npt

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_RECORDS_PER_SHARD",
    "MAX_RECORD_BYTES",
    "LocalFileSystem",
    "RecordFS",
    "RecordFormatError",
    "RecordWriter",
    "ShardIndex",
    "read_index",
    "shard_name",
    "write_shards",
]

MAGIC = b"HSRECORD"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQII")
HEADER_BYTES = _HEADER.size  # 32
# Each record costs 12 bytes of tables (an offset and a CRC): a count is bounded by the file's size
# first, and by this cap too (1.5 GiB of tables), so no header makes a reader allocate more.
MAX_RECORDS_PER_SHARD = 1 << 27
MAX_RECORD_BYTES = 1 << 28
"""The largest record (256 MiB): a batch reads whole records into memory, and the converter holds one."""
# What the first read of a shard takes: the header and, for shards of up to ~5000 records, the
# tables too — one read; a bigger shard's tables take a second.
_FIRST_READ_BYTES = 64 * 1024
# Pieces the writer copies its spooled records in (memory bounded whatever the shard's size).
_COPY_PIECE_BYTES = 4 * 1024 * 1024


class RecordFormatError(ValueError):
    """A file is not a well-formed record shard (or a record fails its checksum); the message names
    the file, and the record where there is one."""


class RecordFS(Protocol):
    """The calls the record code makes on a file system: fs3's client and :class:`LocalFileSystem`
    both have them."""

    def open(self, path: str, mode: str = "r", buffering: int = -1) -> Any: ...
    def stat(self, path: str) -> os.stat_result: ...
    def isdir(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...
    def makedirs(self, path: str, mode: int = 0o777, exist_ok: bool = False) -> None: ...
    def replace(self, src: str, dst: str) -> None: ...
    def remove(self, path: str) -> None: ...
    def read_many(self, ranges: Sequence[tuple[Any, int, int]], buffer: Any = None) -> list[memoryview]: ...
    def close(self) -> None: ...


class LocalFileSystem:
    """:class:`RecordFS` on the local file system (a disk, or fs3's FUSE mount).

    ``read_many`` does what fs3's does, with positional reads (``os.preadv``) on each range in
    turn: no seek, so one open file serves concurrent callers.
    """

    def __repr__(self) -> str:
        return "LocalFileSystem()"

    def open(self, path: str, mode: str = "r", buffering: int = -1) -> Any:
        return open(path, mode, buffering)

    def stat(self, path: str) -> os.stat_result:
        return os.stat(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def makedirs(self, path: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        os.makedirs(path, mode, exist_ok=exist_ok)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        os.remove(path)

    def close(self) -> None:
        """Nothing to release: files are opened and closed per call."""

    def read_many(self, ranges: Sequence[tuple[Any, int, int]], buffer: Any = None) -> list[memoryview]:
        """Each ``(file, offset, length)`` read into ``buffer`` (or a new bytearray), back to back in
        range order; one view per range, short where its file ends. ``file`` is a path or a file
        opened with ``open(path, "rb", buffering=0)``."""
        views = _prepare_ranges(ranges, buffer)
        opened: dict[str, int] = {}
        out: list[memoryview] = []
        try:
            for (file, offset, length), view in zip(ranges, views, strict=True):
                if isinstance(file, str):
                    if file not in opened:
                        opened[file] = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
                    fd = opened[file]
                else:
                    fd = file.fileno()
                got = 0
                while got < length:
                    n = os.preadv(fd, [view[got:]], offset + got)
                    if n == 0:
                        break
                    got += n
                out.append(view[:got])
        finally:
            for fd in opened.values():
                os.close(fd)
        return out


def _prepare_ranges(ranges: Sequence[tuple[Any, int, int]], buffer: Any) -> list[memoryview]:
    """The slice of ``buffer`` each range lands in (a new bytearray when ``buffer`` is None),
    checking the ranges and that the buffer holds them all."""
    total = 0
    for _file, offset, length in ranges:
        if offset < 0 or length < 0:
            raise ValueError(f"a range's offset and length are not negative: got ({offset}, {length})")
        total += length
    whole = memoryview(bytearray(total) if buffer is None else buffer).cast("B")
    if whole.readonly:
        raise ValueError("read_many's buffer must be writable")
    if whole.nbytes < total:
        raise ValueError(f"read_many's buffer holds {whole.nbytes} bytes, the ranges need {total}")
    views, pos = [], 0
    for _file, _offset, length in ranges:
        views.append(whole[pos:pos + length])
        pos += length
    return views


@dataclass(frozen=True, eq=False)
class ShardIndex:
    """A shard's checked tables: where each record lies and its CRC32C."""

    path: str
    size: int
    offsets: npt.NDArray[np.uint64]  # count + 1 entries
    crcs: npt.NDArray[np.uint32]  # count entries

    @property
    def count(self) -> int:
        return len(self.crcs)

    @property
    def data_bytes(self) -> int:
        return int(self.offsets[-1] - self.offsets[0])

    def record_range(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of record ``index`` in the file."""
        start = int(self.offsets[index])
        return start, int(self.offsets[index + 1]) - start

    def check(self, index: int, record: Any) -> None:
        """Raise :class:`RecordFormatError` unless ``record`` (any buffer) is record ``index``'s bytes."""
        view = memoryview(record).cast("B")
        start, length = self.record_range(index)
        if view.nbytes != length:
            raise RecordFormatError(f"{self.path}: record {index} is truncated: read {view.nbytes} of its "
                                    f"{length} bytes at offset {start}")
        got = crc32c.crc32c(view)
        if got != int(self.crcs[index]):
            raise RecordFormatError(f"{self.path}: record {index} fails its checksum (CRC32C {got:#010x}, "
                                    f"the shard's table says {int(self.crcs[index]):#010x})")


def _tables_bytes(count: int) -> int:
    return 8 * (count + 1) + 4 * count


def read_index(fs: RecordFS, path: str, file: Any = None) -> ShardIndex:
    """Read and check shard ``path``'s header and tables (one read, or two for a big shard).

    ``file`` is the shard opened ``"rb", buffering=0`` if the caller has it open already.
    """
    size = fs.stat(path).st_size
    source = path if file is None else file
    if size < HEADER_BYTES:
        raise RecordFormatError(f"{path}: not a record shard: {size} bytes, shorter than the "
                                f"{HEADER_BYTES}-byte header")
    first = fs.read_many([(source, 0, min(size, _FIRST_READ_BYTES))])[0]
    if len(first) < HEADER_BYTES:  # cut short since the stat (another writer truncated it)
        raise RecordFormatError(f"{path}: truncated while reading: {len(first)} bytes, shorter than the "
                                f"{HEADER_BYTES}-byte header")
    magic, version, flags, count, tables_crc, header_crc = _HEADER.unpack_from(first)
    if magic != MAGIC:
        raise RecordFormatError(f"{path}: not a record shard (its first bytes are {bytes(first[:8])!r}, "
                                f"not {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise RecordFormatError(f"{path}: record format version {version} is not one this reader knows "
                                f"(it reads version {FORMAT_VERSION})")
    if crc32c.crc32c(first[:HEADER_BYTES - 4]) != header_crc:
        raise RecordFormatError(f"{path}: the shard's header fails its checksum (corrupt)")
    if flags != 0:
        raise RecordFormatError(f"{path}: header flags {flags:#x} are not defined in version {FORMAT_VERSION}")
    tables = _tables_bytes(count)
    if count > MAX_RECORDS_PER_SHARD or HEADER_BYTES + tables > size:
        raise RecordFormatError(f"{path}: the header claims {count} records, whose tables ({tables} bytes) do "
                                f"not fit in the file's {size} bytes (truncated or corrupt)")
    end = HEADER_BYTES + tables
    if end <= len(first):
        raw = first[HEADER_BYTES:end]
    else:
        raw = fs.read_many([(source, HEADER_BYTES, tables)])[0]
        if len(raw) != tables:
            raise RecordFormatError(f"{path}: truncated while reading: {len(raw)} of {tables} bytes of tables")
    if crc32c.crc32c(raw) != tables_crc:
        raise RecordFormatError(f"{path}: the shard's offset and checksum tables fail their checksum (corrupt)")
    offsets = np.frombuffer(raw, dtype="<u8", count=count + 1).astype(np.uint64)
    crcs = np.frombuffer(raw, dtype="<u4", count=count, offset=8 * (count + 1)).astype(np.uint32)
    if int(offsets[0]) != end:
        raise RecordFormatError(f"{path}: the first record starts at {int(offsets[0])}, not where the tables "
                                f"end ({end}) (corrupt)")
    if count and bool(np.any(offsets[1:] < offsets[:-1])):
        raise RecordFormatError(f"{path}: the offsets table is not in order (corrupt)")
    if int(offsets[-1]) != size:
        what = "truncated" if int(offsets[-1]) > size else "has bytes past its last record"
        raise RecordFormatError(f"{path}: {what}: the file holds {size} bytes, its table says {int(offsets[-1])}")
    return ShardIndex(path, size, offsets, crcs)


def shard_name(number: int) -> str:
    """``shard-00000.rec``: names sort in shard order."""
    return f"shard-{number:05d}.rec"


def _temp_name(path: str) -> str:
    """A hidden name beside ``path`` that no reader lists (readers take ``*.rec`` not starting with ``.``)."""
    head, tail = posixpath.split(path)
    return posixpath.join(head, f".{tail}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


class RecordWriter:
    """Writes one shard: ``with RecordWriter(fs, path) as w: w.write(record) ...``.

    The tables come first in the file but are known only at the end, so records are spooled to a
    local temporary file (``spool_dir``, default the system's) and the shard is written in one
    sequential pass at :meth:`close` — to a hidden temporary name, renamed to ``path`` once whole.
    A writer that fails, or a ``with`` body that raises, leaves nothing under ``path``.
    """

    def __init__(self, fs: RecordFS, path: str, *, spool_dir: str | None = None) -> None:
        self.fs = fs
        self.path = path
        self._spool: IO[bytes] | None = tempfile.TemporaryFile(dir=spool_dir)  # noqa: SIM115 — closed by close/abort
        self._offsets: list[int] = [0]
        self._crcs: list[int] = []

    def __repr__(self) -> str:
        return f"RecordWriter({self.path!r}, records={len(self._crcs)})"

    @property
    def count(self) -> int:
        return len(self._crcs)

    def write(self, record: Any) -> int:
        """Append ``record`` (bytes or any buffer); its index in the shard."""
        if self._spool is None:
            raise ValueError(f"{self.path}: the writer is closed")
        if len(self._crcs) >= MAX_RECORDS_PER_SHARD:
            raise ValueError(f"{self.path}: a shard holds at most {MAX_RECORDS_PER_SHARD} records")
        view = memoryview(record).cast("B")
        if view.nbytes > MAX_RECORD_BYTES:
            raise ValueError(f"{self.path}: a record of {view.nbytes} bytes is larger than the "
                             f"{MAX_RECORD_BYTES} a record may hold")
        self._spool.write(view)
        self._crcs.append(crc32c.crc32c(view))
        self._offsets.append(self._offsets[-1] + view.nbytes)
        return len(self._crcs) - 1

    def _tables(self) -> bytes:
        count = len(self._crcs)
        base = HEADER_BYTES + _tables_bytes(count)
        offsets = np.asarray(self._offsets, dtype=np.uint64) + np.uint64(base)
        tables = offsets.astype("<u8").tobytes() + np.asarray(self._crcs, dtype="<u4").tobytes()
        head = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, count, crc32c.crc32c(tables), 0)[:HEADER_BYTES - 4]
        return head + struct.pack("<I", crc32c.crc32c(head)) + tables

    def close(self) -> None:
        """Write the shard under a temporary name and rename it to :attr:`path`."""
        spool = self._spool
        if spool is None:
            return
        temp = _temp_name(self.path)
        try:
            spool.seek(0)
            with self.fs.open(temp, "wb") as out:
                out.write(self._tables())
                while piece := spool.read(_COPY_PIECE_BYTES):
                    out.write(piece)
                out.flush()
                with suppress(OSError, ValueError):  # fs3 files have no descriptor: durable at close
                    os.fsync(out.fileno())
            self.fs.replace(temp, self.path)
        except BaseException:
            with suppress(OSError):
                self.fs.remove(temp)
            raise
        finally:
            self._spool = None
            spool.close()

    def abort(self) -> None:
        """Drop what was written: nothing appears under :attr:`path`."""
        if self._spool is not None:
            self._spool.close()
            self._spool = None

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_shards(fs: RecordFS, directory: str, records: Iterable[Any], records_per_file: int, *,
                 spool_dir: str | None = None) -> list[str]:
    """Write ``records`` as shards of ``records_per_file`` records (the last may hold fewer) named
    :func:`shard_name` in ``directory`` (made if missing); their paths, in order.

    If it fails part way, the shards it already finished are removed again: a directory holds a whole
    data set or none of it.
    """
    if records_per_file < 1 or records_per_file > MAX_RECORDS_PER_SHARD:
        raise ValueError(f"records per file must be between 1 and {MAX_RECORDS_PER_SHARD}, not {records_per_file}")
    fs.makedirs(directory, exist_ok=True)
    paths: list[str] = []
    writer: RecordWriter | None = None
    try:
        for record in records:
            if writer is None:
                writer = RecordWriter(fs, posixpath.join(directory, shard_name(len(paths))), spool_dir=spool_dir)
            writer.write(record)
            if writer.count == records_per_file:
                writer.close()
                paths.append(writer.path)
                writer = None
        if writer is not None:
            writer.close()
            paths.append(writer.path)
            writer = None
    except BaseException:
        if writer is not None:
            writer.abort()
        for path in paths:
            with suppress(OSError):
                fs.remove(path)
        raise
    return paths


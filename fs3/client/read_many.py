"""Batched reads: many ``(file, offset, length)`` ranges in one call (a data loader's batch of records).

Each range is cut at chunk boundaries into pieces; :meth:`~fs3.client.storage_client.StorageClient.read_pieces`
sends each storage node the pieces it serves in BatchRead calls (bounded in pieces and bytes),
every node at once, and reads a piece its batch failed again with the single-piece ``Read`` path
(same retries and failover). The bytes land once, straight from the answers, in one buffer the
caller may preallocate (a bytearray, an mmap, a numpy array, a uint8 tensor's ``numpy()``): range
``i`` starts at the sum of the lengths before it.

The semantics are ``os.pread``'s, range by range: a range reaching past the end of its file comes
back short, one starting past it empty, holes read as zeros, and this client's own writes not yet
on storage are seen (each handle is prepared as a read prepares it:
:meth:`~fs3.client.files.AsyncFile.readable_length`). Everything that can be checked without I/O
is checked before any (ranges, bounds, the buffer, the handles), and a path is opened (so
permission-checked) like any ``open`` before any byte is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter

from fs3.client.files import AsyncFile
from fs3.client.oserrors import os_errors
from fs3.client.storage_client import BatchReadStats, PieceRead
from fs3.client.tasks import run_all
from fs3.common.layout import chunk_location

if TYPE_CHECKING:
    from fs3.client.fs import AsyncFileSystem

__all__ = [
    "READ_MANY_BYTES_MAX",
    "READ_MANY_OPENS_INFLIGHT_MAX",
    "READ_MANY_RANGES_MAX",
    "BatchReadMetrics",
    "ReadRange",
    "check_ranges",
    "output_view",
    "plan_pieces",
    "read_many",
]

# Ranges and bytes one call may ask for: the plan (a few objects per range and piece) and the
# buffer stay bounded whatever a caller passes; a loader's batch is far below both.
READ_MANY_RANGES_MAX = 65_536
READ_MANY_BYTES_MAX = 1 << 30
# Paths of one call opened at once (each open is one meta call).
READ_MANY_OPENS_INFLIGHT_MAX = 16

PathLike = str | bytes | os.PathLike[str] | os.PathLike[bytes]


class BatchReadMetrics:
    """What batched reads cost, in the client's registry: how well the batching works shows as
    pieces per RPC, how often batches fail pieces as fallbacks per piece."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter("fs3_client_read_many_calls", "read_many calls answered", registry=registry)
        self.rpcs = Counter("fs3_client_batch_read_rpcs", "BatchRead calls sent to storage nodes", registry=registry)
        self.pieces = Counter("fs3_client_batch_read_pieces", "Chunk pieces asked for in BatchRead calls",
                              registry=registry)
        self.fallbacks = Counter("fs3_client_batch_read_fallbacks",
                                 "Pieces a BatchRead did not answer well, read again with Read", registry=registry)


@dataclass(frozen=True, slots=True)
class ReadRange:
    """One checked range: ``file`` (an open handle or a path), where it starts, how many bytes."""

    file: AsyncFile | PathLike
    offset: int
    length: int


def check_ranges(ranges: Sequence[tuple[Any, Any, Any]]) -> tuple[list[ReadRange], int]:
    """The ranges, checked without I/O, and the bytes they ask for in all.

    A negative offset or length is ``EINVAL`` (what ``os.pread`` says); too many ranges or bytes
    for one call is a ``ValueError`` naming the bound; a file that is neither a path nor an open
    fs3 handle is a ``TypeError``.
    """
    if len(ranges) > READ_MANY_RANGES_MAX:
        raise ValueError(f"{len(ranges)} ranges exceed {READ_MANY_RANGES_MAX} per read_many call")
    checked: list[ReadRange] = []
    total = 0
    for entry in ranges:
        try:
            file, offset_arg, length_arg = entry
        except (TypeError, ValueError):
            raise TypeError(f"a read_many range is (file, offset, length), not {entry!r}") from None
        offset, length = operator.index(offset_arg), operator.index(length_arg)
        if offset < 0 or length < 0:
            raise OSError(errno.EINVAL, f"negative {'offset' if offset < 0 else 'length'} in a read_many range",
                          getattr(file, "name", None) or (os.fsdecode(file) if _is_path(file) else None))
        if not isinstance(file, AsyncFile) and not _is_path(file):
            raise TypeError(f"a read_many range's file is a path or an open fs3 file, not {type(file).__name__}")
        total += length
        checked.append(ReadRange(file, offset, length))
    if total > READ_MANY_BYTES_MAX:
        raise ValueError(f"{total} bytes asked exceed {READ_MANY_BYTES_MAX} per read_many call")
    return checked, total


def _is_path(file: object) -> bool:
    return isinstance(file, str | bytes | os.PathLike)


def output_view(buffer: Any, total: int) -> memoryview:
    """The bytes of ``buffer`` the results land in (a new bytearray when None); refused before any
    I/O when it is read-only, not contiguous, or holds fewer than ``total`` bytes."""
    if buffer is None:
        return memoryview(bytearray(total))
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(f"read_many's buffer must support the buffer protocol, not {type(buffer).__name__}") from None
    if view.readonly:
        raise TypeError("read_many's buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("read_many's buffer must be contiguous")
    flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if flat.nbytes < total:
        raise ValueError(f"read_many's buffer holds {flat.nbytes} bytes, the ranges ask for {total}")
    return flat


def plan_pieces(afile: AsyncFile, offset: int, length: int, dst: int) -> list[PieceRead]:
    """The chunk pieces of ``[offset, offset + length)`` of ``afile`` (within its length), landing
    from ``dst`` of the buffer on."""
    chunk_size = afile.chunk_size
    pieces: list[PieceRead] = []
    pos, end = offset, offset + length
    while pos < end:
        size = min(chunk_size - pos % chunk_size, end - pos)
        chain_id, chunk_id = chunk_location(afile.layout, afile.inode.inode_id, pos // chunk_size)
        pieces.append(PieceRead(chain_id, chunk_id, pos % chunk_size, size, dst + pos - offset, afile.capability))
        pos += size
    return pieces


async def read_many(fs: AsyncFileSystem, ranges: Sequence[tuple[Any, Any, Any]],
                    buffer: Any = None) -> list[memoryview]:
    """See the module doc and :meth:`AsyncFileSystem.read_many`."""
    checked, total = check_ranges(ranges)
    out = output_view(buffer, total)
    given = {id(r.file): r.file for r in checked if isinstance(r.file, AsyncFile)}
    for afile in given.values():
        if afile.fs is not fs:
            raise ValueError(f"{afile.name} was opened by another fs3 client")
        with os_errors(afile.name):
            afile.check_readable()
    opened: dict[bytes, AsyncFile] = {}
    try:
        await _open_paths(fs, checked, opened)
        handles = [r.file if isinstance(r.file, AsyncFile) else opened[os.fsencode(r.file)] for r in checked]
        lengths: dict[int, int] = {}
        for afile in {id(h): h for h in handles}.values():
            with os_errors(afile.name):
                lengths[id(afile)] = await afile.readable_length()
        views: list[memoryview] = []
        pieces: list[PieceRead] = []
        owners: list[AsyncFile] = []
        start = 0
        for r, afile in zip(checked, handles, strict=True):
            end = min(r.offset + r.length, lengths[id(afile)])
            size = max(0, end - r.offset)
            views.append(out[start:start + size])
            for piece in plan_pieces(afile, r.offset, size, start):
                pieces.append(piece)
                owners.append(afile)
            start += r.length
        with os_errors():
            got, stats = await fs.storage.read_pieces(pieces, out)
        short: dict[int, AsyncFile] = {}
        for piece, n, afile in zip(pieces, got, owners, strict=True):
            if n < piece.length:
                out[piece.dst + n:piece.dst + piece.length] = bytes(piece.length - n)  # a hole
                short[id(afile)] = afile
        for afile in short.values():
            with os_errors(afile.name):
                await afile.confirm_zeros()
        _count(fs, stats, sum(len(v) for v in views))
        return views
    finally:
        await _close_all(opened.values())


async def _open_paths(fs: AsyncFileSystem, checked: list[ReadRange], opened: dict[bytes, AsyncFile]) -> None:
    """Open each distinct path of the call once, for reading (a few at a time); every handle
    opened is in ``opened`` (for the caller to close) even when another open fails."""
    paths: dict[bytes, PathLike] = {}
    for r in checked:
        if not isinstance(r.file, AsyncFile):
            paths.setdefault(os.fsencode(r.file), r.file)
    slots = asyncio.Semaphore(READ_MANY_OPENS_INFLIGHT_MAX)

    async def open_one(key: bytes, path: PathLike) -> None:
        async with slots:
            opened[key] = await fs.open(path, "rb")

    await run_all(open_one(key, path) for key, path in paths.items())


async def _close_all(handles: Any) -> None:
    """Close the handles the call opened; a failing close loses nothing (they only read), so it is
    not allowed to hide the call's own outcome."""
    for afile in list(handles):
        with contextlib.suppress(OSError):
            await afile.close()


def _count(fs: AsyncFileSystem, stats: BatchReadStats, read_bytes: int) -> None:
    metrics = fs.batch_read_metrics
    metrics.calls.inc()
    metrics.rpcs.inc(stats.rpcs)
    metrics.pieces.inc(stats.pieces)
    metrics.fallbacks.inc(stats.fallbacks)
    fs.metrics.read_bytes.inc(read_bytes)

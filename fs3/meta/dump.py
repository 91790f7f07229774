"""The metadata dump format: what ``fs3 admin dump`` writes and ``fs3 admin load`` reads.

A dump is UTF-8 text, one JSON object a line (JSON Lines), so that it streams both ways and tools
such as ``jq`` and ``grep`` read it:

* a **header**: ``{"format": "fs3-meta-dump", "version": 1, "schema": 1, "meta_format": 2,
  "cluster_id": ..., "created_ms": ...}`` (``meta_format``: the store format of the dumped meta,
  :mod:`fs3.meta.formats`; a dump without it is format 1; a newer one is refused; a load stamps
  it on the store it fills, whose next start migrates from there). ``version``
  is this file format's, ``schema`` the version of meta's key schema (:mod:`fs3.meta.schema`)
  the values are in. A reader refuses any other (it cannot know what a newer one means);
* **records**, one a line, ``{"t": KIND, <the key's fields>, "v": <the stored value, base64>}``,
  grouped by kind in the order of :data:`KINDS` and, within a kind, in key order (a reader checks
  both: a duplicate or a reordered line is refused). The key fields are readable (inode ids as
  numbers, names as base64: a name is any bytes); the value is exactly what meta stores under
  the key (the table in :mod:`fs3.meta.schema` says what: an ``Inode`` or ``DirEntry`` protobuf,
  an xattr's bytes, a job record, a counter's 8 bytes), so a load writes back the very bytes that
  were read, and the inode ids (hence the chunk ids on storage, which are made of them) are kept;
* a **trailer**: ``{"t": "end", "records": N, "counts": {KIND: n, ...}, "sha256": HEX}``, the
  SHA-256 of every byte before it (the header line and each record line, newlines included). A
  file without it was cut short.

What is dumped: inodes (with their layouts, sizes, modes, owners, times, symlink targets),
directory entries (hard links are several entries naming one inode), xattrs, size generations,
pending truncate and GC jobs (so that a restored meta finishes them), counters (the next inode id
above all: without it a restored meta would hand out ids, hence chunk ids, that files already
use) and the user-token table (secret hashes only, never a secret). What is not, and why: open-
file sessions, client leases, expired-client records and saved answers of retried requests
(they belong to clients of the meta that served them; after a restore every client opens its
files again, and an idempotency record replayed to a new client would answer the wrong request),
and the claims and registrations of meta servers (state of running servers, rebuilt at start).
A file that was removed while still open (no names, kept by its sessions) is dumped as a GC job
for its chunks instead of an inode, as its last close would have made it. A file in the trash
(:mod:`fs3.meta.trash`: no names either) is dumped as it is, with its trash entry and expiry key,
so that a restored meta can still restore it, and expires it when it would have.

This module does no I/O of its own: it encodes and checks lines, and :func:`dump_snapshot` reads
through a :class:`~fs3.kv.api.SnapshotReader` a page at a time (bounded memory: one page, plus one
entry per open-but-removed file) and hands each line to a callback. :mod:`fs3.meta.backup` writes
files and loads them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from google.protobuf.message import DecodeError

from fs3 import meta_pb2 as mpb
from fs3.common.errors import InvalidArgument
from fs3.common.formats import FormatRecord
from fs3.kv.api import SnapshotReader, prefix_end
from fs3.meta import schema
from fs3.meta.formats import META_FORMAT, META_FORMAT_VERSION
from fs3.meta.limits import ANCESTOR_WALK_MAX

__all__ = [
    "DUMP_FORMAT",
    "DUMP_FORMAT_VERSION",
    "KINDS",
    "LINE_BYTES_MAX",
    "META_SCHEMA_VERSION",
    "DumpError",
    "DumpReader",
    "DumpStats",
    "DumpWriter",
    "decode_record",
    "dump_snapshot",
    "encode_record",
    "is_dumped_key",
    "read_lines",
]

DUMP_FORMAT = "fs3-meta-dump"
DUMP_FORMAT_VERSION = 1
# The version of meta's key schema (fs3/meta/schema.py) the dumped values are in.
META_SCHEMA_VERSION = 1

# Every kind of record, in the order a dump holds them, with the key prefix it stands for.
KINDS: dict[str, bytes] = {
    "inode": schema.inode_prefix(),
    "dentry": schema.dentry_prefix(),
    "xattr": b"XATR",
    "size_gen": schema.size_gen_prefix(),
    "truncate": schema.truncate_prefix(),
    "gc": schema.gc_prefix(),
    "trash": schema.trash_prefix(),
    "trash_expiry": schema.trash_expiry_prefix(),
    "counter": schema.COUNTER,
    "user": schema.user_prefix(),
    "quota": schema.quota_prefix(),
    "quota_usage": schema.QUOTA_USAGE,
    "quota_away": schema.quota_away_prefix(),
}
_KIND_ORDER = {kind: index for index, kind in enumerate(KINDS)}
# Kinds whose key is the prefix and an inode id(8).
_ID_KINDS = frozenset({"inode", "size_gen", "truncate", "gc", "trash", "quota", "quota_usage"})
LINE_BYTES_MAX = 64 << 20  # far above any value meta stores: a longer line is not a dump


class DumpError(InvalidArgument):
    """A dump that cannot be read: not a dump, another version, cut short, or altered."""


def is_dumped_key(key: bytes) -> bool:
    """Whether a key of meta's store belongs in a dump (see the module docstring for why not)."""
    return any(key.startswith(prefix) for prefix in KINDS.values())


def read_lines(f: IO[bytes]) -> Iterator[bytes]:
    """The lines of a dump file, none longer than :data:`LINE_BYTES_MAX` + 1 bytes: a longer one is
    yielded cut there (without its newline, so :class:`DumpReader` refuses it) instead of being read
    whole, so a crafted or damaged file without newlines cannot take all memory."""
    while line := f.readline(LINE_BYTES_MAX + 1):
        yield line
        if len(line) > LINE_BYTES_MAX:
            return


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise DumpError(f"{what}: expected base64 text, got {type(text).__name__}")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise DumpError(f"{what}: not base64") from None


def _u64(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise DumpError(f"{what}: expected an unsigned 64-bit integer, got {value!r}")
    return value


def encode_record(key: bytes, value: bytes) -> dict[str, Any]:
    """The record for one stored pair (``key`` must be a dumped one: :func:`is_dumped_key`)."""
    found = next(((k, p) for k, p in KINDS.items() if key.startswith(p)), None)
    if found is None:
        raise InvalidArgument(f"key {key[:12]!r} is not part of a dump")
    kind, prefix = found
    rest = key[len(prefix):]
    record: dict[str, Any] = {"t": kind}
    if kind in _ID_KINDS:
        record["id"] = int.from_bytes(rest, "big")
    elif kind == "dentry":
        record["parent"], record["name"] = int.from_bytes(rest[:8], "big"), _b64(rest[8:])
    elif kind == "xattr":
        record["id"], record["name"] = int.from_bytes(rest[:8], "big"), _b64(rest[8:])
    elif kind == "trash_expiry":
        record["expires"], record["id"] = int.from_bytes(rest[:8], "big"), int.from_bytes(rest[8:], "big")
    elif kind == "quota_away":
        record["home"], record["id"] = int.from_bytes(rest[:8], "big"), int.from_bytes(rest[8:], "big")
    elif kind == "counter":
        record["name"] = rest.decode("utf-8", errors="surrogateescape")
    else:  # user
        record["id"] = rest.hex()
    record["v"] = _b64(value)
    return record


def decode_record(record: dict[str, Any]) -> tuple[str, bytes, bytes]:
    """``(kind, key, value)`` of a record; a malformed one raises :class:`DumpError`."""
    kind = record.get("t")
    if kind not in KINDS:
        raise DumpError(f"unknown record kind {kind!r}")
    prefix = KINDS[kind]
    if kind in _ID_KINDS:
        key = prefix + _u64(record.get("id"), f"{kind} id").to_bytes(8, "big")
    elif kind == "dentry":
        key = prefix + _u64(record.get("parent"), "dentry parent").to_bytes(8, "big") + \
            _unb64(record.get("name"), "dentry name")
    elif kind == "xattr":
        key = prefix + _u64(record.get("id"), "xattr inode").to_bytes(8, "big") + \
            _unb64(record.get("name"), "xattr name")
    elif kind == "trash_expiry":
        key = prefix + _u64(record.get("expires"), "trash expiry").to_bytes(8, "big") + \
            _u64(record.get("id"), "trash expiry id").to_bytes(8, "big")
    elif kind == "quota_away":
        key = prefix + _u64(record.get("home"), "quota away home").to_bytes(8, "big") + \
            _u64(record.get("id"), "quota away id").to_bytes(8, "big")
    elif kind == "counter":
        name = record.get("name")
        if not isinstance(name, str) or not name:
            raise DumpError("counter: expected a name")
        key = prefix + name.encode("utf-8", errors="surrogateescape")
    else:
        user_id = record.get("id")
        if not isinstance(user_id, str) or len(user_id) != 16:
            raise DumpError(f"user: expected a 16-hex-digit id, got {user_id!r}")
        try:
            key = prefix + bytes.fromhex(user_id)
        except ValueError:
            raise DumpError(f"user: expected a 16-hex-digit id, got {user_id!r}") from None
    return kind, key, _unb64(record.get("v"), f"{kind} value")


def _check_value(kind: str, key: bytes, value: bytes) -> None:
    """Refuse a value meta could not decode. A load writes values as they are, and the checksum
    proves only that the file is whole, not that what wrote it wrote sane records: a garbled inode
    or entry would fail every request that reaches it, a garbled counter the load itself."""
    try:
        if kind == "inode":
            inode_id = mpb.Inode.FromString(value).inode_id
            if inode_id != int.from_bytes(key[len(KINDS["inode"]):], "big"):
                raise DumpError(f"inode record of id {int.from_bytes(key[len(KINDS['inode']):], 'big')} "
                                f"holds inode {inode_id}")
        elif kind == "dentry":
            mpb.DirEntry.FromString(value)
    except DecodeError:
        raise DumpError(f"{kind} value is not a valid {'Inode' if kind == 'inode' else 'DirEntry'}") from None
    if kind == "counter" and len(value) != 8:
        raise DumpError(f"counter value of {len(value)} bytes, expected 8")


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode() + b"\n"


@dataclass
class DumpWriter:
    """Makes a dump's lines: :meth:`header`, then :meth:`record` for each pair in dump order, then
    :meth:`trailer`. Checks the order as it goes (a bug here must not make a dump no load takes)."""

    cluster_id: str
    created_ms: int
    counts: dict[str, int] = field(default_factory=dict)
    #: The dumped store's format (its format record's version; 1 without one): the format the
    #: records are in, which a load stamps on the store it fills.
    meta_format: int = META_FORMAT_VERSION
    _hash: Any = field(default_factory=hashlib.sha256, init=False, repr=False)
    _last: tuple[int, bytes] | None = field(default=None, init=False, repr=False)

    def header(self) -> bytes:
        line = _line({"format": DUMP_FORMAT, "version": DUMP_FORMAT_VERSION, "schema": META_SCHEMA_VERSION,
                      "meta_format": self.meta_format, "cluster_id": self.cluster_id,
                      "created_ms": self.created_ms})
        self._hash.update(line)
        return line

    def record(self, key: bytes, value: bytes) -> bytes:
        record = encode_record(key, value)
        position = (_KIND_ORDER[record["t"]], key)
        if self._last is not None and position <= self._last:
            raise InvalidArgument(f"dump records out of order at {key[:12]!r}")
        self._last = position
        self.counts[record["t"]] = self.counts.get(record["t"], 0) + 1
        line = _line(record)
        self._hash.update(line)
        return line

    @property
    def records(self) -> int:
        return sum(self.counts.values())

    def trailer(self) -> bytes:
        return _line({"t": "end", "records": self.records, "counts": dict(sorted(self.counts.items())),
                      "sha256": self._hash.hexdigest()})


@dataclass
class DumpReader:
    """Checks a dump line by line: :meth:`records` yields ``(kind, key, value)`` and raises
    :class:`DumpError` at the first problem — the last once every record was yielded (a missing
    trailer, a count or checksum that does not match). So a caller acts on the records only once
    the whole stream was read without error (:mod:`fs3.meta.backup` reads a file twice)."""

    header: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def records(self, lines: Iterable[bytes]) -> Iterator[tuple[str, bytes, bytes]]:
        digest = hashlib.sha256()
        it = iter(lines)
        first = next(it, None)
        if first is None:
            raise DumpError("empty file: not an fs3 metadata dump")
        self.header = self._header(first)
        digest.update(first)
        last: tuple[int, bytes] | None = None
        number = 1
        for line in it:
            number += 1
            obj = self._parse(line, number)
            if obj.get("t") == "end":
                self._trailer(obj, digest.hexdigest(), number)
                if next(it, None) is not None:
                    raise DumpError(f"line {number + 1}: data after the trailer")
                return
            try:
                kind, key, value = decode_record(obj)
                _check_value(kind, key, value)
            except DumpError as exc:
                raise DumpError(f"line {number}: {exc}") from None
            position = (_KIND_ORDER[kind], key)
            if last is not None and position <= last:
                raise DumpError(f"line {number}: record out of order or repeated ({kind})")
            last = position
            digest.update(line)
            self.counts[kind] = self.counts.get(kind, 0) + 1
            yield kind, key, value
        raise DumpError(f"no trailer after line {number}: the dump was cut short")

    @staticmethod
    def _parse(line: bytes, number: int) -> dict[str, Any]:
        if len(line) > LINE_BYTES_MAX:
            raise DumpError(f"line {number}: longer than {LINE_BYTES_MAX} bytes")
        if not line.endswith(b"\n"):
            raise DumpError(f"line {number}: incomplete (no newline): the dump was cut short")
        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            raise DumpError(f"line {number}: not JSON (the dump is damaged or cut short)") from None
        if not isinstance(obj, dict):
            raise DumpError(f"line {number}: expected a JSON object")
        return obj

    def _header(self, line: bytes) -> dict[str, Any]:
        try:
            header = self._parse(line, 1)
        except DumpError:
            raise DumpError("line 1: not an fs3 metadata dump header") from None
        if header.get("format") != DUMP_FORMAT:
            raise DumpError(f"not an fs3 metadata dump (format {header.get('format')!r})")
        if header.get("version") != DUMP_FORMAT_VERSION:
            raise DumpError(f"dump format version {header.get('version')!r}: this fs3 reads version "
                            f"{DUMP_FORMAT_VERSION} only")
        if header.get("schema") != META_SCHEMA_VERSION:
            raise DumpError(f"dump of meta schema version {header.get('schema')!r}: this fs3 loads schema version "
                            f"{META_SCHEMA_VERSION} only")
        # The meta store format of the dumped cluster (absent: taken before format records, 1). Its
        # records are the same at every format this code upgrades from: a load writes them as they
        # are and the next meta start migrates the store (fs3.meta.formats). A newer one is refused.
        meta_format = header.get("meta_format", 1)
        if not isinstance(meta_format, int) or not 1 <= meta_format <= META_FORMAT_VERSION:
            raise DumpError(f"dump of meta format {meta_format!r}, written by a newer fs3: this fs3 loads meta "
                            f"formats 1..{META_FORMAT_VERSION}; load it with that release or newer")
        if not isinstance(header.get("cluster_id"), str):
            raise DumpError("dump header without a cluster id")
        return header

    def _trailer(self, obj: dict[str, Any], digest: str, number: int) -> None:
        if obj.get("sha256") != digest:
            raise DumpError(f"line {number}: checksum mismatch (SHA-256 {digest}, the trailer says "
                            f"{obj.get('sha256')!r}): the dump was altered or damaged")
        if obj.get("records") != sum(self.counts.values()) or obj.get("counts") != dict(sorted(self.counts.items())):
            raise DumpError(f"line {number}: the trailer's counts {obj.get('counts')!r} do not match the records "
                            f"{dict(sorted(self.counts.items()))!r}")


@dataclass
class DumpStats:
    """What :func:`dump_snapshot` did: records by kind, and the pages it read (each at most
    ``page_records`` pairs: the memory it held)."""

    counts: dict[str, int] = field(default_factory=dict)
    pages: int = 0
    page_pairs_max: int = 0
    open_removed: int = 0   # files removed while open, dumped as GC jobs


async def _pages(reader: SnapshotReader, prefix: bytes, page_records: int,
                 stats: DumpStats) -> AsyncIterator[list[tuple[bytes, bytes]]]:
    """The pairs under ``prefix``, ``page_records`` at a time, each page resuming after the last key."""
    start, end = prefix, prefix_end(prefix)
    while True:
        page = await reader.scan(start, end, limit=page_records)
        stats.pages += 1
        stats.page_pairs_max = max(stats.page_pairs_max, len(page))
        if page:
            yield page
        if len(page) < page_records:
            return
        start = page[-1][0] + b"\x00"


def _removed_while_open(value: bytes) -> mpb.Inode | None:
    """The inode if it has no names left (kept only by open handles, which are not dumped)."""
    inode = mpb.Inode.FromString(value)
    return inode if inode.type != mpb.DIRECTORY and inode.nlink == 0 else None


async def _in_trash(reader: SnapshotReader, inode_id: int) -> bool:
    """Whether a file without names is in the trash (kept there, not by open handles)."""
    key = schema.trash_key(inode_id)
    return bool(await reader.scan(key, key + b"\x00", limit=1))


async def _credits_by_quota(reader: SnapshotReader, page_records: int) -> dict[int, int]:
    """Bytes of writers' byte credits (fs3.meta.quota) each quota's usage holds. Credits belong to
    open sessions, which a dump leaves out: so is what they added to each usage. Credits are few
    (one per writing handle that asked, in a cluster with quotas); each walks up its home's parent
    links (a removed file's credit, at home 0, counts nowhere)."""
    quotas: set[int] = set()
    async for page in _plain_pages(reader, schema.quota_prefix(), page_records):
        quotas.update(schema.parse_quota_key(key) for key, _ in page)
    held: dict[int, int] = {}
    if not quotas:
        return held
    prefix = schema.quota_reservation_home_prefix()
    async for page in _plain_pages(reader, prefix, page_records):
        for key, raw in page:
            current, size = int.from_bytes(key[len(prefix):len(prefix) + 8], "big"), schema.decode_u64(raw)
            for _ in range(ANCESTOR_WALK_MAX):
                if current in quotas:
                    held[current] = held.get(current, 0) + size
                found = await reader.scan(schema.inode_key(current), schema.inode_key(current) + b"\x00", limit=1)
                parent = mpb.Inode.FromString(found[0][1]).parent if found else current
                if parent in (0, current):
                    break
                current = parent
    return held


async def _plain_pages(reader: SnapshotReader, prefix: bytes,
                       page_records: int) -> AsyncIterator[list[tuple[bytes, bytes]]]:
    async for page in _pages(reader, prefix, page_records, DumpStats(counts={})):
        yield page


def _without_credits(raw: bytes, credits: int) -> bytes:
    usage = mpb.Quota.FromString(raw)
    usage.bytes_used = max(0, usage.bytes_used - credits)
    return usage.SerializeToString()


def _removal_job(inode: mpb.Inode) -> bytes | None:
    """What removing the inode's last handle queues (as ``Namespace._delete_inode`` does): a GC
    job for a file's chunks, nothing for any other inode."""
    return schema.GcJob(inode.layout, 0, inode.size).encode() if inode.type == mpb.FILE else None


async def dump_snapshot(reader: SnapshotReader, emit: Callable[[bytes], Awaitable[None]], cluster_id: str,
                        created_ms: int, page_records: int = 1000) -> DumpStats:
    """Write the dump of what ``reader`` sees, line by line through ``emit``, reading
    ``page_records`` pairs at a time."""
    if page_records <= 0:
        raise InvalidArgument("page_records must be positive")
    stamped = await reader.scan(META_FORMAT.record_key, META_FORMAT.record_key + b"\x00", limit=1)
    meta_format = FormatRecord.decode(stamped[0][1], "the dumped meta store").version if stamped else 1
    writer = DumpWriter(cluster_id, created_ms, meta_format=meta_format)
    stats = DumpStats(counts=writer.counts)
    await emit(writer.header())
    # Files removed while open: their inode becomes a GC job, and what hangs off it is left out.
    removed: dict[int, bytes | None] = {}
    credits = await _credits_by_quota(reader, page_records)
    for kind, prefix in KINDS.items():
        pending = deque(sorted((i, job) for i, job in removed.items() if job is not None)) if kind == "gc" else deque()
        async for page in _pages(reader, prefix, page_records, stats):
            for key, value in page:
                if kind == "inode":
                    inode = _removed_while_open(value)
                    if inode is not None and not await _in_trash(reader, schema.parse_inode_key(key)):
                        removed[schema.parse_inode_key(key)] = _removal_job(inode)
                        stats.open_removed += 1
                        continue
                elif kind == "quota_usage" and credits.get(int.from_bytes(key[4:12], "big")):
                    value = _without_credits(value, credits[int.from_bytes(key[4:12], "big")])
                elif kind in ("xattr", "size_gen", "truncate") and int.from_bytes(key[4:12], "big") in removed:
                    continue
                elif kind == "gc":
                    inode_id = int.from_bytes(key[4:12], "big")
                    while pending and pending[0][0] <= inode_id:
                        gc_id, job_raw = pending.popleft()
                        if gc_id < inode_id:  # (equal: a job already queued wins)
                            await emit(writer.record(schema.gc_key(gc_id), job_raw))
                await emit(writer.record(key, value))
        for gc_id, job_raw in pending:
            await emit(writer.record(schema.gc_key(gc_id), job_raw))
    await emit(writer.trailer())
    return stats

"""Versioned on-disk formats: each store's format record, what this code can read, and migrations.

Every store fs3 keeps (a storage target's KV, mgmtd's KV, meta's KV on RocksDB or PostgreSQL)
holds one **format record** (:class:`FormatRecord`): the store's kind, its format version, the
fs3 release that last wrote it and the cluster id when known. A store kind is described by a
:class:`StoreFormat`: the version this code writes (``current``) and the oldest one it can still
upgrade (``oldest_upgradable``), and the migrations between them. :func:`decide` is the rule a
service applies when it opens a store:

* the current version: open it;
* older but upgradable: migrate it (``upgrade`` on) or refuse, naming ``fs3 admin upgrade``;
* older than upgradable, or newer than current: refuse, saying which release reads it.

A :class:`Migration` takes a store from version N to N+1 one bounded page of records at a time:
each page's rewritten records, and the migration's :class:`Progress` (its cursor), are written in
one atomic batch or transaction, so a run killed at any point resumes at the next start after the
last page it committed — no page is applied twice, none is skipped. The last page's batch also
writes the new format record and deletes the progress. A store without a record is fresh (no
keys: stamped current) or ``unstamped_version`` (what was there before records existed).

Everything here is pure (no I/O, clock or randomness): the drivers that read and write stores
are in :mod:`fs3.kv.formats`.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fs3.common.errors import InvalidArgument

__all__ = [
    "Action",
    "Decision",
    "FormatRecord",
    "FormatRefused",
    "Migration",
    "Page",
    "Progress",
    "StoreFormat",
    "Write",
    "decide",
    "plan_page",
    "read_version",
    "scan_bounds",
]

#: One write of a migration page: ``(key, value)``, ``value`` None for a delete.
Write = tuple[bytes, bytes | None]
_U64 = struct.Struct(">Q")


class FormatRefused(InvalidArgument):
    """A store this code will not open as it is: its message says why and what to do."""


@dataclass(frozen=True)
class FormatRecord:
    """The format record of one store (JSON in the store, under its kind's ``record_key``)."""

    kind: str
    version: int
    written_by: str = ""
    cluster_id: str = ""

    def encode(self) -> bytes:
        return json.dumps({"kind": self.kind, "version": self.version, "written_by": self.written_by,
                           "cluster_id": self.cluster_id}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, where: str) -> FormatRecord:
        try:
            data = json.loads(raw)
            record = cls(str(data["kind"]), int(data["version"]), str(data.get("written_by", "")),
                         str(data.get("cluster_id", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatRefused(f"{where}: its format record is unreadable ({exc}); this is not a store "
                                "fs3 wrote, or it is damaged") from None
        if record.version < 1:
            raise FormatRefused(f"{where}: format record names version {record.version}")
        return record


@dataclass(frozen=True)
class Progress:
    """Where a migration stopped: the next record to rewrite is the first key ``>= cursor`` in
    ``ranges[range_index]`` (``cursor`` None: that range's start); ``pages`` committed so far."""

    from_version: int
    to_version: int
    range_index: int = 0
    cursor: bytes | None = None
    pages: int = 0
    records: int = 0

    def encode(self) -> bytes:
        return json.dumps({"from": self.from_version, "to": self.to_version, "range": self.range_index,
                           "cursor": None if self.cursor is None else self.cursor.hex(), "pages": self.pages,
                           "records": self.records}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, where: str) -> Progress:
        try:
            data = json.loads(raw)
            cursor = data.get("cursor")
            return cls(int(data["from"]), int(data["to"]), int(data.get("range", 0)),
                       None if cursor is None else bytes.fromhex(cursor), int(data.get("pages", 0)),
                       int(data.get("records", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatRefused(f"{where}: its migration progress record is unreadable ({exc})") from None


@dataclass(frozen=True)
class Migration:
    """One step from ``from_version`` to ``from_version + 1`` of a store kind.

    ``ranges``: the ``[start, end)`` key ranges whose records it rewrites, in order (none: the step
    only stamps the new version). ``rewrite(key, value)``: the writes that replace one record
    (pure; it may raise :class:`FormatRefused` for a record it cannot read). A rewrite may write
    keys inside the range it scans only at or before the record's own key (the cursor moves past
    it), so no record is seen twice."""

    from_version: int
    summary: str
    ranges: tuple[tuple[bytes, bytes | None], ...] = ()
    rewrite: Callable[[bytes, bytes], Sequence[Write]] | None = None

    @property
    def to_version(self) -> int:
        return self.from_version + 1


@dataclass(frozen=True)
class StoreFormat:
    """What this code knows of one kind of store."""

    kind: str
    current: int
    oldest_upgradable: int
    record_key: bytes
    progress_key: bytes
    migrations: tuple[Migration, ...] = ()
    #: The version of a store with keys but no record: its layout from before format records.
    unstamped_version: int = 1
    #: A key an earlier release kept the bare version in (a big-endian u64), still written beside
    #: the record so that release refuses a newer store by itself (None: no such key).
    legacy_key: bytes | None = None
    #: Keys that are not the store's data (the record and progress are always excluded).
    ignored_prefixes: tuple[bytes, ...] = field(default=())

    def __post_init__(self) -> None:
        if not 1 <= self.oldest_upgradable <= self.current:
            raise ValueError(f"{self.kind}: oldest_upgradable must be within [1, current]")
        steps = [m.from_version for m in self.migrations]
        if steps != list(range(self.oldest_upgradable, self.current)):
            raise ValueError(f"{self.kind}: migrations must step from {self.oldest_upgradable} to {self.current} "
                             f"one version at a time, got {steps}")

    def migration(self, from_version: int) -> Migration:
        return self.migrations[from_version - self.oldest_upgradable]

    def is_data_key(self, key: bytes) -> bool:
        if key in (self.record_key, self.progress_key, self.legacy_key):
            return False
        return not any(key.startswith(p) for p in self.ignored_prefixes)

    def record_writes(self, record: FormatRecord) -> list[Write]:
        """The writes that stamp ``record`` (and the legacy key, when the kind has one)."""
        writes: list[Write] = [(self.record_key, record.encode())]
        if self.legacy_key is not None:
            writes.append((self.legacy_key, _U64.pack(record.version)))
        return writes


def read_version(fmt: StoreFormat, raw_record: bytes | None, raw_legacy: bytes | None, has_data: bool,
                 where: str) -> FormatRecord | None:
    """The store's format record from what its keys hold; None: a fresh (empty) store."""
    if raw_record is not None:
        record = FormatRecord.decode(raw_record, where)
        if record.kind != fmt.kind:
            raise FormatRefused(f"{where}: this is a {record.kind} store, not a {fmt.kind} store")
        return record
    if raw_legacy is not None:
        if len(raw_legacy) != _U64.size:
            raise FormatRefused(f"{where}: its format marker is {len(raw_legacy)} bytes, not 8")
        return FormatRecord(fmt.kind, int(_U64.unpack(raw_legacy)[0]))
    if has_data:
        return FormatRecord(fmt.kind, fmt.unstamped_version)
    return None


class Action(enum.Enum):
    FRESH = "fresh"  # an empty store: stamp it current
    OPEN = "open"  # current already
    MIGRATE = "migrate"  # older, upgradable, and upgrading is allowed


@dataclass(frozen=True)
class Decision:
    action: Action
    found: FormatRecord | None
    steps: tuple[Migration, ...] = ()


def decide(fmt: StoreFormat, found: FormatRecord | None, where: str, upgrade: bool, release: str,
           config_hint: str = "<the service's config>") -> Decision:
    """What to do with a store whose record is ``found`` (None: fresh), code of ``release``.

    Raises :class:`FormatRefused` for a store this code must not open, saying what to do."""
    if found is None:
        return Decision(Action.FRESH, None)
    ours = f"formats {fmt.oldest_upgradable}..{fmt.current}" if fmt.oldest_upgradable < fmt.current \
        else f"format {fmt.current}"
    if found.version > fmt.current:
        by = f"fs3 {found.written_by}" if found.written_by else "a newer fs3"
        raise FormatRefused(f"{where}: {fmt.kind} format {found.version} was written by {by}; this is fs3 "
                            f"{release}, which reads {ours}: install fs3 {found.written_by or 'newer'} or newer "
                            "to open it (nothing was changed)")
    if found.version == fmt.current:
        return Decision(Action.OPEN, found)
    if found.version < fmt.oldest_upgradable:
        raise FormatRefused(f"{where}: {fmt.kind} format {found.version} is older than fs3 {release} can upgrade "
                            f"({ours}): upgrade it first with an earlier fs3 release that reads format "
                            f"{found.version}, or empty the store (a storage target then resyncs from its chain)")
    steps = tuple(fmt.migration(v) for v in range(found.version, fmt.current))
    if not upgrade:
        raise FormatRefused(f"{where}: {fmt.kind} format {found.version} needs upgrading to {fmt.current} "
                            f"({len(steps)} migration(s)) and upgrade_on_start is off: stop the service and run "
                            f"`fs3 admin upgrade --config {config_hint}`, or set upgrade_on_start = true")
    return Decision(Action.MIGRATE, found, steps)


@dataclass(frozen=True)
class Page:
    """One committed unit of a migration: its writes (record rewrites, then the progress or, on
    the last page, the new format record), and where the next page starts (None: done)."""

    writes: list[Write]
    next_progress: Progress | None
    records: int


def plan_page(fmt: StoreFormat, migration: Migration, progress: Progress, scanned: Sequence[tuple[bytes, bytes]],
              page_records: int, record: FormatRecord) -> Page:
    """The batch for one page: ``scanned`` is at most ``page_records`` pairs of
    ``ranges[progress.range_index]`` from the cursor on. A short page ends its range; past the
    last range, the batch stamps ``record`` (the new version) and deletes the progress."""
    writes: list[Write] = []
    if migration.rewrite is not None:
        for key, value in scanned:
            writes.extend(migration.rewrite(key, value))
    done_records = progress.records + len(scanned)
    if migration.ranges and len(scanned) >= page_records:
        nxt = Progress(progress.from_version, progress.to_version, progress.range_index,
                       scanned[-1][0] + b"\x00", progress.pages + 1, done_records)
    else:
        nxt = Progress(progress.from_version, progress.to_version, progress.range_index + 1, None,
                       progress.pages + 1, done_records)
    if nxt.range_index >= len(migration.ranges):
        writes.extend(fmt.record_writes(record))
        writes.append((fmt.progress_key, None))
        return Page(writes, None, len(scanned))
    writes.append((fmt.progress_key, nxt.encode()))
    return Page(writes, nxt, len(scanned))


def scan_bounds(migration: Migration, progress: Progress) -> tuple[bytes, bytes | None]:
    """The ``[start, end)`` the next page of ``progress`` reads."""
    start, end = migration.ranges[progress.range_index]
    return (start if progress.cursor is None else max(start, progress.cursor)), end

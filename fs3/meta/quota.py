"""Directory quotas: limits on the bytes and the entries below a directory, kept exact by meta.

What a quota counts (the tree of directory ``Q``, ``Q`` itself left out):

* **inodes**: every directory entry below ``Q`` — a file with two names in the tree counts
  twice, as each name is one more thing a user made;
* **bytes**: the logical length (``st_size``) of every regular file whose *home* is ``Q`` or a
  directory below it. A file's home is its inode's ``parent``: the directory it was created in,
  moved with the file's name when that name is renamed to another directory. When the name in
  its home is unlinked while other names keep the file alive, the home stays (the file keeps
  counting there until its last name goes) and a ``QAWY`` key marks it, so that a count of the
  home's tree finds it; removing such a home moves the file's home up to the removed
  directory's parent (which every remaining quota above it also covers). A file in the trash
  (``nlink`` 0) counts nowhere: its bytes come back when it is restored, and a restore past a
  quota is refused. Symlinks, directories and xattrs cost no bytes.
* **byte credits**: what writers may still write (:func:`reserve`), charged like bytes to the
  quotas above their file's home.

Every ancestor's quota applies (nested quotas). The usage lives in the KV (``QUSE`` keys, see
:mod:`fs3.meta.schema`) and changes in the same transaction as the namespace change it counts,
so it is exact under concurrent clients (two transactions growing one quota conflict on its
usage key, and the second runs again against the first's result) and across a crash.

An operation records what it changed in its :class:`Ledger` as it goes (entries made and
removed per directory, bytes per home directory, directories moved); :func:`settle` then turns
the ledger into a change per quota before the transaction commits, refusing with ``EDQUOT`` a
change that grows a usage past its limit. With no quota set it costs one empty range read.

Pure: reads and writes go through the transaction; no clock, randomness or transport.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fs3 import meta_pb2 as mpb
from fs3.common.errors import BadHandle, CrossDevice, DirectoryNotEmpty, InvalidArgument, NotSupported, QuotaExceeded
from fs3.common.invariant import ensure
from fs3.common.layout import max_file_size
from fs3.kv.api import Transaction, prefix_end
from fs3.meta import schema
from fs3.meta.limits import ANCESTOR_WALK_MAX

if TYPE_CHECKING:
    from fs3.meta.ops import Namespace

__all__ = [
    "AWAY_MOVE_MAX",
    "PARKED_HOME",
    "QUOTA_COUNT_MAX",
    "QUOTA_MOVE_COUNT_MAX",
    "QUOTA_SCAN_BATCH",
    "RESERVATIONS_PER_FILE_MAX",
    "RESERVE_STEP_BYTES",
    "USAGE_MAX",
    "Ledger",
    "Reservation",
    "TreeCount",
    "Usage",
    "adopt",
    "announce",
    "charge_of",
    "credits_scan",
    "drop_reservations",
    "move_reservations",
    "nearest_quota",
    "parse_size",
    "pending_growth",
    "quotas_of",
    "read_quotas",
    "read_reservation",
    "read_usage",
    "refusal",
    "rehome_away",
    "removal_scans",
    "reserve",
    "settle",
    "settle_reservation",
    "tree_usage",
    "widen_reservations",
    "write_usage",
]

# The most bytes (and inodes) a usage counts: its fields are 64-bit.
USAGE_MAX = (1 << 64) - 1
# Quotas a cluster may hold: every growing operation reads them all (one range read).
QUOTA_COUNT_MAX = 1000
# Directory entries one transaction of a usage count (quota set, quota check) reads.
QUOTA_SCAN_BATCH = 1000
# Entries a rename recounts inside its own transaction when it moves a directory from one set of
# quotas to another; a larger tree is refused with EXDEV (``mv`` then copies it).
QUOTA_MOVE_COUNT_MAX = 1000
# The home of the credits of a file that counts nowhere (no name left: in the trash, or open
# after its last name went); no directory has this id, so no quota counts them.
PARKED_HOME = 0
# A writer's byte credit grows at least this much at a time (clipped to what the quotas allow):
# a writer streaming a large file asks meta once per 64 MiB, a round trip per few dozen chunks.
RESERVE_STEP_BYTES = 64 << 20
# Credits of one file that a transaction moving or dropping them reads (one per writing session);
# more are left where they are, and ``fs3 quota check --repair`` recounts.
RESERVATIONS_PER_FILE_MAX = 1000

_SIZE = re.compile(r"([0-9]+)([KMGTP]?)(i?B?)?", re.IGNORECASE)
_UNITS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40, "P": 50}


@dataclass(frozen=True)
class Usage:
    """What a tree uses: logical bytes of its files and its directory entries."""

    bytes: int = 0
    inodes: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.bytes + other.bytes, self.inodes + other.inodes)

    def __neg__(self) -> Usage:
        return Usage(-self.bytes, -self.inodes)

    def floored(self) -> Usage:
        """Never below zero: a usage that drifted (fsck reports it) must not wrap around."""
        return Usage(max(0, self.bytes), max(0, self.inodes))


@dataclass(frozen=True)
class Reservation:
    """A writing session's byte credit: ``size_bytes`` charged to the quotas of directory
    ``home`` beyond the file's length, which the session may write into without asking meta again."""

    home: int
    size_bytes: int

    _FMT = struct.Struct(">QQ")

    def encode(self) -> bytes:
        return self._FMT.pack(self.home, self.size_bytes)

    @classmethod
    def decode(cls, raw: bytes) -> Reservation:
        home, size = cls._FMT.unpack(raw)
        return cls(int(home), int(size))


def parse_size(text: str) -> int:
    """A size as people write it: ``100``, ``10K``, ``1.5``-free ``20G``, ``3TiB`` (powers of 1024)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise InvalidArgument(f"size {text!r} is not a whole number with an optional K, M, G, T or P suffix")
    size = int(match.group(1)) << _UNITS[match.group(2).upper()]
    if size >= 1 << 64:
        raise InvalidArgument(f"size {text!r} is past the largest limit, 16 EiB less a byte")
    return size


def charge_of(inode: mpb.Inode | None) -> tuple[int, int] | None:
    """``(home directory, bytes)`` a file charges to its home's quotas; None: it charges nothing."""
    if inode is None or inode.type != mpb.FILE or inode.nlink == 0 or inode.parent == 0:
        return None
    return inode.parent, inode.size


def refusal(limits: mpb.Quota, before: Usage, after: Usage) -> str | None:
    """Why going from ``before`` to ``after`` breaks the quota (None: it does not). Only growth
    is refused: a tree already over a limit set below its usage may always shrink."""
    if limits.bytes_limit and after.bytes > limits.bytes_limit and after.bytes > before.bytes:
        return (f"directory {limits.inode_id}'s quota of {limits.bytes_limit} bytes: {before.bytes} used, "
                f"the change needs {after.bytes - before.bytes} more")
    if limits.inodes_limit and after.inodes > limits.inodes_limit and after.inodes > before.inodes:
        return (f"directory {limits.inode_id}'s quota of {limits.inodes_limit} inodes: {before.inodes} used, "
                f"the change needs {after.inodes - before.inodes} more")
    return None


@dataclass
class Ledger:
    """What one transaction changed that a quota may count, gathered as the operation runs."""

    entries: dict[int, int] = field(default_factory=dict)  # directory -> entries made minus removed
    bytes: dict[int, int] = field(default_factory=dict)  # home directory -> bytes grown minus shrunk
    moves: list[tuple[int, int, int]] = field(default_factory=list)  # (directory, old parent, new parent)
    dropped_directories: set[int] = field(default_factory=set)
    # Whether growth past a limit is refused: a close (its bytes are on storage, its session must
    # end) and the background jobs charge what they apply without refusing it.
    refuse: bool = True
    # Every quota's limits, once read in this transaction (:func:`quotas_of`): one range read.
    known_quotas: dict[int, mpb.Quota] | None = None

    def entry(self, directory: int, delta: int) -> None:
        self.entries[directory] = self.entries.get(directory, 0) + delta

    def recharge(self, before: tuple[int, int] | None, after: tuple[int, int] | None) -> None:
        """A file's charge changed from ``before`` to ``after`` (see :func:`charge_of`)."""
        if before == after:
            return
        if before is not None:
            self.bytes[before[0]] = self.bytes.get(before[0], 0) - before[1]
        if after is not None:
            self.bytes[after[0]] = self.bytes.get(after[0], 0) + after[1]

    def empty(self) -> bool:
        return not (any(self.entries.values()) or any(self.bytes.values()) or self.moves
                    or self.dropped_directories)


def announce(txn: Transaction) -> None:
    """Announce :func:`read_quotas`'s scan, so that a networked engine runs it with the
    transaction's first read: quotas then cost an operation no round trip of its own."""
    prefix = schema.quota_prefix()
    txn.prefetch_scan(prefix, prefix_end(prefix), QUOTA_COUNT_MAX + 1)


async def read_quotas(txn: Transaction) -> dict[int, mpb.Quota]:
    """Every quota's limits, by directory."""
    prefix = schema.quota_prefix()
    rows = await txn.scan(prefix, prefix_end(prefix), limit=QUOTA_COUNT_MAX + 1)
    ensure(len(rows) <= QUOTA_COUNT_MAX, f"{len(rows)} quotas stored, more than {QUOTA_COUNT_MAX}")
    return {schema.parse_quota_key(key): mpb.Quota.FromString(raw) for key, raw in rows}


async def quotas_of(ns: Namespace) -> dict[int, mpb.Quota]:
    """:func:`read_quotas` read once per operation (the open asks, then its settle does)."""
    if ns.quota.known_quotas is None:
        ns.quota.known_quotas = await read_quotas(ns.txn)
    return dict(ns.quota.known_quotas)


async def read_usage(txn: Transaction, directory: int) -> Usage:
    raw = await txn.get(schema.quota_usage_key(directory))
    if raw is None:
        return Usage()
    stored = mpb.Quota.FromString(raw)
    return Usage(stored.bytes_used, stored.inodes_used)


def write_usage(txn: Transaction, directory: int, usage: Usage) -> None:
    txn.put(schema.quota_usage_key(directory),
            mpb.Quota(inode_id=directory, bytes_used=usage.bytes, inodes_used=usage.inodes).SerializeToString())


async def _quotas_above(ns: Namespace, directory: int, quotas: dict[int, mpb.Quota],
                        known: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    """The quota'd directories among ``directory`` and its ancestors (none when it is gone)."""
    if directory in known:
        return known[directory]
    found: list[int] = []
    current = await ns.find_inode(directory)
    for _ in range(ANCESTOR_WALK_MAX):
        if current is None or current.type != mpb.DIRECTORY:
            break
        if current.inode_id in quotas:
            found.append(current.inode_id)
        if current.inode_id == schema.ROOT_INODE:
            break
        current = await ns.find_inode(current.parent)
    else:
        raise NotSupported(f"directory {directory} is more than {ANCESTOR_WALK_MAX} levels deep: with quotas "
                           f"set, such a directory cannot change")
    known[directory] = tuple(found)
    return known[directory]


async def settle(ns: Namespace) -> None:
    """Apply the transaction's ledger to every quota it touches (see the module's docstring)."""
    ledger = ns.quota
    if ledger.empty():
        return
    quotas = await quotas_of(ns)
    if not quotas:
        return
    for gone in sorted(ledger.dropped_directories & quotas.keys()):  # a removed directory takes its quota
        ns.txn.delete(schema.quota_key(gone))
        ns.txn.delete(schema.quota_usage_key(gone))
        del quotas[gone]
    known: dict[int, tuple[int, ...]] = {}
    deltas: dict[int, Usage] = {}

    def add(directories: tuple[int, ...] | set[int], usage: Usage) -> None:
        for directory in directories:
            deltas[directory] = deltas.get(directory, Usage()) + usage

    for directory, count in ledger.entries.items():
        if count:
            add(await _quotas_above(ns, directory, quotas, known), Usage(0, count))
    for directory, size in ledger.bytes.items():
        if size:
            add(await _quotas_above(ns, directory, quotas, known), Usage(size, 0))
    for moved, old, new in ledger.moves:
        before = set(await _quotas_above(ns, old, quotas, known))
        after = set(await _quotas_above(ns, new, quotas, known))
        if before != after:
            tree = await _moved_tree_usage(ns, moved, quotas)
            add(before - after, -tree)
            add(after - before, tree)
    for directory in sorted(deltas):
        delta = deltas[directory]
        if delta == Usage():
            continue
        was = await read_usage(ns.txn, directory)
        now = (was + delta).floored()
        if now.bytes > USAGE_MAX or now.inodes > USAGE_MAX:
            # Sparse files count their length: under a quota without a byte limit enough of them
            # pass what a usage holds. Growth that would is refused; one that cannot be (a close)
            # stops at the most (fsck then reports the usage).
            if ledger.refuse:
                raise QuotaExceeded(f"directory {directory}'s usage would pass {USAGE_MAX} bytes or inodes, "
                                    f"the most a quota counts")
            now = Usage(min(now.bytes, USAGE_MAX), min(now.inodes, USAGE_MAX))
        why = refusal(quotas[directory], was, now) if ledger.refuse else None
        if why is not None:
            raise QuotaExceeded(why)
        write_usage(ns.txn, directory, now)


async def _moved_tree_usage(ns: Namespace, directory: int, quotas: dict[int, mpb.Quota]) -> Usage:
    """What a directory moving between quotas takes along: its own quota's usage when it has
    one, else a count of its tree here, refused (EXDEV) past :data:`QUOTA_MOVE_COUNT_MAX`."""
    if directory in quotas:
        return await read_usage(ns.txn, directory)
    count = TreeCount(directory)
    if not await count.step(ns.txn, ns.find_inode, QUOTA_MOVE_COUNT_MAX):
        raise CrossDevice(f"directory {directory} holds more than {QUOTA_MOVE_COUNT_MAX} entries and moves "
                          f"between quotas: copy it instead (mv does on EXDEV)")
    return count.usage


InodeReader = Callable[[int], Awaitable[mpb.Inode | None]]


@dataclass
class TreeCount:
    """The usage of a directory's tree, counted a bounded batch of entries at a time.

    Each :meth:`step` may run in a transaction of its own: the count then sees the tree as it was
    at each step, so a count of a tree that changes meanwhile can be off by those changes (a
    quota set on a busy tree; ``fs3 quota check --repair`` recounts it).
    """

    root: int
    usage: Usage = Usage()
    pending: list[tuple[int, bytes]] = field(default_factory=list)  # (directory, resume after name)
    counted_links: set[int] = field(default_factory=set)  # files with several names counted already
    entries_read: int = 0
    # With ``adopting``: files with one name and no home (written before homes existed) are
    # counted where they are named, and listed here as (directory, name, inode id) for
    # :func:`adopt` to give that directory as their home.
    adopting: bool = False
    homeless: list[tuple[int, bytes, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.pending:
            self.pending.append((self.root, b""))

    async def step(self, txn: Transaction, find_inode: InodeReader, entries_max: int) -> bool:
        """Count up to ``entries_max`` more entries; True when the whole tree is counted."""
        budget = entries_max
        while self.pending and budget > 0:
            directory, after = self.pending.pop()
            if not after:  # first visit: writers' credits here, and files at home here by no name
                self.usage = self.usage + Usage(await reserved_in(txn, directory), 0)
                self.usage = self.usage + await self._away_bytes(txn, directory, find_inode)
            prefix = schema.dentry_prefix(directory)
            start = schema.dentry_key(directory, after + b"\x00") if after else prefix
            rows = await txn.scan(start, prefix_end(prefix), limit=budget)
            entries = [mpb.DirEntry.FromString(raw) for _, raw in rows]
            files = [entry.inode_id for entry in entries if entry.type == mpb.FILE]
            txn.prefetch([key for inode_id in files
                          for key in (schema.inode_key(inode_id), schema.truncate_key(inode_id))])
            for entry in entries:
                self.usage = self.usage + Usage(0, 1)
                if entry.type == mpb.DIRECTORY:
                    self.pending.append((entry.inode_id, b""))
                elif entry.type == mpb.FILE:
                    self.usage = self.usage + await self._file_bytes(txn, directory, entry, find_inode)
            budget -= len(rows)
            self.entries_read += len(rows)
            if len(rows) and budget == 0:
                self.pending.append((directory, bytes(entries[-1].name)))  # the directory may hold more
        return not self.pending

    async def _away_bytes(self, txn: Transaction, directory: int, find_inode: InodeReader) -> Usage:
        """Bytes of the files whose home is ``directory`` though no name of theirs is in it."""
        prefix = schema.quota_away_prefix(directory)
        total, start = 0, prefix
        while True:
            rows = await txn.scan(start, prefix_end(prefix), limit=QUOTA_SCAN_BATCH)
            ids = [schema.decode_u64(key[len(prefix):]) for key, _ in rows]
            txn.prefetch([key for inode_id in ids
                          for key in (schema.inode_key(inode_id), schema.truncate_key(inode_id))])
            for inode_id in ids:
                inode = await find_inode(inode_id)
                charge = charge_of(inode)
                if inode is not None and charge is not None and charge[0] == directory \
                        and inode_id not in self.counted_links:
                    self.counted_links.add(inode_id)
                    total += charge[1] + await pending_growth(txn, inode)
            if len(rows) < QUOTA_SCAN_BATCH:
                return Usage(total, 0)
            start = rows[-1][0] + b"\x00"

    async def _file_bytes(self, txn: Transaction, directory: int, entry: mpb.DirEntry,
                          find_inode: InodeReader) -> Usage:
        inode_id = entry.inode_id
        inode = await find_inode(inode_id)
        if self.adopting and inode is not None and inode.nlink == 1 and inode.parent == 0:
            self.homeless.append((directory, bytes(entry.name), inode_id))
            return Usage(inode.size, 0)
        charge = charge_of(inode)
        if charge is None or charge[0] != directory:
            return Usage()
        if inode_id in self.counted_links:
            return Usage()
        self.counted_links.add(inode_id)
        assert inode is not None  # it has a charge
        return Usage(charge[1] + await pending_growth(txn, inode), 0)


async def pending_growth(txn: Transaction, inode: mpb.Inode) -> int:
    """The bytes an unfinished truncate grows ``inode`` by: charged when it was recorded, before
    the length shows it (fs3.meta.ops), so a count adds them; 0 when none is pending or it shrinks."""
    raw = await txn.get(schema.truncate_key(inode.inode_id))
    if raw is None:
        return 0
    job = schema.TruncateJob.decode(raw)
    return max(0, job.size - inode.size) if job.size is not None else 0


def tree_usage(inodes: dict[int, mpb.Inode], entries: list[tuple[int, int]],
               roots: set[int], reservations: Sequence[tuple[int, int]] = (),
               growth: Mapping[int, int] | None = None) -> dict[int, Usage]:
    """The usage of each directory in ``roots``, from a whole namespace read at once (fsck):
    ``entries`` is every directory entry as ``(directory, inode id)``, ``reservations`` every
    writer's credit as ``(home, bytes)``, ``growth`` what each file's unfinished truncate grows it
    by (:func:`pending_growth`). Follows the same rules as :class:`TreeCount` and
    :func:`settle`, which is what lets fsck check them."""
    above: dict[int, tuple[int, ...]] = {}

    def quotas_of(directory: int) -> tuple[int, ...]:
        path: list[int] = []
        current: int | None = directory
        found: tuple[int, ...] = ()
        for _ in range(len(inodes) + 1):
            if current is None or current in above:
                found = above.get(current, ()) if current is not None else ()
                break
            inode = inodes.get(current)
            if inode is None or inode.type != mpb.DIRECTORY:
                break
            path.append(current)
            if current == schema.ROOT_INODE or inode.parent == current:
                break
            current = inode.parent
        for directory_on_path in reversed(path):
            found = ((directory_on_path,) if directory_on_path in roots else ()) + found
            above[directory_on_path] = found
        return above.get(directory, ())

    usage = {root: Usage() for root in roots}
    for directory, _ in entries:
        for root in quotas_of(directory):
            usage[root] = usage[root] + Usage(0, 1)
    for inode in inodes.values():
        charge = charge_of(inode)
        if charge is not None:
            grown = (growth or {}).get(inode.inode_id, 0)
            for root in quotas_of(charge[0]):
                usage[root] = usage[root] + Usage(charge[1] + grown, 0)
    for home, size in reservations:
        for root in quotas_of(home):
            usage[root] = usage[root] + Usage(size, 0)
    return usage


async def adopt(ns: Namespace, homeless: list[tuple[int, bytes, int]]) -> None:
    """Give each file of ``homeless`` (directory, name, inode id) that still has that one name and
    no home the directory as its home; the quotas above it are charged (never refused: the bytes
    are there already). Part of setting a quota on a tree written before files had homes."""
    ns.quota.refuse = False
    for directory, name, inode_id in homeless:
        entry = await ns.entry(directory, name)
        inode = await ns.find_inode(inode_id)
        if entry is None or entry.inode_id != inode_id or inode is None or inode.type != mpb.FILE \
                or inode.nlink != 1 or inode.parent != 0:
            continue  # changed since it was counted: a recount (quota check) settles it
        inode.parent = directory
        ns.touch(inode)
    ns.flush()
    await settle(ns)


async def nearest_quota(txn: Transaction, inode_id: int) -> int | None:
    """The nearest quota'd directory at or above ``inode_id`` (a file: above its home), or None.
    What ``df`` inside a directory reports (the tightest bound is usually the nearest)."""
    quotas = await read_quotas(txn)
    if not quotas:
        return None
    current = inode_id or schema.ROOT_INODE
    for _ in range(ANCESTOR_WALK_MAX):
        raw = await txn.get(schema.inode_key(current))
        if raw is None:
            return None
        inode = mpb.Inode.FromString(raw)
        if inode.type != mpb.DIRECTORY:
            current = inode.parent or schema.ROOT_INODE
            continue
        if current in quotas:
            return current
        if current == schema.ROOT_INODE:
            return None
        current = inode.parent
    return None


# -- byte credits: what a writer may write before meta hears its length --------------------------

async def read_reservation(txn: Transaction, inode_id: int, session_id: bytes) -> Reservation | None:
    raw = await txn.get(schema.quota_reservation_key(inode_id, session_id))
    return None if raw is None else Reservation.decode(raw)


def _write_reservation(txn: Transaction, inode_id: int, session_id: bytes, old: Reservation | None,
                       new: Reservation | None) -> None:
    if old is not None and (new is None or new.home != old.home):
        txn.delete(schema.quota_reservation_home_key(old.home, inode_id, session_id))
    if new is None or new.size_bytes == 0:
        txn.delete(schema.quota_reservation_key(inode_id, session_id))
        if new is not None:
            txn.delete(schema.quota_reservation_home_key(new.home, inode_id, session_id))
        return
    txn.put(schema.quota_reservation_key(inode_id, session_id), new.encode())
    txn.put(schema.quota_reservation_home_key(new.home, inode_id, session_id), schema.encode_u64(new.size_bytes))


async def reserve(ns: Namespace, inode_id: int, session_id: bytes, end: int) -> tuple[int, bool]:
    """Let writing session ``session_id`` write its file up to byte ``end``: the end its credit
    now covers (at least ``end``), and whether a quota counts it now. The credit grows to ``end``
    and a step beyond: :data:`RESERVE_STEP_BYTES`, or half of what the tightest quota above the
    file's home has left if less; ``EDQUOT`` when even ``end`` does not fit. A file no quota counts
    gets its credit too, charged nowhere: a rename (of it or of a directory above it) under a
    quota charges it there, refused like any credit moving between quotas, so a writer never
    writes past what some quota accounted for it.
    Charged in this transaction (the service settles the ledger before the commit)."""
    raw = await ns.txn.get(schema.session_key(inode_id, session_id))
    if raw is None:
        raise BadHandle(f"no open session {session_id.hex()} on inode {inode_id}")
    if not schema.Session.decode(raw).write:
        raise BadHandle(f"session {session_id.hex()} on inode {inode_id} is not open for writing")
    inode = await ns.inode(inode_id)
    if inode.type == mpb.FILE and end > max_file_size(inode.layout):
        raise InvalidArgument(f"a credit to byte {end} of inode {inode_id} is past {max_file_size(inode.layout)}, "
                              f"the largest file its layout allows")
    charge = charge_of(inode)
    held = await read_reservation(ns.txn, inode_id, session_id)
    if inode.type == mpb.FILE and inode.nlink == 0:
        # Removed (in the trash, or open after its last name went): it counts nowhere now, but a
        # restore counts it again, with how far its writers may write (:func:`drop_reservations`).
        parked = max(held.size_bytes if held is not None else 0, end + RESERVE_STEP_BYTES - inode.size)
        _write_reservation(ns.txn, inode_id, session_id, held, Reservation(PARKED_HOME, parked))
        return inode.size + parked, False
    if charge is None:  # no home (written before files had one): a quota set adopts it, and counts it
        if held is not None:
            ns.quota.recharge((held.home, held.size_bytes), None)
            _write_reservation(ns.txn, inode_id, session_id, held, None)
        return end + RESERVE_STEP_BYTES, False
    quotas = await quotas_of(ns)
    above = await _quotas_above(ns, charge[0], quotas, {})
    home = charge[0]
    if held is not None and held.home != home:  # renamed elsewhere since: the credit starts again
        ns.quota.recharge((held.home, held.size_bytes), None)
        _write_reservation(ns.txn, inode_id, session_id, held, None)
        held = None
    have = held.size_bytes if held is not None else 0
    need = end - inode.size
    if need <= have:
        return inode.size + have, bool(above)
    room: int | None = None
    for directory in above:
        limit = quotas[directory].bytes_limit
        if limit:
            free = max(0, limit - (await read_usage(ns.txn, directory)).bytes)
            room = free if room is None else min(room, free)
    if room is not None and need - have > room:
        raise QuotaExceeded(f"writing inode {inode_id} to byte {end} needs {need - have} more bytes than "
                            f"its quotas have ({room} left)")
    # A step ahead, but never more than half of what is left: one writer must not take the
    # whole of a nearly full quota while others write beside it.
    grant = max(need - have, RESERVE_STEP_BYTES if room is None else min(RESERVE_STEP_BYTES, room // 2))
    ns.quota.recharge(None, (home, grant))
    _write_reservation(ns.txn, inode_id, session_id, held, Reservation(home, have + grant))
    return inode.size + have + grant, bool(above)


async def settle_reservation(ns: Namespace, inode_id: int, session_id: bytes, grown: int, closing: bool) -> None:
    """A session published its length, which grew the file by ``grown`` bytes: that growth is
    charged to the file's home as any growth is (:meth:`Namespace.flush`), so the same bytes of
    the session's credit are given back here; a close gives back the rest too."""
    held = await read_reservation(ns.txn, inode_id, session_id)
    if held is None:
        return
    left = 0 if closing else max(0, held.size_bytes - max(0, grown))
    ns.quota.recharge((held.home, held.size_bytes), (held.home, left) if left else None)
    _write_reservation(ns.txn, inode_id, session_id, held, Reservation(held.home, left))


async def _held(ns: Namespace, inode_id: int) -> list[tuple[bytes, Reservation]]:
    start, end, limit = credits_scan(inode_id)
    rows = await ns.txn.scan(start, end, limit=limit)
    return [(schema.parse_quota_reservation_key(key)[1], Reservation.decode(raw)) for key, raw in rows]


def removal_scans(inode_id: int, kind: int) -> list[tuple[bytes, bytes | None, int]]:
    """The scans (start, end, limit) removing the last name of ``inode_id`` makes here: a file's
    writers' credits (:func:`drop_reservations`), a directory's files at home by no name
    (:func:`rehome_away`). Announced before the removal runs, they ride with its first read."""
    if kind == mpb.FILE:
        return [credits_scan(inode_id)]
    prefix = schema.quota_away_prefix(inode_id)
    return [(prefix, prefix_end(prefix), AWAY_MOVE_MAX + 1)]


def credits_scan(inode_id: int) -> tuple[bytes, bytes | None, int]:
    """The scan (start, end, limit) that reads a file's writers' credits, to announce it."""
    prefix = schema.quota_reservation_prefix(inode_id)
    return prefix, prefix_end(prefix), RESERVATIONS_PER_FILE_MAX


async def drop_reservations(ns: Namespace, inode_id: int) -> None:
    """The file stopped counting in any quota (its last name went): its writers' credits are given
    back, and kept at :data:`PARKED_HOME`, which counts nowhere: their writers may still write as
    far as they reached, so a restore from the trash charges them again (:func:`move_reservations`)."""
    for session_id, held in await _held(ns, inode_id):
        ns.quota.recharge((held.home, held.size_bytes), None)
        _write_reservation(ns.txn, inode_id, session_id, held, Reservation(PARKED_HOME, held.size_bytes))


async def move_reservations(ns: Namespace, inode_id: int, home: int) -> None:
    """The file's home moved to ``home`` (or it came back from the trash, its credits parked):
    its writers' credits move with its bytes (refused, with the rest of the operation, where the
    new quotas have no room for them)."""
    for session_id, held in await _held(ns, inode_id):
        if held.home != home:
            ns.quota.recharge((held.home, held.size_bytes), (home, held.size_bytes))
            _write_reservation(ns.txn, inode_id, session_id, held, Reservation(home, held.size_bytes))


async def widen_reservations(ns: Namespace, inode_id: int, shrink: int, size_gen: int) -> None:
    """The file shrank by ``shrink`` bytes (truncate generation ``size_gen``): each open writer
    may still write up to where its credit reached (it learns of a truncate by another client
    only when it asks again), so each credit grows by as much, keeping ``length + credit`` where
    it was. A writer without a credit that opened before the truncate (it used its credit up, or
    overwrites a file that was this long when it opened) may write up to the old length: it gets
    a credit of the shrink; one opened by the truncate (``O_TRUNC``) was told the new length.
    Charged, never refused (the truncate's own shrink pays for it); a close gives it back."""
    held = dict(await _held(ns, inode_id))
    charge = charge_of(await ns.find_inode(inode_id))
    if charge is not None and await quotas_of(ns):  # (no quota anywhere: handles never ask)
        for session_id in await _writers_before(ns, inode_id, size_gen):
            held.setdefault(session_id, Reservation(charge[0], 0))
    for session_id, old in sorted(held.items()):
        new = Reservation(old.home, old.size_bytes + shrink)
        ns.quota.recharge((old.home, old.size_bytes) if old.size_bytes else None, (new.home, new.size_bytes))
        _write_reservation(ns.txn, inode_id, session_id, old if old.size_bytes else None, new)


async def _writers_before(ns: Namespace, inode_id: int, size_gen: int) -> list[bytes]:
    """The sessions open for writing on ``inode_id`` since before truncate generation ``size_gen``
    (at most :data:`RESERVATIONS_PER_FILE_MAX` sessions read)."""
    prefix = schema.session_prefix(inode_id)
    rows = await ns.txn.scan(prefix, prefix_end(prefix), limit=RESERVATIONS_PER_FILE_MAX)
    sessions = [(key[len(prefix):], schema.Session.decode(raw)) for key, raw in rows]
    return [session_id for session_id, session in sessions if session.write and session.size_gen < size_gen]


async def reserved_in(txn: Transaction, directory: int) -> int:
    """Bytes of the credits whose home is ``directory`` (what a count of its tree adds)."""
    prefix = schema.quota_reservation_home_prefix(directory)
    total, start = 0, prefix
    while True:
        rows = await txn.scan(start, prefix_end(prefix), limit=QUOTA_SCAN_BATCH)
        total += sum(schema.decode_u64(raw) for _, raw in rows)
        if len(rows) < QUOTA_SCAN_BATCH:
            return total
        start = rows[-1][0] + b"\x00"


# Files at home in a directory by no name there that removing the directory moves up; more is
# refused (ENOTEMPTY: remove some of their other names first).
AWAY_MOVE_MAX = 1000


async def rehome_away(ns: Namespace, directory: int, parent: int) -> None:
    """Directory ``directory`` (empty) is being removed from ``parent``: the files at home in it
    by no name there (:func:`fs3.meta.quota` module docstring) take ``parent`` as their home, and
    their writers' credits go along. Every quota above ``parent`` covered them already and the
    removed directory's own quota goes with it, so no usage changes."""
    prefix = schema.quota_away_prefix(directory)
    rows = await ns.txn.scan(prefix, prefix_end(prefix), limit=AWAY_MOVE_MAX + 1)
    if len(rows) > AWAY_MOVE_MAX:
        raise DirectoryNotEmpty(f"directory {directory} is the home of more than {AWAY_MOVE_MAX} files named "
                                f"elsewhere: remove some of their other names first")
    for key, _ in rows:
        ns.txn.delete(key)
        inode_id = schema.decode_u64(key[len(prefix):])
        inode = await ns.find_inode(inode_id)
        if inode is None or inode.type != mpb.FILE or inode.parent != directory or inode.nlink == 0:
            continue
        inode.parent = parent
        ns.touch(inode)
        ns.recharged(inode)
        ns.txn.put(schema.quota_away_key(parent, inode_id), b"")
        for session_id, held in await _held(ns, inode_id):
            _write_reservation(ns.txn, inode_id, session_id, held, Reservation(parent, held.size_bytes))

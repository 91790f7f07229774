"""The trash: removed files kept, with their chunks, until they expire or are purged.

With ``trash_days`` > 0 in meta's settings, removing a file's last name (unlink, or a rename
over it) no longer deletes the inode and queues its chunks for GC. The inode stays, with no
name (``nlink`` 0), and a :class:`~fs3.meta_pb2.TrashEntry` records where it was (directory
inode, name, path from the root when the request gave one), who removed it and when, and when
it expires. Two keys hold it (:mod:`fs3.meta.schema`): ``TRSH`` + inode id, the entry, and
``TRSX`` + expiry + inode id, so that expiry reads the trash in order of expiry. Neither is a
directory entry: nothing in the trash shows in any directory's listing.

Since a trashed inode has no GC job, GC cannot touch its chunks; purging an entry (by hand or
at expiry) deletes the inode as the last unlink used to — queueing its GC job in the same
transaction — unless a handle still holds it open, in which case its last close does.

Every function here is part of one transaction (pure: time and the caller come in through the
:class:`~fs3.meta.ops.Namespace`'s environment). An entry belongs to the user who removed the
file: a user lists, restores and purges only its own entries, root all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fs3 import meta_pb2 as mpb
from fs3.common.errors import AlreadyExists, InvalidArgument, NotADirectory, NotFound, NotPermitted
from fs3.common.invariant import ensure
from fs3.common.posix import R_OK, X_OK, may
from fs3.kv.api import Transaction, prefix_end
from fs3.meta import schema

if TYPE_CHECKING:
    from fs3.meta.ops import Namespace

__all__ = [
    "NS_PER_DAY",
    "PATH_WALK_DEPTH_MAX",
    "PATH_WALK_ENTRIES_MAX",
    "TRASH_DAYS_MAX",
    "TRASH_PAGE_MAX",
    "TRASH_PURGE_BATCH",
    "entry_for",
    "expired_page",
    "keep_ns",
    "list_page",
    "purge",
    "purge_page",
    "put",
    "restore",
    "shown_path",
]

NS_PER_DAY = 86_400 * 1_000_000_000
TRASH_DAYS_MAX = 3650  # the longest a trash may keep files (ten years)
# A listing names the directory of an entry removed by directory inode (a mount's removals) by
# walking up from it: at most this many levels, and this many directory entries read per page of
# the listing to find the names (past either, the entry shows as ``<dir N>/name``).
PATH_WALK_DEPTH_MAX = 64
PATH_WALK_ENTRIES_MAX = 16_384
_WALK_PAGE = 256
# Entries one TrashList or TrashPurge page reads (a larger ``limit`` is clamped): one transaction.
TRASH_PAGE_MAX = 1000
# Entries one purge transaction removes: each deletes an inode and a page of its attributes.
TRASH_PURGE_BATCH = 32


def keep_ns(trash_days: float) -> int:
    """How long an entry stays, from meta's ``trash_days`` (0: no trash)."""
    if not 0 <= trash_days <= TRASH_DAYS_MAX:
        raise InvalidArgument(f"trash_days {trash_days} outside [0, {TRASH_DAYS_MAX}]")
    return int(trash_days * NS_PER_DAY)


def entry_for(inode: mpb.Inode, parent: int, name: bytes, path: bytes, uid: int, now_ns: int,
              keep: int) -> mpb.TrashEntry:
    """The entry of ``inode``, whose last name ``name`` in directory ``parent`` is being removed."""
    ensure(inode.nlink == 0 and inode.type == mpb.FILE, f"inode {inode.inode_id} trashed with names or not a file")
    return mpb.TrashEntry(id=inode.inode_id, parent=parent, name=name, path=path, uid=uid,
                          removed_at_ns=now_ns, expires_at_ns=now_ns + keep)


def put(txn: Transaction, entry: mpb.TrashEntry) -> None:
    txn.put(schema.trash_key(entry.id), entry.SerializeToString())
    txn.put(schema.trash_expiry_key(entry.expires_at_ns, entry.id), b"")


def _drop(txn: Transaction, entry: mpb.TrashEntry) -> None:
    txn.delete(schema.trash_key(entry.id))
    txn.delete(schema.trash_expiry_key(entry.expires_at_ns, entry.id))


def shown_path(entry: mpb.TrashEntry) -> str:
    """Where the file was, for people: its path, or its directory's inode and its name."""
    if entry.path:
        return bytes(entry.path).decode(errors="replace")
    return f"<dir {entry.parent}>/{bytes(entry.name).decode(errors='replace')}"


def _mine(ns: Namespace, entry: mpb.TrashEntry) -> bool:
    return ns.caller.is_root or ns.caller.uid == entry.uid


async def _entry(ns: Namespace, entry_id: int) -> mpb.TrashEntry:
    raw = await ns.txn.get(schema.trash_key(entry_id))
    if raw is None:
        raise NotFound(f"no trash entry {entry_id} (restored or purged already, or never there)")
    entry = mpb.TrashEntry.FromString(raw)
    if not _mine(ns, entry):
        raise NotPermitted(f"trash entry {entry_id} belongs to uid {entry.uid}: only it or root may touch it")
    return entry


async def list_page(ns: Namespace, start_after: int, limit: int) -> mpb.TrashListRsp:
    """The caller's entries with ids above ``start_after``, reading at most ``limit`` entries
    (clamped to :data:`TRASH_PAGE_MAX`); each with the file's size."""
    limit = min(limit or TRASH_PAGE_MAX, TRASH_PAGE_MAX)
    prefix = schema.trash_prefix()
    rows = await ns.txn.scan(schema.trash_key(start_after + 1), prefix_end(prefix), limit=limit)
    rsp = mpb.TrashListRsp(more=len(rows) == limit)
    walk = _PathWalk(ns)
    for _, raw in rows:
        entry = mpb.TrashEntry.FromString(raw)
        rsp.next_after = entry.id
        if _mine(ns, entry):
            inode = await ns.find_inode(entry.id)
            entry.size = inode.size if inode is not None else 0  # none: fsck reports the entry
            if not entry.path:
                directory = await walk.path(entry.parent)
                if directory is not None:  # where a restore puts it: the directory's path now
                    entry.path = directory.rstrip(b"/") + b"/" + bytes(entry.name)
            rsp.entries.append(entry)
    return rsp


class _PathWalk:
    """The paths of directories from their inode ids, for one listing page: up through each
    directory's ``parent``, finding its name among its parent's entries, bounded by
    :data:`PATH_WALK_DEPTH_MAX` and :data:`PATH_WALK_ENTRIES_MAX`, and only through directories
    the caller may read and search (root: all); what it found is remembered."""

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.known: dict[int, bytes | None] = {schema.ROOT_INODE: b"/"}
        self.entries_left = PATH_WALK_ENTRIES_MAX

    async def path(self, inode_id: int) -> bytes | None:
        """The directory's path from the root; None when it is gone or the walk's bounds ran out."""
        names: list[bytes] = []
        chain: list[int] = []
        current = inode_id
        for _ in range(PATH_WALK_DEPTH_MAX + 1):
            if current in self.known:
                found = self.known[current]
                break
            chain.append(current)
            inode = await self.ns.find_inode(current)
            parent = inode.parent if inode is not None and inode.type == mpb.DIRECTORY else 0
            name = await self._name_in(parent, current) if parent and parent != current and \
                await self._may_list(parent) else None
            if name is None:
                found = None
                break
            names.append(name)
            current = parent
        else:
            found = None
        # Each directory on the way gets its path (or None) too: its entry of the same page reuses it.
        for index, directory in enumerate(chain):
            self.known[directory] = None if found is None else (
                found.rstrip(b"/") + b"/" + b"/".join(reversed(names[index:])))
        return self.known.get(inode_id)

    async def _may_list(self, directory: int) -> bool:
        """Whether the caller may read and search ``directory``: a name in it is shown only to one
        who could list it (``ls``), on a path it could walk; so the walk of every directory up to
        the root tells a user no name it could not have read itself."""
        inode = await self.ns.find_inode(directory)
        return inode is not None and may(inode, self.ns.caller, R_OK | X_OK)

    async def _name_in(self, parent: int, child: int) -> bytes | None:
        """``child``'s name among ``parent``'s entries (a directory has one name), within the budget."""
        prefix = schema.dentry_prefix(parent)
        start, end = prefix, prefix_end(prefix)
        while self.entries_left > 0:
            rows = await self.ns.txn.scan(start, end, limit=min(_WALK_PAGE, self.entries_left))
            self.entries_left -= len(rows)
            for key, raw in rows:
                if mpb.DirEntry.FromString(raw).inode_id == child:
                    return schema.parse_dentry_key(key)[1]
            if len(rows) < _WALK_PAGE:
                return None
            start = rows[-1][0] + b"\0"
        return None


async def restore(ns: Namespace, entry_id: int, to: mpb.PathRef | None) -> mpb.Inode:
    """Give the file of entry ``entry_id`` a name again: its old one in its old directory, or
    ``to``. Never replaces a name; refused, saying why, when the old place is gone or taken."""
    entry = await _entry(ns, entry_id)
    if to is not None:
        parent, name = await ns.resolve_parent(to)
    else:
        found = await ns.find_inode(entry.parent)
        if found is None or found.type != mpb.DIRECTORY:
            raise NotFound(f"trash entry {entry_id}: its directory {shown_path(entry)!r} is gone; "
                           f"restore it elsewhere (--to PATH)")
        parent, name = found, bytes(entry.name)
    if parent.type != mpb.DIRECTORY:
        raise NotADirectory(f"inode {parent.inode_id} is not a directory")
    if await ns.entry(parent.inode_id, name) is not None:
        # Named as the caller named it (the original path, or --to's), not by directory inode ids.
        if to is None:
            taken = shown_path(entry)
        elif to.path.startswith(b"/") or not to.parent:
            taken = bytes(to.path).decode(errors="replace")
        else:
            taken = f"<dir {parent.inode_id}>/{name.decode(errors='replace')}"
        raise AlreadyExists(f"trash entry {entry_id}: {taken!r} is taken; restore it under another name "
                            f"(--to PATH)")
    inode = await ns.inode(entry.id)
    _drop(ns.txn, entry)
    return await ns.relink(parent, name, inode)


async def purge(ns: Namespace, entry_id: int) -> bool:
    """Empty entry ``entry_id`` now: its inode is deleted and its chunks queued for GC (True),
    or, while a handle holds it open, at that handle's last close."""
    entry = await _entry(ns, entry_id)
    return await _purge_entry(ns, entry)


async def _purge_entry(ns: Namespace, entry: mpb.TrashEntry) -> bool:
    _drop(ns.txn, entry)
    inode = await ns.find_inode(entry.id)
    if inode is None:
        return False  # an entry without its inode (fsck reports one): nothing left to free
    gc = await ns.release_unlinked(inode)
    ns.flush()
    return gc


async def purge_page(ns: Namespace, start_after: int, expired_only: bool) -> mpb.TrashPurgeRsp:
    """Purge the caller's entries (only expired ones with ``expired_only``) among the next
    :data:`TRASH_PURGE_BATCH` entries above id ``start_after``; ``more``: call again from
    ``next_after``."""
    prefix = schema.trash_prefix()
    rows = await ns.txn.scan(schema.trash_key(start_after + 1), prefix_end(prefix), limit=TRASH_PURGE_BATCH)
    rsp = mpb.TrashPurgeRsp(more=len(rows) == TRASH_PURGE_BATCH)
    for _, raw in rows:
        entry = mpb.TrashEntry.FromString(raw)
        rsp.next_after = entry.id
        if _mine(ns, entry) and (not expired_only or entry.expires_at_ns <= ns.now):
            await _purge_entry(ns, entry)
            rsp.purged += 1
    return rsp


async def expired_page(ns: Namespace, limit: int = TRASH_PURGE_BATCH) -> int:
    """Purge up to ``limit`` entries whose expiry has passed, oldest expiry first (the
    background job's step; the caller runs it as root). Returns how many it purged."""
    start = schema.trash_expiry_prefix()
    end = schema.trash_expiry_key(ns.now + 1, 0)
    purged = 0
    for key, _ in await ns.txn.scan(start, end, limit=limit):
        entry_id = int.from_bytes(key[len(start) + 8:len(start) + 16], "big")
        raw = await ns.txn.get(schema.trash_key(entry_id))
        if raw is None:  # a stray expiry key (fsck reports one): dropped, or it would stay at the head
            ns.txn.delete(key)
            continue
        await _purge_entry(ns, mpb.TrashEntry.FromString(raw))
        purged += 1
    return purged

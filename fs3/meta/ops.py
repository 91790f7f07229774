"""POSIX namespace operations as transaction functions. Pure: no transport, clock or randomness.

Each public method of :class:`Namespace` is the body of one transaction: it reads through the
transaction, checks permissions, and buffers its writes; the service commits it, retries it on
conflicts, and performs side effects (storage truncation, chunk removal) only after commit.
Time comes in as ``now_ns`` and new inode ids as arguments, so the same inputs always give the
same result — which is what makes a retried transaction safe.

Semantics follow Linux: permission bits for owner, group (primary and supplementary) and others,
root bypassing read/write/search checks, the sticky bit restricting unlink and rename, setgid
directories passing their group (and, to subdirectories, the bit) on, ``nlink`` of a directory
being 2 plus its subdirectories, and ``atime``/``mtime``/``ctime`` updated as the man pages say
(``atime`` with relatime rules at open).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from fs3 import meta_pb2 as mpb
from fs3.common.errors import (
    AlreadyExists,
    BadHandle,
    DirectoryNotEmpty,
    FileTooLarge,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NotADirectory,
    NotFound,
    NotPermitted,
    NotSupported,
    NoXattr,
    PermissionDenied,
    SymlinkLoop,
    TooManyLinks,
    XattrTooLarge,
)
from fs3.common.invariant import ensure
from fs3.common.layout import file_layout, max_file_size, validate_dir_layout
from fs3.common.posix import (
    LINK_MAX,
    NAME_MAX_BYTES,
    O_ACCMODE,
    O_CREAT,
    O_DIRECTORY,
    O_EXCL,
    O_NOFOLLOW,
    O_RDONLY,
    O_RDWR,
    O_TRUNC,
    O_WRONLY,
    PATH_MAX_BYTES,
    PERM_MASK,
    R_OK,
    S_ISGID,
    S_ISUID,
    S_ISVTX,
    S_IXGRP,
    SYMLINK_FOLLOW_MAX,
    W_OK,
    X_OK,
    XATTR_LIST_MAX_BYTES,
    XATTR_NAME_MAX_BYTES,
    XATTR_VALUE_MAX_BYTES,
    Caller,
    may,
)
from fs3.kv.api import Transaction, prefix_end
from fs3.meta import quota, schema, trash
from fs3.meta.limits import ANCESTOR_WALK_MAX, READDIR_LIMIT_MAX, XATTR_DELETE_PAGE, XATTR_LIST_PAGE

__all__ = [
    "ANCESTOR_WALK_MAX",
    "XATTR_DELETE_PAGE",
    "Ancestry",
    "AncestryUnknown",
    "LengthProbeStale",
    "LengthReport",
    "Namespace",
    "OpEnv",
    "TruncatePending",
    "TruncateUnclaimed",
    "removal_scans",
]

_RELATIME_NS = 24 * 3600 * 1_000_000_000

DIRECTORY = mpb.DIRECTORY
FILE = mpb.FILE
SYMLINK = mpb.SYMLINK


@dataclass(frozen=True)
class OpEnv:
    """What an operation needs from outside the transaction, fixed before it runs."""

    now_ns: int
    caller: Caller
    chain_tables: dict[int, list[int]] = field(default_factory=dict)
    stripe_default: int = 16
    # How long a removed file stays in the trash (fs3.meta.trash); 0: no trash, chunks go to GC.
    trash_keep_ns: int = 0


@dataclass(frozen=True)
class LengthReport:
    """What a writer says about a file's length at close or sync, and what meta found on storage.

    ``hint`` is the end of everything the handle wrote (``wrote``); ``acked`` says every write
    below it is acknowledged. ``exact`` is the file's end on storage, probed under size generation
    ``probed_gen`` (None: not probed). ``final``: no better answer is coming (the service probed
    as often as it will), so :meth:`Namespace._apply_length` decides rather than ask for a new
    probe. The default is a handle that wrote nothing: nothing to apply.
    """

    hint: int = 0
    wrote: bool = False
    acked: bool = False
    exact: int | None = None
    probed_gen: int | None = None
    final: bool = True

    def probed(self, exact: int | None, probed_gen: int | None, final: bool) -> LengthReport:
        """This report with storage's answer (the file's end, probed under ``probed_gen``)."""
        return replace(self, exact=exact, probed_gen=probed_gen, final=final)


@dataclass
class CloseResult:
    inode: mpb.Inode
    gc_enqueued: bool


def split_path(path: bytes) -> tuple[bool, list[bytes]]:
    """``(absolute, components)``; ``.`` and empty components dropped. Validates lengths and NUL."""
    if b"\x00" in path:
        raise InvalidArgument("path contains a NUL byte")
    if len(path) > PATH_MAX_BYTES:
        raise NameTooLong(f"path of {len(path)} bytes exceeds {PATH_MAX_BYTES}")
    parts = [p for p in path.split(b"/") if p and p != b"."]
    for part in parts:
        if len(part) > NAME_MAX_BYTES:
            raise NameTooLong(f"name of {len(part)} bytes exceeds {NAME_MAX_BYTES}")
    return path.startswith(b"/"), parts


def check_new_name(name: bytes) -> None:
    if not name:
        raise InvalidArgument("empty name")
    if name in (b".", b".."):
        raise InvalidArgument(f"{name!r} cannot be created, removed or renamed")
    if b"/" in name or b"\x00" in name:
        raise InvalidArgument("a name cannot contain '/' or NUL")
    if len(name) > NAME_MAX_BYTES:
        raise NameTooLong(f"name of {len(name)} bytes exceeds {NAME_MAX_BYTES}")


class AncestryUnknown(Exception):
    """Whether ``ancestor`` is above directory ``start`` is further up than one transaction looks.

    The service follows the parent links from ``start`` in bounded read transactions and runs
    the operation again with the answer (:class:`Ancestry`): the tree may be as deep as users
    make it, while no transaction reads more than :data:`ANCESTOR_WALK_MAX` inodes for it.
    """

    def __init__(self, start: int, ancestor: int) -> None:
        super().__init__(f"is {ancestor} above {start}? the directory chain is deeper than one transaction walks")
        self.start = start
        self.ancestor = ancestor


@dataclass
class Ancestry:
    """Answers to :class:`AncestryUnknown`, true while no directory moved since they were read.

    ``moves`` is the value of :func:`schema.directory_moves_key` the walks saw; ``above`` maps
    ``(start, ancestor)`` to whether ``ancestor`` is ``start`` or above it.
    """

    moves: bytes
    above: dict[tuple[int, int], bool] = field(default_factory=dict)


class LengthProbeStale(Exception):
    """The file was truncated between meta's probe of storage and the transaction: probe again."""


class TruncatePending(Exception):
    """The inode has a truncate whose chunk removal is not finished: finish it, then run again.

    Until the removal is done the new size is not applied, and nothing that could let a client
    write where the removal is still to come (an open, a length, another size change) goes ahead.
    """

    def __init__(self, inode_id: int) -> None:
        super().__init__(f"inode {inode_id} has an unfinished truncate")
        self.inode_id = inode_id


class TruncateUnclaimed(Exception):
    """The operation changes the size of an inode whose truncate the caller did not claim.

    The service claims an inode (it then carries out the truncate's storage side before it
    answers, and no other truncate or length probe of the inode runs meanwhile in that process),
    and runs the operation again with ``truncating`` set to it.
    """

    def __init__(self, inode_id: int) -> None:
        super().__init__(f"a truncate of inode {inode_id} must be claimed")
        self.inode_id = inode_id


def removal_scans(inode_id: int, kind: int) -> list[tuple[bytes, bytes | None, int]]:
    """The scans (start, end, limit) that removing the last name of an inode makes: whether a
    directory is empty or a file still open, then its first page of attributes, and what quotas
    read (:func:`fs3.meta.quota.removal_scans`). Announced before
    they run (``Transaction.prefetch_scan``), they ride together with an earlier read."""
    first = schema.dentry_prefix(inode_id) if kind == DIRECTORY else schema.session_prefix(inode_id)
    xattrs = schema.xattr_prefix(inode_id)
    # Then quotas': a file's writers' credits, a directory's files at home by no name there.
    return [(first, prefix_end(first), 1), (xattrs, prefix_end(xattrs), XATTR_DELETE_PAGE),
            *quota.removal_scans(inode_id, kind)]


class Namespace:
    """One transaction's view of the namespace, with an inode cache so aliases stay one object."""

    def __init__(self, txn: Transaction, env: OpEnv, ancestry: Ancestry | None = None) -> None:
        self.txn = txn
        self.env = env
        self.ancestry = ancestry
        self._moved_directory = False
        self.caller = env.caller
        self.now = env.now_ns
        self._inodes: dict[int, mpb.Inode | None] = {}
        self._dirty: set[int] = set()
        # Every directory entry this transaction read, wrote or deleted: ``(parent, name) ->
        # (inode id, type)``, None when absent. Meta's path hints learn from it (fs3.meta.hints).
        self.entries_seen: dict[tuple[int, bytes], tuple[int, int] | None] = {}
        # What quotas count of this transaction's changes (fs3.meta.quota): the service settles it
        # before the commit. ``_charged``: each file's charge as last accounted, by inode id.
        self.quota = quota.Ledger()
        self._charged: dict[int, tuple[int, int] | None] = {}
        self._growth_reserved: set[int] = set()

    # -- storage of inodes and entries ---------------------------------------------------------

    async def find_inode(self, inode_id: int) -> mpb.Inode | None:
        if inode_id in self._inodes:
            return self._inodes[inode_id]
        raw = await self.txn.get(schema.inode_key(inode_id))
        inode = None if raw is None else mpb.Inode.FromString(raw)
        self._inodes[inode_id] = inode
        self._charged.setdefault(inode_id, quota.charge_of(inode))
        return inode

    async def inode(self, inode_id: int) -> mpb.Inode:
        found = await self.find_inode(inode_id)
        if found is None:
            raise NotFound(f"inode {inode_id} does not exist")
        return found

    def touch(self, inode: mpb.Inode) -> None:
        """Mark an inode changed; written once when the operation finishes."""
        self._inodes[inode.inode_id] = inode
        self._dirty.add(inode.inode_id)
        self._charged.setdefault(inode.inode_id, None)  # a new inode: it charged nothing before

    def _drop_inode(self, inode_id: int) -> None:
        dropped = self._inodes.get(inode_id)
        if dropped is not None and dropped.type == DIRECTORY:
            self.quota.dropped_directories.add(inode_id)
        self.quota.recharge(self._charged.get(inode_id), None)
        self._charged[inode_id] = None
        self._inodes[inode_id] = None
        self._dirty.discard(inode_id)
        self.txn.delete(schema.inode_key(inode_id))

    def flush(self) -> None:
        for inode_id in sorted(self._dirty):
            inode = self._inodes[inode_id]
            if inode is not None:
                self.txn.put(schema.inode_key(inode_id), inode.SerializeToString())
                self._account(inode)
        self._dirty.clear()

    def recharged(self, inode: mpb.Inode) -> None:
        """Take the file's charge as it is now as already accounted (a home moved without any
        quota's usage changing: see :func:`fs3.meta.quota.rehome_away`)."""
        self._charged[inode.inode_id] = quota.charge_of(inode)

    def _account(self, inode: mpb.Inode) -> None:
        """Record in the quota ledger how the file's charge changed since last accounted. Growth
        a truncate reserved when it was recorded (:meth:`_truncate`) is not charged again."""
        before, after = self._charged.get(inode.inode_id), quota.charge_of(inode)
        if inode.inode_id in self._growth_reserved and before is not None and after is not None \
                and before[0] == after[0] and after[1] > before[1]:
            after = before
            self._charged[inode.inode_id] = quota.charge_of(inode)
        else:
            self._charged[inode.inode_id] = after
        self.quota.recharge(before, after)

    async def entry(self, parent: int, name: bytes) -> mpb.DirEntry | None:
        raw = await self.txn.get(schema.dentry_key(parent, name))
        if raw is None:
            self.entries_seen[(parent, name)] = None
            return None
        entry = mpb.DirEntry.FromString(raw)
        self.entries_seen[(parent, name)] = (entry.inode_id, entry.type)
        return entry

    def put_entry(self, parent: int, name: bytes, inode: mpb.Inode) -> None:
        value = mpb.DirEntry(name=name, inode_id=inode.inode_id, type=inode.type)
        if self.entries_seen.get((parent, name)) is None:  # every caller looked the name up first
            self.quota.entry(parent, 1)
        self.txn.put(schema.dentry_key(parent, name), value.SerializeToString())
        self.entries_seen[(parent, name)] = (inode.inode_id, inode.type)

    def delete_entry(self, parent: int, name: bytes) -> None:
        if self.entries_seen.get((parent, name)) is not None:
            self.quota.entry(parent, -1)
        self.txn.delete(schema.dentry_key(parent, name))
        self.entries_seen[(parent, name)] = None

    def _stamp(self, inode: mpb.Inode, mtime: bool = False) -> None:
        inode.ctime_ns = self.now
        if mtime:
            inode.mtime_ns = self.now
        self.touch(inode)

    # -- path resolution -----------------------------------------------------------------------

    async def _start(self, ref: mpb.PathRef, absolute: bool, first: bytes | None) -> mpb.Inode:
        """The directory a path starts from; ``first`` (its first component) is announced with it."""
        start = schema.ROOT_INODE if absolute or ref.parent == 0 else ref.parent
        if first is not None and first != b"..":
            self.txn.prefetch([schema.dentry_key(start, first)])
        return await self.inode(start)

    async def _walk(self, start: mpb.Inode, parts: list[bytes], follow_last: bool,
                    then: bytes | None = None) -> mpb.Inode:
        """Follow ``parts`` from ``start``. ``then``: the name the caller looks up in the directory
        reached (resolve_parent's last component). Each directory's entry for the next name is
        announced with the directory's inode (``Transaction.prefetch``), so that a networked
        engine fetches both in one round trip: one per level, not two."""
        current = start
        pending = deque(parts)
        followed = 0
        while pending:
            name = pending.popleft()
            if current.type != DIRECTORY:
                raise NotADirectory(f"a path component of inode {current.inode_id} is not a directory")
            if not may(current, self.caller, X_OK):
                raise PermissionDenied(f"no search permission on directory {current.inode_id}")
            if name == b".":
                continue
            if name == b"..":
                current = await self.inode(current.parent or schema.ROOT_INODE)
                continue
            entry = await self.entry(current.inode_id, name)
            if entry is None:
                raise NotFound(f"{name.decode(errors='replace')!r} does not exist")
            if entry.type == DIRECTORY:
                following = pending[0] if pending else then
                if following is not None and following not in (b".", b".."):
                    self.txn.prefetch([schema.dentry_key(entry.inode_id, following)])
            child = await self.inode(entry.inode_id)
            if child.type == SYMLINK and (pending or follow_last):
                followed += 1
                if followed > SYMLINK_FOLLOW_MAX:
                    raise SymlinkLoop("too many levels of symbolic links")
                absolute, target_parts = split_path(child.symlink_target)
                if absolute:
                    current = await self.inode(schema.ROOT_INODE)
                pending.extendleft(reversed(target_parts))
                continue
            current = child
        return current

    async def resolve(self, ref: mpb.PathRef, follow: bool = True) -> mpb.Inode:
        """The inode a reference names (following a final symlink when ``follow``).

        A reference with both an inode id and a path names that inode *as reached through that
        path* (never following a final symlink): a client whose cached answer for the name may be
        stale (a mount's kernel caches names and opens by inode) learns that the name now leads
        elsewhere, or nowhere, from ``NotFound``, within the same transaction as the operation.
        """
        if ref.inode_id:
            if ref.path:
                found = await self.resolve(mpb.PathRef(parent=ref.parent, path=ref.path), follow=False)
                if found.inode_id != ref.inode_id:
                    raise NotFound(f"{bytes(ref.path).decode(errors='replace')!r} no longer names inode "
                                   f"{ref.inode_id}")
                return found
            return await self.inode(ref.inode_id)
        if not ref.path:
            raise NotFound("empty path")
        absolute, parts = split_path(ref.path)
        return await self._walk(await self._start(ref, absolute, parts[0] if parts else None), parts, follow)

    async def resolve_parent(self, ref: mpb.PathRef) -> tuple[mpb.Inode, bytes]:
        """The directory that holds (or would hold) the last component, and that component."""
        if ref.inode_id:
            raise InvalidArgument("this operation needs a parent and a name, not an inode")
        if not ref.path:
            raise NotFound("empty path")
        absolute, parts = split_path(ref.path)
        if not parts:
            raise InvalidArgument("the path names the root or '.'")
        name = parts[-1]
        check_new_name(name)
        parent = await self._walk(await self._start(ref, absolute, parts[0]), parts[:-1], True, then=name)
        if parent.type != DIRECTORY:
            raise NotADirectory(f"inode {parent.inode_id} is not a directory")
        return parent, name

    # -- permission helpers --------------------------------------------------------------------

    def _require(self, inode: mpb.Inode, want: int, what: str) -> None:
        if not may(inode, self.caller, want):
            raise PermissionDenied(f"{what}: permission denied on inode {inode.inode_id}")

    def _require_owner(self, inode: mpb.Inode, what: str) -> None:
        if not self.caller.is_root and self.caller.uid != inode.uid:
            raise NotPermitted(f"{what}: only the owner or root may do this to inode {inode.inode_id}")

    def _check_sticky(self, parent: mpb.Inode, child: mpb.Inode) -> None:
        if parent.mode & S_ISVTX and self.caller.uid not in (0, parent.uid, child.uid):
            raise NotPermitted(f"sticky directory {parent.inode_id}: only the owner may remove or rename")

    def _announce_removal(self, inode: mpb.Inode) -> None:
        """Announce the scans that removing this name of ``inode`` will make (its last name)."""
        if inode.type == DIRECTORY or inode.nlink == 1:
            for start, end, limit in removal_scans(inode.inode_id, inode.type):
                self.txn.prefetch_scan(start, end, limit)
        if inode.type == FILE and inode.parent:
            self.txn.prefetch([schema.truncate_key(inode.inode_id)])  # a growth to refund (quotas)

    async def _has_sessions(self, inode_id: int) -> bool:
        prefix = schema.session_prefix(inode_id)
        return bool(await self.txn.scan(prefix, prefix_end(prefix), limit=1))

    async def _size_gen(self, inode_id: int) -> int:
        """How many truncates the inode has had (see :class:`schema.Session`)."""
        return schema.decode_u64(await self.txn.get(schema.size_gen_key(inode_id)))

    async def _check_no_truncate_pending(self, inode_id: int) -> None:
        if await self.txn.get(schema.truncate_key(inode_id)) is not None:
            raise TruncatePending(inode_id)

    async def _is_empty_dir(self, inode_id: int) -> bool:
        prefix = schema.dentry_prefix(inode_id)
        return not await self.txn.scan(prefix, prefix_end(prefix), limit=1)

    # -- inode creation ------------------------------------------------------------------------

    def _new_inode(self, parent: mpb.Inode, inode_id: int, kind: mpb.InodeType, mode: int) -> mpb.Inode:
        gid = self.caller.gid
        mode &= PERM_MASK
        if parent.mode & S_ISGID:
            gid = parent.gid
            if kind == DIRECTORY:
                mode |= S_ISGID
        if kind != DIRECTORY and mode & S_ISGID and not self.caller.is_root and not self.caller.in_group(gid):
            mode &= ~S_ISGID
        return mpb.Inode(inode_id=inode_id, type=kind, mode=mode, uid=self.caller.uid, gid=gid, nlink=1,
                         atime_ns=self.now, mtime_ns=self.now, ctime_ns=self.now)

    def _assign_layout(self, inode: mpb.Inode, parent: mpb.Inode) -> None:
        dir_layout = parent.layout
        chains = self.env.chain_tables.get(dir_layout.table_id)
        if not chains:
            raise NotFound(f"chain table {dir_layout.table_id} of directory {parent.inode_id} has no chains")
        inode.layout.CopyFrom(file_layout(dir_layout, chains, inode.inode_id, self.env.stripe_default))

    async def _link_new(self, parent: mpb.Inode, name: bytes, inode: mpb.Inode) -> None:
        self._require(parent, W_OK | X_OK, "create")
        self.txn.prefetch([schema.dentry_key(parent.inode_id, name), schema.inode_key(inode.inode_id)])
        if await self.entry(parent.inode_id, name) is not None:
            raise AlreadyExists(f"{name.decode(errors='replace')!r} exists")
        if await self.find_inode(inode.inode_id) is not None:
            raise AlreadyExists(f"inode id {inode.inode_id} already in use")
        self.put_entry(parent.inode_id, name, inode)
        self.touch(inode)
        self._stamp(parent, mtime=True)

    # -- operations ----------------------------------------------------------------------------

    async def ensure_root(self, uid: int, gid: int, mode: int, layout: mpb.Layout) -> mpb.Inode:
        root = await self.find_inode(schema.ROOT_INODE)
        if root is None:
            root = mpb.Inode(inode_id=schema.ROOT_INODE, type=DIRECTORY, mode=mode & PERM_MASK, uid=uid, gid=gid,
                             nlink=2, atime_ns=self.now, mtime_ns=self.now, ctime_ns=self.now,
                             parent=schema.ROOT_INODE, layout=layout)
            self.touch(root)
            self.flush()
        return root

    async def lookup(self, ref: mpb.PathRef, follow: bool) -> mpb.Inode:
        return await self.resolve(ref, follow)

    async def batch_stat(self, inode_ids: list[int]) -> list[mpb.Inode]:
        self.txn.prefetch([schema.inode_key(inode_id) for inode_id in inode_ids])  # one round trip for all
        out = []
        for inode_id in inode_ids:
            found = await self.find_inode(inode_id)
            out.append(found if found is not None else mpb.Inode())
        return out

    async def open(self, ref: mpb.PathRef, flags: int, mode: int, new_inode_id: int,
                   session_id: bytes, client_id: bytes, now_ms: int, truncating: int = 0) -> mpb.OpenRsp:
        """Open (or create) a file, holding a session; ``O_TRUNC`` of an existing file records a
        truncate job for ``truncating`` (see :meth:`_truncate`); the answer shows the new size.

        An inode with an unfinished truncate is not opened (:class:`TruncatePending`): a new
        handle could write where the truncate is still to remove chunks.
        """
        access = flags & O_ACCMODE
        if access == O_ACCMODE:
            raise InvalidArgument("invalid access mode O_WRONLY|O_RDWR")
        writing = access in (O_WRONLY, O_RDWR)
        created = False
        created_in: mpb.Inode | None = None  # the directory a created file was linked into
        if flags & O_CREAT:
            parent, name = await self.resolve_parent(ref)
            # What a create reads next, fetched with the entry (one round trip on a networked engine).
            self.txn.prefetch([schema.dentry_key(parent.inode_id, name), schema.inode_key(new_inode_id),
                               schema.size_gen_key(new_inode_id)])
            entry = await self.entry(parent.inode_id, name)
            followed = 0
            while entry is not None and entry.type == SYMLINK and not flags & (O_NOFOLLOW | O_EXCL):
                # O_CREAT through a symlink creates (or opens) what it points to, dangling or not.
                followed += 1
                if followed > SYMLINK_FOLLOW_MAX:
                    raise SymlinkLoop("too many levels of symbolic links")
                link = await self.inode(entry.inode_id)
                parent, name = await self.resolve_parent(mpb.PathRef(parent=parent.inode_id,
                                                                     path=link.symlink_target))
                entry = await self.entry(parent.inode_id, name)
            if entry is None:
                if not may(parent, self.caller, X_OK):
                    raise PermissionDenied(f"no search permission on directory {parent.inode_id}")
                inode = self._new_inode(parent, new_inode_id, FILE, mode)
                inode.parent = parent.inode_id  # its home, for quotas (fs3.meta.quota)
                self._assign_layout(inode, parent)
                await self._link_new(parent, name, inode)
                created, created_in = True, parent
            else:
                if flags & O_EXCL:
                    raise AlreadyExists(f"{name.decode(errors='replace')!r} exists")
                inode = await self.inode(entry.inode_id)
                if inode.type == SYMLINK:
                    raise SymlinkLoop("O_NOFOLLOW on a symbolic link")
        else:
            inode = await self.resolve(ref, follow=not flags & O_NOFOLLOW)
            if inode.type == SYMLINK:
                raise SymlinkLoop("O_NOFOLLOW on a symbolic link")
        if flags & O_DIRECTORY and inode.type != DIRECTORY:
            raise NotADirectory(f"inode {inode.inode_id} is not a directory")
        if inode.type == DIRECTORY:
            if writing or flags & O_TRUNC:
                raise IsADirectory(f"inode {inode.inode_id} is a directory")
        elif inode.type != FILE:
            raise NotSupported("fifos, sockets and device nodes have no data in fs3")
        truncated = False
        if not created:
            want = (R_OK if access in (O_RDONLY, O_RDWR) else 0) | (W_OK if writing or flags & O_TRUNC else 0)
            self._require(inode, want, "open")
            if inode.type == FILE:
                await self._check_no_truncate_pending(inode.inode_id)
            if flags & O_TRUNC and inode.type == FILE:
                await self._truncate(inode, 0, truncating, always_stamp=True)
                self._drop_privileges(inode)  # the kernel leaves this to an O_TRUNC open (atomic_o_trunc)
                truncated = True
            if access != O_WRONLY and (inode.atime_ns <= inode.mtime_ns or inode.atime_ns <= inode.ctime_ns
                                       or self.now - inode.atime_ns >= _RELATIME_NS):
                inode.atime_ns = self.now
                self.touch(inode)
        if inode.type == FILE:
            session = schema.Session(client_id, writing, now_ms, await self._size_gen(inode.inode_id))
            self.txn.put(schema.session_key(inode.inode_id, session_id), session.encode())
            self.txn.put(schema.client_session_key(client_id, inode.inode_id, session_id), b"")
        else:
            session_id = b""
        self.flush()
        return mpb.OpenRsp(inode=_with_size(inode, 0) if truncated else inode, session_id=session_id,
                           created=created, parent=created_in)

    async def make_node(self, ref: mpb.PathRef, kind: mpb.InodeType, mode: int, rdev: int, symlink_target: bytes,
                        new_inode_id: int) -> mpb.Inode:
        if kind == mpb.INODE_TYPE_UNSPECIFIED or kind not in mpb.InodeType.values():
            raise InvalidArgument(f"unknown inode type {kind}")
        parent, name = await self.resolve_parent(ref)
        if kind in (mpb.CHAR_DEVICE, mpb.BLOCK_DEVICE) and not self.caller.is_root:
            raise NotPermitted("only root may create device nodes")
        if kind == SYMLINK:
            if not symlink_target:
                raise NotFound("empty symlink target")
            if len(symlink_target) > PATH_MAX_BYTES or b"\x00" in symlink_target:
                raise NameTooLong("symlink target too long or contains NUL")
            mode = 0o777
        inode = self._new_inode(parent, new_inode_id, kind, mode)
        if kind == DIRECTORY:
            inode.nlink = 2
            inode.parent = parent.inode_id
            inode.layout.CopyFrom(mpb.Layout(table_id=parent.layout.table_id, chunk_size=parent.layout.chunk_size,
                                             stripe=parent.layout.stripe))
        elif kind == SYMLINK:
            inode.symlink_target = symlink_target
            inode.size = len(symlink_target)
        elif kind == FILE:
            inode.parent = parent.inode_id  # its home, for quotas (fs3.meta.quota)
            self._assign_layout(inode, parent)
        else:
            inode.rdev = rdev
        await self._link_new(parent, name, inode)
        if kind == DIRECTORY:
            if parent.nlink >= LINK_MAX:
                raise TooManyLinks(f"directory {parent.inode_id} has too many subdirectories")
            parent.nlink += 1
        self.flush()
        return inode

    async def readlink(self, ref: mpb.PathRef) -> bytes:
        inode = await self.resolve(ref, follow=False)
        if inode.type != SYMLINK:
            raise InvalidArgument(f"inode {inode.inode_id} is not a symbolic link")
        return bytes(inode.symlink_target)

    async def link(self, source: mpb.PathRef, link: mpb.PathRef) -> mpb.Inode:
        inode = await self.resolve(source, follow=False)
        parent, name = await self.resolve_parent(link)
        if await self.entry(parent.inode_id, name) is not None:
            raise AlreadyExists(f"{name.decode(errors='replace')!r} exists")
        if inode.type == DIRECTORY:
            raise NotPermitted("hard links to directories are not allowed")
        if inode.nlink == 0:
            raise NotFound(f"inode {inode.inode_id} has been removed")
        if inode.nlink >= LINK_MAX:
            raise TooManyLinks(f"inode {inode.inode_id} has {inode.nlink} links")
        self._require(parent, W_OK | X_OK, "link")
        inode.nlink += 1
        self._stamp(inode)
        self.put_entry(parent.inode_id, name, inode)
        self._stamp(parent, mtime=True)
        self.flush()
        return inode

    async def _drop_link(self, parent: mpb.Inode, inode: mpb.Inode, name: bytes, path: bytes = b"") -> bool:
        """One fewer name for ``inode`` (already unlinked from ``parent`` as ``name``, reached by
        ``path`` when the request gave one from the root); True when chunks go to GC. A file's
        last name goes to the trash instead when it is on (:mod:`fs3.meta.trash`)."""
        if inode.type == DIRECTORY:
            parent.nlink -= 1
            # A directory counts "." and its entry in its parent, plus one ".." per subdirectory:
            # losing one it had leaves at least the first two.
            ensure(parent.nlink >= 2, f"directory {parent.inode_id} left with {parent.nlink} links")
            await quota.rehome_away(self, inode.inode_id, parent.inode_id)
            await self._delete_inode(inode)
            return False
        # The caller just removed one of its names, so the inode had that link to lose.
        ensure(inode.nlink > 0, f"inode {inode.inode_id} unlinked with no links left")
        inode.nlink -= 1
        if inode.parent:
            if inode.nlink > 0 and inode.parent == parent.inode_id:
                # Its home lost a name; other names keep it, and it keeps counting at home until
                # the last one goes (fs3.meta.quota): marked, so counts of the home's tree find it.
                self.txn.put(schema.quota_away_key(parent.inode_id, inode.inode_id), b"")
            elif inode.nlink == 0:
                self.txn.delete(schema.quota_away_key(inode.parent, inode.inode_id))
        if quota.charge_of(inode) is None:
            await self._refund_reserved_growth(inode)
            await quota.drop_reservations(self, inode.inode_id)
        self._stamp(inode)
        if inode.nlink == 0 and inode.type == FILE and self.env.trash_keep_ns > 0:
            trash.put(self.txn, trash.entry_for(inode, parent.inode_id, name, path, self.caller.uid,
                                                self.now, self.env.trash_keep_ns))
            return False
        if inode.nlink > 0 or await self._has_sessions(inode.inode_id):
            return False
        return await self._delete_inode(inode)

    async def relink(self, parent: mpb.Inode, name: bytes, inode: mpb.Inode) -> mpb.Inode:
        """Name again a file that has none (one restored from the trash): ``name`` in ``parent``,
        which the caller has checked is free; the caller needs write and search permission there."""
        ensure(inode.nlink == 0 and inode.type == FILE, f"inode {inode.inode_id} relinked with names")
        check_new_name(name)
        self._require(parent, W_OK | X_OK, "restore")
        inode.nlink = 1
        inode.parent = parent.inode_id  # its new home (fs3.meta.quota)
        growth = await self._pending_growth(inode)
        if growth:  # a truncate up recorded before the removal charges again, as when recorded
            self.quota.recharge(None, (parent.inode_id, growth))
        await quota.move_reservations(self, inode.inode_id, parent.inode_id)  # its writers' credits too
        self._stamp(inode)
        self.put_entry(parent.inode_id, name, inode)
        self._stamp(parent, mtime=True)
        self.flush()
        return inode

    async def release_unlinked(self, inode: mpb.Inode) -> bool:
        """Delete an inode that lost its last name (nlink 0) unless a handle still holds it, which
        then deletes it at its last close; True when a GC job is queued for its chunks."""
        ensure(inode.nlink == 0, f"inode {inode.inode_id} released with {inode.nlink} names")
        if await self._has_sessions(inode.inode_id):
            return False
        return await self._delete_inode(inode)

    async def _pending_growth(self, inode: mpb.Inode) -> int:
        """The bytes an unfinished truncate of ``inode`` grows it by (charged to quotas when it was
        recorded, see :meth:`_truncate`); 0 when none is pending or it does not grow the file."""
        return await quota.pending_growth(self.txn, inode)

    async def _refund_reserved_growth(self, inode: mpb.Inode) -> None:
        """The file stops counting in quotas with a truncate up pending: the growth reserved when
        it was recorded goes back too (the job's completion charges nothing to a file without a home)."""
        charged = self._charged.get(inode.inode_id)
        if charged is not None:
            growth = await self._pending_growth(inode)
            if growth:
                self.quota.recharge((charged[0], growth), None)

    async def _move_reserved_growth(self, inode: mpb.Inode) -> None:
        """A file whose home a rename moved takes along the growth a pending truncate reserved."""
        charged, now = self._charged.get(inode.inode_id), quota.charge_of(inode)
        if charged is not None and now is not None and charged[0] != now[0]:
            self.txn.prefetch_scan(*quota.credits_scan(inode.inode_id))  # read with the truncate key
            growth = await self._pending_growth(inode)
            if growth:
                self.quota.recharge((charged[0], growth), (now[0], growth))
            await quota.move_reservations(self, inode.inode_id, now[0])  # and its writers' credits

    async def _delete_inode(self, inode: mpb.Inode) -> bool:
        """Delete the inode; True when a GC job is queued for what this transaction leaves behind.

        Its attributes are deleted here up to :data:`XATTR_DELETE_PAGE` of them: anyone who may
        write a file may set any number, and the transaction must not grow with them. The rest
        go with the GC job (a file always has one, for its chunks; any other inode gets one
        without chains), which deletes them a page per transaction.
        """
        self._drop_inode(inode.inode_id)
        prefix = schema.xattr_prefix(inode.inode_id)
        rows = await self.txn.scan(prefix, prefix_end(prefix), limit=XATTR_DELETE_PAGE)
        for key, _ in rows:
            self.txn.delete(key)
        # An unfinished truncate is dropped: the GC job lists and removes every chunk there is.
        self.txn.delete(schema.truncate_key(inode.inode_id))
        self.txn.delete(schema.size_gen_key(inode.inode_id))
        if inode.type == FILE:
            job = schema.GcJob(inode.layout, 0, inode.size)
        elif len(rows) == XATTR_DELETE_PAGE:
            job = schema.GcJob(mpb.Layout(), 0, 0)  # attributes only
        else:
            return False
        self.txn.put(schema.gc_key(inode.inode_id), job.encode())
        return True

    async def remove(self, ref: mpb.PathRef, directory: bool) -> int:
        return (await self.remove_entry(ref, directory))[0]

    async def remove_entry(self, ref: mpb.PathRef, directory: bool) -> tuple[int, mpb.Inode]:
        """Unlink ``ref``: the removed inode's id and the directory as the removal left it."""
        parent, name = await self.resolve_parent(ref)
        entry = await self.entry(parent.inode_id, name)
        if entry is None:
            raise NotFound(f"{name.decode(errors='replace')!r} does not exist")
        inode = await self.inode(entry.inode_id)
        self._announce_removal(inode)
        if directory:
            if inode.type != DIRECTORY:
                raise NotADirectory(f"{name.decode(errors='replace')!r} is not a directory")
            if not await self._is_empty_dir(inode.inode_id):
                raise DirectoryNotEmpty(f"{name.decode(errors='replace')!r} is not empty")
        elif inode.type == DIRECTORY:
            raise IsADirectory(f"{name.decode(errors='replace')!r} is a directory")
        self._require(parent, W_OK | X_OK, "remove")
        self._check_sticky(parent, inode)
        self.delete_entry(parent.inode_id, name)
        self._stamp(parent, mtime=True)
        await self._drop_link(parent, inode, name, _path_from_root(ref))
        self.flush()
        return inode.inode_id, parent

    async def _is_ancestor(self, ancestor_id: int, directory: mpb.Inode) -> bool:
        """Whether ``ancestor_id`` is ``directory`` or above it (walks parent pointers to the root).

        At most :data:`ANCESTOR_WALK_MAX` links are followed here; above that, the answer must come
        from the service's walk (:class:`Ancestry`), read while no directory moved — this
        transaction reads the directory-move counter, so a move that commits meanwhile conflicts.
        """
        current = directory
        for _ in range(ANCESTOR_WALK_MAX):
            if current.inode_id == ancestor_id:
                return True
            if current.inode_id == schema.ROOT_INODE:
                return False
            current = await self.inode(current.parent)
        if current.inode_id in (ancestor_id, schema.ROOT_INODE):
            return current.inode_id == ancestor_id
        moves = await self.txn.get(schema.directory_moves_key()) or b""
        if self.ancestry is not None and self.ancestry.moves == moves:
            known = self.ancestry.above.get((current.inode_id, ancestor_id))
            if known is not None:
                return known
        raise AncestryUnknown(current.inode_id, ancestor_id)

    async def rename(self, source: mpb.PathRef, destination: mpb.PathRef, flags: int) -> mpb.Inode:
        noreplace = bool(flags & mpb.RENAME_NOREPLACE)
        exchange = bool(flags & mpb.RENAME_EXCHANGE)
        if (noreplace and exchange) or flags & ~(mpb.RENAME_NOREPLACE | mpb.RENAME_EXCHANGE):
            raise InvalidArgument(f"invalid rename flags {flags}")
        src_parent, src_name = await self.resolve_parent(source)
        dst_parent, dst_name = await self.resolve_parent(destination)
        self.txn.prefetch([schema.dentry_key(src_parent.inode_id, src_name),
                           schema.dentry_key(dst_parent.inode_id, dst_name)])
        src_entry = await self.entry(src_parent.inode_id, src_name)
        if src_entry is None:
            raise NotFound(f"{src_name.decode(errors='replace')!r} does not exist")
        inode = await self.inode(src_entry.inode_id)
        dst_entry = await self.entry(dst_parent.inode_id, dst_name)
        self._require(src_parent, W_OK | X_OK, "rename")
        self._require(dst_parent, W_OK | X_OK, "rename")
        if dst_entry is not None and noreplace:
            raise AlreadyExists(f"{dst_name.decode(errors='replace')!r} exists")
        if dst_entry is None and exchange:
            raise NotFound(f"{dst_name.decode(errors='replace')!r} does not exist")
        self._check_sticky(src_parent, inode)
        target = await self.inode(dst_entry.inode_id) if dst_entry is not None else None
        if target is not None:
            self._check_sticky(dst_parent, target)
        if target is not None and target.inode_id == inode.inode_id:
            return inode  # both names are links to the same inode: POSIX says do nothing
        moving_dirs = src_parent.inode_id != dst_parent.inode_id
        if target is not None and target.type == DIRECTORY and moving_dirs \
                and await self._is_ancestor(target.inode_id, src_parent):
            # The target is above the source: Linux refuses before looking at types.
            if exchange:
                raise InvalidArgument("cannot exchange a directory with something inside it")
            raise DirectoryNotEmpty(f"{dst_name.decode(errors='replace')!r} is not empty")
        if inode.type == DIRECTORY and moving_dirs:
            if await self._is_ancestor(inode.inode_id, dst_parent):
                raise InvalidArgument("cannot move a directory into itself")
            self._require(inode, W_OK, "rename directory")
        if exchange and target is not None:
            if target.type == DIRECTORY and moving_dirs:
                if await self._is_ancestor(target.inode_id, src_parent):
                    raise InvalidArgument("cannot move a directory into itself")
                self._require(target, W_OK, "rename directory")
            self.put_entry(src_parent.inode_id, src_name, target)
            self.put_entry(dst_parent.inode_id, dst_name, inode)
            if moving_dirs:
                self._reparent(inode, src_parent, dst_parent)
                self._reparent(target, dst_parent, src_parent)
                await self._move_reserved_growth(inode)
                await self._move_reserved_growth(target)
            self._stamp(target)
        else:
            if target is not None:
                self._announce_removal(target)
                if inode.type == DIRECTORY:
                    if target.type != DIRECTORY:
                        raise NotADirectory(f"{dst_name.decode(errors='replace')!r} is not a directory")
                    if not await self._is_empty_dir(target.inode_id):
                        raise DirectoryNotEmpty(f"{dst_name.decode(errors='replace')!r} is not empty")
                elif target.type == DIRECTORY:
                    raise IsADirectory(f"{dst_name.decode(errors='replace')!r} is a directory")
                await self._drop_link(dst_parent, target, dst_name, _path_from_root(destination))
            self.delete_entry(src_parent.inode_id, src_name)
            self.put_entry(dst_parent.inode_id, dst_name, inode)
            if moving_dirs:
                self._reparent(inode, src_parent, dst_parent)
                await self._move_reserved_growth(inode)
        if self._moved_directory:
            # Parent links changed: walks spread over several transactions (Ancestry) must notice.
            key = schema.directory_moves_key()
            self.txn.put(key, schema.encode_u64(schema.decode_u64(await self.txn.get(key)) + 1))
        self._stamp(inode)
        self._stamp(src_parent, mtime=True)
        self._stamp(dst_parent, mtime=True)
        self.flush()
        return inode

    def _reparent(self, inode: mpb.Inode, old: mpb.Inode, new: mpb.Inode) -> None:
        if inode.type == FILE and inode.parent == old.inode_id:
            inode.parent = new.inode_id  # a name in its home moved: so does the home (fs3.meta.quota)
        if inode.type != DIRECTORY:
            return
        self.quota.moves.append((inode.inode_id, old.inode_id, new.inode_id))
        self._moved_directory = True
        inode.parent = new.inode_id
        old.nlink -= 1
        # The moved directory's ".." was one of the old parent's links beyond its own two.
        ensure(old.nlink >= 2, f"directory {old.inode_id} left with {old.nlink} links")
        new.nlink += 1
        self.touch(old)
        self.touch(new)

    async def readdir(self, ref: mpb.PathRef, start_after: bytes, limit: int, with_attrs: bool) -> mpb.ReadDirRsp:
        directory = await self.resolve(ref, follow=True)
        if directory.type != DIRECTORY:
            raise NotADirectory(f"inode {directory.inode_id} is not a directory")
        self._require(directory, R_OK, "readdir")
        limit = min(limit or 1000, READDIR_LIMIT_MAX)
        prefix = schema.dentry_prefix(directory.inode_id)
        start = schema.dentry_key(directory.inode_id, start_after + b"\x00") if start_after else prefix
        rows = await self.txn.scan(start, prefix_end(prefix), limit=limit + 1)
        # Every engine honours scan limits (a listing in pages must cost O(entries), not O(n²)).
        ensure(len(rows) <= limit + 1, f"a scan limited to {limit + 1} rows returned {len(rows)}")
        rsp = mpb.ReadDirRsp(more=len(rows) > limit)
        for _, raw in rows[:limit]:
            rsp.entries.add().MergeFromString(raw)
        if with_attrs:  # every inode in one round trip on a networked engine, not one each
            self.txn.prefetch([schema.inode_key(entry.inode_id) for entry in rsp.entries])
            for entry in rsp.entries:
                found = await self.find_inode(entry.inode_id)
                if found is not None:
                    entry.attrs.CopyFrom(found)
        return rsp

    async def _truncate(self, inode: mpb.Inode, size: int, truncating: int, always_stamp: bool = False) -> None:
        """Record a size change as a truncate job; the size itself is applied by
        :meth:`complete_truncate` once storage holds nothing past it.

        Applying the size only after the chunk removal is what keeps a truncate from erasing
        data written after it: until the job completes no client sees the new size, no handle
        opens, no length is published and no other size change starts on the inode (each waits
        for the job, :class:`TruncatePending`), so every write that can follow the truncate
        follows the removal too. Writes racing the truncate from handles opened before it are
        concurrent with it, and their lengths are checked against storage.

        What storage must clear: everything from the new size on when the file shrinks or is
        open (an open writer's bytes between the old and the new size may be on storage, not yet
        published, and an extension keeps them); from the old size on when a closed file grows,
        so that the extension reads as zeros whatever a lost writer left past the old end.
        """
        if size > max_file_size(inode.layout):
            raise FileTooLarge(f"size {size} exceeds {max_file_size(inode.layout)} for this file's chunk size")
        if inode.inode_id != truncating:
            raise TruncateUnclaimed(inode.inode_id)
        await self._check_no_truncate_pending(inode.inode_id)
        old = inode.size
        charge = quota.charge_of(inode)
        if size > old and charge is not None:
            # Growth is charged now, when it can still be refused; complete_truncate applies it.
            self.quota.recharge(charge, (charge[0], charge[1] + size - old))
        clear_from = size if size < old or await self._has_sessions(inode.inode_id) else old
        size_gen = await self._size_gen(inode.inode_id) + 1
        self.txn.put(schema.size_gen_key(inode.inode_id), schema.encode_u64(size_gen))
        job = schema.TruncateJob(inode.layout, size, clear_from, size_gen)
        self.txn.put(schema.truncate_key(inode.inode_id), job.encode())
        if size != old or always_stamp:
            self._stamp(inode, mtime=True)

    def _drop_privileges(self, inode: mpb.Inode) -> None:
        """What writing or truncating a regular file does to its mode when the caller is not root
        (Linux: without CAP_FSETID): setuid goes, and setgid when the group may execute (without
        group execute, setgid marks mandatory locking, not privilege)."""
        if inode.type != FILE or self.caller.is_root:
            return
        mode = inode.mode & ~S_ISUID
        if mode & S_IXGRP:
            mode &= ~S_ISGID
        if mode != inode.mode:
            inode.mode = mode
            self._stamp(inode)

    async def complete_truncate(self, inode_id: int, size_gen: int) -> bool:
        """The truncate job of generation ``size_gen`` has cleared storage: apply its size and drop
        it. False when the job is gone (done already, or the inode was deleted)."""
        raw = await self.txn.get(schema.truncate_key(inode_id))
        if raw is None:
            return False
        job = schema.TruncateJob.decode(raw)
        if job.size_gen != size_gen:
            return False
        self.txn.delete(schema.truncate_key(inode_id))
        inode = await self.find_inode(inode_id)
        if inode is not None and job.size is not None:
            # The job's size was checked against the file's layout when the truncate was recorded
            # (the layout of a file never changes): a stored size past it is a corrupt job.
            ensure(0 <= job.size <= max_file_size(inode.layout),
                   f"truncate job of inode {inode_id} has size {job.size} outside its layout")
            self._growth_reserved.add(inode_id)  # charged when the truncate was recorded
            if job.size < inode.size:  # open writers' credits now start lower (fs3.meta.quota)
                await quota.widen_reservations(self, inode_id, inode.size - job.size, job.size_gen)
            inode.size = job.size
            self.touch(inode)
        self.flush()
        return True

    async def setattr(self, req: mpb.SetAttrReq, truncating: int = 0) -> mpb.Inode:
        """chmod, chown, utimes and truncate; a size change is a truncate job for ``truncating``
        (see :meth:`_truncate`), and the answer shows the new size."""
        mask = req.mask
        known = (mpb.SET_MODE | mpb.SET_UID | mpb.SET_GID | mpb.SET_SIZE | mpb.SET_ATIME | mpb.SET_MTIME
                 | mpb.SET_ATIME_NOW | mpb.SET_MTIME_NOW | mpb.SET_DROP_PRIVILEGES)
        if mask & ~known:
            raise InvalidArgument(f"unknown setattr bits {mask & ~known:#x}")
        inode = await self.resolve(req.target, follow=req.follow)
        caller = self.caller
        writable_session = False
        if req.session_id and mask & (mpb.SET_SIZE | mpb.SET_DROP_PRIVILEGES):
            raw = await self.txn.get(schema.session_key(inode.inode_id, req.session_id))
            if raw is None:
                raise BadHandle("unknown or closed file session")
            writable_session = schema.Session.decode(raw).write
            if not writable_session:
                raise BadHandle("the file was not opened for writing")
        if mask & mpb.SET_SIZE:
            if inode.type == DIRECTORY:
                raise IsADirectory(f"inode {inode.inode_id} is a directory")
            if inode.type != FILE:
                raise InvalidArgument(f"inode {inode.inode_id} is not a regular file")
            if not writable_session:
                self._require(inode, W_OK, "truncate")
            await self._truncate(inode, req.size, truncating)
            self._drop_privileges(inode)
        if mask & mpb.SET_DROP_PRIVILEGES:
            if not writable_session:
                self._require(inode, W_OK, "write")
            self._drop_privileges(inode)
        if mask & (mpb.SET_UID | mpb.SET_GID):
            new_uid = req.uid if mask & mpb.SET_UID else inode.uid
            new_gid = req.gid if mask & mpb.SET_GID else inode.gid
            if not caller.is_root:
                if new_uid != inode.uid:
                    raise NotPermitted("only root may change a file's owner")
                if caller.uid != inode.uid or (new_gid != inode.gid and not caller.in_group(new_gid)):
                    raise NotPermitted("only the owner may change the group, to one of its groups")
            inode.uid, inode.gid = new_uid, new_gid
            if inode.type != DIRECTORY:
                inode.mode &= ~S_ISUID
                if inode.mode & S_IXGRP:
                    inode.mode &= ~S_ISGID
            self._stamp(inode)
        if mask & mpb.SET_MODE:
            mode = req.mode & PERM_MASK
            cleared = inode.mode & ~mode
            if inode.type == FILE and cleared and not cleared & ~(S_ISUID | S_ISGID) and not mode & ~inode.mode \
                    and (writable_session or may(inode, caller, W_OK)):
                # Only setuid/setgid cleared, by someone who may write the file: what the kernel
                # sends ahead of a write (FUSE without handle_killpriv), as the write itself does.
                inode.mode = mode
            else:
                self._require_owner(inode, "chmod")
                if not caller.is_root and not caller.in_group(inode.gid):
                    mode &= ~S_ISGID
                inode.mode = mode
            self._stamp(inode)
        if mask & (mpb.SET_ATIME | mpb.SET_MTIME | mpb.SET_ATIME_NOW | mpb.SET_MTIME_NOW):
            explicit = mask & (mpb.SET_ATIME | mpb.SET_MTIME)
            if explicit:
                self._require_owner(inode, "utime")
            elif not caller.is_root and caller.uid != inode.uid and not may(inode, caller, W_OK):
                raise PermissionDenied(f"utime: permission denied on inode {inode.inode_id}")
            if mask & mpb.SET_ATIME_NOW:
                inode.atime_ns = self.now
            elif mask & mpb.SET_ATIME:
                inode.atime_ns = req.atime_ns
            if mask & mpb.SET_MTIME_NOW:
                inode.mtime_ns = self.now
            elif mask & mpb.SET_MTIME:
                inode.mtime_ns = req.mtime_ns
            self._stamp(inode)
        self.flush()
        return _with_size(inode, req.size) if mask & mpb.SET_SIZE else inode

    # -- xattrs --------------------------------------------------------------------------------

    def _check_xattr(self, inode: mpb.Inode, name: bytes, writing: bool) -> None:
        if not name:
            raise InvalidArgument("empty xattr name")
        if len(name) > XATTR_NAME_MAX_BYTES:
            raise NameTooLong(f"xattr name of {len(name)} bytes exceeds {XATTR_NAME_MAX_BYTES}")
        if b"\x00" in name:
            raise InvalidArgument("xattr name contains NUL")
        if name.startswith(b"user."):
            if inode.type not in (FILE, DIRECTORY):
                raise NotPermitted("user xattrs exist only on regular files and directories")
            if writing and inode.type == DIRECTORY and inode.mode & S_ISVTX \
                    and self.caller.uid not in (0, inode.uid):
                raise NotPermitted("user xattrs of a sticky directory belong to its owner")
            self._require(inode, W_OK if writing else R_OK, "xattr")
        elif name.startswith((b"trusted.", b"security.")):
            if writing and not self.caller.is_root and name.startswith(b"trusted."):
                raise NotPermitted("trusted xattrs need root")
            if writing and not self.caller.is_root and self.caller.uid != inode.uid:
                raise NotPermitted("security xattrs belong to the owner")
        else:
            raise NotSupported(f"xattr namespace of {name.decode(errors='replace')!r} is not supported")

    async def get_xattr(self, ref: mpb.PathRef, follow: bool, name: bytes) -> bytes:
        inode = await self.resolve(ref, follow)
        self._check_xattr(inode, name, writing=False)
        if name.startswith(b"trusted.") and not self.caller.is_root:
            raise NoXattr("no such attribute")
        value = await self.txn.get(schema.xattr_key(inode.inode_id, name))
        if value is None:
            raise NoXattr(f"no attribute {name.decode(errors='replace')!r}")
        return value

    async def set_xattr(self, ref: mpb.PathRef, follow: bool, name: bytes, value: bytes, flags: int) -> mpb.Inode:
        if flags & ~(mpb.XATTR_CREATE | mpb.XATTR_REPLACE) or flags == mpb.XATTR_CREATE | mpb.XATTR_REPLACE:
            raise InvalidArgument(f"invalid xattr flags {flags}")
        inode = await self.resolve(ref, follow)
        self._check_xattr(inode, name, writing=True)
        if len(value) > XATTR_VALUE_MAX_BYTES:
            raise XattrTooLarge(f"xattr value of {len(value)} bytes exceeds {XATTR_VALUE_MAX_BYTES}")
        key = schema.xattr_key(inode.inode_id, name)
        exists = await self.txn.get(key) is not None
        if flags & mpb.XATTR_CREATE and exists:
            raise AlreadyExists(f"attribute {name.decode(errors='replace')!r} exists")
        if flags & mpb.XATTR_REPLACE and not exists:
            raise NoXattr(f"no attribute {name.decode(errors='replace')!r}")
        self.txn.put(key, value)
        self._stamp(inode)
        self.flush()
        return inode

    async def list_xattr(self, ref: mpb.PathRef, follow: bool) -> list[bytes]:
        """The attribute names the caller may see; ``E2BIG`` past :data:`XATTR_LIST_MAX_BYTES`.

        Read page by page, so neither memory nor the answer grows with how many attributes
        someone set (Linux answers E2BIG the same way when a file system holds more names than
        one list can carry).
        """
        inode = await self.resolve(ref, follow)
        prefix = schema.xattr_prefix(inode.inode_id)
        end = prefix_end(prefix)
        names: list[bytes] = []
        listed_bytes = 0
        start = prefix
        while True:
            rows = await self.txn.scan(start, end, limit=XATTR_LIST_PAGE)
            for key, _ in rows:
                name = key[len(prefix):]
                if name.startswith(b"trusted.") and not self.caller.is_root:
                    continue
                listed_bytes += len(name) + 1
                if listed_bytes > XATTR_LIST_MAX_BYTES:
                    raise XattrTooLarge(f"the attribute names of inode {inode.inode_id} exceed "
                                        f"{XATTR_LIST_MAX_BYTES} bytes")
                names.append(name)
            if len(rows) < XATTR_LIST_PAGE:
                return names
            start = rows[-1][0] + b"\x00"

    async def remove_xattr(self, ref: mpb.PathRef, follow: bool, name: bytes) -> mpb.Inode:
        inode = await self.resolve(ref, follow)
        self._check_xattr(inode, name, writing=True)
        key = schema.xattr_key(inode.inode_id, name)
        if await self.txn.get(key) is None:
            raise NoXattr(f"no attribute {name.decode(errors='replace')!r}")
        self.txn.delete(key)
        self._stamp(inode)
        self.flush()
        return inode

    # -- sessions, length and layout -----------------------------------------------------------

    async def _session(self, inode_id: int, session_id: bytes) -> schema.Session:
        raw = await self.txn.get(schema.session_key(inode_id, session_id))
        if raw is None:
            raise BadHandle(f"no open session {session_id.hex()} on inode {inode_id}")
        return schema.Session.decode(raw)

    async def capability_file(self, inode_id: int, session_id: bytes, want: int, renewing: bool) -> mpb.Inode:
        """The file a data-path capability granting ``want`` (``R_OK``/``W_OK`` bits) is renewed for.

        A capability is only ever granted to an open session (one that keeps the file's chunks
        from being collected and whose writes meta accounts for), and writing only to a session
        opened for writing. ``renewing``: the caller showed the capability this session's open
        returned, granting at least ``want``; the session keeps the rights it was opened with, as
        a descriptor does. Otherwise the caller's permissions are checked now, as an open would.
        """
        inode = await self.inode(inode_id)
        if inode.type != FILE:
            raise InvalidArgument(f"inode {inode_id} is not a regular file: it has no chunks")
        session = await self._session(inode_id, session_id)
        if want & W_OK and not session.write:
            raise BadHandle(f"session {session_id.hex()} on inode {inode_id} is not open for writing")
        if not renewing:
            self._require(inode, want, "capability")
        return inode

    async def _apply_length(self, inode: mpb.Inode, session: schema.Session, length: LengthReport) -> None:
        """A writer's length (``length``): exact when storage was asked, else its hint.

        ``exact`` is the file's end on storage, probed under size generation ``probed_gen``; it
        counts only if no truncate came since (same generation, no truncate unfinished) — one
        that did may have removed what the probe saw, even one to the same size. The hint is
        taken as is when the writer says every write below it is acknowledged and the file was
        not truncated since the handle opened (nothing it wrote can be gone). Otherwise the
        caller must probe storage again (:class:`LengthProbeStale`), unless ``final`` says no
        better answer is coming: then an unacknowledged hint of an untruncated handle is taken,
        and a truncated handle's length is left out — its hint may cover what a truncate removed,
        so applying it could undo the truncate.
        """
        size_gen = await self._size_gen(inode.inode_id)
        pending = await self.txn.get(schema.truncate_key(inode.inode_id)) is not None
        untruncated = session.size_gen == size_gen and not pending
        if length.exact is not None and length.probed_gen == size_gen and not pending:
            new_size = max(inode.size, length.exact)
        elif length.acked and untruncated:
            new_size = max(inode.size, length.hint)
        elif not length.final:
            raise LengthProbeStale(f"inode {inode.inode_id}: truncated since the probe or since this handle opened")
        elif untruncated:
            new_size = max(inode.size, length.hint)
        else:
            new_size = inode.size
        # A writer's length only ever grows a file: shrinking is a truncate's job, and a length that
        # took bytes away could undo a write another handle already published.
        ensure(new_size >= inode.size, f"inode {inode.inode_id}: a writer's length {new_size} below {inode.size}")
        if new_size > max_file_size(inode.layout):
            raise FileTooLarge(f"size {new_size} exceeds {max_file_size(inode.layout)}")
        inode.size = new_size
        self._stamp(inode, mtime=True)

    async def publish_storage_end(self, inode_id: int, exact: int, probed_gen: int) -> mpb.Inode:
        """Grow the file to ``exact``, its end on storage probed under size generation
        ``probed_gen``, for an append to land past what open writers left there unpublished (see
        :meth:`FileLengths._end_for_append <fs3.meta.lengths.FileLengths._end_for_append>`). A
        truncate since the probe may have removed what it saw: :class:`LengthProbeStale`."""
        inode = await self.inode(inode_id)
        if await self._size_gen(inode_id) != probed_gen or await self.txn.get(schema.truncate_key(inode_id)):
            raise LengthProbeStale(f"inode {inode_id}: truncated since the probe")
        if exact > inode.size:
            if exact > max_file_size(inode.layout):
                raise FileTooLarge(f"size {exact} exceeds {max_file_size(inode.layout)}")
            inode.size = exact
            self._stamp(inode, mtime=True)
            self.flush()
        return inode

    async def close(self, inode_id: int, session_id: bytes, length: LengthReport = LengthReport()) -> CloseResult:
        """End a handle, applying its length (see :meth:`_apply_length`)."""
        session = await self._session(inode_id, session_id)
        inode = await self.inode(inode_id)
        # A close's bytes are on storage and its session must end: charged, never refused.
        self.quota.refuse = False
        self.txn.delete(schema.session_key(inode_id, session_id))
        self.txn.delete(schema.client_session_key(session.client_id, inode_id, session_id))
        size_before = inode.size
        if length.wrote and session.write:
            await self._apply_length(inode, session, length)
        if session.write:  # its byte credit goes back: its bytes are charged as the length (fs3.meta.quota)
            await quota.settle_reservation(self, inode_id, session_id, inode.size - size_before, closing=True)
        gc = False
        if inode.nlink == 0 and not await self._has_sessions(inode_id) \
                and await self.txn.get(schema.trash_key(inode_id)) is None:  # a trashed file stays
            gc = await self._delete_inode(inode)
        self.flush()
        return CloseResult(inode, gc)

    async def close_if_open(self, inode_id: int, session_id: bytes) -> bool:
        """End a handle with no length to publish; False when its session is gone already (its
        client's lease lapsed, or an earlier attempt of the same batch ended it)."""
        if await self.txn.get(schema.session_key(inode_id, session_id)) is None:
            return False
        await self.close(inode_id, session_id)
        return True

    async def sync(self, inode_id: int, session_id: bytes, length: LengthReport) -> mpb.Inode:
        """Publish a handle's length (fsync, flush, periodic hints) without closing it."""
        session = await self._session(inode_id, session_id)
        inode = await self.inode(inode_id)
        if length.wrote and session.write:
            size_before = inode.size
            await self._apply_length(inode, session, length)
            # The growth is charged as the length; as much of the session's credit goes back.
            await quota.settle_reservation(self, inode_id, session_id, inode.size - size_before, closing=False)
        self.flush()
        return inode

    async def set_layout(self, ref: mpb.PathRef, layout: mpb.Layout) -> mpb.Inode:
        inode = await self.resolve(ref, follow=True)
        if inode.type != DIRECTORY:
            raise NotADirectory("a default layout belongs to a directory")
        self._require_owner(inode, "set layout")
        validate_dir_layout(layout, self.env.chain_tables)
        inode.layout.CopyFrom(mpb.Layout(table_id=layout.table_id, chunk_size=layout.chunk_size,
                                         stripe=layout.stripe))
        self._stamp(inode)
        self.flush()
        return inode


def _path_from_root(ref: mpb.PathRef) -> bytes:
    """The path a reference gives from the root, normalised; empty when it is relative to an
    inode (a mount names a file by its directory's inode and its name)."""
    if ref.inode_id or (ref.parent not in (0, schema.ROOT_INODE) and not ref.path.startswith(b"/")):
        return b""
    parts = [p for p in bytes(ref.path).split(b"/") if p and p != b"."]
    if b".." in parts:
        return b""
    return b"/" + b"/".join(parts)


def _with_size(inode: mpb.Inode, size: int) -> mpb.Inode:
    """A copy of ``inode`` showing ``size``: the answer to a truncate whose size is applied later."""
    out = mpb.Inode()
    out.CopyFrom(inode)
    out.size = size
    return out

"""Namespace checks: what ``fs3 admin fsck`` reports.

Reads the whole namespace through one transaction and checks the invariants every operation
keeps: each entry's parent is a directory and its inode exists with the entry's type; a file's
``nlink`` equals the entries naming it (0 only while sessions keep it open); a directory is
named exactly once, knows its parent, and has ``nlink`` = 2 + its subdirectories; every inode
but the root is reachable from the root (following entries: directories whose names form a
detached cycle are not); sessions, xattrs, jobs and size generations belong to live inodes; a file in the trash
(:mod:`fs3.meta.trash`) has no name, no GC job and an inode, and its two keys agree; every
quota's usage equals a recount of its tree (:mod:`fs3.meta.quota`); and, when asked, no
chunk on storage belongs to an inode that is neither live nor queued for GC.

The namespace is read before storage is listed, and the cluster keeps running: a file created
in between has chunks but no inode in what was read. So a chunk is called an orphan only if,
after the listing, a fresh read still finds neither its inode nor a GC job for it *and* the
chunk is still on storage (GC removes chunks before it drops the job).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

from fs3 import meta_pb2 as mpb
from fs3.common.errors import InvalidArgument
from fs3.common.ids import parse_chunk_id
from fs3.kv.api import Transaction, prefix_end
from fs3.meta import quota, schema

__all__ = ["run_fsck"]

_PROBLEMS_MAX = 1000
# Chunks that look orphaned and are checked again (a fresh read, then storage); past this many
# the rest are counted, not named (the report names at most _PROBLEMS_MAX problems anyway).
_SUSPECTS_MAX = _PROBLEMS_MAX

ChunkLister = Callable[[], Awaitable[list[tuple[int, bytes]]]]
ChunkExists = Callable[[int, bytes], Awaitable[bool]]


async def _scan_all(txn: Transaction, prefix: bytes) -> list[tuple[bytes, bytes]]:
    return await txn.scan(prefix, prefix_end(prefix))


def _unreachable_directories(directories: Iterable[int], dir_parent: dict[int, int]) -> set[int]:
    """Directories no chain of entries leads to from the root (named in a detached cycle, or
    under one, or not named at all). Each directory is visited once: linear time and memory."""
    reachable: dict[int, bool] = {schema.ROOT_INODE: True}
    for start in directories:
        path: list[int] = []
        on_path: set[int] = set()
        current: int | None = start
        while current is not None and current not in reachable and current not in on_path:
            path.append(current)
            on_path.add(current)
            current = dir_parent.get(current)
        answer = current is not None and reachable.get(current, False)  # on_path: a cycle
        for directory in path:
            reachable[directory] = answer
    return {d for d, ok in reachable.items() if not ok}


async def _check_trash(txn: Transaction, inodes: dict[int, mpb.Inode], names: Counter[int],
                       problem: Callable[[str], None]) -> set[int]:
    """Check the trash's entries against the inodes; returns the ids of the files in it."""
    trashed: dict[int, mpb.TrashEntry] = {}
    prefix = schema.trash_prefix()
    for key, raw in await _scan_all(txn, prefix):
        entry = mpb.TrashEntry.FromString(raw)
        entry_id = int.from_bytes(key[len(prefix):], "big")
        trashed[entry_id] = entry
        inode = inodes.get(entry_id)
        if entry.id != entry_id:
            problem(f"trash key {entry_id} holds entry {entry.id}")
        if inode is None:
            problem(f"trash entry {entry_id}: its inode does not exist (dangling)")
        elif inode.type != mpb.FILE or inode.nlink != 0 or names[entry_id]:
            problem(f"trash entry {entry_id}: inode has type {inode.type}, nlink {inode.nlink}, "
                    f"{names[entry_id]} names (a trashed file has none)")
    expiry = schema.trash_expiry_prefix()
    indexed: set[int] = set()
    for key, _ in await _scan_all(txn, expiry):
        expires_at_ns = int.from_bytes(key[len(expiry):len(expiry) + 8], "big")
        entry_id = int.from_bytes(key[len(expiry) + 8:], "big")
        indexed.add(entry_id)
        found = trashed.get(entry_id)
        if found is None or found.expires_at_ns != expires_at_ns:
            problem(f"trash expiry key of entry {entry_id} matches no entry")
    for entry_id in sorted(set(trashed) - indexed):
        problem(f"trash entry {entry_id} has no expiry key: it would never expire")
    return set(trashed)


async def _check_away(txn: Transaction, inodes: dict[int, mpb.Inode], entries: list[tuple[int, int]],
                      problem: Callable[[str], None]) -> None:
    """A file at home in a directory that holds none of its names must be marked there (fs3.meta.quota):
    a count of the home's tree finds it only so."""
    named = set(entries)
    prefix = schema.quota_away_prefix()
    marked = {(schema.decode_u64(key[len(prefix):len(prefix) + 8]), schema.decode_u64(key[len(prefix) + 8:]))
              for key, _ in await _scan_all(txn, prefix)}
    for inode in inodes.values():
        if quota.charge_of(inode) is not None and (inode.parent, inode.inode_id) not in named \
                and (inode.parent, inode.inode_id) not in marked:
            problem(f"file {inode.inode_id} is at home in directory {inode.parent}, which neither names it nor "
                    f"marks it: quota counts of that tree miss it")


async def _check_reservations(txn: Transaction, problem: Callable[[str], None]) -> list[tuple[int, int]]:
    """Check writers' byte credits (fs3.meta.quota): each belongs to an open session and is
    indexed by its home; returns the live ones as ``(home, bytes)``. A credit whose session is
    gone leaked (``fs3 quota check --repair`` gives it back)."""
    live: list[tuple[int, int]] = []
    indexed = {key for key, _ in await _scan_all(txn, schema.quota_reservation_home_prefix())}
    for key, raw in await _scan_all(txn, schema.quota_reservation_prefix()):
        inode_id, session_id = schema.parse_quota_reservation_key(key)
        held = quota.Reservation.decode(raw)
        home_key = schema.quota_reservation_home_key(held.home, inode_id, session_id)
        indexed.discard(home_key)
        if await txn.get(schema.session_key(inode_id, session_id)) is None:
            problem(f"byte credit of {held.size_bytes} bytes on inode {inode_id} outlived its session "
                    f"{session_id.hex()} (fs3 quota check --repair)")
            continue
        if await txn.get(home_key) is None:
            problem(f"byte credit on inode {inode_id} is missing from its home {held.home}'s index")
        live.append((held.home, held.size_bytes))
    for key in sorted(indexed):
        problem(f"byte credit index key {key.hex()} has no credit")
    return live


async def _check_quotas(txn: Transaction, inodes: dict[int, mpb.Inode], entries: list[tuple[int, int]],
                        problem: Callable[[str], None]) -> None:
    """Recount every quota's usage from the tree read (fs3.meta.quota) and compare it with the
    usage meta keeps; ``fs3 quota check --repair`` writes the recount."""
    await _check_away(txn, inodes, entries, problem)
    quotas = await quota.read_quotas(txn)
    growth: dict[int, int] = {}
    for key, raw in await _scan_all(txn, schema.truncate_prefix()):
        inode = inodes.get(schema.parse_inode_key(schema.inode_prefix() + key[len(schema.truncate_prefix()):]))
        job = schema.TruncateJob.decode(raw)
        if inode is not None and job.size is not None and job.size > inode.size:
            growth[inode.inode_id] = job.size - inode.size  # charged when recorded (fs3.meta.quota)
    counted = quota.tree_usage(inodes, entries, set(quotas), await _check_reservations(txn, problem), growth)
    for directory in sorted(quotas):
        inode = inodes.get(directory)
        if inode is None or inode.type != mpb.DIRECTORY:
            problem(f"quota of directory {directory}: no such directory")
            continue
        recorded = await quota.read_usage(txn, directory)
        if recorded != counted[directory]:
            problem(f"quota of directory {directory}: records {recorded.bytes} bytes, {recorded.inodes} inodes; "
                    f"its tree holds {counted[directory].bytes} bytes, {counted[directory].inodes} inodes "
                    f"(fs3 quota check --repair)")
    usage = schema.QUOTA_USAGE
    for key, _ in await _scan_all(txn, usage):
        directory = int.from_bytes(key[len(usage):], "big")
        if directory not in quotas:
            problem(f"quota usage of directory {directory} without its quota")


async def run_fsck(txn: Transaction, list_chunks: ChunkLister | None = None,
                   begin: Callable[[], Transaction] | None = None,
                   chunk_exists: ChunkExists | None = None) -> mpb.FsckRsp:
    """Check the namespace read through ``txn``; with ``list_chunks`` ((chain, chunk id) pairs),
    also look for orphaned chunks, confirmed through ``begin`` (a fresh transaction) and
    ``chunk_exists`` (storage) so that a namespace changing meanwhile reports nothing false."""
    if list_chunks is not None and (begin is None or chunk_exists is None):
        raise InvalidArgument("checking chunks needs a fresh transaction and storage to confirm orphans")
    problems: list[str] = []

    def problem(text: str) -> None:
        if len(problems) < _PROBLEMS_MAX:
            problems.append(text)

    inodes: dict[int, mpb.Inode] = {}
    for key, raw in await _scan_all(txn, schema.inode_prefix()):
        inode = mpb.Inode.FromString(raw)
        inode_id = schema.parse_inode_key(key)
        if inode.inode_id != inode_id:
            problem(f"inode key {inode_id} holds inode {inode.inode_id}")
        inodes[inode_id] = inode
    if schema.ROOT_INODE not in inodes:
        problem("the root directory is missing")

    names: Counter[int] = Counter()
    subdirs: Counter[int] = Counter()
    dir_parent: dict[int, int] = {}
    file_parents: dict[int, list[int]] = {}
    dentries = 0
    entry_pairs: list[tuple[int, int]] = []
    for key, raw in await _scan_all(txn, schema.dentry_prefix()):
        dentries += 1
        parent_id, name = schema.parse_dentry_key(key)
        entry = mpb.DirEntry.FromString(raw)
        entry_pairs.append((parent_id, entry.inode_id))
        shown = f"{parent_id}/{name.decode(errors='replace')}"
        parent = inodes.get(parent_id)
        if parent is None:
            problem(f"entry {shown}: parent directory {parent_id} does not exist")
        elif parent.type != mpb.DIRECTORY:
            problem(f"entry {shown}: parent {parent_id} is not a directory")
        target = inodes.get(entry.inode_id)
        if target is None:
            problem(f"entry {shown}: points to missing inode {entry.inode_id}")
            continue
        if target.type != entry.type:
            problem(f"entry {shown}: type {entry.type} but inode {entry.inode_id} has type {target.type}")
        names[entry.inode_id] += 1
        if target.type == mpb.DIRECTORY:
            subdirs[parent_id] += 1
            dir_parent[entry.inode_id] = parent_id
        else:
            file_parents.setdefault(entry.inode_id, []).append(parent_id)

    sessions: Counter[int] = Counter()
    session_count = 0
    for key, _ in await _scan_all(txn, schema.sessions_prefix()):
        session_count += 1
        inode_id = schema.parse_inode_key(schema.inode_prefix() + key[len(schema.sessions_prefix()):][:8])
        sessions[inode_id] += 1
        if inode_id not in inodes:
            problem(f"session on missing inode {inode_id}")

    trashed = await _check_trash(txn, inodes, names, problem)
    for inode_id, inode in inodes.items():
        if inode.type == mpb.DIRECTORY:
            if inode_id == schema.ROOT_INODE:
                if names[inode_id]:
                    problem("the root directory has a name")
            else:
                if names[inode_id] != 1:
                    problem(f"directory {inode_id} has {names[inode_id]} names")
                if dir_parent.get(inode_id) not in (None, inode.parent):
                    problem(f"directory {inode_id} records parent {inode.parent}, is in {dir_parent[inode_id]}")
            if inode.nlink != 2 + subdirs[inode_id]:
                problem(f"directory {inode_id} has nlink {inode.nlink}, expected {2 + subdirs[inode_id]}")
        else:
            if inode.nlink != names[inode_id]:
                problem(f"inode {inode_id} has nlink {inode.nlink} but {names[inode_id]} names")
            if names[inode_id] == 0 and not sessions[inode_id] and inode_id not in trashed:
                problem(f"inode {inode_id} is unreachable and not open")

    detached = _unreachable_directories((i for i, n in inodes.items() if n.type == mpb.DIRECTORY), dir_parent)
    for inode_id in sorted(detached):
        if names[inode_id]:  # a directory without a name is reported above
            problem(f"directory {inode_id} is not reachable from the root (its names form a detached cycle)")
    for inode_id, parents in sorted(file_parents.items()):
        if all(p in detached for p in parents):
            problem(f"inode {inode_id} is not reachable from the root: every directory naming it is detached")

    for prefix, what in ((schema.gc_prefix(), "gc"), (schema.truncate_prefix(), "truncate"),
                         (schema.size_gen_prefix(), "size generation")):
        for key, _ in await _scan_all(txn, prefix):
            inode_id = schema.parse_inode_key(schema.inode_prefix() + key[len(prefix):])
            if what == "gc" and inode_id in inodes:
                problem(f"inode {inode_id} is both live and queued for GC")
            if what == "gc" and inode_id in trashed:
                problem(f"inode {inode_id} is both in the trash and queued for GC")
            if what != "gc" and inode_id not in inodes:
                problem(f"{what} of missing inode {inode_id}")
    gc_pending = {schema.parse_inode_key(schema.inode_prefix() + k[len(schema.gc_prefix()):])
                  for k, _ in await _scan_all(txn, schema.gc_prefix())}

    for key, _ in await _scan_all(txn, b"XATR"):
        inode_id = schema.parse_inode_key(schema.inode_prefix() + key[4:12])
        if inode_id not in inodes and inode_id not in gc_pending:  # GC deletes what a removal left
            problem(f"xattr of missing inode {inode_id}")

    await _check_quotas(txn, inodes, entry_pairs, problem)

    chunk_count = 0
    if list_chunks is not None:
        assert begin is not None and chunk_exists is not None
        suspects: list[tuple[int, bytes, int, int]] = []
        unconfirmed = 0
        for chain_id, cid in await list_chunks():
            chunk_count += 1
            try:
                inode_id, index = parse_chunk_id(cid)
            except InvalidArgument:
                problem(f"chunk {cid.hex()} is not a file chunk id")
                continue
            if inode_id not in inodes and inode_id not in gc_pending:
                if len(suspects) < _SUSPECTS_MAX:
                    suspects.append((chain_id, cid, inode_id, index))
                else:
                    unconfirmed += 1
            elif inode_id in inodes and inodes[inode_id].type != mpb.FILE:
                problem(f"chunk {index} belongs to inode {inode_id}, which is not a file")
        fresh = begin()
        accounted: dict[int, bool] = {}
        for chain_id, cid, inode_id, index in suspects:
            if inode_id not in accounted:  # created, or deleted and queued, after the first read
                accounted[inode_id] = (await fresh.get(schema.inode_key(inode_id)) is not None
                                       or await fresh.get(schema.gc_key(inode_id)) is not None)
            if not accounted[inode_id] and await chunk_exists(chain_id, cid):
                problem(f"chunk {index} of inode {inode_id} has no live inode (orphan)")
        if unconfirmed:
            problem(f"{unconfirmed} more chunks without a live inode were not checked again")

    return mpb.FsckRsp(problems=problems, inodes=len(inodes), dentries=dentries, chunks=chunk_count,
                       sessions=session_count, gc_pending=len(gc_pending))

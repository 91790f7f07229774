"""Namespace checks: what ``fs3 admin fsck`` reports.

Reads the whole namespace through one transaction and checks the invariants every operation
keeps: each entry's parent is a directory and its inode exists with the entry's type; a file's
``nlink`` equals the entries naming it (0 only while sessions keep it open); a directory is
named exactly once, knows its parent, and has ``nlink`` = 2 + its subdirectories; every inode
but the root is reachable; sessions, xattrs, truncate jobs and size generations belong to live
inodes; and, when asked, no chunk on storage belongs to an inode that is neither live nor queued
for GC.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable

from fs3 import meta_pb2 as mpb
from fs3.common.errors import InvalidArgument
from fs3.common.ids import parse_chunk_id
from fs3.kv.store import prefix_end
from fs3.kv.txn import Transaction
from fs3.meta import schema

__all__ = ["run_fsck"]

_PROBLEMS_MAX = 1000


async def _scan_all(txn: Transaction, prefix: bytes) -> list[tuple[bytes, bytes]]:
    return await txn.scan(prefix, prefix_end(prefix))


async def run_fsck(txn: Transaction, list_chunks: Callable[[], Awaitable[list[bytes]]] | None = None) -> mpb.FsckRsp:
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
    dentries = 0
    for key, raw in await _scan_all(txn, schema.dentry_prefix()):
        dentries += 1
        parent_id, name = schema.parse_dentry_key(key)
        entry = mpb.DirEntry.FromString(raw)
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

    sessions: Counter[int] = Counter()
    session_count = 0
    for key, _ in await _scan_all(txn, schema.sessions_prefix()):
        session_count += 1
        inode_id = schema.parse_inode_key(schema.inode_prefix() + key[len(schema.sessions_prefix()):][:8])
        sessions[inode_id] += 1
        if inode_id not in inodes:
            problem(f"session on missing inode {inode_id}")

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
            if names[inode_id] == 0 and not sessions[inode_id]:
                problem(f"inode {inode_id} is unreachable and not open")

    for prefix, what in ((schema.gc_prefix(), "gc"), (schema.truncate_prefix(), "truncate"),
                         (schema.size_gen_prefix(), "size generation")):
        for key, _ in await _scan_all(txn, prefix):
            inode_id = schema.parse_inode_key(schema.inode_prefix() + key[len(prefix):])
            if what == "gc" and inode_id in inodes:
                problem(f"inode {inode_id} is both live and queued for GC")
            if what != "gc" and inode_id not in inodes:
                problem(f"{what} of missing inode {inode_id}")
    gc_pending = {schema.parse_inode_key(schema.inode_prefix() + k[len(schema.gc_prefix()):])
                  for k, _ in await _scan_all(txn, schema.gc_prefix())}

    for key, _ in await _scan_all(txn, b"XATR"):
        inode_id = schema.parse_inode_key(schema.inode_prefix() + key[4:12])
        if inode_id not in inodes:
            problem(f"xattr of missing inode {inode_id}")

    chunk_count = 0
    if list_chunks is not None:
        for cid in await list_chunks():
            chunk_count += 1
            try:
                inode_id, index = parse_chunk_id(cid)
            except InvalidArgument:
                problem(f"chunk {cid.hex()} is not a file chunk id")
                continue
            if inode_id not in inodes and inode_id not in gc_pending:
                problem(f"chunk {index} of inode {inode_id} has no live inode (orphan)")
            elif inode_id in inodes and inodes[inode_id].type != mpb.FILE:
                problem(f"chunk {index} belongs to inode {inode_id}, which is not a file")

    return mpb.FsckRsp(problems=problems, inodes=len(inodes), dentries=dentries, chunks=chunk_count,
                       sessions=session_count, gc_pending=len(gc_pending))

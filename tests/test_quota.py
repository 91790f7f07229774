"""Directory quotas (fs3.meta.quota): set/get/list/unset, EDQUOT on inodes and bytes, nested
quotas, renames between quotas, concurrent growth, fsck and repair, df, bad input, and a seeded
random exerciser against a model (with a planted bug it must catch).

The service's handlers are called as the RPC layer calls them, on the in-memory engine, as
tests/test_trash.py does; writes publish their length with an acknowledged hint (no storage).
tests/test_quota_cluster.py drives the same through a client on an in-process cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from fs3 import meta_pb2 as mpb
from fs3.cli import quota as quota_cli
from fs3.cli.main import build_parser
from fs3.common.errors import (
    BadHandle,
    CrossDevice,
    DirectoryNotEmpty,
    InvalidArgument,
    NotADirectory,
    NotFound,
    NotPermitted,
    QuotaExceeded,
)
from fs3.common.layout import max_file_size
from fs3.common.posix import O_CREAT, O_TRUNC, O_WRONLY, Caller
from fs3.kv.txn import TxnFaults, run_transaction
from fs3.meta import quota, quota_service, schema
from fs3.meta.dump import decode_record, dump_snapshot, is_dumped_key
from fs3.meta.fsck import run_fsck
from fs3.meta.ops import Namespace, OpEnv, TruncateUnclaimed
from fs3.meta.quota import Usage, parse_size, refusal, tree_usage
from tests.meta_service import InMemoryMeta

CLIENT = b"q" * 16


def ref(path: str) -> mpb.PathRef:
    return mpb.PathRef(path=path.encode())


class Meta(InMemoryMeta):
    """A metadata service on the in-memory engine, called as the RPC layer calls it."""

    def __init__(self, trash_days: float = 0.0, faults: TxnFaults | None = None) -> None:
        super().__init__(CLIENT, trash_days, faults)

    async def open(self, path: str) -> mpb.OpenRsp:
        rsp: mpb.OpenRsp = await self.call("open", mpb.OpenReq(ctx=self.ctx(), target=ref(path),
                                                               flags=O_CREAT | O_WRONLY, mode=0o644))
        return rsp

    async def sync(self, opened: mpb.OpenRsp, length: int) -> None:
        await self.call("sync", mpb.SyncReq(ctx=self.ctx(), inode_id=opened.inode.inode_id,
                                            session_id=opened.session_id, length_hint=length, wrote=True,
                                            acked=True))

    async def close(self, opened: mpb.OpenRsp, length: int = 0) -> None:
        await self.call("close", mpb.CloseReq(ctx=self.ctx(), inode_id=opened.inode.inode_id,
                                              session_id=opened.session_id, length_hint=length,
                                              wrote=length > 0, acked=True))

    async def create(self, path: str, size: int = 0) -> int:
        """A file of ``size`` bytes: created, then its length published by fsync, then closed."""
        opened = await self.open(path)
        try:
            if size:
                await self.sync(opened, size)
        finally:
            await self.close(opened)
        return int(opened.inode.inode_id)

    async def grow(self, path: str, size: int) -> None:
        """Publish a length of ``size`` for an existing file (refused past a quota, like fsync)."""
        opened = await self.open(path)
        try:
            await self.sync(opened, size)
        finally:
            await self.close(opened)

    async def reserve(self, opened: mpb.OpenRsp, end: int) -> mpb.QuotaReserveRsp:
        return await self.call("quota_reserve", mpb.QuotaReserveReq(  # type: ignore[no-any-return]
            ctx=self.ctx(), inode_id=opened.inode.inode_id, session_id=opened.session_id, end=end))

    async def mkdir(self, path: str, uid: int = 0) -> None:
        await self.call("make_node", mpb.MakeNodeReq(ctx=self.ctx(uid), target=ref(path), type=mpb.DIRECTORY,
                                                     mode=0o777))

    async def symlink(self, path: str, target: str) -> None:
        await self.call("make_node", mpb.MakeNodeReq(ctx=self.ctx(), target=ref(path), type=mpb.SYMLINK,
                                                     symlink_target=target.encode()))

    async def link(self, source: str, path: str) -> None:
        await self.call("link", mpb.LinkReq(ctx=self.ctx(), source=ref(source), link=ref(path)))

    async def rm(self, path: str, directory: bool = False) -> None:
        await self.call("remove", mpb.RemoveReq(ctx=self.ctx(), target=ref(path), directory=directory))

    async def mv(self, source: str, destination: str) -> None:
        await self.call("rename", mpb.RenameReq(ctx=self.ctx(), source=ref(source), destination=ref(destination)))

    async def set(self, path: str, bytes_limit: int = 0, inodes_limit: int = 0, uid: int = 0) -> mpb.Quota:
        rsp = await self.call("quota_set", mpb.QuotaSetReq(ctx=self.ctx(uid), target=ref(path),
                                                           bytes_limit=bytes_limit, inodes_limit=inodes_limit))
        return rsp.quota  # type: ignore[no-any-return]

    async def get(self, path: str) -> mpb.Quota:
        return (await self.call("quota_get", mpb.QuotaReq(ctx=self.ctx(), target=ref(path)))).quota  # type: ignore[no-any-return]

    async def usage(self, path: str) -> tuple[int, int]:
        found = await self.get(path)
        return found.bytes_used, found.inodes_used

    async def unset(self, path: str, uid: int = 0) -> None:
        await self.call("quota_unset", mpb.QuotaReq(ctx=self.ctx(uid), target=ref(path)))

    async def quotas(self) -> list[mpb.Quota]:
        return list((await self.call("quota_list", mpb.QuotaListReq(ctx=self.ctx()))).quotas)

    async def check(self, repair: bool = False) -> mpb.QuotaCheckRsp:
        return await self.call("quota_check", mpb.QuotaCheckReq(ctx=self.ctx(), repair=repair))  # type: ignore[no-any-return]

    async def problems(self) -> list[str]:
        return list((await run_fsck(self.engine.begin())).problems)

    async def inode_of(self, path: str) -> int:
        return int((await self.call("lookup", mpb.LookupReq(ctx=self.ctx(), target=ref(path)))).inode.inode_id)


def run(body: Callable[[Meta], Awaitable[None]], trash_days: float = 0.0, faults: TxnFaults | None = None) -> None:
    async def main() -> None:
        meta = Meta(trash_days, faults)
        await meta.service.start(background=False)
        await body(meta)

    asyncio.run(main())


ROOT_ENV = OpEnv(now_ns=1, caller=Caller(uid=0, gid=0))


async def record_truncate(meta: Meta, file_id: int, size: int) -> None:
    """Records a truncate of ``file_id`` to ``size`` bytes as meta does before storage answers:
    the growth is charged (EDQUOT if it does not fit), a shrink waits for :func:`complete_truncate`."""
    async def op(txn: Any) -> None:
        ns = Namespace(txn, ROOT_ENV)
        req = mpb.SetAttrReq(target=mpb.PathRef(inode_id=file_id), mask=mpb.SET_SIZE, size=size)
        await ns.setattr(req, truncating=file_id)
        await quota.settle(ns)

    await run_transaction(meta.engine, op)


async def complete_truncate(meta: Meta, file_id: int) -> bool:
    """Applies the truncate :func:`record_truncate` recorded, as storage's answer does (never
    refused); whether it was still the file's latest."""
    applied = False

    async def op(txn: Any) -> None:
        nonlocal applied
        ns = Namespace(txn, ROOT_ENV)
        ns.quota.refuse = False
        applied = await ns.complete_truncate(file_id, schema.decode_u64(await txn.get(schema.size_gen_key(file_id))))
        await quota.settle(ns)

    await run_transaction(meta.engine, op)
    return applied


# -- the pure part ---------------------------------------------------------------------------------

def test_sizes_parse_with_suffixes_and_bad_ones_are_refused() -> None:
    assert parse_size("100") == 100
    assert parse_size("10K") == 10 << 10
    assert parse_size("3g") == 3 << 30
    assert parse_size("2TiB") == 2 << 40
    assert parse_size("16383P") == 16383 << 50
    for bad in ("-1", "1.5G", "ten", "", "10Q", "G", "16384P", str(1 << 64)):  # a limit is 64 bits
        with pytest.raises(InvalidArgument):
            parse_size(bad)


def test_only_growth_past_a_limit_is_refused() -> None:
    limits = mpb.Quota(inode_id=7, bytes_limit=100, inodes_limit=3)
    assert refusal(limits, Usage(50, 1), Usage(100, 3)) is None  # exactly at the limits
    assert "bytes" in (refusal(limits, Usage(50, 1), Usage(101, 1)) or "")
    assert "inodes" in (refusal(limits, Usage(50, 3), Usage(50, 4)) or "")
    assert refusal(limits, Usage(500, 9), Usage(400, 8)) is None  # over a lowered limit: may shrink
    assert refusal(mpb.Quota(inode_id=7), Usage(), Usage(1 << 50, 1 << 30)) is None  # no limits


def test_the_recount_follows_homes_and_nesting() -> None:
    root = mpb.Inode(inode_id=1, type=mpb.DIRECTORY, parent=1, nlink=3)
    a = mpb.Inode(inode_id=2, type=mpb.DIRECTORY, parent=1, nlink=3)
    b = mpb.Inode(inode_id=3, type=mpb.DIRECTORY, parent=2, nlink=2)
    f = mpb.Inode(inode_id=4, type=mpb.FILE, parent=3, nlink=2, size=10)  # home b, also named in root
    g = mpb.Inode(inode_id=5, type=mpb.FILE, parent=2, nlink=0, size=99)  # in the trash: counts nowhere
    inodes = {i.inode_id: i for i in (root, a, b, f, g)}
    entries = [(1, 2), (2, 3), (3, 4), (1, 4)]
    assert tree_usage(inodes, entries, {1, 2, 3}) == {1: Usage(10, 4), 2: Usage(10, 2), 3: Usage(10, 1)}


# -- through the service -----------------------------------------------------------------------------

def test_set_get_list_unset_and_usage_of_an_existing_tree() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.mkdir("/d/sub")
        await meta.create("/d/a", 100)
        await meta.create("/d/sub/b", 50)
        await meta.symlink("/d/s", "a")
        made = await meta.set("/d", bytes_limit=1000, inodes_limit=10)
        assert (made.bytes_used, made.inodes_used) == (150, 4)  # the existing tree, counted
        assert (made.bytes_limit, made.inodes_limit) == (1000, 10)
        await meta.set("/d", bytes_limit=2000)  # a change keeps the usage
        got = await meta.get("/d")
        assert (got.bytes_limit, got.inodes_limit, got.bytes_used, got.inodes_used) == (2000, 0, 150, 4)
        assert [q.inode_id for q in await meta.quotas()] == [await meta.inode_of("/d")]
        await meta.unset("/d")
        assert await meta.quotas() == []
        with pytest.raises(NotFound):
            await meta.get("/d")
        assert await meta.problems() == []

    run(body)


def test_a_listing_shows_each_quota_by_its_path_as_it_is_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """``quota list`` names directories by path (found by walking up, renames followed), and by
    ``<dir N>`` where the walk cannot find a name within its bounds."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/a")
        await meta.mkdir("/a/b")
        await meta.mkdir("/c")
        await meta.set("/a/b", bytes_limit=10)
        await meta.set("/c", inodes_limit=10)
        await meta.mv("/a", "/z")
        listed = {q.inode_id: bytes(q.path) for q in await meta.quotas()}
        assert listed == {await meta.inode_of("/z/b"): b"/z/b", await meta.inode_of("/c"): b"/c"}
        assert {bytes(q.path) for q in (await meta.check()).recomputed} == {b"/z/b", b"/c"}
        monkeypatch.setattr(quota_service, "QUOTA_PATH_SCAN_MAX", 0)  # no name found: shown by id
        assert {bytes(q.path) for q in await meta.quotas()} == {b""}
        rows = [quota_cli.quota_dict(q) for q in await meta.quotas()]
        assert {row["path"] for row in rows} == {""} and all(row["inode_id"] for row in rows)

    run(body)


def test_files_without_a_home_are_adopted_when_a_quota_is_set() -> None:
    """Files written before files had a home (``parent`` 0) count once a quota's count finds them."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.mkdir("/d/e")
        await meta.set("/d", inodes_limit=100)  # an outer quota, set before the file lost its home
        file_id = await meta.create("/d/e/old", 123)

        async def forget_home(txn: Any) -> None:
            inode = mpb.Inode.FromString(await txn.get(schema.inode_key(file_id)))
            inode.parent = 0
            txn.put(schema.inode_key(file_id), inode.SerializeToString())
            quota.write_usage(txn, await meta.inode_of("/d"), Usage(0, 2))

        await run_transaction(meta.engine, forget_home)
        assert await meta.problems() == []  # a homeless file counts nowhere: consistent
        made = await meta.set("/d/e", bytes_limit=1000)
        assert (made.bytes_used, made.inodes_used) == (123, 1)
        assert await meta.usage("/d") == (123, 2)  # the outer quota was charged by the adoption
        await meta.grow("/d/e/old", 200)
        assert await meta.usage("/d/e") == (200, 1)
        assert await meta.problems() == []

    run(body)


def test_a_dump_keeps_quotas_and_leaves_out_writers_credits() -> None:
    """Quotas, their usage and the marks of files at home by no name are dumped; writers' credits
    belong to open sessions, which a dump leaves out, and so does the usage it shows for them."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.mkdir("/o")
        await meta.create("/d/a", 10)
        await meta.set("/d", bytes_limit=5000)
        await meta.link("/d/a", "/o/b")
        await meta.rm("/d/a")  # at home in /d by no name there: marked
        opened = await meta.open("/d/c")
        await meta.reserve(opened, 100)
        assert (await meta.usage("/d"))[0] == 10 + (5000 - 10) // 2
        stored = await meta.engine.begin().scan(b"Q", b"R")
        credit_prefixes = (schema.quota_reservation_prefix(), schema.quota_reservation_home_prefix())
        assert {k[:4] for k, _ in stored if not is_dumped_key(k)} == set(credit_prefixes)
        lines: list[bytes] = []

        async def emit(line: bytes) -> None:
            lines.append(line)

        await dump_snapshot(await meta.engine.snapshot(), emit, "c", 0)
        records = [decode_record(json.loads(line)) for line in lines[1:-1]]
        usage = [mpb.Quota.FromString(v) for kind, _, v in records if kind == "quota_usage"]
        assert [(q.bytes_used, q.inodes_used) for q in usage] == [(10, 1)]
        assert [k for kind, k, _ in records if kind == "quota_away"] == \
            [schema.quota_away_key(await meta.inode_of("/d"), await meta.inode_of("/o/b"))]

    run(body)


def test_inode_limit_refuses_create_mkdir_symlink_and_link_with_edquot() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.create("/outside")
        await meta.set("/d", inodes_limit=2)
        await meta.create("/d/a")
        await meta.mkdir("/d/b")
        attempts: list[Callable[[], Awaitable[Any]]] = [
            lambda: meta.create("/d/c"), lambda: meta.mkdir("/d/b/c"), lambda: meta.symlink("/d/s", "a"),
            lambda: meta.link("/outside", "/d/l"), lambda: meta.mv("/outside", "/d/moved")]
        for attempt in attempts:
            with pytest.raises(QuotaExceeded) as refused:
                await attempt()
            assert refused.value.errno == errno.EDQUOT
        assert await meta.usage("/d") == (0, 2)
        await meta.rm("/d/a")
        await meta.link("/outside", "/d/l")  # room again
        assert await meta.usage("/d") == (0, 2)
        assert await meta.problems() == []

    run(body)


def test_byte_limit_refuses_fsync_growth_but_a_close_is_charged() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.set("/d", bytes_limit=1000)
        await meta.create("/d/a", 600)
        opened = await meta.open("/d/b")
        await meta.sync(opened, 400)  # exactly at the limit
        with pytest.raises(QuotaExceeded):
            await meta.sync(opened, 401)
        assert await meta.usage("/d") == (1000, 2)
        await meta.close(opened, 450)  # its bytes are on storage: a close is never refused
        assert await meta.usage("/d") == (1050, 2)
        with pytest.raises(QuotaExceeded):
            await meta.create("/d/c", 1)  # over: nothing grows any more...
        await meta.rm("/d/a")  # ...until something goes (the refused /d/c exists, empty)
        assert await meta.usage("/d") == (450, 2)
        await meta.grow("/d/c", 550)
        assert await meta.usage("/d") == (1000, 2)
        assert await meta.problems() == []

    run(body)


def test_nested_quotas_each_apply() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/outer")
        await meta.mkdir("/outer/inner")
        await meta.set("/outer", bytes_limit=1000, inodes_limit=100)
        await meta.set("/outer/inner", bytes_limit=300)
        await meta.create("/outer/inner/a", 300)
        with pytest.raises(QuotaExceeded, match="300 bytes"):
            await meta.create("/outer/inner/b", 1)  # the inner limit
        await meta.create("/outer/x", 700)
        await meta.unset("/outer/inner")
        with pytest.raises(QuotaExceeded, match="1000 bytes"):
            await meta.create("/outer/inner/c", 1)  # the outer one still holds
        assert await meta.usage("/outer") == (1000, 5)  # the refused files exist, empty
        assert await meta.problems() == []

    run(body)


def test_renames_move_usage_between_quotas_and_refuse_past_a_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(meta: Meta) -> None:
        for d in ("/a", "/b", "/tree", "/tree/sub"):
            await meta.mkdir(d)
        await meta.create("/tree/f", 10)
        await meta.create("/tree/sub/g", 20)
        await meta.create("/big", 500)
        await meta.set("/a", bytes_limit=100, inodes_limit=10)
        await meta.set("/b", bytes_limit=1000)
        await meta.mv("/tree", "/a/tree")  # a directory's tree moves in: 4 entries, 30 bytes
        assert await meta.usage("/a") == (30, 4)
        with pytest.raises(QuotaExceeded):
            await meta.mv("/big", "/a/big")
        await meta.mv("/a/tree/f", "/b/f")  # a file moves between quotas with its bytes
        assert await meta.usage("/a") == (20, 3)
        assert await meta.usage("/b") == (10, 1)
        await meta.mv("/a/tree", "/tree2")  # out of every quota
        assert await meta.usage("/a") == (0, 0)
        await meta.set("/tree2/sub", inodes_limit=5)
        await meta.mv("/tree2", "/b/tree2")  # its tree is recounted in the rename
        assert await meta.usage("/b") == (30, 4)
        await meta.mv("/b/tree2/sub", "/sub")  # a quota'd directory moves out with its own usage
        assert await meta.usage("/b") == (10, 2)
        assert await meta.usage("/sub") == (20, 1)
        monkeypatch.setattr(quota, "QUOTA_MOVE_COUNT_MAX", 1)  # a tree too large to recount: EXDEV
        await meta.mkdir("/many")
        for name in ("x", "y"):
            await meta.create(f"/many/{name}")
        with pytest.raises(CrossDevice) as refused:
            await meta.mv("/many", "/a/many")
        assert refused.value.errno == errno.EXDEV
        await meta.mv("/many", "/many2")  # within the same quotas (none): no recount needed
        assert await meta.problems() == []

    run(body)


def test_two_clients_growing_at_once_never_pass_the_limit() -> None:
    limit = 10_000

    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.set("/d", bytes_limit=limit)
        acked: list[int] = []

        async def writer(name: str, step: int) -> None:
            opened = await meta.open(f"/d/{name}")
            size = 0
            try:
                for _ in range(40):
                    try:
                        await meta.sync(opened, size + step)
                    except QuotaExceeded:
                        continue
                    size += step
                    acked.append(step)
            finally:
                await meta.close(opened)

        await asyncio.gather(writer("one", 700), writer("two", 300))
        used = (await meta.get("/d")).bytes_used
        assert sum(acked) == used <= limit
        assert used > limit - 700  # both kept going until the quota was (nearly) full
        assert await meta.problems() == []

    run(body)


def test_usage_is_exact_under_injected_conflicts_and_ambiguous_commits() -> None:
    """Every commit may conflict or be "maybe committed" (a crash of the store's reply): each
    change is counted exactly once, as the answer committed with it is what a retry finds."""
    faults = TxnFaults(conflict_probability=0.3, maybe_committed_probability=0.3)

    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.mkdir("/e")
        await meta.set("/d", bytes_limit=10_000, inodes_limit=100)
        for i in range(12):
            await meta.create(f"/d/f{i}", 100 + i)
        for i in range(0, 12, 3):
            await meta.mv(f"/d/f{i}", f"/e/f{i}")
        for i in range(1, 12, 3):
            await meta.rm(f"/d/f{i}")
        kept = [i for i in range(12) if i % 3 == 2]
        assert await meta.usage("/d") == (sum(100 + i for i in kept), len(kept))
        assert meta.engine.conflicts > 0  # the faults did strike
        assert await meta.problems() == []

    run(body, faults=faults)


def test_fsck_finds_a_planted_mismatch_and_repair_fixes_it() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.create("/d/a", 77)
        await meta.set("/d", bytes_limit=1000)
        directory = await meta.inode_of("/d")
        assert (await meta.check()).problems == []

        async def plant(txn: Any) -> None:
            quota.write_usage(txn, directory, Usage(5, 9))

        await run_transaction(meta.engine, plant)
        assert any("records 5 bytes, 9 inodes" in p for p in await meta.problems())
        found = await meta.check()
        assert len(found.problems) == 1 and not found.repaired
        assert (await meta.check(repair=True)).repaired
        assert await meta.usage("/d") == (77, 1)
        assert await meta.problems() == []

    run(body)


def test_df_inside_a_quota_reports_the_quota() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.mkdir("/d/e")
        await meta.create("/d/e/a", 300)
        await meta.set("/d", bytes_limit=1000, inodes_limit=50)
        inside = await meta.inode_of("/d/e")
        rsp = await meta.call("stat_fs", mpb.StatFsReq(ctx=meta.ctx(), inode_id=inside))
        assert (rsp.capacity_bytes, rsp.used_bytes, rsp.free_bytes) == (1000, 300, 700)
        assert (rsp.inodes_limit, rsp.inodes_used) == (50, 2)
        outside = await meta.call("stat_fs", mpb.StatFsReq(ctx=meta.ctx()))  # the root has none
        assert outside.inodes_limit == 0

    run(body)


def test_bad_requests_are_refused_clearly() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.create("/f")
        with pytest.raises(NotADirectory, match="a quota belongs to a directory"):
            await meta.set("/f", bytes_limit=10)
        with pytest.raises(NotFound):
            await meta.set("/nowhere", bytes_limit=10)
        with pytest.raises(InvalidArgument, match="byte or an inode limit"):
            await meta.set("/d")
        with pytest.raises(NotPermitted, match="only root"):
            await meta.set("/d", bytes_limit=10, uid=1000)
        await meta.set("/d", bytes_limit=10)
        with pytest.raises(NotPermitted):
            await meta.unset("/d", uid=1000)
        with pytest.raises(NotFound, match="has no quota"):
            await meta.unset("/")
        assert len(await meta.quotas()) == 1

    run(body)
    parser = build_parser()
    for argv in (["quota", "set", "/d", "--bytes", "-5"], ["quota", "set", "/d", "--bytes", "lots"],
                 ["quota", "set", "/d", "--inodes", "1.5"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    assert parser.parse_args(["quota", "set", "/d", "--bytes", "2G"]).bytes == 2 << 30


def test_removing_a_quota_directory_removes_its_quota() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.set("/d", inodes_limit=5)
        await meta.rm("/d", directory=True)
        assert await meta.quotas() == []
        await meta.mkdir("/d")
        with pytest.raises(NotFound):
            await meta.get("/d")
        assert await meta.problems() == []

    run(body)


def test_trashed_files_count_nowhere_and_a_restore_is_checked() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.set("/d", bytes_limit=100)
        trashed = await meta.create("/d/a", 80)
        await meta.rm("/d/a")
        assert await meta.usage("/d") == (0, 0)
        await meta.create("/d/b", 50)
        with pytest.raises(QuotaExceeded):
            await meta.call("trash_restore", mpb.TrashRestoreReq(ctx=meta.ctx(), id=trashed))
        await meta.rm("/d/b")
        await meta.call("trash_restore", mpb.TrashRestoreReq(ctx=meta.ctx(), id=trashed))
        assert await meta.usage("/d") == (80, 1)
        assert await meta.problems() == []

    run(body, trash_days=1.0)


def test_a_truncate_up_is_charged_when_recorded_and_not_again_when_applied() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        file_id = await meta.create("/d/a", 10)
        await meta.set("/d", bytes_limit=100)
        env = OpEnv(now_ns=1, caller=Caller(uid=0, gid=0))

        async def truncate(size: int) -> None:
            await record_truncate(meta, file_id, size)

        async def complete() -> None:
            assert await complete_truncate(meta, file_id)

        with pytest.raises(QuotaExceeded):
            await truncate(101)
        await truncate(100)
        assert await meta.usage("/d") == (100, 1)  # reserved with the job
        await complete()
        assert await meta.usage("/d") == (100, 1)  # not charged twice
        await truncate(40)
        await complete()
        assert await meta.usage("/d") == (40, 1)  # a shrink counts once applied
        assert await meta.problems() == []
        with pytest.raises(TruncateUnclaimed):
            await run_transaction(meta.engine, lambda txn: Namespace(txn, env).setattr(
                mpb.SetAttrReq(target=mpb.PathRef(inode_id=file_id), mask=mpb.SET_SIZE, size=1)))

        # An open writer holding a credit may still write up to where it reached (it learns of a
        # truncate by another client only when it asks again): its credit grows by the shrink.
        opened = await meta.open("/d/a")
        assert (await meta.reserve(opened, 50)).granted_end == 70  # length 40, and half of the 60 left
        assert (await meta.usage("/d"))[0] == 70
        await truncate(0)
        await complete()
        assert (await meta.usage("/d"))[0] == 70  # length 0, credit 70: still covers byte 70
        assert (await meta.reserve(opened, 70)).granted_end == 70
        assert await meta.problems() == []
        await meta.close(opened)
        assert await meta.usage("/d") == (0, 1)

    run(body)


@pytest.mark.parametrize("trash_days", [0.0, 1.0])
def test_the_growth_a_pending_truncate_reserved_follows_the_file(trash_days: float) -> None:
    # A truncate up whose storage side has not run yet (storage down) has its growth charged: a
    # removal, a rename to another quota, or a restore from the trash meanwhile moves it along.
    async def body(meta: Meta) -> None:
        for directory in ("/d", "/e"):
            await meta.mkdir(directory)
            await meta.set(directory, bytes_limit=1000)

        async def truncate_up(path: str, size: int) -> int:
            file_id = await meta.create(path, 10)
            await record_truncate(meta, file_id, size)
            return file_id

        async def complete(file_id: int) -> None:
            await complete_truncate(meta, file_id)

        removed = await truncate_up("/d/a", 100)
        assert await meta.usage("/d") == (100, 1)
        await meta.rm("/d/a")
        assert await meta.usage("/d") == (0, 0)
        moved = await truncate_up("/d/b", 200)
        await meta.mv("/d/b", "/e/b")
        assert (await meta.usage("/d"), await meta.usage("/e")) == ((0, 0), (200, 1))
        await complete(moved)
        assert await meta.usage("/e") == (200, 1)
        if trash_days:
            await meta.call("trash_restore", mpb.TrashRestoreReq(ctx=meta.ctx(), id=removed))
            assert await meta.usage("/d") == (100, 1)
            await complete(removed)
            assert await meta.usage("/d") == (100, 1)
        assert await meta.problems() == []
        assert not (await meta.check()).problems

    run(body, trash_days=trash_days)


def test_a_hard_link_elsewhere_does_not_take_a_file_out_of_its_quota() -> None:
    """The name in a file's home goes while a hard link outside the quota keeps the file: its bytes
    still count at home (and its growth is still refused), a recount finds them, removing the home
    moves them up to its parent, and only the last name's removal frees them."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.mkdir("/q/d")
        await meta.mkdir("/o")
        await meta.set("/q", bytes_limit=1000)
        await meta.create("/q/d/f", 100)
        await meta.link("/q/d/f", "/o/g")
        await meta.rm("/q/d/f")
        assert await meta.usage("/q") == (100, 1)  # the bytes stay at home, the entry is gone
        with pytest.raises(QuotaExceeded):
            await meta.grow("/o/g", 5000)  # growing it through its other name is still refused
        assert await meta.problems() == [] and not (await meta.check()).problems
        await meta.rm("/q/d", directory=True)  # its home goes: the file is at home in /q now
        assert await meta.usage("/q") == (100, 0)
        assert await meta.problems() == [] and not (await meta.check()).problems
        await meta.unset("/q")
        assert (await meta.set("/q", bytes_limit=1000)).bytes_used == 100  # a fresh count finds it
        await meta.rm("/o/g")
        assert await meta.usage("/q") == (0, 0)
        assert await meta.problems() == [] and not (await meta.check()).problems

    run(body)


def test_a_lost_mark_is_found_and_a_home_of_too_many_files_named_elsewhere_stays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.mkdir("/q/d")
        await meta.create("/q/d/f", 10)
        await meta.link("/q/d/f", "/g")
        await meta.rm("/q/d/f")
        monkeypatch.setattr(quota, "AWAY_MOVE_MAX", 0)
        with pytest.raises(DirectoryNotEmpty):
            await meta.rm("/q/d", directory=True)
        assert await meta.inode_of("/q/d")  # still there, and so is the file's home
        home, file_id = await meta.inode_of("/q/d"), await meta.inode_of("/g")

        async def lose_mark(txn: Any) -> None:
            txn.delete(schema.quota_away_key(home, file_id))
        await run_transaction(meta.engine, lose_mark)
        assert any("neither names it nor marks it" in p for p in await meta.problems())

    run(body)


def test_a_credit_is_only_for_an_open_writing_session_of_the_caller() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.set("/q", bytes_limit=100)
        await meta.create("/q/f")
        reading = await meta.call("open", mpb.OpenReq(ctx=meta.ctx(), target=ref("/q/f"), flags=0))
        with pytest.raises(BadHandle):
            await meta.reserve(reading, 10)  # not open for writing
        writing = await meta.open("/q/f")
        await meta.close(writing)
        with pytest.raises(BadHandle):
            await meta.reserve(writing, 10)  # closed
        other = mpb.OpenRsp()
        other.CopyFrom(writing)
        other.session_id = b"x" * len(writing.session_id)
        with pytest.raises(BadHandle):
            await meta.reserve(other, 10)  # another client's session id
        assert await meta.usage("/q") == (0, 1)

    run(body)


def test_byte_credits_keep_two_writers_within_the_limit() -> None:
    """Two handles writing into one quota'd directory before either publishes a length: each asks
    for a byte credit first, the credits never add up past the limit, the one that does not fit
    gets EDQUOT, and after both close the usage is the files' real lengths."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.set("/q", bytes_limit=1000)
        a, b = await meta.open("/q/a"), await meta.open("/q/b")
        assert not a.quota_free
        assert (await meta.reserve(a, 300)).granted_end == 500  # a step ahead: half of what is left
        assert (await meta.usage("/q"))[0] == 500
        assert (await meta.reserve(b, 300)).granted_end == 300  # the rest holds just what it needs
        assert (await meta.reserve(a, 400)).granted_end == 500  # within its credit: nothing changes
        assert (await meta.reserve(a, 700)).granted_end == 700
        assert (await meta.usage("/q"))[0] == 1000
        with pytest.raises(QuotaExceeded):
            await meta.reserve(b, 301)
        assert (await meta.usage("/q"))[0] == 1000  # refused: nothing charged
        assert await meta.problems() == []
        await meta.sync(a, 200)  # a's published length uses up as much of its credit
        assert (await meta.usage("/q"))[0] == 1000
        await meta.close(a, 650)  # the rest of its credit goes back
        assert (await meta.usage("/q"))[0] == 950
        await meta.close(b, 300)
        assert await meta.usage("/q") == (950, 2)
        assert not (await meta.check()).problems and await meta.problems() == []

    run(body)


def test_a_file_outside_every_quota_needs_no_credit_and_leaked_credits_are_repaired() -> None:
    async def body(meta: Meta) -> None:
        free = await meta.open("/f")
        assert free.quota_free  # no quota anywhere: the handle is told so at its open
        await meta.close(free)
        await meta.mkdir("/q")
        await meta.set("/q", bytes_limit=1 << 40)
        outside = await meta.open("/g")
        assert not outside.quota_free and (await meta.reserve(outside, 10)).unlimited
        await meta.close(outside)
        inside = await meta.open("/q/h")
        assert (await meta.reserve(inside, 10)).granted_end == quota.RESERVE_STEP_BYTES
        assert (await meta.usage("/q"))[0] == quota.RESERVE_STEP_BYTES
        # The session vanishes without a close (a damaged store): the credit leaked.
        async def drop_session(txn: Any) -> None:
            txn.delete(schema.session_key(inside.inode.inode_id, inside.session_id))
        await run_transaction(meta.engine, drop_session)
        assert any("outlived its session" in p for p in await meta.problems())
        found = await meta.check()
        assert any("outlived its session" in p for p in found.problems) and not found.repaired
        assert (await meta.check(repair=True)).repaired
        assert await meta.usage("/q") == (0, 1)
        assert await meta.problems() == [] and not (await meta.check()).problems

    run(body)


def test_an_expired_client_gives_its_credits_back() -> None:
    """A client that dies holding a credit: meta closes its sessions when its lease lapses, and
    the close gives the credit back (the existing session clean-up, nothing of its own)."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.set("/q", bytes_limit=1000)
        opened = await meta.open("/q/a")
        await meta.reserve(opened, 100)
        assert (await meta.usage("/q"))[0] == 500
        async def expire(txn: Any) -> None:
            ns = Namespace(txn, OpEnv(caller=Caller(uid=0, gid=0), now_ns=1))
            await ns.close(opened.inode.inode_id, opened.session_id)
            await quota.settle(ns)
        await run_transaction(meta.engine, expire)
        assert await meta.usage("/q") == (0, 1)
        assert await meta.problems() == []

    run(body)


def test_credits_follow_a_renamed_file_and_go_back_when_it_is_removed() -> None:
    async def body(meta: Meta) -> None:
        for directory in ("/q", "/r"):
            await meta.mkdir(directory)
            await meta.set(directory, bytes_limit=1000)
        opened = await meta.open("/q/a")
        await meta.reserve(opened, 100)
        await meta.mv("/q/a", "/r/a")
        assert (await meta.usage("/q"))[0] == 0 and (await meta.usage("/r"))[0] == 500
        assert await meta.problems() == []
        await meta.rm("/r/a")
        assert (await meta.usage("/r"))[0] == 0
        assert await meta.problems() == []
        await meta.close(opened, 50)
        assert await meta.usage("/r") == (0, 0)

    run(body)


def test_a_truncate_keeps_covered_every_writer_whose_credit_was_used_up() -> None:
    """A writer that published all of its credit (or never needed one: it overwrites a file that
    was long when it opened) holds no credit row, yet may still write up to where the file
    reached when it last asked: a truncate by someone else must leave those bytes charged, or
    another writer takes the room and the first one's close passes the limit."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.set("/q", bytes_limit=1000)
        env = OpEnv(now_ns=1, caller=Caller(uid=0, gid=0))
        writer = await meta.open("/q/f")
        assert (await meta.reserve(writer, 500)).granted_end == 500
        await meta.sync(writer, 500)  # its credit is used up: the handle may write to byte 500
        overwriter = await meta.open("/q/f")  # opened at length 500: overwrites need no credit
        file_id = writer.inode.inode_id

        await record_truncate(meta, file_id, 0)
        assert await complete_truncate(meta, file_id)
        # Each handle may still write bytes 0..500 (meta cannot tell that they overlap).
        assert (await meta.usage("/q"))[0] == 1000
        other = await meta.open("/q/g")
        with pytest.raises(QuotaExceeded):
            await meta.reserve(other, 1)
        assert await meta.problems() == [] and not (await meta.check()).problems
        for opened in (writer, overwriter, other):
            await meta.close(opened)  # (what they wrote is checked against storage: none here)
        assert await meta.usage("/q") == (0, 2)

        # An O_TRUNC open is told the new length: its own session needs no credit for the old one.
        await meta.grow("/q/f", 800)
        session_id = schema.session_id_for(CLIENT, 1 << 40)

        async def open_truncating(txn: Any) -> None:
            ns = Namespace(txn, env)
            opened = await ns.open(ref("/q/f"), O_TRUNC | O_WRONLY, 0, 0, session_id, CLIENT, 1, truncating=file_id)
            assert opened.inode.size == 0
            await quota.settle(ns)

        await run_transaction(meta.engine, open_truncating)
        assert await complete_truncate(meta, file_id)
        assert await meta.usage("/q") == (0, 2)

    run(body)


def test_a_credit_past_the_largest_file_is_refused_clearly() -> None:
    """``end`` comes from the client: one past what the file's layout allows is bad input, not a
    credit that makes a usage that no longer fits its 64-bit field."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.set("/q", inodes_limit=100)  # no byte limit: nothing else bounds the credit
        opened = await meta.open("/q/f")
        with pytest.raises(InvalidArgument):
            await meta.reserve(opened, (1 << 64) - 1)
        second = await meta.open("/q/g")
        with pytest.raises(InvalidArgument):
            await meta.reserve(second, (1 << 64) - 1)
        assert (await meta.usage("/q"))[0] == 0
        await meta.close(opened)
        await meta.close(second)
        assert await meta.problems() == []

    run(body)


def test_usage_past_64_bits_is_refused_not_a_crash() -> None:
    """Sparse files are charged their length, up to the largest their layout allows: enough of
    them under a quota without a byte limit would pass what a usage holds (64 bits). The growth
    that would is EDQUOT, not a usage meta cannot store (every change in the tree failing)."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.set("/q", inodes_limit=10_000)
        layout = mpb.Layout(table_id=1, chunk_size=1 << 26, stripe=1)  # files of up to 2^58 bytes: 64 fill a usage
        await meta.call("set_layout", mpb.SetLayoutReq(ctx=meta.ctx(), dir=ref("/q"), layout=layout))

        async def truncate(file_id: int, size: int) -> None:
            await record_truncate(meta, file_id, size)
            assert await complete_truncate(meta, file_id)

        opened = await meta.open("/q/f0")
        await meta.close(opened)
        big = max_file_size(opened.inode.layout)
        count = (1 << 64) // big
        assert count == 64
        for index in range(count):
            file_id = await meta.create(f"/q/f{index}") if index else opened.inode.inode_id
            await truncate(file_id, big - (index == count - 1))
        with pytest.raises(QuotaExceeded):
            await truncate(await meta.create("/q/g"), 1)
        writer = await meta.open("/q/h")
        with pytest.raises(QuotaExceeded):
            await meta.reserve(writer, 1)
        await meta.close(writer)
        assert await meta.usage("/q") == ((1 << 64) - 1, count + 2)
        assert await meta.problems() == []

    run(body)


def test_counts_see_the_growth_of_a_pending_truncate() -> None:
    """A truncate up is charged when recorded and applied once storage answers: until then the
    file's length is the old one. fsck, ``quota check`` and a directory moving between quotas
    count the growth too, or fsck reports a sound usage, a repair takes the growth out for good
    (the completion charges nothing) and a move leaves it behind."""
    async def body(meta: Meta) -> None:
        for directory in ("/q", "/r"):
            await meta.mkdir(directory)
            await meta.set(directory, bytes_limit=1000)
        await meta.mkdir("/q/d")
        file_id = await meta.create("/q/d/f", 10)


        await record_truncate(meta, file_id, 300)  # storage has not answered yet
        assert await meta.usage("/q") == (300, 2)
        assert await meta.problems() == []
        assert not (await meta.check(repair=True)).problems
        assert await meta.usage("/q") == (300, 2)
        await meta.mv("/q/d", "/r/d")
        assert (await meta.usage("/q"), await meta.usage("/r")) == ((0, 0), (300, 2))
        assert await complete_truncate(meta, file_id)
        assert (await meta.usage("/q"), await meta.usage("/r")) == ((0, 0), (300, 2))
        assert await meta.problems() == [] and not (await meta.check()).problems

    run(body)


def test_a_file_no_quota_counts_carries_its_writers_credits_into_a_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file outside every quota may move into one while open (``mv`` of a file being written):
    its writer's credit, charged nowhere until then, is charged there by the rename (refused when
    it does not fit, as a credit moving between quotas is), so the writer never writes past what
    a quota accounted for it, however far it was let write before."""
    monkeypatch.setattr(quota, "RESERVE_STEP_BYTES", 100)

    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.set("/q", bytes_limit=1000)
        opened = await meta.open("/f")
        answer = await meta.reserve(opened, 10)
        assert answer.unlimited and answer.granted_end == 100
        await meta.mv("/f", "/q/f")
        assert await meta.usage("/q") == (100, 1)
        answer = await meta.reserve(opened, 500)
        assert not answer.unlimited and answer.granted_end == 500
        with pytest.raises(QuotaExceeded):
            await meta.reserve(opened, 1001)
        assert await meta.problems() == [] and not (await meta.check()).problems
        await meta.mv("/q/f", "/f")  # its credit leaves with it
        assert await meta.usage("/q") == (0, 0)
        sparse = await meta.open("/g")
        assert (await meta.reserve(sparse, 5000)).unlimited  # a write far past the end, outside quotas
        with pytest.raises(QuotaExceeded):
            await meta.mv("/g", "/q/g")
        await meta.mkdir("/d")
        await meta.mv("/g", "/d/g")
        with pytest.raises(QuotaExceeded):  # a directory holding it moves its credit along too
            await meta.mv("/d", "/q/d")
        for handle in (opened, sparse):
            await meta.close(handle)
        await meta.mv("/d", "/q/d")
        assert await meta.usage("/q") == (0, 2)
        assert await meta.problems() == [] and not (await meta.check()).problems

    run(body)


def test_a_writer_of_a_file_restored_from_the_trash_is_still_covered() -> None:
    """A writer holds a credit when its file is removed into the trash: the credit stops counting
    with the file, but the writer may still write as far as it reached. A restore charges it
    again (refused past the limit, as the file's own bytes are), so the room it had while the file
    was away cannot be taken twice."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.set("/q", bytes_limit=1000)
        writer = await meta.open("/q/f")
        assert (await meta.reserve(writer, 400)).granted_end == 500  # may write to byte 500 unasked
        await meta.rm("/q/f")
        assert (await meta.usage("/q"))[0] == 0
        other = await meta.open("/q/g")
        assert (await meta.reserve(other, 600)).granted_end == 600
        with pytest.raises(QuotaExceeded):  # 500 more would not fit beside the 600
            await meta.call("trash_restore", mpb.TrashRestoreReq(ctx=meta.ctx(), id=writer.inode.inode_id))
        await meta.close(other)
        await meta.call("trash_restore", mpb.TrashRestoreReq(ctx=meta.ctx(), id=writer.inode.inode_id))
        assert await meta.usage("/q") == (500, 2)  # the writer's credit is back
        assert await meta.problems() == [] and not (await meta.check()).problems
        await meta.close(writer)
        assert await meta.usage("/q") == (0, 2)
        assert await meta.problems() == []

    run(body, trash_days=1.0)


def test_a_truncate_outside_quotas_keeps_its_writers_covered_for_a_later_rename() -> None:
    """A writer opened a file of 500 bytes outside every quota (it may overwrite them unasked);
    the file is truncated, then moved into a quota: the writer's 500 bytes go with it."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.set("/q", bytes_limit=1000)
        file_id = await meta.create("/f", 500)
        writer = await meta.open("/f")


        await record_truncate(meta, file_id, 0)
        assert await complete_truncate(meta, file_id)
        await meta.mv("/f", "/q/f")
        assert await meta.usage("/q") == (500, 1)
        assert await meta.problems() == [] and not (await meta.check()).problems
        await meta.close(writer)
        assert await meta.usage("/q") == (0, 1)

    run(body)


def test_a_retried_credit_request_is_answered_once() -> None:
    """A QuotaReserve whose answer was lost is sent again under the same request id: meta gives
    the saved answer, the credit is charged once."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/q")
        await meta.set("/q", bytes_limit=10_000)
        opened = await meta.open("/q/f")
        req = mpb.QuotaReserveReq(ctx=meta.ctx(), inode_id=opened.inode.inode_id, session_id=opened.session_id,
                                  end=3000)
        first = await meta.call("quota_reserve", req)
        assert (await meta.usage("/q"))[0] == first.granted_end == 5000
        await meta.sync(opened, 5000)  # the credit is used up: a second run would charge again
        assert await meta.call("quota_reserve", req) == first
        assert (await meta.usage("/q"))[0] == 5000
        await meta.close(opened, 5000)
        assert await meta.usage("/q") == (5000, 1) and await meta.problems() == []

    run(body)


# -- a seeded random exerciser against a model --------------------------------------------------------

def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory + "/")


def _moved(path: str, source: str, destination: str) -> str:
    return destination + path[len(source):] if _under(path, source) else path


class Model:
    """The namespace as paths, hard links included: each name leads to a file id, each file has a
    size and a home directory (where it was created or a name of its home last moved to; it stays
    when that name is removed while others remain, and moves up when its home is removed)."""

    def __init__(self) -> None:
        self.dirs: set[str] = {""}
        self.names: dict[str, int] = {}
        self.sizes: dict[int, int] = {}
        self.homes: dict[int, str] = {}
        self.limits: dict[str, tuple[int, int]] = {}
        self.next_id = 0

    def copy(self) -> Model:
        other = Model()
        other.dirs, other.names, other.limits = set(self.dirs), dict(self.names), dict(self.limits)
        other.sizes, other.homes, other.next_id = dict(self.sizes), dict(self.homes), self.next_id
        return other

    def usage(self, quota_dir: str) -> Usage:
        below = quota_dir + "/"
        entries = sum(1 for p in [*self.dirs, *self.names] if p.startswith(below))
        return Usage(sum(self.sizes[f] for f, home in self.homes.items() if _under(home, quota_dir)), entries)

    def create(self, path: str) -> None:
        self.next_id += 1
        self.names[path] = self.next_id
        self.sizes[self.next_id] = 0
        self.homes[self.next_id] = path.rsplit("/", 1)[0]

    def remove(self, path: str) -> None:
        file_id = self.names.pop(path)
        if file_id not in self.names.values():  # its last name: it counts nowhere
            del self.sizes[file_id], self.homes[file_id]

    def rmdir(self, path: str) -> None:
        self.dirs.remove(path)
        self.limits.pop(path, None)
        self.homes = {f: (path.rsplit("/", 1)[0] if home == path else home) for f, home in self.homes.items()}

    def move(self, source: str, destination: str) -> None:
        if source in self.names:
            file_id = self.names.pop(source)
            self.names[destination] = file_id
            if self.homes[file_id] == source.rsplit("/", 1)[0]:  # a name in its home moved: so does the home
                self.homes[file_id] = destination.rsplit("/", 1)[0]
            return
        self.dirs = {_moved(p, source, destination) for p in self.dirs}
        self.names = {_moved(p, source, destination): f for p, f in self.names.items()}
        self.homes = {f: _moved(home, source, destination) for f, home in self.homes.items()}
        self.limits = {_moved(p, source, destination): v for p, v in self.limits.items()}

    def fits(self, change: Callable[[Model], None]) -> bool:
        """Whether applying ``change`` keeps every quota within its limit where it grows."""
        after = self.copy()
        change(after)
        for directory, (bytes_limit, inodes_limit) in self.limits.items():
            if directory not in after.dirs:
                continue
            why = refusal(mpb.Quota(inode_id=1, bytes_limit=bytes_limit, inodes_limit=inodes_limit),
                          self.usage(directory), after.usage(directory))
            if why is not None:
                return False
        return True


async def _write_at_once(meta: Meta, model: Model, rng: random.Random, paths: list[str],
                         where: str) -> dict[str, int]:
    """Writers on ``paths`` (names of files) each ask a byte credit for a random growth, in a
    random order, before any publishes a length; the first one's answer is the model's, every
    answer keeps each quota within its limit, and each close publishes what its writer wrote."""
    outcomes = {"ran": 0, "refused": 0}
    opened = [await meta.open(p) for p in paths]
    ends = [model.sizes[model.names[p]] + rng.randrange(1, 300) for p in paths]
    granted: list[int] = []
    for index in rng.sample(range(len(paths)), len(paths)):
        file_id = model.names[paths[index]]

        def grow(m: Model, f: int = file_id, e: int = ends[index]) -> None:
            m.sizes[f] = max(m.sizes[f], e)

        expected = model.fits(grow)
        try:
            await meta.reserve(opened[index], ends[index])
            done = True
        except QuotaExceeded:
            done = False
        if not granted:
            assert done == expected, f"{where}: credit for {paths[index]} to {ends[index]}: {done}, model {expected}"
        outcomes["ran" if done else "refused"] += 1
        if done:
            granted.append(index)
        for directory, (bytes_limit, _) in model.limits.items():
            used = (await meta.usage(directory))[0]
            assert not bytes_limit or used <= max(bytes_limit, model.usage(directory).bytes), \
                f"{where}: {directory} uses {used} bytes with credits, past its limit {bytes_limit}"
    for index, handle in enumerate(opened):
        await meta.close(handle, ends[index] if index in granted else 0)
        if index in granted:
            file_id = model.names[paths[index]]
            model.sizes[file_id] = max(model.sizes[file_id], ends[index])
    return outcomes


async def exercise(meta: Meta, seed: int, steps: int) -> dict[str, int]:
    """Run ``steps`` random operations; returns how many ran and how many EDQUOT refused."""
    rng = random.Random(seed)
    outcomes = {"ran": 0, "refused": 0}
    model = Model()
    for directory, limits in (("/q", (rng.randrange(200, 900), rng.randrange(4, 10))), ("/q/n", (300, 5))):
        await meta.mkdir(directory)
        await meta.set(directory, *limits)
        model.dirs.add(directory)
        model.limits[directory] = limits
    await meta.mkdir("/o")  # outside every quota: where hard links lead out
    model.dirs.add("/o")
    names = ["a", "b", "c"]
    for step in range(steps):
        where = f"seed {seed} step {step}"
        dirs = sorted(model.dirs)
        parent = rng.choice(dirs)
        path = f"{parent}/{rng.choice(names)}"
        kind = rng.choice(["file", "file", "dir", "grow", "grow", "rm", "mv", "quota", "link", "rmdir", "write"])
        taken = path in model.dirs or path in model.names
        files = sorted(model.names)
        change: Callable[[Model], None] | None = None
        action: Callable[[], Awaitable[Any]] | None = None
        if kind == "file" and not taken:
            change, action = (lambda m, p=path: m.create(p)), (lambda p=path: meta.create(p))
        elif kind == "dir" and not taken:
            change, action = (lambda m, p=path: m.dirs.add(p)), (lambda p=path: meta.mkdir(p))
        elif kind == "grow" and files:
            target = rng.choice(files)
            size = model.sizes[model.names[target]] + rng.randrange(1, 200)
            change, action = (lambda m, p=target, s=size: m.sizes.__setitem__(m.names[p], s)), \
                (lambda p=target, s=size: meta.grow(p, s))
        elif kind == "rm" and files:
            target = rng.choice(files)
            change, action = (lambda m, p=target: m.remove(p)), (lambda p=target: meta.rm(p))
        elif kind == "link" and files and not taken:
            target = rng.choice(files)
            change, action = (lambda m, s=target, d=path: m.names.__setitem__(d, m.names[s])), \
                (lambda s=target, d=path: meta.link(s, d))
        elif kind == "rmdir":
            empty = [d for d in dirs[1:] if d not in model.limits
                     and not any(p.startswith(d + "/") for p in [*model.dirs, *model.names])]
            if empty:
                target = rng.choice(empty)
                change, action = (lambda m, p=target: m.rmdir(p)), (lambda p=target: meta.rm(p, directory=True))
        elif kind == "write" and files:
            outcome = await _write_at_once(meta, model, rng, rng.sample(files, min(len(files), 2)), where)
            outcomes["ran"] += outcome["ran"]
            outcomes["refused"] += outcome["refused"]
        elif kind == "mv" and not taken:
            source = rng.choice(files + dirs[1:]) if len(files) + len(dirs) > 1 else None
            if source is not None and not (path + "/").startswith(source + "/"):
                change, action = (lambda m, s=source, d=path: m.move(s, d)), (lambda s=source, d=path: meta.mv(s, d))
        elif kind == "quota" and len(dirs) > 1:
            quota_dir = rng.choice(dirs[1:])
            limits = (rng.randrange(1, 600), rng.randrange(1, 8))
            model.limits[quota_dir] = limits
            await meta.set(quota_dir, *limits)
        if change is not None and action is not None:
            expected = model.fits(change)
            try:
                await action()
                done = True
            except QuotaExceeded:
                done = False
            assert done == expected, f"{where}: {kind} {path}: ran {done}, model says {expected}"
            outcomes["ran" if done else "refused"] += 1
            if done:
                change(model)
        for directory in model.limits:
            got = await meta.usage(directory)
            want = model.usage(directory)
            assert got == (want.bytes, want.inodes), f"{where}: {directory} uses {got}, model {want}"
    assert await meta.problems() == []
    assert not (await meta.check()).problems
    return outcomes


@pytest.mark.parametrize("seed", range(int(os.environ.get("FS3_QUOTA_SEEDS", "4"))))
def test_random_operations_keep_usage_exact_and_within_limits(seed: int) -> None:
    steps = int(os.environ.get("FS3_QUOTA_STEPS", "120"))
    outcomes: dict[str, int] = {}

    async def body(meta: Meta) -> None:
        outcomes.update(await exercise(meta, seed, steps))

    run(body)
    assert outcomes["ran"] > 0 and outcomes["refused"] > 0, outcomes  # both sides of every check ran


def _seeds_failing_the_model(seeds: range, steps: int) -> int:
    """How many of ``seeds`` the exerciser's model check fails on (a planted bug must fail some)."""
    caught = 0
    for seed in seeds:
        async def body(meta: Meta, s: int = seed) -> None:
            await exercise(meta, s, steps)

        try:
            run(body)
        except AssertionError:
            caught += 1
    return caught


def test_the_exerciser_catches_a_planted_accounting_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries removed no longer counted: the model check must fail on some seed."""
    real = quota.Ledger.entry

    def forgetful(self: quota.Ledger, directory: int, delta: int) -> None:
        if delta > 0:
            real(self, directory, delta)

    monkeypatch.setattr(quota.Ledger, "entry", forgetful)
    assert _seeds_failing_the_model(range(4), steps=80) > 0


def test_the_exerciser_catches_credits_never_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A close that keeps its writer's credit: the model check must fail on some seed."""
    real = quota.settle_reservation

    async def keeping(ns: Namespace, inode_id: int, session_id: bytes, grown: int, closing: bool) -> None:
        await real(ns, inode_id, session_id, grown, False)

    monkeypatch.setattr(quota, "settle_reservation", keeping)
    assert _seeds_failing_the_model(range(4), steps=80) > 0


def test_cli_parses_every_quota_command() -> None:
    parser = build_parser()
    args = parser.parse_args(["quota", "set", "/d", "--bytes", "10M", "--inodes", "100"])
    assert (args.quota_command, args.path, args.bytes, args.inodes) == ("set", "/d", 10 << 20, 100)
    for argv in (["quota", "get", "/d"], ["quota", "list", "--json"], ["quota", "unset", "/d"],
                 ["quota", "check", "--repair"]):
        assert isinstance(parser.parse_args(argv), argparse.Namespace)

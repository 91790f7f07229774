"""The trash (fs3.meta.trash): removed files kept until they expire, listed, restored and purged.

The service's handlers are called as the RPC layer calls them, on the in-memory engine, with
meta's wall clock in the test's hand (time passes by setting it). No storage here: GC's part is
seen in its queue (a GC job is what frees chunks); tests/test_trash_cluster.py checks bytes and
chunks on a cluster.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from fs3 import meta_pb2 as mpb
from fs3.cli.main import build_parser
from fs3.common.errors import AlreadyExists, FS3Error, InvalidArgument, NotFound, NotPermitted, TxnConflict
from fs3.common.posix import O_CREAT, O_WRONLY, Caller
from fs3.kv.api import prefix_end
from fs3.meta import schema, trash
from fs3.meta.dump import DumpReader, dump_snapshot
from fs3.meta.fsck import run_fsck
from fs3.meta.ops import Namespace, OpEnv
from fs3.meta.service import MetaServiceConfig
from tests.meta_service import InMemoryMeta

CLIENT = b"t" * 16
T0_NS = 1_700_000_000 * 1_000_000_000
DAY_NS = trash.NS_PER_DAY


class Meta(InMemoryMeta):
    """A metadata service with a trash of ``trash_days`` and a wall clock set by the test."""

    def __init__(self, trash_days: float = 1.0) -> None:
        self.now_ns = T0_NS
        super().__init__(CLIENT, trash_days, wall_ns=lambda: self.now_ns)

    async def open(self, path: str, uid: int = 0) -> mpb.OpenRsp:
        rsp: mpb.OpenRsp = await self.call("open", mpb.OpenReq(ctx=self.ctx(uid), target=ref(path),
                                                               flags=O_CREAT | O_WRONLY, mode=0o644))
        return rsp

    async def close(self, opened: mpb.OpenRsp, uid: int = 0) -> None:
        await self.call("close", mpb.CloseReq(ctx=self.ctx(uid), inode_id=opened.inode.inode_id,
                                              session_id=opened.session_id))

    async def create(self, path: str, uid: int = 0) -> int:
        opened = await self.open(path, uid)
        await self.close(opened, uid)
        return int(opened.inode.inode_id)

    async def rm(self, path: str, uid: int = 0) -> None:
        await self.call("remove", mpb.RemoveReq(ctx=self.ctx(uid), target=ref(path)))

    async def mkdir(self, path: str, uid: int = 0) -> None:
        await self.call("make_node", mpb.MakeNodeReq(ctx=self.ctx(uid), target=ref(path), type=mpb.DIRECTORY,
                                                     mode=0o777))

    async def ls(self, path: str) -> list[bytes]:
        rsp = await self.call("read_dir", mpb.ReadDirReq(ctx=self.ctx(), dir=ref(path), limit=1000))
        return [bytes(e.name) for e in rsp.entries]

    async def entries(self, uid: int = 0, limit: int = 0) -> list[mpb.TrashEntry]:
        found: list[mpb.TrashEntry] = []
        after, more = 0, True
        while more:
            page = await self.call("trash_list", mpb.TrashListReq(ctx=self.ctx(uid), start_after=after, limit=limit))
            found.extend(page.entries)
            after, more = page.next_after, page.more
        return found

    async def restore(self, entry_id: int, to: str | None = None, uid: int = 0) -> mpb.Inode:
        req = mpb.TrashRestoreReq(ctx=self.ctx(uid), id=entry_id)
        if to is not None:
            req.to.CopyFrom(ref(to))
        return (await self.call("trash_restore", req)).inode  # type: ignore[no-any-return]

    async def purge(self, entry_id: int = 0, *, every: bool = False, expired: bool = False, uid: int = 0) -> int:
        purged, after, more = 0, 0, True
        while more:
            rsp = await self.call("trash_purge", mpb.TrashPurgeReq(ctx=self.ctx(uid), id=entry_id, all=every,
                                                                   expired=expired, start_after=after))
            purged += rsp.purged
            after, more = rsp.next_after, rsp.more
        return purged

    async def keys(self, prefix: bytes) -> list[bytes]:
        return [k for k, _ in await self.engine.begin().scan(prefix, prefix_end(prefix))]

    async def values(self, prefix: bytes) -> list[bytes]:
        return [v for _, v in await self.engine.begin().scan(prefix, prefix_end(prefix))]

    async def gc_queued(self) -> set[int]:
        prefix = schema.gc_prefix()
        return {int.from_bytes(k[len(prefix):], "big") for k in await self.keys(prefix)}

    async def inode_exists(self, inode_id: int) -> bool:
        return await self.engine.begin().get(schema.inode_key(inode_id)) is not None

    async def problems(self) -> list[str]:
        return list((await run_fsck(self.engine.begin())).problems)


def ref(path: str) -> mpb.PathRef:
    return mpb.PathRef(path=path.encode())


def run(body: Callable[[Meta], Awaitable[None]], trash_days: float = 1.0) -> None:
    async def main() -> None:
        meta = Meta(trash_days)
        await meta.service.start(background=False)
        await body(meta)

    asyncio.run(main())


# -- removal, listing, restore -----------------------------------------------------------------------


def test_a_removed_file_is_listed_and_restored_to_its_place() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        inode_id = await meta.create("/d/f", uid=1000)
        meta.now_ns += 5
        await meta.rm("/d/f", uid=1000)
        assert await meta.ls("/d") == [] and await meta.ls("/") == [b"d"]  # the trash shows nowhere
        assert await meta.gc_queued() == set() and await meta.inode_exists(inode_id)
        [entry] = await meta.entries(uid=1000)
        assert (entry.id, entry.path, entry.name, entry.uid) == (inode_id, b"/d/f", b"f", 1000)
        assert entry.removed_at_ns == T0_NS + 5 and entry.expires_at_ns == T0_NS + 5 + DAY_NS
        assert await meta.problems() == []
        restored = await meta.restore(entry.id, uid=1000)
        assert restored.inode_id == inode_id and restored.nlink == 1
        assert await meta.ls("/d") == [b"f"] and await meta.entries(uid=1000) == []
        assert await meta.keys(schema.trash_expiry_prefix()) == []
        assert await meta.problems() == []

    run(body)


def test_restore_never_replaces_a_name_and_to_puts_it_elsewhere() -> None:
    async def body(meta: Meta) -> None:
        first = await meta.create("/f")
        await meta.rm("/f")
        second = await meta.create("/f")  # the name is used again
        [entry] = await meta.entries()
        with pytest.raises(AlreadyExists, match=r"'/f' is taken.*--to"):  # a path, not a directory inode id
            await meta.restore(entry.id)
        with pytest.raises(AlreadyExists, match=r"'/f' is taken"):
            await meta.restore(entry.id, to="/f")
        assert (await meta.restore(entry.id, to="/f.old")).inode_id == first
        assert sorted(await meta.ls("/")) == [b"f", b"f.old"]
        lookup = await meta.call("lookup", mpb.LookupReq(ctx=meta.ctx(), target=ref("/f")))
        assert lookup.inode.inode_id == second

    run(body)


def test_restore_when_the_directory_is_gone_needs_to() -> None:
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.create("/d/f")
        await meta.rm("/d/f")
        await meta.call("remove", mpb.RemoveReq(ctx=meta.ctx(), target=ref("/d"), directory=True))
        [entry] = await meta.entries()
        with pytest.raises(NotFound, match=r"is gone.*--to"):
            await meta.restore(entry.id)
        await meta.restore(entry.id, to="/back")
        assert await meta.ls("/") == [b"back"]
        with pytest.raises(NotFound, match="no trash entry"):
            await meta.restore(entry.id, to="/again")

    run(body)


def test_a_removal_by_directory_inode_is_listed_under_its_directory_s_path() -> None:
    """A mount removes by directory inode and name: the entry records no path below the root, and
    the listing finds the directory's path (as it is now: where a restore puts the file back)."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/d")
        await meta.mkdir("/d/e")
        await meta.mkdir("/d/e/g")
        await meta.create("/top")
        await meta.create("/d/f")
        await meta.create("/d/e/g/h")
        await meta.create("/d/e/g/i")

        async def remove(directory: str, name: bytes) -> None:
            lookup = await meta.call("lookup", mpb.LookupReq(ctx=meta.ctx(), target=ref(directory)))
            await meta.call("remove", mpb.RemoveReq(ctx=meta.ctx(),
                                                    target=mpb.PathRef(parent=lookup.inode.inode_id, path=name)))
        await remove("/", b"top")
        await remove("/d", b"f")
        await remove("/d/e/g", b"h")
        await remove("/d/e/g", b"i")
        assert {bytes(e.name): trash.shown_path(e) for e in await meta.entries()} == {
            b"top": "/top", b"f": "/d/f", b"h": "/d/e/g/h", b"i": "/d/e/g/i"}
        stored = [mpb.TrashEntry.FromString(v) for v in await meta.values(schema.trash_prefix())]
        assert sorted(bytes(e.path) for e in stored) == [b"", b"", b"", b"/top"]  # found when listed
        await meta.call("rename", mpb.RenameReq(ctx=meta.ctx(), source=ref("/d/e"), destination=ref("/e2")))
        shown = {bytes(e.name): e for e in await meta.entries()}
        assert trash.shown_path(shown[b"h"]) == "/e2/g/h"
        await meta.restore(shown[b"h"].id)
        assert await meta.ls("/e2/g") == [b"h"]
        # A directory that is gone shows as its inode; restoring needs --to.
        g = (await meta.call("lookup", mpb.LookupReq(ctx=meta.ctx(), target=ref("/e2/g")))).inode.inode_id
        await meta.call("remove", mpb.RemoveReq(ctx=meta.ctx(), target=ref("/e2/g/h")))
        await meta.call("remove", mpb.RemoveReq(ctx=meta.ctx(), target=ref("/e2/g"), directory=True))
        shown = {bytes(e.name): e for e in await meta.entries()}
        assert trash.shown_path(shown[b"i"]) == f"<dir {g}>/i"
        assert trash.shown_path(shown[b"h"]) == "/e2/g/h"  # removed by path: recorded then

    run(body)


def test_a_listing_names_no_directory_the_user_could_not_list() -> None:
    """The walk up shows a user a directory's path only through directories it may read and
    search, as ``ls`` would: a directory root moved into a private one shows as ``<dir N>/name``,
    not with the names inside the private directory."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/pub")
        await meta.mkdir("/pub/d", uid=1000)
        await meta.create("/pub/d/f", uid=1000)
        d = (await meta.call("lookup", mpb.LookupReq(ctx=meta.ctx(), target=ref("/pub/d")))).inode.inode_id
        await meta.call("remove", mpb.RemoveReq(ctx=meta.ctx(1000), target=mpb.PathRef(parent=d, path=b"f")))
        assert [trash.shown_path(e) for e in await meta.entries(uid=1000)] == ["/pub/d/f"]
        await meta.mkdir("/private")
        await meta.mkdir("/private/payroll-2027")
        await meta.call("set_attr", mpb.SetAttrReq(ctx=meta.ctx(), target=ref("/private"), mask=mpb.SET_MODE,
                                                   mode=0o700))
        await meta.call("rename", mpb.RenameReq(ctx=meta.ctx(), source=ref("/pub/d"),
                                                destination=ref("/private/payroll-2027/d")))
        assert [trash.shown_path(e) for e in await meta.entries(uid=1000)] == [f"<dir {d}>/f"]
        assert [trash.shown_path(e) for e in await meta.entries()] == ["/private/payroll-2027/d/f"]  # root

    run(body)


def test_the_directory_walk_ends_on_a_cycle_of_parents() -> None:
    """A damaged store whose directories name each other as parents (which no rename makes, and
    fsck reports) ends the walk at its depth bound: the entry shows as ``<dir N>/name``."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/a")
        await meta.mkdir("/a/b")
        await meta.create("/a/b/f")
        a = (await meta.call("lookup", mpb.LookupReq(ctx=meta.ctx(), target=ref("/a")))).inode
        b = (await meta.call("lookup", mpb.LookupReq(ctx=meta.ctx(), target=ref("/a/b")))).inode
        await meta.call("remove", mpb.RemoveReq(ctx=meta.ctx(), target=mpb.PathRef(parent=b.inode_id, path=b"f")))
        txn = meta.engine.begin()
        a.parent = b.inode_id  # a in b, b in a
        txn.put(schema.inode_key(a.inode_id), a.SerializeToString())
        txn.put(schema.dentry_key(b.inode_id, b"a"),
                mpb.DirEntry(inode_id=a.inode_id, type=mpb.DIRECTORY).SerializeToString())
        await txn.commit()
        assert [trash.shown_path(e) for e in await meta.entries()] == [f"<dir {b.inode_id}>/f"]

    run(body)


def test_the_directory_walk_of_a_listing_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its budget of directory entries read, a listing shows ``<dir N>/name``."""
    async def body(meta: Meta) -> None:
        await meta.mkdir("/big")
        for i in range(40):
            await meta.mkdir(f"/big/s{i:02d}")
        await meta.create("/big/s39/f")
        s39 = (await meta.call("lookup", mpb.LookupReq(ctx=meta.ctx(), target=ref("/big/s39")))).inode.inode_id
        await meta.call("remove", mpb.RemoveReq(ctx=meta.ctx(), target=mpb.PathRef(parent=s39, path=b"f")))
        assert trash.shown_path((await meta.entries())[0]) == "/big/s39/f"
        monkeypatch.setattr(trash, "PATH_WALK_ENTRIES_MAX", 20)  # s39 is the 40th entry of /big
        assert trash.shown_path((await meta.entries())[0]) == f"<dir {s39}>/f"

    run(body)


def test_rename_over_a_file_puts_the_replaced_file_in_the_trash() -> None:
    async def body(meta: Meta) -> None:
        old = await meta.create("/target")
        await meta.create("/new")
        await meta.call("rename", mpb.RenameReq(ctx=meta.ctx(), source=ref("/new"), destination=ref("/target")))
        [entry] = await meta.entries()
        assert (entry.id, entry.path) == (old, b"/target")
        assert await meta.problems() == []

    run(body)


def test_a_hard_linked_file_goes_to_the_trash_with_its_last_name() -> None:
    async def body(meta: Meta) -> None:
        await meta.create("/a")
        await meta.call("link", mpb.LinkReq(ctx=meta.ctx(), source=ref("/a"), link=ref("/b")))
        await meta.rm("/a")
        assert await meta.entries() == []
        await meta.rm("/b")
        [entry] = await meta.entries()
        assert entry.name == b"b"

    run(body)


# -- users -------------------------------------------------------------------------------------------


def test_a_user_sees_and_touches_only_its_own_entries() -> None:
    async def body(meta: Meta) -> None:
        await meta.create("/alice", uid=1000)
        await meta.rm("/alice", uid=1000)
        await meta.create("/bob", uid=2000)
        await meta.rm("/bob", uid=2000)
        [alice] = await meta.entries(uid=1000)
        [bob] = await meta.entries(uid=2000)
        assert len(await meta.entries(uid=0)) == 2  # root sees all
        with pytest.raises(NotPermitted, match="belongs to uid 1000"):
            await meta.restore(alice.id, uid=2000)
        with pytest.raises(NotPermitted):
            await meta.purge(alice.id, uid=2000)
        assert await meta.purge(every=True, uid=2000) == 1  # bob's only
        assert [e.id for e in await meta.entries()] == [alice.id]
        assert await meta.purge(alice.id, uid=0) == 1  # root may
        assert await meta.gc_queued() == {alice.id, bob.id}

    run(body)


def test_purge_needs_exactly_one_choice() -> None:
    async def body(meta: Meta) -> None:
        with pytest.raises(InvalidArgument):
            await meta.call("trash_purge", mpb.TrashPurgeReq(ctx=meta.ctx(), all=True, expired=True))
        with pytest.raises(InvalidArgument):
            await meta.call("trash_purge", mpb.TrashPurgeReq(ctx=meta.ctx()))

    run(body)


# -- purge, expiry, GC -------------------------------------------------------------------------------


def test_purge_queues_gc_and_expiry_purges_in_order() -> None:
    async def body(meta: Meta) -> None:
        ids = []
        for i in range(3):
            ids.append(await meta.create(f"/f{i}"))
            await meta.rm(f"/f{i}")
            meta.now_ns += DAY_NS // 4
        assert await meta.gc_queued() == set()
        assert await meta.purge(ids[1]) == 1
        assert await meta.gc_queued() == {ids[1]} and not await meta.inode_exists(ids[1])
        meta.now_ns = T0_NS + DAY_NS  # the first entry expires now, the last one not yet
        assert await meta.service.run_trash_expiry_once() == 1
        assert await meta.gc_queued() == {ids[0], ids[1]}
        assert await meta.purge(expired=True) == 0
        meta.now_ns += DAY_NS
        assert await meta.purge(expired=True) == 1
        assert await meta.entries() == [] and await meta.gc_queued() == set(ids)
        assert await meta.problems() == []

    run(body)


def test_expiry_works_in_bounded_batches() -> None:
    async def body(meta: Meta) -> None:
        count = trash.TRASH_PURGE_BATCH * 2 + 3
        for i in range(count):
            await meta.create(f"/f{i}")
            await meta.rm(f"/f{i}")
        assert len(await meta.entries(limit=7)) == count  # paged
        meta.now_ns += DAY_NS
        assert await meta.service.run_trash_expiry_once(batches_max=1) == trash.TRASH_PURGE_BATCH
        assert await meta.service.run_trash_expiry_once() == count - trash.TRASH_PURGE_BATCH
        assert len(await meta.gc_queued()) == count

    run(body, trash_days=0.5)


def test_an_open_file_stays_until_its_last_close_after_a_purge() -> None:
    async def body(meta: Meta) -> None:
        opened = await meta.open("/f")
        await meta.rm("/f")
        [entry] = await meta.entries()
        await meta.purge(entry.id)
        assert await meta.inode_exists(entry.id) and await meta.gc_queued() == set()
        assert await meta.problems() == []
        await meta.close(opened)
        assert not await meta.inode_exists(entry.id) and await meta.gc_queued() == {entry.id}

    run(body)


def test_closing_a_trashed_file_keeps_it_in_the_trash() -> None:
    async def body(meta: Meta) -> None:
        opened = await meta.open("/f")
        await meta.rm("/f")
        await meta.close(opened)
        assert await meta.inode_exists(opened.inode.inode_id) and await meta.gc_queued() == set()
        await meta.restore(opened.inode.inode_id)
        assert await meta.ls("/") == [b"f"]

    run(body)


def test_with_the_trash_off_a_removal_queues_gc_at_once() -> None:
    async def body(meta: Meta) -> None:
        inode_id = await meta.create("/f")
        await meta.rm("/f")
        assert await meta.entries() == [] and await meta.gc_queued() == {inode_id}
        assert not await meta.inode_exists(inode_id)
        assert await meta.keys(schema.trash_prefix()) == []

    run(body, trash_days=0)


def test_trash_days_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="trash_days"):
        MetaServiceConfig(trash_days=-1).validate()
    assert trash.keep_ns(0.5) == DAY_NS // 2


# -- races -------------------------------------------------------------------------------------------


def test_a_purge_racing_a_restore_of_one_entry_has_one_winner() -> None:
    """Both transactions read the entry; the second to commit conflicts, and run again it finds
    the entry gone. Through the handlers, at once: exactly one succeeds."""
    async def body(meta: Meta) -> None:
        inode_id = await meta.create("/f")
        await meta.rm("/f")
        env = OpEnv(now_ns=meta.now_ns, caller=Caller(0, 0), trash_keep_ns=DAY_NS)
        first, second = meta.engine.begin(), meta.engine.begin()
        await trash.restore(Namespace(first, env), inode_id, None)
        await trash.purge(Namespace(second, env), inode_id)
        await first.commit()
        with pytest.raises(TxnConflict):
            await second.commit()
        assert await meta.ls("/") == [b"f"] and await meta.gc_queued() == set()

        await meta.rm("/f")
        outcomes = await asyncio.gather(meta.restore(inode_id), meta.purge(inode_id), return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(failed) == 1 and isinstance(failed[0], NotFound), outcomes
        restored = not isinstance(outcomes[0], BaseException)
        assert (await meta.ls("/") == [b"f"]) == restored
        assert (await meta.gc_queued() == {inode_id}) == (not restored)
        assert await meta.problems() == []

    run(body)


# -- fsck ----------------------------------------------------------------------------------------------


def test_fsck_knows_the_trash_and_catches_a_broken_one() -> None:
    async def body(meta: Meta) -> None:
        kept = await meta.create("/kept")
        await meta.rm("/kept")
        assert await meta.problems() == []
        [entry] = await meta.entries()
        txn = meta.engine.begin()
        txn.delete(schema.trash_expiry_key(entry.expires_at_ns, kept))  # an entry that never expires
        txn.put(schema.trash_key(999), mpb.TrashEntry(id=999, expires_at_ns=1).SerializeToString())  # dangling
        txn.put(schema.trash_expiry_key(1, 999), b"")
        txn.put(schema.gc_key(kept), b"")  # GC must never collect a trashed file
        await txn.commit()
        problems = "\n".join(await meta.problems())
        assert f"trash entry {kept} has no expiry key" in problems
        assert "trash entry 999: its inode does not exist" in problems
        assert f"inode {kept} is both in the trash and queued for GC" in problems
        # The broken entries neither break the listing nor stall expiry.
        assert sorted(e.id for e in await meta.entries()) == [kept, 999]
        stray = meta.engine.begin()
        stray.put(schema.trash_expiry_key(2, 998), b"")  # an expiry key without its entry
        await stray.commit()
        assert await meta.service.run_trash_expiry_once() == 1  # 999 dropped, 998's key deleted
        assert await meta.keys(schema.trash_expiry_prefix()) == []

    run(body)


def test_fsck_reports_a_removed_file_without_an_entry() -> None:
    async def body(meta: Meta) -> None:
        inode_id = await meta.create("/f")
        await meta.rm("/f")
        txn = meta.engine.begin()
        entry = mpb.TrashEntry.FromString(await txn.get(schema.trash_key(inode_id)) or b"")
        txn.delete(schema.trash_key(inode_id))
        txn.delete(schema.trash_expiry_key(entry.expires_at_ns, inode_id))
        await txn.commit()
        assert f"inode {inode_id} is unreachable and not open" in await meta.problems()

    run(body)


def test_the_cli_asks_for_exactly_one_purge_choice() -> None:
    parser = build_parser()
    parsed = parser.parse_args(["trash", "purge", "--all", "--dir", "x"])
    assert (parsed.service, parsed.trash_command, parsed.all, parsed.id, parsed.dir) == ("trash", "purge", True,
                                                                                          None, "x")
    assert parser.parse_args(["trash", "restore", "7", "--to", "/a"]).to == "/a"
    for bad in (["trash", "purge"], ["trash", "purge", "3", "--all"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


# -- dump and load -------------------------------------------------------------------------------------


def test_a_dump_keeps_the_trash_and_a_load_can_restore_from_it() -> None:
    """A trashed file is dumped as it is (not as the GC job of a file removed while open), with
    its entry and expiry key; the loaded meta lists it, restores it, and fsck finds it clean."""
    async def body(meta: Meta) -> None:
        inode_id = await meta.create("/f")
        await meta.rm("/f")
        lines: list[bytes] = []

        async def emit(line: bytes) -> None:
            lines.append(line)

        reader = await meta.engine.snapshot()
        try:
            stats = await dump_snapshot(reader, emit, "test", 1)
        finally:
            await reader.close()
        assert stats.open_removed == 0
        loaded = Meta()
        txn = loaded.engine.begin()
        for _, key, value in DumpReader().records(lines):
            txn.put(key, value)
        await txn.commit()
        [entry] = await loaded.entries()
        assert entry.id == inode_id and await loaded.gc_queued() == set()
        assert await loaded.problems() == []
        await loaded.restore(inode_id)
        assert await loaded.ls("/") == [b"f"]

    run(body)


# -- a seeded exerciser against a model ---------------------------------------------------------------


@dataclass
class Model:
    """What the namespace and the trash should hold: names -> file, trash id -> (name, expiry)."""

    names: dict[str, int]
    trashed: dict[int, tuple[str, int]]
    freed: set[int]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_match_a_model(seed: int) -> None:
    exercise(seed, 120)


@pytest.mark.skipif(not os.environ.get("FS3_TRASH_SEEDS"), reason="a long run: FS3_TRASH_SEEDS=N (make trash-long)")
def test_random_operations_match_a_model_long() -> None:
    """``make trash-long``: many seeds, many steps each (a failure names its seed and step)."""
    steps = int(os.environ.get("FS3_TRASH_STEPS", "400"))
    for seed in range(100, 100 + int(os.environ["FS3_TRASH_SEEDS"])):
        exercise(seed, steps)


def test_the_exerciser_catches_planted_bugs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model check is only as good as the bugs it catches: expiry that never purges, and a
    trashed file handed to GC, must each fail it."""
    async def never(ns: Namespace, limit: int = 0) -> int:
        return 0

    with monkeypatch.context() as patch:
        patch.setattr(trash, "expired_page", never)
        with pytest.raises(AssertionError):
            exercise(1, 120)
    put = trash.put

    def put_and_collect(txn: Any, entry: mpb.TrashEntry) -> None:
        put(txn, entry)
        txn.put(schema.gc_key(entry.id), b"")

    with monkeypatch.context() as patch:
        patch.setattr(trash, "put", put_and_collect)
        with pytest.raises(AssertionError):
            exercise(1, 120)


def exercise(seed: int, steps: int) -> None:
    """Random creates, removals, restores (in place or elsewhere), purges, clock ticks and expiry
    rounds, checked after every step against :class:`Model`: the listing, the directory, the GC
    queue, and fsck."""
    rng = random.Random(seed)

    async def body(meta: Meta) -> None:
        model = Model({}, {}, set())
        keep_ns = trash.keep_ns(0.001)
        for step in range(steps):
            op = rng.choice(["create", "create", "rm", "restore", "restore_to", "purge", "expire", "tick"])
            name = f"/f{rng.randrange(6)}"
            try:
                if op == "create":
                    if name in model.names:
                        continue
                    model.names[name] = await meta.create(name)
                elif op == "rm" and model.names:
                    victim = rng.choice(sorted(model.names))
                    await meta.rm(victim)
                    model.trashed[model.names.pop(victim)] = (victim, meta.now_ns + keep_ns)
                elif op in ("restore", "restore_to") and model.trashed:
                    entry_id = rng.choice(sorted(model.trashed))
                    where = model.trashed[entry_id][0] if op == "restore" else name
                    taken = where in model.names
                    try:
                        await meta.restore(entry_id, to=None if op == "restore" else where)
                    except AlreadyExists:
                        assert taken, f"seed {seed} step {step}: restore refused a free name"
                        continue
                    assert not taken, f"seed {seed} step {step}: restore replaced {where}"
                    del model.trashed[entry_id]
                    model.names[where] = entry_id
                elif op == "purge" and model.trashed:
                    entry_id = rng.choice(sorted(model.trashed))
                    await meta.purge(entry_id)
                    del model.trashed[entry_id]
                    model.freed.add(entry_id)
                elif op == "expire":
                    await meta.service.run_trash_expiry_once()
                    for entry_id, (_, expires) in list(model.trashed.items()):
                        if expires <= meta.now_ns:
                            del model.trashed[entry_id]
                            model.freed.add(entry_id)
                elif op == "tick":
                    meta.now_ns += rng.choice([1, keep_ns // 2, keep_ns])
            except FS3Error as exc:
                raise AssertionError(f"seed {seed} step {step} {op} {name}: {exc!r}") from exc
            listed = {e.id: (e.path.decode(), e.expires_at_ns) for e in await meta.entries()}
            assert listed == model.trashed, f"seed {seed} step {step} {op}"
            assert sorted(await meta.ls("/")) == sorted(n[1:].encode() for n in model.names), f"seed {seed} {step}"
            assert await meta.gc_queued() == model.freed, f"seed {seed} step {step} {op}"
            assert await meta.problems() == [], f"seed {seed} step {step} {op}"

    run(body, trash_days=0.001)

"""Metadata edge cases: names checked with inodes, deep trees, fsck on a live namespace, failed
O_TRUNC opens, impossible lengths, the xattr list limit, and setuid/setgid on writes."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from fs3 import meta_pb2 as mpb
from fs3.common.errors import (
    BadHandle,
    FileTooLarge,
    InvalidArgument,
    NotFound,
    NotPermitted,
    PermissionDenied,
    Unavailable,
    XattrTooLarge,
)
from fs3.common.ids import chunk_id
from fs3.common.layout import DEFAULT_CHUNK_SIZE_BYTES
from fs3.common.posix import O_CREAT, O_RDONLY, O_TRUNC, O_WRONLY, Caller
from fs3.kv.api import Transaction, prefix_end
from fs3.kv.txn import OptimisticTxnEngine, run_transaction
from fs3.meta import ops, schema
from fs3.meta.fsck import run_fsck
from fs3.meta.ops import Namespace
from fs3.meta.service import MetaService
from tests.test_meta_ops import CLIENT, Meta, _service, ref
from tests.test_meta_ops import ROOT as ROOT_CALLER

EMPTY = memoryview(b"")


def ctx(request_id: int, uid: int = 0, client: bytes = CLIENT) -> mpb.ReqCtx:
    return mpb.ReqCtx(user=mpb.User(uid=uid, gid=uid), client_id=client, request_id=request_id)


class Requests:
    """Handlers called as the RPC layer calls them, inside one event loop, for one client."""

    def __init__(self, service: MetaService, client: bytes = CLIENT) -> None:
        self.service = service
        self.client = client
        self.request_id = 0

    def ctx(self, uid: int = 0) -> mpb.ReqCtx:
        self.request_id += 1
        return ctx(self.request_id, uid, self.client)

    async def __call__(self, name: str, req: object) -> object:
        rsp, _ = await getattr(self.service, name)(req, EMPTY)
        return rsp

    async def mkdir(self, parent: int, name: bytes) -> int:
        rsp = await self("make_node", mpb.MakeNodeReq(ctx=self.ctx(), target=mpb.PathRef(parent=parent, path=name),
                                                      type=mpb.DIRECTORY, mode=0o755))
        assert isinstance(rsp, mpb.InodeRsp)
        return rsp.inode.inode_id

    async def rename(self, src_parent: int, src: bytes, dst_parent: int, dst: bytes) -> None:
        await self("rename", mpb.RenameReq(ctx=self.ctx(), source=mpb.PathRef(parent=src_parent, path=src),
                                           destination=mpb.PathRef(parent=dst_parent, path=dst)))


# -- an inode as reached through a name ------------------------------------------------------------


def test_a_reference_with_inode_and_name_must_still_match() -> None:
    meta = Meta()
    f = meta.create("/f").inode  # and kept open: the inode outlives its name
    g = meta.touch("/g")
    both = mpb.PathRef(inode_id=f.inode_id, parent=schema.ROOT_INODE, path=b"f")
    assert meta.run(lambda ns: ns.lookup(both, True)).inode_id == f.inode_id
    meta.run(lambda ns: ns.rename(ref("/g"), ref("/f"), 0))  # /f is now g
    assert meta.run(lambda ns: ns.lookup(mpb.PathRef(inode_id=f.inode_id), True)).nlink == 0

    def open_(r: mpb.PathRef) -> Callable[[Namespace], Awaitable[mpb.OpenRsp]]:
        return lambda ns: ns.open(r, O_RDONLY, 0, 0, b"s" * 24, CLIENT, 0)

    for stale in (both, mpb.PathRef(inode_id=f.inode_id, parent=schema.ROOT_INODE, path=b"missing")):
        with pytest.raises(NotFound):
            meta.run(open_(stale))
    assert meta.run(lambda ns: ns.lookup(mpb.PathRef(inode_id=g.inode_id, parent=schema.ROOT_INODE, path=b"f"),
                                         True)).inode_id == g.inode_id
    assert meta.fsck() == []


# -- directory trees deeper than one transaction walks ---------------------------------------------


def test_rename_into_a_tree_deeper_than_4096_levels_works_and_still_refuses_loops() -> None:
    """Linux has no depth limit: a rename deep down succeeds, and moving a directory under
    itself is EINVAL however deep; no transaction follows more than ANCESTOR_WALK_MAX links."""
    service, _ = _service()
    call = Requests(service)
    engine = service.engine
    assert isinstance(engine, OptimisticTxnEngine)
    begun: list[Any] = []
    real_begin = engine.begin

    def recording_begin() -> Any:
        begun.append(real_begin())
        return begun[-1]

    async def main() -> None:
        top = await call.mkdir(schema.ROOT_INODE, b"top")
        bottom = top
        for _ in range(4200):
            bottom = await call.mkdir(bottom, b"d")
        await call.mkdir(schema.ROOT_INODE, b"x")
        engine.begin = recording_begin  # type: ignore[method-assign]
        await call.rename(schema.ROOT_INODE, b"x", bottom, b"x")  # into the bottom: fine
        with pytest.raises(InvalidArgument):  # top under its own bottom: a loop
            await call.rename(schema.ROOT_INODE, b"top", bottom, b"top")
        engine.begin = real_begin  # type: ignore[method-assign]
        await call.mkdir(schema.ROOT_INODE, b"y")
        await call.rename(bottom, b"x", schema.ROOT_INODE, b"y")  # up again, over an empty directory

    asyncio.run(main())
    assert len(begun) > 8  # the walks took several transactions ...
    assert max(len(txn.read_keys) for txn in begun) < ops.ANCESTOR_WALK_MAX + 20  # ... each of them bounded
    assert not asyncio.run(service.fsck(mpb.FsckReq(), EMPTY))[0].problems


def test_a_directory_moved_during_the_walk_is_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk above the destination happens outside the rename's transaction; a directory
    moved meanwhile could make its answer wrong, so the rename walks again and refuses the loop."""
    monkeypatch.setattr(ops, "ANCESTOR_WALK_MAX", 2)
    import fs3.meta.service as service_module

    monkeypatch.setattr(service_module, "ANCESTOR_WALK_MAX", 2)
    service, _ = _service()
    call = Requests(service)
    walks: list[tuple[int, int]] = []

    async def main() -> None:
        chain = await call.mkdir(schema.ROOT_INODE, b"a")
        for _ in range(6):
            chain = await call.mkdir(chain, b"d")
        x = await call.mkdir(schema.ROOT_INODE, b"x")
        real_walk = service._walk_ancestry

        async def walk_then_move(start: int, ancestor: int) -> tuple[bytes, bool] | None:
            found = await real_walk(start, ancestor)
            walks.append((start, ancestor))
            if len(walks) == 1:
                assert found is not None and found[1] is False  # x is not above the chain: yet
                await call.rename(schema.ROOT_INODE, b"a", x, b"a")  # now it is
            return found

        service._walk_ancestry = walk_then_move  # type: ignore[method-assign]
        with pytest.raises(InvalidArgument):  # x into /x/a/d/.../d: a loop
            await call.rename(schema.ROOT_INODE, b"x", chain, b"x")
        assert len(walks) >= 2

    asyncio.run(main())
    assert not asyncio.run(service.fsck(mpb.FsckReq(), EMPTY))[0].problems


# -- an O_TRUNC open its caller sees fail ----------------------------------------------------------


def test_an_o_trunc_open_that_fails_leaves_no_session_behind_and_its_retry_truncates_nothing() -> None:
    """The open commits, then storage cannot cut the file: the caller gets the error, so the
    session must go (it would keep the file, even unlinked, as long as the client lives). A retry
    of the same request truncates nothing again — the file was written after the first truncate
    finished — and opens the inode the first attempt truncated, though its name now leads
    elsewhere; a further retry gets the same session."""
    service, store = _service()
    call = Requests(service)

    async def main() -> None:
        inode_id = await _file_of_500_bytes(call)

        async def storage_back(inode_id: int) -> None:
            """Storage holds nothing of this file: the job only has its size to apply."""
            async def done(txn: Transaction) -> None:
                raw = await txn.get(schema.truncate_key(inode_id))
                if raw is not None:
                    job = schema.TruncateJob.decode(raw)
                    await Namespace(txn, service._env(mpb.User())).complete_truncate(inode_id, job.size_gen)

            await run_transaction(service.engine, done)

        async def storage_down(inode_id: int) -> None:
            raise Unavailable("no chain can take the truncate")

        def sessions() -> list[bytes]:
            prefix = schema.session_prefix(inode_id)
            return [k for k, _ in store.scan(prefix, prefix_end(prefix))]

        service._run_truncate_locked = storage_down  # type: ignore[method-assign]
        reopen = mpb.OpenReq(ctx=call.ctx(), target=ref("/f"), flags=O_WRONLY | O_TRUNC)
        with pytest.raises(Unavailable):
            await call("open", reopen)
        assert sessions() == []
        assert store.get(schema.truncate_key(inode_id)) is not None  # the cut is still to be done
        with pytest.raises(Unavailable):  # a retry while storage is still down: the same
            await call("open", reopen)
        assert sessions() == []
        service._run_truncate_locked = storage_back  # type: ignore[method-assign]
        await service._finish_truncate(inode_id)  # the maintenance loop finishes the job
        assert store.get(schema.truncate_key(inode_id)) is None
        # Another client writes the file after the truncate, and the name moves to another file.
        other = Requests(service, client=b"o" * 16)
        rsp = await other("open", mpb.OpenReq(ctx=other.ctx(), target=ref("/f"), flags=O_WRONLY))
        assert isinstance(rsp, mpb.OpenRsp) and rsp.inode.size == 0
        await other("close", mpb.CloseReq(ctx=other.ctx(), inode_id=inode_id, session_id=rsp.session_id,
                                          length_hint=300, wrote=True, acked=True))
        await call("open", mpb.OpenReq(ctx=call.ctx(), target=ref("/g"), flags=O_CREAT | O_WRONLY, mode=0o644))
        await call("rename", mpb.RenameReq(ctx=call.ctx(), source=ref("/f"), destination=ref("/h")))
        await call("rename", mpb.RenameReq(ctx=call.ctx(), source=ref("/g"), destination=ref("/f")))

        again = await call("open", reopen)  # the client's retry of the same request
        assert isinstance(again, mpb.OpenRsp)
        assert again.inode.inode_id == inode_id and again.inode.size == 300  # not truncated a second time
        assert sessions() == [schema.session_key(inode_id, again.session_id)]
        assert await call("open", reopen) == again  # answered from the saved answer now
        await call("close", mpb.CloseReq(ctx=call.ctx(), inode_id=inode_id, session_id=again.session_id))

        service._run_truncate_locked = storage_down  # type: ignore[method-assign]
        with pytest.raises(Unavailable):
            await call("open", mpb.OpenReq(ctx=call.ctx(), target=ref("/h"), flags=O_WRONLY | O_TRUNC))
        await call("remove", mpb.RemoveReq(ctx=call.ctx(), target=ref("/h")))
        assert store.get(schema.inode_key(inode_id)) is None  # no session keeps it: its chunks go to GC
        assert store.get(schema.gc_key(inode_id)) is not None

    asyncio.run(main())
    assert not asyncio.run(service.fsck(mpb.FsckReq(), EMPTY))[0].problems


def test_a_retry_of_an_o_trunc_open_never_answers_with_the_session_a_failing_attempt_closes() -> None:
    """The client's open times out while meta's first attempt is still cutting the file, and it
    sends the same request again: the retry finds the saved answer and waits for the cut. The
    first attempt then fails and closes its session; the retry, which goes on once storage is
    back, must not answer with that closed session (the client would hold a handle with no
    session: writes dropped at close, an unlinked file collected under it)."""
    service, store = _service()
    call = Requests(service)

    async def main() -> None:
        inode_id = await _file_of_500_bytes(call)
        first_in, first_fails = asyncio.Event(), asyncio.Event()
        runs = [0]

        async def storage(inode_id: int) -> None:
            runs[0] += 1
            if runs[0] == 1:
                first_in.set()
                await first_fails.wait()
                raise Unavailable("storage stopped answering")

            async def done(txn: Transaction) -> None:  # storage holds nothing: apply the size
                raw = await txn.get(schema.truncate_key(inode_id))
                if raw is not None:
                    job = schema.TruncateJob.decode(raw)
                    await Namespace(txn, service._env(mpb.User())).complete_truncate(inode_id, job.size_gen)

            await run_transaction(service.engine, done)

        service._run_truncate_locked = storage  # type: ignore[method-assign]
        reopen = mpb.OpenReq(ctx=call.ctx(), target=ref("/f"), flags=O_WRONLY | O_TRUNC)
        first = asyncio.create_task(call("open", reopen))
        await first_in.wait()
        retry = asyncio.create_task(call("open", reopen))
        while (entry := service._truncate_locks.get(inode_id)) is None or entry.users < 2:
            await asyncio.sleep(0)  # the retry waits for the first attempt's cut
        first_fails.set()
        with pytest.raises(Unavailable):
            await first
        rsp = await retry
        assert isinstance(rsp, mpb.OpenRsp) and rsp.inode.inode_id == inode_id
        prefix = schema.session_prefix(inode_id)
        open_sessions = [k for k, _ in store.scan(prefix, prefix_end(prefix))]
        assert open_sessions == [schema.session_key(inode_id, rsp.session_id)], "the answer's session is closed"
        await call("close", mpb.CloseReq(ctx=call.ctx(), inode_id=inode_id, session_id=rsp.session_id))
        assert store.get(schema.inode_key(inode_id)) is not None

    asyncio.run(main())


# -- lengths no file can have ----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["sync", "close"])
@pytest.mark.parametrize("hint", [1 << 62, (DEFAULT_CHUNK_SIZE_BYTES << 32) + 1])
def test_a_length_past_the_largest_file_is_efbig_and_changes_nothing(method: str, hint: int) -> None:
    service, store = _service()  # 4 MiB chunks, 32-bit chunk indexes: files up to 2**54 bytes
    call = Requests(service)

    async def main() -> None:
        rsp = await call("open", mpb.OpenReq(ctx=call.ctx(), target=ref("/f"), flags=O_CREAT | O_WRONLY,
                                             mode=0o644))
        assert isinstance(rsp, mpb.OpenRsp)
        inode_id = rsp.inode.inode_id
        before = store.get(schema.inode_key(inode_id))
        req_type = mpb.SyncReq if method == "sync" else mpb.CloseReq
        for acked in (False, True):
            with pytest.raises(FileTooLarge) as info:
                await call(method, req_type(ctx=call.ctx(), inode_id=inode_id, session_id=rsp.session_id,
                                            length_hint=hint, wrote=True, acked=acked))
            assert info.value.errno == errno.EFBIG
        assert store.get(schema.inode_key(inode_id)) == before
        await call("close", mpb.CloseReq(ctx=call.ctx(), inode_id=inode_id, session_id=rsp.session_id))

    asyncio.run(main())


# -- the xattr list limit --------------------------------------------------------------------------


def test_listxattr_answers_at_most_64_kib_of_names_and_e2big_past_it() -> None:
    meta = Meta()
    meta.touch("/f", mode=0o666)
    names = [b"user.%03d." % i + b"n" * 240 for i in range(262)]  # 249 bytes and a NUL each: 65,500 in all

    def set_xattr(name: bytes) -> Callable[[Namespace], Awaitable[mpb.Inode]]:
        return lambda ns: ns.set_xattr(ref("/f"), True, name, b"v", 0)

    for name in names:
        meta.run(set_xattr(name))
    assert meta.run(lambda ns: ns.list_xattr(ref("/f"), True)) == names  # several pages, in order
    meta.run(lambda ns: ns.set_xattr(ref("/f"), True, b"trusted.hidden" + b"t" * 240, b"v", 0))
    alice = Caller(1000, 1000)
    assert meta.run(lambda ns: ns.list_xattr(ref("/f"), True), alice) == names  # trusted names are not hers
    with pytest.raises(XattrTooLarge) as info:  # root sees it too: 65,755 bytes, past 65,536
        meta.run(lambda ns: ns.list_xattr(ref("/f"), True))
    assert info.value.errno == errno.E2BIG
    more = b"user.more" + b"m" * 41  # 51 bytes with its NUL: 65,551
    meta.run(lambda ns: ns.set_xattr(ref("/f"), True, more, b"v", 0))
    with pytest.raises(XattrTooLarge):
        meta.run(lambda ns: ns.list_xattr(ref("/f"), True), alice)
    meta.run(lambda ns: ns.remove_xattr(ref("/f"), True, more))
    assert meta.run(lambda ns: ns.list_xattr(ref("/f"), True), alice) == names
    assert meta.fsck() == []


XATTR_TXN_WRITES_BOUND = 128  # two pages of attributes deleted, and the rest of the remove


def test_removing_an_inode_with_many_xattrs_stays_a_bounded_transaction() -> None:
    """Anyone who may write a file may set as many attributes on it as they like (each up to
    64 KiB). Its last unlink (or rmdir) must still be a transaction of bounded size: what one
    transaction cannot delete is left to the GC job, which deletes it a page at a time."""
    service, _ = _service()
    calls = Requests(service)
    value = b"v" * 1024
    count = 300

    async def main() -> None:
        inodes = {}
        for name in (b"d", b"f"):
            if name == b"d":
                inodes[name] = await calls.mkdir(schema.ROOT_INODE, name)
            else:
                rsp = await calls("make_node", mpb.MakeNodeReq(ctx=calls.ctx(), target=ref("/f"), type=mpb.FILE,
                                                               mode=0o644))
                assert isinstance(rsp, mpb.InodeRsp)
                inodes[name] = rsp.inode.inode_id
            for i in range(count):
                await calls("set_xattr", mpb.SetXattrReq(ctx=calls.ctx(), target=mpb.PathRef(parent=1, path=name),
                                                         name=b"user.%04d" % i, value=value))
        largest = [0]
        engine = service.engine
        assert isinstance(engine, OptimisticTxnEngine)
        original = engine.commit

        async def commit(txn: Any) -> None:
            largest[0] = max(largest[0], len(txn.writes))
            await original(txn)

        engine.commit = commit  # type: ignore[method-assign]
        await calls("remove", mpb.RemoveReq(ctx=calls.ctx(), target=ref("/d"), directory=True))
        await calls("remove", mpb.RemoveReq(ctx=calls.ctx(), target=ref("/f")))
        assert largest[0] <= XATTR_TXN_WRITES_BOUND, f"a transaction of {largest[0]} writes"
        assert (await run_fsck(service.engine.begin())).problems == []  # left to GC: no orphans
        await service.run_gc_once()  # the directory's job (the file's waits for storage)
        assert largest[0] <= XATTR_TXN_WRITES_BOUND
        txn = service.engine.begin()
        prefix = schema.xattr_prefix(inodes[b"d"])
        assert await txn.scan(prefix, prefix_end(prefix), limit=1) == []
        assert await txn.get(schema.gc_key(inodes[b"d"])) is None

    asyncio.run(main())


# -- setuid and setgid on writes -------------------------------------------------------------------


def test_writes_and_truncates_by_anyone_but_root_drop_setuid_and_setgid() -> None:
    """Linux (without CAP_FSETID): setuid always goes, setgid when the group may execute; root
    keeps both. Through a mount the kernel asks with a chmod that only clears those bits, which
    a writer that does not own the file may send; any other chmod stays the owner's."""
    meta = Meta()
    bob = Caller(1001, 1001)
    meta.touch("/f", mode=0o666)
    setattr, chmod, mode = _mode_helpers(meta, bob)

    chmod(0o6777)
    setattr(mask=mpb.SET_SIZE, size=0)  # truncate
    assert mode() == 0o0777
    chmod(0o6767)  # setgid without group execute is not a privilege: it stays
    setattr(mask=mpb.SET_SIZE, size=0)
    assert mode() == 0o2767
    chmod(0o6777)
    setattr(ROOT_CALLER, mask=mpb.SET_SIZE, size=0)
    assert mode() == 0o6777
    inode_id = meta.stat("/f").inode_id
    meta.run(lambda ns: ns.open(ref("/f"), O_WRONLY | O_TRUNC, 0, 0, b"b" * 24, CLIENT, 0, inode_id), bob)
    _complete_truncate(meta, inode_id)
    assert mode() == 0o0777
    chmod(0o6777)
    setattr(mask=mpb.SET_MODE, mode=0o0777)  # the kernel's request ahead of a write
    assert mode() == 0o0777
    chmod(0o6777)
    with pytest.raises(NotPermitted):  # anything more is a chmod, and bob does not own the file
        setattr(mask=mpb.SET_MODE, mode=0o0775)
    chmod(0o6775)  # bob may not write it now
    with pytest.raises(NotPermitted):
        setattr(mask=mpb.SET_MODE, mode=0o0775)
    assert mode() == 0o6775 and meta.stat("/f").uid == 0


async def _file_of_500_bytes(call: Requests) -> int:
    """``/f``, created, written to 500 bytes and closed; its inode id."""
    created = await call("open", mpb.OpenReq(ctx=call.ctx(), target=ref("/f"), flags=O_CREAT | O_WRONLY,
                                             mode=0o644))
    assert isinstance(created, mpb.OpenRsp)
    await call("close", mpb.CloseReq(ctx=call.ctx(), inode_id=created.inode.inode_id, session_id=created.session_id,
                                     length_hint=500, wrote=True, acked=True))
    return created.inode.inode_id


def _complete_truncate(meta: Meta, inode_id: int) -> None:
    """Apply a recorded truncate's size, as the service does once storage is cleared."""
    async def done(ns: Namespace) -> None:
        raw = await ns.txn.get(schema.truncate_key(inode_id))
        if raw is not None:
            await ns.complete_truncate(inode_id, schema.TruncateJob.decode(raw).size_gen)

    meta.run(done)


def _mode_helpers(meta: Meta, caller: Caller) -> tuple[Callable[..., mpb.Inode], Callable[[int], None],
                                                           Callable[[], int]]:
    def setattr(as_caller: Caller = caller, **fields: Any) -> mpb.Inode:
        req = mpb.SetAttrReq(target=ref("/f"), **fields)
        inode_id = meta.stat("/f").inode_id
        inode: mpb.Inode = meta.run(lambda ns: ns.setattr(req, inode_id), as_caller)
        _complete_truncate(meta, inode_id)  # storage holds nothing of the file
        return inode

    def chmod(mode: int) -> None:
        setattr(ROOT_CALLER, mask=mpb.SET_MODE, mode=mode)

    def mode() -> int:
        return meta.stat("/f").mode

    return setattr, chmod, mode


def test_a_client_drops_setuid_and_setgid_before_its_first_write() -> None:
    """SET_DROP_PRIVILEGES: what the client library sends before a handle's first write; it needs
    write permission or a handle open for writing, and does nothing for root."""
    meta = Meta()
    bob = Caller(1001, 1001)
    meta.touch("/f", mode=0o666)
    setattr, chmod, mode = _mode_helpers(meta, bob)
    for kept_by_root in (True, False):
        chmod(0o6777)
        setattr(ROOT_CALLER if kept_by_root else bob, mask=mpb.SET_DROP_PRIVILEGES)
        assert mode() == (0o6777 if kept_by_root else 0o0777)
    chmod(0o6767)
    setattr(mask=mpb.SET_DROP_PRIVILEGES)
    assert mode() == 0o2767
    chmod(0o6775)  # bob may not write it now
    with pytest.raises(PermissionDenied):
        setattr(mask=mpb.SET_DROP_PRIVILEGES)
    session = meta.run(lambda ns: ns.open(ref("/f"), O_RDONLY, 0, 0, b"r" * 24, CLIENT, 0), bob).session_id
    with pytest.raises(BadHandle):  # a read-only handle does not count
        setattr(mask=mpb.SET_DROP_PRIVILEGES, session_id=session)
    writer = meta.run(lambda ns: ns.open(ref("/f"), O_WRONLY, 0, 0, b"w" * 24, CLIENT, 0), ROOT_CALLER).session_id
    setattr(mask=mpb.SET_DROP_PRIVILEGES, session_id=writer)  # a handle opened for writing before the chmod
    assert mode() == 0o0775


# -- fsck ------------------------------------------------------------------------------------------


def fsck_with_chunks(meta: Meta, listing: Callable[[], Awaitable[list[tuple[int, bytes]]]],
                     on_storage: set[bytes]) -> list[str]:
    async def exists(chain_id: int, cid: bytes) -> bool:
        return cid in on_storage

    return list(asyncio.run(run_fsck(meta.engine.begin(), listing, meta.engine.begin, exists)).problems)


def test_fsck_reports_no_orphan_for_a_file_created_while_it_runs() -> None:
    """The namespace is read, then storage listed; a file created in between has chunks and no
    inode in that first read. Real orphans (no inode, no GC job, still on storage) are reported."""
    meta = Meta()
    kept = meta.touch("/kept")
    queued = meta.touch("/queued")
    meta.run(lambda ns: ns.remove(ref("/queued"), False))  # its chunks wait for GC: not orphans
    finished = meta.touch("/finished")
    created: list[int] = []
    on_storage = {chunk_id(kept.inode_id, 0), chunk_id(queued.inode_id, 0), chunk_id(finished.inode_id, 0),
                  chunk_id(999_999, 3)}

    async def listing_while_the_namespace_changes() -> list[tuple[int, bytes]]:
        async def create(txn: Transaction) -> mpb.OpenRsp:
            env = ops.OpEnv(now_ns=meta.now_ns, caller=ROOT_CALLER, chain_tables={1: [11, 12, 13, 14]})
            return await ops.Namespace(txn, env).open(ref("/new"), O_CREAT | O_WRONLY, 0o644, 5000, b"n" * 24,
                                                      CLIENT, 0)

        async def remove_and_collect(txn: Transaction) -> None:
            env = ops.OpEnv(now_ns=meta.now_ns, caller=ROOT_CALLER)
            await ops.Namespace(txn, env).remove(ref("/finished"), False)
            txn.delete(schema.gc_key(finished.inode_id))  # GC already removed its chunks

        created.append((await run_transaction(meta.engine, create)).inode.inode_id)
        on_storage.add(chunk_id(created[0], 0))
        await run_transaction(meta.engine, remove_and_collect)
        listed = sorted(on_storage)
        on_storage.discard(chunk_id(finished.inode_id, 0))
        return [(11, cid) for cid in listed]

    problems = fsck_with_chunks(meta, listing_while_the_namespace_changes, on_storage)
    assert problems == ["chunk 3 of inode 999999 has no live inode (orphan)"]
    assert created == [5000]


def test_fsck_finds_directories_detached_in_a_cycle() -> None:
    """/a/b with a file inside, then damaged: a's entry moved from the root into b. Every count
    still adds up (each directory has one name, nlink matches), but nothing is reachable."""
    meta = Meta()
    a = meta.mkdir("/a")
    b = meta.mkdir("/a/b")
    f = meta.touch("/a/b/f")
    assert meta.fsck() == []

    async def damage(txn: Transaction) -> None:
        ns = ops.Namespace(txn, ops.OpEnv(now_ns=meta.now_ns, caller=ROOT_CALLER))
        root, dir_a, dir_b = [await ns.inode(i) for i in (schema.ROOT_INODE, a.inode_id, b.inode_id)]
        txn.delete(schema.dentry_key(schema.ROOT_INODE, b"a"))
        ns.put_entry(b.inode_id, b"a", dir_a)
        root.nlink -= 1
        dir_b.nlink += 1
        dir_a.parent = b.inode_id
        for inode in (root, dir_a, dir_b):
            ns.touch(inode)
        ns.flush()

    asyncio.run(run_transaction(meta.engine, damage))
    assert meta.fsck() == [
        f"directory {a.inode_id} is not reachable from the root (its names form a detached cycle)",
        f"directory {b.inode_id} is not reachable from the root (its names form a detached cycle)",
        f"inode {f.inode_id} is not reachable from the root: every directory naming it is detached",
    ]


def test_fsck_needs_a_way_to_confirm_orphans() -> None:
    async def nothing() -> list[tuple[int, bytes]]:
        return []

    with pytest.raises(InvalidArgument):
        asyncio.run(run_fsck(Meta().engine.begin(), nothing))

"""Metadata edge cases: names checked with inodes, deep trees, fsck on a live namespace, failed
O_TRUNC opens, impossible lengths, the xattr list limit, and setuid/setgid on writes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fs3 import meta_pb2 as mpb
from fs3.common.errors import InvalidArgument, NotFound
from fs3.kv.txn import OptimisticTxnEngine
from fs3.meta import ops, schema
from fs3.meta.ops import O_RDONLY
from fs3.meta.service import MetaService
from tests.test_meta_ops import CLIENT, Meta, _service, ref

EMPTY = memoryview(b"")


def ctx(request_id: int, uid: int = 0) -> mpb.ReqCtx:
    return mpb.ReqCtx(user=mpb.User(uid=uid, gid=uid), client_id=CLIENT, request_id=request_id)


class Requests:
    """Handlers called as the RPC layer calls them, inside one event loop."""

    def __init__(self, service: MetaService) -> None:
        self.service = service
        self.request_id = 0

    def ctx(self, uid: int = 0) -> mpb.ReqCtx:
        self.request_id += 1
        return ctx(self.request_id, uid)

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
    f = meta.touch("/f")
    g = meta.touch("/g")
    both = mpb.PathRef(inode_id=f.inode_id, parent=schema.ROOT_INODE, path=b"f")
    assert meta.run(lambda ns: ns.lookup(both, True)).inode_id == f.inode_id
    meta.run(lambda ns: ns.rename(ref("/g"), ref("/f"), 0))  # /f is now g
    for stale in (both, mpb.PathRef(inode_id=f.inode_id, parent=schema.ROOT_INODE, path=b"missing")):
        with pytest.raises(NotFound):
            meta.run(lambda ns, r=stale: ns.open(r, O_RDONLY, 0, 0, b"s" * 24, CLIENT, 0))
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

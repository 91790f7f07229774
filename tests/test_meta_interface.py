"""The client's one door to metadata: :class:`fs3.client.meta.Meta`.

Two things are pinned here. Every typed method sends the RPC the Meta service declares, with its
request and answer types, for the user asked (a fake transport records what is sent). And no code
in the ``fs3`` package names a metadata RPC by string or builds a metadata request itself outside
the typed interface (an AST check over the package, which must also reject known-bad sources).
"""

from __future__ import annotations

import ast
import asyncio
import errno
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from google.protobuf.message import Message

import fs3
from fs3 import meta_pb2 as mpb
from fs3.client.fs import AsyncFileSystem
from fs3.client.meta import DirPage, Meta, name_ref, path_ref
from fs3.client.meta_client import MetaClient
from fs3.common.errors import NotFound

PACKAGE = Path(fs3.__file__).parent
# Where raw metadata requests belong: the typed interface, the transport under it (which renews
# the lease itself), the simulator's harness (it drives raw requests to check meta), and meta's
# server side.
ALLOWED = ("client/meta.py", "client/meta_client.py", "sim/", "meta/")
_META_SERVICE = mpb.DESCRIPTOR.services_by_name["Meta"]
META_REQUESTS = frozenset(m.input_type.name for m in _META_SERVICE.methods)
META_METHODS = frozenset(m.name for m in _META_SERVICE.methods)
# Names under which code holds the metadata transport.
_TRANSPORT_NAMES = frozenset({"meta", "meta_client"})


def raw_meta_calls(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` reaches metadata around the typed interface, one line per place:

    * ``X.call("Name", ...)``: a Meta RPC named by string, whatever ``X`` is (mgmtd's calls go
      through :class:`~fs3.client.mgmtd.MgmtdCaller`, which takes names of mgmtd's methods);
    * ``meta.call(...)`` / ``self.fs.meta.call(...)``: the transport called directly, however
      the method is named;
    * ``mpb.OpenReq(...)`` (any request message of the Meta service): a request built by hand.
    """
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call":
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value in META_METHODS:
                found.append(f"{filename}:{node.lineno}: RPC named by string: {first.value!r}")
                continue
            holder = node.func.value
            name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", None)
            if name in _TRANSPORT_NAMES:
                found.append(f"{filename}:{node.lineno}: the metadata transport called directly ({name}.call)")
        elif isinstance(node, ast.Attribute) and node.attr in META_REQUESTS:
            found.append(f"{filename}:{node.lineno}: metadata request built by hand ({node.attr})")
    return found


def test_no_raw_metadata_calls_outside_the_typed_interface() -> None:
    found: list[str] = []
    checked = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(ALLOWED) or relative.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        checked += 1
        found += raw_meta_calls(path.read_text(), f"fs3/{relative}")
    assert checked > 50  # the walk found the package
    assert not found, "\n".join(found)


@pytest.mark.parametrize("bad", [
    'async def f(self):\n    return await self.fs.meta.call("Open", req, mpb.OpenRsp)\n',
    'async def f(meta):\n    await meta.call("Fsck", req, rsp)\n',
    'async def f(client):\n    await client.call("Lookup", req, rsp, user)\n',
    'async def f(self, name):\n    await self.fs.meta.call(name, req, mpb.InodeRsp)\n',
    'async def f(meta_client, name):\n    await meta_client.call(name, req, rsp)\n',
    'def f(inode_id):\n    return mpb.SyncReq(inode_id=inode_id)\n',
    'def f():\n    return meta_pb2.FsckReq(check_chunks=True)\n',
])
def test_the_check_rejects_raw_metadata_calls(bad: str) -> None:
    assert len(raw_meta_calls(bad)) == 1


@pytest.mark.parametrize("good", [
    'async def f(self):\n    return await self.fs.metadata.open(path_ref(b"/a"), 0)\n',
    'async def f(channel):\n    await channel.call(_UPDATE, req, data, timeout_ms=1)\n',
    'async def f(channel):\n    await channel.call(_MGMTD.method("GetRoutingInfo"), req)\n',
    'async def f(mgmtd):\n    await mgmtd.call("GetRoutingInfo", req)\n',
    'def f():\n    return mpb.HeartbeatReq()\n',
    'def f(rsp: mpb.OpenRsp) -> mpb.Inode:\n    return rsp.inode\n',
])
def test_the_check_accepts_the_typed_interface_and_other_services(good: str) -> None:
    assert raw_meta_calls(good) == []


# -- every typed method sends what the service declares ------------------------------------------

@dataclass
class _Sent:
    name: str
    req: Message
    rsp_type: type[Message]
    user: mpb.User | None


class _Recorder:
    """Stands in for :class:`MetaClient`: records each call and answers an empty message."""

    def __init__(self) -> None:
        self.sent: list[_Sent] = []

    async def call(self, name: str, req: Message, rsp_type: type[Message], user: mpb.User | None = None) -> Message:
        self.sent.append(_Sent(name, req, rsp_type, user))
        return rsp_type()


ALICE = mpb.User(uid=1000, gid=1000, groups=[1000, 27])

# One call of every typed method, with arguments, and the request it must send.
CASES: dict[str, tuple[Any, Message]] = {
    "statfs": (lambda m: m.statfs(ALICE, inode_id=3), mpb.StatFsReq(inode_id=3)),
    "lookup": (lambda m: m.lookup(path_ref(b"/a/b"), follow=True, user=ALICE),
               mpb.LookupReq(target=mpb.PathRef(path=b"/a/b"), follow=True)),
    "batch_stat": (lambda m: m.batch_stat([5, 7], ALICE), mpb.BatchStatReq(inode_ids=[5, 7])),
    "set_attr": (lambda m: m.set_attr(9, mpb.SET_SIZE | mpb.SET_MODE, mode=0o640, size=100, session_id=b"s" * 24,
                                      user=ALICE),
                 mpb.SetAttrReq(target=mpb.PathRef(inode_id=9), mask=mpb.SET_SIZE | mpb.SET_MODE, mode=0o640,
                                size=100, session_id=b"s" * 24)),
    "read_link": (lambda m: m.read_link(9, ALICE), mpb.ReadLinkReq(target=mpb.PathRef(inode_id=9))),
    "make_node": (lambda m: m.make_node(name_ref(1, b"l"), mpb.SYMLINK, mode=0o777, symlink_target=b"t", user=ALICE),
                  mpb.MakeNodeReq(target=mpb.PathRef(parent=1, path=b"l"), type=mpb.SYMLINK, mode=0o777,
                                  symlink_target=b"t")),
    "link": (lambda m: m.link(9, name_ref(1, b"n"), ALICE),
             mpb.LinkReq(source=mpb.PathRef(inode_id=9), link=mpb.PathRef(parent=1, path=b"n"))),
    "remove": (lambda m: m.remove(name_ref(1, b"d"), directory=True, user=ALICE),
               mpb.RemoveReq(target=mpb.PathRef(parent=1, path=b"d"), directory=True)),
    "remove_entry": (lambda m: m.remove_entry(name_ref(1, b"f"), user=ALICE),
                     mpb.RemoveReq(target=mpb.PathRef(parent=1, path=b"f"))),
    "rename": (lambda m: m.rename(path_ref(b"/a"), path_ref(b"/b"), flags=mpb.RENAME_NOREPLACE, user=ALICE),
               mpb.RenameReq(source=mpb.PathRef(path=b"/a"), destination=mpb.PathRef(path=b"/b"),
                             flags=mpb.RENAME_NOREPLACE)),
    "read_dir": (lambda m: m.read_dir(1, start_after=b"m", limit=10, with_attrs=True, user=ALICE),
                 mpb.ReadDirReq(dir=mpb.PathRef(inode_id=1), start_after=b"m", limit=10, with_attrs=True)),
    "open": (lambda m: m.open(mpb.PathRef(parent=1, path=b"f", inode_id=9), 0o1101, mode=0o600, user=ALICE),
             mpb.OpenReq(target=mpb.PathRef(parent=1, path=b"f", inode_id=9), flags=0o1101, mode=0o600)),
    "sync": (lambda m: m.sync(9, b"s" * 24, length_hint=4096, wrote=True, acked=True, user=ALICE),
             mpb.SyncReq(inode_id=9, session_id=b"s" * 24, length_hint=4096, wrote=True, acked=True)),
    "close": (lambda m: m.close(9, b"s" * 24, length_hint=10, wrote=True, acked=False, user=ALICE),
              mpb.CloseReq(inode_id=9, session_id=b"s" * 24, length_hint=10, wrote=True, acked=False)),
    "close_sessions": (lambda m: m.close_sessions([(9, b"s" * 24), (10, b"t" * 24)], user=ALICE),
                       mpb.CloseSessionsReq(sessions=[mpb.CloseReq(inode_id=9, session_id=b"s" * 24),
                                                      mpb.CloseReq(inode_id=10, session_id=b"t" * 24)])),
    "get_xattr": (lambda m: m.get_xattr(9, b"user.x", follow=True, user=ALICE),
                  mpb.GetXattrReq(target=mpb.PathRef(inode_id=9), name=b"user.x", follow=True)),
    "set_xattr": (lambda m: m.set_xattr(9, b"user.x", b"v", flags=mpb.XATTR_CREATE, user=ALICE),
                  mpb.SetXattrReq(target=mpb.PathRef(inode_id=9), name=b"user.x", value=b"v",
                                  flags=mpb.XATTR_CREATE)),
    "list_xattr": (lambda m: m.list_xattr(path_ref(b"/a"), follow=True, user=ALICE),
                   mpb.ListXattrReq(target=mpb.PathRef(path=b"/a"), follow=True)),
    "remove_xattr": (lambda m: m.remove_xattr(9, b"user.x", user=ALICE),
                     mpb.RemoveXattrReq(target=mpb.PathRef(inode_id=9), name=b"user.x")),
    "set_layout": (lambda m: m.set_layout(path_ref(b"/d"), mpb.Layout(chunk_size=1 << 20), ALICE),
                   mpb.SetLayoutReq(dir=mpb.PathRef(path=b"/d"), layout=mpb.Layout(chunk_size=1 << 20))),
    "fsck": (lambda m: m.fsck(False), mpb.FsckReq(check_chunks=False)),
    "who_am_i": (lambda m: m.who_am_i(), mpb.WhoAmIReq()),
    "add_user": (lambda m: m.add_user("alice", 1000, 100, [27], comment="c"),
                 mpb.AddUserReq(name="alice", uid=1000, gid=100, groups=[27], comment="c")),
    "list_users": (lambda m: m.list_users(start_after="00000000000000aa", limit=5),
                   mpb.ListUsersReq(start_after="00000000000000aa", limit=5)),
    "remove_user": (lambda m: m.remove_user("00000000000000aa"), mpb.UserIdReq(token_id="00000000000000aa")),
    "rotate_user": (lambda m: m.rotate_user("00000000000000aa"), mpb.UserIdReq(token_id="00000000000000aa")),
    "grant_capability": (lambda m: m.grant_capability(9, mpb.CAPABILITY_READ, b"s" * 24, b"old", user=ALICE),
                         mpb.GrantCapabilityReq(inode_id=9, access=mpb.CAPABILITY_READ, session_id=b"s" * 24,
                                                previous=b"old")),
    "trash_list": (lambda m: m.trash_list(start_after=7, limit=5, user=ALICE),
                   mpb.TrashListReq(start_after=7, limit=5)),
    "trash_restore": (lambda m: m.trash_restore(9, path_ref(b"/r"), user=ALICE),
                      mpb.TrashRestoreReq(id=9, to=mpb.PathRef(path=b"/r"))),
    "trash_purge": (lambda m: m.trash_purge(all_entries=True, start_after=3, user=ALICE),
                    mpb.TrashPurgeReq(all=True, start_after=3)),
    "quota_set": (lambda m: m.quota_set(path_ref(b"/q"), bytes_limit=10, inodes_limit=2, user=ALICE),
                  mpb.QuotaSetReq(target=mpb.PathRef(path=b"/q"), bytes_limit=10, inodes_limit=2)),
    "quota_get": (lambda m: m.quota_get(7, user=ALICE), mpb.QuotaReq(target=mpb.PathRef(inode_id=7))),
    "quota_list": (lambda m: m.quota_list(user=ALICE), mpb.QuotaListReq()),
    "quota_unset": (lambda m: m.quota_unset(path_ref(b"/q"), user=ALICE),
                    mpb.QuotaReq(target=mpb.PathRef(path=b"/q"))),
    "quota_check": (lambda m: m.quota_check(repair=True, user=ALICE), mpb.QuotaCheckReq(repair=True)),
    "quota_reserve": (lambda m: m.quota_reserve(7, b"s", 100, user=ALICE),
                      mpb.QuotaReserveReq(inode_id=7, session_id=b"s", end=100)),
}
# The calls made as the client itself, never for a caller: fsck, and identity and the user table.
_OWN_CALLS = frozenset({"fsck", "who_am_i", "add_user", "list_users", "remove_user", "rotate_user"})


def _operations() -> list[str]:
    """Meta's public coroutine methods: one per metadata operation (the lease ones excepted)."""
    return sorted(name for name, member in inspect.getmembers(Meta, inspect.iscoroutinefunction)
                  if not name.startswith("_") and name not in {"ensure_lease", "renew", "stop"})


def test_every_typed_method_is_covered_here() -> None:
    assert _operations() == sorted(CASES)


@pytest.mark.parametrize("operation", sorted(CASES))
def test_each_typed_method_sends_the_rpc_the_service_declares(operation: str) -> None:
    recorder = _Recorder()
    meta = Meta(cast(MetaClient, recorder))
    invoke, expected = CASES[operation]
    asyncio.run(invoke(meta))
    [sent] = recorder.sent
    method = _META_SERVICE.methods_by_name[sent.name]
    assert sent.req.DESCRIPTOR is method.input_type and sent.rsp_type.DESCRIPTOR is method.output_type
    assert sent.req == expected
    # The FUSE daemon acts for each caller: the user goes with the call (except the client's own calls).
    assert sent.user == (None if operation in _OWN_CALLS else ALICE)


def test_every_rpc_but_the_lease_renewal_has_a_typed_method() -> None:
    recorder = _Recorder()
    meta = Meta(cast(MetaClient, recorder))
    for invoke, _ in CASES.values():
        asyncio.run(invoke(meta))
    assert {s.name for s in recorder.sent} == {m.name for m in _META_SERVICE.methods} - {"RenewClient"}


def test_results_are_typed() -> None:
    class Answering(_Recorder):
        async def call(self, name: str, req: Message, rsp_type: type[Message],
                       user: mpb.User | None = None) -> Message:
            await super().call(name, req, rsp_type, user)
            if rsp_type is mpb.ReadDirRsp:
                return mpb.ReadDirRsp(entries=[mpb.DirEntry(name=b"a", inode_id=3)], more=True)
            if rsp_type is mpb.BatchStatRsp:
                return mpb.BatchStatRsp(inodes=[mpb.Inode(inode_id=5), mpb.Inode()])
            if rsp_type is mpb.InodeRsp:
                return mpb.InodeRsp(inode=mpb.Inode(inode_id=7))
            if rsp_type is mpb.RemoveRsp:
                return mpb.RemoveRsp(inode_id=8)
            return rsp_type()

    meta = Meta(cast(MetaClient, Answering()))

    async def body() -> None:
        page = await meta.read_dir(1, limit=10, with_attrs=False)
        assert page == DirPage([mpb.DirEntry(name=b"a", inode_id=3)], True)
        assert [i.inode_id for i in await meta.batch_stat([5, 6])] == [5, 0]
        assert (await meta.lookup(path_ref(b"/x"))).inode_id == 7
        assert await meta.remove(path_ref(b"/x")) == 8

    asyncio.run(body())


# -- errors: FS3Error from Meta, OSError from the public API --------------------------------------

class _Failing(_Recorder):
    """A transport on which every metadata call fails the way meta answers a missing name."""

    async def call(self, name: str, req: Message, rsp_type: type[Message], user: mpb.User | None = None) -> Message:
        await super().call(name, req, rsp_type, user)
        raise NotFound(f"{name}: no such file")

    async def stop(self) -> None:
        return None


def test_meta_raises_fs3_errors() -> None:
    meta = Meta(cast(MetaClient, _Failing()))
    with pytest.raises(NotFound):
        asyncio.run(meta.lookup(path_ref(b"/a")))


PUBLIC_CALLS: dict[str, Callable[[AsyncFileSystem], Awaitable[object]]] = {
    "stat": lambda fs: fs.stat("/a"),
    "lstat": lambda fs: fs.lstat("/a"),
    "statvfs": lambda fs: fs.statvfs("/"),
    "listdir": lambda fs: fs.listdir("/d"),
    "scandir": lambda fs: fs.scandir("/d"),
    "mkdir": lambda fs: fs.mkdir("/d/e"),
    "rmdir": lambda fs: fs.rmdir("/d"),
    "remove": lambda fs: fs.remove("/a"),
    "rename": lambda fs: fs.rename("/a", "/b"),
    "link": lambda fs: fs.link("/a", "/b"),
    "symlink": lambda fs: fs.symlink("t", "/d/l"),
    "readlink": lambda fs: fs.readlink("/l"),
    "mknod": lambda fs: fs.mknod("/d/n"),
    "chmod": lambda fs: fs.chmod("/a", 0o600),
    "chown": lambda fs: fs.chown("/a", 1, 1),
    "utime": lambda fs: fs.utime("/a"),
    "truncate": lambda fs: fs.truncate("/a", 0),
    "set_layout": lambda fs: fs.set_layout("/d", chunk_size=1 << 20),
    "layout": lambda fs: fs.layout("/d"),
    "getxattr": lambda fs: fs.getxattr("/a", "user.x"),
    "setxattr": lambda fs: fs.setxattr("/a", "user.x", b"v"),
    "listxattr": lambda fs: fs.listxattr("/a"),
    "removexattr": lambda fs: fs.removexattr("/a", "user.x"),
    "open": lambda fs: fs.open("/a", "rb"),
    "read_bytes": lambda fs: fs.read_bytes("/a"),
    "write_bytes": lambda fs: fs.write_bytes("/d/a", b"x"),
    "fsck": lambda fs: fs.fsck(),
}


@pytest.mark.parametrize("operation", sorted(PUBLIC_CALLS))
def test_the_os_like_api_raises_os_errors(operation: str) -> None:
    """Every public method of the asyncio API turns a metadata FS3Error into the OSError a local
    file system raises (here ENOENT: ``FileNotFoundError``)."""

    async def body() -> None:
        fs = AsyncFileSystem("127.0.0.1:1")  # never connected: every metadata call goes to the fake
        failing = _Failing()
        fs.metadata = Meta(cast(MetaClient, failing))
        try:
            with pytest.raises(FileNotFoundError) as info:
                await PUBLIC_CALLS[operation](fs)
            assert info.value.errno == errno.ENOENT and failing.sent
        finally:
            await fs.close()

    asyncio.run(body())

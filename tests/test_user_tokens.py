"""Per-user tokens: meta's user table, identity bound to the token, revocation, rotation, root squash.

The model test drives the user table's functions (what the service runs) against a dict with a
seeded random sequence of adds, removals, rotations, listings and authentications. The cluster
tests connect through the real framed transport with a user token, so the dispatcher sees a USER
principal and meta's gate checks every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import json
import os
import random
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import fs3
import fs3.aio
from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.cli.main import main as cli_main
from fs3.client.admin import AdminClient
from fs3.client.fs import AsyncFileSystem, ClientConfig
from fs3.client.meta import Meta
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient, StorageClientConfig
from fs3.common.errors import (
    AlreadyExists,
    Internal,
    InvalidArgument,
    NotFound,
    NotPermitted,
    PermissionDenied,
    StaleClient,
    Unauthenticated,
)
from fs3.common.secret_files import write_token_file
from fs3.kv.api import prefix_end
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine, run_transaction
from fs3.meta import schema, users
from fs3.meta.identity import MetaGate
from fs3.meta.limits import USER_GROUPS_MAX, USER_NAME_MAX, USER_PAGE_MAX
from fs3.meta.service import MetaService
from fs3.rpc.auth import TRUSTED, Principal, Role, parse_user_token, principal_scope
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.methods import service_spec
from tests.inproc import ClusterThread

_META = service_spec("Meta")
_dirs = itertools.count()


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


# -- the user table against a model -------------------------------------------------------------


@dataclass
class _Model:
    """What the table must hold: token id -> (current secret, record), and every secret ever issued."""

    live: dict[str, tuple[str, mpb.UserInfo]] = field(default_factory=dict)
    retired: dict[str, str] = field(default_factory=dict)  # an old or revoked secret -> its token id
    issued: set[str] = field(default_factory=set)


def _random_secret(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-") for _ in range(43))


async def _exercise(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    kv = MemKVStore()
    engine = OptimisticTxnEngine(kv)
    model = _Model()
    now_ms = 1_000

    def any_id() -> str:
        pool = list(model.live) + [t for t in model.retired.values()]
        return rng.choice(pool) if pool and rng.random() < 0.8 else f"{rng.getrandbits(64):016x}"

    for step in range(steps):
        now_ms += 1
        op = rng.choice(["add", "add", "remove", "rotate", "auth", "auth", "auth", "list"])
        if op == "add":
            token_id = any_id() if rng.random() < 0.2 else f"{rng.getrandbits(64):016x}"
            secret = _random_secret(rng)
            req = mpb.AddUserReq(name=f"user{step}", uid=rng.choice([0, 1000, 1001, 4242]), gid=rng.randrange(2000),
                                 groups=rng.sample(range(100), rng.randrange(4)), comment=rng.choice(["", "ci job"]))
            try:
                info = await run_transaction(engine, functools.partial(
                    users.add_user, req=req, token_id=token_id, secret=secret, now_ms=now_ms))
            except AlreadyExists:
                assert token_id in model.live, f"step {step}: {token_id} is free, yet refused"
                continue
            assert token_id not in model.live, step
            assert (info.uid, info.gid, list(info.groups)) == (req.uid, req.gid, sorted(set(req.groups)))
            model.live[token_id] = (secret, info)
            model.issued.add(secret)
        elif op == "remove":
            token_id = any_id()
            try:
                info = await run_transaction(engine, functools.partial(users.remove_user, token_id=token_id))
            except NotFound:
                assert token_id not in model.live, step
                continue
            secret, expected = model.live.pop(token_id)
            assert info == expected
            model.retired[secret] = token_id
        elif op == "rotate":
            token_id = any_id()
            secret = _random_secret(rng)
            try:
                info = await run_transaction(engine, functools.partial(
                    users.rotate_user, token_id=token_id, secret=secret, now_ms=now_ms))
            except NotFound:
                assert token_id not in model.live, step
                continue
            old, before = model.live[token_id]
            assert info.rotated_ms == now_ms and (info.uid, info.gid, info.created_ms) == (
                before.uid, before.gid, before.created_ms)
            model.retired[old] = token_id
            model.live[token_id] = (secret, info)
            model.issued.add(secret)
        elif op == "auth":
            choice = rng.random()
            if choice < 0.5 and model.live:
                token_id = rng.choice(list(model.live))
                secret, info = model.live[token_id]
                assert await users.authenticate(engine.begin(), token_id, secret) == info
                claim = mpb.User(uid=info.uid, gid=info.gid, groups=list(reversed(info.groups)))
                squash = rng.random() < 0.5
                acting = users.admit_identity(claim if rng.random() < 0.5 else None, info, squash)
                assert acting.uid == (users.NOBODY if squash and info.uid == 0 else info.uid)
                with pytest.raises(NotPermitted):
                    users.admit_identity(mpb.User(uid=info.uid + 1, gid=info.gid, groups=info.groups), info, squash)
                continue
            if choice < 0.8 and model.retired:
                secret, token_id = rng.choice(list(model.retired.items()))
            else:
                token_id, secret = any_id(), _random_secret(rng)
            if token_id in model.live and model.live[token_id][0] == secret:
                continue  # drew the current secret by chance (never with 43 random characters)
            with pytest.raises(Unauthenticated):
                await users.authenticate(engine.begin(), token_id, secret)
        else:
            limit = rng.choice([1, 2, 5, 0])
            seen: list[mpb.UserInfo] = []
            start_after, more = "", True
            while more:
                page, more = await users.list_users(engine.begin(), start_after, limit)
                assert len(page) <= (limit or USER_PAGE_MAX)
                seen.extend(page)
                start_after = page[-1].token_id if page else start_after
            assert seen == [model.live[t][1] for t in sorted(model.live)], step
    # The store holds hashes: no secret ever issued is in any key or value.
    stored = list(kv.scan(b"", None))
    for secret in model.issued:
        assert not any(secret.encode() in key or secret.encode() in value for key, value in stored)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_user_table_follows_a_model_under_random_adds_removals_rotations(seed: int) -> None:
    run(_exercise(seed, 400))


def test_a_record_holds_a_hash_bound_to_its_id() -> None:
    async def body() -> None:
        kv = MemKVStore()
        engine = OptimisticTxnEngine(kv)
        req = mpb.AddUserReq(name="alice", uid=1000, gid=100, groups=[5, 5, 4])
        info = await run_transaction(engine, lambda txn: users.add_user(txn, req, "00000000000000aa", "s" * 43, 7))
        assert list(info.groups) == [4, 5] and info.created_ms == 7
        raw = kv.get(schema.user_key("00000000000000aa"))
        assert raw is not None and b"s" * 43 not in raw
        assert schema.UserRecord.decode(raw).secret_hash == users.secret_hash("00000000000000aa", "s" * 43)
        # The same record copied under another id authenticates nothing there.
        copied = raw

        async def copy(txn: Any) -> None:
            txn.put(schema.user_key("00000000000000bb"), copied)

        await run_transaction(engine, copy)
        with pytest.raises(Unauthenticated):
            await users.authenticate(engine.begin(), "00000000000000bb", "s" * 43)

    run(body())


@pytest.mark.parametrize("req, message", [
    (mpb.AddUserReq(name="", uid=1, gid=1), "must not be empty"),
    (mpb.AddUserReq(name="x" * (USER_NAME_MAX + 1), uid=1, gid=1), "at most"),
    (mpb.AddUserReq(name="bad\nname", uid=1, gid=1), "printable"),
    (mpb.AddUserReq(name=" alice", uid=1, gid=1), "space"),
    (mpb.AddUserReq(name="a", uid=0xFFFFFFFF, gid=1), "no change"),
    (mpb.AddUserReq(name="a", uid=1, gid=1, groups=[0xFFFFFFFF]), "no change"),
    (mpb.AddUserReq(name="a", uid=1, gid=1, groups=range(USER_GROUPS_MAX + 1)), "supplementary groups"),
    (mpb.AddUserReq(name="a", uid=1, gid=1, comment="\x00"), "printable"),
])
def test_bad_users_are_refused_and_nothing_is_written(req: mpb.AddUserReq, message: str) -> None:
    async def body() -> None:
        kv = MemKVStore()
        with pytest.raises(InvalidArgument, match=message):
            await run_transaction(OptimisticTxnEngine(kv),
                                  lambda txn: users.add_user(txn, req, "00000000000000aa", "s" * 43, 1))
        assert list(kv.scan(b"", None)) == []

    run(body())


def test_the_largest_user_is_accepted() -> None:
    users.validate_new_user(mpb.AddUserReq(name="x" * USER_NAME_MAX, uid=0xFFFFFFFE, gid=0,
                                           groups=range(USER_GROUPS_MAX)))


@pytest.mark.parametrize("token_id", ["", "00000000000000a", "00000000000000AA", "zz00000000000000", "../etc"])
def test_a_malformed_token_id_is_refused(token_id: str) -> None:
    with pytest.raises(InvalidArgument, match="16 lowercase hex"):
        schema.user_key(token_id)


def test_identity_binding_and_root_squash() -> None:
    alice = mpb.UserInfo(token_id="00000000000000aa", uid=1000, gid=100, groups=[5, 7])
    assert users.admit_identity(None, alice, True) == mpb.User(uid=1000, gid=100, groups=[5, 7])
    assert users.admit_identity(mpb.User(uid=1000, gid=100, groups=[7, 5, 5]), alice, True).uid == 1000
    for forged in (mpb.User(uid=0, gid=100, groups=[5, 7]), mpb.User(uid=1000, gid=0, groups=[5, 7]),
                   mpb.User(uid=1000, gid=100, groups=[5, 7, 0]), mpb.User(uid=1000, gid=100, groups=[5])):
        with pytest.raises(NotPermitted, match="00000000000000aa"):
            users.admit_identity(forged, alice, True)
    root = mpb.UserInfo(token_id="00000000000000bb", uid=0, gid=0)
    assert users.effective_user(root, True) == (mpb.User(uid=65534, gid=65534), True)
    assert users.admit_identity(None, root, True) == mpb.User(uid=65534, gid=65534)
    assert users.admit_identity(mpb.User(uid=0, gid=0), root, True) == mpb.User(uid=65534, gid=65534)
    assert users.admit_identity(mpb.User(uid=0, gid=0), root, False) == mpb.User(uid=0, gid=0)
    with pytest.raises(NotPermitted):
        users.admit_identity(mpb.User(uid=65534, gid=65534), root, False)


def test_client_leases_keep_their_owner_and_read_older_records() -> None:
    lease = schema.ClientLease(3, "host-a", 42, "00000000000000aa")
    assert schema.ClientLease.decode(lease.encode()) == lease
    assert schema.ClientLease.decode(schema.ClientLease(3, "host-a", 42).encode()).owner == ""
    older = (3).to_bytes(8, "big") + (42).to_bytes(4, "big") + b"host-a"
    assert schema.ClientLease.decode(older) == schema.ClientLease(3, "host-a", 42)


# -- a cluster: identity enforced on every request -------------------------------------------


@contextlib.asynccontextmanager
async def _service_meta(cluster: Any) -> AsyncIterator[Meta]:
    """Meta as the admin CLI reaches it: through mgmtd's routing, with the cluster token."""
    channels = RealChannelFactory(cluster.token, "framed")
    try:
        meta = await AdminClient(cluster.mgmtd_address, channels).metadata()
        yield meta
    finally:
        await channels.close()


async def _add(cluster: Any, name: str, uid: int, gid: int, groups: tuple[int, ...] = ()) -> mpb.UserTokenRsp:
    async with _service_meta(cluster) as meta:
        return await meta.add_user(name, uid, gid, list(groups))


async def _root_files(cluster: Any) -> tuple[AsyncFileSystem, str]:
    """A connection as root (cluster token) and a fresh directory with a root-only file ``secret``."""
    root = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token, uid=0, gid=0, groups=[])
    top = f"/ident-{next(_dirs)}"
    await root.mkdir(top, 0o777)
    await root.chmod(top, 0o777)
    async with await root.open(f"{top}/secret", "wb", perms=0o600) as f:
        await f.write(b"root only")
    await root.chmod(f"{top}/secret", 0o600)
    return root, top


def _errno(exc: pytest.ExceptionInfo[OSError]) -> int:
    return exc.value.errno or 0


@pytest.mark.slow
def test_a_user_token_acts_only_as_its_user(shared_cluster: ClusterThread) -> None:
    cluster = shared_cluster.cluster

    async def body() -> None:
        root, top = await _root_files(cluster)
        alice_token = (await _add(cluster, "alice", 1000, 1000, (20,))).token
        alice = await fs3.aio.connect(cluster.mgmtd_address, token=alice_token)
        forged = await fs3.aio.connect(cluster.mgmtd_address, token=alice_token,
                                       config=ClientConfig(uid=0, gid=0, groups=[]))
        try:
            # No uid given: meta says who the token is, and permissions are checked as that user.
            assert alice.bound_user == mpb.User(uid=1000, gid=1000, groups=[20])
            with pytest.raises(PermissionError) as refused:
                await alice.read_bytes(f"{top}/secret")
            assert _errno(refused) == errno.EACCES
            await alice.mkdir(f"{top}/mine")
            assert (await root.stat(f"{top}/mine")).st_uid == 1000
            # A forged uid: EPERM for every request, and nothing changes.
            for attempt in (forged.read_bytes(f"{top}/secret"), forged.mkdir(f"{top}/forged"),
                            forged.chmod(f"{top}/secret", 0o644), forged.remove(f"{top}/secret"),
                            forged.chown(f"{top}/mine", 0, 0), forged.stat(f"{top}/secret")):
                with pytest.raises(PermissionError) as refused:
                    await attempt
                assert _errno(refused) == errno.EPERM
            assert not await root.exists(f"{top}/forged")
            st = await root.stat(f"{top}/secret")
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
            assert (await root.stat(f"{top}/mine")).st_uid == 1000
            # The cluster token may still act for any uid (as the mount daemon does for its callers).
            assert await root.read_bytes(f"{top}/secret") == b"root only"
        finally:
            for fs in (alice, forged, root):
                await fs.close()

    run(body())


@pytest.mark.slow
def test_a_user_token_reaches_files_only_through_their_paths(shared_cluster: ClusterThread) -> None:
    """Inode ids are sequential, so anyone can name one. A user token names a file by its path, as
    a local process does: an inode id alone, or a path relative to a directory's inode, would skip
    the search permission of every directory above it — the ``0644`` files in someone's ``0700``
    home directory, which no path lets another user reach. Only an open handle (its session) names
    its file by inode: that open went through the path."""
    cluster = shared_cluster.cluster

    async def body() -> None:
        root, top = await _root_files(cluster)
        home = f"{top}/home"
        await root.mkdir(home, 0o700)
        await root.chmod(home, 0o700)
        async with await root.open(f"{home}/notes", "wb", perms=0o644) as f:
            await f.write(b"private by its directory")
        await root.chmod(f"{home}/notes", 0o644)
        await root.setxattr(f"{home}/notes", "user.k", b"v")
        notes = (await root.stat(f"{home}/notes")).st_ino
        home_ino = (await root.stat(home)).st_ino
        token = (await _add(cluster, "eve", 1200, 1200)).token
        eve = await fs3.aio.connect(cluster.mgmtd_address, token=token)
        try:
            with pytest.raises(PermissionError):
                await eve.read_bytes(f"{home}/notes")  # the path: no search permission on home
            meta = eve.metadata
            by_id, in_home = notes, mpb.PathRef(parent=home_ino, path=b"notes")
            attempts: dict[str, Callable[[], Awaitable[object]]] = {
                "open by id": lambda: meta.open(by_id, 0),
                "open under the directory's id": lambda: meta.open(in_home, 0),
                "lookup by id": lambda: meta.lookup(by_id),
                "lookup under the directory's id": lambda: meta.lookup(in_home),
                "batch stat": lambda: meta.batch_stat([notes]),
                "read dir by id": lambda: meta.read_dir(home_ino, limit=10, with_attrs=True),
                "getxattr by id": lambda: meta.get_xattr(by_id, b"user.k"),
                "listxattr by id": lambda: meta.list_xattr(by_id),
                "link by id": lambda: meta.link(by_id, mpb.PathRef(path=f"{top}/stolen".encode())),
                "utime by id": lambda: meta.set_attr(by_id, mpb.SET_ATIME_NOW | mpb.SET_MTIME_NOW),
                "utime by id with a made-up session": lambda: meta.set_attr(
                    by_id, mpb.SET_MTIME_NOW, session_id=eve.meta.client_id + b"\0" * 8),
            }
            for what, attempt in attempts.items():
                with pytest.raises(PermissionDenied):
                    await attempt()
                    raise AssertionError(f"{what}: allowed")
            assert not await root.exists(f"{top}/stolen")
            # An open handle names its file by inode, as an fd does: ftruncate and close work.
            async with await eve.open(f"{top}/own", "w+b") as own:
                await own.write(b"12345")
                await own.truncate(2)
            assert await eve.read_bytes(f"{top}/own") == b"12"
        finally:
            await eve.close()
            await root.close()

    run(body())


@pytest.mark.slow
def test_the_blocking_client_with_a_user_token_cannot_read_a_root_file(shared_cluster: ClusterThread) -> None:
    cluster = shared_cluster.cluster
    root, top = run(_root_files(cluster))
    run(root.close())
    token = run(_add(cluster, "bob", 1000, 1000)).token
    fs = fs3.connect(cluster.mgmtd_address, token=token, config=ClientConfig(uid=0))
    try:
        with pytest.raises(PermissionError) as refused:
            fs.read_bytes(f"{top}/secret")
        assert _errno(refused) == errno.EPERM
    finally:
        fs.close()


@pytest.mark.slow
def test_revoked_and_rotated_tokens_are_refused_at_once(shared_cluster: ClusterThread) -> None:
    cluster = shared_cluster.cluster

    async def body() -> None:
        added = await _add(cluster, "carol", 1000, 1000)
        token_id = added.user.token_id
        carol = await fs3.aio.connect(cluster.mgmtd_address, token=added.token)
        try:
            await carol.stat("/")
            async with _service_meta(cluster) as meta:
                rotated = await meta.rotate_user(token_id)
            assert rotated.user.token_id == token_id and rotated.token != added.token
            # The connection that authenticated with the old secret is refused on its next request.
            with pytest.raises(PermissionError):
                await carol.stat("/")
            with pytest.raises(PermissionError):
                await fs3.aio.connect(cluster.mgmtd_address, token=added.token)
            renewed = await fs3.aio.connect(cluster.mgmtd_address, token=rotated.token)
            try:
                assert (await renewed.stat("/")).st_ino == 1
                async with _service_meta(cluster) as meta:
                    removed = await meta.remove_user(token_id)
                    assert removed.name == "carol"
                    assert token_id not in [u.token_id for u in (await meta.list_users())[0]]
                    with pytest.raises(NotFound):
                        await meta.remove_user(token_id)
                with pytest.raises(PermissionError):
                    await renewed.stat("/")
            finally:
                await renewed.close()
        finally:
            await carol.close()

    run(body())


@pytest.mark.slow
def test_root_squash(shared_cluster: ClusterThread) -> None:
    cluster = shared_cluster.cluster
    assert cluster.meta is not None
    config = cluster.meta.config

    async def body() -> None:
        root, top = await _root_files(cluster)
        token = (await _add(cluster, "root-job", 0, 0)).token
        try:
            squashed = await fs3.aio.connect(cluster.mgmtd_address, token=token)
            try:
                assert squashed.bound_user == mpb.User(uid=65534, gid=65534)
                with pytest.raises(PermissionError) as refused:
                    await squashed.read_bytes(f"{top}/secret")
                assert _errno(refused) == errno.EACCES
                await squashed.mkdir(f"{top}/made")
                assert (await root.stat(f"{top}/made")).st_uid == 65534
            finally:
                await squashed.close()
            config.root_squash = False
            unsquashed = await fs3.aio.connect(cluster.mgmtd_address, token=token)
            try:
                assert unsquashed.bound_user == mpb.User(uid=0, gid=0)
                assert await unsquashed.read_bytes(f"{top}/secret") == b"root only"
            finally:
                await unsquashed.close()
        finally:
            config.root_squash = True
            await root.close()

    run(body())


@pytest.mark.slow
def test_a_user_cannot_use_another_clients_id_or_session(shared_cluster: ClusterThread) -> None:
    """Requests whose effect rides on a client id (its lease, saved answers, open sessions) are
    refused to a user token that did not register that id."""
    cluster = shared_cluster.cluster

    async def body() -> None:
        root, top = await _root_files(cluster)
        mallory_token = (await _add(cluster, "mallory", 1000, 1000)).token
        victim_token = (await _add(cluster, "victim", 1001, 1001)).token
        victim = await fs3.aio.connect(cluster.mgmtd_address, token=victim_token)
        channels = RealChannelFactory(mallory_token, "framed")
        address = next(n.framed_address for n in (await root.routing.refresh()).nodes if n.node_type == cpb.NODE_META)
        try:
            handle = await victim.open(f"{top}/victim", "wb")
            await handle.write(b"x" * 10)
            session = handle.session_id
            inode_id = handle.inode.inode_id
            channel = channels.get(address)

            async def call(name: str, req: Any) -> Any:
                return (await channel.call(_META.method(name), req, timeout_ms=5_000))[0]

            me = mpb.User(uid=1000, gid=1000)
            for client_id in (victim.meta.client_id, root.meta.client_id):
                with pytest.raises(NotPermitted):
                    await call("RenewClient", mpb.RenewClientReq(client_id=client_id, completed_below=1 << 40,
                                                                 renewals=1))
                ctx = mpb.ReqCtx(user=me, client_id=client_id, request_id=1)
                with pytest.raises(NotPermitted):
                    await call("Close", mpb.CloseReq(ctx=ctx, inode_id=inode_id, session_id=session,
                                                     length_hint=1 << 40, wrote=True, acked=True))
                with pytest.raises(NotPermitted):
                    await call("MakeNode", mpb.MakeNodeReq(ctx=ctx, target=mpb.PathRef(path=f"{top}/m".encode()),
                                                           type=mpb.DIRECTORY, mode=0o755))
            # An id nobody registered is refused until registered; once mallory registers one, it is hers.
            fresh = os.urandom(16)
            ctx = mpb.ReqCtx(client_id=fresh, request_id=1)
            with pytest.raises(StaleClient):
                await call("MakeNode", mpb.MakeNodeReq(ctx=ctx, target=mpb.PathRef(path=f"{top}/m".encode()),
                                                       type=mpb.DIRECTORY, mode=0o755))
            await call("RenewClient", mpb.RenewClientReq(client_id=fresh, hostname="h", pid=1))
            made = await call("MakeNode", mpb.MakeNodeReq(ctx=ctx, target=mpb.PathRef(path=f"{top}/m".encode()),
                                                          type=mpb.DIRECTORY, mode=0o755))
            assert made.inode.uid == 1000  # no identity named: the token's
            with pytest.raises(NotPermitted):  # the victim's token may not use mallory's id either
                await victim.channels.get(address).call(
                    _META.method("RenewClient"), mpb.RenewClientReq(client_id=fresh, renewals=1), timeout_ms=5_000)
            # The victim's handle is untouched: it still writes and closes with its own length.
            await handle.write(b"y" * 5)
            await handle.close()
            assert (await root.stat(f"{top}/victim")).st_size == 15
            # Service-only methods stay closed to a user token.
            with pytest.raises(PermissionDenied):
                await call("AddUser", mpb.AddUserReq(name="x", uid=0, gid=0))
            with pytest.raises(PermissionDenied):
                await call("ListUsers", mpb.ListUsersReq())
        finally:
            await channels.close()
            await victim.close()
            await root.close()

    run(body())


@pytest.mark.slow
def test_the_store_and_listings_hold_no_secret(shared_cluster: ClusterThread) -> None:
    cluster = shared_cluster.cluster

    async def body() -> list[str]:
        secrets = []
        async with _service_meta(cluster) as meta:
            for name in ("dave", "erin"):
                rsp = await meta.add_user(name, 2000, 2000, comment="batch job")
                secrets.append(rsp.token)
            rotated = await meta.rotate_user(rsp.user.token_id)
            secrets.append(rotated.token)
            listed, _ = await meta.list_users(limit=USER_PAGE_MAX + 5)
        text = b"".join(u.SerializeToString() for u in listed)
        for token in secrets:
            parsed = parse_user_token(token)
            assert parsed is not None and parsed[1].encode() not in text
        return secrets

    secrets = run(body())
    assert cluster.meta_kv is not None
    stored = cluster.meta_kv.scan(schema.user_prefix(), prefix_end(schema.user_prefix()))
    assert stored
    for token in secrets:
        secret = parse_user_token(token)[1]  # type: ignore[index]
        assert not any(secret.encode() in value for _, value in cluster.meta_kv.scan(b"", None))


@pytest.mark.slow
def test_cli_user_add_list_rotate_remove(shared_cluster: ClusterThread, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    cluster = shared_cluster.cluster
    base = ["admin", "--mgmtd", cluster.mgmtd_address, "--token", cluster.token]
    token_file = tmp_path / "frank.token"
    old = os.umask(0)  # the token file is 0600 whatever the umask
    try:
        assert cli_main([*base, "user", "add", "frank", "--uid", "1500", "--gid", "1500", "--groups", "7,8",
                         "--comment", "ci", "--token-file", str(token_file)]) == 0
    finally:
        os.umask(old)
    out = capsys.readouterr().out
    token = token_file.read_text().strip()
    parsed = parse_user_token(token)
    assert parsed is not None and parsed[1] not in out and parsed[0] in out
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token_id = parsed[0]

    assert cli_main([*base, "user", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    mine = [u for u in listed if u["token_id"] == token_id]
    assert mine and mine[0]["uid"] == 1500 and mine[0]["groups"] == [7, 8] and mine[0]["name"] == "frank"
    assert parsed[1] not in json.dumps(listed)
    assert cli_main([*base, "user", "list"]) == 0
    assert token_id in capsys.readouterr().out

    # --json never shows a token: without --token-file it is refused before anything is made.
    assert cli_main([*base, "--json", "user", "rotate", token_id]) == 1
    assert "--token-file" in capsys.readouterr().err
    fs = fs3.connect(cluster.mgmtd_address, token=token)
    try:
        assert fs.stat("/").st_ino == 1  # the rotation above was refused: the token still works
        assert cli_main([*base, "user", "rotate", token_id]) == 0
        printed = capsys.readouterr().out.strip().split()[-1]
        assert parse_user_token(printed) is not None and printed != token
        with pytest.raises(PermissionError):
            fs.stat("/")
    finally:
        fs.close()
    assert cli_main([*base, "user", "remove", token_id]) == 0
    assert "refused from now on" in capsys.readouterr().out
    assert cli_main([*base, "user", "remove", token_id]) == 1
    assert cli_main([*base, "user", "remove", "not-an-id"]) == 1
    assert "16 lowercase hex" in capsys.readouterr().err
    assert cli_main([*base, "user", "add", "bad\tname", "--uid", "1", "--gid", "1"]) == 1
    assert "printable" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_user_add_with_the_cluster_token_in_a_file(shared_cluster: ClusterThread, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``fs3 admin --token-file CLUSTER user add ... --token-file OUT``: the first file is the
    credential the command presents, the second where the new token goes. They are two options
    (the way that keeps the cluster token out of ``ps``), not one overriding the other."""
    cluster = shared_cluster.cluster
    cluster_file, out = tmp_path / "cluster.token", tmp_path / "grace.token"
    write_token_file(cluster_file, [cluster.token])
    base = ["admin", "--mgmtd", cluster.mgmtd_address, "--token-file", str(cluster_file)]
    assert cli_main([*base, "user", "add", "grace", "--uid", "1600", "--gid", "1600", "--token-file", str(out)]) == 0
    token = out.read_text().strip()
    parsed = parse_user_token(token)
    assert parsed is not None and cluster_file.read_text().strip() == cluster.token
    assert cli_main([*base, "user", "rotate", parsed[0], "--token-file", str(out)]) == 0
    rotated = out.read_text().strip()
    assert rotated != token and parse_user_token(rotated) is not None
    assert cli_main([*base, "user", "remove", parsed[0]]) == 0
    capsys.readouterr()


# -- the gate on its own: an unstarted service over an in-memory store -----------------------------


def _gate(ids: list[str]) -> MetaGate:
    channels = RealChannelFactory(None, "framed")
    routing = RoutingCache(["127.0.0.1:1"], channels)
    service = MetaService(OptimisticTxnEngine(MemKVStore()), routing,
                          StorageClient(routing, channels, b"m" * 16, StorageClientConfig()))
    draws = iter(ids)
    return MetaGate(service, token_id=lambda: next(draws), token_secret=lambda: "S" * 43)


def test_the_gate_checks_every_user_request_and_keeps_the_table_to_services() -> None:
    async def body() -> None:
        gate = _gate(["00000000000000a1", "00000000000000a1", "00000000000000a2"])
        add = mpb.AddUserReq(name="alice", uid=1000, gid=100, groups=[27])
        first, _ = await gate.add_user(add, memoryview(b""))
        assert first.token == "fs3u.00000000000000a1." + "S" * 43
        second, _ = await gate.add_user(add, memoryview(b""))  # the first draw is taken: drawn again
        assert second.user.token_id == "00000000000000a2"
        alice = Principal(Role.USER, first.token)
        for principal in (TRUSTED, alice):
            with principal_scope(principal):
                for call in (gate.add_user(add, memoryview(b"")), gate.list_users(mpb.ListUsersReq(), memoryview(b"")),
                             gate.remove_user(mpb.UserIdReq(token_id="00000000000000a1"), memoryview(b"")),
                             gate.rotate_user(mpb.UserIdReq(token_id="00000000000000a1"), memoryview(b""))):
                    with pytest.raises(PermissionDenied):
                        await call
        with principal_scope(TRUSTED):
            assert not (await gate.who_am_i(mpb.WhoAmIReq(), memoryview(b"")))[0].bound
            forged = mpb.StatFsReq(ctx=mpb.ReqCtx(user=mpb.User(uid=0)))
            await gate.stat_fs(forged, memoryview(b""))  # a trusted client names any identity
        with principal_scope(alice):
            who, _ = await gate.who_am_i(mpb.WhoAmIReq(), memoryview(b""))
            assert who.bound and who.user == mpb.User(uid=1000, gid=100, groups=[27]) and who.name == "alice"
            unnamed = mpb.StatFsReq(ctx=mpb.ReqCtx())
            await gate.stat_fs(unnamed, memoryview(b""))
            assert unnamed.ctx.user == who.user  # filled in with the token's identity
            with pytest.raises(NotPermitted):
                await gate.stat_fs(forged, memoryview(b""))
            with pytest.raises(StaleClient):  # a client id this token never registered
                await gate.stat_fs(mpb.StatFsReq(ctx=mpb.ReqCtx(client_id=b"c" * 16)), memoryview(b""))
        with principal_scope(Principal(Role.USER, "fs3u.00000000000000a1." + "T" * 43)):
            with pytest.raises(Unauthenticated):
                await gate.who_am_i(mpb.WhoAmIReq(), memoryview(b""))
            with pytest.raises(Unauthenticated):
                await gate.stat_fs(mpb.StatFsReq(), memoryview(b""))

    run(body())


def test_a_random_source_that_keeps_colliding_is_an_error() -> None:
    async def body() -> None:
        gate = _gate(["00000000000000a1"] * 20)
        add = mpb.AddUserReq(name="alice", uid=1000, gid=100)
        await gate.add_user(add, memoryview(b""))
        with pytest.raises(Internal, match="random source"):
            await gate.add_user(add, memoryview(b""))
        listed, _ = await gate.list_users(mpb.ListUsersReq(), memoryview(b""))
        assert [u.token_id for u in listed.users] == ["00000000000000a1"]

    run(body())

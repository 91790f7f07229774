"""Data-path authorization on a real cluster: storage serves a client that is not a service a chunk
only with meta's capability for that chunk's file and mode.

The clients here connect with user tokens (the ``USER`` principal): what a second user on a client
host holds. Chunk ids are guessable (inode, index), so the attacker below calls storage directly
with the victim file's chunk ids — with no capability, another file's, a read-only one for a write,
a tampered one and an expired one — and must get nothing read, written or removed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import fs3.aio
from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.client.admin import AdminClient
from fs3.client.fs import AsyncFileSystem
from fs3.common.capability import Access, decode, derive_key
from fs3.common.errors import BadHandle, FS3Error, PermissionDenied
from fs3.common.ids import chunk_id
from fs3.common.layout import chunk_location
from fs3.common.posix import O_RDONLY, O_RDWR, O_WRONLY
from fs3.meta.service import MetaServiceConfig
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.methods import service_spec
from tests.capabilities import FixedCapability, sign_as_meta
from tests.conftest import wait_until
from tests.inproc import InProcessCluster
from tests.test_client import chunks_of

CHUNK = 64 * 1024
SECRET = bytes(range(256)) * (CHUNK * 2 // 256 + 1)  # three chunks, the last one short


def _cluster(tmp_path: Path, body: Callable[[InProcessCluster, AsyncFileSystem], Awaitable[None]],
             **meta_config: Any) -> None:
    """A cluster (cluster token ``tok``) with the owner, uid 1000, connected by user token, and
    ``/t`` world-writable with two chains per file."""

    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777, prune_interval_ms=100, gc_interval_ms=100, **meta_config)
        async with InProcessCluster(tmp_path, targets_per_node=2, with_meta=True, meta_config=config) as cluster:
            owner = await _user(cluster, "owner", 1000)
            try:
                await owner.makedirs("/t")
                await owner.chmod("/t", 0o777)
                await owner.set_layout("/t", chunk_size=CHUNK, stripe=2)
                await body(cluster, owner)
            finally:
                await owner.close()

    asyncio.run(main())


async def _user(cluster: InProcessCluster, name: str, uid: int) -> AsyncFileSystem:
    """A client connected with a fresh user token bound to ``uid`` (meta's user table, as
    ``fs3 admin user add`` makes one): it acts as that user only."""
    channels = RealChannelFactory(cluster.token, "framed")
    try:
        added = await (await AdminClient(cluster.mgmtd_address, channels).metadata()).add_user(name, uid, uid, [])
    finally:
        await channels.close()
    return await fs3.aio.connect(cluster.mgmtd_address, token=added.token, umask=0o077)


def test_a_user_cannot_reach_the_chunks_of_a_file_it_may_not_open(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, owner: AsyncFileSystem) -> None:
        await owner.write_bytes("/t/secret", SECRET)  # the owner writes and reads through its capabilities
        assert await owner.read_bytes("/t/secret") == SECRET
        secret = (await owner.metadata.lookup(mpb.PathRef(path=b"/t/secret"))).inode_id
        layout = (await owner.metadata.lookup(mpb.PathRef(path=b"/t/secret"))).layout
        before = chunks_of(cluster, secret)
        assert before == 3

        attacker = await _user(cluster, "attacker", 2000)
        try:
            with pytest.raises(PermissionError):
                await attacker.open("/t/secret", "rb")  # meta refuses the open, so no capability
            await attacker.write_bytes("/t/mine", b"attacker's own file")
            mine = await attacker.open("/t/mine", "r+b")
            own_capability = await mine.capability.current()
            key = derive_key(cluster.token)  # what only the services hold: the test forges with it
            expired = sign_as_meta(cluster.token, secret, layout.chains, expires_ms=1)
            granted = decode(own_capability, [key])
            tampered = bytearray(own_capability)
            tampered[2:10] = secret.to_bytes(8, "big")  # the inode field of the body

            storage = attacker.storage
            chain, cid = chunk_location(layout, secret, 0)
            assert cid == chunk_id(secret, 0)  # the guess: (inode, index)
            attempts = {
                "no capability": None,
                "another file's": FixedCapability(own_capability),
                "tampered": FixedCapability(bytes(tampered)),
                "expired": FixedCapability(expired),
            }
            for what, source in attempts.items():
                with pytest.raises(PermissionDenied, match="capability") as denied:
                    await storage.read(chain, cid, 0, CHUNK, capability=source)
                assert "capability" in denied.value.message, what
                with pytest.raises(PermissionDenied, match="capability"):
                    await storage.write(chain, cid, 0, b"overwritten", CHUNK, capability=source)
                with pytest.raises(PermissionDenied, match="capability"):
                    await storage.truncate(chain, cid, 0, CHUNK, capability=source)
                with pytest.raises(PermissionDenied, match="capability"):
                    await storage.remove(chain, cid, CHUNK, capability=source)
            # A chunk id that is no file's chunk at all is the services' alone.
            with pytest.raises(PermissionDenied, match="not a file's chunk"):
                await storage.read(chain, b"\x00" * 3, 0, 1, capability=FixedCapability(own_capability))
            # Meta grants nothing either: a capability belongs to an open session on that inode.
            with pytest.raises(BadHandle):
                await attacker.metadata.grant_capability(secret, mpb.CAPABILITY_READ, mine.session_id, b"")
            with pytest.raises(BadHandle):
                await attacker.metadata.grant_capability(secret, mpb.CAPABILITY_READ, mine.session_id,
                                                         own_capability)
            with pytest.raises(BadHandle):
                await attacker.metadata.grant_capability(secret, mpb.CAPABILITY_READ, b"", b"")
            assert granted.inode_id == mine.inode.inode_id
            await mine.close()
        finally:
            await attacker.close()

        # Nothing changed: the owner reads every byte back, and every chunk is still there.
        assert chunks_of(cluster, secret) == before
        assert await owner.read_bytes("/t/secret") == SECRET
        # Meta removes a deleted file's chunks as a service: no capability needed.
        await owner.remove("/t/secret")
        async def collected() -> bool:
            return chunks_of(cluster, secret) == 0

        await wait_until(collected, what="chunks collected")

    _cluster(tmp_path, body)


def test_a_read_only_open_cannot_write_and_a_write_only_open_cannot_read(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, owner: AsyncFileSystem) -> None:
        await owner.write_bytes("/t/f", b"x" * 100)
        inode = await owner.metadata.lookup(mpb.PathRef(path=b"/t/f"))
        chain, cid = chunk_location(inode.layout, inode.inode_id, 0)
        reader = await owner.open("/t/f", "rb")
        writer = await owner.open("/t/f", "wb")
        try:
            read_only = FixedCapability(await reader.capability.current())
            write_only = FixedCapability(await writer.capability.current())
            with pytest.raises(PermissionDenied, match="grants READ, not WRITE"):
                await owner.storage.write(chain, cid, 0, b"y", CHUNK, capability=read_only)
            with pytest.raises(PermissionDenied, match="grants WRITE, not READ"):
                await owner.storage.read(chain, cid, 0, 10, capability=write_only)
            # Asking meta for more than the open allowed re-checks permissions and the session's mode.
            with pytest.raises(BadHandle, match="not open for writing"):
                await owner.metadata.grant_capability(inode.inode_id, mpb.CAPABILITY_READ | mpb.CAPABILITY_WRITE,
                                                      reader.session_id, await reader.capability.current())
        finally:
            await reader.close()
            await writer.close()
        assert await owner.read_bytes("/t/f") == b""  # the "wb" open truncated; nothing else landed

    _cluster(tmp_path, body)


def test_an_open_file_keeps_its_rights_and_a_fresh_grant_rechecks_them(tmp_path: Path) -> None:
    async def body(cluster: InProcessCluster, owner: AsyncFileSystem) -> None:
        f = await owner.open("/t/f", "w+b")
        other = await owner.open("/t/f", "rb")
        try:
            await owner.chmod("/t/f", 0)  # as with a local descriptor, the open file still works
            previous = await f.capability.current()
            both = mpb.CAPABILITY_READ | mpb.CAPABILITY_WRITE
            renewed = await owner.metadata.grant_capability(f.inode.inode_id, both, f.session_id, previous)
            assert decode(renewed.capability, [derive_key(cluster.token)]).access == Access.READ | Access.WRITE
            # Without the capability its open returned, meta checks the caller's permissions now.
            with pytest.raises(PermissionDenied):
                await owner.metadata.grant_capability(f.inode.inode_id, both, f.session_id, b"")
            with pytest.raises(PermissionDenied):
                await owner.metadata.grant_capability(f.inode.inode_id, both, f.session_id, b"\x01" * 80)
            # Another session's capability does not vouch for this one.
            with pytest.raises(PermissionDenied):
                await owner.metadata.grant_capability(f.inode.inode_id, mpb.CAPABILITY_READ, f.session_id,
                                                      await other.capability.current())
            await f.write(b"still mine")
            await f.flush()
        finally:
            await f.close()
            await other.close()

    _cluster(tmp_path, body)


def test_an_expiring_capability_is_renewed_transparently(tmp_path: Path) -> None:
    ttl_ms = 600

    async def body(cluster: InProcessCluster, owner: AsyncFileSystem) -> None:
        for node in cluster.nodes.values():
            node.config.capability_skew_ms = 0  # storage takes meta's expiry to the millisecond
        f = await owner.open("/t/f", "w+b")
        try:
            await f.write(b"a" * 1000)
            await f.flush()
            # Past half its life the next call renews it in the background, before it expires.
            await asyncio.sleep(ttl_ms * 0.6 / 1000)
            assert await f.pread(0, 1000, readahead=False) == b"a" * 1000
            async def renewed() -> bool:
                return f.capability.renewals >= 1

            await wait_until(renewed, what="capability renewed")
            # A capability that expired anyway (never renewed ahead): storage refuses it as
            # expired, the client gets a fresh one from meta and sends the same request again.
            f.capability._renew_at_ms = None
            stale = await f.capability.current()
            await asyncio.sleep(ttl_ms * 1.2 / 1000)
            chain, cid = chunk_location(f.layout, f.inode.inode_id, 0)
            with pytest.raises(PermissionDenied, match="expired"):
                await owner.storage.read(chain, cid, 0, 10, capability=FixedCapability(stale))
            renewals = f.capability.renewals
            await f.write(b"b" * 1000)
            await f.flush()
            assert f.capability.renewals == renewals + 1
            f.capability._renew_at_ms = None
            await asyncio.sleep(ttl_ms * 1.2 / 1000)
            assert await f.pread(0, 2000, readahead=False) == b"a" * 1000 + b"b" * 1000
            assert f.capability.renewals == renewals + 2
        finally:
            await f.close()
        assert await owner.read_bytes("/t/f") == b"a" * 1000 + b"b" * 1000

    _cluster(tmp_path, body, capability_ttl_ms=ttl_ms)


def test_without_a_cluster_token_no_capability_is_issued(tmp_path: Path) -> None:
    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777)
        async with InProcessCluster(tmp_path, storage_nodes=1, replicas=1, token="", with_meta=True,
                                    meta_config=config) as cluster:
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=None)
            try:
                f = await fs.open("/f", "wb")
                assert await f.capability.current() == b""  # every caller is a service there
                await f.write(b"open cluster")
                await f.close()
                assert await fs.read_bytes("/f") == b"open cluster"
            finally:
                await fs.close()

    try:
        asyncio.run(main())
    except FS3Error as exc:  # pragma: no cover - shows the cause rather than a bare failure
        raise AssertionError(str(exc)) from exc


def test_a_retried_open_never_grants_more_than_the_open_that_ran(tmp_path: Path) -> None:
    """A retry of an open (same client id and request id) is answered from the saved answer, with a
    capability of its own: it must grant what the open that ran allowed, not what the retry's flags
    ask for — or a user with read permission gets a write capability by resending its read-only
    open with ``O_RDWR`` (and a write-only open's retry would read a drop box)."""

    async def body(cluster: InProcessCluster, owner: AsyncFileSystem) -> None:
        await owner.write_bytes("/t/readable", b"owner's bytes")
        await owner.chmod("/t/readable", 0o644)
        await owner.write_bytes("/t/dropbox", b"")
        await owner.chmod("/t/dropbox", 0o622)
        attacker = await _user(cluster, "attacker", 2000)
        key = derive_key(cluster.token)
        address = next(n.framed_address for n in (await attacker.routing.refresh()).nodes
                       if n.node_type == cpb.NODE_META)
        channels = RealChannelFactory(attacker.channels.token, "framed")
        try:
            await attacker.stat("/t")  # registers the attacker's client id
            channel = channels.get(address)

            async def open_as(path: str, flags: int, request_id: int) -> mpb.OpenRsp:
                ctx = mpb.ReqCtx(client_id=attacker.meta.client_id, request_id=request_id)
                req = mpb.OpenReq(ctx=ctx, target=mpb.PathRef(path=path.encode()), flags=flags)
                rsp, _ = await channel.call(service_spec("Meta").method("Open"), req, timeout_ms=5_000)
                assert isinstance(rsp, mpb.OpenRsp)
                return rsp

            for path, ran, retried, granted in (("/t/readable", O_RDONLY, O_RDWR, Access.READ),
                                                ("/t/dropbox", O_WRONLY, O_RDWR, Access.WRITE)):
                first = await open_as(path, ran, 1_000_000 + ran)
                assert decode(first.capability, [key]).access == granted
                again = await open_as(path, retried, 1_000_000 + ran)  # "a retry" with more flags
                assert again.session_id == first.session_id
                assert decode(again.capability, [key]).access == granted, path
            # The read-only open's capability writes nothing.
            inode = await owner.metadata.lookup(mpb.PathRef(path=b"/t/readable"))
            chain, cid = chunk_location(inode.layout, inode.inode_id, 0)
            retried_rsp = await open_as("/t/readable", O_RDWR, 1_000_000 + O_RDONLY)
            with pytest.raises(PermissionDenied, match="grants READ, not WRITE"):
                await attacker.storage.write(chain, cid, 0, b"OWNED", CHUNK,
                                             capability=FixedCapability(retried_rsp.capability))
        finally:
            await channels.close()
            await attacker.close()
        assert await owner.read_bytes("/t/readable") == b"owner's bytes"

    _cluster(tmp_path, body)

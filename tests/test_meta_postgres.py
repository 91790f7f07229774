"""Meta on PostgreSQL: its settings, the round trips its operations cost (path hints), and a real
``fs3 meta`` process serving a cluster from a database."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest

import fs3
from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient
from fs3.common.errors import InvalidArgument, NotFound, Unavailable
from fs3.common.posix import O_CREAT, O_EXCL, O_WRONLY
from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine
from fs3.meta.hints import PathHints
from fs3.meta.server import MetaConfig
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.channel import RealChannelFactory
from tests.harness import ProcessCluster


def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect("postgresql://" + url.split("://", 1)[1], autocommit=True) as conn:
        return conn.execute(sql.encode()).fetchall()


@pytest.mark.parametrize("settings, message", [
    ({"kv_engine": "postgres"}, "needs pg_url"),
    ({"kv_engine": "rocksdb", "pg_url": "postgresql://u:p@h/db"}, 'set kv_engine = "postgres"'),
    ({"kv_engine": "sqlite"}, "expected one of rocksdb, mem, postgres"),
    ({"kv_engine": "postgres", "pg_url": "mysql://u:p@h/db"}, "expected postgresql://"),
    ({"kv_engine": "postgres", "pg_url": "postgresql://u:p@h/db", "pg_pool_size_max": 0}, "pool_size_max"),
])
def test_bad_engine_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        MetaConfig(**settings).validate()


def test_the_database_password_is_never_in_the_settings_repr() -> None:
    config = MetaConfig(kv_engine="postgres", pg_url="postgresql://fs3:hunter2@db/fs3")
    config.validate()
    assert "hunter2" not in repr(config)


def test_a_meta_process_serves_the_namespace_from_postgres_and_keeps_it_across_a_restart(
        tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FS3_META_KV_ENGINE", "postgres")
    monkeypatch.setenv("FS3_META_PG_URL", postgres_url)
    cluster = ProcessCluster(tmp_path / "cluster", storage_nodes=1, targets_per_node=1, token="secret")
    try:
        cluster.start_all()
        asyncio.run(cluster.ensure_chains(1))
        fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
        try:
            fs.makedirs("/d/e")
            with fs.open("/d/e/f", "wb"):
                pass
            inode = fs.stat("/d/e/f").st_ino
        finally:
            fs.close()
        assert _rows(postgres_url, "SELECT count(*) FROM fs3_kv")[0][0] > 0
        assert not (tmp_path / "cluster" / "meta" / "kv").exists()  # nothing in the embedded engine
        cluster.kill("meta")
        cluster.start("meta")
        fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
        try:
            assert fs.stat("/d/e/f").st_ino == inode
            assert fs.listdir("/d/e") == ["f"]
        finally:
            fs.close()
        # A meta server of another cluster pointed at this database stops at start, saying why.
        cluster.kill("meta")
        cluster.env["FS3_META_CLUSTER_ID"] = "another"
        with pytest.raises(Unavailable, match="belongs to cluster 'fs3', not 'another'"):
            cluster.start("meta")
    finally:
        cluster.stop_all()


# -- round trips per operation: path hints ---------------------------------------------------------


class Meta:
    """One in-process meta server on an engine, called as RPC would, one request id after another."""

    def __init__(self, service: MetaService, client: int) -> None:
        self.service = service
        self.client_id = f"trips{client:011d}".encode()
        self.request_id = 0

    def ctx(self) -> mpb.ReqCtx:
        self.request_id += 1
        return mpb.ReqCtx(user=mpb.User(uid=0, gid=0), client_id=self.client_id, request_id=self.request_id)

    async def call(self, name: str, req: Any) -> Any:
        rsp, _ = await getattr(self.service, name)(req, memoryview(b""))
        return rsp

    async def mkdir(self, path: str) -> mpb.Inode:
        rsp = await self.call("make_node", mpb.MakeNodeReq(ctx=self.ctx(), target=mpb.PathRef(path=path.encode()),
                                                           type=mpb.DIRECTORY, mode=0o777))
        inode: mpb.Inode = rsp.inode
        return inode

    async def create(self, path: str) -> mpb.OpenRsp:
        rsp: mpb.OpenRsp = await self.call("open", mpb.OpenReq(
            ctx=self.ctx(), target=mpb.PathRef(path=path.encode()), flags=O_CREAT | O_EXCL | O_WRONLY, mode=0o644))
        return rsp

    async def close(self, opened: mpb.OpenRsp) -> None:
        await self.call("close", mpb.CloseReq(ctx=self.ctx(), inode_id=opened.inode.inode_id,
                                              session_id=opened.session_id))

    async def stat(self, path: str) -> mpb.Inode:
        rsp = await self.call("lookup", mpb.LookupReq(ctx=self.ctx(), target=mpb.PathRef(path=path.encode())))
        inode: mpb.Inode = rsp.inode
        return inode

    async def rename(self, source: str, destination: str) -> None:
        await self.call("rename", mpb.RenameReq(ctx=self.ctx(), source=mpb.PathRef(path=source.encode()),
                                                destination=mpb.PathRef(path=destination.encode())))

    async def remove(self, path: str) -> None:
        await self.call("remove", mpb.RemoveReq(ctx=self.ctx(), target=mpb.PathRef(path=path.encode())))


async def _meta(engine: Any, client: int, path_hints_max: int = 65_536) -> Meta:
    channels = RealChannelFactory()
    routing = RoutingCache(["127.0.0.1:1"], channels)
    routing._install(cpb.RoutingInfo(chain_tables=[cpb.ChainTable(table_id=1, chain_ids=[11, 12])]))
    service = MetaService(engine, routing, StorageClient(routing, channels, b"r" * 16),
                          MetaServiceConfig(root_mode=0o777, path_hints_max=path_hints_max))
    await service.start(background=False)
    return Meta(service, client)


async def _trips(engine: PostgresTxnEngine, step: Callable[[], Awaitable[Any]]) -> tuple[int, int]:
    """(round trips on the caller's path, rollbacks after its answer) of one request."""
    await engine.settle()
    start, rollbacks = engine.round_trips, engine.rollbacks
    await step()
    on_path = engine.round_trips - start
    await engine.settle()
    return on_path, engine.rollbacks - rollbacks


@pytest.mark.parametrize("depth", [2, 4])
def test_warm_path_hints_bring_a_stat_and_a_create_to_two_round_trips(postgres_url: str, depth: int) -> None:
    """The issue's goals, counted by the engine: with the directories seen before, a stat, a
    create, close, rename and remove are each one round trip plus the commit (a stat commits its
    reads too: ``reads_commit``), at any depth; a server that never saw the path pays one per
    level more."""
    async def main() -> None:
        engine = await PostgresTxnEngine.open(PostgresConfig(postgres_url, sync=False, pool_size_max=4))
        try:
            meta = await _meta(engine, 1)
            hints = meta.service.path_hints
            assert hints is not None
            parent = "".join(f"/d{level}" for level in range(1, depth))
            for level in range(1, depth):
                await meta.mkdir("".join(f"/d{n}" for n in range(1, level + 1)))
            counts: dict[tuple[str, str], tuple[int, int]] = {}
            for mode, name in (("cold", "a"), ("warm", "b")):
                path = f"{parent}/{name}"
                if mode == "cold":
                    hints.clear()
                opened = await meta.create(path)  # the create counted is the sibling's, below
                if mode == "cold":
                    hints.clear()
                counts[("close", mode)] = await _trips(engine, partial(meta.close, opened))
                if mode == "cold":
                    hints.clear()
                counts[("stat", mode)] = await _trips(engine, partial(meta.stat, path))
                if mode == "cold":
                    hints.clear()
                counts[("create", mode)] = await _trips(engine, partial(meta.create, path + "c"))
                if mode == "cold":
                    hints.clear()
                counts[("rename", mode)] = await _trips(engine, partial(meta.rename, path, path + ".r"))
                assert (await meta.stat(path + ".r")).inode_id == opened.inode.inode_id
                if mode == "cold":
                    hints.clear()
                counts[("remove", mode)] = await _trips(engine, partial(meta.remove, path + ".r"))
                with pytest.raises(NotFound):
                    await meta.stat(path + ".r")
            assert counts[("stat", "warm")] == (2, 0)  # its reads, then its commit (reads_commit)
            assert counts[("create", "warm")] == (2, 0)
            assert counts[("close", "warm")] == (2, 0)
            assert counts[("rename", "warm")] == (2, 0)
            assert counts[("remove", "warm")] == (2, 0)  # its two scans ride with the first read
            # Cold: one round trip per component (its entry, with the inode of the one before),
            # then the last inode (a stat) or the commit (a create), or both walks' ends (rename).
            assert counts[("stat", "cold")] == (depth + 2, 0)
            assert counts[("create", "cold")] == (depth + 1, 0)
            assert counts[("rename", "cold")] == (depth + 2, 0)
            assert counts[("remove", "cold")] == (depth + 3, 0)  # + the inode, then both scans
            assert counts[("close", "cold")] == (2, 0)  # no path: its keys come from the request
            assert hints.hits > 0
        finally:
            engine.terminate()

    asyncio.run(main())


def test_a_listing_with_attributes_and_a_batch_stat_cost_the_same_round_trips_for_any_count(
        postgres_url: str) -> None:
    """The inodes of a listing's entries, and of a batch stat, are fetched together: the round
    trips do not grow with the number of entries."""
    async def main() -> None:
        engine = await PostgresTxnEngine.open(PostgresConfig(postgres_url, sync=False, pool_size_max=4))
        try:
            meta = await _meta(engine, 1)
            counts = []
            for files in (2, 20):
                await meta.mkdir(f"/l{files}")
                ids = [(await meta.create(f"/l{files}/f{n}")).inode.inode_id for n in range(files)]
                listing: list[mpb.ReadDirRsp] = []

                async def list_dir(files: int = files, listing: list[mpb.ReadDirRsp] = listing) -> None:
                    listing.append(await meta.call("read_dir", mpb.ReadDirReq(
                        ctx=meta.ctx(), dir=mpb.PathRef(path=f"/l{files}".encode()), with_attrs=True)))

                async def batch(ids: list[int] = ids) -> None:
                    rsp = await meta.call("batch_stat", mpb.BatchStatReq(ctx=meta.ctx(), inode_ids=ids))
                    assert [inode.inode_id for inode in rsp.inodes] == ids

                counts.append((await _trips(engine, list_dir), await _trips(engine, batch)))
                assert sorted(entry.attrs.inode_id for entry in listing[0].entries) == sorted(ids)
            # The path with the listing's inode, the scan, the entries' inodes; a batch: one.
            assert counts[0] == counts[1] == ((4, 0), (2, 0))  # each with its commit
        finally:
            engine.terminate()

    asyncio.run(main())


def test_a_stale_hint_from_another_meta_server_costs_round_trips_never_a_wrong_answer(postgres_url: str) -> None:
    """Server A learned /x/f; server B (its own engine, same database) renames /x away and makes a
    new /x with other files. A, guessing from what it saw, still answers from the database: the
    old name is gone, the new one is found, and after one more round trip its hints are right."""
    async def main() -> None:
        engine_a = await PostgresTxnEngine.open(PostgresConfig(postgres_url, sync=False, pool_size_max=4))
        engine_b = await PostgresTxnEngine.open(PostgresConfig(postgres_url, sync=False, pool_size_max=4))
        try:
            a, b = await _meta(engine_a, 1), await _meta(engine_b, 2)
            old_dir = await a.mkdir("/x")
            old_file = (await a.create("/x/f")).inode
            assert (await a.stat("/x/f")).inode_id == old_file.inode_id
            assert await _trips(engine_a, lambda: a.stat("/x/f")) == (2, 0)  # warm
            await b.rename("/x", "/moved")
            new_dir = await b.mkdir("/x")
            new_file = (await b.create("/x/f")).inode
            assert new_dir.inode_id != old_dir.inode_id and new_file.inode_id != old_file.inode_id
            # A's hints still say /x is the old directory: the stat reads the right one anyway.
            stale_trips, _ = await _trips(engine_a, lambda: a.stat("/x/f"))
            assert (await a.stat("/x/f")).inode_id == new_file.inode_id
            assert stale_trips > 1  # the wrong guess cost round trips...
            assert await _trips(engine_a, lambda: a.stat("/x/f")) == (2, 0)  # ...once: A learned
            assert (await a.stat("/moved/f")).inode_id == old_file.inode_id
            # A create and a remove through the stale name act on the new directory.
            await b.rename("/x", "/moved2")
            await b.mkdir("/x")
            created = await a.create("/x/g")
            assert (await b.stat("/x/g")).inode_id == created.inode.inode_id
            await a.remove("/moved2/f")
            with pytest.raises(NotFound):
                await b.stat("/moved2/f")
            with pytest.raises(NotFound):
                await a.stat("/x/f")
        finally:
            engine_a.terminate()
            engine_b.terminate()

    asyncio.run(main())


def test_path_hints_stay_bounded_and_forget_the_least_recently_used() -> None:
    hints = PathHints(entries_max=3)
    hints.learn([((1, b"a"), (10, mpb.DIRECTORY)), ((1, b"b"), (11, mpb.FILE)), ((1, b"c"), (12, mpb.FILE))])
    keys: list[bytes] = []
    assert hints.keys(mpb.PathRef(path=b"/a"), keys) == (10, mpb.DIRECTORY)  # /a used: b is now the oldest
    hints.learn([((10, b"d"), (13, mpb.FILE))])
    assert len(hints) == 3
    assert hints.child(1, b"b") is None and hints.child(1, b"a") == (10, mpb.DIRECTORY)
    hints.learn([((1, b"a"), None)])  # an entry found absent is forgotten
    assert hints.child(1, b"a") is None
    with pytest.raises(InvalidArgument):
        PathHints(entries_max=0)
    with pytest.raises(InvalidArgument, match="path_hints_max"):
        MetaServiceConfig(path_hints_max=-1).validate()


def test_a_meta_server_keeps_no_more_hints_than_its_setting(postgres_url: str) -> None:
    async def main() -> None:
        engine = await PostgresTxnEngine.open(PostgresConfig(postgres_url, sync=False, pool_size_max=4))
        try:
            meta = await _meta(engine, 1, path_hints_max=8)
            await meta.mkdir("/many")
            for n in range(30):
                await meta.create(f"/many/f{n}")
            assert meta.service.path_hints is not None
            assert len(meta.service.path_hints) == 8
            assert (await meta.stat("/many/f3")).type == mpb.FILE  # forgotten: read, not guessed
        finally:
            engine.terminate()

    asyncio.run(main())


def test_the_embedded_engine_keeps_no_path_hints() -> None:
    """The embedded engine ignores prefetch: meta guesses nothing there (no bookkeeping at all)."""
    async def main() -> None:
        meta = await _meta(OptimisticTxnEngine(MemKVStore(), sync=False), 1)
        await meta.mkdir("/d")
        await meta.create("/d/f")
        assert meta.service.path_hints is None
        assert (await meta.stat("/d/f")).type == mpb.FILE

    asyncio.run(main())

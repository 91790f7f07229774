"""Meta answers only what a power loss cannot take back.

A commit is visible to other transactions as soon as its batch is applied, before the group sync
that makes it durable has finished. Every answer built on such a commit — the original answer, a
retry answered from the saved answer, "already exists" or "no such file" from another request —
must wait for that sync. The disk here syncs only when the test lets it, so the window is held
open; a power loss inside it (``MemKVStore.crash``) must not contradict anything answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient
from fs3.common.errors import AlreadyExists, NotFound
from fs3.kv.api import Transaction
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine, run_transaction
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.dispatch import Buffer

T = TypeVar("T")
CLIENT_A = b"a" * 16
CLIENT_B = b"b" * 16
_SETTLE_STEPS = 200  # event-loop turns: far more than any answer that does not wait for the disk needs


class HeldDisk(OptimisticTxnEngine):
    """An engine whose log syncs finish only while ``disk`` is set (a slow disk, held by the test)."""

    def __init__(self, store: MemKVStore) -> None:
        super().__init__(store, sync=True)
        self.disk = asyncio.Event()
        self.disk.set()

    async def _sync_wal(self) -> None:
        await self.disk.wait()
        await super()._sync_wal()


async def _settle() -> None:
    for _ in range(_SETTLE_STEPS):
        await asyncio.sleep(0)


def _ref(path: str) -> mpb.PathRef:
    return mpb.PathRef(path=path.encode())


def _ctx(client: bytes, request_id: int) -> mpb.ReqCtx:
    return mpb.ReqCtx(user=mpb.User(uid=0, gid=0), client_id=client, request_id=request_id)


async def _service(store: MemKVStore) -> tuple[MetaService, HeldDisk]:
    engine = HeldDisk(store)
    channels = RealChannelFactory()
    routing = RoutingCache(["127.0.0.1:1"], channels)
    routing._install(cpb.RoutingInfo(chain_tables=[cpb.ChainTable(table_id=1, chain_ids=[11, 12, 13])]))
    service = MetaService(engine, routing, StorageClient(routing, channels, CLIENT_A),
                          MetaServiceConfig(root_mode=0o777))
    await service.start(background=False)
    return service, engine


def _mkdir(service: MetaService, client: bytes, request_id: int,
           path: str) -> Coroutine[Any, Any, tuple[mpb.InodeRsp, Buffer]]:
    return service.make_node(mpb.MakeNodeReq(ctx=_ctx(client, request_id), target=_ref(path),
                                             type=mpb.DIRECTORY, mode=0o755), memoryview(b""))


def _rmdir(service: MetaService, client: bytes, request_id: int,
           path: str) -> Coroutine[Any, Any, tuple[mpb.RemoveRsp, Buffer]]:
    return service.remove(mpb.RemoveReq(ctx=_ctx(client, request_id), target=_ref(path), directory=True),
                          memoryview(b""))


def _lookup(service: MetaService, path: str) -> Coroutine[Any, Any, tuple[mpb.InodeRsp, Buffer]]:
    return service.lookup(mpb.LookupReq(ctx=_ctx(CLIENT_B, 0), target=_ref(path)), memoryview(b""))


def test_no_answer_before_the_commits_it_rests_on_are_durable() -> None:
    """A retry answered from the saved answer, EEXIST and ENOENT all wait for the held sync; after a
    power loss inside the window nothing answered is contradicted."""

    async def body() -> None:
        store = MemKVStore()
        service, engine = await _service(store)
        await _mkdir(service, CLIENT_A, 1, "/gone")  # durable: the disk is running
        engine.disk.clear()
        # Client A's mkdir and rmdir commit; their syncs are held.
        first = asyncio.ensure_future(_mkdir(service, CLIENT_A, 2, "/new"))
        removal = asyncio.ensure_future(_rmdir(service, CLIENT_A, 3, "/gone"))
        await _settle()
        assert not first.done() and not removal.done()
        answers = {
            # A's reply was lost: its retry finds the saved answer.
            "retry": asyncio.ensure_future(_mkdir(service, CLIENT_A, 2, "/new")),
            # Client B sees A's unsynced changes.
            "eexist": asyncio.ensure_future(_mkdir(service, CLIENT_B, 1, "/new")),
            "enoent": asyncio.ensure_future(_rmdir(service, CLIENT_B, 2, "/gone")),
            "lookup": asyncio.ensure_future(_lookup(service, "/gone")),
        }
        await _settle()
        answered = sorted(name for name, task in answers.items() if task.done())
        assert answered == [], f"answered before the commits they rest on were durable: {answered}"
        # The disk comes back: every answer follows.
        engine.disk.set()
        rsp_first, _ = await first
        rsp_retry, _ = await answers["retry"]
        assert rsp_retry == rsp_first
        with pytest.raises(AlreadyExists):
            await answers["eexist"]
        with pytest.raises(NotFound):
            await answers["enoent"]
        with pytest.raises(NotFound):
            await answers["lookup"]
        await removal

    asyncio.run(body())


def test_a_power_loss_in_the_window_takes_back_only_unanswered_changes() -> None:
    """The same window, then the power goes: what the held answers rested on is gone, and none of
    them had been given."""

    async def body() -> None:
        store = MemKVStore()
        service, engine = await _service(store)
        await _mkdir(service, CLIENT_A, 1, "/warm")  # (inode ids reserved while the disk runs)
        engine.disk.clear()
        first = asyncio.ensure_future(_mkdir(service, CLIENT_A, 2, "/new"))
        await _settle()
        retry = asyncio.ensure_future(_mkdir(service, CLIENT_A, 2, "/new"))
        other = asyncio.ensure_future(_mkdir(service, CLIENT_B, 1, "/new"))
        await _settle()
        told = [name for name, task in (("first", first), ("retry", retry), ("other", other)) if task.done()]
        store.crash()  # power loss: the held sync never ran
        for task in (first, retry, other):
            task.cancel()
        await asyncio.gather(first, retry, other, return_exceptions=True)
        again, _ = await _service(store)
        with pytest.raises(NotFound):
            await _lookup(again, "/new")
        assert told == [], f"told {told} about a directory the power loss took back"

    asyncio.run(body())


def test_transactions_answer_only_from_durable_commits() -> None:
    """The engine level: a read-only commit and an error raised by a transaction function wait for
    the held sync of the commit they read."""

    async def body() -> None:
        store = MemKVStore()
        engine = HeldDisk(store)
        engine.disk.clear()

        async def create(txn: Transaction) -> None:
            txn.put(b"k", b"v")

        async def read(txn: Transaction) -> bytes | None:
            return await txn.get(b"k")

        async def fail_if_present(txn: Transaction) -> None:
            if await txn.get(b"k") is not None:
                raise AlreadyExists("k exists")

        def run(fn: Callable[[Transaction], Awaitable[T]]) -> asyncio.Future[T]:
            return asyncio.ensure_future(run_transaction(engine, fn))

        writer = run(create)
        await _settle()
        reader, failing = run(read), run(fail_if_present)
        await _settle()
        assert not writer.done() and not reader.done() and not failing.done()
        engine.disk.set()
        await writer
        assert await reader == b"v"
        with pytest.raises(AlreadyExists):
            await failing

    asyncio.run(body())

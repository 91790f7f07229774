"""One live meta server per node id on a shared store (:mod:`fs3.meta.registration`).

Several :class:`MetaService` on one engine stand in for ``fs3 meta`` processes on one database:
the in-memory :class:`OptimisticTxnEngine` and a private PostgreSQL. Checked: a second server
with the node id of a live one is refused at start, naming the id, with nothing written; other
ids start side by side; a server restarted after a crash takes its id back once the dead life's
record stood still for a claim's time to live, and a clean stop hands it back at once; a server
whose id another took over (it was cut off) learns so and stops its background work.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from fs3.client.routing import RoutingCache
from fs3.common.clock import LoopClock
from fs3.common.errors import AlreadyExists, InvalidArgument
from fs3.kv.api import Transaction, TxnEngine
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine, run_transaction
from fs3.meta.claims import ClaimRecord, claim_key
from fs3.meta.registration import NodeRegistration, node_id_claim
from fs3.meta.service import MetaService, MetaServiceConfig
from tests.conftest import wait_until

TTL_MS = 400


class _NoChannels:
    def node_address(self, framed: str, grpc: str) -> str:
        return framed


def _server(engine: TxnEngine, node_id: int) -> MetaService:
    routing = RoutingCache(["mgmtd"], _NoChannels())  # type: ignore[arg-type]
    return MetaService(engine, routing, None, MetaServiceConfig(claim_ttl_ms=TTL_MS),  # type: ignore[arg-type]
                       server_id=f"meta-node-{node_id}".encode(), node_id=node_id)


async def _everything(engine: TxnEngine) -> list[tuple[bytes, bytes]]:
    async def read(txn: Transaction) -> list[tuple[bytes, bytes]]:
        return await txn.scan(b"", None)

    return await run_transaction(engine, read)


@asynccontextmanager
async def _engine(database: str, request: pytest.FixtureRequest) -> AsyncIterator[TxnEngine]:
    if database == "memory":
        yield OptimisticTxnEngine(MemKVStore(), sync=False)
        return
    from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine

    engine = await PostgresTxnEngine.open(PostgresConfig(request.getfixturevalue("postgres_url")))
    try:
        yield engine
    finally:
        await engine.close()


def _run(database: str, request: pytest.FixtureRequest, body: Callable[[TxnEngine], Awaitable[None]]) -> None:
    async def main() -> None:
        async with _engine(database, request) as engine:
            await body(engine)

    asyncio.run(main())


@pytest.mark.parametrize("database", ["memory", "postgresql"])
def test_a_second_server_with_a_live_servers_node_id_is_refused_and_writes_nothing(
        database: str, request: pytest.FixtureRequest) -> None:
    async def body(engine: TxnEngine) -> None:
        first, other = _server(engine, 1001), _server(engine, 1002)
        await first.start(background=False)
        await other.start(background=False)  # another id: side by side
        try:
            before = await _everything(engine)
            second = _server(engine, 1001)
            with pytest.raises(AlreadyExists, match="meta node id 1001 is in use by a live meta server") as refused:
                await second.start(background=False)
            assert "node_id" in str(refused.value) and "nothing was written" in str(refused.value)
            after = await _everything(engine)
            # The live servers renewed their own records meanwhile; nothing else changed.
            registrations = {claim_key(node_id_claim(n)) for n in (1001, 1002)}
            assert [kv for kv in after if kv[0] not in registrations] == [
                kv for kv in before if kv[0] not in registrations]
            assert ({k: ClaimRecord.decode(v).owner for k, v in after if k in registrations}
                    == {k: ClaimRecord.decode(v).owner for k, v in before if k in registrations})
            assert not first.registration_lost.is_set()
        finally:
            await first.stop()
            await other.stop()
        # A clean stop hands the id back: the next server takes it without waiting.
        assert not [k for k, _ in await _everything(engine) if k == claim_key(node_id_claim(1001))]
        again = _server(engine, 1001)
        await again.start(background=False)
        await again.stop()

    _run(database, request, body)


@pytest.mark.parametrize("database", ["memory", "postgresql"])
def test_a_server_restarted_after_a_crash_takes_its_node_id_back_and_the_old_life_would_lose_it(
        database: str, request: pytest.FixtureRequest) -> None:
    async def body(engine: TxnEngine) -> None:
        # The first life registered, then died: its record is left behind, never renewed again.
        dead = NodeRegistration(engine, 1001, LoopClock(), TTL_MS)
        await dead.acquire()
        restarted = _server(engine, 1001)
        await restarted.start(background=False)  # waits out one ttl of the record standing still
        try:
            assert restarted.registration is not None
            raw = [v for k, v in await _everything(engine) if k == claim_key(node_id_claim(1001))]
            assert [ClaimRecord.decode(v).owner for v in raw] == [restarted.registration.owner]
            # Had the old life been only cut off, its next renewal finds the id taken: it stops.
            assert dead.held is not None and not await dead.table.renew(dead.held)
        finally:
            await restarted.stop()

    _run(database, request, body)


def test_a_server_whose_node_id_was_taken_over_learns_it_and_leaves_the_new_record_alone() -> None:
    async def body() -> None:
        engine = OptimisticTxnEngine(MemKVStore(), sync=False)
        server = _server(engine, 1001)
        await server.start()
        try:
            # Another process took the id over (this one was cut off from the database for a ttl).
            async def take(txn: Transaction) -> None:
                txn.put(claim_key(node_id_claim(1001)), ClaimRecord(b"elsewhere/pid 1/00", 7).encode())
            await run_transaction(engine, take)

            async def lost() -> bool:
                return server.registration_lost.is_set()
            await wait_until(lost, timeout_s=20, what="the server learning its id was taken")
            # Its stop leaves the other's record alone.
            await server.stop()
            raw = engine.store.get(claim_key(node_id_claim(1001)))
            assert raw is not None and ClaimRecord.decode(raw).owner == b"elsewhere/pid 1/00"
        finally:
            await server.stop()

    asyncio.run(body())


def test_node_ids_are_checked() -> None:
    with pytest.raises(InvalidArgument):
        node_id_claim(0)
    with pytest.raises(InvalidArgument):
        node_id_claim(1 << 32)
    assert node_id_claim(1001) == b"N\x00\x00\x03\xe9"

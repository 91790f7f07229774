"""Hostile review of issue 22, second round (the round-trip deadline, path hints, node ids, the
private PostgreSQL and fs3 local on it): findings as tests.

Each test failed before its fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from urllib.parse import urlsplit, urlunsplit

import pytest

from fs3.common.errors import Unavailable


def test_a_password_with_a_colon_is_redacted_whole() -> None:
    """A URI's password may hold ``:`` (libpq splits user from password at the first one)."""
    from fs3.kv.postgres import redact_url

    shown = redact_url("postgresql://fs3:top:s3cret@h:5432/db")
    assert "top" not in shown and "s3cret" not in shown, shown
    assert shown == "postgresql://fs3:***@h:5432/db"


@pytest.mark.parametrize("url", [
    "postgresql://fs3:s3c%zzret@127.0.0.1:1/db",  # a bad percent escape in the password
    "postgresql://fs3@127.0.0.1:1/db?password=%zzs3cret",  # and in ?password=
])
def test_a_url_libpq_cannot_parse_does_not_echo_its_password(url: str) -> None:
    """libpq quotes the token it cannot decode; ``fs3 local up --pg-url`` printed it."""
    from fs3.cluster.postgres import check_reachable

    with pytest.raises(Unavailable) as err:
        check_reachable(url, timeout_s=1)
    assert "s3c" not in str(err.value), str(err.value)


class _Relay:
    """A TCP relay to the server that can hold everything (both ways, sockets left open): a
    database cut off by the network."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.cut = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                while self.cut.is_set():
                    await asyncio.sleep(0.01)
                dst.write(data)
                await dst.drain()

        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        writer.close()
        up_writer.close()

    def url(self, postgres_url: str, port: int) -> str:
        parts = urlsplit(postgres_url)
        return urlunsplit(parts._replace(netloc=f"{parts.username}:{parts.password}@127.0.0.1:{port}"))


def test_a_dropped_transactions_rollback_cut_off_by_the_network_ends_at_the_deadline(postgres_url: str) -> None:
    """A read-only transaction dropped uncommitted (meta's reads) has its ROLLBACK sent by the
    pool; with the database cut off, that round trip had no deadline and held its pooled slot
    for as long as TCP retransmits (minutes): the pool ran dry while every request's own round
    trip was bounded. It must end at ``round_trip_timeout_ms`` like any other."""
    from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine

    parts = urlsplit(postgres_url)
    assert parts.hostname and parts.port

    async def body() -> None:
        relay = _Relay(parts.hostname, parts.port)
        port = await relay.start()
        engine = await PostgresTxnEngine.open(PostgresConfig(
            relay.url(postgres_url, port), statement_timeout_ms=200, round_trip_timeout_ms=600, pool_size_max=1,
            acquire_timeout_ms=30_000))
        try:
            reader = engine.begin()
            assert await reader.get(b"k") is None  # holds the pool's one connection, a transaction open
            relay.cut.set()
            del reader  # dropped uncommitted: the pool rolls it back, over the cut path
            gc.collect()
            try:
                await asyncio.wait_for(engine.settle(), 5)
            except TimeoutError:
                pytest.fail("the pool's ROLLBACK of a dropped transaction still waits, 5 s into the cut "
                            "(its deadline is 600 ms): the pool's only slot is held")
            relay.cut.clear()
            txn = engine.begin()  # the slot came free: a fresh connection
            txn.put(b"k", b"1")
            await txn.commit()
        finally:
            relay.cut.clear()
            await engine.close()
            if relay.server is not None:
                relay.server.close()

    asyncio.run(body())

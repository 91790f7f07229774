"""Hostile review of issue 22, second round (the round-trip deadline, path hints, node ids, the
private PostgreSQL and fs3 local on it): findings as tests.

Each test failed before its fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fs3.common.errors import Unavailable
from tests.conftest import wait_until
from tests.postgres import CutRelay


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


def test_a_dropped_transactions_rollback_cut_off_by_the_network_ends_at_the_deadline(postgres_url: str) -> None:
    """A read-only transaction dropped uncommitted (meta's reads) has its ROLLBACK sent by the
    pool; with the database cut off, that round trip had no deadline and held its pooled slot
    for as long as TCP retransmits (minutes): the pool ran dry while every request's own round
    trip was bounded. It must end at ``round_trip_timeout_ms`` like any other."""
    from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine

    async def body() -> None:
        relay = CutRelay(postgres_url)
        engine = await PostgresTxnEngine.open(PostgresConfig(
            await relay.start(), statement_timeout_ms=200, round_trip_timeout_ms=600, pool_size_max=1,
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
            await relay.close()

    asyncio.run(body())


class _Cuttable:
    """An engine as one meta server sees it: cut off from the database (every read and commit
    Unavailable) while ``cut`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.cut = False

    def begin(self) -> Any:
        if self.cut:
            raise Unavailable("cut off from the database (test)")
        return self.inner.begin()

    async def wait_durable(self) -> None:
        await self.inner.wait_durable()


def test_a_meta_server_whose_node_id_was_taken_over_takes_no_claim_of_the_new_holder() -> None:
    """A claim's owner is the node id, so a server takes a claim recorded under its own id at once.
    A server cut off from the database for a ttl has its id taken over by a restarted one (which
    takes that id's claims); healed, it served again until its next renewal noticed the loss, and
    in that window took the new holder's live claims as its own: both ran one inode's truncate.
    Once its registration is no longer trusted (nor after it learned of the loss) it takes none."""
    from fs3.client.routing import RoutingCache
    from fs3.kv.store import MemKVStore
    from fs3.kv.txn import OptimisticTxnEngine
    from fs3.meta.claims import inode_claim
    from fs3.meta.service import MetaService, MetaServiceConfig

    ttl_ms = 400

    class NoChannels:
        def node_address(self, framed: str, grpc: str) -> str:
            return framed

    def server(engine: Any) -> MetaService:
        routing = RoutingCache(["mgmtd"], NoChannels())  # type: ignore[arg-type]
        return MetaService(engine, routing, None, MetaServiceConfig(claim_ttl_ms=ttl_ms),  # type: ignore[arg-type]
                           server_id=b"meta-node-1001", node_id=1001)

    async def body() -> None:
        engine = OptimisticTxnEngine(MemKVStore(), sync=False)
        seen_by_old = _Cuttable(engine)
        old, new = server(seen_by_old), server(engine)
        await old.start(background=False)
        try:
            seen_by_old.cut = True  # the old one is cut off from the database...
            await new.start(background=False)  # ...for a ttl: a restarted one takes the id over
            held = await new.claims.try_claim(inode_claim(5))
            assert held is not None
            seen_by_old.cut = False  # healed, before the old one's next renewal
            assert await old.claims.try_claim(inode_claim(5)) is None, \
                "a server whose id was taken over took the new holder's live claim"

            async def lost() -> bool:
                return old.registration_lost.is_set()
            await wait_until(lost, timeout_s=20, what="the old server learning its id was taken")
            assert await old.claims.try_claim(inode_claim(5)) is None, \
                "a server that knows its id was taken over still takes claims under it"
        finally:
            seen_by_old.cut = False
            await old.stop()
            await new.stop()

    asyncio.run(body())


def test_the_metadata_ledger_notices_a_remove_that_ran_twice() -> None:
    """The ha scenarios promise exactly-once retries across a meta server's death: a client's
    remove that reached a meta server which died before answering is retried on another, and
    must get the first run's answer. Were the saved answers lost (the ``idempotency`` sabotage),
    the retry runs again and fails "no such file": the workload recorded that as unacknowledged,
    which the ledger ignored (may have happened or not), so the scenario passed. A remove of a
    file whose create was acknowledged and that nothing else removes cannot fail so honestly."""
    from tests.chaos.cluster import check_namespace

    ops = [{"kind": "create", "name": "w0-1", "ok": True, "invoke": 1.0, "complete": 2.0},
           {"kind": "remove", "name": "w0-1", "ok": False, "invoke": 3.0, "complete": None,
            "error": "[Errno 2] No such file or directory: '/chaos/ns/w0-1'", "errno": errno.ENOENT}]
    report = check_namespace({"namespace": {"ops": ops, "final": {}}})
    assert report["namespace_lost"], "a remove that ran twice (its retry saw its own effect) passed the ledger"


@pytest.mark.slow
def test_a_private_postgresql_whose_first_start_was_killed_during_initdb_starts_next_time(tmp_path: Path) -> None:
    """``initdb`` writes ``PG_VERSION`` first and the catalogs after it; the wrapper took
    ``PG_VERSION`` for a finished cluster. A first ``fs3 local up`` interrupted then (``fs3 local
    kill postgres``, a SIGKILL of the group, a machine reset) left a directory no later start
    could use: every start retried for a minute and failed, until the user removed it by hand."""
    from fs3.cluster.postgres import find_bin_dir
    from fs3.common.secret_files import write_secret_file

    if find_bin_dir() is None:
        pytest.skip("PostgreSQL server binaries not found")
    root, password, ready = tmp_path / "pg", tmp_path / "password", tmp_path / "ready.json"
    write_secret_file(password, "s3cret\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-P", "-m", "fs3.cluster.postgres", "serve", "--dir", str(root), "--port", str(port),
            "--password-file", str(password), "--ready-file", str(ready)]
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not any(root.glob("data*/PG_VERSION")) and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.005)
        assert any(root.glob("data*/PG_VERSION")), "initdb never started"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)  # mid-initdb: it takes a second or more
        first.wait()
    second = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while not ready.exists() and second.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        output = b"" if second.poll() is None or second.stdout is None else second.stdout.read()
        assert ready.exists(), f"the start after an interrupted initdb never accepted connections: {output[-600:]!r}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(second.pid, signal.SIGTERM)
        try:
            second.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait()


def test_the_ha_scenarios_notice_a_metadata_client_that_never_failed_over() -> None:
    """"SIGKILL a meta server: its clients carry on through another". The run counted the
    scenario as carried on when *any* metadata worker acknowledged an operation after the kill,
    so a client stuck on the dead server (failover broken) passed as long as another worker,
    on a live server, made progress. Each worker must."""
    from tests.chaos.cluster import stalled_after

    def op(name: str, invoke: float, ok: bool) -> dict[str, Any]:
        return {"kind": "create", "name": name, "invoke": invoke, "complete": invoke + 0.1 if ok else None, "ok": ok}

    ns_ops = [op("w0-1", 1.0, True), op("w0-2", 6.0, True), op("w0-3", 8.0, True),
              op("w1-1", 1.0, True), op("w1-2", 6.0, False), op("w1-3", 8.0, False)]
    result: dict[str, Any] = {"ops": [{"ok": True, "invoke": 9.0}], "namespace": {"ops": ns_ops}}
    assert stalled_after(result, 5.0) == ["metadata worker w1"]
    ns_ops.append(op("w1-4", 9.0, True))
    assert stalled_after(result, 5.0) == []

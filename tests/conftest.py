"""Shared fixtures: real-process clusters and a client factory over either transport."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Tests fork children (other users' processes on the FUSE mount). With gRPC's fork handlers on, a
# child forked while gRPC threads run can report "epoll_wait error: Bad file descriptor" and lose
# its output; the test process never uses gRPC across a fork, so it does not need them. Must be set
# before grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient, StorageClientConfig
from fs3.common import clock as clock_mod
from fs3.rpc.channel import RealChannelFactory
from tests.harness import ProcessCluster, require_fuse

# A session that leaves new files in the git checkout fails (tests/clean_tree.py).
# A failure is printed the moment it happens, and a session past its time budget stops with its
# summary (tests/ci_report.py). A private PostgreSQL server, and databases of either engine
# (tests/postgres.py); either transaction engine (tests/txn_engines.py).
pytest_plugins = ["tests.clean_tree", "tests.ci_report", "tests.postgres", "tests.txn_engines"]

TRANSPORTS = ("framed", "grpc")


@pytest.fixture(autouse=True)
def _umask_restored() -> Iterator[None]:
    """Each test leaves the process's umask as it found it. Commands run in process (``fs3 local
    up`` through ``main(argv)``) set the services' private umask 077 for the rest of the process,
    and a later test's ``mkdir(mode=0o755)`` made 0700 then."""
    saved = os.umask(0o022)
    os.umask(saved)
    try:
        yield
    finally:
        os.umask(saved)


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One in-process cluster with meta for the tests that only need a working file system."""
    from tests.inproc import ClusterThread

    runner = ClusterThread(tmp_path_factory.mktemp("shared-cluster"))
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture
def process_cluster(tmp_path: Path) -> Iterator[ProcessCluster]:
    cluster = ProcessCluster(tmp_path / "cluster", token="secret")
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.stop_all()


@pytest.fixture(scope="session")
def _crash_disk_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require_fuse()
    from fs3.testing.crashfs import CrashDisk

    with CrashDisk(tmp_path_factory.mktemp("crashfs")) as disk:
        yield disk


@pytest.fixture
def crash_disk(_crash_disk_daemon: Any) -> Any:
    """A CrashFS mount (``crash_disk.path``), empty, whose ``power_cut()`` drops everything never
    synced (one daemon for the session, emptied for each test)."""
    _crash_disk_daemon.reset()
    return _crash_disk_daemon


def make_client(cluster: ProcessCluster, transport: str = "framed", name: bytes = b"test-client",
                token: str | None = None) -> tuple[StorageClient, RealChannelFactory]:
    channels = RealChannelFactory(cluster.token if token is None else token, transport)  # type: ignore[arg-type]
    mgmtd = cluster.address("mgmtd", transport)
    routing = RoutingCache([mgmtd], channels, rpc_timeout_ms=3_000)
    client = StorageClient(routing, channels, name,
                           StorageClientConfig(rpc_timeout_ms=3_000, retry_total_ms=45_000, retry_backoff_ms=50),
                           clock=clock_mod.LoopClock())
    return client, channels


async def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.1, what: str = "condition"):  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        result = await predicate()
        if result:
            return result
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")

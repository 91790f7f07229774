"""The private PostgreSQL server of tests/postgres.py: it serves databases, and a test process that is
killed (SIGKILL: no teardown runs) leaves no server running and no directory behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.postgres import OWNER_FILE, PREFIX, PostgresServer, _RunAs, find_bin_dir, sweep_stale

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 60.0


def test_the_server_serves_a_database_of_its_own(postgres_server: PostgresServer, postgres_url: str) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW server_version")).scalar_one().startswith(postgres_server.version)
            assert conn.execute(text("SELECT current_database()")).scalar_one() == postgres_url.rsplit("/", 1)[1]
    finally:
        engine.dispose()
    assert postgres_server.password not in repr(postgres_server.root)


_CHILD = textwrap.dedent("""
    import sys, time
    from tests.postgres import find_bin_dir, start_postgres
    server = start_postgres(find_bin_dir())
    print(server.root, server.port, flush=True)
    time.sleep(600)
""")


def _refused(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_a_killed_test_process_leaves_no_server(postgres_server: PostgresServer) -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout is not None
        root, port = child.stdout.readline().split()
        assert Path(root).is_dir() and not _refused(int(port))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    deadline = time.monotonic() + DEADLINE_S
    while Path(root).exists() or not _refused(int(port)):
        assert time.monotonic() < deadline, f"{root} (port {port}) still there after the test process died"
        time.sleep(0.1)


def test_a_directory_whose_owner_died_is_swept_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    bin_dir = find_bin_dir()
    if bin_dir is None:
        pytest.skip("no PostgreSQL binaries")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    stale, live = tmp_path / f"{PREFIX}stale", tmp_path / f"{PREFIX}live"
    for root, owner in ((stale, dead), (live, str(os.getpid()))):
        (root / "data").mkdir(parents=True)
        (root / OWNER_FILE).write_text(owner)
    assert sweep_stale(tmp_path, _RunAs.pick(), bin_dir) == [stale]
    assert not stale.exists() and live.exists()


def test_a_directory_whose_owner_pid_was_reused_is_swept(tmp_path: Path) -> None:
    """The owner file records the pid with its start time (fs3's pid file): a live process that
    got the dead owner's pid is not taken for it."""
    import json

    from fs3.cluster.processes import process_start_time, write_pid_file

    bin_dir = find_bin_dir()
    if bin_dir is None:
        pytest.skip("no PostgreSQL binaries")
    reused, live = tmp_path / f"{PREFIX}reused", tmp_path / f"{PREFIX}live"
    for root in (reused, live):
        (root / "data").mkdir(parents=True)
    start = process_start_time(os.getpid())
    assert start is not None
    (reused / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "start_time": start - 1}))
    write_pid_file(live / OWNER_FILE, os.getpid())
    assert sweep_stale(tmp_path, _RunAs.pick(), bin_dir) == [reused]
    assert live.exists()

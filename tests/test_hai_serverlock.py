"""One ``hai server`` per database (``hai.store.ServerLock``): a second server is refused at once,
naming the first; on PostgreSQL the lock is taken again after a database restart, and a server
whose lock another server took meanwhile stops scheduling and exits (fencing).

Each test that takes ``url`` runs on a SQLite file and on a PostgreSQL database (tests/postgres.py)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from hai import rules
from hai.rules import Priority, Quota
from hai.server import HaiServer, Users, _loop
from hai.store import _SERVER_LOCK, ServerLock, Store, StoreLockedError, StoreLockLostError, engine_url
from tests.postgres import SKIP_REASON, PostgresServer, find_bin_dir, start_postgres

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 60.0
HERE = f"pid {os.getpid()} on {socket.gethostname()}"


@pytest.fixture
def url(fresh_database: Callable[[], str]) -> str:
    return fresh_database()


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_second_lock_on_a_database_is_refused_naming_the_first(url: str) -> None:
    with Store.open(url) as first, Store.open(url) as second:
        held = ServerLock.acquire(first)
        try:
            with pytest.raises(StoreLockedError) as refused:
                ServerLock.acquire(second)
            assert f"another hai server ({HERE}) holds the database" in str(refused.value)
            held.check()  # still ours
            assert held.held
        finally:
            held.release()
        assert not held.held
        ServerLock.acquire(second).release()  # once let go, the next server takes it


def test_a_sqlite_lock_file_lies_next_to_the_database(tmp_path: Path) -> None:
    with Store.open(f"sqlite:///{tmp_path / 'hai.db'}") as db:
        held = ServerLock.acquire(db)
        try:
            assert (tmp_path / "hai.db.lock").read_text().split() == [str(os.getpid()), socket.gethostname()]
        finally:
            held.release()


def _serve(tmp: Path, name: str, db_url: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FS3_", "HAI_"))}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen([sys.executable, "-m", "hai", "server", "--dir", str(tmp / "hai"), "--db-url", db_url,
                             "--port", "0", "--tick-interval-s", "0.1", "--ready-file", str(tmp / f"{name}.json")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.terminate()
    out, _ = proc.communicate(timeout=DEADLINE_S)
    return out.decode(errors="replace")


def test_a_second_hai_server_process_exits_at_once_saying_who_holds_the_database(url: str, tmp_path: Path) -> None:
    first = _serve(tmp_path, "first", url)
    try:
        wait_for(lambda: (tmp_path / "first.json").exists() or first.poll() is not None, "the first server")
        assert first.poll() is None, _stop(first)
        pid = json.loads((tmp_path / "first.json").read_text())["pid"]
        second = _serve(tmp_path, "second", url)
        out, _ = second.communicate(timeout=DEADLINE_S)
        said = out.decode(errors="replace")
        assert second.returncode == 1, said
        assert f"hai server: another hai server (pid {pid} on {socket.gethostname()}) holds the database" in said
        assert not (tmp_path / "second.json").exists()
    finally:
        _stop(first)


# -- PostgreSQL: a restart, and fencing ------------------------------------------------------------


@pytest.fixture
def private_postgres() -> Iterator[PostgresServer]:
    """A server of this test's own: restarting it must not disturb the session's shared one."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        pytest.skip(SKIP_REASON)
    pytest.importorskip("psycopg")
    server = start_postgres(bin_dir)
    try:
        yield server
    finally:
        server.stop()


def test_the_lock_is_taken_again_after_a_postgresql_restart(private_postgres: PostgresServer) -> None:
    url = private_postgres.create_database()
    with Store.open(url) as first, Store.open(url) as second:
        held = ServerLock.acquire(first)
        try:
            private_postgres.restart()  # ends the lock's session, and the lock with it
            wait_for(lambda: _check_quietly(held), "the lock to be taken again")
            with pytest.raises(StoreLockedError, match=f"another hai server \\({HERE}\\)"):
                ServerLock.acquire(second)
        finally:
            held.release()


def _check_quietly(lock: ServerLock) -> bool:
    lock.check()  # raises if another server took it; while the database is down it only logs
    return lock.held


def _take_from(url: str, server_lock: ServerLock) -> Callable[[], None]:
    """Queue for the lock on a session of the test's own, then end ``server_lock``'s session: the
    queued session gets the lock before the server can take it again (a second server that won the
    race after a restart). Returns how to let go."""
    engine = create_engine(engine_url(url))
    conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    taken = threading.Event()

    def take() -> None:
        conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _SERVER_LOCK})
        taken.set()

    thread = threading.Thread(target=take)
    thread.start()
    with engine.connect() as other:
        wait_for(lambda: other.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                            "AND NOT granted")).scalar_one() == 1, "the test to queue")
        other.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE application_name LIKE 'hai-server %'"))
        other.commit()
    assert taken.wait(DEADLINE_S)
    thread.join()

    def release() -> None:
        conn.close()
        engine.dispose()

    return release


def test_a_server_whose_lock_another_took_stops_scheduling(postgres_url: str) -> None:
    store = Store.open(postgres_url)
    server = HaiServer(store, Users())
    server.server_lock = ServerLock.acquire(store)
    ended: list[bool] = []
    server.on_fenced = lambda: ended.append(True)
    release = _take_from(postgres_url, server.server_lock)
    try:
        with pytest.raises(StoreLockLostError, match="another hai server"):
            server.server_lock.check()
        asyncio.run(asyncio.wait_for(_loop(server), DEADLINE_S))  # returns: no more scheduling passes
        assert ended == [True] and "took the database" in server.fenced
        with pytest.raises(StoreLockLostError):
            server.change(lambda s: rules.set_quota(s, Quota("zed", "default", Priority.LOW, 3)))
    finally:
        release()
        server.server_lock.release()
        server.close()


def test_a_fenced_hai_server_process_exits_with_one_logged_line(postgres_url: str, tmp_path: Path) -> None:
    proc = _serve(tmp_path, "first", postgres_url)
    try:
        wait_for(lambda: (tmp_path / "first.json").exists() or proc.poll() is not None, "the server")
        assert proc.poll() is None, _stop(proc)
        release = _take_from(postgres_url, ServerLock())
        try:
            proc.wait(DEADLINE_S)
        finally:
            release()
        said = _stop(proc)
        assert proc.returncode == 1, said
        assert "hai server: another hai server (pid unknown) took the database" in said, said
    finally:
        _stop(proc)

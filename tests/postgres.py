"""A private PostgreSQL server for the tests: Debian's binaries, a throwaway cluster in /tmp.

``postgres_server`` (session scope) runs ``initdb`` in a fresh ``/tmp/fs3-pg-*`` directory and
starts the server with ``pg_ctl`` on a free TCP port of 127.0.0.1 (password auth, a random
password) and on a unix socket in that directory; it is stopped and the directory removed at the
end of the session. ``postgres_url`` is an empty database of its own for one test, dropped after.
``fresh_database`` is parametrized over ``sqlite`` and ``postgresql``: a callable returning the URL
of a new empty database of that engine, so a test that takes it runs on both.

Why it is built this way:

* The server refuses to run as root, and the tests run as root: ``initdb`` and ``pg_ctl`` then run as
  the ``postgres`` account Debian's package creates (``nobody`` where there is none), the directory
  is theirs. As any other user they run as that user.
* Durability is switched off (``fsync``, ``synchronous_commit``, ``full_page_writes``): the data is
  thrown away, and a commit is then a round trip rather than a disk flush.
* A test process that is killed must not leave a server running: a watchdog process (its own
  session, so a Ctrl-C or a killed process group does not take it) holds the read end of a pipe
  whose write end only the test process holds; when the test process dies, however it dies, the
  read returns and the watchdog stops the server and removes the directory. A directory left by a
  watchdog that was itself killed is swept by the next session (its owner's pid is gone).
* It skips, naming the package, only when the binaries are absent; a server that is present and
  does not start is an error, with the end of its log.
* ``start_postgres(..., netns=NS, listen_host=ADDR, port=N)`` runs the server inside a network
  namespace (the chaos harness's ``postgres`` host): its programs start through ``ip netns exec``
  and then drop to the server's account (``setpriv``), it listens on that host's address, and the
  superuser reaches it by its unix socket (a path, which every namespace shares) with the password,
  so :meth:`PostgresServer.execute` works from the harness's own namespace.
  :meth:`PostgresServer.kill` and :meth:`PostgresServer.start` are a crash and a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from fs3.cluster.processes import pid_alive, read_pid_file, write_pid_file

__all__ = [
    "DATABASES",
    "CutRelay",
    "PostgresError",
    "PostgresServer",
    "find_bin_dir",
    "fresh_database",
    "postgres_server",
    "postgres_url",
    "start_postgres",
]

PG_ROOT = Path("/usr/lib/postgresql")
PREFIX = "fs3-pg-"
OWNER_FILE = "owner.pid"
SUPERUSER = "fs3_test"
DATABASES = ("sqlite", "postgresql")
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30
START_ATTEMPTS = 3  # a free port can be taken between choosing it and the server binding it
SKIP_REASON = ("PostgreSQL server binaries not found (/usr/lib/postgresql/<version>/bin/initdb, pg_ctl): "
               "install Debian's postgresql package (scripts/bootstrap.sh does)")


class PostgresError(RuntimeError):
    """The server did not start or stop; the message carries the end of its log."""


def find_bin_dir(root: Path = PG_ROOT) -> Path | None:
    """The newest ``<root>/<major>/bin`` that has ``initdb``, ``pg_ctl`` and ``postgres``."""
    found: list[tuple[int, Path]] = []
    if root.is_dir():
        for entry in root.iterdir():
            bin_dir = entry / "bin"
            if entry.name.isdigit() and all(os.access(bin_dir / b, os.X_OK) for b in ("initdb", "pg_ctl", "postgres")):
                found.append((int(entry.name), bin_dir))
    return max(found)[1] if found else None


@dataclass(frozen=True)
class _RunAs:
    """Who runs the server's programs: ``None`` fields mean "as this process"."""

    user: str | None
    uid: int
    gid: int
    # A command prefix every program runs under (``ip netns exec NS``); it needs this process's
    # privileges, so the switch to ``user`` then happens after it, by setpriv.
    prefix: tuple[str, ...] = ()

    @classmethod
    def pick(cls) -> _RunAs:
        if os.geteuid() != 0:
            return cls(None, os.geteuid(), os.getegid())
        for name in ("postgres", "nobody"):
            with contextlib.suppress(KeyError):
                entry = pwd.getpwnam(name)
                return cls(name, entry.pw_uid, entry.pw_gid)
        raise PostgresError("running as root and there is no postgres (or nobody) account to run the server as")

    def within(self, prefix: tuple[str, ...]) -> _RunAs:
        """The same account, its programs run under ``prefix``."""
        return _RunAs(self.user, self.uid, self.gid, prefix)

    def run(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        extra: dict[str, Any] = {}
        if self.prefix:
            drop = [] if self.user is None else ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}",
                                                 "--clear-groups"]
            argv = [*self.prefix, *drop, *argv]
        elif self.user is not None:
            extra = {"user": self.uid, "group": self.gid, "extra_groups": []}
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False, cwd="/",
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}, **extra)


@dataclass
class PostgresServer:
    """A running private server. ``url(database)`` is a SQLAlchemy URL (driver psycopg 3) with the
    superuser's password in it; ``create_database()`` makes an empty database and returns its URL."""

    root: Path
    bin_dir: Path
    port: int
    password: str
    version: str
    run_as: _RunAs
    host: str = "127.0.0.1"
    user: str = SUPERUSER
    netns: str | None = None  # the network namespace it runs in (None: this process's)
    options: str = ""  # pg_ctl start -o: what start() starts it with
    _watchdog: subprocess.Popen[bytes] | None = None
    _names: Iterator[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        return self.root

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{self.user}:{self.password}@{self.host}:{self.port}/{database}"

    def execute(self, sql: str) -> None:
        """One statement as the superuser, outside a transaction (CREATE/DROP DATABASE need that)."""
        import psycopg

        # In another namespace its TCP address is not reachable from here; its socket's path is.
        host = str(self.socket_dir) if self.netns else self.host
        with psycopg.connect(host=host, port=self.port, user=self.user, password=self.password,
                             dbname="postgres", autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.encode())

    def create_database(self, prefix: str = "t") -> str:
        """A new empty database (``<prefix>_<n>``); returns its URL."""
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,30}", prefix):
            raise ValueError(f"database prefix {prefix!r}: lower-case letters, digits and _")
        with self._lock:
            name = f"{prefix}_{next(self._names)}"
        # FILE_COPY (PostgreSQL 15+; older servers only copy files) skips WAL-logging the copy: faster here.
        strategy = " STRATEGY FILE_COPY" if int(self.version.split(".")[0]) >= 15 else ""
        self.execute(f'CREATE DATABASE "{name}" TEMPLATE template0{strategy}')
        return self.url(name)

    def drop_database(self, url_or_name: str) -> None:
        """Drop a database, closing whatever connections a test left open to it."""
        name = url_or_name.rsplit("/", 1)[-1]
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,40}", name):
            raise ValueError(f"not a database this fixture made: {name!r}")
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def restart(self) -> None:
        """Restart the server on the same port and data (``pg_ctl restart``, fast shutdown): every
        open connection is cut, as a database failover or upgrade would cut a real server's."""
        done = self.run_as.run([str(self.bin_dir / "pg_ctl"), "restart", "-D", str(self.data_dir), "-m", "fast",
                                "-l", str(self.root / "server.log"),
                                "-w", "-t", str(START_TIMEOUT_S)], START_TIMEOUT_S + STOP_TIMEOUT_S)
        if done.returncode != 0:
            raise PostgresError(f"pg_ctl restart failed: {(done.stderr or done.stdout).strip()[-1000:]}")

    def start(self) -> None:
        """Start the server on its data directory (again, after :meth:`kill`: PostgreSQL then
        recovers from its WAL). A crashed server's backends may hold its shared memory for a moment
        after the postmaster died: a start refused for that is tried again."""
        log = self.root / "server.log"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            started = self.run_as.run([str(self.bin_dir / "pg_ctl"), "start", "-D", str(self.data_dir), "-l",
                                       str(log), "-w", "-t", str(START_TIMEOUT_S), "-o", self.options],
                                      START_TIMEOUT_S + 10)
            if started.returncode == 0:
                return
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else started.stderr
            # A killed postmaster's pid stays in use (a zombie) until something reaps it.
            busy = ("shared memory block is still in use", 'lock file "postmaster.pid" already exists')
            if not any(b in tail[-600:] for b in busy) or time.monotonic() > deadline:
                raise PostgresError(f"pg_ctl start failed: {started.stderr.strip()[-500:]}\n{tail}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crash of its machine would end it (its backends notice and
        exit; nothing is flushed or shut down cleanly)."""
        pid_file = self.data_dir / "postmaster.pid"
        pid = int(pid_file.read_text().split("\n", 1)[0])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (fast, then immediate), remove its directory, dismiss the watchdog."""
        try:
            _stop(self.run_as, self.bin_dir, self.data_dir)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            if self._watchdog is not None:
                if self._watchdog.stdin is not None:
                    self._watchdog.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._watchdog.wait(timeout=STOP_TIMEOUT_S)


def _stop(run_as: _RunAs, bin_dir: Path, data_dir: Path) -> None:
    pid_file = data_dir / "postmaster.pid"
    with contextlib.suppress(OSError, ValueError):
        if not pid_alive(int(pid_file.read_text().split("\n", 1)[0])):
            return  # killed (kill()) and not started again: nothing runs
    if not pid_file.exists():
        return
    for mode in ("fast", "immediate"):
        done = run_as.run([str(bin_dir / "pg_ctl"), "stop", "-D", str(data_dir), "-m", mode, "-w",
                           "-t", str(STOP_TIMEOUT_S)], STOP_TIMEOUT_S + 10)
        if done.returncode == 0 or not (data_dir / "postmaster.pid").exists():
            return
    raise PostgresError(f"pg_ctl stop failed in {data_dir}: {done.stderr.strip()[-500:]}")


# Runs detached; argv: python -c WATCHDOG pg_ctl data_dir root uid gid. Its stdin is the pipe.
_WATCHDOG = """
import os, shutil, subprocess, sys
pg_ctl, data_dir, root, uid, gid = sys.argv[1:6]
sys.stdin.buffer.read()
if os.path.exists(os.path.join(data_dir, "postmaster.pid")):
    extra = {} if uid == "-" else {"user": int(uid), "group": int(gid), "extra_groups": []}
    subprocess.run([pg_ctl, "stop", "-D", data_dir, "-m", "immediate", "-w", "-t", "30"], cwd="/",
                   capture_output=True, timeout=60, **extra)
shutil.rmtree(root, ignore_errors=True)
"""


def _owner_alive(owner_file: Path) -> bool | None:
    """Whether the session that made a server directory still runs: its pid and start time (fs3's
    own pid file, so a reused pid is not taken for the owner); None when the file is not readable
    yet (being set up). A bare pid (a file written by an older version of this module, of a session
    that may still run) is trusted without its start time."""
    try:
        text = owner_file.read_text()
    except OSError:
        return None
    if text.strip().isdigit():
        return pid_alive(int(text))
    return read_pid_file(owner_file) is not None


def sweep_stale(tmp: Path, run_as: _RunAs, bin_dir: Path) -> list[Path]:
    """Stop and remove the servers of sessions that died without their watchdog; returns what went.
    A directory whose owner still runs (another session at the same time) is left alone."""
    swept = []
    for root in tmp.glob(f"{PREFIX}*"):
        alive = _owner_alive(root / OWNER_FILE)
        if alive is None or alive:
            continue  # not finished being set up (or not ours), or its session still runs
        with contextlib.suppress(PostgresError, subprocess.TimeoutExpired):
            _stop(run_as, bin_dir, root / "data")
        shutil.rmtree(root, ignore_errors=True)
        swept.append(root)
    return swept


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def start_postgres(bin_dir: Path, tmp: Path | None = None, durable: bool = False, *, listen_host: str = "127.0.0.1",
                   port: int | None = None, netns: str | None = None) -> PostgresServer:
    """initdb + pg_ctl start in a new ``<tmp>/fs3-pg-*`` directory; the caller must :meth:`stop` it.
    ``durable``: keep the server's default fsync, synchronous_commit and full_page_writes (a
    benchmark comparing engines at the same durability); the tests run without them.
    ``listen_host``/``port``: where it listens (``port`` None: a free one). ``netns``: run it in
    that network namespace (``listen_host`` one of its addresses, ``port`` given)."""
    if netns is not None and port is None:
        raise ValueError("a server in a network namespace needs its port (no free port can be chosen from here)")
    tmp = Path(tmp or tempfile.gettempdir())
    run_as = _RunAs.pick()
    if netns is not None:
        run_as = run_as.within(("ip", "netns", "exec", netns))
    sweep_stale(tmp, run_as, bin_dir)
    root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=tmp))
    try:
        write_pid_file(root / OWNER_FILE, os.getpid())
        os.chmod(root, 0o700)
        os.chown(root, run_as.uid, run_as.gid)
        password = secrets.token_hex(16)
        pwfile = root / "pwfile"
        pwfile.write_text(password + "\n")
        os.chown(pwfile, run_as.uid, run_as.gid)
        os.chmod(pwfile, 0o600)
        initdb = run_as.run([str(bin_dir / "initdb"), "-D", str(root / "data"), "-U", SUPERUSER, "--pwfile",
                             str(pwfile), "--auth-host=scram-sha-256",
                             # peer: as the server's account only; from a namespace the harness
                             # connects by the socket as the superuser, with the password.
                             "--auth-local=scram-sha-256" if netns else "--auth-local=peer", "-E", "UTF8",
                             "--locale=C", "--no-sync", "--no-instructions"], START_TIMEOUT_S)
        pwfile.unlink()
        if initdb.returncode != 0:
            raise PostgresError(f"initdb failed: {(initdb.stderr or initdb.stdout).strip()[-2000:]}")
        version = (root / "data" / "PG_VERSION").read_text().strip()
        if netns is not None:
            # Clients on other hosts, with the password (initdb allows only loopback), as the
            # official image's pg_hba.conf does.
            with (root / "data" / "pg_hba.conf").open("a") as hba:
                hba.write("host all all 0.0.0.0/0 scram-sha-256\n")
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(bin_dir / "pg_ctl"), str(root / "data"), str(root),
         "-" if run_as.user is None else str(run_as.uid), str(run_as.gid)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server = PostgresServer(root, bin_dir, 0, password, version, run_as, host=listen_host, netns=netns,
                            _watchdog=watchdog)
    try:
        for _ in range(START_ATTEMPTS if port is None else 1):
            server.port = _free_port(listen_host) if port is None else port
            unsafe = "" if durable else "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            server.options = (f"-p {server.port} -k {root} -c listen_addresses={listen_host} {unsafe}"
                              "-c max_connections=200 -c max_pred_locks_per_page=64")
            try:
                server.start()
                return server
            except PostgresError as exc:
                if port is not None or "already in use" not in str(exc):
                    raise
        raise PostgresError(f"pg_ctl start: no free port after {START_ATTEMPTS} tries")
    except BaseException:
        server.stop()
        raise


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One private server for the session (skipped, with the reason, where the binaries are absent)."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        pytest.skip(SKIP_REASON)
    pytest.importorskip("psycopg", reason="the psycopg driver is not installed (pip install 'psycopg[binary]')")
    server = start_postgres(bin_dir)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """An empty database of this test's own on the private server, dropped afterwards."""
    url = postgres_server.create_database()
    try:
        yield url
    finally:
        postgres_server.drop_database(url)


@pytest.fixture(params=DATABASES)
def fresh_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """A factory of new empty databases of one engine (the test runs once for each): SQLite files
    in the test's directory, or databases on the private PostgreSQL server (dropped afterwards)."""
    made: list[str] = []
    server: PostgresServer | None = None
    if request.param == "postgresql":
        server = request.getfixturevalue("postgres_server")

    def new() -> str:
        if server is not None:
            made.append(server.create_database())
        else:
            directory = tmp_path / f"db{len(made)}"
            directory.mkdir()
            made.append(f"sqlite:///{directory / 'hai.db'}")
        return made[-1]

    try:
        yield new
    finally:
        if server is not None:
            for url in made:
                server.drop_database(url)


class CutRelay:
    """A TCP relay in front of a test's PostgreSQL that can stop relaying (both ways, the sockets
    left open, the bytes held and delivered after the heal, as TCP would): a database cut off by the
    network, where TCP alone waits for minutes. ``url(postgres_url)`` is the same database through it."""

    def __init__(self, postgres_url: str) -> None:
        self.parts = urlsplit(postgres_url)
        assert self.parts.hostname and self.parts.port
        self.target = (self.parts.hostname, self.parts.port)
        self.cut = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> str:
        """Listen; the URL of the database through the relay."""
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])
        parts = self.parts
        return urlunsplit(parts._replace(netloc=f"{parts.username}:{parts.password}@127.0.0.1:{self.port}"))

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                while self.cut.is_set():
                    await asyncio.sleep(0.01)  # held, never delivered while cut
                dst.write(data)
                await dst.drain()

        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        writer.close()
        up_writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


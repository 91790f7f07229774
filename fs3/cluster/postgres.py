"""A private PostgreSQL server for a local cluster, run as one of its managed processes.

    python -m fs3.cluster.postgres serve --dir DIR --port PORT --password-file FILE --ready-file F [--fsync]

``fs3 local up --meta-engine postgres`` runs this as the service ``postgres``: the first start
runs ``initdb`` in ``DIR/data`` (Debian's binaries, ``/usr/lib/postgresql/<major>/bin``), every
start runs ``postgres`` as this process's child, waits until it accepts connections, creates the
databases fs3 needs (:data:`META_DATABASE`, :data:`MGMTD_DATABASE`: separate, because meta and
mgmtd both keep their data in tables of the same names) and writes the ready file. The ready file
names the address and a URL without its password; the password stays in FILE (``0600``), the
cluster's configs (``0600``) hold the URLs with it.

Why it is built this way:

* The server refuses to run as root. Run by root, ``initdb`` and ``postgres`` run as the
  ``postgres`` account Debian's package creates, and ``DIR/data`` is theirs. The cluster
  directory is ``0700`` (and may sit under another private directory): that account cannot walk
  down to ``DIR/data``. So this process opens it and the server reaches it as
  ``/proc/self/fd/N``, a link the kernel follows without checking the directories above.
* A SIGTERM is a fast shutdown (``SIGINT`` to the server: sessions are cut, the data is
  checkpointed). The server runs in this process's group, so a SIGKILL of the group (``fs3 local
  kill postgres``) is a crash: the next start runs crash recovery; and it gets SIGKILL if this
  process dies alone.
* Only TCP on 127.0.0.1 with password (SCRAM) authentication; no unix socket, so nothing is
  created outside DIR.
* Durability follows the cluster: ``--fsync`` keeps PostgreSQL's defaults, without it ``fsync``,
  ``synchronous_commit`` and ``full_page_writes`` are off (a commit survives a crash of the
  server, not of the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fs3.common.errors import FS3Error, InvalidArgument, Unavailable
from fs3.common.secret_files import make_private_dir, read_secret_file, write_secret_file
from fs3.kv.postgres import redact_message, redact_url

__all__ = [
    "META_DATABASE",
    "MGMTD_DATABASE",
    "PG_ROOT",
    "SUPERUSER",
    "PostgresServerConfig",
    "check_reachable",
    "find_bin_dir",
    "main",
    "postgres_argv",
    "server_url",
]

PG_ROOT = Path("/usr/lib/postgresql")
#: The superuser ``initdb`` makes, the one fs3's services connect as.
SUPERUSER = "fs3"
META_DATABASE = "fs3_meta"
MGMTD_DATABASE = "fs3_mgmtd"
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30
CONNECT_TIMEOUT_S = 5
# After a crash the old server's sessions take a moment to notice and exit; until they have, a new
# server refuses to start (its shared memory is still attached). Start again, this many times.
START_ATTEMPTS = 20
MISSING = ("PostgreSQL server binaries not found (/usr/lib/postgresql/<version>/bin/initdb, postgres): "
           "install Debian's postgresql package (scripts/bootstrap.sh does)")
_PR_SET_PDEATHSIG = 1


def find_bin_dir(root: Path = PG_ROOT) -> Path | None:
    """The newest ``<root>/<major>/bin`` that has ``initdb`` and ``postgres``."""
    found: list[tuple[int, Path]] = []
    if root.is_dir():
        for entry in root.iterdir():
            bin_dir = entry / "bin"
            if entry.name.isdigit() and all(os.access(bin_dir / b, os.X_OK) for b in ("initdb", "postgres")):
                found.append((int(entry.name), bin_dir))
    return max(found)[1] if found else None


def server_url(password: str, port: int, database: str, host: str = "127.0.0.1") -> str:
    """The URL fs3's services use for ``database`` on the private server (it holds the password)."""
    return f"postgresql://{SUPERUSER}:{password}@{host}:{port}/{database}"


def check_reachable(url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Connect once to ``url``: Unavailable, naming the URL without its password, when that fails
    (no server, a wrong password, no such database), so that ``fs3 local up`` stops before it
    starts anything."""
    import psycopg

    from fs3.kv.postgres import PostgresConfig

    PostgresConfig(url).validate()  # the scheme, before anything connects
    conninfo = "postgresql://" + url.partition("://")[2]
    try:
        with psycopg.connect(conninfo, connect_timeout=max(1, int(timeout_s)), autocommit=True):
            pass
    except psycopg.Error as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise Unavailable(f"cannot connect to PostgreSQL at {redact_url(url)}: {redact_message(reason, url)}") from None


@dataclass(frozen=True)
class PostgresServerConfig:
    """The private server of a cluster: its directory, port and password file, and whether it syncs."""

    data_dir: str
    port: int
    password_file: str = field(repr=False)
    fsync: bool = False

    def args(self) -> list[str]:
        """Its command line after ``python -m fs3.cluster.postgres`` (the ready file is added)."""
        return ["serve", "--dir", self.data_dir, "--port", str(self.port), "--password-file", self.password_file,
                *(["--fsync"] if self.fsync else [])]


def postgres_argv(args: list[str], ready_file: Path) -> list[str]:
    """The command line of this module's ``ARGS`` by this interpreter, writing its ready file
    (a :class:`~fs3.cluster.processes.ServiceProcess` ``program``)."""
    return [sys.executable, "-P", "-m", "fs3.cluster.postgres", *args, "--ready-file", str(ready_file)]


@dataclass(frozen=True)
class _RunAs:
    """Who runs the server's programs: ``user`` None means this process's own user."""

    user: str | None
    uid: int
    gid: int

    @classmethod
    def pick(cls) -> _RunAs:
        if os.geteuid() != 0:
            return cls(None, os.geteuid(), os.getegid())
        for name in ("postgres", "nobody"):
            with contextlib.suppress(KeyError):
                entry = pwd.getpwnam(name)
                return cls(name, entry.pw_uid, entry.pw_gid)
        raise InvalidArgument("running as root and there is no postgres (or nobody) account to run PostgreSQL as")

    def popen_args(self, pass_fds: Sequence[int]) -> dict[str, Any]:
        extra: dict[str, Any] = {"pass_fds": tuple(pass_fds), "cwd": "/",
                                 "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}}
        if self.user is not None:
            extra.update(user=self.uid, group=self.gid, extra_groups=[])
        return extra


def _die_with_parent() -> None:
    """In the server's child, after it changed user: SIGKILL when this wrapper dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class _Server:
    """One run of ``serve``: the data directory opened, the server started and watched."""

    def __init__(self, root: Path, port: int, password: str, fsync: bool, bin_dir: Path) -> None:
        self.root, self.port, self.password, self.fsync, self.bin_dir = root, port, password, fsync, bin_dir
        self.run_as = _RunAs.pick()
        data = root / "data"
        # initdb writes PG_VERSION first and the catalogs after it: it runs in a directory of its
        # own, renamed to DIR/data once complete, so that a start killed during it leaves nothing
        # a later start takes for a cluster (that one starts initdb afresh).
        self.initialized = (data / "PG_VERSION").exists()
        where = data if self.initialized else root / "data.initdb"
        if not self.initialized:
            for leftover in (where, data):  # an interrupted initdb's, or an empty one's
                shutil.rmtree(leftover, ignore_errors=True)
            where.mkdir(mode=0o700)
            if self.run_as.user is not None:
                os.chown(where, self.run_as.uid, self.run_as.gid)
        self.data_fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)  # follows the directory's rename
        # As the server's own user, the real path works; as root's stand-in, only the open directory does.
        self.data_path = str(where) if self.run_as.user is None else f"/proc/self/fd/{self.data_fd}"
        self.popen: subprocess.Popen[bytes] | None = None
        self.stopping = False  # a SIGTERM or SIGINT came: start nothing more

    def init_once(self) -> None:
        """``initdb`` unless the directory holds a cluster already (its ``PG_VERSION``)."""
        if self.initialized:
            return
        print(f"fs3-postgres: initdb in {self.root / 'data'}", flush=True)
        pwfile = self.root / "initdb.pw"
        pwfile.unlink(missing_ok=True)
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, (self.password + "\n").encode())
            os.fchown(fd, self.run_as.uid, self.run_as.gid)
        finally:
            os.close(fd)
        pw_fd = os.open(pwfile, os.O_RDONLY)
        pwfile.unlink()
        try:
            done = subprocess.run(
                [str(self.bin_dir / "initdb"), "-D", self.data_path, "-U", SUPERUSER, "--pwfile",
                 f"/proc/self/fd/{pw_fd}", "--auth-host=scram-sha-256", "--auth-local=peer", "-E", "UTF8",
                 "--locale=C", "--no-instructions", *([] if self.fsync else ["--no-sync"])],
                capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False,
                **self.run_as.popen_args([self.data_fd, pw_fd]))
        finally:
            os.close(pw_fd)
        if done.returncode != 0:
            raise Unavailable(f"initdb failed: {(done.stderr or done.stdout).strip()[-2000:]}")
        data = self.root / "data"
        os.rename(self.root / "data.initdb", data)
        if self.fsync:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(root_fd)
            finally:
                os.close(root_fd)
        if self.run_as.user is None:
            self.data_path = str(data)
        self.initialized = True

    def start(self) -> subprocess.Popen[bytes]:
        options = ["-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=", "-c", "max_connections=200",
                   "-c", "max_pred_locks_per_page=64"]
        if not self.fsync:
            options += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        return subprocess.Popen([str(self.bin_dir / "postgres"), "-D", self.data_path, "-p", str(self.port), *options],
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                **self.run_as.popen_args([self.data_fd]))

    def accepting(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, password=self.password,
                                 dbname="postgres", connect_timeout=2, autocommit=True):
                return True
        except psycopg.Error:
            return False

    def start_until_accepting(self) -> subprocess.Popen[bytes]:
        """The running server; a start that exits at once (the previous server's sessions still
        attached after a crash) is tried again, up to :data:`START_ATTEMPTS` times."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for _ in range(START_ATTEMPTS):
            popen = self.popen = self.start()
            while popen.poll() is None and time.monotonic() < deadline:
                if self.accepting():
                    return popen
                time.sleep(0.1)
            if popen.poll() is None or self.stopping:
                break
            time.sleep(0.5)
        self.stop()
        if self.stopping:
            raise Unavailable("stopped while PostgreSQL was starting")
        raise Unavailable(f"PostgreSQL did not accept connections on 127.0.0.1:{self.port} within "
                          f"{START_TIMEOUT_S}s (its output is above)")

    def ensure_databases(self) -> None:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, password=self.password,
                             dbname="postgres", connect_timeout=CONNECT_TIMEOUT_S, autocommit=True) as conn:
            for name in (META_DATABASE, MGMTD_DATABASE):
                if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                    conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0'.encode())

    def stop(self) -> int:
        """Fast shutdown, then immediate if it takes too long; the server's exit status."""
        popen = self.popen
        if popen is None:
            return 0
        if popen.poll() is None:
            popen.send_signal(signal.SIGINT)
            try:
                return popen.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                popen.send_signal(signal.SIGQUIT)
        return popen.wait()


def serve(root: Path, port: int, password_file: Path, ready_file: Path | None, fsync: bool) -> int:
    """Run the server until SIGTERM/SIGINT (a fast shutdown) or until it exits by itself."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise InvalidArgument(MISSING)
    if not 0 < port < 65536:
        raise InvalidArgument(f"--port {port}: expected 1..65535")
    password = read_secret_file(password_file).strip()
    if not password:
        raise InvalidArgument(f"{password_file} holds no password")
    make_private_dir(root)
    server = _Server(root, port, password, fsync, bin_dir)
    stopping = {"now": False}

    def _stop(*_: object) -> None:
        stopping["now"] = server.stopping = True
        if server.popen is not None and server.popen.poll() is None:
            server.popen.send_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a token rotation signals every process of the cluster
    server.init_once()
    try:
        popen = server.start_until_accepting()
    except Unavailable:
        if server.stopping:
            return 0
        raise
    server.ensure_databases()
    if ready_file is not None:
        url = f"postgresql://{SUPERUSER}:***@127.0.0.1:{port}/"
        write_secret_file(ready_file, json.dumps({
            "pid": os.getpid(), "postgres_pid": popen.pid, "address": f"127.0.0.1:{port}", "url": url,
            "databases": [META_DATABASE, MGMTD_DATABASE], "password_file": str(password_file)}))
    print(f"fs3-postgres: serving on 127.0.0.1:{port}", flush=True)
    while popen.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=1)
    code = server.stop()
    if stopping["now"]:
        return 0
    print(f"fs3-postgres: the server exited by itself ({code})", flush=True)
    return 1 if code == 0 else abs(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fs3.cluster.postgres", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("serve", help="run the private server (initdb on first start)")
    run.add_argument("--dir", required=True, help="the server's directory (its data in DIR/data)")
    run.add_argument("--port", type=int, required=True, help="TCP port on 127.0.0.1")
    run.add_argument("--password-file", required=True, help="the superuser's password (a 0600 file)")
    run.add_argument("--ready-file", help="written (JSON, no password) once the server accepts connections")
    run.add_argument("--fsync", action="store_true", help="keep PostgreSQL's durability defaults")
    args = parser.parse_args(argv)
    os.umask(0o077)
    try:
        return serve(Path(args.dir).resolve(), args.port, Path(args.password_file),
                     Path(args.ready_file) if args.ready_file else None, args.fsync)
    except FS3Error as exc:
        print(f"fs3-postgres: error: {exc.message}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())

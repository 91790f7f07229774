"""A cluster as operating-system processes: each service's config, and the process that runs it.

:func:`process_configs` derives every server's typed config from a :class:`Topology` and the
settings a launcher chooses; :func:`config_toml` writes one as the TOML file the service reads.
:class:`ServiceProcess` starts ``fs3 <service>`` through a spawner the launcher injects (a plain
child process for ``fs3 local``, one inside a network namespace for the chaos harness), waits
for the ready file the service writes once it listens, and signals or stops it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fs3.cluster.certs import tls_config
from fs3.cluster.postgres import PostgresServerConfig
from fs3.cluster.topology import POSTGRES, Topology
from fs3.common.errors import InvalidArgument, Unavailable
from fs3.common.secret_files import write_secret_file
from fs3.meta.server import MetaConfig
from fs3.mgmtd.service import MgmtdConfig
from fs3.rpc.tls import TlsConfig
from fs3.storage.replica import ReplicaConfig
from fs3.storage.scrub import ScrubConfig
from fs3.storage.server import StorageConfig, TargetConfig

__all__ = ["LOCAL_LEASE", "META_ENGINES", "ProcessSettings", "ServiceConfig", "ServiceProcess", "Spawner",
           "check_engine", "config_toml", "fs3_argv", "pick_port", "pid_alive", "process_configs",
           "process_start_time",
           "read_pid_file", "signal_group", "spawn_logged", "stop_group", "write_pid_file"]

#: Starts ``argv`` with ``env``, its output appended to the log file; returns the child, leader of
#: its own process group (so that a signal reaches whatever it started).
Spawner = Callable[[list[str], Mapping[str, str], Path], "subprocess.Popen[Any]"]

#: Where meta keeps the namespace: embedded (one meta, one mgmtd) or in PostgreSQL (several of each).
META_ENGINES = ("rocksdb", "postgres")
#: The primary lease of mgmtd instances on PostgreSQL in a cluster of processes on one machine
#: (lease_ms, renew_interval_ms, drift_margin_ms): a standby takes over within about 2 s, and the
#: heartbeat timeout grows to at least twice a lease and a renewal (what mgmtd requires).
LOCAL_LEASE = (1_500, 400, 300)


@dataclass(frozen=True)
class ProcessSettings:
    """What a process launcher chooses for every service of its cluster."""

    token: str = field(repr=False)
    heartbeat_timeout_ms: int = 3_000
    heartbeat_interval_ms: int = 200
    rpc_timeout_ms: int = 2_000
    forward_timeout_ms: int = 2_000
    fsync: bool = False  # storage targets sync their writes
    meta_sync_commits: bool | None = None  # None: as ``fsync``
    meta_prune_interval_ms: int = 1_000
    # A token file every service reads (and reads again on SIGHUP) instead of ``token`` inline.
    token_file: str = ""

    @property
    def inline_token(self) -> str:
        """The ``token`` key of a service's config: empty when the services read a token file."""
        return "" if self.token_file else self.token
    # Certificates made by fs3.cluster.certs for every service by name: mutual TLS everywhere ("" = off).
    tls_dir: str = ""
    # rocksdb: one meta and one mgmtd on embedded stores. postgres: every meta on the database at
    # pg_meta_url, every mgmtd on the one at pg_mgmtd_url (separate databases: both keep their
    # data in tables of the same names), all of cluster_id. The URLs hold a password: not in the repr.
    meta_engine: str = "rocksdb"
    pg_meta_url: str = field(default="", repr=False)
    pg_mgmtd_url: str = field(default="", repr=False)
    cluster_id: str = "fs3"
    # The cluster's own PostgreSQL server (a service named "postgres"): its port and the file of
    # its superuser's password. No password file: the URLs name a server run by someone else.
    pg_port: int = 0
    pg_password_file: str = ""
    pg_fsync: bool | None = None  # the server syncs (None: as ``fsync``)
    # Every storage target's background scrubber (fs3.storage.scrub; the default is off).
    scrub: ScrubConfig = field(default_factory=ScrubConfig)
    # Days meta keeps a removed file in the trash before its space is freed (0: no trash).
    meta_trash_days: float = 0.0

    def check(self, topology: Topology) -> None:
        """Bad combinations, before anything is written: several mgmtd or meta need PostgreSQL."""
        check_engine(topology, self.meta_engine)
        if self.meta_engine != "postgres":
            return
        if not self.pg_meta_url or not self.pg_mgmtd_url:
            raise InvalidArgument("the postgres engine needs the URLs of the meta and mgmtd databases")
        if self.pg_password_file and not 0 < self.pg_port < 65536:
            raise InvalidArgument(f"the cluster's PostgreSQL server needs a port, not {self.pg_port}")


def check_engine(topology: Topology, meta_engine: str) -> None:
    """InvalidArgument unless ``meta_engine`` is known and can run ``topology``: several mgmtd
    instances or meta servers need PostgreSQL, the embedded engine serves one of each."""
    if meta_engine not in META_ENGINES:
        raise InvalidArgument(f"meta engine {meta_engine!r}: expected one of {', '.join(META_ENGINES)}")
    if meta_engine != "postgres":
        if topology.mgmtd_replicas > 1:
            raise InvalidArgument(f"--mgmtd-replicas {topology.mgmtd_replicas} needs --meta-engine postgres: several "
                                  "mgmtd share their state in PostgreSQL (with rocksdb, mgmtd runs alone)")
        if topology.with_meta and topology.meta_servers > 1:
            raise InvalidArgument(f"--meta-servers {topology.meta_servers} needs --meta-engine postgres: several "
                                  "meta servers share the namespace in PostgreSQL (rocksdb is one server's)")


@dataclass(frozen=True)
class ServiceConfig:
    """One server process: its name, the ``fs3`` subcommand that runs it and that command's config."""

    name: str
    command: str
    config: MgmtdConfig | StorageConfig | MetaConfig | PostgresServerConfig


def process_configs(topology: Topology, settings: ProcessSettings, data_dir: Callable[[str], Path],
                    target_dir: Callable[[int, int], Path]) -> list[ServiceConfig]:
    """Every server's config, in start order. Services bind port 0 and report what they got in
    their ready files, so ports never race with other programs; ``data_dir(name)`` is where a
    service keeps its data and ``target_dir(node_id, index)`` a storage target's directory."""
    settings.check(topology)

    def tls(name: str) -> TlsConfig:
        return tls_config(Path(settings.tls_dir), name) if settings.tls_dir else TlsConfig()

    configs = []
    if settings.meta_engine == "postgres" and settings.pg_password_file:
        configs.append(ServiceConfig(POSTGRES, "postgres", PostgresServerConfig(
            str(data_dir(POSTGRES)), settings.pg_port, settings.pg_password_file,
            fsync=settings.fsync if settings.pg_fsync is None else settings.pg_fsync)))
    configs += [ServiceConfig(name, "mgmtd", _mgmtd_config(name, settings, data_dir(name), tls(name)))
                for name in topology.mgmtd_names]
    for node_id in topology.node_ids:
        targets = [TargetConfig(topology.target_id(node_id, index), str(target_dir(node_id, index)))
                   for index in range(1, topology.targets_per_node + 1)]
        configs.append(ServiceConfig(topology.storage_name(node_id), "storage", StorageConfig(
            node_id=node_id, token=settings.inline_token, token_file=settings.token_file,
            heartbeat_interval_ms=settings.heartbeat_interval_ms,
            rpc_timeout_ms=settings.rpc_timeout_ms, fsync=settings.fsync, framed_port=0, grpc_port=0,
            metrics_port=0, replica=ReplicaConfig(forward_timeout_ms=settings.forward_timeout_ms),
            targets=targets, tls=tls(topology.storage_name(node_id)), scrub=settings.scrub)))
    for index, name in enumerate(topology.meta_names):
        configs.append(ServiceConfig(name, "meta", _meta_config(topology.meta_node_id(index), settings,
                                                                data_dir(name), tls(name))))
    return configs


def _mgmtd_config(name: str, settings: ProcessSettings, data_dir: Path, tls: TlsConfig) -> MgmtdConfig:
    """One mgmtd: alone on its RocksDB, or (postgres) one instance named ``name`` of several
    sharing the mgmtd database; its framed port is the launcher's to give (``--framed-port``)."""
    config = MgmtdConfig(data_dir=str(data_dir), grpc_port=0, metrics_port=0,
                         heartbeat_timeout_ms=settings.heartbeat_timeout_ms, token=settings.inline_token,
                         token_file=settings.token_file, tls=tls)
    if settings.meta_engine != "postgres":
        return config
    lease_ms, renew_ms, drift_ms = LOCAL_LEASE
    return dataclasses.replace(
        config, kv_engine="postgres", pg_url=settings.pg_mgmtd_url, cluster_id=settings.cluster_id,
        instance_name=name, lease_ms=lease_ms, lease_renew_interval_ms=renew_ms, lease_drift_margin_ms=drift_ms,
        heartbeat_timeout_ms=max(settings.heartbeat_timeout_ms, 2 * (lease_ms + renew_ms)))


def _meta_config(node_id: int, settings: ProcessSettings, data_dir: Path, tls: TlsConfig) -> MetaConfig:
    sync_commits = settings.fsync if settings.meta_sync_commits is None else settings.meta_sync_commits
    meta = MetaConfig(node_id=node_id, data_dir=str(data_dir), token=settings.inline_token,
                      token_file=settings.token_file, framed_port=0, grpc_port=0, metrics_port=0,
                      sync_commits=sync_commits,
                      heartbeat_interval_ms=settings.heartbeat_interval_ms, rpc_timeout_ms=settings.rpc_timeout_ms,
                      tls=tls)
    meta.service = dataclasses.replace(meta.service, prune_interval_ms=settings.meta_prune_interval_ms,
                                       trash_days=settings.meta_trash_days)
    if settings.meta_engine == "postgres":
        meta = dataclasses.replace(meta, kv_engine="postgres", pg_url=settings.pg_meta_url,
                                   cluster_id=settings.cluster_id)
    return meta


def _toml_value(value: object, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    raise InvalidArgument(f"{where}: cannot write {type(value).__name__} to TOML")


def config_toml(config: object, always: tuple[str, ...] = ("node_id",)) -> str:
    """``config`` (a service's config dataclass) as TOML: the keys that differ from the class's
    defaults, and those named in ``always``, so a file says what this cluster chose and a later
    release's defaults reach the rest. Nested tables and arrays of tables follow the scalars."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"{config!r} is not a dataclass instance")
    default = type(config)()
    lines: list[str] = []
    tables: list[str] = []
    for f in dataclasses.fields(config):
        value, base = getattr(config, f.name), getattr(default, f.name)
        if value == base and f.name not in always:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            keys = [g.name for g in dataclasses.fields(value) if getattr(value, g.name) != getattr(base, g.name)]
            if keys:
                tables.append(f"[{f.name}]")
                tables += [f"{k} = {_toml_value(getattr(value, k), f'{f.name}.{k}')}" for k in keys]
        elif isinstance(value, list) and all(dataclasses.is_dataclass(v) for v in value):
            for item in value:
                tables.append(f"[[{f.name}]]")
                tables += [f"{g.name} = {_toml_value(getattr(item, g.name), f'{f.name}.{g.name}')}"
                           for g in dataclasses.fields(item)]
        else:
            lines.append(f"{f.name} = {_toml_value(value, f.name)}")
    return "\n".join([*lines, *tables]) + "\n"


def fs3_argv(args: list[str], ready_file: Path) -> list[str]:
    """The command line of ``fs3 ARGS`` run by this interpreter, writing its ready file."""
    return [sys.executable, "-P", "-m", "fs3.cli.main", *args, "--ready-file", str(ready_file)]


def spawn_logged(argv: list[str], env: Mapping[str, str], log_path: Path,
                 prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """A :data:`Spawner`: ``prefix + argv`` as a child leading its own session, its output appended
    to ``log_path`` (created ``0600``). ``prefix`` runs it through another program that execs it
    (``ip netns exec NS``: the child's pid is then the program's own)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "ab") as log:
        return subprocess.Popen([*prefix, *argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env), start_new_session=True)


def stop_group(pid: int, timeout_s: float = 10, popen: subprocess.Popen[Any] | None = None) -> None:
    """SIGTERM to the process group ``pid`` leads, SIGKILL if it still runs after ``timeout_s``;
    ``popen`` (when this process is its parent) is reaped."""
    if pid_alive(pid) and signal_group(pid, signal.SIGTERM):
        deadline = time.monotonic() + timeout_s
        while pid_alive(pid) and time.monotonic() < deadline:
            if popen is not None and popen.poll() is not None:
                break
            time.sleep(0.05)
    if pid_alive(pid) and (popen is None or popen.poll() is None):
        signal_group(pid, signal.SIGKILL)
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=5)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def pick_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port of ``host`` free now and outside the kernel's ephemeral range, for a service that
    must listen on a port chosen before it starts and kept across restarts (several mgmtd name each
    other by address). Port 0's answer comes from the ephemeral range, from which every outgoing
    connection on the machine also takes its local port: one of those can hold a kept port when
    its service starts again. Below the range only listeners compete."""
    low, _ = _ephemeral_range()
    top = min(low, 65536)
    bottom = max(1024, top - 12_000)
    for _ in range(attempts):
        port = random.randrange(bottom, top)
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise Unavailable(f"no free port of {host} in [{bottom}, {top}) after {attempts} tries")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left by a killed, unreaped child does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (field 22 of ``/proc/PID/stat``: clock ticks since boot); None
    when there is no such process. A process id is reused once its process is gone; the pair
    (pid, start time) names one process for as long as the machine runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # After the command name, which may hold spaces and parentheses: fields 3, 4, ... 22.
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def write_pid_file(path: Path, pid: int) -> None:
    """Record ``pid`` and its start time in ``path`` (``0600``): who started it can find and stop
    it later, from another process, without mistaking a process that reuses the id for it."""
    write_secret_file(path, json.dumps({"pid": pid, "start_time": process_start_time(pid)}))


def read_pid_file(path: Path) -> int | None:
    """The process ``path`` records while that same process still runs; None when the file is
    missing or torn, or its process is gone (a crash, a reboot) even if another now has its id."""
    try:
        info = json.loads(path.read_text())
        pid, start_time = int(info["pid"]), info.get("start_time")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid <= 0 or start_time is None or process_start_time(pid) != start_time or not pid_alive(pid):
        return None
    return pid


def signal_group(pid: int, sig: int) -> bool:
    """``sig`` to the process group ``pid`` leads; False when it is gone (it may exit between a
    liveness check and the signal: that must not end a shutdown half way)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _read_ready_file(path: Path) -> dict[str, Any] | None:
    """A ready file's contents; None while it is missing or not yet whole (a service that writes
    it in place can be read half-written)."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _runs_with_argument(pid: int, argument: str) -> bool:
    """Whether process ``pid`` was started with ``argument`` on its command line (a service's
    ready file is: :func:`fs3_argv`). Unknown — no such process, no ``/proc`` — is no."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return os.fsencode(argument) in argv


@dataclass
class ServiceProcess:
    """One service as a child process: ``args`` after ``fs3``, its ready file and its log."""

    name: str
    args: list[str]
    ready_file: Path
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # the ready file: addresses, pid
    # Where the process id and its start time are recorded at spawn (None: not recorded), so that
    # another process (``fs3 local down`` after ``up --detach``) finds exactly this process.
    pid_file: Path | None = None
    # The command line of ``args`` writing the ready file: ``fs3 ARGS`` unless told (``hai local``
    # runs ``hai server`` and ``hai agent`` the same way).
    program: Callable[[list[str], Path], list[str]] = fs3_argv

    def spawn(self, spawner: Spawner, env: Mapping[str, str], args: list[str] | None = None) -> None:
        """Start it (``args`` instead of its own, with mgmtd's address filled in, say); a ready file
        left by an earlier run is removed first, so :meth:`wait_ready` waits for this one's."""
        self.ready_file.unlink(missing_ok=True)
        self.popen = spawner(self.program(self.args if args is None else args, self.ready_file), env, self.log_path)
        if self.pid_file is not None:
            write_pid_file(self.pid_file, self.popen.pid)

    def wait_ready(self, timeout_s: float = 30) -> dict[str, Any]:
        """Its ready file once written; Unavailable, with its log's tail, if it exits or takes too long."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = _read_ready_file(self.ready_file)
            if info is not None:
                self.info = info
                return self.info
            if self.popen is not None and self.popen.poll() is not None:
                raise Unavailable(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        raise Unavailable(f"{self.name} not ready after {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        path = self.log_path
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    @property
    def running(self) -> bool:
        """Whether the child this object started has not exited."""
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int | None:
        """Its process id: of the child this object started, else the one its ready file names
        (a cluster started by an earlier ``fs3 local up --detach``) while that process is still
        this service. A ready file outlives its process (a crash, a reboot), and the id it names
        may belong to another program by now: signalling it would stop someone else's work. The
        pid file, when kept, decides: its start time must match the running process's."""
        if self.popen is not None:
            return self.popen.pid
        if self.pid_file is not None and self.pid_file.exists():
            return read_pid_file(self.pid_file)
        info = _read_ready_file(self.ready_file)
        try:
            pid = int(info["pid"]) if info is not None else 0
        except (ValueError, KeyError, TypeError):
            return None
        return pid if pid > 0 and _runs_with_argument(pid, str(self.ready_file)) else None

    def send_signal(self, sig: int) -> None:
        """``sig`` to its process group (a SIGKILL is waited for, so the child is reaped)."""
        pid = self.pid
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)
            if sig == signal.SIGKILL and self.popen is not None:
                self.popen.wait(timeout=10)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """``sig`` (SIGKILL unless told), wait for the child this object started, and forget it:
        the next :meth:`spawn` starts afresh."""
        pid = self.pid
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)
            if self.popen is not None:
                self.popen.wait(timeout=10)
        self.popen = None
        self.ready_file.unlink(missing_ok=True)
        if self.pid_file is not None:
            self.pid_file.unlink(missing_ok=True)

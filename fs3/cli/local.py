"""``fs3 local``: a whole cluster on this machine, as child processes with their data under one directory.

    fs3 local up [--dir DIR] [--storage-nodes N] [--targets-per-node T] [--replicas R] [--detach] [--tls]
                 [--meta-engine rocksdb|postgres] [--meta-servers N] [--mgmtd-replicas N] [--pg-url URL]
    fs3 local status|down [--dir DIR]
    fs3 local kill NAME | start NAME      (fault drills: NAME is mgmtd, storage-N, meta, meta-N, mgmtd-N, postgres)
    fs3 admin token rotate --dir DIR [--finish]

The first ``up`` writes a config per service and a fresh cluster token under DIR; later runs
reuse them, so a restarted cluster finds its data. ``DIR/cluster.json`` describes every endpoint
and process id, and names the token file, ``DIR/token``.

Everything under DIR is for the user running the cluster only: DIR is ``0700``, the token file,
the configs, cluster.json and the logs are created ``0600``, and each service runs with umask
``077`` (its data directories ``0700``, chunk and KV files ``0600``). No token is ever in a
process's arguments: the services and the mount read the token file.

With ``--meta-engine postgres`` the meta servers and mgmtd instances keep their state in
PostgreSQL: a private server under ``DIR/postgres`` (the managed process ``postgres``, started
first and stopped last), or the server ``--pg-url`` names. Its password is in the ``0600``
configs and ``DIR/postgres/password`` only; layout.json, cluster.json and the output name no URL
with a password. Every mgmtd's framed port is chosen once and kept, so the addresses storage,
meta, the mount and the saved profile know stay right across restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from fs3.client import profiles
from fs3.cluster.certs import CLIENT, init_certs, tls_config
from fs3.cluster.postgres import (
    META_DATABASE,
    MGMTD_DATABASE,
    PostgresServerConfig,
    check_reachable,
    postgres_argv,
    server_url,
)
from fs3.cluster.processes import (
    META_ENGINES,
    ProcessSettings,
    ServiceProcess,
    check_engine,
    config_toml,
    pick_port,
    pid_alive,
    process_configs,
    process_start_time,
    read_pid_file,
    signal_group,
    spawn_logged,
)
from fs3.cluster.topology import META, MGMTD, POSTGRES, Topology
from fs3.common.errors import FS3Error, InvalidArgument, Unauthenticated, Unavailable
from fs3.common.secret_files import (
    check_config_file,
    make_private_dir,
    read_secret_file,
    read_token_file,
    write_secret_file,
    write_token_file,
)
from fs3.kv.postgres import redact_url
from fs3.rpc.tls import TlsConfig
from fs3.storage.scrub import ScrubConfig

__all__ = ["LOCAL_SCRUB", "NO_SCRUB_ENV", "TRASH_DAYS_ENV", "LocalCluster", "cluster_lock"]

# The scrubber of a cluster `fs3 local up` makes: on, gently (per target at most 4 MiB and 32
# chunks a second), so that `fs3 admin scrub status` shows passes from the start; --no-scrub: off.
LOCAL_SCRUB = ScrubConfig(bytes_per_s=4 << 20, chunks_per_s=32)
# What --no-scrub sets for a run of a cluster made with the scrubber on (its configs are kept).
NO_SCRUB_ENV = {"FS3_STORAGE_SCRUB_BYTES_PER_S": "0", "FS3_STORAGE_SCRUB_CHUNKS_PER_S": "0"}
# What --trash-days sets for a run (meta's [service] trash_days, read from the environment).
TRASH_DAYS_ENV = "FS3_META_SERVICE_TRASH_DAYS"


@contextlib.contextmanager
def cluster_lock(root: Path, command: str = "fs3 local") -> Iterator[None]:
    """Hold ``root/lock`` (an exclusive ``flock``) while starting, and for as long as a foreground
    ``fs3 local up`` supervises, the cluster in ``root``; a second ``up`` is refused, naming the
    process that holds it. The kernel drops the lock when its holder dies, so a crash leaves
    nothing stale to clean up. Its file records the holder (pid and start time) for that message."""
    make_private_dir(root)
    path = root / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_pid_file(path)
            raise InvalidArgument(f"a local cluster in {root} is already running (pid {holder or '?'}: "
                                  f"{command} up); stop it with: {command} down --dir {root}") from None
        # In place, on the locked file (a file renamed over the path would be a second, unlocked one).
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "start_time": process_start_time(os.getpid())}).encode(), 0)
        yield
    finally:
        os.close(fd)


def mgmtd_database_url(meta_url: str) -> str:
    """The mgmtd database of a cluster whose meta database is ``meta_url``: the same server and
    user, the database's name with ``_mgmtd`` appended (meta and mgmtd tables share names)."""
    head, sep, tail = meta_url.rpartition("/")
    database, qsep, query = tail.partition("?")
    if not sep or "://" not in head or not database:
        raise InvalidArgument(f"--pg-url {redact_url(meta_url)!r}: expected postgresql://user:password@host:port/"
                              "database (the meta database; mgmtd uses DATABASE_mgmtd on the same server)")
    return f"{head}/{database}_mgmtd{qsep}{query}"


class LocalCluster:
    """mgmtd, N storage nodes (T targets each) and meta under ``root``; each can be killed and restarted.
    With ``meta_engine="postgres"``: ``mgmtd_replicas`` mgmtd and ``meta_servers`` meta on PostgreSQL."""

    def __init__(self, root: Path, storage_nodes: int = 3, targets_per_node: int = 2, token: str | None = None,
                 heartbeat_timeout_ms: int = 3_000, heartbeat_interval_ms: int = 200, fsync: bool = False,
                 meta_data_dir: Path | None = None, meta_sync_commits: bool | None = None,
                 storage_data_dirs: dict[int, Path] | None = None, tls: bool | None = None,
                 host: str = "127.0.0.1", meta_engine: str | None = None, meta_servers: int | None = None,
                 mgmtd_replicas: int | None = None, pg_url: str | None = None,
                 scrub: ScrubConfig | None = None, trash_days: float = 0.0) -> None:
        """``fsync``: storage targets sync their writes and meta its commits (``meta_sync_commits``
        decides for meta alone). ``meta_data_dir`` and ``storage_data_dirs`` (node id -> directory
        of its targets) put data elsewhere than under ``root`` (crash tests: on a disk that loses
        unsynced writes), configs and logs staying under ``root``. All three apply when a service's
        config is first written. ``tls``: certificates under ``root/certs`` and mutual TLS for every
        service, the mount and this launcher's own calls (None: as the cluster was first made).
        ``meta_engine``, ``meta_servers``, ``mgmtd_replicas`` (None: as the cluster was made, else
        rocksdb and one of each) and ``pg_url`` (the meta database on a server of the user's; None:
        a private server under ``root/postgres``) are fixed when the cluster is first made, except
        the counts, which a later start may change. ``scrub``: every storage target's background
        scrubber, written into the storage configs when first made (None: off; ``fs3 local up``
        gives :data:`LOCAL_SCRUB`). ``trash_days``: how long meta keeps removed files in the trash,
        written into the meta configs when first made (0: no trash)."""
        if storage_nodes < 1 or targets_per_node < 1:
            raise InvalidArgument("a local cluster needs at least one storage node with one target")
        self.root = root.resolve()
        self.host = host
        saved = self._load_layout()
        # The engine and the counts first: bad ones are refused before anything is written.
        self.meta_engine = self._choose_engine(saved, meta_engine, pg_url)
        self.pg_external = bool(saved.get("pg_external")) if saved.get("meta_engine") else pg_url is not None
        self.topology = Topology(storage_nodes=int(saved.get("storage_nodes") or storage_nodes),
                                 targets_per_node=targets_per_node,
                                 meta_servers=(meta_servers if meta_servers is not None
                                               else int(saved.get("meta_servers") or 1)),
                                 mgmtd_replicas=(mgmtd_replicas if mgmtd_replicas is not None
                                                 else int(saved.get("mgmtd_replicas") or 1)))
        check_engine(self.topology, self.meta_engine)
        if pg_url is not None:
            mgmtd_database_url(pg_url)  # a URL without a database name
        make_private_dir(self.root)
        self.token_file = self.root / "token"
        if not self.token_file.exists():
            # An earlier release kept the token in layout.json: it moves to the token file.
            write_token_file(self.token_file, [saved.get("token") or token or secrets.token_hex(16)])
        read_token_file(self.token_file)  # private, and holds a token: else stop here, saying why
        self.env = {**os.environ, "FS3_LOG_LEVEL": os.environ.get("FS3_LOG_LEVEL", "INFO")}
        # Every service binds port 0 and reports what it got in its ready file, so ports never race
        # with other programs. Only mgmtd's framed port is kept (layout.json) once known: storage
        # nodes and clients find the cluster through it after restarts.
        self.mgmtd_port = int(saved.get("mgmtd_port") or 0)
        # Several mgmtd on PostgreSQL name each other by framed address: each one's port is chosen
        # before its first start and kept (a rocksdb mgmtd binds port 0 once, as before).
        self.mgmtd_ports: dict[str, int] = {k: int(v) for k, v in (saved.get("mgmtd_ports") or {}).items()}
        if self.meta_engine == "postgres":
            for name in self.topology.mgmtd_names:
                self.mgmtd_ports.setdefault(name, self.mgmtd_port if name == MGMTD and self.mgmtd_port
                                            else pick_port())
            self.mgmtd_port = self.mgmtd_ports[MGMTD]
        self.cluster_id = str(saved.get("cluster_id") or f"local-{secrets.token_hex(4)}")
        self.pg_port = int(saved.get("pg_port") or 0)
        # The private server's durability is the cluster's, as first made (its other services keep
        # theirs in their configs; the server's command line is made afresh at every start).
        self.pg_fsync = bool(saved.get("pg_fsync", fsync))
        pg_settings = self._postgres_settings(pg_url)
        if tls and saved and not saved.get("tls"):
            raise InvalidArgument(f"the cluster in {self.root} was made without TLS; make a new one for --tls")
        self.tls = bool(saved.get("tls")) if saved and tls is None else bool(tls)
        tls_dir = self.root / "certs"
        if self.tls:
            names = [*self.topology.mgmtd_names, *self.topology.meta_names,
                     *(self.topology.storage_name(n) for n in self.topology.node_ids)]
            init_certs(tls_dir, {name: ["127.0.0.1", "localhost"] for name in names})
        settings = ProcessSettings("", token_file=str(self.token_file), heartbeat_timeout_ms=heartbeat_timeout_ms,
                                   heartbeat_interval_ms=heartbeat_interval_ms, fsync=fsync,
                                   meta_sync_commits=meta_sync_commits, tls_dir=str(tls_dir) if self.tls else "",
                                   scrub=scrub or ScrubConfig(), meta_trash_days=trash_days, **pg_settings)
        data_dirs = {MGMTD: None, META: meta_data_dir}

        def data_dir(name: str) -> Path:
            return data_dirs.get(name) or self.root / name

        def target_dir(node_id: int, index: int) -> Path:
            node_dir = (storage_data_dirs or {}).get(node_id, self.root / self.topology.storage_name(node_id))
            return node_dir / f"target-{index}"

        self.procs: dict[str, ServiceProcess] = {}
        for service in process_configs(self.topology, settings, data_dir, target_dir):
            # The first run writes each service's config; later runs reuse them, so a restarted
            # cluster finds its data where it left it.
            service_dir = self.root / service.name
            service_dir.mkdir(mode=0o700, exist_ok=True)
            if isinstance(service.config, PostgresServerConfig):
                self._add(service.name, service.config.args(), postgres=True)
                continue
            config = service_dir / f"{service.command}.toml"
            if not config.exists():
                write_secret_file(config, config_toml(service.config))
            self._add(service.name, [service.command, "--config", str(config)])
        self._nodes = self.topology.storage_nodes
        self.mountpoint: str | None = saved.get("mountpoint")
        self.mount_workers = int(saved.get("mount_workers") or 1)
        if self.mountpoint:
            self._add("mount", self._mount_args())
        self._save_layout()

    def _choose_engine(self, saved: dict[str, Any], meta_engine: str | None, pg_url: str | None) -> str:
        """The engine of this cluster: as it was made, else the one asked for (``pg_url``: postgres)."""
        made = saved.get("meta_engine") or ("rocksdb" if saved else None)
        asked = meta_engine or ("postgres" if pg_url is not None else None)
        if asked is not None and asked not in META_ENGINES:
            raise InvalidArgument(f"--meta-engine {asked!r}: expected one of {', '.join(META_ENGINES)}")
        if pg_url is not None and asked != "postgres":
            raise InvalidArgument("--pg-url is the PostgreSQL engine's: use it with --meta-engine postgres")
        if made and asked and asked != made:
            raise InvalidArgument(f"the cluster in {self.root} was made with --meta-engine {made}; "
                                  f"make a new one (another --dir) for {asked}")
        return str(made or asked or "rocksdb")

    def _postgres_settings(self, pg_url: str | None) -> dict[str, Any]:
        """The engine's part of :class:`ProcessSettings`: the database URLs (with the private
        server's password and port, both made on the first start), none for rocksdb."""
        if self.meta_engine != "postgres":
            return {}
        common: dict[str, Any] = {"meta_engine": "postgres", "cluster_id": self.cluster_id}
        if self.pg_external:
            if pg_url is None:
                pg_url = self.configured_pg_url()
            elif (self.root / META / "meta.toml").exists() and pg_url != self.configured_pg_url():
                raise InvalidArgument(f"the cluster in {self.root} was made on another database than "
                                      f"{redact_url(pg_url)}; leave out --pg-url to use its own")
            return {**common, "pg_meta_url": pg_url, "pg_mgmtd_url": mgmtd_database_url(pg_url)}
        pg_dir = self.root / POSTGRES
        make_private_dir(pg_dir)
        password_file = pg_dir / "password"
        if not password_file.exists():
            write_secret_file(password_file, secrets.token_hex(16) + "\n")
        password = read_secret_file(password_file).strip()
        if not self.pg_port:
            self.pg_port = pick_port()
        return {**common, "pg_port": self.pg_port, "pg_password_file": str(password_file),
                "pg_fsync": self.pg_fsync,
                "pg_meta_url": server_url(password, self.pg_port, META_DATABASE),
                "pg_mgmtd_url": server_url(password, self.pg_port, MGMTD_DATABASE)}

    def configured_pg_url(self) -> str:
        """The meta database's URL as the first meta's config holds it (it holds the password)."""
        config = self.root / META / "meta.toml"
        try:
            url = tomllib.loads(read_secret_file(config)).get("pg_url")
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"cannot read the database URL from {config}: {exc}") from None
        if not isinstance(url, str) or not url:
            raise InvalidArgument(f"{config} names no pg_url")
        return url

    def check_database(self) -> None:
        """A server run by someone else (``--pg-url``) must answer before anything starts: an
        Unavailable naming the URL (without its password) otherwise."""
        if self.meta_engine == "postgres" and self.pg_external:
            url = self.configured_pg_url()
            check_reachable(url)
            check_reachable(mgmtd_database_url(url))

    @property
    def token(self) -> str:
        """The token this cluster's processes present now (the token file's first line)."""
        return read_token_file(self.token_file)[0]

    def _mount_args(self) -> list[str]:
        assert self.mountpoint
        return ["mount", "MGMTD", self.mountpoint, "--foreground", "--token-file", str(self.token_file),
                "--metrics-port", "0", "--workers", str(self.mount_workers), *self._client_tls_args()]

    @property
    def client_tls(self) -> TlsConfig | None:
        """The client side of this cluster's TLS (the ``client`` certificate), or None without TLS."""
        return tls_config(self.root / "certs", CLIENT) if self.tls else None

    def _client_tls_args(self) -> list[str]:
        tls = self.client_tls
        if tls is None:
            return []
        return ["--tls-ca-file", tls.ca_file, "--tls-cert-file", tls.cert_file, "--tls-key-file", tls.key_file]

    def set_mount(self, mountpoint: Path | None, workers: int = 1) -> None:
        """Mount the cluster at ``mountpoint`` (a managed process, stopped first), or no longer;
        ``workers``: the mount's ``--workers``."""
        self.procs.pop("mount", None)
        self.mount_workers = workers
        self.mountpoint = str(mountpoint.resolve()) if mountpoint else None
        if self.mountpoint:
            Path(self.mountpoint).mkdir(parents=True, exist_ok=True)
            self._add("mount", self._mount_args())
        self._save_layout()

    @property
    def mgmtd_addresses(self) -> list[str]:
        """Every mgmtd's framed address, the first mgmtd's first."""
        if not self.mgmtd_port:
            raise Unavailable("mgmtd has not been started yet")
        if self.meta_engine != "postgres":
            return [f"{self.host}:{self.mgmtd_port}"]
        return [f"{self.host}:{self.mgmtd_ports[name]}" for name in self.topology.mgmtd_names]

    @property
    def mgmtd_address(self) -> str:
        """Every mgmtd's framed address, comma-separated (what clients and services are given)."""
        return ",".join(self.mgmtd_addresses)

    # -- layout and status file --------------------------------------------------------------

    def _load_layout(self) -> dict[str, Any]:
        path = self.root / "layout.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _save_layout(self) -> None:
        write_secret_file(self.root / "layout.json", json.dumps(
            {"mgmtd_port": self.mgmtd_port, "storage_nodes": self._nodes,
             "mountpoint": getattr(self, "mountpoint", None), "mount_workers": getattr(self, "mount_workers", 1),
             "tls": self.tls, **self._engine_layout()}))

    def _engine_layout(self) -> dict[str, Any]:
        """What layout.json keeps of the engine (no URL: it may hold a password)."""
        if self.meta_engine != "postgres":
            return {}
        return {"meta_engine": "postgres", "meta_servers": self.topology.meta_servers,
                "mgmtd_replicas": self.topology.mgmtd_replicas, "mgmtd_ports": self.mgmtd_ports,
                "cluster_id": self.cluster_id, "pg_external": self.pg_external,
                "pg_port": None if self.pg_external else self.pg_port, "pg_fsync": self.pg_fsync}

    def write_cluster_json(self) -> Path:
        """``DIR/cluster.json`` (``0600``): endpoints, process ids, logs and where the token is."""
        data = {
            "dir": str(self.root), "token_file": str(self.token_file), "mgmtd": self.mgmtd_address,
            # File names, for clients (fs3 admin --dir): the key itself stays in its 0600 file.
            "tls": dataclasses.asdict(self.client_tls) if self.client_tls is not None else None,
            "processes": {name: {"pid": p.popen.pid if p.popen else p.info.get("pid"), "framed": p.info.get("framed"),
                                 "grpc": p.info.get("grpc"), "metrics": p.info.get("metrics"),
                                 **({"address": p.info.get("address")} if name == POSTGRES else {}),
                                 "log": str(p.log_path)} for name, p in self.procs.items()},
            "meta_engine": self.meta_engine,
        }
        path = self.root / "cluster.json"
        write_secret_file(path, json.dumps(data, indent=2))
        return path

    def save_profile(self, name: str, config: Path | None = None) -> Path:
        """Write (or replace) profile ``name`` for this cluster in the clients' config file
        (``$FS3_CONFIG`` or ``~/.config/fs3/config.toml``): its mgmtd, its token file and its
        client TLS, so ``fs3.connect(profile=name)`` and ``fs3://name@/path`` need nothing else."""
        path = config or profiles.config_path()
        profiles.save_profile(path, profiles.Profile(name, tuple(self.mgmtd_addresses), token_file=str(self.token_file),
                                                     tls=self.client_tls))
        return path

    # -- processes ---------------------------------------------------------------------------

    def _add(self, name: str, args: list[str], postgres: bool = False) -> None:
        proc = ServiceProcess(name, args, self.root / f"{name}.ready.json", self.root / f"{name}.log",
                              pid_file=self.root / f"{name}.pid")
        if postgres:
            proc.program = postgres_argv
        self.procs[name] = proc

    def _known(self, name: str) -> ServiceProcess:
        if name not in self.procs:
            raise InvalidArgument(f"no process {name!r}; known: {', '.join(self.procs)}")
        return self.procs[name]

    def start(self, name: str, wait: bool = True) -> None:
        proc = self._known(name)
        if name == POSTGRES:
            proc.spawn(_spawn, self.env)
            if wait:
                self.wait_ready(name, timeout_s=90)  # a first start runs initdb
            return
        args, env = list(proc.args), dict(self.env)
        if self.host != "127.0.0.1":
            for prefix in ("FS3_MGMTD", "FS3_STORAGE", "FS3_META"):
                env[f"{prefix}_LISTEN_HOST"] = self.host
            env["FS3_STORAGE_ADVERTISE_HOST"] = env["FS3_META_ADVERTISE_HOST"] = self.host
        if name in self.topology.mgmtd_names:
            args += ["--framed-port", str(self.mgmtd_ports.get(name, self.mgmtd_port))]
        else:
            env["FS3_STORAGE_MGMTD_ADDRESS"] = self.mgmtd_address
            env["FS3_META_MGMTD_ADDRESS"] = self.mgmtd_address
            args = [self.mgmtd_address if a == "MGMTD" else a for a in args]
        proc.spawn(_spawn, env, args)
        if wait or (name == MGMTD and not self.mgmtd_port):
            self.wait_ready(name)

    def wait_ready(self, name: str, timeout_s: float = 30) -> dict[str, Any]:
        info = self.procs[name].wait_ready(timeout_s)
        if name == MGMTD and not self.mgmtd_port:
            self.mgmtd_port = int(str(info["framed"]).rsplit(":", 1)[1])
            self._save_layout()
        return info

    def log_tail(self, name: str, lines: int = 40) -> str:
        return self.procs[name].log_tail(lines)

    def address(self, name: str, transport: str = "framed") -> str:
        return str(self.procs[name].info[transport])

    def start_all(self) -> None:
        """Start every service: PostgreSQL (when the cluster runs its own), the mgmtd instances,
        then storage and meta (the mount is started on its own, once the chains serve)."""
        if POSTGRES in self.procs:
            self.start(POSTGRES)
        mgmtds = self.topology.mgmtd_names
        for name in mgmtds:
            self.start(name, wait=False)
        for name in mgmtds:
            self.wait_ready(name)
        services = [name for name in self.procs if name not in (*mgmtds, POSTGRES, "mount")]
        for name in services:
            self.start(name, wait=False)
        for name in services:
            self.wait_ready(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self._known(name).kill(sig)

    def stop_all(self) -> None:
        """Stop every process: the mount first, PostgreSQL last (once nothing uses it)."""
        self._stop([name for name in self.procs if name != POSTGRES])
        if POSTGRES in self.procs:
            self._stop([POSTGRES])

    def _stop(self, names: list[str]) -> None:
        """SIGTERM to each of ``names`` (the mount first, the others in reverse start order), wait
        up to 10 s, SIGKILL what still runs."""
        mount = self.procs.get("mount") if "mount" in names else None
        if mount is not None:
            # Unmount first, while meta can still take the last closes.
            pid = mount.pid
            if pid and pid_alive(pid) and signal_group(pid, signal.SIGTERM):
                deadline = time.monotonic() + 10
                while pid_alive(pid) and time.monotonic() < deadline:
                    if mount.popen is not None and mount.popen.poll() is not None:
                        break
                    time.sleep(0.05)
        procs = [self.procs[name] for name in names]
        for proc in reversed(procs):
            pid = proc.pid
            if pid and pid_alive(pid):
                signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in procs:
            pid = proc.pid
            while pid and pid_alive(pid) and time.monotonic() < deadline:
                if proc.popen is not None and proc.popen.poll() is not None:
                    break
                time.sleep(0.05)
            if pid and pid_alive(pid) and (proc.popen is None or proc.popen.poll() is None):
                signal_group(pid, signal.SIGKILL)
            if proc.popen is not None:
                proc.popen.wait(timeout=5)
                proc.popen = None
            proc.ready_file.unlink(missing_ok=True)
            if proc.pid_file is not None and not (proc.pid and pid_alive(proc.pid)):
                proc.pid_file.unlink(missing_ok=True)

    # -- cluster setup -----------------------------------------------------------------------

    async def ensure_chains(self, replicas: int, timeout_s: float = 60) -> list[int]:
        """Create the chain table on first start; wait until every chain is serving."""
        from fs3 import common_pb2 as cpb
        from fs3.client.admin import AdminClient
        from fs3.rpc.channel import RealChannelFactory

        channels = RealChannelFactory(self.token, tls=self.client_tls)
        admin = AdminClient(self.mgmtd_address, channels)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        expected = self._nodes
        try:
            while True:
                targets = await admin.targets()
                nodes = {t.node_id for t in targets}
                if len(nodes) >= expected:
                    break
                if loop.time() > deadline:
                    raise Unavailable(f"only {len(nodes)} of {expected} storage nodes registered")
                await asyncio.sleep(0.1)
            rsp = await admin.chains()
            if not rsp.chains:
                if replicas > len(nodes):
                    raise InvalidArgument(f"{replicas} replicas need {replicas} storage nodes, have {len(nodes)}")
                await admin.create_chain_table(1, replicas=replicas)
            while True:
                rsp = await admin.chains()
                states = {t.target_id: t.public_state for t in rsp.targets}
                if rsp.chains and all(states[t] == cpb.SERVING for c in rsp.chains for t in c.target_ids):
                    return [c.chain_id for c in rsp.chains]
                if loop.time() > deadline:
                    raise Unavailable("chains did not become serving in time")
                await asyncio.sleep(0.1)
        finally:
            await channels.close()

    # -- token rotation ----------------------------------------------------------------------

    def rotate_token(self, finish: bool = False, timeout_s: float = 10) -> list[str]:
        """Rotate the cluster token without restarting anything; returns the processes signalled.

        Without ``finish``: a new token, in two steps so that no call is refused in between —
        first every service also accepts it (token file ``old, new``, SIGHUP, and each service
        is asked until it does), then every process presents it (``new, old``, SIGHUP). Clients
        with the old token still work. With ``finish``: the old token is dropped (``new``, SIGHUP,
        and each service asked until it refuses the old one), also on connections already open.
        A process that is not running reads the file when it starts."""
        tokens = read_token_file(self.token_file)
        self._check_reloadable()
        if finish:
            if len(tokens) < 2:
                raise InvalidArgument(f"no rotation in progress in {self.token_file} (one token): nothing to finish")
            write_token_file(self.token_file, tokens[:1])
            signalled = self._signal_reload()
            asyncio.run(self._wait_until_accepted(tokens[1:], False, timeout_s))
            return signalled
        if len(tokens) > 1:
            raise InvalidArgument(f"a rotation is in progress ({len(tokens)} tokens in {self.token_file}): "
                                  "finish it first with --finish")
        old, new = tokens[0], secrets.token_hex(16)
        write_token_file(self.token_file, [old, new])
        self._signal_reload()
        asyncio.run(self._wait_until_accepted([new], True, timeout_s))
        write_token_file(self.token_file, [new, old])
        return self._signal_reload()

    def _check_reloadable(self) -> None:
        for name, proc in self.procs.items():
            if name in ("mount", POSTGRES):  # PostgreSQL reads no fs3 token
                continue
            config = Path(proc.args[proc.args.index("--config") + 1])
            check_config_file(config)
            if '\ntoken = ' in "\n" + read_secret_file(config):
                raise InvalidArgument(f"{config} holds its token inline (written by an earlier release), so a "
                                      f"rotation cannot reach {name}: replace its token line with "
                                      f"token_file = \"{self.token_file}\" and restart it")

    def running(self) -> dict[str, int]:
        """Name -> process id of each of this cluster's processes that runs now (found by their pid
        files, checked against the process's start time)."""
        return self._running()

    def _running(self) -> dict[str, int]:
        running = {}
        for name, proc in self.procs.items():
            pid = proc.pid
            if pid and pid_alive(pid):
                running[name] = pid
        return running

    def _signal_reload(self) -> list[str]:
        """SIGHUP to every running process of the cluster: each reads the token file again."""
        signalled = []
        for name, pid in self._running().items():
            if name == POSTGRES:
                continue
            if name == "mount" and "--token-file" not in _cmdline(pid):
                # A mount started without a token file would take SIGHUP as "unmount".
                print(f"fs3: warning: the mount (pid {pid}) reads no token file; remount it after --finish",
                      file=sys.stderr)
                continue
            os.kill(pid, signal.SIGHUP)
            signalled.append(name)
        return signalled

    async def _wait_until_accepted(self, tokens: list[str], accepted: bool, timeout_s: float) -> None:
        """Ask every running service until each accepts (or refuses) each of ``tokens``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        running = self._running()
        for name, proc in self.procs.items():
            if name in ("mount", POSTGRES) or name not in running:
                continue
            if not proc.info and proc.ready_file.exists():
                proc.info = json.loads(proc.ready_file.read_text())
            address = str(proc.info.get("framed") or "")
            for token in tokens:
                while pid_alive(running[name]):  # one that died reads the file when it starts again
                    if await _accepts(address, token) is accepted:
                        break
                    if loop.time() > deadline:
                        raise Unavailable(f"{name} did not {'take' if accepted else 'drop'} the token within "
                                          f"{timeout_s}s (its log: {proc.log_path})")
                    await asyncio.sleep(0.05)


async def _accepts(address: str, token: str) -> bool | None:
    """Whether the service at ``address`` accepts ``token`` (None: it cannot be reached)."""
    from fs3 import mgmtd_pb2
    from fs3.rpc.channel import RealChannelFactory
    from fs3.rpc.methods import service_spec

    channels = RealChannelFactory(token)
    try:
        await channels.get(address).call(service_spec("Mgmtd").method("GetRoutingInfo"),
                                         mgmtd_pb2.GetRoutingInfoReq(), timeout_ms=2_000)
    except Unauthenticated:
        return False
    except Unavailable:
        return None
    except FS3Error:
        return True  # accepted, then told this service serves no such method
    finally:
        await channels.close()
    return True


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _spawn(argv: list[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    return spawn_logged(argv, env, log_path)


def _print_endpoints(cluster: LocalCluster, profile: str | None = None, profile_path: Path | None = None) -> None:
    print(f"fs3 local cluster in {cluster.root}")
    for name, proc in cluster.procs.items():
        info = proc.info
        if name == "mount":
            print(f"  {name:<10} {info.get('mountpoint', '-'):<73}  metrics {info.get('metrics') or '-'}  "
                  f"pid {info.get('pid', '-')}")
            continue
        if name == POSTGRES:
            print(f"  {name:<10} {info.get('url', '-'):<73}  pid {info.get('pid', '-')}  "
                  f"(databases {', '.join(info.get('databases') or [])}; password in {info.get('password_file')})")
            continue
        print(f"  {name:<10} framed {info.get('framed', '-'):<22} grpc {info.get('grpc', '-'):<22} "
              f"metrics {info.get('metrics', '-')}  pid {info.get('pid', '-')}")
    # Where the token is, never the token: this output ends up in terminals, logs and CI output.
    print(f"  token:  in {cluster.token_file} (its first line; readable by you only)")
    if cluster.tls:
        print(f"  tls:    mutual TLS on both transports; certificates in {cluster.root / 'certs'} "
              f"(clients use client.pem and client.key; fs3 admin --dir finds them)")
    installed = Path(sys.executable).parent / "fs3"
    command = str(installed) if installed.exists() else "fs3"
    if cluster.mountpoint:
        print(f"  mount:  {cluster.mountpoint}  (an ordinary directory: ls, cp, git, python... all work)")
    print(f"  python: import fs3; fs = fs3.connect({cluster.mgmtd_address!r}, token_file={str(cluster.token_file)!r})")
    if profile:
        print(f"  profile: {profile!r} in {profile_path}: fs3.connect(profile={profile!r}), fs3://{profile}@/path")
    else:
        print(f"  profile: fs3 local up --dir {cluster.root} --profile NAME  (clients then need no address or token)")
    print(f"  url:    fs3://{cluster.mgmtd_address}/path  (fsspec, pandas; storage_options={{'token': ...}})")
    print(f"  try:   {command} admin --dir {cluster.root} chains")
    print(f"         {command} admin --dir {cluster.root} fsck")
    print(f"         {command} admin --mgmtd {cluster.mgmtd_address} --token-file {cluster.token_file} verify")
    print(f"         {command} admin token rotate --dir {cluster.root}   (a new token; --finish drops the old)")
    print(f"         {command} local kill storage-2 --dir {cluster.root}   (a drill; 'local start' undoes it)")


def _up(root: Path, args: Any) -> int:
    """``fs3 local up``, the cluster lock held: refused while any process of the cluster runs
    (one left by ``up --detach``), so a second ``up`` never starts services over running ones."""
    pg_url = getattr(args, "pg_url", None)
    trash_days = getattr(args, "trash_days", None)
    if pg_url is not None and not (root / "layout.json").exists():
        # A server of the user's must answer before the cluster's configs name it.
        check_reachable(pg_url)
        check_reachable(mgmtd_database_url(pg_url))
    cluster = LocalCluster(root, storage_nodes=args.storage_nodes, targets_per_node=args.targets_per_node,
                           tls=args.tls, meta_engine=getattr(args, "meta_engine", None),
                           meta_servers=getattr(args, "meta_servers", None),
                           mgmtd_replicas=getattr(args, "mgmtd_replicas", None), pg_url=pg_url,
                           scrub=None if getattr(args, "no_scrub", False) else LOCAL_SCRUB,
                           trash_days=trash_days or 0.0)
    if getattr(args, "no_scrub", False):
        cluster.env.update(NO_SCRUB_ENV)  # also a cluster made with it on: off for this run
    if trash_days is not None:  # also a cluster made before: for this run (its configs are kept)
        cluster.env[TRASH_DAYS_ENV] = repr(trash_days)
    if pg_url is None:
        cluster.check_database()
    running = cluster.running()
    if running:
        pids = ", ".join(f"pid {pid}: {name}" for name, pid in running.items())
        raise InvalidArgument(f"a local cluster in {root} is already running ({pids}); "
                              f"stop it with: fs3 local down --dir {root}")
    started = False
    try:
        cluster.start_all()
        started = True
        print(f"fs3: waiting for {args.replicas}-replica chains to be serving...", flush=True)
        asyncio.run(cluster.ensure_chains(args.replicas))
        cluster.set_mount(Path(args.mount) if args.mount else None, workers=args.mount_workers)
        if cluster.mountpoint:
            cluster.start("mount")
            print(f"fs3: mounted at {cluster.mountpoint}", flush=True)
        cluster.write_cluster_json()
        profile_path = None
        if args.profile:
            try:
                profile_path = cluster.save_profile(args.profile)
            except FS3Error as exc:  # the cluster is up: say so, and leave it running
                print(f"fs3: warning: profile {args.profile!r} not written: {exc.message}", file=sys.stderr)
        _print_endpoints(cluster, args.profile if profile_path else None, profile_path)
        if args.detach:
            print(f"  stop:  fs3 local down --dir {root}")
            return 0
        print("Ctrl-C stops the cluster.", flush=True)
        stop = {"now": False}

        def _stop(*_: object) -> None:
            stop["now"] = True

        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
        polls = 0
        while not stop["now"]:
            time.sleep(0.2)
            polls += 1
            if polls % 5 == 0 and not cluster.running():
                # `fs3 local down` from another terminal stopped everything: nothing left to supervise.
                print("fs3: every process of the cluster has stopped", flush=True)
                cluster.stop_all()
                return 0
        print("\nfs3: stopping...", flush=True)
        cluster.stop_all()
        return 0
    except BaseException:
        # Whatever stopped the start (a service that never got ready, a spawn that failed,
        # Ctrl-C), the services already started must not run on with nobody to stop them.
        if started or any(p.popen for p in cluster.procs.values()):
            cluster.stop_all()
        raise


def local_command(args: Any) -> int:
    root = Path(args.dir)
    if args.action == "up":
        if args.profile:
            profiles.check_profile_name(args.profile)  # before anything starts
        with cluster_lock(root):
            return _up(root, args)
    if not (root / "layout.json").exists():
        raise InvalidArgument(f"no local cluster in {root} (start one with: fs3 local up --dir {root})")
    cluster = LocalCluster(root)
    for proc in cluster.procs.values():
        if proc.ready_file.exists():
            proc.info = json.loads(proc.ready_file.read_text())
    if args.action == "down":
        cluster.stop_all()
        print(f"fs3: local cluster in {root} stopped")
        return 0
    if args.action == "status":
        running = 0
        for name, proc in cluster.procs.items():
            pid = proc.pid
            up = bool(pid and pid_alive(pid))
            running += up
            print(f"  {name:<10} {'running' if up else 'stopped':<8} pid {pid or '-'}")
        return 0 if running == len(cluster.procs) else 3
    if args.action == "kill":
        cluster.kill(args.name)
        print(f"fs3: {args.name} killed (SIGKILL)")
        return 0
    if args.action == "start":
        pid = cluster.running().get(args.name)
        if pid:
            raise InvalidArgument(f"{args.name} is already running (pid {pid})")
        cluster.start(args.name)
        print(f"fs3: {args.name} started")
        return 0
    raise InvalidArgument(f"unknown action {args.action}")


def rotate_command(args: Any) -> int:
    """``fs3 admin token rotate --dir DIR [--finish]``: prints where the token is, never a token."""
    directory = getattr(args, "rotate_dir", None) or args.dir
    if not directory:
        raise InvalidArgument("fs3 admin token rotate needs --dir DIR (a local cluster's directory)")
    root = Path(directory)
    if not (root / "layout.json").exists():
        raise InvalidArgument(f"no local cluster in {root} (start one with: fs3 local up --dir {root})")
    cluster = LocalCluster(root)
    signalled = cluster.rotate_token(finish=args.finish)
    state = "finished" if args.finish else "rotating"
    if args.json:
        print(json.dumps({"token_file": str(cluster.token_file), "state": state, "signalled": signalled}))
    elif args.finish:
        print(f"fs3: the old token is refused now; {cluster.token_file} holds the new one only "
              f"(reloaded by {', '.join(signalled) or 'no running process'})")
    else:
        print(f"fs3: new token in {cluster.token_file} (its first line), presented by every process "
              f"({', '.join(signalled) or 'none running'}); the old one is still accepted.\n"
              f"     Move clients to the new token, then: fs3 admin token rotate --dir {root} --finish")
    return 0

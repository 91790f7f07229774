"""``fs3 local``: a whole cluster on this machine, as child processes with their data under one directory.

    fs3 local up [--dir DIR] [--storage-nodes N] [--targets-per-node T] [--replicas R] [--detach]
    fs3 local status|down [--dir DIR]
    fs3 local kill NAME | start NAME      (fault drills: NAME is mgmtd or storage-N)

The first ``up`` writes a config per service (fixed ports, a fresh cluster token) under DIR; later
runs reuse them, so a restarted cluster finds its data. ``DIR/cluster.json`` describes every
endpoint, process id and the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fs3.common.errors import FS3Error, InvalidArgument, Unavailable

__all__ = ["LocalCluster"]


@dataclass
class _Proc:
    name: str
    args: list[str]
    ready_file: Path
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] = field(default_factory=dict)


class LocalCluster:
    """mgmtd, N storage nodes (T targets each) and meta under ``root``; each can be killed and restarted."""

    def __init__(self, root: Path, storage_nodes: int = 3, targets_per_node: int = 2, token: str | None = None,
                 heartbeat_timeout_ms: int = 3_000, heartbeat_interval_ms: int = 200, fsync: bool = False,
                 meta_data_dir: Path | None = None, meta_sync_commits: bool | None = None,
                 storage_data_dirs: dict[int, Path] | None = None) -> None:
        """``fsync``: storage targets sync their writes and meta its commits (``meta_sync_commits``
        decides for meta alone). ``meta_data_dir`` and ``storage_data_dirs`` (node id -> directory
        of its targets) put data elsewhere than under ``root`` (crash tests: on a disk that loses
        unsynced writes), configs and logs staying under ``root``. All three apply when a service's
        config is first written."""
        if storage_nodes < 1 or targets_per_node < 1:
            raise InvalidArgument("a local cluster needs at least one storage node with one target")
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        saved = self._load_layout()
        self.token = saved.get("token") or token or secrets.token_hex(16)
        self.env = {**os.environ, "FS3_LOG_LEVEL": os.environ.get("FS3_LOG_LEVEL", "INFO")}
        # Every service binds port 0 and reports what it got in its ready file, so ports never race
        # with other programs. Only mgmtd's framed port is kept (layout.json) once known: storage
        # nodes and clients find the cluster through it after restarts.
        self.mgmtd_port = int(saved.get("mgmtd_port") or 0)
        self.procs: dict[str, _Proc] = {}
        mgmtd_dir = self.root / "mgmtd"
        mgmtd_dir.mkdir(exist_ok=True)
        mgmtd_config = mgmtd_dir / "mgmtd.toml"
        if not mgmtd_config.exists():
            mgmtd_config.write_text(
                f'data_dir = "{mgmtd_dir}"\ngrpc_port = 0\nmetrics_port = 0\n'
                f'heartbeat_timeout_ms = {heartbeat_timeout_ms}\ntoken = "{self.token}"\n')
        self._add("mgmtd", ["mgmtd", "--config", str(mgmtd_config)])
        nodes = int(saved.get("storage_nodes") or storage_nodes)
        for node_id in range(1, nodes + 1):
            node_dir = self.root / f"storage-{node_id}"
            node_dir.mkdir(exist_ok=True)
            data_dir = (storage_data_dirs or {}).get(node_id, node_dir)
            config = node_dir / "storage.toml"
            if not config.exists():
                targets = "\n".join(
                    f'[[targets]]\ntarget_id = {node_id * 100 + j}\npath = "{data_dir / f"target-{j}"}"\n'
                    for j in range(1, targets_per_node + 1))
                config.write_text(
                    f'node_id = {node_id}\ntoken = "{self.token}"\n'
                    f"heartbeat_interval_ms = {heartbeat_interval_ms}\n"
                    f"rpc_timeout_ms = 2000\nfsync = {'true' if fsync else 'false'}\n"
                    f"framed_port = 0\ngrpc_port = 0\nmetrics_port = 0\n"
                    f"[replica]\nforward_timeout_ms = 2000\n{targets}")
            self._add(f"storage-{node_id}", ["storage", "--config", str(config)])
        self._nodes = nodes
        meta_dir = self.root / "meta"
        meta_dir.mkdir(exist_ok=True)
        meta_config = meta_dir / "meta.toml"
        sync_commits = "true" if (fsync if meta_sync_commits is None else meta_sync_commits) else "false"
        if not meta_config.exists():
            meta_config.write_text(
                f'node_id = 1001\ndata_dir = "{meta_data_dir or meta_dir}"\ntoken = "{self.token}"\n'
                f"framed_port = 0\ngrpc_port = 0\nmetrics_port = 0\nsync_commits = {sync_commits}\n"
                f"heartbeat_interval_ms = {heartbeat_interval_ms}\nrpc_timeout_ms = 2000\n"
                f"[service]\nprune_interval_ms = 1000\n")
        self._add("meta", ["meta", "--config", str(meta_config)])
        self.mountpoint: str | None = saved.get("mountpoint")
        if self.mountpoint:
            self._add("mount", ["mount", "MGMTD", self.mountpoint, "--foreground"])
        self._save_layout()

    def set_mount(self, mountpoint: Path | None) -> None:
        """Mount the cluster at ``mountpoint`` (a managed process, stopped first), or no longer."""
        self.procs.pop("mount", None)
        self.mountpoint = str(mountpoint.resolve()) if mountpoint else None
        if self.mountpoint:
            Path(self.mountpoint).mkdir(parents=True, exist_ok=True)
            self._add("mount", ["mount", "MGMTD", self.mountpoint, "--foreground"])
        self._save_layout()

    @property
    def mgmtd_address(self) -> str:
        if not self.mgmtd_port:
            raise Unavailable("mgmtd has not been started yet")
        return f"127.0.0.1:{self.mgmtd_port}"

    # -- layout and status file --------------------------------------------------------------

    def _load_layout(self) -> dict[str, Any]:
        path = self.root / "layout.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _save_layout(self) -> None:
        (self.root / "layout.json").write_text(json.dumps(
            {"token": self.token, "mgmtd_port": self.mgmtd_port, "storage_nodes": self._nodes,
             "mountpoint": getattr(self, "mountpoint", None)}))

    def write_cluster_json(self) -> Path:
        data = {
            "dir": str(self.root), "token": self.token, "mgmtd": self.mgmtd_address,
            "processes": {name: {"pid": p.popen.pid if p.popen else p.info.get("pid"), "framed": p.info.get("framed"),
                                 "grpc": p.info.get("grpc"), "metrics": p.info.get("metrics"),
                                 "log": str(p.log_path)} for name, p in self.procs.items()},
        }
        path = self.root / "cluster.json"
        path.write_text(json.dumps(data, indent=2))
        return path

    # -- processes ---------------------------------------------------------------------------

    def _add(self, name: str, args: list[str]) -> None:
        self.procs[name] = _Proc(name, args, self.root / f"{name}.ready.json", self.root / f"{name}.log")

    def start(self, name: str, wait: bool = True) -> None:
        if name not in self.procs:
            raise InvalidArgument(f"no process {name!r}; known: {', '.join(self.procs)}")
        proc = self.procs[name]
        proc.ready_file.unlink(missing_ok=True)
        args, env = list(proc.args), dict(self.env)
        if name == "mgmtd":
            args += ["--framed-port", str(self.mgmtd_port)]
        else:
            env["FS3_STORAGE_MGMTD_ADDRESS"] = self.mgmtd_address
            env["FS3_META_MGMTD_ADDRESS"] = self.mgmtd_address
            env["FS3_TOKEN"] = self.token
            args = [self.mgmtd_address if a == "MGMTD" else a for a in args]
        with proc.log_path.open("ab") as log:
            proc.popen = subprocess.Popen(
                [sys.executable, "-P", "-m", "fs3.cli.main", *args, "--ready-file", str(proc.ready_file)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)
        if wait or (name == "mgmtd" and not self.mgmtd_port):
            self.wait_ready(name)

    def wait_ready(self, name: str, timeout_s: float = 30) -> dict[str, Any]:
        proc = self.procs[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.ready_file.exists():
                proc.info = json.loads(proc.ready_file.read_text())
                if name == "mgmtd" and not self.mgmtd_port:
                    self.mgmtd_port = int(str(proc.info["framed"]).rsplit(":", 1)[1])
                    self._save_layout()
                return proc.info
            if proc.popen is not None and proc.popen.poll() is not None:
                raise Unavailable(f"{name} exited with {proc.popen.returncode}:\n{self.log_tail(name)}")
            time.sleep(0.05)
        raise Unavailable(f"{name} not ready after {timeout_s}s:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.procs[name].log_path
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def address(self, name: str, transport: str = "framed") -> str:
        return str(self.procs[name].info[transport])

    def start_all(self) -> None:
        """Start every service (the mount is started on its own, once the chains serve)."""
        self.start("mgmtd")
        services = [name for name in self.procs if name not in ("mgmtd", "mount")]
        for name in services:
            self.start(name, wait=False)
        for name in services:
            self.wait_ready(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        pid = proc.popen.pid if proc.popen is not None else _pid_from(proc.ready_file)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)
            if proc.popen is not None:
                proc.popen.wait(timeout=10)
        proc.popen = None
        proc.ready_file.unlink(missing_ok=True)

    def stop_all(self) -> None:
        mount = self.procs.get("mount")
        if mount is not None:
            # Unmount first, while meta can still take the last closes.
            pid = mount.popen.pid if mount.popen is not None else _pid_from(mount.ready_file)
            if pid and _alive(pid):
                os.killpg(pid, signal.SIGTERM)
                deadline = time.monotonic() + 10
                while _alive(pid) and time.monotonic() < deadline:
                    if mount.popen is not None and mount.popen.poll() is not None:
                        break
                    time.sleep(0.05)
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            pid = proc.popen.pid if proc.popen is not None else _pid_from(proc.ready_file)
            if pid and _alive(pid):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            pid = proc.popen.pid if proc.popen is not None else _pid_from(proc.ready_file)
            while pid and _alive(pid) and time.monotonic() < deadline:
                if proc.popen is not None and proc.popen.poll() is not None:
                    break
                time.sleep(0.05)
            if pid and _alive(pid) and (proc.popen is None or proc.popen.poll() is None):
                os.killpg(pid, signal.SIGKILL)
            if proc.popen is not None:
                proc.popen.wait(timeout=5)
                proc.popen = None
            proc.ready_file.unlink(missing_ok=True)

    # -- cluster setup -----------------------------------------------------------------------

    async def ensure_chains(self, replicas: int, timeout_s: float = 60) -> list[int]:
        """Create the chain table on first start; wait until every chain is serving."""
        from fs3 import common_pb2 as cpb
        from fs3.client.admin import AdminClient
        from fs3.rpc.channel import RealChannelFactory

        channels = RealChannelFactory(self.token)
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


def _pid_from(ready_file: Path) -> int | None:
    try:
        return int(json.loads(ready_file.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def _alive(pid: int) -> bool:
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


def _print_endpoints(cluster: LocalCluster) -> None:
    print(f"fs3 local cluster in {cluster.root}")
    for name, proc in cluster.procs.items():
        info = proc.info
        if name == "mount":
            print(f"  {name:<10} {info.get('mountpoint', '-'):<73}  pid {info.get('pid', '-')}")
            continue
        print(f"  {name:<10} framed {info.get('framed', '-'):<22} grpc {info.get('grpc', '-'):<22} "
              f"metrics {info.get('metrics', '-')}  pid {info.get('pid', '-')}")
    print(f"  token: {cluster.token}")
    installed = Path(sys.executable).parent / "fs3"
    command = str(installed) if installed.exists() else "fs3"
    if cluster.mountpoint:
        print(f"  mount:  {cluster.mountpoint}  (an ordinary directory: ls, cp, git, python... all work)")
    print(f"  python: import fs3; fs = fs3.connect({cluster.mgmtd_address!r}, token={cluster.token!r})")
    print(f"  url:    fs3://{cluster.mgmtd_address}/path  (fsspec, pandas; storage_options={{'token': ...}})")
    print(f"  try:   {command} admin --mgmtd {cluster.mgmtd_address} --token {cluster.token} chains")
    print(f"         {command} admin --mgmtd {cluster.mgmtd_address} --token {cluster.token} fsck")
    print(f"         {command} admin --mgmtd {cluster.mgmtd_address} --token {cluster.token} verify")
    print(f"         {command} local kill storage-2 --dir {cluster.root}   (a drill; 'local start' undoes it)")


def local_command(args: Any) -> int:
    root = Path(args.dir)
    if args.action == "up":
        cluster = LocalCluster(root, storage_nodes=args.storage_nodes, targets_per_node=args.targets_per_node)
        started = False
        try:
            cluster.start_all()
            started = True
            print(f"fs3: waiting for {args.replicas}-replica chains to be serving...", flush=True)
            asyncio.run(cluster.ensure_chains(args.replicas))
            cluster.set_mount(Path(args.mount) if args.mount else None)
            if cluster.mountpoint:
                cluster.start("mount")
                print(f"fs3: mounted at {cluster.mountpoint}", flush=True)
            cluster.write_cluster_json()
            _print_endpoints(cluster)
            if args.detach:
                print(f"  stop:  fs3 local down --dir {root}")
                return 0
            print("Ctrl-C stops the cluster.", flush=True)
            stop = {"now": False}

            def _stop(*_: object) -> None:
                stop["now"] = True

            signal.signal(signal.SIGINT, _stop)
            signal.signal(signal.SIGTERM, _stop)
            while not stop["now"]:
                time.sleep(0.2)
            print("\nfs3: stopping...", flush=True)
            cluster.stop_all()
            return 0
        except (FS3Error, KeyboardInterrupt):
            if started or any(p.popen for p in cluster.procs.values()):
                cluster.stop_all()
            raise
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
            pid = _pid_from(proc.ready_file)
            up = bool(pid and _alive(pid))
            running += up
            print(f"  {name:<10} {'running' if up else 'stopped':<8} pid {pid or '-'}")
        return 0 if running == len(cluster.procs) else 3
    if args.action == "kill":
        cluster.kill(args.name)
        print(f"fs3: {args.name} killed (SIGKILL)")
        return 0
    if args.action == "start":
        cluster.start(args.name)
        print(f"fs3: {args.name} started")
        return 0
    raise InvalidArgument(f"unknown action {args.action}")

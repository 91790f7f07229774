"""``hai local``: a whole HAI Platform on this machine — an fs3 cluster, ``hai server`` and N agents.

    hai local up --nodes N [--dir DIR] [--fs3 MGMTD | --with-fs3] [--no-netns]
    hai local status [--dir DIR]
    hai local down [--dir DIR]

``up`` starts, under DIR: an fs3 local cluster (:class:`fs3.cli.local.LocalCluster`, its files at
the top of DIR as ``fs3 local`` keeps them, so ``fs3 local status --dir DIR`` and ``fs3 admin --dir
DIR`` work on it) unless ``--fs3 MGMTD`` names one already running; ``hai server`` with its
SQLite database, users file and agent token in ``DIR/hai``; and N ``hai agent`` processes, nodes
``node1`` .. ``nodeN``, which log their ranks' output to fs3. Every process is a
:class:`~fs3.cluster.processes.ServiceProcess` (pid file with the start time, log, ready file), as
``fs3 local``'s are, and ``up`` returns once all of them are ready (each agent registered).

**Network namespaces.** Run as root, each agent runs in a network namespace of its own with one
veth on a bridge ``up`` creates in this machine's namespace, on a free private /24 (the bridge
holds ``.1``, node K ``.(10+K)``): ranks on different nodes meet over a real network, and the
agents reach the server and fs3 at the bridge's address, where those listen. Without root, or with
``--no-netns``, the agents are plain processes on 127.0.0.1. ``DIR/hai-local.json`` records the
bridge and the namespaces, so ``down`` (from any process) removes exactly those.

**Users.** ``up`` makes an admin user whose token is in ``DIR/hai-admin.token`` (0600; kept across
restarts), and prints how to use it. Its jobs' ranks act on fs3 as an fs3 *user* — never with the
cluster's token, which only the agents and the server hold: ``up`` makes an fs3 user token for the
uid and gid running it (``fs3 admin user add``, kept in ``DIR/hai/admin.fs3token`` and used again
on the same cluster only), or, when
``--fs3`` was given a user token rather than a cluster token, hands on that one. Every (user, group,
priority) may use all N nodes unless an admin sets a quota.

``down`` stops the agents (they kill their ranks), the server and the fs3 cluster it started,
kills whatever still runs in the namespaces and deletes them and the bridge; it is idempotent. A
second ``up`` while any of it runs is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fs3.local import (
    FS3Error,
    InvalidArgument,
    LocalCluster,
    ServiceProcess,
    cluster_lock,
    is_user_token,
    make_private_dir,
    netns,
    pid_alive,
    read_pid_file,
    read_token_file,
    spawn_logged,
    stop_group,
    write_secret_file,
)

__all__ = ["ADMIN_TOKEN_FILE", "NOT_INHERITED", "STATE_FILE", "HaiLocal", "add_arguments", "hai_argv", "run",
           "service_env"]

STATE_FILE = "hai-local.json"
ADMIN_TOKEN_FILE = "hai-admin.token"
ADMIN = "admin"
ADMIN_FS3_TOKEN_FILE = "admin.fs3token"  # in DIR/hai: the fs3 user token the admin's ranks get
MAX_NODES = 64  # one /24 holds them, and one machine runs them
SUBNET_PREFIX = "10.214"  # the chaos harness takes 10.213: the two can run side by side
LOOPBACK = "127.0.0.1"
# What ``hai server`` and ``hai agent`` read from their environment that would take this
# directory's platform elsewhere: an operator's ``HAI_DB_URL`` (the local server would schedule on
# that database, next to its real server) and the container tokens (the server would replace the
# admin whose token is in DIR/hai-admin.token, its ranks getting $FS3_TOKEN, the cluster's token).
NOT_INHERITED = ("HAI_DB_URL", "HAI_ADMIN_TOKEN", "HAI_AGENT_TOKEN")


def service_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment ``hai local`` starts its server and agents with: the caller's, less
    :data:`NOT_INHERITED`."""
    env = {k: v for k, v in environ.items() if k not in NOT_INHERITED}
    env.setdefault("FS3_LOG_LEVEL", "INFO")
    return env


def hai_argv(args: list[str], ready_file: Path) -> list[str]:
    """The command line of ``hai ARGS`` run by this interpreter, writing its ready file."""
    return [sys.executable, "-P", "-m", "hai", *args, "--ready-file", str(ready_file)]


@dataclass
class Settings:
    """What ``up`` was asked for; the agents' grace periods matter to suspend benchmarks."""

    nodes: int = 2
    fs3: str | None = None  # an fs3 mgmtd already running; None: start one in the directory
    fs3_token_file: Path | None = None  # its token (default $FS3_TOKEN)
    netns: bool | None = None  # None: when root and namespaces work
    storage_nodes: int = 1
    replicas: int = 1
    heartbeat_s: float = 0.5
    tick_interval_s: float = 0.5
    ack_grace_s: float = 5.0
    finish_grace_s: float = 5.0
    extra_env: Mapping[str, str] = field(default_factory=dict)  # for every agent (and so every rank)


class HaiLocal:
    """The processes and the network of one ``hai local`` directory."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.hai_dir = self.root / "hai"
        self.state_path = self.root / STATE_FILE
        self.admin_token_file = self.root / ADMIN_TOKEN_FILE
        self.state: dict[str, Any] = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}

    # -- what runs --------------------------------------------------------------------------------

    def _proc(self, name: str, args: list[str]) -> ServiceProcess:
        return ServiceProcess(name, args, self.root / f"{name}.ready.json", self.root / f"{name}.log",
                              pid_file=self.root / f"{name}.pid", program=hai_argv)

    def processes(self) -> dict[str, ServiceProcess]:
        """The server and the agents this directory's state names (args as they were started)."""
        names = ["hai-server", *(f"hai-agent-{k}" for k in range(1, int(self.state.get("nodes", 0)) + 1))]
        return {name: self._proc(name, []) for name in names}

    def fs3_cluster(self) -> LocalCluster | None:
        """The fs3 cluster ``up`` started in the directory, if it did."""
        if not self.state.get("with_fs3") or not (self.root / "layout.json").exists():
            return None
        return LocalCluster(self.root, host=str(self.state.get("host") or LOOPBACK))

    def running(self) -> dict[str, int]:
        """Name -> pid of every process of this directory that runs now (fs3's included)."""
        running = {name: pid for name, proc in self.processes().items() if (pid := proc.pid) and pid_alive(pid)}
        cluster = self.fs3_cluster()
        if cluster is not None:
            running.update({f"fs3 {name}": pid for name, pid in cluster.running().items()})
        return running

    @property
    def server_url(self) -> str:
        return str(self.state.get("server") or "")

    @property
    def admin_token(self) -> str:
        return read_token_file(self.admin_token_file)[0]

    def _save(self) -> None:
        write_secret_file(self.state_path, json.dumps(self.state, indent=2))

    # -- up ---------------------------------------------------------------------------------------

    def up(self, settings: Settings) -> None:
        """Start everything (see the module's docstring); on any failure, stop what started."""
        if not 1 <= settings.nodes <= MAX_NODES:
            raise InvalidArgument(f"--nodes must be 1 to {MAX_NODES}, not {settings.nodes}")
        make_private_dir(self.root)
        with cluster_lock(self.root, "hai local"):
            running = self.running()
            if running:
                pids = ", ".join(f"pid {pid}: {name}" for name, pid in running.items())
                raise InvalidArgument(f"a hai local cluster in {self.root} is already running ({pids}); "
                                      f"stop it with: hai local down --dir {self.root}")
            if self.state.get("namespaces") or self.state.get("bridge"):
                self._remove_network()  # left by a crash: nothing runs in it
            use_netns = settings.netns
            if use_netns is None:
                use_netns = netns.netns_usable()
            elif use_netns and not netns.netns_usable():
                raise InvalidArgument("network namespaces need root (and `ip netns`); use --no-netns")
            fs3_token = self._fs3_token(settings)
            if use_netns and settings.fs3 and settings.fs3.split(":")[0] in (LOOPBACK, "localhost"):
                raise InvalidArgument(f"agents in network namespaces cannot reach fs3 at {settings.fs3} (loopback); "
                                      "give an address on a network they reach, or --no-netns")
            self.state = {"nodes": settings.nodes, "with_fs3": settings.fs3 is None, "netns": use_netns,
                          "host": LOOPBACK, "bridge": None, "namespaces": []}
            self._save()
            try:
                self._start(settings, use_netns, fs3_token)
            except BaseException:
                self._down(quiet=True)  # under this up's lock
                raise

    def _fs3_token(self, settings: Settings) -> str | None:
        if settings.fs3 is None:
            return None
        if settings.fs3_token_file is not None:
            return read_token_file(settings.fs3_token_file)[0]
        token = os.environ.get("FS3_TOKEN", "").strip()
        if not token:
            raise InvalidArgument("--fs3 needs the cluster's token: --fs3-token-file FILE or $FS3_TOKEN")
        return token

    def _ranks_fs3_token(self, mgmtd: str, fs3_token: str, *, own_cluster: bool) -> str:
        """The fs3 token the admin's ranks get: a user token, never the cluster's (a rank holding the
        cluster token could act as any user). A user token given with ``--fs3`` is handed on as it
        is; otherwise one is made once for this process's uid and gid and kept in the hai directory."""
        if is_user_token(fs3_token):
            return fs3_token
        kept = self.hai_dir / ADMIN_FS3_TOKEN_FILE
        # Which cluster the kept token was made on: this directory's own ("local"), else its mgmtd.
        # A token is reused on that cluster only: every `fs3 admin user add` makes one more valid
        # token, which `down` does not remove.
        made_on = self.hai_dir / f"{ADMIN_FS3_TOKEN_FILE}.cluster"
        cluster = "local" if own_cluster else mgmtd
        recorded = made_on.read_text().strip() if made_on.exists() else ("local" if kept.exists() else "")
        if kept.exists() and recorded == cluster:
            return read_token_file(kept)[0]
        with contextlib.suppress(FileNotFoundError):
            kept.unlink()  # made on another cluster: not valid on this one
        target = ["--dir", str(self.root)] if own_cluster else ["--mgmtd", mgmtd]
        argv = [sys.executable, "-P", "-m", "fs3.cli.main", "admin", *target, "user", "add", "hai-admin",
                "--uid", str(os.getuid()), "--gid", str(os.getgid()), "--comment", "hai local: the admin's ranks",
                "--token-file", str(kept)]
        env = {**os.environ, "FS3_TOKEN": fs3_token}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0 or not kept.exists():
            raise FS3Error(f"could not make an fs3 user token for the admin's ranks: "
                           f"{(done.stderr or done.stdout).strip()[-500:]}")
        write_secret_file(made_on, cluster + "\n")
        return read_token_file(kept)[0]

    def _make_network(self, nodes: int) -> tuple[str, list[tuple[str, str]]]:
        """The bridge (its address returned) and one namespace per node: (namespace, address)."""
        run_id = secrets.token_hex(3)
        subnet = netns.free_subnet(SUBNET_PREFIX)
        bridge, host = f"haibr-{run_id}", f"{subnet}.1"
        self.state["bridge"] = bridge  # recorded before it exists: a failure half way is cleaned up
        self._save()
        netns.ip("link", "add", bridge, "type", "bridge")
        netns.ip("addr", "add", f"{host}/24", "dev", bridge)
        netns.ip("link", "set", bridge, "up")
        made = []
        for k in range(1, nodes + 1):
            namespace, address = f"hai-{run_id}-node{k}", f"{subnet}.{10 + k}"
            self.state["namespaces"].append(namespace)
            self._save()
            netns.attach_namespace(namespace, f"{address}/24", bridge, f"h{run_id}p{k}")
            made.append((namespace, address))
        self.state["host"] = host
        self._save()
        return host, made

    def _start(self, settings: Settings, use_netns: bool, fs3_token: str | None) -> None:
        nodes: list[tuple[str | None, str]] = [(None, LOOPBACK)] * settings.nodes
        host = LOOPBACK
        if use_netns:
            host, made = self._make_network(settings.nodes)
            nodes = [(namespace, address) for namespace, address in made]
        if settings.fs3 is None:
            cluster = LocalCluster(self.root, storage_nodes=settings.storage_nodes, targets_per_node=1, host=host)
            print(f"hai: starting fs3 ({settings.storage_nodes} storage node(s)) in {self.root}...", flush=True)
            cluster.start_all()
            import asyncio

            asyncio.run(cluster.ensure_chains(settings.replicas))
            cluster.write_cluster_json()
            mgmtd, fs3_token = cluster.mgmtd_address, cluster.token
        else:
            mgmtd = settings.fs3
        assert fs3_token is not None
        self.state["mgmtd"] = mgmtd
        self._save()

        from hai.server import AGENT_TOKEN_FILE, USERS_FILE, Users, add_user, ensure_agent_token

        make_private_dir(self.hai_dir)
        ensure_agent_token(self.hai_dir)
        users_file = self.hai_dir / USERS_FILE
        known = Users.load(users_file).get(ADMIN)
        ranks_token = self._ranks_fs3_token(mgmtd, fs3_token, own_cluster=settings.fs3 is None)
        if known is None or not self.admin_token_file.exists() or known.fs3_token != ranks_token:
            token = add_user(self.hai_dir, ADMIN, admin=True, fs3_token=ranks_token)
            write_secret_file(self.admin_token_file, token + "\n")

        env = service_env(os.environ)
        server = self._proc("hai-server", [
            "server", "--dir", str(self.hai_dir), "--host", host, "--port", "0",
            "--default-quota-nodes", str(settings.nodes), "--tick-interval-s", str(settings.tick_interval_s),
            "--fs3", mgmtd])  # the dashboard shows the ranks' logs from fs3
        server.spawn(spawn_logged, {**env, "FS3_TOKEN": fs3_token})
        info = server.wait_ready(60)
        self.state["server"] = f"http://{info['http']}"
        self._save()
        agents = []
        agent_env = {**env, **settings.extra_env, "FS3_TOKEN": fs3_token}
        for k, (namespace, address) in enumerate(nodes, 1):
            agent = self._proc(f"hai-agent-{k}", [
                "agent", "--server", self.server_url, "--node", f"node{k}", "--address", address,
                "--token-file", str(self.hai_dir / AGENT_TOKEN_FILE), "--fs3", mgmtd,
                "--heartbeat-s", str(settings.heartbeat_s), "--ack-grace-s", str(settings.ack_grace_s),
                "--finish-grace-s", str(settings.finish_grace_s)])
            prefix = ("ip", "netns", "exec", namespace) if namespace else ()

            def spawner(argv: list[str], e: Mapping[str, str], log: Path,
                        prefix: tuple[str, ...] = prefix) -> subprocess.Popen[bytes]:
                return spawn_logged(argv, e, log, prefix)

            agent.spawn(spawner, agent_env)
            agents.append(agent)
        for agent in agents:
            agent.wait_ready(60)

    # -- down -------------------------------------------------------------------------------------

    def down(self, quiet: bool = False) -> bool:
        """Stop everything this directory runs and remove its network; whether anything ran.

        Refused while an ``up`` is starting the directory's cluster, or another ``down`` stops it
        (either holds the directory's lock):
        a ``down`` in between would stop what that ``up`` had started while it went on starting the
        rest, and each would write its own record of the network over the other's. A failed ``up``
        stops what it started itself."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(cluster_lock(self.root, "hai local"))
            except InvalidArgument:
                holder = read_pid_file(self.root / "lock")
                raise InvalidArgument(f"another hai local up or down (pid {holder or '?'}) is at work on the cluster "
                                      f"in {self.root}; wait for it (a failed up stops what it started) or kill "
                                      "it, then run down again") from None
            return self._down(quiet)

    def _down(self, quiet: bool) -> bool:
        ran = False
        procs = self.processes()
        for name in reversed(list(procs)):  # the agents (and their ranks) first, then the server
            pid = procs[name].pid
            if pid and pid_alive(pid):
                ran = True
                stop_group(pid, timeout_s=15)
            procs[name].ready_file.unlink(missing_ok=True)
            procs[name].pid_file.unlink(missing_ok=True)  # type: ignore[union-attr]
        cluster = self.fs3_cluster()
        if cluster is not None:
            ran = bool(cluster.running()) or ran
            for proc in cluster.procs.values():
                if proc.ready_file.exists():
                    with contextlib.suppress(OSError, ValueError):
                        proc.info = json.loads(proc.ready_file.read_text())
            cluster.stop_all()
        ran = self._remove_network() or ran
        if not quiet:
            print(f"hai: local cluster in {self.root} stopped" if ran else f"hai: nothing runs in {self.root}")
        return ran

    def _remove_network(self) -> bool:
        removed = False
        for namespace in self.state.get("namespaces") or []:
            if namespace in netns.ip("netns", "list", check=False).stdout.split():
                removed = True
            netns.delete_namespace(namespace)
        bridge = self.state.get("bridge")
        if bridge and netns.ip("link", "del", bridge, check=False).returncode == 0:
            removed = True
        if self.state:
            self.state.update(bridge=None, namespaces=[])
            self._save()
        return removed

    # -- output -----------------------------------------------------------------------------------

    def print_usage(self) -> None:
        hai = Path(sys.executable).parent / "hai"
        command = str(hai) if hai.exists() else "hai"
        mode = "in network namespaces" if self.state.get("netns") else "as plain processes"
        print(f"hai local cluster in {self.root}")
        print(f"  server: {self.server_url}  (log {self.root / 'hai-server.log'})")
        print(f"  agents: {self.state['nodes']} ({mode}): node1 .. node{self.state['nodes']}")
        print(f"  fs3:    {self.state.get('mgmtd')}" + (f"  (started here: fs3 local status --dir {self.root})"
                                                        if self.state.get("with_fs3") else ""))
        # Where the token is, never the token: this output ends up in terminals and CI logs.
        print(f"  token:  the admin's, in {self.admin_token_file} (readable by you only)")
        print(f"  try:    export HAI_SERVER={self.server_url} HAI_TOKEN=$(cat {self.admin_token_file})")
        print(f"          {command} nodes; {command} submit job.toml; {command} ls; {command} logs JOB --rank 0 "
              f"--mgmtd {self.state.get('mgmtd')}")
        print(f"  stop:   {command} local down --dir {self.root}")


# -- the command ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = actions.add_parser("up", help="start fs3, hai server and N agents")
    status = actions.add_parser("status", help="which of the processes run")
    down = actions.add_parser("down", help="stop everything up started and remove its namespaces")
    for p in (up, status, down):
        p.add_argument("--dir", type=Path, default=Path("hai-local"), help="the cluster directory (default hai-local)")
    up.add_argument("--nodes", type=int, default=2, help="how many agents (nodes), 1 to 64 (default 2)")
    fs3 = up.add_mutually_exclusive_group()
    fs3.add_argument("--fs3", metavar="MGMTD", help="use this fs3 cluster (token: --fs3-token-file or $FS3_TOKEN)")
    fs3.add_argument("--with-fs3", action="store_true", help="start an fs3 cluster in DIR (the default)")
    up.add_argument("--fs3-token-file", type=Path, help="with --fs3: the file holding its token")
    up.add_argument("--storage-nodes", type=int, default=1, help="the started fs3's storage nodes (default 1)")
    up.add_argument("--replicas", type=int, default=1, help="the started fs3's chain length (default 1)")
    up.add_argument("--no-netns", action="store_true", help="agents as plain processes even when root")
    up.add_argument("--ack-grace-s", type=float, default=5.0, help="the agents' suspend acknowledgement grace")
    up.add_argument("--finish-grace-s", type=float, default=5.0, help="the agents' suspend exit grace")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 done, 1 a process failed to start, 2 bad usage (``up`` twice, no such
    cluster), 3 ``status`` with something stopped."""
    local = HaiLocal(args.dir)
    try:
        if args.action == "up":
            local.up(Settings(nodes=args.nodes, fs3=args.fs3, fs3_token_file=args.fs3_token_file,
                              netns=False if args.no_netns else None, storage_nodes=args.storage_nodes,
                              replicas=args.replicas, ack_grace_s=args.ack_grace_s,
                              finish_grace_s=args.finish_grace_s))
            local.print_usage()
            return 0
        if not local.state:
            raise InvalidArgument(f"no hai local cluster in {local.root} (start one with: hai local up --dir "
                                  f"{local.root})")
        if args.action == "down":
            local.down()
            return 0
        running = local.running()
        expected = [*local.processes()]
        cluster = local.fs3_cluster()
        if cluster is not None:
            expected += [f"fs3 {name}" for name in cluster.procs]
        for name in expected:
            print(f"  {name:<14} {'running' if name in running else 'stopped':<8} pid {running.get(name, '-')}")
        if local.server_url:
            spaces = " ".join(local.state.get("namespaces") or []) or "none"
            print(f"  server {local.server_url}, fs3 {local.state.get('mgmtd')}, namespaces {spaces}")
        return 0 if all(name in running for name in expected) else 3
    except InvalidArgument as exc:
        print(f"hai local: {exc.message}", file=sys.stderr)
        return 2
    except (FS3Error, OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        print(f"hai local: {detail}", file=sys.stderr)
        return 1

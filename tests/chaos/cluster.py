"""The docker-compose topology on network-namespace hosts, with faults and the after-run checks.

Each compose service is a host (its own namespace and address); services get the environment the
compose file gives them, with service names replaced by host addresses and data directories by
ones under the run's root. Admin commands and client workloads run on the ``client`` host.

``profile="ha"`` runs the compose file's `ha` profile instead: its ``postgres`` host runs a real
PostgreSQL (Debian's binaries, tests/postgres.py, durable: a SIGKILL must not lose a commit),
prepared as the official image prepares its volume (the compose user, password and database, then
deploy/postgres/init.sql), and three mgmtd and three meta servers on it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fs3.cli.main import main as fs3_main
from fs3.cluster.processes import ServiceProcess
from fs3.common.errors import Unavailable
from fs3.sim.history import History, Op
from tests.chaos.netns import NetnsLab
from tests.chaos.topology import PROFILES, ROOT, load_compose, service_address
from tests.postgres import PostgresServer, find_bin_dir, start_postgres

POSTGRES = "postgres"

__all__ = ["LabCluster", "check_history", "check_namespace"]


class LabCluster:
    def __init__(self, lab: NetnsLab, root: Path, overrides: dict[str, str] | None = None,
                 small_disks: dict[str, int] | None = None, ext4_disks: dict[str, int] | None = None,
                 extra_hosts: list[str] | None = None, profile: str = "default") -> None:
        """``extra_hosts``: more client hosts (training nodes, say), each its own namespace on the same
        switch, whose programs run with the client's settings (:meth:`spawn_client`). ``profile``:
        the compose topology (``default`` or ``ha``); the client's host is ``client`` in both."""
        self.lab = lab
        self.profile = PROFILES[profile]
        self.servers = self.profile.servers
        self.postgres: PostgresServer | None = None
        # What fault steps measured (a takeover's time, a probe's window), for the report.
        self.notes: dict[str, Any] = {}
        # service -> bytes per target: its targets live on tmpfs mounts of this size (disk-full
        # drills) or on ext4 loop images (disks that turn read-only).
        self.small_disks = small_disks or {}
        self.ext4_disks = ext4_disks or {}
        self._root_shared = False
        self.mounts: list[Path] = []
        self.root = root
        # compose requires a token and has no default: every run makes its own.
        self.token = secrets.token_hex(16)
        self.compose = load_compose({"FS3_TOKEN": self.token, "FS3_PG_PASSWORD": secrets.token_hex(16)})
        self.overrides = overrides or {}
        addresses = lab.create([*self.servers, "client", *(extra_hosts or [])])
        self.addresses: dict[str, str] = {}
        for name in self.servers:
            compose_address = service_address(self.compose, name)
            self.addresses[compose_address] = f"{addresses[name]}:{compose_address.split(':')[1]}"
        # Every mgmtd, comma-separated (clients and admin commands follow the primary).
        self.mgmtd = ",".join(self.addresses[service_address(self.compose, name)] for name in self.servers
                              if self.kind(name) == "mgmtd")
        self.procs: dict[str, ServiceProcess] = {}
        self.base_env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:"
                         f"{os.environ['PATH']}"}

    def kind(self, name: str) -> str:
        """What a server is: ``postgres``, or the fs3 command it runs (mgmtd, meta, storage)."""
        return POSTGRES if name == POSTGRES else str(self.compose["services"][name]["command"][0])

    def _localize(self, name: str, value: str) -> str:
        for address, local in self.addresses.items():
            value = value.replace(address, local)
        return value.replace("/data", str(self.root / name)).replace("/certs", str(self.root / "certs"))

    def make_certs(self) -> None:
        """What the compose file's certs service does, by the same command, each node's certificate
        also naming its host's address (hosts here dial each other by address, not by name)."""
        command = [self._localize("certs", arg) for arg in self.compose["services"]["certs"]["command"]]
        command += [arg for name in self.servers if name != POSTGRES
                    for arg in ("--node", f"{name}={self.lab.address(name)}")]
        if fs3_main(command) != 0:
            raise RuntimeError(f"making the certificates failed: fs3 {' '.join(command)}")

    @property
    def client_env(self) -> dict[str, str]:
        """What a client host's programs get: the token and the compose client's TLS settings."""
        env = self.compose["services"][self.profile.client]["environment"]
        return {"FS3_TOKEN": self.token,
                **{k: self._localize("client", v) for k, v in env.items() if k.startswith("FS3_TLS_")}}

    def env_for(self, name: str) -> dict[str, str]:
        env = {k: self._localize(name, v) for k, v in self.compose["services"][name]["environment"].items()}
        for key in env:
            # Compose's default (no FS3_PUBLIC_HOST) advertises the service's name; here that name's
            # host is a namespace, reached by its address.
            if key.endswith("_ADVERTISE_HOST"):
                env[key] = self.lab.address(name)
        prefix = next((k.rsplit("_", 2)[0] for k in env if k.endswith("_FRAMED_PORT")), "")
        env.update({k: v for k, v in self.overrides.items() if k.startswith(prefix + "_")})
        return env

    def _target_paths(self, name: str) -> list[Path]:
        return [Path(path) for key, value in self.env_for(name).items() if key.endswith("_TARGETS")
                for path in re.findall(r'path = "([^"]+)"', value)]

    def _mount_disks(self, name: str) -> None:
        """Put a service's targets on their own small file systems before it starts.

        ``small_disks``: tmpfs of a fixed size (disk-full drills). ``ext4_disks``: an ext4 image on a
        loop device mounted ``errors=remount-ro``, so the kernel itself can turn it read-only.
        """
        tmpfs_bytes = self.small_disks.get(name)
        ext4_bytes = self.ext4_disks.get(name)
        if not tmpfs_bytes and not ext4_bytes:
            return
        if not self._root_shared:
            # Every `ip netns exec` copies the mount table. Under a shared mount those copies become
            # slaves, so unmounting a disk here unmounts it in every host's copy too (else a stale
            # copy would keep the old, read-only superblock alive across a repair).
            subprocess.run(["mount", "--bind", str(self.root), str(self.root)], check=True)
            subprocess.run(["mount", "--make-shared", str(self.root)], check=True)
            self._root_shared = True
        for target in self._target_paths(name):
            if target in self.mounts:
                continue
            target.mkdir(parents=True, exist_ok=True)
            if tmpfs_bytes:
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs_bytes}", "fs3-chaos", str(target)],
                               check=True)
            else:
                image = self._image(target)
                if not image.exists():
                    with image.open("wb") as f:
                        f.truncate(ext4_bytes or 0)
                    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
                subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(target)], check=True)
            self.mounts.append(target)

    def _image(self, target: Path) -> Path:
        return self.root / f"{target.parent.name}-{target.name}.ext4"

    def fail_disks(self, name: str) -> None:
        """The kernel's own error path: ext4 records an error and remounts itself read-only."""
        for target in self._target_paths(name):
            device = subprocess.run(["findmnt", "-no", "SOURCE", str(target)], capture_output=True, text=True,
                                    check=True).stdout.strip()
            Path(f"/sys/fs/ext4/{Path(device).name}/trigger_fs_error").write_text("fs3 chaos: disk fault\n")

    def repair_disks(self, name: str) -> None:
        """What an operator does after a disk went read-only: unmount, e2fsck, mount again."""
        if self.procs[name].running:
            raise RuntimeError(f"stop {name} before repairing its disks")
        for target in self._target_paths(name):
            subprocess.run(["umount", str(target)], check=True)
            self.mounts.remove(target)
            checked = subprocess.run(["e2fsck", "-f", "-y", str(self._image(target))], capture_output=True,
                                     text=True)
            if checked.returncode >= 4:  # 1 and 2: errors corrected
                raise RuntimeError(f"e2fsck failed on {target}: {checked.stdout}{checked.stderr}")
        self._mount_disks(name)

    def close(self) -> None:
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None
        for target in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(target)], check=False)
        self.mounts.clear()
        if self._root_shared:
            subprocess.run(["umount", "-l", str(self.root)], check=False)
            self._root_shared = False

    def _start_postgres(self) -> None:
        """PostgreSQL on its host: a fresh server on first start, prepared as the official image
        prepares an empty volume; the same data directory on a later start (after a SIGKILL)."""
        if self.postgres is not None:
            self.postgres.start()
            return
        bin_dir = find_bin_dir()
        if bin_dir is None:
            raise RuntimeError("the ha profile needs PostgreSQL's server binaries (Debian's postgresql package)")
        self.postgres = start_postgres(bin_dir, durable=True, listen_host=self.lab.address(POSTGRES),
                                       port=int(self.addresses[service_address(self.compose, POSTGRES)]
                                                .rsplit(":", 1)[1]),
                                       netns=self.lab.namespace(POSTGRES))
        env = self.compose["services"][POSTGRES]["environment"]
        user, database = env["POSTGRES_USER"], env["POSTGRES_DB"]
        password = env["POSTGRES_PASSWORD"].replace("'", "''")
        self.postgres.execute(f'CREATE ROLE "{user}" LOGIN SUPERUSER PASSWORD \'{password}\'')
        self.postgres.execute(f'CREATE DATABASE "{database}" OWNER "{user}"')
        for volume in self.compose["services"][POSTGRES]["volumes"]:
            source, _, target = volume.partition(":")
            if target.startswith("/docker-entrypoint-initdb.d/"):
                sql = (ROOT / source).read_text()
                for statement in (s.strip() for s in re.sub(r"--[^\n]*", "", sql).split(";")):
                    if statement:
                        self.postgres.execute(statement)

    def start(self, name: str, timeout_s: float = 60) -> None:
        if name == POSTGRES:
            self._start_postgres()
            return
        self._mount_disks(name)
        proc = self.procs.setdefault(name, ServiceProcess(name, list(self.compose["services"][name]["command"]),
                                                          self.root / f"{name}.ready", self.root / f"{name}.log"))
        proc.spawn(lambda argv, env, log: self.lab.spawn(name, argv, dict(env), log),
                   {**self.base_env, **self.env_for(name)})
        try:
            proc.wait_ready(timeout_s)
        except Unavailable as exc:
            raise RuntimeError(str(exc)) from None

    def start_all(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.make_certs()
        for name in self.servers:
            self.start(name)
        setup = self.compose["services"][self.profile.setup]
        done = self.client_run(["sh", "-c", self._localize(self.profile.setup, setup["command"][0])],
                               timeout_s=120)
        if done.returncode != 0:
            raise RuntimeError(f"setup failed: {done.stdout}{done.stderr}")

    def signal(self, name: str, sig: int) -> None:
        if name == POSTGRES:
            if sig != signal.SIGKILL or self.postgres is None:
                raise RuntimeError("the postgres host takes SIGKILL only (then start it again)")
            self.postgres.kill()
            return
        self.procs[name].send_signal(sig)

    def log(self, name: str) -> str:
        """What a server wrote so far (its log file)."""
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def client_run(self, args: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        env = {**self.base_env, **self.client_env}
        return subprocess.run(["ip", "netns", "exec", self.lab.namespace("client"), *args], env=env,
                              capture_output=True, text=True, timeout=timeout_s)

    def client_spawn(self, args: list[str], log: Path) -> subprocess.Popen[Any]:
        return self.lab.spawn("client", args, {**self.base_env, **self.client_env}, log)

    def spawn_client(self, host: str, args: list[str], log: Path,
                     env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
        """A program on a client host (``client`` or an extra host), with the cluster's address in
        ``FS3_MGMTD`` and the client's token and TLS settings."""
        return self.lab.spawn(host, args, {**self.base_env, **self.client_env, "FS3_MGMTD": self.mgmtd,
                                           **(env or {})}, log)

    def admin(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.client_run([sys.executable, "-P", "-m", "fs3.cli.main", "admin", "--mgmtd", self.mgmtd, *args])

    def wait_all_serving(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.admin("--json", "chains")
            if out.returncode == 0:
                data = json.loads(out.stdout)
                states = {t["target_id"]: t.get("public_state") for t in data.get("targets", [])}
                if data.get("chains") and all(states.get(t) == "serving" for c in data["chains"]
                                              for t in c["target_ids"]):
                    return
            time.sleep(0.5)
        raise RuntimeError("chains did not all return to serving")


def check_history(result: dict[str, Any]) -> dict[str, Any]:
    """Linearizability per slot, the ledger of acknowledged writes, and the longest client outage."""
    history = History()
    for raw in result["ops"]:
        complete = raw["complete"] if raw["ok"] else math.inf
        op = Op(raw["kind"], raw["file"], (raw["slot"],), raw["invoke"], complete, raw.get("value", 0),
                ok=raw["ok"])
        if raw["kind"] == "read" and raw["ok"]:
            op.observed = {raw["slot"]: raw["observed"]}
        history.add(op)
    violations = history.check()
    # Ledger: each slot ends with its last acknowledged write, or with a write that was in flight
    # (unacknowledged) or started after it.
    lost: list[str] = []
    writes: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for raw in result["ops"]:
        if raw["kind"] == "write":
            writes.setdefault((raw["file"], raw["slot"]), []).append(raw)
    for (file, slot), ops in writes.items():
        acked = [w for w in ops if w["ok"]]
        final = result["final"][str(file)][slot]
        if not acked:
            continue
        last = max(acked, key=lambda w: w["complete"])
        allowed = {last["value"]} | {w["value"] for w in ops if not w["ok"] or w["invoke"] > last["invoke"]}
        if final not in allowed:
            lost.append(f"file {file} slot {slot}: ends with {final}, last acknowledged write was {last['value']}")
    done = sorted(raw["complete"] for raw in result["ops"] if raw["ok"])
    start = min(raw["invoke"] for raw in result["ops"])
    gaps = [b - a for a, b in zip([start, *done], done, strict=False)]
    stalls = [raw["complete"] - raw["invoke"] for raw in result["ops"] if raw["ok"]]
    return {"operations": len(result["ops"]), "acknowledged": len(done), "violations": violations,
            "lost": lost, "worst_gap_s": max(gaps, default=0.0), "worst_stall_s": max(stalls, default=0.0),
            "failed": sum(1 for raw in result["ops"] if not raw["ok"])}


def stalled_after(result: dict[str, Any], last_fault: float) -> list[str]:
    """What made no progress after the last fault: the data workload (nothing it invoked since was
    acknowledged), and each metadata worker (``w<id>``) that acknowledged nothing it invoked since.
    Every worker counts: a client of the meta server a scenario killed must carry on through
    another, and the other workers' progress says nothing about it."""
    stalled = [] if any(op["ok"] and op["invoke"] > last_fault for op in result["ops"]) else ["the data workload"]
    progressed: dict[str, bool] = {}
    for op in result.get("namespace", {}).get("ops", []):
        worker = op["name"].split("-", 1)[0]
        progressed[worker] = progressed.get(worker, False) or (op["ok"] and op["invoke"] > last_fault)
    return stalled + [f"metadata worker {worker}" for worker, ok in sorted(progressed.items()) if not ok]


def check_namespace(result: dict[str, Any]) -> dict[str, Any]:
    """The metadata ledger (the workload's ``namespace`` operations): a file whose create was
    acknowledged and that nobody tried to remove is there, holding its name; a file whose remove was
    acknowledged is gone; nothing is there that no one tried to create. Unacknowledged operations
    may have happened or not, but for one: the only remove of a file whose create was acknowledged
    failing "no such file" (only its worker removes it) saw its own effect, a retry that ran twice
    (exactly-once broken across a meta server's death), or a lost create."""
    ops = result["namespace"]["ops"]
    final: dict[str, str] = result["namespace"]["final"]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for op in ops:
        by_name.setdefault(op["name"], []).append(op)
    lost: list[str] = []
    for name, history in by_name.items():
        created = any(op["kind"] == "create" and op["ok"] for op in history)
        removals = [op for op in history if op["kind"] == "remove"]
        if created and len(removals) == 1 and removals[0].get("errno") == errno.ENOENT:
            lost.append(f"{name}: its only remove failed 'no such file': it ran twice, or the create was lost")
        if any(op["ok"] for op in removals):
            if name in final:
                lost.append(f"{name}: its remove was acknowledged, it is still there")
        elif created and not removals:
            if name not in final:
                lost.append(f"{name}: its create was acknowledged, it is gone")
            elif final[name] != name:
                lost.append(f"{name}: holds {final[name][:40]!r}, not its name")
    lost += [f"{name}: there, never created" for name in final if name not in by_name]
    return {"namespace_operations": len(ops), "namespace_acknowledged": sum(1 for op in ops if op["ok"]),
            "namespace_failed": sum(1 for op in ops if not op["ok"]), "namespace_lost": lost,
            "namespace_worst_stall_s": max((op["complete"] - op["invoke"] for op in ops if op["ok"]), default=0.0)}

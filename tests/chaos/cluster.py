"""The docker-compose topology on network-namespace hosts, with faults and the after-run checks.

Each compose service is a host (its own namespace and address); services get the environment the
compose file gives them, with service names replaced by host addresses and data directories by
ones under the run's root. Admin commands and client workloads run on the ``client`` host.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
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
from tests.chaos.topology import ROOT, SERVER_SERVICES, load_compose, service_address

__all__ = ["LabCluster", "check_history"]


class LabCluster:
    def __init__(self, lab: NetnsLab, root: Path, overrides: dict[str, str] | None = None,
                 small_disks: dict[str, int] | None = None, ext4_disks: dict[str, int] | None = None,
                 extra_hosts: list[str] | None = None) -> None:
        """``extra_hosts``: more client hosts (training nodes, say), each its own namespace on the same
        switch, whose programs run with the client's settings (:meth:`spawn_client`)."""
        self.lab = lab
        # service -> bytes per target: its targets live on tmpfs mounts of this size (disk-full
        # drills) or on ext4 loop images (disks that turn read-only).
        self.small_disks = small_disks or {}
        self.ext4_disks = ext4_disks or {}
        self._root_shared = False
        self.mounts: list[Path] = []
        self.root = root
        # compose requires a token and has no default: every run makes its own.
        self.compose = load_compose({"FS3_TOKEN": secrets.token_hex(16)})
        self.token = self.compose["services"]["mgmtd"]["environment"]["FS3_MGMTD_TOKEN"]
        self.overrides = overrides or {}
        addresses = lab.create([*SERVER_SERVICES, "client", *(extra_hosts or [])])
        self.addresses: dict[str, str] = {}
        for name in SERVER_SERVICES:
            compose_address = service_address(self.compose, name)
            self.addresses[compose_address] = f"{addresses[name]}:{compose_address.split(':')[1]}"
        self.mgmtd = self.addresses[service_address(self.compose, "mgmtd")]
        self.procs: dict[str, ServiceProcess] = {}
        self.base_env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:"
                         f"{os.environ['PATH']}"}

    def _localize(self, name: str, value: str) -> str:
        for address, local in self.addresses.items():
            value = value.replace(address, local)
        return value.replace("/data", str(self.root / name)).replace("/certs", str(self.root / "certs"))

    def make_certs(self) -> None:
        """What the compose file's certs service does, by the same command, each node's certificate
        also naming its host's address (hosts here dial each other by address, not by name)."""
        command = [self._localize("certs", arg) for arg in self.compose["services"]["certs"]["command"]]
        command += [arg for name in SERVER_SERVICES for arg in ("--node", f"{name}={self.lab.address(name)}")]
        if fs3_main(command) != 0:
            raise RuntimeError(f"making the certificates failed: fs3 {' '.join(command)}")

    @property
    def client_env(self) -> dict[str, str]:
        """What a client host's programs get: the token and the compose client's TLS settings."""
        env = self.compose["services"]["client"]["environment"]
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
        for target in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(target)], check=False)
        self.mounts.clear()
        if self._root_shared:
            subprocess.run(["umount", "-l", str(self.root)], check=False)
            self._root_shared = False

    def start(self, name: str, timeout_s: float = 60) -> None:
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
        for name in SERVER_SERVICES:
            self.start(name)
        setup = self.compose["services"]["setup"]
        done = self.client_run(["sh", "-c", self._localize("setup", setup["command"][0])], timeout_s=120)
        if done.returncode != 0:
            raise RuntimeError(f"setup failed: {done.stdout}{done.stderr}")

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)

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

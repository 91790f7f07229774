"""The file systems ``bench/compare.py`` measures, each started, mounted and torn down on this machine.

Every system keeps three copies of each byte: fs3 (``fs3 local``: 3 storage processes, chains of 3),
GlusterFS (a replica-3 volume of three bricks) and MooseFS (three chunkservers, goal 3). The local
directory is the limit. Nothing is started by a service manager: each daemon is started directly,
its files live under the run's directory, and :meth:`System.stop` kills what it started, unmounts,
and removes network namespaces it made — also after a failed start.

GlusterFS binds to loopback through a copy of ``glusterd.vol``; its CLI refuses 127.0.0.1 as a brick
host but accepts this machine's host name (which resolves to loopback). MooseFS refuses 127.x
between master and chunkservers, so its daemons run in a network namespace of their own with a
private address on a veth pair inside it, and its FUSE client joins that namespace's network only
(``nsenter --net``), so the mount is visible to the rest of the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

__all__ = ["Fs3Mount", "GlusterFS", "LocalDir", "MooseFS", "System", "missing_packages"]

GLUSTER_PACKAGES = ["glusterfs-server", "glusterfs-client"]
MOOSEFS_PACKAGES = ["moosefs-master", "moosefs-chunkserver", "moosefs-client", "moosefs-cli"]


def missing_packages(packages: list[str]) -> list[str]:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${Status}\\n", *packages], capture_output=True,
                         text=True).stdout
    installed = {line.split()[0] for line in out.splitlines() if line.endswith("install ok installed")}
    return [p for p in packages if p not in installed]


def install_packages(packages: list[str]) -> None:
    """apt-get install what is missing (root on Debian); a clear error otherwise."""
    missing = missing_packages(packages)
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError(f"missing packages {missing}: install them (apt-get install {' '.join(missing)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True, env=env,
                   capture_output=True)


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def _is_mount(path: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(path)]).returncode == 0


def _umount(path: Path) -> None:
    if _is_mount(path) and subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _kill_matching(needle: str) -> None:
    """SIGKILL every process whose command line mentions ``needle`` (a path unique to this run)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(proc.name), signal.SIGKILL)


class System:
    """A file system under test: ``start`` returns a mounted directory, ``stop`` undoes everything."""

    name = "system"

    def __init__(self, work: Path) -> None:
        self.work = work / self.name
        self.mnt = self.work / "mnt"

    def start(self) -> Path:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def __enter__(self) -> Path:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalDir(System):
    name = "local"

    def start(self) -> Path:
        self.mnt.mkdir(parents=True, exist_ok=True)
        return self.mnt

    def stop(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def describe(self) -> str:
        fs = subprocess.run(["stat", "-f", "-c", "%T", str(self.work.parent)], capture_output=True,
                            text=True).stdout.strip()
        return f"local directory ({fs}, one copy)"


class Fs3Mount(System):
    """``fs3 local``: mgmtd, meta, 3 storage processes (2 targets each), chains of 3, FUSE mount."""

    name = "fs3"

    def __init__(self, work: Path) -> None:
        super().__init__(work)
        self.cluster: Any = None

    def start(self) -> Path:
        from fs3.cli.local import LocalCluster

        self.cluster = LocalCluster(self.work / "cluster", storage_nodes=3, targets_per_node=2)
        self.cluster.start_all()
        asyncio.run(self.cluster.ensure_chains(3))
        self.cluster.set_mount(self.mnt)
        self.cluster.start("mount")
        return self.mnt

    def native_address(self) -> tuple[str, str]:
        """mgmtd address and token for fs3's native client of the same cluster."""
        return self.cluster.mgmtd_address, self.cluster.token

    def connect(self) -> Any:
        from fs3.client.sync_api import connect

        mgmtd, token = self.native_address()
        return connect(mgmtd, token=token)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop_all()
            self.cluster = None
        _umount(self.mnt)
        shutil.rmtree(self.work, ignore_errors=True)

    def describe(self) -> str:
        return "fs3 (FUSE mount; 3 storage processes, chains of 3)"


class GlusterFS(System):
    """glusterd on loopback, a replica-3 volume of three bricks on this host, the FUSE client."""

    name = "glusterfs"
    volume = "fs3bench"

    def __init__(self, work: Path) -> None:
        super().__init__(work)
        self.host = socket.gethostname()
        self.started = False

    def _gluster(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["gluster", "--mode=script", *args], capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            raise RuntimeError(f"gluster {' '.join(args)}: {done.stdout}{done.stderr}")
        return done

    def start(self) -> Path:
        install_packages(GLUSTER_PACKAGES)
        if subprocess.run(["pgrep", "-x", "glusterd"], capture_output=True).returncode == 0:
            raise RuntimeError("a glusterd is already running on this machine: stop it first")
        self.work.mkdir(parents=True, exist_ok=True)
        state = self.work / "glusterd"
        state.mkdir(exist_ok=True)
        vol = self.work / "glusterd.vol"
        vol.write_text(f"""volume management
    type mgmt/glusterd
    option working-directory {state}
    option transport-type socket
    option transport.socket.keepalive-time 10
    option transport.socket.keepalive-interval 2
    option transport.socket.read-fail-log off
    option transport.socket.listen-port 24007
    option transport.socket.bind-address 127.0.0.1
    option ping-timeout 0
    option event-threads 1
    option max-port 60999
end-volume
""")
        self.started = True
        subprocess.run(["glusterd", "-f", str(vol), "-p", str(self.work / "glusterd.pid"),
                        f"--log-file={self.work / 'glusterd.log'}"], check=True, timeout=60)
        _wait(lambda: self._gluster("peer", "status", check=False).returncode == 0, 30, "glusterd")
        bricks = []
        for i in range(1, 4):
            brick = self.work / f"brick{i}"
            brick.mkdir(exist_ok=True)
            bricks.append(f"{self.host}:{brick}")
        self._gluster("volume", "create", self.volume, "replica", "3", *bricks, "force")
        self._gluster("volume", "start", self.volume)
        self.mnt.mkdir(exist_ok=True)
        subprocess.run(["glusterfs", f"--volfile-server={self.host}", f"--volfile-id={self.volume}",
                        f"--log-file={self.work / 'client.log'}", str(self.mnt)], check=True, timeout=60)
        _wait(lambda: _is_mount(self.mnt), 30, "the GlusterFS mount")
        return self.mnt

    def stop(self) -> None:
        _umount(self.mnt)
        if self.started:
            self._gluster("volume", "stop", self.volume, "force", check=False)
            self._gluster("volume", "delete", self.volume, check=False)
            pidfile = self.work / "glusterd.pid"
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)
            _kill_matching(str(self.work))
            _kill_matching(f"--volfile-id shd/{self.volume}")
            _kill_matching(f"{self.volume}.")  # brick processes name their volfile <volume>.<host>.<brick>
            self.started = False
        shutil.rmtree(self.work, ignore_errors=True)

    def describe(self) -> str:
        version = subprocess.run(["glusterfs", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
        return f"GlusterFS ({version.strip()}; replica-3 volume, 3 bricks, FUSE client)"


class MooseFS(System):
    """mfsmaster and three chunkservers in a private network namespace; goal 3; mfsmount."""

    name = "moosefs"

    def __init__(self, work: Path) -> None:
        super().__init__(work)
        self.namespace = f"fs3mfs-{secrets.token_hex(3)}"
        self.address = ""
        self.procs: list[subprocess.Popen[Any]] = []
        self.ns_created = False

    def _in_ns(self, *args: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.namespace}", *args]

    def _pick_address(self) -> str:
        used = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True,
                              text=True).stdout
        third = next(n for n in range(100, 250) if f"10.214.{n}." not in used)
        return f"10.214.{third}.1"

    def _spawn(self, args: list[str], log: str) -> None:
        with (self.work / log).open("ab") as out:
            self.procs.append(subprocess.Popen(self._in_ns(*args), stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True))

    def start(self) -> Path:
        install_packages(MOOSEFS_PACKAGES)
        self.work.mkdir(parents=True, exist_ok=True)
        self.address = self._pick_address()
        subprocess.run(["ip", "netns", "add", self.namespace], check=True)
        self.ns_created = True
        for cmd in (["link", "set", "lo", "up"], ["link", "add", "mfs0", "type", "veth", "peer", "name", "mfs1"],
                    ["addr", "add", f"{self.address}/24", "dev", "mfs0"], ["link", "set", "mfs0", "up"],
                    ["link", "set", "mfs1", "up"]):
            subprocess.run(["ip", "-n", self.namespace, *cmd], check=True)
        master = self.work / "master"
        master.mkdir(exist_ok=True)
        empty = next((p for p in (Path("/var/lib/mfs/metadata.mfs.empty"),
                                  Path("/usr/share/doc/moosefs-master/metadata.mfs.empty")) if p.exists()), None)
        if empty is not None:
            shutil.copy(empty, master / "metadata.mfs")
        (self.work / "mfsexports.cfg").write_text("*\t/\trw,alldirs,maproot=0\n")
        (self.work / "mfsmaster.cfg").write_text(
            f"WORKING_USER = root\nWORKING_GROUP = root\nDATA_PATH = {master}\n"
            f"EXPORTS_FILENAME = {self.work / 'mfsexports.cfg'}\nSYSLOG_IDENT = fs3bench-mfsmaster\n"
            f"LOCK_MEMORY = 0\n")
        self._spawn(["mfsmaster", "-f", "-c", str(self.work / "mfsmaster.cfg"), "-a"], "master.log")
        for i in range(1, 4):
            data = self.work / f"cs{i}"
            (data / "hdd").mkdir(parents=True, exist_ok=True)
            (data / "mfshdd.cfg").write_text(f"{data / 'hdd'}\n")
            (data / "mfschunkserver.cfg").write_text(
                f"WORKING_USER = root\nWORKING_GROUP = root\nDATA_PATH = {data}\n"
                f"HDD_CONF_FILENAME = {data / 'mfshdd.cfg'}\nMASTER_HOST = {self.address}\n"
                f"CSSERV_LISTEN_PORT = {9421 + i * 10}\nSYSLOG_IDENT = fs3bench-mfscs{i}\n"
                f"HDD_LEAVE_SPACE_DEFAULT = 1GiB\n")
            self._spawn(["mfschunkserver", "-f", "-c", str(data / "mfschunkserver.cfg")], f"cs{i}.log")
        _wait(self._chunkservers_up, 60, "three MooseFS chunkservers")
        self.mnt.mkdir(exist_ok=True)
        subprocess.run(self._in_ns("mfsmount", str(self.mnt), "-H", self.address, "-o", "mfscachemode=AUTO"),
                       check=True, timeout=60, capture_output=True)
        _wait(lambda: _is_mount(self.mnt), 30, "the MooseFS mount")
        done = subprocess.run(self._in_ns("mfssetgoal", "-r", "3", str(self.mnt)), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"mfssetgoal: {done.stdout}{done.stderr}")
        return self.mnt

    def _chunkservers_up(self) -> bool:
        for proc in self.procs:
            if proc.poll() is not None:
                logs = "".join(p.read_text()[-1500:] for p in self.work.glob("*.log"))
                raise RuntimeError(f"a MooseFS daemon exited: {proc.args!r}\n{logs}")
        out = subprocess.run(self._in_ns("mfscli", "-H", self.address, "-SCS", "-s", "|"), capture_output=True,
                             text=True).stdout
        return sum(1 for line in out.splitlines() if line.startswith("chunk servers")) >= 3

    def stop(self) -> None:
        _umount(self.mnt)
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        self.procs.clear()
        _kill_matching(str(self.work))
        if self.ns_created:
            subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)
            self.ns_created = False
        shutil.rmtree(self.work, ignore_errors=True)

    def describe(self) -> str:
        out = subprocess.run(["mfsmaster", "-v"], capture_output=True, text=True)
        version = (out.stdout or out.stderr).strip().splitlines()[:1]
        return f"MooseFS ({version[0] if version else 'version unknown'}; 3 chunkservers, goal 3, mfsmount)"


SYSTEMS: dict[str, type[System]] = {"local": LocalDir, "fs3": Fs3Mount, "glusterfs": GlusterFS,
                                    "moosefs": MooseFS}

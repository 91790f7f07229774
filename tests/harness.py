"""Real-process clusters for tests: mgmtd and storage nodes as `fs3` child processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ProcessCluster", "free_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class _Proc:
    name: str
    args: list[str]
    ready_file: Path
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    info: dict[str, object] = field(default_factory=dict)


class ProcessCluster:
    """mgmtd + N storage nodes (T targets each) under ``root``; every process can be killed and restarted."""

    def __init__(self, root: Path, storage_nodes: int = 3, targets_per_node: int = 2, token: str = "secret",
                 heartbeat_timeout_ms: int = 3_000, heartbeat_interval_ms: int = 200, fsync: bool = False) -> None:
        self.root = root
        self.token = token
        self.env = {**os.environ, "FS3_LOG_LEVEL": os.environ.get("FS3_LOG_LEVEL", "INFO")}
        self.mgmtd_port = free_port()
        self.mgmtd_address = f"127.0.0.1:{self.mgmtd_port}"
        self.procs: dict[str, _Proc] = {}
        mgmtd_dir = root / "mgmtd"
        mgmtd_dir.mkdir(parents=True, exist_ok=True)
        self._add("mgmtd", ["mgmtd", "--data-dir", str(mgmtd_dir), "--framed-port", str(self.mgmtd_port),
                            "--grpc-port", str(free_port()), "--metrics-port", "0",
                            "--heartbeat-timeout-ms", str(heartbeat_timeout_ms), "--token", token])
        for node_id in range(1, storage_nodes + 1):
            node_dir = root / f"storage-{node_id}"
            node_dir.mkdir(parents=True, exist_ok=True)
            targets = "\n".join(
                f'[[targets]]\ntarget_id = {node_id * 100 + j}\npath = "{node_dir / f"target-{j}"}"\n'
                for j in range(1, targets_per_node + 1)
            )
            config = node_dir / "storage.toml"
            config.write_text(
                f'node_id = {node_id}\nmgmtd_address = "{self.mgmtd_address}"\ntoken = "{token}"\n'
                f"heartbeat_interval_ms = {heartbeat_interval_ms}\nforward_timeout_ms = 2000\n"
                f"rpc_timeout_ms = 2000\nfsync = {'true' if fsync else 'false'}\n"
                f"framed_port = {free_port()}\ngrpc_port = {free_port()}\n{targets}"
            )
            self._add(f"storage-{node_id}", ["storage", "--config", str(config)])

    def _add(self, name: str, args: list[str]) -> None:
        self.procs[name] = _Proc(name, args, self.root / f"{name}.ready.json", self.root / f"{name}.log")

    def start(self, name: str, wait: bool = True) -> None:
        proc = self.procs[name]
        proc.ready_file.unlink(missing_ok=True)
        log = proc.log_path.open("ab")
        proc.popen = subprocess.Popen(
            [sys.executable, "-m", "fs3.cli.main", *proc.args, "--ready-file", str(proc.ready_file)],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
        )
        if wait:
            self.wait_ready(name)

    def wait_ready(self, name: str, timeout_s: float = 30) -> dict[str, object]:
        proc = self.procs[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.ready_file.exists():
                proc.info = json.loads(proc.ready_file.read_text())
                return proc.info
            if proc.popen is not None and proc.popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.popen.returncode}:\n{self.log_tail(name)}")
            time.sleep(0.05)
        raise TimeoutError(f"{name} not ready after {timeout_s}s:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.procs[name].log_path
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def address(self, name: str, transport: str = "framed") -> str:
        return str(self.procs[name].info[transport])

    def start_all(self) -> None:
        self.start("mgmtd")
        for name in self.procs:
            if name != "mgmtd":
                self.start(name, wait=False)
        for name in self.procs:
            if name != "mgmtd":
                self.wait_ready(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.popen is not None and proc.popen.poll() is None:
            os.killpg(proc.popen.pid, sig)
            proc.popen.wait(timeout=10)
        proc.popen = None

    def alive(self, name: str) -> bool:
        proc = self.procs[name]
        return proc.popen is not None and proc.popen.poll() is None

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.popen is not None and proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            if proc.popen is None:
                continue
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait(timeout=5)
            proc.popen = None

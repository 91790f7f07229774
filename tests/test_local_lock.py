"""``fs3 local up`` on a running cluster is refused and harms nothing; ``down``/``status`` find every
process the cluster started, and never one that merely reuses a recorded process id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fs3.cli.local import LocalCluster, cluster_lock
from fs3.cluster.processes import pid_alive, process_start_time, read_pid_file, write_pid_file
from fs3.common.errors import InvalidArgument

pytestmark = pytest.mark.slow

SMALL = ("--storage-nodes", "1", "--targets-per-node", "1", "--replicas", "1")


def fs3(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fs3.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_pid_file_names_one_process_not_its_id(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        path = tmp_path / "x.pid"
        write_pid_file(path, sleeper.pid)
        assert read_pid_file(path) == sleeper.pid
        # The same id with another start time: a different process that reuses it.
        start = process_start_time(sleeper.pid)
        assert start is not None
        path.write_text(json.dumps({"pid": sleeper.pid, "start_time": start - 1}))
        assert read_pid_file(path) is None
        path.write_text(json.dumps({"pid": sleeper.pid}))  # no start time: not trusted
        assert read_pid_file(path) is None
        path.write_text('{"pid": ')  # torn
        assert read_pid_file(path) is None
    finally:
        sleeper.kill()
        sleeper.wait()
    write_pid_file(tmp_path / "gone.pid", sleeper.pid)
    assert read_pid_file(tmp_path / "gone.pid") is None


def test_the_directory_lock_refuses_a_second_holder_and_outlives_no_crash(tmp_path: Path) -> None:
    root = tmp_path / "c"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from fs3.cli.local import cluster_lock\n"
         "with cluster_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)", str(root)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(InvalidArgument, match=rf"already running \(pid {holder.pid}: fs3 local up\)"), \
                cluster_lock(root):
            pass
        refused = fs3("local", "up", "--dir", str(root), *SMALL, "--detach")
        assert refused.returncode == 1 and f"already running (pid {holder.pid}" in refused.stderr
        assert not (root / "layout.json").exists(), "a refused up writes nothing"
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: the kernel drops its lock
        holder.wait()
    with cluster_lock(root):
        assert json.loads((root / "lock").read_text())["pid"] == os.getpid()


def test_up_twice_is_refused_and_down_stops_everything(tmp_path: Path) -> None:
    root = tmp_path / "c"
    up = fs3("local", "up", "--dir", str(root), *SMALL, "--detach")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        pids = {name: json.loads((root / f"{name}.pid").read_text())["pid"] for name in ("mgmtd", "meta", "storage-1")}
        again = fs3("local", "up", "--dir", str(root), *SMALL, "--detach")
        assert again.returncode == 1 and "already running" in again.stderr
        assert f"pid {pids['mgmtd']}: mgmtd" in again.stderr and "fs3 local down" in again.stderr
        # The cluster keeps serving, with the same processes.
        assert all(pid_alive(pid) for pid in pids.values())
        nodes = fs3("admin", "--dir", str(root), "--json", "nodes")
        assert nodes.returncode == 0 and all(n["alive"] for n in json.loads(nodes.stdout)), nodes.stderr
        assert fs3("local", "status", "--dir", str(root)).returncode == 0
        start = fs3("local", "start", "meta", "--dir", str(root))
        assert start.returncode == 1 and f"already running (pid {pids['meta']})" in start.stderr
        # The ready files gone (say, removed by hand): the pid files still find every process.
        for name in pids:
            (root / f"{name}.ready.json").unlink()
    finally:
        down = fs3("local", "down", "--dir", str(root))
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(pid) for pid in pids.values()), "down left a process running"
    assert fs3("local", "status", "--dir", str(root)).stdout.count("stopped") == 3


def test_stale_pid_files_after_a_crash_are_neither_signalled_nor_in_the_way(tmp_path: Path) -> None:
    """After a crash (or reboot) the pid files name ids another program may have by now: ``down``
    leaves it alone, ``status`` says stopped and ``up`` starts the cluster."""
    root = tmp_path / "c"
    LocalCluster(root, storage_nodes=1, targets_per_node=1)
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        start = process_start_time(bystander.pid)
        assert start is not None
        for name in ("mgmtd", "meta", "storage-1"):
            (root / f"{name}.pid").write_text(json.dumps({"pid": bystander.pid, "start_time": start + 1}))
        status = fs3("local", "status", "--dir", str(root))
        assert status.returncode == 3 and status.stdout.count("stopped") == 3
        assert fs3("local", "down", "--dir", str(root)).returncode == 0
        assert bystander.poll() is None, "down signalled a process it did not start"
        up = fs3("local", "up", "--dir", str(root), *SMALL, "--detach")
        assert up.returncode == 0, up.stdout + up.stderr
        assert fs3("local", "status", "--dir", str(root)).returncode == 0
        assert fs3("local", "down", "--dir", str(root)).returncode == 0
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        fs3("local", "down", "--dir", str(root))

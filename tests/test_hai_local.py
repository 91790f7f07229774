"""``hai local``: a whole platform on this machine, driven through the ``hai`` command as a user would.

Up with two nodes (in network namespaces, since the tests run as root; as plain processes with
``--no-netns``), both nodes healthy in ``hai nodes``, a two-node job that prints its rank finishes
and its rank logs are on fs3 (``hai logs``), a second ``up`` is refused, and ``down`` leaves no
process and no namespace behind — twice in a row, the second saying nothing runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fs3.cli.local import LocalCluster
from fs3.cli.main import main as fs3_main
from fs3.cluster.netns import netns_usable
from fs3.cluster.processes import pid_alive
from hai.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 60.0
# The ranks meet over TCP at MASTER_ADDR:MASTER_PORT, as a training job's rendezvous does (across the
# namespaces' bridge when there are namespaces), so rank 1 has met rank 0 before either ends.
RANK = """
import os, socket, time
rank, addr, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if rank == 0:
    with socket.create_server((addr, port)) as server:
        server.settimeout(50)
        peer, _ = server.accept()
        peer.sendall(b"0")
        peer.close()
else:
    deadline = time.monotonic() + 50
    while True:
        try:
            with socket.create_connection((addr, port), timeout=5) as conn:
                assert conn.recv(1) == b"0"
            break
        except OSError:
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.1)
# The ranks act on fs3 as their user: a user token (fs3u.<id>.<secret>), never the cluster's.
kind = "user-token" if os.environ.get("FS3_TOKEN", "").startswith("fs3u.") else "NOT-a-user-token"
print("rank", rank, "of", os.environ["WORLD_SIZE"], kind, flush=True)
"""
JOB = """
name = "hello"
command = ["{python}", "{script}"]
nodes = 2
"""


def hai(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``hai ARGS`` run in this process (the processes ``hai local up`` starts are real ones, and
    find this checkout through ``PYTHONPATH``); ``env`` is set for the call only."""
    out, err = io.StringIO(), io.StringIO()
    saved = {key: os.environ.get(key) for key in [*(env or {}), "PYTHONPATH"]}
    os.environ.update({**(env or {}), "PYTHONPATH": str(ROOT)})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(args))
            except SystemExit as exc:
                status = int(exc.code or 0)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return subprocess.CompletedProcess(["hai", *args], status, out.getvalue(), err.getvalue())


def state(root: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / "hai-local.json").read_text())
    return data


def user_env(root: Path, fs3_token_file: Path | None = None) -> dict[str, str]:
    return {"HAI_SERVER": state(root)["server"], "HAI_TOKEN": (root / "hai-admin.token").read_text().strip(),
            "FS3_TOKEN": (fs3_token_file or root / "token").read_text().strip()}


def pids(root: Path) -> list[int]:
    found = []
    for path in root.glob("*.pid"):
        found.append(int(json.loads(path.read_text())["pid"]))
    return found


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "platform"
    yield root
    if (root / "hai-local.json").exists():
        hai("local", "down", "--dir", str(root))


def run_job(root: Path, fs3_token_file: Path | None = None) -> None:
    env = user_env(root, fs3_token_file)
    nodes = hai("nodes", "--json", env=env)
    assert nodes.returncode == 0, nodes.stderr
    assert sorted((n["name"], n["healthy"]) for n in json.loads(nodes.stdout)["nodes"]) == \
        [("node1", True), ("node2", True)]
    job_file = root.parent / "job.toml"
    script = root.parent / "rank.py"
    script.write_text(RANK)
    job_file.write_text(JOB.format(python=sys.executable, script=script))
    submitted = hai("submit", str(job_file), "--json", env=env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job_id"]
    deadline = time.monotonic() + DEADLINE_S
    while True:
        shown = hai("show", job_id, "--json", env=env)
        assert shown.returncode == 0, shown.stderr
        job = json.loads(shown.stdout)
        if job["state"] in ("finished", "failed"):
            break
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']}"
        time.sleep(0.3)
    assert job["state"] == "finished", job
    assert sorted(job["assigned"] or job["chain"][-1]["nodes"]) == ["node1", "node2"]
    for rank in (0, 1):
        # The job ends once both nodes reported; an agent may still be closing its rank's log
        # (on fs3), so it is waited for.
        while True:
            logs = hai("logs", job_id, "--rank", str(rank), "--mgmtd", state(root)["mgmtd"], env=env)
            if logs.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert logs.returncode == 0, logs.stderr
        assert logs.stdout == f"rank {rank} of 2 user-token\n"


def check_down(root: Path) -> None:
    started = pids(root)
    namespaces = state(root)["namespaces"]
    down = hai("local", "down", "--dir", str(root))
    assert down.returncode == 0, down.stderr
    assert "stopped" in down.stdout
    assert started and not [pid for pid in started if pid_alive(pid)]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for ns in namespaces if ns in listed]
    again = hai("local", "down", "--dir", str(root))
    assert again.returncode == 0 and "nothing runs" in again.stdout, again


@pytest.mark.slow
@pytest.mark.skipif(not netns_usable(), reason="network namespaces need root")
def test_up_in_namespaces_runs_a_job_and_down_removes_everything(cluster_dir: Path) -> None:
    up = hai("local", "up", "--dir", str(cluster_dir), "--nodes", "2")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "HAI_SERVER=" in up.stdout and "HAI_TOKEN=$(cat" in up.stdout
    assert (cluster_dir / "hai-admin.token").read_text().strip() not in up.stdout  # never the token itself
    info = state(cluster_dir)
    assert info["netns"] and len(info["namespaces"]) == 2
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(ns in listed for ns in info["namespaces"])
    for k in (1, 2):  # each agent runs inside its node's namespace
        pid = json.loads((cluster_dir / f"hai-agent-{k}.pid").read_text())["pid"]
        inside = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout
        assert inside.strip() == info["namespaces"][k - 1]
    run_job(cluster_dir)
    twice = hai("local", "up", "--dir", str(cluster_dir), "--nodes", "2")
    assert twice.returncode == 2 and "already running" in twice.stderr, twice
    status = hai("local", "status", "--dir", str(cluster_dir))
    assert status.returncode == 0 and status.stdout.count("running") == 6, status.stdout
    check_down(cluster_dir)


@pytest.mark.slow
def test_plain_processes_on_an_fs3_already_running(cluster_dir: Path, tmp_path: Path) -> None:
    """``--no-netns --fs3 MGMTD``: the agents are plain processes, the rank logs go to a cluster
    ``hai local`` did not start, and ``down`` leaves that cluster running."""
    fs3_dir = tmp_path / "fs3"
    started = fs3_main(["local", "up", "--dir", str(fs3_dir), "--storage-nodes", "1", "--targets-per-node", "1",
                        "--replicas", "1", "--detach"])
    assert started == 0
    fs3 = LocalCluster(fs3_dir)
    try:
        mgmtd, token_file = fs3.mgmtd_address, fs3.token_file
        up = hai("local", "up", "--dir", str(cluster_dir), "--nodes", "2", "--no-netns", "--fs3", mgmtd,
                 "--fs3-token-file", str(token_file))
        assert up.returncode == 0, up.stdout + up.stderr
        info = state(cluster_dir)
        assert not info["netns"] and not info["namespaces"] and info["server"].startswith("http://127.0.0.1:")
        assert info["mgmtd"] == mgmtd and not info["with_fs3"]
        run_job(cluster_dir, token_file)
        check_down(cluster_dir)
        assert set(fs3.running()) == {"mgmtd", "storage-1", "meta"}, "not hai local's to stop"
        status = hai("local", "status", "--dir", str(cluster_dir))
        assert status.returncode == 3 and "stopped" in status.stdout
    finally:
        fs3.stop_all()


def test_down_and_status_without_a_cluster(tmp_path: Path) -> None:
    for action in ("down", "status"):
        done = hai("local", action, "--dir", str(tmp_path / "none"))
        assert done.returncode == 2 and "no hai local cluster" in done.stderr, done
    bad = hai("local", "up", "--dir", str(tmp_path / "bad"), "--nodes", "0")
    assert bad.returncode == 2 and "--nodes" in bad.stderr, bad
    no_token = hai("local", "up", "--dir", str(tmp_path / "bad"), "--fs3", "10.0.0.1:9000", env={"FS3_TOKEN": ""})
    assert no_token.returncode == 2 and "token" in no_token.stderr, no_token
    if netns_usable():  # namespaces cannot reach this machine's loopback
        loopback = hai("local", "up", "--dir", str(tmp_path / "bad"), "--fs3", "127.0.0.1:9000",
                       env={"FS3_TOKEN": "x" * 32})
        assert loopback.returncode == 2 and "loopback" in loopback.stderr, loopback
    assert not (tmp_path / "bad" / "hai-local.json").exists() or not state(tmp_path / "bad")["namespaces"]

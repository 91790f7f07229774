"""Operator commands (status, info, df, stats, warmup, rmr) on a real local cluster, and the edges of
the command line: --version, --json after the subcommand, numbers and states in JSON, a closed pipe,
a malformed address, a gRPC port given as the framed one, fs3 mount --dir and a non-empty mount point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fs3 as fs3_lib
from fs3 import common_pb2 as cpb
from fs3.cli.ops import parse_rpc_counters
from fs3.cli.output import message_dict, state_name

SMALL = ("--storage-nodes", "2", "--targets-per-node", "1", "--replicas", "2")


def fs3(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fs3.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


# -- no cluster needed -----------------------------------------------------------------------------


def test_json_has_numbers_and_one_spelling_of_states() -> None:
    target = cpb.TargetInfo(target_id=2**40, node_id=1, public_state=cpb.SERVING, local_state=cpb.LOCAL_OFFLINE,
                            capacity_bytes=2**50)
    data = message_dict(target)
    assert data["target_id"] == 2**40 and data["capacity_bytes"] == 2**50  # numbers, not "1099511627776"
    assert data["public_state"] == "serving" and data["local_state"] == "offline" and data["fenced"] is False
    assert state_name(cpb.NodeType, cpb.NODE_STORAGE) == "storage" and state_name(cpb.PublicState, 0) == "none"
    assert json.loads(json.dumps(message_dict(cpb.ChainInfo(chain_id=3, target_ids=[1, 2]))))["target_ids"] == [1, 2]


def test_rpc_counters_are_read_by_label_whatever_their_name() -> None:
    text = "\n".join([
        "# TYPE fs3_rpc_requests_total counter",
        'fs3_rpc_requests_total{service="Meta",method="Open",status="OK"} 5',
        'fs3_rpc_requests_total{service="Meta",method="Open",status="NOT_FOUND"} 2',
        'fs3_rpc_requests_created{service="Meta",method="Open",status="OK"} 1.7e9',
        "# TYPE fs3_rpc_server_requests_total counter",  # a renamed counter is found the same way
        'fs3_rpc_server_requests_total{method="Read"} 7',
        "# TYPE fs3_rpc_payload_bytes_in_total counter",
        'fs3_rpc_payload_bytes_in_total{method="Read"} 4096',
        "# TYPE fs3_up gauge",
        'fs3_up{method="Open"} 1',
        "",
    ])
    assert parse_rpc_counters(text) == {("Meta", "Open"): 7.0, ("fs3_rpc_server_requests", "Read"): 7.0}


def test_version_bad_address_closed_pipe_and_mountpoint(tmp_path: Path) -> None:
    version = fs3("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"fs3 {fs3_lib.__version__}"
    for bad in ("foo", "foo:bar", "host:0", ":9000"):
        done = fs3("admin", "--mgmtd", bad, "nodes")
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert f"bad mgmtd address {bad!r}: expected HOST:PORT" in done.stderr
    # A reader that went away before the output: no traceback, no "Exception ignored".
    closed = subprocess.Popen([sys.executable, "-m", "fs3.cli.main", "admin", "certs", "init", "--dir",
                               str(tmp_path / "certs"), "--hosts", "a,b,c,d,e,f"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert closed.stdout is not None and closed.stderr is not None
    closed.stdout.close()
    stderr = closed.stderr.read().decode()
    assert closed.wait(60) == 141 and stderr == "", stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    refused = fs3("mount", "127.0.0.1:9", str(busy), "--foreground")
    assert refused.returncode == 1 and "is not empty" in refused.stderr and "--nonempty" in refused.stderr
    assert (busy / "keep.txt").read_text() == "mine"
    neither = fs3("mount", str(tmp_path / "m"))
    assert neither.returncode == 1 and "MGMTD" in neither.stderr and "--dir" in neither.stderr


# -- on a cluster ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("ops") / "c"
    up = fs3("local", "up", "--dir", str(root), *SMALL, "--detach")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield root
    finally:
        fs3("local", "down", "--dir", str(root))


def _connect(root: Path) -> Any:
    info = json.loads((root / "cluster.json").read_text())
    return fs3_lib.connect(info["mgmtd"], token=Path(info["token_file"]).read_text().splitlines()[0])




@pytest.mark.slow
def test_status_df_and_json_after_the_subcommand(cluster: Path) -> None:
    d = ("--dir", str(cluster))
    status = fs3("status", *d)
    assert status.returncode == 0, status.stderr
    assert "nodes     3 (3 up)" in status.stdout and "targets   2 (2 serving)" in status.stdout
    assert "chains    1 (1 fully serving)" in status.stdout
    data = json.loads(fs3("status", *d, "--json", "--sessions").stdout)
    assert data["chains_serving"] == 1 and data["targets_by_state"] == {"serving": 2}
    assert isinstance(data["capacity_bytes"], int) and data["capacity_bytes"] > 0 and data["open_sessions"] == 0
    assert {n["type"] for n in data["nodes"]} == {"storage", "meta"}
    df = json.loads(fs3("df", *d, "--json").stdout)
    assert len(df["targets"]) == 2 and df["total"]["free_bytes"] == sum(t["free_bytes"] for t in df["targets"])
    table = fs3("df", *d).stdout
    assert table.splitlines()[-1].startswith("total") and "GiB" in table
    before = fs3("admin", "--json", *d, "targets")
    after = fs3("admin", *d, "targets", "--json")
    assert before.returncode == after.returncode == 0, after.stderr
    assert [t["target_id"] for t in json.loads(before.stdout)] == [t["target_id"] for t in json.loads(after.stdout)]
    assert {t["public_state"] for t in json.loads(after.stdout)} == {"serving"}
    assert json.loads(fs3("admin", *d, "user", "list", "--json").stdout) == []
    # The gRPC port where the framed one belongs: said plainly.
    info = json.loads((cluster / "cluster.json").read_text())
    grpc_port = fs3("admin", "--mgmtd", info["processes"]["mgmtd"]["grpc"], "--token-file", info["token_file"],
                    "nodes")
    assert grpc_port.returncode == 1 and "is a gRPC port" in grpc_port.stderr and "--transport grpc" in grpc_port.stderr


@pytest.mark.slow
def test_info_warmup_stats_and_rmr(cluster: Path) -> None:
    d = ("--dir", str(cluster))
    with _connect(cluster) as fs:
        fs.makedirs("/ops/tree/deep/er")
        fs.set_layout("/ops", chunk_size=65536)
        fs.write_bytes("/ops/big.bin", os.urandom(200_000))
        for i in range(30):
            fs.write_bytes(f"/ops/tree/f{i}", b"x" * 100)
        fs.write_bytes("/ops/tree/deep/er/last", b"y")
        fs.write_bytes("/keep", b"k")
    info = json.loads(fs3("info", *d, "/ops/big.bin", "--json").stdout)
    assert info["type"] == "file" and info["size"] == 200_000 and info["chunks_total"] == 4
    assert info["layout"]["chunk_size"] == 65536 and len(info["chunks"]) == 4
    for chunk in info["chunks"]:
        assert len(chunk["replicas"]) == 2 and all(r["holds"] for r in chunk["replicas"]), chunk
    assert sum(r["length"] for c in info["chunks"] for r in c["replicas"]) == 2 * 200_000
    assert [c["index"] for c in json.loads(fs3("info", *d, "/ops/big.bin", "--chunks", "1", "--json").stdout)
            ["chunks"]] == [0]
    missing = fs3("info", *d, "/ops/nope")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr and "Traceback" not in missing.stderr
    warm = fs3("warmup", *d, "/ops", "-p", "4", "--json")
    assert warm.returncode == 0, warm.stderr
    assert json.loads(warm.stdout) == {"path": "/ops", "files": 32, "bytes": 200_000 + 30 * 100 + 1,
                                       "failed_count": 0, "failed": []}
    stats = fs3("stats", *d, "--interval-s", "0.5", "--json")
    assert stats.returncode == 0, stats.stderr
    rates = json.loads(stats.stdout)["rates"]
    assert any(r["method"] == "Heartbeat" and r["per_second"] > 0 for r in rates), rates  # mgmtd, from --dir
    refused = fs3("rmr", *d, "/")
    assert refused.returncode == 1 and "--force" in refused.stderr
    for spelled in ("//", "/ops/.."):
        assert fs3("rmr", *d, spelled).returncode == 1
    removed = fs3("rmr", *d, "/ops", "-p", "8", "--json")
    assert removed.returncode == 0, removed.stderr
    assert json.loads(removed.stdout) == {"path": "/ops", "files": 32, "directories": 4}
    with _connect(cluster) as fs:
        assert fs.listdir("/") == ["keep"]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/fuse").exists() or shutil.which("fusermount3") is None, reason="no FUSE")
def test_mount_by_cluster_directory(cluster: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = fs3("mount", "--dir", str(cluster), str(mnt), "--log", str(tmp_path / "mount.log"))
    assert done.returncode == 0, done.stderr
    try:
        (mnt / "via-mount").write_bytes(b"hello")
        with _connect(cluster) as fs:
            assert fs.read_bytes("/via-mount") == b"hello"
            fs.remove("/via-mount")
    finally:
        assert fs3("umount", str(mnt)).returncode == 0


@pytest.mark.slow
def test_a_local_cluster_scrubs_gently_by_default(cluster: Path) -> None:
    """`fs3 local up` turns every target's scrubber on: `fs3 admin scrub status` shows it enabled and,
    once the first pass over the (small) targets ends, a completed pass."""
    import time

    deadline = time.monotonic() + 30
    while True:
        status = fs3("admin", "--dir", str(cluster), "scrub", "status", "--json")
        assert status.returncode == 0, status.stderr
        targets = json.loads(status.stdout)["targets"]
        assert len(targets) == 2 and all(t.get("enabled") for t in targets), targets
        if all(int(t.get("passes_completed", 0)) >= 1 for t in targets):
            break
        assert time.monotonic() < deadline, targets
        time.sleep(0.5)
    table = fs3("admin", "--dir", str(cluster), "scrub", "status").stdout
    assert " off " not in table and "passes" in table

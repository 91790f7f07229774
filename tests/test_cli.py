"""The fs3 command: local cluster lifecycle, admin listings, and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def fs3(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fs3.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_local_cluster_and_admin_commands(tmp_path: Path) -> None:
    root = tmp_path / "c"
    up = fs3("local", "up", "--dir", str(root), "--storage-nodes", "3", "--targets-per-node", "1", "--detach")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        info = json.loads((root / "cluster.json").read_text())
        assert set(info["processes"]) == {"mgmtd", "meta", "storage-1", "storage-2", "storage-3"}
        token = Path(info["token_file"]).read_text().splitlines()[0]
        assert token not in up.stdout + up.stderr and info["token_file"] in up.stdout  # where it is, not what
        base = ["admin", "--mgmtd", info["mgmtd"], "--token-file", info["token_file"]]
        listed = json.loads(fs3(*base, "--json", "nodes").stdout)
        assert [(n["node_type"], n["role"], n["lease_epoch"]) for n in listed if n["node_type"] == "mgmtd"] == [
            ("mgmtd", "primary", 0)]  # a single mgmtd: itself, primary, no lease
        nodes = [n for n in listed if n["node_type"] != "mgmtd"]
        assert len(nodes) == 4 and all(n["alive"] for n in nodes)
        assert sorted(n["node_type"] for n in nodes) == ["meta"] + ["storage"] * 3
        chains = json.loads(fs3(*base, "--json", "chains").stdout)
        assert len(chains["chains"]) == 1 and len(chains["chains"][0]["target_ids"]) == 3
        table = fs3(*base, "targets")
        assert table.returncode == 0 and "serving" in table.stdout and "up_to_date" in table.stdout
        grpc_nodes = fs3("admin", "--mgmtd", info["processes"]["mgmtd"]["grpc"], "--transport", "grpc",
                         "--token-file", info["token_file"], "--json", "nodes")
        assert grpc_nodes.returncode == 0 and len(json.loads(grpc_nodes.stdout)) == 5  # and mgmtd
        import urllib.request

        metrics = urllib.request.urlopen(f"http://{info['processes']['storage-1']['metrics']}/metrics", timeout=5)
        assert b"fs3_rpc_requests_total" in metrics.read()
        # Scrape discovery: every process's endpoint from mgmtd's registry, as Prometheus file_sd JSON.
        sd = fs3(*base, "metrics-targets")
        assert sd.returncode == 0, sd.stderr
        groups = json.loads(sd.stdout)
        assert sorted(g["labels"]["service"] for g in groups) == ["meta", "mgmtd"] + ["storage"] * 3
        assert sorted(g["targets"][0] for g in groups) == sorted(p["metrics"] for p in info["processes"].values())
        sd_file = tmp_path / "sd" / "fs3.json"
        sd_file.parent.mkdir()
        assert fs3(*base, "metrics-targets", "-o", str(sd_file)).returncode == 0
        assert json.loads(sd_file.read_text()) == groups and not list(sd_file.parent.glob("*.tmp"))
        import fs3 as fs3_lib

        with fs3_lib.connect(info["mgmtd"], token=token) as fs:
            fs.makedirs("/data/small")
            fs.write_bytes("/data/a.bin", b"x" * 100_000)
        layout = fs3(*base, "set-layout", "/data/small", "--chunk-size", "65536", "--stripe", "1")
        assert layout.returncode == 0 and "65536 byte chunks" in layout.stdout, layout.stderr
        not_pow2 = fs3(*base, "set-layout", "/data/small", "--chunk-size", "65537")
        assert not_pow2.returncode == 1 and "power of two" in not_pow2.stderr
        by_dir = fs3("admin", "--dir", str(root), "--json", "chains")
        assert by_dir.returncode == 0 and len(json.loads(by_dir.stdout)["chains"]) == 1, by_dir.stderr
        fsck = fs3(*base, "fsck")
        assert fsck.returncode == 0 and "namespace clean" in fsck.stdout, fsck.stdout + fsck.stderr
        report = json.loads(fs3(*base, "--json", "fsck").stdout)
        assert report["problems"] == [] and int(report["inodes"]) == 4 and int(report["chunks"]) == 1
        verify = fs3(*base, "verify")
        assert verify.returncode == 0 and "all replicas identical" in verify.stdout
        # Bad input: clear messages, non-zero exits, nothing changed.
        bad_spec = fs3(*base, "create-chain-table", "--table-id", "2", "--chain", "x:1,2")
        assert bad_spec.returncode == 1 and "bad chain spec" in bad_spec.stderr
        taken = fs3(*base, "create-chain-table", "--table-id", "2", "--chain", "9:101")
        assert taken.returncode == 1 and "already in a chain" in taken.stderr
        unknown = fs3(*base, "mark-offline", "999")
        assert unknown.returncode == 1 and "not registered" in unknown.stderr
        # mark-offline returns once the target is out of its chain; its live node stopped serving it first.
        victim = chains["chains"][0]["target_ids"][-1]
        marked = fs3(*base, "--json", "mark-offline", str(victim))
        assert marked.returncode == 0, marked.stderr
        out = json.loads(marked.stdout)
        assert out["fenced"] and out["public_state"] in ("offline", "waiting", "syncing"), out
        wrong_token = fs3("admin", "--mgmtd", info["mgmtd"], "--token", "nope", "nodes")
        assert wrong_token.returncode == 1 and "UNAUTHENTICATED" in wrong_token.stderr
        assert len(json.loads(fs3(*base, "--json", "chains").stdout)["chains"]) == 1
        bench = fs3("bench", "--native", "--dir", str(root), "--big-file-size", "3M", "--small-file-count", "5",
                    "--threads", "2", "--json")
        assert bench.returncode == 0, bench.stderr
        phases = {p["name"]: p for p in json.loads(bench.stdout)["phases"]}
        assert set(phases) == {"write big file", "read big file", "write small files", "read small files",
                               "stat small files"}
        assert phases["read big file"]["bytes_moved"] == 2 * 3 << 20 and phases["write small files"]["operations"] == 10
        with fs3_lib.connect(info["mgmtd"], token=token) as fs:
            assert fs.listdir("/") == ["data"]  # the benchmark removed its files
        status = fs3("local", "status", "--dir", str(root))
        assert status.returncode == 0 and status.stdout.count("running") == 5
        assert fs3("local", "kill", "storage-3", "--dir", str(root)).returncode == 0
        assert fs3("local", "status", "--dir", str(root)).returncode == 3
    finally:
        down = fs3("local", "down", "--dir", str(root))
    assert down.returncode == 0
    assert fs3("local", "status", "--dir", str(root)).stdout.count("stopped") == 5


def test_cli_errors_without_a_cluster(tmp_path: Path) -> None:
    missing = fs3("local", "status", "--dir", str(tmp_path / "none"))
    assert missing.returncode == 1 and "no local cluster" in missing.stderr
    unreachable = fs3("admin", "--mgmtd", "127.0.0.1:1", "--timeout-ms", "500", "nodes")
    assert unreachable.returncode == 1 and "UNAVAILABLE" in unreachable.stderr
    bad_config = tmp_path / "s.toml"
    bad_config.write_text("node_id = 1\nbogus = 2\n")
    storage = fs3("storage", "--config", str(bad_config))
    assert storage.returncode == 1 and "unknown key" in storage.stderr
    for port in ("70000", "-2", "x"):
        bad_port = fs3("mount", "127.0.0.1:1", str(tmp_path), "--metrics-port", port)
        assert bad_port.returncode == 2 and "not a port number" in bad_port.stderr, bad_port.stderr


def test_bench_on_a_directory_and_bad_input(tmp_path: Path) -> None:
    done = fs3("bench", str(tmp_path), "--big-file-size", "2M", "--block-size", "256K", "--small-file-count", "3",
               "--small-file-size", "4K", "--no-drop-caches")
    assert done.returncode == 0, done.stderr
    for phase in ("write big file", "read big file", "write small files", "read small files", "stat small files"):
        assert phase in done.stdout
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    bad_size = fs3("bench", str(tmp_path), "--big-file-size", "12Q")
    assert bad_size.returncode == 1 and "--big-file-size" in bad_size.stderr and "not a size" in bad_size.stderr
    no_threads = fs3("bench", str(tmp_path), "--threads", "0")
    assert no_threads.returncode == 1 and "threads" in no_threads.stderr
    missing = fs3("bench", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "not a directory" in missing.stderr
    no_target = fs3("bench")
    assert no_target.returncode == 1 and "--native" in no_target.stderr

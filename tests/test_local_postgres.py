"""``fs3 local up --meta-engine postgres``: several meta servers and mgmtd instances on a private
PostgreSQL server under the cluster directory, each of them killed and restarted under a client
that keeps working; the cluster found again by a later ``up``; bad input refused, naming the
database without its password."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import fs3
from fs3.cli.local import LocalCluster
from fs3.client.sync_api import FileSystem
from fs3.cluster.postgres import META_DATABASE, MGMTD_DATABASE, PostgresServerConfig, find_bin_dir
from fs3.cluster.processes import ProcessSettings, process_configs
from fs3.cluster.topology import Topology
from fs3.common.errors import InvalidArgument
from fs3.meta.server import MetaConfig
from fs3.mgmtd.service import MgmtdConfig

SMALL = ("--storage-nodes", "1", "--targets-per-node", "1", "--replicas", "1")
HA = ("--meta-engine", "postgres", "--meta-servers", "2", "--mgmtd-replicas", "2")


def fs3_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fs3.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    """A cluster directory whose processes are stopped at the end, however the test ends."""
    if find_bin_dir() is None:
        pytest.skip("PostgreSQL server binaries not found (/usr/lib/postgresql/<version>/bin): install Debian's "
                    "postgresql package (scripts/bootstrap.sh does)")
    root = tmp_path / "c"
    try:
        yield root
    finally:
        if (root / "layout.json").exists():
            LocalCluster(root).stop_all()


def _primary_mgmtd(root: Path, names: list[str]) -> str:
    """The mgmtd instance that holds the primary lease (its lease epoch gauge is not 0)."""
    for name in names:
        metrics = json.loads((root / f"{name}.ready.json").read_text())["metrics"]
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as rsp:
            text = rsp.read().decode()
        epoch = next(float(line.split()[1]) for line in text.splitlines()
                     if line.startswith("fs3_mgmtd_lease_epoch "))
        if epoch > 0:
            return name
    raise AssertionError(f"no mgmtd of {names} holds the lease")


def _check_files(fs: FileSystem, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        with fs.open(path, "rb") as f:
            assert f.read() == data, path


@pytest.mark.slow
def test_a_postgres_cluster_rides_through_killed_mgmtd_meta_and_postgres_and_restarts(cluster_dir: Path) -> None:
    root = cluster_dir
    _ok(fs3_cli("local", "up", "--dir", str(root), *SMALL, *HA, "--detach"))
    layout = json.loads((root / "layout.json").read_text())
    assert (layout["meta_engine"], layout["meta_servers"], layout["mgmtd_replicas"]) == ("postgres", 2, 2)
    status = fs3_cli("local", "status", "--dir", str(root))
    assert status.returncode == 0, status.stdout
    for name in ("postgres", "mgmtd", "mgmtd-1", "storage-1", "meta", "meta-1"):
        assert f"  {name} " in status.stdout and "stopped" not in status.stdout
    # The password is in the 0600 configs and its own file only: never in layout, status, ready files or logs.
    password = (root / "postgres" / "password").read_text().strip()
    for path in [root / "layout.json", root / "cluster.json", *root.glob("*.ready.json"), *root.glob("*.log")]:
        assert password not in path.read_text(errors="replace"), path
    assert password in (root / "meta-1" / "meta.toml").read_text()
    assert (root / "meta" / "meta.toml").stat().st_mode & 0o077 == 0

    cluster = LocalCluster(root)
    assert len(cluster.mgmtd_addresses) == 2
    files: dict[str, bytes] = {}
    with fs3.connect(cluster.mgmtd_address, token_file=str(cluster.token_file)) as fs:

        def write(path: str, data: bytes) -> None:
            with fs.open(path, "wb") as f:
                f.write(data)
            files[path] = data
            _check_files(fs, files)

        write("/before.bin", b"a" * 70_000)
        # The primary mgmtd dies: a standby takes the lease, storage and the client follow it.
        primary = _primary_mgmtd(root, ["mgmtd", "mgmtd-1"])
        _ok(fs3_cli("local", "kill", primary, "--dir", str(root)))
        write("/after-mgmtd.bin", b"b" * 1000)
        # Each meta server dies in turn (one of them serves this client): the other answers.
        for meta in ("meta", "meta-1"):
            _ok(fs3_cli("local", "kill", meta, "--dir", str(root)))
            write(f"/without-{meta}.bin", meta.encode() * 100)
            _ok(fs3_cli("local", "start", meta, "--dir", str(root)))
        _ok(fs3_cli("local", "start", primary, "--dir", str(root)))
        # PostgreSQL crashes (SIGKILL) and comes back after crash recovery: operations resume.
        _ok(fs3_cli("local", "kill", "postgres", "--dir", str(root)))
        _ok(fs3_cli("local", "start", "postgres", "--dir", str(root)))
        write("/after-postgres.bin", b"c" * 5000)
        fs.mkdir("/dir")
        write("/dir/last.bin", b"d")

    _ok(fs3_cli("local", "down", "--dir", str(root)))
    assert not LocalCluster(root).running()
    # A later up on the same directory, with no flags, restarts the same cluster and finds the data.
    _ok(fs3_cli("local", "up", "--dir", str(root), *SMALL, "--detach"))
    cluster = LocalCluster(root)
    assert set(cluster.running()) == {"postgres", "mgmtd", "mgmtd-1", "storage-1", "meta", "meta-1"}
    with fs3.connect(cluster.mgmtd_address, token_file=str(cluster.token_file)) as fs:
        _check_files(fs, files)
    _ok(fs3_cli("local", "down", "--dir", str(root)))


def test_several_mgmtd_or_meta_need_postgres_and_nothing_is_written(tmp_path: Path) -> None:
    for flags, what in ((("--mgmtd-replicas", "2"), "--mgmtd-replicas 2 needs --meta-engine postgres"),
                        (("--meta-servers", "3"), "--meta-servers 3 needs --meta-engine postgres"),
                        (("--meta-engine", "postgres", "--meta-servers", "0"), "meta servers: 0, expected 1..9")):
        root = tmp_path / "c"
        done = fs3_cli("local", "up", "--dir", str(root), *SMALL, *flags, "--detach")
        assert done.returncode == 1 and what in done.stderr, done.stderr
        assert not (root / "layout.json").exists() and not (root / "token").exists()


def test_an_unreachable_database_fails_up_naming_it_without_its_password(tmp_path: Path) -> None:
    root = tmp_path / "c"
    # Port 1 on this machine: nothing listens there.
    done = fs3_cli("local", "up", "--dir", str(root), *SMALL, "--meta-engine", "postgres",
                   "--pg-url", "postgresql://fs3:sekrit-pw@127.0.0.1:1/fs3db", "--detach")
    assert done.returncode == 1
    assert "cannot connect to PostgreSQL at postgresql://fs3:***@127.0.0.1:1/fs3db" in done.stderr, done.stderr
    assert "sekrit-pw" not in done.stdout + done.stderr
    assert not (root / "layout.json").exists()
    with pytest.raises(InvalidArgument, match="use it with --meta-engine postgres"):
        LocalCluster(root, meta_engine="rocksdb", pg_url="postgresql://u:p@h:5432/db")


def test_process_configs_name_every_instance_and_give_each_engine_its_database(tmp_path: Path) -> None:
    topology = Topology(storage_nodes=1, meta_servers=3, mgmtd_replicas=2)
    assert topology.service_names == ["mgmtd", "mgmtd-1", "storage-1", "meta", "meta-1", "meta-2"]
    settings = ProcessSettings("", meta_engine="postgres", cluster_id="c1", pg_port=5999,
                               pg_password_file=str(tmp_path / "pw"),
                               pg_meta_url=f"postgresql://fs3:s3cr3t@127.0.0.1:5999/{META_DATABASE}",
                               pg_mgmtd_url=f"postgresql://fs3:s3cr3t@127.0.0.1:5999/{MGMTD_DATABASE}")
    configs = process_configs(topology, settings, lambda name: tmp_path / name,
                              lambda node, index: tmp_path / f"{node}-{index}")
    assert [c.name for c in configs] == ["postgres", *topology.service_names]
    server = configs[0].config
    assert isinstance(server, PostgresServerConfig) and server.port == 5999 and not server.fsync
    mgmtds = [c.config for c in configs if isinstance(c.config, MgmtdConfig)]
    assert [(m.kv_engine, m.instance_name, m.cluster_id) for m in mgmtds] == [("postgres", "mgmtd", "c1"),
                                                                                ("postgres", "mgmtd-1", "c1")]
    assert all(m.pg_url.endswith(f"/{MGMTD_DATABASE}") for m in mgmtds)
    for m in mgmtds:
        m.framed_port = 9000
        m.validate()  # the local lease fits mgmtd's rule against the heartbeat timeout
    metas = [c.config for c in configs if isinstance(c.config, MetaConfig)]
    assert [m.node_id for m in metas] == [1001, 1002, 1003]
    assert all(m.kv_engine == "postgres" and m.pg_url.endswith(f"/{META_DATABASE}") for m in metas)
    assert "s3cr3t" not in repr(settings) + repr(server)
    # A server of someone else's: no postgres service.
    external = ProcessSettings("", meta_engine="postgres", pg_meta_url="postgresql://u:p@h:1/m",
                               pg_mgmtd_url="postgresql://u:p@h:1/m_mgmtd")
    names = [c.name for c in process_configs(topology, external, lambda name: tmp_path / name,
                                             lambda node, index: tmp_path / f"{node}-{index}")]
    assert names == topology.service_names
    with pytest.raises(InvalidArgument, match=r"expected 1\.\.9"):
        Topology(mgmtd_replicas=10)


def test_a_local_cluster_remembers_its_engine_counts_ports_and_durability(tmp_path: Path) -> None:
    root = tmp_path / "c"
    made = LocalCluster(root, storage_nodes=1, targets_per_node=1, fsync=True, meta_engine="postgres",
                        meta_servers=2, mgmtd_replicas=3)
    assert list(made.procs) == ["postgres", "mgmtd", "mgmtd-1", "mgmtd-2", "storage-1", "meta", "meta-1"]
    assert len(set(made.mgmtd_addresses)) == 3
    # A later construction (fs3 local start/status/down, a later up) finds the same cluster.
    again = LocalCluster(root)
    assert again.mgmtd_address == made.mgmtd_address and list(again.procs) == list(made.procs)
    assert "--fsync" in again.procs["postgres"].args  # as the cluster was made, whatever this caller says
    assert again.configured_pg_url().endswith(f"/{META_DATABASE}")
    with pytest.raises(InvalidArgument, match="was made with --meta-engine postgres"):
        LocalCluster(root, meta_engine="rocksdb")
    with pytest.raises(InvalidArgument, match="no process 'meta-5'"):
        again.kill("meta-5")
    # A RocksDB cluster's layout and configs carry nothing of the engine.
    plain = LocalCluster(tmp_path / "r", storage_nodes=1, targets_per_node=1)
    assert "postgres" not in plain.procs and "meta_engine" not in json.loads((plain.root / "layout.json").read_text())
    assert "kv_engine" not in (plain.root / "meta" / "meta.toml").read_text()

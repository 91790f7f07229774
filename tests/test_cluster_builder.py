"""fs3.cluster: the topology every cluster builder shares, process configs, and the process launcher."""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from fs3.cluster.processes import (
    ProcessSettings,
    ServiceProcess,
    config_toml,
    fs3_argv,
    pick_port,
    process_configs,
)
from fs3.cluster.topology import META, META_NODE_ID, MGMTD, Topology
from fs3.common.config import load_config
from fs3.common.errors import InvalidArgument, Unavailable
from fs3.meta.server import MetaConfig
from fs3.mgmtd.service import MgmtdConfig
from fs3.storage.server import StorageConfig

PREFIXES = {MgmtdConfig: "FS3_MGMTD", StorageConfig: "FS3_STORAGE", MetaConfig: "FS3_META"}


def test_topology_names_and_ids() -> None:
    topology = Topology(storage_nodes=3, targets_per_node=2, replicas=2)
    assert list(topology.node_ids) == [1, 2, 3]
    assert topology.target_ids(2) == [201, 202] and topology.target_count == 6
    assert all(Topology.node_of(t) == n for n in topology.node_ids for t in topology.target_ids(n))
    assert topology.service_names == [MGMTD, "storage-1", "storage-2", "storage-3", META]
    assert dataclasses.replace(topology, with_meta=False).service_names[-1] == "storage-3"


@pytest.mark.parametrize("bad", [dict(storage_nodes=0), dict(targets_per_node=0), dict(targets_per_node=100),
                                 dict(replicas=0)])
def test_topology_rejects_shapes_it_cannot_name(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        Topology(**bad)


def _configs(tmp_path: Path, **settings: Any) -> list[Any]:
    return process_configs(Topology(storage_nodes=2, targets_per_node=2), ProcessSettings("tok", **settings),
                           lambda name: tmp_path / name, lambda node, index: tmp_path / f"n{node}" / f"t{index}")


def test_process_configs_follow_the_topology(tmp_path: Path) -> None:
    services = _configs(tmp_path, fsync=True, meta_sync_commits=False)
    assert [s.name for s in services] == [MGMTD, "storage-1", "storage-2", META]
    storage = services[2].config
    assert isinstance(storage, StorageConfig) and storage.node_id == 2 and storage.fsync
    assert [(t.target_id, t.path) for t in storage.targets] == [(201, str(tmp_path / "n2" / "t1")),
                                                               (202, str(tmp_path / "n2" / "t2"))]
    meta = services[3].config
    assert isinstance(meta, MetaConfig) and meta.node_id == META_NODE_ID and not meta.sync_commits
    assert all(s.config.token == "tok" for s in services)


def test_config_toml_reads_back_as_the_same_config(tmp_path: Path) -> None:
    for service in _configs(tmp_path):
        path = tmp_path / f"{service.name}.toml"
        path.write_text(config_toml(service.config))
        loaded = load_config(type(service.config), path, env_prefix=PREFIXES[type(service.config)], environ={})
        assert loaded == service.config, service.name


def test_config_toml_writes_only_what_differs_from_the_defaults() -> None:
    assert config_toml(MgmtdConfig()) == "\n"
    assert config_toml(StorageConfig()).splitlines() == ["node_id = 1"]  # named in ``always``
    text = config_toml(StorageConfig(node_id=3, token='a "quoted" token'))
    assert 'token = "a \\"quoted\\" token"' in text


def test_config_toml_refuses_what_it_cannot_write() -> None:
    with pytest.raises(TypeError):
        config_toml(MgmtdConfig)
    with pytest.raises(InvalidArgument):
        config_toml(MgmtdConfig(cluster_id=None))  # type: ignore[arg-type]


# A stand-in for ``fs3 <service>``: writes its ready file (the last argument) and waits.
_FAKE = ("import json, os, sys, time; open(sys.argv[-1], 'w').write(json.dumps({'pid': os.getpid(), "
         "'framed': '127.0.0.1:1'})); time.sleep(60)")


def _spawner(script: str) -> Any:
    def spawn(argv: list[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        assert argv[:4] == fs3_argv([], Path())[:4] and argv[-2] == "--ready-file"
        with log_path.open("ab") as log:
            return subprocess.Popen([sys.executable, "-c", script, argv[-1]], stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(env), start_new_session=True)

    return spawn


def test_service_process_waits_for_its_ready_file_and_kills(tmp_path: Path) -> None:
    proc = ServiceProcess("storage-1", ["storage"], tmp_path / "s.ready.json", tmp_path / "s.log")
    (tmp_path / "s.ready.json").write_text(json.dumps({"pid": 1}))  # an earlier run's: not waited for
    proc.spawn(_spawner(_FAKE), {})
    info = proc.wait_ready(10)
    assert proc.popen is not None and info["pid"] == proc.popen.pid == proc.pid and proc.running
    popen = proc.popen
    proc.kill()
    assert popen.returncode == -signal.SIGKILL and proc.popen is None and not proc.ready_file.exists()


def test_service_process_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    proc = ServiceProcess("meta", ["meta"], tmp_path / "m.ready.json", tmp_path / "m.log")
    proc.spawn(_spawner("print('bad config'); raise SystemExit(2)"), {})
    with pytest.raises(Unavailable, match=r"exited with 2:\n.*bad config"):
        proc.wait_ready(10)


def test_a_ready_file_still_being_written_is_waited_for_not_an_error(tmp_path: Path) -> None:
    """A service writing its ready file in place (the mount does) can be read half-written: that
    is "not ready yet", never a JSON error that leaves the child running unsupervised."""
    torn = ("import json, os, sys, time; path = sys.argv[-1]; f = open(path, 'w'); f.write('{\"pid\": '); "
            "f.flush(); time.sleep(0.5); f.write(json.dumps(os.getpid()) + '}'); f.close(); time.sleep(60)")
    proc = ServiceProcess("mount", ["mount"], tmp_path / "m.ready.json", tmp_path / "m.log")
    proc.spawn(_spawner(torn), {})
    try:
        assert proc.wait_ready(10)["pid"] == proc.pid
    finally:
        proc.kill()


def test_stopping_a_local_cluster_signals_only_the_processes_it_started(tmp_path: Path) -> None:
    """``fs3 local down`` (or ``status``) after the cluster's processes died finds ready files whose
    process ids other programs have by now: one leading its own process group, one not. Neither
    is signalled, and neither stops the rest of the shutdown."""
    from fs3.cli.local import LocalCluster

    root = tmp_path / "cluster"
    cluster = LocalCluster(root, storage_nodes=1, targets_per_node=1)
    leader = subprocess.Popen(["sleep", "60"], start_new_session=True)
    member = subprocess.Popen(["sleep", "60"])  # in this test's process group
    try:
        cluster.procs[META].ready_file.write_text(json.dumps({"pid": member.pid}))
        cluster.procs["storage-1"].ready_file.write_text(json.dumps({"pid": leader.pid}))
        cluster.procs[MGMTD].ready_file.write_text(json.dumps({"pid": leader.pid}))
        again = LocalCluster(root)
        assert all(proc.pid is None for proc in again.procs.values()), "a stranger's pid taken for a service's"
        again.stop_all()
        assert leader.poll() is None and member.poll() is None, "a process the cluster never started was signalled"
        assert not any(proc.ready_file.exists() for proc in again.procs.values())
    finally:
        for stranger in (leader, member):
            stranger.kill()
            stranger.wait()


def test_a_kept_port_is_picked_below_the_ephemeral_range_and_free() -> None:
    """Ports chosen before their service starts and kept across restarts come from below the range
    outgoing connections take their local ports from, so no connection can be holding one later."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = pick_port()
        assert 1024 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when picked
    with pytest.raises(Unavailable, match="no free port"):
        pick_port(attempts=0)

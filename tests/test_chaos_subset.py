"""The deterministic subset of the chaos suite: a few scenarios on network-namespace hosts.

`make chaos` runs every scenario and writes the report; here three short ones (one of them a disk
the kernel turns read-only) run with the same checks: no linearizability violation, no
acknowledged write lost, replicas identical, fsck clean. Two more run the compose file's `ha`
profile (PostgreSQL, three mgmtd, three meta): the primary mgmtd SIGKILLed, and PostgreSQL
SIGKILLed and started again, each under file I/O and metadata operations.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                       reason="network namespaces need root and iproute2"),
]


def _netns_usable() -> bool:
    probe = f"fs3-probe-{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


# "two-faults" (a storage kill during a partition) runs in `make chaos` with the rest of the suite.
@pytest.mark.parametrize("name", ["storage-kill-restart", "partition-from-mgmtd", "disk-read-only"])
def test_scenario_keeps_every_promise(name: str, tmp_path: Path) -> None:
    if not _netns_usable():
        pytest.skip("this machine does not allow creating network namespaces")
    if name == "disk-read-only" and not (Path("/dev/loop-control").exists() and shutil.which("mkfs.ext4")):
        pytest.skip("a read-only disk needs loop devices and mkfs.ext4")
    pytest.importorskip("yaml")
    from tests.chaos.run import run_scenario
    from tests.chaos.scenarios import SCENARIOS

    report = run_scenario(SCENARIOS[name], tmp_path)
    assert report["violations"] == [], report["violations"][:5]
    assert report["lost"] == [], report["lost"][:5]
    assert report["replicas_identical"], report["verify"]
    assert report["fsck_clean"], report["fsck"]
    assert report["acknowledged"] > 1000
    if name == "partition-from-mgmtd":  # no split brain: the cut-off node stops serving within its lease
        assert report["lease"] is not None and report["lease"]["ok"], report["lease"]
    _no_namespaces_left(report["run_id"])


# The other ha scenarios (a meta server killed, PostgreSQL restarted, a meta server cut off from it)
# run in `make chaos`; a PostgreSQL restart under load is also in tests/test_local_postgres.py.
@pytest.mark.parametrize("name", ["ha-mgmtd-primary-kill"])
def test_ha_scenario_keeps_every_promise(name: str, tmp_path: Path) -> None:
    """The `ha` profile: no acknowledged write or metadata operation lost, linearizable, fsck clean,
    clients served after the fault; a killed primary mgmtd replaced within lease + heartbeat timeout."""
    if not _netns_usable():
        pytest.skip("this machine does not allow creating network namespaces")
    pytest.importorskip("yaml")
    from tests.postgres import SKIP_REASON, find_bin_dir

    if find_bin_dir() is None or not shutil.which("setpriv"):
        pytest.skip(SKIP_REASON)
    from tests.chaos.run import run_scenario
    from tests.chaos.scenarios import SCENARIOS

    report = run_scenario(SCENARIOS[name], tmp_path)
    assert report["violations"] == [], report["violations"][:5]
    assert report["lost"] == [], report["lost"][:5]
    assert report["namespace_lost"] == [], report["namespace_lost"][:5]
    assert report["replicas_identical"], report["verify"]
    assert report["fsck_clean"], report["fsck"]
    assert report["continued"], f"acknowledged nothing after the fault: {report['stalled']}"
    assert report["acknowledged"] > 500 and report["namespace_acknowledged"] > 50
    if name == "ha-mgmtd-primary-kill":
        takeover = report["takeover"]
        assert takeover is not None and takeover["ok"], takeover
        assert takeover["new_primary"] != takeover["killed"] and takeover["new_epoch"] > takeover["epoch"]
    _no_namespaces_left(report["run_id"])


def _no_namespaces_left(run_id: str) -> None:
    # Only this run's namespaces: another session on the machine may hold (or make) its own.
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [line.split()[0] for line in listing.splitlines()
            if line.startswith((f"fs3-{run_id}-", f"fs3sw-{run_id}"))]
    assert not left, f"namespaces left behind: {left}"

"""The deterministic subset of the chaos suite: a few scenarios on network-namespace hosts.

`make chaos` runs every scenario and writes the report; here four short ones (one of them a disk
the kernel turns read-only) run with the same checks: no linearizability violation, no
acknowledged write lost, replicas identical, fsck clean.
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


@pytest.mark.parametrize("name", ["storage-kill-restart", "partition-from-mgmtd", "two-faults", "disk-read-only"])
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
    # Only this run's namespaces: another session on the machine may hold (or make) its own.
    run_id = report["run_id"]
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [line.split()[0] for line in listing.splitlines()
            if line.startswith((f"fs3-{run_id}-", f"fs3sw-{run_id}"))]
    assert not left, f"namespaces left behind: {left}"

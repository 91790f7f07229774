"""The trash through a FUSE mount: ``rm`` on the mount sends a file to the trash, ``fs3 trash
list`` names it by its path (the mount removes by directory inode: the listing finds the
directory's path), and ``fs3 trash restore`` brings it back, readable on the mount."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import open_mount, require_fuse

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse on this machine"),
]


def _fs3(cluster: Any, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "fs3.cli.main", *args, "--mgmtd", cluster.mgmtd_address,
                           "--token-file", str(cluster.token_file)], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 0, done.stderr
    return done


def _eventually(check: Any, what: str, timeout_s: float = 10.0) -> None:
    """The mount's kernel caches names for its entry timeout (1 s): a restore by another client
    shows once that passes."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_rm_on_a_mount_goes_to_the_trash_and_restore_brings_it_back(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    require_fuse()
    pytest.importorskip("pyfuse3", reason="the fuse extra is not installed")
    monkeypatch.setenv("FS3_META_SERVICE_TRASH_DAYS", "1")  # meta's trash on, for the cluster's processes
    deep_bytes, top_bytes = os.urandom(300_000), b"top\n"
    with open_mount(tmp_path, chunk_size_bytes=65536) as (cluster, mnt):
        (mnt / "a" / "b").mkdir(parents=True)
        (mnt / "a" / "b" / "deep.bin").write_bytes(deep_bytes)
        (mnt / "top.txt").write_bytes(top_bytes)
        subprocess.run(["rm", str(mnt / "a" / "b" / "deep.bin"), str(mnt / "top.txt")], check=True)
        assert not (mnt / "a" / "b" / "deep.bin").exists() and os.listdir(mnt / "a" / "b") == []

        listed = json.loads(_fs3(cluster, "trash", "list", "--json").stdout)
        by_path = {e["path"]: e for e in listed}
        assert set(by_path) == {"/a/b/deep.bin", "/top.txt"}, listed  # not "<dir N>/deep.bin"
        assert by_path["/a/b/deep.bin"]["size"] == len(deep_bytes)
        table = _fs3(cluster, "trash", "list").stdout
        assert "/a/b/deep.bin" in table and "<dir" not in table

        # The directory renamed on the mount: the entry follows it, and restores there.
        (mnt / "a" / "b").rename(mnt / "a" / "c")
        listed = json.loads(_fs3(cluster, "trash", "list", "--json").stdout)
        entry = next(e for e in listed if e["path"].endswith("/deep.bin"))
        assert entry["path"] == "/a/c/deep.bin", listed
        _fs3(cluster, "trash", "restore", str(entry["id"]))
        restored = mnt / "a" / "c" / "deep.bin"
        _eventually(restored.exists, "the restored file on the mount")
        assert restored.read_bytes() == deep_bytes
        assert [e["path"] for e in json.loads(_fs3(cluster, "trash", "list", "--json").stdout)] == ["/top.txt"]
        # Written again on the mount after its restore: an ordinary file.
        with open(restored, "ab") as f:
            f.write(b"more")
        assert restored.read_bytes() == deep_bytes + b"more"

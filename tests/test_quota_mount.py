"""Quotas through a FUSE mount: EDQUOT from mkdir, create and fsync as the kernel passes them
on, and ``df`` on the mount showing a quota set on the root directory."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import open_mount

pytestmark = [
    pytest.mark.slow,  # processes and a mount
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse on this machine"),
]


def quota(address: str, *argv: str) -> None:
    subprocess.run([sys.executable, "-m", "fs3.cli.main", "quota", *argv, "--mgmtd", address, "--token", "t"],
                   check=True, capture_output=True, timeout=60)


def errno_of(fn: object, *args: object) -> int:
    try:
        fn(*args)  # type: ignore[operator]
    except OSError as exc:
        return exc.errno or 0
    return 0


def test_edquot_and_df_through_the_mount(tmp_path: Path) -> None:
    pytest.importorskip("pyfuse3", reason="the fuse extra is not installed")
    with open_mount(tmp_path) as (cluster, mnt):
        os.mkdir(mnt / "q")
        quota(cluster.mgmtd_address, "set", "/q", "--inodes", "2", "--bytes", "64K")
        os.mkdir(mnt / "q" / "d")
        (mnt / "q" / "f").write_bytes(b"")
        assert errno_of(os.mkdir, mnt / "q" / "e") == errno.EDQUOT
        assert errno_of(os.open, mnt / "q" / "g", os.O_CREAT | os.O_WRONLY) == errno.EDQUOT
        fd = os.open(mnt / "q" / "f", os.O_WRONLY)
        os.write(fd, b"x" * 65536)
        os.fsync(fd)
        os.write(fd, b"y")
        assert errno_of(os.fsync, fd) == errno.EDQUOT
        # close(2) reports it too (the kernel's flush publishes the length); the fd is closed anyway.
        assert errno_of(os.close, fd) == errno.EDQUOT

        quota(cluster.mgmtd_address, "set", "/", "--bytes", "1G", "--inodes", "1000")
        stats = os.statvfs(mnt)
        assert (stats.f_blocks * stats.f_frsize, stats.f_files) == (1 << 30, 1000)
        assert stats.f_ffree == 1000 - 3  # q, q/d and q/f

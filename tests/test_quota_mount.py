"""Quotas through a FUSE mount: EDQUOT from mkdir, create and a write past what the quota has
room for (the handle's byte credit) as the kernel passes them on, two descriptors writing at
once never past the limit, and ``df`` on the mount showing a quota set on the root directory."""

from __future__ import annotations

import errno
import json
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


def quota(address: str, *argv: str) -> str:
    return subprocess.run([sys.executable, "-m", "fs3.cli.main", "quota", *argv, "--mgmtd", address, "--token", "t"],
                          check=True, capture_output=True, timeout=60, text=True).stdout


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
        assert errno_of(os.write, fd, b"y") == errno.EDQUOT  # no credit for it: nothing written
        os.close(fd)
        assert os.stat(mnt / "q" / "f").st_size == 65536

        # Two descriptors writing at once, neither publishing: together never past the limit.
        quota(cluster.mgmtd_address, "set", "/q", "--inodes", "10", "--bytes", "256K")
        fds = [os.open(mnt / "q" / name, os.O_CREAT | os.O_WRONLY, 0o644) for name in ("a", "b")]
        written = [0, 0]
        refused = [False, False]
        for _ in range(200):
            for i, fd in enumerate(fds):
                if not refused[i]:
                    got = errno_of(os.pwrite, fd, b"w" * 5000, written[i])
                    refused[i] = got == errno.EDQUOT
                    assert got in (0, errno.EDQUOT)
                    written[i] += 0 if refused[i] else 5000
            assert sum(written) <= 256 * 1024 - 65536
        assert all(refused)
        for fd in fds:
            os.close(fd)
        used = json.loads(quota(cluster.mgmtd_address, "get", "/q", "--json"))["bytes_used"]
        assert used == 65536 + sum(written) == sum(os.stat(mnt / "q" / n).st_size for n in ("f", "a", "b"))

        quota(cluster.mgmtd_address, "set", "/", "--bytes", "1G", "--inodes", "1000")
        stats = os.statvfs(mnt)
        assert (stats.f_blocks * stats.f_frsize, stats.f_files) == (1 << 30, 1000)
        assert stats.f_ffree == 1000 - 5  # q, q/d, q/f, q/a and q/b

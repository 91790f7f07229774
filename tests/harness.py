"""Real-process clusters for tests: the same launcher as ``fs3 local``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from fs3.cli.local import LocalCluster as ProcessCluster

__all__ = ["ProcessCluster", "free_port", "mounted_cluster", "require_fuse"]


def free_port() -> int:
    """A port that was free a moment ago (benchmarks only; services bind port 0 themselves)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def require_fuse() -> None:
    """Skip the calling test (or fixture) where FUSE mounts cannot run: no /dev/fuse, or no pyfuse3."""
    import pytest

    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")
    pytest.importorskip("pyfuse3", reason="the fuse extra is not installed")


@contextlib.contextmanager
def mounted_cluster(root: Path, token: str = "t", workers: int = 1) -> Iterator[tuple[ProcessCluster, Path]]:
    """mgmtd, meta, three storage nodes with one target each, chains of 3 replicas, and a FUSE
    mount at ``root/mnt``; everything is stopped and the mount lazily unmounted on the way out,
    even when the test failed halfway through starting it."""
    cluster = ProcessCluster(root / "cluster", storage_nodes=3, targets_per_node=1, token=token)
    mnt = root / "mnt"
    try:
        cluster.start_all()
        asyncio.run(cluster.ensure_chains(3))
        cluster.set_mount(mnt, workers=workers)
        cluster.start("mount")
        yield cluster, mnt
    finally:
        cluster.stop_all()
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)

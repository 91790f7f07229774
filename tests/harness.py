"""Real-process clusters for tests: the same launcher as ``fs3 local``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from fs3.cli.local import LocalCluster as ProcessCluster

__all__ = ["ProcessCluster", "free_port", "mounted_cluster", "open_mount", "require_fuse", "test_dir"]


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


@contextlib.contextmanager
def open_mount(root: Path, chunk_size_bytes: int | None = None) -> Iterator[tuple[ProcessCluster, Path]]:
    """:func:`mounted_cluster` whose top directory every user may write in (tests that run as other
    users), with ``chunk_size_bytes`` as the root's layout when given (small chunks: many pieces)."""
    require_fuse()
    with mounted_cluster(root) as (cluster, mnt):
        if chunk_size_bytes is not None:
            subprocess.run([sys.executable, "-m", "fs3.cli.main", "admin", "--mgmtd", cluster.mgmtd_address,
                            "--token", cluster.token, "set-layout", "/", "--chunk-size", str(chunk_size_bytes)],
                           check=True, capture_output=True)
        os.chmod(mnt, 0o777)
        yield cluster, mnt


def test_dir(mnt: Path, name: str) -> Path:
    """A fresh directory of one test on a shared mount."""
    path = mnt / name
    path.mkdir()
    return path


test_dir.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test for pytest to collect

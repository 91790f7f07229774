"""Real-process clusters for tests: the same launcher as ``fs3 local``."""

from __future__ import annotations

import socket

from fs3.cli.local import LocalCluster as ProcessCluster

__all__ = ["ProcessCluster", "free_port"]


def free_port() -> int:
    """A port that was free a moment ago (benchmarks only; services bind port 0 themselves)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

"""Real-process clusters for tests: the same launcher as ``fs3 local``."""

from __future__ import annotations

from fs3.cli.local import LocalCluster as ProcessCluster
from fs3.cli.local import free_port

__all__ = ["ProcessCluster", "free_port"]

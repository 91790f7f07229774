"""fs3: a Python implementation of the Fire-Flyer File System (3FS).

Chain-replicated (CRAQ) chunk storage managed by a cluster manager (mgmtd), a metadata
service on RocksDB, and clients (Python API, FUSE). See docs/architecture.md.

    import fs3
    fs = fs3.connect("127.0.0.1:9000", token="...")
    with fs.open("/data/x.bin", "wb") as f:
        f.write(b"hello")

``fs3.aio.connect`` is the same for asyncio code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["connect"]

if TYPE_CHECKING:
    from fs3.client.sync_api import FileSystem


def connect(mgmtd: str | list[str] | None = None, token: str | None = None, **options: Any) -> FileSystem:
    """Connect to the fs3 cluster whose mgmtd listens at ``mgmtd`` (``HOST:PORT``); blocking API.

    Left out, the cluster and token come from ``$FS3_MGMTD``/``$FS3_TOKEN`` or a profile of
    ``~/.config/fs3/config.toml`` (``profile="NAME"``; see docs/operations.md).
    """
    from fs3.client.sync_api import connect as sync_connect

    return sync_connect(mgmtd, token, **options)

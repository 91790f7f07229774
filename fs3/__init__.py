"""fs3: a Python implementation of the Fire-Flyer File System (3FS).

Chain-replicated (CRAQ) chunk storage managed by a cluster manager (mgmtd), a metadata
service on RocksDB, and clients (Python API, FUSE). See docs/architecture.md.
"""

__version__ = "0.1.0"

"""Key-value storage engines.

:class:`KVStore` is the small ordered-map interface that mgmtd and the storage chunk metadata
use: point reads, ordered range scans and atomic write batches. Engines: ``rocksdb``
(embedded, durable, via rocksdict) and ``mem`` (tests and the simulator). The transactional
interface for the metadata service builds on these engines.
"""

from fs3.kv.store import KVStore, MemKVStore, RocksKVStore, WriteBatch, open_kv

__all__ = ["KVStore", "MemKVStore", "RocksKVStore", "WriteBatch", "open_kv"]

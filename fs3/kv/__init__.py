"""Key-value storage engines.

:class:`KVStore` is the small ordered-map interface that mgmtd and the storage chunk metadata
use: point reads, ordered range scans and atomic write batches. Engines: ``rocksdb``
(embedded, durable, via rocksdict) and ``mem`` (tests and the simulator).

:mod:`fs3.kv.txn` adds serializable optimistic transactions over either engine, with injectable
conflicts and "maybe committed" commits, for the metadata service.
"""

from fs3.kv.store import KVStore, MemKVStore, RocksKVStore, WriteBatch, open_kv
from fs3.kv.txn import OptimisticTxnEngine, Transaction, TxnEngine, TxnFaults, run_transaction

__all__ = [
    "KVStore",
    "MemKVStore",
    "OptimisticTxnEngine",
    "RocksKVStore",
    "Transaction",
    "TxnEngine",
    "TxnFaults",
    "WriteBatch",
    "open_kv",
    "run_transaction",
]

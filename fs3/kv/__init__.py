"""Key-value storage engines.

:mod:`fs3.kv.store`: the small ordered-map interface (:class:`~fs3.kv.store.KVStore`) that mgmtd and
the storage chunk metadata use: point reads, ordered range scans and atomic write batches. Engines:
``rocksdb`` (embedded, durable, via rocksdict) and ``mem`` (tests and the simulator).

:mod:`fs3.kv.txn` adds serializable optimistic transactions over either engine, with injectable
conflicts and "maybe committed" commits, for the metadata service. :mod:`fs3.kv.postgres` runs
the same transactions on PostgreSQL (SERIALIZABLE), for meta servers that share one namespace.
:mod:`fs3.kv.api` holds the interfaces code above the engines depends on
(:class:`~fs3.kv.api.Transaction`, :class:`~fs3.kv.api.TxnEngine`) and nothing else, so importing
it loads no engine: this package imports none of its modules itself.
"""

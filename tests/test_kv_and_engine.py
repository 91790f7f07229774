"""KV stores: atomic batches, scans, crash semantics, durability across reopen."""

from __future__ import annotations

from pathlib import Path

import pytest

from fs3.kv.api import prefix_end
from fs3.kv.store import MemKVStore, RocksKVStore, WriteBatch, open_kv


@pytest.fixture(params=["mem", "rocksdb"])
def kv(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    store = open_kv(request.param, tmp_path / "kv")
    yield store
    store.close()


def test_kv_batches_and_scans(kv) -> None:  # type: ignore[no-untyped-def]
    batch = WriteBatch()
    for key in (b"a/2", b"a/1", b"b/1", b"a/3"):
        batch.put(key, key.upper())
    batch.delete(b"a/3")
    kv.write(batch)
    assert list(kv.scan(b"a/", prefix_end(b"a/"))) == [(b"a/1", b"A/1"), (b"a/2", b"A/2")]
    assert list(kv.scan(b"", limit=1)) == [(b"a/1", b"A/1")]
    assert kv.get(b"a/3") is None and kv.get(b"b/1") == b"B/1"


def test_prefix_end() -> None:
    assert prefix_end(b"ab") == b"ac"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") is None


def test_mem_kv_crash_loses_only_unsynced() -> None:
    kv = MemKVStore()
    durable, loose = WriteBatch(), WriteBatch()
    durable.put(b"k1", b"v1")
    kv.write(durable, sync=True)
    loose.put(b"k2", b"v2")
    kv.write(loose, sync=False)
    kv.crash()
    assert kv.get(b"k1") == b"v1" and kv.get(b"k2") is None


def test_rocksdb_persists_across_reopen(tmp_path: Path) -> None:
    kv = RocksKVStore(tmp_path / "db")
    batch = WriteBatch()
    batch.put(b"x", b"1")
    kv.write(batch)
    kv.close()
    again = RocksKVStore(tmp_path / "db")
    assert again.get(b"x") == b"1"
    again.close()

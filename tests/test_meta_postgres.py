"""Meta on PostgreSQL: its settings, and a real ``fs3 meta`` process serving a cluster from a database."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psycopg
import pytest

import fs3
from fs3.common.errors import InvalidArgument, Unavailable
from fs3.meta.server import MetaConfig
from tests.harness import ProcessCluster


def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect("postgresql://" + url.split("://", 1)[1], autocommit=True) as conn:
        return conn.execute(sql.encode()).fetchall()


@pytest.mark.parametrize("settings, message", [
    ({"kv_engine": "postgres"}, "needs pg_url"),
    ({"kv_engine": "rocksdb", "pg_url": "postgresql://u:p@h/db"}, 'set kv_engine = "postgres"'),
    ({"kv_engine": "sqlite"}, "expected one of rocksdb, mem, postgres"),
    ({"kv_engine": "postgres", "pg_url": "mysql://u:p@h/db"}, "expected postgresql://"),
    ({"kv_engine": "postgres", "pg_url": "postgresql://u:p@h/db", "pg_pool_size_max": 0}, "pool_size_max"),
])
def test_bad_engine_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        MetaConfig(**settings).validate()


def test_the_database_password_is_never_in_the_settings_repr() -> None:
    config = MetaConfig(kv_engine="postgres", pg_url="postgresql://fs3:hunter2@db/fs3")
    config.validate()
    assert "hunter2" not in repr(config)


def test_a_meta_process_serves_the_namespace_from_postgres_and_keeps_it_across_a_restart(
        tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FS3_META_KV_ENGINE", "postgres")
    monkeypatch.setenv("FS3_META_PG_URL", postgres_url)
    cluster = ProcessCluster(tmp_path / "cluster", storage_nodes=1, targets_per_node=1, token="secret")
    try:
        cluster.start_all()
        asyncio.run(cluster.ensure_chains(1))
        fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
        try:
            fs.makedirs("/d/e")
            with fs.open("/d/e/f", "wb"):
                pass
            inode = fs.stat("/d/e/f").st_ino
        finally:
            fs.close()
        assert _rows(postgres_url, "SELECT count(*) FROM fs3_kv")[0][0] > 0
        assert not (tmp_path / "cluster" / "meta" / "kv").exists()  # nothing in the embedded engine
        cluster.kill("meta")
        cluster.start("meta")
        fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
        try:
            assert fs.stat("/d/e/f").st_ino == inode
            assert fs.listdir("/d/e") == ["f"]
        finally:
            fs.close()
        # A meta server of another cluster pointed at this database stops at start, saying why.
        cluster.kill("meta")
        cluster.env["FS3_META_CLUSTER_ID"] = "another"
        with pytest.raises(Unavailable, match="belongs to cluster 'fs3', not 'another'"):
            cluster.start("meta")
    finally:
        cluster.stop_all()

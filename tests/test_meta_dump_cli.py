"""``fs3 admin dump | load | backup`` on a RocksDB meta store named by a meta config."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from fs3.cli.main import main
from fs3.kv.store import RocksKVStore, WriteBatch
from fs3.meta import schema
from fs3.meta.backup import list_backups
from fs3.meta.dump import is_dumped_key
from fs3.meta.formats import META_FORMAT
from tests.test_meta_dump import random_store


def _meta_config(tmp_path: Path, name: str) -> Path:
    config = tmp_path / f"{name}.toml"
    config.write_text(f'data_dir = "{tmp_path / name}"\nkv_engine = "rocksdb"\ncluster_id = "cli-test"\n')
    config.chmod(0o600)
    return config


def _contents(path: Path) -> dict[bytes, bytes]:
    store = RocksKVStore.open_view(path)
    try:
        return dict(store.scan(b""))
    finally:
        store.close()


def test_dump_load_and_backup_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = random_store(random.Random(11), 40)
    source = RocksKVStore(tmp_path / "src" / "kv")
    try:  # the source stays open, as under a running meta: the dump reads a read-only view beside it
        batch = WriteBatch()
        for key, value in data.items():
            batch.put(key, value)
        source.write(batch)
        src, dst = _meta_config(tmp_path, "src"), _meta_config(tmp_path, "dst")
        dump = tmp_path / "out.dump"
        assert main(["admin", "dump", "--meta-config", str(src), "--out", str(dump), "--page-records", "9"]) == 0
        assert dump.stat().st_mode & 0o777 == 0o600
        assert main(["admin", "backup", "--meta-config", str(src), "--backup-dir", str(tmp_path / "b"),
                     "--keep", "1"]) == 0
        assert len(list_backups(tmp_path / "b")) == 1
    finally:
        source.close()
    assert main(["admin", "load", str(dump), "--meta-config", str(dst), "--batch-records", "13"]) == 0
    loaded = _contents(tmp_path / "dst" / "kv")
    expected = {k: v for k, v in data.items() if is_dumped_key(k)}
    next_key = schema.counter_key("next_inode")
    assert loaded[META_FORMAT.record_key]  # the dump's meta format, stamped by the load
    assert {k: v for k, v in loaded.items() if k not in (next_key, META_FORMAT.record_key)} == \
        {k: v for k, v in expected.items() if k != next_key}
    capsys.readouterr()
    # A second load into the now non-empty store is refused, and changes nothing.
    assert main(["admin", "load", str(dump), "--meta-config", str(dst)]) == 1
    assert "not empty" in capsys.readouterr().err
    assert _contents(tmp_path / "dst" / "kv") == loaded


def test_load_of_a_damaged_dump_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.dump"
    bad.write_bytes(b'{"format":"fs3-meta-dump","version":1,"schema":1,"cluster_id":"x","created_ms":0}\n')
    assert main(["admin", "load", str(bad), "--meta-config", str(_meta_config(tmp_path, "dst"))]) == 1
    assert "cut short" in capsys.readouterr().err
    assert _contents(tmp_path / "dst" / "kv") == {}


def test_load_into_a_store_in_use_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _meta_config(tmp_path, "src")
    RocksKVStore(tmp_path / "src" / "kv").close()
    dump = tmp_path / "out.dump"
    assert main(["admin", "dump", "--meta-config", str(src), "--out", str(dump)]) == 0
    dst = _meta_config(tmp_path, "dst")
    held = RocksKVStore(tmp_path / "dst" / "kv")  # as a running meta server holds it
    try:
        capsys.readouterr()
        assert main(["admin", "load", str(dump), "--meta-config", str(dst)]) == 1
        assert "stop it first" in capsys.readouterr().err
    finally:
        held.close()
    assert _contents(tmp_path / "dst" / "kv") == {}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("flag", ["--keep", "--page-records"])
def test_backup_loop_refuses_bad_settings_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  flag: str) -> None:
    """A repeating backup with a setting no backup can use exits at once, not logs it forever."""
    src = _meta_config(tmp_path, "src")
    RocksKVStore(tmp_path / "src" / "kv").close()
    backups = tmp_path / "b"
    assert main(["admin", "backup", "--meta-config", str(src), "--backup-dir", str(backups), flag, "0",
                 "--every-s", "0.05"]) == 1
    assert "at least 1" in capsys.readouterr().err
    assert not backups.exists() or list_backups(backups) == []

"""Today's code on the v1 fixture cluster (tests/fixtures/formats/v1, cut by
scripts/make_format_fixture.py with the release before format records): every store upgrades to
the current format, offline (``fs3 admin upgrade``) or at start; ``--check`` changes no byte; a
started cluster serves every file byte for byte and passes fsck."""

from __future__ import annotations

import asyncio
import hashlib
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

import fs3.aio
from fs3.cli.local import LocalCluster
from fs3.cli.main import main
from fs3.client.meta import path_ref
from fs3.common.formats import FormatRefused
from fs3.kv.store import RocksKVStore
from fs3.kv.txn import OptimisticTxnEngine
from fs3.meta.formats import META_FORMAT_VERSION, open_meta_format
from fs3.mgmtd.formats import MGMTD_FORMAT_VERSION, open_mgmtd_format
from fs3.storage import schema
from fs3.storage.blobs import FileBlobStore
from fs3.storage.chunk_engine import ChunkEngine
from fs3.storage.server import StorageConfig, TargetConfig, open_engines

FIXTURES = Path(__file__).parent / "fixtures" / "formats"
TARGETS = ("storage-1/target-1", "storage-2/target-1")


def extract(name: str, root: Path) -> dict[str, Any]:
    """The fixture's data dirs under ``root`` (checked against its manifest); the manifest."""
    fixture = FIXTURES / name
    manifest: dict[str, Any] = json.loads((fixture / "manifest.json").read_text())
    root.mkdir(parents=True, mode=0o700)
    with tarfile.open(fixture / "cluster.tar.gz") as tar:
        tar.extractall(root, filter="data")
    for entry in manifest["files"]:
        data = (root / entry["path"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["size"], entry["sha256"]), entry["path"]
    return manifest


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_configs(root: Path) -> dict[str, Path]:
    """A config per service for the extracted data dirs (what an operator's would say)."""
    configs = {"mgmtd": root / "mgmtd.toml", "meta": root / "meta.toml", "storage": root / "storage.toml"}
    configs["mgmtd"].write_text(f'data_dir = "{root / "mgmtd"}"\nupgrade_on_start = false\n')
    configs["meta"].write_text(f'node_id = 1001\ndata_dir = "{root / "meta"}"\n\n[service]\nupgrade_on_start = false\n')
    targets = "".join(f'\n[[targets]]\ntarget_id = {101 + 100 * i}\npath = "{root / t}"\n'
                      for i, t in enumerate(TARGETS))
    configs["storage"].write_text(f"node_id = 1\nupgrade_on_start = false\n{targets}")
    for path in configs.values():
        path.chmod(0o600)
    return configs


def test_v1_stores_upgrade_offline_check_changes_nothing_and_upgrade_off_refuses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "v1"
    extract("v1", root)
    configs = write_configs(root)
    before = tree_bytes(root)
    for service in ("mgmtd", "meta", "storage"):
        assert main(["admin", "upgrade", "--config", str(configs[service]), "--check", "--json"]) == 0
    reports = [r for chunk in capsys.readouterr().out.split("]\n") if chunk.strip()
               for r in json.loads(chunk + "]")]
    assert [(r["kind"], r["format"], r["current"]) for r in reports] == [
        ("mgmtd", 1, MGMTD_FORMAT_VERSION), ("meta", 1, META_FORMAT_VERSION),
        ("storage-target", 2, schema.FORMAT_VERSION), ("storage-target", 2, schema.FORMAT_VERSION)]
    assert all(r["pending"] and not r["upgraded"] for r in reports)
    assert tree_bytes(root) == before  # --check wrote nothing, not even RocksDB's own files

    # upgrade_on_start = false: the node refuses the old targets, naming the command that upgrades.
    storage = StorageConfig(node_id=1, upgrade_on_start=False,
                            targets=[TargetConfig(101, str(root / TARGETS[0]))])
    with pytest.raises(FormatRefused, match="fs3 admin upgrade --config"):
        open_engines(storage)
    for service in ("mgmtd", "meta", "storage"):
        assert main(["admin", "upgrade", "--config", str(configs[service])]) == 0
    out = capsys.readouterr().out
    assert out.count("(upgraded)") == 4, out
    engines = open_engines(storage)  # current now: opens with upgrading off
    try:
        assert engines[101].chunk_count > 0 and engines[101].corrupt_records == 0
    finally:
        for engine in engines.values():
            engine.kv.close()
    for service in ("mgmtd", "meta", "storage"):
        assert main(["admin", "upgrade", "--config", str(configs[service]), "--check"]) == 0
    assert "pending" not in capsys.readouterr().out


def test_v1_stores_upgrade_when_opened_by_todays_code(tmp_path: Path) -> None:
    """Each store opened as its service opens it: mgmtd and meta stamped, every chunk record of
    both targets rewritten with its CRC and read back the same as the format-2 decoding."""
    root = tmp_path / "v1"
    extract("v1", root)
    kv = RocksKVStore(root / "mgmtd" / "kv")
    try:
        assert open_mgmtd_format(kv, "mgmtd").migrated
        assert open_mgmtd_format(kv, "mgmtd").found == MGMTD_FORMAT_VERSION
    finally:
        kv.close()

    async def meta() -> None:
        store = RocksKVStore(root / "meta" / "kv")
        try:
            engine = OptimisticTxnEngine(store)
            assert (await open_meta_format(engine, "meta")).migrated
            assert (await open_meta_format(engine, "meta")).found == META_FORMAT_VERSION
        finally:
            store.close()

    asyncio.run(meta())
    for target in TARGETS:
        from fs3.storage.chunk_engine import ChunkState

        store = RocksKVStore(root / target / "meta")
        try:
            old = {k: ChunkState.decode_v2(v) for k, v in store.scan(*schema.prefix_range(schema.CHUNK))}
            engine = ChunkEngine(store, FileBlobStore(root / target / "chunks"))
            assert engine.chunk_count == len(old) > 0 and engine.corrupt_records == 0
            new = {k: ChunkState.decode(v) for k, v in store.scan(*schema.prefix_range(schema.CHUNK))}
            assert new == old
        finally:
            store.close()


@pytest.mark.slow  # a cluster of processes
def test_todays_cluster_on_the_v1_fixture_serves_every_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cluster"
    manifest = extract("v1", root)
    cluster = LocalCluster(root, storage_nodes=2, targets_per_node=1)
    cluster.start_all()  # upgrade_on_start (the default): every store migrates as it opens
    try:
        async def check() -> None:
            await cluster.ensure_chains(replicas=2)
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            try:
                for path, entry in manifest["namespace"].items():
                    if entry["kind"] == "file":
                        data = await fs.read_bytes(path)
                        assert hashlib.sha256(data).hexdigest() == entry["sha256"], path
                    elif entry["kind"] == "symlink":
                        assert await fs.readlink(path) == entry["target"]
                    else:
                        assert await fs.isdir(path)
                    if entry.get("hard_link_of"):
                        assert (await fs.stat(path)).st_ino == (await fs.stat(entry["hard_link_of"])).st_ino
                        assert (await fs.stat(path)).st_nlink == 2
                quota = await fs.metadata.quota_get(path_ref(b"/quota"))
                assert quota.bytes_limit == manifest["namespace"]["/quota"]["quota_bytes"]
                assert quota.inodes_limit == manifest["namespace"]["/quota"]["quota_inodes"]
                assert quota.bytes_used == manifest["namespace"]["/quota/q1"]["size"]
                assert list((await fs.fsck(True)).problems) == []
            finally:
                await fs.close()

        asyncio.run(check())
    finally:
        cluster.stop_all()
    capsys.readouterr()
    for config in (root / "mgmtd" / "mgmtd.toml", root / "meta" / "meta.toml", root / "storage-1" / "storage.toml",
                   root / "storage-2" / "storage.toml"):
        assert main(["admin", "upgrade", "--config", str(config), "--check", "--json"]) == 0
    reports = [r for chunk in capsys.readouterr().out.split("]\n") if chunk.strip() for r in json.loads(chunk + "]")]
    assert [(r["kind"], r["format"], r["pending"]) for r in reports] == [
        ("mgmtd", MGMTD_FORMAT_VERSION, []), ("meta", META_FORMAT_VERSION, []),
        ("storage-target", schema.FORMAT_VERSION, []), ("storage-target", schema.FORMAT_VERSION, [])]

"""Cut a fixture cluster of the current on-disk formats: ``tests/fixtures/formats/<name>/``.

Starts a small local cluster (``fs3 local``: one mgmtd, one meta on RocksDB, two storage nodes
with one target each, two replicas), writes a known namespace — files (one spanning several
chunks), an empty file, directories, a symlink, a hard link, a directory quota — stops it
cleanly and archives every service's data directory (mgmtd, the meta RocksDB, the storage
targets; no configs, service logs, tokens or RocksDB ``LOG`` files) as ``cluster.tar.gz``, with
``manifest.json``: the namespace the test expects back (each path's kind, size, sha256, link
target) and every archived file's size and sha256.

The tests start today's code on the extracted directories (``tests/test_formats_fixture.py``):
every file reads back byte for byte, fsck is clean, every store reports the current format.

Run it with the code whose formats the fixture is to keep, before a format changes::

    PYTHONPATH=$PWD .venv/bin/python scripts/make_format_fixture.py v1

See docs/operations.md, "Upgrading", for when to cut a new one.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import hashlib
import io
import json
import random
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fs3
import fs3.aio
from fs3.cli.local import LocalCluster
from fs3.client.meta import path_ref

#: Small chunks, so a small file spans several of them and the fixture stays small.
CHUNK_BYTES = 16 << 10
#: Data directories archived, relative to the cluster's root (the storage nodes' target dirs below).
SERVICE_DIRS = ("mgmtd", "meta", "storage-1", "storage-2")
#: Files that are not data: configs, process files, RocksDB's text logs (LOG, LOG.old.*). A
#: RocksDB write-ahead log (NNNNNN.log) is data and is kept.
SKIPPED_SUFFIXES = (".toml", ".ready", ".pid")


def namespace() -> dict[str, Any]:
    """The namespace written: path -> ``{"data": bytes}`` (file), ``{"dir"}``, ``{"symlink": target}``,
    ``{"link": existing path}`` (a hard link). Deterministic: the same every run."""
    rng = random.Random(24)
    return {
        "/data": {"dir": True},
        "/data/sub": {"dir": True},
        "/data/empty-dir": {"dir": True},
        "/data/big": {"data": rng.randbytes(3 * CHUNK_BYTES + 123)},  # four chunks
        "/data/small": {"data": b"hello, fs3 format v1\n"},
        "/data/sub/notes": {"data": rng.randbytes(5000)},
        "/data/empty": {"data": b""},
        "/data/link-to-small": {"symlink": "small"},
        "/data/sub/hard": {"link": "/data/small"},
        # Chunks above the targets' inline limit (128 KiB) are blob files: text, so it compresses.
        "/blobs": {"dir": True, "chunk_bytes": 256 << 10},
        "/blobs/large": {"data": b"".join(b"line %06d of a large file\n" % i for i in range(12_000))},
        "/quota": {"dir": True, "quota_bytes": 1 << 20, "quota_inodes": 100},
        "/quota/q1": {"data": rng.randbytes(3000)},
    }


async def write_namespace(cluster: LocalCluster) -> None:
    await cluster.ensure_chains(replicas=2)
    fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
    try:
        for path, spec in namespace().items():
            if spec.get("dir"):
                await fs.mkdir(path)
                if path == "/data" or "chunk_bytes" in spec:
                    await fs.set_layout(path, chunk_size=spec.get("chunk_bytes", CHUNK_BYTES))
                if "quota_bytes" in spec:
                    await fs.metadata.quota_set(path_ref(path.encode()), bytes_limit=spec["quota_bytes"],
                                                inodes_limit=spec["quota_inodes"])
            elif "data" in spec:
                await fs.write_bytes(path, spec["data"])
            elif "symlink" in spec:
                await fs.symlink(spec["symlink"], path)
            else:
                await fs.link(spec["link"], path)
        report = await fs.fsck(True)
        if list(report.problems):
            raise SystemExit(f"fsck of the fresh fixture found problems: {list(report.problems)}")
    finally:
        await fs.close()


def expected_namespace() -> dict[str, dict[str, Any]]:
    """What a reader should find: path -> kind and content digest (JSON-able)."""
    out: dict[str, dict[str, Any]] = {}
    for path, spec in namespace().items():
        if spec.get("dir"):
            out[path] = {"kind": "dir", "chunk_bytes": spec.get("chunk_bytes", CHUNK_BYTES if path == "/data" else 0)}
            if "quota_bytes" in spec:
                out[path].update(quota_bytes=spec["quota_bytes"], quota_inodes=spec["quota_inodes"])
        elif "data" in spec:
            out[path] = {"kind": "file", "size": len(spec["data"]), "sha256": hashlib.sha256(spec["data"]).hexdigest()}
        elif "symlink" in spec:
            out[path] = {"kind": "symlink", "target": spec["symlink"]}
        else:
            data = namespace()[spec["link"]]["data"]
            out[path] = {"kind": "file", "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                         "hard_link_of": spec["link"]}
    return out


def archived(path: Path) -> bool:
    name = path.name
    return not (name.endswith(SKIPPED_SUFFIXES) or name == "LOG" or name.startswith("LOG.old"))


def archive(root: Path, out: Path) -> list[dict[str, Any]]:
    """Every data file under the service dirs into ``out`` (a reproducible .tar.gz); their list."""
    files: list[dict[str, Any]] = []
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for service in SERVICE_DIRS:
            for path in sorted((root / service).rglob("*")):
                rel = path.relative_to(root).as_posix()
                info = tarfile.TarInfo(rel)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                if path.is_dir():
                    info.type, info.mode = tarfile.DIRTYPE, 0o700
                    tar.addfile(info)
                elif path.is_file() and archived(path):
                    data = path.read_bytes()
                    info.size, info.mode = len(data), 0o600
                    tar.addfile(info, io.BytesIO(data))
                    files.append({"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    out.write_bytes(gzip.compress(buffer.getvalue(), compresslevel=9, mtime=0))
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the fixture's name: tests/fixtures/formats/NAME (v1, v2, ...)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "fixtures"
                        / "formats", help="where fixture directories live")
    args = parser.parse_args()
    target = args.out / args.name
    with tempfile.TemporaryDirectory(prefix="fs3-fixture-") as tmp:
        root = Path(tmp) / "cluster"
        cluster = LocalCluster(root, storage_nodes=2, targets_per_node=1, fsync=True)
        cluster.start_all()
        try:
            asyncio.run(write_namespace(cluster))
        finally:
            cluster.stop_all()
        target.mkdir(parents=True, exist_ok=True)
        files = archive(root, target / "cluster.tar.gz")
    manifest = {"fixture": args.name, "fs3_version": getattr(fs3, "__version__", "unknown"),
                "layout": {"storage_nodes": 2, "targets_per_node": 1, "replicas": 2, "meta_engine": "rocksdb",
                           "chunk_bytes": CHUNK_BYTES},
                "namespace": expected_namespace(), "files": files}
    (target / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    size = (target / "cluster.tar.gz").stat().st_size
    print(f"{target}: {len(files)} files, cluster.tar.gz {size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

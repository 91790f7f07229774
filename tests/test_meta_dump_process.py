"""The long backup scenario (``make meta-backup``): real processes, meta on RocksDB.

Files are written; while a client keeps creating, renaming and removing files, ``fs3 admin
backup`` runs three times as a process of its own beside the running meta server (keeping 2);
meta is stopped, its store set aside, the newest backup loaded into an empty one and meta started
again. Every file written before the backups reads back byte for byte, the namespace is fsck
clean, and the only chunk problems are orphans of files made after the dump.
Runs only with ``FS3_META_BACKUP_SCENARIO=1``; ``FS3_META_BACKUP_FILES`` sets the file count.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import fs3.aio
from fs3.client.fs import AsyncFileSystem
from fs3.meta.backup import is_backup_name, list_backups
from fs3.meta.dump import DumpReader
from tests.harness import ProcessCluster

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("FS3_META_BACKUP_SCENARIO"),
                                 reason="the long backup scenario: make meta-backup")]

FILES = int(os.environ.get("FS3_META_BACKUP_FILES", "200"))


def _fs3(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "fs3.cli.main", *args], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


async def _churn(fs: AsyncFileSystem, stop: asyncio.Event) -> int:
    rng, steps, live = random.Random(3), 0, list[str]()
    await fs.mkdir("/churn")
    while not stop.is_set():
        if rng.random() < 0.5 or len(live) < 5:
            live.append(f"/churn/f{steps}")
            await fs.write_bytes(live[-1], b"c" * rng.randrange(1, 5000))
        elif rng.random() < 0.5:
            old = live.pop(rng.randrange(len(live)))
            live.append(f"/churn/r{steps}")
            await fs.rename(old, live[-1])
        else:
            await fs.remove(live.pop(rng.randrange(len(live))))
        steps += 1
    return steps


def test_backups_under_load_then_restore(process_cluster: ProcessCluster, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = process_cluster
    monkeypatch.setenv("FS3_TOKEN", cluster.token)  # for the backups into the cluster (fs3://HOST:PORT/...)
    root = str(cluster.root)
    backups = tmp_path / "backups"
    rng = random.Random(24)
    files = {f"/data/d{i % 10}/f{i}": rng.randbytes(rng.randrange(0, 3 << 20 if i % 17 == 0 else 20_000))
             for i in range(FILES)}

    async def write_and_back_up() -> None:
        await cluster.ensure_chains(replicas=3)
        fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
        try:
            for path, data in files.items():
                await fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                await fs.write_bytes(path, data)
            stop = asyncio.Event()
            churn = asyncio.create_task(_churn(fs, stop))
            try:
                for _ in range(3):
                    await asyncio.sleep(0.5)
                    await asyncio.to_thread(_fs3, "admin", "--dir", root, "backup", "--backup-dir", str(backups),
                                            "--keep", "2", "--page-records", "64")
                    await asyncio.to_thread(_fs3, "admin", "--dir", root, "backup", "--backup-dir",
                                            f"fs3://{cluster.mgmtd_address}/backups/meta", "--keep", "2",
                                            "--page-records", "64")
            finally:
                stop.set()
                assert await churn > 10
            # The backups kept in the cluster itself (fs3:///): the newest two, whole, no temporary file.
            in_fs3 = sorted(await fs.listdir("/backups/meta"))
            assert len(in_fs3) == 2 and all(is_backup_name(n) for n in in_fs3), in_fs3
            for name in in_fs3:
                assert sum(1 for _ in DumpReader().records((await fs.read_bytes(f"/backups/meta/{name}"))
                                                            .splitlines(keepends=True))) > FILES
        finally:
            await fs.close()

    asyncio.run(write_and_back_up())
    kept = list_backups(backups)
    assert len(kept) == 2 and not [p for p in backups.iterdir() if p.name.endswith(".tmp")]

    cluster.kill("meta", signal.SIGTERM)  # waits for it to exit: the store is free
    store = cluster.root / "meta" / "kv"
    store.rename(store.with_name("kv.before-restore"))
    print(_fs3("admin", "--dir", root, "load", str(kept[-1]), "--batch-records", "200"))
    cluster.start("meta")

    async def check() -> None:
        fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
        try:
            for path, data in files.items():
                assert await fs.read_bytes(path) == data, path
            report = await fs.fsck(False)
            assert list(report.problems) == []
            for _ in range(60):  # the chains serve again shortly after the restart
                try:
                    report = await fs.fsck(True)
                    break
                except OSError:
                    await asyncio.sleep(0.5)
            assert all("(orphan)" in p for p in report.problems), list(report.problems)[:5]
        finally:
            await fs.close()

    asyncio.run(check())

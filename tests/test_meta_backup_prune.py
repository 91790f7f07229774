"""Which files a backup run removes from its directory (fs3/meta/backup.py ``backup_to``): never the
backup it has just written, never a temporary file another run is still writing, and the
leftovers of a killed run once nobody has touched them for :data:`TMP_STALE_S`."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

from fs3.meta.backup import TMP_STALE_S, backup_once, list_backups
from tests.test_meta_dump import engine_with, random_store, read_back

_2001_NS = 978_307_200 * 1_000_000_000  # names of 2001: older than today's, newer than 2000's


def test_the_new_backup_is_kept_when_newer_names_are_there(tmp_path: Path) -> None:
    """A clock set back, another host's clock ahead, or a file put there by hand: names sorting after
    the new backup's must not make it the oldest, removed at once (no backup left of today)."""
    engine = engine_with(random_store(random.Random(31), 8))
    future = tmp_path / "fs3-meta-29990101T000000.000Z.dump"
    future.write_bytes(b"not a backup of today")
    path, removed = asyncio.run(backup_once(engine.snapshot, tmp_path, keep=1, cluster_id="c"))
    assert path.is_file() and read_back(path.read_bytes().splitlines(keepends=True))
    assert removed == [future] and list_backups(tmp_path) == [path]


def test_keep_counts_the_new_backup_first(tmp_path: Path) -> None:
    engine = engine_with(random_store(random.Random(32), 8))
    for year in (2998, 2999):
        (tmp_path / f"fs3-meta-{year}0101T000000.000Z.dump").write_bytes(b"x")
    path, _ = asyncio.run(backup_once(engine.snapshot, tmp_path, keep=2, cluster_id="c"))
    assert [p.name for p in list_backups(tmp_path)] == [path.name, "fs3-meta-29990101T000000.000Z.dump"]


def test_a_concurrent_runs_temporary_file_is_left_alone(tmp_path: Path) -> None:
    """Two backup loops into one directory: the one that finishes first must not remove the temporary
    file of the other (older name, still being written); both backups end whole."""
    engine = engine_with(random_store(random.Random(33), 8))
    release = asyncio.Event()
    opened = asyncio.Event()

    async def slow_take() -> Any:
        snap = await engine.snapshot()
        scan = snap.scan

        async def gated(*args: Any, **kwargs: Any) -> Any:
            opened.set()
            await release.wait()
            return await scan(*args, **kwargs)
        snap.scan = gated  # type: ignore[method-assign]
        return snap

    async def main() -> tuple[Path, Path]:
        slow = asyncio.create_task(backup_once(slow_take, tmp_path, 2, "c", now_ns=lambda: _2001_NS))
        await opened.wait()  # its temporary file is made, its snapshot not read yet
        fast, _ = await backup_once(engine.snapshot, tmp_path, 2, "c", now_ns=lambda: _2001_NS + 10**9)
        release.set()
        return (await slow)[0], fast

    slow, fast = asyncio.run(main())
    assert list_backups(tmp_path) == [slow, fast]
    for path in (slow, fast):
        assert read_back(path.read_bytes().splitlines(keepends=True))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_killed_runs_leftover_goes_once_stale(tmp_path: Path) -> None:
    """Whatever its name: a temporary file untouched for TMP_STALE_S is a killed run's; a fresh one
    may be a running writer's."""
    engine = engine_with(random_store(random.Random(34), 5))
    old = tmp_path / "fs3-meta-29990101T000000.000Z.dump.1a2b3c4d.tmp"
    fresh = tmp_path / "fs3-meta-20000101T000000.000Z.dump.tmp"
    for leftover in (old, fresh):
        leftover.write_bytes(b"partial")
    stale_s = time.time() - TMP_STALE_S - 60
    os.utime(old, (stale_s, stale_s))
    path, _ = asyncio.run(backup_once(engine.snapshot, tmp_path, keep=2, cluster_id="c"))
    assert path.is_file() and not old.exists() and fresh.exists()

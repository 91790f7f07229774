"""Crash tests with real processes: meta killed during namespace changes, a storage node during a big write.

Each kill is a power loss too: the killed service keeps its data on CrashFS (``fs3.testing.crashfs``),
which drops everything not synced, because a SIGKILL alone loses nothing the kernel already holds.
Every acknowledged operation must survive, the namespace must check clean with fsck, and a file
written through a storage-node crash must read back byte-exact. Sabotage runs (``FS3_SABOTAGE``)
prove the meta test fails when saved answers are not reused or the store's log is not synced.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import fs3.aio
from fs3.client.fs import AsyncFileSystem
from fs3.common.faults import CRASH_ENV, SABOTAGE_ENV
from tests.harness import ProcessCluster

pytestmark = pytest.mark.slow


def _content(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (1 + i % 5)


def _run_on_cluster(tmp_path: Path, body: Callable[[ProcessCluster, AsyncFileSystem], Awaitable[None]],
                    **options: Any) -> None:
    """A 3-node, 3-replica cluster of real processes (``options`` for ProcessCluster) and one client
    with a long retry budget."""
    cluster = ProcessCluster(tmp_path / "c", storage_nodes=3, targets_per_node=1, token="t", **options)

    async def main() -> None:
        fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token, retry_total_ms=60_000)
        try:
            await body(cluster, fs)
        finally:
            await fs.close()

    try:
        cluster.start_all()
        asyncio.run(cluster.ensure_chains(3))
        asyncio.run(main())
    finally:
        cluster.stop_all()


# -- meta: killed mid-operation, power cut, durability on -------------------------------------------

_WORKERS = 3
_STEPS = 24  # per worker
_CRASH_EVERY = 23  # meta answers between crash-point deaths
_CRASH_POINT_DEATHS = 3  # then one SIGKILL from outside, at a random moment


@dataclass
class _MetaRun:
    """What one run saw: every error an acknowledged-or-retried operation got, and every change
    acknowledged but missing (or different) at the end."""

    violations: list[str] = field(default_factory=list)
    deaths: int = 0
    crash_point_deaths: int = 0
    power_cuts: int = 0
    stop_at_first_violation: bool = False


class _MetaSupervisor:
    """Keeps meta running on its crash disk: whenever meta dies (its crash point, or a kill asked
    for), the disk loses its unsynced writes and meta starts again on what is left."""

    def __init__(self, cluster: ProcessCluster, disk: Any, run: _MetaRun) -> None:
        self.cluster, self.disk, self.run = cluster, disk, run
        self.kill_requested = False
        self.stopped = False

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopped:
            await asyncio.sleep(0.02)
            proc = self.cluster.procs["meta"]
            alive = proc.popen is not None and proc.popen.poll() is None
            if alive and not self.kill_requested:
                continue
            requested = alive  # (dead already: its crash point; a kill asked for waits for the next run)
            await loop.run_in_executor(None, self.cluster.kill, "meta")  # reaps it: nothing of it in flight
            if requested:
                self.kill_requested = False
            self.run.deaths += 1
            if not requested:
                self.run.crash_point_deaths += 1
                if self.run.crash_point_deaths >= _CRASH_POINT_DEATHS:
                    self.cluster.env.pop(CRASH_ENV, None)
            await loop.run_in_executor(None, self.disk.power_cut)
            self.run.power_cuts += 1
            await loop.run_in_executor(None, self.cluster.start, "meta")


def _meta_crash_run(tmp_path: Path, disk: Any, sabotage: str = "", stop_at_first_violation: bool = False) -> _MetaRun:
    """Workers create (exclusively), write, rename, remove, make and remove directories, each in
    its own directory, while meta — its store on the crash disk, every commit synced — is killed
    right after commits that are durable but not yet answered, and once more at a random moment,
    each time followed by a power cut. Every operation must succeed exactly once (each of them
    fails if run twice), and everything acknowledged must be there at the end.

    ``stop_at_first_violation``: a sabotage run, which only has to show that it is noticed."""
    cluster = ProcessCluster(tmp_path / "c", storage_nodes=1, targets_per_node=1, token="t",
                             meta_data_dir=disk.path / "meta", meta_sync_commits=True)
    cluster.env[SABOTAGE_ENV] = sabotage
    cluster.env[CRASH_ENV] = f"meta-answer:{_CRASH_EVERY}"
    run = _MetaRun(stop_at_first_violation=stop_at_first_violation)

    async def main() -> None:
        fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token, retry_total_ms=60_000)
        supervisor = _MetaSupervisor(cluster, disk, run)
        watcher = asyncio.create_task(supervisor.watch())
        try:
            models = await asyncio.gather(*(_meta_worker(fs, k, supervisor, run) for k in range(_WORKERS)))
            supervisor.stopped = True
            await watcher
            if run.violations and run.stop_at_first_violation:
                return
            # One more crash with nothing in flight: everything acknowledged is on the disk.
            cluster.env.pop(CRASH_ENV, None)
            cluster.kill("meta")
            disk.power_cut()
            run.power_cuts += 1
            cluster.start("meta")
            await _check_meta_models(fs, models, run)
        finally:
            supervisor.stopped = True
            await asyncio.gather(watcher, return_exceptions=True)
            await fs.close()

    try:
        cluster.start_all()
        asyncio.run(cluster.ensure_chains(1))
        asyncio.run(main())
    finally:
        cluster.stop_all()
    return run


async def _meta_worker(fs: AsyncFileSystem, worker: int, supervisor: _MetaSupervisor,
                       run: _MetaRun) -> dict[str, bytes | None]:
    """One client task's operations, in order; returns its model (name -> contents, None: a
    directory). Stops at its first error, which it records."""
    base = f"/w{worker}"
    model: dict[str, bytes | None] = {}
    step, what = -1, f"mkdir {base}"
    try:
        await fs.mkdir(base)
        for step in range(_STEPS):
            if run.violations and run.stop_at_first_violation:
                return {}
            if worker == 0 and step == _STEPS // 2:
                supervisor.kill_requested = True  # whatever the others have in flight
            name, data = f"f{step}", _content(worker * 1000 + step)
            what = f"create {name}"
            async with await fs.open(f"{base}/{name}", "xb") as f:  # exclusive: a second run fails
                await f.write(data)
            model[name] = data
            if step % 3 == 0:
                what = f"rename {name}"
                await fs.rename(f"{base}/{name}", f"{base}/r{step}")
                model[f"r{step}"] = model.pop(name)
            if step % 4 == 1:
                what = f"mkdir d{step}"
                await fs.mkdir(f"{base}/d{step}")
                model[f"d{step}"] = None
            if step % 4 == 3 and f"d{step - 2}" in model:
                what = f"rmdir d{step - 2}"
                await fs.rmdir(f"{base}/d{step - 2}")
                del model[f"d{step - 2}"]
            if step % 5 == 4:
                victim = min(n for n, v in model.items() if v is not None)
                what = f"remove {victim}"
                await fs.remove(f"{base}/{victim}")
                del model[victim]
    except Exception as exc:  # an operation acknowledged once must never fail on its retry
        run.violations.append(f"worker {worker} step {step}: {what} failed: {exc!r}")
        return {}
    return model


async def _check_meta_models(fs: AsyncFileSystem, models: list[dict[str, bytes | None]], run: _MetaRun) -> None:
    for worker, model in enumerate(models):
        if not model:
            continue  # it failed (recorded): its model is unknown
        base = f"/w{worker}"
        try:
            names = sorted(await fs.listdir(base))
        except OSError as exc:
            run.violations.append(f"{base} is gone after the power cut: {exc!r}")
            continue
        if names != sorted(model):
            run.violations.append(f"{base} lists {names}, acknowledged {sorted(model)}")
        for name, data in model.items():
            if data is not None and await fs.read_bytes(f"{base}/{name}") != data:
                run.violations.append(f"{base}/{name}: contents differ from what was acknowledged")
    problems = list((await fs.fsck()).problems)
    if problems:
        run.violations.append(f"fsck: {problems}")


def test_sigkill_meta_during_creates_and_renames(tmp_path: Path, crash_disk: Any) -> None:
    run = _meta_crash_run(tmp_path, crash_disk)
    assert run.violations == []
    assert run.crash_point_deaths == _CRASH_POINT_DEATHS and run.deaths == _CRASH_POINT_DEATHS + 1


@pytest.mark.parametrize("sabotage", ["idempotency", "kv-sync"])
def test_the_meta_crash_test_fails_when_a_safeguard_is_off(tmp_path: Path, crash_disk: Any, sabotage: str) -> None:
    """The same run with saved answers never reused, or with the store's log never synced, must
    report violations: proof that the test above can fail."""
    run = _meta_crash_run(tmp_path, crash_disk, sabotage, stop_at_first_violation=True)
    assert run.violations, f"the crash test did not notice {sabotage} sabotage"


def test_sigkill_storage_node_during_a_large_write(tmp_path: Path, crash_disk: Any) -> None:
    """storage-2 keeps its targets on the crash disk, syncing as it should: its kill is a power
    loss too, and the resync must bring back whatever the disk did not keep."""

    async def body(cluster: ProcessCluster, fs: AsyncFileSystem) -> None:
        await _storage_crash(cluster, fs, crash_disk)

    _run_on_cluster(tmp_path, body, fsync=True, storage_data_dirs={2: crash_disk.path / "storage-2"})


async def _storage_crash(cluster: ProcessCluster, fs: AsyncFileSystem, disk: Any) -> None:
    await fs.mkdir("/big")
    await fs.set_layout("/big", chunk_size=1 << 20)
    data = os.urandom(48 << 20)
    piece = 1 << 20
    loop = asyncio.get_running_loop()
    async with await fs.open("/big/file", "wb") as f:
        for offset in range(0, len(data), piece):
            if offset == 12 * piece:
                cluster.kill("storage-2")
                await loop.run_in_executor(None, disk.power_cut)
            if offset == 36 * piece:
                await loop.run_in_executor(None, cluster.start, "storage-2")
            await f.write(data[offset:offset + piece])
    assert (await fs.stat("/big/file")).st_size == len(data)
    assert await fs.read_bytes("/big/file") == data
    assert list((await fs.fsck()).problems) == []

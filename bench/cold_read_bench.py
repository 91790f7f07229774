"""Cold and warm 4 KiB random chunk reads: small reads on the event loop (the placement before)
against small reads on the loop only from the page cache (``small_read_nowait``), in one run.

Two measurements, each alternating the two placements round by round (the order flips every
round) and dropping the page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``: needs root)
before every cold row:

* ``storage``: one storage target (RocksDB + chunk files, as ``fs3 storage`` opens it) behind its
  replica, driven in process with ``--inflight`` reader tasks, each one 4 KiB read at a time at a
  random 4 KiB-aligned offset of a random 1 MiB chunk. Both placements read the same chunk files.
* ``fuse``: two ``fs3 local`` clusters (3 storage processes, chains of 3, a FUSE mount each), one
  per placement (``FS3_STORAGE_REPLICA_SMALL_READ_NOWAIT``), both up for the whole run; fio
  ``--rw=randread --bs=4k --iodepth=16 --ioengine=posixaio`` on a file of ``--fuse-size-mib`` on
  each mount, cold and then warm.

The cold rows are what a workload larger than memory sees; the warm rows check that a read served
from the page cache did not get slower. Reported: IOPS per placement (median of the rounds) and
the ratio nowait / loop per row.

Usage: ``python bench/cold_read_bench.py [--rounds 3] [--seconds 5] [--skip-fuse]``. Writes
``bench/results/coldread-<timestamp>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loop_io_bench import CHAIN, TARGET, Host  # noqa: E402  (the one-target node both benches use)
from bench.results_io import save_result  # noqa: E402
from fs3 import storage_pb2 as spb  # noqa: E402
from fs3.common.checksum import crc32c  # noqa: E402
from fs3.common.ids import chunk_id  # noqa: E402
from fs3.storage.replica import ReplicaConfig, TargetReplica  # noqa: E402
from fs3.storage.server import StorageConfig, TargetConfig, open_engines  # noqa: E402

T = TypeVar("T")
MIB = 1 << 20
CHUNK_SIZE = MIB
READ_BYTES = 4096
PLACEMENTS = {"loop": False, "nowait": True}  # name -> ReplicaConfig.small_read_nowait
# Storage rows only: every small read on the pool, cached or not (what the nowait probe saves a
# warm read from).
POOL_ALL = "pool_all"
NOWAIT_ENV = "FS3_STORAGE_REPLICA_SMALL_READ_NOWAIT"


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _storage_config(root: Path) -> StorageConfig:
    return StorageConfig(node_id=1, fsync=True, targets=[TargetConfig(TARGET, str(root))])


async def _fill(root: Path, chunks: int) -> None:
    engine = open_engines(_storage_config(root))[TARGET]
    host = Host(4)
    replica = TargetReplica(TARGET, engine, host, ReplicaConfig())
    for index in range(chunks):
        body = random.randbytes(CHUNK_SIZE)
        await replica.update(spb.UpdateReq(chain_id=CHAIN, chunk_id=chunk_id(7, index), chain_version=1,
                                           type=spb.WRITE, offset=0, length=len(body), chunk_size=CHUNK_SIZE,
                                           checksum=crc32c(body)), body)
    await replica.stop()
    host.pool.shutdown(wait=True)
    engine.close()


async def _read_row(root: Path, placement: str, chunks: int, seconds: float, inflight: int, io_threads: int,
                    seed: int) -> float:
    """4 KiB reads per second with ``inflight`` readers over the first ``chunks`` chunks."""
    engine = open_engines(_storage_config(root))[TARGET]
    host = Host(io_threads)
    config = ReplicaConfig(offload_read_min_bytes=0) if placement == POOL_ALL \
        else ReplicaConfig(small_read_nowait=PLACEMENTS[placement])
    replica = TargetReplica(TARGET, engine, host, config)
    ids = [chunk_id(7, index) for index in range(chunks)]
    reads = 0
    stop = time.monotonic() + seconds

    async def reader(rng: random.Random) -> None:
        nonlocal reads
        while time.monotonic() < stop:
            offset = rng.randrange(0, CHUNK_SIZE, READ_BYTES)
            req = spb.ReadReq(chain_id=CHAIN, chunk_id=rng.choice(ids), offset=offset, length=READ_BYTES)
            _, data = await replica.read(req)
            assert len(data) == READ_BYTES
            reads += 1
            await asyncio.sleep(0)  # the next request arrives through the loop, as from a socket

    started = time.monotonic()
    await asyncio.gather(*(reader(random.Random(seed * 1000 + i)) for i in range(inflight)))
    elapsed = time.monotonic() - started
    await replica.stop()
    host.pool.shutdown(wait=True)
    engine.close()
    return reads / elapsed


def _warm(root: Path) -> None:
    """Read every file under ``root`` once, so the warm rows find the chunks in the page cache (the
    mount opens a file without the kernel's cached pages, so its reads reach the storage service)."""
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                while f.read(MIB):
                    pass


def storage_rows(args: argparse.Namespace, work: Path) -> dict[str, dict[str, list[float]]]:
    root = work / "target"
    asyncio.run(_fill(root, args.chunks))
    rows: dict[str, dict[str, list[float]]] = {"storage_cold": {}, "storage_warm": {}}
    for round_index in range(args.rounds):
        names = [*PLACEMENTS, POOL_ALL]
        order = names if round_index % 2 == 0 else list(reversed(names))
        for name in order:
            drop_caches()
            cold = asyncio.run(_read_row(root, name, args.chunks, args.seconds, args.inflight,
                                         args.io_threads, round_index))
            _warm(root)
            warm = asyncio.run(_read_row(root, name, args.chunks, args.seconds, args.inflight,
                                         args.io_threads, round_index + 100))
            rows["storage_cold"].setdefault(name, []).append(cold)
            rows["storage_warm"].setdefault(name, []).append(warm)
            print(f"round {round_index} {name:7} storage cold {cold:9.0f} warm {warm:9.0f} reads/s", flush=True)
    return rows


def _fio_iops(directory: Path, size_mib: int, seconds: float) -> float:
    done = subprocess.run(
        ["fio", "--name=randread", f"--directory={directory}", "--filename=coldread.dat", "--rw=randread",
         "--bs=4k", "--iodepth=16", "--ioengine=posixaio", f"--size={size_mib}m", "--time_based",
         f"--runtime={seconds:g}", "--output-format=json", "--invalidate=0"],
        capture_output=True, text=True, timeout=seconds + 300, check=True)
    report = json.loads(done.stdout[done.stdout.index("{"):])
    return float(report["jobs"][0]["read"]["iops"])


def fuse_rows(args: argparse.Namespace, work: Path) -> dict[str, dict[str, list[float]]]:
    from fs3.cli.local import LocalCluster

    clusters: dict[str, Any] = {}
    mounts: dict[str, Path] = {}
    rows: dict[str, dict[str, list[float]]] = {"fuse_cold": {}, "fuse_warm": {}}
    try:
        for name, nowait in PLACEMENTS.items():
            cluster = LocalCluster(work / f"cluster-{name}", storage_nodes=3, targets_per_node=2)
            cluster.env[NOWAIT_ENV] = "true" if nowait else "false"
            clusters[name] = cluster
            cluster.start_all()
            asyncio.run(cluster.ensure_chains(3))
            mounts[name] = work / f"mnt-{name}"
            mounts[name].mkdir()
            cluster.set_mount(mounts[name])
            cluster.start("mount")
            with (mounts[name] / "coldread.dat").open("wb") as f:
                for _ in range(args.fuse_size_mib):
                    f.write(random.randbytes(MIB))
        for round_index in range(args.rounds):
            order = list(PLACEMENTS) if round_index % 2 == 0 else list(reversed(PLACEMENTS))
            for name in order:
                drop_caches()
                cold = _fio_iops(mounts[name], args.fuse_size_mib, args.seconds)
                _warm(work / f"cluster-{name}")  # every replica's chunk files in the page cache
                warm = _fio_iops(mounts[name], args.fuse_size_mib, args.seconds)
                rows["fuse_cold"].setdefault(name, []).append(cold)
                rows["fuse_warm"].setdefault(name, []).append(warm)
                print(f"round {round_index} {name:7} fuse cold {cold:9.0f} warm {warm:9.0f} IOPS", flush=True)
    finally:
        for cluster in clusters.values():
            cluster.stop_all()
        for mount in mounts.values():
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=256, help="1 MiB chunks the storage rows read")
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--fuse-size-mib", type=int, default=256)
    parser.add_argument("--skip-storage", action="store_true")
    parser.add_argument("--skip-fuse", action="store_true")
    parser.add_argument("--dir", type=Path, default=None, help="where targets and clusters live (a temp dir)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("dropping the page cache needs root")
    work = Path(tempfile.mkdtemp(prefix="coldread-", dir=args.dir))
    rows: dict[str, dict[str, list[float]]] = {}
    try:
        if not args.skip_storage:
            rows.update(storage_rows(args, work))
        if not args.skip_fuse:
            rows.update(fuse_rows(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {row: {name: statistics.median(values) for name, values in runs.items()} for row, runs in rows.items()}
    ratios = {row: values["nowait"] / max(values["loop"], 1e-6) for row, values in medians.items()}
    print(f"{'row':14} {'loop':>10} {'nowait':>10} {'pool_all':>10} {'nowait/loop':>12}")
    for row, values in medians.items():
        print(f"{row:14} {values['loop']:10.0f} {values['nowait']:10.0f} {values.get(POOL_ALL, 0):10.0f} "
              f"{ratios[row]:12.2f}")
    path = save_result("coldread", {"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows,
                                    "medians": medians, "ratios": ratios})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

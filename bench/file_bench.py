"""Large-file sequential write and read through fs3 (3 replicas), next to the storage level and a local directory.

In one run on this machine:

* local: a file in a temporary directory, written and read with 4 MiB ``os.write``/``os.read``
  (``fsync`` before the write is timed as done, page cache dropped before the read when root);
* storage level: the chunk client alone (no metadata, no files) writing and reading the same
  bytes as 4 MiB chunks on the same 3-replica chains, with the same requests in flight;
* fs3 file: the native client library (``fs3.aio``), 4 MiB ``write`` calls then ``close``, and
  4 MiB ``read`` calls; 4 MiB chunks striped over the chains.

Usage: ``python bench/file_bench.py [--size-mib 1024] [--inflight 8]``.
Writes ``bench/results/file-<timestamp>.json`` and prints the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import save_result  # noqa: E402
from tests.harness import ProcessCluster  # noqa: E402

MIB = 1024 * 1024
PIECE = 4 * MIB


def _drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _local(path: Path, data: memoryview) -> tuple[float, float]:
    start = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    for offset in range(0, len(data), PIECE):
        os.write(fd, data[offset:offset + PIECE])
    os.fsync(fd)
    os.close(fd)
    write_s = time.perf_counter() - start
    _drop_caches()
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    while os.read(fd, PIECE):
        pass
    os.close(fd)
    return write_s, time.perf_counter() - start


async def _storage_level(fs: Any, data: memoryview, inflight: int) -> tuple[float, float]:
    from fs3.common.ids import chunk_id

    layout = await fs.layout("/bench/probe")
    chains = list(layout.chains)
    slots = asyncio.Semaphore(inflight)
    pieces = range(0, len(data), PIECE)

    async def write(i: int, offset: int) -> None:
        async with slots:
            await fs.storage.write(chains[i % len(chains)], chunk_id(1 << 40, i), 0, data[offset:offset + PIECE], PIECE)

    async def read(i: int) -> None:
        async with slots:
            await fs.storage.read(chains[i % len(chains)], chunk_id(1 << 40, i), 0, PIECE)

    start = time.perf_counter()
    await asyncio.gather(*(write(i, offset) for i, offset in enumerate(pieces)))
    write_s = time.perf_counter() - start
    _drop_caches()
    start = time.perf_counter()
    await asyncio.gather(*(read(i) for i in range(len(pieces))))
    read_s = time.perf_counter() - start
    for i in range(len(pieces)):
        await fs.storage.remove(chains[i % len(chains)], chunk_id(1 << 40, i), PIECE)
    return write_s, read_s


async def _file_level(fs: Any, data: memoryview) -> tuple[float, float]:
    start = time.perf_counter()
    async with await fs.open("/bench/big", "wb") as f:
        for offset in range(0, len(data), PIECE):
            await f.write(data[offset:offset + PIECE])
    write_s = time.perf_counter() - start
    _drop_caches()
    start = time.perf_counter()
    async with await fs.open("/bench/big", "rb") as f:
        while await f.read(PIECE):
            pass
    return write_s, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--inflight", type=int, default=8)
    args = parser.parse_args()
    size = args.size_mib * MIB
    data = memoryview(os.urandom(size))
    import uvloop

    import fs3.aio

    with tempfile.TemporaryDirectory(prefix="fs3-file-bench-") as tmp:
        local_w, local_r = _local(Path(tmp) / "local.bin", data)
        (Path(tmp) / "local.bin").unlink()
        cluster = ProcessCluster(Path(tmp) / "cluster", storage_nodes=3, targets_per_node=2)
        try:
            cluster.start_all()
            asyncio.run(cluster.ensure_chains(3))

            async def measure() -> tuple[tuple[float, float], tuple[float, float]]:
                fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token,
                                           inflight_per_file=args.inflight)
                try:
                    await fs.mkdir("/bench")
                    await fs.write_bytes("/bench/probe", b"")
                    # Warm up (connections, first RocksDB and file creations) before timing anything.
                    await fs.write_bytes("/bench/warmup", bytes(data[:64 * MIB]))
                    await fs.read_bytes("/bench/warmup")
                    await fs.remove("/bench/warmup")
                    storage = await _storage_level(fs, data, args.inflight)
                    files = await _file_level(fs, data)
                    return storage, files
                finally:
                    await fs.close()

            storage, files = uvloop.run(measure())
        finally:
            cluster.stop_all()

    def mibps(seconds: float) -> float:
        return float(args.size_mib / seconds)

    result = {
        "size_mib": args.size_mib, "inflight": args.inflight,
        "local": {"write_MiBps": mibps(local_w), "read_MiBps": mibps(local_r)},
        "storage_level_r3": {"write_MiBps": mibps(storage[0]), "read_MiBps": mibps(storage[1])},
        "fs3_file_r3": {"write_MiBps": mibps(files[0]), "read_MiBps": mibps(files[1])},
    }
    print(f"{args.size_mib} MiB sequential, 4 MiB pieces, 3 replicas")
    print(f"{'':<18} {'write MiB/s':>12} {'read MiB/s':>11}")
    for name in ("local", "storage_level_r3", "fs3_file_r3"):
        values = result[name]
        assert isinstance(values, dict)
        print(f"{name:<18} {values['write_MiBps']:>12.1f} {values['read_MiBps']:>11.1f}")
    ratios = {
        "file_vs_storage_write": storage[0] / files[0], "file_vs_storage_read": storage[1] / files[1],
        "file_vs_local_write": local_w / files[0], "file_vs_local_read": local_r / files[1],
    }
    result["ratios"] = ratios
    for name, value in ratios.items():
        print(f"  {name}: {value:.3f}")
    path = save_result("file", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fio on the fs3 FUSE mount next to the same jobs on a local directory, in one run.

Jobs: 1 MiB sequential write and read (numjobs 1 and 4), 4 KiB random read (iodepth 16, numjobs 1
and 4). fs3 runs as a local cluster (mgmtd, meta, 3 storage processes, 3 replicas) mounted with
`fs3 local up --mount`; the page cache is dropped between the write and read phases (as root).

Usage: ``python bench/fuse_bench.py [--size-mib 256] [--runtime-s 10]``.
Writes ``bench/results/fuse-<timestamp>.json`` and prints MiB/s, IOPS and fs3's ratio to local.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import save_result  # noqa: E402
from fs3.cli.local import LocalCluster  # noqa: E402


def _drop_caches() -> None:
    os.sync()
    with contextlib.suppress(OSError):  # not root: caches stay, the read figures flatter both sides
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _fio(directory: Path, name: str, rw: str, bs: str, size_mib: int, numjobs: int, iodepth: int,
         runtime_s: int) -> dict[str, float]:
    args = ["fio", f"--name={name}", f"--directory={directory}", f"--rw={rw}", f"--bs={bs}",
            f"--size={size_mib // numjobs}m", f"--numjobs={numjobs}", f"--iodepth={iodepth}", "--ioengine=psync"
            if iodepth == 1 else "--ioengine=posixaio", "--group_reporting", "--output-format=json",
            f"--runtime={runtime_s}", "--end_fsync=1" if rw.endswith("write") else "--end_fsync=0"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=runtime_s * 10 + 120)
    job = json.loads(out.stdout)["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    return {"MiBps": side["bw_bytes"] / (1 << 20), "iops": side["iops"]}


def _suite(directory: Path, size_mib: int, runtime_s: int) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    for numjobs in (1, 4):
        results[f"seq_write_1m_j{numjobs}"] = _fio(directory, f"seq{numjobs}", "write", "1m", size_mib, numjobs, 1,
                                                   runtime_s)
        _drop_caches()
        results[f"seq_read_1m_j{numjobs}"] = _fio(directory, f"seq{numjobs}", "read", "1m", size_mib, numjobs, 1,
                                                  runtime_s)
        _drop_caches()
        results[f"rand_read_4k_qd16_j{numjobs}"] = _fio(directory, f"seq{numjobs}", "randread", "4k", size_mib,
                                                        numjobs, 16, runtime_s)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--runtime-s", type=int, default=10)
    args = parser.parse_args()
    if not shutil.which("fio"):
        print("fio is not installed (make install adds it on Debian)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="fs3-fuse-bench-") as tmp:
        local_dir = Path(tmp) / "local"
        local_dir.mkdir()
        local = _suite(local_dir, args.size_mib, args.runtime_s)
        shutil.rmtree(local_dir)
        cluster = LocalCluster(Path(tmp) / "cluster", storage_nodes=3, targets_per_node=2)
        try:
            cluster.start_all()
            asyncio.run(cluster.ensure_chains(3))
            cluster.set_mount(Path(tmp) / "mnt")
            cluster.start("mount")
            fs3_dir = Path(tmp) / "mnt" / "bench"
            fs3_dir.mkdir()
            fs3 = _suite(fs3_dir, args.size_mib, args.runtime_s)
        finally:
            cluster.stop_all()
    rows: dict[str, Any] = {}
    print(f"fio, {args.size_mib} MiB per job set; fs3 FUSE mount (3 replicas) vs local directory")
    print(f"{'job':<22} {'fs3':>12} {'local':>12} {'fs3/local':>9}")
    for job, values in fs3.items():
        key = "iops" if job.startswith("rand") else "MiBps"
        ratio = values[key] / local[job][key] if local[job][key] else 0.0
        rows[job] = {"fs3": values, "local": local[job], "ratio": ratio}
        unit = "IOPS" if key == "iops" else "MiB/s"
        print(f"{job:<22} {values[key]:>8.1f} {unit:<5} {local[job][key]:>8.1f} {unit:<5} {ratio:>7.3f}")
    path = save_result("fuse", {"size_mib": args.size_mib, "jobs": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

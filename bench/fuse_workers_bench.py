"""The FUSE mount with one process against the same mount with N data workers, in one run.

Jobs (fio on the mount of a local cluster: 3 storage processes, two targets each, 3 replicas):
1 MiB sequential read with 4 jobs, and 4 KiB random read with 4 jobs at iodepth 16, on files
written once. The mount is restarted with ``--workers 1`` and ``--workers N`` in turn, three
rounds interleaved (the machine is noisy: compare within a round), page cache dropped before every
job; the figure per job is the median over the rounds of N workers / 1 worker.

Usage: ``python bench/fuse_workers_bench.py [--workers 3] [--size-mib 512] [--runtime-s 5] [--rounds 3]``.
Writes ``bench/results/fuse-workers-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import save_result  # noqa: E402
from fs3.cli.local import LocalCluster  # noqa: E402

JOBS = {
    "seq_read_1m_j4": ["--rw=read", "--bs=1m", "--ioengine=psync", "--iodepth=1"],
    "rand_read_4k_qd16_j4": ["--rw=randread", "--bs=4k", "--ioengine=posixaio", "--iodepth=16"],
}


def _drop_caches() -> None:
    os.sync()
    with contextlib.suppress(OSError):  # not root: caches stay, both sides alike
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _fio(directory: Path, args: list[str], size_mib: int, runtime_s: int) -> dict[str, float]:
    cmd = ["fio", "--name=data", f"--directory={directory}", *args, f"--size={size_mib // 4}m", "--numjobs=4",
           "--group_reporting", "--output-format=json", f"--runtime={runtime_s}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=runtime_s * 10 + 120)
    side = json.loads(out.stdout)["jobs"][0]["read"]
    return {"MiBps": side["bw_bytes"] / (1 << 20), "iops": side["iops"]}


def _remount(cluster: LocalCluster, mnt: Path, workers: int) -> None:
    if "mount" in cluster.procs and cluster.procs["mount"].pid:
        cluster.kill("mount", signal.SIGTERM)  # the front unmounts and ends its workers
    cluster.set_mount(mnt, workers=workers)
    cluster.start("mount")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=512, help="all four jobs' files together")
    parser.add_argument("--runtime-s", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not shutil.which("fio"):
        print("fio is not installed (make install adds it on Debian)", file=sys.stderr)
        return 1
    figures: dict[str, dict[int, list[float]]] = {job: {1: [], args.workers: []} for job in JOBS}
    with tempfile.TemporaryDirectory(prefix="fs3-fuse-workers-") as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster", storage_nodes=3, targets_per_node=2)
        mnt = Path(tmp) / "mnt"
        try:
            cluster.start_all()
            asyncio.run(cluster.ensure_chains(3))
            _remount(cluster, mnt, 1)
            data = mnt / "bench"
            data.mkdir()
            subprocess.run(["fio", "--name=data", f"--directory={data}", "--rw=write", "--bs=1m",
                            f"--size={args.size_mib // 4}m", "--numjobs=4", "--end_fsync=1",
                            "--output-format=json"], capture_output=True, check=True, timeout=1800)
            for round_ in range(args.rounds):
                for workers in (1, args.workers) if round_ % 2 == 0 else (args.workers, 1):
                    _remount(cluster, mnt, workers)
                    for job, fio_args in JOBS.items():
                        _drop_caches()
                        result = _fio(data, fio_args, args.size_mib, args.runtime_s)
                        value = result["iops"] if job.startswith("rand") else result["MiBps"]
                        figures[job][workers].append(value)
                        print(f"round {round_ + 1} workers {workers}: {job} {value:,.1f}", flush=True)
        finally:
            cluster.stop_all()
    rows: dict[str, Any] = {}
    print(f"\nfio, 4 jobs, {args.size_mib} MiB in all; --workers {args.workers} / --workers 1, "
          f"median of {args.rounds} interleaved rounds")
    for job, by_workers in figures.items():
        ratios = [n / one for one, n in zip(by_workers[1], by_workers[args.workers], strict=True) if one]
        unit = "IOPS" if job.startswith("rand") else "MiB/s"
        rows[job] = {"unit": unit, "workers1": by_workers[1], f"workers{args.workers}": by_workers[args.workers],
                     "ratios": ratios, "median_ratio": statistics.median(ratios) if ratios else 0.0}
        print(f"{job:<22} 1: {statistics.median(by_workers[1]):>9,.1f} {unit:<5} {args.workers}: "
              f"{statistics.median(by_workers[args.workers]):>9,.1f} {unit:<5} ratio {rows[job]['median_ratio']:.2f}")
    path = save_result("fuse-workers", {"workers": args.workers, "size_mib": args.size_mib,
                                        "runtime_s": args.runtime_s, "jobs": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

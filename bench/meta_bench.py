"""Metadata operations per second through fs3, next to the same workload on a local directory.

Workloads (mdtest-like), each with 1 and 16 concurrent clients: create (open O_CREAT + close),
stat, listdir of a 10,000-entry directory, rename, unlink. fs3 runs against a local cluster
(mgmtd, meta, 3 storage processes, 3 replicas) through the native client; each client is its own
connection with its own client id, spread over two client processes (this machine has 2 cores).
The local baseline runs the same operations with ``os`` calls on a temporary directory, with the
same process split. Everything is measured in one run and printed as ratios.

Usage: ``python bench/meta_bench.py [--files 10000] [--clients 1,16] [--fsync]``.
Writes ``bench/results/meta-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import save_result  # noqa: E402
from tests.harness import ProcessCluster  # noqa: E402

PROCESSES = 2
OPS = ("create", "stat", "rename", "unlink")


# -- fs3 ---------------------------------------------------------------------------------------

async def create_files(fs: Any, paths: list[str]) -> None:
    """Open each path for writing and close it: an empty file (fs3.aio's file system)."""
    for p in paths:
        f = await fs.open(p, "wb")
        await f.close()


async def stat_files(fs: Any, paths: list[str]) -> None:
    for p in paths:
        await fs.stat(p)


async def rename_files(fs: Any, paths: list[str]) -> None:
    for p in paths:
        await fs.rename(p, p + ".r")


async def unlink_files(fs: Any, paths: list[str]) -> None:
    for p in paths:
        await fs.remove(p + ".r")


#: The phases, in order, each over one client's paths (the scale benchmark runs the same).
FS3_PHASES = (("create", create_files), ("stat", stat_files), ("rename", rename_files), ("unlink", unlink_files))


def _fs3_worker(mgmtd: str, token: str, base: str, clients: int, files: int, worker: int,
                barrier: Any, out: Any) -> None:
    import uvloop

    import fs3.aio

    async def main() -> None:
        conns = [await fs3.aio.connect(mgmtd, token=token) for _ in range(clients)]
        names = [[f"{base}/w{worker}c{c}-{i}" for i in range(files)] for c in range(clients)]
        timings: dict[str, float] = {}

        async def phase(name: str, op: Any) -> None:
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
            start = time.perf_counter()
            await asyncio.gather(*(op(conns[c], names[c]) for c in range(clients)))
            timings[name] = time.perf_counter() - start

        for name, op in FS3_PHASES:
            await phase(name, op)
        out.put((worker, timings))
        for fs in conns:
            await fs.close()

    uvloop.run(main())


def _local_worker(base: str, clients: int, files: int, worker: int, barrier: Any, out: Any) -> None:
    names = [f"{base}/w{worker}c{c}-{i}" for c in range(clients) for i in range(files)]
    timings: dict[str, float] = {}
    ops: dict[str, Callable[[str], object]] = {
        "create": lambda p: os.close(os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)),
        "stat": os.stat,
        "rename": lambda p: os.rename(p, p + ".r"),
        "unlink": lambda p: os.unlink(p + ".r"),
    }
    for name, op in ops.items():
        barrier.wait()
        start = time.perf_counter()
        for p in names:
            op(p)
        timings[name] = time.perf_counter() - start
    out.put((worker, timings))


def _run_workers(target: Any, args_of: Any, processes: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(w), w, barrier, out)) for w in range(processes)]
    for p in procs:
        p.start()
    results = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    # Wall time of a phase: the slowest process (they start together at the barrier).
    return {op: max(t[op] for _, t in results) for op in OPS}


def _listdir_rate(fs3_list: Any, local_list: Any, repeats: int = 3) -> tuple[float, float]:
    start = time.perf_counter()
    for _ in range(repeats):
        fs3_list()
    fs3_rate = repeats / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(repeats):
        local_list()
    return fs3_rate, repeats / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=10_000, help="files per run (split across clients)")
    parser.add_argument("--clients", default="1,16")
    parser.add_argument("--fsync", action="store_true", help="meta and storage fsync every commit")
    args = parser.parse_args()
    client_counts = [int(c) for c in args.clients.split(",")]
    report: dict[str, Any] = {"files": args.files, "fsync": args.fsync, "runs": {}}
    import fs3

    with tempfile.TemporaryDirectory(prefix="fs3-meta-bench-") as tmp:
        cluster = ProcessCluster(Path(tmp) / "cluster", storage_nodes=3, targets_per_node=1, fsync=args.fsync)
        try:
            cluster.start_all()
            asyncio.run(cluster.ensure_chains(3))
            fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
            for clients in client_counts:
                processes = min(PROCESSES, clients)
                per_process = clients // processes
                per_client = max(1, args.files // clients)
                base = f"/bench-{clients}"
                fs.mkdir(base)
                # The local baseline first (fs3's writes must not be in its page-cache writeback), best of
                # three: a local directory's timings swing with the journal's background work.
                local_t: dict[str, float] = {}
                for attempt in range(3):
                    local_base = Path(tmp) / f"local-{clients}-{attempt}"
                    local_base.mkdir()
                    os.sync()
                    timing = _run_workers(_local_worker, lambda w, b=str(local_base), c=per_process, n=per_client: (
                        b, c, n), processes)
                    local_t = {op: min(timing[op], local_t.get(op, timing[op])) for op in OPS}
                fs3_t = _run_workers(_fs3_worker, lambda w, b=base, c=per_process, n=per_client: (
                    cluster.mgmtd_address, cluster.token, b, c, n), processes)
                total = per_client * per_process * processes
                run = {op: {"fs3_ops": total / fs3_t[op], "local_ops": total / local_t[op]} for op in OPS}
                report["runs"][str(clients)] = run
            # listdir of a 10,000-entry directory (one client).
            fs.mkdir("/listing")
            local_listing = Path(tmp) / "listing"
            local_listing.mkdir()
            for i in range(args.files):
                fs.mknod(f"/listing/e{i:05d}")
                (local_listing / f"e{i:05d}").touch()
            fs3_rate, local_rate = _listdir_rate(lambda: fs.listdir("/listing"), lambda: os.listdir(local_listing))
            report["listdir"] = {"entries": args.files, "fs3_per_s": fs3_rate, "local_per_s": local_rate,
                                 "fs3_entries_per_s": fs3_rate * args.files}
            fs.close()
        finally:
            cluster.stop_all()

    print(f"metadata ops/s ({args.files} files per run, fsync={args.fsync}); fs3 vs local directory")
    print(f"{'clients':>7} {'op':<8} {'fs3 ops/s':>10} {'local ops/s':>12} {'fs3/local':>9}")
    for clients, run in report["runs"].items():
        for op, values in run.items():
            print(f"{clients:>7} {op:<8} {values['fs3_ops']:>10.0f} {values['local_ops']:>12.0f} "
                  f"{values['fs3_ops'] / values['local_ops']:>9.3f}")
    listing = report["listdir"]
    print(f"listdir of {listing['entries']} entries: fs3 {listing['fs3_per_s']:.1f}/s, local "
          f"{listing['local_per_s']:.1f}/s, ratio {listing['fs3_per_s'] / listing['local_per_s']:.3f}")
    path = save_result("meta", report)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Metadata operations per second with several meta servers on PostgreSQL, against one meta server on
the embedded RocksDB engine, through the whole stack (client, RPC, meta, engine), in one run.

Clusters, one after the other, each a fresh ``fs3 local`` cluster in its own directory (mgmtd, 3
storage processes, 3-replica chains) at the same durability (``--fsync``, on by default: RocksDB's
group-synced WAL, and PostgreSQL with fsync and synchronous_commit on):

* ``rocksdb``: one meta server on the embedded engine (the default cluster);
* ``postgres-1``, ``postgres-2``, ``postgres-3``: one, two or three meta servers on one private
  PostgreSQL server started in the cluster's directory.

Each is driven by ``--clients`` clients (16 by default; each its own connection and client id, so
that they spread over the meta servers by id) split over two worker processes, in directories of
their own (``/c<N>``) or in one shared directory (``--shared-dir``, as mdtest's default), through the
phases create (open for writing + close of an empty file), stat, rename (within the directory) and
unlink. Per phase: operations per second, the ratio to ``rocksdb``, database round trips and
serialization conflicts per operation (every meta server's ``fs3_meta_kv_round_trips`` and
``fs3_meta_kv_conflicts``, summed), and CPU milliseconds per operation of the meta servers, of
the PostgreSQL server (the postmaster and every backend) and of the clients — where the time
goes, so that scaling on more cores can be read off.

Usage: ``python bench/meta_scale_bench.py [--files 4000] [--clients 16] [--configs rocksdb,postgres-1,...]
[--no-fsync] [--shared-dir]``. Writes ``bench/results/meta-scale-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.meta_bench import FS3_PHASES  # noqa: E402
from bench.results_io import save_result  # noqa: E402
from fs3.cli.local import LocalCluster  # noqa: E402

PROCESSES = 2
PHASES = tuple(name for name, _ in FS3_PHASES)
CONFIGS = ("rocksdb", "postgres-1", "postgres-2", "postgres-3")


def _worker(mgmtd: str, token: str, dirs: list[str], files: int, worker: int, barrier: Any, out: Any) -> None:
    """One client process: a connection per directory in ``dirs``, ``files`` files each; every phase
    starts and ends at ``barrier`` (which the parent joins, to read the servers' counters between)."""
    import resource

    import uvloop

    import fs3.aio

    async def main() -> None:
        conns = [await fs3.aio.connect(mgmtd, token=token) for _ in dirs]
        names = [[f"{d}/w{worker}c{c}-{i}" for i in range(files)] for c, d in enumerate(dirs)]

        cpu: dict[str, float] = {}
        loop = asyncio.get_running_loop()
        for name, op in FS3_PHASES:
            await loop.run_in_executor(None, barrier.wait)
            before = resource.getrusage(resource.RUSAGE_SELF)
            await asyncio.gather(*(op(conns[c], names[c]) for c in range(len(dirs))))
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu[name] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            await loop.run_in_executor(None, barrier.wait)
        for fs in conns:
            await fs.close()
        out.put((worker, cpu))

    uvloop.run(main())


def _tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of process ``root`` and every process under it (PostgreSQL's
    postmaster and backends, which each start a session of their own, so a process group would miss
    them), with their exited children's."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)  # ppid
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += sum(int(stats[pid][i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
        todo += children.get(pid, [])
    return total / tick


def _kv_counters(metrics_addresses: list[str]) -> tuple[float, float]:
    """``fs3_meta_kv_round_trips`` and ``fs3_meta_kv_conflicts``, each summed over the meta servers
    (0 on the embedded engine)."""
    trips = conflicts = 0.0
    for address in metrics_addresses:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as rsp:
            for line in rsp.read().decode().splitlines():
                if line.startswith("fs3_meta_kv_round_trips"):
                    trips += float(line.rsplit(" ", 1)[1])
                elif line.startswith("fs3_meta_kv_conflicts"):
                    conflicts += float(line.rsplit(" ", 1)[1])
    return trips, conflicts


def _measure(config: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    import fs3

    engine, _, servers = config.partition("-")
    kwargs: dict[str, Any] = {"meta_engine": engine, "meta_servers": int(servers or 1)} if engine == "postgres" else {}
    cluster = LocalCluster(root, storage_nodes=3, targets_per_node=1, fsync=args.fsync, **kwargs)
    try:
        cluster.start_all()
        asyncio.run(cluster.ensure_chains(3))
        metas = [name for name in cluster.procs if name == "meta" or name.startswith("meta-")]
        metrics = [cluster.address(name, "metrics") for name in metas]
        meta_pids = [pid for name in metas if (pid := cluster.procs[name].pid)]
        pg_pid = cluster.procs["postgres"].pid if "postgres" in cluster.procs else None
        per_process = args.clients // PROCESSES
        files = max(1, args.files // args.clients)
        fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
        dirs_of: dict[int, list[str]] = {}
        for worker in range(PROCESSES):
            dirs_of[worker] = [("/shared" if args.shared_dir else f"/c{worker}-{c}") for c in range(per_process)]
        for d in {d for ds in dirs_of.values() for d in ds}:
            fs.mkdir(d)
        fs.close()
        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(PROCESSES + 1)
        out = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(cluster.mgmtd_address, cluster.token, dirs_of[w], files, w,
                                                    barrier, out)) for w in range(PROCESSES)]
        for p in procs:
            p.start()
        phases: dict[str, dict[str, float]] = {}
        for phase in PHASES:
            barrier.wait(timeout=600)
            (trips, conflicts), meta_cpu = _kv_counters(metrics), sum(_tree_cpu_s(p) for p in meta_pids)
            pg_cpu = _tree_cpu_s(pg_pid) if pg_pid else 0.0
            start = time.perf_counter()
            barrier.wait(timeout=1800)
            elapsed = time.perf_counter() - start
            ops = files * args.clients
            trips_after, conflicts_after = _kv_counters(metrics)
            phases[phase] = {
                "ops_per_s": ops / elapsed,
                "round_trips_per_op": (trips_after - trips) / ops,
                "conflicts_per_op": (conflicts_after - conflicts) / ops,
                "meta_cpu_ms_per_op": 1000 * (sum(_tree_cpu_s(p) for p in meta_pids) - meta_cpu) / ops,
                "db_cpu_ms_per_op": 1000 * ((_tree_cpu_s(pg_pid) if pg_pid else 0.0) - pg_cpu) / ops,
            }
        client_cpu: dict[str, float] = {}
        for _ in procs:
            _, cpu = out.get(timeout=600)
            for phase, seconds in cpu.items():
                client_cpu[phase] = client_cpu.get(phase, 0.0) + seconds
        for p in procs:
            p.join(timeout=60)
        for phase in PHASES:
            phases[phase]["client_cpu_ms_per_op"] = 1000 * client_cpu[phase] / (files * args.clients)
        return phases
    finally:
        cluster.stop_all()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=4_000, help="files per phase, over all clients")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--no-fsync", dest="fsync", action="store_false",
                        help="commits not synced (both engines alike)")
    parser.add_argument("--shared-dir", action="store_true", help="every client in one directory")
    args = parser.parse_args()
    if args.clients % PROCESSES:
        parser.error(f"--clients must be a multiple of {PROCESSES}")
    configs = [c for c in args.configs.split(",") if c]
    for config in configs:
        if config not in CONFIGS:
            parser.error(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
    report: dict[str, Any] = {"files": args.files, "clients": args.clients, "fsync": args.fsync,
                              "shared_dir": args.shared_dir, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="fs3-meta-scale-") as tmp:
        for config in configs:
            report["configs"][config] = _measure(config, Path(tmp) / config, args)
    base = report["configs"].get("rocksdb")
    print(f"metadata ops/s, {args.clients} clients, {args.files} files per phase, fsync={args.fsync}, "
          f"{'one shared directory' if args.shared_dir else 'a directory per client'}")
    print(f"{'config':<11} {'op':<7} {'ops/s':>8} {'/rocksdb':>8} {'trips/op':>8} {'confl/op':>8} {'meta ms':>8} "
          f"{'db ms':>7} {'client ms':>9}   (CPU per operation)")
    for config, phases in report["configs"].items():
        for phase, row in phases.items():
            ratio = row["ops_per_s"] / base[phase]["ops_per_s"] if base else float("nan")
            row["ratio_to_rocksdb"] = ratio
            print(f"{config:<11} {phase:<7} {row['ops_per_s']:>8.0f} {ratio:>8.2f} {row['round_trips_per_op']:>8.2f} "
                  f"{row['conflicts_per_op']:>8.2f} "
                  f"{row['meta_cpu_ms_per_op']:>8.3f} {row['db_cpu_ms_per_op']:>7.3f} "
                  f"{row['client_cpu_ms_per_op']:>9.3f}")
    print(f"wrote {save_result('meta-scale', report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

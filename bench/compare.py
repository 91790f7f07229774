"""fs3 against GlusterFS, MooseFS and the local directory: one workload set, one machine, one run.

Usage: ``python bench/compare.py [--quick] [--systems local,fs3,glusterfs,moosefs] [--no-native]``
(``make bench`` / ``make bench-quick``; root, Debian: the peers are installed with apt if missing).

Workloads, identical on every mount point (page cache dropped between write and read phases):

- fio, 1 MiB sequential write then read, numjobs 1 and 4, one file of ``file_mib`` per job;
  4 KiB random read and random write, iodepth 16 (posixaio), for ``rand_s`` seconds each;
- small files (mdtest-like): ``small_files`` files of 4 KiB created and written, read, stat'ed and
  deleted, by 1 and by 4 processes sharing the count, each in its own directory;
- the flow of ``juicefs bench`` (``fs3 bench``): a big file per thread with 1 MiB I/O, then 100
  files of 128 KiB per thread written, read and stat'ed; 1 and 4 threads.

fs3's native client (the Python library, no FUSE) runs the small-file and juicefs-bench workloads
too, and ``fs3.usrbio`` (shared-memory rings to the mount daemon) the 4 KiB random reads of a data
loader: 4 processes, batches of 64, distinct records of four files of ``file_mib / 4`` written
through the mount, page cache dropped first — set against every system's fio random-read row.
Writes a JSON record and a Markdown table to ``bench/results/peers-<stamp>.*`` and PNG bar
charts beside them; prints the table. Every figure is a rate (higher is better); the table's ratio
columns divide fs3's FUSE figure by each other system's.

Runs on this kind of machine swing by ±30% from one to the next, so every system is measured
``--runs`` times (3 by default), the rounds interleaved (every system once, then every system
again) so that a slow spell hits all of them, and each figure in the table is the median of its
rounds; the JSON record keeps every round.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peers import SYSTEMS, Fs3Mount, System  # noqa: E402
from fs3.cli.bench import BenchConfig, NativeBackend, PathBackend, drop_page_cache, run_bench  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SYSTEM_ORDER = ["local", "fs3", "fs3-native", "fs3-usrbio", "glusterfs", "moosefs"]
LABELS = {"local": "local dir", "fs3": "fs3 (FUSE)", "fs3-native": "fs3 (native)", "fs3-usrbio": "fs3 (usrbio)",
          "glusterfs": "GlusterFS", "moosefs": "MooseFS"}
FIO_RAND_READ = "fio rand read 4K, iodepth 16 (IOPS)"
USRBIO_RAND_READ = "usrbio rand read 4K, 4 procs, batches of 64 (IOPS)"
USRBIO_BATCH = 64
USRBIO_RECORDS_PER_PROC = 4800


@dataclass(frozen=True)
class Sizes:
    file_mib: int
    rand_s: int
    small_files: int
    juicefs_big_mib: int
    threads: tuple[int, ...]


FULL = Sizes(file_mib=1024, rand_s=15, small_files=10_000, juicefs_big_mib=1024, threads=(1, 4))
QUICK = Sizes(file_mib=256, rand_s=5, small_files=2_000, juicefs_big_mib=256, threads=(1,))


# -- fio ---------------------------------------------------------------------------------------------


def _fio(directory: Path, name: str, rw: str, bs: str, file_mib: int, numjobs: int, iodepth: int,
         runtime_s: int | None) -> float:
    args = ["fio", f"--name={name}", f"--directory={directory}", f"--rw={rw}", f"--bs={bs}", f"--size={file_mib}m",
            f"--numjobs={numjobs}", f"--iodepth={iodepth}", "--group_reporting", "--output-format=json",
            "--ioengine=psync" if iodepth == 1 else "--ioengine=posixaio"]
    if rw.endswith("write"):
        args.append("--end_fsync=1")
    if runtime_s:
        args += [f"--runtime={runtime_s}", "--time_based"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"fio {name} {rw} failed: {out.stderr[-2000:]}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    return float(side["iops"] if bs == "4k" else side["bw_bytes"] / (1 << 20))


def fio_suite(directory: Path, sizes: Sizes, log: Callable[[str], None]) -> dict[str, float]:
    rows: dict[str, float] = {}
    for numjobs in (1, 4):
        name = f"seq{numjobs}"
        rows[f"fio seq write 1M, {numjobs} job(s) (MiB/s)"] = _fio(directory, name, "write", "1m", sizes.file_mib,
                                                                   numjobs, 1, None)
        drop_page_cache()
        rows[f"fio seq read 1M, {numjobs} job(s) (MiB/s)"] = _fio(directory, name, "read", "1m", sizes.file_mib,
                                                                  numjobs, 1, None)
        log(f"    fio sequential, {numjobs} job(s) done")
        if numjobs == 1:
            drop_page_cache()
            rows[FIO_RAND_READ] = _fio(directory, name, "randread", "4k", sizes.file_mib, 1,
                                                               16, sizes.rand_s)
            rows["fio rand write 4K, iodepth 16 (IOPS)"] = _fio(directory, name, "randwrite", "4k", sizes.file_mib,
                                                                1, 16, sizes.rand_s)
            log("    fio random done")
        for path in directory.iterdir():
            path.unlink()
    return rows


# -- small files (mdtest-like) -------------------------------------------------------------------------


def _small_worker(args: tuple[str, str | None, str | None, str, int, str]) -> float:
    """One process: one phase over its own files; returns the phase's seconds."""
    root, mgmtd, token, directory, count, phase = args
    payload = os.urandom(4096)
    fs: Any = None
    if mgmtd:
        from fs3.client.sync_api import connect

        fs = connect(mgmtd, token=token)

    def join(name: str) -> str:
        return f"{root}/{directory}/{name}"

    started = time.perf_counter()
    try:
        if phase == "create":
            for i in range(count):
                if fs is not None:
                    with fs.open(join(f"f{i}"), "wb", buffering=0) as f:
                        f.write(payload)
                else:
                    fd = os.open(join(f"f{i}"), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                    os.write(fd, payload)
                    os.close(fd)
        elif phase == "read":
            for i in range(count):
                if fs is not None:
                    with fs.open(join(f"f{i}"), "rb", buffering=0) as f:
                        data = f.read(8192)
                else:
                    fd = os.open(join(f"f{i}"), os.O_RDONLY)
                    data = os.read(fd, 8192)
                    os.close(fd)
                if len(data) != 4096:
                    raise RuntimeError(f"{join(f'f{i}')}: read {len(data)} bytes, wrote 4096")
        elif phase == "stat":
            for i in range(count):
                (fs.stat if fs is not None else os.stat)(join(f"f{i}"))
        elif phase == "delete":
            for i in range(count):
                (fs.remove if fs is not None else os.unlink)(join(f"f{i}"))
        return time.perf_counter() - started
    finally:
        if fs is not None:
            fs.close()


def small_files(root: str, total: int, procs: int, native: tuple[str, str] | None) -> dict[str, float]:
    """files/s per phase for ``total`` files of 4 KiB shared by ``procs`` processes."""
    per = total // procs
    dirs = [f"smallfiles-{procs}-{p}" for p in range(procs)]
    if native:
        from fs3.client.sync_api import connect

        fs = connect(native[0], token=native[1])
        for d in dirs:
            fs.makedirs(f"{root}/{d}", exist_ok=True)
    else:
        fs = None
        for d in dirs:
            os.makedirs(f"{root}/{d}", exist_ok=True)
    rows: dict[str, float] = {}
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(procs) as pool:
        for phase in ("create", "read", "stat", "delete"):
            if phase == "read" and not native:
                drop_page_cache()
            started = time.perf_counter()
            pool.map(_small_worker, [(root, native[0] if native else None, native[1] if native else None, d, per,
                                      phase) for d in dirs])
            rows[f"small files {phase}, {procs} proc(s) (files/s)"] = per * procs / (time.perf_counter() - started)
    for d in dirs:
        if fs is not None:
            fs.rmdir(f"{root}/{d}")
        else:
            os.rmdir(f"{root}/{d}")
    if fs is not None:
        fs.close()
    return rows


# -- juicefs bench flow ----------------------------------------------------------------------------------


def juicefs_flow(backend: Any, sizes: Sizes) -> dict[str, float]:
    rows: dict[str, float] = {}
    for threads in sizes.threads:
        config = BenchConfig(big_file_size_bytes=sizes.juicefs_big_mib << 20, threads=threads)
        for phase in run_bench(backend, config):
            if phase.unit == "block":
                rows[f"juicefs-bench {phase.name}, {threads} thread(s) (MiB/s)"] = phase.mib_per_s
            else:
                rows[f"juicefs-bench {phase.name}, {threads} thread(s) (files/s)"] = phase.ops_per_s
    return rows


# -- fs3.usrbio -----------------------------------------------------------------------------------------


def usrbio_rand_read(mnt: Path, sizes: Sizes) -> float:
    """IOPS of a data loader's reads through ``fs3.usrbio``: 4 processes, batches of 64 distinct 4 KiB records.

    The records are spread over four files written through the mount (the fio files are gone by
    now), and the page cache is dropped first, as before every fio read.
    """
    import random

    from bench.usrbio_bench import PROCESSES, _run

    directory = mnt / "usrbio"
    directory.mkdir()
    file_bytes = max(1, sizes.file_mib // PROCESSES) << 20
    block = os.urandom(1 << 20)
    files = []
    try:
        for index in range(PROCESSES):
            path = directory / f"records-{index}"
            with path.open("wb") as out:
                for _ in range(file_bytes >> 20):
                    out.write(block)
            files.append(str(path))
        drop_page_cache()
        rate = _run("usrbio", files, 4096, USRBIO_RECORDS_PER_PROC, USRBIO_BATCH, str(mnt), random.Random(1),
                    file_bytes)
        return rate / 4096
    finally:
        for name in files:
            os.unlink(name)
        directory.rmdir()


def usrbio_summary(results: dict[str, dict[str, float]]) -> list[str]:
    """usrbio's 4 KiB random-read rate over each system's fio random-read row (the issue's goals: 3x fs3's
    FUSE mount, 2x MooseFS)."""
    ours = results.get("fs3-usrbio", {}).get(USRBIO_RAND_READ)
    if not ours:
        return []
    parts = [f"{LABELS[s]} fio {ours / results[s][FIO_RAND_READ]:.2f}x" for s in SYSTEM_ORDER
             if results.get(s, {}).get(FIO_RAND_READ)]
    return [f"fs3.usrbio 4 KiB random reads ({ours:,.0f} IOPS) over: " + ", ".join(parts)] if parts else []


# -- the run ---------------------------------------------------------------------------------------------


def run_system(system: System, sizes: Sizes, native: bool, log: Callable[[str], None]) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    with system as mnt:
        log(f"  {system.describe()} at {mnt}")
        rows: dict[str, float] = {}
        fio_dir = mnt / "fio"
        fio_dir.mkdir()
        rows.update(fio_suite(fio_dir, sizes, log))
        fio_dir.rmdir()
        for procs in (1, 4):
            rows.update(small_files(str(mnt), sizes.small_files, procs, None))
            log(f"    small files, {procs} proc(s) done")
        rows.update(juicefs_flow(PathBackend(mnt), sizes))
        log("    juicefs-bench flow done")
        results[system.name] = rows
        if isinstance(system, Fs3Mount):
            results["fs3-usrbio"] = {USRBIO_RAND_READ: usrbio_rand_read(mnt, sizes)}
            log("    fs3.usrbio random reads done")
    if native and isinstance(system, Fs3Mount):
        # A fresh cluster, as every system gets one: the mount's deleted files would otherwise
        # still be collected in the background while the native client runs.
        fresh = Fs3Mount(system.work.parent)
        with fresh:
            address = fresh.native_address()
            native_rows: dict[str, float] = {}
            for procs in (1, 4):
                native_rows.update(small_files("/", sizes.small_files, procs, address))
            fs = fresh.connect()
            try:
                native_rows.update(juicefs_flow(NativeBackend(fs, "/"), sizes))
            finally:
                fs.close()
        log("    fs3 native client done (fresh cluster)")
        results["fs3-native"] = native_rows
    return results


def median_of_rounds(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per system and workload, the median of the rounds that measured it (a system that failed in
    a later round keeps the medians of the rounds it completed)."""
    collected: dict[str, dict[str, list[float]]] = {}
    for one in rounds:
        for system, rows in one.items():
            for workload, value in rows.items():
                collected.setdefault(system, {}).setdefault(workload, []).append(value)
    return {system: {workload: statistics.median(values) for workload, values in rows.items()}
            for system, rows in collected.items()}


def markdown_table(results: dict[str, dict[str, float]]) -> str:
    systems = [s for s in SYSTEM_ORDER if s in results]
    peers = [s for s in ("glusterfs", "moosefs", "local") if s in results]
    workloads: list[str] = []
    for s in systems:
        workloads += [w for w in results[s] if w not in workloads]
    header = ["workload", *(LABELS[s] for s in systems), *(f"fs3 / {LABELS[p]}" for p in peers if "fs3" in results)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for w in workloads:
        cells = [w]
        for s in systems:
            value = results[s].get(w)
            cells.append(f"{value:,.1f}" if value is not None else "-")
        if "fs3" in results:
            for p in peers:
                ours = results["fs3"].get(w)
                theirs = results[p].get(w)
                cells.append(f"{ours / theirs:.2f}" if theirs and ours is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def charts(results: dict[str, dict[str, float]], path: Path) -> bool:
    """One bar group per workload, values normalised to the local directory (or the best system)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    systems = [s for s in SYSTEM_ORDER if s in results]
    workloads: list[str] = []
    for s in systems:
        workloads += [w for w in results[s] if w not in workloads]
    fig, ax = plt.subplots(figsize=(12, max(6, 0.35 * len(workloads))))
    height = 0.8 / len(systems)
    for index, s in enumerate(systems):
        values = []
        for w in workloads:
            base = results.get("local", {}).get(w) or max((results[k].get(w) or 0.0) for k in systems) or 1.0
            values.append((results[s].get(w) or 0.0) / base)
        ax.barh([i + index * height for i in range(len(workloads))], values, height=height, label=LABELS[s])
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(workloads))])
    ax.set_yticklabels(workloads, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("rate relative to the local directory (log scale; higher is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller files and counts (a few minutes)")
    parser.add_argument("--systems", default="local,fs3,glusterfs,moosefs")
    parser.add_argument("--no-native", action="store_true", help="skip fs3's native client")
    parser.add_argument("--work", default="/var/tmp/fs3-peers", help="where the systems keep their data")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--runs", type=int, default=3, help="rounds of every system; the table shows medians")
    args = parser.parse_args()
    if not 1 <= args.runs <= 9:
        print(f"--runs must be 1 to 9, not {args.runs}", file=sys.stderr)
        return 1
    if os.geteuid() != 0:
        print("bench/compare.py needs root: it starts file-system daemons, mounts and drops caches", file=sys.stderr)
        return 1
    sizes = QUICK if args.quick else FULL
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        print(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}", file=sys.stderr)
        return 1
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {message}", flush=True)

    described: dict[str, str] = {}
    failed: dict[str, str] = {}
    rounds: list[dict[str, dict[str, float]]] = []
    for round_index in range(args.runs):
        this_round: dict[str, dict[str, float]] = {}
        for name in names:
            if name in failed:
                continue
            log(f"{name} (round {round_index + 1} of {args.runs}) ...")
            system = SYSTEMS[name](work)
            try:
                this_round.update(run_system(system, sizes, not args.no_native, log))
                described[name] = system.describe()
            except Exception as exc:  # one peer failing to start must not lose the others' figures
                failed[name] = f"{type(exc).__name__}: {exc}"
                log(f"  {name} FAILED: {failed[name][:2000]}")
        rounds.append(this_round)
    results = median_of_rounds(rounds)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results)
    record = {"when": stamp, "quick": args.quick, "sizes": sizes.__dict__, "systems": described, "failed": failed,
              "results": results, "runs": args.runs, "rounds": rounds, "seconds": round(time.monotonic() - started, 1)}
    (out / f"peers-{stamp}.json").write_text(json.dumps(record, indent=2))
    md = [f"# fs3 against its peers, {stamp}{' (quick)' if args.quick else ''}", "",
          f"Each figure is the median of {args.runs} interleaved round(s); the JSON record has every round.", "",
          *(f"- **{LABELS.get(k, k)}**: {v}" for k, v in described.items()),
          *(f"- **{k}** did not run: {v}" for k, v in failed.items()), "", table,
          *(["", *usrbio_summary(results)] if usrbio_summary(results) else [])]
    if charts(results, out / f"peers-{stamp}.png"):
        md += ["", f"![rates relative to the local directory](peers-{stamp}.png)"]
    (out / f"peers-{stamp}.md").write_text("\n".join(md) + "\n")
    print(table)
    print("\n".join(usrbio_summary(results)))
    print(f"wrote {out / f'peers-{stamp}.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

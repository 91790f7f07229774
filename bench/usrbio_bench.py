"""fs3.usrbio against the FUSE mount and against the local directory, in one run.

A 3-node, 3-replica process cluster mounted with FUSE (usrbio on); four files of ``--file-mib``
MiB written through the mount and copied to a local directory on the same disk. Each round
measures, in alternating order:

* **4 KiB random reads, 4 processes**: ``fuse`` — each process ``os.pread``\\ s 4 KiB records
  through the mount one after another (read-ahead off: ``POSIX_FADV_RANDOM``); ``usrbio`` — each
  process submits batches of ``--batch`` records to its own ring and waits for them. Every
  record of a round is a distinct 4 KiB page, and the files are opened again each round (the mount
  opens without ``keep_cache``), so the kernel's page cache never answers a FUSE read.
* **128 KiB random records on cold data, 4 processes**: ``local`` — ``os.pread`` from the local
  copy; ``usrbio`` — batches of 16 records; the page cache is dropped before each
  (``/proc/sys/vm/drop_caches``, root only: otherwise the figures say ``warm``).

Ratios are taken per round and the median of ``--rounds`` reported (the machine is noisy: only
figures of one run are compared). Writes ``bench/results/usrbio-<stamp>.json``.

Usage: ``python bench/usrbio_bench.py [--quick] [--rounds 3] [--file-mib 64]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import save_result  # noqa: E402
from tests.harness import mounted_cluster  # noqa: E402

KIB, MIB = 1024, 1024 * 1024
PROCESSES = 4


def _worker(way: str, files: list[str], jobs: list[tuple[int, int]], record: int, batch: int,
            mountpoint: str, start: Any, out: Any) -> None:
    """One process: read ``jobs`` ((file index, offset) each) ``way``; reports (start, end, bytes)."""
    got = 0
    if way == "usrbio":
        from fs3.usrbio import IoRing, Iov

        with Iov(batch * record) as iov, IoRing(mountpoint, entries=batch) as ring:
            ids = [ring.register(f) for f in files]
            start.wait()
            began = time.monotonic()
            for at in range(0, len(jobs), batch):
                chunk = jobs[at:at + batch]
                for n, (index, offset) in enumerate(chunk):
                    ring.prep_io(iov, ids[index], offset, record, iov_offset=n * record, userdata=n)
                ring.submit()
                for completion in ring.wait(min_results=len(chunk)):
                    got += completion.check()
    else:
        fds = [os.open(f, os.O_RDONLY) for f in files]
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        start.wait()
        began = time.monotonic()
        for index, offset in jobs:
            got += len(os.pread(fds[index], record, offset))
        for fd in fds:
            os.close(fd)
    out.put((began, time.monotonic(), got))


def _run(way: str, files: list[str], record: int, per_process: int, batch: int, mountpoint: str,
         rng: random.Random, file_bytes: int) -> float:
    """Bytes per second of ``PROCESSES`` processes reading ``per_process`` distinct records each."""
    slots = file_bytes // record
    picks = rng.sample(range(len(files) * slots), PROCESSES * per_process)  # distinct records
    jobs = [(p // slots, (p % slots) * record) for p in picks]
    ctx = mp.get_context("fork")
    start = ctx.Barrier(PROCESSES)
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(way, files, jobs[i::PROCESSES], record, batch, mountpoint, start, out))
             for i in range(PROCESSES)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise RuntimeError(f"a {way} worker failed ({proc.exitcode})")
    began = min(r[0] for r in results)
    ended = max(r[1] for r in results)
    total = sum(r[2] for r in results)
    if total != PROCESSES * per_process * record:
        raise RuntimeError(f"{way}: read {total} bytes, expected {PROCESSES * per_process * record}")
    return float(total / (ended - began))


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer records per round (about a minute)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--file-mib", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    small_fuse, small_usrbio, large = (500, 1600, 64) if args.quick else (1500, 4800, 192)
    rng = random.Random(args.seed)
    rows: dict[str, list[float]] = {"fuse_4k": [], "usrbio_4k": [], "local_128k": [], "usrbio_128k": []}
    cold = True
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fs3-usrbio-bench-", dir="/var/tmp") as tmp, \
            mounted_cluster(Path(tmp)) as (_, mnt):
        data_dir = mnt / "bench"
        data_dir.mkdir()
        local_dir = Path(tmp) / "local"
        local_dir.mkdir()
        file_bytes = args.file_mib * MIB
        files: list[str] = []
        local_files: list[str] = []
        for n in range(PROCESSES):
            payload = rng.randbytes(file_bytes)
            for where, names in ((data_dir, files), (local_dir, local_files)):
                path = where / f"shard-{n}.rec"
                with open(path, "wb") as f:
                    for at in range(0, file_bytes, 4 * MIB):
                        f.write(payload[at:at + 4 * MIB])
                names.append(str(path))
        for round_ in range(args.rounds):
            flip = round_ % 2 == 1
            for way in (["usrbio", "fuse"] if flip else ["fuse", "usrbio"]):
                per_process = small_usrbio if way == "usrbio" else small_fuse
                rows[f"{way}_4k"].append(_run(way, files, 4 * KIB, per_process, args.batch, str(mnt), rng,
                                              file_bytes))
            for way in (["usrbio", "local"] if flip else ["local", "usrbio"]):
                cold = _drop_caches() and cold
                rows[f"{way}_128k"].append(_run(way, files if way == "usrbio" else local_files, 128 * KIB, large,
                                                16, str(mnt), rng, file_bytes))
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1] / MIB:.1f} MiB/s" for k, v in rows.items()),
                  file=sys.stderr)
        subprocess.run(["sync"], check=False)
        shutil.rmtree(data_dir, ignore_errors=True)
    iops = {k: [v / (4 * KIB) for v in rows[k]] for k in ("fuse_4k", "usrbio_4k")}
    ratio_4k = statistics.median(u / f for u, f in zip(iops["usrbio_4k"], iops["fuse_4k"], strict=True))
    ratio_128k = statistics.median(u / loc for u, loc in zip(rows["usrbio_128k"], rows["local_128k"], strict=True))
    result = {
        "rounds": args.rounds, "quick": args.quick, "processes": PROCESSES, "batch": args.batch,
        "file_mib": args.file_mib, "cold_128k": cold, "seconds": round(time.monotonic() - started, 1),
        "iops_4k": {k: [round(x) for x in v] for k, v in iops.items()},
        "mib_per_s_128k": {k: [round(x / MIB, 1) for x in rows[k]] for k in ("local_128k", "usrbio_128k")},
        "ratios": {"usrbio_vs_fuse_4k_iops": round(ratio_4k, 2),
                   "usrbio_vs_local_128k_cold": round(ratio_128k, 2)},
        "goals": {"usrbio_vs_fuse_4k_iops": 3.0, "usrbio_vs_local_128k_cold": 0.8},
    }
    path = save_result("usrbio", result)
    print(json.dumps(result))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

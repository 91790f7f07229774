"""Small files on the FUSE mount: rates and round trips per file, several mounts compared in one run.

Usage::

    python bench/smallfile_bench.py [--files 2000] [--writes 2048] [--rounds 3] [--phases create,...] \\
        [--variant NAME=MOUNT_ARGS[@SOURCE_DIR]] ...

One cluster (mgmtd, meta, three storage nodes, chains of 3), one FUSE mount per variant, all
mounted at once. Each round runs, on every variant in turn (the order rotates from round to
round, so a slow spell of the machine is spread over all of them), the small-file workload of
``bench/compare.py`` with one process: ``--files`` files of 4 KiB created and written (open
``O_CREAT|O_TRUNC``, one write, close), read (the kernel's caches dropped first, as
``bench/compare.py`` does, unless ``--keep-caches``), stat'ed and deleted;
then small writes to one file: ``--writes`` writes of 4 KiB in order (``seqwrite``) or at random
4 KiB-aligned offsets (``randwrite``), the file closed at the end (the rate counts the close).

A variant is its mount's extra ``fs3 mount`` arguments (``--no-batched-closes``...) and, after
``@``, another checkout to run that mount's daemon from (the code before a change: a
``git worktree`` with its generated ``*_pb2*`` files); the cluster is always this checkout's.
Without ``--variant``: ``default`` (this checkout, no extra arguments).

For each variant and phase it prints the median rate over the rounds, the ratio to the first
variant's median (medians of per-round ratios), and the requests per file: FUSE requests the
mount answered (by operation), meta RPCs and storage RPCs (by method), from the /metrics of the
mount, meta and storage processes before and after the phase. Background traffic (heartbeats,
lease renewals) is included, a few per phase. Needs root (FUSE, dropping the page cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fs3.cli.bench import drop_page_cache  # noqa: E402
from tests.harness import ProcessCluster  # noqa: E402

PHASES = ("create", "read", "stat", "delete", "seqwrite", "randwrite")
UNITS = {"seqwrite": "writes/s", "randwrite": "writes/s"}  # the others: files/s
PAYLOAD_BYTES = 4096


@dataclass
class Variant:
    name: str
    mount_args: list[str]
    source: Path
    mountpoint: Path = Path()
    proc: subprocess.Popen[bytes] | None = None
    metrics: str = ""
    rates: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    requests: dict[str, Counter[str]] = field(default_factory=lambda: {p: Counter() for p in PHASES})


def parse_variant(text: str) -> Variant:
    name, _, rest = text.partition("=")
    args, _, source = rest.partition("@")
    return Variant(name, args.split(), Path(source).resolve() if source else ROOT)


def scrape(address: str) -> Counter[str]:
    """Request counters of one process: FUSE ops (``fuse:OP``) and RPCs served (``SERVICE:METHOD``)."""
    counts: Counter[str] = Counter()
    if not address:
        return counts
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as rsp:
        text = rsp.read().decode()
    for line in text.splitlines():
        if line.startswith("fs3_fuse_ops_total{"):
            op = line.split('op="', 1)[1].split('"', 1)[0]
            counts[f"fuse:{op}"] += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("fs3_rpc_requests_total{"):
            labels = line[line.index("{") + 1:line.index("}")]
            fields = dict(item.split("=", 1) for item in labels.split(","))
            key = f"{fields['service'].strip(chr(34))}:{fields['method'].strip(chr(34))}"
            counts[key] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def mount(variant: Variant, cluster: ProcessCluster, work: Path) -> None:
    variant.mountpoint = work / f"mnt-{variant.name}"
    variant.mountpoint.mkdir()
    ready = work / f"mount-{variant.name}.ready.json"
    env = dict(os.environ, PYTHONPATH=str(variant.source))
    args = [sys.executable, "-P", "-m", "fs3.cli.main", "mount", cluster.mgmtd_address, str(variant.mountpoint),
            "--foreground", "--token-file", str(cluster.token_file), "--metrics-port", "0", "--ready-file",
            str(ready), "--log-level", "WARNING", *variant.mount_args]
    with (work / f"mount-{variant.name}.log").open("ab") as log:
        variant.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=str(work))
    deadline = time.monotonic() + 60
    while not (ready.exists() and os.path.ismount(variant.mountpoint)):
        if variant.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"mount {variant.name} did not come up: see {work}/mount-{variant.name}.log")
        time.sleep(0.1)
    variant.metrics = json.loads(ready.read_text()).get("metrics") or ""


def unmount(variant: Variant) -> None:
    if variant.proc is not None and variant.proc.poll() is None:
        os.killpg(variant.proc.pid, signal.SIGTERM)
        try:
            variant.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(variant.proc.pid, signal.SIGKILL)
    if os.path.ismount(variant.mountpoint):
        subprocess.run(["fusermount3", "-uz", str(variant.mountpoint)], check=False)


def run_phase(directory: Path, phase: str, count: int, payload: bytes, writes: int) -> float:
    """One phase over ``count`` files in ``directory`` (files/s), or ``writes`` 4 KiB writes to one
    file, sequential or at random 4 KiB-aligned offsets, closed at the end (writes/s)."""
    started = time.perf_counter()
    if phase in ("seqwrite", "randwrite"):
        rng = random.Random(writes)
        fd = os.open(directory / phase, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            for i in range(writes):
                offset = i if phase == "seqwrite" else rng.randrange(writes)
                os.pwrite(fd, payload, offset * len(payload))
        finally:
            os.close(fd)
        rate = writes / (time.perf_counter() - started)
        os.unlink(directory / phase)
        return rate
    if phase == "create":
        for i in range(count):
            fd = os.open(directory / f"f{i}", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            os.write(fd, payload)
            os.close(fd)
    elif phase == "read":
        for i in range(count):
            fd = os.open(directory / f"f{i}", os.O_RDONLY)
            data = os.read(fd, 8192)
            os.close(fd)
            if len(data) != len(payload):
                raise RuntimeError(f"{directory}/f{i}: read {len(data)} bytes, wrote {len(payload)}")
    elif phase == "stat":
        for i in range(count):
            os.stat(directory / f"f{i}")
    elif phase == "delete":
        for i in range(count):
            os.unlink(directory / f"f{i}")
    return count / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--writes", type=int, default=2048, help="4 KiB writes of the seqwrite and randwrite phases")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"a subset of {','.join(PHASES)}")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=MOUNT_ARGS[@SOURCE_DIR]")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--keep-caches", action="store_true",
                        help="do not drop the kernel's caches before the read phase (its entries stay)")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant] or [Variant("default", [], ROOT)]
    phases = [p for p in args.phases.split(",") if p]
    if unknown := set(phases) - set(PHASES):
        parser.error(f"unknown phases {sorted(unknown)}; known: {', '.join(PHASES)}")
    payload = os.urandom(PAYLOAD_BYTES)
    with tempfile.TemporaryDirectory(prefix="fs3-smallfile-") as tmp:
        work = Path(tmp)
        cluster = ProcessCluster(work / "cluster", storage_nodes=3, targets_per_node=1, token="bench")
        try:
            cluster.start_all()
            asyncio.run(cluster.ensure_chains(3))
            for variant in variants:
                mount(variant, cluster, work)
            services = [cluster.address(name, "metrics") for name in cluster.procs
                        if name not in ("mgmtd", "mount") and cluster.procs[name].info.get("metrics")]
            for rnd in range(args.rounds):
                order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
                for variant in order:
                    directory = variant.mountpoint / f"round{rnd}"
                    directory.mkdir()
                    for phase in phases:
                        if phase == "read" and not args.keep_caches:
                            drop_page_cache()
                        before = sum((scrape(a) for a in [variant.metrics, *services]), Counter())
                        rate = run_phase(directory, phase, args.files, payload, args.writes)
                        after = sum((scrape(a) for a in [variant.metrics, *services]), Counter())
                        variant.rates[phase].append(rate)
                        after.subtract(before)
                        variant.requests[phase].update(+after)
                    shutil.rmtree(directory)  # what a subset of the phases left
                    print(f"round {rnd + 1}: {variant.name}: " + ", ".join(
                        f"{p} {variant.rates[p][-1]:,.0f}/s" for p in phases), flush=True)
        finally:
            for variant in variants:
                unmount(variant)
            cluster.stop_all()
    report(variants, phases, args.files * args.rounds, args.writes * args.rounds, args.json)
    return 0


def report(variants: list[Variant], phases: list[str], files: int, writes: int, json_path: str | None) -> None:
    base = variants[0]
    print(f"\n| phase | {' | '.join(v.name for v in variants)} | "
          + " | ".join(f"{v.name} / {base.name}" for v in variants[1:]) + " |")
    print("|---" * (1 + 2 * len(variants) - 1) + "|")
    out: dict[str, object] = {}
    for phase in phases:
        medians = [statistics.median(v.rates[phase]) for v in variants]
        ratios = [statistics.median(a / b for a, b in zip(v.rates[phase], base.rates[phase], strict=True))
                  for v in variants[1:]]
        print(f"| {phase} ({UNITS.get(phase, 'files/s')}) | " + " | ".join(f"{m:,.0f}" for m in medians) + " | "
              + " | ".join(f"{r:.2f}" for r in ratios) + " |")
        out[phase] = {"rates": {v.name: v.rates[phase] for v in variants}, "ratios": dict(
            zip((v.name for v in variants[1:]), ratios, strict=True))}
    print("\nrequests per file, or per 4 KiB write (FUSE ops answered; meta and storage RPCs served):")
    requests: dict[str, dict[str, float]] = {}
    for phase in phases:
        per = writes if phase in UNITS else files
        for v in variants:
            counts = v.requests[phase]
            shown = ", ".join(f"{k} {n / per:.2f}" for k, n in sorted(counts.items()) if n / per >= 0.01)
            print(f"  {phase:<7} {v.name:<12} {shown}")
            requests[f"{phase}/{v.name}"] = {k: n / per for k, n in counts.items()}
    out["requests"] = requests
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())

"""HFReduce's allreduce against torch.distributed's gloo, and against this machine's memory bandwidth.

For every layout (N nodes x L ranks per node) the ranks are started once; each rank joins an HFReduce
communicator *and* a gloo process group, and for every tensor size runs both libraries on the same
float32 tensor, alternating which goes first, ``--repeats`` times after a warm-up. A repetition is
timed from a common barrier to the last rank's return (the slowest rank is the op's duration); the
median over repetitions gives the algorithm bandwidth, ``algbw = tensor bytes / time``.

Nodes beyond the first are Linux network namespaces on a bridge (``tests/chaos/netns.py``): ranks of
one namespace share a node, and the node leaders' bytes cross veth links over TCP. Namespaces need
root; without it only the single-node layouts run and the results say why.

The memory-traffic model (the paper's argument for why a CPU reduction is bounded by memory, not by
arithmetic): per byte of the tensor, HFReduce reads plus writes

* copy-in: every rank but a chunk's owner reads its tensor and writes it into shared memory — 2 bytes
  for each of L - 1 ranks;
* the reduction (by the chunk's owner): L inputs read, 1 output written — L + 1 bytes per node;
* copy-out: every rank reads the result and writes its tensor — 2 bytes per rank;
* across nodes (N > 1): each tree of the double binary tree carries half the bytes, and a node with
  c children in a tree adds their c partial sums to its own: c + 1 read, 1 written, per byte of
  that half.

A registered buffer (``Communicator.shared_tensor``) skips the copy-in: 3L + 1 bytes per node instead
of 5L - 1 (on one node the owner writes every rank's result itself, the same bytes as the copy-out).
Both are measured: "hfreduce" on the same private tensor gloo reduces, "registered" on a shared one.

Every node of a namespace layout shares this machine's memory, so a layout's traffic is the sum over
its nodes, and the bytes the leaders send each other count too: each tree carries half the tensor up
and back down every one of its N - 1 links, 2(N - 1) bytes sent per byte in all, and on one machine
each byte sent is copied into a socket and out of another (4 bytes of traffic) — on real nodes a NIC
moves them by DMA instead. The ceiling is ``measured all-core memory bandwidth / traffic per byte``.
The bandwidth is measured in the same run: one process per core copies (2 bytes of traffic per byte)
and adds (3 bytes) large arrays in parallel, before and after the layouts; the best rate, in
read-plus-write bytes per second, is the machine's.

Usage: ``python bench/hfreduce_bench.py [--sizes 1,16,64,256] [--layouts 1x2,1x4,2x2,3x2]
[--repeats 5] [--quick]``. Writes ``bench/results/hfreduce-<UTC timestamp>.{md,json,png}`` and the
named, versioned ``bench/results/hfreduce.json`` (``hfreduce-quick.json`` for ``--quick``, so a smoke
run never replaces a full run's figures), which :func:`load_results` reads and checks.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import ranks as launcher  # noqa: E402
from bench.ranks import Layout, free_port, namespaces_unavailable, parse_layouts, slowest_rank_median  # noqa: E402
from hfreduce.tree import double_binary_tree  # noqa: E402

__all__ = ["FORMAT_VERSION", "Layout", "ResultsError", "load_results", "main", "parse_layouts", "parse_sizes",
           "traffic_bytes_per_byte", "validate_results"]

FORMAT_VERSION = 1
"""Bumped whenever a field of ``hfreduce.json`` changes meaning, so an old file is refused, not misread."""

MIB = 1 << 20
RESULTS = ROOT / "bench" / "results"
FULL_SIZES_MIB = (1, 16, 64, 256)
QUICK_SIZES_MIB = (1, 4)
FULL_LAYOUTS = "1x2,1x4,2x2,3x2"
LIBRARIES = ("hfreduce", "registered", "gloo")
GOAL_RATIO_ONE_NODE = 4.0
GOAL_RATIO_ONE_NODE_MIN_BYTES = 16 * MIB
GOAL_RATIO_NAMESPACE_NODES = 1.5
GOAL_FRACTION_OF_CEILING = 0.5
# Back-to-back ops per timed repetition: small tensors are timed over several ops so that the
# barrier's release skew (tens of microseconds) does not dominate.
_OPS_PER_REPETITION_BYTES = 16 * MIB
_MAX_OPS_PER_REPETITION = 8
_RANK_TIMEOUT_S = 120.0
_ASSERT_RTOL = 1e-5
# Memory traffic per byte a leader sends to another namespace on this machine: read and written into
# the socket's buffer, read and written out of the peer's.
_SOCKET_COPY_BYTES = 4
TRAFFIC_MODEL = (
    "bytes read plus written per byte reduced, summed over the nodes (all on this machine): per node of L ranks, "
    "copy-in by the L - 1 ranks that do not own a chunk (read tensor, write shared memory) 2 each, the owner's "
    "reduction of L inputs L + 1, copy-out by every rank (read result, write tensor) 2 each: 5L - 1; a "
    "registered buffer skips the copy-in: 3L + 1. Across nodes, in each tree of the double binary tree (half "
    "the bytes each) a node with c > 0 children adds their partial sums to its own, c + 2, and the leaders' "
    "sockets copy every byte sent in and out (4 bytes per byte sent; 2(N - 1) bytes sent per byte reduced), "
    "which on separate machines a NIC's DMA would do. Ceiling = measured all-core memory bandwidth "
    "(read+write bytes/s) / traffic per byte.")


class ResultsError(ValueError):
    """A results file that is missing, malformed or of another format version (names the file and field)."""


def parse_sizes(text: str) -> list[int]:
    """``"1,16"`` (MiB) → sizes in bytes; each a positive number of MiB (fractions allowed, e.g. 0.25)."""
    sizes: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            mib = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"size {part!r} is not a number of MiB") from None
        size_bytes = int(mib * MIB) // 4 * 4 if math.isfinite(mib) else 0
        if size_bytes < 4:
            raise argparse.ArgumentTypeError(f"size {part!r} MiB is not a positive size of at least one float32")
        if size_bytes not in sizes:
            sizes.append(size_bytes)
    return sorted(sizes)


# -- the memory-traffic model -------------------------------------------------------------------------


def traffic_bytes_per_byte(layout: Layout, registered: bool = False) -> float:
    """Bytes read plus written on this machine per byte of the tensor (the model in the module doc)."""
    local = layout.ranks_per_node
    total = 0.0
    for node in range(layout.nodes):
        total += (3 * local + 1) if registered else (5 * local - 1)
        if layout.nodes > 1:
            for position in double_binary_tree(layout.nodes, node):
                children = len(position.children)
                if children:
                    total += 0.5 * (children + 2)
    # The namespace nodes' sockets: 2(N - 1) bytes sent per byte, each copied in and out of the kernel.
    total += _SOCKET_COPY_BYTES * 2 * (layout.nodes - 1)
    return total


def _bandwidth_process(barrier: Any, queue: Any, elements: int, rounds: int, trials: int) -> None:
    import numpy as np

    source = np.ones(elements, dtype=np.float32)
    other = np.ones(elements, dtype=np.float32)
    target = np.zeros(elements, dtype=np.float32)
    seconds: list[tuple[float, float]] = []
    for _ in range(trials):
        barrier.wait()
        started = time.perf_counter()
        for _ in range(rounds):
            np.copyto(target, source)
        copy_s = time.perf_counter() - started
        barrier.wait()
        started = time.perf_counter()
        for _ in range(rounds):
            np.add(source, other, out=target)
        seconds.append((copy_s, time.perf_counter() - started))
    queue.put(seconds)


def measure_memory_bandwidth(processes: int, array_bytes: int, rounds: int, trials: int) -> dict[str, float]:
    """All-core read+write bandwidth: one process per core copying, then adding, large arrays at once.

    A trial's rate is the bytes all processes moved over the slowest one's time; the best trial counts
    (other work on a shared machine only ever slows a trial down).
    """
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(processes)
    queue = context.Queue()
    elements = array_bytes // 4
    workers = [context.Process(target=_bandwidth_process, args=(barrier, queue, elements, rounds, trials))
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    try:
        per_process = [queue.get(timeout=300) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    moved = processes * rounds * elements * 4
    copy_rate = max(2 * moved / max(p[trial][0] for p in per_process) for trial in range(trials))
    add_rate = max(3 * moved / max(p[trial][1] for p in per_process) for trial in range(trials))
    return {"copy_bytes_per_s": copy_rate, "add_bytes_per_s": add_rate,
            "memory_bandwidth_bytes_per_s": max(copy_rate, add_rate)}


# -- one rank -------------------------------------------------------------------------------------------


def ops_per_repetition(size_bytes: int) -> int:
    return max(1, min(_MAX_OPS_PER_REPETITION, _OPS_PER_REPETITION_BYTES // size_bytes))


def run_rank(spec_path: Path) -> int:
    """One rank of a layout (torch's environment variables name it): time both libraries, write JSON."""
    import torch
    import torch.distributed as dist

    import hfreduce

    spec = json.loads(spec_path.read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout_s = float(spec["timeout_s"])
    communicator = hfreduce.Communicator(master_port=int(spec["hfreduce_port"]), timeout_s=timeout_s)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{spec['gloo_port']}",
                            rank=rank, world_size=world_size, timeout=dt.timedelta(seconds=timeout_s))

    def with_hfreduce(tensor: torch.Tensor) -> None:
        communicator.allreduce(tensor)

    def with_gloo(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    run = {"hfreduce": with_hfreduce, "registered": with_hfreduce, "gloo": with_gloo}
    seconds: dict[str, dict[str, list[float]]] = {library: {} for library in LIBRARIES}
    rank_sum = world_size * (world_size + 1) / 2
    try:
        for size_bytes in spec["sizes"]:
            private = torch.empty(size_bytes // 4, dtype=torch.float32)
            # Every rank allocates it, same size, same order (a collective); kept until shutdown.
            shared = communicator.shared_tensor((size_bytes // 4,), torch.float32)
            ops = ops_per_repetition(size_bytes)
            # Every rank starts from rank + 1: after k ops every element is sum(rank + 1) * W^(k-1).
            expected = rank_sum * world_size ** (ops - 1)
            for library in LIBRARIES:
                seconds[library][str(size_bytes)] = []
            for repetition in range(spec["warmup"] + spec["repeats"]):
                order = LIBRARIES if repetition % 2 == 0 else LIBRARIES[::-1]
                for library in order:
                    tensor = shared if library == "registered" else private
                    tensor.fill_(rank + 1)
                    dist.barrier()
                    started = time.perf_counter()
                    for _ in range(ops):
                        run[library](tensor)
                    elapsed = time.perf_counter() - started
                    low, high = tensor.min().item(), tensor.max().item()
                    if not (abs(low - expected) <= _ASSERT_RTOL * expected
                            and abs(high - expected) <= _ASSERT_RTOL * expected):
                        raise RuntimeError(f"{library} allreduce of {size_bytes} bytes gave values in [{low}, {high}],"
                                           f" expected {expected}")
                    if repetition >= spec["warmup"]:
                        seconds[library][str(size_bytes)].append(elapsed / ops)
            del private
    finally:
        dist.destroy_process_group()
        communicator.shutdown()
    out = {"rank": rank, "node": communicator.node_index, "local_rank": communicator.local_rank,
           "chunk_size_bytes": communicator.chunk_size_bytes, "slots": communicator.slots, "seconds": seconds}
    Path(spec["out"]).write_text(json.dumps(out))
    return 0


# -- one layout -----------------------------------------------------------------------------------------


def run_layout(layout: Layout, sizes: list[int], repeats: int, warmup: int, work: Path,
               log: Any) -> list[dict[str, Any]]:
    """Start the layout's ranks once (this file's :func:`run_rank`), return every rank's timings (rank order).

    Each rank is told its LOCAL_RANK and LOCAL_WORLD_SIZE as a launcher would, and HFReduce and gloo
    rendezvous on ports of their own.
    """
    # Start-up, then 0.2 s per MiB reduced per repetition (both libraries at 10 MB/s: far below either).
    budget_s = _RANK_TIMEOUT_S + 0.2 * (repeats + warmup) * sum(sizes) / MIB
    spec = {"sizes": sizes, "repeats": repeats, "warmup": warmup, "timeout_s": _RANK_TIMEOUT_S,
            "hfreduce_port": free_port(), "gloo_port": free_port()}
    return launcher.run_layout(layout, launcher.rank_program(__file__), spec, work, budget_s, log, local_ranks=True)


def cells_for_layout(layout: Layout, sizes: list[int], ranks: list[dict[str, Any]],
                     bandwidth_bytes_per_s: float) -> list[dict[str, Any]]:
    """A layout's table rows: medians over repetitions of the slowest rank's time per op."""
    traffic = traffic_bytes_per_byte(layout)
    ceiling = bandwidth_bytes_per_s / traffic
    registered_traffic = traffic_bytes_per_byte(layout, registered=True)
    registered_ceiling = bandwidth_bytes_per_s / registered_traffic
    cells: list[dict[str, Any]] = []
    for size_bytes in sizes:
        algbw: dict[str, float] = {}
        for library in LIBRARIES:
            per_rank = [rank["seconds"][library][str(size_bytes)] for rank in ranks]
            algbw[library] = size_bytes / slowest_rank_median(per_rank)
        ratio = algbw["hfreduce"] / algbw["gloo"]
        fraction = algbw["hfreduce"] / ceiling
        if layout.nodes == 1:
            ratio_goal = GOAL_RATIO_ONE_NODE if size_bytes >= GOAL_RATIO_ONE_NODE_MIN_BYTES else None
        else:
            ratio_goal = GOAL_RATIO_NAMESPACE_NODES
        cells.append({
            "layout": layout.name, "nodes": layout.nodes, "ranks_per_node": layout.ranks_per_node,
            "size_bytes": size_bytes, "hfreduce_algbw_bytes_per_s": algbw["hfreduce"],
            "gloo_algbw_bytes_per_s": algbw["gloo"], "ratio": ratio, "traffic_bytes_per_byte": traffic,
            "ceiling_algbw_bytes_per_s": ceiling, "fraction_of_ceiling": fraction,
            "goal_ratio": ratio_goal, "goal_ratio_met": None if ratio_goal is None else ratio >= ratio_goal,
            "goal_fraction_of_ceiling": GOAL_FRACTION_OF_CEILING,
            "goal_fraction_met": fraction >= GOAL_FRACTION_OF_CEILING,
            "registered_algbw_bytes_per_s": algbw["registered"],
            "registered_ratio": algbw["registered"] / algbw["gloo"],
            "registered_traffic_bytes_per_byte": registered_traffic,
            "registered_ceiling_algbw_bytes_per_s": registered_ceiling,
            "registered_fraction_of_ceiling": algbw["registered"] / registered_ceiling,
        })
    return cells


# -- the results file -----------------------------------------------------------------------------------

_CELL_NUMBERS = ("size_bytes", "hfreduce_algbw_bytes_per_s", "gloo_algbw_bytes_per_s", "ratio",
                 "traffic_bytes_per_byte", "ceiling_algbw_bytes_per_s", "fraction_of_ceiling",
                 "registered_algbw_bytes_per_s", "registered_ratio", "registered_traffic_bytes_per_byte",
                 "registered_ceiling_algbw_bytes_per_s", "registered_fraction_of_ceiling")


def _positive(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def validate_results(data: object, name: str = "hfreduce.json") -> dict[str, Any]:
    """``data`` if it is a results record of this format version; :class:`ResultsError` naming the field."""
    if not isinstance(data, dict):
        raise ResultsError(f"{name}: must hold a JSON object")
    if data.get("format_version") != FORMAT_VERSION:
        raise ResultsError(f"{name}: format_version: this reader reads version {FORMAT_VERSION}, "
                           f"not {data.get('format_version')!r}")
    machine = data.get("machine")
    if not isinstance(machine, dict):
        raise ResultsError(f"{name}: machine: must be an object")
    for field in ("cores", "memory_bandwidth_bytes_per_s"):
        if not _positive(machine.get(field)):
            raise ResultsError(f"{name}: machine.{field}: must be a positive number, not {machine.get(field)!r}")
    cells = data.get("cells")
    if not isinstance(cells, list):
        raise ResultsError(f"{name}: cells: must be a list")
    for index, cell in enumerate(cells):
        where = f"{name}: cells[{index}]"
        if not isinstance(cell, dict):
            raise ResultsError(f"{where}: must be an object")
        if not isinstance(cell.get("layout"), str):
            raise ResultsError(f"{where}.layout: must be a string such as '2x2'")
        for field in ("nodes", "ranks_per_node"):
            value = cell.get(field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ResultsError(f"{where}.{field}: must be a positive integer, not {value!r}")
        for field in _CELL_NUMBERS:
            if not _positive(cell.get(field)):
                raise ResultsError(f"{where}.{field}: must be a positive number, not {cell.get(field)!r}")
        if cell["layout"] != f"{cell['nodes']}x{cell['ranks_per_node']}":
            raise ResultsError(f"{where}.layout: {cell['layout']!r} does not match nodes x ranks_per_node")
    return data


def load_results(path: str | Path) -> dict[str, Any]:
    """The results at ``path``; refuses a missing, malformed or other-version file, naming file and field."""
    name = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ResultsError(f"{name}: no such file (make bench-hfreduce writes it)") from None
    except (OSError, ValueError) as exc:
        raise ResultsError(f"{name}: not a readable JSON file: {exc}") from None
    return validate_results(data, name)


# -- report ---------------------------------------------------------------------------------------------


def _gbs(value: float) -> str:
    return f"{value / 1e9:.2f}"


def _size(size_bytes: int) -> str:
    return f"{size_bytes / MIB:g} MiB"


def _met(flag: bool | None) -> str:
    return "-" if flag is None else ("met" if flag else "**not met**")


def markdown(record: dict[str, Any], png: str | None) -> str:
    machine = record["machine"]
    lines = [f"# HFReduce allreduce against gloo, {record['when']}{' (quick)' if record['quick'] else ''}", "",
             f"- command: `{record['command']}`",
             f"- machine: {machine['cores']} cores; all-core memory bandwidth "
             f"{_gbs(machine['memory_bandwidth_bytes_per_s'])} GB/s read+write (copy "
             f"{_gbs(machine['copy_bytes_per_s'])}, add {_gbs(machine['add_bytes_per_s'])}), the better of "
             f"two measurements in this run (before and after the layouts: "
             f"{', '.join(_gbs(b) for b in machine['memory_bandwidth_runs_bytes_per_s'])} GB/s)",
             f"- float32 SUM; {record['settings']['repeats']} repetitions after {record['settings']['warmup']} "
             f"warm-up, median of the slowest rank's time; HFReduce chunk "
             f"{record['settings']['chunk_size_bytes'] // 1024} KiB x {record['settings']['slots']} slots; "
             f"torch {record['settings']['torch']}; GB/s = 10^9 bytes/s of tensor (algbw)",
             f"- traffic model: {record['traffic_model']}",
             f"- goals: HFReduce/gloo >= {GOAL_RATIO_ONE_NODE:g} within one node at >= "
             f"{GOAL_RATIO_ONE_NODE_MIN_BYTES // MIB} MiB, >= {GOAL_RATIO_NAMESPACE_NODES:g} across namespace nodes"
             f" (every size); >= {GOAL_FRACTION_OF_CEILING:.0%} of the ceiling (every cell)"]
    lines += [f"- **{layout}** not measured: {why}" for layout, why in record["skipped"].items()]
    lines += ["", "HFReduce on the same private tensor as gloo (goals judged here), and on a registered buffer "
              "(`shared_tensor`):", "",
              "| layout | size | HFReduce GB/s | gloo GB/s | HFReduce / gloo | goal | traffic B/B "
              "| ceiling GB/s | % of ceiling | goal | registered GB/s | registered / gloo "
              "| registered % of its ceiling |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in record["cells"]:
        goal = "-" if cell["goal_ratio"] is None else f">= {cell['goal_ratio']:g}: {_met(cell['goal_ratio_met'])}"
        lines.append(
            f"| {cell['layout']} | {_size(cell['size_bytes'])} | {_gbs(cell['hfreduce_algbw_bytes_per_s'])} | "
            f"{_gbs(cell['gloo_algbw_bytes_per_s'])} | {cell['ratio']:.2f} | {goal} | "
            f"{cell['traffic_bytes_per_byte']:g} | {_gbs(cell['ceiling_algbw_bytes_per_s'])} | "
            f"{cell['fraction_of_ceiling']:.0%} | >= {GOAL_FRACTION_OF_CEILING:.0%}: "
            f"{_met(cell['goal_fraction_met'])} | {_gbs(cell['registered_algbw_bytes_per_s'])} | "
            f"{cell['registered_ratio']:.2f} | {cell['registered_fraction_of_ceiling']:.0%} |")
    if any(cell["fraction_of_ceiling"] > 1 for cell in record["cells"]):
        lines += ["", "A share above 100%: the model counts every byte as memory traffic, but a chunk just written "
                  "(1 MiB by default) can still be in the CPU's cache when the next stage reads it; or other work "
                  "on the machine slowed both bandwidth measurements. Either way the ceiling is understated there."]
    if png is not None:
        lines += ["", f"![allreduce algbw against tensor size]({png})"]
    return "\n".join(lines) + "\n"


def plot(record: dict[str, Any], path: Path) -> bool:
    """Bandwidth against size: one colour per layout; HFReduce solid, registered dash-dot, gloo dashed,
    the copying path's ceiling dotted."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    layouts: list[str] = []
    for cell in record["cells"]:
        if cell["layout"] not in layouts:
            layouts.append(cell["layout"])
    fig, ax = plt.subplots(figsize=(9, 6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, layout in enumerate(layouts):
        cells = [c for c in record["cells"] if c["layout"] == layout]
        sizes = [c["size_bytes"] / MIB for c in cells]
        colour = colours[index % len(colours)]
        ax.plot(sizes, [c["hfreduce_algbw_bytes_per_s"] / 1e9 for c in cells], "o-", color=colour,
                label=f"HFReduce {layout}")
        ax.plot(sizes, [c["registered_algbw_bytes_per_s"] / 1e9 for c in cells], "^-.", color=colour,
                label=f"HFReduce registered {layout}")
        ax.plot(sizes, [c["gloo_algbw_bytes_per_s"] / 1e9 for c in cells], "s--", color=colour,
                label=f"gloo {layout}")
        ax.plot(sizes, [c["ceiling_algbw_bytes_per_s"] / 1e9 for c in cells], ":", color=colour, linewidth=1,
                label=f"memory ceiling {layout}")
    ax.set_xscale("log", base=2)
    ticks = sorted({c["size_bytes"] / MIB for c in record["cells"]})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("tensor size (MiB, float32)")
    ax.set_ylabel("allreduce algbw (GB/s, higher is better)")
    ax.set_title("HFReduce and gloo allreduce (layout = nodes x ranks per node)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_sizes, help="tensor sizes in MiB, comma-separated (default "
                        f"{','.join(map(str, FULL_SIZES_MIB))}; --quick: {','.join(map(str, QUICK_SIZES_MIB))})")
    parser.add_argument("--layouts", type=parse_layouts, help=f"NODESxRANKS, comma-separated (default "
                        f"{FULL_LAYOUTS}); nodes beyond one are network namespaces")
    parser.add_argument("--repeats", type=int, help="timed repetitions per library and size (default 5; quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer repetitions (a smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go (default bench/results)")
    parser.add_argument("--rank-spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_spec is not None:
        return run_rank(args.rank_spec)
    sizes: list[int] = args.sizes or [int(mib * MIB) for mib in (QUICK_SIZES_MIB if args.quick else FULL_SIZES_MIB)]
    layouts: list[Layout] = args.layouts or parse_layouts(FULL_LAYOUTS)
    repeats: int = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    if repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1 and --warmup at least 0")
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {message}", flush=True)

    import torch

    cores = os.cpu_count() or 1

    def bandwidth() -> dict[str, float]:
        log(f"memory bandwidth, {cores} processes ...")
        measured = measure_memory_bandwidth(cores, (32 if args.quick else 128) * MIB, 4, 3)
        log(f"  {_gbs(measured['memory_bandwidth_bytes_per_s'])} GB/s read+write")
        return measured

    # Measured before and after the layouts, the better kept: the ceiling is an upper bound, and on a
    # shared machine other work only ever lowers a measurement.
    before = bandwidth()
    work = Path(f"/tmp/hfreduce-bench-{os.getpid()}")
    skipped: dict[str, str] = {}
    cells: list[dict[str, Any]] = []
    measured: list[tuple[Layout, list[dict[str, Any]]]] = []
    chunk_slots: tuple[int, int] | None = None
    unavailable = namespaces_unavailable()
    try:
        for layout in layouts:
            if layout.nodes > 1 and unavailable is not None:
                skipped[layout.name] = unavailable
                log(f"{layout.name}: skipped, {unavailable}")
                continue
            log(f"{layout.name} ({layout.describe()}) ...")
            try:
                ranks = run_layout(layout, sizes, repeats, args.warmup, work, log)
            except Exception as exc:  # one layout failing must not lose the others' figures
                skipped[layout.name] = f"failed: {type(exc).__name__}: {exc}"[:2000]
                log(f"  {layout.name} FAILED: {skipped[layout.name]}")
                continue
            chunk_slots = (ranks[0]["chunk_size_bytes"], ranks[0]["slots"])
            measured.append((layout, ranks))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    after = bandwidth()
    machine: dict[str, Any] = {"cores": cores, **max(before, after, key=lambda m: m["memory_bandwidth_bytes_per_s"]),
                               "memory_bandwidth_runs_bytes_per_s": [before["memory_bandwidth_bytes_per_s"],
                                                                     after["memory_bandwidth_bytes_per_s"]]}
    for layout, ranks in measured:
        for cell in cells_for_layout(layout, sizes, ranks, machine["memory_bandwidth_bytes_per_s"]):
            cells.append(cell)
            log(f"{layout.name} {_size(cell['size_bytes'])}: HFReduce {_gbs(cell['hfreduce_algbw_bytes_per_s'])} "
                f"GB/s, registered {_gbs(cell['registered_algbw_bytes_per_s'])} GB/s, gloo "
                f"{_gbs(cell['gloo_algbw_bytes_per_s'])} GB/s, x{cell['ratio']:.2f}, "
                f"{cell['fraction_of_ceiling']:.0%} of ceiling")
    if chunk_slots is None:
        import hfreduce

        chunk_slots = (hfreduce.DEFAULT_CHUNK_SIZE_BYTES, hfreduce.DEFAULT_SLOTS)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    command = " ".join(["python bench/hfreduce_bench.py", *(sys.argv[1:] if argv is None else argv)])
    record: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "kind": "hfreduce-allreduce", "when": stamp, "quick": args.quick,
        "command": command, "machine": machine,
        "settings": {"dtype": "float32", "op": "sum", "repeats": repeats, "warmup": args.warmup,
                     "chunk_size_bytes": chunk_slots[0], "slots": chunk_slots[1], "torch": torch.__version__,
                     "omp_num_threads": 1},
        "traffic_model": TRAFFIC_MODEL,
        "goals": {"ratio_one_node": GOAL_RATIO_ONE_NODE, "ratio_one_node_min_size_bytes": GOAL_RATIO_ONE_NODE_MIN_BYTES,
                  "ratio_namespace_nodes": GOAL_RATIO_NAMESPACE_NODES,
                  "fraction_of_ceiling": GOAL_FRACTION_OF_CEILING},
        "skipped": skipped, "cells": cells, "seconds": round(time.monotonic() - started, 1)}
    validate_results(record)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    png = f"hfreduce-{stamp}.png" if cells and plot(record, out / f"hfreduce-{stamp}.png") else None
    text = markdown(record, png)
    (out / f"hfreduce-{stamp}.md").write_text(text)
    (out / f"hfreduce-{stamp}.json").write_text(json.dumps(record, indent=2) + "\n")
    named = out / ("hfreduce-quick.json" if args.quick else "hfreduce.json")
    named.write_text(json.dumps(record, indent=2) + "\n")
    print(text)
    log(f"wrote {out / f'hfreduce-{stamp}.md'} and {named}")
    return 1 if any(why.startswith("failed") for why in skipped.values()) or not cells else 0


if __name__ == "__main__":
    sys.exit(main())

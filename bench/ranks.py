"""Start a multi-rank benchmark's ranks as processes, one node here and the others as network namespaces.

The multi-rank benchmarks (``hfreduce_bench``, ``haiscale_ddp_bench``) time collectives across a
*layout* of N nodes x L ranks per node. What they share lives here, so that both start, place, wait
for and stop their ranks the same way:

* :class:`Layout` and :func:`parse_layouts` (``"1x2,2x2"``);
* :func:`run_layout`: every rank of a layout as a process running the benchmark's own rank program
  with its own spec; the first node on this host over loopback, further nodes as Linux network
  namespaces on a bridge (``tests/chaos/netns.py``, gloo told the interface with
  ``GLOO_SOCKET_IFNAME``); a deadline for all of them; each rank's JSON output; a check that the
  rendezvous grouped the ranks into the nodes the layout says (otherwise the figures would belong to
  another layout); everything stopped at the end, whatever happened;
* :func:`slowest_rank_median`: a repetition lasts as long as its slowest rank, and the median over
  repetitions is the figure (robust to one repetition disturbed by other work on a shared machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["Layout", "free_port", "namespaces_unavailable", "parse_layouts", "rank_program", "run_layout",
           "slowest_rank_median", "stop"]

_POLL_S = 0.2
_LOG_TAIL_LINES = 6


@dataclass(frozen=True)
class Layout:
    """``nodes`` nodes of ``ranks_per_node`` ranks each; nodes beyond one are network namespaces."""

    nodes: int
    ranks_per_node: int

    @property
    def name(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node}"

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        if self.nodes == 1:
            return f"1 node x {self.ranks_per_node} ranks"
        return f"{self.nodes} namespace nodes x {self.ranks_per_node} ranks"


def parse_layouts(text: str) -> list[Layout]:
    """``"1x2,2x2"`` → layouts; anything else is a clear error (argparse shows it)."""
    layouts: list[Layout] = []
    for part in (p.strip() for p in text.split(",")):
        nodes_text, sep, ranks_text = part.partition("x")
        if not sep or not nodes_text.isdigit() or not ranks_text.isdigit():
            raise argparse.ArgumentTypeError(f"layout {part!r} is not NODESxRANKS (such as 2x2)")
        layout = Layout(int(nodes_text), int(ranks_text))
        if layout.nodes < 1 or layout.ranks_per_node < 1 or layout.world_size < 2:
            raise argparse.ArgumentTypeError(f"layout {part!r} needs at least 1 node, 1 rank each, 2 ranks in all")
        if layout not in layouts:
            layouts.append(layout)
    return layouts


def free_port() -> int:
    """A TCP port free on this host now (the ranks bind it moments later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def namespaces_unavailable() -> str | None:
    """Why namespace nodes cannot run here (the results name the reason), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root to measure namespace nodes)"
    if not shutil.which("ip"):
        return "network namespaces need iproute2 (the ip command)"
    return None


def stop(proc: subprocess.Popen[Any]) -> None:
    """Kill a rank and whatever it started (each rank leads its own process group)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def slowest_rank_median(per_rank: Sequence[Sequence[float]]) -> float:
    """The median over repetitions of the slowest rank's time (``per_rank[rank][repetition]``)."""
    return float(statistics.median(max(times) for times in zip(*per_rank, strict=True)))


def run_layout(layout: Layout, program: Sequence[str], spec: Mapping[str, Any], work: Path, budget_s: float,
               log: Callable[[str], None] | None = None, *, local_ranks: bool,
               env: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Start the layout's ranks once, wait for them, return every rank's JSON output (rank order).

    Each rank runs ``program`` + ``[path of its spec]``: ``spec`` with ``"out"`` set to where the rank
    writes its JSON, which must name the ``node`` and ``local_rank`` the rendezvous gave it. Ranks get
    RANK, WORLD_SIZE, MASTER_ADDR and GLOO_SOCKET_IFNAME, plus ``env``. ``local_ranks``: also tell each
    rank LOCAL_RANK and LOCAL_WORLD_SIZE as a launcher would; otherwise both are removed, so that the
    rendezvous alone finds which ranks share a node. A rank that fails, or any still running after
    ``budget_s``, fails the layout (RuntimeError with the tail of its log).
    """
    work.mkdir(parents=True, exist_ok=True)
    outs = [work / f"{layout.name}-rank{rank}.json" for rank in range(layout.world_size)]
    logs = [work / f"{layout.name}-rank{rank}.log" for rank in range(layout.world_size)]
    base_env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", WORLD_SIZE=str(layout.world_size))
    base_env.update(env or {})
    if local_ranks:
        base_env["LOCAL_WORLD_SIZE"] = str(layout.ranks_per_node)
    else:
        for variable in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            base_env.pop(variable, None)
    lab = None
    procs: list[subprocess.Popen[Any]] = []
    try:
        if layout.nodes == 1:
            master, interface = "127.0.0.1", "lo"
        else:
            from tests.chaos.netns import NetnsLab

            lab = NetnsLab()
            addresses = lab.create([f"n{node}" for node in range(layout.nodes)])
            master, interface = addresses["n0"], "eth0"
        for rank in range(layout.world_size):
            node, local_rank = divmod(rank, layout.ranks_per_node)
            rank_spec = work / f"{layout.name}-spec{rank}.json"
            rank_spec.write_text(json.dumps({**spec, "out": str(outs[rank])}))
            rank_env = dict(base_env, RANK=str(rank), MASTER_ADDR=master, GLOO_SOCKET_IFNAME=interface)
            if local_ranks:
                rank_env["LOCAL_RANK"] = str(local_rank)
            args = [*program, str(rank_spec)]
            outs[rank].unlink(missing_ok=True)
            logs[rank].unlink(missing_ok=True)
            if lab is not None:
                procs.append(lab.spawn(f"n{node}", args, rank_env, logs[rank]))
            else:
                with logs[rank].open("ab") as out:
                    procs.append(subprocess.Popen(args, env=rank_env, stdout=out, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + budget_s
        while any(proc.poll() is None for proc in procs):
            if any(proc.poll() not in (None, 0) for proc in procs) or time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        failures: list[str] = []
        for rank, proc in enumerate(procs):
            if proc.poll() is None:
                failures.append(f"rank {rank} did not finish within {budget_s:.0f} s")
            elif proc.returncode != 0:
                tail = (logs[rank].read_text(errors="replace").strip().splitlines()[-_LOG_TAIL_LINES:]
                        if logs[rank].exists() else [])
                failures.append(f"rank {rank} exited with status {proc.returncode}: " + " | ".join(tail))
        if failures:
            raise RuntimeError("; ".join(failures))
        ranks = [json.loads(out.read_text()) for out in outs]
        for rank, got in enumerate(ranks):
            # The figures belong to the layout only if the rendezvous grouped the ranks as intended.
            if (got["node"], got["local_rank"]) != divmod(rank, layout.ranks_per_node):
                raise RuntimeError(f"rank {rank} ran as node {got['node']} local rank {got['local_rank']}, not as "
                                   f"layout {layout.name} places it")
        return ranks
    finally:
        for proc in procs:
            stop(proc)
        if lab is not None:
            lab.destroy()
        if log is not None:
            log(f"  {layout.name}: ranks stopped")


def rank_program(script: str | Path) -> list[str]:
    """The command that runs ``script``'s rank program (its hidden ``--rank-spec PATH`` option)."""
    return [sys.executable, str(Path(script).resolve()), "--rank-spec"]

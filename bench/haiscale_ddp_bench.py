"""haiscale's DistributedDataParallel (HFReduce) against torch's DistributedDataParallel on gloo.

For every layout (N nodes x L ranks per node) the ranks are started once; each rank joins the job
with ``haiscale.init()`` (torch's default group on gloo, and an HFReduce group) and, for every model,
wraps one copy in haiscale's DDP and another in torch's DDP (default group: gloo; the same
``bucket_cap_mb`` and ``gradient_as_bucket_view=True``, torch's fastest setting), and keeps a third,
unwrapped, as the compute-only baseline ("local": the same step with no communication). A
repetition runs ``--steps`` training steps of one of them — ``zero_grad()``, forward, loss,
backward, ``SGD.step()`` — timed from a common barrier to the last rank's return (the slowest rank is
the step's duration); libraries alternate which goes first; the median over repetitions is the
step time. After timing, the two DDP copies (trained on the same data the same number of steps) must
hold the same parameters to within float32 rounding, or the run fails: figures of a DDP that trains
something else would mean nothing.

Models: ``wide_mlp()`` (about 55 M parameters, 8 samples per rank: gradients dwarf compute, the
communication-heavy case) and a small ByteGPT (about 0.9 M parameters, 8 sequences of 64 bytes per
rank: compute-heavy); ``--batch`` changes the samples per rank. Nodes beyond the first are Linux
network namespaces on a bridge (``tests/chaos/netns.py``); without root only single-node layouts run
and the results say why.

Usage: ``python bench/haiscale_ddp_bench.py [--layouts 1x4,2x2] [--models mlp,gpt] [--repeats 5]
[--steps 3] [--batch 8] [--quick]``. Writes ``bench/results/haiscale-ddp-<UTC timestamp>.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import ranks as launcher  # noqa: E402
from bench.ranks import Layout, free_port, namespaces_unavailable, parse_layouts, slowest_rank_median  # noqa: E402

__all__ = ["FORMAT_VERSION", "LIBRARIES", "MODELS", "ResultsError", "cells_for_layout", "main", "parse_models",
           "validate_results"]

FORMAT_VERSION = 1
RESULTS = ROOT / "bench" / "results"
MODELS = ("mlp", "gpt")
LIBRARIES = ("haiscale", "torch", "local")
FULL_LAYOUTS = "1x4,2x2"
BUCKET_CAP_MB = 25.0
BATCH_PER_RANK = 8
GOALS = {"mlp": 1.5, "gpt": 1.0}
"""torch DDP step time / haiscale DDP step time wanted: a clear lead where communication dominates,
no loss where compute does."""
# float32 rounding: HFReduce adds the ranks' gradients and divides, torch's DDP divides each by the
# world size and adds; a few SGD steps at this learning rate keep the difference far below this.
_PARAM_TOLERANCE = 1e-5
_LEARNING_RATE = 1e-3
_RANK_TIMEOUT_S = 120.0


class ResultsError(ValueError):
    """A results record that is malformed or of another format version (names the field)."""


def parse_models(text: str) -> list[str]:
    models: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part not in MODELS:
            raise argparse.ArgumentTypeError(f"model {part!r} is not one of {', '.join(MODELS)}")
        if part not in models:
            models.append(part)
    return models


# -- one rank -------------------------------------------------------------------------------------------


def _model_and_batch(name: str, rank: int, quick: bool, batch: int) -> tuple[Any, Any, Any]:
    """The model's constructor, this rank's batch and the loss (the same data on every run)."""
    import torch
    import torch.nn.functional as F

    from haiscale.models import ByteGPT, GPTConfig, lm_loss, wide_mlp

    generator = torch.Generator().manual_seed(1000 + rank)
    if name == "mlp":
        width = 1024 if quick else 4096
        inputs = torch.randn(batch, 1024, generator=generator)
        targets = torch.randn(batch, 16, generator=generator)
        return (lambda: wide_mlp(width=width)), (inputs, targets), F.mse_loss
    config = GPTConfig(block_size=64, n_layer=2 if quick else 4, n_head=4, n_embd=64 if quick else 128)
    tokens = torch.randint(0, 256, (batch, config.block_size + 1), generator=generator)
    return (lambda: ByteGPT(config, seed=0)), (tokens[:, :-1], tokens[:, 1:]), lm_loss


def run_rank(spec_path: Path) -> int:
    """One rank of a layout (torch's environment variables name it): time every library, write JSON."""
    import torch
    import torch.distributed as dist

    import haiscale
    from haiscale.ddp import DistributedDataParallel

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    ctx = haiscale.init(timeout_s=float(spec["timeout_s"]))
    rank = ctx.rank
    seconds: dict[str, dict[str, list[float]]] = {}
    differences: dict[str, float] = {}
    parameters: dict[str, int] = {}
    try:
        for name in spec["models"]:
            make, (inputs, targets), loss_fn = _model_and_batch(name, rank, spec["quick"], spec["batch"])
            models = {"haiscale": DistributedDataParallel(make(), bucket_cap_mb=BUCKET_CAP_MB),
                      "torch": torch.nn.parallel.DistributedDataParallel(make(), bucket_cap_mb=BUCKET_CAP_MB,
                                                                         gradient_as_bucket_view=True),
                      "local": make()}
            parameters[name] = sum(p.numel() for p in models["local"].parameters())
            optimizers = {library: torch.optim.SGD(model.parameters(), lr=_LEARNING_RATE)
                          for library, model in models.items()}

            def step(library: str) -> None:
                model, optimizer = models[library], optimizers[library]  # noqa: B023, F821 (this iteration)
                optimizer.zero_grad()
                torch.autograd.backward(loss_fn(model(inputs), targets))  # noqa: B023
                optimizer.step()

            seconds[name] = {library: [] for library in LIBRARIES}
            for repetition in range(spec["warmup"] + spec["repeats"]):
                order = LIBRARIES if repetition % 2 == 0 else LIBRARIES[::-1]
                for library in order:
                    dist.barrier()
                    started = time.perf_counter()
                    for _ in range(spec["steps"]):
                        step(library)
                    elapsed = time.perf_counter() - started
                    if repetition >= spec["warmup"]:
                        seconds[name][library].append(elapsed / spec["steps"])
            ours = list(models["haiscale"].parameters())
            theirs = list(models["torch"].parameters())
            differences[name] = max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))
            del models, optimizers, ours, theirs
            gc.collect()
    finally:
        comm = ctx.dp_comm
        node, local_rank = comm.node_index, comm.local_rank
        haiscale.destroy()
    out = {"rank": rank, "node": node, "local_rank": local_rank, "seconds": seconds,
           "max_param_difference": differences, "parameters": parameters}
    Path(spec["out"]).write_text(json.dumps(out))
    return 0


# -- one layout -----------------------------------------------------------------------------------------


def run_layout(layout: Layout, spec: dict[str, Any], work: Path, budget_s: float,
               log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Start the layout's ranks once (this file's :func:`run_rank`), return every rank's timings (rank order).

    ``haiscale.init()`` rendezvouses on MASTER_PORT and finds which ranks share a node itself, so no
    LOCAL_RANK or LOCAL_WORLD_SIZE is passed on.
    """
    return launcher.run_layout(layout, launcher.rank_program(__file__), spec, work, budget_s, log,
                               local_ranks=False, env={"MASTER_PORT": str(free_port())})


def cells_for_layout(layout: Layout, models: list[str], ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A layout's table rows: per model and library, the median over repetitions of the slowest rank's
    step time; refuses a run whose two DDPs ended with different parameters."""
    cells: list[dict[str, Any]] = []
    for model in models:
        step_s: dict[str, float] = {}
        for library in LIBRARIES:
            step_s[library] = slowest_rank_median([rank["seconds"][model][library] for rank in ranks])
        difference = max(rank["max_param_difference"][model] for rank in ranks)
        if not difference <= _PARAM_TOLERANCE:
            raise RuntimeError(f"{layout.name} {model}: haiscale's and torch's DDP ended {difference:.3g} apart "
                               f"(more than float32 rounding, {_PARAM_TOLERANCE:g}): not timing the same training")
        speedup = step_s["torch"] / step_s["haiscale"]
        cells.append({
            "layout": layout.name, "nodes": layout.nodes, "ranks_per_node": layout.ranks_per_node, "model": model,
            "parameters": ranks[0]["parameters"][model], "haiscale_step_s": step_s["haiscale"],
            "torch_step_s": step_s["torch"], "local_step_s": step_s["local"], "speedup": speedup,
            "haiscale_overhead_s": step_s["haiscale"] - step_s["local"],
            "torch_overhead_s": step_s["torch"] - step_s["local"], "goal": GOALS[model],
            "goal_met": speedup >= GOALS[model], "max_param_difference": difference})
    return cells


_CELL_NUMBERS = ("haiscale_step_s", "torch_step_s", "local_step_s", "speedup", "parameters")


def validate_results(data: object, name: str = "haiscale-ddp.json") -> dict[str, Any]:
    """``data`` if it is a results record of this format version; :class:`ResultsError` naming the field."""
    if not isinstance(data, dict):
        raise ResultsError(f"{name}: must hold a JSON object")
    if data.get("format_version") != FORMAT_VERSION:
        raise ResultsError(f"{name}: format_version: this reader reads version {FORMAT_VERSION}, "
                           f"not {data.get('format_version')!r}")
    cells = data.get("cells")
    if not isinstance(cells, list):
        raise ResultsError(f"{name}: cells: must be a list")
    for index, cell in enumerate(cells):
        where = f"{name}: cells[{index}]"
        if not isinstance(cell, dict):
            raise ResultsError(f"{where}: must be an object")
        if cell.get("model") not in MODELS:
            raise ResultsError(f"{where}.model: must be one of {', '.join(MODELS)}, not {cell.get('model')!r}")
        for field in _CELL_NUMBERS:
            value = cell.get(field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ResultsError(f"{where}.{field}: must be a positive number, not {value!r}")
    return data


# -- report ---------------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def markdown(record: dict[str, Any]) -> str:
    settings = record["settings"]
    lines = [f"# haiscale DDP against torch DDP on gloo, {record['when']}{' (quick)' if record['quick'] else ''}", "",
             f"- command: `{record['command']}`",
             f"- machine: {record['machine']['cores']} cores, load average {record['machine']['load_before']} "
             f"before the run, {record['machine']['load_after']} after",
             f"- step = zero_grad, forward, loss, backward, SGD step; {settings['repeats']} repetitions of "
             f"{settings['steps']} steps after {settings['warmup']} warm-up, median of the slowest rank's time; "
             f"{settings['batch_per_rank']} samples per rank; bucket_cap_mb {settings['bucket_cap_mb']:g}, "
             f"gradient_as_bucket_view on both; one torch thread per rank; torch {settings['torch']}",
             "- speedup = torch DDP step time / haiscale DDP step time; local = the same step without DDP "
             "(compute only), overhead = DDP step - local step",
             f"- goals: speedup >= {GOALS['mlp']:g} on the MLP, >= {GOALS['gpt']:g} on ByteGPT"]
    lines += [f"- **{layout}** not measured: {why}" for layout, why in record["skipped"].items()]
    lines += ["", "| layout | model | parameters | haiscale ms | torch ms | local ms | speedup | goal "
              "| haiscale overhead ms | torch overhead ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cell in record["cells"]:
        goal = f">= {cell['goal']:g}: {'met' if cell['goal_met'] else '**not met**'}"
        lines.append(f"| {cell['layout']} | {cell['model']} | {cell['parameters'] / 1e6:.1f} M | "
                     f"{_ms(cell['haiscale_step_s'])} | {_ms(cell['torch_step_s'])} | {_ms(cell['local_step_s'])} | "
                     f"{cell['speedup']:.2f} | {goal} | {_ms(cell['haiscale_overhead_s'])} | "
                     f"{_ms(cell['torch_overhead_s'])} |")
    return "\n".join(lines) + "\n"


def _load() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", type=parse_layouts, help=f"NODESxRANKS, comma-separated (default "
                        f"{FULL_LAYOUTS}; --quick: 1x2); nodes beyond one are network namespaces")
    parser.add_argument("--models", type=parse_models, default=list(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)} (default: both)")
    parser.add_argument("--repeats", type=int, help="timed repetitions per library and model (default 5; quick 2)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per repetition (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    parser.add_argument("--batch", type=int, default=BATCH_PER_RANK,
                        help=f"samples per rank and step (default {BATCH_PER_RANK}; fewer: communication weighs more)")
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer repetitions (a smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go (default bench/results)")
    parser.add_argument("--rank-spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_spec is not None:
        return run_rank(args.rank_spec)
    layouts: list[Layout] = args.layouts or parse_layouts("1x2" if args.quick else FULL_LAYOUTS)
    repeats: int = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    if repeats < 1 or args.steps < 1 or args.batch < 1 or args.warmup < 0:
        parser.error("--repeats, --steps and --batch must be at least 1, --warmup at least 0")
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {message}", flush=True)

    import torch

    load_before = _load()
    spec = {"models": args.models, "repeats": repeats, "steps": args.steps, "warmup": args.warmup,
            "batch": args.batch,
            "quick": args.quick, "timeout_s": _RANK_TIMEOUT_S}
    # Start-up, then up to 5 s per step (the MLP's on a loaded machine) for every library.
    budget_s = _RANK_TIMEOUT_S + 5.0 * len(args.models) * len(LIBRARIES) * (repeats + args.warmup) * args.steps
    work = Path(f"/tmp/haiscale-ddp-bench-{os.getpid()}")
    skipped: dict[str, str] = {}
    cells: list[dict[str, Any]] = []
    unavailable = namespaces_unavailable()
    try:
        for layout in layouts:
            if layout.nodes > 1 and unavailable is not None:
                skipped[layout.name] = unavailable
                log(f"{layout.name}: skipped, {unavailable}")
                continue
            log(f"{layout.name} ({layout.describe()}) ...")
            try:
                ranks = run_layout(layout, spec, work, budget_s, log)
                layout_cells = cells_for_layout(layout, args.models, ranks)
            except Exception as exc:  # one layout failing must not lose the others' figures
                skipped[layout.name] = f"failed: {type(exc).__name__}: {exc}"[:2000]
                log(f"  {layout.name} FAILED: {skipped[layout.name]}")
                continue
            for cell in layout_cells:
                log(f"  {cell['model']}: haiscale {_ms(cell['haiscale_step_s'])} ms, torch "
                    f"{_ms(cell['torch_step_s'])} ms, local {_ms(cell['local_step_s'])} ms, x{cell['speedup']:.2f}")
            cells += layout_cells
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    command = " ".join(["python bench/haiscale_ddp_bench.py", *(sys.argv[1:] if argv is None else argv)])
    record: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "kind": "haiscale-ddp-step", "when": stamp, "quick": args.quick,
        "command": command,
        "machine": {"cores": os.cpu_count() or 1, "load_before": load_before, "load_after": _load()},
        "settings": {"repeats": repeats, "steps": args.steps, "warmup": args.warmup,
                     "batch_per_rank": args.batch, "bucket_cap_mb": BUCKET_CAP_MB, "torch": torch.__version__,
                     "learning_rate": _LEARNING_RATE, "param_tolerance": _PARAM_TOLERANCE},
        "goals": GOALS, "skipped": skipped, "cells": cells, "seconds": round(time.monotonic() - started, 1)}
    validate_results(record)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(record)
    (out / f"haiscale-ddp-{stamp}.md").write_text(text)
    (out / f"haiscale-ddp-{stamp}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(text)
    log(f"wrote {out / f'haiscale-ddp-{stamp}.md'}")
    return 1 if any(why.startswith("failed") for why in skipped.values()) or not cells else 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of an FSDP test job: ``python -m tests.haiscale.fsdp_job SCENARIO DIR``.

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment (tests/hfreduce/runner.py's
``rank_env``); the rank prints one JSON line that the test collects. Scenarios:

``train``
    A tiny ByteGPT trained fully sharded (units: embedding, each block, head) for ``STEPS`` Adam
    steps on this rank's share of each global batch; the sharded parameters and optimizer state are
    saved to DIR (one file per rank) with the full parameters, then one more step is taken and saved.
    Ranks built with other weights start from rank 0's. Rank 0 also trains the same model in one
    process on the whole batches (the reference) and on only its half of them (a run that must
    differ), and every rank trains it with torch's FSDP2
    (``fully_shard``) over gloo. Reports the largest differences, and the trace of one step with and
    without prefetch and resharding (for the memory and overlap checks).
``load``
    Whatever world size this job has: rebuilds, from the pieces ``train`` saved, Shards of exactly
    this rank's ranges, loads parameters and optimizer state into a differently initialised model,
    and takes the step ``train`` took after saving; reports the differences to ``train``'s full
    parameters before and after that step (:func:`restore_and_continue`, which the one-rank test
    runs in its own process, also takes the step without the optimizer state).
``dead``
    After one step, rank 1 dies (SIGKILL); rank 0's next forward must fail with a clear error
    within the job's timeout.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

import haiscale
import hfreduce
from haiscale.fsdp import FSDPEvent, FullyShardedDataParallel
from haiscale.models import Block, ByteGPT, Embedding, GPTConfig, Head, lm_loss
from haiscale.sharding import Shard
from tests.hfreduce.runner import run_rank

CONFIG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16)
WRAP = (Embedding, Block, Head)
STEPS = 3
GLOBAL_BATCH = 6  # divides among 1, 2 and 3 ranks
LR = 1e-2
TIMEOUT_S = 120.0  # rendezvous included: on a loaded machine ranks start far apart
DEAD_TIMEOUT_S = 4.0


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank and in every run."""
    data = torch.randint(0, 256, (GLOBAL_BATCH, CONFIG.block_size + 1),
                         generator=torch.Generator().manual_seed(1000 + step))
    return data[:, :-1], data[:, 1:]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, world: int) -> None:
    inputs, targets = batch(step)
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    torch.autograd.backward(lm_loss(model(inputs[mine]), targets[mine]))
    optimizer.step()
    optimizer.zero_grad()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def single_process(steps: int, rank_share: int | None = None) -> dict[str, torch.Tensor]:
    """The reference: one process on the whole global batches (or on one rank's share of 2)."""
    model = ByteGPT(CONFIG, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        if rank_share is None:
            train_step(model, optimizer, step, 0, 1)
        else:
            train_step(model, optimizer, step, rank_share, 2)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def fsdp2(steps: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    """torch's own fully sharded data parallel (FSDP2) over gloo, the same units and data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    model = ByteGPT(CONFIG, seed=0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        train_step(model, optimizer, step, rank, world)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        out[name] = param.full_tensor().detach().clone()
    return out


def starts_from_rank_0(rank: int) -> bool:
    """Ranks built with different weights and buffers all start from rank 0's (parameters and buffers
    are broadcast when the model is wrapped)."""
    model = ByteGPT(CONFIG, seed=rank)
    model.register_buffer("scale", torch.full((3,), float(rank)))
    sharded = FullyShardedDataParallel(model, wrap=WRAP)
    expected = dict(ByteGPT(CONFIG, seed=0).named_parameters())
    full = sharded.full_state_dict()
    same = all(torch.equal(full[name], expected[name]) for name in expected)
    scale = model.get_buffer("scale")
    return same and bool((scale == 0).all())


def traced_step(rank: int, world: int, **options: Any) -> dict[str, Any]:
    """The second step of a fresh model (the first one fixes the forward order), traced."""
    events: list[FSDPEvent] = []
    model = FullyShardedDataParallel(ByteGPT(CONFIG, seed=0), wrap=WRAP, trace=events.append, **options)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    train_step(model, optimizer, 0, rank, world)
    events.clear()
    train_step(model, optimizer, 1, rank, world)
    unit_bytes = {name: shard.numel() * world * shard.element_size()
                  for name, shard in zip(model.unit_names(), model.flat_shards, strict=True)}
    return {"events": [[e.kind, e.unit, e.gathered_bytes] for e in events], "unit_bytes": unit_bytes,
            "order": model.unit_names()}


def train(result: dict[str, Any], directory: Path) -> None:
    ctx = haiscale.init(timeout_s=TIMEOUT_S)
    try:
        rank, world = ctx.dp_rank, ctx.data_size
        model = FullyShardedDataParallel(ByteGPT(CONFIG, seed=0), wrap=WRAP)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        for step in range(STEPS):
            train_step(model, optimizer, step, rank, world)
        saved = model.full_state_dict()
        torch.save({"params": model.sharded_state_dict(), "optim": model.sharded_optimizer_state_dict(optimizer)},
                   directory / f"rank{rank}.pt")
        train_step(model, optimizer, STEPS, rank, world)
        after = model.full_state_dict()
        theirs = fsdp2(STEPS + 1, rank, world)
        result["vs_fsdp2"] = max_diff(after, theirs)
        if rank == 0:
            torch.save({"saved": saved, "after": after}, directory / "full.pt")
            result["vs_single"] = max_diff(after, single_process(STEPS + 1))
            result["half_vs_single"] = max_diff(single_process(STEPS + 1, rank_share=0),
                                                single_process(STEPS + 1))
        result["synced"] = starts_from_rank_0(rank)
        result["traced"] = traced_step(rank, world)
        result["traced_no_prefetch"] = traced_step(rank, world, prefetch=False)
        result["traced_no_reshard"] = traced_step(rank, world, reshard_after_forward=False)
    finally:
        haiscale.destroy()


def rebuild(pieces: list[Shard], start: int, end: int) -> Shard:
    """A Shard of exactly ``[start, end)`` of one parameter, cut out of the pieces other ranks saved."""
    flat = torch.empty(pieces[0].numel, dtype=pieces[0].local.dtype)
    covered = torch.zeros(pieces[0].numel, dtype=torch.bool)
    for piece in pieces:
        flat[piece.flat_offset:piece.flat_end] = piece.local
        covered[piece.flat_offset:piece.flat_end] = True
    assert bool(covered.all()), "the saved pieces do not cover the parameter"
    return Shard(flat[start:end].clone(), pieces[0].global_shape, start)


def restore_and_continue(directory: Path, rank: int, world: int, comm: hfreduce.Communicator | None = None,
                         without_optimizer_state: bool = True) -> dict[str, Any]:
    """Load ``train``'s pieces resharded to this job's ranks, check, take the next step; the findings
    (``without_optimizer_state``: also the same step from the parameters alone, which must differ)."""
    found: dict[str, Any] = {}
    saved = [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(2)]
    full = torch.load(directory / "full.pt", weights_only=False)
    # Other initial weights than train's: only loading can make them match.
    model = FullyShardedDataParallel(ByteGPT(CONFIG, seed=1), wrap=WRAP, comm=comm)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    ranges = model.shard_ranges()
    params = {name: rebuild([s["params"][name] for s in saved], *ranges[name]) for name in ranges}
    optim: dict[str, dict[str, Any]] = {}
    for name in ranges:
        entries = [s["optim"][name] for s in saved]
        optim[name] = {key: (rebuild([e[key] for e in entries], *ranges[name]) if isinstance(value, Shard) else value)
                       for key, value in entries[0].items()}
    mine = model.sharded_state_dict()
    found["names"] = len(mine)
    found["all_names"] = sorted(mine) == sorted(full["saved"])
    found["empty_pieces"] = sum(1 for shard in mine.values() if shard.local.numel() == 0)
    model.load_sharded_state_dict(params)
    model.load_sharded_optimizer_state_dict(optimizer, optim)
    found["loaded_diff"] = max_diff(model.full_state_dict(), full["saved"])
    train_step(model, optimizer, STEPS, rank, world)
    found["continued_diff"] = max_diff(model.full_state_dict(), full["after"])
    if not without_optimizer_state:
        return found
    # Without the optimizer state the same step lands elsewhere: the state is what made it match.
    fresh = FullyShardedDataParallel(ByteGPT(CONFIG, seed=1), wrap=WRAP, comm=comm)
    fresh.load_sharded_state_dict(params)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=LR)
    train_step(fresh, fresh_optimizer, STEPS, rank, world)
    found["no_optimizer_state_diff"] = max_diff(fresh.full_state_dict(), full["after"])
    return found


def load(result: dict[str, Any], directory: Path) -> None:
    ctx = haiscale.init(timeout_s=TIMEOUT_S)
    try:
        # The in-process one-rank load checks the run without optimizer state; here it would cost time.
        result.update(restore_and_continue(directory, ctx.dp_rank, ctx.data_size, without_optimizer_state=False))
    finally:
        haiscale.destroy()


def dead(result: dict[str, Any], directory: Path) -> None:
    ctx = haiscale.init(timeout_s=DEAD_TIMEOUT_S)
    rank, world = ctx.dp_rank, ctx.data_size
    model = FullyShardedDataParallel(ByteGPT(CONFIG, seed=0), wrap=WRAP)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    train_step(model, optimizer, 0, rank, world)
    if rank == 1:
        result["ok"] = True
        import json
        print(json.dumps(result), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        train_step(model, optimizer, 1, rank, world)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["elapsed_s"] = time.monotonic() - started


SCENARIOS = {"train": train, "load": load, "dead": dead}


def main() -> None:
    scenario, directory = SCENARIOS[sys.argv[1]], Path(sys.argv[2])
    run_rank(lambda result: scenario(result, directory))


if __name__ == "__main__":
    main()

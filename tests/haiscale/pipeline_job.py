"""A rank of a pipeline-parallel job (tests/test_haiscale_pipeline.py starts them).

    python -m tests.haiscale.pipeline_job train PIPELINE PLACEMENT [KILL]   # both schedules vs one process
    python -m tests.haiscale.pipeline_job stop                             # rank 1 stops mid-step
    python -m tests.haiscale.pipeline_job bench ROUNDS STEPS        # 1F1B vs GPipe, seconds per step

Prints one JSON line (``{"rank": .., "ok": .., ...}``). ``LOCAL_WORLD_SIZE`` ranks make a node, as
torchrun numbers them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import haiscale
from haiscale.models import ByteGPT, GPTConfig, lm_loss
from haiscale.pipeline import PipelineError, PipelineParallel, Schedule
from tests.hfreduce.runner import run_rank

CONFIG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
MICRO_BATCHES = 4
LR = 0.1
# Per-replica batch sizes of the steps: the second does not divide into equal micro-batches.
REPLICA_BATCHES = (8, 7, 8)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch of byte sequences: (inputs, next-byte targets)."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (size, CONFIG.block_size + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


class SGD:
    """SGD with momentum, by hand: creating a ``torch.optim`` optimizer imports torch's compiler stack,
    seconds per process that these short jobs would spend on nothing else. Same update as
    ``torch.optim.SGD(lr, momentum)`` (buffer = momentum * buffer + grad; param -= lr * buffer)."""

    def __init__(self, module: nn.Module, lr: float = LR, momentum: float = 0.9) -> None:
        self.params = list(module.parameters())
        self.lr, self.momentum = lr, momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        for index, param in enumerate(self.params):
            if param.grad is None:
                continue
            buffer = self.buffers[index]
            if buffer is None:
                buffer = self.buffers[index] = param.grad.detach().clone()
            else:
                buffer.mul_(self.momentum).add_(param.grad)
            param.add_(buffer, alpha=-self.lr)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def train_pipeline(ctx: haiscale.ParallelContext, schedule: Schedule) -> dict[str, Any]:
    """Three steps of the pipeline: this stage's parameters, the losses (last stage), the peaks of stored
    activations and the gradient buckets (overlapped, total) of each step."""
    stage = ByteGPT(CONFIG, seed=0).stages(ctx.pipeline_size)[ctx.stage]
    # Small buckets, so that the stage's gradients make several (a tiny model fits one default bucket).
    pipe = PipelineParallel(stage, loss_fn=lm_loss, micro_batches=MICRO_BATCHES, schedule=schedule,
                            bucket_size_bytes=16 << 10)
    optimizer = SGD(stage)
    losses: list[float] = []
    peaks: list[int] = []
    buckets: list[tuple[int, int]] = []
    for step, size in enumerate(REPLICA_BATCHES):
        inputs, targets = batch(step, size * ctx.data_size)
        mine = slice(ctx.dp_rank * size, (ctx.dp_rank + 1) * size)
        loss = pipe.train_step(inputs[mine], targets[mine])
        assert (loss is None) != (ctx.stage == ctx.pipeline_size - 1), "the loss comes back on the last stage only"
        if loss is not None:
            losses.append(float(loss))
        peaks.append(pipe.peak_stored)
        buckets.append(pipe.gradient_buckets)
        optimizer.step()
        optimizer.zero_grad()
    pipe.close()
    return {"params": flat(stage), "losses": losses, "peaks": peaks, "buckets": buckets}


def train_reference(ctx: haiscale.ParallelContext, micro_losses: str) -> torch.Tensor:
    """The same steps in this process alone, on the global batch; this stage's slice of the result.
    ``"whole"``: one pass over the batch (what the pipeline must equal); ``"summed"``: the micro-batches'
    losses added instead of averaged (what a pipeline that forgot to scale would compute)."""
    model = ByteGPT(CONFIG, seed=0)
    optimizer = SGD(model)
    for step, size in enumerate(REPLICA_BATCHES):
        inputs, targets = batch(step, size * ctx.data_size)
        if micro_losses == "whole":
            torch.autograd.backward(lm_loss(model(inputs), targets))
        else:
            for part_in, part_out in zip(torch.tensor_split(inputs, MICRO_BATCHES),
                                         torch.tensor_split(targets, MICRO_BATCHES), strict=True):
                torch.autograd.backward(lm_loss(model(part_in), part_out))
        optimizer.step()
        optimizer.zero_grad()
    return flat(model.stages(ctx.pipeline_size)[ctx.stage])


def train(result: dict[str, Any], pipeline_size: int, placement: str, then: str) -> None:
    """Both schedules and both references; then, with ``then="KILL"``, one more step that the last rank
    dies in (it prints its result first)."""
    ctx = haiscale.init(pipeline_size=pipeline_size, placement=placement, timeout_s=60)  # type: ignore[arg-type]
    result.update(stage=ctx.stage, dp_rank=ctx.dp_rank, data_size=ctx.data_size)
    # Where this rank sits: its node (torchrun's numbering) and data-parallel group, seen by every rank.
    node = ctx.rank // int(os.environ.get("LOCAL_WORLD_SIZE") or ctx.world_size)
    places: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(places, (node, ctx.layout.dp_group(ctx.stage)))
    result["places"] = places
    runs = {schedule: train_pipeline(ctx, schedule) for schedule in ("1f1b", "gpipe")}
    one_f_one_b, gpipe = runs["1f1b"].pop("params"), runs["gpipe"].pop("params")
    whole = train_reference(ctx, "whole")
    summed = train_reference(ctx, "summed")
    result.update(runs=runs,
                  schedules_identical=bool(torch.equal(one_f_one_b, gpipe)),
                  schedules_max_diff=float((one_f_one_b - gpipe).abs().max()),
                  reference_max_diff=float((one_f_one_b - whole).abs().max()),
                  unscaled_max_diff=float((summed - whole).abs().max()))
    if then == "KILL":
        if ctx.rank == ctx.world_size - 1:
            print(json.dumps({**result, "ok": True}), flush=True)
        lose_a_rank(ctx, result, signal.SIGKILL, ctx.timeout_s)
    haiscale.destroy()


class DiesAt(nn.Module):
    """The stage, and ``signal`` sent to this process at its ``calls``-th forward."""

    def __init__(self, inner: nn.Module, calls: int, signum: int) -> None:
        super().__init__()
        self.inner, self.calls, self.signum = inner, calls, signum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls -= 1
        if self.calls == 0:
            os.kill(os.getpid(), self.signum)
        out: torch.Tensor = self.inner(x)
        return out


def lose_a_rank(ctx: haiscale.ParallelContext, result: dict[str, Any], signum: int, timeout_s: float) -> None:
    """A step in which the last rank (a last stage) sends itself ``signum`` at its second forward; the
    others record the error that ends their step and how long it took. A SIGKILL closes connections:
    with 2 x 2 ranks the pipeline neighbour fails on a message, the data-parallel peer in the gradient
    average, the remaining rank when its own peer leaves. A SIGSTOP closes nothing: the neighbour's wait
    runs into ``timeout_s``."""
    ctx = dataclasses.replace(ctx, timeout_s=timeout_s)
    stage: nn.Module = ByteGPT(CONFIG, seed=0).stages(ctx.pipeline_size)[ctx.stage]
    if ctx.rank == ctx.world_size - 1:
        stage = DiesAt(stage, 2, signum)
    pipe = PipelineParallel(stage, ctx=ctx, loss_fn=lm_loss, micro_batches=MICRO_BATCHES)
    inputs, targets = batch(0, 8)
    started = time.monotonic()
    try:
        pipe.train_step(inputs, targets)
    except PipelineError as exc:
        result.update(error=str(exc), failed_after_s=time.monotonic() - started, timeout_s=timeout_s)


def stop(result: dict[str, Any]) -> None:
    """Two ranks; after a step at the default timeout, rank 1 stops in a step whose waits time out in 5 s."""
    ctx = haiscale.init(pipeline_size=2, timeout_s=60)
    stage = ByteGPT(CONFIG, seed=0).stages(2)[ctx.stage]
    warm = PipelineParallel(stage, ctx=ctx, loss_fn=lm_loss, micro_batches=MICRO_BATCHES)
    warm.train_step(*batch(0, 8))
    warm.close()
    lose_a_rank(ctx, result, signal.SIGSTOP, 5.0)
    haiscale.destroy()


def bench(result: dict[str, Any], rounds: int, steps: int) -> None:
    """Seconds per step of 1F1B and GPipe on a small ByteGPT, alternating ``rounds`` times so that both
    meet the same machine (the median of each is reported, and their ratio)."""
    ctx = haiscale.init(pipeline_size=int(os.environ["WORLD_SIZE"]), timeout_s=60)
    config = GPTConfig(block_size=32, n_layer=4, n_head=4, n_embd=64)
    stage = ByteGPT(config, seed=0).stages(ctx.pipeline_size)[ctx.stage]
    pipes = {schedule: PipelineParallel(stage, loss_fn=lm_loss, micro_batches=8, schedule=schedule)
             for schedule in ("1f1b", "gpipe")}
    tokens = torch.randint(0, 256, (32, config.block_size + 1), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {schedule: [] for schedule in pipes}
    for _ in range(rounds):
        for schedule, pipe in pipes.items():
            dist.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                pipe.train_step(tokens[:, :-1], tokens[:, 1:])
                stage.zero_grad()
            dist.barrier()
            times[schedule].append((time.perf_counter() - started) / steps)
    medians = {schedule: sorted(values)[len(values) // 2] for schedule, values in times.items()}
    result.update(seconds_per_step=medians, gpipe_over_1f1b=medians["gpipe"] / medians["1f1b"],
                  peak_stored={schedule: pipe.peak_stored for schedule, pipe in pipes.items()})
    haiscale.destroy()


def main() -> None:
    torch.set_num_threads(1)
    scenario, args = sys.argv[1], sys.argv[2:]
    if scenario == "train":
        run_rank(lambda result: train(result, int(args[0]), args[1], args[2] if len(args) > 2 else ""))
    elif scenario == "stop":
        run_rank(stop)
    elif scenario == "bench":
        run_rank(lambda result: bench(result, int(args[0]), int(args[1])))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()

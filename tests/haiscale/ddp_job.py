"""One rank of a DDP test job: ``python -m tests.haiscale.ddp_job SCENARIO``.

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment (torch's launcher
conventions); the rank prints one JSON line that the test collects. Scenarios:

``equality``
    A tiny ByteGPT trained a few steps on a fixed global batch, each rank taking its share: with
    haiscale's DDP (small buckets: several per model), with torch's own DDP on gloo, and in this
    process alone on the whole global batch (the reference every rank can compute). Also: a second
    DDP run (must be bit-identical), ``zero_grad(set_to_none=False)`` and
    ``gradient_as_bucket_view=False`` (bit-identical too), ``no_sync`` accumulation over two
    micro-batches against one step on their union, a parameter only some ranks use, the times at
    which the buckets' allreduces started against those at which backward produced gradients, and
    the state dict's keys. First of all, rank 1 wraps a model with a different parameter count, then
    one with the same counts but other shapes: every rank must get a clear error each time, and then
    wrap a matching model. Prints differences and digests for the test to judge.
``kill``
    Trains; at step 2 the last rank kills itself (SIGKILL) before its backward. The others must see
    an HFReduce error from backward or the next step, within the job's timeout, never a hang.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import haiscale
import hfreduce
from haiscale.ddp import DistributedDataParallel
from haiscale.models import ByteGPT, GPTConfig, lm_loss
from tests.hfreduce.runner import run_rank

CONFIG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS = 4
GLOBAL_BATCH = 8
SEED = 7
# Small buckets: the tiny model (about 30 K parameters) spreads over several of them.
BUCKET_CAP_MB = 0.02
KILL_TIMEOUT_S = 20.0  # bounds the rendezvous too: ranks of a loaded machine start seconds apart


def _data(steps: int = STEPS) -> torch.Tensor:
    """``steps`` global batches of byte sequences (inputs and next-byte targets), the same on every rank."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (steps, GLOBAL_BATCH, CONFIG.block_size + 1), generator=generator)


def _share(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world
    return batch[rank * per_rank:(rank + 1) * per_rank]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, set_to_none: bool = True) -> None:
    optimizer.zero_grad(set_to_none=set_to_none)
    torch.autograd.backward(lm_loss(model(batch[:, :-1]), batch[:, 1:]))
    optimizer.step()


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _train_single(kind: str, data: torch.Tensor) -> list[torch.Tensor]:
    model = ByteGPT(CONFIG, seed=SEED)
    optimizer = _optimizer(kind, model)
    for batch in data:
        _step(model, optimizer, batch)
    return _params(model)


def _train_ddp(kind: str, data: torch.Tensor, rank: int, world: int, **options: Any) -> tuple[list[torch.Tensor],
                                                                                                 DistributedDataParallel]:
    set_to_none = options.pop("set_to_none", True)
    # Rank 0's seed differs from the others': the construction's broadcast must make them equal.
    model = DistributedDataParallel(ByteGPT(CONFIG, seed=SEED if rank == 0 else SEED + 1 + rank),
                                    bucket_cap_mb=BUCKET_CAP_MB, **options)
    optimizer = _optimizer(kind, model)
    for batch in data:
        _step(model, optimizer, _share(batch, rank, world), set_to_none)
    return _params(model.module), model


def _train_torch_ddp(kind: str, data: torch.Tensor, rank: int, world: int) -> list[torch.Tensor]:
    model = nn.parallel.DistributedDataParallel(ByteGPT(CONFIG, seed=SEED))  # the default group: gloo
    optimizer = _optimizer(kind, model)
    for batch in data:
        _step(model, optimizer, _share(batch, rank, world))
    return _params(model.module)


def _no_sync(data: torch.Tensor, rank: int, world: int) -> float:
    """Two micro-batches under no_sync (then synchronized), against one single-process step on the union."""
    model = DistributedDataParallel(ByteGPT(CONFIG, seed=SEED), bucket_cap_mb=BUCKET_CAP_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    mine = _share(data[0], rank, world)
    first, second = mine[:len(mine) // 2], mine[len(mine) // 2:]
    optimizer.zero_grad()
    with model.no_sync():
        torch.autograd.backward(lm_loss(model(first[:, :-1]), first[:, 1:]) / 2)
    torch.autograd.backward(lm_loss(model(second[:, :-1]), second[:, 1:]) / 2)
    optimizer.step()
    reference = ByteGPT(CONFIG, seed=SEED)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    _step(reference, reference_optimizer, data[0])
    return _max_diff(_params(model.module), _params(reference))


class _Branches(nn.Module):
    """``a(x)``, plus ``b(x)`` when asked: rank 0 uses ``b``, the others do not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out: torch.Tensor = self.a(x)
        return out + self.b(x) if use_b else out


def _unused(rank: int, world: int) -> dict[str, float]:
    """A parameter used on rank 0 only: its averaged gradient counts the others' as zero."""
    inputs = torch.randn(world, 5, 4, generator=torch.Generator().manual_seed(3))
    model = DistributedDataParallel(_Branches(), bucket_cap_mb=BUCKET_CAP_MB)
    torch.autograd.backward(model(inputs[rank], rank == 0).square().sum())
    expected: dict[str, torch.Tensor] = {}
    for other in range(world):  # every rank's local gradients, computed here
        local = _Branches()
        torch.autograd.backward(local(inputs[other], other == 0).square().sum())
        for name, param in local.named_parameters():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            expected[name] = expected.get(name, torch.zeros_like(param)) + grad / world
    differences: dict[str, float] = {}
    for name, param in model.module.named_parameters():
        reduced = param.grad
        differences[name] = float("inf") if reduced is None else float((reduced - expected[name]).abs().max())
    return differences


def _overlap(data: torch.Tensor, rank: int, world: int) -> dict[str, Any]:
    """When each bucket's allreduce started, against when backward produced each gradient and when it
    ended. The recording hooks are registered before DDP's, so a gradient's time is taken before DDP
    sees it: an allreduce that started earlier than the last gradient overlapped the backward pass."""
    comm = haiscale.get_context().dp_comm
    module = ByteGPT(CONFIG, seed=SEED)
    produced: list[float] = []

    def record(param: torch.Tensor) -> None:
        produced.append(time.perf_counter())

    for param in module.parameters():
        param.register_post_accumulate_grad_hook(record)  # type: ignore[no-untyped-call]
    model = DistributedDataParallel(module, bucket_cap_mb=BUCKET_CAP_MB)
    starts: list[float] = []
    real_allreduce = comm.allreduce

    def recording_allreduce(tensor: Any, op: hfreduce.ReduceOp = hfreduce.ReduceOp.SUM,
                            async_op: bool = False) -> hfreduce.Work:
        starts.append(time.perf_counter())
        return real_allreduce(tensor, op, async_op)

    batch = _share(data[0], rank, world)
    loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
    comm.allreduce = recording_allreduce  # type: ignore[method-assign]
    try:
        torch.autograd.backward(loss)
        ended = time.perf_counter()
    finally:
        comm.allreduce = real_allreduce  # type: ignore[method-assign]
    views = all(slot.param.grad is not None and slot.param.grad.data_ptr() == slot.view.data_ptr()
                for slot in model._slots)
    return {"buckets": len(model.bucket_names()), "allreduces": len(starts), "gradients": len(produced),
            "started_before_last_gradient": sum(start < produced[-1] for start in starts),
            "first_start_after_first_gradient_s": starts[0] - produced[0] if starts else None,
            "last_gradient_s": produced[-1] - produced[0], "backward_end_s": ended - produced[0],
            "grads_are_bucket_views": views}


def equality(result: dict[str, Any]) -> None:
    ctx = haiscale.init(timeout_s=60)
    rank, world = ctx.dp_rank, ctx.data_size
    result["mismatch"] = _mismatch(rank)
    data = _data()
    for kind in ("sgd", "adam"):
        single = _train_single(kind, data)
        ours, model = _train_ddp(kind, data, rank, world)
        theirs = _train_torch_ddp(kind, data, rank, world)
        again, _ = _train_ddp(kind, data, rank, world)
        result[kind] = {"ddp_vs_single": _max_diff(ours, single), "ddp_vs_torch_ddp": _max_diff(ours, theirs),
                        "torch_ddp_vs_single": _max_diff(theirs, single),
                        "rerun_identical": _digest(again) == _digest(ours),
                        "digest": _digest(ours), "moved": _max_diff(ours, _params(ByteGPT(CONFIG, seed=SEED)))}
        if kind == "sgd":
            result["buckets"] = model.bucket_names()
            keys = list(model.state_dict())
            result["state_dict_keys_match"] = keys == list(model.module.state_dict())
            bare = ByteGPT(CONFIG, seed=99)
            bare.load_state_dict(model.state_dict())
            result["state_dict_loads_into_bare_model"] = _digest(_params(bare)) == _digest(ours)
            model.load_state_dict(ByteGPT(CONFIG, seed=SEED).state_dict())
            result["bare_state_dict_loads"] = _max_diff(_params(model.module),
                                                        _params(ByteGPT(CONFIG, seed=SEED))) == 0.0
            keep, _ = _train_ddp(kind, data, rank, world, set_to_none=False)
            copying, _ = _train_ddp(kind, data, rank, world, gradient_as_bucket_view=False)
            result["set_to_none_false_identical"] = _digest(keep) == _digest(ours)
            result["not_bucket_view_identical"] = _digest(copying) == _digest(ours)
    result["no_sync_vs_single"] = _no_sync(data, rank, world)
    result["unused"] = _unused(rank, world)
    result["overlap"] = _overlap(data, rank, world)
    haiscale.destroy()


def _mismatch_model(rank: int, variant: str) -> nn.Module:
    if variant == "count" and rank != 0:
        return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(2, 2))
    if variant == "shapes":  # the same count of parameters and of elements (36), other shapes
        if rank != 0:
            return nn.Sequential(nn.Linear(6, 4, bias=False), nn.Linear(4, 3, bias=False))
        return nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(6, 2, bias=False))
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))


def _mismatch(rank: int) -> dict[str, Any]:
    """Rank 1 wraps other models than rank 0 (bad input): every rank must raise; then a matching one works."""
    result: dict[str, Any] = {}
    for variant in ("count", "shapes"):
        try:
            DistributedDataParallel(_mismatch_model(rank, variant))
            result[variant] = None
        except ValueError as exc:
            result[variant] = str(exc)
    model = DistributedDataParallel(_mismatch_model(rank, "same"))
    torch.autograd.backward(model(torch.ones(3, 4)).sum())
    result["after"] = [float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None]
    return result


def kill(result: dict[str, Any]) -> None:
    ctx = haiscale.init(timeout_s=KILL_TIMEOUT_S)
    rank, world = ctx.dp_rank, ctx.data_size
    data = _data(steps=6)
    model = DistributedDataParallel(ByteGPT(CONFIG, seed=SEED), bucket_cap_mb=BUCKET_CAP_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    started = time.monotonic()
    try:
        for step, batch in enumerate(data):
            if step == 2 and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            started = time.monotonic()
            _step(model, optimizer, _share(batch, rank, world))
            steps += 1
    except hfreduce.HFReduceError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["steps"] = steps
    result["failed_after_s"] = time.monotonic() - started


SCENARIOS: dict[str, Callable[[dict[str, Any]], None]] = {"equality": equality, "kill": kill}


def main() -> None:
    torch.set_num_threads(1)
    run_rank(SCENARIOS[sys.argv[1]])


if __name__ == "__main__":
    main()

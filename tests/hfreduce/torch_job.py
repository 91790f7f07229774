"""One rank of a torch test job: ``python -m tests.hfreduce.torch_job SCENARIO PORT [PORT...]``.

RANK and WORLD_SIZE come from the environment (as torchrun sets them); the rank prints one JSON line
that the test collects. Scenarios:

``ddp``
    The same small model trained 20 steps with DistributedDataParallel four ways, one after the
    other: on gloo (the reference), on gloo with :func:`hfreduce.torch.ddp_comm_hook`, on
    ``backend="hfreduce"``, and on gloo with a hook that sums instead of averaging (which must differ:
    proof that the comparison can fail). Prints each run's final parameters.
``collectives``
    ``torch.distributed`` collectives on ``backend="hfreduce"`` checked against their expected values,
    a subgroup, bad uses (each must raise a clear error and leave the group usable), and the group's
    timeout (a rank that never joins an all_reduce fails it within ``init_process_group``'s timeout).
"""

# No ``from __future__ import annotations``: DDP checks a comm hook's annotations as objects.

import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket

import hfreduce
import hfreduce.torch
from hfreduce.torch import HFReduceOptions, ddp_comm_hook

STEPS = 20
BATCH_PER_RANK = 8
TIMEOUT_S = 6.0


def _init(backend: str, port: int, **kwargs: Any) -> None:
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend=backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            **kwargs)


def _model() -> nn.Module:
    torch.manual_seed(1234)  # the same initial parameters on every rank and in every run
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(ddp: nn.parallel.DistributedDataParallel, rank: int, world: int) -> list[list[float]]:
    generator = torch.Generator().manual_seed(99)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(STEPS):
        inputs = torch.randn(BATCH_PER_RANK * world, 8, generator=generator)
        targets = torch.randn(BATCH_PER_RANK * world, 4, generator=generator)
        mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)  # this rank's share of the global batch
        optimizer.zero_grad()
        torch.autograd.backward(nn.functional.mse_loss(ddp(inputs[mine]), targets[mine]))
        optimizer.step()
    return [parameter.detach().reshape(-1).tolist() for parameter in ddp.module.parameters()]


def ddp(ports: list[int]) -> dict[str, Any]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result: dict[str, Any] = {"initial": [p.detach().reshape(-1).tolist() for p in _model().parameters()]}

    _init("gloo", ports[0])
    result["gloo"] = _train(nn.parallel.DistributedDataParallel(_model()), rank, world)

    hfreduce.init(master_addr="127.0.0.1", master_port=ports[1], timeout_s=30)
    hook_calls = 0

    @functools.wraps(ddp_comm_hook)  # DDP then checks ddp_comm_hook's own signature
    def counting_hook(state: None, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        nonlocal hook_calls
        hook_calls += 1
        return ddp_comm_hook(state, bucket)

    model = nn.parallel.DistributedDataParallel(_model())
    model.register_comm_hook(None, counting_hook)  # None: hfreduce's default communicator
    result["hook"] = _train(model, rank, world)
    result["hook_calls"] = hook_calls

    def summing_hook(state: hfreduce.Communicator, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        state.allreduce(bucket.buffer(), hfreduce.ReduceOp.SUM)
        future.set_result(bucket.buffer())
        return future

    model = nn.parallel.DistributedDataParallel(_model())
    model.register_comm_hook(hfreduce.get_communicator(), summing_hook)
    result["summing_hook"] = _train(model, rank, world)
    hfreduce.destroy()
    dist.destroy_process_group()

    _init("hfreduce", ports[2])
    model = nn.parallel.DistributedDataParallel(_model())
    result["backend_group"] = type(model.process_group).__name__
    result["backend"] = _train(model, rank, world)
    dist.destroy_process_group()
    return result


def _expect_error(checks: dict[str, str], name: str, call: Callable[[], object]) -> None:
    try:
        call()
    except Exception as exc:
        checks[name] = f"{type(exc).__name__}: {exc}"
    else:
        checks[name] = "no error"


def collectives(ports: list[int]) -> dict[str, Any]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _init("hfreduce", ports[0], timeout=timedelta(seconds=TIMEOUT_S),
          pg_options=HFReduceOptions(chunk_size_bytes=64 << 10))
    got: dict[str, Any] = {"backend": dist.get_backend(), "group": type(dist.group.WORLD).__name__}
    count = 50_000  # several 64 KiB chunks
    base = torch.arange(count, dtype=torch.float32) % 97
    for op in ("SUM", "AVG", "MAX", "MIN"):
        tensor = base * (rank + 1)
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
        got[f"all_reduce_{op}"] = [tensor[:3].tolist(), tensor[-3:].tolist()]
    ints = torch.full((5,), rank + 1, dtype=torch.int64)
    dist.all_reduce(ints)
    got["all_reduce_int64"] = ints.tolist()
    halves = torch.full((7,), 0.5 * (rank + 1), dtype=torch.bfloat16)
    dist.all_reduce(halves, op=dist.ReduceOp.AVG)
    got["all_reduce_bf16_avg"] = halves.float().tolist()

    tensor = torch.full((4,), float(rank))
    dist.broadcast(tensor, src=world - 1)
    got["broadcast"] = tensor.tolist()

    output = torch.empty(world * 3)
    dist.all_gather_into_tensor(output, torch.full((3,), float(rank)))
    got["all_gather_into_tensor"] = output.tolist()
    output = torch.empty(world * 3)
    dist.all_gather_single(output, torch.full((3,), float(rank)))
    got["all_gather_single"] = output.tolist()
    outputs = [torch.empty(2, 2) for _ in range(world)]
    dist.all_gather(outputs, torch.full((2, 2), float(rank)))
    got["all_gather"] = [item.reshape(-1).tolist() for item in outputs]

    output = torch.empty(2)
    dist.reduce_scatter_tensor(output, torch.arange(2.0 * world) + rank)
    got["reduce_scatter_tensor"] = output.tolist()
    output = torch.empty(2)
    dist.reduce_scatter_single(output, torch.arange(2.0 * world) + rank, op=dist.ReduceOp.MAX)
    got["reduce_scatter_single_MAX"] = output.tolist()
    output = torch.empty(2)
    dist.reduce_scatter(output, [torch.full((2,), float(rank + block)) for block in range(world)])
    got["reduce_scatter"] = output.tolist()

    work = dist.all_reduce(torch.ones(3), async_op=True)
    assert work is not None
    work.wait()
    got["async"] = [work.is_completed(), work.get_future().value()[0].tolist()]
    dist.barrier()
    got["barrier"] = True

    # A subgroup of the first and last ranks: its own ranks 0 and 1, its own communicator.
    members = [0, world - 1]
    subgroup = dist.new_group(members)
    if rank in members:
        tensor = torch.full((3,), float(rank))
        dist.all_reduce(tensor, group=subgroup)
        got["subgroup"] = {"rank": dist.get_rank(subgroup), "size": dist.get_world_size(subgroup),
                           "all_reduce": tensor.tolist(), "world_size": subgroup.communicator.world_size}
    whole = dist.new_group(list(range(world)))
    tensor = torch.ones(2)
    dist.all_reduce(tensor, group=whole)
    got["whole_group"] = tensor.tolist()

    # Bad uses: every rank makes the same mistake, so none of them starts a collective.
    checks: dict[str, str] = {}
    _expect_error(checks, "product", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.PRODUCT))
    _expect_error(checks, "bitwise", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BOR))
    _expect_error(checks, "product_reduce_scatter",
                  lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world),
                                                     op=dist.ReduceOp.PRODUCT))
    _expect_error(checks, "non_contiguous", lambda: dist.all_reduce(torch.ones(4, 3).t()))
    _expect_error(checks, "dtype", lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint8)))
    _expect_error(checks, "gather_size", lambda: dist.all_gather_into_tensor(torch.empty(5), torch.ones(3)))
    _expect_error(checks, "send", lambda: dist.send(torch.ones(2), dst=(rank + 1) % world))
    _expect_error(checks, "pg_options", lambda: dist.new_group(list(range(world)), pg_options=object()))
    after = torch.ones(2)
    dist.all_reduce(after)
    got["after_bad_uses"] = after.tolist()
    got["errors"] = checks

    # A rank that never joins: the others' all_reduce fails within the group's timeout.
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(2))
            got["hang"] = "no error"
        except Exception as exc:
            got["hang"] = f"{type(exc).__name__}: {exc}"
        got["hang_s"] = time.monotonic() - started
        store.set("hang-done", "1")
    else:
        store.wait(["hang-done"], timedelta(seconds=60))
    dist.destroy_process_group()
    return got


def main() -> None:
    scenario, ports = sys.argv[1], [int(port) for port in sys.argv[2:]]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    try:
        result = {"ddp": ddp, "collectives": collectives}[scenario](ports)
        result.update(rank=int(os.environ["RANK"]), ok=True)
    except Exception:
        result = {"rank": int(os.environ.get("RANK", -1)), "ok": False, "error": traceback.format_exc()}
    print(json.dumps(result), flush=True)
    # Skip interpreter teardown: a timed-out rank's peer may still be unwinding its communicator.
    os._exit(0)


if __name__ == "__main__":
    main()

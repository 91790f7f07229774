"""hfreduce.torch: DDP with the communication hook and with ``backend="hfreduce"`` trains like gloo DDP;
``torch.distributed`` collectives on the backend give the expected values, in subgroups too; bad uses and a
rank that never joins fail with clear errors. Each job is real processes (tests/hfreduce/torch_job.py).
"""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

pytest.importorskip("torch")

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket, HashStore, PrefixStore, TCPStore

import hfreduce
import hfreduce.torch
from hfreduce import InvalidArgument
from hfreduce.torch import BACKEND_NAME, _complete, _store_host, _TorchWork, ddp_comm_hook, reduce_op
from tests.hfreduce.runner import collect_results

ROOT = Path(__file__).resolve().parents[1]


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for probe in sockets:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in sockets]
    finally:
        for probe in sockets:
            probe.close()


def run_job(scenario: str, world: int, ports: int, timeout_s: float = 90) -> list[dict[str, Any]]:
    """``world`` ranks of ``tests.hfreduce.torch_job SCENARIO`` on this machine, launched as torchrun would."""
    port_args = [str(port) for port in _free_ports(ports)]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", PYTHONPATH=str(ROOT),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.hfreduce.torch_job", scenario, *port_args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT))
    results = collect_results(procs, timeout_s, what=f"a rank of {scenario}")
    for result in results:
        assert result["ok"], result.get("error")
    return results


def _params(result: dict[str, Any], run: str) -> np.ndarray:
    return np.concatenate([np.asarray(values, dtype=np.float64) for values in result[run]])


# -- in this process ------------------------------------------------------------------------------------------


def test_importing_registers_the_backend_once() -> None:
    assert BACKEND_NAME in dist.Backend.backend_list
    assert dist.Backend.backend_list.count(BACKEND_NAME) == 1
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # registering does not take over cpu
    hfreduce.torch._register()  # a second registration changes nothing
    assert dist.Backend.backend_list.count(BACKEND_NAME) == 1


def test_reduce_ops_map_and_others_are_refused() -> None:
    assert reduce_op(dist.ReduceOp.SUM) is hfreduce.ReduceOp.SUM
    assert reduce_op(dist.ReduceOp.AVG) is hfreduce.ReduceOp.AVG
    assert reduce_op(dist.ReduceOp(dist.ReduceOp.MAX)) is hfreduce.ReduceOp.MAX  # the object form options carry
    assert reduce_op(dist.ReduceOp.MIN) is hfreduce.ReduceOp.MIN
    for bad in (dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        with pytest.raises(InvalidArgument, match="SUM, AVG, MAX or MIN"):
            reduce_op(bad)


def test_leaders_listen_on_the_route_to_torchs_store_host() -> None:
    port = _free_ports(1)[0]
    tcp = TCPStore("127.0.0.1", port, world_size=1, is_master=True, wait_for_workers=False)
    assert _store_host(PrefixStore("hfreduce/", PrefixStore("0/", tcp))) == "127.0.0.1"
    assert _store_host(PrefixStore("0/", HashStore())) is None  # no host: MASTER_ADDR decides


def test_the_hook_has_the_signature_ddp_accepts() -> None:
    # DDP refuses a hook whose annotations are not these objects (strings, say).
    signature = inspect.signature(ddp_comm_hook)
    assert signature.parameters["bucket"].annotation is GradBucket
    assert signature.return_annotation == torch.futures.Future[torch.Tensor]


class _Bucket:
    """What the hook uses of a GradBucket (torch makes those only inside DDP)."""

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer

    def buffer(self) -> Any:
        return self._buffer


def test_the_hook_completes_its_future_from_the_work() -> None:
    port = _free_ports(1)[0]
    with hfreduce.Communicator(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port,
                               timeout_s=10) as communicator:
        buffer = torch.arange(10, dtype=torch.float32)
        future = ddp_comm_hook(communicator, cast(GradBucket, _Bucket(buffer)))
        assert future.wait() is buffer
        assert buffer.tolist() == list(range(10))  # the average over one rank
        with pytest.raises(InvalidArgument, match="not contiguous"):
            ddp_comm_hook(communicator, cast(GradBucket, _Bucket(torch.ones(4, 3).t())))
    with pytest.raises(hfreduce.HFReduceError, match="shut down"):
        ddp_comm_hook(communicator, cast(GradBucket, _Bucket(buffer)))


def test_a_failed_work_fails_the_future_and_the_torch_work() -> None:
    work = hfreduce.Work("allreduce(AVG)")
    future: torch.futures.Future[int] = torch.futures.Future()
    _complete(work, future, lambda: 1)
    torch_work = _TorchWork(work, lambda: [])
    assert not future.done() and not torch_work.is_completed()
    with pytest.raises(hfreduce.HFReduceTimeout, match=r"did not finish within 0\.05 s"):
        torch_work.wait(timedelta(milliseconds=50))
    work._finish(hfreduce.HFReduceError("rank 1 died"))
    with pytest.raises(hfreduce.HFReduceError, match="rank 1 died"):
        future.wait()
    with pytest.raises(hfreduce.HFReduceError, match="rank 1 died"):
        torch_work.wait()
    assert torch_work.is_completed() and not torch_work.is_success()


def test_hfreduce_imports_without_touching_torch() -> None:
    code = "import sys, hfreduce, hfreduce.comm, hfreduce.store, hfreduce.buffers; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


# -- real jobs -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_with_the_hook_and_the_backend_matches_gloo() -> None:
    results = run_job("ddp", world=2, ports=3)
    reference = _params(results[0], "gloo")
    assert not np.allclose(reference, _params(results[0], "initial"), atol=1e-3)  # training moved the model
    for result in results:
        assert result["hook_calls"] >= 20  # at least one bucket per step went through the hook
        assert result["backend_group"] == "ProcessGroupHFReduce"
        for run in ("gloo", "hook", "backend"):
            np.testing.assert_allclose(_params(result, run), reference, rtol=1e-5, atol=1e-6, err_msg=run)
        # The comparison can fail: summing instead of averaging the gradients trains a different model.
        assert not np.allclose(_params(result, "summing_hook"), reference, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_collectives_subgroups_bad_uses_and_timeout_on_the_backend() -> None:
    world = 3
    results = run_job("collectives", world=world, ports=1)
    count = 50_000
    base = np.arange(count, dtype=np.float32) % 97
    factors = np.arange(1, world + 1, dtype=np.float32)
    expected = {"SUM": base * factors.sum(), "AVG": base * factors.sum() / world, "MAX": base * world, "MIN": base}
    for result in results:
        rank = result["rank"]
        assert result["backend"] == BACKEND_NAME and result["group"] == "ProcessGroupHFReduce"
        for op, values in expected.items():
            head, tail = result[f"all_reduce_{op}"]
            np.testing.assert_allclose(head + tail, np.concatenate([values[:3], values[-3:]]), rtol=1e-6, err_msg=op)
        assert result["all_reduce_int64"] == [world * (world + 1) // 2] * 5
        assert result["all_reduce_bf16_avg"] == [0.5 * (world + 1) / 2] * 7
        assert result["broadcast"] == [float(world - 1)] * 4
        gathered = [float(r) for r in range(world) for _ in range(3)]
        assert result["all_gather_into_tensor"] == gathered
        assert result["all_gather_single"] == gathered
        assert result["all_gather"] == [[float(r)] * 4 for r in range(world)]
        inputs = [np.arange(2.0 * world) + r for r in range(world)]
        mine = slice(2 * rank, 2 * rank + 2)
        assert result["reduce_scatter_tensor"] == list(np.sum(inputs, axis=0)[mine])
        assert result["reduce_scatter_single_MAX"] == list(np.max(inputs, axis=0)[mine])
        assert result["reduce_scatter"] == [float(sum(r + rank for r in range(world)))] * 2
        assert result["async"] == [True, [float(world)] * 3]
        assert result["barrier"] is True
        assert result["whole_group"] == [float(world)] * 2
        if rank in (0, world - 1):
            assert result["subgroup"] == {"rank": 0 if rank == 0 else 1, "size": 2, "world_size": 2,
                                          "all_reduce": [float(world - 1)] * 3}
        else:
            assert "subgroup" not in result

        errors = result["errors"]
        assert errors["product"].startswith("InvalidArgument") and "PRODUCT" in errors["product"]
        assert "BOR" in errors["bitwise"]
        assert "PRODUCT" in errors["product_reduce_scatter"]
        assert errors["non_contiguous"].startswith("InvalidArgument") and "not contiguous" in errors["non_contiguous"]
        assert "uint8 is not supported" in errors["dtype"]
        assert "output has 5 elements" in errors["gather_size"]
        assert "does not implement send" in errors["send"]
        assert "HFReduceOptions" in errors["pg_options"]
        assert result["after_bad_uses"] == [float(world)] * 2  # the group still works
    hang = results[0]
    assert hang["hang"].startswith("HFReduce") and "no error" not in hang["hang"], hang["hang"]
    assert 5 <= hang["hang_s"] <= 30  # the init_process_group timeout (6 s), not an endless wait

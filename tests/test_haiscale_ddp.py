"""haiscale's DistributedDataParallel: it trains what one process trains on the global batch, what
torch's own DDP trains, overlaps its allreduces with backward, and fails loudly, never hangs.

The multi-rank checks run two ranks of ``tests/haiscale/ddp_job.py`` (see its doc); the rest runs in
this process on a one-rank communicator (an allreduce of one rank is the identity, so what is checked
there is the bookkeeping: buckets, views, hooks, state dicts, refusals).

Tolerances (fp32): DDP averages per-rank gradients of half batches, ``(g0 + g1) / 2``, while one
process differentiates the mean loss over the whole batch — the same sum, added in another order, so
the results differ by rounding: after 4 SGD steps by at most ``SGD_TOLERANCE``; Adam divides by the
root of the second moment, which magnifies the rounding of tiny gradients, hence ``ADAM_TOLERANCE``.
Against torch's DDP on gloo (``g0 / 2 + g1 / 2``) two ranks agree exactly: halving is exact in
floating point, so both add the same two numbers.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import hfreduce
from haiscale.ddp import FIRST_BUCKET_CAP_BYTES, DistributedDataParallel
from haiscale.models import ByteGPT
from tests.haiscale import ddp_job
from tests.hfreduce.runner import ROOT, collect_results, free_port, rank_env

SGD_TOLERANCE = 1e-6
ADAM_TOLERANCE = 2e-5
JOB_TIMEOUT_S = 240.0


def _start(scenario: str, world: int) -> list[subprocess.Popen[str]]:
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "tests.haiscale.ddp_job", scenario], cwd=ROOT,
                             env=rank_env(rank, world, port, None, {"OMP_NUM_THREADS": "1"}),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(world)]


@pytest.fixture(scope="module")
def equality() -> list[dict[str, Any]]:
    results = collect_results(_start("equality", 2), JOB_TIMEOUT_S, "a DDP rank")
    for result in results:
        assert result["ok"], result
    return results


@pytest.mark.slow
def test_ddp_trains_what_one_process_trains_on_the_global_batch(equality: list[dict[str, Any]]) -> None:
    for result in equality:
        for kind, tolerance in (("sgd", SGD_TOLERANCE), ("adam", ADAM_TOLERANCE)):
            run = result[kind]
            assert run["moved"] > 100 * tolerance, "training must move the parameters for the comparison to mean much"
            assert run["ddp_vs_single"] <= tolerance, (kind, run)
            assert run["ddp_vs_torch_ddp"] <= tolerance, (kind, run)
            assert run["ddp_vs_torch_ddp"] == 0.0, (kind, run)  # two ranks: the same two addends (module doc)
    # Every rank ends with the same parameters, bit for bit, although rank 1 built its model from
    # another seed (the construction's broadcast) and saw other data.
    assert equality[0]["sgd"]["digest"] == equality[1]["sgd"]["digest"]
    assert equality[0]["adam"]["digest"] == equality[1]["adam"]["digest"]


@pytest.mark.slow
def test_ddp_is_deterministic_and_its_gradient_modes_agree_bit_for_bit(equality: list[dict[str, Any]]) -> None:
    for result in equality:
        assert result["sgd"]["rerun_identical"] and result["adam"]["rerun_identical"]
        assert result["set_to_none_false_identical"]
        assert result["not_bucket_view_identical"]


@pytest.mark.slow
def test_no_sync_accumulates_and_the_next_backward_reduces_the_sum(equality: list[dict[str, Any]]) -> None:
    for result in equality:
        assert result["no_sync_vs_single"] <= SGD_TOLERANCE


@pytest.mark.slow
def test_a_parameter_unused_on_some_ranks_is_averaged_with_zeros(equality: list[dict[str, Any]]) -> None:
    for result in equality:
        assert set(result["unused"]) == {"a.weight", "a.bias", "b.weight", "b.bias"}
        assert max(result["unused"].values()) <= 1e-6, result["unused"]


@pytest.mark.slow
def test_allreduces_start_while_backward_still_produces_gradients(equality: list[dict[str, Any]]) -> None:
    for result in equality:
        overlap = result["overlap"]
        assert overlap["buckets"] >= 4 and overlap["allreduces"] == overlap["buckets"], overlap
        # Every bucket but the last (which holds the last gradient) started before backward produced
        # the last gradient: communication overlapped computation.
        assert overlap["started_before_last_gradient"] == overlap["buckets"] - 1, overlap
        assert overlap["grads_are_bucket_views"], overlap


@pytest.mark.slow
def test_buckets_follow_reverse_registration_order(equality: list[dict[str, Any]]) -> None:
    names = [name for name, _ in ByteGPT(ddp_job.CONFIG).named_parameters()]
    for result in equality:
        flat = [name for bucket in result["buckets"] for name in bucket]
        assert flat == names[::-1]


@pytest.mark.slow
def test_state_dict_has_the_wrapped_modules_keys(equality: list[dict[str, Any]]) -> None:
    for result in equality:
        assert result["state_dict_keys_match"]
        assert result["state_dict_loads_into_bare_model"]
        assert result["bare_state_dict_loads"]


@pytest.mark.slow
def test_ranks_wrapping_different_models_all_get_a_clear_error(equality: list[dict[str, Any]]) -> None:
    for result in equality:
        mismatch = result["mismatch"]
        assert mismatch["count"] is not None and "wrap different models" in mismatch["count"]
        assert "parameters: 4 to 6" in mismatch["count"], mismatch
        assert mismatch["shapes"] is not None and "other parameter names, shapes or dtypes" in mismatch["shapes"]
        # The refusals broke nothing: the group then wrapped a matching model and reduced its gradients.
        assert len(mismatch["after"]) == 4
    assert equality[0]["mismatch"]["after"] == equality[1]["mismatch"]["after"]


@pytest.mark.slow
def test_a_dead_rank_fails_the_others_backward_instead_of_hanging() -> None:
    procs = _start("kill", 2)
    try:
        [survivor] = collect_results(procs[:1], JOB_TIMEOUT_S, "the surviving rank")
        assert procs[1].wait(timeout=JOB_TIMEOUT_S) == -9
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert survivor["ok"], survivor
    assert survivor["steps"] == 2, survivor  # the step the peer died in did not complete
    assert "HFReduce" in survivor.get("error", ""), survivor
    assert survivor["failed_after_s"] <= ddp_job.KILL_TIMEOUT_S + 15, survivor  # within the timeout, not a hang


# -- one rank, in this process ------------------------------------------------------------------


@pytest.fixture(scope="module")
def comm() -> Iterator[hfreduce.Communicator]:
    communicator = hfreduce.Communicator(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                                         timeout_s=30)
    yield communicator
    communicator.shutdown()


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    # 256 x 1024 float32 weights: 1 MiB each, so the caps below decide the buckets.
    return nn.Sequential(nn.Linear(1024, 256), nn.Linear(256, 1024), nn.Linear(1024, 8))


def _backward(model: nn.Module) -> None:
    torch.autograd.backward(model(torch.ones(2, 1024)).square().sum())


def test_bucket_caps_first_bucket_small_and_large_parameters_alone(comm: hfreduce.Communicator) -> None:
    model = DistributedDataParallel(_mlp(), comm=comm, bucket_cap_mb=1.5)
    sizes = [sum(dict(model.module.named_parameters())[name].numel() * 4 for name in bucket)
             for bucket in model.bucket_names()]
    assert model.bucket_names()[0] == ["2.bias", "2.weight", "1.bias"]
    assert sizes[0] <= FIRST_BUCKET_CAP_BYTES
    # 1.weight (1 MiB) would overflow the first bucket; 0.bias (1 KiB) joins it in the second.
    assert model.bucket_names()[1:] == [["1.weight", "0.bias"], ["0.weight"]]


def test_gradients_are_views_of_one_registered_buffer_even_after_set_to_none(comm: hfreduce.Communicator) -> None:
    model = DistributedDataParallel(_mlp(), comm=comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())
        _backward(model)
        slots = {id(slot.param): slot for slot in model._slots}
        for param in model.parameters():
            assert param.grad is not None and param.grad.data_ptr() == slots[id(param)].view.data_ptr()
        optimizer.step()
    # The buckets of one dtype lie end to end in one buffer (allocated with comm.shared_tensor).
    flats = sorted((bucket.flat.data_ptr(), bucket.flat.numel()) for bucket in model._buckets)
    assert all(start + 4 * size == following for (start, size), (following, _) in itertools.pairwise(flats))


def test_frozen_parameters_stay_out_and_dtypes_get_buckets_of_their_own(comm: hfreduce.Communicator) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8).double(), nn.Linear(8, 2).double())
    module[2].bias.requires_grad_(False)
    reference = copy.deepcopy(module)
    model = DistributedDataParallel(module, comm=comm)
    params = dict(model.module.named_parameters())
    for bucket in model.bucket_names():
        assert len({params[name].dtype for name in bucket}) == 1, bucket
    assert "2.bias" not in [name for bucket in model.bucket_names() for name in bucket]

    def run(net: nn.Sequential) -> None:
        out = net[2](net[1](net[0](torch.ones(3, 4)).double()))
        torch.autograd.backward(out.square().sum())

    run(module)
    run(reference)
    assert params["2.bias"].grad is None
    for name, param in reference.named_parameters():
        if param.requires_grad:
            reduced = params[name].grad
            assert param.grad is not None and reduced is not None
            assert torch.equal(reduced, param.grad), name  # one rank: the average is the gradient


def test_gradient_as_bucket_view_false_keeps_its_own_gradients(comm: hfreduce.Communicator) -> None:
    copying = DistributedDataParallel(_mlp(), comm=comm, gradient_as_bucket_view=False)
    viewing = DistributedDataParallel(_mlp(), comm=comm)
    for model in (copying, viewing):
        _backward(model)
    views = {slot.view.data_ptr() for slot in copying._slots}
    for mine, theirs in zip(copying.parameters(), viewing.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert mine.grad.data_ptr() not in views
        assert torch.equal(mine.grad, theirs.grad)


def test_no_sync_communicates_nothing(comm: hfreduce.Communicator, monkeypatch: pytest.MonkeyPatch) -> None:
    model = DistributedDataParallel(_mlp(), comm=comm)
    calls: list[int] = []
    real = comm.allreduce

    def counting(tensor: Any, op: hfreduce.ReduceOp = hfreduce.ReduceOp.SUM, async_op: bool = False) -> hfreduce.Work:
        calls.append(tensor.numel())
        return real(tensor, op, async_op)

    monkeypatch.setattr(comm, "allreduce", counting)
    with model.no_sync():
        _backward(model)
        _backward(model)
    assert calls == []
    once = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    _backward(model)
    assert len(calls) == len(model.bucket_names())
    # Three backward passes accumulated: the synchronized one added the third to the first two.
    for grad, param in zip(once, model.parameters(), strict=True):
        assert param.grad is not None
        torch.testing.assert_close(param.grad, grad * 3 / 2)


def test_state_dict_round_trips_through_a_bare_model_and_a_parent(comm: hfreduce.Communicator) -> None:
    model = DistributedDataParallel(_mlp(), comm=comm)
    assert list(model.state_dict()) == list(model.module.state_dict())
    parent = nn.ModuleDict({"net": model})
    assert list(parent.state_dict()) == [f"net.{key}" for key in model.module.state_dict()]
    bare = _mlp()
    with torch.no_grad():
        for param in bare.parameters():
            param.add_(1)
    model.load_state_dict(bare.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.module.parameters(), bare.parameters(), strict=True))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        model.load_state_dict({**bare.state_dict(), "extra": torch.zeros(1)})


def test_bad_arguments_are_refused_before_anything_changes(comm: hfreduce.Communicator) -> None:
    module = _mlp()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        DistributedDataParallel(module, comm=comm, bucket_cap_mb=0)
    with warnings.catch_warnings():  # torch calls complex modules experimental
        warnings.simplefilter("ignore", UserWarning)
        complex_model = nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises(ValueError, match="complex64: HFReduce reduces"):
        DistributedDataParallel(complex_model, comm=comm)
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), before, strict=True))
    assert all(p.grad is None for p in module.parameters())


def test_forward_after_an_interrupted_backward_is_refused(comm: hfreduce.Communicator) -> None:
    model = DistributedDataParallel(_mlp(), comm=comm)
    first = next(model.module.parameters())

    def fail(param: torch.Tensor) -> None:
        raise RuntimeError("a failing hook")

    handle = first.register_post_accumulate_grad_hook(fail)  # type: ignore[no-untyped-call]
    with pytest.raises(RuntimeError, match="a failing hook"):
        _backward(model)
    handle.remove()
    with pytest.raises(RuntimeError, match="previous backward pass did not finish"):
        model(torch.ones(2, 1024))


# -- the benchmark's bookkeeping ----------------------------------------------------------------


def _bench_rank(rank: int, haiscale_s: list[float], difference: float = 0.0) -> dict[str, Any]:
    return {"rank": rank, "parameters": {"mlp": 1000},
            "seconds": {"mlp": {"haiscale": haiscale_s, "torch": [0.4, 0.4, 0.4], "local": [0.1, 0.1, 0.1]}},
            "max_param_difference": {"mlp": difference}}


def test_bench_takes_the_slowest_rank_per_repetition_and_refuses_diverging_ddps() -> None:
    from bench.haiscale_ddp_bench import ResultsError, cells_for_layout, parse_models, validate_results
    from bench.hfreduce_bench import Layout

    layout = Layout(1, 2)
    # Repetition medians of the slowest rank: max(0.1, 0.2)=0.2, max(0.3, 0.1)=0.3, max(0.1, 0.1)=0.1 -> 0.2.
    [cell] = cells_for_layout(layout, ["mlp"], [_bench_rank(0, [0.1, 0.3, 0.1]), _bench_rank(1, [0.2, 0.1, 0.1])])
    assert cell["haiscale_step_s"] == pytest.approx(0.2)
    assert cell["speedup"] == pytest.approx(2.0) and cell["goal_met"]
    assert cell["haiscale_overhead_s"] == pytest.approx(0.1)
    with pytest.raises(RuntimeError, match="not timing the same training"):
        cells_for_layout(layout, ["mlp"], [_bench_rank(0, [0.1] * 3), _bench_rank(1, [0.1] * 3, difference=0.01)])
    with pytest.raises(argparse.ArgumentTypeError, match="not one of"):
        parse_models("mlp,resnet")
    assert parse_models("gpt,mlp,gpt") == ["gpt", "mlp"]
    record = {"format_version": 1, "cells": [cell]}
    assert validate_results(record) is record
    for bad, field in (({**record, "format_version": 2}, "format_version"),
                       ({**record, "cells": [{**cell, "speedup": 0}]}, "speedup"),
                       ({**record, "cells": [{**cell, "model": "resnet"}]}, "model")):
        with pytest.raises(ResultsError, match=field):
            validate_results(bad)

"""Hostile checks of the parallel training paths: what a user does between the textbook steps
(evaluate, load a state, leave and rejoin) must not leave stale parameters, live communicators or
silent garbage behind. One-rank communicators in this process unless a check needs a peer."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import haiscale
import hfreduce
from haiscale.fsdp import FullyShardedDataParallel
from haiscale.models import Block, ByteGPT, Embedding, GPTConfig, Head, lm_loss
from tests.hfreduce.runner import ROOT, free_port, rank_env

CONFIG = GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)
WRAP = (Embedding, Block, Head)


@pytest.fixture(scope="module")
def comm() -> Iterator[hfreduce.Communicator]:
    one = hfreduce.Communicator(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                                timeout_s=20)
    yield one
    one.shutdown()


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, 256, (4, CONFIG.block_size + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


# -- FSDP: a unit kept gathered must never compute with values its shard no longer holds ---------------------


def test_fsdp_kept_gathered_sees_a_loaded_state(comm: hfreduce.Communicator) -> None:
    model = FullyShardedDataParallel(ByteGPT(CONFIG, seed=1), comm=comm, wrap=WRAP, reshard_after_forward=False)
    other = FullyShardedDataParallel(ByteGPT(CONFIG, seed=5), comm=comm, wrap=WRAP)
    inputs, _ = _batch(1)
    with torch.no_grad():
        model(inputs)  # an evaluation forward
        assert model.gathered_bytes() == 0, "no backward follows a no_grad forward: nothing stays gathered"
        model.load_sharded_state_dict(other.sharded_state_dict())
        assert torch.equal(model(inputs), other(inputs))


def test_fsdp_kept_gathered_sees_an_optimizer_step(comm: hfreduce.Communicator) -> None:
    """Backward, an evaluation, then the step: the next forward must use the stepped parameters (it
    used the gathered pre-step ones: outputs off by the whole update)."""
    inputs, targets = _batch(2)
    outputs = []
    for model in (FullyShardedDataParallel(ByteGPT(CONFIG, seed=1), comm=comm, wrap=WRAP,
                                           reshard_after_forward=False), ByteGPT(CONFIG, seed=1)):
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        torch.autograd.backward(lm_loss(model(inputs), targets))
        # A grad-enabled forward with no backward keeps its units gathered (reshard_after_forward=False).
        model(inputs)
        optimizer.step()
        with torch.no_grad():
            outputs.append(model(inputs))
    assert float((outputs[0] - outputs[1]).abs().max()) <= 1e-6


def test_fsdp_shared_unit_and_double_forward_train_like_the_module(comm: hfreduce.Communicator) -> None:
    """Two forwards before one backward (gradient accumulation in one graph) with units kept gathered
    or resharded: the same gradients as the plain module."""
    for reshard in (True, False):
        reference = ByteGPT(CONFIG, seed=3)
        sharded = FullyShardedDataParallel(ByteGPT(CONFIG, seed=3), comm=comm, wrap=WRAP,
                                           reshard_after_forward=reshard)
        for model in (reference, sharded):
            (x1, y1), (x2, y2) = _batch(3), _batch(4)
            torch.autograd.backward(lm_loss(model(x1), y1) + lm_loss(model(x2), y2))
            torch.optim.SGD(model.parameters(), lr=1.0).step()
        mine = sharded.full_state_dict()
        assert max(float((mine[n] - p.detach()).abs().max()) for n, p in reference.named_parameters()) <= 1e-6
        assert sharded.gathered_bytes() == 0


# -- haiscale.init / destroy ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_destroy_closes_the_hfreduce_groups_when_the_default_group_is_the_callers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    assert not dist.is_initialized()
    dist.init_process_group("gloo")
    try:
        first = haiscale.init(timeout_s=20).dp_comm
        haiscale.destroy()
        haiscale.destroy()  # twice: nothing left to do
        with pytest.raises(hfreduce.HFReduceError, match="shut down"):
            first.allreduce(torch.ones(2))
        assert dist.is_initialized(), "the caller's default group stays"
        second = haiscale.init(timeout_s=20).dp_comm  # and the job can be joined again
        tensor = torch.ones(2)
        second.allreduce(tensor)
        assert tensor.tolist() == [1.0, 1.0]
        haiscale.destroy()
    finally:
        if haiscale.dist._context is not None:
            haiscale.destroy()
        dist.destroy_process_group()


# -- the example: a checkpoint resumes only in the layout that wrote it -------------------------------------------


def _train_gpt(mode: str, data: Path, ckpt: Path, steps: int) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "haiscale.examples.train_gpt", "--mode", mode, "--data", str(data), "--ckpt",
               str(ckpt), "--layers", "1", "--embd", "16", "--heads", "2", "--batch-size", "4", "--save-every", "2",
               "--steps", str(steps), "--timeout-s", "20"]
    return subprocess.run(command, cwd=ROOT, env=rank_env(0, 1, free_port(), None, {"OMP_NUM_THREADS": "1"}),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_checkpoint_of_another_mode_is_refused_before_anything_loads(tmp_path: Path) -> None:
    """An FSDP checkpoint resumed by DDP failed deep in the optimizer's loader (``KeyError: 'params'``,
    after the model had been overwritten); a DDP one resumed by FSDP was called damaged and older
    checkpoints were tried. Both must be one clear refusal that leaves the checkpoint resumable."""
    corpus, data, ckpt = tmp_path / "corpus", tmp_path / "data", tmp_path / "ckpt"
    corpus.mkdir()
    (corpus / "text.txt").write_bytes(bytes(range(256)) * 20)
    subprocess.run([sys.executable, "-m", "haiscale.data", "convert", str(corpus), str(data), "--text",
                    "--record-bytes", "17", "--records-per-file", "512"], cwd=ROOT, check=True, capture_output=True,
                   env=dict(rank_env(0, 1, 0, None, {})), timeout=120)
    first = _train_gpt("fsdp", data, ckpt, 2)
    assert first.returncode == 0, first.stderr
    refused = _train_gpt("ddp", data, ckpt, 4)
    assert refused.returncode != 0
    assert "was written by --mode fsdp (sharded); this run is --mode ddp (replicated)" in refused.stderr
    resumed = _train_gpt("fsdp", data, ckpt, 4)  # the checkpoint is intact, and its own mode resumes it
    assert resumed.returncode == 0, resumed.stderr
    assert '"start_step": 2' in resumed.stdout

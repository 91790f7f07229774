"""Programs the checkpoint tests run as fresh processes.

``train LOCATION TOTAL STOP OUT``: train a tiny model with dropout on shuffled data (torch's, numpy's
and Python's generators all drawn from every step); resume from LOCATION's latest checkpoint if there
is one, stop after step STOP (saving a checkpoint of it there when STOP < TOTAL), and at TOTAL write
the final model and optimizer state to OUT with ``torch.save``.

``crash BASE CASE...``: for each CASE a forked process where two ranks (one manager each) save a
few MiB as step 2 to ``BASE/CASE``, stopping at the point CASE names — ``mid_write`` (while the data files are written),
``no_markers`` (rank 0's files written, no marker anywhere), ``some_markers`` (rank 1's marker only),
``before_rename`` (the manifest written) — printing ``PAUSED CASE PID`` for the test to SIGKILL it.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from haiscale.checkpoint import CheckpointManager

CRASH_RUN_ID = "c0ffee"
CRASH_TENSORS = 4
CRASH_TENSOR_ELEMENTS = 1 << 18


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))


def train(location: str, total: int, stop: int, out: str, reseed_after_load: bool = False) -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    target = data.sum(dim=1, keepdim=True)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(location, keep=2)
    loaded = ckpt.load_latest(model, opt)
    start = 0 if loaded is None else int(loaded.extra["next_step"])
    if reseed_after_load:  # what a resume without the saved RNG states would draw
        torch.manual_seed(0)
    for _step in range(start, stop):
        order = torch.randperm(len(data))[:16]
        noise = torch.from_numpy(np.random.randn(16, 1).astype(np.float32)) * 0.01
        scale = 1.0 + random.random() * 0.01
        loss = ((model(data[order]) - target[order] - noise) ** 2).mean() * scale
        opt.zero_grad()
        loss.backward()
        opt.step()
    if stop < total:
        ckpt.save(stop, model, opt, extra={"next_step": stop})
    ckpt.close()
    if stop == total:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, out)


def crash(location: str, case: str) -> None:
    gen = torch.Generator().manual_seed(2)
    state = {f"w{i}": torch.randn(CRASH_TENSOR_ELEMENTS, generator=gen) for i in range(CRASH_TENSORS)}
    pause = {"no_markers": "rank_files_written", "some_markers": "rank_files_written",
             "before_rename": "manifest_written"}.get(case)

    def observe(phase: str, step: int) -> None:
        if phase == pause:
            print(f"PAUSED {case} {os.getpid()}", flush=True)
            threading.Event().wait()  # until the test kills the process

    managers = [CheckpointManager(location, rank=rank, world_size=2, run_id=CRASH_RUN_ID,
                                  observer=observe if rank == 0 else None) for rank in range(2)]
    extra: dict[str, Any] = {"step": 2}
    if case in ("some_markers", "before_rename"):
        managers[1].save(2, extra=extra | state)
        managers[1].wait()
    managers[0].save(2, extra=extra | state)
    if case == "mid_write":
        print(f"PAUSED {case} {os.getpid()}", flush=True)
    time.sleep(600)


def crash_all(base: str, cases: list[str]) -> None:
    """One process per case (``LOCATION/CASE``), forked from this one once torch is imported: the
    import is the slow part of starting a process."""
    children = []
    for case in cases:
        pid = os.fork()
        if pid == 0:
            try:
                crash(f"{base}/{case}", case)
            finally:
                os._exit(1)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    elif sys.argv[1] == "crash":
        crash_all(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(f"unknown program {sys.argv[1]!r}")

"""The random number generators a training step draws from, captured and restored.

A run resumed from a checkpoint is bit-identical to one that never stopped only if dropout masks,
data shuffles and augmentations draw the same numbers after the resume: so each rank saves torch's
CPU generator (and every CUDA device's, where there are any), numpy's global generator and Python's
``random`` with its checkpoint, and :meth:`CheckpointManager.load_latest` puts them back last.

The state is kept as tensors and JSON values (never pickles), so it travels in the checkpoint's
index and data files like any other state.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states: a tree of tensors and JSON values (see module doc)."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "state": [int(v) for v in internal], "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: Any) -> None:
    """Put back what :func:`capture_rng_state` returned (read back from a checkpoint): every part is
    checked first, so a malformed state changes no generator."""
    if not isinstance(state, dict):
        raise ValueError("an RNG state is a dict")
    torch_state = state.get("torch")
    numpy_state = state.get("numpy")
    python_state = state.get("python")
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8:
        raise ValueError("the RNG state has no torch generator state")
    if not isinstance(numpy_state, dict) or not isinstance(python_state, dict):
        raise ValueError("the RNG state lacks numpy's or Python's generator")
    keys = numpy_state.get("keys")
    internal = python_state.get("state")
    if not isinstance(keys, torch.Tensor) or not isinstance(internal, list | tuple):
        raise ValueError("the RNG state's numpy keys or Python state are malformed")
    numpy_tuple = (str(numpy_state["name"]), keys.numpy().astype(np.uint32), int(numpy_state["pos"]),
                   int(numpy_state["has_gauss"]), float(numpy_state["cached_gaussian"]))
    python_tuple = (int(python_state["version"]), tuple(int(v) for v in internal), python_state.get("gauss_next"))
    cuda = state.get("cuda")
    # Set only once every part has been read: a failure above leaves every generator as it was.
    torch.set_rng_state(torch_state.clone())
    np.random.set_state(numpy_tuple)
    random.setstate(python_tuple)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(cuda))

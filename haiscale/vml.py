"""Resolve MKL's vector-math kernels before any op can call them from several threads at once.

On CPU, torch runs contiguous float32/float64 unary ops (``sqrt``, ``exp``, ``log``, ``tanh``, ...)
through MKL VML (``vmsSqrt(n, in, out, VML_HA | ...)``), each intra-op thread on its own chunk.
oneMKL picks each VML function's kernel (ISA and accuracy) lazily, on that function's first call;
when that first call runs on several threads at once — a fresh process's first sizable op, on a
loaded machine — one thread can run a *low-accuracy* kernel over its whole chunk of that one call
(relative errors up to ~4e-4, thousands of ulps), although high accuracy was asked for. Later calls
are exact, so the damage is silent and looks like a heisenbug (pytorch/pytorch#188792; fixed
upstream by the same warm-up, pytorch/pytorch#188791, and in oneMKL 2025).

For HaiScale it broke DDP's bit-identical replicas: Adam's first ``exp_avg_sq.sqrt()`` (the
process's first large ``sqrt``) came out approximate on one rank now and then, so that rank's
parameters drifted from the others' after step 1 (``train_gpt --check-replicas`` caught it).

:func:`warm_up` calls every VML-backed op once, on one element (one call, one thread), for both
float dtypes: each function's dispatch is then resolved before any concurrent use. Importing
:mod:`haiscale` does it.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["VML_OPS", "warm_up", "warmed_up"]

VML_OPS: tuple[str, ...] = ("sqrt", "rsqrt", "exp", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan",
                            "asin", "acos", "atan", "sinh", "cosh", "tanh", "erf", "erfc", "erfinv", "lgamma",
                            "trunc", "floor", "ceil", "round", "reciprocal", "sigmoid")
"""The float unary ops of torch whose CPU kernels may go through MKL VML (a superset: warming up an op
that does not is harmless)."""

_DTYPES = (torch.float32, torch.float64)
_lock = threading.Lock()
_done = False


def warmed_up() -> bool:
    """True once :func:`warm_up` ran in this process."""
    return _done


def warm_up() -> None:
    """Call each of :data:`VML_OPS` once, single-threaded, in float32 and float64 (once per process)."""
    global _done
    with _lock:
        if _done:
            return
        with torch.no_grad():
            for dtype in _DTYPES:
                one = torch.full((1,), 0.5, dtype=dtype)  # inside every op's domain
                for name in VML_OPS:
                    getattr(torch, name)(one)
        _done = True

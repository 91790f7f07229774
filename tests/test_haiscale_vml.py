"""haiscale.vml: importing haiscale resolves MKL's vector-math kernels with one single-threaded call
each, before any op of the process can make a first call from several intra-op threads at once
(oneMKL's lazy dispatch could then run one thread's chunk with a low-accuracy kernel: Adam's first
``sqrt`` came out approximate on one DDP rank, and its replica drifted after step 1)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.hfreduce.runner import ROOT

torch = pytest.importorskip("torch")

# Runs in a fresh interpreter: records every torch function called while haiscale is imported.
_SPY = """
import json, torch
from torch.overrides import TorchFunctionMode

calls = []

class Spy(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if isinstance(first, torch.Tensor):
            calls.append([getattr(func, "__name__", str(func)), str(first.dtype), first.numel(), first.device.type])
        return func(*args, **(kwargs or {}))

with Spy():
    import haiscale
    import haiscale.vml
print(json.dumps({"calls": calls, "ops": list(haiscale.vml.VML_OPS), "warmed": haiscale.vml.warmed_up()}))
"""


def test_importing_haiscale_calls_every_vector_math_op_once_on_one_element() -> None:
    out = subprocess.run([sys.executable, "-c", _SPY], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["warmed"]
    called = {(name, dtype) for name, dtype, numel, device in result["calls"] if numel == 1 and device == "cpu"}
    for op in ("sqrt", "exp", "log", "tanh", "erf", "sin"):
        assert op in result["ops"]
    missing = [(op, dtype) for op in result["ops"] for dtype in ("torch.float32", "torch.float64")
               if (op, dtype) not in called]
    assert not missing, f"not warmed up at import: {missing}"


def test_warm_up_runs_once_and_leaves_results_exact() -> None:
    import haiscale.vml as vml

    vml.warm_up()
    vml.warm_up()  # idempotent
    assert vml.warmed_up()
    values = torch.rand(1 << 16, dtype=torch.float32) + 1e-3
    # Several threads' chunks of one call agree with one thread's computation, element for element.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = values.sqrt()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(values.sqrt(), serial)

"""What HFReduce accepts as a buffer: torch tensors (CPU, or CUDA through pinned host memory) and
numpy arrays, contiguous, of the supported dtypes; everything else is a typed error before any rank
starts the collective.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hfreduce.errors import InvalidArgument
from hfreduce.kernels import DType

__all__ = ["FlatBuffer", "as_buffer"]

_NUMPY_DTYPES = {np.dtype(np.float32): DType.FLOAT32, np.dtype(np.float64): DType.FLOAT64,
                 np.dtype(np.float16): DType.FLOAT16, np.dtype(np.int32): DType.INT32,
                 np.dtype(np.int64): DType.INT64}


@dataclass(slots=True)
class FlatBuffer:
    """A one-dimensional numpy view of the caller's memory (bf16 as its uint16 bits).

    ``finish`` (CUDA tensors) copies the host staging buffer back to the device once the collective
    has written it; ``owner`` keeps the caller's object alive while the collective runs.
    """

    array: np.ndarray
    dtype: DType
    owner: Any
    finish: Callable[[], None] | None = None

    @property
    def count(self) -> int:
        return int(self.array.shape[0])


def _torch_buffer(tensor: Any, writable: bool, what: str) -> FlatBuffer:
    import torch

    dtypes = {torch.float32: DType.FLOAT32, torch.float64: DType.FLOAT64, torch.float16: DType.FLOAT16,
              torch.bfloat16: DType.BFLOAT16, torch.int32: DType.INT32, torch.int64: DType.INT64}
    dtype = dtypes.get(tensor.dtype)
    if dtype is None:
        raise InvalidArgument(f"{what}: dtype {tensor.dtype} is not supported "
                              f"(float32, float64, float16, bfloat16, int32, int64)")
    if not tensor.is_contiguous():
        raise InvalidArgument(f"{what}: the tensor is not contiguous (call .contiguous() first)")
    if tensor.is_cuda:
        return _cuda_buffer(tensor, dtype, writable, what)
    if tensor.device.type != "cpu":
        raise InvalidArgument(f"{what}: tensors on {tensor.device.type} are not supported (cpu, cuda)")
    host = tensor.detach()
    # bf16 has no numpy type: its bits travel as uint16.
    array = host.view(torch.int16).numpy().view(np.uint16) if dtype is DType.BFLOAT16 else host.numpy()
    return FlatBuffer(array.reshape(-1), dtype, tensor)


def _cuda_buffer(tensor: Any, dtype: DType, writable: bool, what: str) -> FlatBuffer:
    """Stage a CUDA tensor through pinned host memory on a side stream (the paper's D2H / H2D)."""
    import torch

    side = torch.cuda.Stream(device=tensor.device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(tensor.device))
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    with torch.cuda.stream(side):
        host.copy_(tensor, non_blocking=True)
    side.synchronize()
    staged = _torch_buffer(host, writable, what)

    def copy_back() -> None:
        with torch.cuda.stream(side):
            tensor.copy_(host, non_blocking=True)
        side.synchronize()

    return FlatBuffer(staged.array, dtype, (tensor, host), copy_back if writable else None)


def as_buffer(obj: Any, *, writable: bool, what: str) -> FlatBuffer:
    """The flat view of ``obj``, or :class:`InvalidArgument` saying what is wrong with it."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_buffer(obj, writable, what)
    if isinstance(obj, np.ndarray):
        dtype = _NUMPY_DTYPES.get(obj.dtype)
        if dtype is None:
            raise InvalidArgument(f"{what}: dtype {obj.dtype} is not supported "
                                  f"(float32, float64, float16, int32, int64; bfloat16 as a torch tensor)")
        if not obj.flags.c_contiguous:
            raise InvalidArgument(f"{what}: the array is not C-contiguous (use np.ascontiguousarray)")
        if writable and not obj.flags.writeable:
            raise InvalidArgument(f"{what}: the array is read-only")
        return FlatBuffer(obj.reshape(-1), dtype, obj)
    raise InvalidArgument(f"{what}: expected a torch tensor or a numpy array, not {type(obj).__name__}")

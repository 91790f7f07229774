"""The arithmetic of HFReduce: dtypes, the accumulator type of each, and the numpy kernels that add.

Every kernel is one numpy ufunc call over a large block, which runs in C and releases the GIL — the
reducer threads of the leader, the copy-in and copy-out of the ranks and the network threads all run
in parallel on the machine's cores.

Accumulation: 16-bit floats (fp16, bf16) are added in fp32 and the partial sums stay fp32 all the way
through the tree (also on the wire); the result is rounded to the tensor's dtype once, on copy-out.
Integers add with wrap-around, as torch's do. The order of additions is fixed — local ranks in rank
order, then a tree node's own partial followed by its children's in index order — so a job run twice
on the same layout gives bit-identical results.

Broadcast and all-gather reuse the same pipeline with a bitwise OR over the raw bits: every rank but
the source deposits zeros, and ``x | 0 == x`` restores the source's bytes exactly (a float ``+ 0.0``
would turn ``-0.0`` into ``+0.0``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from hfreduce.errors import InvalidArgument

__all__ = ["Arithmetic", "DType", "ReduceOp", "arithmetic", "bits_dtype"]

# Elements per block when more than two inputs are summed: the accumulator block and one input block
# stay in a core's L2 cache, so each input is read from memory once and the result written once.
_BLOCK_ELEMENTS = 32 * 1024
# Overflow to inf and inf - inf are what a sum of floats gives, as in torch's own collectives; numpy
# would print a warning from a pipeline thread for every such chunk.
# (A fresh errstate per call: one shared instance is not safe to enter from several threads.)
def _quiet() -> np.errstate:
    return np.errstate(over="ignore", invalid="ignore")


class DType(enum.IntEnum):
    """The element types HFReduce reduces (the wire and descriptor code of each)."""

    FLOAT32 = 1
    FLOAT64 = 2
    FLOAT16 = 3
    BFLOAT16 = 4
    INT32 = 5
    INT64 = 6
    # Raw bits, for broadcast and all-gather (bitwise OR).
    BITS8 = 7
    BITS16 = 8
    BITS32 = 9
    BITS64 = 10


class ReduceOp(enum.IntEnum):
    SUM = 1
    AVG = 2
    MAX = 3
    MIN = 4
    BOR = 5  # internal: broadcast and all-gather


# How each dtype is stored in memory (bf16 has no numpy type: its bits travel as uint16).
STORAGE: dict[DType, np.dtype[np.generic]] = {
    DType.FLOAT32: np.dtype(np.float32), DType.FLOAT64: np.dtype(np.float64), DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(np.uint16), DType.INT32: np.dtype(np.int32), DType.INT64: np.dtype(np.int64),
    DType.BITS8: np.dtype(np.uint8), DType.BITS16: np.dtype(np.uint16), DType.BITS32: np.dtype(np.uint32),
    DType.BITS64: np.dtype(np.uint64),
}
_BITS_OF_SIZE = {1: DType.BITS8, 2: DType.BITS16, 4: DType.BITS32, 8: DType.BITS64}
_FLOATS = {DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16}


def bits_dtype(itemsize: int) -> DType:
    return _BITS_OF_SIZE[itemsize]


def _bf16_to_f32(bits: np.ndarray, out: np.ndarray) -> None:
    np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)


def _f32_to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    """Round fp32 to bf16 to nearest, ties to even (torch's rounding); NaN stays a quiet NaN."""
    raw = values.view(np.uint32)
    rounded = (raw >> 16) & 1
    rounded += 0x7FFF
    rounded += raw
    rounded >>= 16
    np.copyto(out, rounded, casting="unsafe")
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0


@dataclass(frozen=True, slots=True)
class Arithmetic:
    """How one (dtype, op) pair is deposited, reduced, combined and collected."""

    dtype: DType
    op: ReduceOp
    storage: np.dtype[np.generic]
    accumulator: np.dtype[np.generic]

    @property
    def accumulator_itemsize(self) -> int:
        return self.accumulator.itemsize

    def _ufunc(self) -> np.ufunc:
        if self.op in (ReduceOp.SUM, ReduceOp.AVG):
            return np.add
        if self.op is ReduceOp.MAX:
            return np.maximum
        if self.op is ReduceOp.MIN:
            return np.minimum
        return np.bitwise_or

    def reduce(self, inputs: list[np.ndarray], out: np.ndarray, scratch: np.ndarray) -> None:
        with _quiet():
            self._reduce(inputs, out, scratch)

    def _reduce(self, inputs: list[np.ndarray], out: np.ndarray, scratch: np.ndarray) -> None:
        """``out`` (accumulator dtype) = inputs[0] op inputs[1] op ... in that order.

        ``inputs`` are views in the storage dtype; ``scratch`` is an accumulator-typed buffer at least
        one block long (used only for bf16, whose bits must be widened before they can be added).
        """
        ufunc = self._ufunc()
        count = out.shape[0]
        step = max(count, 1) if len(inputs) <= 2 and self.dtype is not DType.BFLOAT16 else _BLOCK_ELEMENTS
        for start in range(0, count, step):
            end = min(start + step, count)
            acc = out[start:end]
            if self.dtype is DType.BFLOAT16:
                _bf16_to_f32(inputs[0][start:end], acc)
                widened = scratch[:end - start]
                for source in inputs[1:]:
                    _bf16_to_f32(source[start:end], widened)
                    ufunc(acc, widened, out=acc)
                continue
            if len(inputs) == 1:
                np.copyto(acc, inputs[0][start:end], casting="unsafe")
                continue
            ufunc(inputs[0][start:end], inputs[1][start:end], out=acc, dtype=self.accumulator)
            for source in inputs[2:]:
                ufunc(acc, source[start:end], out=acc, dtype=self.accumulator)

    def combine(self, acc: np.ndarray, other: np.ndarray) -> None:
        """``acc = acc op other`` for two partial results (accumulator dtype): the tree's step."""
        with _quiet():
            self._ufunc()(acc, other, out=acc)

    def collect(self, acc: np.ndarray, out: np.ndarray, divisor: int) -> None:
        """Write the final result into the caller's buffer (storage dtype), dividing for AVG."""
        with _quiet():
            self._collect(acc, out, divisor)

    def _collect(self, acc: np.ndarray, out: np.ndarray, divisor: int) -> None:
        if self.dtype is DType.BFLOAT16:
            if self.op is ReduceOp.AVG:
                acc = acc / np.float32(divisor)
            _f32_to_bf16(acc, out)
        elif self.op is ReduceOp.AVG:
            np.divide(acc, self.accumulator.type(divisor), out=out, casting="unsafe")
        else:
            np.copyto(out, acc, casting="unsafe")


def arithmetic(dtype: DType, op: ReduceOp) -> Arithmetic:
    storage = STORAGE[dtype]
    if op is ReduceOp.BOR:
        if dtype not in _BITS_OF_SIZE.values():
            raise InvalidArgument("bitwise reduction is only for raw bits")
        return Arithmetic(dtype, op, storage, storage)
    if dtype not in _FLOATS and dtype not in (DType.INT32, DType.INT64):
        raise InvalidArgument(f"{dtype.name} cannot be reduced with {op.name}")
    if op is ReduceOp.AVG and dtype not in _FLOATS:
        raise InvalidArgument(f"AVG of {dtype.name.lower()} would truncate: use SUM and divide")
    accumulator = np.dtype(np.float32) if dtype in (DType.FLOAT16, DType.BFLOAT16) else storage
    return Arithmetic(dtype, op, storage, accumulator)

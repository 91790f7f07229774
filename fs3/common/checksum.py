"""CRC32C helpers (C-accelerated, SSE4.2 where available, through the ``crc32c`` package).

``crc32c`` accepts any buffer (bytes, bytearray, memoryview) without a copy, which matters on
the hot path where payloads arrive as memoryviews.
"""

from __future__ import annotations

import crc32c as _crc32c

from fs3.common.buffers import Buffer

__all__ = ["crc32c", "crc32c_extend", "crc32c_patch"]


def crc32c(data: Buffer) -> int:
    """CRC32C (Castagnoli) of ``data`` as an unsigned 32-bit int."""
    return int(_crc32c.crc32c(data))


def crc32c_extend(crc: int, data: Buffer) -> int:
    """Continue a CRC32C over more data."""
    return int(_crc32c.crc32c(data, crc))


# -- patching a CRC without rereading the data ---------------------------------------------------
#
# CRC32C is affine over GF(2): for messages of equal length, crc(A) ^ crc(B) = lin(A ^ B), where
# lin is the CRC register with a zero start and no final xor. Overwriting k bytes at ``offset`` of
# an L-byte message changes the CRC by lin(0^offset + D + 0^(L-offset-k)) with D = old ^ new; the
# leading zeros leave a zero register unchanged and the trailing ones are "append n zero bytes",
# a linear map applied by square-and-multiply over precomputed GF(2) matrices (as zlib's
# crc32_combine does).

_POLY = 0x82F63B78  # Castagnoli, reflected


def _gf2_times(matrix: list[int], vector: int) -> int:
    result = 0
    row = 0
    while vector:
        if vector & 1:
            result ^= matrix[row]
        vector >>= 1
        row += 1
    return result


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def _zero_byte_powers() -> list[list[int]]:
    one_bit = [_POLY] + [1 << n for n in range(31)]
    operator = _gf2_square(_gf2_square(_gf2_square(one_bit)))  # 8 zero bits
    powers = [operator]
    for _ in range(47):  # up to 2^48 bytes
        powers.append(_gf2_square(powers[-1]))
    return powers


_ZERO_BYTES = _zero_byte_powers()


def _append_zeros(register: int, count: int) -> int:
    power = 0
    while count:
        if count & 1:
            register = _gf2_times(_ZERO_BYTES[power], register)
        count >>= 1
        power += 1
    return register


def crc32c_patch(crc: int, total_length: int, offset: int, old: Buffer, new: Buffer) -> int:
    """The CRC32C of a ``total_length``-byte message whose CRC is ``crc`` after the bytes ``old``
    at ``offset`` are overwritten by ``new`` (same length), without reading the rest."""
    size = len(new)
    if len(old) != size or offset < 0 or offset + size > total_length:
        raise ValueError("a patch replaces bytes inside the message with as many bytes")
    if size == 0:
        return crc
    delta = (int.from_bytes(old, "little") ^ int.from_bytes(new, "little")).to_bytes(size, "little")
    linear = crc32c(delta) ^ crc32c(bytes(size))
    return crc ^ _append_zeros(linear, total_length - offset - size)

"""CRC32C helpers (C-accelerated, SSE4.2 where available, through the ``crc32c`` package).

``crc32c`` accepts any buffer (bytes, bytearray, memoryview) without a copy, which matters on
the hot path where payloads arrive as memoryviews.
"""

from __future__ import annotations

import crc32c as _crc32c

from fs3.common.buffers import Buffer

__all__ = ["crc32c", "crc32c_extend"]


def crc32c(data: Buffer) -> int:
    """CRC32C (Castagnoli) of ``data`` as an unsigned 32-bit int."""
    return int(_crc32c.crc32c(data))


def crc32c_extend(crc: int, data: Buffer) -> int:
    """Continue a CRC32C over more data."""
    return int(_crc32c.crc32c(data, crc))

"""CRC32C helpers (C-accelerated through google-crc32c)."""

from __future__ import annotations

import google_crc32c

__all__ = ["crc32c", "crc32c_extend"]

Buffer = bytes | bytearray | memoryview


def crc32c(data: Buffer) -> int:
    """CRC32C (Castagnoli) of ``data`` as an unsigned 32-bit int."""
    return int(google_crc32c.value(bytes(data) if isinstance(data, memoryview) and not data.contiguous else data))


def crc32c_extend(crc: int, data: Buffer) -> int:
    """Continue a CRC32C over more data."""
    return int(google_crc32c.extend(crc, data))

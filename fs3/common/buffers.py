"""The one alias for byte buffers passed without copying (payloads, chunk data)."""

from __future__ import annotations

__all__ = ["Buffer"]

Buffer = bytes | bytearray | memoryview

"""Identifiers and their limits.

Target ids are globally unique 64-bit numbers chosen by the operator (or ``fs3 local``);
``node_id * 100 + index`` is the convention the local cluster uses, so a target id says which
node it lives on. Chunk ids are opaque bytes to storage; the metadata service builds them from
an inode id and a chunk index so that a file's chunks sort together.
"""

from __future__ import annotations

import struct

from fs3.common.errors import InvalidArgument

__all__ = [
    "CHUNK_ID_MAX_BYTES",
    "CHUNK_SIZE_MAX_BYTES",
    "CHUNK_SIZE_MIN_BYTES",
    "CLIENT_ID_BYTES",
    "chunk_id",
    "parse_chunk_id",
    "validate_chunk_id",
    "validate_chunk_size",
]

CHUNK_ID_MAX_BYTES = 64
# A client's id (random, chosen at connect); a session id starts with the id of the client that
# opened it, so a client tells its own sessions without asking meta.
CLIENT_ID_BYTES = 16
CHUNK_SIZE_MIN_BYTES = 4096
CHUNK_SIZE_MAX_BYTES = 64 * 1024 * 1024

_CHUNK_ID = struct.Struct(">QI")


def chunk_id(inode_id: int, chunk_index: int) -> bytes:
    """The chunk id of chunk ``chunk_index`` of inode ``inode_id`` (sorts by inode, then index)."""
    return _CHUNK_ID.pack(inode_id, chunk_index)


def parse_chunk_id(raw: bytes) -> tuple[int, int]:
    """Inverse of :func:`chunk_id`."""
    if len(raw) != _CHUNK_ID.size:
        raise InvalidArgument(f"chunk id of {len(raw)} bytes is not an inode chunk id")
    inode_id, index = _CHUNK_ID.unpack(raw)
    return int(inode_id), int(index)


def validate_chunk_id(raw: bytes) -> None:
    if not raw:
        raise InvalidArgument("empty chunk id")
    if len(raw) > CHUNK_ID_MAX_BYTES:
        raise InvalidArgument(f"chunk id of {len(raw)} bytes exceeds {CHUNK_ID_MAX_BYTES}")


def validate_chunk_size(chunk_size_bytes: int) -> None:
    """Chunk sizes are powers of two between 4 KiB and 64 MiB."""
    if not CHUNK_SIZE_MIN_BYTES <= chunk_size_bytes <= CHUNK_SIZE_MAX_BYTES:
        raise InvalidArgument(
            f"chunk size {chunk_size_bytes} outside [{CHUNK_SIZE_MIN_BYTES}, {CHUNK_SIZE_MAX_BYTES}]"
        )
    if chunk_size_bytes & (chunk_size_bytes - 1):
        raise InvalidArgument(f"chunk size {chunk_size_bytes} is not a power of two")

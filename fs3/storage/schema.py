"""Every key a storage target stores, and every blob file name, built in one place.

Key table of a target's KV store (``+`` is concatenation; integers big-endian so keys sort
numerically):

============================================================  =========================================
key                                                           value
============================================================  =========================================
``c/`` + chunk_id                                             :class:`~fs3.storage.chunk_engine.ChunkState`
``h/`` + len(client_id)(1) + client_id + channel_id(4)        :class:`~fs3.storage.chunk_engine.ChannelRecord`
``p/`` + chunk_id                                             :class:`~fs3.storage.chunk_engine.Patch`:
                                                              the pending in-place patch of a file blob
``b/`` + chunk_id + blob(8)                                   the bytes of a small (inline) version
``v/floor``                                                   u64: every version and blob number ever
                                                              used on this target is at most this
``v/format``                                                  u64: the layout's version (:data:`FORMAT_VERSION`),
                                                              kept for releases before format records
``v/record``                                                  JSON: the target's format record
                                                              (:mod:`fs3.common.formats`)
``v/migration``                                               JSON: a format migration's progress
``s/scrub``                                                   JSON: the scrubber's progress
                                                              (:class:`~fs3.storage.scrub.ScrubProgress`)
============================================================  =========================================

Blob files (versions larger than the inline limit): ``<root>/<xx>/<chunk-id-hex>.<blob>``, where
``xx`` is the last two hex digits of the chunk id (spreading chunks over 256 directories).

The values' encodings live with their classes in :mod:`fs3.storage.chunk_engine`.
"""

from __future__ import annotations

import struct

from fs3.kv.api import prefix_end

__all__ = [
    "CHANNEL",
    "CHUNK",
    "FLOOR",
    "FORMAT",
    "FORMAT_MIGRATION",
    "FORMAT_RECORD",
    "FORMAT_VERSION",
    "INLINE",
    "PATCH",
    "SCRUB_PROGRESS",
    "U64",
    "blob_dir_name",
    "blob_file_name",
    "channel_key",
    "chunk_key",
    "inline_key",
    "parse_blob_file_name",
    "parse_channel_key",
    "parse_chunk_key",
    "parse_inline_key",
    "patch_key",
    "prefix_range",
]

CHUNK = b"c/"  # chunk id -> ChunkState
CHANNEL = b"h/"  # client id + channel id -> ChannelRecord
PATCH = b"p/"  # chunk id -> the pending in-place patch of a file blob: offset, size, new bytes, old bytes
INLINE = b"b/"  # chunk id + blob number -> the bytes of a small version
FLOOR = b"v/floor"  # every version and blob number ever used on this target is at most this
FORMAT = b"v/format"
FORMAT_RECORD = b"v/record"  # the format record (fs3.storage.formats); FORMAT mirrors its version
FORMAT_MIGRATION = b"v/migration"  # a migration's progress, in the batch of each page it commits
SCRUB_PROGRESS = b"s/scrub"  # where the scrubber's current pass is (resumed after a restart)
FORMAT_VERSION = 3  # 3: every ChunkState record ends with its CRC32C
U64 = struct.Struct(">Q")
_CHANNEL_ID = struct.Struct(">I")


def prefix_range(prefix: bytes) -> tuple[bytes, bytes | None]:
    """The ``[start, end)`` scan bounds of every key under ``prefix``."""
    return prefix, prefix_end(prefix)


def chunk_key(chunk_id: bytes) -> bytes:
    return CHUNK + chunk_id


def parse_chunk_key(key: bytes) -> bytes:
    return key[len(CHUNK):]


def channel_key(client_id: bytes, channel_id: int) -> bytes:
    return CHANNEL + bytes([len(client_id)]) + client_id + _CHANNEL_ID.pack(channel_id)


def parse_channel_key(key: bytes) -> tuple[bytes, int]:
    size = key[len(CHANNEL)]
    start = len(CHANNEL) + 1
    return key[start : start + size], int(_CHANNEL_ID.unpack_from(key, start + size)[0])


def patch_key(chunk_id: bytes) -> bytes:
    return PATCH + chunk_id


def inline_key(chunk_id: bytes, blob: int) -> bytes:
    return INLINE + chunk_id + U64.pack(blob)


def parse_inline_key(key: bytes) -> tuple[bytes, int]:
    return key[len(INLINE):-U64.size], int(U64.unpack(key[-U64.size:])[0])


def blob_dir_name(chunk_id: bytes) -> str:
    return chunk_id.hex()[-2:]


def blob_file_name(chunk_id: bytes, blob: int) -> str:
    return f"{chunk_id.hex()}.{blob}"


def parse_blob_file_name(name: str) -> tuple[bytes, int] | None:
    """``(chunk id, blob)`` of a blob file's name; ``None`` for a file that is not a blob."""
    stem, _, number = name.partition(".")
    try:
        return bytes.fromhex(stem), int(number)
    except ValueError:
        return None

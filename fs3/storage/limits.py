"""Every bound a storage node enforces on its input, in one place (TigerBeetle-style limits).

Each is checked where requests enter (the servicer, the replica's validation) and refused with
INVALID_ARGUMENT naming the bound, before anything changes. Bounds on work in flight per target
(``updates_inflight_max``, ``updates_inflight_bytes_max``) are operator settings in
:class:`~fs3.storage.replica.ReplicaConfig` and answer RESOURCE_EXHAUSTED (the client backs off).
"""

from __future__ import annotations

from fs3.common.ids import CHUNK_ID_MAX_BYTES, CHUNK_SIZE_MAX_BYTES, CHUNK_SIZE_MIN_BYTES

__all__ = [
    "BATCH_READ_BYTES_MAX",
    "BATCH_READ_PIECES_MAX",
    "CHUNK_ID_MAX_BYTES",
    "CHUNK_SIZE_MAX_BYTES",
    "CHUNK_SIZE_MIN_BYTES",
    "CLIENT_ID_MAX_BYTES",
    "DUMP_CHUNKS_MAX",
    "DUMP_DATA_BYTES_MAX",
    "SYNC_RECORDS_MAX",
    "VERSION_MAX",
]

# Chunk ids and sizes are shared with the metadata service (which makes the ids and picks the
# sizes), so they live in fs3.common.ids; a chunk of CHUNK_SIZE_MAX_BYTES (64 MiB) must fit a
# frame's payload (fs3.rpc.limits.FRAME_PAYLOAD_MAX_BYTES).

# A client id is stored behind a one-byte length in the exactly-once records.
CLIENT_ID_MAX_BYTES = 255

# Versions and blob numbers are u64 on the wire; a target refuses anything within 2^62 of the end,
# so its counter (reserved 1,024 at a time) can never wrap, whatever a peer sends.
VERSION_MAX = 1 << 62

# Chunks per DumpChunkMeta page (asked for, or named): one page is one message, well inside
# FRAME_MSG_MAX_BYTES at about 60 bytes a chunk, and one pass of the event loop.
DUMP_CHUNKS_MAX = 10_000

# A DumpChunkMeta page with data checksums stops once this many bytes were read, so one call on a
# target of big chunks holds neither an I/O thread nor the caller's deadline for long.
DUMP_DATA_BYTES_MAX = 64 << 20

# Exactly-once records per SyncChannels call: one message, and one KV batch on the receiver.
SYNC_RECORDS_MAX = 10_000

# Pieces per BatchRead call, and the bytes they may ask for in all: the answer is one frame, so the
# bytes stay within FRAME_PAYLOAD_MAX_BYTES (a whole chunk of CHUNK_SIZE_MAX_BYTES still fits in one
# call), and the per-piece results (about 20 bytes each) within FRAME_MSG_MAX_BYTES many times over.
BATCH_READ_PIECES_MAX = 4096
BATCH_READ_BYTES_MAX = CHUNK_SIZE_MAX_BYTES

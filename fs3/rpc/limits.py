"""Every bound of the RPC layer, in one place (TigerBeetle-style explicit limits).

A service that accepts unbounded input can be made to hold unbounded memory by one client; each
value here says how much one frame, one message or one connection may hold, and why that much.
A frame past a bound is refused with :class:`~fs3.common.errors.FrameTooLarge` before its body is
read; a connection at its in-flight bound stops reading requests until one finishes (back
pressure, never a refusal: the client's requests wait in its socket).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FRAME_MSG_MAX_BYTES",
    "FRAME_PAYLOAD_MAX_BYTES",
    "GRPC_MESSAGE_MAX_BYTES",
    "HELLO_MSG_MAX_BYTES",
    "HELLO_TIMEOUT_MS",
    "INFLIGHT_REQUESTS_MAX",
    "FramedLimits",
]

# The protobuf part of a frame. The largest messages are listings (a ReadDir page of 10,000
# entries with attributes, a DumpChunkMeta page of 10,000 chunks, a routing table of thousands of
# chains): a few MiB. 16 MiB leaves room and still bounds what a malformed length can make a
# server allocate.
FRAME_MSG_MAX_BYTES = 16 * 1024 * 1024

# The raw bulk part: a whole chunk (at most CHUNK_SIZE_MAX_BYTES, 64 MiB, in a full-chunk replace
# or a read of a whole chunk) plus 8 MiB of slack, so the largest legitimate payload always fits.
FRAME_PAYLOAD_MAX_BYTES = 72 * 1024 * 1024

# Requests one framed connection may have running on a server (and a client may have outstanding
# on one connection). Above the storage client's own bound (one request per channel, 64 channels),
# so a client never waits on its connection; with FRAME_PAYLOAD_MAX_BYTES it bounds what one
# connection can make a server hold.
INFLIGHT_REQUESTS_MAX = 256

# A new connection must present its token within this time, so idle unauthenticated sockets do
# not accumulate.
HELLO_TIMEOUT_MS = 5_000

# The first frame of a connection that has not authenticated yet (its HELLO): a token (at most
# 512 characters, see fs3.common.secret_files) with room to spare, and no payload. Whoever can
# reach a port can send it, so it bounds what an anonymous connection makes a server hold.
HELLO_MSG_MAX_BYTES = 4096

# gRPC (the public API) carries the message and the payload in one protobuf: the largest framed
# payload (a whole chunk and slack) plus 8 MiB for the fields around it — a big payload comes with
# a small message; listings, which have big messages, carry no payload.
GRPC_MESSAGE_MAX_BYTES = 80 * 1024 * 1024


@dataclass(frozen=True)
class FramedLimits:
    """Bounds on what one frame and one connection may hold (the defaults above; tests shrink them)."""

    msg_max_bytes: int = FRAME_MSG_MAX_BYTES
    payload_max_bytes: int = FRAME_PAYLOAD_MAX_BYTES
    inflight_requests_max: int = INFLIGHT_REQUESTS_MAX
    hello_timeout_ms: int = HELLO_TIMEOUT_MS

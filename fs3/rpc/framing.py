"""The framed wire format used on the hot paths.

Every frame starts with a fixed 24-byte little-endian header::

    magic u16 | version u8 | kind u8 | method_id u16 | status u16 | request_id u64 | msg_len u32 | payload_len u32

followed by ``msg_len`` bytes of protobuf (or, for an error response, the UTF-8 error message)
and ``payload_len`` raw bulk bytes. Many requests may be in flight on one connection; responses
carry the request id and may come back in any order. The first frame of a connection is a
HELLO carrying the cluster token; the server answers HELLO_ACK with a status. From protocol 2 on
(fs3/rpc/versions.py) a HELLO also carries the client's protocol range in ``method_id`` (highest)
and ``status`` (lowest), fields protocol 1 leaves zero, and the HELLO_ACK the chosen protocol in
``method_id``. ``version`` is the frame layout, not the protocol.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from fs3.common.errors import FrameTooLarge, ProtocolError
from fs3.rpc.versions import RELEASE

__all__ = ["HEADER", "MAGIC", "VERSION", "FrameHeader", "FrameKind", "pack_header", "unpack_header"]

MAGIC = 0xF53F
VERSION = 1
HEADER = struct.Struct("<HBBHHQII")


class FrameKind(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    HELLO = 3
    HELLO_ACK = 4


@dataclass(frozen=True, slots=True)
class FrameHeader:
    kind: FrameKind
    method_id: int
    status: int
    request_id: int
    msg_len: int
    payload_len: int


def pack_header(kind: FrameKind, method_id: int, status: int, request_id: int, msg_len: int,
                payload_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, method_id, status, request_id, msg_len, payload_len)


def unpack_header(raw: bytes, msg_max_bytes: int, payload_max_bytes: int) -> FrameHeader:
    """Parse and bound-check a header; raises a typed error on anything malformed."""
    magic, version, kind, method_id, status, request_id, msg_len, payload_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic 0x{magic:04x}")
    if version != VERSION:
        # Answered (by a server) with an error frame of layout 1, which every release reads.
        raise ProtocolError(f"unsupported frame version {version}: this peer reads frame version {VERSION} only "
                            f"(release {RELEASE}); {'upgrade it' if version > VERSION else 'the sender is broken'}")
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if msg_len > msg_max_bytes:
        raise FrameTooLarge(f"message of {msg_len} bytes exceeds {msg_max_bytes}")
    if payload_len > payload_max_bytes:
        raise FrameTooLarge(f"payload of {payload_len} bytes exceeds {payload_max_bytes}")
    return FrameHeader(frame_kind, method_id, status, request_id, msg_len, payload_len)

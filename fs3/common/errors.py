"""One error model for fs3.

Every failure inside fs3 is an :class:`FS3Error` carrying a :class:`StatusCode`. The numbers
mirror ``StatusCode`` in ``proto/fs3/common.proto`` so that an error crosses either transport
unchanged: the server encodes ``(code, message)``, the client raises the same class again.
Transport-level failures are mapped to these codes in exactly one place (``fs3.rpc.errors``).
"""

from __future__ import annotations

import enum
from typing import ClassVar

__all__ = [
    "ChainVersionMismatch",
    "ChannelSeqStale",
    "ChecksumMismatch",
    "ChunkNotCommitted",
    "FS3Error",
    "FrameTooLarge",
    "InvalidArgument",
    "InvariantViolation",
    "IoError",
    "LeaseExpired",
    "MaybeCommitted",
    "NoSpace",
    "NotFound",
    "NotHead",
    "ProtocolError",
    "StaleUpdate",
    "StatusCode",
    "TargetNotServing",
    "Timeout",
    "TxnConflict",
    "Unauthenticated",
    "Unavailable",
    "error_for",
]


class StatusCode(enum.IntEnum):
    """Status codes shared by every service (mirror of the proto enum)."""

    OK = 0
    INVALID_ARGUMENT = 1
    NOT_FOUND = 2
    ALREADY_EXISTS = 3
    PERMISSION_DENIED = 4
    UNAUTHENTICATED = 5
    RESOURCE_EXHAUSTED = 6
    NO_SPACE = 7
    TIMEOUT = 8
    UNAVAILABLE = 9
    CHAIN_VERSION_MISMATCH = 10
    NOT_HEAD = 11
    TARGET_NOT_SERVING = 12
    CHUNK_NOT_COMMITTED = 13
    CHECKSUM_MISMATCH = 14
    STALE_UPDATE = 15
    LEASE_EXPIRED = 16
    FRAME_TOO_LARGE = 17
    PROTOCOL_ERROR = 18
    UNKNOWN_METHOD = 19
    CHANNEL_SEQ_STALE = 20
    IO_ERROR = 21
    INTERNAL = 22
    TXN_CONFLICT = 23
    MAYBE_COMMITTED = 24


# Codes after which the same request may succeed if sent again (possibly after a routing refresh).
_RETRYABLE = frozenset(
    {
        StatusCode.TIMEOUT,
        StatusCode.UNAVAILABLE,
        StatusCode.CHAIN_VERSION_MISMATCH,
        StatusCode.NOT_HEAD,
        StatusCode.TARGET_NOT_SERVING,
        StatusCode.CHUNK_NOT_COMMITTED,
        StatusCode.LEASE_EXPIRED,
        StatusCode.RESOURCE_EXHAUSTED,
        StatusCode.TXN_CONFLICT,
    }
)


class FS3Error(Exception):
    """Base of every fs3 error; ``code`` says what happened, ``retryable`` whether to try again."""

    code: ClassVar[StatusCode] = StatusCode.INTERNAL

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code.name.lower())
        self.message = message or self.code.name.lower()

    @property
    def retryable(self) -> bool:
        return self.code in _RETRYABLE

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(FS3Error):
    code = StatusCode.INVALID_ARGUMENT


class NotFound(FS3Error):
    code = StatusCode.NOT_FOUND


class AlreadyExists(FS3Error):
    code = StatusCode.ALREADY_EXISTS


class PermissionDenied(FS3Error):
    code = StatusCode.PERMISSION_DENIED


class Unauthenticated(FS3Error):
    code = StatusCode.UNAUTHENTICATED


class ResourceExhausted(FS3Error):
    code = StatusCode.RESOURCE_EXHAUSTED


class NoSpace(FS3Error):
    code = StatusCode.NO_SPACE


class Timeout(FS3Error):
    code = StatusCode.TIMEOUT


class Unavailable(FS3Error):
    code = StatusCode.UNAVAILABLE


class ChainVersionMismatch(FS3Error):
    code = StatusCode.CHAIN_VERSION_MISMATCH


class NotHead(FS3Error):
    code = StatusCode.NOT_HEAD


class TargetNotServing(FS3Error):
    code = StatusCode.TARGET_NOT_SERVING


class ChunkNotCommitted(FS3Error):
    code = StatusCode.CHUNK_NOT_COMMITTED


class ChecksumMismatch(FS3Error):
    code = StatusCode.CHECKSUM_MISMATCH


class StaleUpdate(FS3Error):
    code = StatusCode.STALE_UPDATE


class LeaseExpired(FS3Error):
    code = StatusCode.LEASE_EXPIRED


class FrameTooLarge(FS3Error):
    code = StatusCode.FRAME_TOO_LARGE


class ProtocolError(FS3Error):
    code = StatusCode.PROTOCOL_ERROR


class UnknownMethod(FS3Error):
    code = StatusCode.UNKNOWN_METHOD


class ChannelSeqStale(FS3Error):
    code = StatusCode.CHANNEL_SEQ_STALE


class IoError(FS3Error):
    code = StatusCode.IO_ERROR


class Internal(FS3Error):
    code = StatusCode.INTERNAL


class TxnConflict(FS3Error):
    code = StatusCode.TXN_CONFLICT


class MaybeCommitted(FS3Error):
    code = StatusCode.MAYBE_COMMITTED


class InvariantViolation(Internal):
    """A broken invariant. Raised by :func:`fs3.common.invariant.ensure`; never caught to continue."""


_BY_CODE: dict[StatusCode, type[FS3Error]] = {}
for _cls in list(globals().values()):
    if isinstance(_cls, type) and issubclass(_cls, FS3Error) and _cls is not InvariantViolation:
        _BY_CODE.setdefault(_cls.code, _cls)


def error_for(code: int, message: str) -> FS3Error:
    """Rebuild the typed error for a status code received from the wire."""
    try:
        status = StatusCode(code)
    except ValueError:
        return Internal(f"unknown status code {code}: {message}")
    return _BY_CODE.get(status, Internal)(message)

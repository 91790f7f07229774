"""One error model for fs3.

Every failure inside fs3 is an :class:`FS3Error` carrying a :class:`StatusCode`. The numbers
mirror ``StatusCode`` in ``proto/fs3/common.proto`` so that an error crosses either transport
unchanged: the server encodes ``(code, message)``, the client raises the same class again.
Transport-level failures are mapped to these codes by each transport, in one place each: gRPC's
status codes by ``_to_fs3_error`` in ``fs3.rpc.grpc_transport``, the framed transport's lost
connections and timeouts by its channel in ``fs3.rpc.framed``.
"""

from __future__ import annotations

import enum
import errno as _errno
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

__all__ = [
    "ALL_RETRY_CAUSES",
    "ERRNO_BY_CODE",
    "RETRYABLE",
    "AlreadyExists",
    "BadHandle",
    "ChainVersionMismatch",
    "ChannelSeqStale",
    "ChecksumMismatch",
    "ChunkNotCommitted",
    "CrossDevice",
    "DirectoryNotEmpty",
    "FS3Error",
    "FileTooLarge",
    "FrameTooLarge",
    "Internal",
    "InvalidArgument",
    "InvariantViolation",
    "IoError",
    "IsADirectory",
    "LeaseExpired",
    "MaybeCommitted",
    "NameTooLong",
    "NoSpace",
    "NoXattr",
    "NotADirectory",
    "NotFound",
    "NotHead",
    "NotPermitted",
    "NotPrimary",
    "NotSupported",
    "PermissionDenied",
    "ProtocolError",
    "QuotaExceeded",
    "RetryCause",
    "Retryable",
    "StaleClient",
    "StaleUpdate",
    "StatusCode",
    "SymlinkLoop",
    "TargetNotServing",
    "Timeout",
    "TooManyLinks",
    "TxnConflict",
    "Unauthenticated",
    "Unavailable",
    "XattrTooLarge",
    "error_for",
    "is_retryable",
    "may_have_run",
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
    NOT_A_DIRECTORY = 25
    IS_A_DIRECTORY = 26
    DIRECTORY_NOT_EMPTY = 27
    SYMLINK_LOOP = 28
    NAME_TOO_LONG = 29
    NOT_PERMITTED = 30
    NO_XATTR = 31
    NOT_SUPPORTED = 32
    BAD_HANDLE = 33
    TOO_MANY_LINKS = 34
    FILE_TOO_LARGE = 35
    XATTR_TOO_LARGE = 36
    STALE_CLIENT = 37
    NOT_PRIMARY = 38
    QUOTA_EXCEEDED = 39
    CROSS_DEVICE = 40


class RetryCause(enum.Enum):
    """Why a request that failed may succeed if sent again; callers retry only the causes they can cure."""

    TRANSPORT = "transport"  # no answer came back: the server, or the way to it, failed
    OVERLOAD = "overload"  # the server refused it for now (a limit was reached)
    COMMIT = "commit"  # the metadata store's commit conflicted, or its outcome is unknown
    ROUTING = "routing"  # the target's view of its chain differs from the caller's: refresh, resend
    CHUNK_BUSY = "chunk busy"  # the chunk is mid-update: ask again shortly (routing is fine)
    REDIRECT = "redirect"  # this server is not the one in charge: ask the one it names (or the next one)


@dataclass(frozen=True)
class Retryable:
    cause: RetryCause
    # The request may have taken effect: only a request that is safe to apply twice, or that
    # carries an id the server deduplicates by, may be sent again.
    may_have_run: bool


# The one table of codes after which the same request may succeed if sent again. Every retry loop
# asks it (by code, never by class or name): ``FS3Error.retryable`` is "in the table", and a caller
# that can cure only some causes filters by :class:`RetryCause`.
RETRYABLE: Mapping[StatusCode, Retryable] = MappingProxyType({
    StatusCode.TIMEOUT: Retryable(RetryCause.TRANSPORT, may_have_run=True),
    StatusCode.UNAVAILABLE: Retryable(RetryCause.TRANSPORT, may_have_run=True),
    StatusCode.RESOURCE_EXHAUSTED: Retryable(RetryCause.OVERLOAD, may_have_run=False),
    StatusCode.TXN_CONFLICT: Retryable(RetryCause.COMMIT, may_have_run=False),
    StatusCode.MAYBE_COMMITTED: Retryable(RetryCause.COMMIT, may_have_run=True),
    StatusCode.CHAIN_VERSION_MISMATCH: Retryable(RetryCause.ROUTING, may_have_run=False),
    StatusCode.NOT_HEAD: Retryable(RetryCause.ROUTING, may_have_run=False),
    StatusCode.TARGET_NOT_SERVING: Retryable(RetryCause.ROUTING, may_have_run=False),
    StatusCode.LEASE_EXPIRED: Retryable(RetryCause.ROUTING, may_have_run=False),
    StatusCode.CHUNK_NOT_COMMITTED: Retryable(RetryCause.CHUNK_BUSY, may_have_run=False),
    StatusCode.NOT_PRIMARY: Retryable(RetryCause.REDIRECT, may_have_run=False),
})
ALL_RETRY_CAUSES: frozenset[RetryCause] = frozenset(RetryCause)


def is_retryable(code: StatusCode, causes: Collection[RetryCause] = ALL_RETRY_CAUSES) -> bool:
    """Whether a request that failed with ``code`` may succeed if sent again, for a caller that
    can cure ``causes`` (a metadata client cannot refresh a storage chain, say)."""
    entry = RETRYABLE.get(code)
    return entry is not None and entry.cause in causes


def may_have_run(code: StatusCode) -> bool:
    """Whether a request that failed with retryable ``code`` may nevertheless have taken effect."""
    entry = RETRYABLE.get(code)
    return entry is not None and entry.may_have_run


class FS3Error(Exception):
    """Base of every fs3 error; ``code`` says what happened, ``retryable`` whether to try again."""

    code: ClassVar[StatusCode] = StatusCode.INTERNAL

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code.name.lower())
        self.message = message or self.code.name.lower()

    @property
    def retryable(self) -> bool:
        return is_retryable(self.code)

    @property
    def errno(self) -> int:
        """The POSIX errno a file-system caller sees for this error."""
        return ERRNO_BY_CODE.get(self.code, _errno.EIO)

    def to_os_error(self, filename: object = None) -> OSError:
        """The matching ``OSError`` subclass (``FileNotFoundError`` for ENOENT, and so on)."""
        if filename is None:
            return OSError(self.errno, self.message)
        return OSError(self.errno, self.message, filename)

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


class NotADirectory(FS3Error):
    code = StatusCode.NOT_A_DIRECTORY


class IsADirectory(FS3Error):
    code = StatusCode.IS_A_DIRECTORY


class DirectoryNotEmpty(FS3Error):
    code = StatusCode.DIRECTORY_NOT_EMPTY


class SymlinkLoop(FS3Error):
    code = StatusCode.SYMLINK_LOOP


class NameTooLong(FS3Error):
    code = StatusCode.NAME_TOO_LONG


class NotPermitted(FS3Error):
    code = StatusCode.NOT_PERMITTED


class NoXattr(FS3Error):
    code = StatusCode.NO_XATTR


class NotSupported(FS3Error):
    code = StatusCode.NOT_SUPPORTED


class BadHandle(FS3Error):
    code = StatusCode.BAD_HANDLE


class TooManyLinks(FS3Error):
    code = StatusCode.TOO_MANY_LINKS


class FileTooLarge(FS3Error):
    code = StatusCode.FILE_TOO_LARGE


class XattrTooLarge(FS3Error):
    code = StatusCode.XATTR_TOO_LARGE


class StaleClient(FS3Error):
    """The client's meta lease lapsed: meta closed its sessions and refuses its id from then on.

    Never retried under the same id (a retry could run a request twice); the client registers
    afresh, and handles opened under the old id fail with ESTALE.
    """

    code = StatusCode.STALE_CLIENT


class NotPrimary(FS3Error):
    """A standby mgmtd refused a state-changing call: it ran nowhere, send it to the primary.

    The message names the primary as the lease last showed it (``primary is at HOST:PORT``, or
    ``primary is unknown`` during a takeover); :attr:`primary_address` reads it back on the client
    side, where only the code and the message crossed the wire.
    """

    code = StatusCode.NOT_PRIMARY
    _MARK: ClassVar[str] = "primary is at "

    @classmethod
    def naming(cls, primary_address: str, detail: str = "this mgmtd is a standby") -> NotPrimary:
        where = f"{cls._MARK}{primary_address}" if primary_address else "primary is unknown"
        return cls(f"{detail}; {where}")

    @property
    def primary_address(self) -> str:
        """The primary's address the message names ('' when unknown)."""
        _, mark, rest = self.message.partition(self._MARK)
        return rest.split()[0] if mark and rest.split() else ""


class QuotaExceeded(FS3Error):
    """The change would take a directory's tree past its quota (fs3.meta.quota): ``EDQUOT``."""

    code = StatusCode.QUOTA_EXCEEDED


class CrossDevice(FS3Error):
    """A rename meta cannot account for in one transaction (a large directory moving between
    quotas): ``EXDEV``, on which ``mv`` copies and removes instead, as between file systems."""

    code = StatusCode.CROSS_DEVICE


# What a POSIX caller sees. Codes not listed are EIO: the operation failed inside fs3.
ERRNO_BY_CODE: dict[StatusCode, int] = {
    StatusCode.INVALID_ARGUMENT: _errno.EINVAL,
    StatusCode.NOT_FOUND: _errno.ENOENT,
    StatusCode.ALREADY_EXISTS: _errno.EEXIST,
    StatusCode.PERMISSION_DENIED: _errno.EACCES,
    StatusCode.UNAUTHENTICATED: _errno.EACCES,
    StatusCode.RESOURCE_EXHAUSTED: _errno.EAGAIN,
    StatusCode.NO_SPACE: _errno.ENOSPC,
    StatusCode.TIMEOUT: _errno.ETIMEDOUT,
    StatusCode.UNAVAILABLE: _errno.EIO,
    StatusCode.NOT_A_DIRECTORY: _errno.ENOTDIR,
    StatusCode.IS_A_DIRECTORY: _errno.EISDIR,
    StatusCode.DIRECTORY_NOT_EMPTY: _errno.ENOTEMPTY,
    StatusCode.SYMLINK_LOOP: _errno.ELOOP,
    StatusCode.NAME_TOO_LONG: _errno.ENAMETOOLONG,
    StatusCode.NOT_PERMITTED: _errno.EPERM,
    StatusCode.NO_XATTR: _errno.ENODATA,
    StatusCode.NOT_SUPPORTED: _errno.EOPNOTSUPP,
    StatusCode.BAD_HANDLE: _errno.EBADF,
    StatusCode.TOO_MANY_LINKS: _errno.EMLINK,
    StatusCode.FILE_TOO_LARGE: _errno.EFBIG,
    StatusCode.XATTR_TOO_LARGE: _errno.E2BIG,
    StatusCode.STALE_CLIENT: _errno.ESTALE,
    StatusCode.QUOTA_EXCEEDED: _errno.EDQUOT,
    StatusCode.CROSS_DEVICE: _errno.EXDEV,
}


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

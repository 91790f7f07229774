"""Every key the metadata service stores, built in one place.

Key table (all integers big-endian, so keys sort numerically; ``+`` is concatenation):

=====================================================  ==========================================
key                                                    value
=====================================================  ==========================================
``INOD`` + inode_id(8)                                 :class:`~fs3.meta_pb2.Inode`
``DENT`` + parent_inode(8) + name                      :class:`~fs3.meta_pb2.DirEntry` (no attrs)
``XATR`` + inode_id(8) + name                          the attribute's value (raw bytes)
``SESS`` + inode_id(8) + session_id(24)                :class:`Session`: an open handle
``CSES`` + client_id(16) + inode_id(8) + session_id    empty: the sessions of one client
``CLNT`` + client_id(16)                               :class:`ClientLease`: renewal count
``CEXP`` + client_id(16)                               :class:`ExpiredClient`: a lapsed client id
``GCQ_`` + inode_id(8)                                 :class:`GcJob`: chunks to remove
``TRNC`` + inode_id(8)                                 :class:`TruncateJob`: a truncate in progress
``SGEN`` + inode_id(8)                                 the inode's size generation (8 bytes)
``IDEM`` + client_id(16) + request_id(8)               :class:`IdemRecord`: a committed answer
``CNTR`` + name                                        a counter (8 bytes)
``USER`` + token_id(8)                                 :class:`UserRecord`: a per-user token
``TRSH`` + inode_id(8)                                 :class:`~fs3.meta_pb2.TrashEntry`: a removed
                                                       file kept in the trash (fs3.meta.trash)
``TRSX`` + expires_at_ns(8) + inode_id(8)              empty: the trash in order of expiry
``QDEF`` + inode_id(8)                                 :class:`~fs3.meta_pb2.Quota`: a directory's
                                                       limits (fs3.meta.quota)
``QUSE`` + inode_id(8)                                 :class:`~fs3.meta_pb2.Quota`: what its tree
                                                       uses (bytes_used, inodes_used)
``QRSV`` + inode_id(8) + session_id(24)                home(8) + bytes(8): a writer's byte credit,
                                                       charged to its home's quotas (fs3.meta.quota)
``QRSH`` + home(8) + inode_id(8) + session_id(24)      bytes(8): the same credit, by home (counts)
``QAWY`` + home(8) + inode_id(8)                       empty: a file whose home lost its name there
                                                       while other names keep it (fs3.meta.quota)
``CNTR`` + ``directory_moves``                         renames that gave a directory a new
                                                       parent (8 bytes)
``LOAD``                                               empty: ``fs3 admin load`` has not finished
                                                       (a meta server refuses to start)
=====================================================  ==========================================

A session id is the opening request's ``client_id + request_id``: unique and known to the
client without another round trip. Directory entries sort by name within their parent, so a
paged ``readdir`` is a range scan that resumes after the last name it returned.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from fs3 import meta_pb2 as mpb
from fs3.common.errors import InvalidArgument
from fs3.common.ids import CLIENT_ID_BYTES

__all__ = [
    "LOAD_UNFINISHED",
    "ROOT_INODE",
    "SESSION_ID_BYTES",
    "ClientLease",
    "ExpiredClient",
    "GcJob",
    "IdemRecord",
    "Session",
    "TruncateJob",
    "UserRecord",
    "client_key",
    "client_prefix",
    "client_session_key",
    "client_sessions_prefix",
    "counter_key",
    "dentry_key",
    "dentry_prefix",
    "directory_moves_key",
    "expired_client_key",
    "expired_client_prefix",
    "gc_key",
    "gc_prefix",
    "idem_key",
    "idem_prefix",
    "inode_key",
    "inode_prefix",
    "parse_dentry_key",
    "parse_inode_key",
    "parse_quota_key",
    "parse_quota_reservation_key",
    "quota_away_key",
    "quota_away_prefix",
    "quota_key",
    "quota_prefix",
    "quota_reservation_home_key",
    "quota_reservation_home_prefix",
    "quota_reservation_key",
    "quota_reservation_prefix",
    "quota_usage_key",
    "session_id_for",
    "session_key",
    "session_prefix",
    "sessions_prefix",
    "size_gen_key",
    "size_gen_prefix",
    "trash_expiry_key",
    "trash_expiry_prefix",
    "trash_key",
    "trash_prefix",
    "truncate_key",
    "truncate_prefix",
    "user_key",
    "user_prefix",
    "xattr_key",
    "xattr_prefix",
]

ROOT_INODE = 1
SESSION_ID_BYTES = CLIENT_ID_BYTES + 8

_U64 = struct.Struct(">Q")

INODE = b"INOD"
DENTRY = b"DENT"
XATTR = b"XATR"
SESSION = b"SESS"
CLIENT_SESSION = b"CSES"
CLIENT = b"CLNT"
EXPIRED_CLIENT = b"CEXP"
GC = b"GCQ_"
TRUNCATE = b"TRNC"
SIZE_GEN = b"SGEN"
IDEM = b"IDEM"
COUNTER = b"CNTR"
USER = b"USER"
TRASH = b"TRSH"
TRASH_EXPIRY = b"TRSX"
LOAD_UNFINISHED = b"LOAD"  # written by a load's first batch, deleted by its last: the store holds part of a dump
QUOTA = b"QDEF"
QUOTA_USAGE = b"QUSE"
QUOTA_RESERVATION = b"QRSV"
QUOTA_AWAY = b"QAWY"
QUOTA_RESERVATION_HOME = b"QRSH"


def _u64(value: int) -> bytes:
    return _U64.pack(value)


def inode_key(inode_id: int) -> bytes:
    return INODE + _u64(inode_id)


def inode_prefix() -> bytes:
    return INODE


def parse_inode_key(key: bytes) -> int:
    return int(_U64.unpack_from(key, len(INODE))[0])


def dentry_key(parent: int, name: bytes) -> bytes:
    return DENTRY + _u64(parent) + name


def dentry_prefix(parent: int | None = None) -> bytes:
    return DENTRY if parent is None else DENTRY + _u64(parent)


def parse_dentry_key(key: bytes) -> tuple[int, bytes]:
    return int(_U64.unpack_from(key, len(DENTRY))[0]), key[len(DENTRY) + 8:]


def xattr_key(inode_id: int, name: bytes) -> bytes:
    return XATTR + _u64(inode_id) + name


def xattr_prefix(inode_id: int) -> bytes:
    return XATTR + _u64(inode_id)


def _check_client(client_id: bytes) -> None:
    if len(client_id) != CLIENT_ID_BYTES:
        raise InvalidArgument(f"client id must be {CLIENT_ID_BYTES} bytes, got {len(client_id)}")


def session_id_for(client_id: bytes, request_id: int) -> bytes:
    _check_client(client_id)
    return client_id + _u64(request_id)


def session_owner(session_id: bytes) -> bytes:
    """The id of the client that opened the session (a session id starts with it)."""
    return session_id[:CLIENT_ID_BYTES]


def session_key(inode_id: int, session_id: bytes) -> bytes:
    if len(session_id) != SESSION_ID_BYTES:
        raise InvalidArgument(f"session id must be {SESSION_ID_BYTES} bytes")
    return SESSION + _u64(inode_id) + session_id


def session_prefix(inode_id: int) -> bytes:
    return SESSION + _u64(inode_id)


def sessions_prefix() -> bytes:
    return SESSION


def client_session_key(client_id: bytes, inode_id: int, session_id: bytes) -> bytes:
    _check_client(client_id)
    return CLIENT_SESSION + client_id + _u64(inode_id) + session_id


def client_sessions_prefix(client_id: bytes) -> bytes:
    _check_client(client_id)
    return CLIENT_SESSION + client_id


def parse_client_session_key(key: bytes) -> tuple[bytes, int, bytes]:
    base = len(CLIENT_SESSION)
    client_id = key[base:base + CLIENT_ID_BYTES]
    inode_id = int(_U64.unpack_from(key, base + CLIENT_ID_BYTES)[0])
    return client_id, inode_id, key[base + CLIENT_ID_BYTES + 8:]


def client_key(client_id: bytes) -> bytes:
    _check_client(client_id)
    return CLIENT + client_id


def client_prefix() -> bytes:
    return CLIENT


def expired_client_key(client_id: bytes) -> bytes:
    _check_client(client_id)
    return EXPIRED_CLIENT + client_id


def expired_client_prefix() -> bytes:
    return EXPIRED_CLIENT


def gc_key(inode_id: int) -> bytes:
    return GC + _u64(inode_id)


def gc_prefix() -> bytes:
    return GC


def trash_key(inode_id: int) -> bytes:
    return TRASH + _u64(inode_id)


def trash_prefix() -> bytes:
    return TRASH


def trash_expiry_key(expires_at_ns: int, inode_id: int) -> bytes:
    return TRASH_EXPIRY + _u64(expires_at_ns) + _u64(inode_id)


def trash_expiry_prefix() -> bytes:
    return TRASH_EXPIRY


def truncate_key(inode_id: int) -> bytes:
    return TRUNCATE + _u64(inode_id)


def truncate_prefix() -> bytes:
    return TRUNCATE


def size_gen_key(inode_id: int) -> bytes:
    return SIZE_GEN + _u64(inode_id)


def size_gen_prefix() -> bytes:
    return SIZE_GEN


def idem_key(client_id: bytes, request_id: int) -> bytes:
    _check_client(client_id)
    return IDEM + client_id + _u64(request_id)


def idem_prefix() -> bytes:
    return IDEM


def quota_key(inode_id: int) -> bytes:
    return QUOTA + _u64(inode_id)


def quota_prefix() -> bytes:
    return QUOTA


def parse_quota_key(key: bytes) -> int:
    return int(_U64.unpack_from(key, len(QUOTA))[0])


def quota_usage_key(inode_id: int) -> bytes:
    """Kept apart from :func:`quota_key`: every operation reads the limits (a range read), and
    only the operations inside a quota's tree write its usage — they conflict with nothing else."""
    return QUOTA_USAGE + _u64(inode_id)


def quota_away_key(home: int, inode_id: int) -> bytes:
    """A file that keeps ``home`` as its home without a name there (its other names keep it): what
    a count of the home's tree reads to find it, and what removing the home moves up."""
    return QUOTA_AWAY + _u64(home) + _u64(inode_id)


def quota_away_prefix(home: int | None = None) -> bytes:
    return QUOTA_AWAY if home is None else QUOTA_AWAY + _u64(home)


def quota_reservation_key(inode_id: int, session_id: bytes) -> bytes:
    """A writing session's byte credit on a file (see :mod:`fs3.meta.quota`); gone with the session."""
    if len(session_id) != SESSION_ID_BYTES:
        raise InvalidArgument(f"session id must be {SESSION_ID_BYTES} bytes")
    return QUOTA_RESERVATION + _u64(inode_id) + session_id


def quota_reservation_prefix(inode_id: int | None = None) -> bytes:
    return QUOTA_RESERVATION if inode_id is None else QUOTA_RESERVATION + _u64(inode_id)


def parse_quota_reservation_key(key: bytes) -> tuple[int, bytes]:
    """``(inode id, session id)`` of a :func:`quota_reservation_key`."""
    base = len(QUOTA_RESERVATION)
    return int(_U64.unpack_from(key, base)[0]), key[base + 8:]


def quota_reservation_home_key(home: int, inode_id: int, session_id: bytes) -> bytes:
    """The credit of :func:`quota_reservation_key` found by its home directory: what a count of a
    tree adds for the credits held in it."""
    return QUOTA_RESERVATION_HOME + _u64(home) + _u64(inode_id) + session_id


def quota_reservation_home_prefix(home: int | None = None) -> bytes:
    return QUOTA_RESERVATION_HOME if home is None else QUOTA_RESERVATION_HOME + _u64(home)


def counter_key(name: str) -> bytes:
    return COUNTER + name.encode()


def directory_moves_key() -> bytes:
    """Counted up by every rename that changes a directory's parent: a walk of parent links spread
    over several transactions is still one consistent walk while this value stays the same."""
    return counter_key("directory_moves")


def user_key(token_id: str) -> bytes:
    """A user token's record, by its id (16 hex digits, so the table sorts as the ids do)."""
    try:
        raw = bytes.fromhex(token_id)
    except ValueError:
        raw = b""
    if len(raw) != 8 or token_id != raw.hex():
        raise InvalidArgument(f"a user token id is 16 lowercase hex digits, not {token_id!r}")
    return USER + raw


def user_prefix() -> bytes:
    return USER


def parse_user_key(key: bytes) -> str:
    return key[len(USER):].hex()


def encode_u64(value: int) -> bytes:
    return _u64(value)


def decode_u64(raw: bytes | None) -> int:
    return 0 if raw is None else int(_U64.unpack(raw)[0])


# A session written by an older release with its "truncated" flag set: never equal to a generation.
SIZE_GEN_UNKNOWN = (1 << 64) - 1


def _session_size_gen(rest: bytes) -> int:
    if len(rest) == 8:
        return int(_U64.unpack(rest)[0])
    return SIZE_GEN_UNKNOWN if rest[:1] == b"\x01" else 0  # an older record: a "truncated" flag, or none


@dataclass(frozen=True)
class Session:
    """An open handle: the client holding it, whether it may write, and the inode's size
    generation when it opened.

    The size generation (``SGEN``) counts the truncates of an inode. It decides how the handle's
    length is believed: a handle whose file has not been truncated since it opened (same
    generation) reports a length that only covers its own acknowledged writes, and meta takes it
    as is; after a truncate, the handle's earlier writes may be gone from storage, so every length
    it reports is checked against storage instead. Comparing generations, rather than flagging
    every open handle in the truncate's transaction, keeps a truncate's transaction one inode's
    size however many handles the file has.
    """

    client_id: bytes
    write: bool
    opened_ms: int
    size_gen: int = 0

    _FMT = struct.Struct(">?Q")

    def encode(self) -> bytes:
        return self.client_id + self._FMT.pack(self.write, self.opened_ms) + _u64(self.size_gen)

    @classmethod
    def decode(cls, raw: bytes) -> Session:
        write, opened_ms = cls._FMT.unpack_from(raw, CLIENT_ID_BYTES)
        rest = raw[CLIENT_ID_BYTES + cls._FMT.size:]
        return cls(raw[:CLIENT_ID_BYTES], bool(write), int(opened_ms), _session_size_gen(rest))


_LEASE_OWNER = b"\x00"  # after the pid: an owner follows (a hostname never starts with a NUL)


@dataclass(frozen=True)
class ClientLease:
    """A client's lease: how many times it was renewed, and who holds it (for operators).

    ``owner`` is the id of the user token that registered the client id ("" when a service or a
    trusted client did): only that token may use the id afterwards, so a user can neither renew
    another client's lease, nor drop its saved answers, nor act through its open files' sessions.

    No time is stored: each meta server times a lease on its own monotonic clock, from the moment
    it saw ``renewals`` change (see ``MetaService.prune_clients_once``), so a wall-clock step
    cannot expire it and servers need not agree on the time. (Records written when the first
    field was a wall time decode as a count; only its changes matter.)
    """

    renewals: int
    hostname: str
    pid: int
    owner: str = ""

    def encode(self) -> bytes:
        head = _u64(self.renewals) + struct.pack(">I", self.pid)
        if self.owner:
            owner = self.owner.encode()
            head += _LEASE_OWNER + bytes([len(owner)]) + owner
        return head + self.hostname.encode()[:255]

    @classmethod
    def decode(cls, raw: bytes) -> ClientLease:
        renewals, pid = int(_U64.unpack_from(raw)[0]), int(struct.unpack_from(">I", raw, 8)[0])
        rest, owner = raw[12:], ""
        if rest[:1] == _LEASE_OWNER:  # a record without an owner (or of an older release) has none
            size = rest[1]
            owner, rest = rest[2:2 + size].decode(errors="replace"), rest[2 + size:]
        return cls(renewals, rest.decode(errors="replace"), pid, owner)


@dataclass(frozen=True)
class ExpiredClient:
    """A client whose lease lapsed: meta refuses its renewals and requests from then on.

    ``cleaned`` once its sessions are closed and its saved answers dropped. The record outlives
    every retry the client may still send (clients retry for at most half its time to live), so a
    request that already ran can never run again once its answer is gone.
    """

    expired_wall_ms: int   # for operators only; nothing is timed by it
    cleaned: bool = False

    _FMT = struct.Struct(">Q?")

    def encode(self) -> bytes:
        return self._FMT.pack(self.expired_wall_ms, self.cleaned)

    @classmethod
    def decode(cls, raw: bytes) -> ExpiredClient:
        wall_ms, cleaned = cls._FMT.unpack_from(raw)
        return cls(int(wall_ms), bool(cleaned))


@dataclass(frozen=True)
class GcJob:
    """Every chunk of a deleted file from index ``first_chunk`` on (whole file: 0) is to be removed.

    The worker lists the chunks that exist (a paged range listing per chain of ``layout``) and
    removes them a page at a time, so it needs no length and holds one page whatever the file's
    length was; ``length`` (the largest size meta knew) is kept for operators only. A removed chunk
    is no longer listed: after a crash the job resumes where storage says it stopped.
    """

    layout: mpb.Layout
    first_chunk: int
    length: int
    keep_bytes: int = 0   # unused (jobs of older releases used it for truncates)

    _FMT = struct.Struct(">QQQ")

    def encode(self) -> bytes:
        return self._FMT.pack(self.first_chunk, self.length, self.keep_bytes) + self.layout.SerializeToString()

    @classmethod
    def decode(cls, raw: bytes) -> GcJob:
        first_chunk, length, keep = cls._FMT.unpack_from(raw)
        return cls(mpb.Layout.FromString(raw[cls._FMT.size:]), int(first_chunk), int(length), int(keep))


_TRUNCATE_FORMAT = b"\xf1"  # leads a current truncate record; an older one starts with a zero byte
_NO_SIZE = (1 << 64) - 1


@dataclass(frozen=True)
class TruncateJob:
    """A size change waiting for storage: from byte ``clear_from`` on, storage must hold nothing
    (chunks past it removed, the chunk holding it trimmed); then the inode's size becomes ``size``.

    The size is applied only when the chunks are gone (see ``fs3.meta.ops``), so no client can
    see the new size — and write beyond it — before the removal that could erase its bytes.
    ``size_gen`` is the inode's size generation the truncate created. ``size`` None: a job
    recorded by an older release, whose size is already set. Like :class:`GcJob`, the job keeps
    no progress of its own: what it removed is no longer listed, the trim is simply done again.
    """

    layout: mpb.Layout
    size: int | None
    clear_from: int
    size_gen: int

    _FMT = struct.Struct(">QQQ")
    _OLD = struct.Struct(">QQQ")

    @property
    def first_chunk(self) -> int:
        """The first chunk to remove whole."""
        return -(-self.clear_from // self.layout.chunk_size)

    def encode(self) -> bytes:
        size = _NO_SIZE if self.size is None else self.size
        return (_TRUNCATE_FORMAT + self._FMT.pack(size, self.clear_from, self.size_gen)
                + self.layout.SerializeToString())

    @classmethod
    def decode(cls, raw: bytes) -> TruncateJob:
        if raw[:1] == _TRUNCATE_FORMAT:
            size, clear_from, size_gen = cls._FMT.unpack_from(raw, 1)
            layout = mpb.Layout.FromString(raw[1 + cls._FMT.size:])
            return cls(layout, None if size == _NO_SIZE else int(size), int(clear_from), int(size_gen))
        # An older record: remove chunks from ``first_chunk`` on, trim the one before to ``keep``.
        first_chunk, _, keep = cls._OLD.unpack_from(raw)
        layout = mpb.Layout.FromString(raw[cls._OLD.size:])
        clear_from = (first_chunk - 1) * layout.chunk_size + keep if keep else first_chunk * layout.chunk_size
        return cls(layout, None, int(clear_from), 0)


@dataclass(frozen=True)
class IdemRecord:
    """The serialized answer of a committed mutating request, and when it committed."""

    committed_ms: int
    response: bytes

    def encode(self) -> bytes:
        return _u64(self.committed_ms) + self.response

    @classmethod
    def decode(cls, raw: bytes) -> IdemRecord:
        return cls(int(_U64.unpack_from(raw)[0]), raw[8:])


_USER_FORMAT = b"\x01"
_SECRET_HASH_BYTES = 32


@dataclass(frozen=True)
class UserRecord:
    """A per-user token: its public record, and a hash of its secret (the secret itself is never
    stored: whoever reads the store learns nothing that authenticates)."""

    info: mpb.UserInfo
    secret_hash: bytes

    def encode(self) -> bytes:
        if len(self.secret_hash) != _SECRET_HASH_BYTES:
            raise InvalidArgument("a user token's secret hash is 32 bytes")
        return _USER_FORMAT + self.secret_hash + self.info.SerializeToString()

    @classmethod
    def decode(cls, raw: bytes) -> UserRecord:
        if raw[:1] != _USER_FORMAT:
            raise InvalidArgument("not a user token record")
        end = 1 + _SECRET_HASH_BYTES
        return cls(mpb.UserInfo.FromString(raw[end:]), raw[1:end])

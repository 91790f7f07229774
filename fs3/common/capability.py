"""Data-path capabilities: the proof a client that is not a service shows storage to touch a file's chunks.

Chunk ids are ``(inode, index)``: anyone can guess one. Storage cannot check a user's permissions
(only meta holds the namespace), so meta hands whoever opens a file a capability for it — signed,
short-lived, and bound to what the open allowed — and storage serves a non-service caller a chunk
read only with a capability that grants ``READ`` on that chunk's inode and chain, and a write,
truncate or remove only with one granting ``WRITE``.

A capability is ``body || HMAC-SHA256(key, body)`` with the body::

    version u8 | access u8 | inode_id u64 | expires_ms u64 | session length u8 | chain count u16
    | session id | chain ids u32...

``expires_ms`` is wall-clock time (milliseconds since the epoch) on meta's clock; storage accepts
a capability until ``expires_ms + skew_ms`` on its own. ``chains`` are the chain ids of the file's
layout, in layout order: chunk ``i`` must be on ``chains[i % len(chains)]``, so a capability
reaches exactly the chunks the file can have. ``session_id`` is the open file's session: storage
ignores it, meta renews a capability only for the session it was issued to.

The key is derived from a cluster token (:func:`derive_key`), which every service already holds:
no further secret has to be distributed, and when the cluster token rotates the capability key
rotates with it (meta signs with the first valid token's key; storage accepts any valid token's).

Pure: no clock (the time comes in as an argument), no transport, no randomness.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from fs3.common.errors import PermissionDenied
from fs3.common.layout import STRIPE_MAX
from fs3.common.posix import O_ACCMODE, O_RDWR, O_WRONLY

__all__ = [
    "CAPABILITY_VERSION",
    "DENIAL_PREFIX",
    "Access",
    "Capability",
    "access_for_flags",
    "check_chunk_access",
    "decode",
    "derive_key",
    "is_capability_denial",
    "parse_access",
    "sign",
]

CAPABILITY_VERSION = 1
# Every refusal by this module says so first: a client tells a refusal it may cure by asking meta
# for a fresh capability from any other permission error.
DENIAL_PREFIX = "capability"
_KEY_LABEL = b"fs3 capability key v1"
_HEADER = struct.Struct(">BBQQBH")
_SESSION_MAX_BYTES = 255
_CHAIN = struct.Struct(">I")
_TAG_BYTES = hashlib.sha256().digest_size
# The longest capability there can be (a full session id, a full stripe): anything longer is
# refused before it is hashed, so a caller cannot make each request cost an HMAC of megabytes.
_CAPABILITY_MAX_BYTES = _HEADER.size + _SESSION_MAX_BYTES + STRIPE_MAX * _CHAIN.size + _TAG_BYTES


class Access(enum.IntFlag):
    """What a capability allows: reading chunks, and writing (write, truncate, remove) them."""

    READ = 1
    WRITE = 2


_ACCESS_BITS = int(Access.READ | Access.WRITE)


def parse_access(bits: int) -> Access:
    """The access ``bits`` name; ``ValueError`` for none or unknown ones."""
    if not bits or bits & ~_ACCESS_BITS:
        raise ValueError(f"invalid access bits {bits}")
    return Access(bits)


def access_for_flags(flags: int) -> Access:
    """The access an ``open(2)`` with these flags grants: a write-only open may not read."""
    mode = flags & O_ACCMODE
    if mode == O_WRONLY:
        return Access.WRITE
    if mode == O_RDWR:
        return Access.READ | Access.WRITE
    return Access.READ


def derive_key(cluster_token: str) -> bytes:
    """The capability key of a cluster token (a one-way function of it: a capability never
    reveals the token, and the key is useless for anything but capabilities)."""
    if not cluster_token:
        raise ValueError("a capability key needs a non-empty cluster token")
    return hmac.new(cluster_token.encode(), _KEY_LABEL, hashlib.sha256).digest()


def _denied(reason: str) -> PermissionDenied:
    return PermissionDenied(f"{DENIAL_PREFIX} {reason}")


def is_capability_denial(code: int, message: str) -> bool:
    """Whether an error (its status code and message) is storage refusing a capability: the
    caller may ask meta for a fresh one (meta checks the permission again) and retry once."""
    return code == PermissionDenied.code and message.startswith(DENIAL_PREFIX)


@dataclass(frozen=True, slots=True)
class Capability:
    """What one capability grants: ``access`` to the chunks of ``inode_id`` on ``chains`` (the
    file's layout order), until ``expires_ms`` (wall clock); issued to the open session
    ``session_id``."""

    inode_id: int
    access: Access
    chains: tuple[int, ...]
    expires_ms: int
    session_id: bytes = b""

    def __post_init__(self) -> None:
        if not self.chains:
            raise ValueError("a capability needs the file's chains")
        if len(self.chains) > STRIPE_MAX:
            raise ValueError(f"{len(self.chains)} chains exceed {STRIPE_MAX}")
        parse_access(int(self.access))
        if len(self.session_id) > _SESSION_MAX_BYTES:
            raise ValueError(f"session id of {len(self.session_id)} bytes exceeds {_SESSION_MAX_BYTES}")

    def body(self) -> bytes:
        return (_HEADER.pack(CAPABILITY_VERSION, int(self.access), self.inode_id, self.expires_ms,
                             len(self.session_id), len(self.chains))
                + self.session_id + b"".join(_CHAIN.pack(c) for c in self.chains))

    def __repr__(self) -> str:
        return (f"Capability(inode {self.inode_id}, {self.access.name}, {len(self.chains)} chains, "
                f"expires {self.expires_ms})")


def sign(capability: Capability, key: bytes) -> bytes:
    """The capability's bytes, signed with ``key``."""
    body = capability.body()
    return body + hmac.new(key, body, hashlib.sha256).digest()


def decode(raw: bytes, keys: Sequence[bytes]) -> Capability:
    """The capability ``raw`` carries, if one of ``keys`` signed it; ``PermissionDenied`` (a
    capability denial) otherwise. Expiry is not checked here: see :func:`check_chunk_access`."""
    if not raw:
        raise _denied("missing: open the file through meta to get one")
    if not _HEADER.size + _TAG_BYTES <= len(raw) <= _CAPABILITY_MAX_BYTES:
        raise _denied(f"malformed: {len(raw)} bytes")
    body, tag = raw[:-_TAG_BYTES], raw[-_TAG_BYTES:]
    # Every key is tried (no early exit), so the time taken says nothing about which one matched.
    signed = False
    for key in keys:
        signed |= hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), tag)
    if not signed:
        raise _denied("not signed by a current cluster key (forged, altered, or from before a token rotation)")
    version, access, inode_id, expires_ms, session_bytes, count = _HEADER.unpack_from(body)
    if version != CAPABILITY_VERSION:
        raise _denied(f"version {version} is not {CAPABILITY_VERSION}")
    if len(body) != _HEADER.size + session_bytes + count * _CHAIN.size:
        raise _denied("malformed: its session and chain list do not match its length")
    session_id = body[_HEADER.size:_HEADER.size + session_bytes]
    start = _HEADER.size + session_bytes
    chains = tuple(_CHAIN.unpack_from(body, start + i * _CHAIN.size)[0] for i in range(count))
    try:
        return Capability(int(inode_id), parse_access(access), chains, int(expires_ms), bytes(session_id))
    except ValueError as exc:
        raise _denied(f"malformed: {exc}") from None


def check_chunk_access(raw: bytes, keys: Sequence[bytes], *, need: Access, inode_id: int, chunk_index: int,
                       chain_id: int, now_ms: int, skew_ms: int) -> Capability:
    """The capability, if it grants ``need`` on chunk ``chunk_index`` of ``inode_id`` on
    ``chain_id`` at wall-clock ``now_ms`` (allowing ``skew_ms`` of clock difference with meta);
    ``PermissionDenied`` with the reason otherwise."""
    capability = decode(raw, keys)
    if capability.inode_id != inode_id:
        raise _denied(f"is for inode {capability.inode_id}, not inode {inode_id}")
    if int(need) & ~int(capability.access):
        raise _denied(f"grants {capability.access.name}, not {need.name}")
    expected_chain = capability.chains[chunk_index % len(capability.chains)]
    if expected_chain != chain_id:
        raise _denied(f"puts chunk {chunk_index} of inode {inode_id} on chain {expected_chain}, not {chain_id}")
    if now_ms > capability.expires_ms + skew_ms:
        raise _denied(f"expired {now_ms - capability.expires_ms} ms ago: renew it with meta")
    return capability

"""The data-path capability format: what it grants, and every way a wrong one is refused."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator

import pytest

from fs3.common.capability import (
    Access,
    Capability,
    access_for_flags,
    check_chunk_access,
    decode,
    derive_key,
    is_capability_denial,
    parse_access,
    sign,
)
from fs3.common.errors import PermissionDenied, StatusCode
from fs3.common.layout import STRIPE_MAX
from fs3.common.posix import O_CREAT, O_RDONLY, O_RDWR, O_TRUNC, O_WRONLY
from fs3.rpc.auth import Authenticator

KEY = derive_key("cluster-token")
OTHER_KEY = derive_key("another-cluster-token")
NOW_MS = 1_700_000_000_000
CHAINS = (101, 102, 103)
RW = Access.READ | Access.WRITE


SESSION = b"s" * 24


def _cap(inode_id: int = 42, access: Access = RW, expires_ms: int = NOW_MS + 60_000,
         chains: tuple[int, ...] = CHAINS, session_id: bytes = SESSION) -> Capability:
    return Capability(inode_id, access, chains, expires_ms, session_id)


def _check(raw: bytes, *, keys: tuple[bytes, ...] = (KEY,), need: Access = Access.READ, inode_id: int = 42,
           chunk_index: int = 0, chain_id: int = 101, now_ms: int = NOW_MS, skew_ms: int = 0) -> Capability:
    return check_chunk_access(raw, keys, need=need, inode_id=inode_id, chunk_index=chunk_index, chain_id=chain_id,
                              now_ms=now_ms, skew_ms=skew_ms)


def test_a_signed_capability_round_trips_and_grants_its_chunks() -> None:
    raw = sign(_cap(), KEY)
    assert decode(raw, [KEY]) == _cap()
    # Chunk i of the file lives on chains[i % stripe]: each is granted on exactly that chain.
    for index in range(7):
        chain = CHAINS[index % len(CHAINS)]
        assert _check(raw, need=RW, chunk_index=index, chain_id=chain).inode_id == 42
    assert _check(raw, now_ms=NOW_MS + 60_000).expires_ms == NOW_MS + 60_000  # valid up to its expiry


def test_any_current_key_verifies_and_the_first_signs() -> None:
    raw = sign(_cap(), OTHER_KEY)
    assert decode(raw, [KEY, OTHER_KEY]).inode_id == 42  # a token rotation: both valid for a while
    with pytest.raises(PermissionDenied, match="not signed by a current cluster key"):
        decode(raw, [KEY])  # the old token was dropped: its capabilities die with it
    auth = Authenticator(["new-token", "old-token"])
    assert auth.capability_keys == (derive_key("new-token"), derive_key("old-token"))
    auth.set_tokens(["new-token"])
    keys: tuple[bytes, ...] = auth.capability_keys
    assert keys == (derive_key("new-token"),)
    assert Authenticator().capability_keys == ()
    assert derive_key("cluster-token") != b"cluster-token" and len(KEY) == 32
    with pytest.raises(ValueError):
        derive_key("")


def _denied(raw: bytes, match: str, **kwargs: object) -> None:
    with pytest.raises(PermissionDenied, match=match) as info:
        _check(raw, **kwargs)  # type: ignore[arg-type]
    assert is_capability_denial(info.value.code, info.value.message)


def test_every_field_is_covered_by_the_signature() -> None:
    raw = sign(_cap(), KEY)
    for position in range(len(raw)):
        for flip in (0x01, 0x80):
            tampered = bytearray(raw)
            tampered[position] ^= flip
            _denied(bytes(tampered), "capability")
    # Rebuilt with another inode, more access, a later expiry or other chains, under the old tag.
    tag = raw[-32:]
    for changed in (_cap(inode_id=43), _cap(access=RW, expires_ms=NOW_MS + 10**9), _cap(chains=(101, 102, 104)),
                    _cap(session_id=b"t" * 24)):
        _denied(changed.body() + tag, "not signed")


def test_wrong_key_truncated_and_malformed_bytes_are_refused() -> None:
    raw = sign(_cap(), KEY)
    _denied(raw, "not signed", keys=(OTHER_KEY,))
    _denied(raw, "not signed", keys=())
    _denied(b"", "missing")
    for cut in (1, 10, len(raw) - 33, len(raw) - 1):
        _denied(raw[:cut], "capability")
    _denied(raw + b"\x00", "not signed")
    # Well signed but inconsistent inside: a chain count that disagrees with the length, a
    # version this code does not know, access bits that mean nothing.
    body = bytearray(_cap().body())
    body[20] ^= 1  # the chain count's low byte (the header's last)
    _denied(sign_body(bytes(body)), "do not match its length")
    body = bytearray(_cap().body())
    body[18] = 25  # the session's length
    _denied(sign_body(bytes(body)), "do not match its length")
    body = bytearray(_cap().body())
    body[0] = 2
    _denied(sign_body(bytes(body)), "version 2")
    body = bytearray(_cap().body())
    body[1] = 4
    _denied(sign_body(bytes(body)), "malformed")


class _WatchedKeys(tuple[bytes, ...]):
    """Keys that note whether anything was checked against them (an HMAC computed)."""

    used = False

    def __iter__(self) -> Iterator[bytes]:
        type(self).used = True
        return super().__iter__()


def test_a_capability_longer_than_any_valid_one_is_refused_before_any_hmac() -> None:
    """The longest valid capability (a 255-byte session, 256 chains) is about 1.3 KiB; storage and
    meta refuse a longer one before hashing it, or a caller makes each request cost an HMAC of a
    16 MiB message per valid key."""
    longest = sign(_cap(chains=tuple(range(STRIPE_MAX)), session_id=b"s" * 255), KEY)
    assert decode(longest, [KEY]).chains == tuple(range(STRIPE_MAX))
    keys = _WatchedKeys((KEY,))
    for raw in (longest + b"\x00", b"\x01" * (1 << 20)):
        _WatchedKeys.used = False
        with pytest.raises(PermissionDenied, match="malformed"):
            decode(raw, keys)
        assert not _WatchedKeys.used


def sign_body(body: bytes) -> bytes:
    return body + hmac.new(KEY, body, hashlib.sha256).digest()


def test_expired_refused_after_the_skew_only() -> None:
    raw = sign(_cap(expires_ms=NOW_MS), KEY)
    _denied(raw, "expired 1 ms ago", now_ms=NOW_MS + 1)
    assert _check(raw, now_ms=NOW_MS + 5_000, skew_ms=5_000).inode_id == 42
    _denied(raw, "expired", now_ms=NOW_MS + 5_001, skew_ms=5_000)


def test_wrong_inode_access_or_chain_refused() -> None:
    raw = sign(_cap(access=Access.READ), KEY)
    _denied(raw, "is for inode 42, not inode 43", inode_id=43)
    _denied(raw, "grants READ, not WRITE", need=Access.WRITE)
    _denied(raw, "grants READ, not READ\\|WRITE", need=RW)
    write_only = sign(_cap(access=Access.WRITE), KEY)
    _denied(write_only, "grants WRITE, not READ", need=Access.READ)
    assert _check(write_only, need=Access.WRITE).access == Access.WRITE
    _denied(raw, "on chain 102, not 101", chunk_index=1, chain_id=101)
    _denied(raw, "on chain 101, not 999", chunk_index=3, chain_id=999)


def test_a_capability_must_name_chains_and_known_access() -> None:
    assert decode(sign(_cap(session_id=b""), KEY), [KEY]).session_id == b""
    with pytest.raises(ValueError):
        _cap(session_id=b"x" * 256)
    with pytest.raises(ValueError):
        _cap(chains=())
    with pytest.raises(ValueError):
        _cap(chains=tuple(range(STRIPE_MAX + 1)))
    assert len(decode(sign(_cap(chains=tuple(range(STRIPE_MAX))), KEY), [KEY]).chains) == STRIPE_MAX
    for bits in (0, 4, 7):
        with pytest.raises(ValueError):
            parse_access(bits)
        with pytest.raises(ValueError):
            _cap(access=Access(bits))


def test_open_flags_give_the_access_they_allow() -> None:
    assert access_for_flags(O_RDONLY) == Access.READ
    assert access_for_flags(O_RDONLY | O_TRUNC) == Access.READ
    assert access_for_flags(O_WRONLY | O_CREAT) == Access.WRITE  # a write-only open may not read
    assert access_for_flags(O_RDWR) == RW


def test_only_capability_refusals_invite_a_renewal() -> None:
    assert is_capability_denial(StatusCode.PERMISSION_DENIED, "capability expired 3 ms ago")
    assert not is_capability_denial(StatusCode.PERMISSION_DENIED, "Storage.Forward needs a cluster token")
    assert not is_capability_denial(StatusCode.NOT_PERMITTED, "capability")


def test_no_secret_in_reprs() -> None:
    raw = sign(_cap(), KEY)
    assert raw.hex() not in repr(decode(raw, [KEY]))
    assert "cluster-token" not in repr(Authenticator(["cluster-token"]))

"""The user table: per-user tokens, each bound to one identity (a uid, its primary gid and groups).

A user token is ``fs3u.<id>.<secret>`` (:func:`fs3.rpc.auth.parse_user_token`). Meta keeps one
record per token id (``USER`` + id, :class:`~fs3.meta.schema.UserRecord`): the identity, a name
and comment for operators, and a SHA-256 hash of the secret, never the secret itself — the
secret is 32 random bytes, so a hash cannot be turned back into it by guessing, and whoever
reads the store (a backup, a copied KV directory) holds nothing that authenticates. The hash is
domain-separated and bound to the id, so a record copied under another id matches nothing.

Every function here runs inside a transaction the caller gives and takes every input (the new
id and secret, the time) as an argument: no randomness, clock or transport, so a seeded model
test drives exactly what the service runs. The service's shell (:mod:`fs3.meta.identity`) draws
the secrets, stamps the times and checks each request against the table.

Identity binding (:func:`admit_identity`): a request made with a user token runs as the token's
identity. A request that names no identity gets it; one that names exactly it passes; any other
claim is refused (``NotPermitted``, EPERM) and nothing runs. With root squash on (the default),
a token bound to uid 0 acts as nobody (65534:65534, no groups), as NFS squashes a remote root: a
stolen token then grants no more than any unprivileged user's.
"""

from __future__ import annotations

import hashlib
import hmac

from fs3 import meta_pb2 as mpb
from fs3.common.errors import AlreadyExists, InvalidArgument, NotFound, NotPermitted, Unauthenticated
from fs3.kv.api import Transaction, prefix_end
from fs3.meta import schema
from fs3.meta.limits import USER_COMMENT_MAX, USER_GROUPS_MAX, USER_NAME_MAX, USER_PAGE_MAX

__all__ = [
    "NOBODY",
    "TOKEN_PREFIX",
    "add_user",
    "admit_identity",
    "authenticate",
    "effective_user",
    "format_token",
    "list_users",
    "remove_user",
    "rotate_user",
    "same_identity",
    "secret_hash",
    "validate_new_user",
]

TOKEN_PREFIX = "fs3u."
# What a squashed root acts as (the kernel's overflow uid and gid, NFS's anonymous user).
NOBODY = 65534
# (uid_t)-1 means "no change" to chown(2): never an identity a token may be bound to.
_NO_ID = 0xFFFFFFFF
_HASH_DOMAIN = b"fs3 user token v1\0"


def secret_hash(token_id: str, secret: str) -> bytes:
    """What the table keeps of a secret: SHA-256 over the id and the secret, domain-separated."""
    return hashlib.sha256(_HASH_DOMAIN + token_id.encode() + b"\0" + secret.encode()).digest()


def format_token(token_id: str, secret: str) -> str:
    return f"{TOKEN_PREFIX}{token_id}.{secret}"


def _printable(text: str, what: str, limit: int, *, empty: bool) -> None:
    if not text and not empty:
        raise InvalidArgument(f"a user's {what} must not be empty")
    if len(text) > limit:
        raise InvalidArgument(f"a user's {what} is {len(text)} characters: at most {limit}")
    if not text.isprintable():
        raise InvalidArgument(f"a user's {what} must be printable text: {text!r}")


def validate_new_user(req: mpb.AddUserReq) -> None:
    """Refuse a user that could not be represented or would be ambiguous, before anything is written."""
    _printable(req.name, "name", USER_NAME_MAX, empty=False)
    if req.name != req.name.strip():
        raise InvalidArgument(f"a user's name must not start or end with a space: {req.name!r}")
    _printable(req.comment, "comment", USER_COMMENT_MAX, empty=True)
    if _NO_ID in (req.uid, req.gid):
        raise InvalidArgument("uid and gid 4294967295 mean 'no change' to chown: not an identity")
    if len(set(req.groups)) > USER_GROUPS_MAX:
        raise InvalidArgument(f"{len(set(req.groups))} supplementary groups: at most {USER_GROUPS_MAX}")
    if _NO_ID in req.groups:
        raise InvalidArgument("group 4294967295 means 'no change' to chown: not a group")


async def _record(txn: Transaction, token_id: str) -> schema.UserRecord | None:
    raw = await txn.get(schema.user_key(token_id))
    return None if raw is None else schema.UserRecord.decode(raw)


async def add_user(txn: Transaction, req: mpb.AddUserReq, token_id: str, secret: str, now_ms: int) -> mpb.UserInfo:
    """Record a new token ``token_id`` with ``secret``; ``AlreadyExists`` if the id is taken (the
    caller draws another)."""
    validate_new_user(req)
    key = schema.user_key(token_id)
    if await txn.get(key) is not None:
        raise AlreadyExists(f"user token id {token_id} is taken")
    info = mpb.UserInfo(token_id=token_id, name=req.name, uid=req.uid, gid=req.gid,
                        groups=sorted(set(req.groups)), comment=req.comment, created_ms=now_ms)
    txn.put(key, schema.UserRecord(info, secret_hash(token_id, secret)).encode())
    return info


async def rotate_user(txn: Transaction, token_id: str, secret: str, now_ms: int) -> mpb.UserInfo:
    """Replace the token's secret: the old one is refused from this commit on."""
    record = await _record(txn, token_id)
    if record is None:
        raise NotFound(f"no user token {token_id}")
    info = mpb.UserInfo()
    info.CopyFrom(record.info)
    info.rotated_ms = now_ms
    txn.put(schema.user_key(token_id), schema.UserRecord(info, secret_hash(token_id, secret)).encode())
    return info


async def remove_user(txn: Transaction, token_id: str) -> mpb.UserInfo:
    """Revoke the token: refused from this commit on, also on connections already open."""
    record = await _record(txn, token_id)
    if record is None:
        raise NotFound(f"no user token {token_id}")
    txn.delete(schema.user_key(token_id))
    return record.info


async def list_users(txn: Transaction, start_after: str, limit: int) -> tuple[list[mpb.UserInfo], bool]:
    """Up to ``limit`` records (``USER_PAGE_MAX`` at most) after token id ``start_after``, in id
    order, and whether more follow. Never a secret or its hash."""
    limit = USER_PAGE_MAX if not 0 < limit <= USER_PAGE_MAX else limit
    prefix = schema.user_prefix()
    start = schema.user_key(start_after) + b"\0" if start_after else prefix
    rows = await txn.scan(start, prefix_end(prefix), limit + 1)
    return [schema.UserRecord.decode(raw).info for _, raw in rows[:limit]], len(rows) > limit


async def authenticate(txn: Transaction, token_id: str, secret: str) -> mpb.UserInfo:
    """The record of a presented token; ``Unauthenticated`` when the id is unknown (never made, or
    revoked) or the secret is not the current one (rotated). The message never holds the secret."""
    record = await _record(txn, token_id)
    if record is None:
        raise Unauthenticated(f"user token {token_id} is unknown or revoked")
    if not hmac.compare_digest(record.secret_hash, secret_hash(token_id, secret)):
        raise Unauthenticated(f"user token {token_id}: wrong secret (rotated?)")
    return record.info


def bound_user(info: mpb.UserInfo) -> mpb.User:
    """The identity the token is bound to, as recorded."""
    return mpb.User(uid=info.uid, gid=info.gid, groups=sorted(set(info.groups)))


def effective_user(info: mpb.UserInfo, root_squash: bool) -> tuple[mpb.User, bool]:
    """The identity requests made with the token run as, and whether root was squashed."""
    if info.uid == 0 and root_squash:
        return mpb.User(uid=NOBODY, gid=NOBODY), True
    return bound_user(info), False


def same_identity(a: mpb.User, b: mpb.User) -> bool:
    """Equal uid, gid and set of supplementary groups (order and repeats do not matter)."""
    return a.uid == b.uid and a.gid == b.gid and set(a.groups) == set(b.groups)


def admit_identity(claimed: mpb.User | None, info: mpb.UserInfo, root_squash: bool) -> mpb.User:
    """The identity a user token's request runs as: ``claimed`` (None: the request named none)
    must be the token's bound identity or its squashed one, else ``NotPermitted``."""
    effective, _ = effective_user(info, root_squash)
    if claimed is not None and not (same_identity(claimed, bound_user(info)) or same_identity(claimed, effective)):
        raise NotPermitted(f"user token {info.token_id} is bound to uid {info.uid} gid {info.gid}: it may not act as "
                           f"uid {claimed.uid} gid {claimed.gid} groups {sorted(set(claimed.groups))}")
    return effective

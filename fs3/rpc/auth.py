"""Who is calling: the principal a connection authenticated as, and what each may call.

A connection presents one credential when it opens (the framed HELLO, or gRPC's ``x-fs3-token``
metadata on every call). It maps to one of three roles:

- ``SERVICE``: a cluster token (mgmtd, meta, storage, the admin CLI). Every method. Several
  cluster tokens may be valid at once, so that a token can be rotated without downtime.
- ``TRUSTED``: a trusted-client token (a mount daemon, running as root, that acts for its
  callers). Client methods only, and it may name any uid/gid in a request.
- ``USER``: a per-user token (``fs3u.<id>.<secret>``) bound to one uid and its gids. Client
  methods only, as that user. Only meta holds the user table: it checks the token on every
  request (so a revoked token is refused at once); mgmtd and storage accept the token's shape
  and serve a user only what it may have anyway (the routing table; chunk I/O with a capability
  meta signed).

The role of the call being served is readable anywhere below the dispatcher through
``current_principal()`` (a context variable the dispatcher sets around each handler).
"""

from __future__ import annotations

import contextvars
import enum
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

from fs3.common.capability import derive_key

__all__ = [
    "CLIENT_METHODS",
    "SERVICE",
    "TRUSTED",
    "USER_TOKEN_PREFIX",
    "Authenticator",
    "Principal",
    "Role",
    "current_principal",
    "parse_user_token",
    "principal_scope",
]

USER_TOKEN_PREFIX = "fs3u."
_USER_TOKEN = re.compile(r"fs3u\.([0-9a-f]{16})\.([A-Za-z0-9_-]{16,128})")

# The methods a client that is not a service may call; every other method (chain forwarding,
# resync, node heartbeats, chain administration, fsck) needs a cluster token.
CLIENT_METHODS: frozenset[tuple[str, str]] = frozenset(
    [("Mgmtd", "GetRoutingInfo"), ("Storage", "Update"), ("Storage", "Read"), ("Storage", "BatchRead")]
    + [("Meta", name) for name in (
        "StatFs", "Lookup", "BatchStat", "Open", "MakeNode", "ReadLink", "Link", "Remove", "Rename", "ReadDir",
        "SetAttr", "GetXattr", "SetXattr", "ListXattr", "RemoveXattr", "Close", "Sync", "SetLayout", "RenewClient",
        "WhoAmI",
        "GrantCapability", "CloseSessions", "TrashList", "TrashRestore", "TrashPurge",
        # Set, unset and check are root's: meta refuses them to anyone else (fs3.meta.quota_service).
        "QuotaSet", "QuotaGet", "QuotaList", "QuotaUnset", "QuotaCheck",
        "QuotaReserve",
    )]
)


class Role(enum.IntEnum):
    USER = 1
    TRUSTED = 2
    SERVICE = 3


@dataclass(frozen=True, slots=True)
class Principal:
    """The authenticated caller of one connection. ``user_token`` is set for ``USER`` only; it
    is verified (and mapped to a uid) by meta, the one service that holds the user table."""

    role: Role
    user_token: str = ""

    @property
    def token_id(self) -> str:
        parsed = parse_user_token(self.user_token)
        return parsed[0] if parsed else ""

    def may_call(self, service: str, method: str) -> bool:
        return self.role == Role.SERVICE or (service, method) in CLIENT_METHODS

    def __repr__(self) -> str:  # never print a secret
        return f"Principal({self.role.name}{', token ' + self.token_id if self.token_id else ''})"


SERVICE = Principal(Role.SERVICE)
TRUSTED = Principal(Role.TRUSTED)

_current: contextvars.ContextVar[Principal] = contextvars.ContextVar("fs3_principal", default=SERVICE)


def current_principal() -> Principal:
    """The principal of the request being served (``SERVICE`` outside any request: in-process
    callers such as tests and the simulator act as the cluster itself)."""
    return _current.get()


class principal_scope:
    """Serve one request as ``principal``."""

    def __init__(self, principal: Principal) -> None:
        self._principal = principal
        self._reset: contextvars.Token[Principal] | None = None

    def __enter__(self) -> Principal:
        self._reset = _current.set(self._principal)
        return self._principal

    def __exit__(self, *exc: object) -> None:
        assert self._reset is not None
        _current.reset(self._reset)


def parse_user_token(text: str) -> tuple[str, str] | None:
    """``(token_id, secret)`` of a well-formed user token, else None."""
    match = _USER_TOKEN.fullmatch(text)
    return (match.group(1), match.group(2)) if match else None


def _equal(presented: bytes, expected: str) -> bool:
    return hmac.compare_digest(presented, expected.encode())


class Authenticator:
    """Maps a presented credential to a principal, in constant time per configured token.

    With no cluster token configured the cluster is open: every connection is a service (the
    in-process tests and the simulator; never a real deployment — ``fs3 local`` and compose
    always set one)."""

    def __init__(self, cluster_tokens: Iterable[str] = (), trusted_tokens: Iterable[str] = ()) -> None:
        self._cluster: tuple[str, ...] = ()
        self._trusted: tuple[str, ...] = ()
        # Counts set_tokens calls: a connection that authenticated under an older generation
        # checks its credential again before its next request (a dropped token is refused there).
        self.generation = 0
        self._capability_keys: tuple[bytes, ...] = ()
        self.set_tokens(cluster_tokens, trusted_tokens)

    def set_tokens(self, cluster_tokens: Iterable[str], trusted_tokens: Iterable[str] = ()) -> None:
        """Replace the valid tokens (a rotation: the new token and the old one are both valid
        until every client moved over, then the old one is dropped)."""
        self._cluster = tuple(t for t in cluster_tokens if t)
        self._trusted = tuple(t for t in trusted_tokens if t)
        self._capability_keys = tuple(derive_key(t) for t in self._cluster)
        self.generation += 1

    @property
    def trusted_tokens(self) -> tuple[str, ...]:
        """The trusted-client tokens (kept as they are when only the cluster tokens are reloaded)."""
        return self._trusted

    @property
    def capability_keys(self) -> tuple[bytes, ...]:
        """The data-path capability keys of the valid cluster tokens (see
        :mod:`fs3.common.capability`): meta signs with the first, storage accepts any. Empty
        for an open cluster, where every caller is a service and no capability is needed."""
        return self._capability_keys

    @property
    def open(self) -> bool:
        return not self._cluster

    def authenticate(self, presented: bytes | str | None) -> Principal | None:
        if self.open:
            return SERVICE
        if presented is None:
            return None
        raw = presented.encode() if isinstance(presented, str) else bytes(presented)
        # Compare against every token, not the first match only, so timing says nothing about which.
        is_service = False
        for token in self._cluster:
            is_service |= _equal(raw, token)
        is_trusted = False
        for token in self._trusted:
            is_trusted |= _equal(raw, token)
        if is_service:
            return SERVICE
        if is_trusted:
            return TRUSTED
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            return None
        if parse_user_token(text) is not None:
            return Principal(Role.USER, text)
        return None

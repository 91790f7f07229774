"""The POSIX vocabulary that clients and metadata engines share. Pure: no transport, clock or randomness.

The numbers here are Linux's, fixed whatever platform a client runs on, because the wire carries
them: an ``O_CREAT`` sent by a client must mean ``O_CREAT`` to every metadata engine. Both sides
import them from here, so the client never depends on the metadata server's package to speak to
it, and a second engine checks permissions exactly as the first does.
"""

from __future__ import annotations

from dataclasses import dataclass

from fs3 import meta_pb2 as mpb

__all__ = [
    "LINK_MAX",
    "NAME_MAX_BYTES",
    "O_ACCMODE",
    "O_APPEND",
    "O_CREAT",
    "O_DIRECTORY",
    "O_EXCL",
    "O_NOFOLLOW",
    "O_RDONLY",
    "O_RDWR",
    "O_TRUNC",
    "O_WRONLY",
    "PATH_MAX_BYTES",
    "PERM_MASK",
    "R_OK",
    "SYMLINK_FOLLOW_MAX",
    "S_ISGID",
    "S_ISUID",
    "S_ISVTX",
    "S_IXGRP",
    "W_OK",
    "XATTR_LIST_MAX_BYTES",
    "XATTR_NAME_MAX_BYTES",
    "XATTR_VALUE_MAX_BYTES",
    "X_OK",
    "Caller",
    "may",
]

# Linux open(2) flags (fixed numbers: the wire carries them, whatever the client's platform).
O_RDONLY = 0
O_WRONLY = 1
O_RDWR = 2
O_ACCMODE = 3
O_CREAT = 0o100
O_EXCL = 0o200
O_TRUNC = 0o1000
O_APPEND = 0o2000
O_DIRECTORY = 0o200000
O_NOFOLLOW = 0o400000

# Mode bits beyond rwx (inode(7)).
S_ISUID = 0o4000
S_ISGID = 0o2000
S_ISVTX = 0o1000
S_IXGRP = 0o010
PERM_MASK = 0o7777

# access(2) bits, as :func:`may` takes them.
R_OK, W_OK, X_OK = 4, 2, 1

# Linux's limits: a longer name or path is ENAMETOOLONG, more links followed ELOOP.
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4096
SYMLINK_FOLLOW_MAX = 40
LINK_MAX = 65_000
XATTR_NAME_MAX_BYTES = 255
XATTR_VALUE_MAX_BYTES = 64 * 1024
# Linux's limit for one listxattr answer (names and their NULs): a longer list is E2BIG.
XATTR_LIST_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class Caller:
    """Who is asking: uid, primary gid and supplementary groups."""

    uid: int
    gid: int
    groups: frozenset[int] = frozenset()

    @classmethod
    def from_pb(cls, user: mpb.User) -> Caller:
        return cls(user.uid, user.gid, frozenset(user.groups))

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups


def may(inode: mpb.Inode, caller: Caller, want: int) -> bool:
    """POSIX access check of ``want`` (R_OK|W_OK|X_OK bits) on ``inode`` for ``caller``."""
    if caller.is_root:
        # Root reads and writes anything; it may execute only what someone may execute.
        return not (want & X_OK and inode.type != mpb.DIRECTORY and not inode.mode & 0o111)
    if caller.uid == inode.uid:
        bits = (inode.mode >> 6) & 7
    elif caller.in_group(inode.gid):
        bits = (inode.mode >> 3) & 7
    else:
        bits = inode.mode & 7
    return bits & want == want

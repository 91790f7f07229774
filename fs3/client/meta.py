"""The client's one door to metadata: :class:`Meta`, a typed method per metadata operation.

Everything in the client that needs metadata (the ``os``-like API, open files, the VFS under the
FUSE mount, the command line) goes through :class:`Meta` and never names an RPC itself: a method
takes typed arguments (what to act on, flags, mode, the session of an open file, the user acting)
and returns typed results (an :class:`~fs3.meta_pb2.Inode`, an :class:`~fs3.meta_pb2.OpenRsp`,
lists), so a renamed field or a changed answer is found by the type checker at every caller, and a
second metadata engine has one surface to implement. The layer is thin on purpose: each method
builds one request and makes one :meth:`MetaClient.call <fs3.client.meta_client.MetaClient.call>`,
which keeps what is delicate — request ids kept across retries (so a retried mutation is applied
once), the retry budget, the lease and re-registration after it lapsed — in one place.

What an operation acts on is a :data:`Target`: an inode id (FUSE works by inode), or a
:class:`~fs3.meta_pb2.PathRef` (an absolute path, a name in a directory inode, or both with an
inode id, which meta then checks the name still leads to); :func:`path_ref` and :func:`name_ref`
build the usual ones.

``user`` overrides the client's identity for one call: the FUSE daemon acts for each caller, and
meta checks that caller's permissions. Left out, the client's own identity is sent.

Errors: every method raises :class:`~fs3.common.errors.FS3Error` (a subclass saying what happened,
carrying its errno), never ``OSError``. Inside the client library errors stay ``FS3Error``; they
become ``OSError`` only at the public edges — the ``fs3.aio`` / ``fs3.connect`` API
(:func:`fs3.client.oserrors.os_errors` around each public method), fsspec (over ``fs3.aio``)
and the FUSE adapter (``FUSEError(errno)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fs3 import meta_pb2 as mpb
from fs3.client.meta_client import MetaClient

__all__ = ["DirPage", "Meta", "Target", "name_ref", "path_ref"]

#: What a metadata operation acts on: an inode id, or a path / a name in a directory (``PathRef``).
Target = mpb.PathRef | int


def path_ref(path: bytes) -> mpb.PathRef:
    """The file at ``path`` (absolute when it starts with ``/``, else from the root)."""
    return mpb.PathRef(path=path)


def name_ref(parent: int, name: bytes) -> mpb.PathRef:
    """The entry ``name`` of the directory inode ``parent``."""
    return mpb.PathRef(parent=parent, path=name)


def _ref(target: Target) -> mpb.PathRef:
    return mpb.PathRef(inode_id=target) if isinstance(target, int) else target


@dataclass(frozen=True)
class DirPage:
    """One page of a directory listing: entries in name order, and whether more follow."""

    entries: list[mpb.DirEntry]
    more: bool


class Meta:
    """Typed metadata operations over one :class:`MetaClient` (its retries, ids and lease)."""

    def __init__(self, client: MetaClient) -> None:
        self.client = client

    # -- the client's identity and lease ---------------------------------------------------------

    @property
    def client_id(self) -> bytes:
        """The id the client registers under now (a new one after its lease lapsed)."""
        return self.client.client_id

    def default_user(self) -> mpb.User:
        """The identity sent when a call names no ``user``."""
        return self.client.user()

    def lease_current(self) -> bool:
        """Whether meta surely still holds the lease (and so every session opened under it)."""
        return self.client.lease_current()

    async def ensure_lease(self) -> None:
        """Return once meta surely holds the lease; ``StaleClient`` if it lapsed."""
        await self.client.ensure_lease()

    async def renew(self) -> None:
        """Renew the lease now (registering the client id if it is new)."""
        await self.client.renew()

    def start_lease(self) -> None:
        """Keep the lease renewed in the background until :meth:`stop`."""
        self.client.start_lease()

    async def stop(self) -> None:
        await self.client.stop()

    # -- names and attributes --------------------------------------------------------------------

    async def statfs(self, user: mpb.User | None = None, inode_id: int = 0) -> mpb.StatFsRsp:
        """Space and inodes; bounded by the nearest quota at or above ``inode_id`` (0: the root)."""
        return await self.client.call("StatFs", mpb.StatFsReq(inode_id=inode_id), mpb.StatFsRsp, user)

    async def lookup(self, target: Target, *, follow: bool = False, user: mpb.User | None = None) -> mpb.Inode:
        """The inode ``target`` names; ``follow``: through a symlink in the last component (stat, not lstat)."""
        rsp = await self.client.call("Lookup", mpb.LookupReq(target=_ref(target), follow=follow), mpb.InodeRsp, user)
        return rsp.inode

    async def batch_stat(self, inode_ids: Sequence[int], user: mpb.User | None = None) -> list[mpb.Inode]:
        """The inodes, in the order asked; one with ``inode_id`` 0 where that inode does not exist."""
        rsp = await self.client.call("BatchStat", mpb.BatchStatReq(inode_ids=inode_ids), mpb.BatchStatRsp, user)
        return list(rsp.inodes)

    async def set_attr(self, target: Target, mask: int, *, follow: bool = False, mode: int = 0, uid: int = 0,
                       gid: int = 0, size: int = 0, atime_ns: int = 0, mtime_ns: int = 0, session_id: bytes = b"",
                       user: mpb.User | None = None) -> mpb.Inode:
        """Change what ``mask`` (``SET_*`` bits) names; the inode after the change.

        ``session_id``: the open file whose handle makes the change (a truncate by handle, the
        privilege drop before a write); meta then answers for that session.
        """
        req = mpb.SetAttrReq(target=_ref(target), follow=follow, mask=mask, mode=mode, uid=uid, gid=gid, size=size,
                             atime_ns=atime_ns, mtime_ns=mtime_ns, session_id=session_id)
        return (await self.client.call("SetAttr", req, mpb.InodeRsp, user)).inode

    async def read_link(self, target: Target, user: mpb.User | None = None) -> bytes:
        rsp = await self.client.call("ReadLink", mpb.ReadLinkReq(target=_ref(target)), mpb.ReadLinkRsp, user)
        return rsp.target

    # -- creating and removing names -------------------------------------------------------------

    async def make_node(self, target: Target, kind: mpb.InodeType, *, mode: int = 0, rdev: int = 0,
                        symlink_target: bytes = b"", user: mpb.User | None = None) -> mpb.Inode:
        """Create the entry ``target`` (a directory, symlink, device ...); the new inode."""
        req = mpb.MakeNodeReq(target=_ref(target), type=kind, mode=mode, rdev=rdev, symlink_target=symlink_target)
        return (await self.client.call("MakeNode", req, mpb.InodeRsp, user)).inode

    async def link(self, source: Target, link: Target, user: mpb.User | None = None) -> mpb.Inode:
        """A new name ``link`` for the file ``source``; the file's inode after it."""
        rsp = await self.client.call("Link", mpb.LinkReq(source=_ref(source), link=_ref(link)), mpb.InodeRsp, user)
        return rsp.inode

    async def remove(self, target: Target, *, directory: bool = False, user: mpb.User | None = None) -> int:
        """Unlink ``target`` (``rmdir`` with ``directory``); the inode id that was removed."""
        rsp = await self.client.call("Remove", mpb.RemoveReq(target=_ref(target), directory=directory),
                                     mpb.RemoveRsp, user)
        return rsp.inode_id

    async def remove_entry(self, target: Target, *, directory: bool = False,
                           user: mpb.User | None = None) -> mpb.RemoveRsp:
        """As :meth:`remove`; the whole answer: the removed inode's id and, from a meta that sends
        it, the directory as the removal left it (``parent``)."""
        return await self.client.call("Remove", mpb.RemoveReq(target=_ref(target), directory=directory),
                                      mpb.RemoveRsp, user)

    async def rename(self, source: Target, destination: Target, *, flags: int = 0,
                     user: mpb.User | None = None) -> mpb.Inode:
        """POSIX rename; ``flags``: ``RENAME_NOREPLACE`` / ``RENAME_EXCHANGE``. The moved inode."""
        rsp = await self.client.call("Rename", mpb.RenameReq(source=_ref(source), destination=_ref(destination),
                                                             flags=flags), mpb.RenameRsp, user)
        return rsp.inode

    async def read_dir(self, directory: Target, *, start_after: bytes = b"", limit: int, with_attrs: bool,
                       user: mpb.User | None = None) -> DirPage:
        """Up to ``limit`` entries named after ``start_after`` (each with its attributes if asked)."""
        rsp = await self.client.call("ReadDir", mpb.ReadDirReq(dir=_ref(directory), start_after=start_after,
                                                               limit=limit, with_attrs=with_attrs),
                                     mpb.ReadDirRsp, user)
        return DirPage(list(rsp.entries), rsp.more)

    # -- open files ------------------------------------------------------------------------------

    async def open(self, target: Target, flags: int, *, mode: int = 0, user: mpb.User | None = None) -> mpb.OpenRsp:
        """Open ``target`` with ``open(2)`` flags (``mode``: permissions of a file it creates).

        The answer has the inode, the session id of a file opened for I/O, and whether it was created.
        """
        return await self.client.call("Open", mpb.OpenReq(target=_ref(target), flags=flags, mode=mode),
                                      mpb.OpenRsp, user)

    async def sync(self, inode_id: int, session_id: bytes, *, length_hint: int, wrote: bool, acked: bool = False,
                   user: mpb.User | None = None) -> mpb.Inode:
        """Tell meta how far the session wrote (``acked``: every write below is acknowledged)."""
        req = mpb.SyncReq(inode_id=inode_id, session_id=session_id, length_hint=length_hint, wrote=wrote,
                          acked=acked)
        return (await self.client.call("Sync", req, mpb.InodeRsp, user)).inode

    async def close(self, inode_id: int, session_id: bytes, *, length_hint: int, wrote: bool, acked: bool,
                    user: mpb.User | None = None) -> mpb.Inode:
        """Close the session, with how far it wrote (as in :meth:`sync`)."""
        req = mpb.CloseReq(inode_id=inode_id, session_id=session_id, length_hint=length_hint, wrote=wrote,
                           acked=acked)
        return (await self.client.call("Close", req, mpb.InodeRsp, user)).inode

    async def close_sessions(self, sessions: Sequence[tuple[int, bytes]], user: mpb.User | None = None) -> int:
        """End sessions that have no length to publish (``(inode_id, session_id)`` each), in one
        call; how many were still open."""
        req = mpb.CloseSessionsReq(sessions=[mpb.CloseReq(inode_id=inode_id, session_id=session_id)
                                             for inode_id, session_id in sessions])
        return (await self.client.call("CloseSessions", req, mpb.CloseSessionsRsp, user)).closed

    async def grant_capability(self, inode_id: int, access: int, session_id: bytes, previous: bytes, *,
                               user: mpb.User | None = None) -> mpb.GrantCapabilityRsp:
        """A fresh data-path capability for an open file's session (``access``: ``CAPABILITY_*``
        bits); ``previous``, the one its open returned, keeps the rights the file was opened with."""
        req = mpb.GrantCapabilityReq(inode_id=inode_id, access=access, session_id=session_id, previous=previous)
        return await self.client.call("GrantCapability", req, mpb.GrantCapabilityRsp, user)

    # -- xattrs ----------------------------------------------------------------------------------

    async def get_xattr(self, target: Target, name: bytes, *, follow: bool = False,
                        user: mpb.User | None = None) -> bytes:
        rsp = await self.client.call("GetXattr", mpb.GetXattrReq(target=_ref(target), follow=follow, name=name),
                                     mpb.GetXattrRsp, user)
        return rsp.value

    async def set_xattr(self, target: Target, name: bytes, value: bytes, *, flags: int = 0, follow: bool = False,
                        user: mpb.User | None = None) -> mpb.Inode:
        """Set one attribute; ``flags``: ``XATTR_CREATE`` / ``XATTR_REPLACE``."""
        req = mpb.SetXattrReq(target=_ref(target), follow=follow, name=name, value=value, flags=flags)
        return (await self.client.call("SetXattr", req, mpb.InodeRsp, user)).inode

    async def list_xattr(self, target: Target, *, follow: bool = False, user: mpb.User | None = None) -> list[bytes]:
        rsp = await self.client.call("ListXattr", mpb.ListXattrReq(target=_ref(target), follow=follow),
                                     mpb.ListXattrRsp, user)
        return list(rsp.names)

    async def remove_xattr(self, target: Target, name: bytes, *, follow: bool = False,
                           user: mpb.User | None = None) -> mpb.Inode:
        rsp = await self.client.call("RemoveXattr", mpb.RemoveXattrReq(target=_ref(target), follow=follow, name=name),
                                     mpb.InodeRsp, user)
        return rsp.inode

    # -- administration --------------------------------------------------------------------------

    async def set_layout(self, directory: Target, layout: mpb.Layout, user: mpb.User | None = None) -> mpb.Inode:
        """The directory's default layout for files created in it from now on; the directory after."""
        rsp = await self.client.call("SetLayout", mpb.SetLayoutReq(dir=_ref(directory), layout=layout),
                                     mpb.InodeRsp, user)
        return rsp.inode

    async def fsck(self, check_chunks: bool = True) -> mpb.FsckRsp:
        """Check the namespace (and, with ``check_chunks``, every chunk on storage for orphans)."""
        return await self.client.call("Fsck", mpb.FsckReq(check_chunks=check_chunks), mpb.FsckRsp)

    # -- the trash -------------------------------------------------------------------------------

    async def trash_list(self, *, start_after: int = 0, limit: int = 0,
                         user: mpb.User | None = None) -> mpb.TrashListRsp:
        """One page of the caller's trash entries (root: everyone's) with ids above ``start_after``;
        ``more``: ask again from ``next_after``."""
        return await self.client.call("TrashList", mpb.TrashListReq(start_after=start_after, limit=limit),
                                      mpb.TrashListRsp, user)

    async def trash_restore(self, entry_id: int, to: Target | None = None, *,
                            user: mpb.User | None = None) -> mpb.Inode:
        """Give a trashed file a name again: its old one, or ``to``; never over an existing name."""
        req = mpb.TrashRestoreReq(id=entry_id)
        if to is not None:
            req.to.CopyFrom(_ref(to))
        return (await self.client.call("TrashRestore", req, mpb.InodeRsp, user)).inode

    async def trash_purge(self, entry_id: int = 0, *, all_entries: bool = False, expired: bool = False,
                          start_after: int = 0, user: mpb.User | None = None) -> mpb.TrashPurgeRsp:
        """Empty one entry (``entry_id``) now, or a page of the caller's entries (``all_entries``,
        or only the ``expired`` ones) above ``start_after``: their chunks go to GC."""
        req = mpb.TrashPurgeReq(id=entry_id, all=all_entries, expired=expired, start_after=start_after)
        return await self.client.call("TrashPurge", req, mpb.TrashPurgeRsp, user)

    # -- directory quotas (fs3.meta.quota) ------------------------------------------------------

    async def quota_set(self, target: Target, *, bytes_limit: int = 0, inodes_limit: int = 0,
                        user: mpb.User | None = None) -> mpb.Quota:
        """Limit the logical bytes and the entries below directory ``target`` (0: no limit of that
        kind; root only). A directory without a quota has its tree counted first."""
        req = mpb.QuotaSetReq(target=_ref(target), bytes_limit=bytes_limit, inodes_limit=inodes_limit)
        return (await self.client.call("QuotaSet", req, mpb.QuotaRsp, user)).quota

    async def quota_get(self, target: Target, *, user: mpb.User | None = None) -> mpb.Quota:
        """The quota of directory ``target`` with its usage; ``NotFound`` when it has none."""
        return (await self.client.call("QuotaGet", mpb.QuotaReq(target=_ref(target)), mpb.QuotaRsp, user)).quota

    async def quota_list(self, *, user: mpb.User | None = None) -> list[mpb.Quota]:
        """Every quota, by directory inode, with its usage."""
        return list((await self.client.call("QuotaList", mpb.QuotaListReq(), mpb.QuotaListRsp, user)).quotas)

    async def quota_unset(self, target: Target, *, user: mpb.User | None = None) -> mpb.Quota:
        """Remove the quota of directory ``target`` (root only); returns what it was."""
        return (await self.client.call("QuotaUnset", mpb.QuotaReq(target=_ref(target)), mpb.QuotaRsp, user)).quota

    async def quota_check(self, *, repair: bool = False, user: mpb.User | None = None) -> mpb.QuotaCheckRsp:
        """Recount every quota's tree and report usage meta keeps wrong (``repair``: fix it)."""
        return await self.client.call("QuotaCheck", mpb.QuotaCheckReq(repair=repair), mpb.QuotaCheckRsp, user)

    async def quota_reserve(self, inode_id: int, session_id: bytes, end: int, *,
                            user: mpb.User | None = None) -> mpb.QuotaReserveRsp:
        """A byte credit for writing session ``session_id`` up to byte ``end`` (``EDQUOT`` when the
        quotas above the file have no room for it; see fs3.meta.quota.reserve)."""
        req = mpb.QuotaReserveReq(inode_id=inode_id, session_id=session_id, end=end)
        return await self.client.call("QuotaReserve", req, mpb.QuotaReserveRsp, user)

    # -- identity and the user table -------------------------------------------------------------

    async def who_am_i(self) -> mpb.WhoAmIRsp:
        """The identity this connection's requests run as, when its token binds one (a user token)."""
        return await self.client.call("WhoAmI", mpb.WhoAmIReq(), mpb.WhoAmIRsp)

    async def add_user(self, name: str, uid: int, gid: int, groups: Sequence[int] = (),
                       comment: str = "") -> mpb.UserTokenRsp:
        """A new user token bound to ``uid``, ``gid`` and ``groups`` (a cluster token's call). The
        answer holds the token; meta keeps only its hash, so it is never shown again."""
        req = mpb.AddUserReq(name=name, uid=uid, gid=gid, groups=groups, comment=comment)
        return await self.client.call("AddUser", req, mpb.UserTokenRsp)

    async def list_users(self, *, start_after: str = "", limit: int = 0) -> tuple[list[mpb.UserInfo], bool]:
        """One page of the user table in token id order (never a secret), and whether more follow."""
        rsp = await self.client.call("ListUsers", mpb.ListUsersReq(start_after=start_after, limit=limit),
                                     mpb.ListUsersRsp)
        return list(rsp.users), rsp.more

    async def remove_user(self, token_id: str) -> mpb.UserInfo:
        """Revoke a user token: refused from now on, also on connections already open."""
        return (await self.client.call("RemoveUser", mpb.UserIdReq(token_id=token_id), mpb.UserInfoRsp)).user

    async def rotate_user(self, token_id: str) -> mpb.UserTokenRsp:
        """A new secret for the token (same id and identity); the old secret is refused from now on."""
        return await self.client.call("RotateUser", mpb.UserIdReq(token_id=token_id), mpb.UserTokenRsp)

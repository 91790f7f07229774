"""Who a request runs as: the gate in front of every metadata handler, and the user table's RPCs.

The dispatcher serves :class:`MetaGate`, not the service itself. For a service or a trusted
client (the mount daemon, acting for each of its callers) the gate adds nothing: the identity
a request names is the one its permissions are checked as. For a user token it runs, before any
handler:

1. the token is looked up in the user table (:mod:`fs3.meta.users`) — on every request, so a
   removed or rotated token is refused at once (``UNAUTHENTICATED``), also on a connection that
   authenticated before;
2. the request's identity (``ReqCtx.user``) becomes the token's: a request that names none gets
   it, one that names it passes, one that names any other uid, gid or group set is refused with
   ``NotPermitted`` (EPERM), logged with the token's id (never its secret), and nothing runs; a
   token bound to uid 0 acts as nobody while root squash is on;
3. the request's client id must be one this token registered (``ClientLease.owner``, set by
   the registering ``RenewClient``): a client id carries state no permission bit guards — saved
   answers, open files' sessions through which a length is reported or a file truncated, the
   lease that keeps those sessions — so a user may touch only its own;
4. files are named by path from the root, as a local process names them: inode ids are
   sequential, and one named alone (or a path relative to a directory's inode) skips the search
   permission of every directory above it — another user's ``0644`` files in a ``0700`` home.
   ``BatchStat`` (inode ids only) is refused; an inode id is accepted with the session of an open
   handle of this client on that inode (``SetAttr`` by handle; ``Close``, ``Sync`` and
   ``GrantCapability`` take an inode and a session, which their handlers check), as an fd names
   its file: the open went through the path. Services and trusted clients (the mount daemon, whose
   kernel works by inode and checks the path itself) are not limited.

The cost is one read of the user table and one of the client's lease per request, in one read
snapshot; a service or trusted client pays nothing.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.message import Message

from fs3 import meta_pb2 as mpb
from fs3.common.buffers import Buffer
from fs3.common.errors import AlreadyExists, Internal, NotPermitted, PermissionDenied, StaleClient
from fs3.kv.api import Transaction
from fs3.kv.txn import run_transaction
from fs3.meta import schema, users
from fs3.meta.service import MetaService
from fs3.rpc.auth import Principal, Role, current_principal, parse_user_token
from fs3.rpc.methods import service_spec

__all__ = ["MetaGate"]

log = logging.getLogger(__name__)

Handler = Callable[[Any, memoryview], Awaitable[tuple[Message, Buffer]]]
_EMPTY = b""
# A new token's id is drawn again when it is taken: 64 random bits collide about never, so a
# few draws in a row that all collide mean the random source is broken.
_ID_DRAWS = 8
_SECRET_BYTES = 32


class MetaGate:
    """The metadata service as the dispatcher serves it: each handler of :class:`MetaService`
    behind the identity check of the module's docstring, plus ``WhoAmI`` and the user table."""

    def __init__(self, service: MetaService, token_id: Callable[[], str] = lambda: secrets.token_hex(8),
                 token_secret: Callable[[], str] = lambda: secrets.token_urlsafe(_SECRET_BYTES)) -> None:
        """``token_id`` and ``token_secret`` draw a new token's parts (a test may fix them)."""
        self.service = service
        self._token_id = token_id
        self._token_secret = token_secret
        own = {"who_am_i", "add_user", "list_users", "remove_user", "rotate_user"}
        self._gated: dict[str, Handler] = {
            m.handler_name: self._admitted(getattr(service, m.handler_name))
            for m in service_spec("Meta").methods if m.handler_name not in own}

    def __getattr__(self, name: str) -> Handler:
        try:
            return self.__dict__["_gated"][name]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def root_squash(self) -> bool:
        return self.service.config.root_squash

    def _admitted(self, handler: Handler) -> Handler:
        async def admitted(request: Any, payload: memoryview) -> tuple[Message, Buffer]:
            principal = current_principal()
            if principal.role == Role.USER:
                await self._admit(principal, request)
            return await handler(request, payload)

        return admitted

    async def _admit(self, principal: Principal, request: Message) -> None:
        txn = self.service.engine.begin()
        info = await self._authenticate(txn, principal)
        if "ctx" not in request.DESCRIPTOR.fields_by_name:
            return  # RenewClient: the handler checks the client id's owner in its own transaction
        ctx: mpb.ReqCtx = request.ctx  # type: ignore[attr-defined]
        try:
            user = users.admit_identity(ctx.user if ctx.HasField("user") else None, info, self.root_squash)
        except NotPermitted as exc:
            log.warning("refused %s: %s", type(request).__name__, exc)
            raise
        ctx.user.CopyFrom(user)
        if ctx.client_id:
            await self._check_client(txn, ctx.client_id, info.token_id)
        await self._check_references(txn, request, info.token_id)

    @staticmethod
    async def _check_references(txn: Transaction, request: Message, token_id: str) -> None:
        """A user names files by path (see the module's docstring, point 4): an inode id alone, or a
        path relative to a directory's inode, is refused — except the inode of an open handle of
        this client's (a session on that inode), as an fd names its file."""
        if isinstance(request, mpb.BatchStatReq):
            raise PermissionDenied("BatchStat names inodes by id: a user token names files by path")
        session_id = bytes(getattr(request, "session_id", b""))
        for field in request.DESCRIPTOR.fields:
            if field.message_type is not mpb.PathRef.DESCRIPTOR or not request.HasField(field.name):
                continue
            ref: mpb.PathRef = getattr(request, field.name)
            if ref.path:
                if ref.parent and not ref.path.startswith(b"/"):
                    raise PermissionDenied("a path relative to a directory's inode id: a user token names files "
                                           "by their path from the root")
                continue
            if not ref.inode_id:
                continue  # an empty reference: the handler refuses it
            ctx: mpb.ReqCtx = request.ctx  # type: ignore[attr-defined]
            if not (isinstance(request, mpb.SetAttrReq) and session_id
                    and schema.session_owner(session_id) == ctx.client_id
                    and await txn.get(schema.session_key(ref.inode_id, session_id)) is not None):
                log.warning("refused user token %s %s by inode id %d", token_id, type(request).__name__,
                            ref.inode_id)
                raise PermissionDenied(f"inode {ref.inode_id} named by its id: a user token names files by path "
                                       f"(or an open handle's session)")

    async def _authenticate(self, txn: Transaction, principal: Principal) -> mpb.UserInfo:
        parsed = parse_user_token(principal.user_token)
        if parsed is None:  # the dispatcher only makes USER principals of well-formed tokens
            raise Internal("a user principal without a well-formed token")
        try:
            return await users.authenticate(txn, *parsed)
        except Exception as exc:
            log.warning("refused a request: %s", exc)
            raise

    @staticmethod
    async def _check_client(txn: Transaction, client_id: bytes, token_id: str) -> None:
        raw = await txn.get(schema.client_key(client_id))
        if raw is None:
            # Never registered, or its lease lapsed: the client registers (afresh) and sends again.
            raise StaleClient("this client id holds no lease (unregistered, or it lapsed): register afresh")
        owner = schema.ClientLease.decode(raw).owner
        if owner != token_id:
            log.warning("refused user token %s the client id %s of %s", token_id, client_id.hex(),
                        f"user token {owner}" if owner else "a service or trusted client")
            raise NotPermitted("this client id was registered with another credential")

    # -- the caller's identity ------------------------------------------------------------------

    async def who_am_i(self, req: mpb.WhoAmIReq, payload: memoryview) -> tuple[mpb.WhoAmIRsp, Buffer]:
        """The identity a user token's requests run as (``bound``); a service or a trusted client
        names the identity of each request itself (not bound)."""
        principal = current_principal()
        if principal.role != Role.USER:
            return mpb.WhoAmIRsp(bound=False), _EMPTY
        info = await self._authenticate(self.service.engine.begin(), principal)
        user, squashed = users.effective_user(info, self.root_squash)
        return mpb.WhoAmIRsp(bound=True, user=user, token_id=info.token_id, name=info.name,
                             squashed=squashed), _EMPTY

    # -- the user table (cluster token only) ----------------------------------------------------

    @staticmethod
    def _service_only(what: str) -> None:
        """The dispatcher already keeps these from non-services; a second check here keeps the user
        table closed should the client method list ever name one by mistake."""
        if current_principal().role != Role.SERVICE:
            raise PermissionDenied(f"{what} needs a cluster token")

    def _now_ms(self) -> int:
        return self.service.wall_ns() // 1_000_000

    async def add_user(self, req: mpb.AddUserReq, payload: memoryview) -> tuple[mpb.UserTokenRsp, Buffer]:
        """A new token for the identity ``req`` names; the token is in this answer only."""
        self._service_only("adding a user")
        users.validate_new_user(req)
        for _ in range(_ID_DRAWS):
            token_id, secret = self._token_id(), self._token_secret()

            async def add(txn: Transaction, token_id: str = token_id, secret: str = secret) -> mpb.UserInfo:
                return await users.add_user(txn, req, token_id, secret, self._now_ms())

            try:
                info = await run_transaction(self.service.engine, add)
            except AlreadyExists:
                continue
            log.info("added user token %s (%s, uid %d gid %d)", info.token_id, info.name, info.uid, info.gid)
            return mpb.UserTokenRsp(user=info, token=users.format_token(token_id, secret)), _EMPTY
        raise Internal(f"{_ID_DRAWS} new user token ids in a row were taken: the random source is broken")

    async def list_users(self, req: mpb.ListUsersReq, payload: memoryview) -> tuple[mpb.ListUsersRsp, Buffer]:
        self._service_only("listing users")
        found, more = await users.list_users(self.service.engine.begin(), req.start_after, req.limit)
        return mpb.ListUsersRsp(users=found, more=more), _EMPTY

    async def remove_user(self, req: mpb.UserIdReq, payload: memoryview) -> tuple[mpb.UserInfoRsp, Buffer]:
        self._service_only("removing a user")
        info = await run_transaction(self.service.engine, lambda txn: users.remove_user(txn, req.token_id))
        log.info("removed user token %s (%s, uid %d)", info.token_id, info.name, info.uid)
        return mpb.UserInfoRsp(user=info), _EMPTY

    async def rotate_user(self, req: mpb.UserIdReq, payload: memoryview) -> tuple[mpb.UserTokenRsp, Buffer]:
        """A new secret for the same token id and identity; the old secret is refused from now on."""
        self._service_only("rotating a user's token")
        secret = self._token_secret()
        info = await run_transaction(self.service.engine,
                                     lambda txn: users.rotate_user(txn, req.token_id, secret, self._now_ms()))
        log.info("rotated user token %s (%s, uid %d)", info.token_id, info.name, info.uid)
        return mpb.UserTokenRsp(user=info, token=users.format_token(info.token_id, secret)), _EMPTY

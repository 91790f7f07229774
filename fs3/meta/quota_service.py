"""The service's quota handlers (``QuotaSet``/``Get``/``List``/``Unset``/``Check``; see
:mod:`fs3.meta.quota` for what a quota counts and how it is enforced).

Setting a quota on a directory that has none counts its tree first: :data:`QUOTA_SCAN_BATCH
<fs3.meta.quota.QUOTA_SCAN_BATCH>` entries per read transaction (one range read and one batched
inode read each), so the cost is about ``entries / 1000`` round trips and never one large
transaction; the quota and the count are then written in one transaction. Changes made in the
tree while it is counted are not in the count: ``QuotaCheck`` (``fs3 quota check [--repair]``)
recounts every quota the same way and reports (or writes) the difference. Files written before
files had a home (``Inode.parent``) are given the directory naming them as home by that count, in
batches of the same size, so they count from then on.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from fs3 import meta_pb2 as mpb
from fs3.common.buffers import Buffer
from fs3.common.errors import BadHandle, InvalidArgument, NotADirectory, NotFound, NotPermitted
from fs3.kv.api import Transaction, prefix_end
from fs3.kv.txn import run_transaction
from fs3.meta import quota, schema
from fs3.meta.host import MetaHost
from fs3.meta.limits import ANCESTOR_WALK_MAX
from fs3.meta.ops import Namespace

__all__ = ["QUOTA_PATH_SCAN_MAX", "QuotaHandlers", "directory_path"]

T = TypeVar("T")
_EMPTY = b""
# Entries of one directory a listing reads to find the name of a quota'd directory in it (its
# parent names it nowhere else): past that, the quota is shown as ``<dir N>``.
QUOTA_PATH_SCAN_MAX = 10_000


async def directory_path(txn: Transaction, directory: int) -> bytes | None:
    """The path of ``directory`` from the root, found by walking its parent links up and looking
    for each one's name in its parent (a bounded scan of :data:`QUOTA_PATH_SCAN_MAX` entries a
    level, at most ``ANCESTOR_WALK_MAX`` levels); None when it cannot be found within those bounds
    or the links are damaged. For people: ``fs3 quota list`` shows it instead of an inode id."""
    names: list[bytes] = []
    current = directory
    for _ in range(ANCESTOR_WALK_MAX):
        if current == schema.ROOT_INODE:
            return b"/" + b"/".join(reversed(names))
        raw = await txn.get(schema.inode_key(current))
        if raw is None:
            return None
        parent = mpb.Inode.FromString(raw).parent
        if parent in (0, current):
            return None
        name = await _name_in(txn, parent, current)
        if name is None:
            return None
        names.append(name)
        current = parent
    return None


async def _name_in(txn: Transaction, parent: int, child: int) -> bytes | None:
    """The name ``child`` has in directory ``parent``, reading at most QUOTA_PATH_SCAN_MAX entries."""
    prefix = schema.dentry_prefix(parent)
    start, end, read = prefix, prefix_end(prefix), 0
    while read < QUOTA_PATH_SCAN_MAX:
        rows = await txn.scan(start, end, limit=min(quota.QUOTA_SCAN_BATCH, QUOTA_PATH_SCAN_MAX - read))
        for _, value in rows:
            entry = mpb.DirEntry.FromString(value)
            if entry.inode_id == child and entry.type == mpb.DIRECTORY:
                return bytes(entry.name)
        read += len(rows)
        if not rows or len(rows) < quota.QUOTA_SCAN_BATCH:
            return None
        start = rows[-1][0] + b"\x00"
    return None


def _reader(txn: Transaction) -> quota.InodeReader:
    async def find_inode(inode_id: int) -> mpb.Inode | None:
        raw = await txn.get(schema.inode_key(inode_id))
        return None if raw is None else mpb.Inode.FromString(raw)
    return find_inode


def _require_root(ctx: mpb.ReqCtx, what: str) -> None:
    if ctx.user.uid != 0:
        raise NotPermitted(f"only root may {what} quotas")


async def _directory(ns: Namespace, target: mpb.PathRef) -> mpb.Inode:
    inode = await ns.resolve(target, follow=True)
    if inode.type != mpb.DIRECTORY:
        raise NotADirectory(f"inode {inode.inode_id} is not a directory: a quota belongs to a directory")
    return inode


async def _quota_of(txn: Transaction, directory: int) -> mpb.Quota | None:
    raw = await txn.get(schema.quota_key(directory))
    if raw is None:
        return None
    found = mpb.Quota.FromString(raw)
    usage = await quota.read_usage(txn, directory)
    found.bytes_used, found.inodes_used = usage.bytes, usage.inodes
    return found


class QuotaHandlers(MetaHost):
    """The service's quota part (see the module's docstring)."""

    @abc.abstractmethod
    async def _read(self, ctx: mpb.ReqCtx, fn: Callable[[Namespace], Awaitable[T]],
                    refs: Sequence[mpb.PathRef] = (), keys: Sequence[bytes] = ()) -> T:
        """A read-only operation on the latest committed state (the service's)."""

    async def _count_tree(self, directory: int, adopting: bool = False) -> quota.Usage:
        """The usage of ``directory``'s tree, counted in read transactions of bounded size;
        ``adopting``: files without a home found in it get the directory naming them as home."""
        count = quota.TreeCount(directory, adopting=adopting)
        while True:
            txn = self.engine.begin()
            if await count.step(txn, _reader(txn), quota.QUOTA_SCAN_BATCH):
                break
        for first in range(0, len(count.homeless), quota.QUOTA_SCAN_BATCH):
            batch = count.homeless[first:first + quota.QUOTA_SCAN_BATCH]

            async def adopt(txn: Transaction, batch: list[tuple[int, bytes, int]] = batch) -> None:
                await quota.adopt(Namespace(txn, self._env(mpb.User())), batch)

            await run_transaction(self.engine, adopt, retry_max=self.config.txn_retry_max)
        return count.usage

    async def quota_set(self, req: mpb.QuotaSetReq, payload: memoryview) -> tuple[mpb.QuotaRsp, Buffer]:
        _require_root(req.ctx, "set")
        if not req.bytes_limit and not req.inodes_limit:
            raise InvalidArgument("a quota needs a byte or an inode limit (to remove one, unset it)")
        directory = await self._read(req.ctx, lambda ns: _directory(ns, req.target), (req.target,))
        existing = await _quota_of(self.engine.begin(), directory.inode_id)
        counted = None if existing is not None else await self._count_tree(directory.inode_id, adopting=True)

        async def op(ns: Namespace) -> mpb.QuotaRsp:
            found = await _directory(ns, req.target)
            if found.inode_id != directory.inode_id:
                raise NotFound("the directory was replaced while its tree was counted: set the quota again")
            limits = mpb.Quota(inode_id=found.inode_id, bytes_limit=req.bytes_limit, inodes_limit=req.inodes_limit)
            quotas = await quota.read_quotas(ns.txn)
            if found.inode_id not in quotas:
                if len(quotas) >= quota.QUOTA_COUNT_MAX:
                    raise InvalidArgument(f"{len(quotas)} quotas exist already, the most meta keeps")
                if counted is None:
                    raise NotFound("the quota was removed while being changed: set it again")
                quota.write_usage(ns.txn, found.inode_id, counted)
            ns.txn.put(schema.quota_key(found.inode_id), limits.SerializeToString())
            shown = await _quota_of(ns.txn, found.inode_id)
            assert shown is not None  # written just above
            shown.path = req.target.path
            return mpb.QuotaRsp(quota=shown)

        return await self._mutate(req.ctx, mpb.QuotaRsp, op, refs=(req.target,)), _EMPTY

    async def quota_get(self, req: mpb.QuotaReq, payload: memoryview) -> tuple[mpb.QuotaRsp, Buffer]:
        async def op(ns: Namespace) -> mpb.QuotaRsp:
            directory = await _directory(ns, req.target)
            found = await _quota_of(ns.txn, directory.inode_id)
            if found is None:
                raise NotFound(f"directory {directory.inode_id} has no quota")
            found.path = req.target.path
            return mpb.QuotaRsp(quota=found)

        return await self._read(req.ctx, op, (req.target,)), _EMPTY

    async def quota_list(self, req: mpb.QuotaListReq, payload: memoryview) -> tuple[mpb.QuotaListRsp, Buffer]:
        async def op(ns: Namespace) -> mpb.QuotaListRsp:
            rsp = mpb.QuotaListRsp()
            for directory in sorted(await quota.read_quotas(ns.txn)):
                found = await _quota_of(ns.txn, directory)
                if found is not None:
                    found.path = await directory_path(ns.txn, directory) or b""
                    rsp.quotas.append(found)
            return rsp

        return await self._read(req.ctx, op), _EMPTY

    async def quota_unset(self, req: mpb.QuotaReq, payload: memoryview) -> tuple[mpb.QuotaRsp, Buffer]:
        _require_root(req.ctx, "unset")

        async def op(ns: Namespace) -> mpb.QuotaRsp:
            directory = await _directory(ns, req.target)
            found = await _quota_of(ns.txn, directory.inode_id)
            if found is None:
                raise NotFound(f"directory {directory.inode_id} has no quota")
            ns.txn.delete(schema.quota_key(directory.inode_id))
            ns.txn.delete(schema.quota_usage_key(directory.inode_id))
            found.path = req.target.path
            return mpb.QuotaRsp(quota=found)

        return await self._mutate(req.ctx, mpb.QuotaRsp, op, refs=(req.target,)), _EMPTY

    async def quota_check(self, req: mpb.QuotaCheckReq, payload: memoryview) -> tuple[mpb.QuotaCheckRsp, Buffer]:
        """Recount every quota's tree and compare with the usage meta keeps; ``repair`` writes
        the count where they differ (run it while the trees are quiet: see the module's docstring)."""
        _require_root(req.ctx, "check")
        rsp = mpb.QuotaCheckRsp()
        wrong: dict[int, quota.Usage] = {}
        rsp.repaired = await self._leaked_reservations(rsp, req.repair)
        for directory in sorted(await quota.read_quotas(self.engine.begin())):
            counted = await self._count_tree(directory)
            recorded = await _quota_of(self.engine.begin(), directory)
            if recorded is None:
                continue  # unset meanwhile
            if quota.Usage(recorded.bytes_used, recorded.inodes_used) != counted:
                rsp.problems.append(f"quota of directory {directory}: records {recorded.bytes_used} bytes, "
                                    f"{recorded.inodes_used} inodes; its tree holds {counted.bytes} bytes, "
                                    f"{counted.inodes} inodes")
                wrong[directory] = counted
            recorded.bytes_used, recorded.inodes_used = counted.bytes, counted.inodes
            recorded.path = await directory_path(self.engine.begin(), directory) or b""
            rsp.recomputed.append(recorded)
        if req.repair and wrong:
            async def repair(ns: Namespace) -> mpb.QuotaCheckRsp:
                quotas = await quota.read_quotas(ns.txn)
                for directory, usage in wrong.items():
                    if directory in quotas:
                        quota.write_usage(ns.txn, directory, usage)
                return mpb.QuotaCheckRsp()

            await self._mutate(req.ctx, mpb.QuotaCheckRsp, repair)
            rsp.repaired = True
        return rsp, _EMPTY

    async def quota_reserve(self, req: mpb.QuotaReserveReq,
                            payload: memoryview) -> tuple[mpb.QuotaReserveRsp, Buffer]:
        """A writer's byte credit (see :func:`quota.reserve <fs3.meta.quota.reserve>`)."""
        if req.session_id and schema.session_owner(req.session_id) != req.ctx.client_id:
            raise BadHandle("the file session belongs to another client id (opened before the client's lease lapsed)")

        async def op(ns: Namespace) -> mpb.QuotaReserveRsp:
            granted_end, counted = await quota.reserve(ns, req.inode_id, req.session_id, req.end)
            return mpb.QuotaReserveRsp(granted_end=granted_end, unlimited=not counted)

        keys = (schema.session_key(req.inode_id, req.session_id), schema.inode_key(req.inode_id),
                schema.quota_reservation_key(req.inode_id, req.session_id))
        return await self._mutate(req.ctx, mpb.QuotaReserveRsp, op, keys=keys), _EMPTY

    async def _leaked_reservations(self, rsp: mpb.QuotaCheckRsp, repair: bool) -> bool:
        """Report each writer's byte credit whose session is gone (a bug, or a store edited by
        hand: a close gives its credit back); ``repair`` deletes them before the recount, which
        then leaves them out of the usage it writes (True: some were). Read a page at a time."""
        prefix = schema.quota_reservation_prefix()
        start, end = prefix, prefix_end(prefix)
        leaked: list[tuple[bytes, quota.Reservation]] = []
        while True:
            txn = self.engine.begin()
            rows = await txn.scan(start, end, limit=quota.QUOTA_SCAN_BATCH)
            for key, raw in rows:
                inode_id, session_id = schema.parse_quota_reservation_key(key)
                if await txn.get(schema.session_key(inode_id, session_id)) is None:
                    held = quota.Reservation.decode(raw)
                    rsp.problems.append(f"byte credit of {held.size_bytes} bytes on inode {inode_id} outlived its "
                                        f"session {session_id.hex()}")
                    leaked.append((key, held))
            if len(rows) < quota.QUOTA_SCAN_BATCH:
                break
            start = rows[-1][0] + b"\x00"
        if not repair or not leaked:
            return False
        for first in range(0, len(leaked), quota.QUOTA_SCAN_BATCH):
            async def drop(txn: Transaction, batch: list[tuple[bytes, quota.Reservation]]
                           = leaked[first:first + quota.QUOTA_SCAN_BATCH]) -> None:
                for key, held in batch:
                    inode_id, session_id = schema.parse_quota_reservation_key(key)
                    if await txn.get(schema.session_key(inode_id, session_id)) is None:
                        txn.delete(key)
                        txn.delete(schema.quota_reservation_home_key(held.home, inode_id, session_id))

            await run_transaction(self.engine, drop, retry_max=self.config.txn_retry_max)
        return True

    async def _quota_bound(self, inode_id: int) -> mpb.Quota | None:
        """The quota ``df`` at ``inode_id`` reports (the nearest at or above it), with its usage."""
        txn = self.engine.begin()
        directory = await quota.nearest_quota(txn, inode_id)
        return None if directory is None else await _quota_of(txn, directory)

"""A file's length: probing storage for a file's end, and applying a writer's length.

A writer's close or fsync brings its length hint; meta takes it as is when nothing can have
removed what it covers, and otherwise asks storage where the file ends: it lists, a page at a
time per chain, the file's chunks from the known size on (``DumpChunkMeta`` over the file's id
range), so a probe costs what the few chunks past the size cost, never the file's length. The
probe runs under the inode's lock after any unfinished truncate job, and the length goes in
with the size generation it was probed under, so a truncate between probe and commit (another
meta server) makes the transaction probe again (see :meth:`Namespace._apply_length
<fs3.meta.ops.Namespace._apply_length>`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from fs3 import meta_pb2 as mpb
from fs3 import storage_pb2 as spb
from fs3.common.errors import FileTooLarge, FS3Error, StatusCode, Unavailable
from fs3.common.ids import CHUNK_SIZE_MIN_BYTES, chunk_id, parse_chunk_id
from fs3.common.layout import max_file_size
from fs3.common.retry import Attempts, Backoff, RetryPolicy
from fs3.common.target_state import PublicState
from fs3.kv.api import Transaction, prefix_end
from fs3.kv.txn import run_transaction
from fs3.meta import quota, schema
from fs3.meta.host import MetaHost
from fs3.meta.limits import (
    CHUNK_INDEX_END,
    LENGTH_PROBE_ATTEMPTS,
    LIST_RETRY_BACKOFF_MAX_MS,
    LIST_RETRY_BACKOFF_MS,
    PRUNE_PAGE,
    REMOVE_PARALLEL,
)
from fs3.meta.ops import LengthProbeStale, LengthReport, Namespace
from fs3.rpc.storage_calls import list_chunk_range

__all__ = ["FileLengths", "all_of"]

log = logging.getLogger(__name__)
T = TypeVar("T")
# A chunk listing that failed on every member is tried again, the n-th time after n x 50 ms (at
# most a second), until the storage client's retry budget is spent.
_LIST_RETRY = RetryPolicy(backoff_base_ms=LIST_RETRY_BACKOFF_MS, backoff_max_ms=LIST_RETRY_BACKOFF_MAX_MS,
                          backoff=Backoff.LINEAR)
_LENGTH_EVERY_LAYOUT_ALLOWS = max_file_size(mpb.Layout(chunk_size=CHUNK_SIZE_MIN_BYTES))

class FileLengths(MetaHost):
    """The service's file-length part (see the module's docstring)."""

    async def _with_exact_length(self, ctx: mpb.ReqCtx, inode_id: int, length: LengthReport,
                                 op: Callable[[Namespace, LengthReport], Awaitable[mpb.InodeRsp]],
                                 keys: Sequence[bytes] = ()) -> mpb.InodeRsp:
        """Apply a writer's length (``length``, as the writer reports it) in one transaction.

        An acknowledged hint from a handle whose file was not truncated since it opened is taken
        as is (no storage round trip: the common create-write-close path). Otherwise storage is
        probed for the file's end and the length applied, holding the inode's lock (so in this
        process no truncate comes between); a probe made stale by a truncate anyway (another meta
        server) is made again, and the last attempt gives up on it (``final``, see
        :meth:`Namespace._apply_length`). ``op`` gets the namespace and the report to apply.

        A stale probe is an exception (:class:`LengthProbeStale`) rather than an answer: it must
        abort the transaction it is found in — a close has already deleted its session there —
        so that nothing of it commits and the next attempt starts afresh. ``keys``: what ``op``
        reads, fetched with the transaction's first read on a networked engine.
        """
        for attempt in range(LENGTH_PROBE_ATTEMPTS):
            final = attempt == LENGTH_PROBE_ATTEMPTS - 1
            try:
                if attempt == 0 and length.acked:
                    return await self._mutate(ctx, mpb.InodeRsp, _applying(op, replace(length, final=False)),
                                              keys=keys)
                if not length.wrote:
                    return await self._mutate(ctx, mpb.InodeRsp, _applying(op, length), keys=keys)
                async with self._inode_lock(inode_id):
                    await self._run_truncate_locked(inode_id)
                    exact, probed_gen = await self._probe_length_locked(inode_id, length.hint,
                                                                        within_size_is_exact=True)
                    probed = length.probed(exact, probed_gen, final or exact is None)
                    return await self._mutate(ctx, mpb.InodeRsp, _applying(op, probed), keys=keys)
            except LengthProbeStale:
                continue
        raise AssertionError("unreachable: the last attempt does not raise LengthProbeStale")

    async def _end_for_append(self, inode: mpb.Inode, session_id: bytes) -> mpb.Inode:
        """``inode`` as an append opened by ``session_id`` must see it: its length grown to the end
        of what other open writers left on storage (see docs/decisions.md, "An append open
        publishes what open writers left on storage").

        A writer's bytes reach storage before its length reaches meta (at fsync, close, a hint),
        and a writer that dies leaves its session open until its client's lease lapses: an append
        at the published length would land on the dead writer's bytes, and the length meta probes
        when it closes that session would then cover both, interleaved. So when another handle
        may write the file, storage is probed (from the known size on, after any truncate job)
        and the end it finds is published before the append gets its answer. A file no other
        handle writes costs one range read of its sessions.
        """
        inode_id = inode.inode_id
        if not await self._another_writer(inode_id, session_id):
            return inode
        for _ in range(LENGTH_PROBE_ATTEMPTS):
            exact, probed_gen = await self._exact_length(inode_id, 0, wrote=True)
            if exact is None or probed_gen is None:
                return inode  # removed meanwhile: the handle's own calls say so

            async def publish(txn: Transaction, exact: int = exact, gen: int = probed_gen) -> mpb.Inode:
                ns = Namespace(txn, self._env(mpb.User()))
                ns.quota.refuse = False  # the bytes are on storage already: charged, not refused
                published = await ns.publish_storage_end(inode_id, exact, gen)
                await quota.settle(ns)
                return published

            try:
                return await run_transaction(self.engine, publish, retry_max=self.config.txn_retry_max)
            except LengthProbeStale:
                continue  # truncated under the probe (another meta server): probe again
        # Not an error: the open has committed its session, and a caller told it failed would leave
        # that open until the lease ends. Each truncate removed what lay past its size anyway.
        log.warning("inode %d kept being truncated under an append's open: its length as meta has it", inode_id)
        raw = await self.engine.begin().get(schema.inode_key(inode_id))
        return inode if raw is None else mpb.Inode.FromString(raw)

    async def _another_writer(self, inode_id: int, session_id: bytes) -> bool:
        """Whether a session other than ``session_id`` holds the inode open for writing (read a
        page of sessions at a time: a file many readers hold open is no one large read)."""
        prefix = schema.session_prefix(inode_id)
        own = schema.session_key(inode_id, session_id)
        start, end = prefix, prefix_end(prefix)
        while True:
            page = await self.engine.begin().scan(start, end, limit=PRUNE_PAGE)
            if any(key != own and schema.Session.decode(value).write for key, value in page):
                return True
            if len(page) < PRUNE_PAGE:
                return False
            start = page[-1][0] + b"\x00"

    async def _refuse_impossible_length(self, inode_id: int, hint: int) -> None:
        """A writer's length past the largest file its layout allows is ``EFBIG``, up front.

        Storage would be probed at that length, and chunk indexes are 32-bit: the probe cannot
        name such a chunk. Lengths every layout allows cost nothing here (no read).
        """
        if hint <= _LENGTH_EVERY_LAYOUT_ALLOWS:
            return
        raw = await self.engine.begin().get(schema.inode_key(inode_id))
        if raw is None:
            return  # the operation itself says the inode is missing
        limit = max_file_size(mpb.Inode.FromString(raw).layout)
        if hint > limit:
            raise FileTooLarge(f"length {hint} exceeds {limit}, the largest file of inode {inode_id}'s layout")

    async def _list_inode_chunks(self, chain_id: int, inode_id: int, index: int,
                                 head_first: bool) -> tuple[list[spb.ChunkMeta], bool]:
        """One page of the inode's chunks on a chain from chunk ``index`` on, and whether more follow.

        ``head_first``: ask the head (it also holds chunks whose first write is still in flight:
        what a removal must find); else the tail (every acknowledged write is committed there:
        what a length probe must find). Other serving members are asked when that one fails, and
        the listing is retried like a storage read until the storage client's budget is spent.
        """
        if index >= CHUNK_INDEX_END:
            return [], False
        prefix = schema.encode_u64(inode_id)
        start_after = chunk_id(inode_id, index - 1) if index > 0 else prefix
        end_before = prefix_end(prefix) or b""
        attempts = Attempts(_LIST_RETRY, self.storage.clock, budget_ms=self.storage.config.retry_total_ms)
        config = self.storage.config
        while True:
            _, members = await self.routing.chain(chain_id)
            serving = [m for m in members if m.state is PublicState.SERVING]
            error: FS3Error = Unavailable(f"chain {chain_id} has no serving target to list")
            for member in serving if head_first else reversed(serving):
                try:
                    return await list_chunk_range(self.storage.channels.get(member.address), chain_id,
                                                  member.target_id, start_after, end_before, self.config.chunk_page,
                                                  config.rpc_timeout_ms)
                except FS3Error as exc:
                    # One member's disk error is no verdict on the chain: the next member is asked.
                    if not exc.retryable and exc.code != StatusCode.IO_ERROR:
                        raise
                    error = exc
            if attempts.expired():
                raise Unavailable(f"listing inode {inode_id}'s chunks on chain {chain_id} gave up: {error}")
            with contextlib.suppress(FS3Error):
                await self.routing.refresh()
            await attempts.backoff()

    async def _storage_end(self, inode_id: int, layout: mpb.Layout, size: int) -> int:
        """The end of the file's last committed byte on storage past ``size`` (``size`` if none).

        Every chain of the layout is listed from the chunk holding ``size`` on, so a chunk past a
        gap counts as much as one next to the end.
        """
        chunk_size = layout.chunk_size
        limiter = asyncio.Semaphore(REMOVE_PARALLEL)

        async def chain_end(chain_id: int) -> int:
            end, index = size, size // chunk_size
            async with limiter:
                while True:
                    page, more = await self._list_inode_chunks(chain_id, inode_id, index, head_first=False)
                    for meta in page:
                        position = parse_chunk_id(meta.chunk_id)[1]
                        if meta.commit_version:
                            end = max(end, position * chunk_size + meta.length)
                        index = position + 1
                    if not more:
                        return end

        return max([size, *await all_of([chain_end(c) for c in sorted(set(layout.chains))])])

    async def _probe_length_locked(self, inode_id: int, hint: int,
                                   within_size_is_exact: bool = False) -> tuple[int | None, int | None]:
        """The file's end as storage sees it, and the size generation it was probed under (None,
        None when the inode is gone or holds no chunks). The caller holds the inode's lock.

        ``within_size_is_exact``: the hint is a writer's own (the end of everything it wrote, now
        on storage); when it is inside the known size the writer has nothing to add, and storage
        is not asked. Otherwise the hint plays no part: storage is listed from the known size on.
        """
        txn = self.engine.begin()
        raw = await txn.get(schema.inode_key(inode_id))
        if raw is None:
            return None, None
        inode = mpb.Inode.FromString(raw)
        if inode.type != mpb.FILE or not inode.layout.chains:
            return None, None
        size_gen = schema.decode_u64(await txn.get(schema.size_gen_key(inode_id)))
        if within_size_is_exact and hint <= inode.size:
            return inode.size, size_gen
        return await self._storage_end(inode_id, inode.layout, inode.size), size_gen

    async def _exact_length(self, inode_id: int, hint: int, wrote: bool,
                            within_size_is_exact: bool = False) -> tuple[int | None, int | None]:
        """:meth:`_probe_length_locked` after any unfinished truncate (nothing when not ``wrote``)."""
        if not wrote:
            return None, None
        async with self._inode_lock(inode_id):
            await self._run_truncate_locked(inode_id)
            return await self._probe_length_locked(inode_id, hint, within_size_is_exact)


def _applying(op: Callable[[Namespace, LengthReport], Awaitable[mpb.InodeRsp]],
              length: LengthReport) -> Callable[[Namespace], Awaitable[mpb.InodeRsp]]:
    """``op`` run with the length report it is to apply."""
    return lambda ns: op(ns, length)


async def all_of(calls: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run every call to its end, then raise the first error: a failed removal never leaves its
    siblings running on after the job that started them has given up."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]

"""The metadata service's background jobs: truncate jobs, GC, client expiry, fsck's chunk listing.

Every job is driven by durable records, so a crash or an error leaves it to be resumed:

* truncation (``O_TRUNC``, ``truncate``): the request's transaction records a truncate job;
  the service removes and trims chunks, then applies the new size, before answering — and the
  inode's next open, length or size change, or the maintenance loop, finishes a job an error or
  a crash interrupted (see :meth:`Namespace._truncate <fs3.meta.ops.Namespace._truncate>` for
  why the size waits for the removal);
* deletion: the last unlink (or the last close of an unlinked file) queues the inode's chunks
  for the GC loop, which removes them from storage in the background and survives restarts;
* the trash (:mod:`fs3.meta.trash`): entries past their expiry are purged a bounded batch per
  transaction, by one meta server at a time (it holds the trash's claim), and their chunks then
  go to GC as any removed file's;
* dead clients: a client that stops renewing its lease has its sessions closed by the pruner.
  Leases are timed on this server's monotonic clock from when it saw a lease's renewal count
  change, never by comparing stored wall times: a clock step expires nobody, and several servers
  sharing the leases each time them on their own clock.

Several meta servers share one store and so one set of queues. Each scans them all; before it
works on an inode (its truncate job, its GC) or an expired client it takes that thing's claim in
the store (:mod:`fs3.meta.claims`), skips it when another server holds it, and reads the job's
record again under the claim, so one job never runs on two servers at once nor again once
done. A server that dies stops renewing its claims, and another takes the job over a claim's
time to live later.

Chunk removal never enumerates chunk indexes: it lists the chunks of the file that exist, a
page at a time per chain, so memory and every transaction stay one page's worth whatever the
file's length. A removed chunk is no longer listed, so a job interrupted by an error or a crash
resumes where storage says it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TypeVar

from prometheus_client import Counter, Gauge

from fs3 import meta_pb2 as mpb
from fs3.common.errors import FS3Error, NotFound, Unavailable
from fs3.common.ids import parse_chunk_id
from fs3.common.layout import chunk_location
from fs3.common.tasks import finish_despite_cancel
from fs3.kv.api import Transaction, prefix_end
from fs3.kv.txn import run_transaction
from fs3.meta import quota, schema, trash
from fs3.meta.claims import client_claim
from fs3.meta.host import MetaHost
from fs3.meta.lengths import all_of
from fs3.meta.limits import (
    ANSWER_DELETE_PAGE,
    BACKLOG_COUNT_MAX,
    JOB_SCAN_PAGE,
    LENGTH_PROBE_ATTEMPTS,
    PRUNE_PAGE,
    REMOVE_PARALLEL,
    XATTR_DELETE_PAGE,
)
from fs3.meta.ops import LengthProbeStale, LengthReport, Namespace, OpEnv

# The claim under which one meta server at a time expires trash entries.
_TRASH_CLAIM = b"T"
# Batches (of trash.TRASH_PURGE_BATCH entries) one maintenance round purges: the rest wait a round.
TRASH_EXPIRY_BATCHES = 32

__all__ = ["MetaJobs"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class MetaJobs(MetaHost):
    _backlog: tuple[Gauge, Gauge, Counter] | None = None
    _trash_gauge: Gauge | None = None
    _removed_counted = 0
    """The service's background part (see the module's docstring)."""

    async def _clear_chunks(self, inode_id: int, layout: mpb.Layout, first: int) -> int:
        """Remove every chunk of the inode from index ``first`` on; returns how many there were.

        Each chain of the layout is listed from ``first`` a page at a time and the page removed
        before the next is asked for (chains in parallel, a bounded number at once), so memory is
        a few pages whatever the file's length. Nothing needs saving as it goes: a removed chunk
        is no longer listed, so a job run again after a crash or an error starts where storage
        says it stopped.
        """
        limiter = asyncio.Semaphore(REMOVE_PARALLEL)

        async def remove(chain_id: int, cid: bytes) -> None:
            async with limiter:
                await self.storage.remove(chain_id, cid, layout.chunk_size)

        async def clear(chain_id: int) -> int:
            removed, index = 0, first
            while True:
                self._check_inode_claim(inode_id)  # another server may have taken the inode over
                async with limiter:
                    page, more = await self._list_inode_chunks(chain_id, inode_id, index, head_first=True)
                await all_of([remove(chain_id, meta.chunk_id) for meta in page])
                removed += len(page)
                if not more:
                    return removed
                index = parse_chunk_id(page[-1].chunk_id)[1] + 1

        return sum(await all_of([clear(c) for c in sorted(set(layout.chains))]))

    async def _run_truncate_locked(self, inode_id: int) -> None:
        """Carry out the inode's truncate job, if it has one: trim the chunk holding the new end,
        remove every chunk past it, then apply the size and drop the job (one transaction).
        The caller holds the inode's lock.

        A storage error leaves the job in place (the next open, length or size change of the
        inode, or the maintenance loop, finishes it) and is answered as UNAVAILABLE, so that the
        client retries the request, and says that the truncate is still to complete.
        """
        raw = await self.engine.begin().get(schema.truncate_key(inode_id))
        if raw is None:
            return
        # Storage calls already sent cannot be taken back: a cancelled caller keeps the lock until
        # they have answered, or a removal landing late could remove what is written after the job.
        await finish_despite_cancel(self._run_truncate_job(inode_id, schema.TruncateJob.decode(raw)))

    async def _run_truncate_job(self, inode_id: int, job: schema.TruncateJob) -> None:
        """The storage side of :meth:`_run_truncate_locked`, then the size applied."""
        layout = job.layout
        try:
            if layout.chains:
                keep = job.clear_from % layout.chunk_size
                if keep:
                    chain_id, cid = chunk_location(layout, inode_id, job.clear_from // layout.chunk_size)
                    _, rsp = await self.storage.read(chain_id, cid, 0, 0)
                    if rsp.version > 0 and rsp.chunk_length > keep:
                        await self.storage.truncate(chain_id, cid, keep, layout.chunk_size)
                await self._clear_chunks(inode_id, layout, job.first_chunk)
        except FS3Error as exc:
            raise Unavailable(f"the truncate of inode {inode_id} is recorded and will complete once storage "
                              f"answers: {exc}") from exc

        async def complete(txn: Transaction) -> bool:
            ns = Namespace(txn, self._env(mpb.User()))
            ns.quota.refuse = False  # the growth was charged when the truncate was recorded
            done = await ns.complete_truncate(inode_id, job.size_gen)
            await quota.settle(ns)
            return done

        await run_transaction(self.engine, complete)

    async def _finish_truncate(self, inode_id: int) -> None:
        """Carry out the inode's recorded truncate job (if any)."""
        async with self._inode_lock(inode_id):
            await self._run_truncate_locked(inode_id)

    async def run_gc_once(self, limit: int = JOB_SCAN_PAGE) -> int:
        """Remove the chunks of every deleted file queued for GC, reading the queue ``limit`` jobs
        at a time; returns how many files were finished. A job storage cannot serve yet is
        passed over, so it never holds up the jobs queued after it."""
        prefix = schema.gc_prefix()
        finished = 0
        async for rows in self._pages(prefix, limit):
            for key, raw in rows:
                inode_id = schema.parse_inode_key(schema.inode_prefix() + key[len(prefix):])
                job = schema.GcJob.decode(raw)
                try:
                    # A truncate job of the inode may still be running (it read its job before the
                    # inode was deleted): its trim of a chunk already removed would create the chunk
                    # afresh, with nothing left to collect it. Under the inode's lock (and claim:
                    # another meta server may be collecting it, or running that truncate) GC
                    # removes what that job leaves.
                    async with self._try_inode_lock(inode_id) as mine:
                        if not mine:
                            continue  # another meta server holds the inode: its job, or its GC
                        if await self.engine.begin().get(key) is None:
                            continue  # collected meanwhile (by another meta server)
                        if job.layout.chains:
                            self.gc_removed_chunks += await self._clear_chunks(inode_id, job.layout,
                                                                               job.first_chunk)
                        await self._delete_xattrs(inode_id)

                        async def done(txn: Transaction, key: bytes = key) -> None:
                            txn.delete(key)

                        await run_transaction(self.engine, done)
                except FS3Error as exc:
                    log.warning("gc of inode %d postponed: %s", inode_id, exc)
                    continue
                finished += 1
        return finished

    async def _delete_xattrs(self, inode_id: int) -> None:
        """Delete the attributes a deleted inode's removal left (a page per transaction)."""
        prefix = schema.xattr_prefix(inode_id)
        await self._delete_range(prefix, prefix_end(prefix), XATTR_DELETE_PAGE)

    async def _delete_range(self, start: bytes, end: bytes | None, page: int) -> int:
        """Delete every key in ``[start, end)``, at most ``page`` keys per transaction; returns how
        many were deleted. Each transaction is complete in itself: a crash between two leaves the
        rest for the next call, which starts over from ``start`` and finds only what is left."""
        async def delete_page(txn: Transaction) -> int:
            rows = await txn.scan(start, end, limit=page)
            for key, _ in rows:
                txn.delete(key)
            return len(rows)

        deleted = 0
        while True:
            count = await run_transaction(self.engine, delete_page)
            deleted += count
            if count < page:
                return deleted

    async def _forget_answers(self, client_id: bytes, below: int | None = None) -> int:
        """Delete the client's saved answers (those of requests below ``below``; None: all), a
        bounded page per transaction (see :meth:`_delete_range`). Returns how many were deleted."""
        start = schema.idem_key(client_id, 0)
        end = prefix_end(start[:-8]) if below is None else schema.idem_key(client_id, below)
        return await self._delete_range(start, end, ANSWER_DELETE_PAGE)

    async def run_truncates_once(self) -> None:
        """Finish every recorded truncate job, reading the queue a page at a time; a job storage
        cannot serve yet is passed over, so it never holds up the jobs queued after it."""
        prefix = schema.truncate_prefix()
        async for rows in self._pages(prefix, JOB_SCAN_PAGE):
            for key, _ in rows:
                inode_id = schema.parse_inode_key(schema.inode_prefix() + key[len(prefix):])
                try:
                    async with self._try_inode_lock(inode_id) as mine:
                        if mine:  # else another meta server is running it
                            await self._run_truncate_locked(inode_id)
                except FS3Error as exc:
                    log.warning("truncate of inode %d postponed: %s", inode_id, exc)

    async def run_trash_expiry_once(self, batches_max: int = TRASH_EXPIRY_BATCHES) -> int:
        """Purge trash entries past their expiry, at most ``batches_max`` transactions of
        :data:`~fs3.meta.trash.TRASH_PURGE_BATCH` each; returns how many. Skipped while another
        meta server holds the trash's claim (it is doing the same)."""
        held = await self.claims.try_claim(_TRASH_CLAIM)
        if held is None:
            return 0
        purged = 0
        try:
            for _ in range(batches_max):
                env = self._env(mpb.User())  # as root: expiry purges everyone's entries

                async def step(txn: Transaction, env: OpEnv = env) -> int:
                    return await trash.expired_page(Namespace(txn, env))

                count = await run_transaction(self.engine, step, retry_max=self.config.txn_retry_max)
                purged += count
                if count < trash.TRASH_PURGE_BATCH:
                    break
        finally:
            await self.claims.release(held)
        if purged:
            self._gc_wakeup.set()
        return purged

    async def count_queue(self, prefix: bytes, limit: int = BACKLOG_COUNT_MAX) -> int:
        """Jobs under ``prefix``, counting no further than ``limit`` (a bounded scan, page by page)."""
        count = 0
        async for rows in self._pages(prefix, min(PRUNE_PAGE, limit)):
            count += len(rows)
            if count >= limit:
                return limit
        return count

    async def export_backlog(self) -> None:
        """Set the GC and truncate queue gauges (and the removed-chunks counter) from the store."""
        if self.metrics is None:
            return
        if self._backlog is None:
            self._backlog = (
                self.metrics.gauge("fs3_meta_gc_queue_files",
                                   "Removed files whose chunks wait for garbage collection (at most 10000 counted)"),
                self.metrics.gauge("fs3_meta_truncate_queue_files",
                                   "Files whose truncate has chunks left to trim (at most 10000 counted)"),
                self.metrics.counter("fs3_meta_gc_removed_chunks", "Chunks garbage collection removed"),
            )
        gc, truncate, removed = self._backlog
        if self._trash_gauge is None:
            self._trash_gauge = self.metrics.gauge(
                "fs3_meta_trash_files", "Removed files kept in the trash, chunks and all (at most 10000 counted)")
        self._trash_gauge.set(await self.count_queue(schema.trash_prefix()))
        gc.set(await self.count_queue(schema.gc_prefix()))
        truncate.set(await self.count_queue(schema.truncate_prefix()))
        removed.inc(self.gc_removed_chunks - self._removed_counted)
        self._removed_counted = self.gc_removed_chunks

    async def _pages(self, prefix: bytes, page: int = PRUNE_PAGE) -> AsyncIterator[list[tuple[bytes, bytes]]]:
        """Every key under ``prefix``, at most ``page`` per read (each page from a fresh snapshot,
        the next starting after the last key of the one before)."""
        start, end = prefix, prefix_end(prefix)
        while True:
            rows = await self.engine.begin().scan(start, end, limit=page)
            if rows:
                yield rows
            if len(rows) < page:
                return
            start = rows[-1][0] + b"\x00"

    async def prune_clients_once(self) -> int:
        """Expire the clients whose lease lapsed, then clean up after expired clients.

        A lease lapses once its renewal count has stayed the same for ``client_lease_ms`` of this
        server's monotonic clock, counted from when this server first saw that count (read after
        the scan that returned it, so never before the renewal it reflects). A restarted server
        sees every count anew, which gives every client a full lease to renew. Returns how many
        clients were expired in this round.
        """
        prefix = schema.client_prefix()
        expired = 0
        seen: set[bytes] = set()
        async for page in self._pages(prefix):
            now_ms = self.clock.now_ms()
            for key, raw in page:
                client_id = key[len(prefix):]
                seen.add(client_id)
                renewals = schema.ClientLease.decode(raw).renewals
                observed = self._leases_seen.get(client_id)
                if observed is None or observed[0] != renewals:
                    self._leases_seen[client_id] = (renewals, now_ms)
                    continue
                if now_ms - observed[1] <= self.config.client_lease_ms:
                    continue
                try:
                    if await self._expire_lease(client_id, renewals):
                        expired += 1
                except FS3Error as exc:
                    log.warning("expiring client %s postponed: %s", client_id.hex(), exc)
        for client_id in self._leases_seen.keys() - seen:
            del self._leases_seen[client_id]
        await self._clean_up_expired_clients()
        return expired

    async def _expire_lease(self, client_id: bytes, renewals: int) -> bool:
        """Mark the client expired if its lease still holds the count judged stale (one transaction:
        a renewal that slipped in since the scan keeps the lease). Returns whether it expired."""
        key = schema.client_key(client_id)

        async def expire(txn: Transaction) -> bool:
            raw = await txn.get(key)
            if raw is None or schema.ClientLease.decode(raw).renewals != renewals:
                return False
            txn.delete(key)
            txn.put(schema.expired_client_key(client_id), schema.ExpiredClient(self._now_ms()).encode())
            return True

        if not await run_transaction(self.engine, expire):
            return False
        self._leases_seen.pop(client_id, None)
        log.info("client %s stopped renewing its lease: expired", client_id.hex())
        return True

    async def _clean_up_expired_clients(self) -> None:
        """Close the sessions and drop the saved answers of expired clients; forget a cleaned-up
        client once its refusal outlived every retry it could send. One client's failure (a
        storage error while probing a length) leaves the others' clean-up going."""
        prefix = schema.expired_client_prefix()
        ttl_ms = self.config.expired_client_ttl_ms
        seen: set[bytes] = set()
        async for page in self._pages(prefix):
            now_ms = self.clock.now_ms()
            for key, raw in page:
                client_id = key[len(prefix):]
                seen.add(client_id)
                try:
                    if not schema.ExpiredClient.decode(raw).cleaned:
                        await self._expire_client_claimed(client_id, key)
                        continue
                    first_ms = self._expired_seen.setdefault(client_id, now_ms)
                    if now_ms - first_ms > ttl_ms:
                        await run_transaction(self.engine, functools.partial(_delete_if, key=key, value=raw))
                        del self._expired_seen[client_id]
                except Exception:  # not only FS3Error: nothing about one client may stop the others
                    log.exception("cleaning up after expired client %s postponed", client_id.hex())
        for client_id in self._expired_seen.keys() - seen:
            del self._expired_seen[client_id]

    async def _expire_client_claimed(self, client_id: bytes, expired_key: bytes) -> None:
        """:meth:`_expire_client` under the client's claim: one meta server cleans up after a
        client at a time (another one holding it is skipped: it is doing the work)."""
        held = await self.claims.try_claim(client_claim(client_id))
        if held is None:
            return
        async with self.claims.holding(held):
            raw = await self.engine.begin().get(expired_key)
            if raw is not None and not schema.ExpiredClient.decode(raw).cleaned:
                await self._expire_client(client_id, expired_key)

    async def _expire_client(self, client_id: bytes, expired_key: bytes) -> None:
        """Close an expired client's sessions (lengths made exact), drop its answers, mark it cleaned."""
        sessions_prefix = schema.client_sessions_prefix(client_id)
        async for page in self._pages(sessions_prefix):
            for key, _ in page:
                _, inode_id, session_id = schema.parse_client_session_key(key)
                await self._close_expired_session(client_id, key, inode_id, session_id)
        await self._forget_answers(client_id)

        async def cleaned(txn: Transaction) -> None:
            raw = await txn.get(expired_key)
            if raw is not None:
                txn.put(expired_key, replace(schema.ExpiredClient.decode(raw), cleaned=True).encode())

        await run_transaction(self.engine, cleaned)
        self._gc_wakeup.set()

    async def _close_expired_session(self, client_id: bytes, key: bytes, inode_id: int, session_id: bytes) -> None:
        """Close one session of an expired client, its length probed from storage.

        A size that changed under the probe (another writer's close, a truncate) is probed again;
        the last attempt keeps the size meta has rather than fail, so one busy file cannot hold
        up the clean-up (as for a live client's close).
        """
        raw = await self.engine.begin().get(schema.session_key(inode_id, session_id))
        wrote = raw is not None and schema.Session.decode(raw).write
        for attempt in range(LENGTH_PROBE_ATTEMPTS):
            last = attempt == LENGTH_PROBE_ATTEMPTS - 1
            exact, probed_gen = (None, None) if last else await self._exact_length(inode_id, 0, wrote)
            final = last or exact is None

            async def expire(txn: Transaction, exact: int | None = exact, probed_gen: int | None = probed_gen,
                             final: bool = final) -> None:
                if await txn.get(schema.session_key(inode_id, session_id)) is None:
                    txn.delete(key)
                    return
                ns = Namespace(txn, self._env(mpb.User()))
                await ns.close(inode_id, session_id, LengthReport(wrote=wrote).probed(exact, probed_gen, final))
                await quota.settle(ns)

            try:
                await run_transaction(self.engine, expire)
            except LengthProbeStale:
                if last:
                    raise  # not closed: the client stays not cleaned up, and the next round tries again
                continue
            log.info("closed session %s of inode %d: client %s stopped renewing", session_id.hex(), inode_id,
                     client_id.hex())
            return

    async def _chunk_exists(self, chain_id: int, cid: bytes) -> bool:
        _, rsp = await self.storage.read(chain_id, cid, 0, 0)
        return rsp.version > 0

    async def _list_chunks(self) -> list[tuple[int, bytes]]:
        """Every chunk stored on any chain, with its chain (for fsck's orphan check)."""
        from fs3.rpc.storage_calls import dump_chunk_meta

        if self.routing.routing is None:
            await self.routing.refresh()
        routing = self.routing.routing
        assert routing is not None
        found: set[tuple[int, bytes]] = set()
        for chain_id in sorted({c.chain_id for c in routing.chains}):
            _, members = await self.routing.chain(chain_id)
            serving = [m for m in members if m.state.name == "SERVING"]
            if not serving:
                raise NotFound(f"chain {chain_id} has no serving target to list")
            channel = self.storage.channels.get(serving[-1].address)
            chunks = await dump_chunk_meta(channel, chain_id, serving[-1].target_id, 1000,
                                           self.storage.config.rpc_timeout_ms)
            found.update((chain_id, bytes(cid)) for cid in chunks)
        return sorted(found)

    # -- background loops ------------------------------------------------------------------------

    async def _maintenance_loop(self) -> None:
        while True:
            try:
                with contextlib.suppress(FS3Error):
                    await self.routing.refresh()
                await self.run_truncates_once()
                await self.prune_clients_once()
                await self.run_trash_expiry_once()
                await self.export_backlog()
            except FS3Error as exc:
                log.warning("meta maintenance: %s", exc)
            except Exception:
                log.exception("meta maintenance failed")
            await asyncio.sleep(self.config.prune_interval_ms / 1000)

    async def _gc_loop(self) -> None:
        while True:
            try:
                while await self.run_gc_once() > 0:
                    pass
            except FS3Error as exc:
                log.warning("meta gc: %s", exc)
            except Exception:
                log.exception("meta gc failed")
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: 3.11's wait_for can swallow a cancel
                async with asyncio.timeout(self.config.gc_interval_ms / 1000):
                    await self._gc_wakeup.wait()
            self._gc_wakeup.clear()



async def _delete_if(txn: Transaction, key: bytes, value: bytes) -> None:
    if await txn.get(key) == value:
        txn.delete(key)

"""The scrubber of one storage target: the thin shell around :mod:`fs3.storage.scrub`.

Every tick it refills its rate budget, lists the next chunks after its position, reads each
committed copy back on the node's I/O pool and lets :func:`~fs3.storage.scrub.judge_local` say
whether the bytes still match their CRC. A corrupt copy is repaired in :meth:`TargetScrubber.check`:

1. every other member of the chain is asked (``DumpChunkMeta`` with data checksums, for this one
   chunk) what it holds and whether its bytes check out; :func:`~fs3.storage.scrub.plan_repair`
   picks the source (tail first) or concludes;
2. the source's bytes are read (``Read`` with ``verify_checksum``) and accepted only if they are
   the same version, length and CRC this target recorded;
3. under the chunk's lock (the one every write holds from staging to commit), if the chunk is
   still exactly the corrupt copy that was found (same committed version, nothing staged, no
   commit rewriting the file), the bytes are installed as that same version the way a resync's
   full-chunk replace is: a new blob written and synced, then one synced metadata batch that
   switches to it. A write that committed meanwhile has replaced the bad copy: nothing is installed,
   so a repair never puts an older version over a newer one.

Cancellation (node shutdown) waits for a blob write already on the I/O pool; a blob written but
not installed is deleted (and would be at the next open anyway). Progress is saved in the target's
KV store (``schema.SCRUB_PROGRESS``) every ``save_every_chunks`` chunks and at each pass end, so a
restarted node resumes the pass near where it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from prometheus_client import Counter, Gauge

from fs3 import storage_pb2 as spb
from fs3.common.checksum import crc32c
from fs3.common.clock import Clock
from fs3.common.errors import FS3Error, IoError
from fs3.common.metrics import ServiceMetrics
from fs3.common.target_state import PublicState
from fs3.kv.store import WriteBatch
from fs3.rpc.channel import ChannelFactory
from fs3.rpc.methods import service_spec
from fs3.rpc.storage_calls import dump_chunks
from fs3.storage import schema
from fs3.storage.scrub import (
    ChunkSnap,
    Finding,
    FindingKind,
    LocalRead,
    LocalVerdict,
    PeerAnswer,
    PeerCopy,
    Plan,
    RateBudget,
    ScrubConfig,
    ScrubProgress,
    judge_local,
    judge_peer,
    plan_repair,
)

if TYPE_CHECKING:
    from fs3.storage.chain_view import ChainMember, ChainView
    from fs3.storage.chunk_engine import ChunkEngine, ChunkState
    from fs3.storage.replica import TargetReplica

__all__ = ["ScrubHost", "ScrubMetrics", "TargetScrubber", "wall_ms"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_READ = service_spec("Storage").method("Read")


class ScrubHost(Protocol):
    """What a scrubber needs from its storage node."""

    channels: ChannelFactory
    clock: Clock
    replicas: dict[int, TargetReplica]  # looked up each time: a replaced disk gets a new replica

    def view(self, chain_id: int, target_id: int) -> ChainView | None: ...

    def chain_of(self, target_id: int) -> int: ...

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T: ...

    def fail_target(self, target_id: int, exc: FS3Error) -> None: ...


class ScrubMetrics:
    """The scrubber's Prometheus series, labelled by target."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        labels = ("target_id",)
        self.chunks: Counter = metrics.counter("fs3_storage_scrub_scanned_chunks", "Chunks the scrubber read back",
                                               labels)
        self.bytes: Counter = metrics.counter("fs3_storage_scrub_scanned_bytes", "Chunk bytes the scrubber read back",
                                              labels)
        self.corruptions: Counter = metrics.counter(
            "fs3_storage_scrub_corruptions", "Committed copies whose bytes did not match their recorded CRC", labels)
        self.repaired: Counter = metrics.counter("fs3_storage_scrub_repaired_chunks",
                                                 "Corrupt copies rewritten from a good replica", labels)
        self.unrecoverable: Counter = metrics.counter(
            "fs3_storage_scrub_unrecoverable_chunks", "Corrupt chunks with no good copy in their chain", labels)
        self.last_pass: Gauge = metrics.gauge(
            "fs3_storage_scrub_last_pass_end_seconds", "Wall-clock time the last full scrub pass ended", labels)
        self.pass_chunks: Gauge = metrics.gauge(
            "fs3_storage_scrub_pass_chunks", "Chunks scanned so far in the current pass", labels)


def wall_ms() -> int:
    """Milliseconds since the epoch: when passes end and findings happen, as an operator reads them."""
    return time.time_ns() // 1_000_000


def _snap(state: ChunkState | None) -> ChunkSnap | None:
    if state is None:
        return None
    return ChunkSnap(state.commit_version, state.length, state.checksum, state.pending_version)


def _read_crc(read: Callable[[bytes, int, int, int], bytes], chunk_id: bytes, version: int,
              length: int) -> tuple[int, int]:
    data = read(chunk_id, version, 0, length)
    return crc32c(data), len(data)


class TargetScrubber:
    """Scrubs one target: :meth:`run` is its background loop; :meth:`step` and :meth:`check` are what
    it does each tick and for each chunk (tests drive them directly)."""

    def __init__(self, host: ScrubHost, target_id: int, config: ScrubConfig,
                 wall_ms: Callable[[], int] = wall_ms, metrics: ScrubMetrics | None = None) -> None:
        config.validate()
        self.host = host
        self.target_id = target_id
        self.config = config
        self.wall_ms = wall_ms
        self.metrics = metrics
        self.budget = RateBudget(config.bytes_per_s, config.chunks_per_s, config.tick_ms)
        raw = self.engine.kv.get(schema.SCRUB_PROGRESS)
        self.progress = ScrubProgress.decode(raw, config.findings_max) if raw is not None \
            else ScrubProgress(findings_max=config.findings_max)
        self._unsaved = 0
        label = str(self.target_id)
        self._m = None if metrics is None else (
            metrics.chunks.labels(label), metrics.bytes.labels(label), metrics.corruptions.labels(label),
            metrics.repaired.labels(label), metrics.unrecoverable.labels(label), metrics.last_pass.labels(label),
            metrics.pass_chunks.labels(label))
        if self._m is not None and self.progress.last_pass_end_ms:
            self._m[5].set(self.progress.last_pass_end_ms / 1000)

    @property
    def replica(self) -> TargetReplica:
        return self.host.replicas[self.target_id]

    @property
    def engine(self) -> ChunkEngine:
        return self.replica.engine

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Scan at the configured rate until cancelled (a repair in progress finishes its install first)."""
        if not self.config.enabled:
            return
        last_ms = self.host.clock.now_ms()
        try:
            while True:
                await asyncio.sleep(self.config.tick_ms / 1000)
                now_ms = self.host.clock.now_ms()
                self.budget.refill(max(0, now_ms - last_ms))
                last_ms = now_ms
                try:
                    await self.step()
                except FS3Error as exc:
                    log.warning("target %d: scrub step failed: %s", self.target_id, exc)
                except Exception:  # a scrubber's bug must not end scrubbing for good, nor flood the log
                    log.exception("target %d: scrub step failed", self.target_id)
                    await asyncio.sleep(max(self.config.pass_pause_ms, 1_000) / 1000)
        finally:
            self.save()

    def _serving(self) -> bool:
        chain_id = self.host.chain_of(self.target_id)
        view = self.host.view(chain_id, self.target_id) if chain_id else None
        return view is not None and view.my_state is PublicState.SERVING

    async def step(self) -> int:
        """Scan what the budget allows now; the number of chunks scanned. A target that is not serving
        (syncing, offline) is not scrubbed: its resync replaces its copies anyway."""
        if not self.progress.due(self.wall_ms(), self.config.pass_pause_ms) or not self._serving():
            return 0
        done = 0
        while True:
            page = list(self.engine.iter_states(self.progress.position, self.config.page_chunks))
            if not page:
                self.progress.pass_done(self.wall_ms())
                log.info("target %d: scrub pass %d done (%d passes)", self.target_id, self.progress.pass_number - 1,
                         self.progress.passes_completed)
                if self._m is not None:
                    self._m[5].set(self.progress.last_pass_end_ms / 1000)
                    self._m[6].set(0)
                self.save()
                return done
            for chunk_id, state in page:
                if not self.budget.try_take(state.length):
                    return done
                await self.check(chunk_id)
                self.progress.scanned(chunk_id, state.length, self.wall_ms())
                done += 1
                if self._m is not None:
                    self._m[0].inc()
                    self._m[1].inc(state.length)
                    self._m[6].set(self.progress.pass_chunks)
                self._unsaved += 1
                if self._unsaved >= self.config.save_every_chunks:
                    self.save()

    def save(self) -> None:
        """Persist the progress (unsynced: a lost save only means rescanning a few chunks)."""
        batch = WriteBatch()
        batch.put(schema.SCRUB_PROGRESS, self.progress.encode())
        try:
            self.engine.kv.write(batch, sync=False)
        except Exception as exc:  # best effort (a store closed at shutdown, a full disk): rescanning is safe
            log.warning("target %d: scrub progress not saved: %s", self.target_id, exc)
        self._unsaved = 0

    # -- one chunk ---------------------------------------------------------------------------

    async def check(self, chunk_id: bytes) -> LocalVerdict:
        """Read one chunk's committed copy back; repair it if its bytes no longer match their CRC."""
        state = self.engine.get(chunk_id)
        before = _snap(state)
        busy = self.replica.locks.held(chunk_id) or self.replica.rewriting(chunk_id)
        read = LocalRead()
        if before is not None and before.commit_version and not before.pending_version and not busy:
            try:
                checksum, size = await self.host.run_blocking(_read_crc, self.engine.read, chunk_id,
                                                              before.commit_version, before.length)
                read = LocalRead(checksum, size)
            except IoError as exc:
                read = LocalRead(error=str(exc) or "unreadable")
        busy = busy or self.replica.rewriting(chunk_id) or self.engine.get(chunk_id) is not state
        verdict = judge_local(before, _snap(self.engine.get(chunk_id)), busy, read)
        if verdict is LocalVerdict.CORRUPT:
            assert before is not None
            self.progress.corruptions += 1
            if self._m is not None:
                self._m[2].inc()
            log.warning("target %d: chunk %s v%d does not match its recorded CRC%s; repairing", self.target_id,
                        chunk_id.hex(), before.commit_version, f" ({read.error})" if read.error else "")
            await self.repair(chunk_id, before)
        return verdict

    def _note(self, finding: Finding) -> None:
        if self.progress.record(finding) and self._m is not None:
            if finding.kind is FindingKind.REPAIRED:
                self._m[3].inc()
            elif finding.kind is FindingKind.UNRECOVERABLE:
                self._m[4].inc()

    async def repair(self, chunk_id: bytes, bad: ChunkSnap) -> FindingKind:
        """Repair the corrupt copy ``bad`` from a good peer (see the module docstring)."""
        chain_id = self.host.chain_of(self.target_id)
        view = self.host.view(chain_id, self.target_id) if chain_id else None
        if view is None:
            return self._finding(chunk_id, bad, FindingKind.PENDING, "target is in no chain")
        peers = [m for m in reversed(view.members) if m.target_id != self.target_id]  # tail first
        answers = [(m.target_id, await self._ask(m, chain_id, chunk_id, bad)) for m in peers]
        plan = plan_repair(answers, len(peers))
        if plan.plan is Plan.UNRECOVERABLE:
            log.error("target %d: chunk %s v%d is UNRECOVERABLE: %s; its bytes are left as they are",
                      self.target_id, chunk_id.hex(), bad.commit_version, plan.reason)
            return self._finding(chunk_id, bad, FindingKind.UNRECOVERABLE, plan.reason)
        if plan.plan is Plan.RETRY:
            return self._finding(chunk_id, bad, FindingKind.PENDING, plan.reason)
        source = next(m for m in peers if m.target_id == plan.source_target_id)
        data = await self.fetch(source, chain_id, chunk_id, bad)
        if data is None:
            return self._finding(chunk_id, bad, FindingKind.PENDING,
                                 f"target {source.target_id}'s copy changed or failed while it was read")
        self.budget.charge(len(data))
        return await self._install(chunk_id, bad, data, source.target_id)

    def _finding(self, chunk_id: bytes, bad: ChunkSnap, kind: FindingKind, detail: str,
                 source: int = 0) -> FindingKind:
        self._note(Finding(chunk_id, bad.commit_version, kind, detail, source, self.wall_ms()))
        return kind

    async def _ask(self, member: ChainMember, chain_id: int, chunk_id: bytes, bad: ChunkSnap) -> PeerAnswer:
        if member.state is not PublicState.SERVING or not member.address:
            return PeerAnswer.UNKNOWN
        try:
            dump = await dump_chunks(self.host.channels.get(member.address), chain_id, member.target_id,
                                     timeout_ms=self.config.rpc_timeout_ms, data_checksums=True,
                                     chunk_ids=[chunk_id])
        except FS3Error as exc:
            log.info("target %d: peer %d did not answer about chunk %s: %s", self.target_id, member.target_id,
                     chunk_id.hex(), exc)
            return PeerAnswer.UNKNOWN
        meta = dump.chunks.get(chunk_id)
        copy = None if meta is None else PeerCopy(meta.commit_version, meta.length, meta.checksum,
                                                  meta.pending_version, meta.data_checked, meta.data_checksum,
                                                  meta.data_error)
        return judge_peer(bad, copy)

    async def fetch(self, source: ChainMember, chain_id: int, chunk_id: bytes, bad: ChunkSnap) -> bytes | None:
        """The source's bytes of the corrupt version, or None unless they are exactly that version's
        (same version, length and recorded CRC as this target's metadata says)."""
        req = spb.ReadReq(chain_id=chain_id, chunk_id=chunk_id, offset=0, length=bad.length, verify_checksum=True,
                          dirty_policy=spb.DIRTY_READ_RETRY)
        try:
            rsp, data = await self.host.channels.get(source.address).call(_READ, req,
                                                                           timeout_ms=self.config.rpc_timeout_ms)
        except FS3Error as exc:
            log.info("target %d: repair read of chunk %s from %d failed: %s", self.target_id, chunk_id.hex(),
                     source.target_id, exc)
            return None
        assert isinstance(rsp, spb.ReadRsp)
        content = bytes(data)
        if rsp.version != bad.commit_version or len(content) != bad.length or crc32c(content) != bad.checksum:
            return None
        return content

    async def _install(self, chunk_id: bytes, bad: ChunkSnap, content: bytes, source_id: int) -> FindingKind:
        """Put ``content`` in place of the corrupt copy, under the chunk lock, only if the chunk is
        still that copy; written as a full-chunk replace is (new blob synced, then one batch)."""
        async with self.replica.hold_chunk(chunk_id):
            current = self.engine.get(chunk_id)
            if _snap(current) != bad or self.replica.rewriting(chunk_id) or current is None:
                return self._finding(chunk_id, bad, FindingKind.SUPERSEDED,
                                     "a write replaced the chunk before the repair; nothing installed")
            written = 0
            if not self.engine.stores_inline(len(content)):
                written = self.engine.new_blob()
                try:
                    await self.host.run_blocking(self.engine.write_blob, chunk_id, written, content)
                except BaseException as exc:
                    self._drop_blob(chunk_id, written)
                    if isinstance(exc, IoError):
                        self.host.fail_target(self.target_id, exc)
                    raise
                if self.engine.get(chunk_id) is not current:  # cannot happen under the lock; stay safe
                    self._drop_blob(chunk_id, written)
                    return self._finding(chunk_id, bad, FindingKind.SUPERSEDED, "changed during the repair")
            try:
                self.engine.install(chunk_id, bad.commit_version, current.chain_version, content, bad.checksum,
                                    written_blob=written)
            except IoError as exc:  # the disk failed a write: the target fails, as for any update
                if written:
                    self._drop_blob(chunk_id, written)
                self.host.fail_target(self.target_id, exc)
                raise
        log.warning("target %d: chunk %s v%d repaired from target %d", self.target_id, chunk_id.hex(),
                    bad.commit_version, source_id)
        return self._finding(chunk_id, bad, FindingKind.REPAIRED, f"copied from target {source_id}", source_id)

    def _drop_blob(self, chunk_id: bytes, blob: int) -> None:
        with contextlib.suppress(OSError, FS3Error):  # else the next open deletes blobs no metadata names
            self.engine.files.delete(chunk_id, blob)

    # -- status ------------------------------------------------------------------------------

    def status(self) -> spb.ScrubTargetStatus:
        p = self.progress
        out = spb.ScrubTargetStatus(
            target_id=self.target_id, chain_id=self.host.chain_of(self.target_id), enabled=self.config.enabled,
            pass_number=p.pass_number, pass_chunks=p.pass_chunks, pass_bytes=p.pass_bytes,
            chunk_count=self.engine.chunk_count, passes_completed=p.passes_completed,
            last_pass_end_ms=p.last_pass_end_ms, chunks_scanned=p.chunks_scanned, bytes_scanned=p.bytes_scanned,
            corruptions=p.corruptions, repaired=p.repaired, unrecoverable=p.unrecoverable)
        for f in p.findings:
            out.findings.add(chunk_id=f.chunk_id, version=f.version, kind=f.kind.value, detail=f.detail,
                             source_target_id=f.source_target_id, at_ms=f.at_ms)
        return out

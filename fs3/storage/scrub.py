"""Scrubbing: the decisions of a target's background re-read of its chunks. Pure: no I/O, clock or randomness.

A scrubber walks one target's chunks in id order, a pass after another, reads each committed
version back from disk and compares its CRC32C with the one recorded when it was committed. A
replica whose bytes no longer match is repaired from a peer of the same chain whose copy of the
*same committed version* checks out; never from a copy that fails its own CRC, and never while a
write of that chunk is in flight on this target. If no peer holds a good copy, the chunk is
reported unrecoverable and its bytes are left as they are.

This module decides; :mod:`fs3.storage.scrubber` (the shell in the storage node) reads, asks the
peers and writes. What is decided here:

* what to scan next and when a pass ends (:class:`ScrubProgress`, persisted so that a restart
  resumes the pass where it was);
* how much may be read now (:class:`RateBudget`, a token bucket counted in the shell's ticks: the
  scrubber never takes more than its configured bytes/s and chunks/s from foreground I/O);
* whether a local read shows corruption, or only a chunk that changed under the read
  (:func:`judge_local`);
* whether a peer's copy can serve as the repair source (:func:`judge_peer`) and, from every
  peer's answer, whether to repair, from whom, give up as unrecoverable or try again later
  (:func:`plan_repair`).
"""

from __future__ import annotations

import enum
import json
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from fs3.common.errors import InvalidArgument

__all__ = [
    "ChunkSnap",
    "Finding",
    "FindingKind",
    "LocalRead",
    "LocalVerdict",
    "PeerAnswer",
    "PeerCopy",
    "Plan",
    "RateBudget",
    "RepairPlan",
    "ScrubConfig",
    "ScrubProgress",
    "judge_local",
    "judge_peer",
    "plan_repair",
]

# Token units per whole unit: budgets are kept in unit-milliseconds, so refilling with a rate per
# second times elapsed milliseconds stays in integers.
_MS_PER_S = 1000
# Upper bounds that catch a misplaced unit (a rate in bits, a tick in microseconds).
_RATE_MAX = 1 << 40
_TICK_MS_MAX = 60_000


@dataclass(frozen=True)
class ScrubConfig:
    """Settings of every target's scrubber (the storage TOML's ``[scrub]`` table).

    Scrubbing is off while both rates are 0 (the default). With one of them 0, only the other
    bounds the scrubber.
    """

    bytes_per_s: int = 0  # chunk bytes read per second, per target (0: not limited by bytes)
    chunks_per_s: int = 0  # chunks read per second, per target (0: not limited by count)
    tick_ms: int = 100  # how often the budget is refilled and scanning resumes
    page_chunks: int = 64  # chunk ids listed at once from the target's metadata
    save_every_chunks: int = 256  # progress is persisted at least this often (and at each pass end)
    pass_pause_ms: int = 60_000  # wait after a pass ends before the next one starts
    findings_max: int = 32  # recent findings kept per target for ``fs3 admin scrub status``
    rpc_timeout_ms: int = 5_000  # calls to peers while repairing

    @property
    def enabled(self) -> bool:
        return self.bytes_per_s > 0 or self.chunks_per_s > 0

    def validate(self) -> None:
        """Refuse settings that would make the scrubber unbounded or stuck, naming the key."""
        for name in ("bytes_per_s", "chunks_per_s"):
            value = getattr(self, name)
            if not 0 <= value <= _RATE_MAX:
                raise InvalidArgument(f"scrub {name} must be within [0, {_RATE_MAX}] (0: no limit of this kind; "
                                      f"both 0: scrubbing off), got {value}")
        if not 1 <= self.tick_ms <= _TICK_MS_MAX:
            raise InvalidArgument(f"scrub tick_ms must be within [1, {_TICK_MS_MAX}], got {self.tick_ms}")
        for name in ("page_chunks", "save_every_chunks", "findings_max", "rpc_timeout_ms"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"scrub {name} must be positive, got {getattr(self, name)}")
        if self.pass_pause_ms < 0:
            raise InvalidArgument(f"scrub pass_pause_ms must not be negative, got {self.pass_pause_ms}")


class RateBudget:
    """A token bucket of chunks and bytes, refilled by the caller's ticks.

    Holds at most one tick's worth (``burst_ms`` of each rate), so the scrubber never catches up
    in a burst after a stall. A chunk larger than that burst is admitted once the bucket is full
    and leaves it in debt, which later refills repay: over any ``T`` ms the bytes taken are at most
    ``bytes_per_s * T / 1000`` plus one burst plus one chunk, and the chunks at most
    ``chunks_per_s * T / 1000`` plus one burst.
    """

    def __init__(self, bytes_per_s: int, chunks_per_s: int, burst_ms: int) -> None:
        if bytes_per_s < 0 or chunks_per_s < 0 or burst_ms < 1:
            raise InvalidArgument("rates must not be negative and the burst must be at least 1 ms")
        self.bytes_per_s = bytes_per_s
        self.chunks_per_s = chunks_per_s
        self._byte_cap = bytes_per_s * burst_ms
        self._chunk_cap = max(chunks_per_s * burst_ms, _MS_PER_S)  # at least one chunk fits
        self._bytes = 0  # byte-milliseconds; negative: debt
        self._chunks = 0  # chunk-milliseconds

    def refill(self, elapsed_ms: int) -> None:
        if elapsed_ms < 0:
            raise InvalidArgument("time does not run backwards for a budget")
        self._bytes = min(self._byte_cap, self._bytes + self.bytes_per_s * elapsed_ms)
        self._chunks = min(self._chunk_cap, self._chunks + self.chunks_per_s * elapsed_ms)

    def try_take(self, length: int) -> bool:
        """Take one chunk of ``length`` bytes if the budget allows it now."""
        cost = length * _MS_PER_S
        if self.chunks_per_s and self._chunks < _MS_PER_S:
            return False
        if self.bytes_per_s and self._bytes < min(cost, self._byte_cap):
            return False
        if self.chunks_per_s:
            self._chunks -= _MS_PER_S
        if self.bytes_per_s:
            self._bytes -= cost
        return True

    def charge(self, length: int) -> None:
        """Bytes read for another purpose (a repair's copy): paid from the budget, into debt if need be."""
        if self.bytes_per_s:
            self._bytes -= length * _MS_PER_S


@dataclass(frozen=True)
class ChunkSnap:
    """What identifies a chunk's committed copy on one target (and whether a write is staged)."""

    commit_version: int
    length: int
    checksum: int
    pending_version: int = 0


class LocalVerdict(enum.Enum):
    CLEAN = "clean"
    BUSY = "busy"  # a write in flight or a change under the read: look again in a later pass
    CORRUPT = "corrupt"


@dataclass(frozen=True)
class LocalRead:
    """The committed bytes as the disk returned them: their CRC and size, or why they could not be read."""

    data_checksum: int = 0
    data_length: int = 0
    error: str = ""


def judge_local(before: ChunkSnap | None, after: ChunkSnap | None, busy: bool, read: LocalRead) -> LocalVerdict:
    """Whether a read of a chunk's committed copy shows corruption.

    The read counts only if the chunk's metadata is the same after it as before, no write was
    staged and nothing (``busy``: a held chunk lock, a commit rewriting the file) touched the chunk
    meanwhile; a removed or changed chunk is not corrupt, only busy.
    """
    if before is None or after is None or before != after or busy or before.pending_version:
        return LocalVerdict.BUSY
    if before.commit_version == 0:
        return LocalVerdict.CLEAN
    if read.error or read.data_length != before.length or read.data_checksum != before.checksum:
        return LocalVerdict.CORRUPT
    return LocalVerdict.CLEAN


class PeerAnswer(enum.Enum):
    GOOD = "good"  # the same committed version, and its bytes match the recorded CRC
    BAD = "bad"  # the same committed version, and its bytes do not match (or could not be read)
    OTHER = "other"  # another version, or a write in flight there: not comparable now
    UNKNOWN = "unknown"  # not serving, unreachable, or its bytes changed under its read


@dataclass(frozen=True)
class PeerCopy:
    """A peer's answer about one chunk (its DumpChunkMeta entry with data checksums); None fields: absent."""

    commit_version: int
    length: int
    checksum: int
    pending_version: int
    data_checked: bool
    data_checksum: int
    data_error: str = ""


def judge_peer(local: ChunkSnap, peer: PeerCopy | None, reachable: bool = True) -> PeerAnswer:
    """Whether ``peer``'s copy can repair ``local``'s: only a copy of exactly the same committed
    version (same length and recorded CRC) whose bytes were read back and match that CRC."""
    if not reachable:
        return PeerAnswer.UNKNOWN
    if peer is None or peer.commit_version != local.commit_version or peer.length != local.length \
            or peer.checksum != local.checksum or peer.pending_version:
        return PeerAnswer.OTHER
    if not peer.data_checked and not peer.data_error:
        return PeerAnswer.UNKNOWN
    if peer.data_error or peer.data_checksum != local.checksum:
        return PeerAnswer.BAD
    return PeerAnswer.GOOD


class Plan(enum.Enum):
    REPAIR = "repair"
    UNRECOVERABLE = "unrecoverable"
    RETRY = "retry"  # nothing conclusive now: the next pass looks again


@dataclass(frozen=True)
class RepairPlan:
    plan: Plan
    source_target_id: int = 0
    reason: str = ""


def plan_repair(answers: Sequence[tuple[int, PeerAnswer]], peers_in_chain: int) -> RepairPlan:
    """From every peer's answer (in the order the shell prefers sources: tail first), what to do.

    Repair from the first good copy. Unrecoverable only when every other replica of the chain was
    asked and holds the same version with bad bytes (or there is no other replica): then no copy
    anywhere has the committed bytes. Anything else (a peer unreachable, syncing, or at another
    version) may still have or become a good copy: try again in a later pass.
    """
    for target_id, answer in answers:
        if answer is PeerAnswer.GOOD:
            return RepairPlan(Plan.REPAIR, target_id)
    if peers_in_chain == 0:
        return RepairPlan(Plan.UNRECOVERABLE, reason="no other replica in the chain")
    if len(answers) == peers_in_chain and all(answer is PeerAnswer.BAD for _, answer in answers):
        return RepairPlan(Plan.UNRECOVERABLE, reason="every replica's copy fails its checksum")
    seen = ", ".join(f"{tid}:{answer.value}" for tid, answer in answers) or "no peer answered"
    return RepairPlan(Plan.RETRY, reason=f"no good copy yet ({seen})")


class FindingKind(enum.Enum):
    REPAIRED = "repaired"
    UNRECOVERABLE = "unrecoverable"
    PENDING = "pending"  # corrupt, repair not possible yet (retried next pass)
    SUPERSEDED = "superseded"  # corrupt, but a write replaced the copy before the repair


@dataclass(frozen=True)
class Finding:
    chunk_id: bytes
    version: int
    kind: FindingKind
    detail: str = ""
    source_target_id: int = 0
    at_ms: int = 0


@dataclass
class ScrubProgress:
    """One target's scrub state: where the current pass is, what past passes did, recent findings.

    The shell persists :meth:`encode` now and then; a restart resumes the pass after the last
    saved position (chunks scanned since that save are scanned again).
    """

    pass_number: int = 1
    position: bytes = b""  # last chunk id scanned in the current pass (b"": the pass starts)
    pass_chunks: int = 0
    pass_bytes: int = 0
    pass_started_ms: int = 0
    passes_completed: int = 0
    last_pass_end_ms: int = 0  # wall clock of the last completed pass (0: none yet)
    chunks_scanned: int = 0
    bytes_scanned: int = 0
    corruptions: int = 0
    repaired: int = 0
    unrecoverable: int = 0
    findings_max: int = 32
    findings: deque[Finding] = field(default_factory=deque)
    # (chunk, version) already reported unrecoverable: counted once, not once a pass.
    known_unrecoverable: set[tuple[bytes, int]] = field(default_factory=set)

    def due(self, now_ms: int, pass_pause_ms: int) -> bool:
        """Whether scanning may go on: within a pass always, between passes after the pause."""
        return bool(self.position) or self.pass_chunks > 0 or self.last_pass_end_ms == 0 \
            or now_ms - self.last_pass_end_ms >= pass_pause_ms

    def scanned(self, chunk_id: bytes, length: int, now_ms: int) -> None:
        if chunk_id <= self.position:
            raise InvalidArgument("a pass scans chunks in increasing id order")
        if not self.position and not self.pass_chunks:
            self.pass_started_ms = now_ms
        self.position = chunk_id
        self.pass_chunks += 1
        self.pass_bytes += length
        self.chunks_scanned += 1
        self.bytes_scanned += length

    def pass_done(self, now_ms: int) -> None:
        self.passes_completed += 1
        self.last_pass_end_ms = now_ms
        self.pass_number += 1
        self.position, self.pass_chunks, self.pass_bytes = b"", 0, 0

    def record(self, finding: Finding) -> bool:
        """Note a finding; False when it only repeats an unrecoverable chunk already reported."""
        if finding.kind is FindingKind.UNRECOVERABLE:
            key = (finding.chunk_id, finding.version)
            if key in self.known_unrecoverable:
                return False
            if len(self.known_unrecoverable) >= 16 * self.findings_max:
                self.known_unrecoverable.clear()  # bounded: a rare re-report beats unbounded memory
            self.known_unrecoverable.add(key)
            self.unrecoverable += 1
        elif finding.kind is FindingKind.REPAIRED:
            self.repaired += 1
        self.findings.append(finding)
        while len(self.findings) > self.findings_max:
            self.findings.popleft()
        return True

    def encode(self) -> bytes:
        """The resumable part (position and counters; findings are reported, not persisted)."""
        raw = {key: value for key, value in asdict(self).items() if key not in ("findings", "known_unrecoverable")}
        raw["position"] = self.position.hex()
        return json.dumps(raw, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, findings_max: int) -> ScrubProgress:
        """A saved state; an unreadable one starts a new pass (scrubbing again is always safe)."""
        try:
            fields = json.loads(raw)
            fields["position"] = bytes.fromhex(fields["position"])
            fields["findings_max"] = findings_max
            # A counter of the wrong type would fail every step after the restart, not this one.
            if any(not isinstance(value, int) or isinstance(value, bool) or value < 0
                   for key, value in fields.items() if key != "position"):
                raise ValueError("a counter that is not a non-negative integer")
            return cls(**fields)
        except (ValueError, TypeError, KeyError, AttributeError):
            return cls(findings_max=findings_max)

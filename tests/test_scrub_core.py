"""The scrubber's pure decisions (fs3.storage.scrub): rate budget per simulated tick, judging a read
and a peer's copy, choosing the repair source, progress that survives a restart, refused settings,
and a seeded random exerciser that checks every decision against a simple model of a chain."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from fs3.common.errors import InvalidArgument
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

# -- configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "named"), [
    ({"bytes_per_s": -1}, "bytes_per_s"),
    ({"chunks_per_s": -5}, "chunks_per_s"),
    ({"chunks_per_s": 1, "tick_ms": 0}, "tick_ms"),
    ({"chunks_per_s": 1, "page_chunks": 0}, "page_chunks"),
    ({"chunks_per_s": 1, "pass_pause_ms": -1}, "pass_pause_ms"),
])
def test_bad_settings_are_refused_naming_the_key(settings: dict[str, int], named: str) -> None:
    with pytest.raises(InvalidArgument, match=named):
        ScrubConfig(**settings).validate()


def test_scrubbing_is_off_unless_a_rate_is_set() -> None:
    assert not ScrubConfig().enabled
    assert ScrubConfig(bytes_per_s=1).enabled and ScrubConfig(chunks_per_s=1).enabled
    with pytest.raises(InvalidArgument):
        RateBudget(-1, 0, 100)


# -- the rate budget, counted in simulated ticks ----------------------------------------------------


@pytest.mark.parametrize(("bytes_per_s", "chunks_per_s", "chunk_bytes", "tick_ms"), [
    (0, 50, 4096, 100), (1 << 20, 0, 64 << 10, 100), (1 << 20, 1000, 300 << 10, 50), (10_000, 0, 1 << 20, 100),
])
def test_chunks_scanned_per_tick_stay_within_the_rate(bytes_per_s: int, chunks_per_s: int, chunk_bytes: int,
                                                      tick_ms: int) -> None:
    budget = RateBudget(bytes_per_s, chunks_per_s, tick_ms)
    ticks = 200
    per_tick = []
    taken_bytes = 0
    for _ in range(ticks):
        budget.refill(tick_ms)
        count = 0
        while count < 10_000 and budget.try_take(chunk_bytes):
            count += 1
        per_tick.append(count)
        taken_bytes += count * chunk_bytes
    elapsed_s = ticks * tick_ms / 1000
    if chunks_per_s:
        assert max(per_tick) <= max(1, chunks_per_s * tick_ms // 1000)
        assert sum(per_tick) <= chunks_per_s * elapsed_s + 1
    if bytes_per_s:
        # at most the rate, plus one burst and one chunk of debt
        assert taken_bytes <= bytes_per_s * elapsed_s + bytes_per_s * tick_ms / 1000 + chunk_bytes
    assert sum(per_tick) > 0  # and it makes progress, even with chunks bigger than a tick's bytes
    if chunks_per_s and not bytes_per_s:
        assert sum(per_tick) >= chunks_per_s * elapsed_s - chunks_per_s  # it uses its rate, not less


def test_a_stall_does_not_let_the_scrubber_catch_up_in_a_burst() -> None:
    budget = RateBudget(0, 100, 100)
    budget.refill(60_000)  # a minute without ticks
    count = 0
    while budget.try_take(1):
        count += 1
    assert count == 10  # one tick's worth, not 6000


def test_repair_reads_are_paid_from_the_budget() -> None:
    budget = RateBudget(1000, 0, 1000)
    budget.refill(1000)
    budget.charge(3000)  # a repair copied 3 KB: 2 s of debt
    budget.refill(1000)
    assert not budget.try_take(10)
    budget.refill(2000)
    assert budget.try_take(10)


# -- judging reads and peers ------------------------------------------------------------------------

V5 = ChunkSnap(commit_version=5, length=100, checksum=0xABC)


@pytest.mark.parametrize(("before", "after", "busy", "read", "verdict"), [
    (V5, V5, False, LocalRead(0xABC, 100), LocalVerdict.CLEAN),
    (V5, V5, False, LocalRead(0xABD, 100), LocalVerdict.CORRUPT),
    (V5, V5, False, LocalRead(0xABC, 99), LocalVerdict.CORRUPT),
    (V5, V5, False, LocalRead(error="file missing"), LocalVerdict.CORRUPT),
    (V5, V5, True, LocalRead(0xABD, 100), LocalVerdict.BUSY),  # a write holds the lock
    (V5, ChunkSnap(6, 100, 1), False, LocalRead(0xABD, 100), LocalVerdict.BUSY),  # committed under the read
    (ChunkSnap(5, 100, 0xABC, 6), ChunkSnap(5, 100, 0xABC, 6), False, LocalRead(1, 100), LocalVerdict.BUSY),
    (V5, None, False, LocalRead(0xABD, 100), LocalVerdict.BUSY),  # removed under the read
    (None, None, False, LocalRead(), LocalVerdict.BUSY),
])
def test_judge_local(before: ChunkSnap | None, after: ChunkSnap | None, busy: bool, read: LocalRead,
                     verdict: LocalVerdict) -> None:
    assert judge_local(before, after, busy, read) is verdict


def _copy(version: int = 5, length: int = 100, checksum: int = 0xABC, pending: int = 0, checked: bool = True,
          data: int = 0xABC, error: str = "") -> PeerCopy:
    return PeerCopy(version, length, checksum, pending, checked, data, error)


@pytest.mark.parametrize(("copy", "reachable", "answer"), [
    (_copy(), True, PeerAnswer.GOOD),
    (_copy(data=0x1), True, PeerAnswer.BAD),
    (_copy(error="no file", checked=False), True, PeerAnswer.BAD),
    (_copy(version=6), True, PeerAnswer.OTHER),  # newer: never a source for v5
    (_copy(version=4), True, PeerAnswer.OTHER),  # older: never resurrected over v5
    (_copy(checksum=0x1, data=0x1), True, PeerAnswer.OTHER),  # same version, other recorded CRC
    (_copy(pending=6), True, PeerAnswer.OTHER),
    (_copy(checked=False), True, PeerAnswer.UNKNOWN),  # changed under its read
    (None, True, PeerAnswer.OTHER),
    (_copy(), False, PeerAnswer.UNKNOWN),
])
def test_judge_peer(copy: PeerCopy | None, reachable: bool, answer: PeerAnswer) -> None:
    assert judge_peer(V5, copy, reachable) is answer


def test_plan_repair_prefers_the_first_good_copy_and_never_a_bad_one() -> None:
    assert plan_repair([(3, PeerAnswer.BAD), (2, PeerAnswer.GOOD), (1, PeerAnswer.GOOD)], 3).source_target_id == 2
    assert plan_repair([(3, PeerAnswer.BAD), (2, PeerAnswer.BAD)], 2).plan is Plan.UNRECOVERABLE
    assert plan_repair([], 0).plan is Plan.UNRECOVERABLE  # a single-replica chain
    # one peer not asked, unreachable, or at another version: it may hold a good copy later
    assert plan_repair([(3, PeerAnswer.BAD)], 2).plan is Plan.RETRY
    assert plan_repair([(3, PeerAnswer.BAD), (2, PeerAnswer.UNKNOWN)], 2).plan is Plan.RETRY
    assert plan_repair([(3, PeerAnswer.BAD), (2, PeerAnswer.OTHER)], 2).plan is Plan.RETRY


# -- progress ---------------------------------------------------------------------------------------


def test_progress_resumes_from_its_saved_state_and_unreadable_state_restarts_the_pass() -> None:
    progress = ScrubProgress(findings_max=4)
    for i in range(1, 4):
        progress.scanned(bytes([i]), 10, now_ms=7)
    progress.record(Finding(b"\x02", 3, FindingKind.REPAIRED))
    restored = ScrubProgress.decode(progress.encode(), findings_max=4)
    assert (restored.position, restored.pass_chunks, restored.pass_bytes, restored.repaired) == (b"\x03", 3, 30, 1)
    with pytest.raises(InvalidArgument):
        restored.scanned(b"\x02", 1, 8)  # a pass only moves forward
    fresh = ScrubProgress.decode(b"{not json", findings_max=4)
    assert fresh.position == b"" and fresh.pass_number == 1
    for garbled in (b'{"position": "03", "pass_chunks": "3"}', b'{"position": 3}', b"[]",
                    b'{"position": "", "repaired": -1}'):
        fresh = ScrubProgress.decode(garbled, findings_max=4)
        assert fresh.position == b"" and fresh.pass_chunks == 0 and fresh.repaired == 0, garbled
        fresh.scanned(b"\x01", 1, 5)  # and it scans on
    progress.pass_done(now_ms=100)
    assert (progress.position, progress.passes_completed, progress.pass_number) == (b"", 1, 2)
    assert not progress.due(150, pass_pause_ms=100) and progress.due(200, pass_pause_ms=100)


def test_an_unrecoverable_chunk_is_counted_once_and_findings_are_bounded() -> None:
    progress = ScrubProgress(findings_max=3)
    assert progress.record(Finding(b"a", 1, FindingKind.UNRECOVERABLE))
    assert not progress.record(Finding(b"a", 1, FindingKind.UNRECOVERABLE))
    assert progress.unrecoverable == 1
    for i in range(10):
        progress.record(Finding(bytes([i]), 1, FindingKind.PENDING))
    assert len(progress.findings) == 3


# -- a seeded random exerciser against a model of one chain ------------------------------------------


@dataclass
class _Copy:
    version: int
    content: int  # stands for the bytes
    recorded: int  # the CRC recorded at commit (of the true content)


@dataclass
class _Model:
    """A chain of ``replicas`` targets holding ``chunks`` chunks; the truth is ``content[chunk]``."""

    rng: random.Random
    replicas: int
    chunks: int
    content: dict[int, int] = field(default_factory=dict)
    version: dict[int, int] = field(default_factory=dict)
    disks: list[dict[int, _Copy]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for c in range(self.chunks):
            self.version[c], self.content[c] = 1, self.rng.getrandbits(32)
        self.disks = [{c: _Copy(1, self.content[c], self.content[c]) for c in range(self.chunks)}
                      for _ in range(self.replicas)]

    def write(self, chunk: int) -> None:  # a committed CRAQ write reaches every replica
        self.version[chunk] += 1
        self.content[chunk] = self.rng.getrandbits(32)
        for disk in self.disks:
            disk[chunk] = _Copy(self.version[chunk], self.content[chunk], self.content[chunk])

    def snap(self, replica: int, chunk: int) -> ChunkSnap:
        copy = self.disks[replica][chunk]
        return ChunkSnap(copy.version, 8, copy.recorded)

    def peer(self, replica: int, chunk: int) -> PeerCopy:
        copy = self.disks[replica][chunk]
        return PeerCopy(copy.version, 8, copy.recorded, 0, True, copy.content)


def _scrub_one(model: _Model, replica: int, chunk: int, race: bool, seen_unrecoverable: set[tuple[int, int]]) -> None:
    """What the shell does for one chunk, against the model, with the core's decisions."""
    before = model.snap(replica, chunk)
    copy = model.disks[replica][chunk]
    verdict = judge_local(before, model.snap(replica, chunk), False, LocalRead(copy.content, 8))
    assert (verdict is LocalVerdict.CORRUPT) == (copy.content != copy.recorded)
    if verdict is not LocalVerdict.CORRUPT:
        return
    peers = [r for r in reversed(range(model.replicas)) if r != replica]
    answers = [(r, judge_peer(before, model.peer(r, chunk))) for r in peers]
    plan = plan_repair(answers, len(peers))
    good_exists = any(model.disks[r][chunk].content == model.content[chunk] for r in peers)
    if plan.plan is Plan.UNRECOVERABLE:
        assert not good_exists, "reported unrecoverable while a good copy exists"
        seen_unrecoverable.add((chunk, before.commit_version))
        return
    assert plan.plan is Plan.REPAIR and good_exists  # every peer answers in this model
    source = model.disks[plan.source_target_id][chunk]
    assert source.content == source.recorded == before.checksum, "repair from a bad copy"
    data = source.content
    if race:
        model.write(chunk)  # a write commits between the peer read and the install
    # the install, under the chunk lock: only over exactly the copy found corrupt
    if model.snap(replica, chunk) == before:
        model.disks[replica][chunk] = _Copy(before.commit_version, data, before.checksum)


@pytest.mark.parametrize("seed", range(40))
def test_random_corruptions_writes_and_scans_against_a_model(seed: int) -> None:
    rng = random.Random(seed)
    model = _Model(rng, replicas=rng.randint(1, 4), chunks=rng.randint(1, 12))
    chunks_per_s, tick_ms = rng.choice([(10, 100), (50, 20), (200, 50)])
    budgets = [RateBudget(0, chunks_per_s, tick_ms) for _ in range(model.replicas)]
    progress = [ScrubProgress() for _ in range(model.replicas)]
    ids = [bytes([c + 1]) for c in range(model.chunks)]  # chunk c's id, sorted as c
    unrecoverable: set[tuple[int, int]] = set()
    now_ms = 0
    try:
        for step in range(300):
            quiet = step >= 200  # the last ticks: no more faults, so every repairable copy gets repaired
            if not quiet and rng.random() < 0.3:
                disk = model.disks[rng.randrange(model.replicas)]
                disk[rng.randrange(model.chunks)].content ^= 1 << rng.randrange(32)  # a flipped bit
            if not quiet and rng.random() < 0.2:
                model.write(rng.randrange(model.chunks))
            now_ms += tick_ms
            for r in range(model.replicas):
                budgets[r].refill(tick_ms)
                scanned = 0
                while budgets[r].try_take(8):
                    nxt = [c for c in range(model.chunks) if ids[c] > progress[r].position]
                    if not nxt:
                        progress[r].pass_done(now_ms)
                        break
                    race = not quiet and rng.random() < 0.1
                    _scrub_one(model, r, nxt[0], race=race, seen_unrecoverable=unrecoverable)
                    progress[r].scanned(ids[nxt[0]], 8, now_ms)
                    scanned += 1
                assert scanned <= max(1, chunks_per_s * tick_ms // 1000)
            for c in range(model.chunks):  # no write is ever lost or rolled back
                assert all(disk[c].version == model.version[c] for disk in model.disks)
        for c in range(model.chunks):
            copies = [disk[c].content for disk in model.disks]
            if all(disk[c].content != disk[c].recorded for disk in model.disks):
                assert (c, model.version[c]) in unrecoverable
                continue
            assert copies == [model.content[c]] * model.replicas, f"chunk {c} not repaired everywhere"
    except AssertionError:
        print(f"replay: seed={seed}")
        raise


def test_the_exerciser_catches_a_repair_from_a_bad_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: a core that takes a bad copy as good must fail the exerciser."""
    import fs3.storage.scrub as core

    def lenient(local: ChunkSnap, peer: PeerCopy | None, reachable: bool = True) -> PeerAnswer:
        return PeerAnswer.GOOD if peer is not None and peer.commit_version == local.commit_version \
            else PeerAnswer.OTHER

    monkeypatch.setattr(core, "judge_peer", lenient)
    monkeypatch.setitem(globals(), "judge_peer", lenient)
    failures = 0
    for seed in range(40):
        try:
            test_random_corruptions_writes_and_scans_against_a_model(seed)
        except AssertionError:
            failures += 1
    assert failures > 0

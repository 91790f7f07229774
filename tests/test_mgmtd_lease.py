"""The mgmtd primary lease's pure core (fs3/mgmtd/lease.py) and a seeded random exerciser of it.

The exerciser runs several instances against one shared lease record on a global time line of its
own: each instance reads only its own clock (offset, rate within the drift the margin covers, and,
in some runs, steps forwards and backwards), every read and commit takes a random delay, and
processes pause for up to several lease periods at any step. It checks the rule the lease exists
for: at most one instance acts as primary per epoch, and epochs only grow — for the writes that
land (fencing: always) and for the moments instances believe they are primary (timing: whenever
clocks only drift within the margin). Known-bad setups (a standby configured with a shorter lease,
writes without the fence) must be caught by the same checks.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from fs3.common.errors import InvalidArgument, NotPrimary
from fs3.mgmtd.lease import (
    ROUTING_COUNTER_BITS,
    LeaseConfig,
    LeaseCore,
    LeaseRecord,
    check_fence,
    next_routing_version,
    primary_history_violations,
    routing_epoch,
)

CONFIG = LeaseConfig(lease_ms=1_000, renew_interval_ms=100, drift_margin_ms=100)


def _elect(core: LeaseCore, now_ms: int = 0) -> LeaseRecord:
    record = core.plan(None, now_ms, now_ms)
    assert record is not None
    core.committed(record, now_ms, now_ms)
    return record


# -- the core ------------------------------------------------------------------------------------


def test_the_first_instance_takes_a_lease_nobody_held_and_renews_it_within_its_epoch() -> None:
    core = LeaseCore("a", "h:1", CONFIG)
    record = _elect(core, 0)
    assert record == LeaseRecord(1, "a", "h:1", 0) and core.is_primary(0) and core.epoch == 1
    renewal = core.plan(record, 100, 101)
    assert renewal == LeaseRecord(1, "a", "h:1", 1)
    core.committed(renewal, 100, 103)
    # Valid for a lease less the drift margin, counted from when the renewal's transaction began.
    assert core.valid_until_ms == 100 + 1_000 - 100
    assert core.is_primary(999) and not core.is_primary(1_000)


def test_a_standby_takes_over_only_after_a_whole_period_of_an_unchanged_record() -> None:
    standby = LeaseCore("b", "h:2", CONFIG)
    held = LeaseRecord(4, "a", "h:1", 17)
    assert standby.plan(held, 0, 10) is None  # first seen when this read returned: t=10
    assert standby.plan(held, 500, 1_009) is None  # one millisecond short of a whole period
    assert standby.primary_address == "h:1"
    takeover = standby.plan(held, 1_000, 1_010)
    assert takeover == LeaseRecord(5, "b", "h:2", 0)  # every takeover increments the epoch
    standby.committed(takeover, 1_000, 1_012)
    assert standby.is_primary(1_012) and standby.epoch == 5


def test_a_renewal_seen_meanwhile_restarts_the_standbys_wait() -> None:
    standby = LeaseCore("b", "h:2", CONFIG)
    assert standby.plan(LeaseRecord(1, "a", "h:1", 0), 0, 0) is None
    assert standby.plan(LeaseRecord(1, "a", "h:1", 1), 900, 900) is None  # the holder renewed
    assert standby.plan(LeaseRecord(1, "a", "h:1", 1), 1_500, 1_500) is None  # only 600 ms unchanged
    assert standby.plan(LeaseRecord(1, "a", "h:1", 1), 1_900, 1_900) == LeaseRecord(2, "b", "h:2", 0)


def test_a_primary_that_cannot_renew_steps_down_at_its_own_deadline() -> None:
    core = LeaseCore("a", "h:1", CONFIG)
    record = _elect(core, 0)
    for started_ms in (100, 200, 300):  # every renewal fails (the database is unreachable)
        renewal = core.plan(record, started_ms, started_ms)
        assert renewal is not None
        core.failed(renewal, started_ms)
    assert core.is_primary(899)
    assert not core.is_primary(900) and core.epoch == 0
    # Its own old record, unchanged, is taken again only after a whole period, under a new epoch.
    assert core.plan(record, 950, 950) is None
    assert core.plan(record, 1_950, 1_950) == LeaseRecord(2, "a", "h:1", 0)


def test_a_holder_that_reads_someone_elses_record_has_lost_the_lease() -> None:
    core = LeaseCore("a", "h:1", CONFIG)
    _elect(core, 0)
    assert core.plan(LeaseRecord(2, "b", "h:2", 0), 100, 100) is None
    assert not core.is_primary(100) and core.primary_address == "h:2"


def test_a_renewal_reported_failed_that_did_land_is_adopted_from_its_start() -> None:
    core = LeaseCore("a", "h:1", CONFIG)
    record = _elect(core, 0)
    renewal = core.plan(record, 500, 500)
    assert renewal is not None
    core.failed(renewal, 500)  # the commit's outcome was unknown
    again = core.plan(renewal, 600, 600)  # it landed after all
    assert again == LeaseRecord(1, "a", "h:1", 2) and core.valid_until_ms == 500 + 900


def test_a_clock_that_goes_backwards_makes_the_holder_step_down_and_a_standby_wait_afresh() -> None:
    holder = LeaseCore("a", "h:1", CONFIG)
    _elect(holder, 5_000)
    assert not holder.is_primary(4_000)
    standby = LeaseCore("b", "h:2", CONFIG)
    held = LeaseRecord(1, "a", "h:1", 0)
    assert standby.plan(held, 5_000, 5_000) is None
    assert standby.plan(held, 4_000, 4_000) is None  # stepped back 1 s: the wait restarts here
    assert standby.plan(held, 4_900, 4_900) is None
    assert standby.plan(held, 5_000, 5_000) == LeaseRecord(2, "b", "h:2", 0)


def test_a_handed_back_lease_is_taken_at_once_and_fences_its_old_holder() -> None:
    holder = LeaseCore("a", "h:1", CONFIG)
    _elect(holder, 0)
    released = holder.release()
    assert released == LeaseRecord(1, "a", "h:1", 1, released=True) and not holder.is_primary(1)
    assert LeaseRecord.decode(released.encode()) == released
    with pytest.raises(NotPrimary):
        check_fence(released, "a", 1)
    standby = LeaseCore("b", "h:2", CONFIG)
    assert standby.plan(released, 10, 10) == LeaseRecord(2, "b", "h:2", 0)  # no wait
    assert LeaseCore("c", "h:3", CONFIG).release() is None  # nothing held, nothing to hand back


def test_the_fence_refuses_a_deposed_primarys_write() -> None:
    check_fence(LeaseRecord(3, "a", "h:1", 9), "a", 3)  # its own epoch: accepted
    for record in (LeaseRecord(4, "b", "h:2", 0), LeaseRecord(4, "a", "h:1", 0), LeaseRecord(2, "a", "h:1", 0), None):
        with pytest.raises(NotPrimary) as caught:
            check_fence(record, "a", 3)
        expected = "h:2" if record is not None and record.holder == "b" else ""
        assert caught.value.primary_address == expected and caught.value.retryable


def test_routing_versions_carry_the_epoch_and_sort_after_every_older_primarys() -> None:
    assert next_routing_version(0, 0) == 1 and next_routing_version(41, 0) == 42  # a single mgmtd: as before
    first = next_routing_version(41, 1)
    assert routing_epoch(first) == 1 and first > 41
    late_old = (1 << ROUTING_COUNTER_BITS) + 10_000  # epoch 1 published many changes
    second = next_routing_version(late_old, 2)
    assert routing_epoch(second) == 2 and second > late_old
    with pytest.raises(InvalidArgument):
        next_routing_version(second, 1)  # a version from a newer epoch than the publisher's


def test_bad_lease_settings_and_records_are_refused() -> None:
    for bad in (LeaseConfig(lease_ms=50), LeaseConfig(lease_ms=1_000, renew_interval_ms=400),
                LeaseConfig(lease_ms=1_000, drift_margin_ms=600), LeaseConfig(renew_interval_ms=5)):
        with pytest.raises(InvalidArgument):
            bad.validate()
    for raw in (b"", b"{", b'{"epoch": 0, "holder": "a", "address": "", "renewals": 0}', b'{"epoch": 1}'):
        with pytest.raises(InvalidArgument):
            LeaseRecord.decode(raw)
    record = LeaseRecord(7, "a", "h:1", 3)
    assert LeaseRecord.decode(record.encode()) == record


def test_the_history_check_rejects_two_primaries_in_an_epoch_and_an_epoch_going_back() -> None:
    good = [(1.0, "a", 1), (2.0, "a", 1), (3.0, "b", 2), (4.0, "c", 3)]
    assert primary_history_violations(good) == []
    assert primary_history_violations([(1.0, "a", 1), (2.0, "b", 1)])  # two instances, one epoch
    assert primary_history_violations([(1.0, "a", 1), (2.0, "b", 2), (3.0, "a", 1)])  # the old one acts late
    assert primary_history_violations([(1.0, "a", 0)])  # acting with no epoch at all


# -- the exerciser -------------------------------------------------------------------------------


@dataclass
class _Clock:
    """One host's monotonic clock: its own origin and rate, and (when allowed) steps."""

    offset_ms: float
    rate: float
    step_ms: float = 0.0

    def local(self, t: float) -> int:
        return int(self.offset_ms + self.rate * t + self.step_ms)


@dataclass
class _Run:
    rng: random.Random
    configs: list[LeaseConfig]
    fenced: bool = True
    clock_steps: bool = False
    duration_ms: float = 40_000.0
    record: LeaseRecord | None = None
    landed: list[tuple[float, str, int]] = field(default_factory=list)
    beliefs: list[tuple[float, str, int]] = field(default_factory=list)
    takeovers: int = 0
    _events: list[tuple[float, int, Callable[[float], None]]] = field(default_factory=list)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def delay(self) -> float:
        """How long one step (a read, a commit, its answer) takes: mostly milliseconds, sometimes a
        pause of the whole process for up to three lease periods."""
        if self.rng.random() < 0.01:
            return self.rng.uniform(0, 3 * self.configs[0].lease_ms)
        return self.rng.uniform(0, 8)

    def run(self) -> None:
        lease_ms = self.configs[0].lease_ms
        for i, config in enumerate(self.configs):
            clock = _Clock(self.rng.uniform(-1e6, 1e6), self.rng.uniform(0.99, 1.01))
            core = LeaseCore(f"m{i}", f"h:{i}", config)
            self.at(self.rng.uniform(0, 50), self._lease_try(core, clock))
            self.at(self.rng.uniform(0, 50), self._act(core, clock))
            if self.clock_steps:
                self.at(self.rng.uniform(0, self.duration_ms), self._step(clock, lease_ms))
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            if t > self.duration_ms:
                break
            fn(t)

    def _step(self, clock: _Clock, lease_ms: int) -> Callable[[float], None]:
        def step(t: float) -> None:
            clock.step_ms += self.rng.uniform(-lease_ms, lease_ms)
            self.at(t + self.rng.uniform(0, self.duration_ms / 4), step)
        return step

    def _lease_try(self, core: LeaseCore, clock: _Clock) -> Callable[[float], None]:
        interval_ms = core.config.renew_interval_ms

        def begin(t0: float) -> None:
            started_ms = clock.local(t0)

            def read(t1: float) -> None:
                seen = self.record

                def returned(t2: float) -> None:
                    write = core.plan(seen, started_ms, max(started_ms, clock.local(t2)))
                    if write is None:
                        self.at(t2 + interval_ms, begin)
                        return

                    def commit(t3: float) -> None:
                        landed = self.record == seen  # serializable: the record is as it was read
                        if landed:
                            assert self.record is None or write.epoch >= self.record.epoch, "epoch went back"
                            self.takeovers += write.renewals == 0
                            self.record = write

                        def answered(t4: float) -> None:
                            if landed and self.rng.random() > 0.05:
                                core.committed(write, started_ms, clock.local(t4))
                            else:  # refused, or landed but the answer was lost
                                core.failed(write, started_ms)
                            self.at(t4 + interval_ms, begin)
                        self.at(t3 + self.delay(), answered)
                    self.at(t2 + self.delay(), commit)
                self.at(t1 + self.delay(), returned)
            self.at(t0 + self.delay(), read)
        return begin

    def _act(self, core: LeaseCore, clock: _Clock) -> Callable[[float], None]:
        def act(t: float) -> None:
            if core.is_primary(clock.local(t)) and self.rng.random() < 0.005:
                released = core.release()  # a graceful stop: it stops acting, then hands the lease back
                assert released is not None

                def hand_back(tr: float) -> None:
                    record = self.record
                    if record is not None and not record.released and \
                            (record.epoch, record.holder) == (released.epoch, released.holder):
                        self.record = released
                self.at(t + self.delay(), hand_back)
            elif core.is_primary(clock.local(t)):
                epoch = core.epoch
                self.beliefs.append((t, core.name, epoch))

                def write(tw: float) -> None:
                    try:
                        if self.fenced:
                            check_fence(self.record, core.name, epoch)
                    except NotPrimary:
                        return
                    self.landed.append((tw, core.name, epoch))
                self.at(t + self.delay(), write)
            self.at(t + self.rng.uniform(20, 120), act)
        return act


@pytest.mark.parametrize("seed", range(12))
def test_random_lease_events_keep_one_primary_per_epoch_and_growing_epochs(seed: int) -> None:
    rng = random.Random(seed)
    clock_steps = seed % 3 == 2
    run = _Run(rng, [CONFIG] * rng.choice((2, 3)), clock_steps=clock_steps)
    run.run()
    # Fencing: whatever the clocks do, the writes that land obey the rule.
    assert primary_history_violations(run.landed) == []
    if not clock_steps:
        # Timing: with clocks that only drift within the margin, no two instances even believe
        # they are primary at the same time.
        assert primary_history_violations(run.beliefs) == []
    assert run.landed and run.takeovers >= 1  # a primary was elected and acted


def test_the_exerciser_catches_a_standby_with_a_shorter_lease_than_the_holder() -> None:
    """Known bad: one instance misconfigured to wait 300 ms where the holder relies on 1 s."""
    impatient = LeaseConfig(lease_ms=300, renew_interval_ms=50, drift_margin_ms=30)
    found = 0
    for seed in range(6):
        run = _Run(random.Random(seed), [CONFIG, impatient, CONFIG], duration_ms=20_000)
        run.run()
        found += bool(primary_history_violations(run.beliefs))
    assert found > 0


def test_the_exerciser_catches_writes_without_the_fence() -> None:
    """Known bad: a paused primary's late write lands when nothing checks the epoch."""
    found = 0
    for seed in range(6):
        run = _Run(random.Random(seed), [CONFIG, CONFIG, CONFIG], fenced=False, duration_ms=30_000)
        run.run()
        found += bool(primary_history_violations(run.landed))
    assert found > 0

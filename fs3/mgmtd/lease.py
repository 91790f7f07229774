"""The primary lease of several mgmtd instances on one shared database: a pure core.

Who may change the cluster state is decided by one record in the shared database (the lease):
``(epoch, holder, address, renewals)``. No clock is shared between hosts, so nothing in the record
is a time. Each instance reads the record in a transaction and decides with :class:`LeaseCore`,
fed only its own monotonic clock's readings:

* The **holder** renews by writing the record back with ``renewals + 1``. A renewal whose
  transaction began at ``started_ms`` keeps it primary until ``started_ms + lease_ms -
  drift_margin_ms`` by its own clock: the write landed after ``started_ms``, so every standby
  measures its wait from a later moment. When it cannot renew by then, it **steps down** (stops
  acting as primary) without being told.
* A **standby** takes over only after it has seen the very same record, renewal counter included,
  for a whole ``lease_ms`` by its own clock, counted from when the read that first showed it
  *returned* (after the holder's write). The takeover writes ``epoch + 1`` in a transaction that
  read the record, so it commits only if no renewal landed meanwhile. Clock *rates* may differ by
  the drift the margin covers; clock *readings* are never compared across hosts.
* A clock seen going backwards is distrusted: the holder steps down and a standby starts waiting
  afresh.

Timing keeps two primaries from *believing* they are primary at the same time (with drift within
the margin). What keeps the state safe even when timing fails (a paused process, a stepped clock)
is **fencing**: every write of the cluster state runs in a transaction that reads the lease and
checks its epoch and holder are still the writer's (:func:`check_fence`); a deposed primary's
write conflicts with the takeover or sees the new epoch, and never lands. Every routing version a
primary publishes carries its epoch in the high bits (:func:`next_routing_version`), so nodes that
keep the newest version never go back to an older primary's view.

:func:`primary_history_violations` is the rule the exerciser and the in-process tests check: at
most one instance acts per epoch, and epochs only grow.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace

from fs3.common.errors import InvalidArgument, NotPrimary

__all__ = [
    "ROUTING_COUNTER_BITS",
    "LeaseConfig",
    "LeaseCore",
    "LeaseRecord",
    "check_fence",
    "next_routing_version",
    "primary_history_violations",
    "routing_epoch",
]

# A routing version is ``epoch << ROUTING_COUNTER_BITS | counter``: 2**40 changes per epoch (35
# years at a thousand changes a second) and 2**24 takeovers fit in the uint64 of the wire.
ROUTING_COUNTER_BITS = 40
_COUNTER_MASK = (1 << ROUTING_COUNTER_BITS) - 1
_EPOCH_MAX = (1 << (64 - ROUTING_COUNTER_BITS)) - 1


def routing_epoch(version: int) -> int:
    """The lease epoch a routing version was published under (0: a single mgmtd)."""
    return version >> ROUTING_COUNTER_BITS


def next_routing_version(stored_version: int, epoch: int) -> int:
    """The first routing version a primary of ``epoch`` publishes after ``stored_version``.

    Larger than ``stored_version`` (and than any version an older epoch published), so every
    existing "newer than" comparison of versions orders the new primary's view after the old one's.
    With epoch 0 (a single mgmtd) this is ``stored_version + 1``, as a restart has always done.
    """
    if not 0 <= epoch <= _EPOCH_MAX:
        raise InvalidArgument(f"lease epoch {epoch} outside [0, {_EPOCH_MAX}]")
    if routing_epoch(stored_version) > epoch:
        raise InvalidArgument(f"routing version {stored_version:#x} is from epoch {routing_epoch(stored_version)}, "
                              f"newer than {epoch}")
    counter = (stored_version & _COUNTER_MASK) + 1
    if counter > _COUNTER_MASK:
        raise InvalidArgument("routing version counter exhausted for this epoch")
    return (epoch << ROUTING_COUNTER_BITS) | counter


@dataclass(frozen=True)
class LeaseRecord:
    """The lease as stored: who holds it, under which epoch, and a counter every renewal bumps."""

    epoch: int
    holder: str  # the instance's name, unique among the mgmtd instances of a cluster
    address: str  # where the holder serves: what standbys name in their redirects
    renewals: int = 0
    # The holder stopped acting and handed the lease back (a graceful stop): the next instance
    # that reads this takes over at once, with a new epoch, instead of waiting a whole period.
    released: bool = False

    def encode(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "holder": self.holder, "address": self.address,
                           "renewals": self.renewals, "released": self.released}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> LeaseRecord:
        try:
            fields = json.loads(raw)
            record = cls(int(fields["epoch"]), str(fields["holder"]), str(fields["address"]),
                         int(fields["renewals"]), bool(fields.get("released", False)))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"unreadable mgmtd lease record {raw[:80]!r}: {exc}") from None
        if record.epoch < 1 or record.renewals < 0 or not record.holder:
            raise InvalidArgument(f"invalid mgmtd lease record {record}")
        return record


@dataclass(frozen=True)
class LeaseConfig:
    """Timing of the lease (milliseconds of each host's own monotonic clock)."""

    lease_ms: int = 3_000
    renew_interval_ms: int = 500
    # How far two hosts' clocks may drift apart over one lease period (rates, never readings).
    drift_margin_ms: int = 300

    def validate(self) -> None:
        if self.lease_ms < 100:
            raise InvalidArgument("lease_ms must be at least 100")
        if not 0 <= self.drift_margin_ms <= self.lease_ms // 4:
            raise InvalidArgument("drift_margin_ms must be within [0, lease_ms / 4]")
        if not 10 <= self.renew_interval_ms <= (self.lease_ms - self.drift_margin_ms) // 3:
            raise InvalidArgument("renew_interval_ms must be within [10, (lease_ms - drift_margin_ms) / 3]: "
                                  "the holder gets at least three tries to renew before it must step down")


class LeaseCore:
    """One instance's view of the lease: reads and commits in, decisions out; no clock, no I/O.

    The caller runs, in one transaction: read the record, :meth:`plan`, write what it returns,
    commit; then tells :meth:`committed` or :meth:`failed`. :meth:`is_primary` answers whether the
    instance may act as primary at a given reading of its clock.
    """

    def __init__(self, name: str, address: str, config: LeaseConfig) -> None:
        if not name:
            raise InvalidArgument("a lease holder needs a name")
        config.validate()
        self.name = name
        self.address = address
        self.config = config
        self._seen: LeaseRecord | None = None  # the record as last read or written
        self._seen_since_ms = 0  # when that record was first seen (the read returned)
        self._held: LeaseRecord | None = None  # what this instance last wrote as holder
        self._valid_until_ms = 0
        self._attempt: tuple[LeaseRecord, int] | None = None  # a write whose outcome is unknown
        # The write plan() last asked for; release() and step_down() forget it, so that a write
        # planned before them and answered after them does not make the instance primary again.
        self._planned: LeaseRecord | None = None
        self._last_now_ms: int | None = None

    # -- queries -----------------------------------------------------------------------------

    def is_primary(self, now_ms: int) -> bool:
        """Whether this instance may act as primary now; steps down once its deadline passed."""
        self._tick(now_ms)
        if self._held is not None and now_ms >= self._valid_until_ms:
            self._held = None
        return self._held is not None

    @property
    def epoch(self) -> int:
        """The epoch this instance holds (0: none)."""
        return self._held.epoch if self._held is not None else 0

    @property
    def valid_until_ms(self) -> int:
        return self._valid_until_ms if self._held is not None else 0

    @property
    def primary_address(self) -> str:
        """Where the primary is, as far as this instance knows ('' when no lease was seen)."""
        if self._held is not None:
            return self.address
        return self._seen.address if self._seen is not None else ""

    @property
    def seen(self) -> LeaseRecord | None:
        return self._seen

    def seen_unchanged_ms(self, now_ms: int) -> int:
        """How long, on this instance's clock, the lease has read as :attr:`seen`: a holder that
        renews changes it every renewal interval, a dead one leaves it standing."""
        return max(0, now_ms - self._seen_since_ms)

    # -- decisions ---------------------------------------------------------------------------

    def plan(self, record: LeaseRecord | None, started_ms: int, now_ms: int) -> LeaseRecord | None:
        """What to write after reading ``record`` (None: never written) in a transaction begun at
        ``started_ms`` whose read returned at ``now_ms``; None: write nothing."""
        if now_ms < started_ms:
            raise InvalidArgument("a read cannot return before its transaction began")
        self._tick(now_ms)
        if self._attempt is not None:
            attempted, attempt_started_ms = self._attempt
            self._attempt = None
            if record == attempted:  # a commit reported as failed did land: it counts from its start
                self._hold(attempted, attempt_started_ms, now_ms)
        self._observe(record, now_ms)
        self._planned = self._decide(record, now_ms)
        return self._planned

    def _decide(self, record: LeaseRecord | None, now_ms: int) -> LeaseRecord | None:
        if record is None:
            return LeaseRecord(1, self.name, self.address, 0)  # never held by anyone: nothing to wait for
        if record.epoch >= _EPOCH_MAX:
            raise InvalidArgument("mgmtd lease epochs exhausted")
        if record.released:  # handed back: its holder stopped acting before it wrote this
            self._held = None
            return LeaseRecord(record.epoch + 1, self.name, self.address, 0)
        if self._held is not None and record != self._held:
            self._held = None  # someone else wrote the lease: this instance lost it
        if self.is_primary(now_ms):
            return replace(record, renewals=record.renewals + 1)
        if now_ms - self._seen_since_ms >= self.config.lease_ms:
            return LeaseRecord(record.epoch + 1, self.name, self.address, 0)
        return None

    def committed(self, written: LeaseRecord, started_ms: int, now_ms: int) -> None:
        """The write :meth:`plan` asked for committed (the transaction began at ``started_ms``)."""
        self._tick(now_ms)
        self._attempt = None
        if written != self._planned:  # planned before a release or a step-down: stay a standby
            self._observe(written, now_ms)
            return
        self._planned = None
        self._hold(written, started_ms, now_ms)

    def failed(self, written: LeaseRecord, started_ms: int) -> None:
        """The write's commit failed or its outcome is unknown: the next read tells whether it landed."""
        if written == self._planned:
            self._attempt = (written, started_ms)
        self._planned = None

    def release(self) -> LeaseRecord | None:
        """Step down, and return the record that hands the lease back (None: none held).

        The caller writes it only if the lease still reads as this instance's (the same
        transaction), after it stopped acting: a standby that reads it takes over at once.
        """
        held, self._held = self._held, None
        self._attempt = self._planned = None  # a renewal still in flight must not make it primary again
        return replace(held, renewals=held.renewals + 1, released=True) if held is not None else None

    def step_down(self) -> None:
        """Stop acting as primary at once (a fenced write failed, the state could not be loaded).

        The lease record still names this instance; it is taken again (with a new epoch) only
        after a full unchanged period, like by any standby.
        """
        self._held = None
        self._attempt = self._planned = None  # a renewal still in flight must not make it primary again

    # -- internals ---------------------------------------------------------------------------

    def _hold(self, written: LeaseRecord, started_ms: int, now_ms: int) -> None:
        if written.holder != self.name:
            raise InvalidArgument(f"{self.name} cannot hold a lease written for {written.holder}")
        self._seen, self._seen_since_ms = written, now_ms
        self._held = written
        self._valid_until_ms = started_ms + self.config.lease_ms - self.config.drift_margin_ms
        self.is_primary(now_ms)  # a commit that took the whole lease leaves nothing to act in

    def _observe(self, record: LeaseRecord | None, now_ms: int) -> None:
        if record != self._seen:
            self._seen, self._seen_since_ms = record, now_ms

    def _tick(self, now_ms: int) -> None:
        """Distrust a clock that went backwards: the holder's deadline and a standby's wait were
        measured on it, so the holder steps down and the standby starts waiting afresh."""
        if self._last_now_ms is not None and now_ms < self._last_now_ms:
            self._held = None
            self._seen_since_ms = now_ms
        self._last_now_ms = now_ms


def check_fence(record: LeaseRecord | None, holder: str, epoch: int) -> None:
    """Refuse a state write unless the lease (read in the same transaction) is still ``holder``'s
    at ``epoch``: a deposed primary's write fails and never lands."""
    if record is None or record.epoch != epoch or record.holder != holder or record.released:
        where = record.address if record is not None and record.holder != holder else ""
        now = f"epoch {record.epoch} held by {record.holder}" if record is not None else "no lease"
        raise NotPrimary.naming(where, f"write fenced: {holder} acted under epoch {epoch}, the lease is at {now}")


def primary_history_violations(acts: Iterable[tuple[float, str, int]]) -> list[str]:
    """Break-downs of "at most one primary acts per epoch, epochs only grow" in ``acts``.

    ``acts`` are ``(time, instance, epoch)``: an instance acted as primary of ``epoch`` at
    ``time`` on one global time line (a write that landed, or a moment it believed itself primary).
    In time order, the epochs must never decrease and each epoch belongs to one instance.
    """
    problems: list[str] = []
    owner: dict[int, str] = {}
    latest: tuple[float, str, int] | None = None
    for time, instance, epoch in sorted(acts, key=lambda a: a[0]):
        if epoch < 1:
            problems.append(f"t={time}: {instance} acted without an epoch")
            continue
        first = owner.setdefault(epoch, instance)
        if first != instance:
            problems.append(f"t={time}: epoch {epoch} acted by {instance} and {first}")
        if latest is not None and epoch < latest[2]:
            problems.append(f"t={time}: {instance} acted in epoch {epoch} after {latest[1]} acted in "
                            f"epoch {latest[2]} at t={latest[0]}")
        if latest is None or epoch >= latest[2]:
            latest = (time, instance, epoch)
    return problems

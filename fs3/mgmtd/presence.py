"""Which mgmtd instances of a shared database are up, and in which role: a pure core.

Each instance on a shared engine keeps a record of itself in the database (:class:`InstanceRecord`:
its name, the address it serves, and a ``presence`` counter it bumps every renewal interval). As
with the lease (:mod:`fs3.mgmtd.lease`), nothing in the record is a time: hosts' clocks are not
synchronized, so a reader judges liveness only by watching the counter advance on its *own*
monotonic clock (:class:`PresenceWatch`). An instance whose counter it has seen unchanged for a
whole lease period is *stale* (dead, paused or cut off from the database); one it has only just
started watching is presumed up until a lease period has passed.

The role of each instance, as one instance judges it (:meth:`PresenceWatch.roles`):

* **primary**: the lease names it, it was not handed back, and the lease record changed (was
  renewed) within a lease period of the reader's clock. The reader itself is primary exactly when
  it may act as one (:meth:`fs3.mgmtd.service.MgmtdServicer.is_primary`).
* **standby**: its counter advances (or the reader is that instance, and is not primary).
* **stale**: neither: its counter stood still for a lease period. A primary that died is shown
  stale once its lease and its counter stood still that long, before or after a standby took over.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from fs3.common.errors import InvalidArgument
from fs3.mgmtd.lease import LeaseRecord

__all__ = ["PRIMARY", "STALE", "STANDBY", "InstanceRecord", "PresenceWatch"]

PRIMARY = "primary"
STANDBY = "standby"
STALE = "stale"


@dataclass(frozen=True)
class InstanceRecord:
    """One mgmtd instance as it records itself in the shared database."""

    name: str
    address: str
    presence: int  # bumped by the instance every renewal interval; compared only with itself

    def encode(self) -> bytes:
        return json.dumps({"name": self.name, "address": self.address, "presence": self.presence},
                          sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> InstanceRecord:
        try:
            fields = json.loads(raw)
            record = cls(str(fields["name"]), str(fields["address"]), int(fields["presence"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"unreadable mgmtd instance record {raw[:80]!r}: {exc}") from None
        if not record.name or record.presence < 0:
            raise InvalidArgument(f"invalid mgmtd instance record {record}")
        return record


class PresenceWatch:
    """One instance's view of every instance's record: reads in, roles out; no clock, no I/O.

    ``stale_after_ms`` is the lease period: the writers bump their counters every renewal
    interval, at most a third of it, so a live instance misses at least two bumps before it
    looks stale.
    """

    def __init__(self, name: str, stale_after_ms: int) -> None:
        if not name:
            raise InvalidArgument("a mgmtd instance needs a name")
        if stale_after_ms <= 0:
            raise InvalidArgument("stale_after_ms must be positive")
        self.name = name
        self.stale_after_ms = stale_after_ms
        # name -> (the record as last read, when this reader first saw its counter at that value)
        self._seen: dict[str, tuple[InstanceRecord, int]] = {}
        self._presence = 0  # this instance's own counter, as last written or read
        self._last_now_ms: int | None = None

    def observe(self, records: Iterable[InstanceRecord], now_ms: int) -> None:
        """The records one read of the database returned at ``now_ms`` (every instance's; a name
        missing from them was deleted, and is forgotten)."""
        self._tick(now_ms)
        seen: dict[str, tuple[InstanceRecord, int]] = {}
        for record in records:
            before = self._seen.get(record.name)
            unchanged = before is not None and before[0] == record
            seen[record.name] = (record, before[1] if unchanged and before is not None else now_ms)
            if record.name == self.name:
                self._presence = max(self._presence, record.presence)
        self._seen = seen

    def next_record(self, address: str) -> InstanceRecord:
        """This instance's record with its counter bumped, to write now."""
        self._presence += 1
        return InstanceRecord(self.name, address, self._presence)

    def fresh(self, name: str, now_ms: int) -> bool:
        """Whether ``name``'s counter changed within the last lease period of this reader's clock."""
        seen = self._seen.get(name)
        return seen is not None and now_ms - seen[1] < self.stale_after_ms

    def forgettable(self, now_ms: int, forget_after_ms: int) -> list[InstanceRecord]:
        """Records unchanged for ``forget_after_ms``: instances gone for good (renamed, removed)."""
        return [record for record, since_ms in self._seen.values()
                if record.name != self.name and now_ms - since_ms >= forget_after_ms]

    def roles(self, lease: LeaseRecord | None, lease_unchanged_ms: int, self_primary: bool, self_address: str,
              now_ms: int) -> list[tuple[InstanceRecord, str]]:
        """Every known instance (this one included, even before its first record was read) and its
        role, sorted by name. ``lease`` is the lease record as this instance last read it, unchanged
        for ``lease_unchanged_ms`` of its clock; ``self_primary``: this instance may act as primary."""
        self._tick(now_ms)
        records = {name: record for name, (record, _) in self._seen.items()}
        records.setdefault(self.name, InstanceRecord(self.name, self_address, self._presence))
        renewing = (lease is not None and not lease.released and lease_unchanged_ms < self.stale_after_ms)
        out: list[tuple[InstanceRecord, str]] = []
        for name in sorted(records):
            if name == self.name:
                role = PRIMARY if self_primary else STANDBY
            elif renewing and lease is not None and lease.holder == name:
                role = PRIMARY
            elif self.fresh(name, now_ms):
                role = STANDBY
            else:
                role = STALE
            out.append((records[name], role))
        return out

    def _tick(self, now_ms: int) -> None:
        """A clock seen going backwards measured every wait so far: start them afresh."""
        if self._last_now_ms is not None and now_ms < self._last_now_ms:
            self._seen = {name: (record, now_ms) for name, (record, _) in self._seen.items()}
        self._last_now_ms = now_ms

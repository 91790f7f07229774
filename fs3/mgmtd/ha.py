"""Several mgmtd instances on one shared transactional engine: the I/O around :mod:`fs3.mgmtd.lease`.

Everything here speaks only :class:`~fs3.kv.api.TxnEngine`, so the same code runs on PostgreSQL
(the networked engine) and, in tests, on one :class:`~fs3.kv.txn.OptimisticTxnEngine` shared by
every instance of a process: a faithful stand-in for a shared serializable database.

Keys on the shared engine (every key under ``mgmtd/``, so that the database can be shared with the
metadata service's own keys):

==========================================  ===============================================
key                                         value
==========================================  ===============================================
``mgmtd/ha/lease``                          :class:`~fs3.mgmtd.lease.LeaseRecord` (JSON)
``mgmtd/ha/routing``                        the primary's last published ``RoutingInfo``
``mgmtd/ha/instance/`` + name               :class:`~fs3.mgmtd.presence.InstanceRecord` (JSON), one per instance
``mgmtd/`` + every key of :mod:`~fs3.mgmtd.schema`  the same records a single mgmtd keeps locally
==========================================  ===============================================

The published routing information lets standbys answer routing reads without being primary: it
is written in the same fenced transaction as the records it was built from. The instance records
let every instance list the others with their roles (``fs3 admin nodes``): each writes its own, with
a counter it bumps every renewal interval, and reads everyone's (:mod:`fs3.mgmtd.presence`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fs3 import common_pb2 as cpb
from fs3.common.clock import Clock
from fs3.common.errors import FS3Error
from fs3.kv.api import Transaction, TxnEngine, prefix_end
from fs3.kv.txn import run_transaction
from fs3.mgmtd import schema
from fs3.mgmtd.lease import LeaseConfig, LeaseCore, LeaseRecord, check_fence
from fs3.mgmtd.presence import InstanceRecord, PresenceWatch

__all__ = ["INSTANCE_PREFIX", "LEASE_KEY", "MAX_INSTANCES", "PREFIX", "ROUTING_KEY", "LeaseLoop", "SharedEngine",
           "forget_instances", "instance_key", "read_instances", "read_lease", "read_published_routing",
           "read_state_records", "release_lease", "write_fenced", "write_instance"]

log = logging.getLogger(__name__)

PREFIX = b"mgmtd/"
LEASE_KEY = PREFIX + b"ha/lease"
ROUTING_KEY = PREFIX + b"ha/routing"
INSTANCE_PREFIX = PREFIX + b"ha/instance/"
# Instance records read at most (a cluster runs two or three; records of instances gone for good
# are deleted by the primary, see FORGET_AFTER_LEASES).
MAX_INSTANCES = 64
# The primary deletes an instance record it has seen unchanged for this many lease periods.
FORGET_AFTER_LEASES = 100
# Rows per scan of a state table when a new primary loads it (the topology is bounded by the
# limits in fs3.mgmtd.limits; pages keep each read of the database small).
_LOAD_PAGE_ROWS = 1_000
_STATE_PREFIXES = (schema.NODE, schema.TARGET, schema.CHAIN, schema.TABLE, schema.MOVES)


@dataclass
class SharedEngine:
    """What turns a mgmtd into one of several on a shared database (None: a single mgmtd on its
    local store). ``name`` is unique among the instances; ``address`` is what standbys tell
    clients to call instead (this instance's framed address as clients reach it)."""

    engine: TxnEngine
    name: str
    address: str
    lease: LeaseConfig = field(default_factory=LeaseConfig)


async def read_lease(txn: Transaction) -> LeaseRecord | None:
    raw = await txn.get(LEASE_KEY)
    return LeaseRecord.decode(raw) if raw is not None else None


async def _scan_all(txn: Transaction, prefix: bytes) -> list[bytes]:
    start, end = prefix, prefix_end(prefix)
    values: list[bytes] = []
    while True:
        page = await txn.scan(start, end, limit=_LOAD_PAGE_ROWS)
        values.extend(value for _, value in page)
        if len(page) < _LOAD_PAGE_ROWS:
            return values
        start = page[-1][0] + b"\x00"


async def read_state_records(engine: TxnEngine, name: str,
                             epoch: int) -> tuple[dict[bytes, list[bytes]], bytes | None]:
    """The persisted state (records by :mod:`~fs3.mgmtd.schema` prefix, and the stored routing
    version), read in one transaction that also checks the lease is still ``name``'s at ``epoch``."""

    async def read(txn: Transaction) -> tuple[dict[bytes, list[bytes]], bytes | None]:
        check_fence(await read_lease(txn), name, epoch)
        records = {prefix: await _scan_all(txn, PREFIX + prefix) for prefix in _STATE_PREFIXES}
        return records, await txn.get(PREFIX + schema.ROUTING_VERSION)

    return await run_transaction(engine, read)


async def write_fenced(engine: TxnEngine, name: str, epoch: int, records: dict[bytes, bytes]) -> None:
    """Write ``records`` (keys of :mod:`~fs3.mgmtd.schema`, or ``ha/routing``) only if the lease is
    still ``name``'s at ``epoch`` in the same transaction; otherwise :class:`NotPrimary`, nothing written."""

    async def write(txn: Transaction) -> None:
        check_fence(await read_lease(txn), name, epoch)
        for key, value in records.items():
            txn.put(key if key == ROUTING_KEY else PREFIX + key, value)

    await run_transaction(engine, write)


async def release_lease(engine: TxnEngine, released: LeaseRecord) -> bool:
    """Write ``released`` (from :meth:`LeaseCore.release`) if the lease still reads as its holder's
    at its epoch; returns whether it did (otherwise the lease had already moved on)."""

    async def write(txn: Transaction) -> bool:
        record = await read_lease(txn)
        if record is None or record.released or (record.epoch, record.holder) != (released.epoch, released.holder):
            return False
        txn.put(LEASE_KEY, released.encode())
        return True

    return await run_transaction(engine, write)


async def read_published_routing(engine: TxnEngine) -> cpb.RoutingInfo | None:
    """What the primary last published (None: no primary has published yet)."""

    async def read(txn: Transaction) -> bytes | None:
        return await txn.get(ROUTING_KEY)

    raw = await run_transaction(engine, read)
    return cpb.RoutingInfo.FromString(raw) if raw is not None else None


def instance_key(name: str) -> bytes:
    return INSTANCE_PREFIX + name.encode()


async def read_instances(engine: TxnEngine) -> list[InstanceRecord]:
    """Every instance's record (at most :data:`MAX_INSTANCES`), in one read-only transaction.
    A record that does not decode is skipped with a warning: it names no instance to list."""

    async def read(txn: Transaction) -> list[tuple[bytes, bytes]]:
        return await txn.scan(INSTANCE_PREFIX, prefix_end(INSTANCE_PREFIX), limit=MAX_INSTANCES)

    records: list[InstanceRecord] = []
    for key, raw in await run_transaction(engine, read):
        try:
            records.append(InstanceRecord.decode(raw))
        except FS3Error as exc:
            log.warning("skipping mgmtd instance record %r: %s", key, exc)
    return records


async def write_instance(engine: TxnEngine, record: InstanceRecord) -> None:
    """Write this instance's own record. Only it writes that key, so the write reads nothing and
    conflicts with no other instance's transaction."""

    async def write(txn: Transaction) -> None:
        txn.put(instance_key(record.name), record.encode())

    await run_transaction(engine, write)


async def forget_instances(engine: TxnEngine, records: list[InstanceRecord]) -> int:
    """Delete each of ``records`` that still reads exactly so (an instance that came back since
    bumped its counter and is kept); returns how many were deleted."""

    async def delete(txn: Transaction) -> int:
        deleted = 0
        for record in records:
            raw = await txn.get(instance_key(record.name))
            if raw is not None and raw == record.encode():
                txn.delete(instance_key(record.name))
                deleted += 1
        return deleted

    return await run_transaction(engine, delete) if records else 0


class LeaseLoop:
    """Reads and writes the lease every ``renew_interval_ms`` and tells the owner after each try.

    Each try is one transaction: read the lease, ask :class:`LeaseCore`, write what it says. A try
    that takes longer than the renewal interval is abandoned (it counts as failed: the core then
    learns at the next read whether it landed). ``on_tick`` runs after every try, so the owner can
    load the state on a takeover or drop it on a step-down.

    Beside it, :meth:`run_presence` records this instance's presence and reads the others'
    (:meth:`record_presence`) as often, in a task and transactions of their own: a slow or failed
    presence write never delays or costs a lease renewal.
    """

    def __init__(self, setup: SharedEngine, clock: Clock, on_tick: Callable[[], Awaitable[None]]) -> None:
        self.setup = setup
        self.clock = clock
        self.core = LeaseCore(setup.name, setup.address, setup.lease)
        self.presence = PresenceWatch(setup.name, setup.lease.lease_ms)
        self._on_tick = on_tick
        self.tries = 0
        self.failures = 0

    async def try_once(self) -> None:
        started_ms = self.clock.now_ms()
        txn = self.setup.engine.begin()
        record = await read_lease(txn)
        write = self.core.plan(record, started_ms, self.clock.now_ms())
        if write is None:
            await txn.commit()  # nothing written: ends the read (a networked engine frees its snapshot)
            return
        txn.put(LEASE_KEY, write.encode())
        try:
            await txn.commit()
        except BaseException:
            self.core.failed(write, started_ms)
            raise
        self.core.committed(write, started_ms, self.clock.now_ms())
        if write.renewals == 0:
            log.warning("mgmtd %s took the primary lease: epoch %d", self.setup.name, write.epoch)

    async def record_presence(self) -> None:
        """Bump this instance's record and read everyone's (two small transactions: one scan, read
        only, so that instances writing their own records at once never conflict). The primary
        also deletes the records of instances gone for good."""
        engine = self.setup.engine
        self.presence.observe(await read_instances(engine), self.clock.now_ms())
        await write_instance(engine, self.presence.next_record(self.setup.address))
        if self.core.is_primary(self.clock.now_ms()):
            gone = self.presence.forgettable(self.clock.now_ms(), FORGET_AFTER_LEASES * self.setup.lease.lease_ms)
            if gone and await forget_instances(engine, gone):
                log.warning("mgmtd %s forgot instances unseen for %d lease periods: %s", self.setup.name,
                            FORGET_AFTER_LEASES, ", ".join(r.name for r in gone))

    async def run(self) -> None:
        interval_s = self.setup.lease.renew_interval_ms / 1000
        while True:
            self.tries += 1
            try:
                # (asyncio.timeout, not wait_for: wait_for can swallow a cancellation that
                # arrives as the try completes, and a stopped mgmtd would keep renewing.)
                async with asyncio.timeout(interval_s):
                    await self.try_once()
            except (FS3Error, TimeoutError) as exc:
                self.failures += 1
                log.info("mgmtd %s: lease try failed: %s", self.setup.name, exc)
            await self._on_tick()
            await asyncio.sleep(interval_s)

    async def run_presence(self) -> None:
        """:meth:`record_presence` every renewal interval, forever (cancel to stop)."""
        interval_s = self.setup.lease.renew_interval_ms / 1000
        while True:
            try:
                async with asyncio.timeout(interval_s):
                    await self.record_presence()
            except (FS3Error, TimeoutError) as exc:
                log.info("mgmtd %s: presence record failed: %s", self.setup.name, exc)
            await asyncio.sleep(interval_s)

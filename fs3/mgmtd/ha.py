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
``mgmtd/`` + every key of :mod:`~fs3.mgmtd.schema`  the same records a single mgmtd keeps locally
==========================================  ===============================================

The published routing information lets standbys answer routing reads without being primary: it
is written in the same fenced transaction as the records it was built from.
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

__all__ = ["LEASE_KEY", "PREFIX", "ROUTING_KEY", "LeaseLoop", "SharedEngine", "read_lease", "read_published_routing",
           "read_state_records", "release_lease", "write_fenced"]

log = logging.getLogger(__name__)

PREFIX = b"mgmtd/"
LEASE_KEY = PREFIX + b"ha/lease"
ROUTING_KEY = PREFIX + b"ha/routing"
# Rows per scan of a state table when a new primary loads it (the topology is bounded by the
# limits in fs3.mgmtd.limits; pages keep each read of the database small).
_LOAD_PAGE_ROWS = 1_000
_STATE_PREFIXES = (schema.NODE, schema.TARGET, schema.CHAIN, schema.TABLE)


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


class LeaseLoop:
    """Reads and writes the lease every ``renew_interval_ms`` and tells the owner after each try.

    Each try is one transaction: read the lease, ask :class:`LeaseCore`, write what it says. A try
    that takes longer than the renewal interval is abandoned (it counts as failed: the core then
    learns at the next read whether it landed). ``on_tick`` runs after every try, so the owner can
    load the state on a takeover or drop it on a step-down.
    """

    def __init__(self, setup: SharedEngine, clock: Clock, on_tick: Callable[[], Awaitable[None]]) -> None:
        self.setup = setup
        self.clock = clock
        self.core = LeaseCore(setup.name, setup.address, setup.lease)
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

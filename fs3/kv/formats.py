"""Open a store by its format record, migrating it page by page (the I/O of :mod:`fs3.common.formats`).

Two drivers, one rule:

* :func:`open_kv_format` for a :class:`~fs3.kv.store.KVStore` that one process owns (a storage
  target, a mgmtd on RocksDB): each page is one atomic :class:`~fs3.kv.store.WriteBatch`, synced.
* :func:`open_txn_format` for a :class:`~fs3.kv.api.TxnEngine` (meta on RocksDB or PostgreSQL,
  mgmtd on PostgreSQL): each page is one transaction that first reads the format record and the
  progress. Several servers sharing the store may run it at once: two transactions writing the
  same progress key conflict, the loser retries from the progress the winner committed, and a
  server that finds the record already stamped by another one just opens the store. No claim or
  lock is needed, and none can be left behind by a killed server.

Both log each migration's start, its progress every :data:`LOG_EVERY_PAGES` pages, and its end.
``after_page`` (tests: a kill injected after page k) is called after each committed page.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from fs3.common.errors import MaybeCommitted, TxnConflict
from fs3.common.formats import (
    Action,
    FormatRecord,
    FormatRefused,
    Migration,
    Page,
    Progress,
    StoreFormat,
    decide,
    plan_page,
    read_version,
    scan_bounds,
)
from fs3.kv.api import Transaction, TxnEngine, prefix_end
from fs3.kv.store import KVStore, WriteBatch

__all__ = [
    "LOG_EVERY_PAGES",
    "PAGE_RECORDS",
    "AfterPage",
    "FormatReport",
    "open_kv_format",
    "open_txn_format",
    "release",
]

log = logging.getLogger(__name__)

#: Records rewritten per page (one batch or transaction): bounds each commit's size.
PAGE_RECORDS = 1000
LOG_EVERY_PAGES = 100
#: Conflicts a page's transaction retries before giving up (servers racing on a shared store).
TXN_RETRY_MAX = 50
#: Keys looked at to tell an empty store from one with data.
_PROBE_KEYS = 64

AfterPage = Callable[[Migration, Progress | None], None]


def release() -> str:
    """This code's release, as format records name it (``fs3.__version__``; the package is loaded
    by now, being this module's parent, and is not imported here: it would reach the client)."""
    return str(getattr(sys.modules.get("fs3"), "__version__", "unknown"))


@dataclass(frozen=True)
class FormatReport:
    """What opening (or checking) a store found and did."""

    where: str
    kind: str
    found: int | None  # None: the store was empty
    current: int
    pending: tuple[str, ...]  # the migrations still to run ("N->N+1: summary"), for --check
    migrated: bool = False

    def line(self) -> str:
        found = "empty" if self.found is None else f"format {self.found}"
        if self.pending:
            return f"{self.where}: {self.kind} {found}, current {self.current}; pending: " + "; ".join(self.pending)
        return f"{self.where}: {self.kind} {found}, current {self.current}" + (" (upgraded)" if self.migrated else "")


def _pending(steps: tuple[Migration, ...]) -> tuple[str, ...]:
    return tuple(f"{m.from_version}->{m.to_version}: {m.summary}" for m in steps)


# -- a store one process owns ------------------------------------------------------------------


def _kv_has_data(kv: KVStore, fmt: StoreFormat) -> bool:
    start: bytes | None = b""
    for _ in range(_PROBE_KEYS):
        if start is None:
            return False
        pair = next(iter(kv.scan(start, None, limit=1)), None)
        if pair is None:
            return False
        key = pair[0]
        if fmt.is_data_key(key):
            return True
        skip = next((p for p in fmt.ignored_prefixes if key.startswith(p)), None)
        start = prefix_end(skip) if skip is not None else key + b"\x00"
    return True  # too many bookkeeping keys to be empty


def _kv_found(kv: KVStore, fmt: StoreFormat, where: str) -> FormatRecord | None:
    legacy = kv.get(fmt.legacy_key) if fmt.legacy_key is not None else None
    raw = kv.get(fmt.record_key)
    return read_version(fmt, raw, legacy, raw is None and legacy is None and _kv_has_data(kv, fmt), where)


def open_kv_format(kv: KVStore, fmt: StoreFormat, where: str, *, upgrade: bool = True, check: bool = False,
                   cluster_id: str = "", page_records: int = PAGE_RECORDS, config_hint: str = "<config>",
                   after_page: AfterPage | None = None) -> FormatReport:
    """Open ``kv`` as a ``fmt`` store: stamp it when fresh, migrate it when older (``upgrade``),
    or raise :class:`FormatRefused`. ``check``: report only, write nothing (``fs3 admin upgrade --check``)."""
    found = _kv_found(kv, fmt, where)
    decision = decide(fmt, found, where, upgrade or check, release(), config_hint)
    report = FormatReport(where, fmt.kind, None if found is None else found.version, fmt.current,
                          _pending(decision.steps))
    if check:
        return report
    if decision.action is Action.FRESH:
        batch = WriteBatch()
        for key, value in fmt.record_writes(FormatRecord(fmt.kind, fmt.current, release(), cluster_id)):
            batch.put(key, value) if value is not None else batch.delete(key)
        kv.write(batch, sync=True)
        return report
    if decision.action is Action.OPEN:
        return report
    assert found is not None
    for migration in decision.steps:
        raw = kv.get(fmt.progress_key)
        progress = Progress.decode(raw, where) if raw is not None else Progress(migration.from_version,
                                                                                 migration.to_version)
        _check_progress(progress, migration, where)
        _log_start(where, fmt, migration, progress)
        new = FormatRecord(fmt.kind, migration.to_version, release(), cluster_id or found.cluster_id)
        current: Progress | None = progress
        while current is not None:
            scanned = []
            if migration.ranges:
                start, end = scan_bounds(migration, current)
                scanned = list(kv.scan(start, end, limit=page_records))
            page = plan_page(fmt, migration, current, scanned, page_records, new)
            batch = WriteBatch()
            for key, value in page.writes:
                batch.put(key, value) if value is not None else batch.delete(key)
            kv.write(batch, sync=True)
            _log_page(where, fmt, migration, current, page)
            current = page.next_progress
            if after_page is not None:
                after_page(migration, current)
    return FormatReport(where, fmt.kind, found.version, fmt.current, (), migrated=True)


# -- a store behind transactions (possibly shared by several servers) ---------------------------


async def _txn_has_data(txn: Transaction, fmt: StoreFormat) -> bool:
    start: bytes | None = b""
    for _ in range(_PROBE_KEYS):
        if start is None:
            return False
        pairs = await txn.scan(start, None, limit=1)
        if not pairs:
            return False
        key = pairs[0][0]
        if fmt.is_data_key(key):
            return True
        skip = next((p for p in fmt.ignored_prefixes if key.startswith(p)), None)
        start = prefix_end(skip) if skip is not None else key + b"\x00"
    return True


async def _txn_found(txn: Transaction, fmt: StoreFormat, where: str) -> FormatRecord | None:
    legacy = await txn.get(fmt.legacy_key) if fmt.legacy_key is not None else None
    raw = await txn.get(fmt.record_key)
    has_data = raw is None and legacy is None and await _txn_has_data(txn, fmt)
    return read_version(fmt, raw, legacy, has_data, where)


async def open_txn_format(engine: TxnEngine, fmt: StoreFormat, where: str, *, upgrade: bool = True,
                          check: bool = False, cluster_id: str = "", page_records: int = PAGE_RECORDS,
                          config_hint: str = "<config>", after_page: AfterPage | None = None) -> FormatReport:
    """:func:`open_kv_format` on a transaction engine: each page one transaction that re-reads the
    record and the progress, so servers sharing the store may all run it (see the module doc)."""
    txn = engine.begin()
    try:
        found = await _txn_found(txn, fmt, where)
        decision = decide(fmt, found, where, upgrade or check, release(), config_hint)
        report = FormatReport(where, fmt.kind, None if found is None else found.version, fmt.current,
                              _pending(decision.steps))
        if check or decision.action is Action.OPEN:
            return report
        if decision.action is Action.FRESH:
            for key, value in fmt.record_writes(FormatRecord(fmt.kind, fmt.current, release(), cluster_id)):
                txn.put(key, value) if value is not None else txn.delete(key)
            try:
                await txn.commit()
            except (TxnConflict, MaybeCommitted):
                # Another server stamped or wrote it meanwhile: decide again on what is there now.
                return await open_txn_format(engine, fmt, where, upgrade=upgrade, cluster_id=cluster_id,
                                             page_records=page_records, config_hint=config_hint,
                                             after_page=after_page)
            return report
    finally:
        end_transaction(txn)
    assert found is not None
    logged: set[int] = set()
    while True:
        step = await _txn_page(engine, fmt, where, cluster_id or found.cluster_id, page_records, logged, after_page)
        if step is None:
            break
    return FormatReport(where, fmt.kind, found.version, fmt.current, (), migrated=True)


async def _txn_page(engine: TxnEngine, fmt: StoreFormat, where: str, cluster_id: str, page_records: int,
                    logged: set[int], after_page: AfterPage | None) -> bool | None:
    """Commit the next page of whatever migration the store is at; None once it is current."""
    for _ in range(TXN_RETRY_MAX):
        txn = engine.begin()
        try:
            found = await _txn_found(txn, fmt, where)
            if found is None or found.version >= fmt.current:
                return None  # another server finished it
            if found.version < fmt.oldest_upgradable:
                decide(fmt, found, where, True, release())  # raises: too old
            migration = fmt.migration(found.version)
            raw = await txn.get(fmt.progress_key)
            progress = Progress.decode(raw, where) if raw is not None else Progress(migration.from_version,
                                                                                     migration.to_version)
            _check_progress(progress, migration, where)
            if migration.from_version not in logged:
                logged.add(migration.from_version)
                _log_start(where, fmt, migration, progress)
            scanned: list[tuple[bytes, bytes]] = []
            if migration.ranges:
                start, end = scan_bounds(migration, progress)
                scanned = await txn.scan(start, end, limit=page_records)
            new = FormatRecord(fmt.kind, migration.to_version, release(), cluster_id)
            page = plan_page(fmt, migration, progress, scanned, page_records, new)
            for key, value in page.writes:
                txn.put(key, value) if value is not None else txn.delete(key)
            try:
                await txn.commit()
            except (TxnConflict, MaybeCommitted):
                continue  # re-read the progress: another server's page, or ours, committed
        finally:
            end_transaction(txn)
        _log_page(where, fmt, migration, progress, page)
        if after_page is not None:
            after_page(migration, page.next_progress)
        return True
    raise TxnConflict(f"{where}: a migration page kept conflicting ({TXN_RETRY_MAX} tries)")


# -- shared ---------------------------------------------------------------------------------------


def end_transaction(txn: Transaction) -> None:
    """End ``txn`` if it is still open (a read-only look, a refusal): an engine that holds a
    connection per transaction (PostgreSQL) gives it back now. Harmless after a commit."""
    abandon = getattr(txn, "abandon", None)
    if abandon is not None:
        abandon()


def _check_progress(progress: Progress, migration: Migration, where: str) -> None:
    if (progress.from_version, progress.to_version) != (migration.from_version, migration.to_version):
        raise FormatRefused(f"{where}: a migration {progress.from_version}->{progress.to_version} is recorded "
                            f"in progress, but the store is at format {migration.from_version}: it is damaged")


def _log_start(where: str, fmt: StoreFormat, migration: Migration, progress: Progress) -> None:
    resumed = f", resumed after {progress.pages} pages ({progress.records} records)" if progress.pages else ""
    log.warning("%s: upgrading %s format %d -> %d: %s%s", where, fmt.kind, migration.from_version,
                migration.to_version, migration.summary, resumed)


def _log_page(where: str, fmt: StoreFormat, migration: Migration, before: Progress, page: Page) -> None:
    after = page.next_progress
    if after is None:
        log.warning("%s: %s format %d -> %d done (%d pages, %d records)", where, fmt.kind, migration.from_version,
                    migration.to_version, before.pages + 1, before.records + page.records)
    elif after.pages % LOG_EVERY_PAGES == 0:
        log.info("%s: %s format %d -> %d: %d pages, %d records", where, fmt.kind, migration.from_version,
                 migration.to_version, after.pages, after.records)

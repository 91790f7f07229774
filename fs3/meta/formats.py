"""meta's store format versions: keys inside the namespace's KV, so RocksDB and PostgreSQL alike.

====  ==============================================================================================
1     the layout before format records (no record)
2     the same records, and a format record (``FRMT``): stamped by a migration that rewrites nothing
====  ==============================================================================================

Every page of a migration is one transaction that re-reads the record and the progress
(:func:`fs3.kv.formats.open_txn_format`): meta servers sharing one PostgreSQL database that start
together may all run it; their pages conflict, the losers retry from the winner's progress, and
whoever finds the store current opens it. A dump records the meta format of the store it was taken of; a load
stamps that format on the store it fills, which the next start migrates (:mod:`fs3.meta.dump`).
"""

from __future__ import annotations

from fs3.common.errors import InvalidArgument
from fs3.common.formats import Migration, StoreFormat
from fs3.kv.api import TxnEngine
from fs3.kv.formats import PAGE_RECORDS, AfterPage, FormatReport, end_transaction, open_txn_format
from fs3.meta.schema import LOAD_UNFINISHED

__all__ = ["META_FORMAT", "META_FORMAT_VERSION", "META_KIND", "MGMTD_SHARED_PREFIX", "open_meta_format"]

META_KIND = "meta"
META_FORMAT_VERSION = 2
RECORD = b"FRMT"
MIGRATION = b"FMIG"
#: mgmtd's keys when it shares meta's PostgreSQL database (fs3.mgmtd.ha.PREFIX; meta does not
#: import mgmtd): not meta's data, so a new cluster's meta started after mgmtd finds its store fresh.
MGMTD_SHARED_PREFIX = b"mgmtd/"

META_FORMAT = StoreFormat(
    kind=META_KIND, current=META_FORMAT_VERSION, oldest_upgradable=1, record_key=RECORD, progress_key=MIGRATION,
    ignored_prefixes=(MGMTD_SHARED_PREFIX,),
    migrations=(Migration(1, "format records: the store is stamped, no record changes"),),
)


async def open_meta_format(engine: TxnEngine, where: str, *, upgrade: bool = True, check: bool = False,
                           cluster_id: str = "", page_records: int = PAGE_RECORDS,
                           after_page: AfterPage | None = None) -> FormatReport:
    """Open meta's store by its format: stamp, migrate or refuse (see the module doc). A store an
    unfinished ``fs3 admin load`` left is refused first, with nothing written (``fs3 admin
    upgrade`` too: a format record written there would hide what it holds)."""
    look = engine.begin()
    try:
        if await look.get(LOAD_UNFINISHED) is not None:
            raise InvalidArgument(f"{where}: this meta store holds part of a dump: an `fs3 admin load` into it "
                                  "did not finish; load again into an empty store (docs/operations.md); "
                                  "nothing was changed")
    finally:
        end_transaction(look)
    return await open_txn_format(engine, META_FORMAT, where, upgrade=upgrade, check=check, cluster_id=cluster_id,
                                 page_records=page_records, config_hint="<meta's config>", after_page=after_page)

"""meta's store format versions: keys inside the namespace's KV, so RocksDB and PostgreSQL alike.

====  ==============================================================================================
1     the layout before format records (no record)
2     the same records, and a format record (``FRMT``): stamped by a migration that rewrites nothing
====  ==============================================================================================

Every page of a migration is one transaction that re-reads the record and the progress
(:func:`fs3.kv.formats.open_txn_format`): meta servers sharing one PostgreSQL database that start
together may all run it; their pages conflict, the losers retry from the winner's progress, and
whoever finds the store current opens it. A dump records the meta format it was taken at; a load
writes unstamped records, which the next start migrates (:mod:`fs3.meta.dump`).
"""

from __future__ import annotations

from fs3.common.formats import Migration, StoreFormat
from fs3.kv.api import TxnEngine
from fs3.kv.formats import PAGE_RECORDS, AfterPage, FormatReport, open_txn_format

__all__ = ["META_FORMAT", "META_FORMAT_VERSION", "META_KIND", "open_meta_format"]

META_KIND = "meta"
META_FORMAT_VERSION = 2
RECORD = b"FRMT"
MIGRATION = b"FMIG"

META_FORMAT = StoreFormat(
    kind=META_KIND, current=META_FORMAT_VERSION, oldest_upgradable=1, record_key=RECORD, progress_key=MIGRATION,
    migrations=(Migration(1, "format records: the store is stamped, no record changes"),),
)


async def open_meta_format(engine: TxnEngine, where: str, *, upgrade: bool = True, check: bool = False,
                           cluster_id: str = "", page_records: int = PAGE_RECORDS,
                           after_page: AfterPage | None = None) -> FormatReport:
    """Open meta's store by its format: stamp, migrate or refuse (see the module doc)."""
    return await open_txn_format(engine, META_FORMAT, where, upgrade=upgrade, check=check, cluster_id=cluster_id,
                                 page_records=page_records, config_hint="<meta's config>", after_page=after_page)

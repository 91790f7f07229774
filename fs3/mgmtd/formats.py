"""mgmtd's store format versions (its RocksDB, or its keys under ``mgmtd/`` in PostgreSQL).

====  ==============================================================================================
1     the layout before format records (no record)
2     the same records, and a format record (``format/record``): stamped by a migration that
      rewrites nothing
====  ==============================================================================================
"""

from __future__ import annotations

from fs3.common.formats import Migration, StoreFormat
from fs3.kv.api import TxnEngine
from fs3.kv.formats import PAGE_RECORDS, AfterPage, FormatReport, open_kv_format, open_txn_format
from fs3.kv.store import KVStore
from fs3.mgmtd.ha import PREFIX

__all__ = ["MGMTD_KIND", "mgmtd_format", "open_mgmtd_format", "open_shared_mgmtd_format"]

MGMTD_KIND = "mgmtd"
MGMTD_FORMAT_VERSION = 2
RECORD = b"format/record"
MIGRATION = b"format/migration"


def mgmtd_format(prefix: bytes = b"") -> StoreFormat:
    """mgmtd's format, its keys under ``prefix`` (``mgmtd/`` on a shared engine)."""
    return StoreFormat(
        kind=MGMTD_KIND, current=MGMTD_FORMAT_VERSION, oldest_upgradable=1,
        record_key=prefix + RECORD, progress_key=prefix + MIGRATION,
        ignored_prefixes=(prefix + b"ha/",) if prefix else (),
        migrations=(Migration(1, "format records: the store is stamped, no record changes"),),
    )


def open_mgmtd_format(kv: KVStore, where: str, *, upgrade: bool = True, check: bool = False, cluster_id: str = "",
                      page_records: int = PAGE_RECORDS, after_page: AfterPage | None = None) -> FormatReport:
    """Open mgmtd's own store by its format (:func:`fs3.kv.formats.open_kv_format`)."""
    return open_kv_format(kv, mgmtd_format(), where, upgrade=upgrade, check=check, cluster_id=cluster_id,
                          page_records=page_records, config_hint="<mgmtd's config>", after_page=after_page)


async def open_shared_mgmtd_format(engine: TxnEngine, where: str, *, upgrade: bool = True, check: bool = False,
                                   cluster_id: str = "") -> FormatReport:
    """The same for mgmtd instances sharing a PostgreSQL database (each page one transaction)."""
    return await open_txn_format(engine, mgmtd_format(PREFIX), where, upgrade=upgrade, check=check,
                                 cluster_id=cluster_id, config_hint="<mgmtd's config>")

"""A storage target's format versions and the migrations between them.

====  ==============================================================================================
2     the layout before format records (``v/format`` = 2): ChunkState records without a checksum
3     every ChunkState record ends with a CRC32C of itself, checked when the target opens, so a
      damaged metadata value is reported (and the chunk resynced) rather than read as another state
====  ==============================================================================================

A target without ``v/format`` but with chunk records predates version 2; no release since reads
it (it is emptied and resyncs from its chain). The chunk metadata (ChunkState, patches, inline
blobs, blob file names) is covered by this one version: a target is one store, written by one
process, and its records change together (docs/decisions.md).
"""

from __future__ import annotations

from fs3.common.errors import FS3Error
from fs3.common.formats import FormatRefused, Migration, StoreFormat, Write
from fs3.kv.formats import PAGE_RECORDS, AfterPage, FormatReport, open_kv_format
from fs3.kv.store import KVStore
from fs3.storage import schema

__all__ = ["TARGET_FORMAT", "TARGET_KIND", "chunk_state_v2_to_v3", "open_target_format"]

TARGET_KIND = "storage-target"


def chunk_state_v2_to_v3(key: bytes, value: bytes) -> list[Write]:
    """One ChunkState record of format 2 rewritten as format 3 (the same fields, then their CRC)."""
    from fs3.storage.chunk_engine import ChunkState

    try:
        state = ChunkState.decode_v2(value)
    except (ValueError, IndexError, FS3Error) as exc:  # struct.error is a ValueError
        raise FormatRefused(f"chunk record {key.hex()} is not a format-2 ChunkState ({exc})") from None
    return [(key, state.encode())]


TARGET_FORMAT = StoreFormat(
    kind=TARGET_KIND, current=schema.FORMAT_VERSION, oldest_upgradable=2,
    record_key=schema.FORMAT_RECORD, progress_key=schema.FORMAT_MIGRATION, legacy_key=schema.FORMAT,
    ignored_prefixes=(b"v/", schema.CHANNEL, schema.SCRUB_PROGRESS),
    migrations=(
        Migration(2, "ChunkState records gain a CRC32C", (schema.prefix_range(schema.CHUNK),), chunk_state_v2_to_v3),
    ),
)


def open_target_format(kv: KVStore, where: str, *, upgrade: bool = True, check: bool = False,
                       page_records: int = PAGE_RECORDS, after_page: AfterPage | None = None) -> FormatReport:
    """Open a target's KV by its format (see :func:`fs3.kv.formats.open_kv_format`)."""
    return open_kv_format(kv, TARGET_FORMAT, where, upgrade=upgrade, check=check, page_records=page_records,
                          config_hint="<the storage node's config>", after_page=after_page)

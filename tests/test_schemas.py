"""The storage and mgmtd key layouts are on-disk formats: pinned byte for byte."""

from __future__ import annotations

from fs3.mgmtd import schema as mgmtd_schema
from fs3.storage import schema as storage_schema


def test_storage_keys_are_unchanged() -> None:
    chunk = bytes.fromhex("00aa11bb")
    assert storage_schema.chunk_key(chunk) == b"c/" + chunk
    assert storage_schema.patch_key(chunk) == b"p/" + chunk
    assert storage_schema.inline_key(chunk, 7) == b"b/" + chunk + b"\0\0\0\0\0\0\0\x07"
    assert storage_schema.channel_key(b"cli", 258) == b"h/\x03cli\0\0\x01\x02"
    assert (storage_schema.FLOOR, storage_schema.FORMAT, storage_schema.FORMAT_VERSION) == (b"v/floor", b"v/format", 3)


def test_storage_keys_parse_back() -> None:
    chunk = bytes(range(20))
    assert storage_schema.parse_chunk_key(storage_schema.chunk_key(chunk)) == chunk
    assert storage_schema.parse_inline_key(storage_schema.inline_key(chunk, 1 << 40)) == (chunk, 1 << 40)
    assert storage_schema.parse_channel_key(storage_schema.channel_key(b"\xff" * 16, 9)) == (b"\xff" * 16, 9)


def test_blob_file_names_are_unchanged() -> None:
    chunk = bytes.fromhex("0102abcd")
    assert storage_schema.blob_dir_name(chunk) == "cd"
    assert storage_schema.blob_file_name(chunk, 12) == "0102abcd.12"
    assert storage_schema.parse_blob_file_name("0102abcd.12") == (chunk, 12)
    assert storage_schema.parse_blob_file_name("README") is None
    assert storage_schema.parse_blob_file_name("0102abcd.tmp") is None


def test_mgmtd_keys_are_unchanged() -> None:
    assert mgmtd_schema.node_key(3) == b"node/00000003"
    assert mgmtd_schema.target_key(101) == b"target/" + b"0" * 17 + b"101"
    assert mgmtd_schema.chain_key(12) == b"chain/00000012"
    assert mgmtd_schema.table_key(1) == b"table/00000001"
    assert mgmtd_schema.ROUTING_VERSION == b"meta/routing_version"
    assert mgmtd_schema.prefix_range(mgmtd_schema.NODE) == (b"node/", b"node0")

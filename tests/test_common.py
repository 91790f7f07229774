"""Errors, config, ids, checksums, clock."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fs3 import common_pb2
from fs3.common.checksum import crc32c, crc32c_extend, crc32c_patch
from fs3.common.clock import ManualClock
from fs3.common.config import load_config
from fs3.common.errors import (
    ChunkNotCommitted,
    FS3Error,
    InvalidArgument,
    InvariantViolation,
    StatusCode,
    error_for,
)
from fs3.common.ids import chunk_id, parse_chunk_id, validate_chunk_id, validate_chunk_size
from fs3.common.invariant import ensure
from fs3.common.tasks import finish_despite_cancel
from fs3.storage.server import StorageConfig


def test_status_codes_mirror_the_proto_enum() -> None:
    proto = {v.name: v.number for v in common_pb2.DESCRIPTOR.enum_types_by_name["StatusCode"].values}
    assert proto == {c.name: c.value for c in StatusCode}


def test_errors_round_trip_through_codes() -> None:
    for code in StatusCode:
        if code is StatusCode.OK:
            continue
        err = error_for(code, "boom")
        assert isinstance(err, FS3Error)
        assert err.code is code
        assert err.message == "boom"
    assert isinstance(error_for(9999, "x"), FS3Error)
    assert ChunkNotCommitted().retryable and not InvalidArgument().retryable


def test_invariants_stay_on() -> None:
    ensure(True, "fine")
    with pytest.raises(InvariantViolation, match="broken"):
        ensure(False, "broken")


def test_chunk_ids_sort_by_inode_then_index() -> None:
    ids = [chunk_id(2, 0), chunk_id(1, 5), chunk_id(1, 300)]
    assert sorted(ids) == [chunk_id(1, 5), chunk_id(1, 300), chunk_id(2, 0)]
    assert parse_chunk_id(chunk_id(42, 7)) == (42, 7)
    with pytest.raises(InvalidArgument):
        parse_chunk_id(b"short")
    with pytest.raises(InvalidArgument):
        validate_chunk_id(b"")
    with pytest.raises(InvalidArgument):
        validate_chunk_id(b"x" * 65)


@pytest.mark.parametrize("size", [0, 1000, 4095, 3 * 4096, 128 * 1024 * 1024])
def test_bad_chunk_sizes(size: int) -> None:
    with pytest.raises(InvalidArgument):
        validate_chunk_size(size)


def test_crc32c_known_value_and_extend() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c_extend(crc32c(b"1234"), memoryview(b"56789")) == 0xE3069283
    assert crc32c(bytearray(b"abc")) == crc32c(b"abc")


@given(st.binary(min_size=1, max_size=3000), st.data())
def test_crc32c_patch_matches_a_full_recompute(message: bytes, data: st.DataObject) -> None:
    offset = data.draw(st.integers(0, len(message)))
    new = data.draw(st.binary(min_size=0, max_size=len(message) - offset))
    patched = message[:offset] + new + message[offset + len(new):]
    assert crc32c_patch(crc32c(message), len(message), offset, message[offset:offset + len(new)], new) \
        == crc32c(patched)


def test_crc32c_patch_of_a_large_chunk_and_bad_patches() -> None:
    chunk = bytearray(range(256)) * 16384  # 4 MiB
    before = crc32c(chunk)
    old = bytes(chunk[4_000_000:4_004_096])
    chunk[4_000_000:4_004_096] = b"\xab" * 4096
    assert crc32c_patch(before, len(chunk), 4_000_000, old, b"\xab" * 4096) == crc32c(chunk)
    with pytest.raises(ValueError):
        crc32c_patch(before, 10, 8, b"abc", b"xyz")  # past the end
    with pytest.raises(ValueError):
        crc32c_patch(before, 10, 0, b"ab", b"xyz")  # lengths differ


def test_manual_clock() -> None:
    clock = ManualClock(5)
    clock.advance(10)
    assert clock.now_ms() == 15
    with pytest.raises(ValueError):
        clock.advance(-1)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "storage.toml"
    path.write_text(text)
    return path


def test_config_file_env_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, 'node_id = 3\n[[targets]]\ntarget_id = 301\npath = "/x"\n')
    config = load_config(StorageConfig, path, env_prefix="FS3_STORAGE",
                         environ={"FS3_STORAGE_HEARTBEAT_INTERVAL_MS": "250", "FS3_STORAGE_FSYNC": "false"})
    assert config.node_id == 3 and config.heartbeat_interval_ms == 250 and config.fsync is False
    assert config.targets[0].target_id == 301
    env_targets = load_config(StorageConfig, path, env_prefix="FS3_STORAGE",
                              environ={"FS3_STORAGE_TARGETS": '[{target_id = 9, path = "/y"}]'})
    assert [dataclasses.astuple(t) for t in env_targets.targets] == [(9, "/y")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('node_id = 1\nnode_idd = 2\n[[targets]]\ntarget_id = 1\npath = "/x"\n', "unknown key"),
        ('node_id = "one"\n[[targets]]\ntarget_id = 1\npath = "/x"\n', "expected an integer"),
        ("node_id = 1\n", "at least one"),
        ('node_id = 1\ntransport = "udp"\n[[targets]]\ntarget_id = 1\npath = "/x"\n', "transport"),
        ("node_id = [\n", "config file"),
        ('node_id = 1\n[[targets]]\ntarget_id = 1\npath = "/x"\n[[targets]]\ntarget_id = 1\npath = "/y"\n',
         "unique"),
        ('node_id = 1\nchannel_record_ttl_ms = 1000\n[[targets]]\ntarget_id = 1\npath = "/x"\n',
         "channel_record_ttl_ms"),
        ('node_id = 1\nupdates_inflight_max = 0\n[[targets]]\ntarget_id = 1\npath = "/x"\n', "updates_inflight"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        load_config(StorageConfig, _write(tmp_path, text), env_prefix="FS3_STORAGE", environ={})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_config(StorageConfig, tmp_path / "nope.toml", environ={})


def test_a_cancelled_caller_waits_for_the_work_it_started_then_is_cancelled() -> None:
    """The rule behind every lock held over I/O: cancelling the waiter must not end the wait early."""
    events: list[str] = []

    async def work() -> int:
        await asyncio.sleep(0.05)
        events.append("work done")
        raise OSError("the work's own error is dropped once the caller was cancelled")

    async def caller() -> None:
        try:
            await finish_despite_cancel(work())
        finally:
            events.append("caller released")

    async def main() -> None:
        task = asyncio.create_task(caller())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert events == ["work done", "caller released"]
        # Not cancelled: the work's result (or error) is the caller's.
        assert await finish_despite_cancel(asyncio.sleep(0, result=7)) == 7
        with pytest.raises(OSError):
            await finish_despite_cancel(work())

    asyncio.run(main())

"""``fs3 admin verify`` reads and compares the chunk bytes on every replica, not only their metadata.

A replica whose bytes rot on disk under an intact record (a flipped bit, a lost file) keeps the
version, length and CRC the others have: only reading the bytes back finds it. Chunks written
during the check differ for a moment and must not be reported as mismatches.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fs3 import common_pb2 as cpb
from fs3 import storage_pb2 as spb
from fs3.client.admin import AdminClient, Observation, Seen, VerifyReport
from fs3.common.ids import chunk_id
from fs3.kv.store import WriteBatch
from fs3.rpc.methods import service_spec
from fs3.rpc.storage_calls import dump_chunks
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # in-process clusters

STORAGE = service_spec("Storage")
CHUNK_SIZE = 1 << 20
BIG = 300 * 1024  # above the storage's inline limit (128 KiB): a file per version
SMALL = 4 * 1024  # inline: a record in the target's RocksDB


# -- reaching behind the engine ------------------------------------------------------------------
# The only code here that knows where a chunk version's bytes live on a target; adapt it when that
# changes (see fs3/storage/blobs.py).

def _version_location(cluster: InProcessCluster, target_id: int, cid: bytes) -> tuple[Path | None, bytes, int]:
    """(the version's file, or None when it is inline; its inline KV key; the committed version)."""
    node_id, index = divmod(target_id, 100)
    state = cluster.nodes[node_id].engines[target_id].get(cid)
    assert state is not None and state.commit_version, f"target {target_id} holds no committed {cid.hex()}"
    name = cid.hex()
    path = cluster.root / f"n{node_id}" / f"t{index}" / "chunks" / name[-2:] / f"{name}.{state.commit_blob}"
    return (None if state.commit_inline else path), b"b/" + cid + state.commit_blob.to_bytes(8, "big"), \
        state.commit_version


def corrupt_chunk(cluster: InProcessCluster, target_id: int, cid: bytes, offset: int = 1000) -> str:
    """Flip one byte of the committed version of ``cid`` on ``target_id``'s disk, behind the engine's
    back (its recorded version, length and CRC stay as they were). Returns where the byte was."""
    path, key, _ = _version_location(cluster, target_id, cid)
    if path is not None:
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
        return "file"
    kv = cluster.nodes[target_id // 100].engines[target_id].kv
    raw = kv.get(key)
    assert raw is not None, f"chunk {cid.hex()} on target {target_id} is neither a file nor a KV record"
    flipped = bytearray(raw)
    flipped[offset] ^= 0xFF
    batch = WriteBatch()
    batch.put(key, bytes(flipped))
    kv.write(batch, sync=False)
    return "kv"


def lose_chunk_file(cluster: InProcessCluster, target_id: int, cid: bytes) -> None:
    """Delete the file of a (large) chunk's committed version, as a lost or unlinked file would."""
    path, _, _ = _version_location(cluster, target_id, cid)
    assert path is not None, "only a file-backed version can lose its file"
    os.unlink(path)

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def _write_chunks(cluster: InProcessCluster) -> dict[str, bytes]:
    client = cluster.client()
    chain = cluster.chain_ids[0]
    chunks = {"big": chunk_id(7, 0), "small": chunk_id(7, 1), "lost": chunk_id(7, 2),
              "clean-big": chunk_id(8, 0), "clean-small": chunk_id(8, 1)}
    for name, cid in chunks.items():
        size = BIG if "big" in name or name == "lost" else SMALL
        await client.write(chain, cid, 0, os.urandom(size), CHUNK_SIZE)
    return chunks


def test_verify_finds_a_flipped_byte_that_metadata_hides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            chunks = await _write_chunks(cluster)
            admin = cluster.admin()
            clean = await admin.verify()
            assert clean.ok and clean.data and not clean.mismatches and not clean.busy, clean.as_dict()
            assert clean.chunks_checked == 5
            assert clean.bytes_read == 3 * (3 * BIG + 2 * SMALL)  # every replica read every byte once

            assert corrupt_chunk(cluster, 201, chunks["big"]) == "file"
            assert corrupt_chunk(cluster, 301, chunks["small"], offset=7) == "kv"
            lose_chunk_file(cluster, 101, chunks["lost"])

            report = await admin.verify(recheck_delay_s=0.01)
            assert not report.ok and not report.busy, report.as_dict()
            by_chunk = {d["chunk_id"]: d for d in report.mismatch_details}
            assert set(by_chunk) == {chunks["big"].hex(), chunks["small"].hex(), chunks["lost"].hex()}
            assert by_chunk[chunks["big"].hex()]["targets"] == [201]
            assert by_chunk[chunks["small"].hex()]["targets"] == [301]
            assert by_chunk[chunks["lost"].hex()]["targets"] == [101]
            big = by_chunk[chunks["big"].hex()]["replicas"]
            assert isinstance(big, dict) and big["201"]["problem"] == "bytes do not match the recorded CRC"
            assert big["101"]["problem"] is None and big["101"]["data_checksum"] == big["101"]["checksum"]
            lost = by_chunk[chunks["lost"].hex()]["replicas"]
            assert isinstance(lost, dict) and "unreadable" in lost["101"]["problem"]
            line = next(m for m in report.mismatches if chunks["big"].hex() in m)
            assert "target 201 differs" in line and "bytes do not match the recorded CRC" in line
            assert report.rechecked == 3  # each looked at again once, the same disagreement both times

            metadata = await admin.verify(data=False)
            assert metadata.ok and metadata.bytes_read == 0 and metadata.chunks_checked == 5, metadata.as_dict()

            # The command line, in this process against the same cluster.
            from fs3.cli.main import build_parser, run_admin

            base = ["admin", "--mgmtd", cluster.mgmtd_address, "--token", cluster.token, "--json", "verify"]
            capsys.readouterr()
            assert await run_admin(build_parser().parse_args(base)) == 2
            out = json.loads(capsys.readouterr().out)
            assert out["ok"] is False and out["mode"] == "data" and out["bytes_read"] > 0
            assert {d["chunk_id"] for d in out["mismatch_details"]} == set(by_chunk)
            assert await run_admin(build_parser().parse_args([*base, "--metadata-only"])) == 0
            out = json.loads(capsys.readouterr().out)
            assert out["ok"] is True and out["mode"] == "metadata" and out["bytes_read"] == 0
            assert await run_admin(build_parser().parse_args([a for a in base if a != "--json"])) == 2
            text = capsys.readouterr().out
            assert "MISMATCH: chain" in text and "replicas DIFFER" in text and "of chunk data" in text
    run(body())


def test_dump_pages_are_bounded_in_bytes(tmp_path: Path) -> None:
    """A page with data checksums stops once its byte budget is read; chunk_ids narrows a dump."""
    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_nodes=1, replicas=1) as cluster:
            chunks = await _write_chunks(cluster)
            chain = cluster.chain_ids[0]
            channel = cluster.channels.get(cluster.nodes[1].config.framed_address)
            rsp, _ = await channel.call(STORAGE.method("DumpChunkMeta"), spb.DumpChunkMetaReq(
                chain_id=chain, data_checksums=True, max_data_bytes=BIG + 1))
            assert isinstance(rsp, spb.DumpChunkMetaRsp)
            assert rsp.more and len(rsp.chunks) == 2 and rsp.data_bytes == BIG + SMALL  # stopped past the budget
            assert all(m.data_checked and m.data_checksum == m.checksum for m in rsp.chunks)
            whole = await dump_chunks(channel, chain, 0, timeout_ms=5_000, data_checksums=True, max_data_bytes=1)
            assert len(whole.chunks) == 5 and whole.pages == 5 and whole.data_bytes == 3 * BIG + 2 * SMALL
            plain = await dump_chunks(channel, chain, 0, timeout_ms=5_000)
            assert plain.pages == 1 and plain.data_bytes == 0 and not any(m.data_checked for m in plain.chunks.values())
            some = await dump_chunks(channel, chain, 0, timeout_ms=5_000, data_checksums=True, batch=1,
                                     chunk_ids=[chunks["small"], chunks["big"], chunk_id(99, 0)])
            assert set(some.chunks) == {chunks["small"], chunks["big"]} and some.data_bytes == BIG + SMALL
    run(body())


def test_chunks_written_during_verify_are_not_mismatches(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            client = cluster.client()
            chain = cluster.chain_ids[0]
            hot = [chunk_id(9, i) for i in range(4)]
            for i in range(40):
                await client.write(chain, chunk_id(10, i), 0, os.urandom(SMALL if i % 2 else BIG), CHUNK_SIZE)
            stop = asyncio.Event()

            async def writer(cid: bytes) -> None:
                n = 0
                while not stop.is_set():
                    size = BIG if n % 3 == 0 else SMALL
                    await client.write(chain, cid, (n * 4096) % BIG, os.urandom(size), CHUNK_SIZE)
                    n += 1

            writers = [asyncio.create_task(writer(cid)) for cid in hot]
            try:
                await asyncio.sleep(0.2)
                for _ in range(3):
                    report = await cluster.admin().verify(recheck_delay_s=0.05)
                    assert report.ok and not report.mismatches, report.as_dict()
                    assert all(any(c.hex() in line for c in hot) for line in report.busy), report.busy
            finally:
                stop.set()
                await asyncio.gather(*writers)
            settled = await cluster.admin().verify()
            assert settled.ok and not settled.busy and settled.chunks_checked == 44, settled.as_dict()
    run(body())


class _NoChannels:
    @staticmethod
    def node_address(framed: str, grpc: str) -> str:
        return framed


class _Scripted(AdminClient):
    """An admin client whose replicas answer from a script, one observation per look."""

    def __init__(self, looks: list[dict[bytes, Observation]]) -> None:
        super().__init__("unused", _NoChannels())  # type: ignore[arg-type]
        self.looks = looks

    async def routing(self) -> cpb.RoutingInfo:
        routing = cpb.RoutingInfo()
        routing.nodes.add(node_id=1, framed_address="n1")
        routing.chains.add(chain_id=1, target_ids=[101, 201, 301])
        for tid in (101, 201, 301):
            routing.targets.add(target_id=tid, node_id=1, public_state=cpb.SERVING)
        return routing

    async def _observe(self, chain_id: int, addresses: dict[int, str], chunk_ids: list[bytes] | None, data: bool,
                       batch: int, max_data_bytes: int,
                       report: VerifyReport) -> tuple[dict[bytes, Observation], dict[int, str]]:
        look = self.looks.pop(0)
        return ({cid: seen for cid, seen in look.items() if chunk_ids is None or cid in chunk_ids}), {}


def _seen(version: int, data_crc: int = 7, crc: int = 7) -> Seen:
    return Seen(version, 100, crc, data_crc)


def test_rechecks_tell_busy_from_mismatched() -> None:
    """Settles → clean; the same disagreement twice → mismatch; changing every time, or held by a
    write in flight, → busy; a first write in flight on one replica and none on another → clean."""
    settles, rotten, busy, stuck, first = b"s" * 16, b"r" * 16, b"b" * 16, b"k" * 16, b"f" * 16

    def look(n: int) -> dict[bytes, Observation]:
        return {
            settles: {101: _seen(2), 201: _seen(2), 301: _seen(1 if n == 0 else 2)},
            rotten: {101: _seen(1), 201: _seen(1, data_crc=8), 301: _seen(1)},
            busy: {101: _seen(n + 2), 201: _seen(n + 1), 301: _seen(n + 1)},
            stuck: {101: Seen(4, 100, 7, 7, pending=True), 201: _seen(5), 301: _seen(5)},
            first: {101: Seen(0, 0, 0, None, pending=True), 201: None, 301: None},
        }

    admin = _Scripted([look(n) for n in range(4)])
    report = run(admin.verify(recheck_delay_s=0, rechecks=3))
    assert report.chunks_checked == 5 and report.rechecked == 4 and report.ok is False
    assert [d["chunk_id"] for d in report.mismatch_details] == [rotten.hex()]
    assert report.mismatch_details[0]["targets"] == [201]
    assert len(report.busy) == 2 and busy.hex() in report.busy[0] and stuck.hex() in report.busy[1]
    assert "write in flight" in report.busy[1]
    assert not admin.looks  # three re-checks after the first look

    immediate = run(_Scripted([look(0)]).verify(rechecks=0))  # no second look: every difference counts
    assert {d["chunk_id"]: d["targets"] for d in immediate.mismatch_details} == {
        settles.hex(): [301], rotten.hex(): [201], busy.hex(): [101], stuck.hex(): [101]}

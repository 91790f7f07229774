"""The storage scrubber on an in-process cluster: a byte flipped on one replica's disk is found and
repaired with no client read; corruptions of different chunks on two replicas are both repaired; a
chunk corrupt on every replica is reported unrecoverable and left alone; a write racing a repair
is never lost; progress survives a restart; ``fs3 admin scrub status`` and the metrics report it."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fs3.common.config import load_config
from fs3.common.errors import InvalidArgument
from fs3.common.ids import chunk_id
from fs3.storage.chain_view import ChainMember
from fs3.storage.node import StorageNode
from fs3.storage.scrub import ChunkSnap, FindingKind, LocalVerdict, ScrubConfig
from fs3.storage.scrubber import TargetScrubber
from fs3.storage.server import StorageConfig
from tests.conftest import wait_until
from tests.inproc import InProcessCluster
from tests.test_verify import corrupt_chunk, lose_chunk_file

pytestmark = pytest.mark.slow  # in-process clusters

CHUNK_SIZE = 1 << 20
BIG = 300 * 1024  # a file per version
SMALL = 4 * 1024  # inline: a record in the target's RocksDB
TARGETS = (101, 201, 301)
FAST = ScrubConfig(chunks_per_s=100_000, tick_ms=10, pass_pause_ms=0)

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _node_of(cluster: InProcessCluster, target_id: int) -> StorageNode:
    return cluster.nodes[target_id // 100]


def raw_copies(cluster: InProcessCluster, cid: bytes) -> dict[int, bytes]:
    """Every replica's committed bytes of ``cid`` as its disk holds them (no CRC check)."""
    out = {}
    for tid in TARGETS:
        engine = _node_of(cluster, tid).engines[tid]
        state = engine.get(cid)
        assert state is not None
        out[tid] = engine.read(cid, state.commit_version, 0, state.length)
    return out


def scrubber(cluster: InProcessCluster, target_id: int, config: ScrubConfig = FAST) -> TargetScrubber:
    """A scrubber of ``target_id`` driven by the test (the cluster's own are off unless configured)."""
    node = _node_of(cluster, target_id)
    return TargetScrubber(node, target_id, config)


async def full_pass(s: TargetScrubber) -> None:
    passes = s.progress.passes_completed
    while s.progress.passes_completed == passes:
        s.budget.refill(1000)
        await s.step()


def _counter(s: TargetScrubber, name: str) -> float:
    assert s.metrics is not None
    metric = getattr(s.metrics, name)
    for family in metric.collect():
        for sample in family.samples:
            if sample.labels.get("target_id") == str(s.target_id) and sample.name.endswith("_total"):
                return float(sample.value)
    return 0.0


async def _write(cluster: InProcessCluster, chunks: dict[bytes, bytes], name: bytes = b"c1") -> None:
    """Write whole chunks as client ``name`` (a second writer needs its own name: a client's
    exactly-once channel would answer a new client of the same name as a retry)."""
    client = cluster.client(name)
    for cid, data in chunks.items():
        await client.write(cluster.chain_ids[0], cid, 0, data, CHUNK_SIZE)


def test_a_flipped_byte_is_found_and_repaired_in_the_background_without_a_client_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def body() -> None:
        config = ScrubConfig(chunks_per_s=2_000, tick_ms=20, pass_pause_ms=0)
        async with InProcessCluster(tmp_path, scrub_config=config) as cluster:
            big, small = chunk_id(7, 0), chunk_id(7, 1)
            data = {big: os.urandom(BIG), small: os.urandom(SMALL)}
            await _write(cluster, data)
            assert corrupt_chunk(cluster, 201, big) == "file"
            assert raw_copies(cluster, big)[201] != data[big]
            node = _node_of(cluster, 201)
            s = node.scrubbers[201]
            async def repaired() -> bool:
                return s.progress.repaired >= 1

            async def passed() -> bool:
                return s.progress.passes_completed >= 1

            await wait_until(repaired, timeout_s=20, what="the scrubber repaired the chunk")
            assert set(raw_copies(cluster, big).values()) == {data[big]}  # every replica, byte for byte
            assert set(raw_copies(cluster, small).values()) == {data[small]}
            got = await cluster.client().read(cluster.chain_ids[0], big, 0, BIG, verify_checksum=True)
            assert got[0] == data[big]
            assert _counter(s, "corruptions") >= 1 and _counter(s, "repaired") == 1
            assert _counter(s, "chunks") >= 2 and _counter(s, "unrecoverable") == 0
            finding = next(f for f in s.progress.findings if f.kind is FindingKind.REPAIRED)
            assert finding.chunk_id == big and finding.source_target_id in (101, 301)

            from fs3.cli.main import build_parser, run_admin

            await wait_until(passed, timeout_s=20, what="a full pass")
            base = ["admin", "--mgmtd", cluster.mgmtd_address, "--token", cluster.token]
            capsys.readouterr()
            assert await run_admin(build_parser().parse_args([*base, "--json", "scrub", "status"])) == 0
            out = json.loads(capsys.readouterr().out)
            rows = {t["target_id"]: t for t in out["targets"]}
            assert set(rows) == set(TARGETS) and not out["unreachable"]
            assert rows[201]["repaired"] == 1 and rows[201]["enabled"] and rows[201]["passes_completed"] >= 1
            assert rows[201]["findings"][0]["kind"] == "repaired"
            assert await run_admin(build_parser().parse_args([*base, "scrub", "status"])) == 0
            text = capsys.readouterr().out
            assert "REPAIRED" in text and big.hex() in text and "unrecoverable" in text
    run(body())


def test_corruption_of_different_chunks_on_two_replicas_is_all_repaired(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            a, b, clean, lost = chunk_id(8, 0), chunk_id(8, 1), chunk_id(8, 2), chunk_id(8, 3)
            data = {a: os.urandom(BIG), b: os.urandom(SMALL), clean: os.urandom(BIG), lost: os.urandom(BIG)}
            await _write(cluster, data)
            assert corrupt_chunk(cluster, 101, a) == "file"  # the head's copy of a
            assert corrupt_chunk(cluster, 301, b, offset=9) == "kv"  # the tail's copy of b
            lose_chunk_file(cluster, 201, lost)  # a file gone is repaired too
            for tid in TARGETS:
                await full_pass(scrubber(cluster, tid))
            for cid, content in data.items():
                assert set(raw_copies(cluster, cid).values()) == {content}, cid.hex()
            clean_pass = scrubber(cluster, 201)  # counters persist: the first pass found the lost file
            assert (clean_pass.progress.corruptions, clean_pass.progress.repaired) == (1, 1)
            await full_pass(clean_pass)
            assert (clean_pass.progress.corruptions, clean_pass.progress.passes_completed) == (1, 2)
            assert not _node_of(cluster, 201).failed_targets  # a lost file is repaired, not a failed disk
    run(body())


def test_a_chunk_corrupt_on_every_replica_is_unrecoverable_and_left_alone(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            cid = chunk_id(9, 0)
            await _write(cluster, {cid: os.urandom(BIG)})
            for tid in TARGETS:
                corrupt_chunk(cluster, tid, cid, offset=100 + tid)
            before = raw_copies(cluster, cid)
            s = scrubber(cluster, 201)
            await full_pass(s)
            await full_pass(s)  # a second pass reports it again in its findings but counts it once
            assert raw_copies(cluster, cid) == before  # bytes not changed anywhere
            assert s.progress.unrecoverable == 1 and s.progress.repaired == 0 and s.progress.corruptions == 2
            kinds = {f.kind for f in s.progress.findings}
            assert kinds == {FindingKind.UNRECOVERABLE}
            status = _node_of(cluster, 201).scrub_status()
            assert status.targets[0].target_id == 201 and status.targets[0].unrecoverable == 0  # its own scrubber
    run(body())


def test_a_write_racing_the_repair_is_never_lost(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path) as cluster:
            cid = chunk_id(10, 0)
            await _write(cluster, {cid: os.urandom(BIG)})
            corrupt_chunk(cluster, 201, cid)
            newer = os.urandom(BIG)
            s = scrubber(cluster, 201)
            original_fetch = s.fetch

            async def fetch_then_write(source: ChainMember, chain_id: int, chunk: bytes,
                                       bad: ChunkSnap) -> bytes | None:
                good_old = await original_fetch(source, chain_id, chunk, bad)
                assert good_old is not None  # the good copy of the old version, as the repair would install
                await _write(cluster, {cid: newer}, b"racer")  # commits on every replica before the install
                return good_old

            s.fetch = fetch_then_write  # type: ignore[method-assign, assignment]
            assert await s.check(cid) is LocalVerdict.CORRUPT
            assert s.progress.findings[-1].kind is FindingKind.SUPERSEDED and s.progress.repaired == 0
            assert set(raw_copies(cluster, cid).values()) == {newer}
            got = await cluster.client().read(cluster.chain_ids[0], cid, 0, BIG, verify_checksum=True)
            assert got[0] == newer

            # A write in flight (the chunk lock held) makes the chunk busy: not judged, not repaired.
            corrupt_chunk(cluster, 201, cid)
            replica = _node_of(cluster, 201).replicas[201]
            async with replica.hold_chunk(cid):
                assert await s.check(cid) is LocalVerdict.BUSY
            s.fetch = original_fetch  # type: ignore[method-assign]
            assert await s.check(cid) is LocalVerdict.CORRUPT
            assert set(raw_copies(cluster, cid).values()) == {newer}
    run(body())


def test_a_repair_cancelled_mid_write_leaves_the_old_copy_whole_and_no_stray_blob(tmp_path: Path) -> None:
    """Shutdown cancels a scrubber while its repair copy is being written on the I/O pool: the write
    finishes, the new blob is deleted, the committed copy is untouched; the next scrub repairs it."""
    import threading
    import time

    async def body() -> None:
        async with InProcessCluster(tmp_path, io_threads=2) as cluster:
            cid = chunk_id(12, 0)
            data = os.urandom(BIG)
            await _write(cluster, {cid: data})
            corrupt_chunk(cluster, 201, cid)
            engine = _node_of(cluster, 201).engines[201]
            state = engine.get(cid)
            corrupt = raw_copies(cluster, cid)[201]
            writing = threading.Event()
            written_blobs: list[int] = []
            original_write = engine.write_blob

            def slow_write(chunk: bytes, blob: int, content: bytes | memoryview) -> None:
                writing.set()
                time.sleep(0.3)  # on an I/O thread: the cancellation arrives meanwhile
                original_write(chunk, blob, content)
                written_blobs.append(blob)

            engine.write_blob = slow_write  # type: ignore[method-assign, assignment]
            s = scrubber(cluster, 201)
            task = asyncio.create_task(s.check(cid))
            while not writing.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert written_blobs, "the blob write ran to its end before the cancellation took effect"
            assert engine.get(cid) is state  # nothing installed
            assert raw_copies(cluster, cid)[201] == corrupt
            blob_dir = tmp_path / "n2" / "t1" / "chunks" / cid.hex()[-2:]
            assert not (blob_dir / f"{cid.hex()}.{written_blobs[0]}").exists()  # the stray copy is gone
            engine.write_blob = original_write  # type: ignore[method-assign]
            assert await scrubber(cluster, 201).check(cid) is LocalVerdict.CORRUPT
            assert set(raw_copies(cluster, cid).values()) == {data}
    run(body())


def test_progress_survives_a_restart_and_the_rate_bounds_each_step(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_nodes=1, replicas=1) as cluster:
            await _write(cluster, {chunk_id(11, i): os.urandom(SMALL) for i in range(10)})
            config = ScrubConfig(chunks_per_s=30, tick_ms=100)  # 3 chunks a tick
            s = scrubber(cluster, 101, config)
            s.budget.refill(100)
            assert await s.step() == 3
            assert await s.step() == 0  # no budget left until the next tick
            s.budget.refill(100)
            assert await s.step() == 3
            s.save()
            resumed = scrubber(cluster, 101, config)  # as a restarted node reads it
            assert resumed.progress.position == s.progress.position and resumed.progress.pass_chunks == 6
            await full_pass(resumed)
            assert resumed.progress.passes_completed == 1 and resumed.progress.chunks_scanned == 10
    run(body())


def test_a_negative_rate_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    toml = tmp_path / "storage.toml"
    toml.write_text('[[targets]]\ntarget_id = 1\npath = "/tmp/x"\n\n[scrub]\nbytes_per_s = -1\n')
    with pytest.raises(InvalidArgument, match="scrub bytes_per_s must be within"):
        load_config(StorageConfig, str(toml), env_prefix="FS3_STORAGE", environ={})
    with pytest.raises(InvalidArgument, match="scrub chunks_per_s"):
        TargetScrubber(None, 1, ScrubConfig(chunks_per_s=-3))  # type: ignore[arg-type]



# -- the long scenario: ``make scrub-demo`` -----------------------------------------------------------

DEMO_CHUNKS = int(os.environ.get("FS3_SCRUB_DEMO_CHUNKS", "0"))


@pytest.mark.skipif(DEMO_CHUNKS <= 0, reason="the long scenario: make scrub-demo (FS3_SCRUB_DEMO_CHUNKS)")
def test_scrub_demo_rot_under_load(tmp_path: Path) -> None:
    """Many chunks, a writer rewriting some of them all along, and bytes flipped on random replicas of
    the others (never every replica of one chunk) while the background scrubbers run at their rate:
    every corruption is repaired, every replica ends byte-identical, every write reads back."""
    import random

    async def body() -> None:
        seed = int(os.environ.get("FS3_SCRUB_DEMO_SEED", "1"))
        rng = random.Random(seed)
        print(f"scrub demo: seed {seed} (FS3_SCRUB_DEMO_SEED replays the same corruptions), {DEMO_CHUNKS} chunks")
        config = ScrubConfig(chunks_per_s=400, bytes_per_s=32 << 20, tick_ms=50, pass_pause_ms=200)
        async with InProcessCluster(tmp_path, scrub_config=config, io_threads=2) as cluster:
            cold = {chunk_id(20, i): os.urandom(rng.choice((SMALL, BIG))) for i in range(DEMO_CHUNKS)}
            hot = {chunk_id(21, i): os.urandom(BIG if i % 2 else SMALL) for i in range(8)}  # each keeps its size
            await _write(cluster, {**cold, **hot})
            stop = asyncio.Event()
            writes = 0

            async def writer() -> None:
                nonlocal writes
                client = cluster.client(b"demo-writer")
                while not stop.is_set():
                    cid = rng.choice(list(hot))
                    hot[cid] = os.urandom(len(hot[cid]))
                    await client.write(cluster.chain_ids[0], cid, 0, hot[cid], CHUNK_SIZE)
                    writes += 1
                    await asyncio.sleep(0.01)

            task = asyncio.create_task(writer())
            flipped: dict[bytes, set[int]] = {}
            try:
                for _ in range(max(4, DEMO_CHUNKS // 5)):
                    cid = rng.choice(list(cold))
                    bad = flipped.setdefault(cid, set())
                    choices = [t for t in TARGETS if t not in bad]
                    if len(choices) <= 1:
                        continue  # keep one good copy of every chunk
                    tid = rng.choice(choices)
                    corrupt_chunk(cluster, tid, cid, offset=rng.randrange(len(cold[cid])))
                    bad.add(tid)
                    await asyncio.sleep(rng.random() * 0.05)
                expected = sum(len(t) for t in flipped.values())

                async def all_repaired() -> bool:
                    return sum(n.scrubbers[t].progress.repaired for n in cluster.nodes.values()
                               for t in n.scrubbers) >= expected

                await wait_until(all_repaired, timeout_s=600, interval_s=0.5, what="every corruption repaired")
            finally:
                stop.set()
                await task
            for cid, content in {**cold, **hot}.items():
                assert set(raw_copies(cluster, cid).values()) == {content}, cid.hex()
            report = await cluster.admin().verify()
            assert report.ok and not report.busy, report.as_dict()
            rows, _ = await cluster.admin().scrub_status()
            print(f"scrub demo: {expected} corrupt copies repaired under {writes} writes; "
                  + ", ".join(f"t{r.target_id}: {r.passes_completed} passes {r.chunks_scanned} chunks "
                              f"{r.repaired} repaired" for r in rows))
            assert sum(r.unrecoverable for r in rows) == 0
    run(body())

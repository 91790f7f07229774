"""A storage target's chunk metadata, chunk files and exactly-once records through a power loss.

A child process runs one target's chunk engine — RocksDB and chunk files, every commit synced the
way the replica syncs before it acknowledges — on CrashFS, and reports each update before it
starts and once it is acknowledged. It is killed in the middle of its work and the power is cut.
The reopened target must hold every acknowledged version byte for byte (or the update that was in
flight), an exactly-once record for every acknowledged request (a retry must be answered, not run
again), and no leftover that a later, larger version of a chunk could be confused with. The same
run with a sabotaged sync (log, files, directory entries) must be caught.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from fs3.common.checksum import crc32c
from fs3.common.faults import SABOTAGE_ENV
from fs3.kv.store import RocksKVStore
from fs3.storage.blobs import FileBlobStore
from fs3.storage.chunk_engine import ChunkEngine

pytestmark = pytest.mark.slow

_INLINE_MAX_BYTES = 4096
_CLIENT = b"client-1"

# The target's side: a seeded stream of updates, each announced ("begin", with the state it will
# leave) and acknowledged ("ack") on stdout, the way a replica would answer a client.
_TARGET = r"""
import hashlib, json, random, sys
from fs3.common.checksum import crc32c, crc32c_patch
from fs3.kv.store import RocksKVStore
from fs3.storage.blobs import FileBlobStore
from fs3.storage.chunk_engine import ChunkEngine

root, seed, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = ChunkEngine(RocksKVStore(root + "/meta"), FileBlobStore(root + "/chunks"), inline_max_bytes=4096)
rng = random.Random(seed)
contents = {}
seqs = {}

def say(**message):
    print(json.dumps(message), flush=True)

for step in range(steps):
    chunk = b"chunk-%d" % rng.randrange(6)
    channel_id = rng.randrange(1, 4)
    seqs[channel_id] = seqs.get(channel_id, 0) + 1
    channel = (b"client-1", channel_id, seqs[channel_id])
    old = contents.get(chunk)
    kinds = ["write", "write-deferred", "write-blob", "remove"] + (["patch", "patch-deferred"] if old else [])
    kind = rng.choice(kinds)
    version = engine.new_version()
    if kind == "remove":
        new = None
    elif kind.startswith("patch"):
        offset = rng.randrange(len(old))
        piece = rng.randbytes(min(rng.randrange(1, 300), len(old) - offset))
        new = old[:offset] + piece + old[offset + len(piece):]
    else:
        new = rng.randbytes(rng.choice([50, 3000, 9000, 70000]) if kind != "write-blob" else 70000)
    say(begin=step, chunk=chunk.hex(), version=version, channel=channel_id, seq=channel[2],
        sha=hashlib.sha256(new).hexdigest() if new is not None else None)
    if kind == "remove":
        engine.stage(chunk, version, None, 0, 1, channel)
        engine.commit(chunk, version, 1)
    elif kind == "write":
        engine.stage(chunk, version, new, crc32c(new), 1, channel)
        engine.commit(chunk, version, 1)
    elif kind == "write-deferred":  # the replica's group commit
        engine.stage(chunk, version, new, crc32c(new), 1, channel)
        engine.commit(chunk, version, 1, defer_sync=True)
        engine.sync_log()
    elif kind == "write-blob":  # a large write done on the I/O pool
        blob = engine.new_blob()
        engine.write_blob(chunk, blob, new)
        engine.stage(chunk, version, new, crc32c(new), 1, channel, written_blob=blob)
        engine.commit(chunk, version, 1, defer_sync=True)
        engine.sync_log()
    else:
        checksum = crc32c_patch(crc32c(old), len(old), offset, old[offset:offset + len(piece)], piece)
        deferred = kind == "patch-deferred"
        engine.stage_patch(chunk, version, offset, piece, old[offset:offset + len(piece)], checksum, 1, channel,
                           defer_sync=deferred)
        if deferred:
            engine.sync_log()
        engine.commit(chunk, version, 1, defer_sync=deferred, patch_synced=deferred)
        if deferred:
            engine.sync_log()
    contents[chunk] = new
    say(ack=step)
sys.stdin.read()  # (killed before it gets here, unless the run is short)
"""


@dataclass
class _Update:
    step: int
    chunk: bytes
    version: int
    channel: int
    seq: int
    sha: str | None  # None: a removal


def _state(engine: ChunkEngine, chunk: bytes) -> tuple[int, str | None]:
    state = engine.get(chunk)
    if state is None:
        return 0, None
    data = engine.read(chunk, state.commit_version, 0, state.length)
    return state.commit_version, hashlib.sha256(data).hexdigest()


def _power_loss_run(disk: Any, seed: int, kill_after_acks: int, sabotage: str = "") -> list[str]:
    """Run the target until it acknowledged ``kill_after_acks`` updates, kill it mid-stream, cut the
    power, reopen it; returns every way the reopened target contradicts what it acknowledged."""
    root = disk.path / "target"
    env = {**os.environ, SABOTAGE_ENV: sabotage}
    child = subprocess.Popen([sys.executable, "-c", _TARGET, str(root), str(seed), "80"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
    assert child.stdout is not None
    acked = 0
    lines: list[bytes] = []
    while acked < kill_after_acks:
        line = child.stdout.readline()
        assert line, "the target died on its own"
        lines.append(line)
        acked += b'"ack"' in line
    child.kill()
    child.wait()
    lines += child.stdout.read().splitlines()  # everything it said before it died was said
    child.stdout.close()
    disk.power_cut()

    updates: dict[int, _Update] = {}
    acknowledged: list[_Update] = []
    for raw in lines:
        message = json.loads(raw)
        if "begin" in message:
            updates[message["begin"]] = _Update(message["begin"], bytes.fromhex(message["chunk"]), message["version"],
                                                message["channel"], message["seq"], message["sha"])
        else:
            acknowledged.append(updates.pop(message["ack"]))
    in_flight = list(updates.values())  # at most one: the target works on one update at a time

    problems: list[str] = []
    engine = ChunkEngine(RocksKVStore(root / "meta"), FileBlobStore(root / "chunks"),
                         inline_max_bytes=_INLINE_MAX_BYTES)
    try:
        last: dict[bytes, _Update] = {u.chunk: u for u in acknowledged}
        for chunk in {u.chunk for u in acknowledged + in_flight}:
            allowed: set[tuple[int, str | None]] = {(0, None)}
            if chunk in last:
                allowed = {(last[chunk].version, last[chunk].sha) if last[chunk].sha else (0, None)}
            allowed |= {(u.version, u.sha) if u.sha else (0, None) for u in in_flight if u.chunk == chunk}
            try:
                found = _state(engine, chunk)
            except Exception as exc:
                problems.append(f"{chunk!r}: unreadable after the power loss: {exc!r}")
                continue
            if found not in allowed:
                problems.append(f"{chunk!r}: holds v{found[0]}, acknowledged {sorted(allowed, key=str)}")
        last_seq: dict[int, _Update] = {u.channel: u for u in acknowledged}
        for channel_id, update in last_seq.items():
            record = engine.channel(_CLIENT, channel_id)
            allowed_seqs = {update.seq} | {u.seq for u in in_flight if u.channel == channel_id}
            if record is None or record.seq not in allowed_seqs:
                problems.append(f"channel {channel_id}: record {record}, acknowledged seq {update.seq}: "
                                "a retry would run again")
            elif record.seq == update.seq and record.commit_version != (update.version if update.sha else 0):
                problems.append(f"channel {channel_id}: record answers v{record.commit_version}, "
                                f"acknowledged v{update.version}")
        # Each chunk removed, then written anew larger than the inline limit, then small again:
        # whatever a power loss left behind must never be read in place of the new bytes.
        for index in range(6):
            chunk = b"chunk-%d" % index
            for data in (os.urandom(_INLINE_MAX_BYTES * 3), os.urandom(100)):
                if engine.get(chunk) is not None:
                    version = engine.new_version()
                    engine.stage(chunk, version, None, 0, 1)
                    engine.commit(chunk, version, 1)
                version = engine.new_version()
                engine.stage(chunk, version, data, crc32c(data), 1)
                engine.commit(chunk, version, 1)
                if engine.read(chunk, version, 0, len(data)) != data:
                    problems.append(f"{chunk!r}: a rewritten version reads back other bytes")
    finally:
        engine.close()
    return problems


@pytest.mark.parametrize("seed", [1, 2])
def test_a_target_keeps_what_it_acknowledged_through_a_power_loss(crash_disk: Any, seed: int) -> None:
    assert _power_loss_run(crash_disk, seed, kill_after_acks=25 + 7 * seed) == []


@pytest.mark.parametrize("sabotage", ["kv-sync", "file-sync", "dir-sync"])
def test_the_power_loss_check_catches_a_sabotaged_sync(crash_disk: Any, sabotage: str) -> None:
    """Proof that the check above can fail: the log, the chunk files or their directory entries
    left unsynced lose acknowledged versions or records."""
    assert _power_loss_run(crash_disk, 1, kill_after_acks=32, sabotage=sabotage)

"""A client workload for chaos runs: concurrent writers and readers on slots of a few files.

Run inside a client host: ``python -m tests.chaos.workload MGMTD TOKEN SECONDS OUT.json``. Every
write stores a unique id in one 4 KiB slot (the id repeated, so a torn slot shows); every read
observes one slot straight from storage. Each operation is recorded with its invocation and
completion times (CLOCK_MONOTONIC, shared by every namespace on the machine) for the
linearizability check; at the end every slot is read back once more for the ledger check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from typing import Any

import fs3.aio
from fs3.cli.cluster import tls_from_env
from fs3.sim.history import decode_slots, encode_slot

SLOT = 4096
SLOTS = 32
FILES = 3
WRITERS = 2
READERS = 2


async def run(mgmtd: str, token: str, seconds: float, out: str) -> None:
    fs = await fs3.aio.connect(mgmtd, token=token, retry_total_ms=120_000, tls=tls_from_env())
    await fs.makedirs("/chaos", exist_ok=True)
    await fs.set_layout("/chaos", chunk_size=65536)
    for i in range(FILES):
        await fs.write_bytes(f"/chaos/f{i}", bytes(SLOT * SLOTS))
    ops: list[dict[str, Any]] = []
    stop = time.monotonic() + seconds

    async def writer(wid: int) -> None:
        rng = random.Random(wid)
        handles = [await fs.open(f"/chaos/f{i}", "r+b") for i in range(FILES)]
        seq = 0
        while time.monotonic() < stop:
            seq += 1
            file, slot = rng.randrange(FILES), rng.randrange(SLOTS)
            value = (wid + 1) << 32 | seq
            op = {"kind": "write", "file": file, "slot": slot, "value": value, "invoke": time.monotonic(),
                  "complete": None, "ok": False}
            ops.append(op)
            try:
                await handles[file].pwrite(slot * SLOT, encode_slot(value, SLOT))
                await handles[file].flush()
                op["complete"], op["ok"] = time.monotonic(), True
            except OSError as exc:
                op["error"] = str(exc)
        for handle in handles:
            with contextlib.suppress(OSError):
                await handle.close()

    async def reader(rid: int) -> None:
        rng = random.Random(1000 + rid)
        handles = [await fs.open(f"/chaos/f{i}", "rb") for i in range(FILES)]
        while time.monotonic() < stop:
            file, slot = rng.randrange(FILES), rng.randrange(SLOTS)
            op = {"kind": "read", "file": file, "slot": slot, "invoke": time.monotonic(), "complete": None,
                  "ok": False}
            ops.append(op)
            try:
                data = await handles[file].pread(slot * SLOT, SLOT, readahead=False)
                op["observed"] = decode_slots(data, 1, SLOT)[0]
                op["complete"], op["ok"] = time.monotonic(), True
            except OSError as exc:
                op["error"] = str(exc)
        for handle in handles:
            await handle.close()

    await asyncio.gather(*(writer(w) for w in range(WRITERS)), *(reader(r) for r in range(READERS)))
    final: dict[str, list[int | None]] = {}
    for i in range(FILES):
        final[str(i)] = decode_slots(await fs.read_bytes(f"/chaos/f{i}"), SLOTS, SLOT)
    await fs.close()
    with open(out, "w") as f:
        json.dump({"ops": ops, "final": final, "slots": SLOTS, "files": FILES}, f)


if __name__ == "__main__":
    import uvloop

    uvloop.run(run(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]))

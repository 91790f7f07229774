"""A client workload for chaos runs: concurrent writers and readers on slots of a few files.

Run inside a client host: ``python -m tests.chaos.workload MGMTD TOKEN SECONDS OUT.json``. Every
write stores a unique id in one 4 KiB slot (the id repeated, so a torn slot shows); every read
observes one slot straight from storage. Each operation is recorded with its invocation and
completion times (CLOCK_MONOTONIC, shared by every namespace on the machine) for the
linearizability check; at the end every slot is read back once more for the ledger check.

With a fifth argument ``namespace`` it also runs metadata operations (the meta servers' ledger):
workers create small files of their own under ``/chaos/ns`` (each holding its own name) and remove
every third one they created; at the end the directory is listed and every file read back, so
:func:`tests.chaos.cluster.check_namespace` can tell an acknowledged create or remove that was lost.
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
NAMESPACE_WORKERS = 3
NS_DIR = "/chaos/ns"


async def run(mgmtd: str, token: str, seconds: float, out: str, namespace: bool = False) -> None:
    fs = await fs3.aio.connect(mgmtd, token=token, retry_total_ms=120_000, tls=tls_from_env())
    await fs.makedirs("/chaos", exist_ok=True)
    if namespace:
        await fs.makedirs(NS_DIR, exist_ok=True)
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
                op["error"], op["errno"] = str(exc), exc.errno
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
                op["error"], op["errno"] = str(exc), exc.errno
        for handle in handles:
            await handle.close()

    ns_ops: list[dict[str, Any]] = []

    async def namespace_worker(wid: int) -> None:
        # A client of its own: clients spread over the meta servers by their ids.
        own = await fs3.aio.connect(mgmtd, token=token, retry_total_ms=120_000, tls=tls_from_env())
        try:
            await namespace_ops(own, wid)
        finally:
            await own.close()

    async def namespace_ops(fs: fs3.aio.AsyncFileSystem, wid: int) -> None:
        created: list[str] = []
        seq = 0
        while time.monotonic() < stop:
            seq += 1
            remove = seq % 3 == 0 and bool(created)
            name = created.pop(0) if remove else f"w{wid}-{seq}"
            op = {"kind": "remove" if remove else "create", "name": name, "invoke": time.monotonic(),
                  "complete": None, "ok": False}
            ns_ops.append(op)
            try:
                if remove:
                    await fs.remove(f"{NS_DIR}/{name}")
                else:
                    await fs.write_bytes(f"{NS_DIR}/{name}", name.encode())
                    created.append(name)
                op["complete"], op["ok"] = time.monotonic(), True
            except OSError as exc:
                op["error"], op["errno"] = str(exc), exc.errno

    await asyncio.gather(*(writer(w) for w in range(WRITERS)), *(reader(r) for r in range(READERS)),
                         *(namespace_worker(n) for n in range(NAMESPACE_WORKERS if namespace else 0)))
    final: dict[str, list[int | None]] = {}
    for i in range(FILES):
        final[str(i)] = decode_slots(await fs.read_bytes(f"/chaos/f{i}"), SLOTS, SLOT)
    result: dict[str, Any] = {"ops": ops, "final": final, "slots": SLOTS, "files": FILES}
    if namespace:
        contents = {name: (await fs.read_bytes(f"{NS_DIR}/{name}")).decode(errors="replace")
                    for name in await fs.listdir(NS_DIR)}
        result["namespace"] = {"ops": ns_ops, "final": contents}
    await fs.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    import uvloop

    uvloop.run(run(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4],
                   namespace=sys.argv[5:6] == ["namespace"]))

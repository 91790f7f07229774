"""Files for ``make rolling-upgrade``: written before the upgrade, read back after it.

Run on a client host as a script (``python -P tests/chaos/upgrade_files.py ...``), under whichever
release's code ``PYTHONPATH`` names: it imports only what every release since the previous one
has (``fs3.aio``, ``fs3.cli.cluster.tls_from_env``), never this repository's ``tests`` package.

* ``write MGMTD TOKEN COUNT OUT.json``: COUNT files of 1 B..300 KiB (seeded), each recorded with
  its size and SHA-256 once its write is acknowledged (closed).
* ``read MGMTD TOKEN IN.json OUT.json``: read every file IN.json lists; records what it read (or
  the error). ``--corrupt`` first overwrites one byte of the first file: the sabotage that shows
  the verification catching a lost write.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
from typing import Any

import fs3.aio
from fs3.cli.cluster import tls_from_env

DIRECTORY = "/upgrade"


async def write(mgmtd: str, token: str, count: int, out: str) -> None:
    fs = await fs3.aio.connect(mgmtd, token=token, retry_total_ms=120_000, tls=tls_from_env())
    await fs.makedirs(DIRECTORY, exist_ok=True)
    rng = random.Random(24)
    written: dict[str, dict[str, Any]] = {}
    for index in range(count):
        data = rng.randbytes(rng.choice([1, 4096, 65536 + 7, rng.randrange(1, 300 * 1024)]))
        path = f"{DIRECTORY}/f{index}"
        await fs.write_bytes(path, data)
        written[path] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    await fs.close()
    with open(out, "w") as f:
        json.dump(written, f)


async def read(mgmtd: str, token: str, expected_file: str, out: str, corrupt: bool) -> None:
    with open(expected_file) as f:
        expected: dict[str, Any] = json.load(f)
    fs = await fs3.aio.connect(mgmtd, token=token, retry_total_ms=60_000, tls=tls_from_env())
    if corrupt and expected:
        first = sorted(expected)[0]
        handle = await fs.open(first, "r+b")
        old = await handle.pread(0, 1)
        await handle.pwrite(0, bytes([old[0] ^ 0xFF]) if old else b"x")
        await handle.close()
    observed: dict[str, dict[str, Any]] = {}
    for path in expected:
        try:
            data = await fs.read_bytes(path)
            observed[path] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        except OSError as exc:
            observed[path] = {"error": str(exc)}
    await fs.close()
    with open(out, "w") as f:
        json.dump(observed, f)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        asyncio.run(write(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]))
    else:
        asyncio.run(read(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], corrupt="--corrupt" in sys.argv))

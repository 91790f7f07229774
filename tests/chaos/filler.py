"""Fill the cluster with one big file until storage keeps saying it is full (or remove it again).

``python -m tests.chaos.filler MGMTD TOKEN fill|remove [MIB]`` on the client host.
"""

from __future__ import annotations

import asyncio
import errno
import os
import sys

import fs3.aio
from fs3.cli.cluster import tls_from_env

PATH = "/chaos-fill/big"
_REFUSALS = 5
_REFUSAL_PAUSE_S = 0.2


async def main(mgmtd: str, token: str, action: str, mib: int) -> None:
    fs = await fs3.aio.connect(mgmtd, token=token, retry_total_ms=10_000, tls=tls_from_env())
    try:
        if action == "remove":
            await fs.remove(PATH)
            return
        await fs.makedirs("/chaos-fill", exist_ok=True)
        await fs.set_layout("/chaos-fill", chunk_size=65536)  # fill to the last 64 KiB
        f = await fs.open(PATH, "wb")
        refused = written = 0
        try:
            # Full means refused again and again for a second, not one refusal that space freed by a
            # compaction a moment later would lift: the disk stays full until the file is removed.
            while written < mib and refused < _REFUSALS:
                try:
                    # Incompressible: storage keeps small chunks in RocksDB, whose table files are
                    # compressed; zeros would never fill the disk.
                    await f.write(os.urandom(1 << 20))
                    await f.flush()
                    written, refused = written + 1, 0
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EIO):
                        raise
                    refused += 1
                    print(f"filler refused ({refused}): {exc}", flush=True)
                    await asyncio.sleep(_REFUSAL_PAUSE_S)
            print(f"filler stopped after {written} MiB, {refused} refusals in a row", flush=True)
        finally:
            try:
                await f.close()
            except OSError as exc:
                print(f"filler close: {exc}", flush=True)
    finally:
        await fs.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 0))

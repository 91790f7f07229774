"""Fill the cluster with one big file until storage says it is full (or remove it again).

``python -m tests.chaos.filler MGMTD TOKEN fill|remove [MIB]`` on the client host.
"""

from __future__ import annotations

import asyncio
import errno
import sys

import fs3.aio

PATH = "/chaos-fill/big"


async def main(mgmtd: str, token: str, action: str, mib: int) -> None:
    fs = await fs3.aio.connect(mgmtd, token=token, retry_total_ms=10_000)
    try:
        if action == "remove":
            await fs.remove(PATH)
            return
        await fs.makedirs("/chaos-fill", exist_ok=True)
        await fs.set_layout("/chaos-fill", chunk_size=65536)  # fill to the last 64 KiB
        f = await fs.open(PATH, "wb")
        try:
            for _ in range(mib):
                await f.write(bytes(1 << 20))
            await f.flush()
        except OSError as exc:
            print(f"filler stopped: {exc}", flush=True)
            if exc.errno not in (errno.ENOSPC, errno.EIO):
                raise
        finally:
            try:
                await f.close()
            except OSError as exc:
                print(f"filler close: {exc}", flush=True)
    finally:
        await fs.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 0))

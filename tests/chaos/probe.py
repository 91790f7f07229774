"""Measure how long a storage node keeps serving after it lost mgmtd (the lease, against split brain).

``python -m tests.chaos.probe ADDRESS TOKEN SECONDS OUT.json`` on the client host: reads from every
chain of the node every 50 ms and records the first time each answer is LEASE_EXPIRED (or any
refusal), measured from the probe's start, which the caller aligns with the partition.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from fs3 import storage_pb2 as spb
from fs3.cli.cluster import tls_from_env
from fs3.common.errors import FS3Error, StatusCode
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.methods import service_spec

_READ = service_spec("Storage").method("Read")


async def main(address: str, token: str, seconds: float, out: str) -> None:
    channels = RealChannelFactory(token, tls=tls_from_env())
    start = time.monotonic()
    refused_at: float | None = None
    last_ok: float | None = None
    code = ""
    try:
        while time.monotonic() - start < seconds and refused_at is None:
            for chain_id in (1, 2):
                try:
                    await channels.get(address).call(_READ, spb.ReadReq(chain_id=chain_id, chunk_id=b"probe-chunk",
                                                                         length=1), timeout_ms=2_000)
                    last_ok = time.monotonic() - start
                except FS3Error as exc:
                    if exc.code in (StatusCode.LEASE_EXPIRED, StatusCode.TARGET_NOT_SERVING):
                        refused_at, code = time.monotonic() - start, exc.code.name
                        break
            await asyncio.sleep(0.05)
    finally:
        await channels.close()
    with open(out, "w") as f:
        json.dump({"refused_after_s": refused_at, "last_ok_s": last_ok, "code": code}, f)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]))

"""Whether a meta server answers reads while it cannot reach its database (no stale reads).

``python -m tests.chaos.meta_probe ADDRESS TOKEN PATH SECONDS OUT.json`` on the client host: looks up
PATH on that one meta server every 100 ms (each with a 1 s timeout) and records every attempt with
its invocation and completion times (CLOCK_MONOTONIC, which the harness's own times share) and its
outcome: ``ok``, an answer that is an error of the namespace (``NOT_FOUND``: also read from the
database), or a failure to answer (a timeout, unavailable). The harness then checks that nothing
invoked while the server was cut off from the database was answered.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from fs3 import meta_pb2 as mpb
from fs3.cli.cluster import tls_from_env
from fs3.client.meta import path_ref
from fs3.common.errors import FS3Error, StatusCode
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.methods import service_spec

_LOOKUP = service_spec("Meta").method("Lookup")
# Answers the server can only give after reading its database.
_ANSWERS = (StatusCode.NOT_FOUND,)


async def main(address: str, token: str, path: str, seconds: float, out: str) -> None:
    channels = RealChannelFactory(token, tls=tls_from_env())
    req = mpb.LookupReq(ctx=mpb.ReqCtx(user=mpb.User(uid=0, gid=0)), target=path_ref(path.encode()))
    attempts: list[dict[str, Any]] = []
    stop = time.monotonic() + seconds
    try:
        while time.monotonic() < stop:
            attempt: dict[str, Any] = {"invoke": time.monotonic(), "answered": False, "outcome": "ok"}
            try:
                await channels.get(address).call(_LOOKUP, req, timeout_ms=1_000)
                attempt["answered"] = True
            except FS3Error as exc:
                attempt["outcome"] = exc.code.name
                attempt["answered"] = exc.code in _ANSWERS
            attempt["complete"] = time.monotonic()
            attempts.append(attempt)
            await asyncio.sleep(0.1)
    finally:
        await channels.close()
    with open(out, "w") as f:
        json.dump({"address": address, "attempts": attempts}, f)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]))

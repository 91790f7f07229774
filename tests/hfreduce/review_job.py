"""One rank of a review job: ``python -m tests.hfreduce.review_job SCENARIO`` with torch's environment
variables; small chunks (4 KiB) and two slots so that every collective wraps the rings many times.

Prints one JSON line (``{"rank": .., "ok": .., ...}``). ``HFREDUCE_TEST_NODE`` groups ranks into nodes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

import hfreduce

CHUNK_SIZE_BYTES = 4096
CHUNK = CHUNK_SIZE_BYTES // 4  # float32 elements per chunk


def main() -> None:
    scenario = sys.argv[1]
    node = os.environ.get("HFREDUCE_TEST_NODE") or None
    timeout_s = float(os.environ.get("HFREDUCE_TEST_TIMEOUT_S", "20"))
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        comm = hfreduce.init(node=node, timeout_s=timeout_s, chunk_size_bytes=CHUNK_SIZE_BYTES, slots=2)
        world = comm.world_size
        if scenario == "idle":
            # A job that pauses longer than the timeout between collectives (a checkpoint, an evaluation).
            values = np.ones(3 * CHUNK + 1, dtype=np.float32)
            comm.allreduce(values)
            time.sleep(timeout_s * 1.5)
            comm.allreduce(values)
            assert (values == world * world).all()
        elif scenario == "straddle-mismatch":
            # Node 0 passes one whole chunk, the others one chunk and a bit: the first chunk agrees.
            count = CHUNK if comm.node_index == 0 else CHUNK + 5
            try:
                comm.allreduce(np.ones(count, dtype=np.float32))
            except hfreduce.HFReduceError as exc:
                result["error"] = str(exc)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        result["ok"] = True
    except Exception as exc:
        result["exception"] = f"{type(exc).__name__}: {exc}"
    finally:
        print(json.dumps(result), flush=True)
        hfreduce.destroy()


if __name__ == "__main__":
    main()

"""One rank of the validator's intra-node HFReduce allreduce (``python -m hai.allreduce_probe``).

:func:`hai.validate.check_allreduce` starts two of these on the node with torch's launcher
variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus ``HAI_PROBE_ELEMENTS``,
``HAI_PROBE_REPEATS`` and ``HAI_PROBE_TIMEOUT_S``. Each rank reduces float32 small integers, whose
sum is exact, so the result is compared bit for bit: a node whose shared memory or reduction is
broken fails even if it is fast. The rank prints one JSON line (``ok``, ``exact``, ``best_s``,
``error``) and leaves the job.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

import hfreduce

_VALUE_PERIOD = 1000  # element i of rank r holds (i mod 1000) + 7r: exact in float32 when summed


def rank_values(rank: int, elements: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """What rank ``rank`` contributes."""
    return (np.arange(elements, dtype=np.int64) % _VALUE_PERIOD + 7 * rank).astype(np.float32)


def expected_sum(world_size: int, elements: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """The exact elementwise sum over ranks, in float64."""
    base = (np.arange(elements, dtype=np.int64) % _VALUE_PERIOD).astype(np.float64)
    return base * world_size + 7.0 * sum(range(world_size))


def main() -> None:
    result: dict[str, Any] = {"rank": int(os.environ.get("RANK", "-1")), "ok": False}
    try:
        elements = int(os.environ["HAI_PROBE_ELEMENTS"])
        repeats = int(os.environ["HAI_PROBE_REPEATS"])
        comm = hfreduce.init(timeout_s=float(os.environ["HAI_PROBE_TIMEOUT_S"]))
        mine = rank_values(comm.rank, elements)
        expected = expected_sum(comm.world_size, elements)
        best_s = float("inf")
        exact = True
        for _ in range(repeats):
            data = mine.copy()
            comm.barrier()
            start = time.perf_counter()
            comm.allreduce(data, op=hfreduce.ReduceOp.SUM)
            best_s = min(best_s, time.perf_counter() - start)
            exact = exact and bool(np.array_equal(data.astype(np.float64), expected))
        result.update(exact=exact, best_s=best_s, ok=True)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        print(json.dumps(result), flush=True)
        hfreduce.destroy()


if __name__ == "__main__":
    main()

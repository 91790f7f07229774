"""One rank of a review job: ``python -m tests.hfreduce.review_job SCENARIO`` with torch's environment
variables; small chunks (4 KiB) and two slots so that every collective wraps the rings many times.

Prints one JSON line (``{"rank": .., "ok": .., ...}``). ``HFREDUCE_TEST_NODE`` groups ranks into nodes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

import hfreduce
from tests.hfreduce.runner import run_rank

CHUNK_SIZE_BYTES = 4096
CHUNK = CHUNK_SIZE_BYTES // 4  # float32 elements per chunk


def _reference(op: hfreduce.ReduceOp, stacked: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """What a collective gives for every rank's values (rows), in the storage dtype."""
    result: np.ndarray
    with np.errstate(all="ignore"):
        if op is hfreduce.ReduceOp.MAX:
            result = np.maximum.reduce(stacked, axis=0).astype(dtype)
        elif op is hfreduce.ReduceOp.MIN:
            result = np.minimum.reduce(stacked, axis=0).astype(dtype)
        elif dtype.kind == "i":
            result = np.add.reduce(stacked.astype(dtype), axis=0, dtype=dtype)  # wraps, like the kernels
        else:
            total = np.add.reduce(stacked.astype(np.float64), axis=0)
            if op is hfreduce.ReduceOp.AVG:
                total = total / stacked.shape[0]
            result = total.astype(dtype)
    return result


def stress(comm: hfreduce.Communicator) -> str:
    """Many collectives of every kind, dtype and size in flight at once, on private and registered
    memory, checked against references every rank computes for every rank; returns a digest."""
    import torch

    world, rank = comm.world_size, comm.rank
    rng = np.random.default_rng(7)  # the same program on every rank
    sizes = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 3, 3 * CHUNK + 7, 7 * CHUNK + 1]
    shared_count = 9 * CHUNK + 5
    shared = comm.shared_array(shared_count, np.float32)
    shared_bf16 = comm.shared_tensor((2 * CHUNK + 3,), torch.bfloat16)
    # Every rank's registered buffer as every rank expects it (they start as small integers).
    state = [np.random.default_rng([11, r]).integers(-40, 40, shared_count).astype(np.float32) for r in range(world)]
    shared[:] = state[rank]
    bf16_state = [np.random.default_rng([12, r]).integers(-40, 40, shared_bf16.numel()).astype(np.float32)
                  for r in range(world)]
    shared_bf16.copy_(torch.from_numpy(bf16_state[rank]))
    checks: list[tuple[str, Any, Any]] = []  # (what, buffer, expected)
    works: list[hfreduce.Work] = []
    digest = hashlib.sha256()
    ops = [hfreduce.ReduceOp.SUM, hfreduce.ReduceOp.AVG, hfreduce.ReduceOp.MAX, hfreduce.ReduceOp.MIN]
    for index in range(70):
        kind = int(rng.integers(0, 9))
        count = int(sizes[rng.integers(0, len(sizes))])
        salt = [index, kind, count]
        if kind <= 2:  # allreduce of a private buffer, any dtype and op
            dtype = np.dtype([np.float32, np.float64, np.float16, np.int32, np.int64][int(rng.integers(0, 5))])
            op = ops[int(rng.integers(0, 4))]
            if op is hfreduce.ReduceOp.AVG and dtype.kind == "i":
                op = hfreduce.ReduceOp.SUM
            high = 2**31 - 5 if dtype == np.int32 and index % 3 == 0 else 40  # int32 sums that wrap
            rows = np.stack([np.random.default_rng([*salt, r]).integers(-high, high, count) for r in range(world)])
            rows = rows.astype(dtype).astype(np.float64) if dtype.kind == "f" else rows
            if dtype.kind == "f" and count > 2 and index % 4 == 0:
                rows[0, 0], rows[world - 1, 1], rows[0, 2] = np.nan, np.inf, -np.inf
            expected = _reference(op, rows, dtype) if count else np.zeros(0, dtype)
            buffer = rows[rank].astype(dtype)
            works.append(comm.allreduce(buffer, op=op, async_op=True))
            checks.append((f"#{index} allreduce {op.name} {count} {dtype}", buffer, expected))
        elif kind == 3:  # bf16
            op = ops[int(rng.integers(0, 4))]
            rows = np.stack([np.random.default_rng([*salt, r]).integers(-40, 40, count) for r in range(world)])
            expected_t = torch.from_numpy(_reference(op, rows.astype(np.float64), np.dtype(np.float64))).to(
                torch.bfloat16)
            tensor = torch.from_numpy(rows[rank].astype(np.float32)).to(torch.bfloat16)
            works.append(comm.allreduce(tensor, op=op, async_op=True))
            checks.append((f"#{index} bf16 allreduce {op.name} {count}", tensor, expected_t))
        elif kind == 4:  # reduce_scatter
            block = count // world + 1
            rows = np.stack([np.random.default_rng([*salt, r]).integers(-40, 40, block * world) for r in range(world)])
            out = np.full(block, -7, dtype=np.int64)
            works.append(comm.reduce_scatter(out, rows[rank].astype(np.int64), async_op=True))
            checks.append((f"#{index} reduce_scatter {block}", out, rows.sum(axis=0)[rank * block:(rank + 1) * block]))
        elif kind == 5:  # all_gather
            piece = np.random.default_rng([*salt]).standard_normal((world, count)).astype(np.float32)
            out = np.full(count * world, 3.0, dtype=np.float32)
            works.append(comm.all_gather(out, piece[rank].copy(), async_op=True))
            checks.append((f"#{index} all_gather {count}", out, piece.reshape(-1)))
        elif kind == 6:  # broadcast
            src = int(rng.integers(0, world))
            data = np.random.default_rng([*salt]).standard_normal(count)
            buffer = data.copy() if rank == src else np.full(count, -0.0)
            works.append(comm.broadcast(buffer, src=src, async_op=True))
            checks.append((f"#{index} broadcast {count} from {src}", buffer, data))
        elif kind == 7:  # a slice of the registered buffer; some ranks pass a private copy instead
            start = int(rng.integers(0, shared_count))
            end = min(shared_count, start + count)
            op = ops[int(rng.integers(0, 4))]
            private = set() if index % 2 else {int(r) for r in rng.integers(0, world, 1)}
            result = _reference(op, np.stack([s[start:end] for s in state]), np.dtype(np.float32))
            if rank in private:
                buffer = state[rank][start:end].copy()
                checks.append((f"#{index} private copy of shared[{start}:{end}] {op.name}", buffer, result.copy()))
            else:
                buffer = shared[start:end]
            works.append(comm.allreduce(buffer, op=op, async_op=True))
            for r in range(world):
                if r not in private:
                    state[r][start:end] = result
        else:  # the registered bf16 tensor, whole, averaged
            rows = np.stack(bf16_state)
            result = torch.from_numpy(rows.sum(axis=0) / world).to(torch.bfloat16).float().numpy()
            works.append(comm.allreduce(shared_bf16, op=hfreduce.ReduceOp.AVG, async_op=True))
            bf16_state = [result.copy() for _ in range(world)]
    for work in works:
        work.wait()
    for what, got, expected in checks:
        if isinstance(got, torch.Tensor):
            got_bits = got.view(torch.int16).numpy()
            assert np.array_equal(got_bits, expected.view(torch.int16).numpy()), (
                f"{what}: {got[:4]} != {expected[:4]}")
            digest.update(got_bits.tobytes())
            continue
        if got.dtype.kind == "f" and ("AVG" in what or "shared" in what):  # (float32 sums in tree order)
            assert np.allclose(got, expected, rtol=2e-3, equal_nan=True), f"{what}: {got[:4]} != {expected[:4]}"
        else:
            wrong = np.flatnonzero(~((got == np.asarray(expected, dtype=got.dtype))
                                     | (np.isnan(got) & np.isnan(expected)) if got.dtype.kind == "f"
                                     else got == expected))
            assert wrong.size == 0, (f"{what}: {wrong.size} elements differ, first at {wrong[:3]}: "
                                     f"{got[wrong[:3]]} != {np.asarray(expected)[wrong[:3]]}")
        digest.update(got.tobytes())
    assert np.allclose(shared, state[rank], rtol=2e-3), "registered buffer"
    digest.update(shared.tobytes())
    assert torch.equal(shared_bf16.float(), torch.from_numpy(bf16_state[rank])), "registered bf16 buffer"
    digest.update(shared_bf16.view(torch.int16).numpy().tobytes())
    comm.barrier()
    return digest.hexdigest()


def run_scenario(result: dict[str, Any]) -> None:
    scenario = sys.argv[1]
    node = os.environ.get("HFREDUCE_TEST_NODE") or None
    timeout_s = float(os.environ.get("HFREDUCE_TEST_TIMEOUT_S", "20"))
    rank = int(os.environ["RANK"])
    comm = hfreduce.init(node=node, timeout_s=timeout_s, chunk_size_bytes=CHUNK_SIZE_BYTES, slots=2)
    world = comm.world_size
    if scenario == "stress":
        result["digest"] = stress(comm)
    elif scenario == "absent":
        # The last rank never calls the collective; the others must fail within the timeout.
        if rank == world - 1:
            time.sleep(timeout_s * 1.5)
        else:
            started = time.monotonic()
            try:
                comm.allreduce(np.ones(5 * CHUNK, dtype=np.float32))
            except hfreduce.HFReduceError as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"
            result["failed_after_s"] = time.monotonic() - started
    elif scenario == "register-loop":
        # Registering buffers until killed from outside (or failed).
        print(json.dumps({"rank": rank, "started": True}), flush=True)
        started = time.monotonic()
        try:
            while time.monotonic() - started < 60:
                comm.shared_array(CHUNK, np.float32)
        except hfreduce.HFReduceError as exc:
            result["error"] = str(exc)
    elif scenario == "idle":
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


if __name__ == "__main__":
    run_rank(run_scenario)

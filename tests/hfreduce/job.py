"""One rank of a test job: ``python -m tests.hfreduce.job SCENARIO`` with torch's environment variables.

Prints one JSON line (``{"rank": .., "ok": .., ...}``) that the test collects. ``HFREDUCE_TEST_NODE``
groups ranks into nodes on one machine (ranks with the same value share a node); unset, the node is
what the rendezvous sees (the netns tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import hfreduce
from hfreduce import ReduceOp
from tests.hfreduce.runner import run_rank

CHUNK_SIZE_BYTES = 64 << 10
NUMPY_DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "int32": np.int32,
                "int64": np.int64}
# Relative error allowed against the float64 sum, per dtype (the result is rounded to the dtype once).
EPSILON = {"float32": 2.0**-21, "float64": 2.0**-50, "float16": 2.0**-9, "bfloat16": 2.0**-6}


def rank_input(rank: int, dtype: str, count: int, salt: int) -> np.ndarray:
    """Rank ``rank``'s data, as float64 values exactly representable in ``dtype``."""
    rng = np.random.default_rng([rank, count, salt])
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, count).astype(np.float64)
    values = rng.standard_normal(count)
    if dtype == "bfloat16":
        import torch

        rounded: np.ndarray = torch.from_numpy(values).to(torch.bfloat16).to(torch.float64).numpy()
        return rounded
    return values.astype(NUMPY_DTYPES[dtype]).astype(np.float64)


def make_tensor(values: np.ndarray, dtype: str) -> Any:
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(values).to(torch.bfloat16)
    return values.astype(NUMPY_DTYPES[dtype])


def as_float64(tensor: Any) -> np.ndarray:
    if isinstance(tensor, np.ndarray):
        return tensor.astype(np.float64)
    import torch

    converted: np.ndarray = tensor.to(dtype=torch.float64).numpy()
    return converted


def raw_bytes(tensor: Any) -> bytes:
    if isinstance(tensor, np.ndarray):
        return tensor.tobytes()
    import torch

    raw: bytes = tensor.view(torch.int16).numpy().tobytes()
    return raw


def check_ops(comm: hfreduce.Communicator, dtypes: list[str], sizes: list[int]) -> dict[str, str]:
    """Every op on every dtype and size against a float64 reference; returns result digests."""
    world = comm.world_size
    digests: dict[str, str] = {}
    for dtype in dtypes:
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN):
            if op is ReduceOp.AVG and dtype.startswith("int"):
                continue
            for count in sizes:
                salt = int(op) * 7 + len(dtype)
                inputs = [rank_input(r, dtype, count, salt) for r in range(world)]
                tensor = make_tensor(inputs[comm.rank], dtype)
                comm.allreduce(tensor, op=op)
                got = as_float64(tensor)
                stacked = np.stack(inputs) if count else np.zeros((world, 0))
                if op is ReduceOp.MAX:
                    expected = stacked.max(axis=0)
                elif op is ReduceOp.MIN:
                    expected = stacked.min(axis=0)
                else:
                    expected = stacked.sum(axis=0) / (world if op is ReduceOp.AVG else 1)
                where = f"{op.name} of {count} {dtype}"
                if dtype.startswith("int") or op in (ReduceOp.MAX, ReduceOp.MIN):
                    assert np.array_equal(got, expected), f"{where}: {got[:4]} != {expected[:4]}"
                else:
                    bound = EPSILON[dtype] * (np.abs(stacked).sum(axis=0) + np.abs(expected)) + 1e-300
                    worst = np.abs(got - expected) - bound
                    assert (worst <= 0).all(), f"{where}: error {float(worst.max()):.3g} over the bound"
                digests[where] = hashlib.sha256(raw_bytes(tensor)).hexdigest()
    return digests


def check_collectives(comm: hfreduce.Communicator, sizes: list[int]) -> None:
    world, rank = comm.world_size, comm.rank
    for count in sizes:
        gathered = np.full(count * world, -1.0, dtype=np.float32)
        comm.all_gather(gathered, np.full(count, rank + 0.5, dtype=np.float32))
        assert np.array_equal(gathered, np.repeat(np.arange(world, dtype=np.float32) + 0.5, count)), "all_gather"
        source = world - 1
        value = np.full(count, -0.0 if rank == source else 7.0, dtype=np.float64)
        value[: min(count, 3)] = [np.nan, np.inf, -1.5][: min(count, 3)] if rank == source else 0.0
        expected_bits = value.tobytes() if rank == source else None
        comm.broadcast(value, src=source)
        if expected_bits is not None:
            assert value.tobytes() == expected_bits, "broadcast changed the source"
        assert np.signbit(value[3:]).all(), "broadcast lost -0.0"
        scattered = np.zeros(count, dtype=np.int64)
        comm.reduce_scatter(scattered, np.arange(count * world, dtype=np.int64) + rank)
        block = np.arange(rank * count, (rank + 1) * count, dtype=np.int64)
        assert np.array_equal(scattered, block * world + sum(range(world))), "reduce_scatter"
    comm.barrier()


def check_async(comm: hfreduce.Communicator) -> None:
    """Many collectives in flight at once, of different sizes and kinds, complete in order and right."""
    buffers = [np.full(1 + 997 * index, comm.rank + index, dtype=np.float32) for index in range(40)]
    works = [comm.allreduce(buffer, async_op=True) for buffer in buffers]
    assert not all(work.is_completed() for work in works) or len(works) == 40
    for index, (buffer, work) in enumerate(zip(buffers, works, strict=True)):
        work.wait()
        assert work.is_completed()
        expected = sum(r + index for r in range(comm.world_size))
        assert (buffer == expected).all(), f"async allreduce {index}"


def check_shared(comm: hfreduce.Communicator) -> None:
    """Registered buffers: zero-copy allreduces (whole, sliced, bf16), and one rank's private buffer
    against the others' shared ones (the copying path) — all against the expected values."""
    world, rank = comm.world_size, comm.rank
    chunk = CHUNK_SIZE_BYTES // 4
    for count in (1, chunk + 3, 5 * chunk + 7):
        shared = comm.shared_array(count, np.float32)
        shared[:] = np.arange(count, dtype=np.float32) * (rank + 1)
        comm.allreduce(shared)
        assert np.array_equal(shared, np.arange(count, dtype=np.float32) * sum(range(1, world + 1))), "shared SUM"
        shared[:] = rank
        comm.allreduce(shared[count // 3:], op=ReduceOp.MAX)
        assert (shared[count // 3:] == world - 1).all() and (shared[:count // 3] == rank).all(), "shared slice"
        # One rank passes a private buffer: every rank still gets the sum.
        target = np.full(count, rank, dtype=np.float32) if rank == 0 else shared
        target[:] = rank
        comm.allreduce(target, op=ReduceOp.AVG)
        assert np.allclose(target, sum(range(world)) / world), "mixed shared and private"
    import torch

    tensor = comm.shared_tensor((3, 1000), torch.bfloat16)
    tensor.fill_(0.5 * (rank + 1))
    comm.allreduce(tensor)
    assert torch.equal(tensor, torch.full((3, 1000), 0.5 * sum(range(1, world + 1)), dtype=torch.bfloat16))
    try:
        comm.shared_array(100 + rank, np.float32)
    except hfreduce.InvalidArgument as exc:
        assert "different sizes" in str(exc), exc
    else:
        raise AssertionError("ranks asking for different sizes were not refused")


def _interface_and_links(comm: hfreduce.Communicator) -> tuple[list[int], dict[str, Any]]:
    counters = Path("/sys/class/net/eth0/statistics")
    return ([int((counters / name).read_text()) for name in ("tx_bytes", "rx_bytes")], comm.stats()["links"])


def run_scenarios(result: dict[str, Any]) -> None:
    scenarios = sys.argv[1]
    node = os.environ.get("HFREDUCE_TEST_NODE") or None
    timeout_s = float(os.environ.get("HFREDUCE_TEST_TIMEOUT_S", "60"))  # a loaded machine starts ranks far apart
    comm = hfreduce.init(node=node, timeout_s=timeout_s, chunk_size_bytes=CHUNK_SIZE_BYTES, slots=4)
    result["layout"] = [comm.node_index, comm.local_rank, comm.node_count, comm.local_world_size]
    chunk = CHUNK_SIZE_BYTES // 4
    for scenario in scenarios.split(","):
        if scenario == "ops":
            dtypes = os.environ.get("HFREDUCE_TEST_DTYPES", "float32,float64,float16,bfloat16,int32,int64")
            sizes = [0, 1, 1000, chunk + 1, 3 * chunk + 5]
            result["digests"] = check_ops(comm, dtypes.split(","), sizes)
            check_collectives(comm, [1, 777, chunk * comm.world_size + 3])
            check_async(comm)
        elif scenario == "shared":
            check_shared(comm)
        elif scenario == "traffic":
            # The interface's counters and the links' byte counts, taken together before a
            # barrier and three 8 MiB allreduces and after them. (Before the barrier no socket
            # holds more than a barrier's few unread bytes; after it, a faster node's allreduce
            # bytes could reach eth0 before this rank's snapshot.)
            before, links_before = _interface_and_links(comm)
            comm.barrier()
            payload = np.ones(2 << 20, dtype=np.float32)
            for _ in range(3):
                comm.allreduce(payload)
            assert (payload == comm.world_size**3).all()
            after, links_after = _interface_and_links(comm)
            result["eth0"] = [after[0] - before[0], after[1] - before[1]]
            result["links"] = {peer: {key: value - links_before[peer][key] for key, value in counts.items()}
                               for peer, counts in links_after.items()}
        elif scenario == "leave":
            # Rank 0 leaves after a collective; the others finish theirs, then fail at once on
            # the next one (it needs rank 0), never with a timeout.
            payload = np.ones(3 << 16, dtype=np.float32)
            comm.allreduce(payload)
            if comm.rank == 0:
                hfreduce.destroy()
            else:
                time.sleep(0.5)
                started = time.monotonic()
                try:
                    comm.allreduce(payload)
                except hfreduce.HFReduceError as exc:
                    result["error"] = str(exc)
                    result["failed_after_s"] = time.monotonic() - started
        elif scenario == "mismatch":
            count = 1000 + (comm.rank == comm.world_size - 1)
            try:
                comm.allreduce(np.ones(count, dtype=np.float32))
            except hfreduce.HFReduceError as exc:
                result["error"] = str(exc)
        elif scenario == "dtype-mismatch":
            dtype = np.float64 if comm.rank == 0 else np.float32
            try:
                comm.allreduce(np.ones(1000, dtype=dtype))
            except hfreduce.HFReduceError as exc:
                result["error"] = str(exc)
        elif scenario == "loop":
            # Until killed from outside (or failed): the victim's signal arrives mid-allreduce.
            payload = np.ones(4 << 20, dtype=np.float32)
            print(json.dumps({"rank": comm.rank, "started": True}), flush=True)
            started = time.monotonic()
            try:
                while time.monotonic() - started < 120:
                    comm.allreduce(payload)
            except hfreduce.HFReduceError as exc:
                result["error"] = str(exc)
                result["failed_after_s"] = time.monotonic() - started
        else:
            raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    run_rank(run_scenarios)

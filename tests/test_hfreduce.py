"""HFReduce: the tree, the kernels, and real multi-process jobs (one machine, and network namespaces
acting as nodes) — correctness of every op and dtype against a float64 reference, bit-identical
reruns, disagreements and killed ranks failing every rank with a clear error, nothing left in
/dev/shm, bad arguments refused.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hfreduce
from hfreduce import InvalidArgument, ReduceOp
from hfreduce.kernels import DType, arithmetic
from hfreduce.shm import remove_stale_segments
from hfreduce.tree import double_binary_tree
from tests.hfreduce.runner import ROOT, collect_results, free_port, rank_env, segments

# -- the tree (pure) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("node_count", [*range(1, 20), 31, 32, 33, 100])
def test_double_binary_tree_is_two_spanning_trees_of_degree_two(node_count: int) -> None:
    interior_in = [0] * node_count
    for tree in (0, 1):
        positions = [double_binary_tree(node_count, node)[tree] for node in range(node_count)]
        roots = [node for node, position in enumerate(positions) if position.is_root]
        assert len(roots) == 1
        reached, stack = set(), [roots[0]]
        while stack:
            node = stack.pop()
            assert node not in reached
            reached.add(node)
            assert len(positions[node].children) <= 2
            assert list(positions[node].children) == sorted(positions[node].children)
            for child in positions[node].children:
                assert positions[child].parent == node
            stack.extend(positions[node].children)
        assert reached == set(range(node_count))
        for node, position in enumerate(positions):
            interior_in[node] += bool(position.children)
    if node_count % 2 == 0:
        # The point of the second tree: a node is interior in at most one of them.
        assert max(interior_in) <= 1


def test_a_broken_tree_would_be_caught() -> None:
    # The checks above on a known-bad "tree": a cycle and a node outside it.
    positions = {0: (None, (1,)), 1: (0, (0,)), 2: (None, ())}
    roots = [node for node, (parent, _) in positions.items() if parent is None]
    assert len(roots) != 1


# -- kernels ------------------------------------------------------------------------------------------------


def test_sixteen_bit_floats_accumulate_in_float32() -> None:
    inputs = [np.full(64, 1024.0, dtype=np.float16)] + [np.full(64, 0.25, dtype=np.float16)] * 7
    arith = arithmetic(DType.FLOAT16, ReduceOp.SUM)
    out = np.empty(64, dtype=np.float32)
    arith.reduce(inputs, out, np.empty(64, dtype=np.float32))
    assert (out == 1025.75).all()
    naive = inputs[0].copy()
    for other in inputs[1:]:
        naive += other  # fp16 accumulation loses every 0.25 at 1024 (its spacing there is 1.0)
    assert (naive == 1024).all()
    final = np.empty(64, dtype=np.float16)
    arith.collect(out, final, 1)
    assert (final == np.float16(1025.75)).all()


def test_bfloat16_rounds_like_torch() -> None:
    torch = pytest.importorskip("torch")
    values = np.concatenate([np.random.default_rng(1).standard_normal(10_000).astype(np.float32) * 1e3,
                             np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.0e38, 1e-40], dtype=np.float32)])
    arith = arithmetic(DType.BFLOAT16, ReduceOp.SUM)
    out = np.empty(values.shape[0], dtype=np.uint16)
    arith.collect(values, out, 1)
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(out[~nan], expected[~nan])
    assert np.isnan(torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).float().numpy()[nan]).all()


def test_average_of_integers_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="AVG of int32"):
        arithmetic(DType.INT32, ReduceOp.AVG)


# -- arguments refused before a job starts ----------------------------------------------------------------------


def test_bad_arguments_are_typed_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidArgument, match="RANK is not set"):
        hfreduce.Communicator()
    with pytest.raises(InvalidArgument, match="world size must be at least 1"):
        hfreduce.Communicator(rank=0, world_size=0, master_addr="127.0.0.1", master_port=1)
    with pytest.raises(InvalidArgument, match="rank 3 is outside"):
        hfreduce.Communicator(rank=3, world_size=2, master_addr="127.0.0.1", master_port=1)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(InvalidArgument, match="WORLD_SIZE='two' is not an integer"):
        hfreduce.Communicator(rank=0)
    with pytest.raises(InvalidArgument, match="chunk_size_bytes"):
        hfreduce.Communicator(rank=0, world_size=1, master_addr="127.0.0.1", master_port=1, chunk_size_bytes=100)
    with pytest.raises(InvalidArgument, match="slots"):
        hfreduce.Communicator(rank=0, world_size=1, master_addr="127.0.0.1", master_port=1, slots=3)


def test_a_single_rank_job_and_bad_buffers() -> None:
    comm = hfreduce.Communicator(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                                 node="solo")
    try:
        values = np.arange(10, dtype=np.float32)
        comm.allreduce(values, op=ReduceOp.AVG)
        assert np.array_equal(values, np.arange(10, dtype=np.float32))
        with pytest.raises(InvalidArgument, match="not C-contiguous"):
            comm.allreduce(np.zeros((4, 4), dtype=np.float32)[:, 1])
        with pytest.raises(InvalidArgument, match="dtype uint8 is not supported"):
            comm.allreduce(np.zeros(4, dtype=np.uint8))
        with pytest.raises(InvalidArgument, match="read-only"):
            frozen = np.zeros(4, dtype=np.float32)
            frozen.flags.writeable = False
            comm.allreduce(frozen)
        with pytest.raises(InvalidArgument, match="expected a torch tensor or a numpy array"):
            comm.allreduce([1.0, 2.0])
        with pytest.raises(InvalidArgument, match="op must be"):
            comm.allreduce(values, op=ReduceOp.BOR)
        with pytest.raises(InvalidArgument, match="input has 5 elements"):
            comm.reduce_scatter(np.zeros(2, dtype=np.float32), np.zeros(5, dtype=np.float32))
        with pytest.raises(InvalidArgument, match="src 1 is outside"):
            comm.broadcast(values, src=1)
        torch = pytest.importorskip("torch")
        with pytest.raises(InvalidArgument, match="not contiguous"):
            comm.allreduce(torch.zeros(4, 4).t())
        with pytest.raises(InvalidArgument, match="complex64 is not supported"):
            comm.allreduce(torch.zeros(4, dtype=torch.complex64))
        # After refused calls the communicator still works.
        comm.allreduce(values)
    finally:
        comm.shutdown()
    with pytest.raises(hfreduce.HFReduceError, match="shut down"):
        comm.allreduce(values)


# -- multi-process jobs -----------------------------------------------------------------------------------


def run_job(scenario: str, nodes: list[int], extra: dict[str, str] | None = None,
            timeout_s: float = 120) -> list[dict[str, Any]]:
    """Ranks on one machine grouped into nodes of the given sizes (``[2, 2]``: two nodes of two)."""
    port = free_port()
    world = sum(nodes)
    node_of = [index for index, size in enumerate(nodes) for _ in range(size)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.hfreduce.job", scenario],
                              env=rank_env(rank, world, port, f"test-node-{node_of[rank]}", extra or {}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for rank in range(world)]
    return collect_results(procs, timeout_s)


@pytest.mark.slow
@pytest.mark.parametrize(("nodes", "dtypes"), [
    ([2], None), ([4], None), ([1, 1, 1], None), ([2, 1], None),
    ([1] * 5, "float32"), ([1] * 8, "float32"), ([3, 2, 1, 2, 1], "float16"),
], ids=["1x2", "1x4", "3x1", "2+1", "5x1", "8x1", "3+2+1+2+1"])
def test_every_op_and_dtype_matches_the_reference(nodes: list[int], dtypes: str | None) -> None:
    before = segments()
    results = run_job("ops", nodes, {"HFREDUCE_TEST_DTYPES": dtypes} if dtypes else None)
    for result in results:
        assert result["ok"], result
    # Every rank holds the same bytes, and the layout is what the rendezvous was told.
    assert len({json.dumps(result["digests"], sort_keys=True) for result in results}) == 1
    assert sorted(tuple(result["layout"][:2]) for result in results) == sorted(
        (node, local) for node, size in enumerate(nodes) for local in range(size))
    assert segments() <= before


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [[3], [2, 1]], ids=["1x3", "2+1"])
def test_registered_buffers_reduce_in_place(nodes: list[int]) -> None:
    before = segments()
    for result in run_job("shared", nodes):
        assert result["ok"], result
    assert segments() <= before


@pytest.mark.slow
def test_repeated_runs_are_bit_identical() -> None:
    extra = {"HFREDUCE_TEST_DTYPES": "float32,float16"}
    first = run_job("ops", [2, 1], extra)
    second = run_job("ops", [2, 1], extra)
    assert all(result["ok"] for result in first + second), first + second
    assert first[0]["digests"] == second[0]["digests"]


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "nodes", "message"), [
    ("mismatch", [2], "differs across ranks"),
    ("mismatch", [1, 1], "differs across nodes"),
    ("dtype-mismatch", [2, 1], "differs across"),
])
def test_disagreeing_ranks_fail_every_rank_clearly(scenario: str, nodes: list[int], message: str) -> None:
    results = run_job(scenario, nodes, timeout_s=60)
    for result in results:
        assert result["ok"], result
        assert message in result.get("error", ""), result


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [[3], [1, 1, 1], [2, 2]], ids=["1x3", "3x1", "2x2"])
def test_a_rank_that_leaves_lets_the_others_finish_and_fails_their_next_collective_at_once(nodes: list[int]) -> None:
    results = run_job("leave", nodes, {"HFREDUCE_TEST_TIMEOUT_S": "30"})
    assert results[0]["ok"] and "error" not in results[0], results[0]
    for result in results[1:]:
        assert result["ok"], result
        assert "shut down its communicator after 1 collectives" in result.get("error", ""), result
        assert result["failed_after_s"] < 5, result


@pytest.mark.slow
@pytest.mark.parametrize(("nodes", "victim", "stop"), [
    ([3], 1, False), ([3], 0, False), ([2, 2], 3, False), ([2, 2], 2, False), ([2, 2], 3, True), ([2, 1], 0, True),
], ids=["local-rank", "local-leader", "remote-rank", "remote-leader", "remote-rank-hangs", "local-leader-hangs"])
def test_a_killed_rank_fails_the_others_quickly_and_leaves_no_segment(nodes: list[int], victim: int,
                                                                     stop: bool) -> None:
    """SIGKILL: the others fail at once (a dead pid, a closed link). SIGSTOP (a hang): they fail with
    "no progress" once the timeout passes, not before and not much after."""
    before = segments()
    port = free_port()
    world = sum(nodes)
    node_of = [index for index, size in enumerate(nodes) for _ in range(size)]
    timeout_s = 4.0 if stop else 20.0
    procs = [subprocess.Popen([sys.executable, "-m", "tests.hfreduce.job", "loop"],
                              env=rank_env(rank, world, port, f"kill-node-{node_of[rank]}",
                                       {"HFREDUCE_TEST_TIMEOUT_S": str(timeout_s)}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for rank in range(world)]
    try:
        for proc in procs:  # every rank is inside its allreduce loop
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert '"started"' in line, line
        time.sleep(0.5)
        os.kill(procs[victim].pid, signal.SIGSTOP if stop else signal.SIGKILL)
        killed_at = time.monotonic()
        survivors = [proc for rank, proc in enumerate(procs) if rank != victim]
        results = collect_results(survivors, timeout_s=timeout_s + 15)
        elapsed = time.monotonic() - killed_at
        procs[victim].kill()
        procs[victim].wait()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    words = ("no progress",) if stop else ("exited", "lost", "shut down")
    for result in results:
        assert result["ok"] and "error" in result, result
        assert any(word in result["error"] for word in words), result
    if stop:
        assert timeout_s <= elapsed < 3 * timeout_s + 5, f"the survivors took {elapsed:.1f} s (timeout {timeout_s} s)"
    else:
        assert elapsed < timeout_s, f"the survivors took {elapsed:.1f} s (timeout {timeout_s} s)"
    assert segments() <= before, "a shared-memory segment was left behind"


def test_cuda_tensors_go_through_pinned_host_memory() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU on this machine: the CUDA staging path (pinned host buffer, side stream) needs one")
    comm = hfreduce.Communicator(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(),
                                 node="solo-cuda")
    try:
        tensor = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        comm.allreduce(tensor, op=ReduceOp.AVG)
        assert torch.equal(tensor.cpu(), torch.arange(1 << 20, dtype=torch.float32))
        half = torch.ones(1000, dtype=torch.bfloat16, device="cuda")
        comm.allreduce(half)
        assert half.is_cuda and torch.equal(half.cpu(), torch.ones(1000, dtype=torch.bfloat16))
    finally:
        comm.shutdown()


def test_stale_segments_of_dead_leaders_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive_start = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
    stale = tmp_path / f"hfreduce-abc123-n0-p{dead.pid}-12345"
    live = tmp_path / f"hfreduce-abc123-n1-p{os.getpid()}-{alive_start}"
    reused = tmp_path / f"hfreduce-abc123-n2-p{os.getpid()}-1"  # this pid, another start time: a reused pid
    other = tmp_path / "hfreduce-not-a-segment-name"
    for path in (stale, live, reused, other):
        path.write_bytes(b"x")
    removed = remove_stale_segments(tmp_path)
    assert sorted(removed) == sorted([stale.name, reused.name])
    assert live.exists() and other.exists() and not stale.exists() and not reused.exists()


# -- network namespaces as nodes ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="network namespaces need root and iproute2")
def test_namespace_nodes_allreduce_over_tcp() -> None:
    """Two namespaces (same host name, same /dev/shm) are two nodes; their leaders' bytes cross the veth."""
    from tests.chaos.netns import NetnsLab

    with NetnsLab() as lab:
        addresses = lab.create(["a", "b"])
        port = free_port()
        procs = []
        for rank, host in enumerate(["a", "a", "b", "b"]):
            env = rank_env(rank, 4, port, None, {})
            env["MASTER_ADDR"] = addresses["a"]
            procs.append(lab.spawn(host, [sys.executable, "-m", "tests.hfreduce.job", "ops,traffic"], env,
                                   Path(f"/tmp/hfreduce-netns-{lab.run_id}-{rank}.log")))
        for proc in procs:
            proc.wait(timeout=120)
        results = []
        for rank in range(4):
            log = Path(f"/tmp/hfreduce-netns-{lab.run_id}-{rank}.log")
            lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
            results.append(json.loads(lines[-1]))
            log.unlink()
    for result in results:
        assert result["ok"], result
    assert [result["layout"][:2] for result in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    tensor_bytes = 3 * (8 << 20)
    for leader in (results[0], results[2]):
        (link,) = leader["links"].values()
        # With two nodes each link carries half the chunks up and half down, both ways.
        assert link["bytes_sent"] >= tensor_bytes and link["bytes_received"] >= tensor_bytes
        tx, rx = leader["eth0"]
        # The interface carried at least what the link did (less a barrier frame or two that may
        # have arrived before the first snapshot), headers included.
        assert tx >= link["bytes_sent"] - 4096 and rx >= link["bytes_received"] - 4096, leader

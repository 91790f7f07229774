"""HFReduce under hostile use: idle pauses, disagreements that only show after the first chunk, a
rendezvous peer that never answers, the leader's ready counter under racing threads, and more.

Jobs run as processes on this machine, grouped into nodes with ``node=`` (tests/hfreduce/review_job.py:
4 KiB chunks and two slots, so every collective wraps the rings many times).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import hfreduce
from tests.hfreduce.runner import ROOT, collect_results, free_port, rank_env, segments


def run_review_job(scenario: str, nodes: list[int], timeout_s: float = 5.0, job_timeout_s: float = 60.0,
                   extra: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Ranks of ``tests.hfreduce.review_job`` grouped into nodes of the given sizes."""
    port = free_port()
    world = sum(nodes)
    node_of = [index for index, size in enumerate(nodes) for _ in range(size)]
    env_extra = {"HFREDUCE_TEST_TIMEOUT_S": str(timeout_s), **(extra or {})}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.hfreduce.review_job", scenario],
                              env=rank_env(rank, world, port, f"review-{port}-{node_of[rank]}", env_extra),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for rank in range(world)]
    return collect_results(procs, job_timeout_s)


def test_a_pause_longer_than_the_timeout_between_collectives_is_not_a_failure() -> None:
    # The leaders' tree threads used to count the idle time before the next collective as "no progress".
    before = segments()
    results = run_review_job("idle", [1, 1], timeout_s=2.0)
    for result in results:
        assert result["ok"], result
    assert segments() <= before


def test_sizes_that_differ_only_after_the_first_chunk_fail_every_node() -> None:
    # Node 0 passes one whole chunk, node 1 a chunk and five elements: chunk 0 has the same elements on
    # both. Node 0 used to return success (and node 1 learn only that node 0 shut down).
    results = run_review_job("straddle-mismatch", [1, 2])
    for result in results:
        assert result["ok"], result
        assert "differs across nodes" in result.get("error", ""), result
        assert "1024 float32 elements" in result["error"] and "1029" in result["error"], result


def test_a_rendezvous_peer_that_never_answers_is_a_timeout_not_a_hang() -> None:
    # Something on MASTER_PORT accepts connections and never replies (another service, or a rank 0
    # stopped with SIGSTOP): a rank used to wait for the reply for ever.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    outcome: dict[str, object] = {}

    def join() -> None:
        started = time.monotonic()
        try:
            hfreduce.Communicator(rank=1, world_size=2, master_addr="127.0.0.1", master_port=port, timeout_s=1.0,
                                  node="silent-store")
        except hfreduce.HFReduceError as exc:
            outcome["error"] = exc
        outcome["elapsed_s"] = time.monotonic() - started

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    thread.join(timeout=10)
    try:
        assert not thread.is_alive(), "the rank still waits for the store's reply"
        assert isinstance(outcome.get("error"), hfreduce.HFReduceTimeout), outcome
        assert "did not answer within" in str(outcome["error"]), outcome
        assert float(outcome["elapsed_s"]) < 5, outcome  # type: ignore[arg-type]
    finally:
        for connection in accepted:
            connection.close()
        listener.close()


class _SlowControl:
    """The shared control words, where the store of ``ready = 1`` waits (up to 0.5 s) for ``ready = 2``."""

    def __init__(self) -> None:
        self.words = [0]
        self.two_stored = threading.Event()

    def __setitem__(self, index: int, value: int) -> None:
        if value == 1:
            self.two_stored.wait(0.5)
        self.words[index] = value
        if value == 2:
            self.two_stored.set()


class _QuietBell:
    def ring(self) -> None:
        pass


def test_the_leaders_ready_counter_never_goes_back() -> None:
    # Tree A's thread finishes chunk 0 and tree B's chunk 1 at the same moment; the count of final
    # chunks they publish must end at 2. The store used to be made after the lock, so the older count
    # (1) could land last and the ranks wait for chunk 1 until the timeout.
    from types import SimpleNamespace

    from hfreduce.engine import Network

    network = Network.__new__(Network)
    network._lock = threading.Lock()
    network._finished = set()
    network._ready = 0
    network._ops = []
    control = _SlowControl()
    network.node = SimpleNamespace(control=control, segment=SimpleNamespace(ready_at=0))  # type: ignore[assignment]
    first = threading.Thread(target=network._mark_ready, args=(0, _QuietBell()))
    first.start()
    time.sleep(0.05)  # the first thread is inside its store of 1
    second = threading.Thread(target=network._mark_ready, args=(1, _QuietBell()))
    second.start()
    first.join(5)
    second.join(5)
    assert control.words[0] == 2


def _communicators(world_size: int, port: int | None = None, **options: Any) -> list[hfreduce.Communicator]:
    """``world_size`` ranks of one node in this process (threads make them; each joins the rendezvous)."""
    port = port or free_port()
    made: list[hfreduce.Communicator | None] = [None] * world_size

    def make(rank: int) -> None:
        made[rank] = hfreduce.Communicator(rank=rank, world_size=world_size, master_addr="127.0.0.1",
                                           master_port=port, node=f"in-process-{port}", **options)

    threads = [threading.Thread(target=make, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(comm is not None for comm in made), "a rank did not start"
    return [comm for comm in made if comm is not None]


def test_a_barrier_with_a_timeout_raises_when_a_rank_is_missing() -> None:
    # barrier(timeout_s) used to return None when the time ran out, as if every rank had arrived.
    comms = _communicators(2, timeout_s=10.0)
    try:
        started = time.monotonic()
        with pytest.raises(hfreduce.HFReduceTimeout, match=r"barrier: not every rank arrived within 0\.3 s"):
            comms[0].barrier(timeout_s=0.3)
        assert time.monotonic() - started < 2
        comms[1].barrier()  # the late rank arrives: both barriers complete, and the job goes on
        values = np.ones(3, dtype=np.float32)
        work = comms[0].allreduce(values.copy(), async_op=True)
        comms[1].allreduce(values)
        work.wait(5)
        assert (values == 2).all()
    finally:
        for comm in comms:
            comm.shutdown()


def test_a_job_started_again_on_the_same_port_in_the_same_process_starts() -> None:
    # shutdown() closed rank 0's store socket, but the thread blocked in accept() kept it listening:
    # the next start on the same MASTER_PORT failed ("address already in use" on rank 0, "lost the
    # rendezvous store" on the others), and every start leaked that thread.
    port = free_port()
    for _ in range(3):
        comms = _communicators(2, port=port, timeout_s=5.0)
        values = np.ones(4, dtype=np.float32)
        work = comms[0].allreduce(values, async_op=True)
        comms[1].allreduce(np.ones(4, dtype=np.float32))
        work.wait(5)
        assert (values == 2).all()
        for comm in comms:
            comm.shutdown()
    assert not [thread for thread in threading.enumerate() if thread.name == "hfreduce-store"]


class _MemoryStore:
    """A rendezvous store in this process that lets a test act when a key is set."""

    def __init__(self, on_set: Any) -> None:
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._on_set = on_set

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()
        self._on_set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._values, timeout_s):
                raise hfreduce.HFReduceTimeout(f"{key} did not appear")
            return self._values[key]

    def add(self, key: str, delta: int) -> int:
        with self._changed:
            value = int(self._values.get(key, b"0")) + delta
            self._values[key] = str(value).encode()
            return value


def test_strangers_on_a_leaders_link_port_do_not_stop_the_job_starting() -> None:
    # A leader read each connection's hello in turn, for up to the timeout: a stranger that connected
    # first and sent three bytes held it until the real peer had given up, and the job never started.
    strangers: list[socket.socket] = []

    def intrude(key: str, value: bytes) -> None:
        if key.endswith("/node/1"):  # node 1's leader now listens for node 0
            port = json.loads(value)[1]
            idle = socket.create_connection(("127.0.0.1", port))
            idle.sendall(b"GET")
            strangers.append(idle)
            with socket.create_connection(("127.0.0.1", port)) as garbage:
                garbage.sendall(os.urandom(100))
            socket.create_connection(("127.0.0.1", port)).close()

    store = _MemoryStore(intrude)
    made: list[hfreduce.Communicator] = []
    errors: list[BaseException] = []

    def start(rank: int) -> None:
        try:
            made.append(hfreduce.Communicator(rank=rank, world_size=2, store=store, master_addr="127.0.0.1",
                                              node=f"stranger-node-{rank}", timeout_s=2.0))
        except BaseException as exc:
            errors.append(exc)

    started = time.monotonic()
    threads = [threading.Thread(target=start, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    try:
        assert not errors, errors
        assert len(made) == 2 and strangers
        assert time.monotonic() - started < 1.5
        comms = sorted(made, key=lambda comm: comm.rank)
        values = np.full(5000, 2.0, dtype=np.float32)
        work = comms[0].allreduce(values, async_op=True)
        comms[1].allreduce(np.full(5000, 3.0, dtype=np.float32))
        work.wait(5)
        assert (values == 5).all()
    finally:
        for comm in made:
            comm.shutdown()
        for stranger in strangers:
            stranger.close()


@pytest.mark.slow
def test_many_collectives_of_every_kind_in_flight_on_small_rings_are_right_and_repeatable() -> None:
    # 70 collectives submitted at once on every rank (allreduce of every dtype and op, with NaN, inf and
    # wrapping int32 sums; reduce_scatter, all_gather, broadcast; slices of a registered buffer, some
    # ranks passing a private copy; a registered bf16 tensor averaged), sizes on and around chunk
    # boundaries, 4 KiB chunks and two slots, three nodes of 2, 1 and 2 ranks; run twice.
    before = segments()
    first = run_review_job("stress", [2, 1, 2], timeout_s=30.0)
    assert all(result["ok"] for result in first), first
    second = run_review_job("stress", [2, 1, 2], timeout_s=30.0)
    assert all(result["ok"] for result in second), second
    assert [result["digest"] for result in first] == [result["digest"] for result in second]
    assert segments() <= before


def test_a_rank_killed_while_registering_buffers_leaves_nothing_in_dev_shm() -> None:
    # Its own registered buffer's name (created, not yet unlinked) stayed in /dev/shm after the job,
    # until some later start on this machine; the survivors now remove it as they exit (the dead rank
    # is not reaped yet then: a zombie counts as dead).
    before = segments()
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.hfreduce.review_job", "register-loop"],
                              env=rank_env(rank, 3, port, f"register-{port}", {"HFREDUCE_TEST_TIMEOUT_S": "5"}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for rank in range(3)]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert '"started"' in proc.stdout.readline()
        time.sleep(0.3)
        os.kill(procs[1].pid, signal.SIGKILL)
        results = collect_results([procs[0], procs[2]], timeout_s=20)
        left = segments() - before
        procs[1].wait()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for result in results:
        assert result["ok"] and "exited" in result.get("error", ""), result
    assert not left, f"left in /dev/shm: {left}"


def test_on_a_slow_leader_no_byte_of_an_allreduce_lands_after_wait_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    # The DDP replica-drift hunt (tests/test_haiscale_train.py): could rank 0, the node leader whose
    # process runs the network threads, see wait() return before the last chunk's result is in its
    # registered buffer, or have it written there afterwards? Two nodes of two ranks in this process,
    # registered buffers (zero copy: the owner reads every rank's buffer in place), AVG as DDP does,
    # the leader's receives, the tree's additions, the collects and the ready counter all delayed at
    # random: at wait() every rank's buffer holds the average, and nothing changes it later.
    import random

    from hfreduce import engine, kernels

    chance = random.Random(7)

    def delayed(function: Any) -> Any:
        def call(*args: Any) -> Any:
            time.sleep(chance.random() * 0.004)
            return function(*args)
        return call

    monkeypatch.setattr(engine.PeerLink, "recv_into", delayed(engine.PeerLink.recv_into))
    monkeypatch.setattr(engine.Network, "_mark_ready", delayed(engine.Network._mark_ready))
    for name in ("reduce", "combine", "collect"):
        monkeypatch.setattr(kernels.Arithmetic, name, delayed(getattr(kernels.Arithmetic, name)))
    port = free_port()
    made: list[hfreduce.Communicator | None] = [None] * 4
    shared: list[np.ndarray | None] = [None] * 4
    count = 3 * 1024 + 17  # three 4 KiB chunks and a bit: both trees, and a short last chunk

    def start(rank: int) -> None:
        made[rank] = comm = hfreduce.Communicator(rank=rank, world_size=4, master_addr="127.0.0.1",
                                                  master_port=port, node=f"late-{port}-{rank // 2}",
                                                  timeout_s=10.0, chunk_size_bytes=4096, slots=2)
        shared[rank] = comm.shared_array(count, np.float32)

    threads = [threading.Thread(target=start, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    comms = [comm for comm in made if comm is not None]
    buffers = [buffer for buffer in shared if buffer is not None]
    try:
        assert len(comms) == 4 and len(buffers) == 4, "a rank did not start"
        assert comms[0].node_count == 2
        ramp = np.arange(count, dtype=np.float64)
        for step in range(12):
            for rank, buffer in enumerate(buffers):
                buffer[:] = ramp * (rank + 1) / 7 + step
            expected = (ramp * (1 + 2 + 3 + 4) / 7 / 4 + step).astype(np.float32)
            works = [comm.allreduce(buffer, op=hfreduce.ReduceOp.AVG, async_op=True)
                     for comm, buffer in zip(comms, buffers, strict=True)]
            at_wait = []
            for work, buffer in zip(works, buffers, strict=True):
                assert work.wait(20)
                at_wait.append(buffer.copy())
            time.sleep(0.02)
            for rank, (seen, buffer) in enumerate(zip(at_wait, buffers, strict=True)):
                assert np.allclose(seen, expected, rtol=1e-6), f"step {step}: rank {rank}'s result at wait()"
                assert np.array_equal(seen, at_wait[0]), f"step {step}: rank {rank} differs from rank 0"
                assert np.array_equal(buffer, seen), f"step {step}: rank {rank}'s buffer changed after wait()"
    finally:
        for comm in comms:
            comm.shutdown()

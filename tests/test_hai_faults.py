"""The HAI Platform's fault proofs (issue 20), end to end, every part its own process
(``tests/hai_e2e.py``): ``hai server`` on SQLite, one ``hai agent`` process per node (distinct
node names on one host), HaiScale ranks checkpointing to the shared in-process fs3 cluster as
alice — with alice's fs3 *user* token, never the cluster's.

- A node's agent and its ranks SIGKILLed mid-job: the server hears no heartbeat for its node
  timeout, marks the node unhealthy, restarts the job from its latest periodic checkpoint on the
  spare node, and the job ends bit-identical to the uninterrupted run; the chain shows both tasks.
- A LOW job that ignores the suspend request is force-stopped after the grace (1 s + 1 s here), the
  HIGH job runs, and LOW resumes from its last periodic checkpoint, again bit-identical.
- In both, rank 0 records its ``FS3_TOKEN`` (alice's user token) and that a file in bob's mode-0700
  directory is refused to it; the checkpoints on fs3 belong to alice's uid.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hai_e2e import (
    ALICE_UID,
    TRAIN,
    Fs3Users,
    ProcCluster,
    assert_bit_identical,
    checkpoints,
    identities,
    reference_run,
    starts,
    train_env,
    wait_for,
)
from tests.test_hai_timesharing import HIGH

pytestmark = pytest.mark.slow

TOTAL_STEPS, EVERY = 60, 5


@pytest.fixture
def fs3_users(shared_cluster: Any) -> Iterator[Fs3Users]:
    users = Fs3Users.make(shared_cluster.cluster, shared_cluster.loop)
    try:
        yield users
    finally:
        users.close()


def _assert_alice(users: Fs3Users, out: Path, directory: str) -> None:
    """What alice's ranks ran as: her user token, bob's private file refused, her uid on fs3."""
    seen = identities(out)
    assert seen, "rank 0 recorded no identity"
    for record in seen:
        assert record["fs3_token"] == users.alice_token != users.cluster_token
        assert record["private"] == "denied", record
    for step in checkpoints(users.fs, directory):
        assert users.fs.stat(f"{directory}/step-{step:08d}").st_uid == ALICE_UID


def test_a_killed_node_restarts_the_job_on_the_spare_from_its_checkpoint(tmp_path: Path,
                                                                       fs3_users: Fs3Users) -> None:
    pytest.importorskip("torch")
    top, private = fs3_users.workspace()
    directory = f"{top}/ckpt"
    cluster = ProcCluster(tmp_path, fs3_users, node_timeout_s=2.0)
    try:
        cluster.start_server()
        for name in ("n1", "n2", "n3"):
            cluster.agent(name)
        wait_for(lambda: len(cluster.nodes()) == 3, "three nodes to register", cluster.server_log)
        with reference_run(tmp_path, TOTAL_STEPS, EVERY) as reference:
            job = cluster.submit(TRAIN, name="train", nodes=2,
                                 env=train_env(directory, TOTAL_STEPS, EVERY, private=private))
            first = cluster.wait_job(job, "running", task=0)["assigned"]
            wait_for(lambda: len(checkpoints(fs3_users.fs, directory)) >= 2, "two periodic checkpoints",
                     lambda: (cluster.job(job), cluster.log(job)))
            victim = first[0]  # rank 0's node: the survivor's rank 1 is left holding on
            cluster.kill_node(victim)
            saved = checkpoints(fs3_users.fs, directory)[-1]
            assert saved < TOTAL_STEPS, "the job ended before the kill: make it longer"

            wait_for(lambda: not cluster.nodes()[victim]["healthy"], f"{victim} to be marked unhealthy",
                     lambda: cluster.nodes())
            restarted = cluster.wait_job(job, "running", task=1)
            spare = ({"n1", "n2", "n3"} - set(first)).pop()
            assert sorted(restarted["assigned"]) == sorted({*first, spare} - {victim}), restarted
            view = cluster.wait_job(job, "finished", task=1)
        assert_bit_identical(reference, tmp_path / "out-train" / "final.pt")

        node = cluster.nodes()[victim]
        assert not node["healthy"] and "heartbeat" in (node["reason"] or ""), node
        chain = view["chain"]
        assert [t["task"] for t in chain] == [0, 1], chain
        assert sorted(chain[0]["nodes"]) == sorted(first) and victim not in chain[1]["nodes"], chain
        assert chain[0]["outcome"] != "finished" and chain[1]["outcome"] == "finished", chain
        assert view["restarts"] == 1, view
        # Rank 0 started twice: from scratch, then from a periodic checkpoint at or after the one
        # seen before the kill.
        begun = starts(cluster.log(job))
        assert begun[0] == 0 and len(begun) == 2 and saved <= begun[1] < TOTAL_STEPS and begun[1] % EVERY == 0, begun
        _assert_alice(fs3_users, tmp_path / "out-train", directory)
    finally:
        cluster.close()


def test_a_job_ignoring_the_suspend_is_force_stopped_and_resumes_from_its_periodic_checkpoint(
        tmp_path: Path, fs3_users: Fs3Users) -> None:
    pytest.importorskip("torch")
    top, private = fs3_users.workspace()
    directory = f"{top}/ckpt"
    cluster = ProcCluster(tmp_path, fs3_users, node_timeout_s=10.0, ack_grace_s=1.0, finish_grace_s=1.0)
    try:
        cluster.start_server()
        for name in ("n1", "n2"):
            cluster.agent(name)
        wait_for(lambda: len(cluster.nodes()) == 2, "both nodes to register", cluster.server_log)
        with reference_run(tmp_path, TOTAL_STEPS, EVERY) as reference:
            low = cluster.submit(TRAIN, name="low", nodes=2, priority="LOW",
                                 env=train_env(directory, TOTAL_STEPS, EVERY, private=private, ignore_suspend=True))
            cluster.wait_job(low, "running", task=0)
            wait_for(lambda: len(checkpoints(fs3_users.fs, directory)) >= 2, "two periodic checkpoints",
                     lambda: (cluster.job(low), cluster.log(low)))
            high = cluster.submit(HIGH, name="high", nodes=2, priority="HIGH")
            wait_for(lambda: cluster.job(high)["state"] in ("running", "finished"), "the HIGH job to start",
                     lambda: (cluster.job(high), cluster.job(low)))
            at_high = checkpoints(fs3_users.fs, directory)
            assert at_high and at_high[-1] < TOTAL_STEPS, at_high
            high_view = cluster.wait_job(high, "finished")
            low_view = cluster.wait_job(low, "finished", task=1)
        assert_bit_identical(reference, tmp_path / "out-low" / "final.pt")
        assert {p.name for p in (tmp_path / "out-high").glob("high-*")} == {"high-0", "high-1"}

        chain = low_view["chain"]
        assert [t["task"] for t in chain] == [0, 1] and chain[0]["outcome"] == "suspended", chain
        assert low_view["restarts"] == 0, low_view  # a forced suspend is no fault
        high_chain = high_view["chain"]
        assert chain[0]["ended_s"] <= high_chain[0]["started_s"] <= high_chain[0]["ended_s"] <= chain[1]["started_s"]
        log0 = cluster.log(low)
        assert "suspended at" not in log0  # it never acknowledged: the agent stopped it
        # It resumed from the last periodic checkpoint published before the force-stop.
        assert starts(log0) == [0, at_high[-1]], (starts(log0), at_high)
        _assert_alice(fs3_users, tmp_path / "out-low", directory)
    finally:
        cluster.close()

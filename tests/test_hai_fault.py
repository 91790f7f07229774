"""The HAI Platform's fault proof (issue 20), end to end, every part its own process
(``tests/hai_e2e.py``): ``hai server`` on SQLite, one ``hai agent`` process per node (distinct
node names on one host), HaiScale ranks checkpointing to the shared in-process fs3 cluster as
alice — with alice's fs3 *user* token, never the cluster's.

A node's agent and its ranks SIGKILLed mid-job: the server hears no heartbeat for its node
timeout, marks the node unhealthy, restarts the job from its latest periodic checkpoint on the
spare node, and the job ends bit-identical to the uninterrupted run; the chain shows both tasks.
Rank 0 records its ``FS3_TOKEN`` (alice's user token) and that a file in bob's mode-0700
directory is refused to it; the checkpoints on fs3 belong to alice's uid.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hai_e2e import (
    TRAIN,
    Fs3Users,
    ProcCluster,
    assert_alice,
    assert_bit_identical,
    checkpoints,
    reference_run,
    starts,
    train_env,
    wait_for,
)

pytestmark = pytest.mark.slow

TOTAL_STEPS, EVERY = 60, 5


@pytest.fixture
def fs3_users(shared_cluster: Any) -> Iterator[Fs3Users]:
    users = Fs3Users.make(shared_cluster.cluster, shared_cluster.loop)
    try:
        yield users
    finally:
        users.close()


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
        begun = starts(tmp_path / "out-train")
        assert begun[0] == 0 and len(begun) == 2 and saved <= begun[1] < TOTAL_STEPS and begun[1] % EVERY == 0, begun
        assert_alice(fs3_users, tmp_path / "out-train", directory)
    finally:
        cluster.close()

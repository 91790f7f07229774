"""The HAI Platform's headline proof (issue 20), end to end: time-sharing by suspend and resume.

The real server (FastAPI under uvicorn, SQLite, the scheduling loop on the wall clock) and two
in-process agents (``tests/test_hai_agent.py``'s :class:`Cluster`), whose ranks reach the shared
in-process fs3 cluster (``$FS3_MGMTD`` from the agents, ``$FS3_TOKEN`` from alice's platform user:
her own fs3 user token, so her checkpoints on fs3 are owned by her uid).

A LOW-priority job on both nodes trains a small seeded MLP (drawing from torch's global RNG every
step) with HaiScale's :class:`~haiscale.checkpoint.CheckpointManager` on fs3; a HIGH-priority job
that needs both nodes arrives mid-run → the scheduler suspends LOW (rank 0 saves through
``on_suspend`` and acknowledges with ``go_suspend``), its checkpoint is on fs3 before HIGH starts,
HIGH runs to completion, LOW resumes as task 1 of its chain from that checkpoint and finishes —
with final parameters and optimizer state bit-identical to the same script run uninterrupted
outside hai.

The job has one rank per node: rank 0 trains and checkpoints, rank 1 only holds its node (it
acknowledges a suspend, and leaves once rank 0 has written the result) — the 2-node placement,
suspend and resume are the platform's, without a collective between the ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hai.server import User, Users, hash_token
from tests.hai_e2e import ALICE_UID, Fs3Users, assert_bit_identical
from tests.test_hai_agent import AGENT, ALICE, BARRIER, ROOT, Cluster, wait_for

pytestmark = pytest.mark.slow

TOTAL_STEPS = 200

TRAIN = """
    import os, sys, time
    import torch
    from torch import nn
    import hai.client
    from haiscale.checkpoint import CheckpointManager

    out, total, location = sys.argv[1], int(os.environ["TS_TOTAL"]), os.environ["TS_CKPT"]
    os.makedirs(out, exist_ok=True)
    final = os.path.join(out, "final.pt")
    if os.environ["RANK"] != "0":  # holds its node: acknowledges a suspend, leaves when rank 0 is done
        deadline = time.monotonic() + 120
        while not os.path.exists(final):
            if hai.client.receive_suspend_command():
                hai.client.go_suspend()
                sys.exit(0)
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.05)
        sys.exit(0)
    torch.manual_seed(0)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    target = data.sum(dim=1, keepdim=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager = CheckpointManager(location, keep=2)
    loaded = manager.load_latest(model, opt)
    start = 0 if loaded is None else int(loaded.extra["next_step"])
    print(f"start {start}", flush=True)
    for step in range(start, total):
        order = torch.randperm(len(data))[:16]  # the global RNG: its state must survive the suspend
        loss = ((model(data[order]) - target[order]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}", flush=True)
        if hai.client.receive_suspend_command():
            manager.on_suspend(step + 1, model, opt, extra={"next_step": step + 1})
            print(f"suspended at {step + 1}", flush=True)
            hai.client.go_suspend()
            manager.close()
            sys.exit(0)
        if os.environ.get("HAI_JOB_ID"):
            time.sleep(0.02)  # under hai only: leaves room for the HIGH job to arrive mid-run
    manager.close()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, final + ".tmp")
    os.replace(final + ".tmp", final)
"""

# Both ranks meet before they end, as a collective would (the task ends once both nodes have
# reported their ranks' end, so the barrier is the job's own, not the scheduler's).
HIGH = BARRIER + """
    import sys
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    print("high rank", os.environ["RANK"], "running", flush=True)
    time.sleep(1.0)
    barrier(out, "high-")
"""


@pytest.fixture
def fs3_cluster(tmp_path: Path, shared_cluster: Any) -> Iterator[tuple[Cluster, Fs3Users]]:
    """The hai cluster whose user alice's ranks get her own fs3 user token (never the cluster's),
    and the fs3 users with an admin client of the test's own."""
    inproc = shared_cluster.cluster
    fs3_users = Fs3Users.make(inproc, shared_cluster.loop)
    users = Users(users=(User("alice", hash_token(ALICE), fs3_token=fs3_users.alice_token),),
                  agent_token_sha256=hash_token(AGENT))
    cluster = Cluster(tmp_path, users=users)
    try:
        cluster.agent("n1", "10.0.0.1", fs3_mgmtd=inproc.mgmtd_address)
        cluster.agent("n2", "10.0.0.2", fs3_mgmtd=inproc.mgmtd_address)
        yield cluster, fs3_users
    finally:
        cluster.close()
        fs3_users.close()


def _log(cluster: Cluster, job: str, rank: int = 0) -> str:
    path = cluster.tmp / "logs" / job / f"{rank}.log"
    return path.read_text() if path.exists() else ""


def test_low_job_is_suspended_for_high_and_resumes_bit_identical(fs3_cluster: tuple[Cluster, Fs3Users]) -> None:
    pytest.importorskip("torch")
    cluster, fs3_users = fs3_cluster
    fs = fs3_users.fs
    top, _private = fs3_users.workspace()
    tmp = cluster.tmp
    script = tmp / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    # The reference: the same script, uninterrupted, outside hai (no control directory, no fs3),
    # running meanwhile.
    reference_env = {k: v for k, v in os.environ.items() if not k.startswith(("FS3_", "HAI_"))}
    reference_env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RANK="0", TS_TOTAL=str(TOTAL_STEPS),
                         TS_CKPT=str(tmp / "reference-ckpt"))
    reference = subprocess.Popen([sys.executable, str(script), str(tmp / "reference")], env=reference_env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(cluster.nodes()) == 2, "both nodes to register")
        directory = f"{top}/ckpt"  # written by alice's ranks as alice
        low = cluster.submit(TRAIN, nodes=2, priority="LOW",
                             env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TS_TOTAL": str(TOTAL_STEPS),
                                  "TS_CKPT": f"fs3://{directory}"})
        assert sorted(cluster.wait_job(low, "running", task=0)["assigned"]) == ["n1", "n2"]
        wait_for(lambda: "step 20\n" in _log(cluster, low), "the LOW job to train a while",
                 lambda: (cluster.job(low), _log(cluster, low)))
        assert _listing(fs, directory) == []  # nothing saved yet: the job saves only on suspend

        high = cluster.submit(HIGH, nodes=2, priority="HIGH")
        high_waits: set[str | None] = set()
        seen_when_high_ran: list[str] = []

        def high_running() -> bool:
            view = cluster.job(high)
            high_waits.add(view["wait"])
            if view["state"] in ("running", "finished"):
                seen_when_high_ran.extend(_listing(fs, directory))
                return True
            return False

        wait_for(high_running, "the HIGH job to start", lambda: (cluster.job(high), cluster.job(low)))
        low_view = cluster.job(low)
        assert low_view["state"] == "queued" and low_view["task"] == 1, low_view
        # LOW's suspend checkpoint was published on fs3 before HIGH took the nodes.
        saved = [name for name in seen_when_high_ran if name.startswith("step-")]
        assert len(saved) == 1, seen_when_high_ran
        suspended_at = int(saved[0].removeprefix("step-"))
        assert 20 < suspended_at < TOTAL_STEPS

        high_view = cluster.wait_job(high, "finished")
        assert {p.name for p in (tmp / "out").glob("high-*")} == {"high-0", "high-1"}
        low_view = cluster.wait_job(low, "finished", task=1)
        assert reference.wait(60) == 0, reference.communicate()[0]
    finally:
        if reference.poll() is None:
            reference.kill()
        reference.communicate()

    # The chains: LOW ran twice (suspended, then finished), HIGH once, in between, and never
    # queued for any reason other than LOW's suspension in progress.
    chain = low_view["chain"]
    assert [t["task"] for t in chain] == [0, 1] and low_view["restarts"] == 0, chain
    assert chain[0]["outcome"] == "suspended", chain
    assert len(chain[0]["nodes"]) == 2 and len(chain[1]["nodes"]) == 2
    high_chain = high_view["chain"]
    assert [t["task"] for t in high_chain] == [0] and high_view["restarts"] == 0, high_chain
    assert sorted(high_chain[0]["nodes"]) == ["n1", "n2"]
    assert chain[0]["ended_s"] <= high_chain[0]["started_s"] <= high_chain[0]["ended_s"] <= chain[1]["started_s"]
    assert high_waits <= {None, "suspending"}, high_waits
    # LOW's rank 0 started twice: from scratch, then from the step it saved on suspend.
    log0 = _log(cluster, low)
    starts = [line for line in log0.splitlines() if line.startswith("start ")]
    assert starts == ["start 0", f"start {suspended_at}"], starts
    assert f"suspended at {suspended_at}\n" in log0
    assert _listing(fs, directory) == [f"step-{suspended_at:08d}"]
    assert fs.stat(f"{directory}/step-{suspended_at:08d}").st_uid == ALICE_UID  # alice's token, alice's files

    assert_bit_identical(tmp / "reference" / "final.pt", tmp / "out" / "final.pt")
    # Every rank of both jobs is gone.
    wait_for(lambda: all(not agent.held() for agent, _ in cluster.agents.values()), "the agents to drop the tasks")


def _listing(fs: Any, directory: str) -> list[str]:
    """The names in ``directory`` on fs3 (none when it does not exist yet)."""
    if not fs.exists(directory):
        return []
    return sorted(str(name) for name in fs.listdir(directory))

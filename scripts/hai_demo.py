"""``make hai-demo``: the HAI Platform's long scenario, narrated. An in-process fs3 cluster, ``hai
server`` and three ``hai agent`` processes (nodes n1, n2, n3), and alice's HaiScale training job
(the seeded MLP of ``tests/hai_e2e.py``, periodic checkpoints to fs3 with her fs3 user token) run
three ways, each ending bit-identical to the same script run uninterrupted outside hai:

1. time-sharing: LOW on two nodes, HIGH on all three arrives → LOW saves and acknowledges the
   suspend, HIGH runs, LOW resumes from its suspend checkpoint;
2. a fault: the node holding rank 0 loses its agent and ranks (SIGKILL) → the server marks it
   unhealthy after its node timeout and restarts the job on the spare from its latest checkpoint;
3. an ignored suspend: a LOW job that never acknowledges is force-stopped after the grace, HIGH
   runs, LOW resumes from its last periodic checkpoint.

Run from the repository root: ``python scripts/hai_demo.py [--steps N] [--every K]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
from tests.inproc import ClusterThread
from tests.test_hai_timesharing import HIGH

T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {text}", flush=True)


def chain(cluster: ProcCluster, job: str) -> None:
    view = cluster.job(job)
    for task in view["chain"]:
        say(f"    {job} task {task['task']} on {','.join(task['nodes'])}: {task['outcome']}")


def time_sharing(cluster: ProcCluster, users: Fs3Users, top: str, private: str, steps: int, every: int,
                 reference: Path) -> None:
    say("== 1. time-sharing: LOW on 2 nodes, then HIGH on 3")
    directory = f"{top}/timesharing"
    low = cluster.submit(TRAIN, name="ts-low", nodes=2, priority="LOW",
                         env=train_env(directory, steps, every, private=private))
    cluster.wait_job(low, "running", task=0)
    wait_for(lambda: bool(checkpoints(users.fs, directory)), "LOW's first periodic checkpoint")
    high = cluster.submit(HIGH, name="ts-high", nodes=3, priority="HIGH")
    cluster.wait_job(high, "running")
    say(f"LOW suspended; checkpoints on fs3: {checkpoints(users.fs, directory)}")
    cluster.wait_job(high, "finished")
    cluster.wait_job(low, "finished", task=1)
    say(f"LOW's rank 0 started from steps {starts(cluster.tmp / 'out-ts-low')}")
    assert_bit_identical(reference, cluster.tmp / "out-ts-low" / "final.pt")
    assert_alice(users, cluster.tmp / "out-ts-low", directory)
    say("LOW's parameters and optimizer state are bit-identical to the uninterrupted run")
    chain(cluster, low)


def fault(cluster: ProcCluster, users: Fs3Users, top: str, private: str, steps: int, every: int,
          reference: Path) -> None:
    say("== 2. a fault: the node of rank 0 SIGKILLed (agent and ranks), a spare node waiting")
    directory = f"{top}/fault"
    job = cluster.submit(TRAIN, name="fault", nodes=2, env=train_env(directory, steps, every, private=private))
    first = cluster.wait_job(job, "running", task=0)["assigned"]
    wait_for(lambda: len(checkpoints(users.fs, directory)) >= 2, "two periodic checkpoints")
    cluster.kill_node(first[0])
    say(f"checkpoints at the kill: {checkpoints(users.fs, directory)}")
    wait_for(lambda: not cluster.nodes()[first[0]]["healthy"], f"{first[0]} to be marked unhealthy")
    say(f"{first[0]} is unhealthy: {cluster.nodes()[first[0]]['reason']}")
    cluster.wait_job(job, "running", task=1)
    cluster.wait_job(job, "finished", task=1)
    say(f"rank 0 started from steps {starts(cluster.tmp / 'out-fault')}")
    assert_bit_identical(reference, cluster.tmp / "out-fault" / "final.pt")
    assert_alice(users, cluster.tmp / "out-fault", directory)
    say("the restarted job's result is bit-identical to the uninterrupted run")
    chain(cluster, job)


def ignored_suspend(cluster: ProcCluster, users: Fs3Users, top: str, private: str, steps: int, every: int,
                    reference: Path) -> None:
    say("== 3. a LOW job that ignores the suspend request, on the two healthy nodes")
    directory = f"{top}/ignored"
    low = cluster.submit(TRAIN, name="ig-low", nodes=2, priority="LOW",
                         env=train_env(directory, steps, every, private=private, ignore_suspend=True))
    cluster.wait_job(low, "running", task=0)
    wait_for(lambda: len(checkpoints(users.fs, directory)) >= 2, "two periodic checkpoints")
    high = cluster.submit(HIGH, name="ig-high", nodes=2, priority="HIGH")
    cluster.wait_job(high, "running")
    say(f"LOW force-stopped after the grace; checkpoints on fs3: {checkpoints(users.fs, directory)}")
    cluster.wait_job(high, "finished")
    cluster.wait_job(low, "finished", task=1)
    say(f"LOW's rank 0 started from steps {starts(cluster.tmp / 'out-ig-low')} (the last periodic checkpoint)")
    assert_bit_identical(reference, cluster.tmp / "out-ig-low" / "final.pt")
    assert_alice(users, cluster.tmp / "out-ig-low", directory)
    say("LOW's result is bit-identical to the uninterrupted run")
    chain(cluster, low)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of every job")
    parser.add_argument("--every", type=int, default=20, help="steps between periodic checkpoints")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hai-demo-") as scratch:
        tmp = Path(scratch)
        say(f"fs3 in-process cluster and the hai cluster in {tmp}")
        fs3_cluster: Any = ClusterThread(tmp / "fs3")
        users = Fs3Users.make(fs3_cluster.cluster, fs3_cluster.loop)
        cluster = ProcCluster(tmp / "hai-run", users, node_timeout_s=3.0, ack_grace_s=2.0, finish_grace_s=2.0,
                              say=say)
        try:
            top, private = users.workspace()
            say(f"alice's jobs run with her fs3 user token; bob's private file is {private}")
            cluster.start_server()
            for name in ("n1", "n2", "n3"):
                cluster.agent(name)
            wait_for(lambda: len(cluster.nodes()) == 3, "three nodes to register")
            say("nodes n1, n2, n3 registered")
            say("the uninterrupted reference run: the same script outside hai")
            with reference_run(tmp, args.steps, args.every) as reference:
                pass  # waits for it
            time_sharing(cluster, users, top, private, args.steps, args.every, reference)
            fault(cluster, users, top, private, args.steps, args.every, reference)
            ignored_suspend(cluster, users, top, private, args.steps, args.every, reference)
        finally:
            cluster.close()
            users.close()
            fs3_cluster.close()
    say("all three scenarios ended bit-identical to the uninterrupted run")
    return 0


if __name__ == "__main__":
    sys.exit(main())

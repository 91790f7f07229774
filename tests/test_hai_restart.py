"""``hai server`` SIGKILLed mid-run and started again on the same database (issue 20's "server
restart loses no job, queue position or chain"), with real agent processes and running ranks
(``tests/hai_e2e.py``).

Job A runs on both nodes at its second task (suspended once by its user, resumed), B and C wait
behind it. The server is killed and restarted on the same SQLite file and port: every job view
and the queue order are what they were, A's ranks were never restarted (the agents re-attach
with their next heartbeat and the new server counts them as running), A finishes, and B and C
start as the nodes free up.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hai_e2e import Fs3Users, ProcCluster, wait_for
from tests.test_hai_timesharing import HIGH

pytestmark = pytest.mark.slow

# Holds its node until the test opens the gate; acknowledges a suspend; leaves one mark per start.
GATE = """
    import os, sys, time
    import hai.client
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rank, port = os.environ["RANK"], os.environ["MASTER_PORT"]
    open(os.path.join(out, f"start-{port}-{rank}-{os.getpid()}"), "w").close()
    print("started rank", rank, flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "go")):
        if hai.client.receive_suspend_command():
            hai.client.go_suspend()
            sys.exit(0)
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
    print("done rank", rank, flush=True)
"""


@pytest.fixture
def fs3_users(shared_cluster: Any) -> Iterator[Fs3Users]:
    users = Fs3Users.make(shared_cluster.cluster, shared_cluster.loop)
    try:
        yield users
    finally:
        users.close()


def test_a_server_killed_mid_run_loses_no_job_position_or_chain(tmp_path: Path, fs3_users: Fs3Users) -> None:
    cluster = ProcCluster(tmp_path, fs3_users, node_timeout_s=5.0)
    try:
        cluster.start_server()
        cluster.agent("n1")
        cluster.agent("n2")
        wait_for(lambda: len(cluster.nodes()) == 2, "both nodes to register", cluster.server_log)
        a = cluster.submit(GATE, name="a", nodes=2)
        cluster.wait_job(a, "running", task=0)
        b = cluster.submit(HIGH, name="b", nodes=2)
        c = cluster.submit(HIGH, name="c", nodes=1)
        out_a = tmp_path / "out-a"
        wait_for(lambda: len(list(out_a.glob("start-*"))) == 2, "A's two ranks to start")
        assert cluster.http.post(f"/jobs/{a}/suspend").status_code == 200
        cluster.wait_job(a, "running", task=1)  # resumed first: it is first in the queue
        wait_for(lambda: len(list(out_a.glob("start-*"))) == 4, "A's second task's ranks to start")
        pids_before = sorted(out_a.glob("start-*"))

        before_queue = cluster.queue()
        before = {j: cluster.job(j) for j in (a, b, c)}
        assert [j["job_id"] for j in before_queue] == [a, b, c], before_queue
        assert [j["state"] for j in before_queue] == ["running", "queued", "queued"], before_queue
        assert [t["task"] for t in before[a]["chain"]] == [0, 1] and before[a]["chain"][0]["outcome"] == "suspended"

        cluster.kill_server()
        cluster.start_server()

        assert cluster.queue() == before_queue
        assert {j: cluster.job(j) for j in (a, b, c)} == before
        # The agents re-attach: heartbeats reach the new server, the nodes stay healthy and A's
        # task is the one already running (no launch, no stop).
        seen = cluster.nodes()["n1"]["last_heartbeat_s"]
        wait_for(lambda: all(n["last_heartbeat_s"] > seen for n in cluster.nodes().values()),
                 "heartbeats to reach the new server", cluster.nodes)
        assert all(n["healthy"] and n["job"] == a for n in cluster.nodes().values()), cluster.nodes()
        assert sorted(out_a.glob("start-*")) == pids_before
        assert cluster.job(a)["task"] == 1 and cluster.job(a)["state"] == "running"

        (out_a / "go").touch()
        view_a = cluster.wait_job(a, "finished", task=1)
        assert [t["task"] for t in view_a["chain"]] == [0, 1] and view_a["restarts"] == 0, view_a
        assert sorted(out_a.glob("start-*")) == pids_before  # its second task ran to the end
        view_b = cluster.wait_job(b, "finished")
        view_c = cluster.wait_job(c, "finished")
        assert view_a["chain"][1]["ended_s"] <= view_b["chain"][0]["started_s"]
        assert view_a["chain"][1]["ended_s"] <= view_c["chain"][0]["started_s"]
        assert all(n["healthy"] for n in cluster.nodes().values())
    finally:
        cluster.close()

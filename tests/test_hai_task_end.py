"""When a multi-node task ends, through ``hai server``'s API (tests/test_hai_server.py's in-process
cluster, agents played by the test, on SQLite and PostgreSQL): a task ends once every one of its
nodes has reported the end of its ranks, not when rank 0's node has; until then the job holds all
its nodes. A failure on any node ends it at once, and the other nodes' agents are told to stop the
old ranks before anything new starts there. And end to end, with real agents and ranks
(tests/test_hai_agent.py's cluster): a 2-node job is finished only after its last rank is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import test_hai_agent as agents
from tests.test_hai_server import BOB, Clock, Cluster, launches


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cluster(fresh_database: Callable[[], str], clock: Clock) -> Iterator[Cluster]:
    c = Cluster(fresh_database(), clock)
    yield c
    c.close()


def _placed(cluster: Cluster, job: str) -> list[str]:
    view = cluster.job(job)
    assert view["state"] == "running", view
    nodes: list[str] = view["assigned"]
    for node in nodes:
        assert [c["job_id"] for c in launches(cluster.heartbeat(node))] == [job]
    return nodes


def test_a_job_ends_when_its_last_node_reports_not_its_first(cluster: Cluster) -> None:
    for name in ("n1", "n2"):
        cluster.register(name)
    job = cluster.submit(nodes=2)
    cluster.tick()
    first, second = _placed(cluster, job)
    waiting = cluster.submit(token=BOB, name="next", nodes=1)
    # Rank 0 exits at once; rank 1 still runs on the second node.
    assert cluster.report(first, job, 0, "finished")["applied"] is True
    assert cluster.report(first, job, 0, "finished")["applied"] is False  # a repeated report
    cluster.tick()
    view = cluster.job(job)
    assert view["state"] == "running" and view["assigned"] == [first, second] and view["ended"] == [first]
    assert cluster.job(waiting)["state"] == "queued"  # neither node is given away
    nodes = {n["name"]: n["job"] for n in cluster.call("GET", "/nodes")["nodes"]}
    assert nodes == {first: job, second: job}
    # Neither agent is told anything meanwhile: the task is still theirs.
    assert cluster.heartbeat(first, [(job, 0)]) == []
    assert cluster.heartbeat(second, [(job, 0)]) == []
    assert cluster.report(second, job, 0, "finished")["applied"] is True
    view = cluster.job(job)
    assert view["state"] == "finished" and view["chain"][0]["outcome"] == "finished" and view["ended"] == []
    cluster.tick()
    assert cluster.job(waiting)["state"] == "running"
    # A report about the ended task is refused and changes nothing.
    before = cluster.server.state
    cluster.report(second, job, 0, "finished", expect=409)
    assert cluster.server.state == before


def test_a_suspended_node_is_not_reassigned_until_it_reports(cluster: Cluster) -> None:
    for name in ("n1", "n2"):
        cluster.register(name)
    low = cluster.submit(name="low", nodes=2, priority="LOW")
    cluster.tick()
    first, second = _placed(cluster, low)
    high = cluster.submit(token=BOB, name="high", nodes=2, priority="HIGH")
    cluster.tick()
    assert cluster.job(low)["state"] == "suspending"
    # Rank 0's node saved and exited; the second node's ranks are still in their grace period.
    cluster.report(first, low, 0, "suspended")
    for _ in range(3):
        cluster.tick()
        assert cluster.job(low)["state"] == "suspending"
        assert cluster.job(high)["state"] == "queued"
        assert launches(cluster.heartbeat(first, [(low, 0)])) == []
        assert cluster.heartbeat(second, [(low, 0)]) == [{"type": "suspend", "job_id": low, "task": 0}]
    # Force-stopped at the end of the grace: the agent reports it as suspended too.
    cluster.report(second, low, 0, "suspended", reason="force-stopped: no acknowledgement")
    assert cluster.job(low)["state"] == "queued"
    cluster.tick()
    assert cluster.job(high)["state"] == "running"
    assert [t["outcome"] for t in cluster.job(low)["chain"]] == ["suspended"]


def test_a_node_that_finished_then_a_failure_is_a_failure(cluster: Cluster) -> None:
    for name in ("n1", "n2"):
        cluster.register(name)
    job = cluster.submit(nodes=2)
    cluster.tick()
    first, second = _placed(cluster, job)
    cluster.report(first, job, 0, "finished")
    cluster.report(second, job, 0, "failed", exit_code=3)
    view = cluster.job(job)
    assert view["state"] == "queued" and view["restarts"] == 1 and view["task"] == 1
    assert view["chain"][0]["outcome"].startswith("failed: rank exited 3")


def test_a_suspend_report_for_a_running_job_is_refused(cluster: Cluster) -> None:
    for name in ("n1", "n2"):
        cluster.register(name)
    job = cluster.submit(nodes=2)
    cluster.tick()
    first, _ = _placed(cluster, job)
    before = cluster.server.state
    cluster.report(first, job, 0, "suspended", expect=409)
    assert cluster.server.state == before


def test_a_failure_frees_the_other_node_with_a_stop_before_the_next_launch(cluster: Cluster) -> None:
    """A failure frees the job's other nodes at once; the agent there is told to stop the old ranks
    ahead of the next job's launch, in one answer (the agent defers a launch while a stopped task's
    ranks are still ending: tests/test_hai_agent_handover.py), and again until it forgets them."""
    for name in ("n1", "n2"):
        cluster.register(name)
    job = cluster.submit(nodes=2)
    cluster.tick()
    first, second = _placed(cluster, job)
    cluster.report(first, job, 0, "failed", exit_code=1)  # first is now unhealthy
    other = cluster.submit(token=BOB, name="other", nodes=1)
    cluster.tick()
    assert cluster.job(other)["assigned"] == [second]
    for _ in range(2):
        commands = cluster.heartbeat(second, [(job, 0)])
        assert commands[0] == {"type": "stop", "job_id": job, "task": 0}
        assert [c["job_id"] for c in launches(commands[1:])] == [other]
    # The old ranks are gone: the agent forgot the task, and holds the launched one.
    assert cluster.heartbeat(second, [(other, 0)]) == []


# -- with real agents -----------------------------------------------------------------------------

RANK_0_EXITS_AT_ONCE = """
    import os, sys, time
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    if os.environ["RANK"] == "1":
        time.sleep(2.0)
        with open(os.path.join(out, "rank-1-done"), "w") as f:
            f.write(str(time.time()))
"""


@pytest.fixture
def with_agents(tmp_path: Path) -> Iterator[agents.Cluster]:
    c = agents.Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def test_a_job_whose_rank_0_exits_at_once_ends_after_rank_1(with_agents: agents.Cluster) -> None:
    """Two in-process agents, one rank each: rank 0 exits at once, rank 1 sleeps 2 s and leaves a
    marker. The job is seen running after rank 0's node reported, and is finished only once the
    marker exists (before, rank 1 was stopped, or never launched, when rank 0's node reported)."""
    cluster = with_agents
    cluster.agent("n1", "10.0.0.1")
    cluster.agent("n2", "10.0.0.2")
    agents.wait_for(lambda: len(cluster.nodes()) == 2, "both nodes to register")
    job = cluster.submit(RANK_0_EXITS_AT_ONCE, nodes=2)
    marker = cluster.tmp / "out" / "rank-1-done"
    states: list[tuple[str, bool]] = []

    def ended() -> bool:
        view = cluster.job(job)
        states.append((view["state"], marker.exists()))
        return view["state"] in ("finished", "failed")

    agents.wait_for(ended, f"{job} to end", lambda: states[-3:])
    assert states[-1] == ("finished", True), states[-3:]
    assert all(seen for state, seen in states if state == "finished")
    view = cluster.job(job)
    assert [t["outcome"] for t in view["chain"]] == ["finished"] and view["restarts"] == 0
    agents.wait_for(lambda: all(not a.held() for a, _ in cluster.agents.values()), "the agents to drop the task")

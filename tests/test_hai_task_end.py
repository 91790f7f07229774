"""When a multi-node task ends, through ``hai server``'s API (tests/test_hai_server.py's in-process
cluster, agents played by the test, on SQLite and PostgreSQL): a task ends once every one of its
nodes has reported the end of its ranks, not when rank 0's node has; until then the job holds all
its nodes. A failure on any node ends it at once, and a node whose agent still runs an old task's
ranks is launched nothing new until they are gone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

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
    assert view["state"] == "running" and view["assigned"] == [first, second]
    assert cluster.job(waiting)["state"] == "queued"  # neither node is given away
    nodes = {n["name"]: n["job"] for n in cluster.call("GET", "/nodes")["nodes"]}
    assert nodes == {first: job, second: job}
    # Neither agent is told anything meanwhile: the task is still theirs.
    assert cluster.heartbeat(first, [(job, 0)]) == []
    assert cluster.heartbeat(second, [(job, 0)]) == []
    assert cluster.report(second, job, 0, "finished")["applied"] is True
    view = cluster.job(job)
    assert view["state"] == "finished" and view["chain"][0]["outcome"] == "finished"
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


def test_no_launch_beside_ranks_still_being_stopped(cluster: Cluster) -> None:
    """A failure frees the job's other nodes at once; the agent there is told to stop the old ranks,
    and gets the next job's launch only once its heartbeat no longer lists them."""
    for name in ("n1", "n2"):
        cluster.register(name)
    job = cluster.submit(nodes=2)
    cluster.tick()
    first, second = _placed(cluster, job)
    cluster.report(first, job, 0, "failed", exit_code=1)  # first is now unhealthy
    other = cluster.submit(token=BOB, name="other", nodes=1)
    cluster.tick()
    assert cluster.job(other)["assigned"] == [second]
    assert cluster.heartbeat(second, [(job, 0)]) == [{"type": "stop", "job_id": job, "task": 0}]
    assert cluster.heartbeat(second, [(job, 0)]) == [{"type": "stop", "job_id": job, "task": 0}]
    # The old ranks are gone: the agent forgot the task, and the launch comes.
    assert [c["job_id"] for c in launches(cluster.heartbeat(second, []))] == [other]

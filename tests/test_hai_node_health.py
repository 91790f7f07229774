"""Node health through ``hai server``'s API (``hai/server.py``, ``hai/rules.py``): a node where a rank
failed, or that was lost, is told to validate once it is idle, and its agent's verdict
(``POST /agents/{node}/validation``) puts it back or keeps it out with the validator's sentences;
too many failures in a row leave it to an admin. Agents are played by the test, as in
tests/test_hai_server.py, on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.test_hai_server import ADMIN, AGENT, Clock, Cluster


@pytest.fixture
def cluster(fresh_database: Callable[[], str]) -> Iterator[Cluster]:
    c = Cluster(fresh_database(), Clock())
    yield c
    c.close()


def _node(cluster: Cluster, name: str) -> dict[str, Any]:
    nodes: dict[str, dict[str, Any]] = {n["name"]: n for n in cluster.call("GET", "/nodes")["nodes"]}
    return nodes[name]


def _validation(cluster: Cluster, node: str, expect: int = 200, **body: Any) -> Any:
    return cluster.call("POST", f"/agents/{node}/validation", AGENT, expect=expect, json=body)


def _failed_rank(cluster: Cluster) -> tuple[str, str]:
    """Two nodes, a job on one of them whose rank fails there: (job, the node)."""
    for name in ("n1", "n2"):
        cluster.register(name)
    job = cluster.submit()
    cluster.tick()
    bad: str = cluster.job(job)["assigned"][0]
    cluster.report(bad, job, 0, "failed", exit_code=1)
    return job, bad


def test_a_node_whose_rank_failed_validates_and_takes_work_again(cluster: Cluster) -> None:
    job, bad = _failed_rank(cluster)
    view = _node(cluster, bad)
    assert view["health"] == "needs validation" and not view["healthy"] and "rank exited 1" in view["reason"]
    # The old task is stopped first; only an idle node is told to validate.
    assert cluster.heartbeat(bad, [(job, 0)]) == [{"type": "stop", "job_id": job, "task": 0}]
    assert [c["type"] for c in cluster.heartbeat(bad)] == ["validate"]
    assert _validation(cluster, bad, event="started")["health"] == "validating"
    assert cluster.heartbeat(bad) == []  # running: not asked again
    other = cluster.submit(nodes=2)
    cluster.tick(31)  # past the failed job's back-off: it restarts on the other node
    assert cluster.job(job)["state"] == "running" and cluster.job(other)["state"] == "queued"
    view = _validation(cluster, bad, passed=True, summary={"gemm_gflops": 812.5})
    assert view["health"] == "healthy" and view["reason"] == "" and view["validation_failures"] == 0
    assert view["last_validation"]["summary"] == {"gemm_gflops": 812.5}
    cluster.report(cluster.job(job)["assigned"][0], job, 1, "finished")
    cluster.tick()
    assert sorted(cluster.job(other)["assigned"]) == ["n1", "n2"]


def test_failed_validations_keep_the_node_out_and_too_many_leave_it_to_an_admin(cluster: Cluster) -> None:
    _job, bad = _failed_rank(cluster)
    view = _validation(cluster, bad, passed=False, reasons=["gemm 310 GFLOP/s below 400 GFLOP/s", "ib0: down"])
    assert view["health"] == "needs validation"
    assert view["reason"] == "validation failed: gemm 310 GFLOP/s below 400 GFLOP/s; ib0: down"
    assert [c["type"] for c in cluster.heartbeat(bad)] == ["validate"]  # another try
    for _ in range(2):  # Config.max_validation_failures is 3
        _validation(cluster, bad, event="started")
        view = _validation(cluster, bad, passed=False, reasons=["ib0: down"])
    assert view["health"] == "unhealthy" and view["validation_failures"] == 3
    assert "3 times in a row, an admin must heal it: ib0: down" in view["reason"]
    assert cluster.heartbeat(bad) == []  # no more tries: it does not flap
    # Neither a scheduled run nor a passing verdict puts it back; an admin does.
    assert "admin" in _validation(cluster, bad, 409, event="started")["detail"]
    _validation(cluster, bad, 409, passed=True)
    assert _node(cluster, bad)["health"] == "unhealthy"
    healed = cluster.call("POST", f"/nodes/{bad}/healthy", ADMIN)
    assert healed["health"] == "healthy" and healed["validation_failures"] == 0


def test_a_lost_node_validates_once_it_heartbeats_again(cluster: Cluster) -> None:
    for name in ("n1", "n2"):
        cluster.register(name)
    for _ in range(4):  # n1 falls silent
        cluster.clock.now += 20
        cluster.heartbeat("n2")
        cluster.server.tick(cluster.clock.now)
    assert _node(cluster, "n1")["health"] == "needs validation"
    assert [c["type"] for c in cluster.heartbeat("n1")] == ["validate"]
    cluster.tick()
    assert _node(cluster, "n1")["health"] == "needs validation"  # a heartbeat alone is not enough
    assert _validation(cluster, "n1", passed=True)["health"] == "healthy"


def test_a_busy_node_is_not_validated_and_bad_verdicts_are_refused(cluster: Cluster) -> None:
    cluster.register("n1")
    job = cluster.submit()
    cluster.tick()
    assert "runs job" in _validation(cluster, "n1", 409, event="started")["detail"]
    assert cluster.job(job)["state"] == "running"
    _validation(cluster, "n1", 422)  # a verdict without passed
    _validation(cluster, "n1", 422, passed=False, reasons=["x"] * 17)
    _validation(cluster, "n1", 422, passed=False, reasons=["x" * 201])
    _validation(cluster, "n1", 422, passed=True, summary={f"m{i}": 1.0 for i in range(33)})
    _validation(cluster, "n9", 404, passed=True)
    cluster.call("POST", "/agents/n1/validation", "alice-token", expect=401, json={"passed": True})

"""``hai agent``'s validation (``hai/agent.py``) against a real server on a free port, with a fake
validator so it stays fast: a node whose rank failed is told to validate and comes back when its
validator passes; an idle node validates on its schedule without missing a heartbeat, takes no work
while the validator runs, and a failing verdict keeps it out with the validator's sentences.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hai.agent import Agent, AgentConfig, NodeVerdict
from hai.launcher import LocalLogSink
from tests.test_hai_agent import AGENT, FAIL_ONCE, SLEEPER, Cluster, wait_for


class FakeValidator:
    """Counts its runs and gives ``verdict``; a ``blocking`` one holds each run until the test sets
    ``release``, which lets exactly one run through."""

    def __init__(self, verdict: NodeVerdict, blocking: bool = False) -> None:
        self.verdict = verdict
        self.blocking = blocking
        self.runs = 0
        self.running = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> NodeVerdict:
        self.runs += 1
        self.running.set()
        if self.blocking:
            assert self.release.wait(30.0), "the test never released the validator"
            if self.blocking:  # still one run per release (a test that ends unblocks them all)
                self.release.clear()
        self.running.clear()
        return self.verdict


def _agent(cluster: Cluster, name: str, validator: FakeValidator, **settings: Any) -> Agent:
    config = AgentConfig(server=cluster.url, node=name, token=AGENT, address="127.0.0.1", heartbeat_s=0.2,
                         http_timeout_s=5.0, validation_retry_s=0.0, **settings)
    agent = Agent(config, LocalLogSink(cluster.tmp / "logs"), control_root=str(cluster.tmp), validator=validator)
    thread = threading.Thread(target=agent.serve, daemon=True)
    thread.start()
    cluster.agents[name] = (agent, thread)
    return agent


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def test_a_node_whose_rank_failed_validates_and_runs_the_restart(cluster: Cluster) -> None:
    validator = FakeValidator(NodeVerdict((), {"gemm_gflops": 900.0}))
    _agent(cluster, "n1", validator)
    wait_for(lambda: "n1" in cluster.nodes(), "the node to register")
    job = cluster.submit(FAIL_ONCE)
    view = cluster.wait_job(job, "finished")
    # The only node was suspect after the failure; it ran the restart only once it had passed.
    assert validator.runs == 1 and view["restarts"] == 1
    assert [t["nodes"] for t in view["chain"]] == [["n1"], ["n1"]]
    node = cluster.nodes()["n1"]
    assert node["health"] == "healthy" and node["last_validation"]["summary"] == {"gemm_gflops": 900.0}


def test_an_idle_node_validates_on_schedule_and_a_failure_keeps_it_out(cluster: Cluster) -> None:
    validator = FakeValidator(NodeVerdict(["gemm: 310 GFLOP/s below 400 GFLOP/s"]), blocking=True)
    agent = _agent(cluster, "n1", validator, validate_every_s=0.5)
    assert validator.running.wait(30.0)
    wait_for(lambda: cluster.nodes()["n1"]["health"] == "validating", "the node to be validating")
    job = cluster.submit(SLEEPER)
    seen = cluster.nodes()["n1"]["last_heartbeat_s"]
    wait_for(lambda: cluster.nodes()["n1"]["last_heartbeat_s"] > seen + 0.5, "heartbeats while validating")
    assert cluster.job(job)["state"] == "queued"
    validator.release.set()
    wait_for(lambda: cluster.nodes()["n1"]["validation_failures"] == 1, "the failed verdict")
    node = cluster.nodes()["n1"]
    assert not node["healthy"] and node["reason"] == "validation failed: gemm: 310 GFLOP/s below 400 GFLOP/s"
    assert node["last_validation"]["passed"] is False
    # The server asks for another run; one that passes lets the job start.
    validator.verdict = NodeVerdict()
    validator.release.set()
    cluster.wait_job(job, "running")
    assert cluster.nodes()["n1"]["health"] == "healthy" and validator.runs >= 2
    wait_for(lambda: agent.held() == [(job, 0)], "the launch")
    assert not agent.validating()


def test_a_validator_past_its_time_fails_the_node(cluster: Cluster) -> None:
    stuck = FakeValidator(NodeVerdict(), blocking=True)
    _agent(cluster, "n1", stuck, validate_every_s=0.2, validation_timeout_s=0.5)
    wait_for(lambda: cluster.nodes().get("n1", {}).get("validation_failures", 0) >= 1, "the timed-out verdict")
    node = cluster.nodes()["n1"]  # asked again at once (validation_retry_s=0): any of the runs' states
    assert not node["healthy"] and "the validator did not finish within 0.5 s" in node["reason"]
    stuck.blocking = False
    stuck.release.set()


def test_the_command_line_takes_the_schedule_and_the_time_bound() -> None:
    from hai.__main__ import build_parser

    base = ["agent", "--server", "http://127.0.0.1:9", "--node", "n1"]
    args = build_parser().parse_args(base)
    assert args.validate_every_s == 3600.0 and args.validation_timeout_s == 1800.0
    args = build_parser().parse_args([*base, "--validate-every-s", "0", "--validation-timeout-s", "60"])
    assert args.validate_every_s == 0.0 and args.validation_timeout_s == 60.0
    for bad in (["--validate-every-s", "-1"], ["--validate-every-s", "inf"], ["--validation-timeout-s", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, *bad])

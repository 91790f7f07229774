"""``hai agent`` (``hai/agent.py``) against the real server app, served by uvicorn on a free port
in a thread, on a SQLite file per test, with the scheduling loop running on the wall clock (a
tenth of a second per pass, a short restart back-off and node timeout).

The agents are in-process :class:`~hai.agent.Agent` objects, each heartbeating from a thread of
its own and running small Python scripts as ranks. Covered: a 2-node job with the env:// numbers
each rank sees, a failing rank restarted on the other node, a cooperative suspend resumed as the
next task, a silent agent whose node is lost and whose job moves, and the command line. Every
wait polls with a generous deadline; every test ends with no rank left running.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from hai.agent import Agent, AgentConfig, memory_bytes, node_cpus
from hai.launcher import LocalLogSink
from hai.rules import Config
from hai.server import HaiServer, ServerConfig, User, Users, create_app, hash_token
from hai.store import Store, default_url

ALICE, AGENT = "alice-token", "agent-token"
USERS = Users(users=(User("alice", hash_token(ALICE), fs3_token="fs3-alice"),), agent_token_sha256=hash_token(AGENT))
CONFIG = ServerConfig(rules=Config(default_quota_nodes=100, backoff_base_s=0.5, node_timeout_s=3.0),
                      tick_interval_s=0.1)
ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 30.0


class Cluster:
    """A server on a free port and the agents started against it."""

    def __init__(self, tmp: Path, users: Users = USERS) -> None:
        self.tmp = tmp
        self.server = HaiServer(Store.open(default_url(tmp)), users, CONFIG)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(create_app(self.server), host="127.0.0.1", port=port,
                                                     log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.uvicorn.started, "the server to start")
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=10.0)
        self.agents: dict[str, tuple[Agent, threading.Thread]] = {}

    def agent(self, name: str, address: str, **settings: Any) -> Agent:
        config = AgentConfig(server=self.url, node=name, token=AGENT, address=address, heartbeat_s=0.2,
                             http_timeout_s=5.0, **settings)
        agent = Agent(config, LocalLogSink(self.tmp / "logs"), control_root=str(self.tmp))
        thread = threading.Thread(target=agent.serve, daemon=True)
        thread.start()
        self.agents[name] = (agent, thread)
        return agent

    def kill(self, name: str) -> None:
        agent, thread = self.agents[name]
        agent.close()
        thread.join(10.0)
        assert not thread.is_alive()

    def close(self) -> None:
        for name in list(self.agents):
            self.kill(name)
        self.http.close()
        self.uvicorn.should_exit = True
        self.thread.join(10.0)
        self.server.close()

    def submit(self, script: str, **spec: Any) -> str:
        path = self.tmp / f"job-{len(list(self.tmp.glob('job-*.py')))}.py"
        path.write_text(textwrap.dedent(script))
        body = {"name": "train", "command": f"{sys.executable} {path} {self.tmp / 'out'}", "nodes": 1,
                "env": {"PYTHONPATH": str(ROOT)}, **spec}
        response = self.http.post("/jobs", json=body)
        assert response.status_code == 201, response.text
        job_id: str = response.json()["job_id"]
        return job_id

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.http.get(f"/jobs/{job_id}")
        assert response.status_code == 200, response.text
        view: dict[str, Any] = response.json()
        return view

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["name"]: n for n in self.http.get("/nodes").json()["nodes"]}

    def wait_job(self, job_id: str, state: str, task: int | None = None) -> dict[str, Any]:
        views: list[dict[str, Any]] = []

        def reached() -> bool:
            views.append(self.job(job_id))
            return bool(views[-1]["state"] == state and (task is None or views[-1]["task"] == task))

        wait_for(reached, f"{job_id} to be {state}", lambda: views[-1] if views else None)
        return views[-1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], bool], what: str, show: Callable[[], object] = lambda: None) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {show()}")
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


# Ranks of a job meet before they end, as a collective would: a barrier on files in the output
# directory (each node reports its own ranks' end; the rank files are written before any leaves).
BARRIER = """
    import glob, os, time
    def barrier(out, prefix):
        open(os.path.join(out, prefix + os.environ["RANK"]), "w").close()
        deadline = time.monotonic() + 20
        while len(glob.glob(os.path.join(out, prefix + "*"))) < int(os.environ["WORLD_SIZE"]):
            assert time.monotonic() < deadline, "barrier timed out"
            time.sleep(0.02)
"""

ENV_SCRIPT = BARRIER + """
    import json, sys
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FS3_TOKEN")
    with open(os.path.join(out, os.environ["RANK"] + ".json"), "w") as f:
        json.dump({n: os.environ.get(n) for n in names}, f)
    barrier(out, "done-")
    print("rank", os.environ["RANK"], "done", flush=True)
"""


def test_two_node_job_runs_and_finishes(cluster: Cluster) -> None:
    cluster.agent("n1", "10.0.0.1")
    cluster.agent("n2", "10.0.0.2")
    wait_for(lambda: len(cluster.nodes()) == 2, "both nodes to register")
    nodes = cluster.nodes()
    assert nodes["n1"]["cpus"] == node_cpus() > 0 and nodes["n1"]["memory_bytes"] == memory_bytes() > 0
    job = cluster.submit(ENV_SCRIPT, nodes=2, ranks_per_node=2)
    view = cluster.wait_job(job, "finished")
    first = view["assigned"] or view["chain"][0]["nodes"]
    master = "10.0.0.1" if first[0] == "n1" else "10.0.0.2"
    seen = {int(p.stem): json.loads(p.read_text()) for p in (cluster.tmp / "out").glob("*.json")}
    assert sorted(seen) == [0, 1, 2, 3]
    ports = {s["MASTER_PORT"] for s in seen.values()}
    assert len(ports) == 1
    for rank, env in seen.items():
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank % 2)
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == master and env["FS3_TOKEN"] == "fs3-alice"
    assert (cluster.tmp / "logs" / job / "3.log").read_text() == "rank 3 done\n"
    # Both agents forget the task once the server no longer expects it.
    wait_for(lambda: all(not a.held() for a, _ in cluster.agents.values()), "the agents to drop the task")
    assert all(n["healthy"] and n["job"] is None for n in cluster.nodes().values())


FAIL_ONCE = """
    import os, sys
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    marker = os.path.join(out, "failed-once")
    if not os.path.exists(marker):
        open(marker, "w").close()
        print("failing", flush=True)
        sys.exit(1)
    print("fine", flush=True)
"""


def test_failed_rank_restarts_on_the_other_node(cluster: Cluster) -> None:
    cluster.agent("n1", "10.0.0.1")
    cluster.agent("n2", "10.0.0.2")
    wait_for(lambda: len(cluster.nodes()) == 2, "both nodes to register")
    job = cluster.submit(FAIL_ONCE)
    view = cluster.wait_job(job, "finished")
    assert view["restarts"] == 1
    chain = view["chain"]
    assert [t["task"] for t in chain] == [0, 1]
    assert "rank exited 1" in chain[0]["outcome"]
    bad = chain[0]["nodes"][0]
    assert chain[1]["nodes"] != [bad]
    node = cluster.nodes()[bad]
    assert not node["healthy"] and "rank exited 1" in node["reason"]


SUSPENDABLE = BARRIER + """
    import sys
    import hai.client
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    resumed = os.path.exists(os.path.join(out, "suspended-0"))
    for step in range(100000):
        print("step", step, flush=True)
        if resumed and step >= 3:
            barrier(out, "resumed-")
            sys.exit(0)
        if hai.client.receive_suspend_command():
            barrier(out, "suspended-")  # the collective checkpoint
            hai.client.go_suspend()
            sys.exit(0)
        time.sleep(0.05)
"""


def test_suspend_requeues_and_resumes_as_next_task(cluster: Cluster) -> None:
    agents = [cluster.agent("n1", "10.0.0.1"), cluster.agent("n2", "10.0.0.2")]
    wait_for(lambda: len(cluster.nodes()) == 2, "both nodes to register")
    job = cluster.submit(SUSPENDABLE, nodes=2)
    cluster.wait_job(job, "running")
    wait_for(lambda: all(a.held() == [(job, 0)] for a in agents), "both agents to launch task 0")
    # The job writes output: the heartbeats carry progress.
    launcher = agents[0].launcher((job, 0))
    assert launcher is not None
    wait_for(lambda: launcher.report().log_bytes > 0, "rank output")
    response = cluster.http.post(f"/jobs/{job}/suspend")
    assert response.status_code == 200, response.text
    view = cluster.wait_job(job, "finished", task=1)
    assert view["chain"][0]["outcome"] == "suspended"
    out = cluster.tmp / "out"
    assert {p.name for p in out.iterdir()} >= {"suspended-0", "suspended-1", "resumed-0", "resumed-1"}
    assert "step 3" in (cluster.tmp / "logs" / job / "0.log").read_text()


IGNORES_SUSPEND = """
    import time
    while True:
        print("busy", flush=True)
        time.sleep(0.05)
"""


def test_ignored_suspend_is_force_stopped_and_still_requeued(cluster: Cluster) -> None:
    # Short graces, so the test does not wait 10 s.
    agent = cluster.agent("n1", "10.0.0.1", ack_grace_s=0.5, finish_grace_s=0.5, term_grace_s=0.5)
    job = cluster.submit(IGNORES_SUSPEND)
    cluster.wait_job(job, "running")
    wait_for(lambda: agent.held() == [(job, 0)], "the launch")
    launcher = agent.launcher((job, 0))
    assert launcher is not None
    pids = launcher.pids
    assert cluster.http.post(f"/jobs/{job}/suspend").status_code == 200
    view = cluster.wait_job(job, "running", task=1)  # queued, then placed again on the only node
    assert view["chain"][0]["outcome"] == "suspended" and view["restarts"] == 0
    assert cluster.nodes()["n1"]["healthy"]
    wait_for(lambda: not any(pid_alive(p) for p in pids), "task 0's ranks to be gone")
    assert cluster.http.post(f"/jobs/{job}/stop").status_code == 200
    wait_for(lambda: not agent.held(), "the stop to reach the agent")


SLEEPER = """
    import time
    while True:
        print("alive", flush=True)
        time.sleep(0.2)
"""


def test_silent_agent_loses_its_node_and_the_job_moves(cluster: Cluster) -> None:
    cluster.agent("n1", "10.0.0.1")
    cluster.agent("n2", "10.0.0.2")
    wait_for(lambda: len(cluster.nodes()) == 2, "both nodes to register")
    job = cluster.submit(SLEEPER)
    held = cluster.wait_job(job, "running")["assigned"][0]
    agent = cluster.agents[held][0]
    wait_for(lambda: agent.held() == [(job, 0)], "the launch")
    launcher = agent.launcher((job, 0))
    assert launcher is not None
    pids = launcher.pids
    cluster.kill(held)  # stops heartbeating and kills its ranks, reporting nothing
    assert not any(pid_alive(p) for p in pids)
    spare = "n2" if held == "n1" else "n1"
    view = cluster.wait_job(job, "running", task=1)
    assert view["assigned"] == [spare] and view["restarts"] == 1
    assert "lost" in view["chain"][0]["outcome"]
    node = cluster.nodes()[held]
    assert not node["healthy"] and node["reason"] == "no heartbeat"
    wait_for(lambda: cluster.agents[spare][0].held() == [(job, 1)], "the spare to launch task 1")


def test_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hai import agent as hai_agent
    from hai.__main__ import build_parser, main

    args = build_parser().parse_args(["agent", "--server", "http://127.0.0.1:9", "--node", "n1", "--zone", "z",
                                      "--group", "g", "--address", "10.0.0.1", "--heartbeat-s", "0.5",
                                      "--label", "gpu=a100", "--log-dir", str(tmp_path)])
    assert args.heartbeat_s == 0.5 and args.label == [("gpu", "a100")] and args.zone == "z"
    monkeypatch.delenv("HAI_AGENT_TOKEN", raising=False)
    assert main(["agent", "--server", "http://127.0.0.1:9", "--node", "n1"]) == 2  # no token
    token = tmp_path / "token"
    token.write_text("t\n")
    argv = ["agent", "--server", "http://127.0.0.1:9", "--node", "n1", "--token-file", str(token), "--validate"]
    args = build_parser().parse_args(argv)
    assert hai_agent.run(args, validator=lambda _: ["gemm: wrong result"]) == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--heartbeat-s", "0"])

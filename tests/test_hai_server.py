"""``hai server`` (``hai/server.py``) in-process: the HTTP API through FastAPI's TestClient and the
scheduling loop driven with virtual time (:meth:`HaiServer.tick`), on a database of its own per
test: each test runs twice, on a SQLite file and on the private PostgreSQL server (tests/postgres.py).

Agents are played by the test: they register, heartbeat with what they run, and report how tasks
ended. Covered: placement and the launch numbers, preemption by suspend and the resume as the next
task of the chain, a failing rank, a silent node, auth, bad job files, body and page bounds, a
server restarted on the same database, and replayed reports.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hai import server as hai_server
from hai.rules import Config
from hai.server import HaiServer, ServerConfig, User, Users, create_app, hash_token
from hai.store import Store

ALICE, BOB, ADMIN, AGENT = "alice-token", "bob-token", "admin-token", "agent-token"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


USERS = Users(users=(User("alice", hash_token(ALICE), fs3_token="fs3-alice"),
                     User("bob", hash_token(BOB), fs3_token="fs3-bob"),
                     User("root", hash_token(ADMIN), admin=True)),
              agent_token_sha256=hash_token(AGENT))
CONFIG = ServerConfig(rules=Config(default_quota_nodes=100, backoff_base_s=30.0, node_timeout_s=60.0))


class Cluster:
    """A server on ``url`` with a TestClient, and helpers for users and agents."""

    def __init__(self, url: str, clock: Clock) -> None:
        self.clock = clock
        self.server = HaiServer(Store.open(url), USERS, CONFIG, clock=clock)
        self.client = TestClient(create_app(self.server, run_loop=False))
        self.client.__enter__()

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        self.server.close()

    def call(self, method: str, path: str, token: str | None = ALICE, expect: int = 200, **kw: Any) -> Any:
        headers = {**kw.pop("headers", {}), **({"Authorization": f"Bearer {token}"} if token else {})}
        response = self.client.request(method, path, headers=headers, **kw)
        assert response.status_code == expect, (response.status_code, response.text)
        return response.json()

    def register(self, name: str, zone: str = "z1", group: str = "default") -> None:
        self.call("POST", "/agents/register", AGENT,
                  json={"name": name, "cpus": 8, "memory_bytes": 1 << 30, "zone": zone, "group": group,
                        "labels": {"gpu": "a100"}, "address": f"10.0.0.{name[-1]}"})

    def heartbeat(self, node: str, running: list[tuple[str, int]] | None = None,
                  progress: bool = False) -> list[dict[str, Any]]:
        body = {"running": [{"job_id": j, "task": t, "progress": progress} for j, t in running or []]}
        commands: list[dict[str, Any]] = self.call("POST", f"/agents/{node}/heartbeat", AGENT, json=body)["commands"]
        return commands

    def report(self, node: str, job: str, task: int, event: str, expect: int = 200, **kw: Any) -> Any:
        return self.call("POST", f"/agents/{node}/report", AGENT, expect=expect,
                         json={"job_id": job, "task": task, "event": event, **kw})

    def submit(self, token: str = ALICE, **spec: Any) -> str:
        body = {"name": "train", "command": "python train.py --steps 10", "nodes": 1, **spec}
        job_id: str = self.call("POST", "/jobs", token, expect=201, json=body)["job_id"]
        return job_id

    def job(self, job_id: str) -> dict[str, Any]:
        view: dict[str, Any] = self.call("GET", f"/jobs/{job_id}")
        return view

    def tick(self, advance_s: float = 1.0) -> None:
        self.clock.now += advance_s
        self.server.tick(self.clock.now)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def url(fresh_database: Callable[[], str]) -> str:
    return fresh_database()


@pytest.fixture
def cluster(url: str, clock: Clock) -> Iterator[Cluster]:
    c = Cluster(url, clock)
    yield c
    c.close()


def launches(commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in commands if c["type"] == "launch"]


def test_submit_place_and_launch_numbers(cluster: Cluster) -> None:
    for name in ("n1", "n2", "n3"):
        cluster.register(name)
    job = cluster.submit(nodes=2, ranks_per_node=4, env={"LR": "0.1"}, priority="HIGH")
    assert cluster.job(job)["state"] == "queued"
    cluster.tick()
    view = cluster.job(job)
    assert view["state"] == "running" and len(view["assigned"]) == 2
    first, second = view["assigned"]
    a = launches(cluster.heartbeat(first))
    b = launches(cluster.heartbeat(second))
    assert len(a) == len(b) == 1
    a0, b0 = a[0], b[0]
    assert a0["world_size"] == b0["world_size"] == 8
    assert (a0["first_rank"], b0["first_rank"]) == (0, 4)
    assert a0["local_world_size"] == 4
    assert a0["master_addr"] == b0["master_addr"] == f"10.0.0.{first[-1]}"
    assert a0["master_port"] == b0["master_port"] == hai_server.master_port(CONFIG, cluster.server.state.jobs[job])
    assert a0["argv"] == ["python", "train.py", "--steps", "10"]
    assert a0["env"] == {"LR": "0.1"}
    assert a0["fs3_token"] == "fs3-alice" and a0["task"] == 0
    # Once the agent runs it, nothing more is sent; the free node has nothing to do.
    assert cluster.heartbeat(first, [(job, 0)]) == []
    assert cluster.heartbeat("n3") == [] or all(c["job_id"] != job for c in cluster.heartbeat("n3"))
    cluster.report(first, job, 0, "started")
    cluster.report(first, job, 0, "finished")
    assert cluster.job(job)["state"] == "running"  # the second node's ranks have not ended yet
    cluster.report(second, job, 0, "finished")
    assert cluster.job(job)["state"] == "finished"
    # Each agent still lists the task until it is told to forget it.
    assert cluster.heartbeat(second, [(job, 0)]) == [{"type": "stop", "job_id": job, "task": 0}]
    nodes = {n["name"]: n for n in cluster.call("GET", "/nodes")["nodes"]}
    assert nodes["n1"]["labels"]["gpu"] == "a100" and nodes["n1"]["job"] is None


def test_preemption_suspend_ack_and_resume(cluster: Cluster) -> None:
    for name in ("n1", "n2"):
        cluster.register(name)
    low = cluster.submit(name="low", nodes=2, priority="LOW")
    cluster.tick()
    assert cluster.job(low)["state"] == "running"
    for node in ("n1", "n2"):
        assert launches(cluster.heartbeat(node))[0]["task"] == 0
    high = cluster.submit(token=BOB, name="high", nodes=2, priority="HIGH")
    cluster.tick()
    assert cluster.job(low)["state"] == "suspending"
    assert "suspend" in cluster.job(high)["reason"]
    for node in ("n1", "n2"):
        assert cluster.heartbeat(node, [(low, 0)]) == [{"type": "suspend", "job_id": low, "task": 0}]
    for node in ("n1", "n2"):
        cluster.report(node, low, 0, "suspended")
    assert cluster.job(low)["state"] == "queued"
    cluster.tick()
    assert cluster.job(high)["state"] == "running"
    assert cluster.job(low)["state"] == "queued"
    commands = cluster.heartbeat("n1")
    assert [c["job_id"] for c in launches(commands)] == [high]
    for node in cluster.job(high)["assigned"]:
        cluster.report(node, high, 0, "finished")
    cluster.tick()
    view = cluster.job(low)
    assert view["state"] == "running" and view["task"] == 1
    assert [t["outcome"] for t in view["chain"]] == ["suspended", "running"]
    assert launches(cluster.heartbeat("n1"))[0]["task"] == 1


def test_rank_failure_restarts_elsewhere_with_backoff(cluster: Cluster) -> None:
    for name in ("n1", "n2"):
        cluster.register(name)
    job = cluster.submit()
    cluster.tick()
    bad = cluster.job(job)["assigned"][0]
    cluster.report(bad, job, 0, "failed", exit_code=1)
    view = cluster.job(job)
    assert view["state"] == "queued" and view["restarts"] == 1 and view["task"] == 1
    assert "rank exited 1" in view["chain"][0]["outcome"]
    nodes = {n["name"]: n for n in cluster.call("GET", "/nodes")["nodes"]}
    assert not nodes[bad]["healthy"] and "rank exited 1" in nodes[bad]["reason"]
    cluster.tick(5)
    assert cluster.job(job)["wait"] == "backoff"
    cluster.tick(30)
    view = cluster.job(job)
    assert view["state"] == "running" and view["assigned"] != [bad]
    # The failed node's agent is told to stop what it still runs, and gets nothing new.
    assert cluster.heartbeat(bad, [(job, 0)]) == [{"type": "stop", "job_id": job, "task": 0}]


def test_heartbeat_timeout_loses_node_and_restarts(cluster: Cluster) -> None:
    for name in ("n1", "n2"):
        cluster.register(name)
    job = cluster.submit()
    cluster.tick()
    held = cluster.job(job)["assigned"][0]
    spare = "n2" if held == "n1" else "n1"
    for _ in range(4):  # only the spare keeps heartbeating
        cluster.clock.now += 20
        cluster.heartbeat(spare)
        cluster.server.tick(cluster.clock.now)
    nodes = {n["name"]: n for n in cluster.call("GET", "/nodes")["nodes"]}
    assert not nodes[held]["healthy"] and nodes[held]["reason"] == "no heartbeat"
    view = cluster.job(job)
    assert view["restarts"] == 1 and "lost" in view["chain"][0]["outcome"]
    cluster.clock.now += 30
    cluster.heartbeat(spare)
    cluster.server.tick(cluster.clock.now)
    assert cluster.job(job)["assigned"] == [spare]
    # A report about the lost task is refused and changes nothing.
    before = cluster.server.state
    cluster.report(held, job, 0, "finished", expect=409)
    assert cluster.server.state == before


def test_auth(cluster: Cluster) -> None:
    cluster.register("n1")
    cluster.call("GET", "/jobs", token=None, expect=401)
    cluster.call("GET", "/jobs", token="nope", expect=401)
    cluster.call("POST", "/agents/register", token=ALICE, expect=401, json={"name": "n9"})
    cluster.call("POST", "/agents/n1/heartbeat", token=None, expect=401, json={})
    cluster.call("POST", "/agents/n9/heartbeat", token=AGENT, expect=404, json={})
    assert "name" in cluster.call("POST", "/agents/register", token=AGENT, expect=422, json={"name": "a/b"})["detail"]
    job = cluster.submit()
    cluster.tick()
    cluster.call("POST", f"/jobs/{job}/suspend", token=BOB, expect=403)
    cluster.call("POST", f"/jobs/{job}/stop", token=BOB, expect=403)
    cluster.call("PUT", "/quota", token=ALICE, expect=403,
                 json={"user": "alice", "priority": "HIGH", "max_nodes": 1})
    cluster.call("PUT", "/quota", token=ADMIN, json={"user": "alice", "priority": "HIGH", "max_nodes": 1})
    quotas = cluster.call("GET", "/quota")["quotas"]
    assert quotas == [{"user": "alice", "group": "default", "priority": "HIGH", "max_nodes": 1, "used": 0}]
    assert cluster.call("GET", "/quota", token=BOB)["quotas"] == []
    # The owner may stop it; the node is told to kill the ranks.
    assert cluster.call("POST", f"/jobs/{job}/stop")["state"] == "failed"
    assert cluster.heartbeat("n1", [(job, 0)]) == [{"type": "stop", "job_id": job, "task": 0}]
    assert cluster.job(job)["reason"] == "stopped by alice"


def test_bad_job_files(cluster: Cluster) -> None:
    base = {"name": "j", "command": "run", "nodes": 1}
    detail = cluster.call("POST", "/jobs", expect=422, json={**base, "gpus": 8})["detail"]
    assert detail == "unknown field 'gpus'"
    assert "nodes" in cluster.call("POST", "/jobs", expect=422, json={**base, "nodes": 0})["detail"]
    assert "priority" in cluster.call("POST", "/jobs", expect=422, json={**base, "priority": "URGENT"})["detail"]
    assert "command" in cluster.call("POST", "/jobs", expect=422, json={**base, "command": "a 'b"})["detail"]
    assert "HAI_X" in cluster.call("POST", "/jobs", expect=422, json={**base, "env": {"HAI_X": "1"}})["detail"]
    assert "env" in cluster.call("POST", "/jobs", expect=422, json={**base, "env": {"A=B": "1"}})["detail"]
    assert "RANK" in cluster.call("POST", "/jobs", expect=422, json={**base, "env": {"RANK": "3"}})["detail"]
    assert "nodes" in cluster.call("POST", "/jobs", expect=422, json={**base, "nodes": "two"})["detail"]
    assert "name" in cluster.call("POST", "/jobs", expect=422, json={**base, "name": "../x"})["detail"]
    assert "command" in cluster.call("POST", "/jobs", expect=422, json={"name": "j", "nodes": 1})["detail"]
    big = cluster.call("POST", "/jobs", expect=413, content=b"{" + b" " * (2 << 20) + b"}",
                       headers={"Content-Type": "application/json"})
    assert "bytes" in big["detail"]
    assert "command" in cluster.call("POST", "/jobs", expect=422, json={**base, "command": "x" * 70000})["detail"]
    # More nodes than the group has: accepted, queued, with the reason.
    cluster.register("n1")
    job = cluster.submit(nodes=4)
    cluster.tick()
    view = cluster.job(job)
    assert view["state"] == "queued" and view["reason"] == "needs 4 nodes, group default has 1 healthy"


def test_lists_are_paged(cluster: Cluster) -> None:
    ids = [cluster.submit(name=f"j{i}") for i in range(7)]
    page = cluster.call("GET", "/jobs", params={"limit": 3})
    assert [j["job_id"] for j in page["jobs"]] == ids[:3] and page["total"] == 7 and page["next_offset"] == 3
    last = cluster.call("GET", "/jobs", params={"limit": 3, "offset": 6})
    assert [j["job_id"] for j in last["jobs"]] == ids[6:] and last["next_offset"] is None
    cluster.call("GET", "/jobs", params={"limit": 100_000}, expect=422)


def test_a_listing_carries_the_named_environment_variables(cluster: Cluster) -> None:
    """``GET /jobs?env=NAME`` (repeatable) adds those variables of each job's environment to the
    listing, so ``hai ls --wide`` needs one request; hai's own variables stay hidden as in ``GET /jobs/ID``."""
    sized = cluster.submit(name="a", env={"CHECKPOINT_BYTES": "2e9", "LR": "0.1"}, ranks_per_node=2)
    plain = cluster.submit(name="b")
    assert all("env" not in j for j in cluster.call("GET", "/jobs")["jobs"])
    listed = cluster.call("GET", "/jobs", params={"env": ["CHECKPOINT_BYTES", "SEED", hai_server.RANKS_ENV]})
    assert {j["job_id"]: j["env"] for j in listed["jobs"]} == {sized: {"CHECKPOINT_BYTES": "2e9"}, plain: {}}
    assert cluster.job(sized)["env"] == {"CHECKPOINT_BYTES": "2e9", "LR": "0.1"}
    cluster.call("GET", "/jobs", params={"env": "NOT-A-NAME"}, expect=422)
    too_many = [f"V{i}" for i in range(hai_server.MAX_ENV_LISTED + 1)]
    assert "at most 16" in cluster.call("GET", "/jobs", params={"env": too_many}, expect=422)["detail"]


def test_another_users_environment_values_are_withheld(cluster: Cluster) -> None:
    """A job's environment may hold its user's secrets: another user sees the variables' names with
    no values (in ``GET /jobs/ID`` and in a listing's ``env=``), except hai's own ``CHECKPOINT_BYTES``;
    the owner and admins see everything."""
    job = cluster.submit(name="a", env={"CHECKPOINT_BYTES": "2e9", "WANDB_API_KEY": "s3cret"})
    assert cluster.job(job)["env"] == {"CHECKPOINT_BYTES": "2e9", "WANDB_API_KEY": "s3cret"}
    assert cluster.call("GET", f"/jobs/{job}", ADMIN)["env"]["WANDB_API_KEY"] == "s3cret"
    seen_by_bob = cluster.call("GET", f"/jobs/{job}", BOB)
    assert seen_by_bob["env"] == {"CHECKPOINT_BYTES": "2e9", "WANDB_API_KEY": None}
    listed = cluster.call("GET", "/jobs", BOB, params={"env": ["CHECKPOINT_BYTES", "WANDB_API_KEY"]})
    assert listed["jobs"][0]["env"] == {"CHECKPOINT_BYTES": "2e9", "WANDB_API_KEY": None}
    assert "s3cret" not in cluster.client.get("/jobs", params={"state": "all", "env": "WANDB_API_KEY"},
                                              headers={"Authorization": f"Bearer {BOB}"}).text


def test_a_job_view_needs_a_viewer(cluster: Cluster) -> None:
    """No default that shows everything: a future endpoint that forgets the viewer fails at once
    instead of leaking another user's environment; the server's own calls name SYSTEM_VIEWER."""
    job = cluster.submit(name="a", env={"WANDB_API_KEY": "s3cret"})
    found = cluster.server.state.jobs[job]
    with pytest.raises(TypeError, match="viewer"):
        cluster.server.job_view(found, chain=True)  # type: ignore[call-arg]
    viewer = inspect.signature(HaiServer.job_view).parameters["viewer"]
    assert viewer.kind is inspect.Parameter.KEYWORD_ONLY and viewer.default is inspect.Parameter.empty
    bob = User("bob", hash_token(BOB))
    assert cluster.server.job_view(found, chain=True, viewer=bob)["env"] == {"WANDB_API_KEY": None}
    system = cluster.server.job_view(found, chain=True, viewer=hai_server.SYSTEM_VIEWER)
    assert system["env"] == {"WANDB_API_KEY": "s3cret"}
    assert hai_server.SYSTEM_VIEWER not in cluster.server.users.users


def test_restart_keeps_state_and_resends(url: str, clock: Clock) -> None:
    first = Cluster(url, clock)
    for name in ("n1", "n2", "n3"):
        first.register(name)
    running = first.submit(name="big", nodes=2, ranks_per_node=2)
    first.tick()
    # A chain of more than one task: the first task's rank fails, the job is placed again after its back-off.
    failed_on = first.job(running)["assigned"][0]
    first.report(failed_on, running, 0, "failed", exit_code=1)
    first.call("POST", f"/nodes/{failed_on}/healthy", ADMIN)
    first.tick(CONFIG.rules.backoff_base_s + 1)
    assert first.job(running)["task"] == 1 and first.job(running)["state"] == "running"
    waiting = [first.submit(name=f"w{i}", nodes=2) for i in range(2)]
    first.tick()
    node = first.job(running)["assigned"][1]
    sent = first.heartbeat(node)
    jobs = first.call("GET", "/jobs")
    shown = first.job(running)
    state = first.server.state
    first.close()

    second = Cluster(url, clock)
    try:
        assert second.server.state == state
        assert second.heartbeat(node) == sent
        assert second.call("GET", "/jobs") == jobs
        assert [j["job_id"] for j in jobs["jobs"]] == [running, *waiting]
        assert second.job(running) == shown and [t["task"] for t in shown["chain"]] == [0, 1]
    finally:
        second.close()


def test_replayed_report_is_harmless(cluster: Cluster) -> None:
    cluster.register("n1")
    cluster.register("n2")
    job = cluster.submit()
    cluster.tick()
    node = cluster.job(job)["assigned"][0]
    cluster.report(node, job, 0, "failed", exit_code=1)
    after = cluster.server.state
    cluster.report(node, job, 0, "failed", exit_code=1, expect=409)
    cluster.report(node, job, 0, "finished", expect=409)
    cluster.report("n9", job, 0, "started", expect=409)
    assert cluster.server.state == after
    assert cluster.job(job)["restarts"] == 1


def test_cli_add_user_and_parser(tmp_path: Path) -> None:
    from hai.__main__ import build_parser, main

    assert main(["server", "--dir", str(tmp_path), "--add-user", "carol", "--admin", "--fs3-token", "t"]) == 0
    users = Users.load(tmp_path / hai_server.USERS_FILE)
    carol = users.get("carol")
    assert carol is not None and carol.admin and carol.fs3_token == "t"
    assert (tmp_path / hai_server.USERS_FILE).stat().st_mode & 0o077 == 0
    hai_server.ensure_agent_token(tmp_path)
    token = (tmp_path / hai_server.AGENT_TOKEN_FILE).read_text().strip()
    assert Users.load(tmp_path / hai_server.USERS_FILE).is_agent(token)
    args = build_parser().parse_args(["server", "--dir", str(tmp_path), "--db-url", "sqlite://", "--port", "9"])
    assert args.port == 9 and args.db_url == "sqlite://"


def test_server_database_by_flag_or_environment_and_no_password_shown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--db URL`` (or ``--db-url``, or ``$HAI_DB_URL``) names the database; a database that cannot
    be opened is one line on stderr and exit status 1, with the URL's password masked."""
    from hai.__main__ import build_parser, main

    assert build_parser().parse_args(["server", "--dir", "d", "--db", "sqlite://"]).db_url == "sqlite://"
    monkeypatch.setenv(hai_server.DB_URL_ENV, "postgresql://hai@db/hai")
    assert build_parser().parse_args(["server", "--dir", "d"]).db_url == "postgresql://hai@db/hai"
    assert build_parser().parse_args(["server", "--dir", "d", "--db-url", "sqlite://"]).db_url == "sqlite://"
    pytest.importorskip("psycopg")
    monkeypatch.setenv(hai_server.DB_URL_ENV, "postgresql://hai:s3cret-pw@127.0.0.1:1/hai")  # nothing on port 1
    assert main(["server", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "hai server: postgresql+psycopg://hai:***@127.0.0.1:1/hai: cannot open the database" in err, err
    assert "s3cret-pw" not in err and err.count("\n") == 1


def test_lifespan_loop_places_jobs(url: str, clock: Clock) -> None:
    import dataclasses
    import time

    server = HaiServer(Store.open(url), USERS, dataclasses.replace(CONFIG, tick_interval_s=0.01), clock=clock)
    try:
        with TestClient(create_app(server)) as client:
            auth = {"Authorization": f"Bearer {AGENT}"}
            assert client.post("/agents/register", headers=auth, json={"name": "n1"}).status_code == 200
            response = client.post("/jobs", headers={"Authorization": f"Bearer {ALICE}"},
                                   json={"name": "j", "command": "true", "nodes": 1})
            job = response.json()["job_id"]
            deadline = time.monotonic() + 10
            while server.state.jobs[job].state.value != "running" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.state.jobs[job].state.value == "running"
    finally:
        server.close()


def test_watchdog_and_progress(cluster: Cluster) -> None:
    cluster.register("n1")
    cluster.register("n2")
    job = cluster.submit(nodes=2, priority="LOW")
    cluster.tick()
    first, second = cluster.job(job)["assigned"]
    for _ in range(40):  # 2000 s with output: past the 1800 s watchdog, still running
        cluster.clock.now += 50
        cluster.heartbeat(first, [(job, 0)], progress=True)
        cluster.heartbeat(second, [(job, 0)])
        cluster.server.tick(cluster.clock.now)
    assert cluster.job(job)["state"] == "running"
    # A suspend acknowledged by the second node alone is recorded; the job goes back to the queue
    # once its first node has acknowledged too.
    cluster.call("POST", f"/jobs/{job}/suspend")
    assert cluster.report(second, job, 0, "suspended")["applied"] is True
    assert cluster.job(job)["state"] == "suspending"
    assert cluster.report(first, job, 0, "suspended")["applied"] is True
    assert cluster.job(job)["state"] == "queued"
    for _ in range(40):  # running again, silent: the watchdog fails it
        cluster.clock.now += 50
        for node in (first, second):
            cluster.heartbeat(node, [(job, 1)])
        cluster.server.tick(cluster.clock.now)
    view = cluster.job(job)
    assert view["restarts"] == 1
    assert [t["outcome"] for t in view["chain"]][:3] == ["suspended", "failed: watchdog expired", "running"]


def test_restart_after_downtime_gives_agents_a_grace(url: str, clock: Clock) -> None:
    first = Cluster(url, clock)
    first.register("n1")
    job = first.submit()
    first.tick()
    first.close()
    clock.now += 3600  # the server was down an hour
    second = Cluster(url, clock)
    try:
        second.tick()
        assert second.job(job)["state"] == "running"
        assert all(n["healthy"] for n in second.call("GET", "/nodes")["nodes"])
        second.tick(61)  # the agent never came back: now it is lost
        assert not second.call("GET", "/nodes")["nodes"][0]["healthy"]
        assert second.job(job)["restarts"] == 1
    finally:
        second.close()


def test_streamed_body_over_the_limit(cluster: Cluster) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"name": "j", "command": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'", "nodes": 1}'

    response = cluster.call("POST", "/jobs", expect=413, content=chunks(), headers={"Content-Type": "application/json"})
    assert "bytes" in response["detail"]
    assert cluster.server.state.jobs == {}

"""The user commands of ``hai`` (``hai/cli.py``) against the real server app, served by uvicorn on a
loopback port in a thread (SQLite in a temporary directory, the scheduling loop on), driven through
``main(argv)``; agents are played by the test over HTTP. Logs are read from an in-process fs3
cluster. Nothing here depends on how fast the machine is: waits are for a state, with a deadline.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

import fs3
from hai import cli
from hai.__main__ import main
from hai.cli import CHECKPOINT_BYTES_ENV, parse_job
from hai.rules import Config
from hai.server import HaiServer, ServerConfig, User, Users, create_app, hash_token
from hai.store import Store, default_url

ALICE, BOB, ADMIN, AGENT = "alice-token", "bob-token", "admin-token", "agent-token"
USERS = Users(users=(User("alice", hash_token(ALICE)), User("bob", hash_token(BOB)),
                     User("root", hash_token(ADMIN), admin=True)),
              agent_token_sha256=hash_token(AGENT))
DEADLINE_S = 20.0


class Served:
    """The server app on a free loopback port, in a thread."""

    def __init__(self, directory: Path) -> None:
        config = ServerConfig(rules=Config(default_quota_nodes=2), tick_interval_s=0.05)
        self.server = HaiServer(Store.open(default_url(directory)), USERS, config)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(create_app(self.server), log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.uvicorn.started, "the server to start")
        self.agent = httpx.Client(base_url=self.url, timeout=10, headers={"Authorization": f"Bearer {AGENT}"})

    def close(self) -> None:
        self.agent.close()
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.server.close()

    def register(self, *names: str) -> None:
        for name in names:
            assert self.agent.post("/agents/register", json={"name": name}).status_code == 200

    def report(self, job: dict[str, Any], event: str) -> None:
        """``event`` from every node of the job (a task ends once each has reported its ranks' end)."""
        for node in job["assigned"]:
            response = self.agent.post(f"/agents/{node}/report",
                                       json={"job_id": job["job_id"], "task": job["task"], "event": event})
            assert response.status_code == 200, response.text

    def job(self, job_id: str) -> dict[str, Any]:
        view: dict[str, Any] = self.agent.get(f"/jobs/{job_id}", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        return view


def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # never the real user's config
    for name in ("HAI_SERVER", "HAI_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    s = Served(tmp_path)
    yield s
    s.close()


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def hai(served: Served, capsys: pytest.CaptureFixture[str]) -> Run:
    def run(*argv: str, token: str = ALICE) -> tuple[int, str, str]:
        capsys.readouterr()
        status = main([*argv, "--server", served.url, "--token", token])
        out, err = capsys.readouterr()
        return status, out, err

    return run


def job_file(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


GOOD = """\
name = "train"
command = ["python", "train.py", "--lr", "0.1 0.2"]
nodes = 2
ranks_per_node = 4
priority = "HIGH"
checkpoint_bytes = 2e10

[env]
SEED = "7"
"""


def submit(hai: Run, tmp_path: Path, text: str = GOOD, token: str = ALICE) -> dict[str, Any]:
    status, out, err = hai("submit", job_file(tmp_path, text), "--json", token=token)
    assert status == 0, err
    job: dict[str, Any] = json.loads(out)
    return job


def test_submit_ls_show(served: Served, hai: Run, tmp_path: Path) -> None:
    served.register("n1", "n2", "n3")
    status, out, err = hai("submit", job_file(tmp_path, GOOD))
    assert status == 0, err
    assert out.startswith("submitted train-")
    job_id = out.split()[1].rstrip(":")
    wait_for(lambda: served.job(job_id)["state"] == "running", "the job to run")
    view = served.job(job_id)
    assert view["command"] == "python train.py --lr '0.1 0.2'"
    assert view["ranks_per_node"] == 4 and view["requested"] == "HIGH"
    assert view["env"] == {"SEED": "7", CHECKPOINT_BYTES_ENV: "20000000000"}

    status, out, _ = hai("ls", "--json")
    listed = json.loads(out)
    assert status == 0 and listed["total"] == 1 and listed["jobs"][0]["job_id"] == job_id
    status, out, _ = hai("ls")
    assert out.splitlines()[0].split() == ["ID", "USER", "STATE", "PRIORITY", "NODES", "REASON"]
    assert job_id in out and "running" in out

    status, out, _ = hai("ls", "--wide", "--json", "--write-gbps-per-node", "1", "--node-mtbf-h", "720")
    advice = json.loads(out)["jobs"][0]["checkpoint_advice"]
    assert advice["checkpoint_s"] == pytest.approx(10.0)  # 2e10 bytes over 2 nodes at 1 GB/s each
    assert advice["job_mtbf_s"] == pytest.approx(360 * 3600)
    assert advice["interval_s"] > 0 and 0 < advice["wasted_fraction"] < 1
    status, out, _ = hai("ls", "--wide")  # the cluster model's rates
    assert status == 0 and "CKPT EVERY" in out and "%" in out.splitlines()[1]

    status, out, _ = hai("show", job_id, "--json")
    shown = json.loads(out)
    assert shown["chain"] == [{"task": 0, "nodes": shown["assigned"], "started_s": shown["chain"][0]["started_s"],
                               "ended_s": None, "outcome": "running"}]
    status, out, _ = hai("show", job_id)
    assert status == 0 and "TASK" in out and "restarts" in out and "SEED=7" in out

    served.report(served.job(job_id), "finished")
    status, out, _ = hai("ls", "--json")
    assert json.loads(out)["total"] == 0
    status, out, _ = hai("ls", "--all", "--json")
    assert [j["state"] for j in json.loads(out)["jobs"]] == ["finished"]
    status, _, err = hai("show", "nope-9")
    assert status == 1 and "no job nope-9" in err


def test_a_job_without_its_state_size_gets_no_advice(served: Served, hai: Run, tmp_path: Path) -> None:
    submit(hai, tmp_path, 'name = "j"\ncommand = "true"\nnodes = 1\n')
    status, out, _ = hai("ls", "--wide", "--json", "--write-gbps-per-node", "1", "--node-mtbf-h", "720")
    assert json.loads(out)["jobs"][0]["checkpoint_advice"] is None
    status, out, _ = hai("ls", "--wide", "--write-gbps-per-node", "1", "--node-mtbf-h", "720")
    assert status == 0 and " - " in out.splitlines()[1]


def test_ls_wide_is_one_request_and_the_same_with_an_older_server(served: Served, hai: Run, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``ls --wide`` reads every job's state size with the listing (``GET /jobs?env=CHECKPOINT_BYTES``),
    one request for the page rather than one per job; against a server that ignores ``env=`` it asks
    for each job, and the output is the same either way."""
    for i in range(4):
        size = f"checkpoint_bytes = {i + 1}e9\n" if i != 2 else ""
        submit(hai, tmp_path, f'name = "j{i}"\ncommand = "true"\nnodes = 1\n{size}')
    sent: list[tuple[str, str]] = []
    call = cli.Api.call
    drop_env = [False]

    def counted(self: cli.Api, method: str, path: str, **kw: Any) -> Any:
        sent.append((method, path))
        answer = call(self, method, path, **kw)
        if drop_env[0] and path == "/jobs":
            for job in answer["jobs"]:
                job.pop("env", None)
        return answer

    monkeypatch.setattr(cli.Api, "call", counted)
    wide = ("ls", "--wide", "--write-gbps-per-node", "1", "--node-mtbf-h", "720")
    outputs = []
    for older in (False, True):
        drop_env[0] = older
        sent.clear()
        status, table, _ = hai(*wide)
        status_json, out, _ = hai(*wide, "--json")
        assert status == status_json == 0
        outputs.append((table, out))
        assert sent.count(("GET", "/jobs")) == 2 and len(sent) == (2 + 2 * 4 if older else 2), sent
    assert outputs[0] == outputs[1]
    listed = json.loads(outputs[0][1])["jobs"]
    assert [j["checkpoint_advice"] is None for j in listed] == [False, False, True, False]
    assert all("env" not in j for j in listed)  # the listing's env= is the CLI's business, not its output
    assert listed[3]["checkpoint_advice"]["checkpoint_bytes"] == 4e9


@pytest.mark.parametrize(("text", "expected"), [
    ('name = "j"\ncommand = "x"\nnodes = 1\ngpus = 8\n', "job.toml:4: unknown field 'gpus'"),
    ('name = "j"\ncommand = "x"\nnodes = "two"\n', "job.toml:3: nodes must be a whole number, not str 'two'"),
    ('name = "j"\ncommand = "x"\nnodes = true\n', "job.toml:3: nodes must be a whole number"),
    ('name = "j"\nnodes = 1\n', "missing field 'command'"),
    ('name = "j"\ncommand = "x"\nnodes = 0\n', "job.toml:3: nodes must be at least 1"),
    ('name = "j"\ncommand = "a \'b"\nnodes = 1\n', "job.toml:2: command is not a command line"),
    ('name = "j"\ncommand = []\nnodes = 1\n', "job.toml:2: command must be a non-empty list"),
    ('name = "j"\ncommand = "x"\nnodes = 1\npriority = "URGENT"\n', "job.toml:4: unknown priority 'URGENT'"),
    ('name = "j"\ncommand = "x"\nnodes = 1\n[env]\nA = "1"\nB = 2\n', "job.toml:6: env.B must be a string"),
    ('name = "j"\ncommand = "x"\nnodes = 1\ncheckpoint_bytes = -1\n', "job.toml:4: checkpoint_bytes must be above"),
    ('name = "../j"\ncommand = "x"\nnodes = 1\n', "job.toml:1: name '../j' is not a plain name"),
    ('name = "j"\ncommand = "x"\nnodes = = 1\n', "not TOML: Invalid value (at line 3, column 9)"),
])
def test_bad_job_files(served: Served, hai: Run, tmp_path: Path, text: str, expected: str) -> None:
    status, out, err = hai("submit", job_file(tmp_path, text))
    assert status == 2 and out == ""
    assert expected in err and err.count("\n") == 1, err
    assert served.server.state.jobs == {}


def test_the_servers_refusal_is_shown(served: Served, hai: Run, tmp_path: Path) -> None:
    status, _, err = hai("submit", job_file(tmp_path, 'name = "j"\ncommand = "x"\nnodes = 1\n[env]\nHAI_X = "1"\n'))
    assert status == 1 and "refused by the server: env: HAI_X is set by hai" in err and "HTTP 422" in err
    status, _, err = hai("submit", job_file(tmp_path, 'name = "j"\ncommand = "x"\nnodes = 1\n'), token="wrong")
    assert status == 1 and "refused the token" in err
    status, _, err = hai("submit", str(tmp_path / "missing.toml"))
    assert status == 2 and "cannot read" in err


def test_too_many_nodes_and_quota_are_queued_with_the_reason(served: Served, hai: Run, tmp_path: Path) -> None:
    served.register("n1", "n2", "n3")
    assert hai("quota", "--set", "alice", "default", "HIGH", "10", token=ADMIN)[0] == 0
    status, out, _ = hai("submit", job_file(tmp_path, 'name = "big"\ncommand = "x"\nnodes = 5\npriority = "HIGH"\n'))
    assert status == 0 and "queued (needs 5 nodes, group default has 3 healthy)" in out
    status, out, _ = hai("submit", job_file(tmp_path, 'name = "over"\ncommand = "x"\nnodes = 3\n'))
    assert status == 0 and "queued (quota exceeded at NORMAL" in out
    status, out, _ = hai("ls")
    assert "needs 5 nodes" in out and "quota exceeded" in out


def test_suspend_and_stop_own_job_not_anothers(served: Served, hai: Run, tmp_path: Path) -> None:
    served.register("n1")
    job_id = submit(hai, tmp_path, 'name = "j"\ncommand = "x"\nnodes = 1\n')["job_id"]
    wait_for(lambda: served.job(job_id)["state"] == "running", "the job to run")
    for verb in ("suspend", "stop"):
        status, out, err = hai(verb, job_id, token=BOB)
        assert status == 1 and out == "" and err == f"hai: job {job_id} belongs to another user (HTTP 403)\n"
    status, out, _ = hai("suspend", job_id)
    assert status == 0 and out == f"{job_id}: suspending\n"
    status, out, _ = hai("stop", job_id, "--json")
    assert status == 0 and json.loads(out)["state"] == "failed" and json.loads(out)["reason"] == "stopped by alice"
    status, _, err = hai("stop", job_id)
    assert status == 1 and "already ended" in err and "HTTP 409" in err


def test_nodes_and_quota(served: Served, hai: Run) -> None:
    served.register("n1", "n2")
    status, out, _ = hai("nodes")
    assert status == 0 and out.splitlines()[0].split() == ["NODE", "ZONE", "GROUP", "HEALTH", "JOB", "REASON"]
    assert out.splitlines()[1].split()[:5] == ["n1", "default", "default", "healthy", "-"]
    status, out, _ = hai("nodes", "--json")
    assert [n["name"] for n in json.loads(out)["nodes"]] == ["n1", "n2"]
    status, _, err = hai("quota", "--set", "alice", "default", "HIGH", "4")
    assert status == 1 and "admins only" in err
    status, out, _ = hai("quota", "--set", "alice", "default", "HIGH", "4", token=ADMIN)
    assert status == 0 and out == "quota of alice in default at HIGH: 4 nodes\n"
    status, _, err = hai("quota", "--set", "alice", "default", "AUTO", "4", token=ADMIN)
    assert status == 1 and "not AUTO" in err
    status, _, err = hai("quota", "--set", "alice", "default", "HIGH", "four", token=ADMIN)
    assert status == 2 and "whole number" in err
    status, out, _ = hai("quota", "--json")
    assert json.loads(out) == {"quotas": [{"user": "alice", "group": "default", "priority": "HIGH", "max_nodes": 4,
                                           "used": 0}], "total": 1, "default_quota_nodes": 2}
    status, out, _ = hai("quota")
    assert "alice" in out and "without an entry: 2 nodes" in out


class Collected(io.StringIO):
    """Standard output shared with a thread; read with :meth:`text`."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, s: str) -> int:
        with self.lock:
            return super().write(s)

    def text(self) -> str:
        with self.lock:
            return self.getvalue()


def test_logs_and_follow(served: Served, hai: Run, tmp_path: Path, shared_cluster: Any,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = shared_cluster.cluster
    fs3_args = ["--mgmtd", cluster.mgmtd_address, "--fs3-token", cluster.token, "--interval-s", "0.05"]
    served.register("n1")
    job_id = submit(hai, tmp_path, 'name = "logged"\ncommand = "x"\nnodes = 1\n')["job_id"]
    status, _, err = hai("logs", job_id, *fs3_args)
    assert status == 1 and "no log /hai/logs/" in err
    fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
    try:
        fs.makedirs(f"/hai/logs/{job_id}", exist_ok=True)
        fs.write_bytes(f"/hai/logs/{job_id}/0.log", "step 1 loss 2.5\nstep 2 naïve\n".encode())
        status, out, _ = hai("logs", job_id, *fs3_args)
        assert status == 0 and out == "step 1 loss 2.5\nstep 2 naïve\n"
        status, out, _ = hai("logs", job_id, "--json", *fs3_args)
        assert json.loads(out.splitlines()[0]) == {"job_id": job_id, "rank": 0, "offset": 0,
                                                   "data": "step 1 loss 2.5\nstep 2 naïve\n"}
        status, _, err = hai("logs", job_id, "--rank", "3", *fs3_args)
        assert status == 1 and f"/hai/logs/{job_id}/3.log" in err

        wait_for(lambda: served.job(job_id)["state"] == "running", "the job to run")
        collected = Collected()
        monkeypatch.setattr(sys, "stdout", collected)
        result: list[int] = []
        follower = threading.Thread(target=lambda: result.append(main(
            ["logs", job_id, "--follow", *fs3_args, "--server", served.url, "--token", ALICE])))
        follower.start()
        wait_for(lambda: "step 2" in collected.text(), "the follower to print the log")
        with fs.open(f"/hai/logs/{job_id}/0.log", "ab") as f:
            f.write(b"step 3 appended\n")
            f.fsync()
        wait_for(lambda: "step 3 appended" in collected.text(), "the follower to see the appended line")
        assert follower.is_alive()  # the job still runs
        served.report(served.job(job_id), "finished")
        follower.join(DEADLINE_S)
        assert not follower.is_alive() and result == [0]
        assert collected.text() == "step 1 loss 2.5\nstep 2 naïve\nstep 3 appended\n"
    finally:
        fs.close()


def test_server_down_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                 tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    for argv in (["ls"], ["nodes", "--json"], ["stop", "j-1"]):
        assert main([*argv, "--server", f"127.0.0.1:{port}", "--token", ALICE, "--timeout-s", "2"]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and f"cannot reach the hai server at http://127.0.0.1:{port}" in err
    monkeypatch.delenv("HAI_TOKEN", raising=False)
    assert main(["ls", "--server", f"127.0.0.1:{port}"]) == 2
    assert "no token" in capsys.readouterr().err


def test_config_file(served: Served, hai: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config" / "hai" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'server = "{served.url}"\ntoken = "{BOB}"\n')
    config.chmod(0o644)
    assert main(["quota", "--json"]) == 2
    assert "chmod 600" in capsys.readouterr().err
    config.chmod(0o600)
    assert main(["quota", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quotas"] == []
    config.write_text(f'server = "{served.url}"\ntokn = "x"\n')
    assert main(["quota"]) == 2
    assert "unknown field 'tokn'" in capsys.readouterr().err


def test_entry_point_ls_json(served: Served, hai: Run, tmp_path: Path) -> None:
    submit(hai, tmp_path, 'name = "sub"\ncommand = "x"\nnodes = 1\n')
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "HAI_SERVER": served.url, "HAI_TOKEN": ALICE, "XDG_CONFIG_HOME": str(tmp_path / "none"),
           "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "hai", "ls", "--json"], capture_output=True, text=True, env=env,
                          cwd=root, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert [j["user"] for j in json.loads(done.stdout)["jobs"]] == ["alice"]


def test_parse_job_defaults() -> None:
    body = parse_job('name = "j"\ncommand = "python -m x"\nnodes = 3\n')
    assert body == {"name": "j", "command": "python -m x", "nodes": 3, "priority": "NORMAL", "group": "default",
                    "env": {}}
    assert parse_job('name = "j"\ncommand = "x"\nnodes = 1\npriority = "AUTO"\n')["priority"] == "AUTO"


def test_hai_and_the_dashboard_show_durations_and_times_alike() -> None:
    """One helper (hai.timefmt) for both: a chain of tasks reads the same in ``hai show`` and on the
    job page, in UTC."""
    from hai import dashboard, timefmt

    for module in (cli, dashboard):
        assert module.duration is timefmt.duration and module.when is timefmt.when
        assert not hasattr(module, "_duration") and not hasattr(module, "_when")
    assert [timefmt.duration(s) for s in (-3, 42, 1020, 19800, 276480)] == ["0 s", "42 s", "17 min", "5.5 h", "3.2 d"]
    assert timefmt.when(1_700_000_000) == "2023-11-14 22:13:20Z"
    assert timefmt.when(None) == timefmt.when(0) == "—" and timefmt.when(None, "-") == "-"

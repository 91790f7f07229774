"""Shared pieces of the HAI Platform's end-to-end proofs that run every part as its own process:
``hai server`` (a subprocess on a SQLite file in a cluster directory, killable and restartable on
the same database) and ``hai agent``s (one subprocess per node, each with a distinct node name and
its ranks as its children), against the shared in-process fs3 cluster.

The training script (:data:`TRAIN`) is the time-sharing proof's seeded MLP with HaiScale periodic
checkpoints (``every_steps``) on fs3, so that a task killed or force-stopped at any moment resumes
from its latest periodic checkpoint and still ends bit-identical to the uninterrupted run
(:func:`reference_run`). Rank 0 trains; rank 1 holds its node and keeps a liveness file fresh,
and rank 0 waits (as a collective would hang) while its peer is silent: a lost node stalls the
job rather than letting it finish alone. Before training, rank 0 records what it runs as
(``identity-<port>.json``): its ``FS3_TOKEN`` and whether another user's private file is readable;
and each start's step (``starts``), which the tests read instead of the log on fs3.

Used by ``tests/test_hai_fault.py``, ``tests/test_hai_ignored_suspend.py``, ``tests/test_hai_restart.py``
and ``scripts/hai_demo.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from hai.server import USERS_FILE, User, Users, hash_token
from tests.test_hai_agent import free_port

ROOT = Path(__file__).resolve().parents[1]
ALICE, BOB_HAI, AGENT = "alice-hai-token", "bob-hai-token", "agent-hai-token"
ALICE_UID, BOB_UID = 1601, 1602
DEADLINE_S = 60.0

TRAIN = """
    import json, os, sys, time
    import hai.client

    out = sys.argv[1]
    total, every, location = int(os.environ["TS_TOTAL"]), int(os.environ["TS_EVERY"]), os.environ["TS_CKPT"]
    ignore_suspend = os.environ.get("TS_IGNORE_SUSPEND") == "1"
    step_sleep_s = float(os.environ.get("TS_SLEEP_S", "0"))
    os.makedirs(out, exist_ok=True)
    final = os.path.join(out, "final.pt")
    task = os.environ.get("MASTER_PORT", "local")  # a different port per task of the chain
    alive = os.path.join(out, f"alive-{task}")
    world = int(os.environ.get("WORLD_SIZE", "1"))

    def suspend_requested():
        return not ignore_suspend and hai.client.receive_suspend_command()

    if os.environ["RANK"] != "0":  # holds its node, keeps its liveness file fresh, leaves when rank 0 is done
        deadline = time.monotonic() + 300
        while not os.path.exists(final):
            with open(alive, "w") as f:
                f.write(str(time.time()))
            if suspend_requested():
                hai.client.go_suspend()
                sys.exit(0)
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.05)
        sys.exit(0)

    def wait_for_peer():
        # As a collective would: no step while the peer is silent; a job whose peer is gone hangs
        # until the platform stops it.
        if world == 1:
            return
        while True:
            try:
                if time.time() - os.stat(alive).st_mtime < 1.0:
                    return
            except FileNotFoundError:
                pass
            time.sleep(0.05)

    if os.environ.get("TS_PRIVATE"):
        record = {"fs3_token": os.environ.get("FS3_TOKEN", ""), "private": "readable"}
        try:
            import fs3
            with fs3.connect() as fs:
                fs.read_bytes(os.environ["TS_PRIVATE"])
        except PermissionError:
            record["private"] = "denied"
        except Exception as exc:
            record["private"] = repr(exc)
        with open(os.path.join(out, f"identity-{task}.json"), "w") as f:
            json.dump(record, f)
    import torch  # rank 0 only: the holding ranks start quicker without it
    from torch import nn
    from haiscale.checkpoint import CheckpointManager
    torch.manual_seed(0)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    target = data.sum(dim=1, keepdim=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager = CheckpointManager(location, keep=2, every_steps=every)
    loaded = manager.load_latest(model, opt)
    start = 0 if loaded is None else int(loaded.extra["next_step"])
    print(f"start {start}", flush=True)
    with open(os.path.join(out, "starts"), "a") as f:  # beside the log: a killed agent's log loses its tail
        f.write(f"{start}\\n")
    for step in range(start, total):
        wait_for_peer()
        order = torch.randperm(len(data))[:16]  # the global RNG: its state must survive every restart
        loss = ((model(data[order]) - target[order]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}", flush=True)
        if manager.maybe_save(step + 1, model, opt, extra={"next_step": step + 1}):
            manager.wait()  # published before the next step: the test reads the listing as progress
            print(f"saved {step + 1}", flush=True)
        if suspend_requested():
            manager.on_suspend(step + 1, model, opt, extra={"next_step": step + 1})
            print(f"suspended at {step + 1}", flush=True)
            hai.client.go_suspend()
            manager.close()
            sys.exit(0)
        if os.environ.get("HAI_JOB_ID"):
            time.sleep(step_sleep_s)  # under hai only: leaves room for the test's event mid-run
    manager.close()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, final + ".tmp")
    os.replace(final + ".tmp", final)
    print("done", flush=True)
"""


def wait_for(condition: Callable[[], bool], what: str, show: Callable[[], object] = lambda: None,
             deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {show()}")
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's list), from /proc."""
    found: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for tid in threads:
        try:
            found += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return sorted(set(found))


@dataclass
class Fs3Users:
    """The fs3 side of the platform's users: alice's and bob's fs3 user tokens, and an admin
    (cluster-token) client."""

    mgmtd: str
    cluster_token: str
    alice_token: str
    bob_token: str
    fs: Any

    @classmethod
    def make(cls, inproc: Any, loop: asyncio.AbstractEventLoop) -> Fs3Users:
        import fs3
        from fs3.client.admin import AdminClient
        from fs3.rpc.channel import RealChannelFactory

        async def add(name: str, uid: int) -> str:
            channels = RealChannelFactory(inproc.token, "framed")
            try:
                meta = await AdminClient(inproc.mgmtd_address, channels).metadata()
                token: str = (await meta.add_user(f"{name}-{uuid.uuid4().hex[:8]}", uid, uid, [])).token
                return token
            finally:
                await channels.close()

        alice = asyncio.run_coroutine_threadsafe(add("alice", ALICE_UID), loop).result(30)
        bob = asyncio.run_coroutine_threadsafe(add("bob", BOB_UID), loop).result(30)
        admin = fs3.connect(inproc.mgmtd_address, token=inproc.token)
        return cls(inproc.mgmtd_address, inproc.token, alice, bob, admin)

    def workspace(self) -> tuple[str, str]:
        """A fresh world-writable top directory (alice's checkpoints go below it) and the path of a
        file bob keeps in his own mode-0700 directory there."""
        import fs3

        top = f"/hai-e2e-{uuid.uuid4().hex[:12]}"
        self.fs.makedirs(top)
        self.fs.chmod(top, 0o777)
        with fs3.connect(self.mgmtd, token=self.bob_token) as bob:
            bob.makedirs(f"{top}/bob")
            bob.chmod(f"{top}/bob", 0o700)
            bob.write_bytes(f"{top}/bob/secret", b"bob's only")
        return top, f"{top}/bob/secret"

    def close(self) -> None:
        self.fs.close()


class ProcCluster:
    """``hai server`` and ``hai agent``s as processes, in ``tmp``; alice's ranks get her fs3 user
    token from the users file."""

    def __init__(self, tmp: Path, fs3_users: Fs3Users, *, node_timeout_s: float = 2.0,
                 ack_grace_s: float = 1.0, finish_grace_s: float = 1.0, say: Callable[[str], None] = lambda _: None):
        self.tmp = tmp
        self.dir = tmp / "hai"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fs3 = fs3_users
        self.node_timeout_s = node_timeout_s
        self.grace = (ack_grace_s, finish_grace_s)
        self.say = say
        users = Users(users=(User("alice", hash_token(ALICE), fs3_token=fs3_users.alice_token),
                             User("bob", hash_token(BOB_HAI), fs3_token=fs3_users.bob_token)),
                      agent_token_sha256=hash_token(AGENT))
        (self.dir / USERS_FILE).write_text(users.dump())
        (self.dir / "agent.token").write_text(AGENT + "\n")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=10.0)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("FS3_", "HAI_"))}
        self.env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    # -- processes ---------------------------------------------------------------------------------

    def start_server(self) -> None:
        with open(self.tmp / "server.log", "ab") as log:  # the child keeps its own descriptor
            self.server = subprocess.Popen(
                [sys.executable, "-m", "hai", "server", "--dir", str(self.dir), "--port", str(self.port),
                 "--default-quota-nodes", "100", "--tick-interval-s", "0.1",
                 "--node-timeout-s", str(self.node_timeout_s), "--backoff-base-s", "0.5"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT)

        def up() -> bool:
            assert self.server is not None and self.server.poll() is None, self.server_log()
            try:
                return self.http.get("/nodes").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, "the server to answer", self.server_log)
        self.say(f"server up on {self.url} (pid {self.server.pid})")

    def kill_server(self) -> None:
        assert self.server is not None
        self.server.send_signal(signal.SIGKILL)
        self.server.wait(10)
        self.say(f"server pid {self.server.pid} SIGKILLed")
        self.server = None

    def server_log(self) -> str:
        path = self.tmp / "server.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def agent(self, name: str) -> None:
        env = dict(self.env, FS3_TOKEN=self.fs3.cluster_token)  # the agent's own: for the logs on fs3
        with open(self.tmp / f"agent-{name}.log", "ab") as log:
            self.agents[name] = subprocess.Popen(
                [sys.executable, "-m", "hai", "agent", "--server", self.url, "--node", name, "--address", "127.0.0.1",
                 "--token-file", str(self.dir / "agent.token"), "--fs3", self.fs3.mgmtd, "--heartbeat-s", "0.2",
                 "--http-timeout-s", "5", "--ack-grace-s", str(self.grace[0]),
                 "--finish-grace-s", str(self.grace[1])],
                env=env, stdout=log, stderr=subprocess.STDOUT)

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL the node's agent and every rank it started (each rank leads its own process
        group): the node is gone at once, nothing reported. Returns the ranks' pids."""
        agent = self.agents.pop(name)
        ranks = children(agent.pid)
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        for pid in ranks:
            with suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.say(f"node {name}: agent pid {agent.pid} and ranks {ranks} SIGKILLed")
        return ranks

    def close(self) -> None:
        for name in list(self.agents):
            agent = self.agents.pop(name)
            agent.send_signal(signal.SIGTERM)  # the agent kills its ranks on the way out
            try:
                agent.wait(20)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(10)
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(10)
        self.http.close()

    # -- the API -----------------------------------------------------------------------------------

    def submit(self, script: str, *, name: str, **spec: Any) -> str:
        path = self.tmp / f"{name}.py"
        path.write_text(textwrap.dedent(script))
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **spec.pop("env", {})}
        body = {"name": name, "command": f"{sys.executable} {path} {self.tmp / ('out-' + name)}", "nodes": 1,
                "env": env, **spec}
        response = self.http.post("/jobs", json=body)
        assert response.status_code == 201, response.text
        job_id: str = response.json()["job_id"]
        self.say(f"submitted {name} as {job_id}: {spec.get('nodes', 1)} nodes at {spec.get('priority', 'NORMAL')}")
        return job_id

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.http.get(f"/jobs/{job_id}")
        assert response.status_code == 200, response.text
        view: dict[str, Any] = response.json()
        return view

    def queue(self) -> list[dict[str, Any]]:
        jobs: list[dict[str, Any]] = self.http.get("/jobs").json()["jobs"]
        return jobs

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["name"]: n for n in self.http.get("/nodes").json()["nodes"]}

    def wait_job(self, job_id: str, state: str, task: int | None = None) -> dict[str, Any]:
        views: list[dict[str, Any]] = []

        def reached() -> bool:
            views.append(self.job(job_id))
            return bool(views[-1]["state"] == state and (task is None or views[-1]["task"] == task))

        wait_for(reached, f"{job_id} to be {state} (task {task})", lambda: (views[-1] if views else None,
                                                                            self.server_log()))
        self.say(f"{job_id} is {state}, task {views[-1]['task']}, on {views[-1]['assigned']}")
        return views[-1]

    def log(self, job_id: str, rank: int = 0) -> str:
        path = f"/hai/logs/{job_id}/{rank}.log"
        if not self.fs3.fs.exists(path):
            return ""
        return bytes(self.fs3.fs.read_bytes(path)).decode(errors="replace")


def checkpoints(fs: Any, directory: str) -> list[int]:
    """The published checkpoint steps in ``directory`` on fs3."""
    if not fs.exists(directory):
        return []
    return sorted(int(str(n).removeprefix("step-")) for n in fs.listdir(directory) if str(n).startswith("step-"))


def train_env(directory: str, total: int, every: int, *, sleep_s: float = 0.05, private: str = "",
              ignore_suspend: bool = False) -> dict[str, str]:
    env = {"TS_TOTAL": str(total), "TS_EVERY": str(every), "TS_CKPT": f"fs3://{directory}", "TS_SLEEP_S": str(sleep_s)}
    if private:
        env["TS_PRIVATE"] = private
    if ignore_suspend:
        env["TS_IGNORE_SUSPEND"] = "1"
    return env


@contextmanager
def reference_run(tmp: Path, total: int, every: int) -> Iterator[Path]:
    """The training script run uninterrupted, outside hai (local checkpoints, no control
    directory), meanwhile; yields where its ``final.pt`` will be, and waits for it on exit."""
    script = tmp / "reference.py"
    script.write_text(textwrap.dedent(TRAIN))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FS3_", "HAI_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RANK="0", TS_TOTAL=str(total), TS_EVERY=str(every),
               TS_CKPT=str(tmp / "reference-ckpt"))
    out = tmp / "reference"
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        yield out / "final.pt"
        assert proc.wait(120) == 0, proc.communicate()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def assert_bit_identical(a_path: Path, b_path: Path) -> None:
    """Model parameters and optimizer state of two ``final.pt`` files are equal bit for bit."""
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    assert a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    state_a, state_b = a["optim"]["state"], b["optim"]["state"]
    assert state_a.keys() == state_b.keys() and state_a
    for key in state_a:
        for name, value in state_a[key].items():
            assert torch.equal(value, state_b[key][name]), (key, name)


def starts(out: Path) -> list[int]:
    """The steps rank 0 started from, task after task, as it recorded them in its output directory
    (its log on fs3 says so too, but the unpublished tail of a log whose agent was SIGKILLed is
    lost, and the next task's log is appended at the last published length)."""
    path = out / "starts"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def assert_alice(users: Fs3Users, out: Path, directory: str) -> None:
    """What alice's ranks ran as: her user token, bob's private file refused, her uid on fs3."""
    seen = [json.loads(p.read_text()) for p in sorted(out.glob("identity-*.json"))]
    assert seen, "rank 0 recorded no identity"
    for record in seen:
        assert record["fs3_token"] == users.alice_token != users.cluster_token
        assert record["private"] == "denied", record
    for step in checkpoints(users.fs, directory):
        assert users.fs.stat(f"{directory}/step-{step:08d}").st_uid == ALICE_UID


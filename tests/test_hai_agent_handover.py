"""A node's old task is gone before its next one starts (``hai/agent.py``).

The server answers a heartbeat with ``stop`` for the task a node ran and ``launch`` for its next
in one list (a job restarted after a fault elsewhere, or the next job on a node whose job the
server stopped). The agent stops on a thread, since a stop takes up to ``term_grace_s``; the
launch must wait for it, or the new task's ranks run beside the old ones — two rank 0s of one job
writing the same checkpoint directory, or two jobs on a node meant for one. A fake server (an
httpx mock transport that derives commands as the real one does) hands over from a task whose
rank ignores SIGTERM to the next; the next task's rank records whether the old one was still alive
when it started.
"""

from __future__ import annotations

import json
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import httpx

from hai.agent import Agent, AgentConfig
from hai.launcher import LocalLogSink
from tests.hai_e2e import wait_for

OLD = """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaves only at the SIGKILL, after term_grace_s
    out = sys.argv[1]
    with open(os.path.join(out, "old.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
"""

NEW = """
    import json, os, sys
    out = sys.argv[1]
    pid = open(os.path.join(out, "old.pid")).read()
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    with open(os.path.join(out, "new.json"), "w") as f:
        json.dump({"old_state": state}, f)
"""


class FakeServer:
    """Holds one expected task for node n1 and derives the commands from the heartbeat, as
    :meth:`hai.server.HaiServer.commands` does: stops for what the agent runs and the server does
    not expect, a launch for what it expects and the agent does not run."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.expected: tuple[str, int] | None = None
        self.scripts: dict[str, Path] = {}
        self.lock = threading.Lock()

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/agents/register":
            return httpx.Response(200, json={})
        if request.url.path.endswith("/report"):
            return httpx.Response(200, json={"applied": True})
        running = {(r["job_id"], r["task"]) for r in json.loads(request.content)["running"]}
        with self.lock:
            expected = self.expected
        commands: list[dict[str, Any]] = [{"type": "stop", "job_id": j, "task": t}
                                          for j, t in sorted(running - {expected})]
        if expected is not None and expected not in running:
            job_id, task = expected
            commands.append({"type": "launch", "job_id": job_id, "task": task,
                             "argv": [sys.executable, str(self.scripts[job_id]), str(self.tmp)],
                             "master_addr": "127.0.0.1", "master_port": 29500 + task, "world_size": 1,
                             "first_rank": 0, "local_world_size": 1, "env": {}})
        return httpx.Response(200, json={"node": "n1", "commands": commands})


def test_the_old_task_is_gone_before_the_next_starts(tmp_path: Path) -> None:
    server = FakeServer(tmp_path)
    for name, script in (("old", OLD), ("new", NEW)):
        server.scripts[name] = tmp_path / f"{name}.py"
        server.scripts[name].write_text(textwrap.dedent(script))
    config = AgentConfig(server="http://hai", node="n1", token="t", heartbeat_s=0.1, term_grace_s=1.0)
    agent = Agent(config, LocalLogSink(tmp_path / "logs"), control_root=str(tmp_path),
                  transport=httpx.MockTransport(server.handle))
    thread = threading.Thread(target=agent.serve, daemon=True)
    thread.start()
    try:
        server.expected = ("old", 0)
        wait_for(lambda: (tmp_path / "old.pid").exists(), "the old task's rank to start")
        with server.lock:  # one heartbeat answer: stop the old task, launch the next
            server.expected = ("new", 1)
        wait_for(lambda: (tmp_path / "new.json").exists(), "the next task's rank to start")
        seen = json.loads((tmp_path / "new.json").read_text())
        assert seen["old_state"] in ("gone", "Z"), seen  # dead (at most not yet reaped) when it started
        wait_for(lambda: agent.held() == [("new", 1)], "the agent to hold only the next task", agent.held)
    finally:
        agent.close()
        thread.join(10.0)

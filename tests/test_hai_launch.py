"""hai.launcher and hai.client: a job's ranks on one node, their logs, and how they end.

Ranks are small Python scripts written to tmp_path; logs go to a local directory, and to fs3 (the
shared in-process cluster) where landing on fs3 is the point.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hai.client
from hai.launcher import (
    Fs3LogSink,
    LaunchError,
    LaunchSpec,
    LocalLogSink,
    Outcome,
    RankLauncher,
    log_path,
)

ROOT = Path(__file__).resolve().parents[1]

# A rank that polls for the suspend request the way a training loop would, then acknowledges.
COOPERATIVE = """
import sys, time
import hai.client
while not hai.client.receive_suspend_command():
    time.sleep(0.01)
print("saving", flush=True)
hai.client.go_suspend()
sys.exit(0)
"""

IGNORES = """
import time
print("ignoring", flush=True)
while True:
    time.sleep(0.05)
"""

ACKS_NEVER_EXITS = """
import time
import hai.client
while not hai.client.receive_suspend_command():
    time.sleep(0.01)
hai.client.go_suspend()
while True:
    time.sleep(0.05)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _spec(script: Path, job_id: str, *, ranks: int = 1, **kwargs: Any) -> LaunchSpec:
    env = {"PYTHONPATH": str(ROOT), **kwargs.pop("env", {})}
    return LaunchSpec(job_id=job_id, command=(sys.executable, str(script)), master_addr="127.0.0.1",
                      master_port=29500, world_size=kwargs.pop("world_size", ranks),
                      local_world_size=ranks, env=env, cwd=str(script.parent), **kwargs)


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def logs(tmp_path: Path) -> LocalLogSink:
    return LocalLogSink(tmp_path / "logs")


@pytest.fixture(scope="module")
def fs3_fs(shared_cluster: Any) -> Iterator[Any]:
    import fs3

    cluster = shared_cluster.cluster
    fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
    yield fs
    fs.close()


def test_each_rank_sees_its_env_and_the_users_token_only(tmp_path: Path, logs: LocalLogSink) -> None:
    script = _script(tmp_path, "env.py", """
import json, os
names = ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
         "HAI_CONTROL_DIR", "HAI_JOB_ID", "FS3_TOKEN", "FS3_MGMTD", "FS3_TOKEN_FILE", "JOB_SETTING"]
seen = {name: os.environ.get(name) for name in names}
seen["all_values"] = sorted(os.environ.values())
seen["pgid_is_pid"] = os.getpgid(0) == os.getpid()
with open(f"env-{os.environ['RANK']}.json", "w") as f:
    json.dump(seen, f)
""")
    inherited = {**os.environ, "FS3_TOKEN": "cluster-secret", "FS3_TOKEN_FILE": "/etc/fs3/token",
                 "HAI_CONTROL_DIR": "/elsewhere"}
    spec = _spec(script, "env-job", ranks=2, world_size=4, first_rank=2, env={"JOB_SETTING": "x=1"},
                 fs3_token="user-token", fs3_mgmtd="10.0.0.1:9000")
    with RankLauncher(spec, logs, inherited_env=inherited) as job:
        control = job.control_dir
        report = job.wait(20)
    assert report.outcome is Outcome.FINISHED, report
    assert [(r.rank, r.local_rank, r.exit_code) for r in report.ranks] == [(2, 0, 0), (3, 1, 0)]
    for local_rank in (0, 1):
        seen = json.loads((tmp_path / f"env-{2 + local_rank}.json").read_text())
        assert {k: seen[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                                     "LOCAL_WORLD_SIZE", "HAI_JOB_ID", "JOB_SETTING")} == {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4",
            "RANK": str(2 + local_rank), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2",
            "HAI_JOB_ID": "env-job", "JOB_SETTING": "x=1"}
        assert seen["HAI_CONTROL_DIR"] == control
        assert (seen["FS3_TOKEN"], seen["FS3_MGMTD"], seen["FS3_TOKEN_FILE"]) == ("user-token", "10.0.0.1:9000", None)
        assert "cluster-secret" not in seen["all_values"]
        assert seen["pgid_is_pid"]
    assert not os.path.exists(control), "the control directory is removed on close"


def test_a_job_cannot_set_what_hai_sets(tmp_path: Path, logs: LocalLogSink) -> None:
    script = _script(tmp_path, "x.py", "")
    for env in ({"RANK": "0"}, {"FS3_TOKEN": "t"}, {"HAI_CONTROL_DIR": "/x"}, {"A B": "1"}):
        with pytest.raises(LaunchError):
            RankLauncher(_spec(script, "bad", env=env), logs)
    with pytest.raises(LaunchError, match="job id"):
        RankLauncher(_spec(script, "../escape"), logs)
    with pytest.raises(LaunchError, match="do not fit"):
        RankLauncher(_spec(script, "big", ranks=2, world_size=1), logs)


def test_logs_land_on_fs3_byte_for_byte_with_bounded_memory(tmp_path: Path, fs3_fs: Any) -> None:
    """Rank 0 prints 3 MiB in odd-sized pieces on stdout and stderr; rank 1 prints a line, waits
    until the test saw it on fs3 (published while it runs: what a follower tails), then exits."""
    job_id = f"logs-{random.randrange(1 << 32):08x}"
    script = _script(tmp_path, "talk.py", """
import os, random, sys, time
rank = int(os.environ["RANK"])
if rank == 0:
    rng = random.Random(7)
    for i in range(400):
        piece = rng.randbytes(rng.randrange(1, 16_000))
        stream = sys.stdout if i % 3 else sys.stderr
        stream.buffer.write(piece)
        stream.flush()
else:
    print("started", flush=True)
    deadline = time.monotonic() + 20
    while not os.path.exists("go") and time.monotonic() < deadline:
        time.sleep(0.02)
    print("done", flush=True)
""")
    rng = random.Random(7)
    expected = b"".join(rng.randbytes(rng.randrange(1, 16_000)) for _ in range(400))
    chunk_bytes = 64 * 1024
    with RankLauncher(_spec(script, job_id, ranks=2), Fs3LogSink(fs3_fs), log_chunk_bytes=chunk_bytes,
                      log_flush_interval_s=0.1) as job:
        path1 = log_path(job_id, 1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if fs3_fs.exists(path1) and fs3_fs.read_bytes(path1) == b"started\n":
                break
            time.sleep(0.05)
        else:
            pytest.fail("the running rank's first line never became visible on fs3")
        (tmp_path / "go").touch()
        report = job.wait(30)
    assert report.outcome is Outcome.FINISHED, report
    assert fs3_fs.read_bytes(log_path(job_id, 0)) == expected
    assert fs3_fs.read_bytes(path1) == b"started\ndone\n"
    assert report.log_bytes == len(expected) + len(b"started\ndone\n")
    assert report.log_dropped_bytes == 0
    assert report.log_peak_buffered_bytes < chunk_bytes + 64 * 1024


def test_a_restarted_agents_log_lands_after_what_a_killed_agent_left(tmp_path: Path, shared_cluster: Any,
                                                                       fs3_fs: Any) -> None:
    """The agent holding a rank's log is SIGKILLed with lines on storage past the last publish
    (its session stays open on meta until its lease lapses); the job restarts on another node,
    whose agent opens the same log to append. Its lines come after everything the killed agent
    left: none of them written over the killed agent's, none lost."""
    job_id = f"killed-{random.randrange(1 << 32):08x}"
    cluster = shared_cluster.cluster
    published = b"".join(b"first task %05d published\n" % i for i in range(100))
    unpublished = b"".join(b"first task %05d on storage, not published\n" % i for i in range(3000))
    script = _script(tmp_path, "killed_agent.py", f"""
import os, signal
from hai.launcher import Fs3LogSink
writer = Fs3LogSink.connect({cluster.mgmtd_address!r}, {cluster.token!r}).open({job_id!r}, 0)
writer.write({published!r})
writer.publish()
writer.write({unpublished!r})
writer._file.flush()
writer._file.raw.flush()  # on storage, acknowledged; meta not told
os.kill(os.getpid(), signal.SIGKILL)
""")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    killed = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr.decode(errors="replace")
    path = log_path(job_id, 0)
    assert fs3_fs.stat(path).st_size == len(published)
    writer = Fs3LogSink(fs3_fs).open(job_id, 0)
    writer.write(b"restarted task first line\n")
    writer.close()
    assert fs3_fs.read_bytes(path) == published + unpublished + b"restarted task first line\n"


def test_a_rank_exiting_1_fails_the_job_and_the_others_are_stopped(tmp_path: Path, logs: LocalLogSink) -> None:
    script = _script(tmp_path, "fail.py", """
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(0.2)
    sys.exit(1)
while True:
    time.sleep(0.05)
""")
    with RankLauncher(_spec(script, "fails", ranks=3), logs) as job:
        pids = job.pids
        report = job.wait(20)
    assert report.outcome is Outcome.FAILED
    assert report.reason == "rank 1 exited with 1"
    assert [(r.exit_code, r.signal) for r in report.ranks] == [(None, 15), (1, None), (None, 15)]
    assert not any(_alive(pid) for pid in pids)


def test_a_cooperative_job_suspends_within_the_grace(tmp_path: Path, logs: LocalLogSink) -> None:
    script = _script(tmp_path, "coop.py", COOPERATIVE)
    with RankLauncher(_spec(script, "coop", ranks=2), logs) as job:
        time.sleep(0.3)
        start = time.monotonic()
        report = job.suspend(ack_grace_s=30, finish_grace_s=30)
        elapsed_s = time.monotonic() - start
    assert report.outcome is Outcome.SUSPENDED, report
    assert [r.exit_code for r in report.ranks] == [0, 0]
    assert elapsed_s < 30  # it ended when the job did, not at a grace (slack for a loaded machine)
    assert (tmp_path / "logs" / "coop" / "0.log").read_bytes() == b"saving\n"


def test_a_job_ignoring_the_request_is_force_stopped_after_both_graces(tmp_path: Path, logs: LocalLogSink) -> None:
    script = _script(tmp_path, "ignores.py", IGNORES)
    with RankLauncher(_spec(script, "ignores", ranks=2), logs, term_grace_s=0.5) as job:
        pids = job.pids
        time.sleep(0.2)
        start = time.monotonic()
        report = job.suspend(ack_grace_s=0.5, finish_grace_s=0.5)
        elapsed_s = time.monotonic() - start
        assert not any(_alive(pid) for pid in pids)
    assert report.outcome is Outcome.FORCE_STOPPED
    assert "did not acknowledge" in report.reason
    assert 1.0 <= elapsed_s < 15.0  # both graces, then SIGTERM (the upper bound only rules out a hang)
    assert [r.signal for r in report.ranks] == [15, 15]


def test_a_child_ignoring_sigterm_is_killed_with_its_rank(tmp_path: Path, logs: LocalLogSink) -> None:
    script = _script(tmp_path, "forks.py", """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE)
child.stdout.readline()
with open("child.pid", "w") as f:
    f.write(str(child.pid))
while True:
    time.sleep(0.05)
""")
    with RankLauncher(_spec(script, "forks"), logs, term_grace_s=0.5) as job:
        deadline = time.monotonic() + 10
        while not (tmp_path / "child.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        child = int((tmp_path / "child.pid").read_text())
        assert _alive(child)
        report = job.suspend(ack_grace_s=0.3, finish_grace_s=0.3)
        assert report.outcome is Outcome.FORCE_STOPPED
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(child)


def test_a_finished_rank_leaves_no_process_behind(tmp_path: Path, logs: LocalLogSink) -> None:
    script = _script(tmp_path, "leaves.py", """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL)
with open("child.pid", "w") as f:
    f.write(str(child.pid))
""")
    with RankLauncher(_spec(script, "leaves"), logs) as job:
        report = job.wait(20)
    assert report.outcome is Outcome.FINISHED
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child)


def test_a_job_that_acks_but_never_exits_is_killed_after_the_finish_grace(tmp_path: Path,
                                                                          logs: LocalLogSink) -> None:
    script = _script(tmp_path, "acks.py", ACKS_NEVER_EXITS)
    with RankLauncher(_spec(script, "acks"), logs, term_grace_s=0.3) as job:
        pids = job.pids
        time.sleep(0.3)
        start = time.monotonic()
        report = job.suspend(ack_grace_s=60, finish_grace_s=0.5)
        elapsed_s = time.monotonic() - start
        assert not any(_alive(pid) for pid in pids)
    assert report.outcome is Outcome.FORCE_STOPPED
    assert "did not exit within the finish grace" in report.reason
    assert 0.5 <= elapsed_s < 30.0, "the finish grace runs from the acknowledgement, not the ack grace's end"


def test_closing_mid_suspend_leaves_no_rank_running(tmp_path: Path, logs: LocalLogSink) -> None:
    script = _script(tmp_path, "ignores.py", IGNORES)
    job = RankLauncher(_spec(script, "closing", ranks=2), logs)
    pids = job.pids
    reports: list[Any] = []
    suspender = threading.Thread(target=lambda: reports.append(job.suspend(ack_grace_s=30, finish_grace_s=30)))
    suspender.start()
    time.sleep(0.3)
    start = time.monotonic()
    job.close()
    suspender.join(20)
    assert not suspender.is_alive()
    assert time.monotonic() - start < 20  # graces of 30 s: close() did not wait for them
    assert not any(_alive(pid) for pid in pids)
    assert reports[0].outcome is Outcome.STOPPED
    assert [r.signal for r in reports[0].ranks] == [9, 9]


def test_stop_kills_and_reports_stopped(tmp_path: Path, logs: LocalLogSink) -> None:
    script = _script(tmp_path, "ignores.py", IGNORES)
    with RankLauncher(_spec(script, "stops"), logs) as job:
        pids = job.pids
        report = job.stop()
        assert not any(_alive(pid) for pid in pids)
    assert report.outcome is Outcome.STOPPED


def test_receive_suspend_command_outside_and_inside_hai(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hai.client, "_seen_suspend", False)
    monkeypatch.delenv(hai.client.CONTROL_DIR_ENV, raising=False)
    assert hai.client.receive_suspend_command() is False
    assert hai.client.go_suspend() is False
    monkeypatch.setenv(hai.client.CONTROL_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    assert hai.client.receive_suspend_command() is False
    (tmp_path / hai.client.SUSPEND_FILE).touch()
    assert hai.client.receive_suspend_command() is True
    assert hai.client.go_suspend() is True
    assert (tmp_path / "ack-3").exists()
    monkeypatch.setenv(hai.client.CONTROL_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(hai.client.HaiClientError):
        hai.client.go_suspend()


HAISCALE_JOB = """
import sys, time
import torch
from torch import nn
import hai.client
from haiscale.checkpoint import CheckpointManager

total, directory, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.manual_seed(0)
data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
target = data.sum(dim=1, keepdim=True)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
manager = CheckpointManager(directory, keep=2)
loaded = manager.load_latest(model, opt)
start = 0 if loaded is None else int(loaded.extra["next_step"])
print(f"start {start}", flush=True)
for step in range(start, total):
    batch = slice((step * 16) % 64, (step * 16) % 64 + 16)
    loss = ((model(data[batch]) - target[batch]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step}", flush=True)
    time.sleep(0.02)
    if hai.client.receive_suspend_command():
        manager.on_suspend(step + 1, model, opt, extra={"next_step": step + 1})
        hai.client.go_suspend()
        manager.close()
        sys.exit(0)
manager.close()
torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, out)
"""


def test_a_haiscale_job_suspends_through_on_suspend_and_resumes_bit_identical(tmp_path: Path,
                                                                              logs: LocalLogSink) -> None:
    torch = pytest.importorskip("torch")
    script = _script(tmp_path, "train.py", HAISCALE_JOB)
    total = 30

    def spec(job_id: str, directory: str, out: str) -> LaunchSpec:
        base = _spec(script, job_id, env={"OMP_NUM_THREADS": "1"})
        return LaunchSpec(**{**base.__dict__, "command": (*base.command, str(total), directory, out)})

    with RankLauncher(spec("straight", str(tmp_path / "ckpt-a"), str(tmp_path / "a.pt")), logs) as job:
        assert job.wait(60).outcome is Outcome.FINISHED

    log0 = tmp_path / "logs" / "resumed" / "0.log"
    resumed = spec("resumed", str(tmp_path / "ckpt-b"), str(tmp_path / "b.pt"))
    with RankLauncher(resumed, logs, log_flush_interval_s=0.05) as job:
        deadline = time.monotonic() + 60
        while b"step 5\n" not in (log0.read_bytes() if log0.exists() else b""):
            assert time.monotonic() < deadline, "the job never reached step 5"
            time.sleep(0.02)
        report = job.suspend(ack_grace_s=10, finish_grace_s=5)
    assert report.outcome is Outcome.SUSPENDED, report
    assert not (tmp_path / "b.pt").exists()
    with RankLauncher(resumed, logs) as job:
        assert job.wait(60).outcome is Outcome.FINISHED
    starts = [line for line in log0.read_text().splitlines() if line.startswith("start")]
    assert starts[0] == "start 0" and starts[1] != "start 0" and len(starts) == 2
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    state_a, state_b = a["optim"]["state"], b["optim"]["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for name, value in state_a[key].items():
            assert torch.equal(value, state_b[key][name]), (key, name)

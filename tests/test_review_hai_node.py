"""A hostile review of the HAI node side (launcher, suspend channel, validator) and the state store:
each test names what it tries to break; those that once broke pin the fix."""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hai import store, validate
from hai.launcher import LaunchError, LaunchSpec, LocalLogSink, Outcome, RankLauncher
from hai.rules import ClusterState, Job, Node, Priority
from hai.store import Store, StoreError, StoreLimitError

ROOT = Path(__file__).resolve().parents[1]
HANG = 60.0  # upper bound only: rules out a hang on a loaded machine


def _spec(script: Path, job_id: str, *, ranks: int = 1, env: dict[str, str] | None = None) -> LaunchSpec:
    return LaunchSpec(job_id=job_id, command=(sys.executable, str(script)), master_addr="127.0.0.1",
                      master_port=29500, world_size=ranks, local_world_size=ranks,
                      env={"PYTHONPATH": str(ROOT), **(env or {})}, cwd=str(script.parent))


def _script(tmp_path: Path, text: str, name: str = "rank.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- launcher: the spec ------------------------------------------------------------------------------


@pytest.mark.parametrize("change", [
    {"env": {"PYTHONPATH": str(ROOT), "X": "a\0b"}},
    {"command": (sys.executable, "-c", "pass\0")},
    {"fs3_token": "tok\0en"},
    {"command": "python3"},  # a string is a sequence of one-letter arguments, not a command line
])
def test_a_spec_popen_would_choke_on_is_a_launch_error(tmp_path: Path, change: dict[str, Any]) -> None:
    spec = LaunchSpec(job_id="nul", command=(sys.executable, "-c", "pass"), master_addr="127.0.0.1",
                      master_port=29500, world_size=1)
    spec = LaunchSpec(**{**spec.__dict__, **change})
    with pytest.raises(LaunchError):
        RankLauncher(spec, LocalLogSink(tmp_path / "logs"), control_root=str(tmp_path))
    assert not list(tmp_path.glob("hai-nul-*")), "the control directory was left behind"


def test_a_missing_control_root_is_a_launch_error(tmp_path: Path) -> None:
    script = _script(tmp_path, "pass\n")
    with pytest.raises(LaunchError):
        RankLauncher(_spec(script, "noroot"), LocalLogSink(tmp_path / "logs"), control_root=str(tmp_path / "gone"))


def test_an_environment_past_the_kernels_limit_is_a_launch_error(tmp_path: Path) -> None:
    script = _script(tmp_path, "pass\n")
    spec = _spec(script, "hugeenv", env={"HUGE": "x" * (1 << 20)})  # past MAX_ARG_STRLEN: execve says E2BIG
    with pytest.raises(LaunchError):
        RankLauncher(spec, LocalLogSink(tmp_path / "logs"), control_root=str(tmp_path))
    assert not list(tmp_path.glob("hai-hugeenv-*"))


def test_job_env_may_set_path_and_ld_preload_but_not_the_token(tmp_path: Path) -> None:
    """Policy: a job runs its own code, so what it could export itself (PATH, LD_PRELOAD) it may set;
    what hai sets (the rendezvous, the control directory, the fs3 credentials) it may not."""
    script = _script(tmp_path, "import os\n"
                               "open('seen', 'w').write(os.environ['PATH'] + '|' + os.environ['LD_PRELOAD'])\n")
    spec = _spec(script, "envpolicy", env={"PATH": "/usr/bin:/bin", "LD_PRELOAD": ""})
    with RankLauncher(spec, LocalLogSink(tmp_path / "logs"), control_root=str(tmp_path)) as job:
        assert job.wait(HANG).outcome is Outcome.FINISHED
    assert (tmp_path / "seen").read_text() == "/usr/bin:/bin|"
    with pytest.raises(LaunchError):
        RankLauncher(_spec(script, "envpolicy", env={"FS3_TOKEN": "cluster"}), LocalLogSink(tmp_path / "logs"))


# -- launcher: the control directory -------------------------------------------------------------

BLOCKS_THE_REQUEST = """
import os, pathlib, time
control = pathlib.Path(os.environ["HAI_CONTROL_DIR"])
pathlib.Path("elsewhere").mkdir()
{action}
pathlib.Path("ready").touch()
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("action", [
    "(control / 'suspend').mkdir(); (control / '.suspend').mkdir()",
    "import shutil; shutil.rmtree(control)",
    "os.chmod(control, 0o500)",
    "import shutil; shutil.rmtree(control); os.symlink(os.path.abspath('elsewhere'), control)",
])
def test_a_rank_that_blocks_the_request_is_force_stopped_not_raised(tmp_path: Path, action: str) -> None:
    script = _script(tmp_path, BLOCKS_THE_REQUEST.format(action=action))
    with RankLauncher(_spec(script, "blocker"), LocalLogSink(tmp_path / "logs"), control_root=str(tmp_path),
                      term_grace_s=0.5) as job:
        _until((tmp_path / "ready").exists, "the rank to tamper")
        if os.geteuid() == 0 and "chmod" in action:
            pytest.skip("root writes into a read-only directory")
        report = job.suspend(ack_grace_s=0.2, finish_grace_s=0.2)
        assert report.outcome is Outcome.FORCE_STOPPED
        assert not any(_alive(pid) for pid in job.pids)
    assert list((tmp_path / "elsewhere").iterdir()) == []


SYMLINKS_THE_TEMPORARY = """
import os, pathlib, sys, time
import hai.client
control = pathlib.Path(os.environ["HAI_CONTROL_DIR"])
os.symlink(os.path.abspath("victim"), control / ".suspend")
pathlib.Path("ready").touch()
while not hai.client.receive_suspend_command():
    time.sleep(0.01)
hai.client.go_suspend()
sys.exit(0)
"""


def test_the_agent_does_not_write_through_a_symlink_in_the_control_dir(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("the agent's file\n")
    script = _script(tmp_path, SYMLINKS_THE_TEMPORARY)
    with RankLauncher(_spec(script, "symlink"), LocalLogSink(tmp_path / "logs"), control_root=str(tmp_path)) as job:
        _until((tmp_path / "ready").exists, "the rank to plant its symlink")
        report = job.suspend(ack_grace_s=HANG, finish_grace_s=HANG)
    assert report.outcome is Outcome.SUSPENDED, report
    assert victim.read_text() == "the agent's file\n"
    assert not victim.is_symlink()


def test_a_control_root_with_odd_characters_works(tmp_path: Path) -> None:
    root = tmp_path / "a dir with spaces, 'quotes' and é\n"
    root.mkdir()
    script = _script(tmp_path, "import hai.client, sys, time\nwhile not hai.client.receive_suspend_command():\n"
                               "    time.sleep(0.01)\nhai.client.go_suspend()\nsys.exit(0)\n")
    with RankLauncher(_spec(script, "odd"), LocalLogSink(tmp_path / "logs"), control_root=str(root)) as job:
        assert job.suspend(ack_grace_s=HANG, finish_grace_s=HANG).outcome is Outcome.SUSPENDED


# -- launcher: signals to reaped ranks ----------------------------------------------------------------

ZERO_EXITS_EARLY = """
import os, sys, time
if os.environ["LOCAL_RANK"] == "0":
    sys.exit(0)
while True:
    time.sleep(0.05)
"""


def test_a_reaped_ranks_empty_group_is_never_signalled_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a rank's group is empty its id may be any new process's: a later stop() or close()
    must not signal it (pid reuse)."""
    script = _script(tmp_path, ZERO_EXITS_EARLY)
    sent: list[tuple[int, int]] = []
    real_killpg = os.killpg

    def recording_killpg(pgid: int, sig: int) -> None:
        sent.append((pgid, sig))
        real_killpg(pgid, sig)

    with RankLauncher(_spec(script, "reaped", ranks=2), LocalLogSink(tmp_path / "logs"),
                      control_root=str(tmp_path), term_grace_s=0.5) as job:
        first = job.pids[0]
        _until(lambda: job.report().ranks[0].exit_code == 0, "rank 0 to be reaped")
        time.sleep(0.2)  # a few supervisor rounds
        monkeypatch.setattr(os, "killpg", recording_killpg)
        report = job.stop()
        assert report.outcome is Outcome.STOPPED
        job.close()
    assert [s for pgid, s in sent if pgid == first and s != 0] == []
    assert any(pgid == job.pids[1] and s == signal.SIGTERM for pgid, s in sent)


def test_close_after_the_end_signals_no_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script(tmp_path, "pass\n")
    job = RankLauncher(_spec(script, "ended", ranks=2), LocalLogSink(tmp_path / "logs"), control_root=str(tmp_path))
    assert job.wait(HANG).outcome is Outcome.FINISHED
    sent: list[tuple[int, int]] = []
    real_killpg = os.killpg

    def recording_killpg(pgid: int, sig: int) -> None:
        sent.append((pgid, sig))
        real_killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", recording_killpg)
    job.stop()
    job.close()
    assert [s for _, s in sent if s != 0] == []


# -- launcher: what held ------------------------------------------------------------------------------


class _FailingAfter:
    """A log writer that takes ``budget`` bytes, then fails every write and publish."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        if len(self.data) + len(data) > self.budget:
            raise OSError("fs3 went away")
        self.data += data

    def publish(self) -> None:
        if len(self.data) >= self.budget:
            raise OSError("fs3 went away")

    def close(self) -> None:
        raise OSError("fs3 went away")


def test_a_sink_failing_mid_job_loses_log_not_the_job(tmp_path: Path) -> None:
    writer = _FailingAfter(4096)

    class Sink:
        def open(self, job_id: str, rank: int) -> _FailingAfter:
            return writer

    script = _script(tmp_path, "import os\nfor _ in range(64):\n    os.write(1, os.urandom(1000))\n"
                               "os.write(1, b'no newline at the end')\nos.close(1)\nos.close(2)\n")
    with RankLauncher(_spec(script, "sinkfail"), Sink(), control_root=str(tmp_path), log_chunk_bytes=1024,
                      log_retries=2) as job:
        report = job.wait(HANG)
    assert report.outcome is Outcome.FINISHED
    assert report.log_bytes + report.log_dropped_bytes == 64 * 1000 + len(b"no newline at the end")
    assert report.log_dropped_bytes > 0 and report.log_peak_buffered_bytes <= 1024 + 64 * 1024


def test_suspend_twice_and_stop_concurrently_agree_and_leave_nothing(tmp_path: Path) -> None:
    script = _script(tmp_path, "import time\nwhile True:\n    time.sleep(0.05)\n")
    with RankLauncher(_spec(script, "race", ranks=2), LocalLogSink(tmp_path / "logs"), control_root=str(tmp_path),
                      term_grace_s=0.5) as job:
        results: list[Any] = []
        threads = [threading.Thread(target=lambda: results.append(job.suspend(0.3, 0.3))) for _ in range(2)]
        threads.append(threading.Thread(target=lambda: results.append(job.stop())))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG)
        assert len(results) == 3
        assert len({r.outcome for r in results}) == 1
        assert results[0].outcome in (Outcome.STOPPED, Outcome.FORCE_STOPPED)
        assert not any(_alive(pid) for pid in job.pids)


ESCAPES_ITS_GROUP = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
open("escaped", "w").write(str(child.pid))
sys.stdout.write("no newline, and the pipe stays open in the child")
"""


def test_a_child_in_its_own_session_does_not_hold_the_job(tmp_path: Path) -> None:
    """An escaped child keeps the log pipe open; the reader stops ``log_drain_s`` after the rank was
    reaped, so the job still ends (the child itself is out of reach without a cgroup, as documented)."""
    script = _script(tmp_path, ESCAPES_ITS_GROUP)
    try:
        with RankLauncher(_spec(script, "escape"), LocalLogSink(tmp_path / "logs"), control_root=str(tmp_path),
                          log_drain_s=0.2) as job:
            report = job.wait(HANG)
            assert report.outcome is Outcome.FINISHED
        assert (tmp_path / "logs" / "escape" / "0.log").read_bytes().startswith(b"no newline")
    finally:
        if (tmp_path / "escaped").exists():
            os.kill(int((tmp_path / "escaped").read_text()), signal.SIGKILL)


# -- validator ----------------------------------------------------------------------------------------


def test_ctrl_c_mid_allreduce_leaves_no_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    hang = _script(tmp_path, "import os, pathlib, time\n"
                             f"pathlib.Path({str(pids)!r}, str(os.getpid())).touch()\n"
                             "while True:\n    time.sleep(0.05)\n", "hang.py")
    calls = 0
    real_sleep = time.sleep

    def interrupting_sleep(seconds: float) -> None:
        nonlocal calls
        calls += 1
        if len(list(pids.iterdir())) == validate.ALLREDUCE_RANKS:
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", interrupting_sleep)  # the check's poll loop sleeps through it
    with pytest.raises(KeyboardInterrupt):
        validate.check_allreduce(validate.Sizes(allreduce_bytes=4096, allreduce_timeout_s=HANG),
                                 lambda rank: [sys.executable, str(hang)])
    monkeypatch.undo()
    assert not any(_alive(int(p.name)) for p in pids.iterdir())


# -- store --------------------------------------------------------------------------------------------


def _one_job(job_id: str = "J1", **kwargs: Any) -> ClusterState:
    return ClusterState(jobs={job_id: Job(job_id, "alice", "default", 1, Priority.HIGH, 1, **kwargs)}, next_seq=2)


def test_a_file_that_is_not_sqlite_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / store.DB_FILE).write_bytes(b"this is not a database\n" * 100)
    with pytest.raises(StoreError):
        Store.open(store.default_url(tmp_path))


def test_a_read_only_database_refuses_a_commit_with_a_store_error(tmp_path: Path) -> None:
    url = store.default_url(tmp_path)
    with Store.open(url):
        pass
    path = tmp_path / store.DB_FILE
    with Store.open(f"sqlite:///file:{path}?mode=ro&uri=true") as read_only:
        assert read_only.load() == ClusterState()
        with pytest.raises(StoreError):
            read_only.save(_one_job())
        assert read_only.load() == ClusterState()


def test_a_writer_locked_out_gets_a_store_error(tmp_path: Path) -> None:
    url = store.default_url(tmp_path)
    with Store.open(url + "?timeout=0.2") as db:
        db.load()
        holder = sqlite3.connect(tmp_path / store.DB_FILE, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            with pytest.raises(StoreError):
                db.save(_one_job())
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        db.save(_one_job())  # the failed commit left the store usable
        assert db.load() == _one_job()


@pytest.mark.parametrize("job_id", ["J\ud800", "\udcff"])
def test_a_lone_surrogate_is_refused_before_the_transaction(tmp_path: Path, job_id: str) -> None:
    """JSON (the API's wire format) lets a client send "\\ud800"; no database can store it."""
    with Store.open(store.default_url(tmp_path)) as db:
        db.load()
        with pytest.raises(StoreLimitError):
            db.save(_one_job(job_id))
        assert db.load() == ClusterState()


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_an_int_too_large_for_a_float_is_refused_as_a_limit(tmp_path: Path, value: int) -> None:
    with Store.open(store.default_url(tmp_path)) as db:
        db.load()
        with pytest.raises(StoreLimitError):
            db.save(ClusterState(nodes={"n1": Node("n1", "a", last_heartbeat_s=value)}))
        with pytest.raises(StoreLimitError):
            db.save(_one_job(started_s=value))


def test_unicode_names_and_extreme_ints_round_trip(tmp_path: Path) -> None:
    url = store.default_url(tmp_path)
    state = ClusterState(nodes={"nœud-✓": Node("nœud-✓", "zone-日本", memory_bytes=2**63 - 1, cpus=2**31 - 1)},
                         jobs={"作业": Job("作业", "ユーザー", "default", 2**31 - 1, Priority.HIGH, 2**63 - 2)},
                         next_seq=2**63 - 1)
    with Store.open(url) as db:
        db.load()
        db.save(state)
    with Store.open(url) as db:
        assert db.load() == state

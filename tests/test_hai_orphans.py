"""A rank does not outlive its agent's process (``hai/launcher.py``).

An agent SIGKILLed (or OOM-killed) cannot stop its ranks, and a rank runs in a session of its own,
so nothing else reaches it: a rank that does not print (printing would meet the closed log pipe)
ran on for ever — still holding the node's memory and accelerators, and still writing the job's
checkpoint directory while the server restarts the job elsewhere from that directory. The
launcher has the kernel kill each rank when the thread that started it dies (Linux
``PR_SET_PDEATHSIG``). Here a process starts a silent rank through :class:`RankLauncher` and is
SIGKILLed; the rank must be gone soon after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.hai_e2e import ROOT, wait_for

LAUNCHING = """
    import sys, time
    from hai.launcher import LaunchSpec, LocalLogSink, RankLauncher
    tmp = sys.argv[1]
    spec = LaunchSpec(job_id="silent", command=[sys.executable, "-c", "import time; time.sleep(120)"],
                      master_addr="127.0.0.1", master_port=29999, world_size=1, first_rank=0, local_world_size=1)
    launcher = RankLauncher(spec, LocalLogSink(tmp), control_root=tmp)
    print(launcher.pids[0], flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie is reaped by init at once anyway)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_dies_with_its_sigkilled_agent(tmp_path: Path) -> None:
    script = tmp_path / "launching.py"
    script.write_text(textwrap.dedent(LAUNCHING))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    rank = 0
    try:
        assert proc.stdout is not None
        rank = int(proc.stdout.readline())
        assert _alive(rank)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not _alive(rank), "the rank to die with its launcher's process", deadline_s=20.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if rank and _alive(rank):
            os.killpg(rank, signal.SIGKILL)

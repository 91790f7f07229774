"""The switches tests use to break services on purpose, and directories made durable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fs3.common.durable import make_dirs_durable
from fs3.common.errors import InvalidArgument, IoError
from fs3.common.faults import CRASH_ENV, SABOTAGE_ENV, CrashPoint, sabotaged


def test_sabotage_names_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SABOTAGE_ENV, "")
    assert not sabotaged("kv-sync")
    monkeypatch.setenv(SABOTAGE_ENV, " kv-sync , idempotency")
    assert sabotaged("kv-sync") and sabotaged("idempotency") and not sabotaged("file-sync")
    monkeypatch.setenv(SABOTAGE_ENV, "kv-sync,fsync")  # a typo must not pass as "nothing sabotaged"
    with pytest.raises(InvalidArgument, match="unknown sabotage fsync"):
        sabotaged("kv-sync")
    with pytest.raises(ValueError):
        sabotaged("no-such-thing")


@pytest.mark.parametrize("value", ["meta-answer", "meta-answer:0", "meta-answer:x", "meta-anwser:3"])
def test_malformed_crash_points_are_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(CRASH_ENV, value)
    with pytest.raises(InvalidArgument):
        CrashPoint("meta-answer")


def test_a_crash_point_kills_the_process_on_its_nth_pass() -> None:
    script = ("from fs3.common.faults import CrashPoint\n"
              "point = CrashPoint('meta-answer')\n"
              "for i in range(10):\n"
              "    point.passed()\n"
              "    print(i, flush=True)\n")
    env = {**os.environ, CRASH_ENV: "meta-answer:4"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, env=env, timeout=60)
    assert done.returncode == -signal.SIGKILL
    assert done.stdout.split() == [b"0", b"1", b"2"]
    env.pop(CRASH_ENV)
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, env=env, timeout=60).returncode == 0


def test_new_directories_survive_a_power_loss_only_when_made_durable(crash_disk: Any) -> None:
    root: Path = crash_disk.path
    make_dirs_durable(root / "a" / "b" / "c")
    (root / "x" / "y").mkdir(parents=True)  # the way directories were made before
    make_dirs_durable(root / "a" / "b" / "c")  # (already there: nothing to do)
    crash_disk.power_cut()
    assert (root / "a" / "b" / "c").is_dir()
    assert not (root / "x").exists()
    (root / "file").write_bytes(b"")
    with pytest.raises(IoError):
        make_dirs_durable(root / "file")

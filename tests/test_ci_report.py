"""The failure reporter prints a failure the moment it happens and stops a session past its budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = '''
import time

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "the numbers differ"

def test_slow_then_more():
    time.sleep(1.2)

def test_after_the_budget():
    pass
'''


def run_sample(tmp_path: Path, limit: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.ci_report"]\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FS3_TEST_SESSION_LIMIT_S": limit}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-o", "addopts=-ra", str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)


def test_a_failure_is_printed_at_once_with_its_message(tmp_path: Path) -> None:
    done = run_sample(tmp_path, "0")
    assert done.returncode == 1, done.stdout
    lines = done.stdout.splitlines()
    [line] = [text for text in lines if text.startswith("!! FAILED")]
    assert "test_sample.py::test_fails (call, " in line and "the numbers differ" in line, line
    # printed before the summary, not only in it
    assert lines.index(line) < next(i for i, text in enumerate(lines) if "short test summary" in text)
    assert "1 failed, 3 passed" in done.stdout


def test_a_session_past_its_budget_stops_with_its_summary(tmp_path: Path) -> None:
    done = run_sample(tmp_path, "1")
    assert done.returncode == 3, done.stdout
    assert "stopped before" in done.stdout and "test_after_the_budget" in done.stdout, done.stdout
    assert "1 failed, 2 passed" in done.stdout, done.stdout


@pytest.mark.parametrize("limit", ["soon", "-5", "nan", "inf"])
def test_a_bad_budget_is_refused_before_any_test_runs(tmp_path: Path, limit: str) -> None:
    done = run_sample(tmp_path, limit)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "FS3_TEST_SESSION_LIMIT_S" in done.stdout + done.stderr
    assert "passed" not in done.stdout

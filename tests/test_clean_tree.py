"""The clean-checkout check (tests/clean_tree.py) run on a throwaway git repository, so that what it
catches fails that session and not this one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clean_tree import new_entries

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,  # pytest sessions in subprocesses
    pytest.mark.skipif(shutil.which("git") is None, reason="git not installed"),
]

CONFTEST = 'pytest_plugins = ["tests.clean_tree"]\n'


def run_session(root: Path, test_body: str, *, git: bool = True) -> subprocess.CompletedProcess[str]:
    """A pytest session in ``root`` (a fresh git repository with one commit unless ``git`` is False)
    running one test whose body is ``test_body``."""
    root.mkdir()
    (root / "conftest.py").write_text(CONFTEST)
    (root / ".gitignore").write_text("__pycache__/\nignored/\n")
    (root / "tracked.txt").write_text("as committed\n")
    (root / "test_one.py").write_text(
        "from pathlib import Path\n\nROOT = Path(__file__).parent\n\n\ndef test_it() -> None:\n"
        + "".join(f"    {line}\n" for line in test_body.splitlines()))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@e"}
    if git:
        for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "start"]):
            subprocess.run(["git", *cmd], cwd=root, env=env, check=True, capture_output=True)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root),
                           str(root)], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_a_stray_file_fails_the_session(tmp_path: Path) -> None:
    done = run_session(tmp_path / "repo", "(ROOT / 'local-verify-0-verify.state').write_bytes(b'x')")
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "checkout not clean" in done.stdout and "?? local-verify-0-verify.state" in done.stdout, done.stdout


def test_a_rewritten_tracked_file_fails_the_session(tmp_path: Path) -> None:
    done = run_session(tmp_path / "repo", "(ROOT / 'tracked.txt').write_text('rewritten\\n')")
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert " M tracked.txt" in done.stdout, done.stdout


def test_ignored_and_temporary_files_pass(tmp_path: Path) -> None:
    body = ("(ROOT / 'ignored').mkdir()\n(ROOT / 'ignored' / 'out.json').write_text('{}')\n"
            "import tempfile\nPath(tempfile.mkdtemp(), 'scratch').write_text('x')")
    done = run_session(tmp_path / "repo", body)
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    assert "checkout not clean" not in done.stdout


def test_outside_a_checkout_the_check_is_off(tmp_path: Path) -> None:
    # tmp_path is outside any git work tree (pytest's base temp lies under the system temp directory).
    done = run_session(tmp_path / "plain", "(ROOT / 'stray.txt').write_text('x')", git=False)
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr


def test_only_entries_new_this_session_count() -> None:
    before = frozenset({"?? scratch.txt", " M README.md"})
    after = frozenset({"?? scratch.txt", " M README.md", "?? a.state", " D gone.py"})
    assert new_entries(before, after) == [" D gone.py", "?? a.state"]
    assert new_entries(after, before) == []

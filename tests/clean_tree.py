"""A pytest plugin that fails a session which leaves new files in the git checkout.

Tests write only under temporary directories; a file a test run leaves in the repository (fio's verify
state, a report written next to the code) is rewritten by every run and ends up committed. The plugin
records ``git status --porcelain`` when the session starts and compares it when the session ends: any
entry that was not there before (a new untracked file, a tracked file newly modified or deleted) fails
the session. Paths in ``.gitignore`` never appear in porcelain output, so ignored outputs (``.venv``,
caches, ``bench/results/tmp``) are allowed without a list here. Outside a git checkout, or without git,
the check is off.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

STATUS_TIMEOUT_S = 60
"""A status of a checkout this size takes well under a second; a hung git must not hang the session."""

_BEFORE = pytest.StashKey[frozenset[str]]()
_TOP = pytest.StashKey[Path]()


def git_status(top: Path) -> frozenset[str] | None:
    """The porcelain status lines of the checkout at ``top`` (every untracked file listed on its own
    line, not folded into its directory), or None when git cannot tell."""
    try:
        done = subprocess.run(["git", "-C", str(top), "status", "--porcelain", "--untracked-files=all"],
                              capture_output=True, text=True, timeout=STATUS_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return frozenset(line for line in done.stdout.splitlines() if line)


def checkout_top(start: Path) -> Path | None:
    """The top of the git work tree holding ``start``, or None when it is not in one."""
    if shutil.which("git") is None:
        return None
    try:
        done = subprocess.run(["git", "-C", str(start), "rev-parse", "--show-toplevel"], capture_output=True,
                              text=True, timeout=STATUS_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    return Path(done.stdout.strip())


def new_entries(before: frozenset[str], after: frozenset[str]) -> list[str]:
    """Status lines present after the session and not before it, sorted."""
    return sorted(after - before)


def pytest_sessionstart(session: pytest.Session) -> None:
    top = checkout_top(session.config.rootpath)
    if top is None:
        return
    before = git_status(top)
    if before is None:
        return
    session.stash[_TOP] = top
    session.stash[_BEFORE] = before


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _BEFORE not in session.stash:
        return
    after = git_status(session.stash[_TOP])
    if after is None:
        return
    stray = new_entries(session.stash[_BEFORE], after)
    if not stray:
        return
    lines = [f"tests left files in the checkout {session.stash[_TOP]} (git status --porcelain, new this session):",
             *(f"  {line}" for line in stray),
             "write them under tmp_path instead (or add the path to .gitignore if it is a build output)."]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_sep("=", "checkout not clean", red=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print("\n".join(lines))
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

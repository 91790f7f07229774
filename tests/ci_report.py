"""A pytest plugin that makes a run on another machine explain itself from the tail of its output.

CI keeps only the last part of what a run prints, and a run that outlives CI's limit prints no summary
at all: a failure early in the session would be known only as an ``F`` in a progress line. So:

- every failure or error is written out at once, one line each (the test, the phase, the seconds it
  took and the first line of its message), between the progress dots;
- a session that has run longer than ``FS3_TEST_SESSION_LIMIT_S`` (default 3600 s, well inside CI's
  limit; ``0`` turns the guard off) stops before its next test, so the summary, the failures and the
  slowest tests are still printed instead of being cut off by CI's kill.
"""

from __future__ import annotations

import math
import os
import time

import pytest

SESSION_LIMIT_ENV = "FS3_TEST_SESSION_LIMIT_S"
DEFAULT_SESSION_LIMIT_S = 3600.0
MESSAGE_CHARS = 300
"""How much of a failure's first line is printed at once (the full report comes in the summary)."""

def session_limit_s() -> float | None:
    """The session's wall-clock budget in seconds, or None when the guard is off."""
    text = os.environ.get(SESSION_LIMIT_ENV, "").strip()
    if not text:
        return DEFAULT_SESSION_LIMIT_S
    try:
        limit_s = float(text)
    except ValueError:
        limit_s = math.nan
    if not (math.isfinite(limit_s) and limit_s >= 0):  # NaN would switch the guard off unnoticed
        raise pytest.UsageError(f"{SESSION_LIMIT_ENV}={text!r}: expected a number of seconds (0 = no limit)")
    return limit_s or None


def failure_line(report: pytest.TestReport) -> str:
    """One line naming a failed test, its phase, its duration and the start of its message."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr)
    first = message.strip().splitlines()[0] if message.strip() else "(no message)"
    where = f"{report.nodeid} ({report.when}, {report.duration:.1f} s)"
    return f"!! {report.outcome.upper()} {where}: {first[:MESSAGE_CHARS]}"


class FailureReporter:
    """The plugin's state: the terminal to write to, the session's start and its budget."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.limit_s = session_limit_s()  # a bad value is refused before any test runs
        self.started = time.monotonic()

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        elapsed_s = time.monotonic() - self.started
        if self.limit_s is not None and elapsed_s > self.limit_s:
            pytest.exit(f"the session has run {elapsed_s:.0f} s, past {SESSION_LIMIT_ENV}={self.limit_s:.0f}: "
                        f"stopped before {item.nodeid} so that its summary is printed", returncode=3)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.failed:
            return
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if isinstance(terminal, pytest.TerminalReporter):
            terminal.write("\n")  # off the progress line (its dots go on under the message)
            terminal.write_line(failure_line(report))


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(FailureReporter(config), "fs3-failure-reporter")

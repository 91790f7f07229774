"""What the HFReduce tests share: starting ranks as processes, collecting the one JSON line each
prints, and the body of a rank's ``main`` (run a scenario, print the result, leave the job)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hfreduce
from hfreduce.shm import SHM_DIR

__all__ = ["ROOT", "collect_results", "free_port", "rank_env", "run_rank", "segments"]

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def segments() -> set[str]:
    """HFReduce's names in /dev/shm now (a test compares before and after: nothing may stay)."""
    return {name for name in os.listdir(SHM_DIR) if name.startswith("hfreduce-")}


def rank_env(rank: int, world: int, port: int, node: str | None, extra: dict[str, str]) -> dict[str, str]:
    """torch's launcher variables for one rank on this machine; ``node`` groups ranks into nodes."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=str(ROOT), **extra)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    if node is not None:
        env["HFREDUCE_TEST_NODE"] = node
    return env


OUTPUT_TAIL_CHARS = 2_000
"""How much of a failed rank's output an assertion quotes: enough for a traceback's last frames."""


def _tail(text: str | None) -> str:
    return (text or "")[-OUTPUT_TAIL_CHARS:]


def collect_results(procs: list[subprocess.Popen[str]], timeout_s: float, what: str = "a rank") -> list[dict[str, Any]]:
    """Each process's last JSON line, in order. If one outlives the deadline or prints no result, every
    process is killed and reaped (none outlives the test to slow the ones after it), and the error
    quotes the tail of each rank's output: a hang on another machine explains itself."""
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    for index, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{what} hung (rank {index} still running after {timeout_s:.0f} s)\n"
                                 f"{_kill_and_report(procs)}") from None
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        if not lines:
            raise AssertionError(f"{what} printed no result (rank {index}, exit {proc.returncode}):\n"
                                 f"{_tail(out)}\n{_tail(err)}\n{_kill_and_report(procs)}")
        results.append(json.loads(lines[-1]))
    return results


def _kill_and_report(procs: list[subprocess.Popen[str]]) -> str:
    """Kill every process of a failed job, reap it, and return each one's exit status and output tail."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    report: list[str] = []
    for index, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=30)
        except (subprocess.TimeoutExpired, ValueError):  # ValueError: its pipes were already read and closed
            out, err = "", ""
        report.append(f"--- rank {index}: exit {proc.returncode}\n{_tail(out)}\n{_tail(err)}")
    return "\n".join(report)


def run_rank(body: Callable[[dict[str, Any]], None]) -> None:
    """A rank's ``main``: ``body(result)`` fills the result; it is printed as one JSON line however the
    body ends (``ok`` only if it returned), and the rank leaves its job."""
    result: dict[str, Any] = {"rank": int(os.environ["RANK"]), "ok": False}
    try:
        body(result)
        result["ok"] = True
    except Exception as exc:
        result["exception"] = f"{type(exc).__name__}: {exc}"
    finally:
        print(json.dumps(result), flush=True)
        hfreduce.destroy()

"""Long simulator sweeps: seeds in parallel on every core, every result kept on disk, resumable.

Each seed is deterministic and independent of the others, so a sweep is embarrassingly parallel;
what makes a long one (``make sim SEEDS=10000``) usable is not losing work. Every finished seed is
appended as one JSON line to ``<results>/<config>.jsonl`` — the configuration being the run options
a seed's outcome depends on — the moment it finishes, so a sweep that is interrupted (Ctrl-C, a
killed job, a reboot) resumes where it stopped with ``--resume`` instead of starting over. The
lines stay out of git (they are many and machine-specific); ``summary-<config>.md`` next to them is
small, deterministic for a given set of results, and meant to be committed: which seed ranges were
covered, how many passed, and each failing seed with the command that replays it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fs3.sim.run import run_seed

__all__ = ["RESULTS_DIR", "SweepBusy", "SweepConfig", "SweepOutcome", "load_results", "print_outcome", "run_one",
           "sweep", "write_summary"]

RESULTS_DIR = Path("bench/results/sim")
_MAX_LISTED = 50  # violations and faults kept per failing seed (the replay shows the rest)
_PR_SET_PDEATHSIG = 1

Record = dict[str, Any]


@dataclass(frozen=True)
class SweepConfig:
    """The options a seed's outcome depends on; results are kept per configuration."""

    clients: int = 3
    ops: int = 60
    faults: float = 1.0
    mix: str = "default"  # the operation, shape and fault mix (see run_seed)

    def key(self) -> str:
        """A file-name-safe name of the configuration, stable across runs."""
        mix = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.mix)
        if len(mix) > 40 or mix != self.mix:
            mix = f"{mix[:32]}-{hashlib.sha1(self.mix.encode()).hexdigest()[:8]}"
        return f"c{self.clients}-o{self.ops}-f{self.faults:g}-{mix}"

    def describe(self) -> str:
        return f"clients {self.clients}, ops {self.ops}, faults {self.faults:g}, mix {self.mix}"

    def replay(self, seed: int) -> str:
        """The command that reruns one seed, verbose with virtual timestamps."""
        command = f"python -m fs3.sim --seed {seed} --clients {self.clients} --ops {self.ops} --faults {self.faults:g}"
        return command + (f" --mix {self.mix!r}" if self.mix != "default" else "")


def run_one(config: SweepConfig, seed: int) -> Record:
    """Run one seed and return its result line. A crash of the simulator itself is a failed seed,
    not the end of the sweep."""
    started = time.monotonic()
    try:
        result = run_seed(seed, clients=config.clients, ops_per_client=config.ops, fault_intensity=config.faults,
                          mix=config.mix)
    except Exception:  # recorded as the seed's failure, with its traceback
        return {"seed": seed, "ok": False, "summary": f"seed {seed}: CRASHED",
                "violations": [f"crash: {traceback.format_exc(limit=20)}"], "faults": [],
                "elapsed": round(time.monotonic() - started, 3)}
    return {"seed": seed, "ok": result.ok, "summary": result.summary(), "violations": result.violations[:_MAX_LISTED],
            "faults": [] if result.ok else result.faults[:_MAX_LISTED],
            "elapsed": round(time.monotonic() - started, 3)}


def _run_one_packed(job: tuple[SweepConfig, int]) -> Record:
    return run_one(*job)


def _worker_init() -> None:
    """Workers log nothing (a sweep reports per seed; the replay command shows the details), leave
    Ctrl-C to the parent (which stops the pool), and die with the parent if it is killed instead of
    finishing seeds nobody will record."""
    logging.basicConfig(level=logging.CRITICAL)
    logging.getLogger().setLevel(logging.CRITICAL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # Linux; elsewhere orphans finish their seed


# -- the results file ---------------------------------------------------------------------------

def load_results(path: Path) -> dict[int, Record]:
    """Every seed recorded in ``path`` (the last line wins for a seed recorded twice).

    A line cut short — the sweep was killed while writing it — or otherwise unreadable is skipped:
    that seed simply runs again on resume.
    """
    records: dict[int, Record] = {}
    if not path.exists():
        return records
    with open(path, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
                seed = int(record["seed"])
                bool(record["ok"])
            except (ValueError, KeyError, TypeError):
                continue
            records[seed] = record
    return records


class SweepBusy(RuntimeError):
    """Another sweep of the same configuration is writing its results file."""


class _ResultLog:
    """Appends whole lines, one ``write`` each, to an O_APPEND file descriptor: a kill leaves at
    most the last line cut short, and that tail is cut off before anything is appended after it
    (so it cannot swallow the next line). Held under an exclusive lock: two sweeps of the same
    configuration at once would run the same seeds twice."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise SweepBusy(f"another sweep is writing {path}; wait for it or use --results elsewhere") from None
        size = os.fstat(self._fd).st_size
        if size:
            with open(path, "rb") as f:
                data = f.read()
            keep = data.rfind(b"\n") + 1
            if keep != size:
                os.ftruncate(self._fd, keep)

    def append(self, record: Record) -> None:
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        view = memoryview(line)
        while view:
            view = view[os.write(self._fd, view):]

    def close(self) -> None:
        os.close(self._fd)


# -- the summary ---------------------------------------------------------------------------------

def _ranges(seeds: Iterable[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for seed in sorted(seeds):
        if out and seed == out[-1][1] + 1:
            out[-1] = (out[-1][0], seed)
        else:
            out.append((seed, seed))
    return out


def _format_ranges(seeds: Iterable[int]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _ranges(seeds)) or "none"


def write_summary(directory: Path, config: SweepConfig, records: dict[int, Record]) -> Path:
    """Refresh ``summary-<config>.md``: its content depends only on the recorded results."""
    failing = sorted(s for s, r in records.items() if not r["ok"])
    commits: dict[str, int] = {}
    for record in records.values():
        commits[record.get("commit") or "unknown"] = commits.get(record.get("commit") or "unknown", 0) + 1
    mix_flag = f" --mix {config.mix}" if config.mix != "default" else ""
    make_target = "sim-meta" if config.mix == "meta" else "sim"
    lines = [
        f"# Simulator sweep: {config.describe()}",
        "",
        f"Results: `{config.key()}.jsonl` (not in git); rerun or extend with "
        f"`python -m fs3.sim --resume --first N --seeds M --clients {config.clients} --ops {config.ops} "
        f"--faults {config.faults:g}{mix_flag}` (or `make {make_target} SEEDS=M`).",
        "",
        f"- seeds covered: {_format_ranges(records)}",
        f"- {len(records)} seeds: {len(records) - len(failing)} passed, {len(failing)} failed",
        f"- CPU time: {sum(float(r.get('elapsed', 0)) for r in records.values()) / 3600:.1f} h"
        if records else "- CPU time: 0 h",
        "- code: " + ", ".join(f"{c} ({n} seeds)" for c, n in sorted(commits.items(), key=lambda kv: -kv[1])),
        "",
    ]
    if failing:
        lines += ["## Failing seeds", "", "| seed | first violation | replay |", "|---|---|---|"]
        for seed in failing:
            violations = records[seed].get("violations") or ["?"]
            first = str(violations[0]).splitlines()[0].replace("|", "\\|")[:160]
            lines.append(f"| {seed} | {first} | `{config.replay(seed)}` |")
    else:
        lines.append("No failing seeds.")
    path = directory / f"summary-{config.key()}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)  # a kill leaves the old summary or the new one, never half of one
    return path


def _git_commit() -> str:
    """The code a result came from (a sweep may span commits; the summary lists them)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        if rev.returncode == 0:
            # Results and summaries are tracked files that sweeps rewrite: they do not make the code dirty.
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                    ":(top,exclude)bench/results"], capture_output=True, text=True, timeout=10,
                                   cwd=Path(__file__).resolve().parent)
            return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    return ""


# -- the sweep -----------------------------------------------------------------------------------

@dataclass
class SweepOutcome:
    """What a sweep did, and where the selected seeds stand (earlier runs' results included)."""

    config: SweepConfig
    selected: list[int]
    ran: list[int] = field(default_factory=list)
    skipped: int = 0  # recorded before and not run again (resume)
    records: dict[int, Record] = field(default_factory=dict)  # the selected seeds that have a result
    elapsed: float = 0.0
    interrupted: bool = False
    summary_path: Path | None = None

    @property
    def failing(self) -> list[int]:
        return sorted(s for s, r in self.records.items() if not r["ok"])

    @property
    def ok(self) -> bool:
        return not self.failing and not self.interrupted and len(self.records) == len(self.selected)


def _report_failure(record: Record, config: SweepConfig, out: Callable[[str], None]) -> None:
    out(str(record["summary"]))
    for violation in record.get("violations", [])[:20]:
        out(f"    {violation}")
    for fault in record.get("faults", [])[:20]:
        out(f"    fault: {fault}")
    out(f"    replay: {config.replay(int(record['seed']))}")


def sweep(config: SweepConfig, seeds: Sequence[int], *, jobs: int | None = None, resume: bool = False,
          results_dir: Path = RESULTS_DIR, record: bool = True, out: Callable[[str], None] = print,
          progress_interval_s: float = 15.0) -> SweepOutcome:
    """Run ``seeds`` on ``jobs`` processes (default: every core), appending each result as it comes.

    With ``resume``, seeds already recorded for this configuration are not run again. Failures are
    printed as they arrive; progress lines every ``progress_interval_s`` (and every 5 %).
    """
    results_path = results_dir / f"{config.key()}.jsonl"
    log = _ResultLog(results_path) if record else None  # locked before reading what is recorded
    known = load_results(results_path) if record else {}
    todo = [s for s in seeds if not (resume and s in known)]
    outcome = SweepOutcome(config, list(seeds), skipped=len(seeds) - len(todo))
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    commit = _git_commit() if record else ""
    if outcome.skipped:
        out(f"resuming: {outcome.skipped} of {len(seeds)} seeds already recorded in {results_path}")
    if todo:
        out(f"running {len(todo)} seeds on {jobs} process{'es' if jobs > 1 else ''} ({config.describe()})")
    started = time.monotonic()
    last_progress = started
    step = max(1, len(todo) // 20)
    failed = 0
    pool = None
    try:
        if jobs == 1:
            results: Iterable[Record] = (run_one(config, seed) for seed in todo)
        else:
            # spawn: workers start clean (no inherited threads, loops or gRPC state from the parent).
            pool = multiprocessing.get_context("spawn").Pool(jobs, initializer=_worker_init)
            results = pool.imap_unordered(_run_one_packed, [(config, seed) for seed in todo])
        for result in results:
            if commit:
                result["commit"] = commit
            if log is not None:
                log.append(result)
            known[int(result["seed"])] = result
            outcome.ran.append(int(result["seed"]))
            if not result["ok"]:
                failed += 1
                _report_failure(result, config, out)
            now = time.monotonic()
            done = len(outcome.ran)
            if done == len(todo) or done % step == 0 or now - last_progress >= progress_interval_s:
                last_progress = now
                rate = done / max(now - started, 1e-9)
                out(f"  {done}/{len(todo)} seeds, {failed} failed, {now - started:.0f}s"
                    + (f", ~{(len(todo) - done) / rate:.0f}s left" if done < len(todo) else ""))
    except KeyboardInterrupt:
        outcome.interrupted = True
        out(f"interrupted: {len(outcome.ran)} of {len(todo)} seeds recorded; --resume continues from there")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if log is not None:
            log.close()
    outcome.elapsed = time.monotonic() - started
    selected = set(seeds)
    outcome.records = {s: r for s, r in known.items() if s in selected}
    if record:
        outcome.summary_path = write_summary(results_dir, config, known)
    return outcome


def print_outcome(outcome: SweepOutcome, out: Callable[[str], None] = print) -> None:
    """The closing lines: this run, the selected range as recorded, and every failing seed's replay."""
    new_failed = sum(1 for s in outcome.ran if not outcome.records[s]["ok"])
    out(f"{len(outcome.ran) - new_failed} passed, {new_failed} failed ({outcome.elapsed:.1f}s)"
        + (f"; {outcome.skipped} seeds skipped as already recorded" if outcome.skipped else ""))
    if outcome.skipped or outcome.interrupted:
        missing = len(outcome.selected) - len(outcome.records)
        out(f"seeds {_format_ranges(outcome.selected)}: {len(outcome.records) - len(outcome.failing)} passed, "
            f"{len(outcome.failing)} failed" + (f", {missing} not run" if missing else ""))
    if outcome.failing:
        out("failing seeds:")
        for seed in outcome.failing:
            out(f"  {seed}: {outcome.config.replay(seed)}")
    if outcome.summary_path is not None:
        out(f"summary: {outcome.summary_path}")

"""The HAI scheduler's rules against strict FIFO, replayed on one synthetic trace in virtual time.

Why: time-sharing by priority with suspends should cut the wait of high-priority jobs without
leaving nodes idle; preemption costs the low-priority jobs lost work and extra waiting. This
replays the same trace through the real scheduling core (:mod:`hai.rules`: ``submit``,
``schedule``, ``apply``, ``finish``, ``suspend_acknowledged``) and through a small FIFO baseline
(strict arrival order, whole nodes, no priorities, no preemption, no backfill) on the same node
count, and compares node occupancy, waits per priority, suspensions and makespan.

The trace (fixed seed, ``random.Random``; every figure below is also written to the result):

* arrivals: a Poisson process, exponential inter-arrival times with mean ``--interarrival-s``
  (default 720 s: an expected offered load of about 0.95 of the 32 nodes, so queues form; the
  heavy-tailed work makes a drawn trace's load vary, and the result records its ``offered_node_s``);
* sizes: 1, 2, 4, 8 or 16 nodes with probabilities 0.40, 0.25, 0.15, 0.12, 0.08 (capped at the node count);
* priorities: LOW 0.4, NORMAL 0.4, HIGH 0.2;
* work: log-normal, median 3600 s, sigma 1.0, clipped to [60 s, 24 h];
* users: 8, uniform; quotas are the whole cluster, so quota never holds a job back.

The replay of the rules (all times virtual seconds):

* a job is submitted at its arrival; after every batch of simultaneous events one ``schedule``
  pass runs and its decision is applied;
* a placed task finishes when its remaining work is done; a resumed task first spends
  ``RESUME_S`` (120 s) loading its checkpoint;
* a suspended job keeps its progress up to its last periodic checkpoint (every
  ``CHECKPOINT_INTERVAL_S`` = 1800 s of work); the work since is lost. Its suspend is acknowledged
  ``SUSPEND_ACK_S`` (10 s: the issue's 5 s to acknowledge plus 5 s to finish) after the request,
  and its nodes stay busy until then. The time periodic checkpoints take is left out of both
  schedulers alike.

Figures: occupancy (busy node-seconds over nodes x makespan, busy meaning held by a job, suspending
included) and useful occupancy (the trace's work over nodes x makespan: lost work, checkpoint
loading and suspend time left out); lost work (node-seconds thrown away by suspends); wait
(arrival to first start) and queued time (all time spent queued, re-queues after a suspend
included), mean and p95 (nearest rank) per priority; suspensions; makespan (last finish).
Every replay is checked (:func:`check_replay`): each job finishes exactly once, no node is held by
two jobs at any time step, occupancy is at most one.

**Real processes** (:func:`real_suspend`, skipped with ``--no-real``): the suspend path itself, timed
on ``hai local``'s processes (:class:`hai.local.HaiLocal`: an fs3 cluster, ``hai server`` and two
``hai agent`` processes, in network namespaces when root) with the agents' grace periods set to
``REAL_ACK_GRACE_S`` + ``REAL_FINISH_GRACE_S``. A LOW job holds both nodes; a HIGH job needing both
arrives; the scheduler suspends LOW. Timed: from the server's suspend request (LOW seen
``suspending``, polled every 20 ms) to the nodes being free (LOW's task ended ``suspended``, the
server's own timestamp), as a ratio to the whole grace (ack + finish), for a job whose ranks
acknowledge (``hai.client``: they "save" for ``REAL_SAVE_S`` and call ``go_suspend``) and for one
that ignores the request, which the agents must force-stop at the end of the grace (ratio near 1.0).
The ratio includes a heartbeat (the agents learn of the suspend at their next one, every
``REAL_HEARTBEAT_S``) and the report's way back. "Free" is as the server sees it: the end counts
from the node holding rank 0 (``hai.server._report``); the other node's agent ends its rank on the
same deadline.

Usage: ``python bench/hai_bench.py [--jobs 300] [--nodes 32] [--seed 1] [--interarrival-s 720] [--no-real]``
(``--jobs`` at most 2000). Prints a table and writes ``bench/results/hai-<UTC timestamp>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import heapq
import json
import math
import random
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hai import rules  # noqa: E402
from hai.rules import Priority  # noqa: E402

__all__ = ["Replay", "ReplayError", "Segment", "TraceJob", "check_replay", "make_trace", "occupancy", "p95",
           "pick_free", "replay_fifo", "replay_rules", "run", "summary", "useful_occupancy"]

RESULTS = ROOT / "bench" / "results"
MAX_JOBS = 2000  # bound on the trace: the replay is quadratic-ish in jobs (each pass walks every job)
SIZES_NODES = (1, 2, 4, 8, 16)
SIZE_WEIGHTS = (0.40, 0.25, 0.15, 0.12, 0.08)
PRIORITIES = (Priority.LOW, Priority.NORMAL, Priority.HIGH)
PRIORITY_WEIGHTS = (0.4, 0.4, 0.2)
WORK_MEDIAN_S = 3600.0
WORK_SIGMA = 1.0
WORK_MIN_S, WORK_MAX_S = 60.0, 86_400.0
USERS = 8
CHECKPOINT_INTERVAL_S = 1800.0
SUSPEND_ACK_S = 10.0
RESUME_S = 120.0


class ReplayError(AssertionError):
    """A replay broke conservation: a job lost or finished twice, a node double-booked, occupancy over one."""


@dataclass(frozen=True)
class TraceJob:
    """One job of the trace: when it arrives, what it needs and how much work it is."""

    job_id: str
    user: str
    nodes: int
    priority: Priority
    arrival_s: float
    work_s: float


@dataclass(frozen=True)
class Segment:
    """A job holding ``nodes`` from ``start_s`` to ``end_s`` (one task of its chain)."""

    job_id: str
    nodes: tuple[str, ...]
    start_s: float
    end_s: float


@dataclass
class Replay:
    """What one scheduler did with the trace."""

    name: str
    nodes: int
    segments: list[Segment] = field(default_factory=list)
    first_start_s: dict[str, float] = field(default_factory=dict)
    finished_s: dict[str, list[float]] = field(default_factory=dict)  # a list, so a double finish shows
    queued_s: dict[str, float] = field(default_factory=dict)
    suspensions: int = 0
    lost_work_node_s: float = 0.0  # work since the last checkpoint, thrown away by suspends, times nodes


def make_trace(jobs: int, seed: int, nodes: int, interarrival_s: float) -> list[TraceJob]:
    """The synthetic trace of the module docstring; the same seed gives the same trace."""
    if not 1 <= jobs <= MAX_JOBS:
        raise ValueError(f"jobs must be between 1 and {MAX_JOBS}, not {jobs}")
    if nodes < 1 or not math.isfinite(interarrival_s) or interarrival_s <= 0:
        raise ValueError("nodes must be at least one and interarrival_s a positive number")
    rng = random.Random(seed)
    out: list[TraceJob] = []
    now_s = 0.0
    for index in range(jobs):
        now_s += rng.expovariate(1.0 / interarrival_s)
        size = min(rng.choices(SIZES_NODES, SIZE_WEIGHTS)[0], nodes)
        priority = rng.choices(PRIORITIES, PRIORITY_WEIGHTS)[0]
        work_s = min(max(rng.lognormvariate(math.log(WORK_MEDIAN_S), WORK_SIGMA), WORK_MIN_S), WORK_MAX_S)
        out.append(TraceJob(f"j{index:04d}", f"u{rng.randrange(USERS)}", size, priority,
                            round(now_s, 3), round(work_s, 3)))
    return out


# -- the real rules -------------------------------------------------------------------------------

_ARRIVE, _ACK, _FINISH = 2, 1, 0  # finishes first at one instant, so freed nodes are seen by the pass


def node_names(count: int) -> list[str]:
    return [f"n{i:03d}" for i in range(count)]


def replay_rules(trace: Sequence[TraceJob], nodes: int) -> Replay:
    """Replay ``trace`` through :mod:`hai.rules` on ``nodes`` nodes in one zone."""
    config = rules.Config(default_quota_nodes=nodes)
    state = rules.ClusterState()
    for name in node_names(nodes):
        state = rules.add_node(state, rules.Node(name=name, zone="z0"))
    by_id = {job.job_id: job for job in trace}
    progress_s = {entry.job_id: 0.0 for entry in trace}  # checkpointed work
    task_start_s: dict[str, float] = {}
    queued_since_s: dict[str, float] = {}
    out = Replay("rules", nodes, queued_s={entry.job_id: 0.0 for entry in trace})
    events: list[tuple[float, int, int, str, int]] = []  # (time, kind, tiebreak, job, task)
    for index, entry in enumerate(trace):
        heapq.heappush(events, (entry.arrival_s, _ARRIVE, index, entry.job_id, 0))
    tiebreak = len(trace)
    budget = 200 * len(trace) + 10  # every event is an arrival, a finish or an ack; suspends are bounded by passes
    for _ in range(budget):
        if not events:
            break
        now_s = events[0][0]
        while events and events[0][0] == now_s:
            _, kind, _, job_id, task = heapq.heappop(events)
            job = state.jobs.get(job_id)
            if kind == _ARRIVE:
                spec = by_id[job_id]
                state = rules.submit(state, rules.JobSpec(job_id, spec.user, spec.nodes, spec.priority), now_s)
                queued_since_s[job_id] = now_s
            elif job is None or job.task != task or job.state not in (rules.JobState.RUNNING,
                                                                      rules.JobState.SUSPENDING):
                continue  # a stale event: the task it was about has ended
            elif kind == _FINISH:
                state = rules.finish(state, job_id, now_s, task=task)
                out.segments.append(Segment(job_id, job.assigned, task_start_s[job_id], now_s))
                out.finished_s.setdefault(job_id, []).append(now_s)
            else:  # _ACK
                resume_s = RESUME_S if task > 0 else 0.0
                done_s = progress_s[job_id] + max(0.0, now_s - task_start_s[job_id] - resume_s)
                kept_s = max(progress_s[job_id], math.floor(done_s / CHECKPOINT_INTERVAL_S) * CHECKPOINT_INTERVAL_S)
                out.lost_work_node_s += (done_s - kept_s) * len(job.assigned)
                progress_s[job_id] = kept_s
                state = rules.suspend_acknowledged(state, job_id, now_s, task=task)
                out.segments.append(Segment(job_id, job.assigned, task_start_s[job_id], now_s))
                queued_since_s[job_id] = now_s
        decision = rules.schedule(state, now_s, config)
        state = rules.apply(state, decision)
        for suspension in decision.suspensions:
            out.suspensions += 1
            tiebreak += 1
            heapq.heappush(events, (now_s + SUSPEND_ACK_S, _ACK, tiebreak, suspension.job_id,
                                    state.jobs[suspension.job_id].task))
        for placement in decision.placements:
            job = state.jobs[placement.job_id]
            out.first_start_s.setdefault(job.job_id, now_s)
            out.queued_s[job.job_id] += now_s - queued_since_s.pop(job.job_id)
            task_start_s[job.job_id] = now_s
            remaining_s = by_id[job.job_id].work_s - progress_s[job.job_id]
            tiebreak += 1
            heapq.heappush(events, (now_s + (RESUME_S if job.task > 0 else 0.0) + remaining_s, _FINISH, tiebreak,
                                    job.job_id, job.task))
    if events:
        raise ReplayError(f"the rules replay did not end within {budget} event batches")
    return out


# -- the FIFO baseline ----------------------------------------------------------------------------

Picker = Callable[[Sequence[str], Sequence[str], int], tuple[str, ...]]


def pick_free(free: Sequence[str], every: Sequence[str], need: int) -> tuple[str, ...]:
    """The honest choice: the first ``need`` free nodes."""
    return tuple(free[:need])


def replay_fifo(trace: Sequence[TraceJob], nodes: int, pick: Picker = pick_free) -> Replay:
    """Strict FIFO: the head of the queue starts when enough nodes are free; nothing overtakes it.
    ``pick`` chooses the nodes (a test passes a broken one to prove the checker catches it)."""
    every = node_names(nodes)
    busy: set[str] = set()
    queue = sorted(trace, key=lambda j: (j.arrival_s, j.job_id))
    out = Replay("fifo", nodes, queued_s={job.job_id: 0.0 for job in trace})
    running: list[tuple[float, str, tuple[str, ...], float]] = []  # (end, job, nodes, start)
    head = 0
    now_s = 0.0
    for _ in range(2 * len(queue) + 1):
        # Start every job at the head that fits now (arrived, and enough free nodes).
        while head < len(queue) and queue[head].arrival_s <= now_s and \
                len(every) - len(busy) >= min(queue[head].nodes, len(every)):
            job = queue[head]
            chosen = pick([n for n in every if n not in busy], every, job.nodes)
            busy |= set(chosen)
            out.first_start_s[job.job_id] = now_s
            out.queued_s[job.job_id] = now_s - job.arrival_s
            heapq.heappush(running, (now_s + job.work_s, job.job_id, chosen, now_s))
            head += 1
        # The head has arrived and waits for nodes (only a finish helps), or has not arrived yet.
        next_arrival_s = queue[head].arrival_s if head < len(queue) and queue[head].arrival_s > now_s else math.inf
        if not running and next_arrival_s == math.inf:
            break  # nothing runs and nothing arrives: done (or, with a broken picker, stuck)
        if running and running[0][0] <= next_arrival_s:
            end_s, job_id, chosen, start_s = heapq.heappop(running)
            busy -= set(chosen)
            out.segments.append(Segment(job_id, chosen, start_s, end_s))
            out.finished_s.setdefault(job_id, []).append(end_s)
            now_s = end_s
        else:
            now_s = next_arrival_s
    return out


# -- checks and figures ---------------------------------------------------------------------------


def makespan_s(replay: Replay) -> float:
    return max((s.end_s for s in replay.segments), default=0.0)


def occupancy(replay: Replay) -> float:
    """Busy node-seconds over nodes x makespan."""
    span_s = makespan_s(replay)
    busy = sum(len(s.nodes) * (s.end_s - s.start_s) for s in replay.segments)
    return busy / (replay.nodes * span_s) if span_s > 0 else 0.0


def useful_occupancy(replay: Replay, trace: Sequence[TraceJob]) -> float:
    """The trace's work (node-seconds) over nodes x makespan: occupancy less lost work, checkpoint
    loading and suspend time, the same for any scheduler with the same makespan."""
    span_s = makespan_s(replay)
    return sum(j.nodes * j.work_s for j in trace) / (replay.nodes * span_s) if span_s > 0 else 0.0


def check_replay(replay: Replay, trace: Sequence[TraceJob]) -> None:
    """Conservation, or :class:`ReplayError`: every job finishes exactly once, no earlier than its
    arrival plus its work; no node is held by two jobs in any time step between two event times
    (a sweep over every segment's start and end, ends first at one instant); occupancy at most one."""
    expected = {job.job_id for job in trace}
    if set(replay.finished_s) != expected:
        missing, extra = sorted(expected - set(replay.finished_s)), sorted(set(replay.finished_s) - expected)
        raise ReplayError(f"{replay.name}: jobs not finished {missing[:5]}, unknown jobs finished {extra[:5]}")
    twice = sorted(j for j, ends in replay.finished_s.items() if len(ends) != 1)
    if twice:
        raise ReplayError(f"{replay.name}: jobs finished more than once: {twice[:5]}")
    for job in trace:
        if replay.finished_s[job.job_id][0] < job.arrival_s + job.work_s - 1e-6:
            raise ReplayError(f"{replay.name}: {job.job_id} finished before its work could be done")
    edges: list[tuple[float, int, str, str]] = []
    valid = set(node_names(replay.nodes))
    for s in replay.segments:
        for node in s.nodes:
            if node not in valid:
                raise ReplayError(f"{replay.name}: {s.job_id} ran on unknown node {node}")
            edges += [(s.start_s, 1, node, s.job_id), (s.end_s, 0, node, s.job_id)]
    edges.sort()
    holders: Counter[str] = Counter()
    for time_s, starting, node, job_id in edges:
        holders[node] += 1 if starting else -1
        if holders[node] > 1:
            raise ReplayError(f"{replay.name}: node {node} double-booked at t={time_s:g} (by {job_id} and another)")
    if occupancy(replay) > 1.0 + 1e-9:
        raise ReplayError(f"{replay.name}: occupancy {occupancy(replay):.3f} is over one")


def p95(values: Sequence[float]) -> float:
    """Nearest-rank 95th percentile."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def summary(replay: Replay, trace: Sequence[TraceJob]) -> dict[str, Any]:
    """The replay's figures, per priority where they differ by it."""
    per: dict[str, Any] = {}
    arrival_s = {j.job_id: j.arrival_s for j in trace}
    for priority in PRIORITIES:
        ids = [j.job_id for j in trace if j.priority is priority]
        waits = [replay.first_start_s[i] - arrival_s[i] for i in ids]
        queued = [replay.queued_s[i] for i in ids]
        per[priority.name] = {"jobs": len(ids), "wait_mean_s": sum(waits) / len(waits) if waits else 0.0,
                              "wait_p95_s": p95(waits), "queued_mean_s": sum(queued) / len(queued) if queued else 0.0,
                              "queued_p95_s": p95(queued)}
    return {"occupancy": occupancy(replay), "useful_occupancy": useful_occupancy(replay, trace),
            "makespan_s": makespan_s(replay), "suspensions": replay.suspensions,
            "lost_work_node_s": replay.lost_work_node_s, "per_priority": per}


def occupancy_curve(replay: Replay) -> tuple[list[float], list[float]]:
    """(times, busy fraction) as a step function: the value holds from each time to the next."""
    changes: Counter[float] = Counter()
    for s in replay.segments:
        changes[s.start_s] += len(s.nodes)
        changes[s.end_s] -= len(s.nodes)
    times, values, busy = [0.0], [0.0], 0
    for time_s in sorted(changes):
        busy += changes[time_s]
        times.append(time_s)
        values.append(busy / replay.nodes)
    return times, values


def write_png(path: Path, replays: Sequence[Replay], title: str) -> bool:
    """Occupancy over time for each scheduler; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(replays), 1, figsize=(10, 2.6 * len(replays)), sharex=True, squeeze=False)
    for axis, replay in zip(axes[:, 0], replays, strict=True):
        times, values = occupancy_curve(replay)
        axis.step([t / 3600 for t in times], values, where="post", linewidth=0.8)
        axis.set_ylim(0, 1.05)
        axis.set_ylabel("busy nodes / all")
        axis.set_title(f"{replay.name}: occupancy {occupancy(replay):.3f}, makespan {makespan_s(replay) / 3600:.1f} h",
                       fontsize=9)
    axes[-1, 0].set_xlabel("virtual time (h)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def ratios(figures: dict[str, dict[str, Any]]) -> dict[str, float]:
    """rules / FIFO for the headline figures (below one: the rules do better, except occupancy)."""
    rules_f, fifo_f = figures["rules"], figures["fifo"]
    out = {"occupancy": rules_f["occupancy"] / fifo_f["occupancy"],
           "useful_occupancy": rules_f["useful_occupancy"] / fifo_f["useful_occupancy"],
           "makespan": rules_f["makespan_s"] / fifo_f["makespan_s"]}
    for priority in PRIORITIES:
        a, b = rules_f["per_priority"][priority.name], fifo_f["per_priority"][priority.name]
        for key in ("wait_mean_s", "wait_p95_s", "queued_p95_s"):
            out[f"{priority.name}_{key.removesuffix('_s')}"] = a[key] / b[key] if b[key] > 0 else math.nan
    return out


def table(figures: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'scheduler':<9} {'occupancy':>9} {'useful':>6} {'makespan h':>10} {'suspends':>8}  " +
             "  ".join(f"{p.name + ' wait mean/p95 h':>24}" for p in PRIORITIES)]
    for name, f in figures.items():
        waits = "  ".join(f"{f['per_priority'][p.name]['wait_mean_s'] / 3600:>11.2f} /"
                          f"{f['per_priority'][p.name]['wait_p95_s'] / 3600:>10.2f}" for p in PRIORITIES)
        lines.append(f"{name:<9} {f['occupancy']:>9.3f} {f['useful_occupancy']:>6.3f} {f['makespan_s'] / 3600:>10.1f} "
                     f"{f['suspensions']:>8}  {waits}")
    return "\n".join(lines)


def run(jobs: int, nodes: int, seed: int, interarrival_s: float) -> tuple[dict[str, Any], list[Replay]]:
    """Both replays of one trace, checked, and their figures."""
    trace = make_trace(jobs, seed, nodes, interarrival_s)
    replays = [replay_rules(trace, nodes), replay_fifo(trace, nodes)]
    for replay in replays:
        check_replay(replay, trace)
    figures = {r.name: summary(r, trace) for r in replays}
    record: dict[str, Any] = {
        "kind": "hai",
        "trace": {"jobs": jobs, "nodes": nodes, "seed": seed, "interarrival_mean_s": interarrival_s,
                  "sizes_nodes": list(SIZES_NODES), "size_weights": list(SIZE_WEIGHTS),
                  "priorities": [p.name for p in PRIORITIES], "priority_weights": list(PRIORITY_WEIGHTS),
                  "work": {"distribution": "lognormal", "median_s": WORK_MEDIAN_S, "sigma": WORK_SIGMA,
                           "min_s": WORK_MIN_S, "max_s": WORK_MAX_S},
                  "users": USERS, "offered_node_s": sum(j.nodes * j.work_s for j in trace)},
        "replay": {"checkpoint_interval_s": CHECKPOINT_INTERVAL_S, "suspend_ack_s": SUSPEND_ACK_S,
                   "resume_s": RESUME_S, "fifo": "strict arrival order, whole nodes, no priorities, no backfill"},
        "schedulers": figures,
        "ratios_rules_over_fifo": ratios(figures),
    }
    return record, replays


REAL_ACK_GRACE_S = 2.0
REAL_FINISH_GRACE_S = 2.0
REAL_HEARTBEAT_S = 0.5
REAL_SAVE_S = 0.3
REAL_DEADLINE_S = 60.0
REAL_POLL_S = 0.02

_RANK = """
import sys, time
import hai.client
mode, save_s = sys.argv[1], float(sys.argv[2])
print("started", flush=True)
while True:
    if mode == "ack" and hai.client.receive_suspend_command():
        time.sleep(save_s)  # the checkpoint
        hai.client.go_suspend()
        sys.exit(0)
    time.sleep(0.02)
"""


def _poll(what: str, probe: Callable[[], Any]) -> Any:
    """``probe()`` until it returns something true, every ``REAL_POLL_S``; bounded by ``REAL_DEADLINE_S``."""
    import time

    deadline = time.monotonic() + REAL_DEADLINE_S
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(REAL_POLL_S)


def real_suspend(work_dir: Path) -> dict[str, Any]:
    """The suspend path on real processes (see the module's docstring): one LOW job whose ranks
    acknowledge and one whose ranks ignore the request, each pushed out by a HIGH job."""
    import os
    import time

    import httpx

    from hai.local import HaiLocal, Settings

    # The server and agents (and so the ranks) run this checkout's hai, as this script does.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    script = work_dir / "rank.py"
    work_dir.mkdir(parents=True, exist_ok=True)
    script.write_text(_RANK)
    local = HaiLocal(work_dir / "platform")
    grace_s = REAL_ACK_GRACE_S + REAL_FINISH_GRACE_S
    env = {"PYTHONPATH": str(ROOT)}
    local.up(Settings(nodes=2, ack_grace_s=REAL_ACK_GRACE_S, finish_grace_s=REAL_FINISH_GRACE_S,
                      heartbeat_s=REAL_HEARTBEAT_S, tick_interval_s=0.2, extra_env=env))
    out: dict[str, Any] = {"ack_grace_s": REAL_ACK_GRACE_S, "finish_grace_s": REAL_FINISH_GRACE_S,
                           "grace_s": grace_s, "heartbeat_s": REAL_HEARTBEAT_S, "save_s": REAL_SAVE_S,
                           "netns": bool(local.state.get("netns")), "nodes": 2}
    http = httpx.Client(base_url=local.server_url, headers={"Authorization": f"Bearer {local.admin_token}"},
                        timeout=10)

    def job(job_id: str) -> dict[str, Any]:
        view: dict[str, Any] = http.get(f"/jobs/{job_id}").raise_for_status().json()
        return view

    def submit(name: str, priority: str, command: str) -> str:
        body = {"name": name, "command": command, "nodes": 2, "priority": priority, "env": env}
        job_id: str = http.post("/jobs", json=body).raise_for_status().json()["job_id"]
        return job_id

    try:
        def one(mode: str) -> dict[str, Any]:
            low = submit(f"low-{mode}", "LOW", f"{sys.executable} {script} {mode} {REAL_SAVE_S}")
            _poll(f"{low} to run", lambda: job(low)["state"] == "running")
            time.sleep(3 * REAL_HEARTBEAT_S)  # both agents have launched their rank
            high = submit(f"high-{mode}", "HIGH", f"{sys.executable} -c pass")
            requested_s = _poll(f"{low} to be suspending",
                                lambda: time.time() if job(low)["state"] == "suspending" else None)
            ended = _poll(f"{low}'s task to end",
                          lambda: next((t for t in job(low)["chain"] if t["task"] == 0 and t["ended_s"]), None))
            _poll(f"{high} to finish", lambda: job(high)["state"] == "finished")
            http.post(f"/jobs/{low}/stop")  # it was queued again, to resume: not needed here
            free_s = float(ended["ended_s"]) - requested_s
            return {"suspend_to_free_s": free_s, "ratio_to_grace": free_s / grace_s, "outcome": ended["outcome"]}

        out["acknowledging"] = one("ack")
        out["ignoring"] = one("ignore")
    finally:
        http.close()
        local.down(quiet=True)
    return out


def markdown(record: dict[str, Any]) -> str:
    """The result as a page: the replay's table and ratios, the real-process suspend figures, the plot."""
    lines = [f"# HAI scheduler bench, {record['when']}", "",
             f"Trace: {record['trace']['jobs']} jobs on {record['trace']['nodes']} nodes, seed "
             f"{record['trace']['seed']} (virtual time; see bench/hai_bench.py).", "",
             "```", table(record["schedulers"]), "```", "", "Rules / FIFO: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                     record["ratios_rules_over_fifo"].items()), ""]
    real = record.get("real_suspend")
    if real:
        lines += ["## Suspend on real processes", "",
                  f"hai local, 2 nodes ({'network namespaces' if real['netns'] else 'plain processes'}), grace "
                  f"{real['ack_grace_s']:g} s to acknowledge + {real['finish_grace_s']:g} s to finish, heartbeat "
                  f"{real['heartbeat_s']:g} s. Time from the suspend request to the nodes being free:", "",
                  "| LOW job | seconds | / grace | outcome |", "|---|---|---|---|"]
        for label in ("acknowledging", "ignoring"):
            r = real[label]
            lines.append(f"| {label} | {r['suspend_to_free_s']:.2f} | {r['ratio_to_grace']:.2f} | {r['outcome']} |")
        lines.append("")
    if record.get("png"):
        lines += ["## Occupancy over time", "", f"![occupancy]({record['png']})", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=300, help=f"trace size, 1 to {MAX_JOBS} (default 300)")
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--interarrival-s", type=float, default=720.0, help="mean of the Poisson arrivals")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go (default bench/results)")
    parser.add_argument("--no-real", action="store_true", help="skip the suspend timing on real processes")
    args = parser.parse_args(argv)
    if not 1 <= args.jobs <= MAX_JOBS:
        parser.error(f"--jobs must be between 1 and {MAX_JOBS}")
    record, replays = run(args.jobs, args.nodes, args.seed, args.interarrival_s)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"hai-{stamp}.png"
    title = f"{args.jobs} jobs on {args.nodes} nodes, seed {args.seed}: the HAI rules and strict FIFO"
    record = {"when": stamp, **record, "png": png.name if write_png(png, replays, title) else None}
    if not args.no_real:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="hai-bench-") as work:
            record["real_suspend"] = real_suspend(Path(work))
    path = args.out / f"hai-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    (args.out / f"hai-{stamp}.md").write_text(markdown(record))
    print(table(record["schedulers"]))
    print("rules / FIFO: " + ", ".join(f"{k} {v:.3f}" for k, v in record["ratios_rules_over_fifo"].items()))
    real = record.get("real_suspend")
    if real:
        for label in ("acknowledging", "ignoring"):
            r = real[label]
            print(f"suspend on real processes, {label} job: nodes free {r['suspend_to_free_s']:.2f} s after the "
                  f"request = {r['ratio_to_grace']:.2f} x the {real['grace_s']:g} s grace ({r['outcome']})")
    print(f"wrote {path}, its .md" + (f" and {png}" if record["png"] else " (no matplotlib: no PNG)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


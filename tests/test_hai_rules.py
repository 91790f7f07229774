"""The HAI scheduler's rules (``hai/rules.py``): text scenarios, a seeded exerciser against
invariants, the invariant checker fed known-bad states, and the core's purity.

Scenarios (``tests/hai_scenarios/*.txt``) are scripts, one event per line; ``schedule`` and the
listing commands are followed by their result on lines starting with ``=>``::

    node n1 zone=a                  # a healthy node (group=G for another group than "default")
    quota alice default * 8         # alice may hold 8 nodes of group default at every priority
    submit J1 alice nodes=2 prio=LOW   # prio=AUTO, group=G
    at 100                          # virtual time is now 100 s
    schedule                        # heartbeats, timeouts, one pass, applied
    => place J1 n1,n2 LOW
    finish J1 / fail J1 [node=n1] / ack J1 / suspend J1 / lose n1 / heal n1
    finish J1 node=n1 / ack J1 node=n1   # one node reported its ranks' end (the task ends once all have)
    validating n1                   # n1's validator started
    validated n1 pass / validated n1 fail gemm: too slow   # ... and ended (a failure says why)
    silence n1 / hang J1            # the node stops heartbeating / the job stops reporting progress
    wake n1                         # the node heartbeats again
    config demote_after_s=60        # any Config field
    jobs / nodes                    # list every job / node

Run with ``FS3_REWRITE=1`` to regenerate every "=>" line from the code, then review the diff.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hai import rules
from hai.rules import (
    AUTO,
    ClusterState,
    Config,
    Decision,
    Job,
    JobSpec,
    JobState,
    Node,
    Placement,
    Priority,
    Quota,
    Suspension,
)
from tests.hai_events import USERS, Run, random_cluster, random_event
from tests.scenario_files import check_scenario_file

SCENARIOS = sorted((Path(__file__).parent / "hai_scenarios").glob("*.txt"))

# -- scenarios ------------------------------------------------------------------------------------


@dataclass
class _Script:
    state: ClusterState = field(default_factory=ClusterState)
    config: Config = field(default_factory=Config)
    now_s: float = 0.0
    silent: set[str] = field(default_factory=set)
    hung: set[str] = field(default_factory=set)


def _options(words: Iterable[str]) -> dict[str, str]:
    return dict(w.split("=", 1) for w in words)


def _priority(word: str) -> Priority | rules.Auto:
    return AUTO if word == "AUTO" else Priority[word]


def _decision_lines(decision: Decision) -> list[str]:
    out = [f"=> demote {j}" for j in decision.demotions]
    out += [f"=> suspend {s.job_id} for {s.for_job}" for s in decision.suspensions]
    out += [f"=> place {p.job_id} {','.join(p.nodes)} {p.priority.name}" + (" cross-zone" if p.cross_zone else "")
            for p in decision.placements]
    out += [f"=> wait {j} {w.priority.name}: {w.text}" for j, w in decision.waits.items()]
    return out or ["=> nothing"]


def _job_line(job: Job, now_s: float) -> str:
    words = [job.job_id, job.state.value]
    if job.state in (JobState.RUNNING, JobState.SUSPENDING) and job.priority is not None:
        words += [job.priority.name, "on", ",".join(job.assigned)]
    if job.ended:
        words.append("ended=" + ",".join(f"{n}:{o}" for n, o in job.ended))
    if job.task:
        words.append(f"task={job.task}")
    if job.restarts:
        words.append(f"restarts={job.restarts}")
    if job.state is JobState.QUEUED and job.not_before_s > now_s:
        words.append(f"until=t{job.not_before_s:g}")
    if job.end_reason:
        words.append(f"({job.end_reason})")
    return "=> " + " ".join(words)


def _schedule(script: _Script) -> Decision:
    """What the server's loop does each round: take heartbeats, expire, decide, carry out."""
    state = script.state
    for name in sorted(state.nodes):
        if name not in script.silent:
            state = rules.node_heartbeat(state, name, script.now_s)
    for job in sorted(state.jobs.values(), key=lambda j: j.seq):
        if job.state is JobState.RUNNING and job.job_id not in script.hung:
            state = rules.job_progress(state, job.job_id, script.now_s)
    state = rules.check_timeouts(state, script.now_s, script.config)
    decision = rules.schedule(state, script.now_s, script.config)
    script.state = rules.apply(state, decision)
    return decision


def run_script(text: str) -> str:
    """Execute a scenario; returns the script with every '=>' line recomputed."""
    script = _Script()
    out: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("=>"):
            continue  # expectations are regenerated below
        out.append(raw)
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        command, args = words[0], words[1:]
        s, now = script.state, script.now_s
        if command == "node":
            opts = _options(args[1:])
            script.state = rules.add_node(s, Node(args[0], opts["zone"], opts.get("group", "default"),
                                                  last_heartbeat_s=now))
        elif command == "quota":
            user, group, level, count = args
            levels = list(Priority) if level == "*" else [Priority[level]]
            for priority in levels:
                script.state = rules.set_quota(script.state, Quota(user, group, priority, int(count)))
        elif command == "config":
            values = {k: type(getattr(script.config, k))(v) for k, v in _options(args).items()}
            script.config = dataclasses.replace(script.config, **values)
        elif command == "submit":
            opts = _options(args[2:])
            spec = JobSpec(args[0], args[1], int(opts["nodes"]), _priority(opts["prio"]), opts.get("group", "default"))
            script.state = rules.submit(s, spec, now)
        elif command == "at":
            script.now_s = float(args[0])
        elif command == "schedule":
            out += _decision_lines(_schedule(script))
        elif command == "finish":
            script.state = rules.finish(s, args[0], now, node=_options(args[1:]).get("node"))
        elif command == "fail":
            bad = _options(args[1:]).get("node")
            script.state = rules.fail_job(s, args[0], now, script.config, "rank exited 1", bad)
        elif command == "ack":
            script.state = rules.suspend_acknowledged(s, args[0], now, node=_options(args[1:]).get("node"))
        elif command == "suspend":
            script.state = rules.request_suspend(s, args[0])
        elif command == "lose":
            script.state = rules.node_lost(s, args[0], now, script.config, "lost")
        elif command == "heal":
            script.silent.discard(args[0])
            script.state = rules.node_healthy(s, args[0], now)
        elif command == "validating":
            script.state = rules.validation_started(s, args[0], now)
        elif command == "validated":
            script.silent.discard(args[0])  # its agent speaks again
            passed = {"pass": True, "fail": False}[args[1]]
            script.state = rules.validation_result(s, args[0], passed, [" ".join(args[2:])], now, script.config)
        elif command == "silence":
            script.silent.add(args[0])
        elif command == "wake":
            script.silent.discard(args[0])
        elif command == "hang":
            script.hung.add(args[0])
        elif command == "jobs":
            out += [_job_line(j, now) for j in sorted(s.jobs.values(), key=lambda j: j.seq)]
        elif command == "nodes":
            out += [f"=> {n.name} zone={n.zone} {rules.node_health(n)}"
                    + (f" ({n.unhealthy_reason})" if n.unhealthy_reason else "")
                    for n in sorted(s.nodes.values(), key=lambda n: n.name)]
        else:
            raise ValueError(f"line {number}: unknown command {command!r}")
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_scenario(path: Path) -> None:
    check_scenario_file(path, run_script)


def test_there_are_scenarios() -> None:
    assert len(SCENARIOS) >= 10


# -- the invariant checker ------------------------------------------------------------------------
# Written from the rules, not from the scheduler's code: it counts nodes per zone itself.

_HOLDING = (JobState.RUNNING, JobState.SUSPENDING)


def _zones(state: ClusterState, names: Iterable[str]) -> set[str]:
    return {state.nodes[n].zone for n in names}


def _could_fit(state: ClusterState, names: Iterable[str], need: int, cross_zone_free: bool) -> bool:
    per_zone = Counter(state.nodes[n].zone for n in names)
    return any(c >= need for c in per_zone.values()) or (cross_zone_free and sum(per_zone.values()) >= need)


def _waiting_priority(state: ClusterState, config: Config, job: Job) -> Priority:
    if job.demoted:
        return Priority.NORMAL
    if job.requested is AUTO:
        return rules.resolve_auto(state, config, job)[0]
    return job.requested


def state_violations(state: ClusterState, config: Config, submitted: Iterable[str] = ()) -> list[str]:
    """Every way ``state`` breaks the rules' invariants."""
    found: list[str] = []
    missing = set(submitted) - set(state.jobs)
    if missing:
        found.append(f"jobs lost: {sorted(missing)}")
    owner: dict[str, str] = {}
    used: Counter[tuple[str, str, Priority]] = Counter()
    crossing: list[str] = []
    for job in state.jobs.values():
        if job.state in _HOLDING:
            if len(job.assigned) != job.nodes or len(set(job.assigned)) != job.nodes:
                found.append(f"{job.job_id} holds {job.assigned}, needs {job.nodes} nodes")
            if job.charged is None:
                found.append(f"{job.job_id} holds nodes without a charged priority")
            else:
                used[(job.user, job.group, job.charged)] += job.nodes
            for name in job.assigned:
                if name in owner:
                    found.append(f"node {name} double-booked: {owner[name]} and {job.job_id}")
                owner[name] = job.job_id
                node = state.nodes.get(name)
                if node is None or not node.healthy:
                    found.append(f"{job.job_id} runs on unhealthy or unknown node {name}")
                elif node.group != job.group:
                    found.append(f"{job.job_id} of group {job.group} runs on {name} of group {node.group}")
            if len(_zones(state, (n for n in job.assigned if n in state.nodes))) > 1:
                crossing.append(job.job_id)
            reported = [name for name, _ in job.ended]
            if not set(reported) <= set(job.assigned) or len(set(reported)) != len(reported) \
                    or len(reported) >= len(job.assigned):
                found.append(f"{job.job_id} holds {job.assigned} with end reports {job.ended}: "
                             "a task whose every node reported must have ended")
        elif job.assigned or job.ended:
            found.append(f"{job.job_id} is {job.state.value} but holds {job.assigned} ({job.ended})")
        if job.restarts > config.max_restarts:
            found.append(f"{job.job_id} restarted {job.restarts} times, max {config.max_restarts}")
    for node in state.nodes.values():
        if node.healthy and (node.validation is not rules.Validation.NONE or node.unhealthy_reason):
            found.append(f"node {node.name} is healthy with validation {node.validation.value} "
                         f"and reason {node.unhealthy_reason!r}")
        if node.validation is rules.Validation.NEEDED and node.validation_failures >= config.max_validation_failures:
            found.append(f"node {node.name} failed {node.validation_failures} validations and still gets more")
    for (user, group, priority), count in used.items():
        limit = rules.quota_limit(state, config, user, group, priority)
        if count > limit:
            found.append(f"quota exceeded: {user}/{group}/{priority.name} holds {count} of {limit}")
    if len(crossing) > 1:
        found.append(f"more than one job crosses zones: {sorted(crossing)}")
    return found


def decision_violations(before: ClusterState, decision: Decision, config: Config) -> list[str]:
    """Every way ``decision`` (taken on ``before``) breaks the rules; the state it leads to is
    checked by :func:`state_violations`."""
    found: list[str] = []
    now = decision.now_s
    after = rules.apply(before, decision)
    placed = {p.job_id: p for p in decision.placements}
    held_before = {n for j in before.jobs.values() if j.state in _HOLDING for n in j.assigned}
    for p in decision.placements:
        job = before.jobs[p.job_id]
        if job.state is not JobState.QUEUED or job.not_before_s > now:
            found.append(f"{p.job_id} placed while {job.state.value}, not before t={job.not_before_s:g}")
        for name in p.nodes:
            if name in held_before:
                found.append(f"{p.job_id} placed on {name}, which another job holds")
            if not before.nodes[name].healthy:
                found.append(f"{p.job_id} placed on unhealthy node {name}")
    prio_after = {j.job_id: j.priority for j in after.jobs.values() if j.state in _HOLDING}
    for s in decision.suspensions:
        victim, waiter = before.jobs[s.job_id], before.jobs[s.for_job]
        wp = _waiting_priority(before, config, waiter)
        if waiter.requested is AUTO and s.for_job in decision.waits:
            wp = decision.waits[s.for_job].priority  # the level AUTO took at its turn in the pass
            if rules.quota_limit(before, config, waiter.user, waiter.group, wp) < waiter.nodes:
                found.append(f"{s.for_job} suspends jobs at {wp.name}, where it has no quota")
        vp = prio_after[victim.job_id]
        assert vp is not None
        if victim.state is not JobState.RUNNING or waiter.state is not JobState.QUEUED or s.for_job in placed:
            found.append(f"suspension of {s.job_id} for {s.for_job}: wrong states or the waiter was placed")
        if rules.rank_key(vp, victim.seq) <= rules.rank_key(wp, waiter.seq):
            found.append(f"{s.job_id} ({vp.name}) suspended for {s.for_job} ({wp.name}), which ranks behind it")
        if victim.user == waiter.user and vp is wp:
            found.append(f"{s.job_id} suspended for a job of the same user at the same priority")
    for job_id, names in decision.reserved.items():
        free_or_leaving = {n for j in after.jobs.values() if j.state is JobState.SUSPENDING for n in j.assigned}
        free_or_leaving |= {n.name for n in after.nodes.values()
                            if n.healthy and n.name not in {m for j in after.jobs.values() for m in j.assigned}}
        if not set(names) <= free_or_leaving:
            found.append(f"{job_id} reserved {names}, not all free or being freed")
    # Priority respected: a waiting job ahead of a placed one must not have fit into what was left.
    reserved = {n for names in decision.reserved.values() for n in names}
    used: Counter[tuple[str, str, Priority]] = Counter()
    for job in after.jobs.values():
        if job.state in _HOLDING and job.charged is not None:
            used[(job.user, job.group, job.charged)] += job.nodes
    for job_id in decision.reserved:
        job = before.jobs[job_id]
        used[(job.user, job.group, _waiting_priority(before, config, job))] += job.nodes
    held_after = {n for j in after.jobs.values() if j.state in _HOLDING for n in j.assigned}
    crossing_after = [j.job_id for j in after.jobs.values()
                      if j.state in _HOLDING and len(_zones(after, j.assigned)) > 1]
    crossing_after += [j for j, names in decision.reserved.items() if len(_zones(after, names)) > 1]
    for waiter in before.jobs.values():
        if waiter.state is not JobState.QUEUED or waiter.job_id in placed or waiter.job_id in decision.reserved:
            continue
        if waiter.job_id not in decision.waits:
            found.append(f"{waiter.job_id} waits without a reason")
        if waiter.not_before_s > now:
            continue
        levels = [_waiting_priority(before, config, waiter)]
        if waiter.requested is AUTO and not waiter.demoted:
            levels = sorted(Priority, reverse=True)
        roomy = [p for p in levels if used[(waiter.user, waiter.group, p)] + waiter.nodes
                 <= rules.quota_limit(before, config, waiter.user, waiter.group, p)]
        if not roomy:
            continue
        wp = roomy[0]
        for p in decision.placements:
            x = before.jobs[p.job_id]
            if rules.rank_key(p.priority, x.seq) <= rules.rank_key(wp, waiter.seq) or x.group != waiter.group:
                continue
            pool = {n.name for n in after.nodes.values() if n.healthy and n.group == waiter.group
                    and n.name not in held_after and n.name not in reserved} | set(p.nodes)
            cross_free = not [j for j in crossing_after if j != x.job_id]
            if _could_fit(after, pool, waiter.nodes, cross_free):
                found.append(f"priority inversion: {x.job_id} ({p.priority.name}) placed while "
                             f"{waiter.job_id} ({wp.name}) ahead of it fits")
    return found


# -- the seeded exerciser -------------------------------------------------------------------------

CheckFn = Callable[[ClusterState, Decision, Config], list[str]]


def exercise(seed: int, events: int, schedule: Callable[[ClusterState, float, Config], Decision] = rules.schedule
             ) -> tuple[Run, list[str]]:
    """Random events, a scheduling pass after each, every invariant checked after every pass.
    Returns the run and the first violations found (empty when none). Timeouts are the scenarios'
    business: here a silent node is a ``node_lost`` event, so no heartbeats are needed."""
    rng = random.Random(seed)
    state, config = random_cluster(rng)
    run = Run(seed, state, config)
    trail: list[str] = []
    for _ in range(events):
        trail.append(random_event(rng, run))
        decision = schedule(run.state, run.now_s, run.config)
        found = decision_violations(run.state, decision, run.config)
        run.state = rules.apply(run.state, decision)
        found += state_violations(run.state, run.config, run.submitted)
        found += _ranks_violations(run, decision)
        live = sum(1 for j in run.state.jobs.values() if j.state in
                   (JobState.QUEUED, JobState.RUNNING, JobState.SUSPENDING, JobState.FINISHED, JobState.FAILED))
        if live != len(run.submitted) or len(run.state.jobs) != len(run.submitted):
            found.append(f"{len(run.submitted)} submitted, {live} in some state")
        run.suspensions += len(decision.suspensions)
        run.placements += len(decision.placements)
        run.partial_ends += any(j.ended for j in run.state.jobs.values() if j.state in _HOLDING)
        if found:
            return run, [f"seed {seed} after {trail[-8:]}", *found]
    return run, []


def _ranks_violations(run: Run, decision: Decision) -> list[str]:
    """The rules against the exerciser's model of the nodes (:attr:`Run.alive`): no job is placed
    on a node whose old ranks have not reported their end, and a job holding nodes has ranks
    running on each node that has not reported. Records the new placements in the model."""
    found: list[str] = []
    for p in decision.placements:
        for name in p.nodes:
            if name in run.alive:
                old_job, old_task = run.alive[name]
                found.append(f"{p.job_id} placed on {name}, where the ranks of {old_job} task {old_task} "
                             "have not reported their end")
            run.alive[name] = (p.job_id, run.state.jobs[p.job_id].task)
    for job in run.state.jobs.values():
        if job.state in _HOLDING:
            reported = {name for name, _ in job.ended}
            for name in job.assigned:
                if name not in reported and run.alive.get(name) != (job.job_id, job.task):
                    found.append(f"{job.job_id} holds {name} but its ranks there are not running")
    return found


EXERCISER_SEEDS = int(os.environ.get("HAI_RULES_SEEDS", "200"))


def test_seeded_exerciser_keeps_every_invariant() -> None:
    started = time.monotonic()
    suspensions = placements = partial_ends = 0
    for seed in range(1, EXERCISER_SEEDS + 1):
        run, found = exercise(seed, 100)
        assert not found, "\n".join(found)
        suspensions += run.suspensions
        placements += run.placements
        partial_ends += run.partial_ends
    # The runs reach the interesting paths, or they prove little.
    assert placements > 10 * EXERCISER_SEEDS and suspensions > EXERCISER_SEEDS, (placements, suspensions)
    assert partial_ends > EXERCISER_SEEDS, partial_ends
    assert time.monotonic() - started < 30


def test_the_exerciser_catches_a_scheduler_that_ignores_priority() -> None:
    """Sabotage: a pass that places the queue in submit order, whatever the priority."""

    def fifo_only(state: ClusterState, now_s: float, config: Config) -> Decision:
        flat = dataclasses.replace(state, jobs={k: dataclasses.replace(j, requested=Priority.LOW, demoted=False)
                                                if j.state is JobState.QUEUED else j for k, j in state.jobs.items()})
        decision = rules.schedule(flat, now_s, config)
        return dataclasses.replace(decision, suspensions=())

    failures = [found for seed in range(1, 60) if (found := exercise(seed, 100, fifo_only)[1])]
    assert failures and any("priority inversion" in line for found in failures for line in found)



def _sabotage(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """Turn one safeguard of the real pass off (the scheduler's own code otherwise)."""
    if which == "unhealthy nodes":
        init = rules._Pass.__init__

        def everything_free(self: rules._Pass, state: ClusterState, now_s: float, config: Config,
                            demoted: frozenset[str]) -> None:
            init(self, state, now_s, config, demoted)
            held = {n for j in state.jobs.values() if j.state in _HOLDING for n in j.assigned}
            self.free |= set(state.nodes) - held

        def any_health(self: rules._Pass, names: Iterable[str], group: str,
                       incoming_last: Iterable[str] = ()) -> list[Node]:
            late = set(incoming_last)
            return sorted((self.state.nodes[n] for n in set(names) if self.state.nodes[n].group == group),
                          key=lambda n: (n.name in late, n.zone, n.name))

        monkeypatch.setattr(rules._Pass, "__init__", everything_free)
        monkeypatch.setattr(rules._Pass, "nodes_of", any_health)
    elif which == "quotas":
        monkeypatch.setattr(rules._Pass, "quota_short", lambda self, job, priority: False)
    elif which == "zones":
        choose = rules._choose
        monkeypatch.setattr(rules, "_choose", lambda nodes, need, ok: choose(nodes, need, True))
    elif which == "first report ends the task":
        def first_report_ends(state: ClusterState, job: Job, node: str, outcome: str, now_s: float) -> ClusterState:
            if outcome == "finished":
                done = dataclasses.replace(rules._end_task(job, now_s, outcome), state=JobState.FINISHED)
            else:
                done = dataclasses.replace(rules._end_task(job, now_s, outcome), state=JobState.QUEUED,
                                           task=job.task + 1)
            return rules._replace_job(state, done)

        monkeypatch.setattr(rules, "_node_ended", first_report_ends)
    elif which == "same user":
        preempt = rules._Pass.preempt
        monkeypatch.setattr(rules._Pass, "preempt", lambda self, job, priority:
                            preempt(self, dataclasses.replace(job, user="\0nobody"), priority))


@pytest.mark.parametrize(("which", "caught"), [
    ("unhealthy nodes", "unhealthy node"), ("quotas", "quota exceeded"), ("zones", "crosses zones"),
    ("same user", "same user at the same priority"),
    ("first report ends the task", "have not reported their end"),
])
def test_the_exerciser_catches_each_sabotaged_rule(monkeypatch: pytest.MonkeyPatch, which: str, caught: str) -> None:
    _sabotage(monkeypatch, which)
    for seed in range(1, EXERCISER_SEEDS + 1):
        found = exercise(seed, 100)[1]
        if found:
            assert any(caught in line for line in found), found
            return
    pytest.fail(f"{EXERCISER_SEEDS} seeds never broke a rule with {which} sabotaged")

# -- known-bad input: the checker must reject each ------------------------------------------------


def _cluster(*zones: str) -> ClusterState:
    state = ClusterState()
    for i, zone in enumerate(zones):
        state = rules.add_node(state, Node(f"n{i}", zone))
    for user in USERS:
        for priority in Priority:
            state = rules.set_quota(state, Quota(user, "default", priority, 8))
    return state


def _running(state: ClusterState, job_id: str, user: str, priority: Priority, nodes: tuple[str, ...]) -> ClusterState:
    state = rules.submit(state, JobSpec(job_id, user, len(nodes), priority), 0.0)
    return rules.apply(state, Decision(0.0, placements=(Placement(job_id, nodes, priority, False),)))


def _with_job(state: ClusterState, job_id: str, **changes: object) -> ClusterState:
    job = dataclasses.replace(state.jobs[job_id], **changes)  # type: ignore[arg-type]
    return dataclasses.replace(state, jobs={**state.jobs, job_id: job})


def test_checker_accepts_a_good_state() -> None:
    state = _running(_cluster("a", "a", "b"), "J1", "alice", Priority.LOW, ("n0", "n1"))
    assert state_violations(state, Config(), ["J1"]) == []


def test_checker_rejects_double_booking() -> None:
    state = _running(_cluster("a", "a", "a"), "J1", "alice", Priority.LOW, ("n0", "n1"))
    state = _running(state, "J2", "bob", Priority.LOW, ("n1", "n2"))
    assert any("double-booked" in v for v in state_violations(state, Config(), ["J1", "J2"]))
    decision = Decision(0.0, placements=(Placement("J3", ("n0",), Priority.LOW, False),))
    state = rules.submit(_running(_cluster("a", "a"), "J1", "alice", Priority.LOW, ("n0",)),
                         JobSpec("J3", "bob", 1, Priority.LOW), 0.0)
    assert any("another job holds" in v for v in decision_violations(state, decision, Config()))


def test_checker_rejects_a_task_every_node_of_which_reported_its_end() -> None:
    state = _running(_cluster("a", "a"), "J1", "alice", Priority.NORMAL, ("n0", "n1"))
    half = _with_job(state, "J1", ended=(("n0", "finished"),))
    assert state_violations(half, Config()) == []
    done = _with_job(state, "J1", ended=(("n0", "finished"), ("n1", "finished")))
    assert any("must have ended" in v for v in state_violations(done, Config()))


def test_checker_rejects_exceeded_quota() -> None:
    state = rules.set_quota(_cluster("a", "a", "a"), Quota("alice", "default", Priority.HIGH, 2))
    state = _running(state, "J1", "alice", Priority.HIGH, ("n0", "n1", "n2"))
    assert any("quota exceeded" in v for v in state_violations(state, Config(), ["J1"]))


def test_checker_rejects_a_lost_job() -> None:
    state = _running(_cluster("a", "a"), "J1", "alice", Priority.LOW, ("n0",))
    assert any("jobs lost" in v for v in state_violations(state, Config(), ["J1", "J2"]))
    dropped = dataclasses.replace(state, jobs={})
    assert any("jobs lost" in v for v in state_violations(dropped, Config(), ["J1"]))
    # A job "running" on no nodes is as lost as a missing one.
    ghost = _with_job(state, "J1", assigned=())
    assert any("needs 1 nodes" in v for v in state_violations(ghost, Config(), ["J1"]))


def test_checker_rejects_priority_inversion() -> None:
    state = rules.submit(_cluster("a", "a"), JobSpec("J1", "alice", 2, Priority.HIGH), 0.0)
    state = rules.submit(state, JobSpec("J2", "bob", 1, Priority.LOW), 0.0)
    bad = Decision(0.0, placements=(Placement("J2", ("n0",), Priority.LOW, False),),
                   waits={"J1": rules.Wait(rules.WaitKind.NODES, Priority.HIGH, "made up")})
    assert any("priority inversion" in v for v in decision_violations(state, bad, Config()))
    assert decision_violations(state, rules.schedule(state, 0.0, Config()), Config()) == []


def test_checker_rejects_an_unhealthy_node_in_use() -> None:
    state = _running(_cluster("a", "a"), "J1", "alice", Priority.LOW, ("n0",))
    lame = dataclasses.replace(state.nodes["n0"], healthy=False)
    sick = dataclasses.replace(state, nodes={**state.nodes, "n0": lame})
    assert any("unhealthy" in v for v in state_violations(sick, Config(), ["J1"]))
    queued = rules.submit(rules.node_lost(_cluster("a", "a"), "n1", 0.0, Config(), "lost"),
                          JobSpec("J2", "bob", 1, Priority.LOW), 0.0)
    bad = Decision(0.0, placements=(Placement("J2", ("n1",), Priority.LOW, False),))
    assert any("unhealthy node n1" in v for v in decision_violations(queued, bad, Config()))


def test_checker_rejects_two_cross_zone_jobs() -> None:
    state = _running(_cluster("a", "b", "a", "b"), "J1", "alice", Priority.LOW, ("n0", "n1"))
    assert state_violations(state, Config(), ["J1"]) == []
    state = _running(state, "J2", "bob", Priority.LOW, ("n2", "n3"))
    assert any("crosses zones" in v for v in state_violations(state, Config(), ["J1", "J2"]))


def test_checker_rejects_suspending_for_a_lower_or_same_user_job() -> None:
    state = _running(_cluster("a", "a"), "J1", "alice", Priority.HIGH, ("n0", "n1"))
    state = rules.submit(state, JobSpec("J2", "alice", 2, Priority.HIGH), 0.0)
    state = rules.submit(state, JobSpec("J3", "bob", 2, Priority.LOW), 0.0)
    same_user = Decision(0.0, suspensions=(Suspension("J1", "J2"),))
    lower = Decision(0.0, suspensions=(Suspension("J1", "J3"),))
    assert any("same user" in v for v in decision_violations(state, same_user, Config()))
    assert any("ranks behind it" in v for v in decision_violations(state, lower, Config()))


def test_checker_rejects_a_silent_wait_and_too_many_restarts() -> None:
    state = rules.submit(_cluster("a"), JobSpec("J1", "alice", 4, Priority.LOW), 0.0)
    assert any("without a reason" in v for v in decision_violations(state, Decision(0.0), Config()))
    tired = _with_job(state, "J1", restarts=5)
    assert any("restarted 5 times" in v for v in state_violations(tired, Config(max_restarts=3), ["J1"]))


# -- rules that a table says best -----------------------------------------------------------------


def test_backoff_doubles_and_is_capped() -> None:
    config = Config(backoff_base_s=10.0, backoff_max_s=50.0)
    assert [rules.backoff_s(config, n) for n in range(1, 6)] == [10.0, 20.0, 40.0, 50.0, 50.0]
    assert rules.backoff_s(config, 10_000) == 50.0


def test_auto_resolves_to_the_highest_level_with_room() -> None:
    state = ClusterState(quotas={("alice", "default", Priority.HIGH): 2, ("alice", "default", Priority.NORMAL): 8})
    job = Job("J1", "alice", "default", 4, AUTO, 1)
    assert rules.resolve_auto(state, Config(), job) == (Priority.NORMAL, True)
    small = dataclasses.replace(job, nodes=2)
    assert rules.resolve_auto(state, Config(), small) == (Priority.HIGH, True)
    huge = dataclasses.replace(job, nodes=9)
    assert rules.resolve_auto(state, Config(), huge) == (Priority.LOW, False)


def test_events_refuse_what_the_state_cannot_take() -> None:
    state = rules.submit(_cluster("a"), JobSpec("J1", "alice", 1, Priority.LOW), 0.0)
    with pytest.raises(rules.RuleError):
        rules.submit(state, JobSpec("J1", "alice", 1, Priority.LOW), 0.0)
    with pytest.raises(rules.RuleError):
        rules.submit(state, JobSpec("J2", "alice", 0, Priority.LOW), 0.0)
    with pytest.raises(rules.RuleError):
        rules.finish(state, "J1", 0.0)
    with pytest.raises(rules.RuleError):
        rules.suspend_acknowledged(state, "J1", 0.0)
    with pytest.raises(rules.RuleError):
        rules.node_lost(state, "n9", 0.0, Config(), "lost")


def test_a_decision_is_deterministic() -> None:
    run, found = exercise(7, 60)
    assert not found
    state = rules.submit(run.state, JobSpec("X", "alice", 2, AUTO), run.now_s)
    assert rules.schedule(state, run.now_s, run.config) == rules.schedule(state, run.now_s, run.config)


# -- purity ---------------------------------------------------------------------------------------

_IMPURE = {"socket", "asyncio", "time", "random", "secrets", "threading", "subprocess", "os", "sys", "io",
           "multiprocessing", "concurrent", "select", "signal", "datetime", "pathlib", "shutil", "logging",
           "sqlite3", "sqlalchemy", "http", "urllib", "grpc", "uvloop", "fs3", "tempfile"}


def _imported_roots(source: str) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None and not node.level:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            roots.add("__import__")
    return roots


def test_the_rules_are_pure() -> None:
    for module in ("rules.py", "__init__.py"):
        source = (Path(__file__).resolve().parents[1] / "hai" / module).read_text()
        impure = _imported_roots(source) & (_IMPURE | {"__import__"})
        assert not impure, f"hai/{module} imports {sorted(impure)}"


def test_the_purity_check_catches_an_import() -> None:
    planted = "import os.path\nfrom time import monotonic\ndef f():\n    import socket\n    __import__('random')\n"
    assert {"os", "time", "socket", "__import__"} <= _imported_roots(planted)



# -- node health ----------------------------------------------------------------------------------


def test_validation_is_refused_on_a_busy_or_admin_held_node() -> None:
    state = _running(_cluster("a", "a"), "J1", "alice", Priority.LOW, ("n0",))
    with pytest.raises(rules.RuleError, match="runs job J1"):
        rules.validation_started(state, "n0", 1.0)
    with pytest.raises(rules.RuleError, match="runs job J1"):
        rules.validation_result(state, "n0", True, (), 1.0, Config())
    config = Config(max_validation_failures=1)
    held = rules.validation_result(state, "n1", False, ("gpu0: missing",), 1.0, config)
    assert rules.node_health(held.nodes["n1"]) == "unhealthy"
    assert "gpu0: missing" in held.nodes["n1"].unhealthy_reason
    with pytest.raises(rules.RuleError, match="until an admin heals it"):
        rules.validation_started(held, "n1", 2.0)
    with pytest.raises(rules.RuleError, match="until an admin heals it"):
        rules.validation_result(held, "n1", True, (), 2.0, config)
    # A lost node an admin must heal does not become a candidate for validation.
    assert rules.node_lost(held, "n1", 2.5, config, "no heartbeat") == held
    healed = rules.node_healthy(held, "n1", 3.0)
    assert rules.node_health(healed.nodes["n1"]) == "healthy" and healed.nodes["n1"].validation_failures == 0


def test_a_passing_validation_without_a_start_report_heals_a_suspect_node() -> None:
    state = rules.node_lost(_cluster("a"), "n0", 5.0, Config(), "no heartbeat")
    assert rules.node_health(state.nodes["n0"]) == "needs validation"
    assert rules.node_heartbeat(state, "n0", 6.0).nodes["n0"].healthy is False
    back = rules.validation_result(state, "n0", True, (), 7.0, Config())
    assert back.nodes["n0"].healthy and back.nodes["n0"].last_heartbeat_s == 7.0
    # Registering again keeps where the node stands with its validator.
    again = rules.add_node(state, Node("n0", "a", last_heartbeat_s=8.0))
    assert rules.node_health(again.nodes["n0"]) == "needs validation"

"""Random events for the HAI scheduler's rules, shared by the rules' exerciser
(tests/test_hai_rules.py) and the store's (tests/test_hai_store.py).

``rng`` draws the events; ``payload``, when given, draws what the rules carry without reading it
(a node's CPUs, memory and labels; a job's command and environment) from a second generator, so the
events of a seed are the same with or without it.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from hai import rules
from hai.rules import AUTO, ClusterState, Config, JobSpec, JobState, Node, Priority, Quota

USERS = ("alice", "bob", "carol")
LEVELS: tuple[Priority | rules.Auto, ...] = (*Priority, AUTO)


def random_cluster(rng: random.Random, payload: random.Random | None = None) -> tuple[ClusterState, Config]:
    """A cluster shape per seed: 4 to 12 nodes over 1 to 3 zones and 1 or 2 groups, random quotas."""
    config = Config(demote_after_s=rng.choice((300.0, 1800.0)), max_restarts=rng.randint(0, 3),
                    backoff_base_s=rng.choice((10.0, 60.0)), default_quota_nodes=rng.choice((0, 4, 100)))
    state = ClusterState()
    zones = [f"z{i}" for i in range(rng.randint(1, 3))]
    groups = ["default", "gpu"][: rng.randint(1, 2)]
    for i in range(rng.randint(4, 12)):
        node = Node(f"n{i:02d}", rng.choice(zones), rng.choice(groups))
        if payload is not None:
            node = dataclasses.replace(node, cpus=payload.choice((8, 64, 192)), memory_bytes=payload.randrange(2**40),
                                       labels=_pairs(payload, "rack", 3))
        state = rules.add_node(state, node)
    for user in USERS:
        for group in groups:
            for priority in rng.sample(list(Priority), 4):
                state = rules.set_quota(state, Quota(user, group, priority, rng.randint(0, 8)))
    return state, config


@dataclass
class Run:
    seed: int
    state: ClusterState
    config: Config
    now_s: float = 0.0
    submitted: list[str] = field(default_factory=list)
    suspensions: int = 0
    placements: int = 0
    partial_ends: int = 0  # passes with a job holding nodes some of which reported their ranks' end
    # The model of the nodes themselves: node -> the (job, task) whose ranks run there, from its
    # placement until that node reports their end (or its task fails: the server has the agents
    # stop the ranks, and an agent starts nothing before they are gone). The exerciser places
    # nothing on a node listed here; the store's exerciser leaves it empty.
    alive: dict[str, tuple[str, int]] = field(default_factory=dict)

    def ranks_ended(self, job_id: str, task: int, nodes: tuple[str, ...]) -> None:
        for name in nodes:
            if self.alive.get(name) == (job_id, task):
                del self.alive[name]


def _report_node(rng: random.Random, job: rules.Job) -> str | None:
    """A node of ``job`` that has not reported its ranks' end, or None for all of them at once."""
    waiting = [n for n in job.assigned if n not in {name for name, _ in job.ended}]
    return rng.choice(waiting) if waiting and rng.random() < 0.7 else None


def random_event(rng: random.Random, run: Run, payload: random.Random | None = None) -> str:
    """Apply one random event to ``run``; returns what it was, for the failure message."""
    s, now, config = run.state, run.now_s, run.config
    by_state: dict[JobState, list[str]] = {st: [] for st in JobState}
    for job in sorted(s.jobs.values(), key=lambda j: j.seq):
        by_state[job.state].append(job.job_id)
    roll = rng.random()
    if roll < 0.30:
        job_id = f"J{len(run.submitted) + 1}"
        groups = sorted({n.group for n in s.nodes.values()})
        spec = JobSpec(job_id, rng.choice(USERS), rng.choice((1, 1, 2, 2, 3, 4, 6)), rng.choice(LEVELS),
                       rng.choice(groups))
        if payload is not None:
            spec = dataclasses.replace(spec, command=f"python train.py --run {job_id} " + "x" * payload.randrange(40),
                                       env=_pairs(payload, "VAR", 4))
        run.state = rules.submit(s, spec, now)
        run.submitted.append(job_id)
        return f"submit {spec}"
    if roll < 0.45:
        run.now_s += rng.choice((1.0, 30.0, 120.0, 600.0, 1800.0))
        return f"at {run.now_s:g}"
    holding = by_state[JobState.RUNNING] + by_state[JobState.SUSPENDING]
    if roll < 0.58 and holding:
        job = s.jobs[rng.choice(holding)]
        node = _report_node(rng, job)
        run.state = rules.finish(s, job.job_id, now, node=node)
        run.ranks_ended(job.job_id, job.task, job.assigned if node is None else (node,))
        return f"finish {job.job_id} node={node}"
    if roll < 0.70 and by_state[JobState.SUSPENDING]:
        job = s.jobs[rng.choice(by_state[JobState.SUSPENDING])]
        node = _report_node(rng, job)
        run.state = rules.suspend_acknowledged(s, job.job_id, now, node=node)
        run.ranks_ended(job.job_id, job.task, job.assigned if node is None else (node,))
        return f"ack {job.job_id} node={node}"
    if roll < 0.78 and holding:
        job = s.jobs[rng.choice(holding)]
        bad = rng.choice((None, job.assigned[0]))
        run.state = rules.fail_job(s, job.job_id, now, config, "rank exited 1", bad)
        run.ranks_ended(job.job_id, job.task, job.assigned)
        return f"fail {job.job_id} node={bad}"
    if roll < 0.84 and by_state[JobState.RUNNING]:
        job_id = rng.choice(by_state[JobState.RUNNING])
        run.state = rules.request_suspend(s, job_id)
        return f"suspend {job_id}"
    healthy = sorted(n.name for n in s.nodes.values() if n.healthy)
    sick = sorted(n.name for n in s.nodes.values() if not n.healthy)
    if roll < 0.92 and healthy:
        name = rng.choice(healthy)
        run.state = rules.node_lost(s, name, now, config, "lost")
        for job in s.jobs.values():
            if job.state in (JobState.RUNNING, JobState.SUSPENDING) and name in job.assigned:
                run.ranks_ended(job.job_id, job.task, job.assigned)
        return f"lose {name}"
    if sick:
        name = rng.choice(sick)
        sick_node = s.nodes[name]
        if sick_node.validation is rules.Validation.NONE or rng.random() < 0.3:
            run.state = rules.node_healthy(s, name, now)
            return f"heal {name}"
        if sick_node.validation is rules.Validation.NEEDED and rng.random() < 0.5:
            run.state = rules.validation_started(s, name, now)
            return f"validating {name}"
        passed = rng.random() < 0.6
        run.state = rules.validation_result(s, name, passed, ("gemm: too slow",), now, config)
        return f"validated {name} passed={passed}"
    idle = sorted(set(s.nodes) - {n for j in s.jobs.values() for n in j.assigned})
    if idle and rng.random() < 0.5:
        name = rng.choice(idle)
        if s.nodes[name].healthy:
            run.state = rules.validation_started(s, name, now)
            return f"validating {name} on schedule"
    return "nothing"


def _pairs(payload: random.Random, prefix: str, most: int) -> tuple[tuple[str, str], ...]:
    """Up to ``most`` (name, value) pairs with distinct names, values of any characters."""
    names = payload.sample(range(10), payload.randint(0, most))
    return tuple((f"{prefix}{n}", "".join(payload.choice("ab=é ,\"") for _ in range(payload.randrange(8))))
                 for n in names)

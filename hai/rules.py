"""The HAI Platform's scheduling rules as pure functions: events in, a new state out; one pass, one decision.

The time-sharing scheduler shares whole nodes among training jobs by priority and quota. Everything
it decides is here, and nothing here does I/O: time comes in as ``now_s`` (virtual seconds), there
is no clock, no randomness, no asyncio and no transport, so a scenario script or a seeded exerciser
drives exactly the code the server runs. The server is a shell around it: it stores the
:class:`ClusterState`, calls :func:`schedule`, carries the :class:`Decision` out (launches, suspend
requests) and feeds what happens back through the event functions (:func:`submit`, :func:`finish`,
:func:`suspend_acknowledged`, :func:`fail_job`, :func:`node_lost`, ...), each a pure transition.

The rules (docs/decisions.md says where the issue left a choice open):

* **Priorities** :class:`Priority`, ``LOW`` (0) to ``EXTREME_HIGH`` (50), and :data:`AUTO`: the
  highest priority at which the user still has quota for the job's node count, resolved at every
  pass while the job is queued.
* **Quotas** are node counts per (user, node group, priority); a job holding nodes is charged at
  the priority it was placed at. A missing entry is ``Config.default_quota_nodes``.
* **Order**: queued jobs in rank order, higher priority first, then by submit sequence (FIFO). A
  job keeps its sequence for its whole chain of tasks, so a suspended or restarted job returns to
  its old place. A job that does not fit waits, and later jobs that fit may still start.
* **Preemption is a suspend.** A waiting job that fits no free nodes may suspend running jobs that
  rank behind it (lowest priority first, latest started first), never one of the same user at the
  same priority, and only when suspending them makes it fit; the nodes being freed are reserved
  for it. A suspended job returns to the queue as the next task of its chain when its suspend is
  acknowledged (:func:`suspend_acknowledged`), and resumes on whatever nodes fit then.
* **A task ends when every one of its nodes has reported its end.** Each node's agent reports the
  end of the ranks it runs (``finished``, or ``suspended``), and the report is recorded per node
  (:attr:`Job.ended`); until the last of the job's nodes has reported, the job stays RUNNING (or
  SUSPENDING) and holds *all* its nodes, the ones that reported included. Only then does the task
  end: FINISHED when every node finished, back to the queue when any node suspended (a job can only
  be suspending then: its finished ranks run again from the checkpoint, which is safe and rare).
  Holding the reported nodes too keeps the rules as they were (a job holds ``nodes`` nodes, is
  charged for them, frees them at once), and no new job can land on a node whose old ranks have
  not confirmed their end; the cost is a node left idle while its job's other ranks finish, as a
  Slurm allocation stays whole until its last step ends. A *failure* on any node (or a lost node,
  or the watchdog) ends the task at once, whatever the other nodes reported: a mixed
  finished/failed task is a failure. Its nodes are free at once, while ranks may still run on
  the ones that had not reported: the server tells their agents to stop them, in the same answer
  as any launch of the node's next task, and an agent starts no launch while a stopped task's
  ranks are still ending (``hai.agent``), so those nodes are not double-booked in reality either.
* **ABOVE_NORMAL drops to NORMAL** once the chain has run ``Config.demote_after_s`` (30 min).
* **A job keeps its nodes** while they stay healthy: only queued jobs are placed.
* **Zones**: a job goes into one zone when one has room (best fit); at most one job at a time
  holds nodes in more than one zone.
* **Faults** (:func:`fail_job`, :func:`node_lost`, :func:`check_timeouts`): the task stops, the job
  is queued again with exponential back-off, and after ``Config.max_restarts`` restarts it fails.
* **Node health** (:class:`Validation`, :func:`node_health`): a node is *healthy* (takes work),
  *validating* (the validator runs on it), *needs validation* (suspect), or *unhealthy* (out until
  an admin's :func:`node_healthy`). A node whose rank failed, or that went silent, is suspect, not
  condemned: a rank fails as often from the user's script, or from a peer that died mid-collective,
  as from the node. A suspect node gets no work until a validation passes
  (:func:`validation_started`, :func:`validation_result`); a silent one must first heartbeat
  again, since only its agent runs the validator. A failed validation records the validator's
  sentences as the reason, and ``Config.max_validation_failures`` failures in a row leave the node
  unhealthy until an admin heals it, so a broken node does not flap in and out of scheduling. A
  healthy idle node may validate on a schedule; it takes no work while the validator runs.

Loops run over the state's nodes and jobs, or over a job's restarts, so each is bounded by the
state it is given.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "AUTO",
    "Auto",
    "ClusterState",
    "Config",
    "Decision",
    "Job",
    "JobSpec",
    "JobState",
    "Node",
    "Placement",
    "Priority",
    "Quota",
    "RuleError",
    "SchedulerInvariantError",
    "Suspension",
    "TaskRecord",
    "Validation",
    "Wait",
    "WaitKind",
    "add_node",
    "apply",
    "backoff_s",
    "check_timeouts",
    "fail_job",
    "finish",
    "job_progress",
    "node_health",
    "node_healthy",
    "node_heartbeat",
    "node_lost",
    "queued_priority",
    "quota_limit",
    "quota_used",
    "rank_key",
    "request_suspend",
    "resolve_auto",
    "schedule",
    "set_quota",
    "submit",
    "suspend_acknowledged",
    "validation_result",
    "validation_started",
]


class Priority(enum.IntEnum):
    """HAI Platform's priority levels; the gaps leave room between them, as the platform's do."""

    LOW = 0
    BELOW_NORMAL = 5
    UNDER_NORMAL = 8
    NORMAL = 10
    ABOVE_NORMAL = 20
    HIGH = 30
    VERY_HIGH = 40
    EXTREME_HIGH = 50


class Auto(enum.Enum):
    """The requested priority that means "the highest at which I still have quota"."""

    AUTO = "AUTO"


AUTO = Auto.AUTO
_HIGHEST_FIRST = tuple(sorted(Priority, reverse=True))


class RuleError(ValueError):
    """An event that the state cannot take: an unknown job or node, a job in the wrong state."""


class SchedulerInvariantError(RuntimeError):
    """A rule the scheduler itself must keep was broken: a bug, never a user's mistake."""


def _ensure(condition: bool, message: str) -> None:
    """An assertion that stays on under ``python -O``."""
    if not condition:
        raise SchedulerInvariantError(message)


class JobState(enum.Enum):
    """Where a job is. Exactly one at a time, so no job can be in two places or none."""

    QUEUED = "queued"  # waiting for nodes: new, suspended, or restarting after a fault
    RUNNING = "running"  # holds its nodes
    SUSPENDING = "suspending"  # asked to save and exit; still holds its nodes until it acknowledges
    FINISHED = "finished"
    FAILED = "failed"  # restarts exhausted


_HOLDING = (JobState.RUNNING, JobState.SUSPENDING)


@dataclass(frozen=True)
class Config:
    """The scheduler's settings; the defaults are HAI Platform's where it has one."""

    demote_after_s: float = 1800.0  # ABOVE_NORMAL becomes NORMAL after this much running time
    max_restarts: int = 3  # restarts after faults before the job fails
    backoff_base_s: float = 30.0  # first restart waits this long, doubling each time
    backoff_max_s: float = 1800.0
    node_timeout_s: float = 60.0  # a node silent this long is lost
    watchdog_s: float = 1800.0  # a running job silent this long has failed
    default_quota_nodes: int = 0  # quota for (user, group, priority) without an entry
    max_validation_failures: int = 3  # failed validations in a row before only an admin heals the node

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.default_quota_nodes < 0:
            raise ValueError("max_restarts and default_quota_nodes must not be negative")
        if self.max_validation_failures < 1:
            raise ValueError("max_validation_failures must be at least 1")
        times = (self.demote_after_s, self.backoff_base_s, self.backoff_max_s, self.node_timeout_s, self.watchdog_s)
        if any(math.isnan(t) or t < 0 for t in times):
            raise ValueError("times must not be negative or NaN")


class Validation(enum.Enum):
    """Where a node stands with its validator. With ``healthy`` it makes the node's health
    (:func:`node_health`): NONE on an unhealthy node means only an admin puts it back."""

    NONE = "none"  # nothing pending
    NEEDED = "needed"  # suspect: no work until a validation passes
    RUNNING = "running"  # the validator runs now: no work until it has passed


@dataclass(frozen=True)
class Node:
    """A host (or a network namespace in tests) that runs one job at a time. ``healthy`` is what
    the scheduler reads: a node that is not healthy gets no work, whatever the reason."""

    name: str
    zone: str
    group: str = "default"
    healthy: bool = True
    last_heartbeat_s: float = 0.0
    unhealthy_reason: str = ""
    validation: Validation = Validation.NONE  # with healthy, the node's health: see node_health
    validation_failures: int = 0  # failed validations in a row
    cpus: int = 0  # what the agent reported; the rules place whole nodes and do not read these
    memory_bytes: int = 0
    labels: tuple[tuple[str, str], ...] = ()  # (name, value) pairs, in the order the agent gave them


@dataclass(frozen=True)
class Quota:
    """At most ``max_nodes`` nodes held by ``user``'s jobs in ``group`` at ``priority``."""

    user: str
    group: str
    priority: Priority
    max_nodes: int


@dataclass(frozen=True)
class JobSpec:
    """What a user submits: a job id chosen by the server, and what the job needs."""

    job_id: str
    user: str
    nodes: int
    priority: Priority | Auto
    group: str = "default"
    command: str = ""  # the command line each rank runs; the rules carry it and never read it
    env: tuple[tuple[str, str], ...] = ()  # (name, value) pairs added to the ranks' environment


@dataclass(frozen=True)
class TaskRecord:
    """One finished task of a job's chain: where it ran and how it ended."""

    index: int
    nodes: tuple[str, ...]
    started_s: float
    ended_s: float
    outcome: str  # "finished", "suspended", or "failed: <reason>"


@dataclass(frozen=True)
class Job:
    """A job and its chain of tasks. ``priority`` is its current level (demotion lowers it);
    ``charged`` is the level its quota is charged at while it holds nodes."""

    job_id: str
    user: str
    group: str
    nodes: int
    requested: Priority | Auto
    seq: int  # submit order; kept for the whole chain
    state: JobState = JobState.QUEUED
    priority: Priority | None = None  # None: AUTO, not resolved yet
    charged: Priority | None = None
    assigned: tuple[str, ...] = ()
    started_s: float = 0.0  # when the current task started (holding states)
    ran_s: float = 0.0  # running time of the chain's earlier tasks
    task: int = 0  # index of the current (or next) task in the chain
    restarts: int = 0
    not_before_s: float = 0.0  # back-off: not placed before this time
    demoted: bool = False
    last_progress_s: float = 0.0
    end_reason: str = ""
    history: tuple[TaskRecord, ...] = ()
    command: str = ""  # from the spec, for the agents that launch the ranks
    env: tuple[tuple[str, str], ...] = ()
    # (node, "finished" | "suspended"): the current task's nodes that reported the end of their ranks,
    # in report order. The task ends when every assigned node is here (the module docstring).
    ended: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ClusterState:
    """Everything the scheduler knows. Treated as immutable: every event returns a new one."""

    nodes: Mapping[str, Node] = field(default_factory=dict)
    jobs: Mapping[str, Job] = field(default_factory=dict)
    quotas: Mapping[tuple[str, str, Priority], int] = field(default_factory=dict)
    next_seq: int = 1


class WaitKind(enum.Enum):
    """Why a queued job was not placed, for the queue view and the dashboard."""

    BACKOFF = "backoff"
    QUOTA = "quota"
    NODES = "nodes"
    CROSS_ZONE = "cross-zone"
    SUSPENDING = "suspending"


@dataclass(frozen=True)
class Wait:
    """A waiting job's reason: a kind to filter on and a sentence to show."""

    kind: WaitKind
    priority: Priority
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Placement:
    """Start ``job_id``'s next task on ``nodes`` at ``priority``."""

    job_id: str
    nodes: tuple[str, ...]
    priority: Priority
    cross_zone: bool


@dataclass(frozen=True)
class Suspension:
    """Ask ``job_id`` to save and exit, to make room for ``for_job``."""

    job_id: str
    for_job: str


@dataclass(frozen=True)
class Decision:
    """One pass's outcome. ``reserved`` maps a waiting job to the nodes held for it until the jobs
    suspended for it have exited."""

    now_s: float
    placements: tuple[Placement, ...] = ()
    suspensions: tuple[Suspension, ...] = ()
    demotions: tuple[str, ...] = ()
    waits: Mapping[str, Wait] = field(default_factory=dict)
    reserved: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


# -- small helpers --------------------------------------------------------------------------------


def _replace_job(state: ClusterState, job: Job) -> ClusterState:
    return dataclasses.replace(state, jobs={**state.jobs, job.job_id: job})


def _job(state: ClusterState, job_id: str) -> Job:
    job = state.jobs.get(job_id)
    if job is None:
        raise RuleError(f"no job {job_id}")
    return job


def _node(state: ClusterState, name: str) -> Node:
    node = state.nodes.get(name)
    if node is None:
        raise RuleError(f"no node {name}")
    return node


def _time(now_s: float) -> float:
    """A virtual time from outside: a finite number, or the event is refused (NaN would disable
    every comparison that back-off, timeouts and demotion rely on)."""
    if isinstance(now_s, bool) or not isinstance(now_s, (int, float)) or not math.isfinite(now_s):
        raise RuleError(f"time must be a finite number of seconds, not {now_s!r}")
    return float(now_s)


def _current_task(job: Job, task: int | None) -> None:
    """Refuse an event about an earlier task of the chain (a late or replayed report)."""
    if task is not None and task != job.task:
        raise RuleError(f"job {job.job_id} is at task {job.task}; the event is for task {task}")


def rank_key(priority: Priority, seq: int) -> tuple[int, int]:
    """Sort key of the queue: higher priority first, then submit order."""
    return (-int(priority), seq)


def quota_limit(state: ClusterState, config: Config, user: str, group: str, priority: Priority) -> int:
    """Nodes ``user`` may hold in ``group`` at ``priority``."""
    return state.quotas.get((user, group, priority), config.default_quota_nodes)


def quota_used(state: ClusterState, user: str, group: str, priority: Priority) -> int:
    """Nodes ``user``'s jobs hold in ``group`` charged at ``priority`` (running and suspending)."""
    return sum(j.nodes for j in state.jobs.values()
               if j.state in _HOLDING and j.user == user and j.group == group and j.charged is priority)


def resolve_auto(state: ClusterState, config: Config, job: Job,
                 used: Mapping[tuple[str, str, Priority], int] | None = None) -> tuple[Priority, bool]:
    """``(priority, has_room)`` for an AUTO job: the highest level with room for its nodes now.

    With room nowhere it waits at the highest level whose quota could ever hold it (so it starts as
    soon as that level frees up), or LOW when none could."""
    counts = used if used is not None else _usage(state)
    for priority in _HIGHEST_FIRST:
        if counts.get((job.user, job.group, priority), 0) + job.nodes <= \
                quota_limit(state, config, job.user, job.group, priority):
            return priority, True
    for priority in _HIGHEST_FIRST:
        if job.nodes <= quota_limit(state, config, job.user, job.group, priority):
            return priority, False
    return Priority.LOW, False


def queued_priority(state: ClusterState, config: Config, job: Job,
                    used: Mapping[tuple[str, str, Priority], int] | None = None) -> Priority:
    """The level a queued job waits at: NORMAL once demoted, AUTO resolved now, else what it asked."""
    if job.demoted:
        return Priority.NORMAL
    if job.requested is AUTO:
        return resolve_auto(state, config, job, used)[0]
    return job.requested


def backoff_s(config: Config, restarts: int) -> float:
    """Wait before restart number ``restarts`` (1-based): base, 2 x base, 4 x base, ... capped."""
    _ensure(restarts >= 1, "back-off is for restarts only")
    exponent = min(restarts - 1, 32)  # 2**32 x base is past any cap; keeps the number finite
    return float(min(config.backoff_base_s * 2 ** exponent, config.backoff_max_s))


def _usage(state: ClusterState) -> Counter[tuple[str, str, Priority]]:
    used: Counter[tuple[str, str, Priority]] = Counter()
    for job in state.jobs.values():
        if job.state in _HOLDING and job.charged is not None:
            used[(job.user, job.group, job.charged)] += job.nodes
    return used


def _nodes(count: int) -> str:
    return f"{count} node" if count == 1 else f"{count} nodes"


def _crosses_zones(state: ClusterState, names: Iterable[str]) -> bool:
    return len({state.nodes[n].zone for n in names if n in state.nodes}) > 1


# -- events ---------------------------------------------------------------------------------------


def add_node(state: ClusterState, node: Node) -> ClusterState:
    """Register a node (or update its zone and group); it takes work once healthy.

    Registering again never heals a node marked unhealthy (only a passing validation or
    :func:`node_healthy` does), nor changes where it stands with its validator. A
    node that runs a job keeps its zone and group until the job has left it."""
    _time(node.last_heartbeat_s)
    old = state.nodes.get(node.name)
    held = any(node.name in j.assigned for j in state.jobs.values() if j.state in _HOLDING)
    if held and not node.healthy:
        raise RuleError(f"node {node.name} runs a job: use node_lost to take it out")
    if held and old is not None and (old.zone, old.group) != (node.zone, node.group):
        raise RuleError(f"node {node.name} runs a job: its zone and group cannot change under it")
    if old is not None:
        node = dataclasses.replace(node, validation=old.validation, validation_failures=old.validation_failures)
    if old is not None and not old.healthy:
        node = dataclasses.replace(node, healthy=False, unhealthy_reason=old.unhealthy_reason)
    if old is not None:
        node = dataclasses.replace(node, last_heartbeat_s=max(old.last_heartbeat_s, node.last_heartbeat_s))
    return dataclasses.replace(state, nodes={**state.nodes, node.name: node})


def set_quota(state: ClusterState, quota: Quota) -> ClusterState:
    """Set one quota entry. Lowering it never stops running jobs; it only holds back new ones."""
    if isinstance(quota.max_nodes, bool) or not isinstance(quota.max_nodes, int) or quota.max_nodes < 0:
        raise RuleError("a quota is a node count, at least 0")
    if not isinstance(quota.priority, Priority):
        raise RuleError(f"a quota is set per priority level, not {quota.priority!r}")
    key = (quota.user, quota.group, quota.priority)
    return dataclasses.replace(state, quotas={**state.quotas, key: quota.max_nodes})


def submit(state: ClusterState, spec: JobSpec, now_s: float) -> ClusterState:
    """Queue a new job at the end of its priority (FIFO)."""
    if spec.job_id in state.jobs:
        raise RuleError(f"job {spec.job_id} exists")
    if isinstance(spec.nodes, bool) or not isinstance(spec.nodes, int) or spec.nodes < 1:
        raise RuleError("a job needs a whole number of nodes, at least one")
    if not isinstance(spec.priority, (Priority, Auto)):
        raise RuleError(f"unknown priority {spec.priority!r}")
    now_s = _time(now_s)
    job = Job(job_id=spec.job_id, user=spec.user, group=spec.group, nodes=spec.nodes, requested=spec.priority,
              seq=state.next_seq, priority=None if spec.priority is AUTO else spec.priority,
              last_progress_s=now_s, command=spec.command, env=spec.env)
    return dataclasses.replace(state, jobs={**state.jobs, job.job_id: job}, next_seq=state.next_seq + 1)


def _end_task(job: Job, now_s: float, outcome: str) -> Job:
    """The current task stops: its record joins the chain and its running time is kept."""
    _ensure(job.state in _HOLDING, f"job {job.job_id} holds no nodes")
    record = TaskRecord(job.task, job.assigned, job.started_s, now_s, outcome)
    return dataclasses.replace(job, assigned=(), charged=None, ran_s=job.ran_s + max(0.0, now_s - job.started_s),
                               history=(*job.history, record), ended=())


_FINISHED = "finished"
_SUSPENDED = "suspended"


def _node_ended(state: ClusterState, job: Job, node: str, outcome: str, now_s: float) -> ClusterState:
    """Record that ``node``'s ranks of the job's current task ended with ``outcome``; end the task
    once every assigned node has. A node's second report changes nothing (the first one counts)."""
    if node not in job.assigned:
        raise RuleError(f"node {node} is not one of job {job.job_id}'s nodes")
    if any(name == node for name, _ in job.ended):
        return state
    ended = (*job.ended, (node, outcome))
    if len(ended) < len(job.assigned):
        return _replace_job(state, dataclasses.replace(job, ended=ended))
    if all(o == _FINISHED for _, o in ended):
        return _replace_job(state, dataclasses.replace(_end_task(job, now_s, _FINISHED), state=JobState.FINISHED))
    _ensure(job.state is JobState.SUSPENDING, f"job {job.job_id} suspended without being asked")
    queued = dataclasses.replace(_end_task(job, now_s, _SUSPENDED), state=JobState.QUEUED, task=job.task + 1)
    return _replace_job(state, queued)


def finish(state: ClusterState, job_id: str, now_s: float, task: int | None = None,
           node: str | None = None) -> ClusterState:
    """The job's ranks exited successfully. With ``node``, that node's ranks did: the task ends
    (FINISHED, nodes free) once every node of the job has reported its end, and a node's repeated
    report changes nothing. Without ``node``, every node's ranks did: the job ends at once.
    ``task``, when given, is the task the report is about; a report about an earlier task is refused."""
    job = _job(state, job_id)
    now_s = _time(now_s)
    _current_task(job, task)
    if job.state not in _HOLDING:
        raise RuleError(f"job {job_id} is {job.state.value}, not running")
    if node is not None:
        return _node_ended(state, job, node, _FINISHED, now_s)
    done = dataclasses.replace(_end_task(job, now_s, _FINISHED), state=JobState.FINISHED)
    return _replace_job(state, done)


def request_suspend(state: ClusterState, job_id: str) -> ClusterState:
    """A user's own suspend (``hai suspend``): like a preemption, the job saves and exits."""
    job = _job(state, job_id)
    if job.state is not JobState.RUNNING:
        raise RuleError(f"job {job_id} is {job.state.value}, not running")
    return _replace_job(state, dataclasses.replace(job, state=JobState.SUSPENDING))


def suspend_acknowledged(state: ClusterState, job_id: str, now_s: float, task: int | None = None,
                         node: str | None = None) -> ClusterState:
    """The suspended job saved and exited (or was force-stopped after the grace period): it goes
    back to the queue as the next task of its chain, at its old place (same sequence). With
    ``node``, only that node's ranks did: the job keeps every node until all have reported their
    end (a node whose ranks had finished before the suspend counts as ended), then goes back to
    the queue. Without ``node``, all of them did."""
    job = _job(state, job_id)
    now_s = _time(now_s)
    _current_task(job, task)
    if job.state is not JobState.SUSPENDING:
        raise RuleError(f"job {job_id} is {job.state.value}, not suspending")
    if node is not None:
        return _node_ended(state, job, node, _SUSPENDED, now_s)
    queued = dataclasses.replace(_end_task(job, now_s, _SUSPENDED), state=JobState.QUEUED, task=job.task + 1)
    return _replace_job(state, queued)


def fail_job(state: ClusterState, job_id: str, now_s: float, config: Config, reason: str,
             bad_node: str | None = None, task: int | None = None) -> ClusterState:
    """A rank failed (or the job went silent): stop the task and restart it after a back-off, or
    fail the job once it has used its restarts. It acts at once, whatever the job's other nodes
    have reported (a task some of whose nodes finished and one failed has failed). ``bad_node``,
    if named, becomes suspect (no work until a validation passes, :func:`validation_result`): it
    must be one of the job's nodes (another job may be running on any other)."""
    job = _job(state, job_id)
    now_s = _time(now_s)
    _current_task(job, task)
    if job.state not in _HOLDING:
        raise RuleError(f"job {job_id} is {job.state.value}, not running")
    if bad_node is not None and bad_node not in job.assigned:
        raise RuleError(f"node {bad_node} is not one of job {job_id}'s nodes")
    if bad_node is not None:
        state = _mark_suspect(state, bad_node, reason)
    ended = _end_task(job, now_s, f"failed: {reason}")
    restarts = job.restarts + 1
    if restarts > config.max_restarts:
        ended = dataclasses.replace(ended, state=JobState.FAILED, restarts=job.restarts,
                                    end_reason=f"{reason}; {job.restarts} restarts used")
    else:
        ended = dataclasses.replace(ended, state=JobState.QUEUED, task=job.task + 1, restarts=restarts,
                                    not_before_s=now_s + backoff_s(config, restarts))
    return _replace_job(state, ended)


def _replace_node(state: ClusterState, node: Node) -> ClusterState:
    return dataclasses.replace(state, nodes={**state.nodes, node.name: node})


def _mark_suspect(state: ClusterState, name: str, reason: str) -> ClusterState:
    """No work for ``name`` until a validation passes; a node an admin must heal stays so."""
    old = _node(state, name)
    if not old.healthy and old.validation is Validation.NONE:
        return state  # out until an admin heals it: a rank's failure changes nothing
    node = dataclasses.replace(old, healthy=False, unhealthy_reason=reason, validation=Validation.NEEDED)
    return _replace_node(state, node)


def _holds(state: ClusterState, name: str) -> str | None:
    """The job holding node ``name``, if any."""
    return next((j.job_id for j in state.jobs.values() if j.state in _HOLDING and name in j.assigned), None)


def node_health(node: Node) -> str:
    """``healthy``, ``validating``, ``needs validation`` or ``unhealthy`` (out until an admin heals it)."""
    if node.validation is Validation.RUNNING:
        return "validating"
    if node.healthy:
        return "healthy"
    return "needs validation" if node.validation is Validation.NEEDED else "unhealthy"


def validation_started(state: ClusterState, name: str, now_s: float) -> ClusterState:
    """The node's validator started: the node takes no work until it has passed. A node that runs
    a job, or that only an admin may heal, is refused (its agent skips the run)."""
    old = _node(state, name)
    now_s = _time(now_s)
    job = _holds(state, name)
    if job is not None:
        raise RuleError(f"node {name} runs job {job}: validate it once the job has left")
    if not old.healthy and old.validation is Validation.NONE:
        raise RuleError(f"node {name} is out of scheduling until an admin heals it ({old.unhealthy_reason})")
    reason = old.unhealthy_reason if not old.healthy else "scheduled validation"
    node = dataclasses.replace(old, healthy=False, unhealthy_reason=reason, validation=Validation.RUNNING,
                               last_heartbeat_s=max(old.last_heartbeat_s, now_s))
    return _replace_node(state, node)


def validation_result(state: ClusterState, name: str, passed: bool, reasons: Sequence[str], now_s: float,
                      config: Config) -> ClusterState:
    """The node's validator ended. A pass makes it healthy; a failure keeps it out with the
    validator's sentences as the reason, for another try, or for good (until an admin heals it)
    once it has failed ``max_validation_failures`` times in a row. A result without a start report
    counts the same (the start report may have been lost). Refused for a node that runs a job or
    that only an admin may heal."""
    old = _node(state, name)
    now_s = _time(now_s)
    job = _holds(state, name)
    if job is not None:
        raise RuleError(f"node {name} runs job {job}: its validation cannot count")
    if not old.healthy and old.validation is Validation.NONE:
        raise RuleError(f"node {name} is out of scheduling until an admin heals it ({old.unhealthy_reason})")
    heartbeat = max(old.last_heartbeat_s, now_s)  # its agent spoke
    if passed:
        node = dataclasses.replace(old, healthy=True, unhealthy_reason="", validation=Validation.NONE,
                                   validation_failures=0, last_heartbeat_s=heartbeat)
        return _replace_node(state, node)
    failures = old.validation_failures + 1
    said = "; ".join(r.strip() for r in reasons if r.strip()) or "no reason given"
    reason = f"validation failed: {said}"  # validation_rules.VALIDATION_REASON_PREFIX
    pending = Validation.NEEDED
    if failures >= config.max_validation_failures:
        pending = Validation.NONE
        reason = f"validation failed {failures} times in a row, an admin must heal it: {said}"
    node = dataclasses.replace(old, healthy=False, unhealthy_reason=reason, validation=pending,
                               validation_failures=failures, last_heartbeat_s=heartbeat)
    return _replace_node(state, node)


def node_lost(state: ClusterState, name: str, now_s: float, config: Config, reason: str) -> ClusterState:
    """A node stopped heartbeating or failed a check: it takes no work until it heartbeats again
    and passes a validation, and every job on it fails over (restart with back-off). The job's
    other nodes stay healthy and are freed. This holds when the other nodes had reported their
    ranks' end: the lost node's ranks never did, so the task failed, and the job is not left
    waiting for a report that cannot come."""
    now_s = _time(now_s)
    state = _mark_suspect(state, name, reason)
    victims = sorted(j.job_id for j in state.jobs.values() if j.state in _HOLDING and name in j.assigned)
    for job_id in victims:  # a node holds at most one job; sorted keeps it deterministic regardless
        state = fail_job(state, job_id, now_s, config, f"node {name} lost: {reason}")
    return state


def node_healthy(state: ClusterState, name: str, now_s: float) -> ClusterState:
    """An admin puts the node back: it takes work from the next pass, whatever its validator said."""
    old = _node(state, name)
    node = dataclasses.replace(old, healthy=True, unhealthy_reason="", validation=Validation.NONE,
                               validation_failures=0, last_heartbeat_s=max(old.last_heartbeat_s, _time(now_s)))
    return dataclasses.replace(state, nodes={**state.nodes, name: node})


def node_heartbeat(state: ClusterState, name: str, now_s: float) -> ClusterState:
    """The node's agent is alive. A heartbeat alone does not make an unhealthy node healthy. A late
    (replayed) heartbeat never moves the last one back."""
    old = _node(state, name)
    node = dataclasses.replace(old, last_heartbeat_s=max(old.last_heartbeat_s, _time(now_s)))
    return dataclasses.replace(state, nodes={**state.nodes, name: node})


def job_progress(state: ClusterState, job_id: str, now_s: float) -> ClusterState:
    """The job reported progress (a log line, a step): its watchdog starts again. A late (replayed)
    report never moves the last one back."""
    job = _job(state, job_id)
    return _replace_job(state, dataclasses.replace(job, last_progress_s=max(job.last_progress_s, _time(now_s))))


def check_timeouts(state: ClusterState, now_s: float, config: Config) -> ClusterState:
    """Nodes silent past ``node_timeout_s`` are lost (healthy ones, and validating ones: an agent
    that died mid-validation must not leave its node "validating" for ever); jobs silent past
    ``watchdog_s`` fail, whether running or suspending (a suspend never acknowledged would hold its
    nodes for ever)."""
    now_s = _time(now_s)
    silent_nodes = sorted(n.name for n in state.nodes.values()
                          if (n.healthy or n.validation is Validation.RUNNING)
                          and now_s - n.last_heartbeat_s > config.node_timeout_s)
    for name in silent_nodes:
        state = node_lost(state, name, now_s, config, "no heartbeat")
    silent_jobs = sorted(j.job_id for j in state.jobs.values()
                         if j.state in _HOLDING and now_s - max(j.last_progress_s, j.started_s)
                         > config.watchdog_s)
    for job_id in silent_jobs:
        state = fail_job(state, job_id, now_s, config, "watchdog expired")
    return state


# -- one scheduling pass --------------------------------------------------------------------------


def _choose(candidates: Sequence[Node], need: int, cross_zone_ok: bool) -> tuple[tuple[str, ...], bool] | None:
    """``need`` nodes out of ``candidates`` (in order of preference), or None.

    One zone when one has room: the one with the fewest candidates that still fits (best fit, so
    big zones stay whole for big jobs). Otherwise, if the cross-zone slot is free, the fewest zones:
    the largest first."""
    if len(candidates) < need:
        return None
    by_zone: dict[str, list[str]] = {}
    for node in candidates:
        by_zone.setdefault(node.zone, []).append(node.name)
    fitting = [z for z, names in by_zone.items() if len(names) >= need]
    if fitting:
        zone = min(fitting, key=lambda z: (len(by_zone[z]), z))
        return tuple(by_zone[zone][:need]), False
    if not cross_zone_ok:
        return None
    chosen: list[str] = []
    for zone in sorted(by_zone, key=lambda z: (-len(by_zone[z]), z)):
        chosen.extend(by_zone[zone][:need - len(chosen)])
        if len(chosen) == need:
            break
    return tuple(chosen), True


class _Pass:
    """The working sets of one pass: what is free, what is being freed, who holds the cross-zone slot."""

    def __init__(self, state: ClusterState, now_s: float, config: Config, demoted: frozenset[str]) -> None:
        self.state, self.now_s, self.config = state, now_s, config
        self.demoted = demoted
        self.used = _usage(state)
        held = {n for j in state.jobs.values() if j.state in _HOLDING for n in j.assigned}
        self.free = {n.name for n in state.nodes.values() if n.healthy and n.name not in held}
        # Nodes of suspending jobs, not yet reserved for a waiting job.
        self.incoming = {n for j in state.jobs.values() if j.state is JobState.SUSPENDING for n in j.assigned
                         if state.nodes[n].healthy}
        self.suspending = {j.job_id for j in state.jobs.values() if j.state is JobState.SUSPENDING}
        crossing = sorted(j.job_id for j in state.jobs.values()
                          if j.state in _HOLDING and _crosses_zones(state, j.assigned))
        _ensure(len(crossing) <= 1, f"more than one job crosses zones: {crossing}")
        self.cross_holder: str | None = crossing[0] if crossing else None
        self.priority_of: dict[str, Priority] = {}
        for job in state.jobs.values():
            if job.state in _HOLDING:
                if job.priority is None:
                    raise SchedulerInvariantError(f"job {job.job_id} holds nodes without a priority")
                self.priority_of[job.job_id] = Priority.NORMAL if job.job_id in demoted else job.priority
        self.victims_taken: set[str] = set()
        self.running = sorted((j for j in state.jobs.values() if j.state is JobState.RUNNING), key=lambda j: j.seq)
        self.placements: list[Placement] = []
        self.suspensions: list[Suspension] = []
        self.waits: dict[str, Wait] = {}
        self.reserved: dict[str, tuple[str, ...]] = {}

    def nodes_of(self, names: Iterable[str], group: str, incoming_last: Iterable[str] = ()) -> list[Node]:
        """Healthy nodes of ``group`` among ``names``, free ones first, then by zone and name."""
        late = set(incoming_last)
        nodes = [self.state.nodes[n] for n in names]
        return sorted((n for n in nodes if n.group == group and n.healthy),
                      key=lambda n: (n.name in late, n.zone, n.name))

    def run(self, queue: Sequence[tuple[Job, Priority]]) -> None:
        """Consider the queue in rank order. An AUTO job whose level filled up earlier in this pass
        goes back in at the highest level that still has room, behind the jobs now ahead of it; a
        level only ever drops, so each job is taken at most once per level."""
        heap = [(rank_key(priority, job.seq), job.job_id, priority) for job, priority in queue]
        heapq.heapify(heap)
        jobs = {job.job_id: job for job, _ in queue}
        for _ in range(len(heap) * len(Priority)):
            if not heap:
                break
            _, job_id, priority = heapq.heappop(heap)
            job = jobs[job_id]
            auto = job.requested is AUTO and not job.demoted and job_id not in self.demoted
            if auto and self.quota_short(job, priority):
                level, room = resolve_auto(self.state, self.config, job, self.used)
                if room and level < priority:
                    heapq.heappush(heap, (rank_key(level, job.seq), job_id, level))
                    continue
            self.consider(job, priority)
        _ensure(not heap, "the queue did not drain within its bound")

    def quota_short(self, job: Job, priority: Priority) -> bool:
        key = (job.user, job.group, priority)
        return self.used[key] + job.nodes > quota_limit(self.state, self.config, *key)

    def consider(self, job: Job, priority: Priority) -> None:
        key = (job.user, job.group, priority)
        if job.not_before_s > self.now_s:
            self.wait(job, WaitKind.BACKOFF, priority, f"backoff until t={job.not_before_s:g}")
            return
        limit = quota_limit(self.state, self.config, *key)
        if self.quota_short(job, priority):
            self.wait(job, WaitKind.QUOTA, priority,
                      f"quota exceeded at {priority.name}: {self.used[key]} of {limit} in use, needs {job.nodes}")
            return
        plan = _choose(self.nodes_of(self.free, job.group), job.nodes, self.cross_holder is None)
        if plan is not None:
            self.place(job, priority, *plan)
            return
        if self.reserve(job, priority, self.incoming, ()):
            return
        if self.preempt(job, priority):
            return
        self.explain(job, priority)

    def place(self, job: Job, priority: Priority, names: tuple[str, ...], cross_zone: bool) -> None:
        self.free -= set(names)
        self.used[(job.user, job.group, priority)] += job.nodes
        if cross_zone:
            self.cross_holder = job.job_id
        self.placements.append(Placement(job.job_id, names, priority, cross_zone))

    def cross_ok_after(self, leaving: Iterable[str]) -> bool:
        """Whether the cross-zone slot is free once the suspending jobs and ``leaving`` have exited."""
        return self.cross_holder is None or self.cross_holder in self.suspending or \
            self.cross_holder in set(leaving)

    def reserve(self, job: Job, priority: Priority, incoming: set[str], victims: Sequence[Job]) -> bool:
        """Hold the nodes that will fit ``job`` once the suspending jobs (and ``victims``) exit."""
        victim_nodes = [n for v in victims for n in v.assigned]
        pool = self.nodes_of([*self.free, *incoming, *victim_nodes], job.group,
                             incoming_last=[*incoming, *victim_nodes])
        plan = _choose(pool, job.nodes, self.cross_ok_after(v.job_id for v in victims))
        if plan is None:
            return False
        names, cross_zone = plan
        self.free -= set(names)
        self.incoming -= set(names)
        self.incoming |= {n for n in victim_nodes if n not in names and self.state.nodes[n].healthy}
        self.used[(job.user, job.group, priority)] += job.nodes
        self.reserved[job.job_id] = names
        holders = {j.job_id for j in self.state.jobs.values() if set(j.assigned) & set(names)}
        if cross_zone and self.cross_holder is not None and self.cross_holder != job.job_id:
            holders.add(self.cross_holder)
        if cross_zone:
            self.cross_holder = job.job_id
        self.wait(job, WaitKind.SUSPENDING, priority, f"waiting for {', '.join(sorted(holders))} to suspend")
        return True

    def preempt(self, job: Job, priority: Priority) -> bool:
        """Suspend the fewest jobs behind ``job`` that make it fit; nothing when none would.

        The holder of the cross-zone slot counts as a candidate whatever its group: suspending it
        frees the slot. Fitting is judged on node counts per zone, kept as victims are added, so a
        pass stays near-linear in the running jobs for each waiting one."""
        mine = rank_key(priority, job.seq)
        candidates = [r for r in self.running
                      if (r.group == job.group or r.job_id == self.cross_holder) and r.job_id not in self.victims_taken
                      and rank_key(self.priority_of[r.job_id], r.seq) > mine
                      and not (r.user == job.user and self.priority_of[r.job_id] is priority)]
        candidates.sort(key=lambda r: (self.priority_of[r.job_id], -r.started_s, -r.seq))
        base = self.zone_counts([*self.free, *self.incoming], job.group)
        if sum(base.values()) + sum(r.nodes for r in candidates) < job.nodes:
            return False
        gained = {r.job_id: self.zone_counts(r.assigned, job.group) for r in candidates}

        def fits(victims: Sequence[Job]) -> bool:
            counts = base.copy()
            for victim in victims:
                counts.update(gained[victim.job_id])
            return any(c >= job.nodes for c in counts.values()) or \
                (self.cross_ok_after(v.job_id for v in victims) and sum(counts.values()) >= job.nodes)

        if not fits(candidates):
            return False
        chosen: list[Job] = []
        counts = base.copy()
        for victim in candidates:
            chosen.append(victim)
            counts.update(gained[victim.job_id])
            if any(c >= job.nodes for c in counts.values()) or \
                    (self.cross_ok_after(v.job_id for v in chosen) and sum(counts.values()) >= job.nodes):
                break
        for victim in reversed(chosen[:-1]):  # drop any that the last ones made unnecessary
            rest = [v for v in chosen if v is not victim]
            if fits(rest):
                chosen = rest
        _ensure(self.fits_after(job, chosen), "preemption chose victims that do not make room")
        for victim in chosen:
            self.victims_taken.add(victim.job_id)
            self.suspensions.append(Suspension(victim.job_id, job.job_id))
        self.reserve(job, priority, self.incoming, chosen)
        return True

    def zone_counts(self, names: Iterable[str], group: str) -> Counter[str]:
        """Healthy nodes of ``group`` among ``names``, counted per zone."""
        return Counter(node.zone for node in (self.state.nodes[n] for n in names)
                       if node.group == group and node.healthy)

    def fits_after(self, job: Job, victims: Sequence[Job]) -> bool:
        names = [*self.free, *self.incoming, *(n for v in victims for n in v.assigned)]
        return _choose(self.nodes_of(names, job.group), job.nodes,
                       self.cross_ok_after(v.job_id for v in victims)) is not None

    def explain(self, job: Job, priority: Priority) -> None:
        group_nodes = [n for n in self.state.nodes.values() if n.group == job.group and n.healthy]
        free = self.nodes_of(self.free, job.group)
        if len(group_nodes) < job.nodes:
            self.wait(job, WaitKind.NODES, priority,
                      f"needs {_nodes(job.nodes)}, group {job.group} has {len(group_nodes)} healthy")
        elif len(free) >= job.nodes and self.cross_holder is not None:
            self.wait(job, WaitKind.CROSS_ZONE, priority, f"cross-zone slot taken by {self.cross_holder}")
        else:
            held = {j: [n for n in names if self.state.nodes[n].group == job.group]
                    for j, names in sorted(self.reserved.items())}
            count = sum(len(names) for names in held.values())
            also = f" ({count} held for {', '.join(j for j, names in held.items() if names)})" if count else ""
            self.wait(job, WaitKind.NODES, priority, f"needs {_nodes(job.nodes)}, {len(free)} free{also}")

    def wait(self, job: Job, kind: WaitKind, priority: Priority, text: str) -> None:
        self.waits[job.job_id] = Wait(kind, priority, text)


def _demotions(state: ClusterState, now_s: float, config: Config) -> tuple[str, ...]:
    """ABOVE_NORMAL jobs whose chain has run ``demote_after_s``: running ones, and queued ones whose
    earlier tasks crossed the line between two passes (they must not return at ABOVE_NORMAL)."""
    def ran(j: Job) -> float:
        return j.ran_s + max(0.0, now_s - j.started_s) if j.state in _HOLDING else j.ran_s

    return tuple(sorted(j.job_id for j in state.jobs.values()
                        if j.state in (*_HOLDING, JobState.QUEUED) and j.priority is Priority.ABOVE_NORMAL
                        and not j.demoted and ran(j) >= config.demote_after_s))


def schedule(state: ClusterState, now_s: float, config: Config) -> Decision:
    """One pass: demote, then go through the queue in rank order, placing what fits, suspending what
    must make room, and saying why everything else waits. The state is not changed: :func:`apply`."""
    now_s = _time(now_s)
    demotions = _demotions(state, now_s, config)
    work = _Pass(state, now_s, config, frozenset(demotions))
    queue = [(j, Priority.NORMAL if j.job_id in demotions else queued_priority(state, config, j, work.used))
             for j in state.jobs.values() if j.state is JobState.QUEUED]
    queue.sort(key=lambda item: rank_key(item[1], item[0].seq))
    work.run(queue)
    return Decision(now_s=now_s, placements=tuple(work.placements), suspensions=tuple(work.suspensions),
                    demotions=demotions, waits=work.waits, reserved=work.reserved)


def apply(state: ClusterState, decision: Decision) -> ClusterState:
    """The state once the decision is carried out: demoted jobs at NORMAL (still charged where they
    were placed), suspended jobs suspending, placed jobs running on their nodes from ``now_s``.
    It trusts the decision to be ``schedule``'s on this very state: the caller applies no event
    between the two."""
    jobs = dict(state.jobs)
    for job_id in decision.demotions:
        jobs[job_id] = dataclasses.replace(jobs[job_id], priority=Priority.NORMAL, demoted=True)
    for suspension in decision.suspensions:
        _ensure(jobs[suspension.job_id].state is JobState.RUNNING, f"{suspension.job_id} is not running")
        jobs[suspension.job_id] = dataclasses.replace(jobs[suspension.job_id], state=JobState.SUSPENDING)
    for p in decision.placements:
        job = jobs[p.job_id]
        _ensure(job.state is JobState.QUEUED and len(p.nodes) == job.nodes, f"bad placement of {p.job_id}")
        jobs[p.job_id] = dataclasses.replace(job, state=JobState.RUNNING, assigned=p.nodes, priority=p.priority,
                                             charged=p.priority, started_s=decision.now_s,
                                             last_progress_s=decision.now_s)
    return dataclasses.replace(state, jobs=jobs)

"""``hai agent``: the node agent. It registers its node with ``hai server``, heartbeats, and carries
out the commands the server answers with, one :class:`~hai.launcher.RankLauncher` per task.

**Registration** sends the node's name, zone, group, labels, the address its ranks' peers reach
it at (``MASTER_ADDR`` when it holds rank 0), its CPUs (``sched_getaffinity``) and its memory
(``MemTotal`` of ``/proc/meminfo``). An agent started before its server retries with bounded
back-off until the server answers. With ``--validate`` the agent first runs :mod:`hai.validate`'s
checks; a node that fails does not register (an unregistered node gets no work): the agent prints
the reasons and exits 1.

**Heartbeats** (every ``heartbeat_s``) list the ``(job, task)`` pairs the agent holds, each with a
progress flag: true when the task's ranks wrote any log output since the previous heartbeat (the
launcher's count of log bytes grew), which is what keeps the job's watchdog from expiring. A task
stays listed after its ranks ended until the server answers ``stop`` for it: the server still
expects it on the node until the task's end counted (once every node of the job has reported the
end of its ranks), and an unlisted task it expects would be launched again.

**Commands**: ``launch`` starts the task's ranks with ``RANK = first_rank + LOCAL_RANK``, the
command's ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, the job's variables and the submitting
user's fs3 token, logging to fs3 (``/hai/logs/<job>/<rank>.log``) when the agent has an fs3
cluster, else below ``--log-dir``; a launch of a task it already holds does nothing, and a launch
while a stopped task's ranks are still ending waits for the next heartbeat (the server sends its
``stop`` for the old task and ``launch`` for the next in one answer; the old ranks must be gone
first, or a restarted job's old and new rank 0 run side by side). ``suspend``
runs :meth:`RankLauncher.suspend` (``ack_grace_s`` + ``finish_grace_s``, 5 + 5 s by default) on a
thread. ``stop`` runs :meth:`RankLauncher.stop` on a thread and forgets the task once its ranks
are gone.

**Reports**: one thread per task waits for its ranks on this node to end and reports the outcome
(every node reports its own ranks' end; the task ends once all of the job's nodes have): ``finished``;
``failed`` with the first non-zero exit code (or none for a signal) and the launcher's reason;
``suspended`` for a suspend the job acknowledged and also for one the agent force-stopped after
the grace, since the server must put the job back in the queue to resume from its last
checkpoint (``failed`` would count a fault and make the node suspect); nothing for a task the
server had the agent stop (the server has already moved on). A launch that cannot start is
reported ``failed``. Reports go through a bounded queue to one sender, which retries a report with
back-off (capped at ``report_backoff_max_s``) until the server answers it; 409 means the server
applied it already or refused it as late, and ends the retries like a 200. Every HTTP call has a
timeout.

**Validation**: the node's validator (:mod:`hai.validate`'s checks and thresholds; a fake in tests)
runs on a thread of its own, so heartbeats go on, and within ``validation_timeout_s`` (past it the
run counts as failed). It runs when the server's heartbeat answer says ``validate`` (a node where a
rank failed, or that was lost, must pass one before it takes work again), no sooner than
``validation_retry_s`` after the previous run ended, and on a schedule: every
``validate_every_s`` (``--validate-every-s``, 3600 by default, 0 for never) while the node runs no
task. The agent reports ``started`` to ``POST /agents/{node}/validation`` first and skips the run
when the server refuses it (the node took a job meanwhile, or only an admin may put it back), then
the verdict: whether it passed, the validator's sentences, and a summary of its measurements.

**Shutdown** (SIGTERM, SIGINT, or :meth:`Agent.close`) stops heartbeating and kills every rank the
agent started; nothing is reported, and the server, hearing nothing, marks the node lost after its
node timeout and restarts its job elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hai.launcher import LaunchError, LaunchReport, LaunchSpec, LocalLogSink, LogSink, Outcome, RankLauncher

__all__ = [
    "Agent",
    "AgentConfig",
    "NodeVerdict",
    "add_arguments",
    "memory_bytes",
    "node_cpus",
    "run",
]

log = logging.getLogger(__name__)

MAX_PENDING_REPORTS = 1024
MAX_TASKS = 64  # what one heartbeat may list (the server's MAX_RUNNING_REPORTED)

TaskKey = tuple[str, int]
MAX_VERDICT_REASONS = 16  # the server's MAX_VALIDATION_REASONS, MAX_REASON_CHARS, MAX_SUMMARY_ENTRIES
MAX_VERDICT_REASON_CHARS = 200
MAX_VERDICT_SUMMARY = 32
VERDICT_TRIES = 5  # a verdict is sent this many times at most before the agent gives up on it


@dataclass(frozen=True)
class NodeVerdict:
    """What a validator run found: the sentences that say why the node failed (none: it passed)
    and a summary of its measurements (name -> number), for the server's node view."""

    reasons: Sequence[str] = ()
    summary: Mapping[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.reasons

    def body(self) -> dict[str, Any]:
        """The verdict as ``POST /agents/{node}/validation`` takes it, cut to the server's bounds."""
        reasons = [r[:MAX_VERDICT_REASON_CHARS] for r in self.reasons][:MAX_VERDICT_REASONS]
        summary = {k[:64]: float(v) for k, v in list(self.summary.items())[:MAX_VERDICT_SUMMARY]
                   if isinstance(v, (int, float)) and v == v and abs(v) != float("inf")}
        return {"event": "result", "passed": self.passed, "reasons": reasons, "summary": summary}


Validator = Callable[[], NodeVerdict]


def node_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """``MemTotal`` in bytes, 0 when it cannot be read."""
    try:
        with open(meminfo) as text:
            for line in text:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass(frozen=True)
class AgentConfig:
    """An agent's settings; see the module docstring."""

    server: str
    node: str
    token: str
    zone: str = "default"
    group: str = "default"
    address: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    heartbeat_s: float = 1.0
    http_timeout_s: float = 10.0
    ack_grace_s: float = 5.0
    finish_grace_s: float = 5.0
    term_grace_s: float = 2.0
    report_backoff_max_s: float = 5.0
    register_backoff_max_s: float = 5.0
    fs3_mgmtd: str | None = None  # handed to the ranks as FS3_MGMTD
    validate_every_s: float = 0.0  # validate an idle node this often; 0: only when the server asks
    validation_timeout_s: float = 1800.0  # a validator run longer than this has failed
    validation_retry_s: float = 30.0  # a validation the server asks for again waits this long after the last

    def __post_init__(self) -> None:
        times = (self.heartbeat_s, self.http_timeout_s, self.report_backoff_max_s, self.register_backoff_max_s,
                 self.validation_timeout_s)
        if any(not t > 0 for t in times) or self.ack_grace_s < 0 or self.finish_grace_s < 0:
            raise ValueError("intervals and timeouts must be positive, graces not negative")
        if not 0 <= self.validate_every_s < float("inf") or not 0 <= self.validation_retry_s < float("inf"):
            raise ValueError("validate_every_s and validation_retry_s must be finite, not negative")


class AgentError(RuntimeError):
    """The agent cannot go on (its server refused it)."""


class _Task:
    """One (job, task) the agent holds: its launcher (None when the launch failed) and what the
    heartbeat and the commands need to know of it."""

    def __init__(self, key: TaskKey, launcher: RankLauncher | None) -> None:
        self.key = key
        self.launcher = launcher
        self.log_bytes = 0
        self.stopping = False
        self.suspending = False
        self.ended = launcher is None

    def progress(self) -> bool:
        """Whether its ranks wrote output since the last call."""
        if self.launcher is None:
            return False
        now = self.launcher.report().log_bytes
        grew, self.log_bytes = now > self.log_bytes, now
        return grew


def _report_for(report: LaunchReport) -> dict[str, Any] | None:
    """The server report for how a task's ranks ended; None when there is nothing to say."""
    outcome = report.outcome
    if outcome is Outcome.FINISHED:
        return {"event": "finished", "exit_code": 0}
    if outcome is Outcome.SUSPENDED:
        return {"event": "suspended"}
    if outcome is Outcome.FORCE_STOPPED:
        return {"event": "suspended", "reason": f"force-stopped: {report.reason}"[:1024]}
    if outcome is Outcome.FAILED:
        code = next((r.exit_code for r in report.ranks if r.exit_code not in (None, 0)), None)
        return {"event": "failed", "exit_code": code, "reason": report.reason[:1024]}
    return None  # STOPPED: by the server's stop or the agent's shutdown; RUNNING cannot be final


class Agent:
    """A node agent. :meth:`serve` registers and runs the heartbeat loop until :meth:`close`.

    ``sink`` is where ranks' logs go; ``transport`` (tests) replaces httpx's network transport;
    ``validator`` runs the node's checks (none: the agent never validates, whatever it is asked).
    """

    def __init__(self, config: AgentConfig, sink: LogSink, *, control_root: str | None = None,
                 transport: httpx.BaseTransport | None = None, validator: Validator | None = None) -> None:
        self.config = config
        self.sink = sink
        self.control_root = control_root
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._tasks: dict[TaskKey, _Task] = {}
        self._threads: list[threading.Thread] = []
        self._reports: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=MAX_PENDING_REPORTS)
        headers = {"Authorization": f"Bearer {config.token}"}
        timeout = httpx.Timeout(config.http_timeout_s)
        # One client per thread that calls the server: the heartbeat loop and the report sender.
        self._http = httpx.Client(base_url=config.server, headers=headers, timeout=timeout, transport=transport)
        self._report_http = httpx.Client(base_url=config.server, headers=headers, timeout=timeout,
                                         transport=transport)
        self._validation_http = httpx.Client(base_url=config.server, headers=headers, timeout=timeout,
                                             transport=transport)
        self._validator = validator
        self._validation: threading.Thread | None = None
        self._validated_at = time.monotonic()  # the schedule counts from the last run's end (or the start)
        self._validation_ended: float | None = None  # when the last run ended: the retry pause counts from it
        self._sender = threading.Thread(target=self._send_reports, name=f"hai-agent-{config.node}-reports",
                                        daemon=True)
        self._sender.start()

    # -- the loop --------------------------------------------------------------------------------

    def register(self) -> dict[str, Any]:
        """Register the node, retrying with back-off until the server answers; :class:`AgentError`
        when it refuses."""
        c = self.config
        body = {"name": c.node, "cpus": node_cpus(), "memory_bytes": memory_bytes(), "zone": c.zone,
                "group": c.group, "labels": dict(c.labels), "address": c.address}
        delay = 0.1
        while not self._closing.is_set():
            try:
                response = self._http.post("/agents/register", json=body)
            except httpx.HTTPError as exc:
                log.warning("registering %s: %s; retrying in %.1f s", c.node, exc, delay)
            else:
                if response.status_code == 200:
                    answer: dict[str, Any] = response.json()
                    log.info("registered %s with %s", c.node, c.server)
                    return answer
                if response.status_code < 500:
                    raise AgentError(f"the server refused to register {c.node}: "
                                     f"{response.status_code} {response.text[:300]}")
                log.warning("registering %s: %s; retrying in %.1f s", c.node, response.status_code, delay)
            self._closing.wait(delay)
            delay = min(delay * 2, c.register_backoff_max_s)
        raise AgentError("closed before registering")

    def serve(self, registered: Callable[[], None] | None = None) -> None:
        """Register, then heartbeat every ``heartbeat_s`` and carry out the commands, until
        :meth:`close` (from another thread or a signal handler). :class:`AgentError` when the
        server refuses the node. ``registered`` is called once the server has taken the node."""
        try:
            self.register()
        except AgentError:
            if self._closing.is_set():
                return  # closed before the server answered
            raise
        if registered is not None:
            registered()
        while not self._closing.is_set():
            started = time.monotonic()
            self.heartbeat()
            every = self.config.validate_every_s
            if every > 0 and started - self._validated_at >= every:
                self.validate("scheduled")
            self._closing.wait(max(0.0, self.config.heartbeat_s - (time.monotonic() - started)))

    def heartbeat(self) -> list[dict[str, Any]]:
        """One heartbeat and its commands; returns the commands (none when the server could not
        be reached)."""
        with self._lock:
            tasks = sorted(self._tasks.values(), key=lambda t: t.key)[:MAX_TASKS]
            running = [{"job_id": t.key[0], "task": t.key[1], "progress": t.progress()} for t in tasks]
        try:
            response = self._http.post(f"/agents/{self.config.node}/heartbeat", json={"running": running})
        except httpx.HTTPError as exc:
            log.warning("heartbeat: %s", exc)
            return []
        if response.status_code == 404:  # the server lost the node (a new database): register again
            log.warning("heartbeat: the server does not know %s; registering again", self.config.node)
            with contextlib.suppress(AgentError, httpx.HTTPError):
                self.register()
            return []
        if response.status_code != 200:
            log.warning("heartbeat: %s %s", response.status_code, response.text[:300])
            return []
        commands: list[dict[str, Any]] = list(response.json().get("commands", []))
        for command in commands:
            try:
                self._execute(command)
            except Exception:
                log.exception("command %s failed", command.get("type"))
        return commands

    def _execute(self, command: Mapping[str, Any]) -> None:
        kind = command.get("type")
        if kind == "validate":
            ended = self._validation_ended
            if ended is None or time.monotonic() - ended >= self.config.validation_retry_s:
                self.validate(f"asked by the server: {command.get('reason', '')}")
            return
        key = (str(command["job_id"]), int(command["task"]))
        if kind == "launch":
            self._launch(key, command)
        elif kind == "suspend":
            self._suspend(key)
        elif kind == "stop":
            self._stop(key)
        else:
            log.warning("unknown command %r", kind)

    # -- commands --------------------------------------------------------------------------------

    def _launch(self, key: TaskKey, command: Mapping[str, Any]) -> None:
        with self._lock:
            if key in self._tasks or self._closing.is_set():
                return  # already held: a repeated launch does nothing
            if any(t.stopping for t in self._tasks.values()):
                # A stopped task's ranks are still ending (up to term_grace_s): the next task
                # starts only once they are gone. The server answers the launch again at the next
                # heartbeat, since the agent does not list the task.
                log.info("launch of %s task %d deferred: a stopped task's ranks are still ending", *key)
                return
            if len(self._tasks) >= MAX_TASKS:
                log.warning("launch of %s task %d refused: %d tasks held", *key, len(self._tasks))
                return
        spec = LaunchSpec(
            job_id=key[0], command=[str(a) for a in command["argv"]], master_addr=str(command["master_addr"]),
            master_port=int(command["master_port"]), world_size=int(command["world_size"]),
            first_rank=int(command["first_rank"]), local_world_size=int(command["local_world_size"]),
            env={str(k): str(v) for k, v in dict(command.get("env", {})).items()},
            fs3_token=str(command.get("fs3_token") or "") or None, fs3_mgmtd=self.config.fs3_mgmtd)
        try:
            launcher: RankLauncher | None = RankLauncher(spec, self.sink, control_root=self.control_root,
                                                         term_grace_s=self.config.term_grace_s)
        except LaunchError as exc:
            log.warning("launch of %s task %d failed: %s", *key, exc)
            launcher = None
            self._queue_report(key, {"event": "failed", "exit_code": None, "reason": f"launch failed: {exc}"[:1024]})
        task = _Task(key, launcher)
        with self._lock:
            self._tasks[key] = task
        if launcher is None:
            return
        log.info("launched %s task %d: ranks %d..%d of %d", key[0], key[1], spec.first_rank,
                 spec.first_rank + spec.local_world_size - 1, spec.world_size)
        self._queue_report(key, {"event": "started"})
        self._spawn(self._watch, task, f"watch-{key[0]}-{key[1]}")

    def _suspend(self, key: TaskKey) -> None:
        with self._lock:
            task = self._tasks.get(key)
            if task is None or task.launcher is None or task.suspending or task.stopping or task.ended:
                return
            task.suspending = True
        launcher = task.launcher
        self._spawn(lambda: launcher.suspend(self.config.ack_grace_s, self.config.finish_grace_s),
                    None, f"suspend-{key[0]}-{key[1]}")

    def _stop(self, key: TaskKey) -> None:
        with self._lock:
            task = self._tasks.get(key)
            if task is None or task.stopping:
                return
            task.stopping = True
            launcher = task.launcher
            if launcher is None or task.ended:
                del self._tasks[key]  # its ranks are gone already: forget it
        if launcher is None or task.ended:
            if launcher is not None:
                launcher.close()
            return

        def stop() -> None:
            launcher.stop()
            launcher.close()
            with self._lock:
                self._tasks.pop(key, None)

        self._spawn(stop, None, f"stop-{key[0]}-{key[1]}")

    def _watch(self, task: _Task) -> None:
        """Wait for the task's ranks to end and report how."""
        assert task.launcher is not None
        while not self._closing.is_set():
            report = task.launcher.wait(0.5)
            if self._ended(report):
                break
        else:
            return
        with self._lock:
            task.ended = True
            stopped = task.stopping
        body = _report_for(report)
        log.info("%s task %d ended: %s (%s)", *task.key, report.outcome.value, report.reason)
        if body is not None and not stopped:
            self._queue_report(task.key, body)

    @staticmethod
    def _ended(report: LaunchReport) -> bool:
        return report.outcome is not Outcome.RUNNING and not any(r.running for r in report.ranks)

    def _spawn(self, target: Callable[..., object], arg: object, name: str) -> None:
        thread = threading.Thread(target=target, args=() if arg is None else (arg,),
                                  name=f"hai-agent-{name}", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    # -- validation ------------------------------------------------------------------------------

    def validate(self, why: str) -> bool:
        """Start a validator run on its own thread, unless one runs, the node holds a task, or the
        agent has no validator; whether it started."""
        with self._lock:
            busy = self._validation is not None and self._validation.is_alive()
            if busy or self._tasks or self._validator is None or self._closing.is_set():
                return False
            self._validation = threading.Thread(target=self._validate, args=(why,), daemon=True,
                                                name=f"hai-agent-{self.config.node}-validation")
            self._validation.start()
            return True

    def _validate(self, why: str) -> None:
        try:
            self._validate_once(why)
        finally:
            self._validated_at = self._validation_ended = time.monotonic()

    def _validate_once(self, why: str) -> None:
        path = f"/agents/{self.config.node}/validation"
        try:
            response = self._validation_http.post(path, json={"event": "started"})
        except httpx.HTTPError as exc:
            log.warning("validation (%s) not started: %s", why, exc)
            return
        if response.status_code != 200:
            log.info("validation (%s) not started: %s %s", why, response.status_code, response.text[:300])
            return
        log.info("validating %s (%s)", self.config.node, why)
        verdict = self._run_validator()
        log.log(logging.INFO if verdict.passed else logging.WARNING, "validation %s%s",
                "passed" if verdict.passed else "failed", "" if verdict.passed else ": " + "; ".join(verdict.reasons))
        delay = 0.1
        for _ in range(VERDICT_TRIES):
            if self._closing.is_set():
                return
            try:
                response = self._validation_http.post(path, json=verdict.body())
            except httpx.HTTPError as exc:
                log.warning("validation verdict: %s; retrying in %.1f s", exc, delay)
            else:
                if response.status_code < 500:
                    if response.status_code != 200:
                        log.warning("validation verdict refused: %s %s", response.status_code, response.text[:300])
                    return
                log.warning("validation verdict: %s; retrying in %.1f s", response.status_code, delay)
            self._closing.wait(delay)
            delay = min(delay * 2, self.config.report_backoff_max_s)
        log.error("validation verdict not delivered after %d tries; the server asks again", VERDICT_TRIES)

    def _run_validator(self) -> NodeVerdict:
        """The validator's verdict, or a failing one when it raised or outran ``validation_timeout_s``
        (its thread is left to end on its own: the checks bound their own subprocesses)."""
        validator = self._validator
        assert validator is not None
        result: list[NodeVerdict] = []

        def run() -> None:
            try:
                result.append(validator())
            except Exception as exc:
                log.exception("the validator failed")
                result.append(NodeVerdict([f"the validator failed: {type(exc).__name__}: {exc}"]))

        worker = threading.Thread(target=run, daemon=True, name=f"hai-agent-{self.config.node}-validator")
        worker.start()
        worker.join(self.config.validation_timeout_s)
        if not result:
            return NodeVerdict([f"the validator did not finish within {self.config.validation_timeout_s:g} s"])
        return result[0]

    def validating(self) -> bool:
        """Whether a validator run is in progress."""
        with self._lock:
            return self._validation is not None and self._validation.is_alive()

    # -- reports ---------------------------------------------------------------------------------

    def _queue_report(self, key: TaskKey, body: Mapping[str, Any]) -> None:
        item = {"job_id": key[0], "task": key[1], **body}
        while not self._closing.is_set():
            try:
                self._reports.put(item, timeout=0.5)
                return
            except queue.Full:
                log.warning("report queue full; waiting to add %s", item)

    def _send_reports(self) -> None:
        while not self._closing.is_set():
            try:
                item = self._reports.get(timeout=0.2)
            except queue.Empty:
                continue
            self._send(item)

    def _send(self, item: Mapping[str, Any]) -> None:
        """Send one report until the server answers it (200, or 409: applied before or refused)."""
        delay = 0.1
        path = f"/agents/{self.config.node}/report"
        while not self._closing.is_set():
            try:
                response = self._report_http.post(path, json=dict(item))
            except httpx.HTTPError as exc:
                log.warning("report %s: %s; retrying in %.1f s", item, exc, delay)
            else:
                if response.status_code in (200, 409):
                    if response.status_code == 409:
                        log.info("report %s not applied: %s", item, response.text[:300])
                    return
                if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
                    log.error("report %s refused: %s %s", item, response.status_code, response.text[:300])
                    return
                log.warning("report %s: %s; retrying in %.1f s", item, response.status_code, delay)
            self._closing.wait(delay)
            delay = min(delay * 2, self.config.report_backoff_max_s)

    # -- views and shutdown ----------------------------------------------------------------------

    def held(self) -> list[TaskKey]:
        """The (job, task) pairs the agent holds now."""
        with self._lock:
            return sorted(self._tasks)

    def launcher(self, key: TaskKey) -> RankLauncher | None:
        with self._lock:
            task = self._tasks.get(key)
            return task.launcher if task is not None else None

    def request_stop(self) -> None:
        """Make :meth:`serve` return at its next turn (what SIGTERM does); :meth:`close` then
        kills the ranks."""
        self._closing.set()

    def close(self) -> None:
        """Stop heartbeating and reporting, kill every rank the agent started. Safe from any
        thread, more than once."""
        self._closing.set()
        with self._lock:
            tasks = list(self._tasks.values())
        for task in tasks:
            if task.launcher is not None:
                task.launcher.close()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(10.0)
        self._sender.join(10.0)
        with self._lock:
            validation = self._validation
        if validation is not None:
            validation.join(10.0)
        self._http.close()
        self._report_http.close()
        self._validation_http.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the command ----------------------------------------------------------------------------------


def _label(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a label is NAME=VALUE, not {text!r}")
    return name, value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number at least 0, not {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", required=True, help="the hai server's URL, e.g. http://10.0.0.1:8470")
    parser.add_argument("--node", required=True, help="this node's name")
    parser.add_argument("--zone", default="default")
    parser.add_argument("--group", default="default", help="the node group")
    parser.add_argument("--address", default="", help="the address other nodes reach this one at (MASTER_ADDR)")
    parser.add_argument("--label", action="append", type=_label, default=[], metavar="NAME=VALUE")
    parser.add_argument("--token-file", type=Path,
                        help="the agent token (the server's hai-agent.token); default $HAI_AGENT_TOKEN")
    fs3 = parser.add_mutually_exclusive_group()
    fs3.add_argument("--fs3", metavar="MGMTD", help="log to this fs3 cluster (token from $FS3_TOKEN)")
    fs3.add_argument("--profile", help="log to the fs3 cluster of this client profile")
    parser.add_argument("--log-dir", type=Path, help="log here when no fs3 cluster is given")
    parser.add_argument("--heartbeat-s", type=_positive, default=1.0)
    parser.add_argument("--ack-grace-s", type=_positive, default=5.0, help="a suspend's acknowledgement grace")
    parser.add_argument("--finish-grace-s", type=_positive, default=5.0, help="a suspend's exit grace")
    parser.add_argument("--http-timeout-s", type=_positive, default=10.0)
    parser.add_argument("--validate", action="store_true",
                        help="run hai validate's checks first; a failing node does not register (exit 1)")
    parser.add_argument("--validate-every-s", type=_non_negative, default=3600.0,
                        help="validate the node this often while it runs no job (0: only when the server asks)")
    parser.add_argument("--validation-timeout-s", type=_positive, default=1800.0,
                        help="a validator run longer than this counts as failed")
    parser.add_argument("--ready-file", type=Path,
                        help="once registered, write {pid, node} here as JSON (how hai local waits for it)")


def _validate(args: argparse.Namespace) -> NodeVerdict:
    """Run the validator: the reasons the node failed (none when it passed) and its measurements."""
    from hai import validate
    from hai.validation_rules import Thresholds, judge

    target = None
    if args.fs3:
        target = validate.Fs3Target(mgmtd=args.fs3, token=os.environ.get("FS3_TOKEN"))
    elif args.profile:
        target = validate.Fs3Target(profile=args.profile)
    measurements = validate.run_checks(validate.Sizes(), target)
    verdict = judge(measurements, Thresholds())
    summary = {f.name: float(v) for f in dataclasses.fields(measurements)
               if isinstance(v := getattr(measurements, f.name), (int, float)) and not isinstance(v, bool)}
    return NodeVerdict([] if verdict.ok else list(verdict.failures) or ["the validator failed"], summary)


def _sink(args: argparse.Namespace) -> LogSink:
    from hai.launcher import Fs3LogSink

    if args.fs3:
        return Fs3LogSink.connect(args.fs3, os.environ.get("FS3_TOKEN"))
    if args.profile:
        import fs3

        return Fs3LogSink(fs3.connect(profile=args.profile))
    return LocalLogSink(args.log_dir if args.log_dir is not None else Path("hai-logs"))


def _as_verdict(found: NodeVerdict | Sequence[str]) -> NodeVerdict:
    """A validator may give a :class:`NodeVerdict` or only the reasons the node failed."""
    return found if isinstance(found, NodeVerdict) else NodeVerdict(list(found))


def run(args: argparse.Namespace, *,
        validator: Callable[[argparse.Namespace], NodeVerdict | Sequence[str]] = _validate) -> int:
    """Exit status: 0 after a clean shutdown, 1 when the node failed validation or the server
    refused it, 2 bad usage."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            print(f"hai agent: cannot read the token: {exc}", file=sys.stderr)
            return 2
    else:
        token = os.environ.get("HAI_AGENT_TOKEN", "").strip()
    if not token:
        print("hai agent: no agent token (--token-file, or $HAI_AGENT_TOKEN)", file=sys.stderr)
        return 2
    try:
        config = AgentConfig(server=args.server, node=args.node, token=token, zone=args.zone, group=args.group,
                             address=args.address, labels=dict(args.label), heartbeat_s=args.heartbeat_s,
                             http_timeout_s=args.http_timeout_s, ack_grace_s=args.ack_grace_s,
                             finish_grace_s=args.finish_grace_s, fs3_mgmtd=args.fs3,
                             validate_every_s=args.validate_every_s, validation_timeout_s=args.validation_timeout_s)
    except ValueError as exc:
        print(f"hai agent: {exc}", file=sys.stderr)
        return 2
    if args.validate:
        failures = _as_verdict(validator(args)).reasons
        if failures:
            print(f"hai agent: {args.node} failed validation, not registering: " + "; ".join(failures),
                  file=sys.stderr)
            return 1
    agent = Agent(config, _sink(args), validator=lambda: _as_verdict(validator(args)))
    previous = {sig: signal.signal(sig, lambda *_: agent.request_stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    def registered() -> None:
        if args.ready_file is not None:
            tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(json.dumps({"pid": os.getpid(), "node": args.node}))
            os.replace(tmp, args.ready_file)

    try:
        agent.serve(registered)
    except AgentError as exc:
        print(f"hai agent: {exc}", file=sys.stderr)
        return 1
    finally:
        agent.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hai agent", description=(__doc__ or "").split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))

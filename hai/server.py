"""``hai server``: the HAI Platform's HTTP API and scheduling loop around :mod:`hai.rules`.

The server is a shell around the pure rules. Its state is a :class:`~hai.rules.ClusterState` kept
in the database through :mod:`hai.store` (SQLite in the cluster directory by default, any
SQLAlchemy URL), mirrored in memory. Every change goes the same way: a rules event (or one
scheduling pass) makes the next state, :meth:`Store.commit` writes it, and only then is the
in-memory copy replaced and anything announced, so whatever an agent or a user has been told is
already in the database.

**The loop** (:meth:`HaiServer.tick`, run every ``tick_interval_s`` by an asyncio task in the app's
lifespan, and called directly with virtual time by tests): ``check_timeouts`` → ``schedule`` →
``apply`` → commit. The pass's reasons for waiting jobs are kept for the queue view.

**Commands are derived, not queued.** What a node's agent must do is a function of the committed
state and of what the agent says it runs (its heartbeat lists ``(job, task)`` pairs): a task the
state has on the node and the agent does not run → ``launch`` (with the rendezvous numbers); a
suspending job's task it runs → ``suspend``; a task it runs that the state no longer has on the
node (finished elsewhere, stopped, failed over, lost node come back) → ``stop``. A restarted server
therefore re-sends everything still pending without a command table, and a repeated heartbeat gets
the same answer. Agent reports carry the task index, so a late or replayed report is refused by the
rules (409) and changes nothing.

**Node health** (:func:`hai.rules.node_health`): a node where a rank failed, or that was lost, needs
a validation. The heartbeat answer of an idle node that needs one carries ``validate``, derived
like the other commands; the agent reports ``started`` and then its verdict to
``POST /agents/{node}/validation`` (the agent's own schedule reports the same way), and the rules
put the node back or keep it out with the validator's sentences as the reason. The last verdict's
measurements (a bounded summary) are kept in memory for the node view, not in the database.

**Auth**: bearer tokens, stored as SHA-256 hashes in ``hai-users.toml`` in the cluster directory
(:class:`Users`), compared in constant time; users submit and manage their own jobs, admins also
set quotas and manage any job, and the agents' endpoints take the agent token. A job's ranks get
the submitting user's fs3 token from the user's record, never the cluster's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import shlex
import sys
import threading
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hai import dashboard, rules
from hai.rules import AUTO, Auto, ClusterState, Config, Decision, Job, JobSpec, JobState, Node, Priority, Wait
from hai.store import (
    ServerLock,
    Store,
    StoreConflictError,
    StoreError,
    StoreLimitError,
    StoreLockLostError,
    check_job_spec,
    check_node,
    default_url,
)

__all__ = [
    "ADDRESS_LABEL",
    "MAX_BODY_BYTES",
    "RANKS_ENV",
    "USERS_FILE",
    "HaiServer",
    "ServerConfig",
    "User",
    "Users",
    "add_arguments",
    "create_app",
    "hash_token",
    "master_port",
    "run",
]

log = logging.getLogger(__name__)

USERS_FILE = "hai-users.toml"
AGENT_TOKEN_FILE = "hai-agent.token"
DB_URL_ENV = "HAI_DB_URL"  # the database URL, out of the process list (it may carry a password)
MAX_BODY_BYTES = 1 << 20  # a job spec's command and environment are 64 KiB each at most
MAX_PAGE = 500  # entries per page of a list endpoint
MAX_ENV_LISTED = 16  # variables one job listing may ask to see of each job (GET /jobs?env=NAME)
MAX_RUNNING_REPORTED = 64  # (job, task) pairs one heartbeat may list; a node runs one job at a time
# Variables hai defines whose values any user may see (``hai ls --wide`` reads every job's state size).
PUBLIC_ENV = frozenset({"CHECKPOINT_BYTES"})
RANKS_ENV = "HAI_RANKS_PER_NODE"  # carried in the job's stored environment; the HAI_ prefix is the server's
ADDRESS_LABEL = "hai.address"  # the node's address for MASTER_ADDR, carried as a label
MAX_RANKS_PER_NODE = 1024
MAX_VALIDATION_REASONS = 16  # sentences one verdict may give; with MAX_REASON_CHARS, within the store's 4 KiB
MAX_REASON_CHARS = 200
MAX_SUMMARY_ENTRIES = 32  # measurements one verdict may carry, kept in memory per node
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PRIORITY_NAMES = (*Priority.__members__, AUTO.value)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")
# What the launcher sets for every rank (hai.launcher), so a job's environment cannot.
_RESERVED_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                           "FS3_TOKEN", "FS3_MGMTD"})


# -- users and tokens -----------------------------------------------------------------------------


def hash_token(token: str) -> str:
    """The stored form of a bearer token: SHA-256, hex. Tokens are 32 random bytes, so no salt or
    slow hash is needed (nothing to guess from the hash)."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class User:
    name: str
    token_sha256: str
    admin: bool = False
    fs3_token: str = ""  # handed to the user's jobs' ranks as FS3_TOKEN


# The server itself as a viewer (``HaiServer.job_view``): everything, as an admin sees it. Not a
# user of the users file (its name is no user name, and it has no token), so no request is it.
SYSTEM_VIEWER = User("(hai server)", "", admin=True)


@dataclass(frozen=True)
class Users:
    """Who may call the server: users by token hash, and the agents' token hash."""

    users: tuple[User, ...] = ()
    agent_token_sha256: str = ""

    @classmethod
    def load(cls, path: Path) -> Users:
        """Read ``hai-users.toml``::

            agent_token_sha256 = "<hex>"
            [users.alice]
            token_sha256 = "<hex>"
            admin = false
            fs3_token = "<alice's fs3 token>"
        """
        data = tomllib.loads(path.read_text())
        users: list[User] = []
        for name, entry in dict(data.get("users", {})).items():
            if not _NAME.fullmatch(name) or not isinstance(entry, dict):
                raise ValueError(f"{path}: bad user entry {name!r}")
            unknown = set(entry) - {"token_sha256", "admin", "fs3_token"}
            if unknown:
                raise ValueError(f"{path}: user {name}: unknown field {sorted(unknown)[0]!r}")
            users.append(User(name, str(entry["token_sha256"]), bool(entry.get("admin", False)),
                              str(entry.get("fs3_token", ""))))
        return cls(tuple(users), str(data.get("agent_token_sha256", "")))

    def dump(self) -> str:
        lines = [f'agent_token_sha256 = "{self.agent_token_sha256}"', ""]
        for user in self.users:
            lines += [f"[users.{user.name}]", f'token_sha256 = "{user.token_sha256}"',
                      f"admin = {'true' if user.admin else 'false'}", f"fs3_token = {_toml_string(user.fs3_token)}", ""]
        return "\n".join(lines)

    def user_for(self, token: str) -> User | None:
        """The user holding ``token``: every entry is compared, in constant time each."""
        presented = hash_token(token)
        found = None
        for user in self.users:
            if hmac.compare_digest(presented, user.token_sha256):
                found = user
        return found

    def is_agent(self, token: str) -> bool:
        return bool(self.agent_token_sha256) and hmac.compare_digest(hash_token(token), self.agent_token_sha256)

    def get(self, name: str) -> User | None:
        return next((u for u in self.users if u.name == name), None)


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def add_user(cluster_dir: Path, name: str, *, admin: bool = False, fs3_token: str = "") -> str:
    """Add (or re-key) a user in the cluster directory's users file; returns the new bearer token."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"user name {name!r} is not a plain name (letters, digits, . _ -, <= 64)")
    path = cluster_dir / USERS_FILE
    users = Users.load(path) if path.exists() else Users()
    token = secrets.token_urlsafe(32)
    kept = tuple(u for u in users.users if u.name != name)
    users = dataclasses.replace(users, users=(*kept, User(name, hash_token(token), admin, fs3_token)))
    _write_private(path, users.dump())
    return token


def ensure_agent_token(cluster_dir: Path) -> None:
    """Give a cluster directory an agent token if it has none: the plain token goes to
    ``hai-agent.token`` (mode 0600, read by the node agents), its hash to the users file."""
    path = cluster_dir / USERS_FILE
    users = Users.load(path) if path.exists() else Users()
    if users.agent_token_sha256:
        return
    token = secrets.token_urlsafe(32)
    _write_private(cluster_dir / AGENT_TOKEN_FILE, token + "\n")
    _write_private(path, dataclasses.replace(users, agent_token_sha256=hash_token(token)).dump())


ADMIN_TOKEN_ENV = "HAI_ADMIN_TOKEN"
AGENT_TOKEN_ENV = "HAI_AGENT_TOKEN"
ADMIN_FS3_TOKEN_ENV = "HAI_ADMIN_FS3_TOKEN"
ENV_TOKENS = (ADMIN_TOKEN_ENV, AGENT_TOKEN_ENV, ADMIN_FS3_TOKEN_ENV)


def tokens_from_environment(cluster_dir: Path, environ: Mapping[str, str]) -> None:
    """Tokens an operator hands the server in its environment (containers: docker-compose.yml, with
    ``--require-env-tokens``), so none is ever written into a file of the image or a command line:
    ``HAI_AGENT_TOKEN`` becomes the agent token (the agents read the same variable),
    ``HAI_ADMIN_TOKEN`` user ``admin``'s, whose jobs' ranks get ``HAI_ADMIN_FS3_TOKEN``: an fs3
    *user* token (``fs3u.<id>.<secret>``, made with ``fs3 admin user add``). Ranks act on fs3 as their
    user, with that user's permissions; the cluster token would make them a service that bypasses
    every permission, so one that is not a user token is refused (ValueError), and ``FS3_TOKEN`` is
    never read. Only the hai tokens' hashes reach the users file."""
    from fs3.local import is_user_token  # only this path needs it

    agent = environ.get(AGENT_TOKEN_ENV, "").strip()
    admin = environ.get(ADMIN_TOKEN_ENV, "").strip()
    admin_fs3 = environ.get(ADMIN_FS3_TOKEN_ENV, "").strip()
    if admin and not is_user_token(admin_fs3):
        raise ValueError(f"${ADMIN_FS3_TOKEN_ENV} is {'empty' if not admin_fs3 else 'not an fs3 user token'}: "
                         "the admin's ranks need an fs3 user token (fs3u.<id>.<secret>, made with "
                         "`fs3 admin user add NAME`), never the cluster token")
    path = cluster_dir / USERS_FILE
    users = Users.load(path) if path.exists() else Users()
    if agent:
        users = dataclasses.replace(users, agent_token_sha256=hash_token(agent))
    if admin:
        kept = tuple(u for u in users.users if u.name != "admin")
        users = dataclasses.replace(users, users=(*kept, User("admin", hash_token(admin), True, admin_fs3)))
    if agent or admin:
        _write_private(path, users.dump())


# -- the server -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    rules: Config = dataclasses.field(default_factory=Config)
    tick_interval_s: float = 1.0
    port_base: int = 29500  # MASTER_PORT is chosen per task in [port_base, port_base + port_span)
    port_span: int = 1000


def master_port(config: ServerConfig, job: Job) -> int:
    """The rendezvous port of a job's current task: a different one for each task of the chain (a
    resumed task must not meet the previous one's socket in TIME_WAIT), and for neighbouring jobs."""
    return config.port_base + (job.seq * 31 + job.task) % config.port_span


class Refused(Exception):
    """An event the state cannot take: 409 with the reason."""


class HaiServer:
    """The state, the store and the scheduling loop. Every mutation holds ``lock``."""

    def __init__(self, store: Store, users: Users, config: ServerConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.users = users
        self.config = config if config is not None else ServerConfig()
        self.clock = clock
        self.lock = threading.Lock()
        self.state = store.load()
        self.started_s = clock()
        self.waits: Mapping[str, Wait] = rules.schedule(self.state, clock(), self.config.rules).waits
        # node -> the last verdict its agent reported: bounded by the nodes and MAX_SUMMARY_ENTRIES.
        self.verdicts: dict[str, dict[str, Any]] = {}
        # The hold on the database (``hai server`` sets it; in-process tests may leave it None), and
        # why this server stopped scheduling if it lost that hold to another server ("": it has not).
        self.server_lock: ServerLock | None = None
        self.fenced = ""
        self.on_fenced: Callable[[], None] = lambda: None

    def close(self) -> None:
        self.store.close()

    def fence(self, reason: str) -> None:
        """Stop for good: another server holds the database now. Nothing more is committed (the
        store's generation check would refuse it anyway) and ``on_fenced`` ends the process."""
        with self.lock:
            self.fenced = reason
        log.error("%s", reason)
        self.on_fenced()

    def _commit(self, new: ClusterState) -> None:
        """Write ``new``, then adopt it. A conflict reloads what the database holds and refuses."""
        if self.fenced:
            raise StoreLockLostError(self.fenced)
        try:
            self.store.commit(self.state, new)
        except StoreConflictError:
            self.state = self.store.load()
            raise
        self.state = new

    def change(self, event: Callable[[ClusterState], ClusterState]) -> ClusterState:
        """Apply one rules event and commit it. A :class:`RuleError` becomes :class:`Refused`."""
        with self.lock:
            try:
                new = event(self.state)
            except rules.RuleError as error:
                raise Refused(str(error)) from error
            self._commit(new)
            return new

    def tick(self, now_s: float | None = None) -> Decision:
        """One turn of the loop: timeouts, one scheduling pass, apply, commit. For ``node_timeout_s``
        after the server starts, nothing times out: the agents must get the chance to reach a server
        that was down before their silence counts."""
        now = self.clock() if now_s is None else now_s
        with self.lock:
            state = self.state
            if now - self.started_s >= self.config.rules.node_timeout_s:
                state = rules.check_timeouts(state, now, self.config.rules)
            decision = rules.schedule(state, now, self.config.rules)
            new = rules.apply(state, decision)
            if new != self.state:
                self._commit(new)
            self.waits = decision.waits
        for p in decision.placements:
            log.info("placed %s on %s at %s", p.job_id, ",".join(p.nodes), p.priority.name)
        for s in decision.suspensions:
            log.info("suspending %s for %s", s.job_id, s.for_job)
        return decision

    # -- what a node must do ---------------------------------------------------------------------

    def commands(self, node: str, running: Iterable[tuple[str, int]]) -> list[dict[str, Any]]:
        """The node's pending commands, given the ``(job, task)`` pairs its agent runs: stops first
        (so a node's old task is gone before its next starts), then suspends, then launches; and
        ``validate`` for a node that needs a validation once it runs nothing."""
        state = self.state
        running = set(running)
        expected = {(j.job_id, j.task): j for j in state.jobs.values()
                    if j.state in (JobState.RUNNING, JobState.SUSPENDING) and node in j.assigned}
        out: list[dict[str, Any]] = []
        for job_id, task in sorted(running - set(expected)):
            out.append({"type": "stop", "job_id": job_id, "task": task})
        for (job_id, task), job in sorted(expected.items()):
            if job.state is JobState.SUSPENDING and (job_id, task) in running:
                out.append({"type": "suspend", "job_id": job_id, "task": task})
            elif job.state is JobState.RUNNING and (job_id, task) not in running:
                out.append(self.launch(job, node))
        found = state.nodes.get(node)
        if found is not None and found.validation is rules.Validation.NEEDED and not running and not expected:
            out.append({"type": "validate", "reason": found.unhealthy_reason})
        return out

    def launch(self, job: Job, node: str) -> dict[str, Any]:
        """A launch assignment for ``job``'s ranks on ``node``: the numbers of an env:// rendezvous."""
        env = dict(job.env)
        per_node = int(env.pop(RANKS_ENV, "1"))
        index = job.assigned.index(node)
        user = self.users.get(job.user)
        return {"type": "launch", "job_id": job.job_id, "task": job.task, "user": job.user,
                "command": job.command, "argv": shlex.split(job.command), "env": env,
                "master_addr": self.address(job.assigned[0]), "master_port": master_port(self.config, job),
                "world_size": len(job.assigned) * per_node, "first_rank": index * per_node,
                "local_world_size": per_node, "node_index": index,
                "fs3_token": user.fs3_token if user is not None else ""}

    def address(self, node: str) -> str:
        found = self.state.nodes.get(node)
        labels = dict(found.labels) if found is not None else {}
        return labels.get(ADDRESS_LABEL, node)

    # -- views -----------------------------------------------------------------------------------

    def job_view(self, job: Job, *, viewer: User, chain: bool = False,
                 env_names: frozenset[str] = frozenset()) -> dict[str, Any]:
        """A job as the API shows it; with ``chain``, also its command, environment and chain of tasks;
        with ``env_names``, those of its environment variables it has (a listing's ``env=``).

        A job's environment may carry its user's secrets (an API key for a metrics service, say), so
        a ``viewer`` who is neither the job's user nor an admin sees the variables' names with their
        values withheld (None), except the few hai itself defines and reads (:data:`PUBLIC_ENV`).
        ``viewer`` is required, so that no endpoint shows everything by forgetting it: where the
        server itself needs the whole view (the agents' calls), it passes :data:`SYSTEM_VIEWER`."""
        own = dict(job.env)
        per_node = int(own.pop(RANKS_ENV, "1"))
        env: dict[str, str | None] = dict(own)
        if viewer.name != job.user and not viewer.admin:
            env = {k: (v if k in PUBLIC_ENV else None) for k, v in own.items()}
        wait = self.waits.get(job.job_id) if job.state is JobState.QUEUED else None
        view: dict[str, Any] = {
            "job_id": job.job_id, "user": job.user, "group": job.group, "nodes": job.nodes,
            "ranks_per_node": per_node, "state": job.state.value,
            "requested": job.requested.value if isinstance(job.requested, Auto) else job.requested.name,
            "priority": None if job.priority is None else job.priority.name, "seq": job.seq,
            "assigned": list(job.assigned), "ended": [n for n, _ in job.ended], "task": job.task,
            "restarts": job.restarts, "not_before_s": job.not_before_s, "reason": str(wait) if wait else job.end_reason,
            "wait": wait.kind.value if wait else None}
        if env_names:
            view["env"] = {k: v for k, v in env.items() if k in env_names}
        if chain:
            view["command"] = job.command
            view["env"] = env
            view["chain"] = [{"task": r.index, "nodes": list(r.nodes), "started_s": r.started_s,
                              "ended_s": r.ended_s, "outcome": r.outcome} for r in job.history]
            if job.state in (JobState.RUNNING, JobState.SUSPENDING):
                view["chain"].append({"task": job.task, "nodes": list(job.assigned), "started_s": job.started_s,
                                      "ended_s": None, "outcome": job.state.value})
        return view

    def node_view(self, node: Node) -> dict[str, Any]:
        job = next((j.job_id for j in self.state.jobs.values()
                    if j.state in (JobState.RUNNING, JobState.SUSPENDING) and node.name in j.assigned), None)
        return {"name": node.name, "zone": node.zone, "group": node.group, "healthy": node.healthy,
                "health": rules.node_health(node), "reason": node.unhealthy_reason,
                "validation_failures": node.validation_failures, "last_validation": self.verdicts.get(node.name),
                "cpus": node.cpus, "memory_bytes": node.memory_bytes,
                "labels": dict(node.labels), "last_heartbeat_s": node.last_heartbeat_s, "job": job}


# -- request bodies -------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobIn(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=f"^{_NAME.pattern}$")
    command: str = Field(min_length=1, max_length=65536)
    nodes: int = Field(ge=1, le=100_000)
    ranks_per_node: int = Field(default=1, ge=1, le=MAX_RANKS_PER_NODE)
    priority: str = "NORMAL"
    group: str = Field(default="default", min_length=1, max_length=255)
    env: dict[str, str] = Field(default_factory=dict, max_length=255)


class QuotaIn(_Body):
    user: str = Field(min_length=1, max_length=255)
    group: str = Field(default="default", min_length=1, max_length=255)
    priority: str
    max_nodes: int = Field(ge=0, le=2**31 - 1)


class RegisterIn(_Body):
    name: str = Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # it is a path segment
    cpus: int = Field(default=0, ge=0, le=2**31 - 1)
    memory_bytes: int = Field(default=0, ge=0, le=2**63 - 1)
    zone: str = Field(default="default", min_length=1, max_length=255)
    group: str = Field(default="default", min_length=1, max_length=255)
    labels: dict[str, str] = Field(default_factory=dict, max_length=63)
    address: str = Field(default="", max_length=255)


class RunningTask(_Body):
    job_id: str = Field(max_length=255)
    task: int = Field(ge=0)
    progress: bool = False  # the ranks wrote output since the last heartbeat: the job's watchdog restarts


class HeartbeatIn(_Body):
    running: list[RunningTask] = Field(default_factory=list, max_length=MAX_RUNNING_REPORTED)


class ReportIn(_Body):
    job_id: str = Field(max_length=255)
    task: int = Field(ge=0)
    event: Literal["started", "finished", "failed", "suspended", "stopped"]
    exit_code: int | None = None
    reason: str = Field(default="", max_length=1024)


class ValidationIn(_Body):
    """A validator's start (``started``), or its verdict (``result``): whether it passed, the
    sentences that say why not, and a summary of its measurements (name -> number)."""

    event: Literal["started", "result"] = "result"
    passed: bool | None = None
    reasons: list[Annotated[str, Field(max_length=MAX_REASON_CHARS)]] = Field(
        default_factory=list, max_length=MAX_VALIDATION_REASONS)
    summary: dict[Annotated[str, Field(max_length=64)], Annotated[float, Field(allow_inf_nan=False)]] = Field(
        default_factory=dict, max_length=MAX_SUMMARY_ENTRIES)


# -- the app --------------------------------------------------------------------------------------


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413: by Content-Length, or while reading a
    streamed body, which is read whole (at most ``limit`` bytes held) before the app sees it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await _too_large(self.limit)(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await _too_large(self.limit)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse({"detail": f"request body over {limit} bytes"}, status_code=413)


def _field_errors(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        loc = [str(x) for x in item.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        if item.get("type") == "extra_forbidden":
            parts.append(f"unknown field {where!r}")
        else:
            parts.append(f"{where}: {item.get('msg', 'invalid')}")
    return "; ".join(parts)


def _priority(name: str, what: str) -> Priority | Auto:
    if name == AUTO.value:
        return AUTO
    if name in Priority.__members__:
        return Priority[name]
    raise HTTPException(422, f"{what}: unknown priority {name!r} (one of {', '.join(_PRIORITY_NAMES)})")


_bearer = HTTPBearer(auto_error=False)
_Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _users(request: Request) -> Users:
    server: HaiServer = request.app.state.hai
    return server.users


def _user(request: Request, credentials: _Credentials) -> User:
    if credentials is None:
        raise HTTPException(401, "no bearer token", headers={"WWW-Authenticate": "Bearer"})
    found = _users(request).user_for(credentials.credentials)
    if found is None:
        raise HTTPException(401, "unknown token", headers={"WWW-Authenticate": "Bearer"})
    return found


def _agent(request: Request, credentials: _Credentials) -> None:
    if credentials is None or not _users(request).is_agent(credentials.credentials):
        raise HTTPException(401, "agent endpoints need the agent token", headers={"WWW-Authenticate": "Bearer"})


def _admin(caller: Annotated[User, Depends(_user)]) -> User:
    if not caller.admin:
        raise HTTPException(403, "admins only")
    return caller


Caller = Annotated[User, Depends(_user)]
Admin = Annotated[User, Depends(_admin)]


def create_app(server: HaiServer, *, run_loop: bool = True, logs: dashboard.LogReader | None = None) -> FastAPI:
    """The ASGI app, with the web dashboard (:mod:`hai.dashboard`) under ``/dashboard/``, which shows
    ranks' logs through ``logs`` when given. With ``run_loop`` the lifespan runs
    :meth:`HaiServer.tick` every ``tick_interval_s``; tests leave it off and tick with virtual time."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_loop(server)) if run_loop else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    app = FastAPI(title="hai server", lifespan=lifespan)
    app.state.hai = server
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    agent_only = [Depends(_agent)]
    dashboard.add_routes(app, server, logs)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _field_errors(error)}, status_code=422)

    @app.exception_handler(Refused)
    async def _refused(_request: Request, error: Refused) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=409)

    @app.exception_handler(StoreLimitError)
    async def _limit(_request: Request, error: StoreLimitError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=422)

    @app.exception_handler(StoreConflictError)
    async def _conflict(_request: Request, error: StoreConflictError) -> JSONResponse:
        return JSONResponse({"detail": f"database conflict, state reloaded: {error}"}, status_code=503)

    @app.exception_handler(StoreError)
    async def _unavailable(_request: Request, error: StoreError) -> JSONResponse:
        # The database is down or refused the commit (nothing was written): say so, 503 like a
        # conflict, so that `hai` prints why and the agents retry, instead of a bare 500. Its
        # message is the driver's, one line, with no statement values and no password.
        log.warning("database: %s", error)
        return JSONResponse({"detail": f"database unavailable, nothing was written: {error}"}, status_code=503)

    def own_job(job_id: str, caller: User) -> Job:
        job = server.state.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        if job.user != caller.name and not caller.admin:
            raise HTTPException(403, f"job {job_id} belongs to another user")
        return job

    # -- users -----------------------------------------------------------------------------------

    @app.post("/jobs", status_code=201)
    def submit(body: JobIn, caller: Caller) -> dict[str, Any]:
        priority = _priority(body.priority, "priority")
        try:
            if not shlex.split(body.command):
                raise ValueError("empty")
        except ValueError as error:
            raise HTTPException(422, f"command: not a command line ({error})") from error
        for name in body.env:
            if not _ENV_NAME.fullmatch(name):
                raise HTTPException(422, f"env: {name[:64]!r} is not a variable name (letters, digits, _)")
            if name.startswith("HAI_") or name in _RESERVED_ENV:
                raise HTTPException(422, f"env: {name} is set by hai, not by the job")
        env = (*sorted(body.env.items()), (RANKS_ENV, str(body.ranks_per_node)))

        job_ids: list[str] = []

        def event(state: ClusterState) -> ClusterState:
            # The name, then the submit sequence: unique, since the part after the last '-' is the sequence.
            spec = JobSpec(job_id=f"{body.name}-{state.next_seq}", user=caller.name, nodes=body.nodes,
                           priority=priority, group=body.group, command=body.command, env=env)
            check_job_spec(spec)
            job_ids.append(spec.job_id)
            return rules.submit(state, spec, server.clock())

        new = server.change(event)
        return server.job_view(new.jobs[job_ids[-1]], chain=True, viewer=caller)

    @app.get("/jobs")
    def list_jobs(caller: Caller, state: Annotated[str | None, Query(max_length=16)] = None,
                  mine: bool = False, offset: Annotated[int, Query(ge=0)] = 0,
                  limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
                  env: Annotated[list[str] | None, Query()] = None) -> dict[str, Any]:
        """The queue and running jobs by default (``state=all`` for every job), in queue order. Each
        ``env=NAME`` adds that variable of each job's environment to its view (``"env": {NAME: value}``,
        where the job has it), so a listing that needs one variable of every job (``hai ls --wide``:
        the checkpoint size) is one request, not one per job. Another user's values are withheld
        (see :meth:`HaiServer.job_view`), as they are by ``GET /jobs/ID``."""
        names = env or []
        if len(names) > MAX_ENV_LISTED:
            raise HTTPException(422, f"env: {len(names)} variables, at most {MAX_ENV_LISTED}")
        for name in names:
            if not _ENV_NAME.fullmatch(name):
                raise HTTPException(422, f"env: {name[:64]!r} is not a variable name (letters, digits, _)")
        env_names = frozenset(names)
        waits = server.waits

        def level(job: Job) -> Priority:
            wait = waits.get(job.job_id)
            return wait.priority if wait is not None else job.priority or Priority.LOW

        jobs = sorted(server.state.jobs.values(), key=lambda j: rules.rank_key(level(j), j.seq))
        if state is None:
            jobs = [j for j in jobs if j.state not in (JobState.FINISHED, JobState.FAILED)]
        elif state != "all":
            jobs = [j for j in jobs if j.state.value == state]
        if mine:
            jobs = [j for j in jobs if j.user == caller.name]
        page = jobs[offset:offset + limit]
        return {"jobs": [server.job_view(j, env_names=env_names, viewer=caller) for j in page],
                "total": len(jobs), "offset": offset,
                "next_offset": offset + len(page) if offset + len(page) < len(jobs) else None}

    @app.get("/jobs/{job_id}")
    def show_job(job_id: str, caller: Caller) -> dict[str, Any]:
        job = server.state.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return server.job_view(job, chain=True, viewer=caller)

    @app.post("/jobs/{job_id}/suspend")
    def suspend(job_id: str, caller: Caller) -> dict[str, Any]:
        own_job(job_id, caller)
        new = server.change(lambda s: rules.request_suspend(s, job_id))
        return server.job_view(new.jobs[job_id], chain=True, viewer=caller)

    @app.post("/jobs/{job_id}/stop")
    def stop(job_id: str, caller: Caller) -> dict[str, Any]:
        own_job(job_id, caller)
        new = server.change(lambda s: _stop(s, job_id, server.clock(), caller.name))
        return server.job_view(new.jobs[job_id], chain=True, viewer=caller)

    @app.get("/nodes")
    def nodes(_caller: Caller, offset: Annotated[int, Query(ge=0)] = 0,
              limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE) -> dict[str, Any]:
        names = sorted(server.state.nodes)
        page = names[offset:offset + limit]
        return {"nodes": [server.node_view(server.state.nodes[n]) for n in page], "total": len(names),
                "offset": offset, "next_offset": offset + len(page) if offset + len(page) < len(names) else None}

    @app.post("/nodes/{name}/healthy")
    def heal(name: str, _admin: Admin) -> dict[str, Any]:
        new = server.change(lambda s: rules.node_healthy(s, name, server.clock()))
        return server.node_view(new.nodes[name])

    @app.get("/quota")
    def quota(caller: Caller) -> dict[str, Any]:
        state = server.state
        entries = [{"user": u, "group": g, "priority": p.name, "max_nodes": n,
                    "used": rules.quota_used(state, u, g, p)}
                   for (u, g, p), n in sorted(state.quotas.items()) if caller.admin or u == caller.name]
        return {"quotas": entries[:MAX_PAGE], "total": len(entries),
                "default_quota_nodes": server.config.rules.default_quota_nodes}

    @app.put("/quota")
    def set_quota(body: QuotaIn, _admin: Admin) -> dict[str, Any]:
        priority = _priority(body.priority, "priority")
        if not isinstance(priority, Priority):
            raise HTTPException(422, "priority: a quota is set per level, not AUTO")
        server.change(lambda s: rules.set_quota(s, rules.Quota(body.user, body.group, priority, body.max_nodes)))
        return {"user": body.user, "group": body.group, "priority": priority.name, "max_nodes": body.max_nodes}

    # -- agents ----------------------------------------------------------------------------------

    @app.post("/agents/register", dependencies=agent_only)
    def register(body: RegisterIn) -> dict[str, Any]:
        labels = {k: v for k, v in body.labels.items() if k != ADDRESS_LABEL}
        labels[ADDRESS_LABEL] = body.address or body.name
        node = Node(name=body.name, zone=body.zone, group=body.group, last_heartbeat_s=server.clock(),
                    cpus=body.cpus, memory_bytes=body.memory_bytes, labels=tuple(sorted(labels.items())))
        check_node(node)
        new = server.change(lambda s: rules.add_node(s, node))
        return server.node_view(new.nodes[body.name])

    @app.post("/agents/{node}/heartbeat", dependencies=agent_only)
    def heartbeat(node: str, body: HeartbeatIn) -> dict[str, Any]:
        if node not in server.state.nodes:
            raise HTTPException(404, f"no node {node}: register first")
        now = server.clock()

        def event(state: ClusterState) -> ClusterState:
            state = rules.node_heartbeat(state, node, now)
            for r in body.running:
                job = state.jobs.get(r.job_id)
                if r.progress and job is not None and job.task == r.task and node in job.assigned \
                        and job.state in (JobState.RUNNING, JobState.SUSPENDING):
                    state = rules.job_progress(state, r.job_id, now)
            return state

        server.change(event)
        with server.lock:
            commands = server.commands(node, ((r.job_id, r.task) for r in body.running))
        return {"node": node, "commands": commands}

    @app.post("/agents/{node}/validation", dependencies=agent_only)
    def validation(node: str, body: ValidationIn) -> dict[str, Any]:
        if node not in server.state.nodes:
            raise HTTPException(404, f"no node {node}: register first")
        now = server.clock()
        if body.event == "started":
            new = server.change(lambda s: rules.validation_started(s, node, now))
        else:
            if body.passed is None:
                raise HTTPException(422, "passed: a verdict says whether the node passed")
            passed = body.passed
            new = server.change(lambda s: rules.validation_result(s, node, passed, body.reasons, now,
                                                                  server.config.rules))
            with server.lock:
                if node in server.state.nodes:
                    server.verdicts[node] = {"passed": passed, "at_s": now, "reasons": list(body.reasons),
                                             "summary": dict(body.summary)}
                for gone in set(server.verdicts) - set(server.state.nodes):
                    del server.verdicts[gone]
            level = logging.INFO if passed else logging.WARNING
            log.log(level, "node %s %s validation%s", node, "passed" if passed else "failed",
                    f": {'; '.join(body.reasons)}" if body.reasons else "")
        return server.node_view(new.nodes[node])

    @app.post("/agents/{node}/report", dependencies=agent_only)
    def report(node: str, body: ReportIn) -> dict[str, Any]:
        now = server.clock()
        changed: list[bool] = []

        def event(state: ClusterState) -> ClusterState:
            new = _report(state, node, body, now, server.config.rules)
            changed.append(new is not state)
            return new

        new = server.change(event)
        return {"job": server.job_view(new.jobs[body.job_id], viewer=SYSTEM_VIEWER), "applied": changed[-1]}

    return app


def _holding(state: ClusterState, node: str, job_id: str, task: int) -> Job:
    job = state.jobs.get(job_id)
    if job is None:
        raise rules.RuleError(f"no job {job_id}")
    if job.task != task or job.state not in (JobState.RUNNING, JobState.SUSPENDING):
        raise rules.RuleError(f"job {job_id} is {job.state.value} at task {job.task}; the report is for task {task}")
    if node not in job.assigned:
        raise rules.RuleError(f"node {node} is not one of job {job_id}'s nodes")
    return job


def _report(state: ClusterState, node: str, body: ReportIn, now: float, config: Config) -> ClusterState:
    """An agent's report as a rules event. Every node's end counts: the task ends once each of
    the job's nodes has reported the end of its ranks (:func:`hai.rules.finish` with ``node``), and
    a node's repeated report changes nothing ("applied": false). A failure on any node ends the task
    at once, and that node then needs a validation before it takes work."""
    _holding(state, node, body.job_id, body.task)
    if body.event == "started":
        return rules.job_progress(state, body.job_id, now)
    if body.event == "failed":
        code = "unknown" if body.exit_code is None else str(body.exit_code)
        reason = f"rank exited {code} on {node}" + (f": {body.reason}" if body.reason else "")
        return rules.fail_job(state, body.job_id, now, config, reason, bad_node=node, task=body.task)
    if body.event == "finished":
        return rules.finish(state, body.job_id, now, task=body.task, node=node)
    if body.event == "suspended":
        return rules.suspend_acknowledged(state, body.job_id, now, task=body.task, node=node)
    raise rules.RuleError(f"job {body.job_id} was not stopped by hai; report its end as finished or failed")


def _stop(state: ClusterState, job_id: str, now: float, by: str) -> ClusterState:
    """A user's stop: the job ends (failed, "stopped by <user>") whatever it was doing; its nodes are
    free at once and the agents are told to kill its ranks at their next heartbeat."""
    job = state.jobs.get(job_id)
    if job is None:
        raise rules.RuleError(f"no job {job_id}")
    if job.state in (JobState.FINISHED, JobState.FAILED):
        raise rules.RuleError(f"job {job_id} has already ended ({job.state.value})")
    reason = f"stopped by {by}"
    history = job.history
    ran = job.ran_s
    if job.state in (JobState.RUNNING, JobState.SUSPENDING):
        history = (*history, rules.TaskRecord(job.task, job.assigned, job.started_s, now, reason))
        ran += max(0.0, now - job.started_s)
    ended = dataclasses.replace(job, state=JobState.FAILED, assigned=(), charged=None, ran_s=ran,
                                history=history, end_reason=reason)
    return dataclasses.replace(state, jobs={**state.jobs, job_id: ended})


async def _loop(server: HaiServer) -> None:
    while True:
        if server.server_lock is not None:  # still this database's one server? (a restart drops the lock)
            try:
                await asyncio.to_thread(server.server_lock.check)
            except StoreLockLostError as error:
                server.fence(f"hai server: {error}")
                return
        try:
            await asyncio.to_thread(server.tick)
        except Exception:  # a failed pass is logged and retried at the next tick; the server stays up
            log.exception("scheduling pass failed")
        await asyncio.sleep(server.config.tick_interval_s)


# -- the command ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, type=Path, help="the cluster directory (database, users file)")
    parser.add_argument("--db-url", "--db", dest="db_url", default=os.environ.get(DB_URL_ENV) or None,
                        metavar="URL",
                        help=f"the database: a SQLAlchemy URL, e.g. postgresql://hai@db.example/hai (default: "
                             f"${DB_URL_ENV}, else SQLite in --dir). A password is better kept out of the command "
                             "line: PGPASSWORD, ~/.pgpass, or the URL in the environment")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8470, help="0: any free port (see --ready-file)")
    parser.add_argument("--default-quota-nodes", type=int, default=0,
                        help="quota of a (user, group, priority) without an entry (default 0)")
    parser.add_argument("--tick-interval-s", type=float, default=1.0)
    parser.add_argument("--node-timeout-s", type=float, default=Config.node_timeout_s,
                        help="a node whose agent is silent this long is lost, its job restarted elsewhere")
    parser.add_argument("--backoff-base-s", type=float, default=Config.backoff_base_s,
                        help="the first restart back-off of a failed job (doubling per restart)")
    parser.add_argument("--watchdog-s", type=float, default=Config.watchdog_s,
                        help="a running job that writes no output this long has failed")
    parser.add_argument("--add-user", metavar="NAME", help="add a user (or give it a new token), print the token, exit")
    parser.add_argument("--admin", action="store_true", help="with --add-user: the user is an admin")
    parser.add_argument("--fs3-token", default="", help="with --add-user: the fs3 token the user's jobs get")
    parser.add_argument("--require-env-tokens", action="store_true",
                        help=f"take the tokens from ${ADMIN_TOKEN_ENV}, ${AGENT_TOKEN_ENV} and ${ADMIN_FS3_TOKEN_ENV} "
                             "(all required; containers: no token in a file). Without it the environment is "
                             "not read")
    parser.add_argument("--ready-file", type=Path,
                        help="once serving, write {pid, http: HOST:PORT} here as JSON (how hai local finds it)")
    logs = parser.add_mutually_exclusive_group()
    logs.add_argument("--fs3", metavar="MGMTD",
                      help="the dashboard reads ranks' logs from this fs3 cluster (token from $FS3_TOKEN)")
    logs.add_argument("--profile", help="the dashboard reads ranks' logs from the fs3 cluster of this client profile")
    logs.add_argument("--log-dir", type=Path, help="the dashboard reads ranks' logs from this directory (agents "
                      "started with the same --log-dir on this host)")


def _log_reader(args: argparse.Namespace) -> dashboard.LogReader | None:
    """Where the dashboard reads logs: fs3 when given (connected on first use, so the server starts
    while fs3 is down), else a directory, else nowhere (the job page says so)."""
    options: dict[str, Any] = {"rpc_timeout_ms": 10_000, "retry_total_ms": 10_000}
    if args.fs3 or args.profile:
        def connect() -> Any:
            import fs3

            if args.fs3:
                return fs3.connect(args.fs3, token=os.environ.get("FS3_TOKEN"), **options)
            return fs3.connect(profile=args.profile, **options)

        return dashboard.Fs3LogReader(connect)
    if args.log_dir is not None:
        return dashboard.LocalLogReader(args.log_dir)
    return None


def run(args: argparse.Namespace) -> int:
    cluster_dir: Path = args.dir
    cluster_dir.mkdir(parents=True, exist_ok=True)
    if args.add_user:
        print(add_user(cluster_dir, args.add_user, admin=args.admin, fs3_token=args.fs3_token))
        return 0
    if args.require_env_tokens:
        missing = [name for name in ENV_TOKENS if not os.environ.get(name, "").strip()]
        if missing:
            print(f"hai server: --require-env-tokens: set {', '.join(missing)} (the hai tokens: a secret "
                  f"each, e.g. openssl rand -hex 32; ${ADMIN_FS3_TOKEN_ENV}: the admin's fs3 user token, "
                  "from fs3 admin user add)", file=sys.stderr)
            return 2
    import uvicorn  # only the command needs the HTTP server itself

    try:
        rules_config = Config(default_quota_nodes=args.default_quota_nodes, node_timeout_s=args.node_timeout_s,
                              backoff_base_s=args.backoff_base_s, watchdog_s=args.watchdog_s)
    except ValueError as exc:
        print(f"hai server: {exc}", file=sys.stderr)
        return 2
    config = ServerConfig(rules=rules_config, tick_interval_s=args.tick_interval_s)
    try:
        store = Store.open(args.db_url or default_url(cluster_dir))
    except StoreError as error:  # its message shows the URL without the password
        print(f"hai server: {error}", file=sys.stderr)
        return 1
    try:
        # Before anything is written (users file, state): a second server must change nothing.
        server_lock = ServerLock.acquire(store)
    except StoreError as error:
        store.close()
        print(f"hai server: {error}", file=sys.stderr)
        return 1
    try:
        return _run_locked(args, cluster_dir, store, server_lock, config, uvicorn)
    finally:
        server_lock.release()


def _run_locked(args: argparse.Namespace, cluster_dir: Path, store: Store, server_lock: ServerLock,
                config: ServerConfig, uvicorn: Any) -> int:
    """The server, once it holds its database. 1 when it stopped because another server took it."""
    if args.require_env_tokens:
        try:
            tokens_from_environment(cluster_dir, os.environ)
        except ValueError as error:
            store.close()
            print(f"hai server: {error}", file=sys.stderr)
            return 2
    ensure_agent_token(cluster_dir)
    log.info("state in %s", store.engine.url.render_as_string(hide_password=True))
    server = HaiServer(store, Users.load(cluster_dir / USERS_FILE), config)
    server.server_lock = server_lock
    logs = _log_reader(args)
    app = create_app(server, logs=logs)
    serving: list[Any] = []  # the uvicorn server, once made: a fenced server asks it to shut down

    def shut_down() -> None:
        for http in serving:
            http.should_exit = True

    server.on_fenced = shut_down
    try:
        if args.ready_file is None:
            http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
            serving.append(http)
            http.run()
        else:
            _serve_with_ready_file(uvicorn, app, args.host, args.port, args.ready_file, serving)
    finally:
        server.close()
        if isinstance(logs, dashboard.Fs3LogReader):
            logs.close()
    return 1 if server.fenced else 0


def _serve_with_ready_file(uvicorn: Any, app: FastAPI, host: str, port: int, ready_file: Path,
                           serving: list[Any]) -> None:
    """Serve on ``host:port`` (0: a free port, never racing another program for one) and write the
    ready file once the app has started, so a launcher waits for the file instead of polling.
    The uvicorn server goes into ``serving``."""
    import socket

    sock = socket.create_server((host, port), reuse_port=False)
    bound_host, bound_port = sock.getsockname()[:2]

    class Server(uvicorn.Server):  # type: ignore[misc]
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            tmp = ready_file.with_name(ready_file.name + ".tmp")
            _write_private(tmp, json.dumps({"pid": os.getpid(), "http": f"{bound_host}:{bound_port}"}))
            os.replace(tmp, ready_file)

    http = Server(uvicorn.Config(app, log_level="info"))
    serving.append(http)
    http.run(sockets=[sock])


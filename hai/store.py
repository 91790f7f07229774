"""The HAI server's state in a database, through one SQL layer (SQLAlchemy 2 Core).

The server keeps its :class:`~hai.rules.ClusterState` here: nodes, quotas, jobs with their specs,
queue positions, restarts and back-off, and each job's chain of tasks, plus the counter that hands
out submit sequences. :meth:`Store.load` returns exactly the state last committed;
:meth:`Store.commit` writes the difference between two states in one transaction, so a server that
dies mid-commit comes back to the state before it. The default is a SQLite file in the cluster
directory (:func:`default_url`); any SQLAlchemy URL works, and the schema and every statement are
portable SQL (no SQLite-only types or statements), so PostgreSQL serves a real deployment
(``postgresql://user@host/db``, driven by psycopg 3; the test suite runs on both).

What the store needs of the database, and how each engine gives it: a load is one consistent
snapshot (SQLite: one read transaction; PostgreSQL: a REPEATABLE READ, read-only transaction, since
READ COMMITTED would give each SELECT its own snapshot); commits are serialized by the generation
row, which every commit updates first (SQLite: one writer at a time; PostgreSQL: the row lock, and a
second writer's ``WHERE value = <generation>`` is re-checked against the committed row, so it
matches nothing and the commit is refused as a conflict, never mixed in); schema creation in an
empty database is serialized by an advisory lock on PostgreSQL. A transaction the server aborts as
a serialization failure or a deadlock is retried a bounded number of times (:data:`RETRIES`).

What a user can size is bounded before anything is written (:data:`LIMITS`): names, a job's command
line and environment, a node's labels, reasons. An input past a limit raises
:class:`StoreLimitError` naming the field, the size and the limit, and the transaction is not begun.

A database carries its schema version in ``hai_meta``; an empty database gets the current schema, and
one of a newer version is refused (:class:`StoreVersionError`) rather than misread. An older one is
upgraded in place when opened, in the transaction that reads its version (:data:`_UPGRADES`): version
2 added ``hai_jobs.ended``, the nodes that reported the end of the current task's ranks (a version-1
row gets ``[]``: no node has reported, which is what a version-1 server's running job meant); version
3 added the nodes' validation columns (an older node reads as having nothing pending, so a node it
held unhealthy still waits for an admin). Each commit also
bumps a generation number, checked against the one this store last saw: two servers writing the same
database, or a commit from a stale state, fail with :class:`StoreConflictError` instead of mixing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Connection,
    Double,
    Engine,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    RowMapping,
    String,
    Table,
    Text,
    create_engine,
    delete,
    event,
    insert,
    inspect,
    make_url,
    select,
    text,
    update,
)
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError
from sqlalchemy.pool import NullPool

from hai.rules import AUTO, Auto, ClusterState, Job, JobSpec, JobState, Node, Priority, TaskRecord, Validation

__all__ = [
    "LIMITS",
    "SCHEMA_VERSION",
    "Limits",
    "ServerLock",
    "Store",
    "StoreConflictError",
    "StoreCorruptError",
    "StoreError",
    "StoreLimitError",
    "StoreLockLostError",
    "StoreLockedError",
    "StoreVersionError",
    "check_job_spec",
    "check_node",
    "default_url",
    "engine_url",
]

SCHEMA_VERSION = 3
DB_FILE = "hai.db"


class StoreError(RuntimeError):
    """Something about the database itself: its version, its contents, another writer."""


class StoreVersionError(StoreError):
    """The database is of a schema this code does not know (newer, or not a hai database)."""


class StoreCorruptError(StoreError):
    """A row that no commit could have written: an unknown state or priority, a malformed list."""


class StoreConflictError(StoreError):
    """The database is not at the state this store last saw: another writer, or a stale ``old``."""


class StoreLimitError(ValueError):
    """A user-sized field past its limit; nothing was written."""


@dataclass(frozen=True)
class Limits:
    """What the store accepts. Columns are sized to match, so PostgreSQL and SQLite refuse alike."""

    name_chars: int = 255  # job ids, users, node names, zones, groups
    command_chars: int = 65536
    env_vars: int = 256
    env_name_chars: int = 255
    env_total_chars: int = 65536  # names and values together
    labels: int = 64
    label_name_chars: int = 63
    label_value_chars: int = 255
    reason_chars: int = 4096  # task outcomes, a failed job's reason, an unhealthy node's reason


LIMITS = Limits()
_INT32 = 2**31 - 1
_INT64 = 2**63 - 1


def default_url(cluster_dir: str | Path) -> str:
    """The SQLite database in a cluster directory: ``sqlite:///<dir>/hai.db``."""
    return f"sqlite:///{Path(cluster_dir).resolve() / DB_FILE}"


def engine_url(url: str | URL) -> URL:
    """``url`` with its driver made explicit: a bare ``postgresql://`` (or ``postgres://``) URL
    means psycopg 3, the driver hai installs (SQLAlchemy's own default for it is psycopg2)."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


# PostgreSQL: transient aborts worth retrying (serialization failure, deadlock detected), how many
# times, and the first pause (doubled each time). A commit rolled back by the server wrote nothing,
# so running it again is safe; the generation check then decides whether it still applies.
_RETRY_SQLSTATES = frozenset({"40001", "40P01"})
RETRIES = 3
_RETRY_PAUSE_S = 0.05
# PostgreSQL pool: the server's request threads and its loop share a few connections; a connection
# the database dropped (a restart, an idle timeout) is found by a ping before use, not by a failure.
_PG_POOL: dict[str, Any] = {"pool_size": 4, "max_overflow": 4, "pool_timeout": 30, "pool_recycle": 1800,
                            "pool_pre_ping": True}
_PG_CONNECT_TIMEOUT_S = 10
_SCHEMA_LOCK = 0x6861690001  # pg_advisory_xact_lock key: one Store.open creates the schema at a time
_T = TypeVar("_T")


def _retrying(attempt: Callable[[], _T]) -> _T:
    """Run ``attempt`` again when PostgreSQL aborted it as a serialization failure or deadlock."""
    for tries in range(RETRIES + 1):
        try:
            return attempt()
        except DBAPIError as error:
            if getattr(error.orig, "sqlstate", None) not in _RETRY_SQLSTATES or tries == RETRIES:
                raise
            time.sleep(_RETRY_PAUSE_S * 2 ** tries)
    raise AssertionError("unreachable")


# -- schema ---------------------------------------------------------------------------------------

_metadata = MetaData(naming_convention={
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
})

_NAME = LIMITS.name_chars

# key -> value: "schema_version", "next_seq" (the next job's submit sequence), "generation".
meta_table = Table(
    "hai_meta", _metadata,
    Column("key", String(64), primary_key=True),
    Column("value", BigInteger, nullable=False),
)

nodes_table = Table(
    "hai_nodes", _metadata,
    Column("name", String(_NAME), primary_key=True),
    Column("zone", String(_NAME), nullable=False),
    Column("node_group", String(_NAME), nullable=False),
    Column("cpus", Integer, nullable=False),
    Column("memory_bytes", BigInteger, nullable=False),
    Column("labels", JSON, nullable=False),  # [[name, value], ...]
    Column("healthy", Boolean, nullable=False),
    Column("last_heartbeat_s", Double, nullable=False),
    Column("unhealthy_reason", Text, nullable=False),
    # Schema version 2. The defaults are what a version-1 node means: nothing pending, no failures.
    Column("validation", String(16), nullable=False, server_default=Validation.NONE.value),
    Column("validation_failures", Integer, nullable=False, server_default="0"),
)

# Statements that bring a database of version N (the key) to N + 1, run in the transaction that
# opens it. Portable SQL: a column added with a default that every existing row takes.

quotas_table = Table(
    "hai_quotas", _metadata,
    Column("user_name", String(_NAME), primary_key=True),
    Column("node_group", String(_NAME), primary_key=True),
    Column("priority", Integer, primary_key=True),
    Column("max_nodes", Integer, nullable=False),
)

jobs_table = Table(
    "hai_jobs", _metadata,
    Column("job_id", String(_NAME), primary_key=True),
    Column("seq", BigInteger, nullable=False, unique=True),  # queue position within a priority
    Column("state", String(16), nullable=False),
    Column("user_name", String(_NAME), nullable=False),
    Column("node_group", String(_NAME), nullable=False),
    Column("nodes", Integer, nullable=False),
    Column("requested", String(16), nullable=False),  # a Priority name, or AUTO
    Column("priority", Integer, nullable=True),  # effective level; NULL: AUTO not resolved yet
    Column("charged", Integer, nullable=True),
    Column("demoted", Boolean, nullable=False),
    Column("assigned", JSON, nullable=False),  # the placement: [node, ...]
    Column("task", Integer, nullable=False),
    Column("restarts", Integer, nullable=False),
    Column("not_before_s", Double, nullable=False),  # back-off
    Column("started_s", Double, nullable=False),
    Column("ran_s", Double, nullable=False),
    Column("last_progress_s", Double, nullable=False),
    Column("end_reason", Text, nullable=False),
    Column("command", Text, nullable=False),
    Column("env", JSON, nullable=False),  # [[name, value], ...]
    # [[node, "finished" | "suspended"], ...]: the current task's nodes that reported their ranks' end.
    Column("ended", JSON, nullable=False, server_default=text("'[]'")),
    Index(None, "state", "seq"),  # the queue, and listings by state
)

# A job's chain: one row per ended task. The primary key serves "the tasks of a job", in order.
tasks_table = Table(
    "hai_tasks", _metadata,
    Column("job_id", String(_NAME), ForeignKey("hai_jobs.job_id"), primary_key=True),
    Column("task_index", Integer, primary_key=True),
    Column("nodes", JSON, nullable=False),
    Column("started_s", Double, nullable=False),
    Column("ended_s", Double, nullable=False),
    Column("outcome", Text, nullable=False),
)

_TABLES = (meta_table, nodes_table, quotas_table, jobs_table, tasks_table)


def _add_ended(conn: Connection) -> None:
    json_type = JSON().compile(dialect=conn.dialect)
    conn.execute(text(f"ALTER TABLE hai_jobs ADD COLUMN ended {json_type} DEFAULT '[]' NOT NULL"))


def _add_validation(conn: Connection) -> None:
    conn.execute(text(f"ALTER TABLE hai_nodes ADD COLUMN validation VARCHAR(16) "
                      f"DEFAULT '{Validation.NONE.value}' NOT NULL"))
    conn.execute(text("ALTER TABLE hai_nodes ADD COLUMN validation_failures INTEGER DEFAULT 0 NOT NULL"))


# version -> what brings a database of that version to the next one.
_UPGRADES: dict[int, Callable[[Connection], None]] = {1: _add_ended, 2: _add_validation}
_LOAD_BATCH = 500  # rows fetched at a time while loading


# -- limits ---------------------------------------------------------------------------------------


def _check_text(what: str, value: str, limit: int, *, empty_ok: bool = False) -> None:
    if not isinstance(value, str):
        raise StoreLimitError(f"{what} must be text, not {type(value).__name__}")
    if not value and not empty_ok:
        raise StoreLimitError(f"{what} must not be empty")
    if len(value) > limit:
        raise StoreLimitError(f"{what} is {len(value)} characters, at most {limit}")
    if "\0" in value:
        raise StoreLimitError(f"{what} contains a NUL character")
    try:
        value.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate: JSON can carry one, no database stores it
        raise StoreLimitError(f"{what} is not valid Unicode ({exc.reason} at {exc.start})") from None


def _check_int(what: str, value: int, high: int = _INT32) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise StoreLimitError(f"{what} must be a whole number from 0 to {high}, not {value!r}")


def _check_time(what: str, value: float) -> None:
    try:
        finite = isinstance(value, int | float) and math.isfinite(value)
    except OverflowError:  # an int past the largest float
        finite = False
    if not finite:
        raise StoreLimitError(f"{what} must be a finite number of seconds, not {str(value)[:40]!r}")


def _check_pairs(what: str, pairs: Sequence[tuple[str, str]], count: int, name_chars: int, value_chars: int,
                 total_chars: int) -> None:
    if len(pairs) > count:
        raise StoreLimitError(f"{what} has {len(pairs)} entries, at most {count}")
    seen: set[str] = set()
    total = 0
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise StoreLimitError(f"{what}: each entry is a (name, value) pair, not {pair!r}")
        name, value = pair
        _check_text(f"{what} name {name!r}"[:200], name, name_chars)
        _check_text(f"{what} {name!r}", value, value_chars, empty_ok=True)
        if "=" in name:
            raise StoreLimitError(f"{what} name {name!r} contains '='")
        if name in seen:
            raise StoreLimitError(f"{what} names {name!r} twice")
        seen.add(name)
        total += len(name) + len(value)
    if total > total_chars:
        raise StoreLimitError(f"{what} is {total} characters in all, at most {total_chars}")


def _check_env(what: str, env: Sequence[tuple[str, str]], limits: Limits) -> None:
    _check_pairs(what, env, limits.env_vars, limits.env_name_chars, limits.env_total_chars, limits.env_total_chars)


def check_job_spec(spec: JobSpec, limits: Limits = LIMITS) -> None:
    """Refuse a spec the store would refuse, before it is submitted (the API calls this)."""
    where = f"job {spec.job_id[:64]!r}"
    _check_text("job id", spec.job_id, limits.name_chars)
    _check_text(f"{where} user", spec.user, limits.name_chars)
    _check_text(f"{where} group", spec.group, limits.name_chars)
    _check_int(f"{where} nodes", spec.nodes)
    _check_text(f"{where} command", spec.command, limits.command_chars, empty_ok=True)
    _check_env(f"{where} env", spec.env, limits)


def check_node(node: Node, limits: Limits = LIMITS) -> None:
    """Refuse a node the store would refuse (the agent's registration)."""
    where = f"node {node.name[:64]!r}"
    _check_text("node name", node.name, limits.name_chars)
    _check_text(f"{where} zone", node.zone, limits.name_chars)
    _check_text(f"{where} group", node.group, limits.name_chars)
    _check_int(f"{where} cpus", node.cpus)
    _check_int(f"{where} memory_bytes", node.memory_bytes, _INT64)
    _check_time(f"{where} last heartbeat", node.last_heartbeat_s)
    _check_text(f"{where} unhealthy reason", node.unhealthy_reason, limits.reason_chars, empty_ok=True)
    _check_int(f"{where} validation failures", node.validation_failures)
    _check_pairs(f"{where} labels", node.labels, limits.labels, limits.label_name_chars, limits.label_value_chars,
                 limits.labels * (limits.label_name_chars + limits.label_value_chars))


def _check_job(job: Job, limits: Limits) -> None:
    check_job_spec(JobSpec(job.job_id, job.user, job.nodes, job.requested, job.group, job.command, job.env), limits)
    where = f"job {job.job_id!r}"
    _check_int(f"{where} seq", job.seq, _INT64)
    for what in ("task", "restarts"):
        _check_int(f"{where} {what}", getattr(job, what))
    for what in ("started_s", "ran_s", "not_before_s", "last_progress_s"):
        _check_time(f"{where} {what}", getattr(job, what))
    _check_text(f"{where} end reason", job.end_reason, limits.reason_chars, empty_ok=True)
    for name in job.assigned:
        _check_text(f"{where} node", name, limits.name_chars)
    for name, outcome in job.ended:
        if name not in job.assigned or outcome not in ("finished", "suspended"):
            raise StoreLimitError(f"{where}: end report {name!r} {outcome!r} is not of one of its nodes")
    previous = -1
    for record in job.history:
        if record.index <= previous:
            raise StoreLimitError(f"{where}: task {record.index} follows task {previous} in the chain")
        previous = record.index
        _check_int(f"{where} task index", record.index)
        _check_time(f"{where} task {record.index} start", record.started_s)
        _check_time(f"{where} task {record.index} end", record.ended_s)
        _check_text(f"{where} task {record.index} outcome", record.outcome, limits.reason_chars)
        for name in record.nodes:
            _check_text(f"{where} task {record.index} node", name, limits.name_chars)


def _check_quota(key: tuple[str, str, Priority], max_nodes: int, limits: Limits) -> None:
    user, group, priority = key
    _check_text("quota user", user, limits.name_chars)
    _check_text("quota group", group, limits.name_chars)
    if not isinstance(priority, Priority):
        raise StoreLimitError(f"quota priority must be a Priority, not {priority!r}")
    _check_int(f"quota {user}/{group}/{priority.name}", max_nodes)


# -- rows -----------------------------------------------------------------------------------------


def _pairs_json(pairs: Sequence[tuple[str, str]]) -> list[list[str]]:
    return [[name, value] for name, value in pairs]


def _node_row(node: Node) -> dict[str, Any]:
    return {"name": node.name, "zone": node.zone, "node_group": node.group, "cpus": node.cpus,
            "memory_bytes": node.memory_bytes, "labels": _pairs_json(node.labels), "healthy": node.healthy,
            "last_heartbeat_s": float(node.last_heartbeat_s), "unhealthy_reason": node.unhealthy_reason,
            "validation": node.validation.value, "validation_failures": node.validation_failures}


def _job_row(job: Job) -> dict[str, Any]:
    return {"job_id": job.job_id, "seq": job.seq, "state": job.state.value, "user_name": job.user,
            "node_group": job.group, "nodes": job.nodes,
            "requested": job.requested.value if isinstance(job.requested, Auto) else job.requested.name,
            "priority": None if job.priority is None else int(job.priority),
            "charged": None if job.charged is None else int(job.charged), "demoted": job.demoted,
            "assigned": list(job.assigned), "task": job.task, "restarts": job.restarts,
            "not_before_s": float(job.not_before_s), "started_s": float(job.started_s), "ran_s": float(job.ran_s),
            "last_progress_s": float(job.last_progress_s), "end_reason": job.end_reason, "command": job.command,
            "env": _pairs_json(job.env), "ended": _pairs_json(job.ended)}


def _task_rows(job_id: str, records: Sequence[TaskRecord]) -> list[dict[str, Any]]:
    return [{"job_id": job_id, "task_index": r.index, "nodes": list(r.nodes), "started_s": float(r.started_s),
             "ended_s": float(r.ended_s), "outcome": r.outcome} for r in records]


def _corrupt(table: str, key: object, column: str, value: object) -> StoreCorruptError:
    return StoreCorruptError(f"{table} row {key!r}: {column} = {value!r} is not something hai writes")


def _names(table: str, key: object, column: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _corrupt(table, key, column, value)
    return tuple(value)


def _pairs(table: str, key: object, column: str, value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in value):
        raise _corrupt(table, key, column, value)
    return tuple((p[0], p[1]) for p in value)


def _priority(table: str, key: object, column: str, value: Any) -> Priority:
    try:
        return Priority(value)
    except ValueError:
        raise _corrupt(table, key, column, value) from None


def _node_of(row: RowMapping) -> Node:
    name = row["name"]
    try:
        validation = Validation(row["validation"])
    except ValueError:
        raise _corrupt("hai_nodes", name, "validation", row["validation"]) from None
    if row["validation_failures"] < 0:
        raise _corrupt("hai_nodes", name, "validation_failures", row["validation_failures"])
    return Node(name=name, zone=row["zone"], group=row["node_group"], healthy=bool(row["healthy"]),
                last_heartbeat_s=row["last_heartbeat_s"], unhealthy_reason=row["unhealthy_reason"], cpus=row["cpus"],
                memory_bytes=row["memory_bytes"], labels=_pairs("hai_nodes", name, "labels", row["labels"]),
                validation=validation, validation_failures=row["validation_failures"])


def _job_of(row: RowMapping, history: tuple[TaskRecord, ...]) -> Job:
    job_id = row["job_id"]
    try:
        state = JobState(row["state"])
    except ValueError:
        raise _corrupt("hai_jobs", job_id, "state", row["state"]) from None
    requested: Priority | Auto
    if row["requested"] == AUTO.value:
        requested = AUTO
    elif row["requested"] in Priority.__members__:
        requested = Priority[row["requested"]]
    else:
        raise _corrupt("hai_jobs", job_id, "requested", row["requested"])
    priority = None if row["priority"] is None else _priority("hai_jobs", job_id, "priority", row["priority"])
    charged = None if row["charged"] is None else _priority("hai_jobs", job_id, "charged", row["charged"])
    return Job(job_id=job_id, user=row["user_name"], group=row["node_group"], nodes=row["nodes"], requested=requested,
               seq=row["seq"], state=state, priority=priority, charged=charged,
               assigned=_names("hai_jobs", job_id, "assigned", row["assigned"]), started_s=row["started_s"],
               ran_s=row["ran_s"], task=row["task"], restarts=row["restarts"], not_before_s=row["not_before_s"],
               demoted=bool(row["demoted"]), last_progress_s=row["last_progress_s"], end_reason=row["end_reason"],
               history=history, command=row["command"], env=_pairs("hai_jobs", job_id, "env", row["env"]),
               ended=_pairs("hai_jobs", job_id, "ended", row["ended"]))


def _task_of(row: RowMapping) -> TaskRecord:
    key = (row["job_id"], row["task_index"])
    return TaskRecord(index=row["task_index"], nodes=_names("hai_tasks", key, "nodes", row["nodes"]),
                      started_s=row["started_s"], ended_s=row["ended_s"], outcome=row["outcome"])


# -- the store ------------------------------------------------------------------------------------


def _sqlite_transactions(engine: Engine) -> None:
    """pysqlite begins a transaction only at the first write, so a load's SELECTs would each see
    their own snapshot; SQLAlchemy's documented recipe hands BEGIN to SQLAlchemy instead."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN")


class Store:
    """One database holding one cluster's state. Use :meth:`open`; :meth:`close` when done."""

    def __init__(self, engine: Engine, generation: int, known: ClusterState | None, limits: Limits) -> None:
        self.engine = engine
        self.limits = limits
        self._generation = generation
        self._known = known

    @classmethod
    def open(cls, url: str, limits: Limits = LIMITS) -> Store:
        """Connect to ``url``; create the schema in an empty database, refuse one of another version."""
        try:
            parsed = engine_url(url)
        except (ArgumentError, ValueError) as error:
            # Not the URL itself nor the parser's words, which may quote it: it may carry a password.
            raise StoreError(f"the database URL is not a SQLAlchemy URL ({type(error).__name__}); expected "
                             "DIALECT[+DRIVER]://USER[:PASSWORD]@HOST[:PORT]/DATABASE") from None
        shown = parsed.render_as_string(hide_password=True)
        # hide_parameters: a failed statement's error (chained under every StoreError, so in the
        # traceback the server logs) would otherwise quote its values: jobs' commands and
        # environments, which may carry users' secrets (see hai.server.HaiServer.job_view).
        try:
            if parsed.get_backend_name() == "postgresql":
                # Defaults only: a URL's own ?connect_timeout= or ?application_name= wins.
                defaults = {"connect_timeout": _PG_CONNECT_TIMEOUT_S, "application_name": "hai"}
                engine = create_engine(parsed, **_PG_POOL, hide_parameters=True,
                                       connect_args={k: v for k, v in defaults.items() if k not in parsed.query})
            else:
                engine = create_engine(parsed, hide_parameters=True)
        except (ArgumentError, ImportError) as error:  # an unknown dialect, a driver not installed
            raise StoreError(f"{shown}: no database driver for it ({error}); hai installs psycopg (PostgreSQL) "
                             "and has SQLite") from None
        if engine.dialect.name == "sqlite":
            _sqlite_transactions(engine)
        shown = engine.url.render_as_string(hide_password=True)
        database = engine.url.database
        if engine.dialect.name == "sqlite" and database and database != ":memory:" and \
                not database.startswith("file:") and not Path(database).parent.is_dir():
            engine.dispose()
            raise StoreError(f"{shown}: no directory {Path(database).parent} (create the cluster directory first)")
        try:
            with engine.begin() as conn:
                if engine.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK})
                inspector = inspect(conn)
                if not inspector.has_table(meta_table.name):
                    ours = sorted(t for t in inspector.get_table_names() if t.startswith("hai_"))
                    if ours:
                        raise StoreVersionError(f"{shown} has tables {', '.join(ours)} but no {meta_table.name}: "
                                                "not a hai database this version can read")
                    _metadata.create_all(conn)
                    conn.execute(insert(meta_table), [{"key": "schema_version", "value": SCHEMA_VERSION},
                                                      {"key": "next_seq", "value": ClusterState().next_seq},
                                                      {"key": "generation", "value": 0}])
                meta = _read_meta(conn)
                version = meta.get("schema_version")
                while version is not None and version in _UPGRADES and version < SCHEMA_VERSION:
                    _UPGRADES[version](conn)
                    version += 1
                    conn.execute(update(meta_table).where(meta_table.c.key == "schema_version")
                                 .values(value=version))
                if version != SCHEMA_VERSION:
                    newer = version is not None and version > SCHEMA_VERSION
                    raise StoreVersionError(
                        f"{shown} has hai schema version {version}; this hai reads version {SCHEMA_VERSION}"
                        + (": upgrade hai to use it" if newer else ": not a database this version can read"))
                generation = meta["generation"]
        except DBAPIError as error:
            engine.dispose()
            raise StoreError(f"{shown}: cannot open the database: {_said(error)}") from error
        except BaseException:
            engine.dispose()
            raise
        known = ClusterState() if generation == 0 else None
        return cls(engine, generation, known, limits)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @property
    def generation(self) -> int:
        """How many commits the database has taken, as this store last saw it."""
        return self._generation

    def load(self) -> ClusterState:
        """The committed state, read in one transaction, rows streamed in batches."""
        try:
            return _retrying(self._load)
        except DBAPIError as error:
            raise StoreError(f"cannot load the state: {_said(error)}") from error

    def _load(self) -> ClusterState:
        options: dict[str, Any] = {"yield_per": _LOAD_BATCH}
        if self.engine.dialect.name == "postgresql":
            options.update(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        with self.engine.connect().execution_options(**options) as conn, conn.begin():
            meta = _read_meta(conn)
            nodes = {n.name: n for n in map(_node_of, _rows(conn, select(nodes_table).order_by(nodes_table.c.name)))}
            quotas: dict[tuple[str, str, Priority], int] = {}
            for row in _rows(conn, select(quotas_table).order_by(*quotas_table.primary_key.columns)):
                key = (row["user_name"], row["node_group"], row["priority"])
                quotas[(key[0], key[1], _priority("hai_quotas", key, "priority", key[2]))] = row["max_nodes"]
            chains: dict[str, list[TaskRecord]] = {}
            for row in _rows(conn, select(tasks_table).order_by(tasks_table.c.job_id, tasks_table.c.task_index)):
                chains.setdefault(row["job_id"], []).append(_task_of(row))
            jobs: dict[str, Job] = {}
            for row in _rows(conn, select(jobs_table).order_by(jobs_table.c.seq)):
                jobs[row["job_id"]] = _job_of(row, tuple(chains.pop(row["job_id"], ())))
            if chains:
                raise StoreCorruptError(f"hai_tasks has tasks of jobs that do not exist: {sorted(chains)[:5]}")
        # In code-point order whatever the database's collation (PostgreSQL's may sort "B" after "a"),
        # so a loaded state iterates alike on every engine.
        nodes = dict(sorted(nodes.items()))
        quotas = dict(sorted(quotas.items()))
        state = ClusterState(nodes=nodes, jobs=jobs, quotas=quotas, next_seq=meta["next_seq"])
        self._generation, self._known = meta["generation"], state
        return state

    def save(self, state: ClusterState) -> None:
        """Commit ``state`` against the state this store last loaded or committed."""
        if self._known is None:
            raise StoreError("load() before save(): the store does not know what the database holds")
        self.commit(self._known, state)

    def commit(self, old: ClusterState, new: ClusterState) -> None:
        """Write what changed from ``old`` (the state in the database) to ``new``, in one transaction.

        Every changed row is checked against the limits first; a refused input writes nothing. The
        database must be at the generation this store last saw, or :class:`StoreConflictError`."""
        changes = _Changes(old, new)
        changes.check(self.limits)
        generation = self._generation

        def attempt() -> None:
            with self.engine.begin() as conn:
                # First, so that on every engine this row's lock orders the commits (no deadlock).
                bumped = conn.execute(update(meta_table).where(meta_table.c.key == "generation",
                                                               meta_table.c.value == generation)
                                      .values(value=generation + 1))
                if bumped.rowcount != 1:
                    raise StoreConflictError(f"the database moved past generation {generation}: another writer")
                self._write_nodes(conn, changes)
                self._write_quotas(conn, changes)
                self._write_jobs(conn, changes)
                self._write_tasks(conn, changes)
                if new.next_seq != old.next_seq:
                    _expect(conn.execute(update(meta_table).where(meta_table.c.key == "next_seq")
                                         .values(value=new.next_seq)), 1, "next_seq")

        try:
            _retrying(attempt)
        except IntegrityError as error:
            raise StoreConflictError(f"the database is not at the old state: {_said(error)}") from error
        except DBAPIError as error:  # read-only, locked by another writer past its timeout, gone
            raise StoreError(f"the commit was not written: {_said(error)}") from error
        self._generation, self._known = generation + 1, new

    # Each step of a commit is its own method, so a test can stop a commit between two of them.

    def _write_nodes(self, conn: Connection, changes: _Changes) -> None:
        c = nodes_table.c
        if changes.nodes_gone:
            _expect(conn.execute(delete(nodes_table).where(c.name.in_(changes.nodes_gone))), len(changes.nodes_gone),
                    "nodes to delete")
        for node in changes.nodes_changed:
            _expect(conn.execute(update(nodes_table).where(c.name == node.name).values(_node_row(node))), 1,
                    f"node {node.name}")
        if changes.nodes_added:
            conn.execute(insert(nodes_table), [_node_row(n) for n in changes.nodes_added])

    def _write_quotas(self, conn: Connection, changes: _Changes) -> None:
        c = quotas_table.c
        for user, group, priority in changes.quotas_gone:
            _expect(conn.execute(delete(quotas_table).where(c.user_name == user, c.node_group == group,
                                                            c.priority == int(priority))), 1, "quota")
        for (user, group, priority), count in changes.quotas_changed:
            _expect(conn.execute(update(quotas_table).where(c.user_name == user, c.node_group == group,
                                                            c.priority == int(priority)).values(max_nodes=count)),
                    1, "quota")
        if changes.quotas_added:
            conn.execute(insert(quotas_table), [{"user_name": u, "node_group": g, "priority": int(p), "max_nodes": n}
                                                for (u, g, p), n in changes.quotas_added])

    def _write_jobs(self, conn: Connection, changes: _Changes) -> None:
        c = jobs_table.c
        if changes.jobs_gone:
            conn.execute(delete(tasks_table).where(tasks_table.c.job_id.in_(changes.jobs_gone)))
            _expect(conn.execute(delete(jobs_table).where(c.job_id.in_(changes.jobs_gone))), len(changes.jobs_gone),
                    "jobs to delete")
        for job in changes.jobs_changed:
            _expect(conn.execute(update(jobs_table).where(c.job_id == job.job_id).values(_job_row(job))), 1,
                    f"job {job.job_id}")
        if changes.jobs_added:
            conn.execute(insert(jobs_table), [_job_row(j) for j in changes.jobs_added])

    def _write_tasks(self, conn: Connection, changes: _Changes) -> None:
        for job_id in changes.chains_rewritten:
            conn.execute(delete(tasks_table).where(tasks_table.c.job_id == job_id))
        if changes.tasks_added:
            conn.execute(insert(tasks_table), changes.tasks_added)


def _said(error: DBAPIError) -> str:
    """The driver's message on one line (libpq's run over several, with hints after tabs)."""
    return " ".join(str(error.orig).split())


def _rows(conn: Connection, statement: Any) -> Iterator[RowMapping]:
    for row in conn.execute(statement):
        yield row._mapping


def _read_meta(conn: Connection) -> dict[str, int]:
    return {row.key: row.value for row in conn.execute(select(meta_table))}


def _expect(result: Any, count: int, what: str) -> None:
    if result.rowcount != count:
        raise StoreConflictError(f"{what}: {result.rowcount} rows where the old state has {count}")


class _Changes:
    """The rows that differ between two states: what a commit writes, and all it checks."""

    def __init__(self, old: ClusterState, new: ClusterState) -> None:
        self.new = new
        self.nodes_gone = sorted(set(old.nodes) - set(new.nodes))
        self.nodes_changed = [n for name, n in new.nodes.items() if name in old.nodes and old.nodes[name] != n]
        self.nodes_added = [n for name, n in new.nodes.items() if name not in old.nodes]
        self.quotas_gone = sorted(set(old.quotas) - set(new.quotas))
        self.quotas_changed = [(k, n) for k, n in new.quotas.items() if k in old.quotas and old.quotas[k] != n]
        self.quotas_added = [(k, n) for k, n in new.quotas.items() if k not in old.quotas]
        self.jobs_gone = sorted(set(old.jobs) - set(new.jobs))
        self.jobs_changed = [j for job_id, j in new.jobs.items()
                             if job_id in old.jobs and _without_history(old.jobs[job_id]) != _without_history(j)]
        self.jobs_added = [j for job_id, j in new.jobs.items() if job_id not in old.jobs]
        self.chains_rewritten: list[str] = []
        self.tasks_added: list[dict[str, Any]] = []
        for job_id, job in new.jobs.items():
            before = old.jobs[job_id].history if job_id in old.jobs else ()
            if job.history[:len(before)] == before:
                self.tasks_added += _task_rows(job_id, job.history[len(before):])
            else:  # never from the rules (a chain only grows), but a state may be replaced wholesale
                self.chains_rewritten.append(job_id)
                self.tasks_added += _task_rows(job_id, job.history)

    def check(self, limits: Limits) -> None:
        for node in [*self.nodes_changed, *self.nodes_added]:
            check_node(node, limits)
        for key, count in [*self.quotas_changed, *self.quotas_added]:
            _check_quota(key, count, limits)
        touched = {j.job_id for j in [*self.jobs_changed, *self.jobs_added]} | \
            {row["job_id"] for row in self.tasks_added}
        for job_id in sorted(touched):
            _check_job(self.new.jobs[job_id], limits)
        _check_int("next_seq", self.new.next_seq, _INT64)


def _without_history(job: Job) -> Job:
    return dataclasses.replace(job, history=())


# -- one server per database ----------------------------------------------------------------------

log = logging.getLogger("hai.store")
_SERVER_LOCK = 0x6861690002  # pg_try_advisory_lock key (session level): the one server of a database
LOCK_SUFFIX = ".lock"  # SQLite: the lock file next to the database file


class StoreLockedError(StoreError):
    """Another hai server holds the database: a second one must not start (two schedulers would
    place jobs on the same nodes and refuse each other's commits)."""


class StoreLockLostError(StoreError):
    """This server's hold on the database is gone and another server has it now: this one must stop
    scheduling and exit (its commits would be refused anyway: the generation check)."""


def _holder_text(pid: object, host: object) -> str:
    return f"pid {pid} on {host}" if pid and host else "pid unknown"


class ServerLock:
    """The exclusive hold a running ``hai server`` keeps on its database, for its whole life.

    SQLite: ``flock`` on ``<database>.lock`` next to the database file (the cluster directory),
    which holds ``pid host`` of the holder; the kernel drops the lock when the process dies, however
    it dies. PostgreSQL: a session-level advisory lock (``pg_try_advisory_lock``) on a connection
    of its own, outside the store's pool (a pooled connection goes back to the pool and may be
    closed by it, which would drop the lock); the database drops it when the session ends. The
    holder is named in the session's ``application_name``, which the second server reads from
    ``pg_stat_activity`` to say who holds it.

    A PostgreSQL restart ends the session and with it the lock: :meth:`check` (the scheduling loop
    calls it every pass) notices the dead connection, reconnects and takes the lock again. If
    another server took it meanwhile, :meth:`check` raises :class:`StoreLockLostError`. An
    in-memory SQLite database is private to its process and needs no lock; nor is a SQLite
    ``file:`` URI locked (its path is the driver's to parse), so a server is run on a plain path."""

    def __init__(self, *, fd: int | None = None, engine: Engine | None = None, conn: Connection | None = None,
                 tag: str = "", private: bool = False) -> None:
        self._private = private  # a database no other process can open (in-memory SQLite): nothing to hold
        self._fd = fd
        self._engine = engine
        self._conn = conn
        self._tag = tag

    @classmethod
    def acquire(cls, store: Store) -> ServerLock:
        """Take the lock of ``store``'s database, or raise :class:`StoreLockedError` naming the holder."""
        url = store.engine.url
        if store.engine.dialect.name == "postgresql":
            return cls._acquire_postgres(url)
        database = url.database
        if store.engine.dialect.name != "sqlite" or not database or database == ":memory:" \
                or database.startswith("file:"):
            return cls(private=True)
        path = Path(database).with_name(Path(database).name + LOCK_SUFFIX)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                said = os.pread(fd, 300, 0).decode(errors="replace").split()
            finally:
                os.close(fd)
            pid, host = [*said, "", ""][:2]
            raise StoreLockedError(f"another hai server ({_holder_text(pid, host)}) holds the database "
                                   f"{database} (lock file {path}); stop it first: two schedulers must "
                                   "never run on one cluster") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        return cls(fd=fd)

    @classmethod
    def _acquire_postgres(cls, url: URL) -> ServerLock:
        # application_name: at most 63 bytes; the random part tells this server's own old session
        # (a connection cut on our side while the database still holds it) from another server's.
        tag = f"hai-server {secrets.token_hex(4)} {os.getpid()} {socket.gethostname()}"[:63]
        query = {k: v for k, v in {"connect_timeout": str(_PG_CONNECT_TIMEOUT_S)}.items() if k not in url.query}
        engine = create_engine(url.update_query_dict({**query, "application_name": tag}), poolclass=NullPool,
                               hide_parameters=True)
        lock = cls(engine=engine, tag=tag)
        try:
            holder = lock._connect_and_take()
        except DBAPIError as error:
            engine.dispose()
            raise StoreError(f"{url.render_as_string(hide_password=True)}: cannot take the server lock: "
                             f"{_said(error)}") from error
        if holder is not None:
            engine.dispose()
            raise StoreLockedError(f"another hai server ({holder}) holds the database "
                                   f"{url.render_as_string(hide_password=True)}; stop it first: two "
                                   "schedulers must never run on one cluster")
        return lock

    def _connect_and_take(self) -> str | None:
        """Connect (autocommit: the session holds no transaction open) and try the lock: None when
        taken, else who holds it. A failed try closes the connection."""
        assert self._engine is not None
        conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            taken = conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": _SERVER_LOCK}).scalar_one()
            if taken:
                self._conn = conn
                return None
            row = conn.execute(text(
                "SELECT a.application_name, a.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = :hi AND l.objid = :lo "
                "AND l.objsubid = 1 AND l.database = (SELECT oid FROM pg_database "
                "WHERE datname = current_database())"),
                {"hi": _SERVER_LOCK >> 32, "lo": _SERVER_LOCK & 0xFFFFFFFF}).first()
            name = str(row[0]) if row is not None and row[0] else ""
            if name == self._tag and row is not None:
                # Our own earlier session, cut on this side but not yet noticed by the database:
                # end it, and the next check takes the lock.
                conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": row[1]})
                return "this server's own earlier session, ended now"
            words = name.split()
            holder = _holder_text(words[2], words[3]) if len(words) >= 4 and words[0] == "hai-server" \
                else "pid unknown"
            conn.close()
            return holder
        except BaseException:
            conn.close()
            raise

    def check(self) -> None:
        """Make sure the lock is still held. PostgreSQL: ping the lock's connection; a dead one
        (a database restart) is replaced and the lock taken again. Raises
        :class:`StoreLockLostError` when another server holds it now; while the database is
        unreachable, logs and returns (no other server can take it then, and the store's own
        operations fail on their own)."""
        if self._engine is None:
            return
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT 1"))
                return
            except DBAPIError:
                with contextlib.suppress(Exception):
                    self._conn.close()
                self._conn = None
                log.warning("the server lock's database session is gone (a database restart?): taking it again")
        try:
            holder = self._connect_and_take()
        except DBAPIError as error:
            log.warning("cannot take the server lock again yet: %s", _said(error))
            return
        if holder is None:
            log.info("server lock taken again")
        elif holder.startswith("this server's own"):
            log.warning("server lock: %s", holder)
        else:
            raise StoreLockLostError(f"another hai server ({holder}) took the database while this one's session "
                                     "was gone: this server stops")

    @property
    def held(self) -> bool:
        """Whether this process holds the lock as far as it knows (PostgreSQL: its session is open;
        :meth:`check` finds out whether the session still lives)."""
        return self._fd is not None or self._conn is not None or self._private

    def release(self) -> None:
        """Let the lock go (the process's end does too)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
        self._private = False

"""The HAI server's state in SQL (``hai/store.py``): round trips, a seeded exerciser that reopens the
database mid-run, and the known-bad cases — a corrupted row, a newer schema, oversized input, a
commit that dies half-way (an exception, and a SIGKILLed process).

Every test that takes ``url`` (or ``fresh_database``) runs twice: on a SQLite file and on a database
of the private PostgreSQL server (tests/postgres.py).

The exerciser is the state-level proof of "a server restart mid-run loses no job, queue position or
chain": the rules are driven by random events (tests/hai_events.py), every step is committed, and
every few steps a fresh :class:`Store` loads the database and must hold exactly the state in memory.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import DBAPIError

from hai import rules, store
from hai.rules import AUTO, ClusterState, Config, Job, JobSpec, JobState, Node, Priority, Quota, TaskRecord, Validation
from hai.store import Store, StoreConflictError, StoreCorruptError, StoreLimitError, StoreVersionError
from tests.hai_events import Run, random_cluster, random_event
from tests.postgres import SKIP_REASON, find_bin_dir, start_postgres

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def url(fresh_database: Callable[[], str]) -> str:
    """An empty database: a SQLite file, or a PostgreSQL database (each test runs on both)."""
    return fresh_database()


@pytest.fixture
def db(url: str) -> Iterator[Store]:
    with Store.open(url) as opened:
        yield opened


def _reloaded(url: str) -> ClusterState:
    """The state as a restarted server sees it: a new engine, a new store."""
    with Store.open(url) as fresh:
        return fresh.load()


def state_diff(want: ClusterState, got: ClusterState) -> list[str]:
    """Every field where ``got`` differs from ``want``, named (``jobs[J3].seq: 3 != 9``)."""
    found: list[str] = []
    if want.next_seq != got.next_seq:
        found.append(f"next_seq: {want.next_seq} != {got.next_seq}")
    for what, a, b in (("nodes", want.nodes, got.nodes), ("jobs", want.jobs, got.jobs),
                       ("quotas", want.quotas, got.quotas)):
        for key in sorted(set(a) ^ set(b), key=str):
            found.append(f"{what}[{key}] only in {'the first' if key in a else 'the second'}")
        for key in sorted(set(a) & set(b), key=str):
            x, y = a[key], b[key]  # type: ignore[index]
            if x == y:
                continue
            if dataclasses.is_dataclass(x) and dataclasses.is_dataclass(y):
                for f in dataclasses.fields(x):
                    if getattr(x, f.name) != getattr(y, f.name):
                        found.append(f"{what}[{key}].{f.name}: {getattr(x, f.name)!r} != {getattr(y, f.name)!r}")
            else:
                found.append(f"{what}[{key}]: {x!r} != {y!r}")
    return found


# -- hand-made states -----------------------------------------------------------------------------


def _sample() -> ClusterState:
    """A state with something in every column: jobs in every state, AUTO unresolved, a demoted job,
    a chain of three tasks, labels and an environment with awkward characters."""
    nodes = {
        "n1": Node("n1", "a", cpus=192, memory_bytes=2**41 + 3, labels=(("rack", "r1"), ("gpu", "a100 = 8 ,é"))),
        "n2": Node("n2", "a", "gpu", healthy=False, last_heartbeat_s=12.25, unhealthy_reason="gemm check failed"),
        "n3": Node("n3", "b", last_heartbeat_s=1e-300),
        "n4": Node("n4", "b", healthy=False, unhealthy_reason="failed validation: ib0: down",
                   validation=Validation.NEEDED, validation_failures=2),
        "n5": Node("n5", "b", healthy=False, unhealthy_reason="rank exited 1", validation=Validation.RUNNING),
    }
    quotas = {("alice", "default", Priority.HIGH): 4, ("bob", "gpu", Priority.LOW): 0,
              ("bob", "default", Priority.EXTREME_HIGH): 2**31 - 1}
    chain = (TaskRecord(0, ("n1", "n3"), 0.1, 100.5, "suspended"),
             TaskRecord(1, ("n3",), 130.0, 131.0, "failed: node n1 lost: no heartbeat"),
             TaskRecord(2, ("n1",), 200.0, 400.0, "finished"))
    jobs = {
        "J1": Job("J1", "alice", "default", 2, Priority.HIGH, 1, JobState.FINISHED, Priority.HIGH, None, (), 200.0,
                  361.4, 2, 1, 160.0, False, 390.0, "", chain, "python train.py --lr 3e-4 'a b'",
                  (("CUDA_VISIBLE_DEVICES", "0,1"), ("EMPTY", ""), ("QUOTE", "x\"y'z\n"))),
        "J2": Job("J2", "bob", "default", 1, Priority.ABOVE_NORMAL, 2, JobState.RUNNING, Priority.NORMAL,
                  Priority.ABOVE_NORMAL, ("n1",), 420.0, 1800.0, 1, demoted=True, last_progress_s=421.0,
                  history=(TaskRecord(0, ("n3",), 0.0, 1800.0, "suspended"),)),
        "J3": Job("J3", "carol", "gpu", 1, AUTO, 3, command="true"),
        "J4": Job("J4", "alice", "default", 1, Priority.LOW, 4, JobState.SUSPENDING, Priority.LOW, Priority.LOW,
                  ("n3",), 10.0),
        "J5": Job("J5", "bob", "default", 3, Priority.VERY_HIGH, 5, JobState.FAILED, Priority.VERY_HIGH,
                  restarts=3, end_reason="rank exited 1; 3 restarts used", task=3),
        "J6": Job("J6", "dave", "default", 1, AUTO, 6, JobState.QUEUED, Priority.UNDER_NORMAL, task=1,
                  restarts=1, not_before_s=1e12),
    }
    return ClusterState(nodes=nodes, jobs=jobs, quotas=quotas, next_seq=2**40)


def test_a_hand_made_state_round_trips(db: Store, url: str) -> None:
    state = _sample()
    db.commit(ClusterState(), state)
    assert state_diff(state, _reloaded(url)) == []
    assert _reloaded(url) == state
    assert db.load() == state


def test_a_state_that_shrinks_and_rewrites_round_trips(db: Store, url: str) -> None:
    """What the rules never do but a commit must still write exactly: rows deleted, a chain rewritten."""
    before = _sample()
    db.commit(ClusterState(), before)
    nodes = {k: v for k, v in before.nodes.items() if k != "n2"}
    nodes["n4"] = Node("n4", "c")
    quotas = {k: v + 1 for k, v in before.quotas.items() if k[0] != "bob"}
    jobs = {k: v for k, v in before.jobs.items() if k != "J1"}
    jobs["J2"] = dataclasses.replace(jobs["J2"], history=(TaskRecord(0, ("n1",), 5.0, 6.0, "suspended"),))
    jobs["J7"] = Job("J7", "erin", "default", 1, Priority.NORMAL, 7)
    after = ClusterState(nodes=nodes, jobs=jobs, quotas=quotas, next_seq=8)
    db.commit(before, after)
    assert state_diff(after, _reloaded(url)) == []
    db.save(ClusterState())  # everything deleted
    assert _reloaded(url) == ClusterState()


def test_an_empty_database_gets_the_schema(db: Store, url: str) -> None:
    assert db.load() == ClusterState()
    engine = create_engine(url)
    try:
        inspector = inspect(engine)
        assert {"hai_meta", "hai_nodes", "hai_quotas", "hai_jobs", "hai_tasks"} <= set(inspector.get_table_names())
        indexed = {tuple(ix["column_names"]) for ix in inspector.get_indexes("hai_jobs")}
        assert ("state", "seq") in indexed  # the queue: jobs by state, in submit order
        assert inspector.get_pk_constraint("hai_tasks")["constrained_columns"] == ["job_id", "task_index"]
        with engine.connect() as conn:
            meta = {str(k): int(v) for k, v in conn.execute(text("SELECT key, value FROM hai_meta"))}
        assert meta == {"schema_version": store.SCHEMA_VERSION, "next_seq": 1, "generation": 0}
    finally:
        engine.dispose()


def test_default_url_is_a_sqlite_file_in_the_cluster_directory(tmp_path: Path) -> None:
    assert store.default_url(tmp_path) == f"sqlite:///{tmp_path.resolve()}/hai.db"
    Store.open(store.default_url(tmp_path)).close()
    assert (tmp_path / "hai.db").is_file()
    with pytest.raises(store.StoreError, match=r"no directory .*missing"):
        Store.open(store.default_url(tmp_path / "missing"))


# -- the seeded exerciser: restarts mid-run lose nothing --------------------------------------------


def _operator_event(payload: random.Random, run: Run) -> None:
    """What the random events leave out and the server also commits: heartbeats, progress,
    timeouts, quota changes, new nodes."""
    s, roll = run.state, payload.random()
    if roll < 0.3 and s.nodes:
        run.state = rules.node_heartbeat(s, payload.choice(sorted(s.nodes)), run.now_s)
    elif roll < 0.5:
        running = sorted(j.job_id for j in s.jobs.values() if j.state is JobState.RUNNING)
        if running:
            run.state = rules.job_progress(s, payload.choice(running), run.now_s)
    elif roll < 0.6:
        run.state = rules.check_timeouts(s, run.now_s, run.config)
    elif roll < 0.7:
        user, group, priority = payload.choice(sorted(s.quotas))
        run.state = rules.set_quota(s, Quota(user, group, priority, payload.randint(0, 8)))
    elif roll < 0.75:
        groups = sorted({n.group for n in s.nodes.values()})
        name = f"m{len(s.nodes):02d}"
        run.state = rules.add_node(s, Node(name, "z0", payload.choice(groups), last_heartbeat_s=run.now_s))


def exercise_store(seed: int, steps: int, url: str, reopen_every: int) -> tuple[Run, int]:
    """Drive the rules with random events, commit each step, and reload from a fresh store every
    ``reopen_every`` steps; the loaded state must equal the one in memory. Returns the run and the
    number of reloads."""
    rng, payload = random.Random(seed), random.Random(-seed)
    state, config = random_cluster(rng, payload)
    run = Run(seed, state, config)
    reloads = 0
    db = Store.open(url)
    try:
        db.commit(ClusterState(), run.state)
        for step in range(1, steps + 1):
            before = run.state
            event = random_event(rng, run, payload)
            _operator_event(payload, run)
            decision = rules.schedule(run.state, run.now_s, run.config)
            run.state = rules.apply(run.state, decision)
            run.placements += len(decision.placements)
            run.suspensions += len(decision.suspensions)
            db.commit(before, run.state)
            if step % reopen_every == 0 or step == steps:
                db.close()
                loaded = _reloaded(url)
                diff = state_diff(run.state, loaded)
                assert not diff and loaded == run.state, f"seed {seed} step {step} after {event}: {diff}"
                reloads += 1
                db = Store.open(url)
                assert db.load() == run.state
    finally:
        db.close()
    return run, reloads


STORE_SEEDS = int(os.environ.get("HAI_STORE_SEEDS", "12"))


def test_a_restarted_store_loses_no_job_queue_position_or_chain(fresh_database: Callable[[], str]) -> None:
    started = time.monotonic()
    placements = suspensions = chains = reloads = 0
    first = fresh_database()
    # PostgreSQL runs a third of the seeds: a commit there is several network round trips, and the
    # engine-specific paths (types, snapshot loads, the generation row) are all in every seed.
    seeds = STORE_SEEDS if first.startswith("sqlite") else max(2, STORE_SEEDS // 3)
    for seed in range(1, seeds + 1):
        run, n = exercise_store(seed, 80, first if seed == 1 else fresh_database(), reopen_every=10)
        placements, suspensions, reloads = placements + run.placements, suspensions + run.suspensions, reloads + n
        chains += sum(len(j.history) > 1 for j in run.state.jobs.values())
    # The runs reach the interesting rows (placements, suspensions, chains of several tasks), or prove little.
    assert placements > 5 * seeds and suspensions > seeds // 2 and chains > seeds, \
        (placements, suspensions, chains)
    assert reloads == 8 * seeds
    assert time.monotonic() - started < 120  # rules out a hang only: CI machines are loaded and slow


@pytest.mark.parametrize(("step", "caught"), [("_write_tasks", ".history"), ("_write_nodes", "nodes[")])
def test_the_exerciser_catches_a_store_that_drops_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         step: str, caught: str) -> None:
    """Sabotage: one step of every commit writes nothing (a chain that never grows on disk, or nodes
    whose health never changes). The reload must notice, naming what differs."""
    monkeypatch.setattr(Store, step, lambda self, conn, changes: None)
    with pytest.raises(AssertionError) as failed:
        exercise_store(1, 80, store.default_url(tmp_path), reopen_every=10)
    assert caught in str(failed.value), str(failed.value)[:2000]


# -- known-bad: corrupted rows, a newer schema, oversized input -----------------------------------


@pytest.mark.parametrize(("sql", "named"), [
    ("UPDATE hai_jobs SET seq = 99 WHERE job_id = 'J4'", "jobs[J4].seq"),
    ("UPDATE hai_jobs SET restarts = 0 WHERE job_id = 'J6'", "jobs[J6].restarts"),
    ("UPDATE hai_jobs SET assigned = '[\"n2\"]' WHERE job_id = 'J2'", "jobs[J2].assigned"),
    ("DELETE FROM hai_tasks WHERE job_id = 'J1' AND task_index = 1", "jobs[J1].history"),
    ("UPDATE hai_tasks SET outcome = 'finished' WHERE job_id = 'J2'", "jobs[J2].history"),
    ("UPDATE hai_jobs SET env = '[]' WHERE job_id = 'J1'", "jobs[J1].env"),
    ("UPDATE hai_nodes SET healthy = true WHERE name = 'n2'", "nodes[n2].healthy"),
    ("UPDATE hai_nodes SET labels = '[[\"rack\", \"r2\"]]' WHERE name = 'n1'", "nodes[n1].labels"),
    ("DELETE FROM hai_quotas WHERE max_nodes = 4", "quotas[('alice', 'default', <Priority.HIGH: 30>)]"),
    ("UPDATE hai_meta SET value = 7 WHERE key = 'next_seq'", "next_seq"),
])
def test_the_comparison_catches_a_corrupted_row(db: Store, url: str, sql: str, named: str) -> None:
    state = _sample()
    db.commit(ClusterState(), state)
    engine = create_engine(url)
    with engine.begin() as conn:
        assert conn.execute(text(sql)).rowcount == 1
    engine.dispose()
    loaded = _reloaded(url)
    assert loaded != state
    assert any(line.startswith(named) for line in state_diff(state, loaded)), state_diff(state, loaded)


_NO_FOREIGN_KEYS = "<no foreign keys>"  # each engine says it its own way


@pytest.mark.parametrize(("sql", "said"), [
    ("UPDATE hai_jobs SET state = 'paused' WHERE job_id = 'J1'", "hai_jobs row 'J1': state = 'paused'"),
    ("UPDATE hai_jobs SET requested = 'URGENT' WHERE job_id = 'J1'", "requested = 'URGENT'"),
    ("UPDATE hai_jobs SET priority = 7 WHERE job_id = 'J1'", "priority = 7"),
    ("UPDATE hai_jobs SET assigned = '\"n1\"' WHERE job_id = 'J2'", "assigned = 'n1'"),
    ("UPDATE hai_nodes SET labels = '{\"rack\": \"r1\"}' WHERE name = 'n1'", "labels = {'rack': 'r1'}"),
    ("UPDATE hai_quotas SET priority = 11 WHERE user_name = 'alice'", "priority = 11"),
    (f"{_NO_FOREIGN_KEYS}; INSERT INTO hai_tasks VALUES ('J99', 0, '[]', 0, 1, 'finished')",
     "tasks of jobs that do not exist: ['J99']"),
])
def test_load_refuses_a_row_hai_never_writes(db: Store, url: str, sql: str, said: str) -> None:
    db.commit(ClusterState(), _sample())
    engine = create_engine(url)
    with engine.begin() as conn:
        for statement in sql.split("; "):
            if statement == _NO_FOREIGN_KEYS:
                statement = {"sqlite": "PRAGMA foreign_keys = OFF",
                             "postgresql": "ALTER TABLE hai_tasks DROP CONSTRAINT fk_hai_tasks_job_id_hai_jobs"
                             }[engine.dialect.name]
            conn.execute(text(statement))
    engine.dispose()
    with pytest.raises(StoreCorruptError) as caught:
        _reloaded(url)
    assert said in str(caught.value)


def test_a_newer_schema_is_refused(url: str) -> None:
    Store.open(url).close()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE hai_meta SET value = :v WHERE key = 'schema_version'"),
                      {"v": store.SCHEMA_VERSION + 1})
    engine.dispose()
    with pytest.raises(StoreVersionError, match=f"schema version {store.SCHEMA_VERSION + 1}.*upgrade hai"):
        Store.open(url)


def _downgrade(url: str, version: int) -> None:
    """Make a database of schema ``version`` from a current one: version 2 had no validation
    columns, version 1 not ``hai_jobs.ended`` either."""
    engine = create_engine(url)
    with engine.begin() as conn:
        if version <= 2:
            conn.execute(text("ALTER TABLE hai_nodes DROP COLUMN validation"))
            conn.execute(text("ALTER TABLE hai_nodes DROP COLUMN validation_failures"))
        if version <= 1:
            conn.execute(text("ALTER TABLE hai_jobs DROP COLUMN ended"))
        conn.execute(text(f"UPDATE hai_meta SET value = {version} WHERE key = 'schema_version'"))
    engine.dispose()


def _two_node_job_half_ended() -> ClusterState:
    """A 2-node job whose first node has reported its ranks' end and whose second has not."""
    state = ClusterState(nodes={n: Node(n, "a") for n in ("n1", "n2")})
    state = rules.set_quota(state, Quota("alice", "default", Priority.NORMAL, 2))
    state = rules.submit(state, JobSpec("J1", "alice", 2, Priority.NORMAL), 0.0)
    state = rules.apply(state, rules.schedule(state, 0.0, Config()))
    return rules.finish(state, "J1", 5.0, node="n1")


def test_a_task_s_per_node_ends_round_trip(db: Store, url: str) -> None:
    state = _two_node_job_half_ended()
    assert state.jobs["J1"].ended == (("n1", "finished"),)
    db.commit(ClusterState(), state)
    assert _reloaded(url) == state
    with pytest.raises(StoreLimitError, match="not of one of its nodes"):
        db.commit(state, rules._replace_job(state, dataclasses.replace(state.jobs["J1"], ended=(("n9", "finished"),))))


def test_a_version_1_database_is_upgraded_in_place(url: str) -> None:
    """A database written before per-node ends (schema 1: no ``hai_jobs.ended``) opens, its running
    job with no node reported, and takes the new column from then on."""
    submitted = _two_node_job_half_ended()
    before = rules._replace_job(submitted, dataclasses.replace(submitted.jobs["J1"], ended=()))
    with Store.open(url) as first:
        first.commit(ClusterState(), before)
    _downgrade(url, 1)
    with Store.open(url) as upgraded:
        assert upgraded.load() == before
        upgraded.save(rules.finish(before, "J1", 5.0, node="n1"))
    engine = create_engine(url)
    with engine.begin() as conn:
        version = conn.execute(text("SELECT value FROM hai_meta WHERE key = 'schema_version'")).scalar()
        columns = {c["name"] for c in inspect(conn).get_columns("hai_jobs")}
    engine.dispose()
    assert version == store.SCHEMA_VERSION == 3 and "ended" in columns
    assert _reloaded(url).jobs["J1"].ended == (("n1", "finished"),)


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_database_opens_and_its_unhealthy_node_still_waits_for_an_admin(url: str, version: int) -> None:
    """Schemas 1 and 2 had no validation columns: made here from a new database by dropping them."""
    with Store.open(url) as db:
        db.commit(ClusterState(), ClusterState(nodes={
            "n1": Node("n1", "a"), "n2": Node("n2", "a", healthy=False, unhealthy_reason="rank exited 1")}))
    _downgrade(url, version)
    with Store.open(url) as db:
        old = db.load()
        assert old.nodes["n2"] == Node("n2", "a", healthy=False, unhealthy_reason="rank exited 1")
        assert rules.node_health(old.nodes["n2"]) == "unhealthy"
        new = rules.node_lost(old, "n1", 5.0, Config(), "no heartbeat")
        db.commit(old, new)
    assert _reloaded(url) == new and new.nodes["n1"].validation is Validation.NEEDED
    engine = create_engine(url)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT value FROM hai_meta WHERE key = 'schema_version'")).scalar() == \
            store.SCHEMA_VERSION
    engine.dispose()


def test_a_database_with_hai_tables_but_no_version_is_refused(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE hai_jobs (job_id VARCHAR(255) PRIMARY KEY)"))
    engine.dispose()
    with pytest.raises(StoreVersionError, match="hai_jobs but no hai_meta"):
        Store.open(url)


_BIG = store.LIMITS


@pytest.mark.parametrize(("change", "said"), [
    ({"env": tuple((f"V{i}", "x") for i in range(_BIG.env_vars + 1))}, f"env has 257 entries, at most {_BIG.env_vars}"),
    ({"env": (("BLOB", "x" * _BIG.env_total_chars),)}, "env is 65540 characters in all, at most 65536"),
    ({"env": (("A", "1"), ("A", "2"))}, "names 'A' twice"),
    ({"env": (("A=B", "1"),)}, "contains '='"),
    ({"env": (("", "1"),)}, "must not be empty"),
    ({"command": "x" * (_BIG.command_chars + 1)}, "command is 65537 characters, at most 65536"),
    ({"command": "echo \0"}, "command contains a NUL"),
    ({"user": "u" * 256}, "user is 256 characters, at most 255"),
])
def test_an_oversized_job_is_refused_and_nothing_written(db: Store, url: str, change: dict[str, object],
                                                         said: str) -> None:
    before = _sample()
    db.commit(ClusterState(), before)
    spec = dataclasses.replace(JobSpec("J9", "alice", 1, Priority.LOW), **change)  # type: ignore[arg-type]
    with pytest.raises(StoreLimitError) as caught:
        store.check_job_spec(spec)
    assert said in str(caught.value)
    after = rules.submit(before, spec, 5.0)  # the rules carry it; the store refuses it
    with pytest.raises(StoreLimitError) as again:
        db.commit(before, rules.set_quota(after, Quota("zed", "default", Priority.LOW, 1)))
    assert said in str(again.value)
    assert _reloaded(url) == before
    db.commit(before, rules.set_quota(before, Quota("zed", "default", Priority.LOW, 1)))  # the store still works


@pytest.mark.parametrize(("change", "said"), [
    ({"labels": tuple((f"l{i}", "v") for i in range(_BIG.labels + 1))}, "labels has 65 entries, at most 64"),
    ({"labels": (("x" * 64, "v"),)}, "is 64 characters, at most 63"),
    ({"cpus": -1}, "cpus must be a whole number"),
    ({"last_heartbeat_s": float("nan")}, "must be a finite number"),
    ({"unhealthy_reason": "r" * 5000}, "unhealthy reason is 5000 characters, at most 4096"),
])
def test_an_oversized_node_is_refused_and_nothing_written(db: Store, url: str, change: dict[str, object],
                                                          said: str) -> None:
    before = _sample()
    db.commit(ClusterState(), before)
    node = dataclasses.replace(Node("n9", "a"), **change)  # type: ignore[arg-type]
    with pytest.raises(StoreLimitError) as caught:
        db.commit(before, dataclasses.replace(before, nodes={**before.nodes, "n9": node}))
    assert said in str(caught.value)
    assert _reloaded(url) == before


# -- a commit that dies half-way ------------------------------------------------------------------


def _busy_step(before: ClusterState) -> ClusterState:
    """A step that writes to every table: a node lost (its jobs' chains grow), new jobs, a quota."""
    state = rules.node_lost(before, "n3", 500.0, Config(), "no heartbeat")
    for i in range(20):
        state = rules.submit(state, JobSpec(f"K{i}", "alice", 1, Priority.LOW, command=f"run {i}"), 500.0)
    return rules.set_quota(state, Quota("alice", "default", Priority.LOW, 9))


def test_an_exception_mid_commit_leaves_the_old_state(db: Store, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _sample()
    db.commit(ClusterState(), before)
    after = _busy_step(before)
    write_jobs = Store._write_jobs

    def jobs_then_crash(self: Store, conn: object, changes: object) -> None:
        write_jobs(self, conn, changes)  # type: ignore[arg-type]
        raise RuntimeError("the server died here")

    monkeypatch.setattr(Store, "_write_jobs", jobs_then_crash)
    with pytest.raises(RuntimeError, match="died here"):
        db.commit(before, after)
    assert state_diff(before, _reloaded(url)) == []
    monkeypatch.undo()
    db.commit(before, after)  # nothing half-written is in the way
    assert _reloaded(url) == after


_KILLED_CHILD = textwrap.dedent("""
    import os, pickle, signal, sys
    from sqlalchemy import event
    from hai.store import Store

    url, path, after_statements = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(path, "rb") as f:
        before, after = pickle.load(f)
    db = Store.open(url)
    assert db.load() == before
    count = 0

    @event.listens_for(db.engine, "after_cursor_execute")
    def _count(_conn, _cursor, statement, *_args):
        global count
        if statement == "BEGIN":  # SQLite's explicit BEGIN; PostgreSQL's driver begins implicitly
            return
        count += 1
        if count == after_statements:
            os.kill(os.getpid(), signal.SIGKILL)

    db.commit(before, after)
    sys.exit(f"committed after {count} statements: kill after fewer")
""")


# The commit below runs (after BEGIN) the generation bump, the node, quota, job updates, job inserts,
# task inserts and next_seq: 7 statements, then COMMIT. Killed after the 1st, the 4th and the last.
@pytest.mark.parametrize("after_statements", [1, 4, 7])
def test_a_process_killed_mid_commit_leaves_the_old_state(db: Store, url: str, tmp_path: Path,
                                                          after_statements: int) -> None:
    """SIGKILL while the transaction is open (after the generation bump, amid node, job and task
    writes): a restarted server loads the state before the commit, and can commit again."""
    before = _sample()
    db.commit(ClusterState(), before)
    after = _busy_step(before)
    path = tmp_path / "states.pickle"
    path.write_bytes(pickle.dumps((before, after)))
    child = subprocess.run([sys.executable, "-c", _KILLED_CHILD, url, str(path), str(after_statements)],
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    assert state_diff(before, _reloaded(url)) == []
    with Store.open(url) as fresh:
        assert fresh.load() == before
        fresh.commit(before, after)
    assert _reloaded(url) == after


# -- writers that do not agree with the database --------------------------------------------------


def test_a_second_writer_is_refused(db: Store, url: str) -> None:
    before = _sample()
    db.commit(ClusterState(), before)
    with Store.open(url) as other:
        other.load()
        other.save(rules.set_quota(before, Quota("zed", "default", Priority.LOW, 1)))
    with pytest.raises(StoreConflictError, match="another writer"):
        db.commit(before, rules.set_quota(before, Quota("zed", "default", Priority.LOW, 2)))
    assert _reloaded(url).quotas[("zed", "default", Priority.LOW)] == 1


def test_a_stale_old_state_is_refused(db: Store, url: str) -> None:
    db.commit(ClusterState(), _sample())
    with pytest.raises(StoreConflictError):
        db.commit(ClusterState(), _sample())  # inserts rows that exist
    assert _reloaded(url) == _sample()
    with Store.open(url) as fresh, pytest.raises(store.StoreError, match="load"):
        fresh.save(ClusterState())


def test_concurrent_writers_one_wins_the_other_is_refused(url: str) -> None:
    """Two stores at the same generation commit at once, from two threads: exactly one commit lands
    and the other is a conflict, whatever the engine's locking (SQLite's one writer, PostgreSQL's
    row lock on the generation row with READ COMMITTED's re-check)."""
    with Store.open(url) as a, Store.open(url) as b:
        base = _sample()
        a.commit(ClusterState(), base)
        b.load()
        barrier = threading.Barrier(2)
        outcomes: dict[str, str] = {}

        def write(name: str, db: Store, max_nodes: int) -> None:
            barrier.wait(timeout=30)
            try:
                db.commit(base, rules.set_quota(base, Quota("zed", "default", Priority.LOW, max_nodes)))
                outcomes[name] = "committed"
            except StoreConflictError:
                outcomes[name] = "conflict"

        threads = [threading.Thread(target=write, args=("a", a, 1)), threading.Thread(target=write, args=("b", b, 2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(outcomes.values()) == ["committed", "conflict"], outcomes
        winner = 1 if outcomes["a"] == "committed" else 2
        loaded = _reloaded(url)
        assert loaded.quotas[("zed", "default", Priority.LOW)] == winner
        assert state_diff(rules.set_quota(base, Quota("zed", "default", Priority.LOW, winner)), loaded) == []


def test_a_load_on_postgresql_is_one_snapshot(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit that lands while a load reads (here: after the chains are read, before the jobs) is
    not half seen: the load returns the state before it. Under READ COMMITTED each SELECT would see
    its own snapshot, the job gone but its chain read, and the load would fail as corrupt."""
    before = _sample()
    with Store.open(postgres_url) as reader, Store.open(postgres_url) as writer:
        writer.commit(ClusterState(), before)
        reader.load()
        after = dataclasses.replace(before, jobs={k: v for k, v in before.jobs.items() if k != "J1"})
        task_of = store._task_of
        written: list[bool] = []

        def commit_midway(row: object) -> TaskRecord:
            if not written:
                written.append(True)
                writer.commit(before, after)  # another connection, committed at once
            return task_of(row)  # type: ignore[arg-type]

        monkeypatch.setattr(store, "_task_of", commit_midway)
        assert reader.load() == before and written
        monkeypatch.undo()
        assert reader.load() == after


def test_serialization_failures_are_retried_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "_RETRY_PAUSE_S", 0.0)

    class Aborted(Exception):
        sqlstate = "40001"

    failures: list[int] = []

    def flaky(times: int) -> str:
        if len(failures) < times:
            failures.append(1)
            raise DBAPIError("UPDATE hai_meta", {}, Aborted("could not serialize access"))
        return "done"

    assert store._retrying(lambda: flaky(store.RETRIES)) == "done" and len(failures) == store.RETRIES
    failures.clear()
    with pytest.raises(DBAPIError):
        store._retrying(lambda: flaky(store.RETRIES + 1))
    assert len(failures) == store.RETRIES + 1
    failures.clear()
    Aborted.sqlstate = "23505"  # a unique violation is an answer, not a transient abort
    with pytest.raises(DBAPIError):
        store._retrying(lambda: flaky(5))
    assert len(failures) == 1


def test_a_postgresql_url_means_psycopg_and_its_password_is_never_shown() -> None:
    assert store.engine_url("postgresql://hai:pw@db/hai").drivername == "postgresql+psycopg"
    assert store.engine_url("postgres://hai@db/hai").drivername == "postgresql+psycopg"
    assert store.engine_url("postgresql+psycopg2://hai@db/hai").drivername == "postgresql+psycopg2"
    assert store.engine_url("sqlite:///x.db").drivername == "sqlite"
    pytest.importorskip("psycopg")
    with pytest.raises(store.StoreError) as caught:
        Store.open("postgresql://hai:s3cret-pw@127.0.0.1:1/hai")  # nothing listens on port 1
    assert "s3cret-pw" not in str(caught.value) and "***" in str(caught.value), str(caught.value)


def test_a_store_outlives_a_postgresql_restart() -> None:
    """The database server restarts under an open store (a failover, an upgrade): every pooled
    connection is dead, and the next load and commit still work (the pool pings before use), with
    nothing lost. A server of its own, so the session's shared one is not disturbed."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        pytest.skip(SKIP_REASON)
    pytest.importorskip("psycopg")
    server = start_postgres(bin_dir)
    try:
        with Store.open(server.create_database()) as db:
            before = _sample()
            db.commit(ClusterState(), before)
            assert db.load() == before  # a pooled connection, now open
            server.restart()
            assert db.load() == before
            after = rules.set_quota(before, Quota("zed", "default", Priority.LOW, 3))
            db.commit(before, after)
            assert db.load() == after
    finally:
        server.stop()

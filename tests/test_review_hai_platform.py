"""Bugs found in a third review of the HAI platform's newest parts (the dashboard, ``hai local``,
the PostgreSQL store, ``hai server --db``, the compose services): one test each, each failing
before its fix (docs/reliability.md, "HAI platform bugs found in a third review"). All fast: no
fs3, no cluster processes (``hai local``'s spawner and ``fs3 admin`` are stand-ins), SQLite stores,
one short Python subprocess for the installed command."""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import threading
import tomllib
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import hai.cli
import hai.local
from fs3.cli.local import cluster_lock
from fs3.common.errors import InvalidArgument
from fs3.common.secret_files import make_private_dir, write_token_file
from hai import rules
from hai.__main__ import main as hai_main
from hai.dashboard import COOKIE, LOG_TAIL_BYTES, Fs3LogReader, LocalLogReader
from hai.local import HaiLocal, Settings
from hai.rules import JobSpec, Priority
from hai.server import HaiServer, User, Users, create_app, hash_token
from hai.store import DB_FILE, Store, StoreError, default_url

USER_TOKEN = "fs3u.0123456789abcdef." + "s" * 32  # a user token: hai local hands it on, runs no fs3 admin


class Spawned(Exception):
    """Raised by the fake spawner: the test has what it wanted, ``up`` cleans up."""


def test_hai_local_server_and_agents_do_not_inherit_an_operators_database_or_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An operator with HAI_DB_URL exported (docs/operations.md) runs `hai local up`: its server must
    # keep its own SQLite in DIR/hai, not schedule on the production database; likewise the
    # container tokens must not replace the admin that DIR/hai-admin.token holds.
    monkeypatch.setenv("HAI_DB_URL", "postgresql://hai:pw@db.example/hai")
    monkeypatch.setenv("HAI_ADMIN_TOKEN", "a" * 32)
    monkeypatch.setenv("HAI_AGENT_TOKEN", "b" * 32)
    monkeypatch.setenv("FS3_TOKEN", USER_TOKEN)
    seen: list[Mapping[str, str]] = []

    def spawn(argv: list[str], env: Mapping[str, str], log: Path,
              prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        seen.append(dict(env))
        raise Spawned()

    monkeypatch.setattr(hai.local, "spawn_logged", spawn)
    with pytest.raises(Spawned):
        HaiLocal(tmp_path / "local").up(Settings(nodes=1, fs3="127.0.0.1:1", netns=False))
    assert seen, "the server was never spawned"
    for name in ("HAI_DB_URL", "HAI_ADMIN_TOKEN", "HAI_AGENT_TOKEN"):
        assert name not in seen[0], name
    assert seen[0]["FS3_TOKEN"] == USER_TOKEN


def test_hai_local_down_is_refused_while_an_up_is_starting(tmp_path: Path) -> None:
    # An up in progress holds the directory's lock; a down from another terminal must not stop what
    # it started while it goes on, nor overwrite its record of the network.
    root = tmp_path / "local"
    root.mkdir(mode=0o700)
    recorded = {"nodes": 1, "with_fs3": False, "netns": True, "host": "10.214.250.1",
                "bridge": "haibr-nosuch", "namespaces": ["hai-nosuch-node1"]}
    (root / hai.local.STATE_FILE).write_text(json.dumps(recorded))
    with cluster_lock(root, "hai local"):
        with pytest.raises(InvalidArgument, match="is at work on the cluster"):
            HaiLocal(root).down()
        assert json.loads((root / hai.local.STATE_FILE).read_text()) == recorded
    HaiLocal(root).down(quiet=True)  # once the up is over
    assert json.loads((root / hai.local.STATE_FILE).read_text())["bridge"] is None


@pytest.mark.parametrize("url", ["postgresql://hai:s3cretpw@db:notaport/hai", "postgresql+nodriver://hai:s3cretpw@db/hai",
                                 "mysql://hai:s3cretpw@db/hai", "hai:s3cretpw@db/hai"])
def test_a_database_url_hai_cannot_use_is_one_line_without_its_password(
        url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # docs/operations.md: a database the server cannot open is one line on stderr and exit status 1;
    # a URL that does not parse, or names a driver hai lacks, was a traceback.
    assert hai_main(["server", "--dir", str(tmp_path / "hai"), "--db", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hai server: ") and err.count("\n") == 1, err
    assert "s3cretpw" not in err


def test_a_failed_commit_does_not_carry_a_jobs_environment_into_the_servers_log(tmp_path: Path) -> None:
    # A commit the database refuses raises StoreError, chained to the driver's error; the server logs
    # the whole chain (a failed scheduling pass, a 500). It must not quote the statement's values: a
    # job's environment and command may carry its user's secrets, withheld from other users.
    store = Store.open(default_url(tmp_path))
    with sqlite3.connect(tmp_path / DB_FILE) as conn:
        conn.execute("CREATE TRIGGER refuse BEFORE INSERT ON hai_jobs BEGIN SELECT RAISE(ABORT, 'refused'); END")
    old = store.load()
    spec = JobSpec("job-1", "alice", 1, Priority.NORMAL, command="train --key=cmd-secret-1",
                   env=(("API_KEY", "env-secret-2"),))
    with pytest.raises(StoreError) as raised:
        store.commit(old, rules.submit(old, spec, 1.0))
    logged = "".join(traceback.format_exception(raised.value))
    assert "refused" in logged and "INSERT INTO hai_jobs" in logged
    assert "env-secret-2" not in logged and "cmd-secret-1" not in logged
    store.close()


def test_the_admins_fs3_user_token_is_made_once_per_cluster_and_never_used_on_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `fs3 admin user add` makes one more valid token each time; `down` removes none. An `up --fs3 X`
    # made a new one on X at every up, and an `up` on the directory's own fs3 after an `up --fs3 X`
    # handed its ranks X's token, which the own cluster does not know.
    made: list[tuple[str, str]] = []

    def user_add(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        where = argv[argv.index("admin") + 1:argv.index("admin") + 3]
        token = f"fs3u.{len(made):016x}." + "t" * 32
        write_token_file(argv[argv.index("--token-file") + 1], [token])
        made.append((" ".join(where), token))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(subprocess, "run", user_add)  # hai.local calls subprocess.run
    local = HaiLocal(tmp_path / "local")
    make_private_dir(local.root)
    make_private_dir(local.hai_dir)
    cluster_token = "c" * 32
    on_x = local._ranks_fs3_token("10.0.0.9:9000", cluster_token, own_cluster=False)
    assert local._ranks_fs3_token("10.0.0.9:9000", cluster_token, own_cluster=False) == on_x
    assert len(made) == 1 and made[0][0] == "--mgmtd 10.0.0.9:9000"
    own = local._ranks_fs3_token("127.0.0.1:9100", cluster_token, own_cluster=True)
    assert own != on_x and made[-1][0] == f"--dir {local.root}"
    assert local._ranks_fs3_token("127.0.0.1:9100", cluster_token, own_cluster=True) == own
    assert local._ranks_fs3_token("10.0.0.10:9000", cluster_token, own_cluster=False) not in (on_x, own)
    assert len(made) == 3


def test_hai_show_says_a_withheld_value_is_withheld_not_the_string_none(capsys: pytest.CaptureFixture[str]) -> None:
    # The server gives another user's job's variables with their values null; `hai show` printed
    # API_KEY=None, which reads as the value "None".
    job = {"job_id": "train-3", "user": "bob", "state": "queued", "requested": "NORMAL", "priority": "NORMAL",
           "group": "default", "nodes": 1, "ranks_per_node": 1, "assigned": [], "task": 0, "restarts": 0,
           "reason": None, "command": "train", "env": {"API_KEY": None, "CHECKPOINT_BYTES": "1024"}, "chain": []}

    class Api:
        def call(self, method: str, path: str) -> dict[str, Any]:
            return job

    assert hai.cli.cmd_show(Api(), argparse.Namespace(job="train-3", json=False)) == 0  # type: ignore[arg-type]
    shown = capsys.readouterr().out
    assert "API_KEY=(withheld)" in shown and "CHECKPOINT_BYTES=1024" in shown and "None" not in shown


def _log_page(tmp_path: Path, log: bytes) -> str:
    """The dashboard's job page of a one-rank job whose rank 0 log is ``log``."""
    token = "alice-token"
    tmp_path.mkdir()
    server = HaiServer(Store.open(default_url(tmp_path)), Users(users=(User("alice", hash_token(token)),)))
    server.change(lambda s: rules.submit(s, JobSpec("logged-1", "alice", 1, Priority.NORMAL, command="x"), 0.0))
    (tmp_path / "logs" / "logged-1").mkdir(parents=True)
    (tmp_path / "logs" / "logged-1" / "0.log").write_bytes(log)
    app = create_app(server, run_loop=False, logs=LocalLogReader(tmp_path / "logs"))
    with TestClient(app, follow_redirects=False) as client:
        client.cookies.set(COOKIE, token)
        text: str = client.get("/dashboard/jobs/logged-1").text
    server.close()
    return text


def test_the_log_tail_says_all_of_it_for_a_log_of_exactly_the_tail_size(tmp_path: Path) -> None:
    # A log of exactly LOG_TAIL_BYTES was taken for a cut one: its first line dropped, "the last
    # ... bytes" said; a longer log of one line was "all of it".
    lines = b"".join(b"line %05d\n" % i for i in range((LOG_TAIL_BYTES - 6) // 11))
    whole = b"first\n" + b"x" * (LOG_TAIL_BYTES - 6 - len(lines)) + lines
    assert len(whole) == LOG_TAIL_BYTES
    page = _log_page(tmp_path / "a", whole)
    assert "all of it" in page and "first" in page
    page = _log_page(tmp_path / "b", b"y" * (LOG_TAIL_BYTES + 100))
    assert "all of it" not in page and f"the last {LOG_TAIL_BYTES} bytes" in page


ROOT = Path(__file__).resolve().parents[1]
# What the container image lacks: it installs fs3 with the fuse extra only (Dockerfile), not the
# training extra (numpy, torch) nor the training packages.
_WITHOUT_TRAINING = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("numpy", "torch", "hfreduce", "haiscale"):
            raise ModuleNotFoundError(f"No module named {name!r} (not in the image)")
        return None
sys.meta_path.insert(0, Absent())
from hai.__main__ import main
for command in ("server", "agent", "local", "ls", "submit"):
    try:
        main([command, "--help"])
    except SystemExit as done:
        assert done.code == 0, (command, done.code)
print("hai runs without the training extra")
"""


def test_the_hai_command_is_installed_and_runs_with_fs3s_own_dependencies_only() -> None:
    # docker-compose.yml's hai services have the entrypoint `hai`: the package must install that
    # command, and it must start in the image, which has fs3's dependencies but not numpy (hai
    # validate imported numpy at the top, and every hai command imports hai validate).
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts.get("hai") == "hai.__main__:main"
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TRAINING], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "hai runs without the training extra" in done.stdout, done.stderr[-2000:]


def test_pages_do_not_queue_behind_a_log_readers_slow_connect_to_fs3() -> None:
    # A connect to an fs3 that does not answer takes the client's retry budget (10 s). Every page
    # that wanted a log waited for it under the reader's lock, each holding one of the threads the
    # API's requests run on: enough open job pages starved the agents' heartbeats.
    entered, release = threading.Event(), threading.Event()

    def connect() -> Any:
        entered.set()
        release.wait(30)
        raise ConnectionError("fs3 does not answer")

    reader = Fs3LogReader(connect)
    errors: list[str] = []

    def view() -> None:
        try:
            reader.tail("job-1", 0, 1024)
        except OSError as error:
            errors.append(str(error))

    first = threading.Thread(target=view)
    first.start()
    assert entered.wait(30)
    second = threading.Thread(target=view)
    second.start()
    second.join(timeout=10)
    waited = second.is_alive()
    release.set()
    first.join(timeout=30)
    second.join(timeout=30)
    assert not waited, "a second page waited for the first page's connect"
    assert any("connecting to fs3" in e for e in errors) and any("cannot connect to fs3" in e for e in errors)
    with pytest.raises(OSError, match="cannot connect to fs3"):  # the next page tries again
        release.set()
        reader.tail("job-1", 0, 1024)


def test_a_request_the_database_cannot_take_is_a_503_that_says_why(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # PostgreSQL down under a running server: a submit was a bare 500 "Internal Server Error"
    # (`hai submit` could not say why) and a traceback in the log.
    token = "alice-token"
    server = HaiServer(Store.open(default_url(tmp_path)), Users(users=(User("alice", hash_token(token)),)))

    def down(old: Any, new: Any) -> None:
        raise StoreError("the commit was not written: connection refused")

    monkeypatch.setattr(server.store, "commit", down)
    with TestClient(create_app(server, run_loop=False), raise_server_exceptions=False) as client:
        response = client.post("/jobs", json={"name": "train", "command": "python train.py", "nodes": 1},
                               headers={"Authorization": f"Bearer {token}"})
    server.close()
    assert response.status_code == 503, response.text
    assert "connection refused" in response.json()["detail"]
    assert not server.state.jobs  # nothing adopted that was not written

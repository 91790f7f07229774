"""The HAI server's web dashboard (``hai/dashboard.py``).

Fast tests drive the pages through FastAPI's TestClient with virtual time: the login and its
cookie, a wrong token refused, the nodes page (healthy, unhealthy with its reason, offline), the
queue in order with the reasons waiting jobs wait, a job's chain (a restarted task, a finished
one), the log tail, and user-supplied text (a ``<script>`` in a job's id, command and group)
shown escaped. One test drives Debian's ``chromium`` through ``chromium-driver`` and Selenium
against the real server on a free port: it logs in, opens the nodes, queue and job pages, checks
what they show, and keeps a screenshot of each as a test artefact (``$FS3_TEST_ARTIFACTS``, else
``.test-artifacts/`` in the repository) named ``hai-dashboard-<page>.png``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from hai import dashboard, rules
from hai.dashboard import COOKIE, Fs3LogReader, LocalLogReader, LogReader, node_status, task_ending
from hai.launcher import Fs3LogSink
from hai.rules import ClusterState, Config, Job, JobSpec, JobState, Node, Priority, TaskRecord
from hai.server import HaiServer, ServerConfig, User, Users, create_app, hash_token
from hai.store import Store, default_url

ALICE, BOB, AGENT = "alice-token", "bob-token", "agent-token"
USERS = Users(users=(User("alice", hash_token(ALICE)), User("bob", hash_token(BOB))),
              agent_token_sha256=hash_token(AGENT))
CONFIG = ServerConfig(rules=Config(default_quota_nodes=100, backoff_base_s=30.0, node_timeout_s=60.0))
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "<script>alert(1)</script>"
EVIL_COMMAND = f"python train.py --note '{SCRIPT}'"
EVIL_GROUP = "<b>grp</b>"
EVIL_ZONE = "<i>zone</i>"
DEADLINE_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def agent_call(client: Any, path: str, body: dict[str, Any]) -> Any:
    response = client.post(path, json=body, headers={"Authorization": f"Bearer {AGENT}"})
    assert response.status_code == 200, response.text
    return response.json()


def submit(client: Any, token: str, **spec: Any) -> str:
    body = {"name": "train", "command": "python train.py", "nodes": 1, **spec}
    response = client.post("/jobs", json=body, headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 201, response.text
    job_id: str = response.json()["job_id"]
    return job_id


def populate(client: Any, server: HaiServer, clock: Clock, log_dir: Path) -> dict[str, str]:
    """Three nodes in group default, one (n4) in a group and zone with markup in their names; alice's
    job whose first task fails on one node (unhealthy after) and whose second finishes; bob's job
    running on n4; alice's big job waiting for nodes; a job whose id and command carry markup."""
    for name in ("n1", "n2", "n3"):
        agent_call(client, "/agents/register", {"name": name, "cpus": 8, "memory_bytes": 16 << 30, "zone": "z1",
                                                "labels": {"gpu": "a100"}})
    agent_call(client, "/agents/register", {"name": "n4", "zone": EVIL_ZONE, "group": EVIL_GROUP})

    def tick() -> None:
        server.tick(clock.now)

    chain = submit(client, ALICE, name="chain", nodes=2, command=EVIL_COMMAND, group="default")
    tick()
    first = client.get(f"/jobs/{chain}", headers={"Authorization": f"Bearer {ALICE}"}).json()
    assert first["state"] == "running", first
    bad = first["assigned"][1]
    agent_call(client, f"/agents/{bad}/report", {"job_id": chain, "task": 0, "event": "failed", "exit_code": 1})
    clock.now += 31.0  # past the back-off
    heartbeat_all(client, server)
    tick()
    second = client.get(f"/jobs/{chain}", headers={"Authorization": f"Bearer {ALICE}"}).json()
    assert second["state"] == "running" and second["task"] == 1, second
    for node in second["assigned"]:
        agent_call(client, f"/agents/{node}/report", {"job_id": chain, "task": 1, "event": "finished"})
    running = submit(client, BOB, name="bobs", nodes=1, priority="HIGH", group=EVIL_GROUP)
    big = submit(client, ALICE, name="big", nodes=3, priority="LOW")
    tick()
    evil_id = f"x{SCRIPT}"
    server.change(lambda s: rules.submit(s, JobSpec(evil_id, "alice", 9, Priority.NORMAL, command=SCRIPT),
                                         server.clock()))
    tick()
    (log_dir / chain).mkdir(parents=True)
    (log_dir / chain / "0.log").write_text("".join(f"step {i} loss {1.0 / (i + 1):.4f}\n" for i in range(3000))
                                           + f"done {SCRIPT}\n")
    return {"chain": chain, "bad": bad, "running": running, "big": big, "evil": evil_id}


def heartbeat_all(client: Any, server: HaiServer) -> None:
    for name in server.state.nodes:
        agent_call(client, f"/agents/{name}/heartbeat", {"running": []})


class Fast:
    """The populated server behind a TestClient; logs read from ``log_dir`` unless ``logs`` says otherwise."""

    def __init__(self, tmp: Path, *, logs: LogReader | bool | None = True) -> None:
        self.clock = Clock()
        self.server = HaiServer(Store.open(default_url(tmp)), USERS, CONFIG, clock=self.clock)
        self.log_dir = tmp / "logs"
        reader = (LocalLogReader(self.log_dir) if logs else None) if isinstance(logs, bool) else logs
        self.client = TestClient(create_app(self.server, run_loop=False, logs=reader), follow_redirects=False)
        self.client.__enter__()
        self.jobs = populate(self.client, self.server, self.clock, self.log_dir)

    def login(self, token: str = ALICE) -> httpx.Response:
        response: httpx.Response = self.client.post("/dashboard/login", data={"token": token})
        return response

    def page(self, path: str) -> str:
        """The page's HTML, checked: no script allowed, and no markup from the state unescaped."""
        response = self.client.get(path)
        assert response.status_code == 200, (response.status_code, response.text[:500])
        assert "script-src" not in response.headers["content-security-policy"]  # default-src 'none' applies
        assert "default-src 'none'" in response.headers["content-security-policy"]
        text: str = response.text
        assert SCRIPT not in text and "<b>grp" not in text
        return text

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        self.server.close()


@pytest.fixture
def fast(tmp_path: Path) -> Iterator[Fast]:
    f = Fast(tmp_path)
    yield f
    f.close()


def test_pages_need_a_login_and_a_known_token(fast: Fast) -> None:
    for path in ("/dashboard/", "/dashboard/nodes", "/dashboard/queue", f"/dashboard/jobs/{fast.jobs['chain']}"):
        response = fast.client.get(path)
        assert response.status_code == 303 and response.headers["location"] == "/dashboard/login", path
    assert 'name="token"' in fast.client.get("/dashboard/login").text
    for wrong in ("nope", AGENT, "", "x" * 10_000):
        response = fast.login(wrong)
        assert response.status_code == 401 and "Unknown token" in response.text, wrong
        assert "set-cookie" not in response.headers
    fast.client.cookies.set(COOKIE, "forged", path="/dashboard")
    assert fast.client.get("/dashboard/queue").status_code == 303
    fast.client.cookies.clear()
    # A form posted from another site's page is refused, even with a good token.
    response = fast.client.post("/dashboard/login", data={"token": ALICE}, headers={"Origin": "http://evil.example"})
    assert response.status_code == 403 and "set-cookie" not in response.headers
    assert fast.client.post("/dashboard/login", content="&".join(f"f{i}=1" for i in range(50)),
                            headers={"Content-Type": "application/x-www-form-urlencoded"}).status_code == 401
    # Behind a TLS proxy the page is https while the server sees http: the same host is the same site.
    response = fast.client.post("/dashboard/login", data={"token": BOB}, headers={"Origin": "https://testserver"})
    assert response.status_code == 303
    fast.client.cookies.clear()

    response = fast.login(BOB)
    assert response.status_code == 303 and response.headers["location"] == "/dashboard/queue"
    cookie = response.headers["set-cookie"].lower()
    assert cookie.startswith(f"{COOKIE}={BOB}") and "httponly" in cookie and "samesite=strict" in cookie
    assert "path=/dashboard" in cookie
    assert "bob" in fast.page("/dashboard/queue")  # any user sees every job: bob sees alice's
    assert fast.jobs["chain"] in fast.page("/dashboard/queue")
    # The API stays bearer-only: the dashboard's cookie is no credential there.
    assert fast.client.get("/jobs", headers={"Cookie": f"{COOKIE}={BOB}"}).status_code == 401

    response = fast.client.post("/dashboard/logout")
    assert response.status_code == 303 and f'{COOKIE}=""' in response.headers["set-cookie"]
    assert fast.client.get("/dashboard/queue").status_code == 303


def test_nodes_page_shows_state_reason_zone_and_job(fast: Fast) -> None:
    fast.login()
    text = fast.page("/dashboard/nodes")
    bad = fast.jobs["bad"]
    assert "4 nodes: 3 healthy, 1 suspect." in text
    row = _row(text, f"<td>{bad}</td>")
    assert "b-suspect" in row and f"rank exited 1 on {bad}" in row and "z1" in row
    running = fast.server.state.jobs[fast.jobs["running"]]
    assert running.assigned == ("n4",)
    n4 = _row(text, "<td>n4</td>")
    assert f'href="/dashboard/jobs/{running.job_id}"' in n4 and "&lt;i&gt;zone&lt;/i&gt;" in n4
    assert "<i>" not in text
    # A node silent past the node timeout is offline, before and after the scheduler marks it lost.
    fast.clock.now += 61.0
    assert "4 nodes: 4 offline." in fast.page("/dashboard/nodes")
    fast.server.tick(fast.clock.now + 1000.0)  # a pass after the server's start-up grace
    fast.clock.now += 1000.0
    text = fast.page("/dashboard/nodes")
    assert "4 offline" in text and "no heartbeat for" in text


def test_queue_page_orders_jobs_and_gives_reasons(fast: Fast) -> None:
    fast.login()
    text = fast.page("/dashboard/queue")
    big, running, evil = fast.jobs["big"], fast.jobs["running"], fast.jobs["evil"]
    waits = fast.server.waits
    assert waits[big].kind is rules.WaitKind.NODES
    big_row = _row(text, f">{big}</a>")
    assert "alice" in big_row and "LOW" in big_row and "b-queued" in big_row
    assert _escaped(str(waits[big])) in big_row
    running_row = _row(text, f">{running}</a>")
    assert "HIGH" in running_row and "bob" in running_row and "b-running" in running_row
    assert "&lt;b&gt;grp&lt;/b&gt;" in running_row  # the group, escaped
    # Queue order: the running HIGH job, then NORMAL, then LOW.
    assert text.index(f">{running}</a>") < text.index(_escaped(evil)) < text.index(f">{big}</a>")
    assert _escaped(evil) in text and 'href="/dashboard/jobs/x%3Cscript%3Ealert%281%29%3C%2Fscript%3E"' in text
    assert "2 queued, 1 running or suspending" in text
    ended = text[text.index("Recently ended"):]
    assert fast.jobs["chain"] in ended and "b-finished" in ended
    assert '<meta http-equiv="refresh"' in text


def test_job_page_shows_chain_restarts_and_log_tail(fast: Fast) -> None:
    fast.login()
    chain = fast.jobs["chain"]
    text = fast.page(f"/dashboard/jobs/{chain}")
    assert _escaped(EVIL_COMMAND) in text
    assert "<dt>Restarts</dt><dd>1 of 3</dd>" in text
    task0, task1 = _row(text, "<tr><td>0</td>"), _row(text, "<tr><td>1</td>")
    assert "b-restarted" in task0 and f"rank exited 1 on {fast.jobs['bad']}" in task0 and "restarted as task 1" \
        in task0
    assert "b-finished" in task1
    log = text[text.index("Log of rank 0"):]
    assert "step 2999 loss" in log and "step 0 loss" not in log and _escaped(f"done {SCRIPT}") in log
    assert "the last" in log and str(fast.log_dir / chain / "0.log") in log
    assert "No log at" in fast.page(f"/dashboard/jobs/{chain}?rank=1")
    assert "ranks 0 to 1" in fast.page(f"/dashboard/jobs/{chain}?rank=7")
    evil = fast.page(f"/dashboard/jobs/{fast.jobs['evil']}")
    assert f"Job {_escaped(fast.jobs['evil'])}" in evil and "No task has run yet." in evil
    running = fast.page(f"/dashboard/jobs/{fast.jobs['running']}")
    assert "b-running" in _row(running, "<tr><td>0</td>")
    missing = fast.client.get("/dashboard/jobs/nope-1")
    assert missing.status_code == 404 and "No job nope-1" in missing.text


def test_a_job_s_log_is_shown_only_to_its_user_and_admins(tmp_path: Path) -> None:
    """The server reads logs with its own fs3 credentials, past the permissions ``hai logs`` meets:
    another user sees that the logs exist, never their text, and the reader is never asked."""
    asked: list[tuple[str, int]] = []

    class Counting(LocalLogReader):
        def tail(self, job_id: str, rank: int, max_bytes: int) -> bytes | None:
            asked.append((job_id, rank))
            return super().tail(job_id, rank, max_bytes)

    f = Fast(tmp_path, logs=Counting(tmp_path / "logs"))
    root = "root-token"
    f.server.users = dataclasses.replace(USERS, users=(*USERS.users, User("root", hash_token(root), admin=True)))
    try:
        chain = f.jobs["chain"]
        assert f.server.state.jobs[chain].user == "alice"
        f.login(BOB)
        text = f.page(f"/dashboard/jobs/{chain}")
        assert "The logs are visible to the job's user and admins." in text and "step 2999" not in text
        assert asked == []
        for token in (ALICE, root):
            f.client.cookies.clear()
            f.login(token)
            assert "step 2999 loss" in f.page(f"/dashboard/jobs/{chain}"), token
        assert len(asked) == 2
    finally:
        f.close()


def test_pages_read_only_the_in_memory_state(fast: Fast) -> None:
    """One snapshot per page, never the database: a store that refuses every use changes nothing."""
    fast.login()

    class NoStore:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the dashboard touched the store: {name}")

    real, fast.server.store = fast.server.store, NoStore()  # type: ignore[assignment]
    try:
        for path in ("/dashboard/nodes", "/dashboard/queue", f"/dashboard/jobs/{fast.jobs['chain']}"):
            fast.page(path)
    finally:
        fast.server.store = real


def test_a_server_without_log_access_says_so(tmp_path: Path) -> None:
    f = Fast(tmp_path, logs=False)
    try:
        f.login()
        text = f.page(f"/dashboard/jobs/{f.jobs['chain']}")
        assert "This server has no access to the jobs' logs" in text and f"hai logs {f.jobs['chain']} --rank 0" in text
    finally:
        f.close()


@pytest.mark.slow
def test_job_page_reads_the_log_from_fs3_where_the_agent_writes_it(tmp_path: Path, shared_cluster: Any) -> None:
    """The agent's fs3 log sink writes, the dashboard's fs3 reader shows the tail; the same path
    ``hai logs`` reads (``<root>/<job>/<rank>.log``), below a root of this test's own."""
    import fs3

    inproc = shared_cluster.cluster
    root = f"/hai-dashboard-{uuid.uuid4().hex[:8]}"
    connects: list[int] = []

    def connect() -> Any:
        connects.append(1)
        return fs3.connect(inproc.mgmtd_address, token=inproc.token)

    reader = Fs3LogReader(connect, root)
    f = Fast(tmp_path, logs=reader)
    writer_fs = fs3.connect(inproc.mgmtd_address, token=inproc.token)
    try:
        f.login()
        chain = f.jobs["chain"]
        assert f"No log at {root}/{chain}/0.log yet (fs3 {root})" in f.page(f"/dashboard/jobs/{chain}")
        log = Fs3LogSink(writer_fs, root).open(chain, 0)
        log.write(b"".join(b"step %d on fs3\n" % i for i in range(5000)) + SCRIPT.encode() + b"\n")
        log.publish()
        text = f.page(f"/dashboard/jobs/{chain}")
        assert "step 4999 on fs3" in text and "step 0 on fs3" not in text and _escaped(SCRIPT) in text
        assert f"{root}/{chain}/0.log (fs3 {root}), the last" in text
        assert len(connects) == 1  # one client, kept
        log.close()
    finally:
        writer_fs.close()
        reader.close()
        f.close()


def test_an_unreachable_fs3_is_said_on_the_page(tmp_path: Path) -> None:
    import fs3

    reader = Fs3LogReader(lambda: fs3.connect("127.0.0.1:1", rpc_timeout_ms=300, retry_total_ms=300))
    f = Fast(tmp_path, logs=reader)
    try:
        f.login()
        text = f.page(f"/dashboard/jobs/{f.jobs['chain']}")
        assert "Cannot read /hai/logs/chain-1/0.log (fs3 /hai/logs): cannot connect to fs3" in text
    finally:
        f.close()


def test_node_states_and_task_endings() -> None:
    config = CONFIG.rules
    now = 5000.0
    fresh = Node("n", "z", last_heartbeat_s=now - 1)
    assert node_status(fresh, now, config) == ("healthy", "")
    one = ClusterState(nodes={"n": fresh})
    validating = rules.validation_started(one, "n", now).nodes["n"]
    assert node_status(validating, now, config) == ("validating", "the validator is running")
    busy = rules.apply(rules.submit(one, JobSpec("J", "alice", 1, Priority.LOW), now),
                       rules.Decision(now, placements=(rules.Placement("J", ("n",), Priority.LOW, False),)))
    suspect = rules.fail_job(busy, "J", now, config, "rank exited 1", "n").nodes["n"]
    assert node_status(suspect, now, config) == ("suspect", "rank exited 1; waiting for its validator to pass")
    again = rules.validation_started(ClusterState(nodes={"n": suspect}), "n", now).nodes["n"]
    assert node_status(again, now, config) == ("validating", "the validator is running, after: rank exited 1")
    out = rules.validation_result(ClusterState(nodes={"n": suspect}), "n", False, ["GEMM"], now,
                                  rules.Config(max_validation_failures=1)).nodes["n"]
    assert node_status(out, now, config) == ("unhealthy", out.unhealthy_reason)
    assert out.unhealthy_reason.endswith("an admin must heal it: GEMM")
    assert node_status(Node("n", "z", last_heartbeat_s=now - 61), now, config) == ("offline", "no heartbeat for 61 s")
    back = rules.node_lost(one, "n", now, config, "no heartbeat").nodes["n"]
    assert node_status(back, now, config) == ("suspect", "was silent; back, waiting for its validator to pass")
    held = Node("n", "z", healthy=False, unhealthy_reason="no heartbeat", last_heartbeat_s=now - 1)
    assert node_status(held, now, config)[0] == "offline"  # from a version-1 database: back, for an admin

    def job(state: JobState, task: int) -> Job:
        return Job("j-1", "alice", "default", 1, Priority.LOW, seq=1, state=state, task=task)

    suspended = TaskRecord(0, ("n1",), 1.0, 2.0, "suspended")
    failed = TaskRecord(1, ("n1",), 3.0, 4.0, "failed: rank exited 9 on n1")
    assert task_ending(suspended, job(JobState.QUEUED, 1)) == ("suspended", "resumes as task 1")
    assert task_ending(failed, job(JobState.QUEUED, 2)) == ("restarted", "rank exited 9 on n1 (restarted as task 2)")
    assert task_ending(failed, job(JobState.FAILED, 1)) == ("failed", "rank exited 9 on n1")
    stopped = TaskRecord(1, ("n1",), 3.0, 4.0, "stopped by alice")
    assert task_ending(stopped, job(JobState.FAILED, 1)) == ("stopped", "stopped by alice")


def _row(text: str, marker: str) -> str:
    at = text.index(marker)
    return text[text.rindex("<tr>", 0, at):text.index("</tr>", at)]


def _escaped(value: str) -> str:
    import html

    return html.escape(value, quote=True)


# -- the browser ----------------------------------------------------------------------------------


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def _artifacts() -> Path:
    directory = Path(os.environ.get("FS3_TEST_ARTIFACTS") or ROOT / ".test-artifacts")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"


@pytest.mark.slow
def test_dashboard_in_headless_chromium(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No page reloads itself while the test reads it (a reload makes the elements it holds stale).
    monkeypatch.setattr(dashboard, "REFRESH_S", 3600)
    found = _chromium()
    if found is None:
        pytest.skip("no chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver; "
                    "scripts/bootstrap.sh installs them)")
    browser_path, driver_path = found
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.expected_conditions import staleness_of
    from selenium.webdriver.support.ui import WebDriverWait

    clock = Clock()
    server = HaiServer(Store.open(default_url(tmp_path)), USERS, CONFIG, clock=clock)
    log_dir = tmp_path / "logs"
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    web = uvicorn.Server(uvicorn.Config(create_app(server, run_loop=False, logs=LocalLogReader(log_dir)),
                                        host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    driver = None
    try:
        _wait_for(lambda: web.started, "the server to start")
        with httpx.Client(base_url=base, timeout=10.0) as client:
            jobs = populate(client, server, clock, log_dir)
        options = webdriver.ChromeOptions()
        options.binary_location = browser_path
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,900", f"--user-data-dir={tmp_path / 'chromium'}"):
            options.add_argument(flag)
        driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
        driver.set_page_load_timeout(DEADLINE_S)
        artifacts = _artifacts()

        def go(click: Callable[[], None]) -> None:
            """Click what navigates, and wait until the new page replaced the old (a click returns
            before the browser has loaded what it leads to: reading then finds the old page's
            elements, stale a moment later)."""
            assert driver is not None
            old = driver.find_element(By.TAG_NAME, "html")
            click()
            WebDriverWait(driver, DEADLINE_S).until(staleness_of(old))

        def shot(page: str) -> None:
            path = artifacts / f"hai-dashboard-{page}.png"
            assert driver is not None and driver.save_screenshot(str(path))
            assert _is_png(path), path

        driver.get(f"{base}/dashboard/nodes")
        assert driver.current_url == f"{base}/dashboard/login"
        driver.find_element(By.NAME, "token").send_keys("wrong")
        go(driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click)
        assert "Unknown token" in driver.find_element(By.TAG_NAME, "main").text
        driver.find_element(By.NAME, "token").send_keys(ALICE)
        shot("login")
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        _wait_for(lambda: driver is not None and driver.current_url == f"{base}/dashboard/queue", "the queue page")
        cookie = driver.get_cookie(COOKIE)
        assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert driver.execute_script("return document.cookie") == ""  # HttpOnly: no script can read it

        main = driver.find_element(By.TAG_NAME, "main").text
        assert jobs["big"] in main and jobs["running"] in main and str(server.waits[jobs["big"]]) in main
        assert EVIL_GROUP in main and jobs["evil"] in main  # shown as text, not markup
        assert not driver.find_elements(By.CSS_SELECTOR, "main b, main script")
        shot("queue")

        go(driver.find_element(By.LINK_TEXT, "Nodes").click)
        main = driver.find_element(By.TAG_NAME, "main").text
        assert "4 nodes: 3 healthy, 1 suspect." in main and f"rank exited 1 on {jobs['bad']}" in main
        shot("nodes")

        driver.get(f"{base}/dashboard/queue")
        go(driver.find_element(By.LINK_TEXT, jobs["chain"]).click)
        main = driver.find_element(By.TAG_NAME, "main").text
        assert f"Job {jobs['chain']}" in main and "restarted" in main and "finished" in main
        assert "step 2999 loss" in main and f"done {SCRIPT}" in main and EVIL_COMMAND in main
        shot("job")

        driver.find_element(By.CSS_SELECTOR, "header button[type=submit]").click()
        _wait_for(lambda: driver is not None and driver.current_url == f"{base}/dashboard/login", "the logout")
        driver.get(f"{base}/dashboard/queue")
        assert driver.current_url == f"{base}/dashboard/login"
    finally:
        if driver is not None:
            driver.quit()
        web.should_exit = True
        thread.join(10.0)
        server.close()

"""The HAI server's web dashboard: nodes, the queue and each job's chain, as server-rendered HTML.

Served by ``hai server`` under ``/dashboard/`` (:func:`add_routes`, called by
:func:`hai.server.create_app`). Read-only by design: there is no button that changes anything, so
no page needs CSRF protection, and a user looks at every job (the API's ``GET /jobs`` shows any
user every job too); stopping and suspending stay with the ``hai`` command and its bearer token.

**Login.** The API takes a bearer token per user; a browser cannot send one by itself, so
``/dashboard/login`` takes the token in a form and sets it as a cookie that scripts cannot read
(``HttpOnly``), that no other site's page can make the browser send (``SameSite=Strict``), scoped
to ``/dashboard`` (the API never reads it, so the API's own endpoints stay bearer-only and immune
to CSRF), ``Secure`` when served over HTTPS. Every page checks the cookie's token against the
users file as the API does; an unknown or missing one goes to the login page. Logout clears it.
A form POST from another origin (an ``Origin`` header that is not this server) is refused.

**Escaping.** Job names, commands, groups, node labels and reasons come from users and agents:
every value goes into the page through :func:`html.escape` (:func:`_e`), and into a URL through
:func:`urllib.parse.quote`. As a second line, every page carries a Content-Security-Policy that
allows no script at all, so markup that slipped through still could not run. Auto-refresh is a
``<meta http-equiv="refresh">``, which needs no script.

**Cost.** A page takes the state and the last pass's wait reasons once, under the server's lock,
and renders from that snapshot: no database query, and no per-job or per-node lookups that scan
the state again (the node → job map is built in one pass). Tables show at most
:data:`MAX_ROWS` rows and say how many more there are.

**Logs.** A job page shows the tail (:data:`LOG_TAIL_BYTES`) of one rank's log, from where the
agents write them: fs3 ``/hai/logs/<job>/<rank>.log`` (:class:`Fs3LogReader`, the path ``hai logs``
reads) or a directory (:class:`LocalLogReader`, for agents started with ``--log-dir`` on the same
host). A server started without either says so on the page instead of failing, as it does when
fs3 cannot be reached.
"""

from __future__ import annotations

import contextlib
import html
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from hai import rules
from hai.launcher import LOG_ROOT, log_path
from hai.rules import Auto, ClusterState, Job, JobState, Node, Priority, Wait
from hai.timefmt import duration, when

if TYPE_CHECKING:
    from hai.server import HaiServer, User

__all__ = [
    "COOKIE",
    "LOG_TAIL_BYTES",
    "MAX_ROWS",
    "PREFIX",
    "Fs3LogReader",
    "LocalLogReader",
    "LogReader",
    "add_routes",
    "node_status",
    "task_ending",
]

PREFIX = "/dashboard"
COOKIE = "hai_session"
REFRESH_S = 5  # how often the nodes, queue and job pages reload themselves
MAX_ROWS = 500  # rows of one table; the rest is counted, not shown
RECENT_ENDED = 20  # ended jobs listed under the queue, newest first
LOG_TAIL_BYTES = 16 * 1024  # of one rank's log, on a job page
MAX_RANK_LINKS = 32  # ranks linked on a job page; any other is reached through the rank form
MAX_TOKEN_CHARS = 512  # a token longer than any the server hands out is refused unread

_RANKS_ENV = "HAI_RANKS_PER_NODE"  # hai.server.RANKS_ENV; not imported, the server imports this module
_HOLDING = (JobState.RUNNING, JobState.SUSPENDING)
_ENDED = (JobState.FINISHED, JobState.FAILED)


# -- logs -----------------------------------------------------------------------------------------


class LogReader(Protocol):
    """Where the dashboard reads ranks' logs."""

    where: str  # shown on the page: "fs3 /hai/logs", "directory /var/hai-logs"

    def path(self, job_id: str, rank: int) -> str: ...

    def tail(self, job_id: str, rank: int, max_bytes: int) -> bytes | None:
        """The last ``max_bytes`` of the log, or None when there is none (yet). Raises OSError."""
        ...


def _seek_tail(f: Any, size: int, max_bytes: int) -> bytes:
    start = max(0, size - max_bytes)
    f.seek(start)
    data: bytes = f.read(size - start)
    return data


class LocalLogReader:
    """Logs in a local directory (``<directory>/<job>/<rank>.log``), as :class:`hai.launcher.LocalLogSink` writes."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.where = f"directory {self.directory}"

    def path(self, job_id: str, rank: int) -> str:
        return str(self.directory / job_id / f"{rank}.log")

    def tail(self, job_id: str, rank: int, max_bytes: int) -> bytes | None:
        if "/" in job_id or job_id in (".", ".."):  # never a path outside the directory
            return None
        try:
            with open(self.path(job_id, rank), "rb") as f:
                return _seek_tail(f, os.fstat(f.fileno()).st_size, max_bytes)
        except FileNotFoundError:
            return None


class Fs3LogReader:
    """Logs on fs3 below ``root`` (``/hai/logs``), through fs3's public client, the way ``hai logs``
    reads them. The client is made on first use and again after a failure, so a server started
    while fs3 was down shows logs once fs3 is up."""

    def __init__(self, connect: Callable[[], Any], root: str = LOG_ROOT) -> None:
        self._connect = connect
        self._root = root
        self._fs: Any = None
        self._connecting = False
        self._lock = threading.Lock()
        self.where = f"fs3 {root}"

    def path(self, job_id: str, rank: int) -> str:
        return log_path(job_id, rank, self._root)

    def _client(self) -> Any:
        """The client, connecting when there is none. One page connects at a time, outside the lock,
        and the others are told so at once rather than waiting: a connect to an fs3 that does not
        answer takes the client's whole retry budget, and pages queued behind it would each hold
        one of the threads the API's requests (the agents' heartbeats) run on."""
        with self._lock:
            if self._fs is not None:
                return self._fs
            if self._connecting:
                raise OSError("connecting to fs3 (for another page): reload in a moment")
            self._connecting = True
        try:
            fs = self._connect()
        except Exception as error:  # whatever the client raises: the page says it
            raise OSError(f"cannot connect to fs3: {error}") from error
        else:
            with self._lock:
                self._fs = fs
            return fs
        finally:
            with self._lock:
                self._connecting = False

    def tail(self, job_id: str, rank: int, max_bytes: int) -> bytes | None:
        path = self.path(job_id, rank)
        fs = self._client()
        try:
            size = int(fs.stat(path).st_size)
            with fs.open(path, "rb") as f:
                return _seek_tail(f, size, max_bytes)
        except FileNotFoundError:
            return None
        except OSError:
            self._drop(fs)  # the next page connects afresh
            raise
        except Exception as error:  # the client's own errors too: the page says it, the server stays up
            self._drop(fs)
            raise OSError(f"{type(error).__name__}: {error}") from error

    def _drop(self, fs: Any) -> None:
        with self._lock:
            if self._fs is fs:
                self._fs = None
        with contextlib.suppress(Exception):
            fs.close()

    def close(self) -> None:
        with self._lock:
            fs, self._fs = self._fs, None
        if fs is not None:
            fs.close()


# -- what the pages show --------------------------------------------------------------------------


def node_status(node: Node, now_s: float, config: rules.Config) -> tuple[str, str]:
    """A node's state for people, and why, from its health (:func:`hai.rules.node_health`):
    ``offline`` (no heartbeat for ``node_timeout_s``), ``validating`` (its validator runs),
    ``suspect`` (a failed rank, a silence, or a failed validation: no work until a validation
    passes), ``unhealthy`` (out until an admin puts it back), else ``healthy``."""
    silent_s = now_s - node.last_heartbeat_s
    health = rules.node_health(node)
    if silent_s > config.node_timeout_s:
        why = f"no heartbeat for {duration(silent_s)}"
        return "offline", why if node.healthy or node.unhealthy_reason == "no heartbeat" else \
            f"{why}; {node.unhealthy_reason}"
    if health == "validating":
        why = "the validator is running"
        return "validating", why if node.unhealthy_reason == "scheduled validation" else \
            f"{why}, after: {node.unhealthy_reason}"
    if health == "needs validation":
        if node.unhealthy_reason == "no heartbeat":
            return "suspect", "was silent; back, waiting for its validator to pass"
        return "suspect", f"{node.unhealthy_reason}; waiting for its validator to pass"
    if health == "unhealthy":
        if node.unhealthy_reason == "no heartbeat":
            return "offline", "was silent; back, waiting for an admin to mark it healthy"
        return "unhealthy", node.unhealthy_reason
    return "healthy", ""


def task_ending(record: rules.TaskRecord, job: Job) -> tuple[str, str]:
    """How one ended task of a chain ended: ``finished``, ``suspended`` (the job went back to the
    queue to resume), ``restarted`` (a fault; the chain went on), ``failed`` (the fault that ended
    the job), ``stopped`` (by a user); and the detail."""
    outcome = record.outcome
    later = job.task > record.index
    if outcome == "finished":
        return "finished", ""
    if outcome == "suspended":
        return "suspended", f"resumes as task {record.index + 1}" if later else ""
    if outcome.startswith("failed: "):
        reason = outcome.removeprefix("failed: ")
        if later:
            return "restarted", f"{reason} (restarted as task {record.index + 1})"
        return "failed", reason
    if outcome.startswith("stopped by "):
        return "stopped", outcome
    return "ended", outcome


def _priority(job: Job) -> str:
    level = "AUTO (unresolved)" if job.priority is None else job.priority.name
    requested = job.requested.value if isinstance(job.requested, Auto) else job.requested.name
    return level if requested == level else f"{level} (asked {requested})"


def _ranks_per_node(job: Job) -> int:
    try:
        return max(1, int(dict(job.env).get(_RANKS_ENV, "1")))
    except ValueError:
        return 1


def _queue_order(jobs: Iterable[Job], waits: Mapping[str, Wait]) -> list[Job]:
    """The order of ``GET /jobs``: the level a waiting job was ranked at in the last pass."""

    def level(job: Job) -> Priority:
        wait = waits.get(job.job_id)
        return wait.priority if wait is not None else job.priority or Priority.LOW

    return sorted(jobs, key=lambda j: rules.rank_key(level(j), j.seq))


# -- HTML -----------------------------------------------------------------------------------------


def _e(value: object) -> str:
    """Every value from the state goes into the page through here (quotes too: attributes)."""
    return html.escape(str(value), quote=True)


def _job_href(job_id: str) -> str:
    return f"{PREFIX}/jobs/{urllib.parse.quote(job_id, safe='')}"


def _job_link(job_id: str) -> str:
    return f'<a href="{_e(_job_href(job_id))}">{_e(job_id)}</a>'


def _badge(kind: str) -> str:
    return f'<span class="b b-{_e(kind)}">{_e(kind)}</span>'


def _table(header: list[str], rows: list[list[str]], total: int, empty: str) -> str:
    """Cells are HTML already (escaped by the caller); ``total`` counts the rows not shown too."""
    if not rows:
        return f'<p class="muted">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    more = f'<p class="muted">{total - len(rows)} more not shown.</p>' if total > len(rows) else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}"


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:center}
header a{color:#cfe0ff;text-decoration:none;font-weight:600}header .who{margin-left:auto}
header form{display:inline}header button{margin-left:8px}
main{padding:12px 16px}h1{font-size:20px;margin:4px 0 12px}h2{font-size:16px;margin:18px 0 6px}
table{border-collapse:collapse;background:#fff;width:100%}
th,td{border:1px solid #d9dde4;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eceff4}.muted{color:#6b7280}
pre{background:#111827;color:#e5e7eb;padding:8px;overflow:auto;white-space:pre-wrap}
.b{display:inline-block;padding:0 6px;border-radius:8px;font-size:12px;font-weight:600;background:#e5e7eb}
.b-healthy,.b-running,.b-finished{background:#c9f2d5}.b-unhealthy,.b-failed{background:#fbd0d0}
.b-offline{background:#d1d5db}.b-validating,.b-suspect,.b-suspending,.b-suspended{background:#fde9b6}
.b-queued,.b-restarted{background:#dbe7ff}.b-stopped{background:#eadcf8}
dl{display:grid;grid-template-columns:max-content auto;gap:2px 12px}dt{font-weight:600}dd{margin:0}
.err{color:#b91c1c}
"""

_CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'")
# same-origin, not no-referrer: under no-referrer a browser sends "Origin: null" with its own form posts.
_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
            "Cache-Control": "no-store", "X-Frame-Options": "DENY"}


def _page(title: str, body: str, user: User | None, *, refresh: bool, status: int = 200) -> HTMLResponse:
    nav = ""
    if user is not None:
        nav = (f'<a href="{PREFIX}/nodes">Nodes</a><a href="{PREFIX}/queue">Queue</a>'
               f'<span class="who">{_e(user.name)}{" (admin)" if user.admin else ""}'
               f'<form method="post" action="{PREFIX}/logout"><button type="submit">Log out</button></form></span>')
    meta = f'<meta http-equiv="refresh" content="{REFRESH_S}">' if refresh else ""
    text = (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{_e(title)} · hai</title><style>{_CSS}</style></head>"
            f"<body><header><strong>hai</strong>{nav}</header><main><h1>{_e(title)}</h1>{body}</main></body></html>")
    return HTMLResponse(text, status_code=status, headers=_HEADERS)


# -- pages ----------------------------------------------------------------------------------------


def _nodes_page(state: ClusterState, now_s: float, config: rules.Config) -> str:
    on_node: dict[str, str] = {}
    for job in state.jobs.values():  # one pass: each node's current job
        if job.state in _HOLDING:
            for name in job.assigned:
                on_node[name] = job.job_id
    counts: dict[str, int] = {}
    rows: list[list[str]] = []
    for name in sorted(state.nodes):
        node = state.nodes[name]
        status, why = node_status(node, now_s, config)
        counts[status] = counts.get(status, 0) + 1
        if len(rows) >= MAX_ROWS:
            continue
        job_id = on_node.get(name)
        rows.append([_e(name), _badge(status), _e(why), _e(node.zone), _e(node.group), _e(node.cpus),
                     _e(f"{node.memory_bytes / 2**30:.1f} GiB"),
                     _e(f"{duration(now_s - node.last_heartbeat_s)} ago" if node.last_heartbeat_s > 0 else "—"),
                     _job_link(job_id) if job_id else '<span class="muted">idle</span>'])
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return (f"<p>{len(state.nodes)} nodes{': ' + _e(summary) if summary else ''}.</p>"
            + _table(["Node", "State", "Reason", "Zone", "Group", "CPUs", "Memory", "Last heartbeat", "Job"],
                     rows, len(state.nodes), "No node has registered yet."))


def _queue_page(state: ClusterState, waits: Mapping[str, Wait], now_s: float) -> str:
    active = _queue_order((j for j in state.jobs.values() if j.state not in _ENDED), waits)
    rows: list[list[str]] = []
    for position, job in enumerate(active[:MAX_ROWS], 1):
        wait = waits.get(job.job_id) if job.state is JobState.QUEUED else None
        if job.state is JobState.QUEUED:
            reason = _e(wait) if wait is not None else '<span class="muted">next pass</span>'
            if job.not_before_s > now_s and wait is None:
                reason = _e(f"back-off for {duration(job.not_before_s - now_s)}")
            where = f"{job.nodes}"
        else:
            reason = _e(f"running for {duration(now_s - job.started_s)}")
            where = f"{job.nodes}: " + ", ".join(job.assigned)
        rows.append([_e(position), _job_link(job.job_id), _e(job.user), _e(job.group), _e(_priority(job)),
                     _badge(job.state.value), _e(where), _e(job.task), _e(job.restarts), reason])
    ended = sorted((j for j in state.jobs.values() if j.state in _ENDED), key=lambda j: -j.seq)
    recent = [[_job_link(j.job_id), _e(j.user), _badge(j.state.value), _e(len(j.history)), _e(j.restarts),
               _e(when(j.history[-1].ended_s) if j.history else "—"), _e(j.end_reason)]
              for j in ended[:RECENT_ENDED]]
    queued = sum(1 for j in active if j.state is JobState.QUEUED)
    return (f"<p>{queued} queued, {len(active) - queued} running or suspending, in queue order "
            "(higher priority first, then submit order).</p>"
            + _table(["#", "Job", "User", "Group", "Priority", "State", "Nodes", "Task", "Restarts", "Reason"],
                     rows, len(active), "No job is queued or running.")
            + "<h2>Recently ended</h2>"
            + _table(["Job", "User", "State", "Tasks", "Restarts", "Ended", "Reason"], recent, len(ended),
                     "No job has ended yet."))


def _log_section(job: Job, rank: int, logs: LogReader | None, user: User) -> str:
    """The tail of one rank's log, for the job's user and admins only: the server reads it with its
    own fs3 credentials, which may read every job's logs, while ``hai logs`` reads as the user
    (fs3's permissions decide there); anyone else would see a log fs3 would not show them."""
    world = job.nodes * _ranks_per_node(job)
    links = " ".join(
        f'<a href="{_e(_job_href(job.job_id))}?rank={r}">{"<strong>" if r == rank else ""}{r}'
        f'{"</strong>" if r == rank else ""}</a>' for r in range(min(world, MAX_RANK_LINKS)))
    form = ""
    if world > MAX_RANK_LINKS:
        form = (f'<form method="get" action="{_e(_job_href(job.job_id))}">rank <input name="rank" type="number" '
                f'min="0" max="{world - 1}" value="{rank}"><button type="submit">show</button></form>')
    head = f"<h2>Log of rank {rank}</h2><p>Ranks: {links}{' …' if world > MAX_RANK_LINKS else ''}</p>{form}"
    if not 0 <= rank < world:
        return head + f'<p class="err">The job has ranks 0 to {world - 1}.</p>'
    if user.name != job.user and not user.admin:
        return head + '<p class="muted">The logs are visible to the job\'s user and admins.</p>'
    if logs is None:
        return head + ('<p class="muted">This server has no access to the jobs\' logs (start <code>hai server</code> '
                       "with <code>--fs3 MGMTD</code>, <code>--profile NAME</code> or <code>--log-dir DIR</code>); "
                       f"read them with <code>hai logs {_e(job.job_id)} --rank {rank}</code>.</p>")
    path = logs.path(job.job_id, rank)
    try:
        # One byte more than is shown: whether the log is longer, and whether the shown part starts
        # with a whole line (the byte before it ends one).
        data = logs.tail(job.job_id, rank, LOG_TAIL_BYTES + 1)
    except OSError as error:
        return head + f'<p class="err">Cannot read {_e(path)} ({_e(logs.where)}): {_e(error)}</p>'
    if data is None:
        return head + f'<p class="muted">No log at {_e(path)} yet ({_e(logs.where)}).</p>'
    cut = len(data) > LOG_TAIL_BYTES
    if cut:
        newline = data.find(b"\n")
        data = data[newline + 1:] if 0 <= newline < len(data) - 1 else data[1:]  # from the first whole line
    text = data.decode("utf-8", errors="replace")
    note = f"the last {_e(len(data))} bytes" if cut else "all of it"
    return head + f'<p class="muted">{_e(path)} ({_e(logs.where)}), {note}:</p><pre>{_e(text)}</pre>'


def _job_page(job: Job, wait: Wait | None, rank: int, now_s: float, config: rules.Config,
              logs: LogReader | None, user: User) -> str:
    if job.state is JobState.QUEUED:
        why = str(wait) if wait is not None else (
            f"back-off for {duration(job.not_before_s - now_s)}" if job.not_before_s > now_s else "next pass")
    elif job.state in _HOLDING:
        why = f"task {job.task} on {', '.join(job.assigned)} for {duration(now_s - job.started_s)}"
    else:
        why = job.end_reason or job.state.value
    env_names = ", ".join(name for name, _ in job.env if name != _RANKS_ENV) or "—"
    facts = [("State", _badge(job.state.value)), ("Why", _e(why)), ("User", _e(job.user)), ("Group", _e(job.group)),
             ("Priority", _e(_priority(job))), ("Nodes", _e(f"{job.nodes} nodes, {_ranks_per_node(job)} ranks each")),
             ("Task", _e(job.task)), ("Restarts", _e(f"{job.restarts} of {config.max_restarts}")),
             ("Ran", _e(duration(job.ran_s + (now_s - job.started_s if job.state in _HOLDING else 0.0)))),
             ("Command", f"<code>{_e(job.command)}</code>"), ("Environment", _e(env_names))]
    dl = "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"
    rows: list[list[str]] = []
    for record in job.history[-MAX_ROWS:]:
        kind, detail = task_ending(record, job)
        rows.append([_e(record.index), _e(", ".join(record.nodes)), _e(when(record.started_s)),
                     _e(when(record.ended_s)), _e(duration(record.ended_s - record.started_s)), _badge(kind),
                     _e(detail)])
    if job.state in _HOLDING:
        rows.append([_e(job.task), _e(", ".join(job.assigned)), _e(when(job.started_s)), "—",
                     _e(duration(now_s - job.started_s)), _badge(job.state.value), ""])
    elif job.state is JobState.QUEUED and job.history:
        rows.append([_e(job.task), "—", "—", "—", "—", _badge("queued"), _e(why)])
    total = len(job.history) + (1 if job.state in _HOLDING or (job.state is JobState.QUEUED and job.history) else 0)
    chain = "<h2>Chain of tasks</h2>" + _table(["Task", "Nodes", "Started", "Ended", "Ran", "How it ended", "Detail"],
                                                rows, total, "No task has run yet.")
    return dl + chain + _log_section(job, rank, logs, user)


_LOGIN_FORM = (f'<form method="post" action="{PREFIX}/login"><p><label>Token <input name="token" type="password" '
               'autocomplete="current-password" required size="48"></label> <button type="submit">Log in</button></p>'
               '</form><p class="muted">Your hai token: the one <code>hai</code> uses (<code>$HAI_TOKEN</code>, or '
               "<code>token</code> in <code>~/.config/hai/config.toml</code>).</p>")


# -- routes ---------------------------------------------------------------------------------------


def add_routes(app: FastAPI, server: HaiServer, logs: LogReader | None = None) -> None:
    """Mount the dashboard on ``app`` under :data:`PREFIX`."""

    def viewer(request: Request) -> User | None:
        token = request.cookies.get(COOKIE, "")
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        return server.users.user_for(token)

    def snapshot() -> tuple[ClusterState, Mapping[str, Wait]]:
        with server.lock:  # the state and the reasons of the same pass
            return server.state, server.waits

    def to_login() -> Response:
        return RedirectResponse(f"{PREFIX}/login", status_code=303, headers={"Cache-Control": "no-store"})

    def cross_origin(request: Request) -> bool:
        """A browser names the page a form was posted from; its host must be this server's. Only the
        host is compared: behind a TLS proxy the page is https while this server may see http."""
        origin = request.headers.get("origin")
        if origin is None:
            return False  # not a browser's cross-site form post
        return urllib.parse.urlsplit(origin).netloc != request.headers.get("host", "")

    @app.get(PREFIX, include_in_schema=False)
    @app.get(f"{PREFIX}/", include_in_schema=False)
    def home(request: Request) -> Response:
        if viewer(request) is None:
            return to_login()
        return RedirectResponse(f"{PREFIX}/queue", status_code=303)

    @app.get(f"{PREFIX}/login", include_in_schema=False)
    def login_form(request: Request) -> Response:
        user = viewer(request)
        if user is not None:
            return RedirectResponse(f"{PREFIX}/queue", status_code=303)
        return _page("Log in", _LOGIN_FORM, None, refresh=False)

    @app.post(f"{PREFIX}/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        if cross_origin(request):
            return _page("Log in", '<p class="err">A login from another site is refused (a proxy in front of '
                         "the server must pass the Host header on).</p>", None, refresh=False, status=403)
        try:
            form = urllib.parse.parse_qs((await request.body()).decode("utf-8", errors="replace"), max_num_fields=8)
        except ValueError:  # more fields than the login form has
            form = {}
        token = (form.get("token") or [""])[0].strip()
        user = server.users.user_for(token) if token and len(token) <= MAX_TOKEN_CHARS else None
        if user is None:
            return _page("Log in", '<p class="err">Unknown token.</p>' + _LOGIN_FORM, None, refresh=False, status=401)
        response = RedirectResponse(f"{PREFIX}/queue", status_code=303, headers={"Cache-Control": "no-store"})
        response.set_cookie(COOKIE, token, path=PREFIX, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response

    @app.post(f"{PREFIX}/logout", include_in_schema=False)
    def logout(request: Request) -> Response:
        if cross_origin(request):
            return _page("Log out", '<p class="err">A logout from another site is refused.</p>', None,
                         refresh=False, status=403)
        response = to_login()
        response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict",
                               secure=request.url.scheme == "https")
        return response

    @app.get(f"{PREFIX}/nodes", include_in_schema=False)
    def nodes(request: Request) -> Response:
        user = viewer(request)
        if user is None:
            return to_login()
        state, _waits = snapshot()
        return _page("Nodes", _nodes_page(state, server.clock(), server.config.rules), user, refresh=True)

    @app.get(f"{PREFIX}/queue", include_in_schema=False)
    def queue(request: Request) -> Response:
        user = viewer(request)
        if user is None:
            return to_login()
        state, waits = snapshot()
        return _page("Queue", _queue_page(state, waits, server.clock()), user, refresh=True)

    @app.get(PREFIX + "/jobs/{job_id:path}", include_in_schema=False)
    def job(request: Request, job_id: str, rank: int = 0) -> Response:
        user = viewer(request)
        if user is None:
            return to_login()
        state, waits = snapshot()
        found = state.jobs.get(job_id)
        if found is None:
            return _page("No such job", f'<p class="err">No job {_e(job_id)}.</p>', user, refresh=False, status=404)
        wait = waits.get(job_id) if found.state is JobState.QUEUED else None
        body = _job_page(found, wait, rank, server.clock(), server.config.rules, logs, user)
        return _page(f"Job {job_id}", body, user, refresh=True)

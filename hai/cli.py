"""The user side of the ``hai`` command: ``submit``, ``ls``, ``show``, ``logs``, ``suspend``, ``stop``,
``nodes`` and ``quota``, each one or a few calls to ``hai server``'s HTTP API.

**Where the server is.** ``--server URL`` and ``--token T``, else ``$HAI_SERVER`` and ``$HAI_TOKEN``,
else ``server`` and ``token`` (or ``token_file``) of ``$XDG_CONFIG_HOME/hai/config.toml``
(``~/.config/hai/config.toml``); the server defaults to ``http://127.0.0.1:8470``. A config file
that holds a token must be the user's own and readable by nobody else (mode 0600), one that says
where the token goes must not be writable by others; otherwise it is refused, as fs3 refuses its
profiles.

**Job files** are TOML::

    name = "train"
    command = ["python", "train.py", "--steps", "1000"]   # or one string, split as a shell would
    nodes = 2
    ranks_per_node = 8          # default 1
    priority = "HIGH"           # a level, or AUTO; default NORMAL
    group = "default"
    checkpoint_bytes = 14e9     # optional: the job's state size, for `hai ls --wide`
    [env]
    LR = "0.1"

An unknown field, a value of the wrong type or a missing field is refused before anything is sent,
with the field and its line. ``checkpoint_bytes`` travels as the job's ``CHECKPOINT_BYTES``
variable, so the server keeps it and ``ls --wide`` reads it back.

**Output**: tables for people, ``--json`` for programs (the server's views, keys as the server names
them, plus ``checkpoint_advice`` with ``--wide``). **Exit status**: 0 done, 1 the server refused or
failed (or cannot be reached: one line), 2 bad usage or a bad job file. Every request has a
timeout (``--timeout-s``, 10 s by default).
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import os
import re
import shlex
import stat
import sys
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from hai.launcher import LOG_ROOT, log_path
from hai.rules import AUTO, Priority
from hai.timefmt import duration, when

__all__ = [
    "CHECKPOINT_BYTES_ENV",
    "DEFAULT_SERVER",
    "CliError",
    "JobFileError",
    "add_commands",
    "load_job_file",
    "parse_job",
]

DEFAULT_SERVER = "http://127.0.0.1:8470"
CHECKPOINT_BYTES_ENV = "CHECKPOINT_BYTES"
ENDED = ("finished", "failed")
MAX_LISTED = 100_000  # entries one `ls` or `nodes` reads, page by page
PAGE = 500
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PRIORITIES = (*Priority.__members__, AUTO.value)


class CliError(Exception):
    """A failure to report in one line; ``status`` is the exit status (1 server, 2 usage)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


class JobFileError(CliError):
    def __init__(self, message: str) -> None:
        super().__init__(message, 2)


# -- job files ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Field:
    types: tuple[type, ...]
    what: str
    required: bool = False


_FIELDS: Mapping[str, _Field] = {
    "name": _Field((str,), "a string", required=True),
    "command": _Field((str, list), "a string or a list of strings", required=True),
    "nodes": _Field((int,), "a whole number", required=True),
    "ranks_per_node": _Field((int,), "a whole number"),
    "priority": _Field((str,), f"one of {', '.join(_PRIORITIES)}"),
    "group": _Field((str,), "a string"),
    "env": _Field((dict,), "a table of strings"),
    "checkpoint_bytes": _Field((int, float), "a number of bytes"),
}


def _line_of(text: str, key: str, table: str | None = None) -> int | None:
    """The line (1-based) where ``key`` is set at the top level or in ``[table]``, if it can be found."""
    current: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        header = re.fullmatch(r"\[\s*([^\]]+?)\s*\]\s*(#.*)?", stripped)
        if header:
            current = header.group(1).strip('"\'')
            continue
        found = re.match(r"""(?:"([^"]*)"|'([^']*)'|([A-Za-z0-9_-]+))\s*[=.]""", stripped)
        if found and current == table and key in found.groups():
            return number
    return None


def parse_job(text: str, source: str = "job file") -> dict[str, Any]:
    """A job file's text as the body of ``POST /jobs``; :class:`JobFileError` names the field and line."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise JobFileError(f"{source}: not TOML: {error}") from error

    def where(key: str, table: str | None = None) -> str:
        line = _line_of(text, key, table)
        return f"{source}:{line}" if line is not None else source

    for key in data:
        if key not in _FIELDS:
            raise JobFileError(f"{where(key)}: unknown field {key!r} (fields: {', '.join(_FIELDS)})")
    for key, spec in _FIELDS.items():
        if key not in data:
            if spec.required:
                raise JobFileError(f"{source}: missing field {key!r} ({spec.what})")
            continue
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, spec.types):
            raise JobFileError(f"{where(key)}: {key} must be {spec.what}, not {type(value).__name__} {value!r:.80}")

    name = data["name"]
    if not _NAME.fullmatch(name):
        raise JobFileError(f"{where('name')}: name {name!r:.80} is not a plain name (letters, digits, . _ -, <= 64)")
    command = data["command"]
    if isinstance(command, list):
        if not command or not all(isinstance(part, str) for part in command):
            raise JobFileError(f"{where('command')}: command must be a non-empty list of strings")
        command = shlex.join(command)
    else:
        try:
            argv = shlex.split(command)
        except ValueError as error:
            raise JobFileError(f"{where('command')}: command is not a command line ({error})") from error
        if not argv:
            raise JobFileError(f"{where('command')}: command is empty")
    for key in ("nodes", "ranks_per_node"):
        if key in data and data[key] < 1:
            raise JobFileError(f"{where(key)}: {key} must be at least 1, not {data[key]}")
    priority = data.get("priority", "NORMAL")
    if priority not in _PRIORITIES:
        raise JobFileError(f"{where('priority')}: unknown priority {priority!r:.40} (one of {', '.join(_PRIORITIES)})")
    env: dict[str, str] = {}
    for var, value in dict(data.get("env", {})).items():
        if not isinstance(value, str):
            raise JobFileError(f"{where(var, 'env')}: env.{var} must be a string, not "
                               f"{type(value).__name__} {value!r:.80}")
        env[var] = value
    if "checkpoint_bytes" in data:
        size = data["checkpoint_bytes"]
        if not math.isfinite(size) or size <= 0:
            raise JobFileError(f"{where('checkpoint_bytes')}: checkpoint_bytes must be above zero, not {size}")
        if CHECKPOINT_BYTES_ENV in env:
            raise JobFileError(f"{where(CHECKPOINT_BYTES_ENV, 'env')}: env.{CHECKPOINT_BYTES_ENV} and "
                               "checkpoint_bytes both set; keep one")
        env[CHECKPOINT_BYTES_ENV] = str(int(size))
    body: dict[str, Any] = {"name": name, "command": command, "nodes": data["nodes"], "priority": priority,
                            "group": data.get("group", "default"), "env": env}
    if "ranks_per_node" in data:
        body["ranks_per_node"] = data["ranks_per_node"]
    return body


def load_job_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise JobFileError(f"{path}: cannot read: {error}") from error
    return parse_job(text, str(path))


# -- where the server is --------------------------------------------------------------------------


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "hai" / "config.toml"


def _load_config(path: Path) -> dict[str, str]:
    """``server``, ``token`` and ``token_file`` from the config file ({} without one), checked."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise CliError(f"hai config {path}: {error}", 2) from error
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        raw = f.read(1 << 20)
    try:
        data = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise CliError(f"hai config {path}: not TOML: {error}", 2) from error
    unknown = set(data) - {"server", "token", "token_file"}
    if unknown:
        raise CliError(f"hai config {path}: unknown field {sorted(unknown)[0]!r} (server, token, token_file)", 2)
    if not all(isinstance(v, str) for v in data.values()):
        raise CliError(f"hai config {path}: server, token and token_file are strings", 2)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (os.geteuid(), 0):
        raise CliError(f"hai config {path} is owned by uid {st.st_uid}, not {os.geteuid()}; fix: chown", 2)
    if "token" in data and mode & 0o077:
        raise CliError(f"hai config {path} holds a token and has mode {mode:04o}; fix: chmod 600 {path}", 2)
    if mode & 0o022:
        raise CliError(f"hai config {path} has mode {mode:04o}: others may change where the token goes; "
                       f"fix: chmod go-w {path}", 2)
    return dict(data)


def _endpoint(args: argparse.Namespace) -> tuple[str, str]:
    config: dict[str, str] | None = None

    def from_config() -> dict[str, str]:
        nonlocal config
        if config is None:
            config = _load_config(config_path())
        return config

    server = args.server or os.environ.get("HAI_SERVER") or from_config().get("server") or DEFAULT_SERVER
    token = args.token or os.environ.get("HAI_TOKEN") or from_config().get("token")
    if not token and from_config().get("token_file"):
        try:
            token = Path(from_config()["token_file"]).expanduser().read_text().strip()
        except OSError as error:
            raise CliError(f"hai config: token_file: {error}", 2) from error
    if not token:
        raise CliError(f"no token: give --token, set HAI_TOKEN, or put token in {config_path()}", 2)
    if not server.startswith(("http://", "https://")):
        server = "http://" + server
    return server.rstrip("/"), token


# -- the API --------------------------------------------------------------------------------------


class Api:
    """``hai server``'s API: every call with a timeout; failures as :class:`CliError` (status 1)."""

    def __init__(self, server: str, token: str, timeout_s: float) -> None:
        self.server = server
        self.client = httpx.Client(base_url=server, timeout=timeout_s,
                                   headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        self.client.close()

    def call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = self.client.request(method, path, **kw)
        except httpx.TimeoutException as error:
            raise CliError(f"the hai server at {self.server} did not answer in time ({type(error).__name__})") \
                from error
        except httpx.HTTPError as error:
            raise CliError(f"cannot reach the hai server at {self.server}: {error}") from error
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except (ValueError, AttributeError):
                detail = response.text[:200]
            if response.status_code == 401:
                detail = f"the server refused the token ({detail})"
            raise CliError(f"{detail} (HTTP {response.status_code})")
        try:
            return response.json()
        except ValueError as error:
            raise CliError(f"the hai server at {self.server} answered with something not JSON") from error

    def paged(self, path: str, key: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None and len(out) < MAX_LISTED:
            page = self.call("GET", path, params={**(params or {}), "offset": offset, "limit": PAGE})
            out += page[key]
            offset = page.get("next_offset")
        return out


# -- output ---------------------------------------------------------------------------------------


def _table(rows: list[list[str]], header: list[str]) -> str:
    cells = [header, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def _emit_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _priority(job: Mapping[str, Any]) -> str:
    effective, requested = job.get("priority"), job.get("requested")
    if effective is None or effective == requested:
        return str(requested)
    return f"{effective} ({requested})"


# -- checkpoint advice ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rates:
    write_bytes_per_s_per_node: float
    node_mtbf_s: float


def _rates(args: argparse.Namespace) -> _Rates:
    """fs3's per-node write rate and a node's MTBF: the flags, else cluster_model's inputs."""
    from hai import advice

    write = args.write_gbps_per_node * 1e9 if args.write_gbps_per_node else None
    mtbf = args.node_mtbf_h * 3600.0 if args.node_mtbf_h else None
    if write is None or mtbf is None:
        from cluster_model import load_cluster
        from cluster_model.measured import load_measured

        if write is None:
            write = advice.write_bytes_per_s_per_node_from(load_measured())
        if mtbf is None:
            cluster = load_cluster()
            mtbf = advice.node_mtbf_s_from_failures(cluster.failures, cluster.node.gpus)
    return _Rates(write, mtbf)


def _checkpoint_advice(job: Mapping[str, Any], rates: _Rates, overhead_s: float) -> dict[str, Any] | None:
    from hai import advice

    raw = dict(job.get("env") or {}).get(CHECKPOINT_BYTES_ENV)
    try:
        state_bytes = float(raw) if raw is not None else None
    except ValueError:
        state_bytes = None
    if state_bytes is None:
        return None
    try:
        result = advice.advise(int(job["nodes"]), state_bytes, rates.write_bytes_per_s_per_node, rates.node_mtbf_s,
                               overhead_s=overhead_s)
    except advice.AdviceError:
        return None
    return {"checkpoint_bytes": state_bytes, "checkpoint_s": result.checkpoint_s, "job_mtbf_s": result.job_mtbf_s,
            "interval_s": result.daly_interval_s, "young_interval_s": result.young_interval_s,
            "wasted_fraction": result.wasted_fraction}


# -- the commands ---------------------------------------------------------------------------------


def cmd_submit(api: Api, args: argparse.Namespace) -> int:
    body = load_job_file(Path(args.job_file))
    try:
        job = api.call("POST", "/jobs", json=body)
    except CliError as error:
        raise CliError(f"{args.job_file}: refused by the server: {error}") from error
    deadline = time.monotonic() + max(0.0, args.wait_s)
    while job.get("state") == "queued" and not job.get("reason") and time.monotonic() < deadline:
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        job = api.call("GET", f"/jobs/{job['job_id']}")
    if args.json:
        _emit_json(job)
        return 0
    line = f"submitted {job['job_id']}: {job['state']}"
    if job.get("state") == "queued":
        line += f" ({job['reason']})" if job.get("reason") else " (waiting for the scheduler's next pass)"
    print(line)
    return 0


def cmd_ls(api: Api, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"state": "all"} if args.all else {}
    if args.mine:
        params["mine"] = "true"
    if args.wide:
        params["env"] = CHECKPOINT_BYTES_ENV  # each job's state size comes with the listing: one request
    jobs = api.paged("/jobs", "jobs", params)
    if args.wide:
        rates = _rates(args)
        for job in jobs:
            if "env" in job:
                detail = {"nodes": job["nodes"], "env": job.pop("env")}
            else:  # a server without the listing's env= asks for each job on its own
                detail = api.call("GET", f"/jobs/{job['job_id']}")
            job["checkpoint_advice"] = _checkpoint_advice(detail, rates, args.checkpoint_overhead_s)
    if args.json:
        _emit_json({"jobs": jobs, "total": len(jobs)})
        return 0
    header = ["ID", "USER", "STATE", "PRIORITY", "NODES", "REASON"]
    if args.wide:
        header[5:5] = ["RANKS/NODE", "ASSIGNED", "RESTARTS", "CKPT EVERY", "WASTE"]
    rows = []
    for job in jobs:
        row = [job["job_id"], job["user"], job["state"], _priority(job), str(job["nodes"]), job.get("reason") or ""]
        if args.wide:
            tip = job.get("checkpoint_advice")
            row[5:5] = [str(job["ranks_per_node"]), ",".join(job["assigned"]) or "-", str(job["restarts"]),
                        duration(tip["interval_s"]) if tip else "-",
                        f"{tip['wasted_fraction']:.1%}" if tip else "-"]
        rows.append(row)
    print(_table(rows, header))
    return 0


WITHHELD = "(withheld)"  # how `hai show` prints a variable of another user's job, whose value the server withholds


def cmd_show(api: Api, args: argparse.Namespace) -> int:
    job = api.call("GET", f"/jobs/{args.job}")
    if args.json:
        _emit_json(job)
        return 0
    fields = [("job", job["job_id"]), ("user", job["user"]), ("state", job["state"]),
              ("priority", _priority(job)), ("group", job["group"]),
              ("nodes", f"{job['nodes']} x {job['ranks_per_node']} ranks"),
              ("assigned", ", ".join(job["assigned"]) or "-"), ("task", str(job["task"])),
              ("restarts", str(job["restarts"])), ("reason", job.get("reason") or "-"),
              ("command", job.get("command", ""))]
    if job.get("env"):
        # A value the server withholds (another user's job) is null: shown as such, not as "None".
        fields.append(("env", " ".join(f"{k}={WITHHELD if v is None else v}" for k, v in sorted(job["env"].items()))))
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        print(f"{key.ljust(width)}  {value}")
    chain = job.get("chain", [])
    if chain:
        print()
        print(_table([[str(t["task"]), ",".join(t["nodes"]) or "-", when(t["started_s"], "-"), when(t["ended_s"], "-"),
                       str(t["outcome"])] for t in chain], ["TASK", "NODES", "STARTED", "ENDED", "OUTCOME"]))
    return 0


def _act(verb: str) -> Callable[[Api, argparse.Namespace], int]:
    def command(api: Api, args: argparse.Namespace) -> int:
        job = api.call("POST", f"/jobs/{args.job}/{verb}")
        if args.json:
            _emit_json(job)
        else:
            print(f"{job['job_id']}: {job['state']}" + (f" ({job['reason']})" if job.get("reason") else ""))
        return 0

    return command


def cmd_nodes(api: Api, args: argparse.Namespace) -> int:
    nodes = api.paged("/nodes", "nodes")
    if args.json:
        _emit_json({"nodes": nodes, "total": len(nodes)})
        return 0
    print(_table([[n["name"], n["zone"], n["group"], n.get("health") or ("healthy" if n["healthy"] else "unhealthy"),
                   n.get("job") or "-", n.get("reason") or ""] for n in nodes],
                 ["NODE", "ZONE", "GROUP", "HEALTH", "JOB", "REASON"]))
    return 0


def cmd_quota(api: Api, args: argparse.Namespace) -> int:
    if args.set:
        user, group, priority, count = args.set
        try:
            max_nodes = int(count)
        except ValueError:
            raise CliError(f"quota --set: N must be a whole number, not {count!r}", 2) from None
        result = api.call("PUT", "/quota", json={"user": user, "group": group, "priority": priority,
                                                 "max_nodes": max_nodes})
        if args.json:
            _emit_json(result)
        else:
            print(f"quota of {result['user']} in {result['group']} at {result['priority']}: "
                  f"{result['max_nodes']} nodes")
        return 0
    quotas = api.call("GET", "/quota")
    if args.json:
        _emit_json(quotas)
        return 0
    print(_table([[q["user"], q["group"], q["priority"], str(q["max_nodes"]), str(q["used"])]
                  for q in quotas["quotas"]], ["USER", "GROUP", "PRIORITY", "MAX NODES", "USED"]))
    print(f"(without an entry: {quotas['default_quota_nodes']} nodes)")
    return 0


def _connect_fs3(args: argparse.Namespace) -> Any:
    import fs3

    options: dict[str, Any] = {"rpc_timeout_ms": int(args.timeout_s * 1000),
                               "retry_total_ms": int(args.timeout_s * 1000)}
    if args.profile:
        options["profile"] = args.profile
    try:
        return fs3.connect(args.mgmtd, token=args.fs3_token, **options)
    except Exception as error:  # whatever the client raises, one line
        raise CliError(f"cannot connect to fs3: {error}") from error


def cmd_logs(api: Api, args: argparse.Namespace) -> int:
    job = api.call("GET", f"/jobs/{args.job}")
    path = log_path(job["job_id"], args.rank, args.log_root)
    interval = min(max(args.interval_s, 0.05), 10.0)
    fs = _connect_fs3(args)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offset = 0

    def drain() -> None:
        nonlocal offset
        size = fs.stat(path).st_size
        if size <= offset:
            return
        with fs.open(path, "rb") as f:
            f.seek(offset)
            while offset < size:
                data = f.read(min(size - offset, 1 << 20))
                if not data:
                    break
                offset += len(data)
                if args.json:
                    print(json.dumps({"job_id": job["job_id"], "rank": args.rank, "offset": offset - len(data),
                                      "data": data.decode("utf-8", errors="replace")}), flush=True)
                else:
                    sys.stdout.write(decoder.decode(data))
                    sys.stdout.flush()

    try:
        if not args.follow:
            try:
                drain()
            except FileNotFoundError:
                raise CliError(f"no log {path} on fs3 (the job has not started, or no rank {args.rank})") from None
            return 0
        while True:
            ended = job["state"] in ENDED
            try:
                drain()
            except FileNotFoundError:
                if ended:
                    raise CliError(f"job {job['job_id']} has {job['state']} and left no log {path}") from None
            if ended:
                return 0
            time.sleep(interval)
            job = api.call("GET", f"/jobs/{args.job}")
    except KeyboardInterrupt:
        return 0
    except OSError as error:
        raise CliError(f"{path}: {error}") from error
    finally:
        if not args.json:
            sys.stdout.write(decoder.decode(b"", final=True))
        fs.close()


# -- the parser -----------------------------------------------------------------------------------


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--server", help=f"the hai server's URL (default: $HAI_SERVER, config, {DEFAULT_SERVER})")
    common.add_argument("--token", help="your bearer token (default: $HAI_TOKEN, or the config file)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--timeout-s", type=float, default=10.0, help="timeout of each request (default 10)")
    return common


_COMMANDS: dict[str, tuple[Callable[[Api, argparse.Namespace], int], str]] = {
    "submit": (cmd_submit, "submit a job file (TOML)"),
    "ls": (cmd_ls, "the queue and the running jobs"),
    "show": (cmd_show, "one job: its state, reason and chain of tasks"),
    "logs": (cmd_logs, "a rank's log, from fs3"),
    "suspend": (_act("suspend"), "suspend one of your jobs (it checkpoints and returns to the queue)"),
    "stop": (_act("stop"), "stop one of your jobs for good"),
    "nodes": (cmd_nodes, "the nodes, their health and jobs"),
    "quota": (cmd_quota, "your quotas (admins: everyone's), or set one"),
}


def add_commands(commands: Any) -> None:
    """Add the user subcommands to ``hai``'s subparsers (``commands`` from ``add_subparsers``)."""
    common = _common()
    parsers = {name: commands.add_parser(name, help=text, description=text, parents=[common])
               for name, (_, text) in _COMMANDS.items()}
    for name, parser in parsers.items():
        parser.set_defaults(run=_runner(_COMMANDS[name][0]))
    p = parsers["submit"]
    p.add_argument("job_file", metavar="JOB.toml")
    p.add_argument("--wait-s", type=float, default=3.0,
                   help="wait up to this long for a queued job's reason (default 3; 0: do not wait)")
    p = parsers["ls"]
    p.add_argument("--all", action="store_true", help="ended jobs too")
    p.add_argument("--mine", action="store_true", help="only your jobs")
    p.add_argument("--wide", action="store_true", help="more columns, with the checkpoint interval advice")
    p.add_argument("--write-gbps-per-node", type=float, help="fs3 write rate per node, GB/s (default: measured)")
    p.add_argument("--node-mtbf-h", type=float, help="a node's mean time between failures, hours "
                                                     "(default: the cluster model's)")
    p.add_argument("--checkpoint-overhead-s", type=float, default=0.0, help="fixed cost of one checkpoint")
    for name in ("show", "suspend", "stop"):
        parsers[name].add_argument("job", metavar="JOB")
    p = parsers["logs"]
    p.add_argument("job", metavar="JOB")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--follow", "-f", action="store_true", help="keep printing what is appended until the job ends")
    p.add_argument("--interval-s", type=float, default=1.0, help="--follow's polling interval (0.05 to 10 s)")
    p.add_argument("--mgmtd", help="fs3's mgmtd HOST:PORT (default: $FS3_MGMTD or the fs3 profile)")
    p.add_argument("--fs3-token", help="your fs3 token (default: $FS3_TOKEN or the fs3 profile)")
    p.add_argument("--profile", help="the fs3 profile of ~/.config/fs3/config.toml")
    p.add_argument("--log-root", default=LOG_ROOT, help=f"where the logs are on fs3 (default {LOG_ROOT})")
    parsers["quota"].add_argument("--set", nargs=4, metavar=("USER", "GROUP", "PRIORITY", "N"),
                                  help="set USER's quota in GROUP at PRIORITY to N nodes (admins)")


def _runner(command: Callable[[Api, argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        api: Api | None = None
        try:
            server, token = _endpoint(args)
            api = Api(server, token, args.timeout_s)
            return command(api, args)
        except CliError as error:
            print(f"hai: {error}", file=sys.stderr)
            return error.status
        finally:
            if api is not None:
                api.close()

    return run

"""What a node agent does to one job's ranks on its node: start them, carry their output to fs3,
ask them to suspend, stop them, and say how they ended.

:class:`RankLauncher` starts the node's ranks of a job as processes, each with the environment of
``torch.distributed``'s env:// rendezvous (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), the job's own variables, the job's control
directory (:mod:`hai.client`) and the submitting user's fs3 token. Nothing of the agent's own fs3
credentials reaches a rank: every inherited ``FS3_*`` variable is dropped first, since a job runs
user code and the cluster token would let it act as any service.

Each rank starts in a session of its own, so its process group holds everything it forks (a
launcher script, data loader workers, a shell pipeline) and one ``killpg`` reaches all of it. A rank
that exits leaves no process behind: once every rank has been reaped, each group gets a last
SIGKILL, whatever the outcome.

A rank's stdout and stderr go, as one stream, to ``/hai/logs/<job>/<rank>.log`` through a
:class:`LogSink` — :class:`Fs3LogSink` on fs3's public client, :class:`LocalLogSink` on a local
directory. A reader thread per rank holds at most ``log_chunk_bytes`` before it writes them out,
and writes synchronously, so a rank printing faster than the sink takes it is slowed by its full
pipe instead of growing the agent's memory. Written bytes are made visible to readers every
``log_flush_interval_s`` (an fs3 ``fsync`` publishes the length), which is what ``hai logs
--follow`` tails. A sink that keeps failing loses the chunk after ``log_retries`` tries (counted in
the report); a job is never stopped because its log could not be written.

How a job ends (:class:`Outcome`): every rank exited 0 → finished; a rank exited non-zero or by a
signal the launcher did not send → failed, and the others are stopped; a suspend that the job
acknowledged and then exited 0 → suspended; a suspend not completed within its grace → force-stopped
(SIGTERM to every group, SIGKILL after ``term_grace_s``); :meth:`RankLauncher.stop` → stopped.
:meth:`RankLauncher.close` kills whatever still runs at once, from any state, including from
another thread while :meth:`~RankLauncher.suspend` waits: no rank outlives its launcher. Nor its
process: each rank is started with Linux's parent-death signal (SIGKILL when the thread that
started it dies), so an agent killed by SIGKILL or the OOM killer leaves no rank running on the
node — what a rank itself forked is not reached that way (its group is only killed by a living
launcher). So a launcher must be made on a thread that lives as long as its ranks should (the
agent's heartbeat loop).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hai.client import ACK_PREFIX, CONTROL_DIR_ENV, SUSPEND_FILE

__all__ = [
    "LOG_ROOT",
    "Fs3LogSink",
    "LaunchError",
    "LaunchReport",
    "LaunchSpec",
    "LocalLogSink",
    "LogSink",
    "LogWriter",
    "Outcome",
    "RankExit",
    "RankLauncher",
    "log_path",
]

log = logging.getLogger(__name__)

LOG_ROOT = "/hai/logs"
"""Where on fs3 ranks' logs live: ``<LOG_ROOT>/<job>/<rank>.log``."""

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Variables the launcher sets itself: a job's environment cannot override them.
_RESERVED_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                           "LOCAL_WORLD_SIZE", "HAI_JOB_ID", CONTROL_DIR_ENV, "FS3_TOKEN", "FS3_MGMTD"})
_READ_BYTES = 64 * 1024
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the forked rank, before its exec: the kernel SIGKILLs it when the thread that started it
    dies — a SIGKILLed agent cannot stop its ranks itself, and a rank in a session of its own
    is reached by nothing else. The setting survives the exec (not into set-user-ID programs).
    Nothing here takes a lock, as code between fork and exec in a threaded program must not."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def log_path(job_id: str, rank: int, root: str = LOG_ROOT) -> str:
    """The path of one rank's log below ``root``."""
    return f"{root.rstrip('/')}/{job_id}/{rank}.log"


class LaunchError(RuntimeError):
    """The job could not be started (bad spec, a rank that could not be spawned, a log sink that
    could not be opened); nothing of it is left running."""


class Outcome(enum.StrEnum):
    """How a job's ranks on this node ended; RUNNING until they did."""

    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    SUSPENDED = "suspended"
    FORCE_STOPPED = "force-stopped"
    STOPPED = "stopped"


@dataclass(frozen=True)
class LaunchSpec:
    """One job's ranks on one node.

    ``first_rank`` is the global rank of this node's local rank 0; the node runs ranks
    ``first_rank .. first_rank + local_world_size - 1`` of ``world_size``. ``fs3_token`` is the
    submitting user's token, handed to the ranks as ``FS3_TOKEN`` (never the cluster's).
    """

    job_id: str
    command: Sequence[str]
    master_addr: str
    master_port: int
    world_size: int
    first_rank: int = 0
    local_world_size: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    fs3_token: str | None = None
    fs3_mgmtd: str | None = None
    cwd: str | None = None

    def validate(self) -> None:
        """Raise :class:`LaunchError` for a spec that cannot be launched as given."""
        if not _JOB_ID.fullmatch(self.job_id):
            raise LaunchError(f"job id {self.job_id!r} is not a plain name (letters, digits, . _ -, <= 128)")
        if isinstance(self.command, str | bytes) or not self.command:
            raise LaunchError("the command must be a non-empty sequence of arguments, not "
                              f"{type(self.command).__name__} {self.command!r}"[:300])
        for what, text in [*(("a command argument", arg) for arg in self.command),
                           *((f"environment variable {name}", value) for name, value in self.env.items()),
                           ("the fs3 token", self.fs3_token or ""), ("the fs3 mgmtd", self.fs3_mgmtd or ""),
                           ("the working directory", self.cwd or "")]:
            if not isinstance(text, str) or "\0" in text:
                raise LaunchError(f"{what} is not text without NUL characters")
        if not 0 < self.master_port < 65536:
            raise LaunchError(f"master port {self.master_port} is out of range")
        if self.local_world_size < 1 or self.first_rank < 0 \
                or self.first_rank + self.local_world_size > self.world_size:
            raise LaunchError(f"ranks {self.first_rank}..{self.first_rank + self.local_world_size - 1} "
                              f"do not fit a world of {self.world_size}")
        for name in self.env:
            if not _ENV_NAME.fullmatch(name):
                raise LaunchError(f"environment variable name {name!r} is not valid")
            if name in _RESERVED_ENV:
                raise LaunchError(f"environment variable {name} is set by hai, not by the job")

    def rank_env(self, local_rank: int, control_dir: str, inherited: Mapping[str, str]) -> dict[str, str]:
        """The environment of one rank: ``inherited`` less every ``FS3_``/``HAI_`` variable, then
        the job's variables, then the launcher's own."""
        env = {k: v for k, v in inherited.items() if not k.startswith(("FS3_", "HAI_"))}
        env.update(self.env)
        env.update({
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "WORLD_SIZE": str(self.world_size),
            "RANK": str(self.first_rank + local_rank),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "HAI_JOB_ID": self.job_id,
            CONTROL_DIR_ENV: control_dir,
        })
        if self.fs3_token is not None:
            env["FS3_TOKEN"] = self.fs3_token
        if self.fs3_mgmtd is not None:
            env["FS3_MGMTD"] = self.fs3_mgmtd
        return env


@dataclass(frozen=True)
class RankExit:
    """One rank's end: ``exit_code`` when it exited, ``signal`` when a signal killed it, both None
    while it runs."""

    rank: int
    local_rank: int
    pid: int
    exit_code: int | None
    signal: int | None

    @property
    def running(self) -> bool:
        return self.exit_code is None and self.signal is None


@dataclass(frozen=True)
class LaunchReport:
    """Where the job's ranks on this node stand, or how they ended."""

    job_id: str
    outcome: Outcome
    reason: str
    ranks: tuple[RankExit, ...]
    log_bytes: int
    log_dropped_bytes: int
    log_peak_buffered_bytes: int


class LogWriter(Protocol):
    """One rank's log, open for appending."""

    def write(self, data: bytes) -> None: ...

    def publish(self) -> None:
        """Make everything written so far visible to readers."""

    def close(self) -> None: ...


class LogSink(Protocol):
    """Where ranks' logs go."""

    def open(self, job_id: str, rank: int) -> LogWriter: ...


class _FileWriter:
    def __init__(self, file: Any, durable: bool) -> None:
        self._file = file
        self._durable = durable

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = self._file.write(view)
            view = view[written if written is not None else len(view):]

    def publish(self) -> None:
        self._file.flush()
        if self._durable:
            self._file.fsync()

    def close(self) -> None:
        try:
            self.publish()
        finally:
            self._file.close()


class Fs3LogSink:
    """Logs on fs3 through its public client; appends, so a resumed or restarted job's rank adds
    to the log of its earlier tasks. :meth:`LogWriter.publish` is an fsync, which makes the new
    length visible to other clients (a follower)."""

    def __init__(self, fs: Any, root: str = LOG_ROOT) -> None:
        self._fs = fs
        self._root = root

    @classmethod
    def connect(cls, mgmtd: str | None = None, token: str | None = None, root: str = LOG_ROOT) -> Fs3LogSink:
        import fs3

        return cls(fs3.connect(mgmtd, token=token), root)

    def open(self, job_id: str, rank: int) -> LogWriter:
        path = log_path(job_id, rank, self._root)
        self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        return _FileWriter(self._fs.open(path, "ab"), durable=True)


class LocalLogSink:
    """Logs in a local directory, same layout (``<directory>/<job>/<rank>.log``): for an agent
    without fs3, and for tests."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._directory = Path(directory)

    def open(self, job_id: str, rank: int) -> LogWriter:
        path = self._directory / job_id / f"{rank}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return _FileWriter(open(path, "ab", buffering=0), durable=False)


class _Rank:
    """One rank's process, its reader thread and what the launcher learned of it."""

    def __init__(self, rank: int, local_rank: int, proc: subprocess.Popen[bytes], writer: LogWriter) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.proc = proc
        self.pgid = proc.pid  # start_new_session: the rank leads its own group
        self.writer = writer
        self.returncode: int | None = None
        self.reaped_mono: float | None = None
        self.reader: threading.Thread | None = None
        # Set once the group was seen empty after the rank was reaped: from then on its id may be
        # a new process's, and the launcher never signals it again.
        self.group_gone = False

    def exit(self) -> RankExit:
        code = self.returncode
        return RankExit(self.rank, self.local_rank, self.proc.pid,
                        code if code is not None and code >= 0 else None,
                        -code if code is not None and code < 0 else None)


def _rank_group_alive(rank: _Rank) -> bool:
    """Whether the rank's group may still hold a process; once the rank was reaped and the group
    was seen empty, never again (the id is free for the system to hand out)."""
    if rank.group_gone:
        return False
    if not _group_alive(rank.pgid):
        if rank.proc.returncode is not None:
            rank.group_gone = True
        return False
    return True


def _signal_group(rank: _Rank, sig: int) -> None:
    """Signal the rank's group unless it is known gone. While the rank is unreaped its pid, and so
    the group id, cannot be reused; after that only a group seen alive just now is signalled."""
    if rank.proc.returncode is not None and not _rank_group_alive(rank):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(rank.pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RankLauncher:
    """One job's ranks on this node; see the module docstring for what it guarantees.

    Use as a context manager (or call :meth:`close`) so that nothing outlives it::

        with RankLauncher(spec, LocalLogSink(tmp)) as job:
            report = job.suspend(ack_grace_s=5, finish_grace_s=5)

    ``term_grace_s``: between SIGTERM and SIGKILL when stopping by force (a rank may flush on
    SIGTERM, but a group that ignores it must not hold the node). ``log_chunk_bytes``: the most of a
    rank's output held before it is written. ``log_flush_interval_s``: how stale a follower's view
    of a log may be. ``log_retries``: tries per chunk before it is dropped. ``log_drain_s``: how long
    a reader keeps reading after its rank was reaped (a process that left the group may hold the
    pipe forever). ``final_wait_s``: the most :meth:`suspend` and :meth:`stop` wait for the reaping
    after the kill (a process stuck in the kernel cannot be hurried). ``control_root``: where the
    control directory is made (the system's temporary directory by default).
    """

    def __init__(self, spec: LaunchSpec, sink: LogSink, *, control_root: str | None = None,
                 inherited_env: Mapping[str, str] | None = None, term_grace_s: float = 2.0,
                 log_chunk_bytes: int = 256 * 1024, log_flush_interval_s: float = 0.5,
                 log_retries: int = 3, log_drain_s: float = 1.0, poll_interval_s: float = 0.02,
                 final_wait_s: float = 30.0) -> None:
        spec.validate()
        if log_chunk_bytes < 1 or log_retries < 1:
            raise LaunchError("log_chunk_bytes and log_retries must be positive")
        self.spec = spec
        self._sink = sink
        self._term_grace_s = term_grace_s
        self._chunk_bytes = log_chunk_bytes
        self._flush_interval_s = log_flush_interval_s
        self._log_retries = log_retries
        self._drain_s = log_drain_s
        self._poll_s = poll_interval_s
        self._final_wait_s = final_wait_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._done = threading.Event()
        self._outcome = Outcome.RUNNING
        self._reason = ""
        self._suspending = False
        self._acked = False
        self._terminate_started = False
        self._log_bytes = 0
        self._dropped_bytes = 0
        self._peak_buffered = 0
        self._ranks: list[_Rank] = []
        try:
            self._control = tempfile.mkdtemp(prefix=f"hai-{spec.job_id}-", dir=control_root)
        except OSError as exc:
            raise LaunchError(f"cannot make the job's control directory in {control_root!r}: {exc}") from exc
        inherited = dict(os.environ if inherited_env is None else inherited_env)
        try:
            self._start(inherited)
        except BaseException:
            self._kill_all_now()
            shutil.rmtree(self._control, ignore_errors=True)
            raise
        self._supervisor = threading.Thread(target=self._supervise, name=f"hai-{spec.job_id}-supervisor",
                                            daemon=True)
        self._supervisor.start()

    # -- starting -------------------------------------------------------------------------------

    def _start(self, inherited: Mapping[str, str]) -> None:
        spec = self.spec
        for local_rank in range(spec.local_world_size):
            rank = spec.first_rank + local_rank
            try:
                writer = self._sink.open(spec.job_id, rank)
            except Exception as exc:
                raise LaunchError(f"cannot open the log of rank {rank}: {exc}") from exc
            try:
                proc = subprocess.Popen(
                    list(spec.command), env=spec.rank_env(local_rank, self._control, inherited), cwd=spec.cwd,
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    start_new_session=True, close_fds=True, bufsize=0, preexec_fn=_die_with_parent)
            except OSError as exc:
                writer.close()
                raise LaunchError(f"cannot start rank {rank}: {exc}") from exc
            state = _Rank(rank, local_rank, proc, writer)
            self._ranks.append(state)
            state.reader = threading.Thread(target=self._pump, args=(state,), name=f"hai-{spec.job_id}-log-{rank}",
                                            daemon=True)
            state.reader.start()

    # -- logs -----------------------------------------------------------------------------------

    def _pump(self, rank: _Rank) -> None:
        """Carry one rank's output to its log in chunks of at most ``log_chunk_bytes``.

        Stops at end of file, or ``log_drain_s`` after the rank was reaped when something that
        escaped its process group still holds the pipe open.
        """
        assert rank.proc.stdout is not None
        fd = rank.proc.stdout.fileno()
        buffer = bytearray()
        unpublished = False
        last_publish = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                reaped = rank.reaped_mono
                if reaped is not None and now - reaped > self._drain_s:
                    break
                ready, _, _ = select.select([fd], [], [], min(self._flush_interval_s, 0.1))
                if ready:
                    data = os.read(fd, _READ_BYTES)
                    if not data:
                        break
                    buffer += data
                    with self._lock:
                        self._peak_buffered = max(self._peak_buffered, len(buffer))
                    if len(buffer) >= self._chunk_bytes:
                        self._write(rank, buffer)
                        unpublished = True
                if time.monotonic() - last_publish >= self._flush_interval_s:
                    if buffer:
                        self._write(rank, buffer)
                        unpublished = True
                    if unpublished:
                        self._publish(rank)
                        unpublished = False
                    last_publish = time.monotonic()
        except Exception:
            log.exception("log reader of %s rank %d failed", self.spec.job_id, rank.rank)
        finally:
            if buffer:
                self._write(rank, buffer)
            try:
                rank.writer.close()
            except Exception as exc:
                log.warning("closing the log of %s rank %d: %s", self.spec.job_id, rank.rank, exc)
            rank.proc.stdout.close()

    def _write(self, rank: _Rank, buffer: bytearray) -> None:
        """Write and empty ``buffer``, retrying a failing sink a bounded number of times."""
        data = bytes(buffer)
        buffer.clear()
        for attempt in range(self._log_retries):
            try:
                rank.writer.write(data)
            except Exception as exc:
                log.warning("log of %s rank %d: write failed (%s), attempt %d/%d", self.spec.job_id,
                            rank.rank, exc, attempt + 1, self._log_retries)
                time.sleep(min(0.05 * 2 ** attempt, 1.0))
                continue
            with self._lock:
                self._log_bytes += len(data)
            return
        with self._lock:
            self._dropped_bytes += len(data)

    def _publish(self, rank: _Rank) -> None:
        try:
            rank.writer.publish()
        except Exception as exc:
            log.warning("log of %s rank %d: publish failed: %s", self.spec.job_id, rank.rank, exc)

    # -- supervising ----------------------------------------------------------------------------

    def _reap(self) -> None:
        """Record every rank that exited, then decide the outcome if the exits settle it."""
        now = time.monotonic()
        with self._lock:
            for rank in self._ranks:
                if rank.returncode is None:
                    code = rank.proc.poll()
                    if code is not None:
                        rank.returncode = code
                        rank.reaped_mono = now
                        _rank_group_alive(rank)  # an empty group is marked gone before its id can be reused
            if self._suspending and not self._acked:
                with contextlib.suppress(OSError):
                    self._acked = any(name.startswith(ACK_PREFIX) for name in os.listdir(self._control))
            self._decide_locked()

    def _decide_locked(self) -> None:
        if self._outcome is not Outcome.RUNNING:
            return
        for rank in self._ranks:
            if rank.returncode not in (None, 0):
                assert rank.returncode is not None
                how = (f"exited with {rank.returncode}" if rank.returncode > 0
                       else f"was killed by {signal.Signals(-rank.returncode).name}")
                self._outcome, self._reason = Outcome.FAILED, f"rank {rank.rank} {how}"
                return
        if all(rank.returncode is not None for rank in self._ranks):
            if self._suspending and self._acked:
                self._outcome, self._reason = Outcome.SUSPENDED, "acknowledged the suspend request and exited"
            elif self._suspending:
                self._outcome, self._reason = Outcome.FINISHED, "exited 0 without acknowledging the suspend request"
            else:
                self._outcome, self._reason = Outcome.FINISHED, "every rank exited 0"

    def _all_reaped(self) -> bool:
        with self._lock:
            return all(rank.returncode is not None for rank in self._ranks)

    def _supervise(self) -> None:
        try:
            while not self._closing.is_set():
                self._reap()
                with self._lock:
                    failed = self._outcome is Outcome.FAILED
                if failed:
                    self._terminate()
                if self._all_reaped():
                    break
                self._wake.wait(self._poll_s)
        finally:
            self._kill_all_now()
            for rank in self._ranks:
                if rank.reader is not None:
                    rank.reader.join(self._drain_s + 5.0)
            self._done.set()

    def _terminate(self) -> None:
        """SIGTERM every rank's group, SIGKILL after ``term_grace_s`` what is left, and reap."""
        with self._lock:
            if self._terminate_started:
                return
            self._terminate_started = True
        for rank in self._ranks:
            _signal_group(rank, signal.SIGTERM)
        deadline = time.monotonic() + self._term_grace_s
        while time.monotonic() < deadline and not self._closing.is_set():
            self._reap()
            if self._all_reaped() and not any(_rank_group_alive(rank) for rank in self._ranks):
                break
            time.sleep(self._poll_s)
        self._kill_all_now()

    def _kill_all_now(self) -> None:
        """SIGKILL every rank's group and reap the ranks (a SIGKILLed process exits at once)."""
        for rank in self._ranks:
            _signal_group(rank, signal.SIGKILL)
        for rank in self._ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rank.proc.wait(timeout=5.0)
        self._reap()

    # -- the agent's calls ----------------------------------------------------------------------

    @property
    def control_dir(self) -> str:
        """The directory the ranks know as ``$HAI_CONTROL_DIR``."""
        return self._control

    @property
    def pids(self) -> tuple[int, ...]:
        """The ranks' process ids (each also its process group's id)."""
        return tuple(rank.proc.pid for rank in self._ranks)

    def report(self) -> LaunchReport:
        """Where the job stands now; final once :meth:`wait` returned it."""
        with self._lock:
            return LaunchReport(self.spec.job_id, self._outcome, self._reason,
                                tuple(rank.exit() for rank in self._ranks), self._log_bytes,
                                self._dropped_bytes, self._peak_buffered)

    def wait(self, timeout_s: float | None = None) -> LaunchReport:
        """Wait until every rank has ended and its log is written (or ``timeout_s`` passed)."""
        self._done.wait(timeout_s)
        return self.report()

    def suspend(self, ack_grace_s: float = 5.0, finish_grace_s: float = 5.0) -> LaunchReport:
        """Ask the ranks to suspend and wait for them; stop them by force when they do not.

        The job gets at most ``ack_grace_s + finish_grace_s`` in all and, once it acknowledged
        (:func:`hai.client.go_suspend`), at most ``finish_grace_s`` more to exit: an acknowledgement
        says the checkpoint is saved, so from then on only exiting is left. A job still running at
        its deadline is force-stopped (SIGTERM, SIGKILL after ``term_grace_s``). A rank exiting
        non-zero meanwhile fails the job as it would at any time. Returns the final report.
        """
        with self._lock:
            if self._outcome is not Outcome.RUNNING or self._suspending:
                already = True
            else:
                already, self._suspending = False, True
        if already:
            return self.wait(ack_grace_s + finish_grace_s + self._term_grace_s + self._final_wait_s)
        try:
            self._deliver_suspend()
            start = time.monotonic()
            exit_deadline = start + ack_grace_s + finish_grace_s
            acked_at: float | None = None
            while not self._closing.is_set():
                self._reap()
                now = time.monotonic()
                with self._lock:
                    if self._acked and acked_at is None:
                        acked_at = now
                        exit_deadline = min(exit_deadline, now + finish_grace_s)
                    if self._outcome is not Outcome.RUNNING:
                        break
                    if now >= exit_deadline:
                        self._outcome = Outcome.FORCE_STOPPED
                        self._reason = ("acknowledged but did not exit within the finish grace" if self._acked
                                        else "did not acknowledge the suspend request within the grace")
                        break
                time.sleep(self._poll_s)
            with self._lock:
                forced = self._outcome is Outcome.FORCE_STOPPED
            if forced:
                self._terminate()
        except BaseException:
            self.close()
            raise
        return self.wait(self._final_wait_s)

    def _deliver_suspend(self) -> bool:
        """Create the request in the control directory; False (logged) when it cannot be.

        The ranks can write the directory, so nothing in it is trusted: the directory itself is
        opened without following a symlink, the temporary file gets a fresh name created
        exclusively (never written through a link a rank planted), and a rank that removed the
        directory or blocked the name is force-stopped at the end of the grace, as one that
        ignores the request would be."""
        temporary = f".{SUSPEND_FILE}.{secrets.token_hex(8)}"
        try:
            directory = os.open(self._control, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            log.warning("%s: cannot deliver the suspend request: %s", self.spec.job_id, exc)
            return False
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=directory)
            try:
                os.write(fd, b"suspend\n")
            finally:
                os.close(fd)
            os.replace(temporary, SUSPEND_FILE, src_dir_fd=directory, dst_dir_fd=directory)
        except OSError as exc:
            log.warning("%s: cannot deliver the suspend request: %s", self.spec.job_id, exc)
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=directory)
            return False
        finally:
            os.close(directory)
        return True

    def stop(self) -> LaunchReport:
        """Stop the job now (SIGTERM, SIGKILL after ``term_grace_s``); returns the final report."""
        with self._lock:
            if self._outcome is Outcome.RUNNING:
                self._outcome, self._reason = Outcome.STOPPED, "stopped"
        self._terminate()
        return self.wait(self._final_wait_s)

    def close(self) -> None:
        """Kill whatever still runs, wait for the logs, remove the control directory. Safe to call
        from any thread, at any time, more than once."""
        with self._lock:
            if self._outcome is Outcome.RUNNING:
                self._outcome, self._reason = Outcome.STOPPED, "the launcher was closed"
        self._closing.set()
        self._wake.set()
        self._kill_all_now()
        self._done.wait(self._drain_s + 10.0)
        shutil.rmtree(self._control, ignore_errors=True)

    def __enter__(self) -> RankLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

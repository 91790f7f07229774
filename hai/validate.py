"""``hai validate``: measure a node before it takes work (and on a schedule) and judge it.

The checks, each bounded in time and memory, each returning a measurement or a reason it failed:

* **cpu** — the CPUs this process may run on (``os.sched_getaffinity``) and a short integer loop
  whose result is known, so a miscomputing core fails as well as a slow one.
* **memory** — copy a buffer (256 MiB by default) with numpy, best of a few passes; bandwidth counts
  the bytes read plus the bytes written.
* **gemm** — multiply fixed seeded float32 matrices of small integers (every product and sum is
  exact in float32) and compare every element with the float64 reference: a wrong result fails
  the node however fast it came.
* **allreduce** — two local ranks (:mod:`hai.allreduce_probe`) allreduce with HFReduce through the
  node's shared memory; the sum must be exact. Bounded by a timeout; the ranks are killed and
  reaped whatever happens, and HFReduce segments left by a killed rank are removed.
* **fs3** — write a file (64 MiB by default) through the fs3 client, read it back, compare the
  bytes; the file is removed even when the check fails. Skipped, with the reason stated, when no
  cluster is given.

One check failing never stops the others. :mod:`hai.validation_rules` turns the measurements into a
verdict; the node agent (``hai agent``, on a schedule and whenever the server asks) reports it to
the server, which feeds it to the scheduler (:func:`hai.rules.validation_result`): a failing node
leaves scheduling with the reasons recorded, a passing one comes back.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from hai.validation_rules import CHECKS, Measurements, Thresholds, Verdict, judge

if TYPE_CHECKING:
    import numpy as np
# numpy is imported by the checks that use it, not here: every `hai` command imports this module
# (hai.__main__), and the server, the agent and the user commands run where only fs3's own
# dependencies are installed (the container image), without the training extra that brings numpy.

__all__ = ["Sizes", "check_allreduce", "check_cpu", "check_fs3", "check_gemm", "check_memory", "main",
           "run_checks"]

ROOT = Path(__file__).resolve().parents[1]

MIB = 1 << 20
MAX_MEMORY_BUFFER_BYTES = 4 << 30
"""The memory check allocates two buffers of this size at most: a validator must not starve the node."""
MAX_GEMM_SIZE = 4096
MAX_ALLREDUCE_BYTES = 1 << 30
MAX_FS3_FILE_BYTES = 4 << 30
MAX_REPEATS = 100
FS3_PIECE_BYTES = 4 * MIB
"""Writes go to fs3 in pieces this large: big enough to keep several chunk writes in flight."""


class CheckFailed(Exception):
    """A check could not produce a trustworthy measurement; the message is the reason."""


@dataclass(frozen=True)
class Sizes:
    """How much work each check does. The defaults take a few seconds on a server; tests shrink them."""

    cpu_loop_iterations: int = 2_000_000
    memory_buffer_bytes: int = 256 * MIB
    memory_repeats: int = 5
    gemm_size: int = 1024
    gemm_repeats: int = 3
    allreduce_bytes: int = 64 * MIB
    allreduce_repeats: int = 3
    allreduce_timeout_s: float = 60.0
    fs3_file_bytes: int = 64 * MIB
    fs3_directory: str = "/hai/validate"

    def __post_init__(self) -> None:
        bounds: dict[str, tuple[float, float]] = {
            "cpu_loop_iterations": (1, 1e9), "memory_buffer_bytes": (MIB, MAX_MEMORY_BUFFER_BYTES),
            "memory_repeats": (1, MAX_REPEATS), "gemm_size": (8, MAX_GEMM_SIZE), "gemm_repeats": (1, MAX_REPEATS),
            "allreduce_bytes": (4096, MAX_ALLREDUCE_BYTES), "allreduce_repeats": (1, MAX_REPEATS),
            "allreduce_timeout_s": (0.1, 3600), "fs3_file_bytes": (4096, MAX_FS3_FILE_BYTES),
        }
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{name} must be in {low:g}..{high:g}, not {value!r}")
        if not self.fs3_directory.startswith("/"):
            raise ValueError(f"fs3_directory must be an absolute path, not {self.fs3_directory!r}")


# -- cpu -------------------------------------------------------------------------------------------


def _cpu_loop(iterations: int) -> int:
    """A fixed integer recurrence (an LCG mod 2**32): its result is known, so a wrong core shows."""
    x = 1
    for _ in range(iterations):
        x = (x * 1_664_525 + 1_013_904_223) & 0xFFFF_FFFF
    return x


def _cpu_loop_reference(iterations: int) -> int:
    """The same recurrence by repeated squaring of the affine map: O(log n), no shared code path."""
    a_total, c_total = 1, 0  # the composed map x -> a_total * x + c_total
    a, c = 1_664_525, 1_013_904_223
    n = iterations
    while n:
        if n & 1:
            a_total, c_total = (a_total * a) & 0xFFFF_FFFF, (c_total * a + c) & 0xFFFF_FFFF
        a, c = (a * a) & 0xFFFF_FFFF, (c * a + c) & 0xFFFF_FFFF
        n >>= 1
    return (a_total * 1 + c_total) & 0xFFFF_FFFF


def check_cpu(sizes: Sizes) -> dict[str, float]:
    """``cpu_count`` and ``cpu_loop_mops`` (million loop iterations per second on one core)."""
    count = len(os.sched_getaffinity(0))
    start = time.perf_counter()
    got = _cpu_loop(sizes.cpu_loop_iterations)
    elapsed_s = time.perf_counter() - start
    want = _cpu_loop_reference(sizes.cpu_loop_iterations)
    if got != want:
        raise CheckFailed(f"the CPU loop computed {got}, not {want}")
    return {"cpu_count": count, "cpu_loop_mops": sizes.cpu_loop_iterations / max(elapsed_s, 1e-9) / 1e6}


# -- memory ----------------------------------------------------------------------------------------


def check_memory(sizes: Sizes) -> dict[str, float]:
    """``memory_bandwidth_gbps``: best of ``memory_repeats`` copies, (read + written bytes) / time."""
    import numpy as np

    count = sizes.memory_buffer_bytes // 8
    source = np.arange(count, dtype=np.int64)
    target = np.empty_like(source)
    best_s = float("inf")
    for _ in range(sizes.memory_repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best_s = min(best_s, time.perf_counter() - start)
    # Spot checks, not a full compare (that would be a second pass as long as the copy).
    probe = np.linspace(0, count - 1, num=min(count, 1024), dtype=np.int64)
    if not np.array_equal(target[probe], probe):
        raise CheckFailed("the copied buffer differs from its source")
    return {"memory_bandwidth_gbps": 2 * count * 8 / max(best_s, 1e-9) / 1e9}


# -- gemm ------------------------------------------------------------------------------------------

GEMM_SEED = 20_240_520
GEMM_VALUE_RANGE = 4
"""Matrix entries are integers in -4..4: a 4096-long dot product stays below 2**24, exact in float32."""


def _matmul(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The GEMM under test (the node's BLAS through numpy)."""
    import numpy as np

    result: np.ndarray[Any, Any] = np.matmul(a, b)
    return result


def gemm_inputs(size: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The fixed seeded float32 matrices."""
    import numpy as np

    rng = np.random.default_rng(GEMM_SEED)
    a = rng.integers(-GEMM_VALUE_RANGE, GEMM_VALUE_RANGE + 1, size=(size, size)).astype(np.float32)
    b = rng.integers(-GEMM_VALUE_RANGE, GEMM_VALUE_RANGE + 1, size=(size, size)).astype(np.float32)
    return a, b


def check_gemm(sizes: Sizes) -> dict[str, float]:
    """``gemm_gflops`` (2n³ per multiply, best of ``gemm_repeats``) and ``gemm_max_abs_error`` against
    the float64 reference; the result is also checked against the reference's row and column sums
    computed with matrix-vector products, which share no code with the GEMM."""
    import numpy as np

    n = sizes.gemm_size
    a, b = gemm_inputs(n)
    reference = a.astype(np.float64) @ b.astype(np.float64)
    ones = np.ones(n)
    if not (np.array_equal(reference.sum(axis=0), (ones @ a.astype(np.float64)) @ b.astype(np.float64))
            and np.array_equal(reference.sum(axis=1), a.astype(np.float64) @ (b.astype(np.float64) @ ones))):
        raise CheckFailed("the float64 reference disagrees with its own checksums")
    _matmul(a, b)  # warm-up, not timed: the BLAS starts its threads on the first call
    best_s = float("inf")
    error = 0.0
    for _ in range(sizes.gemm_repeats):
        start = time.perf_counter()
        result = _matmul(a, b)
        best_s = min(best_s, time.perf_counter() - start)
        if result.shape != reference.shape:
            raise CheckFailed(f"the GEMM returned shape {result.shape}, not {reference.shape}")
        difference = np.abs(result.astype(np.float64) - reference)
        error = max(error, float(np.nan_to_num(difference, nan=np.inf).max()))
    return {"gemm_gflops": 2 * n**3 / max(best_s, 1e-9) / 1e9, "gemm_max_abs_error": error}


# -- allreduce -------------------------------------------------------------------------------------

ALLREDUCE_RANKS = 2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def probe_command(rank: int) -> list[str]:
    """The command line of one allreduce rank (tests substitute a rank that hangs or dies)."""
    return [sys.executable, "-m", "hai.allreduce_probe"]


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every rank's process group and reap it: no rank outlives the check."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _read_result(out: IO[bytes]) -> dict[str, Any] | None:
    out.seek(0)
    lines = [line for line in out.read().decode(errors="replace").splitlines() if line.startswith("{")]
    if not lines:
        return None
    try:
        parsed = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _tail(err: IO[bytes]) -> str:
    err.seek(0)
    lines = err.read().decode(errors="replace").strip().splitlines()
    return f" ({lines[-1][-300:]})" if lines else ""


def check_allreduce(sizes: Sizes, command: Callable[[int], list[str]] = probe_command) -> dict[str, float]:
    """``allreduce_gbps``: bytes per rank / best allreduce time of two local HFReduce ranks. Fails
    when a rank dies, reports an error or an inexact sum, or the ranks outlive the timeout."""
    from hfreduce.shm import remove_stale_segments

    elements = sizes.allreduce_bytes // 4
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    outputs: list[tuple[IO[bytes], IO[bytes]]] = []
    deadline = time.monotonic() + sizes.allreduce_timeout_s
    with contextlib.ExitStack() as files:
        try:
            for rank in range(ALLREDUCE_RANKS):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ALLREDUCE_RANKS), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), HAI_PROBE_ELEMENTS=str(elements),
                           HAI_PROBE_REPEATS=str(sizes.allreduce_repeats),
                           HAI_PROBE_TIMEOUT_S=str(max(0.1, sizes.allreduce_timeout_s / 2)),
                           PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
                for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                    env.pop(name, None)
                out = files.enter_context(tempfile.TemporaryFile())
                err = files.enter_context(tempfile.TemporaryFile())
                outputs.append((out, err))
                procs.append(subprocess.Popen(command(rank), env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
            while True:
                codes = [proc.poll() for proc in procs]  # every rank polled: a dead one is seen at once
                for rank, code in enumerate(codes):
                    if code is not None and code != 0:
                        raise CheckFailed(f"rank {rank} {_describe_exit(code)}{_tail(outputs[rank][1])}")
                if all(code is not None for code in codes):
                    break
                if time.monotonic() > deadline:
                    running = [rank for rank, code in enumerate(codes) if code is None]
                    said = [f"; rank {rank}: {result['error']}" for rank, code in enumerate(codes)
                            if code is not None and (result := _read_result(outputs[rank][0])) and "error" in result]
                    raise CheckFailed(f"rank(s) {running} still running after {sizes.allreduce_timeout_s:g} s: killed"
                                      + "".join(said))
                time.sleep(0.02)
            times: list[float] = []
            for rank, proc in enumerate(procs):
                result = _read_result(outputs[rank][0])
                if proc.returncode != 0 or result is None:
                    raise CheckFailed(f"rank {rank} {_describe_exit(proc.returncode)} without a result"
                                      f"{_tail(outputs[rank][1])}")
                if "error" in result:
                    raise CheckFailed(f"rank {rank}: {result['error']}")
                if not result.get("exact"):
                    raise CheckFailed(f"rank {rank} got a wrong sum")
                times.append(float(result["best_s"]))
            return {"allreduce_gbps": elements * 4 / max(max(times), 1e-9) / 1e9}
        finally:
            _stop(procs)
            remove_stale_segments()


# -- fs3 -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fs3Target:
    """Which cluster to check: ``mgmtd`` and ``token``, or a client profile (see docs/operations.md)."""

    mgmtd: str | None = None
    token: str | None = None
    profile: str | None = None


def _pattern(size: int) -> bytes:
    """Bytes that differ at every offset of a chunk (a misplaced piece shows), seeded per run."""
    import numpy as np

    return np.random.default_rng(uuid.uuid4().int).integers(0, 256, size=size, dtype=np.uint8).tobytes()


def check_fs3(sizes: Sizes, target: Fs3Target) -> dict[str, float]:
    """``fs3_write_mbps`` (write + fsync) and ``fs3_read_mbps`` of one file, verified byte for byte
    and removed afterwards whatever happened."""
    import fs3

    options: dict[str, Any] = {"profile": target.profile} if target.profile else {}
    data = _pattern(sizes.fs3_file_bytes)
    view = memoryview(data)
    path = f"{sizes.fs3_directory}/{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    with fs3.connect(target.mgmtd, token=target.token, **options) as fs:
        fs.makedirs(sizes.fs3_directory, exist_ok=True)
        try:
            start = time.perf_counter()
            with fs.open(path, "wb", buffering=0) as f:
                for offset in range(0, len(view), FS3_PIECE_BYTES):
                    f.write(view[offset:offset + FS3_PIECE_BYTES])
                f.fsync()
            write_s = time.perf_counter() - start
            start = time.perf_counter()
            with fs.open(path, "rb", buffering=0) as f:
                back = f.readall()
            read_s = time.perf_counter() - start
            if len(back) != len(data):
                raise CheckFailed(f"read back {len(back)} bytes of the {len(data)} written")
            if back != data:
                first = next(i for i, (x, y) in enumerate(zip(back, data, strict=True)) if x != y)
                raise CheckFailed(f"the bytes read back differ from those written, first at offset {first}")
        finally:
            try:
                if fs.exists(path):
                    fs.remove(path)
            except Exception:  # the check's own failure says more; a leftover file is named below
                pass
    return {"fs3_write_mbps": len(data) / max(write_s, 1e-9) / 1e6,
            "fs3_read_mbps": len(data) / max(read_s, 1e-9) / 1e6}


# -- all together ----------------------------------------------------------------------------------


def _reason(exc: BaseException) -> str:
    if isinstance(exc, CheckFailed):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def run_checks(sizes: Sizes, fs3_target: Fs3Target | None, only: Sequence[str] = CHECKS) -> Measurements:
    """Run the chosen checks in order; a check that fails or raises is recorded and the next one runs."""
    values: dict[str, float] = {}
    errors: dict[str, str] = {}
    skipped: dict[str, str] = {}

    def fs3_check() -> dict[str, float]:
        if fs3_target is None:
            raise CheckFailed("no fs3 cluster given")
        return check_fs3(sizes, fs3_target)

    runners: dict[str, Callable[[], dict[str, float]]] = {
        "cpu": lambda: check_cpu(sizes),
        "memory": lambda: check_memory(sizes),
        "gemm": lambda: check_gemm(sizes),
        "allreduce": lambda: check_allreduce(sizes),
        "fs3": fs3_check,
    }
    for check in CHECKS:
        if check not in only:
            skipped[check] = "not selected"
            continue
        if check == "fs3" and fs3_target is None:
            skipped[check] = "no fs3 cluster given (--fs3 MGMTD --token T, or --profile NAME)"
            continue
        try:
            values.update(runners[check]())
        except Exception as exc:
            errors[check] = _reason(exc)
    return Measurements(**values, errors=errors, skipped=skipped)  # type: ignore[arg-type]


# -- command line ----------------------------------------------------------------------------------

_THRESHOLD_FLAGS = {item.name: f"--{item.name.replace('_', '-')}" for item in dataclasses.fields(Thresholds)}


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, not {text!r}")
    return value


def _size_mib(text: str) -> int:
    value = _non_negative(text)
    return int(value * MIB)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hai validate``'s flags (the dispatcher in :mod:`hai.__main__` adds them to its subcommand)."""
    where = parser.add_argument_group("fs3 (the fs3 check is skipped without one of these)")
    where.add_argument("--fs3", metavar="MGMTD", help="the cluster's mgmtd, HOST:PORT")
    where.add_argument("--token", help="the fs3 token to write with (with --fs3)")
    where.add_argument("--profile", help="an fs3 client profile from ~/.config/fs3/config.toml")
    parser.add_argument("--json", action="store_true", help="print the measurements and verdict as JSON")
    parser.add_argument("--only", metavar="CHECK,...", help=f"run only these checks, of {','.join(CHECKS)}")
    sizes = parser.add_argument_group("sizes")
    sizes.add_argument("--memory-mib", type=_size_mib, help="memory check buffer (default 256 MiB)")
    sizes.add_argument("--gemm-size", type=int, help="GEMM matrix side (default 1024)")
    sizes.add_argument("--allreduce-mib", type=_size_mib, help="allreduce buffer per rank (default 64 MiB)")
    sizes.add_argument("--allreduce-timeout-s", type=_non_negative, help="allreduce time limit (default 60 s)")
    sizes.add_argument("--fs3-mib", type=_size_mib, help="fs3 test file (default 64 MiB)")
    sizes.add_argument("--fs3-directory", help="where on fs3 the test file goes (default /hai/validate)")
    limits = parser.add_argument_group("thresholds (units in the names: gbps GB/s, mbps MB/s, mops M iterations/s)")
    for name, flag in _THRESHOLD_FLAGS.items():
        limits.add_argument(flag, dest=name, type=_non_negative, metavar="X")


def _sizes_from(args: argparse.Namespace) -> Sizes:
    given = {"memory_buffer_bytes": args.memory_mib, "gemm_size": args.gemm_size,
             "allreduce_bytes": args.allreduce_mib, "allreduce_timeout_s": args.allreduce_timeout_s,
             "fs3_file_bytes": args.fs3_mib, "fs3_directory": args.fs3_directory}
    return Sizes(**{name: value for name, value in given.items() if value is not None})


def _thresholds_from(args: argparse.Namespace) -> Thresholds:
    given = {name: getattr(args, name) for name in _THRESHOLD_FLAGS if getattr(args, name) is not None}
    if "min_cpu_count" in given:
        if given["min_cpu_count"] != int(given["min_cpu_count"]):
            raise ValueError(f"--min-cpu-count must be a whole number, not {given['min_cpu_count']:g}")
        given["min_cpu_count"] = int(given["min_cpu_count"])
    return Thresholds(**given)


def _only_from(args: argparse.Namespace) -> tuple[str, ...]:
    if args.only is None:
        return CHECKS
    chosen = tuple(name.strip() for name in args.only.split(",") if name.strip())
    unknown = [name for name in chosen if name not in CHECKS]
    if unknown or not chosen:
        raise ValueError(f"--only takes checks from {','.join(CHECKS)}, not {args.only!r}")
    return chosen


def _target_from(args: argparse.Namespace) -> Fs3Target | None:
    if args.fs3 and args.profile:
        raise ValueError("give --fs3 or --profile, not both")
    if args.token and not args.fs3:
        raise ValueError("--token goes with --fs3")
    if args.fs3:
        return Fs3Target(mgmtd=args.fs3, token=args.token)
    if args.profile:
        return Fs3Target(profile=args.profile)
    return None


_ROWS: tuple[tuple[str, str, str], ...] = (
    ("cpu", "cpu_count", ""), ("cpu", "cpu_loop_mops", "M it/s"), ("memory", "memory_bandwidth_gbps", "GB/s"),
    ("gemm", "gemm_gflops", "GFLOP/s"), ("gemm", "gemm_max_abs_error", ""), ("allreduce", "allreduce_gbps", "GB/s"),
    ("fs3", "fs3_write_mbps", "MB/s"), ("fs3", "fs3_read_mbps", "MB/s"),
)


def format_table(measurements: Measurements, verdict: Verdict) -> str:
    """The human report: one row per measurement, then the failures and the verdict."""
    lines = [f"{'check':<10} {'measurement':<24} {'value':>14}"]
    for check, name, unit in _ROWS:
        value = getattr(measurements, name)
        if check in measurements.errors:
            shown = "FAILED"
        elif check in measurements.skipped:
            shown = "skipped"
        elif value is None:
            shown = "-"
        else:
            shown = f"{value:.4g} {unit}".strip()
        lines.append(f"{check:<10} {name:<24} {shown:>14}")
    lines += [f"skipped   {line}" for line in verdict.skipped]
    lines += [f"FAIL      {line}" for line in verdict.failures]
    lines.append("node OK" if verdict.ok else "node FAILED")
    return "\n".join(lines)


def to_json(measurements: Measurements, verdict: Verdict, thresholds: Thresholds) -> dict[str, Any]:
    values = {name: getattr(measurements, name) for _, name, _ in _ROWS}
    return {"ok": verdict.ok, "failures": verdict.failures, "skipped": dict(measurements.skipped),
            "errors": dict(measurements.errors), "measurements": values,
            "thresholds": dataclasses.asdict(thresholds)}


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 the node passed, 1 it failed, 2 bad usage."""
    try:
        sizes, thresholds = _sizes_from(args), _thresholds_from(args)
        only, target = _only_from(args), _target_from(args)
    except ValueError as exc:
        print(f"hai validate: {exc}", file=sys.stderr)
        return 2
    measurements = run_checks(sizes, target, only)
    verdict = judge(measurements, thresholds)
    if args.json:
        print(json.dumps(to_json(measurements, verdict, thresholds), indent=2))
    else:
        print(format_table(measurements, verdict))
    return 0 if verdict.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hai validate", description=__doc__.split("\n")[0] if __doc__ else None)
    add_arguments(parser)
    return run(parser.parse_args(argv))

"""``hai validate``: the verdict table (known-bad measurements must fail), every check on this machine
with small sizes, a sabotaged GEMM, allreduce ranks that die or hang, fs3 on a real cluster, the CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hai import rules
from hai import validate as validate_mod
from hai.validate import Fs3Target, Sizes, check_allreduce, check_cpu, check_fs3, check_gemm, check_memory, run_checks
from hai.validation_rules import CHECKS, Measurements, Thresholds, Verdict, apply_verdict, judge
from tests.hfreduce.runner import segments

ROOT = Path(__file__).resolve().parents[1]

SMALL = Sizes(cpu_loop_iterations=20_000, memory_buffer_bytes=8 << 20, memory_repeats=2, gemm_size=96,
              gemm_repeats=1, allreduce_bytes=1 << 20, allreduce_repeats=1, allreduce_timeout_s=30.0,
              fs3_file_bytes=3 << 20)

GOOD = Measurements(cpu_count=8, cpu_loop_mops=20.0, memory_bandwidth_gbps=20.0, gemm_gflops=100.0,
                    gemm_max_abs_error=0.0, allreduce_gbps=2.0, fs3_write_mbps=500.0, fs3_read_mbps=800.0)
STRICT = Thresholds(min_cpu_count=4, min_cpu_loop_mops=5.0, min_memory_bandwidth_gbps=5.0, min_gemm_gflops=50.0,
                    min_allreduce_gbps=1.0, min_fs3_write_mbps=100.0, min_fs3_read_mbps=100.0)


def _with(**changes: Any) -> Measurements:
    fields = {name: getattr(GOOD, name) for name in GOOD.__dataclass_fields__}
    fields.update(changes)
    return Measurements(**fields)


# -- the verdict ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("measurements", "failures"), [
    (GOOD, []),
    (_with(memory_bandwidth_gbps=3.1), ["memory bandwidth 3.1 GB/s below 5.0 GB/s"]),
    (_with(cpu_count=2), ["usable CPUs 2 below 4"]),
    (_with(cpu_loop_mops=0.5), ["CPU loop rate 0.5 M iterations/s below 5.0 M iterations/s"]),
    (_with(gemm_max_abs_error=1.0), ["GEMM result error 1.0 above 0"]),
    (_with(gemm_gflops=10.0), ["GEMM rate 10.0 GFLOP/s below 50.0 GFLOP/s"]),
    (_with(allreduce_gbps=0.2), ["HFReduce allreduce bandwidth 0.2 GB/s below 1.0 GB/s"]),
    (_with(fs3_write_mbps=12.0, fs3_read_mbps=13.0),
     ["fs3 write bandwidth 12.0 MB/s below 100.0 MB/s", "fs3 read bandwidth 13.0 MB/s below 100.0 MB/s"]),
    # One failure never hides another: every check is judged.
    (_with(cpu_count=1, gemm_max_abs_error=2.0, fs3_read_mbps=1.0),
     ["usable CPUs 1 below 4", "GEMM result error 2.0 above 0", "fs3 read bandwidth 1.0 MB/s below 100.0 MB/s"]),
    # Broken probes are refused, not passed.
    (_with(memory_bandwidth_gbps=math.nan), ["memory bandwidth measurement nan is not a finite number >= 0"]),
    (_with(gemm_gflops=math.inf), ["GEMM rate measurement inf is not a finite number >= 0"]),
    (_with(allreduce_gbps=-1.0), ["HFReduce allreduce bandwidth measurement -1.0 is not a finite number >= 0"]),
    (_with(gemm_max_abs_error=math.nan), ["GEMM result error measurement nan is not a finite number >= 0"]),
    (_with(fs3_write_mbps=None), ["fs3 write bandwidth was not measured"]),
    # A check that failed to measure fails with its own reason; a skipped one does not fail.
    (_with(allreduce_gbps=None, errors={"allreduce": "rank 1 was killed by SIGKILL"}),
     ["allreduce: rank 1 was killed by SIGKILL"]),
    (_with(fs3_write_mbps=None, fs3_read_mbps=None, skipped={"fs3": "no fs3 cluster given"}), []),
], ids=["good", "slow-memory", "few-cpus", "slow-cpu", "wrong-gemm", "slow-gemm", "slow-allreduce", "slow-fs3",
        "several", "nan", "inf", "negative", "nan-error", "missing", "errored", "skipped"])
def test_judge_table(measurements: Measurements, failures: list[str]) -> None:
    verdict = judge(measurements, STRICT)
    assert verdict.failures == failures
    assert verdict.ok is (not failures)
    assert verdict.reason() == ("" if not failures else "validation failed: " + "; ".join(failures))


def test_the_default_thresholds_fail_a_node_that_measured_nothing() -> None:
    verdict = judge(Measurements(), Thresholds())
    assert not verdict.ok and len(verdict.failures) == 8


@pytest.mark.parametrize("bad", [{"min_memory_bandwidth_gbps": math.nan}, {"min_gemm_gflops": -1.0},
                                 {"max_gemm_abs_error": math.inf}, {"min_cpu_count": True}])
def test_thresholds_refuse_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="threshold"):
        Thresholds(**bad)


def test_judge_refuses_unknown_checks() -> None:
    with pytest.raises(ValueError, match="unknown checks"):
        judge(Measurements(errors={"disk": "x"}), Thresholds())


def test_a_failing_verdict_takes_the_node_out_of_scheduling_and_a_passing_one_brings_it_back() -> None:
    config = rules.Config()
    state = rules.ClusterState(nodes={"n1": rules.Node(name="n1", zone="z")})
    failed = Verdict(ok=False, failures=["memory bandwidth 3.1 GB/s below 5.0 GB/s"], skipped=[])
    state = apply_verdict(state, "n1", failed, 10.0, config)
    assert not state.nodes["n1"].healthy
    assert state.nodes["n1"].unhealthy_reason == "validation failed: memory bandwidth 3.1 GB/s below 5.0 GB/s"
    passed = Verdict(ok=True, failures=[], skipped=[])
    state = apply_verdict(state, "n1", passed, 20.0, config)
    assert state.nodes["n1"].healthy and state.nodes["n1"].unhealthy_reason == ""
    # A lost node that is back passes and returns; one that failed too often waits for an admin.
    state = rules.node_lost(state, "n1", 30.0, config, "no heartbeat")
    assert apply_verdict(state, "n1", passed, 40.0, config).nodes["n1"].healthy
    for now_s in (50.0, 60.0, 70.0):
        state = apply_verdict(state, "n1", failed, now_s, config)
    assert state.nodes["n1"].unhealthy_reason.startswith("validation failed 3 times in a row")
    with pytest.raises(rules.RuleError, match="admin"):
        apply_verdict(state, "n1", passed, 80.0, config)
    with pytest.raises(rules.RuleError):
        apply_verdict(state, "n2", passed, 40.0, config)


# -- the checks on this machine ---------------------------------------------------------------------


def test_cpu_memory_and_gemm_measure_sane_numbers() -> None:
    cpu = check_cpu(SMALL)
    assert cpu["cpu_count"] == len(os.sched_getaffinity(0)) >= 1
    assert 0.1 < cpu["cpu_loop_mops"] < 10_000
    memory = check_memory(SMALL)
    assert 0.05 < memory["memory_bandwidth_gbps"] < 10_000
    gemm = check_gemm(SMALL)
    assert gemm["gemm_max_abs_error"] == 0.0
    assert 0.001 < gemm["gemm_gflops"] < 1e6


def test_a_wrong_gemm_fails_the_node_however_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    def sabotaged(a: Any, b: Any) -> Any:
        result = np.matmul(a, b)
        result[3, 5] += 1.0
        return result

    monkeypatch.setattr(validate_mod, "_matmul", sabotaged)
    measurements = run_checks(SMALL, None, only=("gemm",))
    assert measurements.gemm_max_abs_error == 1.0
    verdict = judge(measurements, Thresholds())
    assert verdict.failures == ["GEMM result error 1.0 above 0"]


def test_a_raising_check_is_recorded_and_the_others_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(sizes: Sizes) -> dict[str, float]:
        raise MemoryError("no room")

    monkeypatch.setattr(validate_mod, "check_memory", broken)
    measurements = run_checks(SMALL, None, only=("cpu", "memory", "gemm"))
    assert measurements.errors == {"memory": "MemoryError: no room"}
    assert measurements.cpu_count is not None and measurements.gemm_gflops is not None
    verdict = judge(measurements, Thresholds())
    assert verdict.failures == ["memory: MemoryError: no room"]
    assert set(measurements.skipped) == {"allreduce", "fs3"}


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[bytes]]:
    """Every process the allreduce check starts, to show that none outlives it unreaped."""
    procs: list[subprocess.Popen[bytes]] = []
    real = subprocess.Popen

    def recording(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = real(*args, **kwargs)
        procs.append(proc)
        return proc

    monkeypatch.setattr(subprocess, "Popen", recording)
    return procs


def _all_reaped(procs: list[subprocess.Popen[bytes]]) -> bool:
    """Each process exited and was waited for (its pid is gone: no zombie, no orphan)."""
    return len(procs) == 2 and all(proc.returncode is not None and not Path(f"/proc/{proc.pid}").exists()
                                   for proc in procs)


@pytest.mark.slow
def test_the_allreduce_is_exact_and_leaves_nothing_behind(started: list[subprocess.Popen[bytes]]) -> None:
    before = segments()
    result = check_allreduce(SMALL)
    assert 0.0001 < result["allreduce_gbps"] < 10_000
    assert segments() <= before
    assert _all_reaped(started)


@pytest.mark.parametrize(("stand_in", "message"), [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "rank 1 was killed by SIGKILL"),
    ("import time; time.sleep(600)", "still running after 3 s: killed"),
], ids=["killed", "hangs"])
@pytest.mark.slow
def test_an_allreduce_rank_that_dies_or_hangs_fails_clearly_and_is_reaped(
        stand_in: str, message: str, started: list[subprocess.Popen[bytes]]) -> None:
    def command(rank: int) -> list[str]:
        if rank == 1:
            return [sys.executable, "-c", stand_in]
        return validate_mod.probe_command(rank)

    before = segments()
    sizes = Sizes(allreduce_bytes=1 << 20, allreduce_repeats=1, allreduce_timeout_s=3.0)
    start = time.monotonic()
    with pytest.raises(validate_mod.CheckFailed, match=message):
        check_allreduce(sizes, command)
    assert time.monotonic() - start < 30  # the 3 s limit held: no hang (slack for a loaded machine)
    assert segments() <= before, "a shared-memory segment was left behind"
    assert _all_reaped(started), "a rank outlived the check"


@pytest.mark.slow
def test_fs3_writes_verifies_and_removes(shared_cluster: Any) -> None:
    import fs3

    cluster = shared_cluster.cluster
    target = Fs3Target(mgmtd=cluster.mgmtd_address, token=cluster.token)
    sizes = Sizes(fs3_file_bytes=3 << 20, fs3_directory="/hai-validate-test")
    result = check_fs3(sizes, target)
    assert result["fs3_write_mbps"] > 0.01 and result["fs3_read_mbps"] > 0.01
    with fs3.connect(cluster.mgmtd_address, token=cluster.token) as fs:
        assert fs.listdir("/hai-validate-test") == []


@pytest.mark.slow
def test_fs3_removes_the_file_when_the_bytes_differ(shared_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import fs3

    cluster = shared_cluster.cluster
    real_open = fs3.client.sync_api.FileSystem.open

    class Corrupting:
        """A reader that flips the first byte it returns."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __enter__(self) -> Corrupting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.close()

        def readall(self) -> bytes:
            data = bytearray(self.inner.readall())
            data[0] ^= 0xFF
            return bytes(data)

    def open_(self: Any, path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(self, path, mode, *args, **kwargs)
        return Corrupting(handle) if mode == "rb" else handle

    monkeypatch.setattr(fs3.client.sync_api.FileSystem, "open", open_)
    target = Fs3Target(mgmtd=cluster.mgmtd_address, token=cluster.token)
    sizes = Sizes(fs3_file_bytes=1 << 20, fs3_directory="/hai-validate-corrupt")
    with pytest.raises(validate_mod.CheckFailed, match="differ from those written, first at offset 0"):
        check_fs3(sizes, target)
    monkeypatch.undo()
    with fs3.connect(cluster.mgmtd_address, token=cluster.token) as fs:
        assert fs.listdir("/hai-validate-corrupt") == []


def test_fs3_without_a_cluster_is_skipped_with_the_reason() -> None:
    measurements = run_checks(SMALL, None, only=("cpu", "fs3"))
    assert "no fs3 cluster given" in measurements.skipped["fs3"]
    verdict = judge(measurements, Thresholds())
    assert verdict.ok and any("no fs3 cluster given" in line for line in verdict.skipped)


# -- the command line -------------------------------------------------------------------------------


def _hai(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "hai", "validate", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60)


@pytest.mark.slow
def test_cli_json_parses_and_a_strict_threshold_fails_the_node(shared_cluster: Any) -> None:
    cluster = shared_cluster.cluster
    small = ["--memory-mib", "8", "--gemm-size", "64", "--allreduce-mib", "1", "--fs3-mib", "1",
             "--fs3-directory", "/hai-validate-cli"]
    done = _hai("--json", *small, "--fs3", cluster.mgmtd_address, "--token", cluster.token)
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(done.stdout)
    assert report["ok"] and report["failures"] == [] and report["skipped"] == {}
    assert set(report["measurements"]) >= {"memory_bandwidth_gbps", "gemm_gflops", "allreduce_gbps",
                                           "fs3_write_mbps", "fs3_read_mbps"}
    done = _hai("--json", "--only", "memory", "--memory-mib", "8", "--min-memory-bandwidth-gbps", "1000000")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert not report["ok"] and report["failures"][0].startswith("memory bandwidth ")
    assert report["thresholds"]["min_memory_bandwidth_gbps"] == 1_000_000


@pytest.mark.slow
def test_cli_human_table() -> None:
    done = _hai("--only", "cpu,gemm", "--gemm-size", "64")
    assert done.returncode == 0, done.stderr
    assert "gemm_max_abs_error" in done.stdout and "node OK" in done.stdout
    assert "skipped   fs3: not selected" in done.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--bogus"], "unrecognized arguments"),
    (["--min-gemm-gflops", "fast"], "expected a number"),
    (["--min-memory-bandwidth-gbps", "-3"], "expected a finite number >= 0"),
    (["--only", "cpu,disk"], "--only takes checks"),
    (["--token", "t"], "--token goes with --fs3"),
    (["--fs3", "h:1", "--profile", "p"], "not both"),
    (["--gemm-size", "100000"], "gemm_size must be in"),
    (["--min-cpu-count", "1.5"], "whole number"),
], ids=["unknown-flag", "not-a-number", "negative", "unknown-check", "token-alone", "two-targets", "too-big",
        "fractional-cpus"])
def test_cli_bad_usage_exits_2_with_a_clear_error(args: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # The command's own main, in this process: each case is refused before anything runs, and a
    # fresh interpreter per case (importing the whole platform) cost about a second each. The
    # entry point as a process is the subject of the tests around this one.
    from hai.__main__ import main

    status: int | str | None
    try:
        status = main(["validate", *args])
    except SystemExit as exc:  # argparse's own refusals
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 2, out + err
    assert message in err
    assert out == ""


@pytest.mark.slow
def test_every_check_is_named_in_the_help() -> None:
    done = _hai("--help")
    assert done.returncode == 0
    for check in CHECKS:
        assert check in done.stdout

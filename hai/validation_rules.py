"""The node validator's verdict as a pure function: measurements and thresholds in, pass or fail out.

``hai validate`` (:mod:`hai.validate`) measures a node — CPUs, memory bandwidth, a GEMM against a
known result, an intra-node HFReduce allreduce, fs3 read/write bandwidth — and this module decides
whether the node may take work. Keeping the decision apart from the measuring means it can be
table-tested with known-bad numbers (a checker that never fails proves nothing) and that an
operator's thresholds mean the same thing on every node. Nothing here does I/O, reads a clock or
draws random numbers (the ``pure-cores`` import contract holds it to that).

Units are in the names: ``_gbps`` is 10⁹ bytes per second, ``_mbps`` 10⁶ bytes per second,
``_gflops`` 10⁹ floating-point operations per second, ``_mops`` 10⁶ loop iterations per second.

A measurement is ``None`` when its check did not produce one; the check then says why in
``Measurements.errors`` (a failure) or ``Measurements.skipped`` (not a failure: fs3 is only checked
when the validator is told which cluster to use). A measurement that is NaN, infinite or negative is
refused: it is a broken probe, and a broken probe must not pass a node.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from hai import rules

__all__ = ["CHECKS", "VALIDATION_REASON_PREFIX", "Measurements", "Thresholds", "Verdict", "apply_verdict", "judge"]

CHECKS = ("cpu", "memory", "gemm", "allreduce", "fs3")
"""Every check the validator runs, in the order it runs them and reports them."""

VALIDATION_REASON_PREFIX = "validation failed: "
"""How a node's ``unhealthy_reason`` starts when the validator took it out of scheduling."""


@dataclass(frozen=True)
class Thresholds:
    """The minimums a node must reach (maximum, for the GEMM error). The defaults are floors that
    any working machine clears, so a fresh install does not reject its own nodes; an operator sets
    real ones from a healthy node's numbers (``hai validate --json``)."""

    min_cpu_count: int = 1
    min_cpu_loop_mops: float = 1.0
    min_memory_bandwidth_gbps: float = 0.5
    min_gemm_gflops: float = 0.5
    max_gemm_abs_error: float = 0.0
    """The GEMM multiplies small integers whose products are exact in float32: any error is a fault."""
    min_allreduce_gbps: float = 0.01
    min_fs3_write_mbps: float = 1.0
    min_fs3_read_mbps: float = 1.0

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"threshold {item.name} must be a finite number >= 0, not {value!r}")


@dataclass(frozen=True)
class Measurements:
    """What the checks measured; ``None`` where a check produced nothing (see ``errors``/``skipped``)."""

    cpu_count: int | None = None
    cpu_loop_mops: float | None = None
    memory_bandwidth_gbps: float | None = None
    gemm_gflops: float | None = None
    gemm_max_abs_error: float | None = None
    allreduce_gbps: float | None = None
    fs3_write_mbps: float | None = None
    fs3_read_mbps: float | None = None
    errors: Mapping[str, str] = field(default_factory=dict)
    """check name → why it failed to measure (its result was wrong, it timed out, it crashed)."""
    skipped: Mapping[str, str] = field(default_factory=dict)
    """check name → why it was not run; not a failure."""


@dataclass(frozen=True)
class Verdict:
    """``ok`` when there are no failures; ``failures`` are one sentence each, in check order."""

    ok: bool
    failures: list[str]
    skipped: list[str]

    def reason(self) -> str:
        """One line for a node's ``unhealthy_reason`` (empty when the node passed)."""
        return "" if self.ok else VALIDATION_REASON_PREFIX + "; ".join(self.failures)


# check → (measurement field, threshold field, words, unit, whether the threshold is a maximum)
_LIMITS: tuple[tuple[str, str, str, str, str, bool], ...] = (
    ("cpu", "cpu_count", "min_cpu_count", "usable CPUs", "", False),
    ("cpu", "cpu_loop_mops", "min_cpu_loop_mops", "CPU loop rate", "M iterations/s", False),
    ("memory", "memory_bandwidth_gbps", "min_memory_bandwidth_gbps", "memory bandwidth", "GB/s", False),
    ("gemm", "gemm_max_abs_error", "max_gemm_abs_error", "GEMM result error", "", True),
    ("gemm", "gemm_gflops", "min_gemm_gflops", "GEMM rate", "GFLOP/s", False),
    ("allreduce", "allreduce_gbps", "min_allreduce_gbps", "HFReduce allreduce bandwidth", "GB/s", False),
    ("fs3", "fs3_write_mbps", "min_fs3_write_mbps", "fs3 write bandwidth", "MB/s", False),
    ("fs3", "fs3_read_mbps", "min_fs3_read_mbps", "fs3 read bandwidth", "MB/s", False),
)


def _show(value: float, unit: str) -> str:
    text = str(value) if isinstance(value, int) else f"{value:.1f}" if value >= 1 else f"{value:.3g}"
    return f"{text} {unit}" if unit else text


def judge(measurements: Measurements, thresholds: Thresholds) -> Verdict:
    """The node's verdict. Every check is judged, so one failure never hides another."""
    unknown = (set(measurements.errors) | set(measurements.skipped)) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}: the checks are {list(CHECKS)}")
    failures: list[str] = []
    skipped = [f"{check}: {measurements.skipped[check]}" for check in CHECKS if check in measurements.skipped]
    for check in CHECKS:
        if check in measurements.errors:
            failures.append(f"{check}: {measurements.errors[check]}")
            continue
        if check in measurements.skipped:
            continue
        for owner, name, limit_name, words, unit, is_maximum in _LIMITS:
            if owner != check:
                continue
            value = getattr(measurements, name)
            limit = getattr(thresholds, limit_name)
            if value is None:
                failures.append(f"{words} was not measured")
            elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value < 0:
                failures.append(f"{words} measurement {value!r} is not a finite number >= 0")
            elif is_maximum and value > limit:
                failures.append(f"{words} {_show(value, unit)} above {_show(limit, unit)}")
            elif not is_maximum and value < limit:
                failures.append(f"{words} {_show(value, unit)} below {_show(limit, unit)}")
    return Verdict(ok=not failures, failures=failures, skipped=skipped)


def apply_verdict(state: rules.ClusterState, node: str, verdict: Verdict, now_s: float,
                  config: rules.Config) -> rules.ClusterState:
    """Feed a node's verdict to the scheduler (:func:`hai.rules.validation_result`): a failing node
    leaves scheduling with the reason recorded, a passing one comes back. Refused
    (:class:`~hai.rules.RuleError`) for an unknown node, one that runs a job, and one that failed
    too often in a row or that only an admin may put back."""
    if node not in state.nodes:
        raise rules.RuleError(f"unknown node {node!r}")
    return rules.validation_result(state, node, verdict.ok, verdict.failures, now_s, config)

"""How often a job should checkpoint: Young's and Daly's optimal intervals, as pure functions.

A checkpoint costs time ``C`` (seconds the job spends writing its state instead of training); a
failure costs the work done since the last checkpoint. Checkpointing too often wastes time on
``C``; too rarely wastes it on redone work. The optimum depends on two numbers the platform
knows: ``C`` from the job's state size and fs3's write rate, and the job's mean time between
failures ``M`` from the nodes' failure rate. This module turns them into an interval and an
expected wasted fraction, for ``hai ls --wide`` and for the scheduler's users.

Inputs, and where their defaults come from (the caller reads them; nothing here does I/O):

* **Node MTBF.** ``cluster_model`` derives per-GPU interruption rates from the Fire-Flyer 2 Xid
  log (Table VI, its ``data/fire_flyer_2.toml``); :func:`node_mtbf_s_from_failures` turns its
  :class:`cluster_model.FailureModel` into one node's MTBF (``FailureModel.mtbi_s`` for the node's
  GPU count: about 36 days for 8 GPUs). Failures are independent and memoryless, so a job on
  ``N`` nodes fails ``N`` times as often: :func:`job_mtbf_s`.
* **Write rate.** fs3's measured per-node write rate is ``cluster_model/inputs/measured-v2.json``
  (:func:`cluster_model.measured.load_measured`); :func:`write_bytes_per_s_per_node_from` reads it
  off that record. Every node writes its share of the state at once, so a job's checkpoint takes
  ``state / (N x per-node rate)`` plus a fixed overhead (open, flush, barrier).

Formulas (``C``: checkpoint seconds, ``M``: job MTBF seconds, ``R``: restart seconds):

* Young (1974): ``tau = sqrt(2 C M)``, first order in ``C/M``.
* Daly (2006), higher order: ``tau = sqrt(2 C M) (1 + sqrt(C/2M)/3 + (C/2M)/9) - C`` when
  ``C < 2M``, else ``tau = M``.
* Waste under exponential failures (Daly's model): the expected wall time for ``T`` seconds of
  work is ``M e^{R/M} (e^{(tau+C)/M} - 1) T / tau``; the wasted fraction is one minus work over
  that. :func:`first_order_waste` is the familiar ``C/tau + tau/2M`` for comparison.

Nonsense (zero, negative, NaN or infinite rates, sizes and times; booleans) is refused with
:class:`AdviceError` naming the argument, so a bad input never becomes a plausible-looking interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "Advice",
    "AdviceError",
    "advise",
    "checkpoint_cost_s",
    "daly_interval_s",
    "first_order_waste",
    "job_mtbf_s",
    "node_mtbf_s_from_failures",
    "wasted_fraction",
    "write_bytes_per_s_per_node_from",
    "young_interval_s",
]

_BYTES_PER_GB = 1e9  # cluster_model's GB/s are decimal (its measured input converts MiB/s with / 1e9)


class AdviceError(ValueError):
    """An input that no interval can be computed from; the message names it."""


class FailureRates(Protocol):
    """What :func:`node_mtbf_s_from_failures` needs of ``cluster_model.FailureModel``."""

    def mtbi_s(self, job_gpus: int) -> float: ...


class MeasuredWrite(Protocol):
    """What :func:`write_bytes_per_s_per_node_from` needs of ``cluster_model.measured.Measured``."""

    @property
    def write_gbs_per_node(self) -> float: ...


def _positive(name: str, value: float) -> float:
    """``value`` as a float if it is a finite number above zero; else :class:`AdviceError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AdviceError(f"{name} must be a number, not {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise AdviceError(f"{name} must be a finite number above zero, not {value!r}")
    return float(value)


def _not_negative(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AdviceError(f"{name} must be a number, not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise AdviceError(f"{name} must be a finite number, at least zero, not {value!r}")
    return float(value)


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdviceError(f"{name} must be a whole number, at least one, not {value!r}")
    return value


def node_mtbf_s_from_failures(failures: FailureRates, gpus_per_node: int) -> float:
    """One node's mean time between interruptions, from cluster_model's per-GPU Xid rates."""
    return _positive("node MTBF", failures.mtbi_s(_count("gpus_per_node", gpus_per_node)))


def write_bytes_per_s_per_node_from(measured: MeasuredWrite) -> float:
    """fs3's measured write rate per node in bytes per second, from cluster_model's measured input."""
    return _positive("write_gbs_per_node", measured.write_gbs_per_node) * _BYTES_PER_GB


def job_mtbf_s(node_mtbf_s: float, nodes: int) -> float:
    """A job on ``nodes`` nodes fails when any one does: independent, memoryless failures add up."""
    return _positive("node_mtbf_s", node_mtbf_s) / _count("nodes", nodes)


def checkpoint_cost_s(state_bytes: float, write_bytes_per_s: float, overhead_s: float = 0.0) -> float:
    """Seconds one checkpoint takes: the state over the rate it is written at, plus a fixed overhead."""
    return _positive("state_bytes", state_bytes) / _positive("write_bytes_per_s", write_bytes_per_s) + \
        _not_negative("overhead_s", overhead_s)


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimum ``sqrt(2 C M)``: compute time between checkpoints."""
    return math.sqrt(2.0 * _positive("checkpoint_s", checkpoint_s) * _positive("mtbf_s", mtbf_s))


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum; ``M`` itself once a checkpoint takes ``2M`` or more (checkpointing
    then barely pays, and the series no longer converges)."""
    c = _positive("checkpoint_s", checkpoint_s)
    m = _positive("mtbf_s", mtbf_s)
    if c >= 2.0 * m:
        return m
    ratio = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - c


def wasted_fraction(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected fraction of wall time not spent on useful work, checkpointing every ``interval_s``
    seconds of work, under exponential failures (Daly's model: checkpoints, redone work and
    restarts all counted). Always in ``[0, 1)``."""
    tau = _positive("interval_s", interval_s)
    c = _positive("checkpoint_s", checkpoint_s)
    m = _positive("mtbf_s", mtbf_s)
    r = _not_negative("restart_s", restart_s)
    exponent = (tau + c + r) / m
    if exponent > 700.0:  # e^700 is near the float limit: the job essentially never gets work done
        return 1.0
    wall_per_work = m * math.exp(r / m) * math.expm1((tau + c) / m) / tau
    return 1.0 - 1.0 / wall_per_work


def first_order_waste(interval_s: float, checkpoint_s: float, mtbf_s: float) -> float:
    """The first-order estimate ``C/tau + tau/2M`` (cluster_model's ``FailureModel.overhead``)."""
    tau = _positive("interval_s", interval_s)
    return _positive("checkpoint_s", checkpoint_s) / tau + tau / (2.0 * _positive("mtbf_s", mtbf_s))


@dataclass(frozen=True)
class Advice:
    """One job's checkpoint advice; every time in seconds."""

    nodes: int
    checkpoint_s: float
    job_mtbf_s: float
    young_interval_s: float
    daly_interval_s: float
    wasted_fraction: float  # at Daly's interval, Daly's exponential model


def advise(nodes: int, state_bytes: float, write_bytes_per_s_per_node: float, node_mtbf_s: float,
           overhead_s: float = 0.0, restart_s: float = 0.0) -> Advice:
    """The advice for a job of ``nodes`` nodes checkpointing ``state_bytes`` in total, every node
    writing its share at ``write_bytes_per_s_per_node``."""
    n = _count("nodes", nodes)
    rate = _positive("write_bytes_per_s_per_node", write_bytes_per_s_per_node) * n
    c = checkpoint_cost_s(state_bytes, rate, overhead_s)
    m = job_mtbf_s(node_mtbf_s, n)
    daly = daly_interval_s(c, m)
    return Advice(nodes=n, checkpoint_s=c, job_mtbf_s=m, young_interval_s=young_interval_s(c, m),
                  daly_interval_s=daly, wasted_fraction=wasted_fraction(daly, c, m, restart_s))

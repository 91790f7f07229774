"""Checkpoint interval advice: known values, the shape of the curves, and nonsense refused."""

from __future__ import annotations

import math

import pytest

from cluster_model import load_cluster
from cluster_model.measured import load_measured
from hai import advice
from hai.advice import AdviceError

DAY_S = 86_400.0


@pytest.mark.parametrize(("checkpoint_s", "mtbf_s", "young_s", "daly_s"), [
    (60.0, DAY_S, 3219.94, 3180.06),  # C = 1 min, M = 1 day
    (1.0, 2.0, 2.0, 2.0 * (1 + math.sqrt(0.25) / 3 + 0.25 / 9) - 1.0),  # C/2M = 1/4: every term shows
    (600.0, 3600.0, 2078.46, 2078.46 * (1 + math.sqrt(600 / 7200) / 3 + (600 / 7200) / 9) - 600.0),
    (10.0, 4.0, math.sqrt(80.0), 4.0),  # C >= 2M: Daly falls back to M
])
def test_known_intervals(checkpoint_s: float, mtbf_s: float, young_s: float, daly_s: float) -> None:
    assert advice.young_interval_s(checkpoint_s, mtbf_s) == pytest.approx(young_s, rel=1e-5)
    assert advice.daly_interval_s(checkpoint_s, mtbf_s) == pytest.approx(daly_s, rel=1e-5)


def test_daly_is_close_to_the_cluster_models_first_order_form_when_checkpoints_are_cheap() -> None:
    failures = load_cluster().failures
    mtbf_s = failures.mtbi_s(64 * 8)
    cluster_model_s = failures.optimal_interval_s(64 * 8, 30.0)  # sqrt(2CM) - C
    assert advice.daly_interval_s(30.0, mtbf_s) == pytest.approx(cluster_model_s, rel=0.01)
    assert advice.daly_interval_s(30.0, mtbf_s) > cluster_model_s  # the higher-order terms add


def test_wasted_fraction_known_values_and_first_order_agreement() -> None:
    assert advice.wasted_fraction(3600.0, 60.0, 1e12) == pytest.approx(60.0 / 3660.0, rel=1e-6)  # no failures
    tau = advice.daly_interval_s(60.0, DAY_S)
    exact = advice.wasted_fraction(tau, 60.0, DAY_S)
    assert exact == pytest.approx(advice.first_order_waste(tau, 60.0, DAY_S), rel=0.05)
    assert 0.0 < exact < 0.05
    assert advice.wasted_fraction(1.0, 1e6, 1.0) == 1.0  # hopeless: capped rather than overflowing


def test_dalys_interval_is_near_the_minimum_of_the_waste() -> None:
    for checkpoint_s, mtbf_s in [(60.0, DAY_S), (300.0, 3600.0), (5.0, 600.0)]:
        tau = advice.daly_interval_s(checkpoint_s, mtbf_s)
        at_tau = advice.wasted_fraction(tau, checkpoint_s, mtbf_s)
        for factor in (0.5, 0.8, 0.95, 1.05, 1.25, 2.0):
            assert at_tau <= advice.wasted_fraction(tau * factor, checkpoint_s, mtbf_s) + 1e-4


def test_monotonic() -> None:
    costs = [1.0, 10.0, 60.0, 600.0]
    mtbfs = [3600.0, DAY_S, 30 * DAY_S]
    for m in mtbfs:
        young = [advice.young_interval_s(c, m) for c in costs]
        daly = [advice.daly_interval_s(c, m) for c in costs]
        waste = [advice.wasted_fraction(d, c, m) for c, d in zip(costs, daly, strict=True)]
        assert young == sorted(young) and daly == sorted(daly) and waste == sorted(waste)
    for c in costs:
        daly = [advice.daly_interval_s(c, m) for m in mtbfs]
        waste = [advice.wasted_fraction(d, c, m) for d, m in zip(daly, mtbfs, strict=True)]
        assert daly == sorted(daly) and waste == sorted(waste, reverse=True)
    # More nodes: shorter MTBF, shorter interval, more waste (state fixed, so the write gets faster too).
    rows = [advice.advise(n, 1e12, 5e8, 3e6, overhead_s=10.0) for n in (1, 4, 16, 64, 256)]
    assert [r.job_mtbf_s for r in rows] == sorted((r.job_mtbf_s for r in rows), reverse=True)
    assert [r.checkpoint_s for r in rows] == sorted((r.checkpoint_s for r in rows), reverse=True)
    assert advice.checkpoint_cost_s(2e9, 1e9) < advice.checkpoint_cost_s(4e9, 1e9) < \
        advice.checkpoint_cost_s(4e9, 1e9, overhead_s=1.0)


def test_advise_from_the_cluster_models_inputs() -> None:
    cluster = load_cluster()
    node_mtbf_s = advice.node_mtbf_s_from_failures(cluster.failures, cluster.node.gpus)
    assert node_mtbf_s == pytest.approx(cluster.failures.mtbi_s(cluster.node.gpus))
    assert 10 * DAY_S < node_mtbf_s < 100 * DAY_S  # Table VI: a node of 8 GPUs fails about monthly
    per_node = advice.write_bytes_per_s_per_node_from(load_measured())
    assert per_node == pytest.approx(load_measured().write_gbs_per_node * 1e9)
    result = advice.advise(16, 14 * 7e9, per_node, node_mtbf_s, overhead_s=5.0)  # a 7B model's training state
    assert result.job_mtbf_s == pytest.approx(node_mtbf_s / 16)
    assert result.checkpoint_s == pytest.approx(14 * 7e9 / (16 * per_node) + 5.0)
    assert result.young_interval_s == pytest.approx(math.sqrt(2 * result.checkpoint_s * result.job_mtbf_s))
    assert 0.0 < result.wasted_fraction < 0.1


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(("call", "names"), [
    (lambda: advice.young_interval_s(0.0, DAY_S), "checkpoint_s"),
    (lambda: advice.young_interval_s(60.0, -1.0), "mtbf_s"),
    (lambda: advice.daly_interval_s(NAN, DAY_S), "checkpoint_s"),
    (lambda: advice.daly_interval_s(60.0, INF), "mtbf_s"),
    (lambda: advice.checkpoint_cost_s(0, 1e9), "state_bytes"),
    (lambda: advice.checkpoint_cost_s(-5e9, 1e9), "state_bytes"),
    (lambda: advice.checkpoint_cost_s(1e9, 0.0), "write_bytes_per_s"),
    (lambda: advice.checkpoint_cost_s(1e9, 1e9, overhead_s=-1.0), "overhead_s"),
    (lambda: advice.checkpoint_cost_s(1e9, 1e9, overhead_s=NAN), "overhead_s"),
    (lambda: advice.job_mtbf_s(DAY_S, 0), "nodes"),
    (lambda: advice.job_mtbf_s(DAY_S, True), "nodes"),
    (lambda: advice.job_mtbf_s(NAN, 4), "node_mtbf_s"),
    (lambda: advice.wasted_fraction(0.0, 60.0, DAY_S), "interval_s"),
    (lambda: advice.wasted_fraction(600.0, 60.0, DAY_S, restart_s=-1.0), "restart_s"),
    (lambda: advice.young_interval_s("60", DAY_S), "checkpoint_s"),  # type: ignore[arg-type]
    (lambda: advice.advise(4, 1e9, NAN, DAY_S), "write_bytes_per_s_per_node"),
    (lambda: advice.advise(4, 1e9, 1e9, 0.0), "node_mtbf_s"),
    (lambda: advice.node_mtbf_s_from_failures(load_cluster().failures, 0), "gpus_per_node"),
])
def test_nonsense_is_refused_naming_the_argument(call: object, names: str) -> None:
    assert callable(call)
    with pytest.raises(AdviceError, match=names):
        call()

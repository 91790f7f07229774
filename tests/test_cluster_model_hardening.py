"""cluster_model: the allreduce, fabric and training models refuse what they cannot price, and count once.

Bad counts, sizes and radices name their field instead of failing deep inside (ZeroDivisionError,
TypeError) or returning NaN; a job bigger than the fabric is refused by every algorithm; a tree far
beyond any cluster is refused rather than walked; a GPU whose NVLink partner is not in the job copies
its whole buffer; and an allreduce's pipeline fill counts its first chunk once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from cluster_model import ConfigError, load_cluster
from cluster_model.cluster import Cluster
from cluster_model.collectives import Collective
from cluster_model.fabric import MAX_TREE_NODES, Fabric, double_binary_tree
from cluster_model.predict import allreduce_predictions
from cluster_model.topology import MAX_ACCESS_POINTS, three_layer_fat_tree, three_layer_sizing
from cluster_model.training import MODELS, TrainingJob

_MIB = 1 << 20


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return load_cluster()


def _field(call: Callable[[], object]) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return info.value.field


def test_bad_allreduce_inputs_name_their_field(cluster: Cluster) -> None:
    col = cluster.collective
    bad: list[tuple[Callable[[], object], str]] = [
        (lambda: col.hfreduce(True, _MIB), "gpus"),
        (lambda: col.hfreduce(8.0, _MIB), "gpus"),  # type: ignore[arg-type]
        (lambda: col.hfreduce(16, True), "message_bytes"),
        (lambda: col.hfreduce(16, 1.5), "message_bytes"),  # type: ignore[arg-type]
        (lambda: col.nccl(16, math.nan), "message_bytes"),  # type: ignore[arg-type]
        (lambda: col.nccl(16, math.inf), "message_bytes"),  # type: ignore[arg-type]
        (lambda: col.hfreduce(24, _MIB, gpus_per_node=True), "gpus_per_node"),
        (lambda: col.hfreduce(24, _MIB, gpus_per_node=1.5), "gpus_per_node"),  # type: ignore[arg-type]
        (lambda: col.hfreduce(16, _MIB, cross_zone_gbs=math.nan), "cross_zone_gbs"),
        (lambda: col.hfreduce(16, _MIB, cross_zone_gbs=True), "cross_zone_gbs"),
        # A job bigger than the cluster: the ring consults no tree, so it must check the fabric itself.
        (lambda: col.nccl(8 * 10**6, _MIB, algorithm="ring"), "gpus"),
        (lambda: col.hfreduce(4000, _MIB, gpus_per_node=1), "gpus"),
    ]
    for call, field in bad:
        assert _field(call) == field


def test_bad_fabric_inputs_name_their_field() -> None:
    bad: list[tuple[Callable[[], object], str]] = [
        (lambda: Fabric(2, 1, switch_latency_s="x"), "fabric.switch_latency_s"),  # type: ignore[arg-type]
        (lambda: Fabric(2, 1, switch_latency_s=math.inf), "fabric.switch_latency_s"),
        (lambda: Fabric.two_zone(0, 1250, 1, 2, 20), "network.switch_ports"),
        (lambda: Fabric.two_zone(1, 1250, 1, 2, 20), "network.switch_ports"),
        (lambda: Fabric.two_zone(True, 1250, 1, 2, 20), "network.switch_ports"),
        (lambda: Fabric.two_zone(39, 1250, 1, 2, 20), "network.switch_ports"),
        (lambda: Fabric.two_zone(40, 1250, 1, 0, 20), "network.zones"),
        (lambda: Fabric.two_zone(40, True, 1, 2, 20), "network.compute_nodes"),
        (lambda: Fabric.two_zone(40, 1.5, 1, 2, 20), "network.compute_nodes"),  # type: ignore[arg-type]
    ]
    for call, field in bad:
        assert _field(call) == field


def test_a_tree_far_beyond_any_cluster_is_refused_not_walked() -> None:
    assert _field(lambda: double_binary_tree(MAX_TREE_NODES + 1)) == "nodes"
    assert _field(lambda: Fabric(20, 10**6).tree_traffic(10**6)) == "nodes"
    assert _field(lambda: Fabric(10**9, 10**9).place(10**7)) == "nodes"
    assert len(double_binary_tree(1000)[0]) == 1000


def test_bad_training_inputs_name_their_field(cluster: Cluster) -> None:
    llama, vgg = MODELS["llama-13b"], MODELS["vgg16"]
    bad: list[tuple[Callable[[], object], str]] = [
        (lambda: TrainingJob(vgg, cluster.node, 16, bucket_bytes=0), "training.bucket_bytes"),
        (lambda: TrainingJob(vgg, cluster.node, 16, bucket_bytes=-5), "training.bucket_bytes"),
        (lambda: TrainingJob(vgg, cluster.node, 16, gpu_memory_bytes=math.nan),  # type: ignore[arg-type]
         "training.gpu_memory_bytes"),
        # 64 stages of a 40-layer model: 24 stages would hold no layer.
        (lambda: TrainingJob(llama, cluster.node, 64, strategy="pp", stages=64), "training.stages"),
    ]
    for call, field in bad:
        assert _field(call) == field


def test_a_gpu_without_its_nvlink_partner_copies_its_whole_buffer(cluster: Cluster) -> None:
    col = Collective(cluster.node)
    # One GPU, or one GPU per node: there is no bridged partner to pre-reduce with.
    assert col.hfreduce(1, 64 * _MIB, nvlink=True).time_s == col.hfreduce(1, 64 * _MIB).time_s
    one_per_node = cluster.collective.hfreduce(16, 64 * _MIB, gpus_per_node=1, nvlink=True)
    assert one_per_node.time_s == cluster.collective.hfreduce(16, 64 * _MIB, gpus_per_node=1).time_s
    for local in range(1, 9):  # NVLink never lowers bandwidth, and an odd GPU out gains nothing on copies
        with_nv = col.hfreduce(local, 64 * _MIB, nvlink=True)
        without = col.hfreduce(local, 64 * _MIB)
        assert with_nv.algbw_gbs >= without.algbw_gbs, local


def test_the_fill_counts_the_first_chunk_once(cluster: Cluster) -> None:
    col = replace(cluster.collective, pipeline_chunk_bytes=_MIB, nccl_chunk_bytes=256 << 10)
    # A message of exactly one chunk is nothing but the first chunk's passage.
    one = col.hfreduce(128, _MIB)
    assert one.time_s == pytest.approx(one.fill_s)
    nccl_one = col.nccl(128, 256 << 10)
    assert nccl_one.time_s == pytest.approx(nccl_one.fill_s)
    # A message smaller than a chunk is one chunk of its own size, not a full chunk's fill.
    small = col.hfreduce(128, 4096)
    assert small.time_s == pytest.approx(small.fill_s) and small.fill_s < one.fill_s
    # So bandwidth never falls as the message grows, from one page to a gigabyte.
    sizes = [4096 << shift for shift in range(19)]
    for algo in (col.hfreduce, col.nccl):
        bandwidths = [algo(128, m).algbw_gbs for m in sizes]
        assert all(b >= a * (1 - 1e-12) for a, b in pairwise(bandwidths))


def test_a_three_layer_tree_beyond_a_billion_access_points_is_refused_not_walked() -> None:
    # A full radix-10,000 tree has 2.5e11 access points: sizing it leaf by leaf would run for minutes.
    assert _field(lambda: three_layer_fat_tree(10_000, 200)) == "endpoints"
    assert _field(lambda: three_layer_sizing(10_000, MAX_ACCESS_POINTS + 1)) == "endpoints"
    assert three_layer_sizing(2_000, MAX_ACCESS_POINTS).violations() == []


_EXAMPLES = Path(__file__).resolve().parent.parent / "cluster_model" / "examples"


@pytest.mark.parametrize("whatif", [_EXAMPLES / "dgx_three_layer.toml", _EXAMPLES / "four_plane_400g.toml",
                                    {"network": {"zones": 4, "storage_nics_per_node": 4}}])
def test_no_point_is_predicted_twice_on_other_fabrics(whatif: Path | dict[str, object]) -> None:
    rows = allreduce_predictions(load_cluster(whatif))
    keys = [(r.section, r.setup, r.quantity) for r in rows]
    assert len(keys) == len(set(keys))
    assert all("spread over" not in r.setup or "2 zones" in r.setup for r in rows)


def test_a_collective_with_bad_pipeline_settings_is_refused(cluster: Cluster) -> None:
    col = cluster.collective
    bad: list[tuple[Callable[[], object], str]] = [
        (lambda: replace(col, pipeline_chunk_bytes=0), "collective.pipeline_chunk_bytes"),
        (lambda: replace(col, nccl_chunk_bytes=-1), "collective.nccl_chunk_bytes"),
        (lambda: replace(col, hop_latency_s=-1e-6), "collective.hop_latency_s"),  # would make time negative
        (lambda: replace(col, hop_latency_s=math.nan), "collective.hop_latency_s"),
        (lambda: replace(col, placement="random"), "placement"),
    ]
    for call, field in bad:
        assert _field(call) == field


def test_the_mechanism_names_the_rate_its_bound_sets(cluster: Cluster) -> None:
    # HFReduce with NVLink at 32 GPUs is held by the NIC: 2 bytes per byte through 25 GB/s is 12.50 GB/s.
    row = next(r for r in allreduce_predictions(cluster) if r.section == "Fig. 7b" and r.setup.startswith("32 "))
    nic_gbs = cluster.node.compute_nics * cluster.node.nic_gbs
    assert row.mechanism.startswith(f"NIC sets {nic_gbs / 2:.2f} GB/s")
    assert row.value < nic_gbs / 2

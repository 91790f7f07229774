"""cluster_model's predictions: allreduce trees on the fat-tree behave as their mechanisms say, every
point the paper's other figures need is predicted once, and bad input is refused with the field named."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from cluster_model import ConfigError, load_cluster
from cluster_model.cluster import Cluster
from cluster_model.collectives import Collective
from cluster_model.fabric import Fabric, double_binary_tree
from cluster_model.predict import (
    FIG7A_GPUS,
    FIG7B_ONE_ZONE_GPUS,
    FIG7B_TWO_ZONE_GPUS,
    allreduce_predictions,
    predictions,
)
from cluster_model.reproduce import FIG7A_MESSAGE_BYTES

SIZE = FIG7A_MESSAGE_BYTES


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return load_cluster()


def _children(parents: list[int | None]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for parent in parents:
        if parent is not None:
            counts[parent] = counts.get(parent, 0) + 1
    return counts


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 64, 100, 180, 625])
def test_the_double_binary_tree_is_two_trees_of_at_most_two_children(count: int) -> None:
    for parents in double_binary_tree(count):
        assert sum(parent is None for parent in parents) == 1          # one root
        assert all(parent is None or 0 <= parent < count for parent in parents)
        assert max(_children(parents).values(), default=0) <= 2
        for rank in range(count):                                       # every rank reaches the root
            seen, node = set(), rank
            while (parent := parents[node]) is not None:
                assert node not in seen
                seen.add(node)
                node = parent
    tree_a, tree_b = double_binary_tree(count)
    # What makes it a *double* tree: no rank is interior (two children) in both trees.
    interior_a = {rank for rank, children in _children(tree_a).items() if children == 2}
    interior_b = {rank for rank, children in _children(tree_b).items() if children == 2}
    assert not interior_a & interior_b


def test_a_nodes_nic_carries_at_most_two_bytes_per_byte_and_links_only_what_crosses() -> None:
    fabric = Fabric(nodes_per_leaf=20, leaves_per_zone=32, zones=2, cross_zone_links=20)
    for nodes in (2, 3, 8, 16, 20, 21, 40, 64, 128, 180, 333, 640):
        one = fabric.tree_traffic(nodes)
        assert one.nic_load <= 2.0
        assert one.leaves == math.ceil(nodes / 20)
        assert one.cross_zone_load == 0
        assert (one.uplink_load == 0) == (nodes <= 20)                  # one leaf: no spine traffic
        assert one.depth <= math.ceil(math.log2(nodes)) + 1
        two = fabric.tree_traffic(nodes, zones=2)
        assert two.zones == 2 and two.cross_zone_load > 0
        assert two.deepest_path_switches >= one.deepest_path_switches or two.depth < one.depth


def test_destination_routing_shares_an_uplink_only_between_flows_to_the_same_port() -> None:
    # Two leaves of two nodes: ranks 0, 1 on leaf 0 (ports 0, 1), ranks 2, 3 on leaf 1 (ports 0, 1).
    fabric = Fabric(nodes_per_leaf=2, leaves_per_zone=2)
    traffic = fabric.tree_traffic(4)
    # Tree A: 0-2, 2-1, 2-3; tree B (mirrored): 0-1, 1-2, 1-3. Leaving leaf 0: 0->2 and 1->2 (tree A),
    # 1->2 (tree B) all go to port 0 of leaf 1, so they share leaf 0's uplink to spine 0: three flows
    # of half a byte; 1->3 (tree B) alone takes spine 1.
    assert traffic.uplink_load == 1.5
    assert traffic.nic_load == 2.0
    # A fabric with one link between the zones carries every crossing flow on it.
    narrow = Fabric(nodes_per_leaf=20, leaves_per_zone=32, zones=2, cross_zone_links=1)
    wide = replace(narrow, cross_zone_links=20)
    scattered = [narrow.tree_traffic(180, 2, "scattered"), wide.tree_traffic(180, 2, "scattered")]
    assert scattered[0].cross_zone_load > scattered[1].cross_zone_load


def test_the_tree_on_the_fabric_is_a_bound_the_collective_can_hit(cluster: Cluster) -> None:
    """A checker that can fail: squeeze the links between the zones and the shared links must become the bound."""
    narrow = Collective(cluster.node, replace(cluster.fabric, cross_zone_links=1), placement="scattered")
    result = narrow.hfreduce(1440, SIZE, nvlink=True, zones=2)
    assert result.bound == "shared switch links"
    assert result.algbw_gbs < 0.6 * cluster.collective.hfreduce(1440, SIZE, nvlink=True).algbw_gbs


def test_nvlink_never_lowers_and_crossing_zones_never_raises_bandwidth(cluster: Cluster) -> None:
    for placement in ("packed", "scattered"):
        collective = replace(cluster.collective, placement=placement)
        for gpus in (16, 32, 64, 128, 256, 512, 1024, 1440, 2048, 4096):
            plain = collective.hfreduce(gpus, SIZE).algbw_gbs
            nvlink = collective.hfreduce(gpus, SIZE, nvlink=True).algbw_gbs
            assert nvlink >= plain, (placement, gpus)
            for nv in (False, True):
                one = collective.hfreduce(gpus, SIZE, nvlink=nv, zones=1).algbw_gbs
                two = collective.hfreduce(gpus, SIZE, nvlink=nv, zones=2).algbw_gbs
                assert two <= one + 1e-12, (placement, gpus, nv)
            assert collective.nccl(gpus, SIZE, zones=2).algbw_gbs <= collective.nccl(gpus, SIZE).algbw_gbs + 1e-12


def test_more_gpus_never_raise_bandwidth_once_the_tree_spans_nodes(cluster: Cluster) -> None:
    collective = cluster.collective
    counts = [32, 64, 128, 256, 512, 1024, 1440, 2048, 4096]
    curves = {
        "HFReduce": [collective.hfreduce(g, SIZE).algbw_gbs for g in counts],
        "NCCL": [collective.nccl(g, SIZE).algbw_gbs for g in counts],
        "HFReduce with NVLink": [collective.hfreduce(g, SIZE, nvlink=True).algbw_gbs for g in counts],
    }
    for name, values in curves.items():
        assert all(b <= a + 1e-12 for a, b in itertools.pairwise(values)), (name, values)
    # ... and HFReduce stays ahead of NCCL on this node at every scale: their bounds do not move.
    for gpus in counts:
        assert collective.hfreduce(gpus, SIZE).algbw_gbs > 1.4 * collective.nccl(gpus, SIZE).algbw_gbs


def test_a_job_that_does_not_fit_or_a_bad_fabric_is_refused(cluster: Cluster) -> None:
    fabric = cluster.fabric
    with pytest.raises(ConfigError, match="nodes"):
        fabric.place(fabric.nodes_per_leaf * fabric.leaves_per_zone + 1)   # more than one zone holds
    with pytest.raises(ConfigError, match="zones"):
        fabric.place(8, zones=3)
    with pytest.raises(ConfigError, match="zones"):
        fabric.place(1, zones=2)
    with pytest.raises(ConfigError, match="placement"):
        fabric.place(8, placement="random")
    with pytest.raises(ConfigError, match="nodes"):
        fabric.place(0)
    with pytest.raises(ConfigError, match="nodes"):
        double_binary_tree(True)
    with pytest.raises(ConfigError, match="cross_zone_links"):
        Fabric(nodes_per_leaf=20, leaves_per_zone=4, zones=2, cross_zone_links=0)
    with pytest.raises(ConfigError, match="nodes_per_leaf"):
        Fabric(nodes_per_leaf=0, leaves_per_zone=4)
    with pytest.raises(ConfigError, match="zones"):
        cluster.collective.hfreduce(64, SIZE, zones=3)


def test_every_point_of_the_issue_is_predicted_once_with_its_mechanism(cluster: Cluster) -> None:
    rows = predictions(cluster)
    keys = [(r.section, r.setup, r.quantity) for r in rows]
    assert len(keys) == len(set(keys))
    for row in rows:
        assert math.isfinite(row.value) and row.value > 0, row
        assert row.mechanism and row.unit, row
    allreduce = allreduce_predictions(cluster)
    fig7a = [r for r in allreduce if r.section == "Fig. 7a"]
    assert len(fig7a) == 2 * len(FIG7A_GPUS)
    fig7b = [r for r in allreduce if r.section == "Fig. 7b"]
    assert len(fig7b) == len(FIG7B_ONE_ZONE_GPUS) + len(FIG7B_TWO_ZONE_GPUS)
    sections = {r.section for r in rows}
    assert {"Table III", "Fig. 7a", "Fig. 7b", "Power"} <= sections


def test_zones_with_no_links_between_them_keep_every_job_inside_one_zone() -> None:
    isolated = load_cluster({"network": {"cross_zone_links": 0}})
    assert isolated.fabric.zones == 1
    rows = predictions(isolated)
    assert rows and not [r for r in rows if "zones" in r.setup and r.section == "Fig. 7b"]
    with pytest.raises(ConfigError, match="zones"):
        isolated.collective.hfreduce(128, SIZE, zones=2)

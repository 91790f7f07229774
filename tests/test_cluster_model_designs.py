"""cluster_model: Table III's three designs and the cluster's power, held by their mechanisms.

A three-layer tree sized for n access points lies between the full-bisection bound and the full
radix-k tree, grows with n, overloads no switch and keeps full bisection; small radices are
checked by hand; the sizing checker rejects hand-built bad sizings; bad input names its field.
"""

from __future__ import annotations

import math

import pytest

from cluster_model import ConfigError, load_cluster
from cluster_model.cluster import Cluster
from cluster_model.cost import StorageNodePower
from cluster_model.designs import DESIGN_B_ACCESS_POINTS, power_predictions, table_iii_designs, table_iii_predictions
from cluster_model.topology import PodSizing, ThreeLayerSizing, three_layer_fat_tree, three_layer_sizing

_SAMPLED_N = sorted({801, 802, 819, 820, 821, 1599, 1600, 1601, 1610, 4000, 4001, 9999, 10_000, 10_001, 11_610,
                     15_999, 16_000, *range(801, 16_001, 97)})


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return load_cluster()


def _bound(n: int, radix: int) -> int:
    """Full bisection needs n/(k/2) leaves, as many aggregation switches, and n/k core switches."""
    half = radix // 2
    return math.ceil(n / half) + math.ceil(n / half) + math.ceil(n / radix)


@pytest.mark.parametrize("radix", [40, 8, 4])
def test_three_layer_lies_between_the_bisection_bound_and_a_full_tree(radix: int) -> None:
    capacity = radix ** 3 // 4
    full = 5 * radix * radix // 4
    points = [n for n in _SAMPLED_N if n <= capacity] if radix == 40 else list(range(1, capacity + 1))
    previous = None
    for n in points:
        sizing = three_layer_sizing(radix, n)
        assert _bound(n, radix) <= sizing.switches <= full, n
        assert max(sizing.ports_used_max().values()) <= radix, n
        assert sizing.bisection_ports() >= n / 2, n
        assert sizing.violations() == [], n
        counts = (sizing.leaves, sizing.aggregation, sizing.core)
        if previous is not None:
            assert all(now >= before for now, before in zip(counts, previous, strict=True)), n
        previous = counts


def test_three_layer_counts_for_small_radix_by_hand() -> None:
    # k=4: leaves of 2 ports down, pods of 2 leaves. 5 endpoints: leaves 2,2,1 -> 3 leaves; pods of
    # 2 and 1 leaves take 4 and 2 uplinks -> 2 + 1 aggregation; 6 uplinks / 4 ports -> 2 core.
    small = three_layer_sizing(4, 5)
    assert (small.leaves, small.aggregation, small.core, small.switches) == (3, 3, 2, 8)
    assert [pod.leaves for pod in small.pods] == [2, 1]
    assert small.ports_used_max() == {"leaf": 4, "aggregation": 4, "core": 3}
    # k=4 full: 16 endpoints, 8 leaves, 8 aggregation, 4 core (5k^2/4 = 20).
    full = three_layer_sizing(4, 16)
    assert (full.leaves, full.aggregation, full.core) == (8, 8, 4)
    # k=8: 4 ports down per leaf, pods of 4 leaves. 13 endpoints: 4 leaves (4,4,4,1), one pod of
    # 4 leaves -> 4 aggregation; 16 uplinks / 8 -> 2 core.
    eight = three_layer_sizing(8, 13)
    assert (eight.leaves, eight.aggregation, eight.core) == (4, 4, 2)
    # k=8, 17 endpoints: 5 leaves, pods of 4 and 1 leaves -> 4 + 1 aggregation, 20 uplinks -> 3 core.
    more = three_layer_sizing(8, 17)
    assert (more.leaves, more.aggregation, more.core) == (5, 5, 3)
    assert more.leaf_aggregation_links == 20 and more.aggregation_core_links == 20
    assert three_layer_fat_tree(8, 100, 17).switch_links == 40  # plus 17 endpoint cables in .links


def test_the_sizing_checker_rejects_bad_sizings() -> None:
    good = three_layer_sizing(8, 32)
    assert good.violations() == []
    # One aggregation switch too few in a pod: its down ports are overloaded.
    thin = ThreeLayerSizing(8, 32, (PodSizing((4, 4, 4, 4), 4, 3, 16), *good.pods[1:]), good.core)
    assert any("aggregation" in v for v in thin.violations())
    # Leaves with fewer uplinks than endpoints: blocking.
    blocking = ThreeLayerSizing(8, 16, (PodSizing((4, 4, 4, 4), 2, 2, 8),), 1)
    assert blocking.bisection_ports() < 8
    assert any("bisection" in v for v in blocking.violations())
    # A core too small for the uplinks.
    starved = ThreeLayerSizing(8, 32, good.pods, good.core - 1)
    assert starved.violations()


@pytest.mark.parametrize(("radix", "endpoints", "field"), [
    (40, 0, "endpoints"),
    (40, -5, "endpoints"),
    (40, 16_001, "endpoints"),
    (40, True, "endpoints"),
    (40, 12.5, "endpoints"),
    (41, 100, "network.switch_ports"),
    (2, 1, "network.switch_ports"),
    (True, 1, "network.switch_ports"),
])
def test_invalid_three_layer_input_names_the_field(radix: int, endpoints: int, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        three_layer_sizing(radix, endpoints)
    assert info.value.field == field
    with pytest.raises(ConfigError):
        three_layer_fat_tree(radix, 200, endpoints)


def test_table_iii_designs(cluster: Cluster) -> None:
    a, b, c = table_iii_designs(cluster)
    assert (a.network.switches, b.network.switches, c.network.switches) == (120, 80 + 80 + 40, 500 + 500 + 250)
    assert b.network.endpoints == DESIGN_B_ACCESS_POINTS and c.network.endpoints == 1250 * 8
    switch = 350 / 120
    assert a.cost.network_price == pytest.approx(350)
    assert b.cost.network_price == pytest.approx(200 * switch)
    assert c.cost.network_price == pytest.approx(1250 * switch)
    assert (a.cost.server_price, b.cost.server_price, c.cost.server_price) == (11_250, 11_250, 19_000)
    # More layers cost more network for the same access points; the DGX design costs most.
    assert a.cost.network_price < b.cost.network_price < c.cost.network_price
    assert a.cost.price < b.cost.price < c.cost.price
    assert all(d.network.oversubscription == 1.0 for d in (b, c))
    rows = table_iii_predictions(cluster)
    assert len(rows) == 12 and {r.section for r in rows} == {"Table III"}
    assert {r.quantity for r in rows} == {"switches", "network price", "server price", "total price"}
    by_key = {(r.setup[:3], r.quantity): r for r in rows}
    assert by_key[("(c)", "switches")].mechanism.startswith("500 leaves + 500 aggregation + 250 core")
    assert "1,610" in by_key[("(b)", "switches")].mechanism
    assert by_key[("(b)", "total price")].value == pytest.approx(11_250 + 200 * switch)


def test_dgx_equivalent_takes_the_access_points(cluster: Cluster) -> None:
    net, cost = cluster.dgx_equivalent()
    assert net.endpoints == 10_000 and cost.nodes == 1250
    every_nic, _ = cluster.dgx_equivalent(1250 * 9 + 360)
    assert every_nic.switches > net.switches
    with pytest.raises(ConfigError, match="endpoints"):
        cluster.dgx_equivalent(0)


def test_power_is_built_from_parts(cluster: Cluster) -> None:
    rows = {r.quantity: r for r in power_predictions(cluster)}
    assert {r.section for r in rows.values()} == {"Power"}
    assert rows["compute power (IT)"].value == pytest.approx(1250 * 2500 / 1e6)
    assert rows["network power (IT)"].value == pytest.approx(120 * 300 / 1e6)
    node = StorageNodePower(ssds=16, nics=2)
    parts = node.parts_w()
    dc_w = 16 * node.ssd_active_w + 2 * node.cpu_w + 16 * node.dimm_w + 2 * node.nic_w + node.fans_w + node.board_w
    assert parts["SSDs"] == 16 * node.ssd_active_w
    assert node.power_w == pytest.approx(dc_w / node.psu_efficiency)
    assert rows["storage power (IT)"].value == pytest.approx(180 * node.power_w / 1e6)
    total = rows["cluster power (IT, no cooling)"].value
    assert total == pytest.approx(sum(rows[k].value for k in ("compute power (IT)", "storage power (IT)",
                                                              "network power (IT)")))
    # Compute dominates: the storage and network together are a small fraction of the IT load.
    assert rows["compute power (IT)"].value > 0.9 * total
    assert any("PUE" in q and r.value > total for q, r in rows.items())
    # More SSDs per node draw more.
    assert StorageNodePower(ssds=24, nics=2).power_w > node.power_w


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"ssds": -1, "nics": 2}, "storage_power.ssds"),
    ({"ssds": 16, "nics": True}, "storage_power.nics"),
    ({"ssds": 16, "nics": 2, "cpu_w": -1.0}, "storage_power.cpu_w"),
    ({"ssds": 16, "nics": 2, "psu_efficiency": 0.0}, "storage_power.psu_efficiency"),
    ({"ssds": 16, "nics": 2, "psu_efficiency": 1.5}, "storage_power.psu_efficiency"),
])
def test_invalid_storage_power_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        StorageNodePower(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field

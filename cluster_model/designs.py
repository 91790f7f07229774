"""Table III's three designs for about 10,000 A100 GPUs, and Fire-Flyer 2's power draw, predicted.

Table III sets Fire-Flyer 2 (a) beside the same PCIe nodes on one three-layer fat-tree (b) and
DGX-A100 nodes on one (c). Each design's network is sized from the switch radix and the setup's
access points (:func:`cluster_model.topology.three_layer_sizing`: leaves, then pods' aggregation
switches, then the core, only as ports need them), and priced with the unit prices of
:mod:`cluster_model.cost`: a server is the paper's servers line over 1,250 nodes, a switch the
two-zone network's line over its switch count. Nothing here is fitted to a Table III value.

The power draw is the cluster's IT load: compute nodes at their measured average (Table II),
storage nodes built from their parts (:class:`cluster_model.cost.StorageNodePower`) and the
switches at an assumed per-switch draw. Cooling is not included; one row adds an assumed PUE,
labelled as such.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster_model.cluster import Cluster
from cluster_model.config import ConfigError
from cluster_model.cost import ClusterCost, StorageNodePower
from cluster_model.predict import Prediction
from cluster_model.topology import Topology, three_layer_fat_tree, three_layer_sizing

__all__ = [
    "ASSUMED_PUE",
    "DESIGN_B_ACCESS_POINTS",
    "TableIIIDesign",
    "power_predictions",
    "table_iii_designs",
    "table_iii_predictions",
]

#: Design (b)'s access points, the setup's input: our own count is 1,250 compute + 360 storage NICs.
DESIGN_B_ACCESS_POINTS = 1600

#: Assumption, for one clearly labelled row only: a new air-cooled facility of the period targets
#: 1.2-1.4; the paper's power figures are the IT load, which the other rows report.
ASSUMED_PUE = 1.3


@dataclass(frozen=True)
class TableIIIDesign:
    """One of Table III's designs: its network and its priced cluster, and what sets them."""

    label: str            # "(a)", "(b)", "(c)"
    setup: str
    network: Topology
    cost: ClusterCost
    network_mechanism: str


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value == int(value) else f"{value:,.4g}"


def _three_layer_mechanism(network: Topology) -> str:
    sizing = three_layer_sizing(network.switch_radix, network.endpoints)
    last = sizing.pods[-1]
    pods = (f"{len(sizing.pods)} pods of {network.switch_radix // 2} leaves"
            if last.leaves == network.switch_radix // 2 else
            f"{len(sizing.pods) - 1} full pods and one of {last.leaves} leaves")
    return (f"{sizing.leaves} leaves + {sizing.aggregation} aggregation + {sizing.core} core, "
            f"{network.switch_radix}-port switches ({pods}; leaves ceil({network.endpoints:,}/"
            f"{network.switch_radix // 2}), core ceil({sizing.aggregation_core_links:,} uplinks/"
            f"{network.switch_radix}))")


def table_iii_designs(cluster: Cluster) -> list[TableIIIDesign]:
    """Designs (a), (b) and (c) of Table III, built from ``cluster``'s radix, nodes and prices."""
    if cluster.compute_nodes <= 0:
        raise ConfigError("network.compute_nodes", f"must be positive, not {cluster.compute_nodes}")
    radix, port = cluster.network.switch_radix, cluster.network.port_gbps
    ours = cluster.network
    per_zone = ours.endpoints // max(1, ours.zones)
    a_mech = (f"{ours.leaf_switches} leaves + {ours.spine_switches} spines: {ours.zones} zones of "
              f"{radix}-port two-layer trees, each holding {per_zone:,} of {ours.endpoint_capacity // ours.zones} "
              f"ports (storage dual-homed), joined by {ours.cross_zone_links} cross-zone links (assumed)")
    own_ports = (cluster.compute_nodes * (cluster.node.compute_nics + cluster.node.storage_nics)
                 + cluster.storage.storage_nodes * cluster.storage.nics_per_node)
    net_b = three_layer_fat_tree(radix, port, DESIGN_B_ACCESS_POINTS, name="three-layer fat-tree (PCIe)")
    b_mech = (f"{_three_layer_mechanism(net_b)}; {DESIGN_B_ACCESS_POINTS:,} access points is the setup's "
              f"input (ours: {cluster.compute_nodes:,} compute + "
              f"{cluster.storage.storage_nodes * cluster.storage.nics_per_node} storage NICs = {own_ports:,})")
    net_c, cost_c = cluster.dgx_equivalent()
    dgx = cluster.nodes["dgx_a100"]
    c_mech = (f"{_three_layer_mechanism(net_c)}; one access point per compute NIC: "
              f"{cost_c.nodes:,} nodes x {dgx.compute_nics}")
    return [
        TableIIIDesign("(a)", "(a) Fire-Flyer 2: PCIe nodes, two zones of two-layer fat-trees, storage dual-homed",
                       ours, cluster.cost(), a_mech),
        TableIIIDesign("(b)", f"(b) PCIe nodes, three-layer fat-tree, {DESIGN_B_ACCESS_POINTS:,} access points",
                       net_b, cluster.cost_model.cluster("PCIe A100, three-layer", cluster.node,
                                                         cluster.compute_nodes, net_b), b_mech),
        TableIIIDesign("(c)", f"(c) DGX-A100 nodes, three-layer fat-tree, {net_c.endpoints:,} access points",
                       net_c, cost_c, c_mech),
    ]


def table_iii_predictions(cluster: Cluster) -> list[Prediction]:
    """Switch count, network price, server price and total price of each Table III design."""
    switch_price = cluster.cost_model.switch_price
    line = cluster.config.get("price_relative", {}).get("pcie_network_two_zone")
    per_switch = f"{switch_price:.4g} per switch"
    if "switch" not in cluster.config.get("price_relative", {}) and isinstance(line, (int, float)):
        per_switch = f"{line:g}/{round(line / switch_price)} per switch"
    rows: list[Prediction] = []
    for design in table_iii_designs(cluster):
        cost, net = design.cost, design.network
        node_price = cost.server_price / cost.nodes
        rows += [
            Prediction("Table III", design.setup, "switches", net.switches, "switches", design.network_mechanism),
            Prediction("Table III", design.setup, "network price", cost.network_price, "rel.",
                       f"{net.switches:,} switches x {per_switch} (the two-zone network's price over its "
                       f"switches, cabling included)"),
            Prediction("Table III", design.setup, "server price", cost.server_price, "rel.",
                       f"{cost.nodes:,} nodes x {node_price:.4g} per node (Table III's servers line over "
                       f"1,250 nodes)"),
            Prediction("Table III", design.setup, "total price", cost.price, "rel.",
                       f"servers {_fmt(cost.server_price)} + network {_fmt(round(cost.network_price, 1))}"),
        ]
    return rows


def storage_node_power(cluster: Cluster) -> StorageNodePower:
    """One 3FS storage node of ``cluster`` (its SSD and NIC counts), parts at their assumed draw."""
    return StorageNodePower(ssds=cluster.storage.ssds_per_node, nics=cluster.storage.nics_per_node)


def power_predictions(cluster: Cluster) -> list[Prediction]:
    """Fire-Flyer 2's IT power in MW: compute, storage, network, their sum, and the sum at an assumed PUE."""
    nodes, node_w = cluster.compute_nodes, cluster.node.power_w
    storage = cluster.storage
    part = storage_node_power(cluster)
    switches, switch_w = cluster.network.switches, cluster.cost_model.switch_power_w
    compute_mw = nodes * node_w / 1e6
    storage_mw = storage.storage_nodes * part.power_w / 1e6
    network_mw = switches * switch_w / 1e6
    it_mw = compute_mw + storage_mw + network_mw
    setup = (f"Fire-Flyer 2: {nodes:,} PCIe A100 nodes, {storage.storage_nodes} storage nodes, "
             f"{switches} switches")
    storage_mech = (f"{storage.storage_nodes} nodes x {part.power_w:.0f} W: {part.ssds} SSDs x "
                    f"{part.ssd_active_w:g} W + {part.cpu_sockets} CPUs x {part.cpu_w:g} W + {part.dimms} DIMMs x "
                    f"{part.dimm_w:g} W + {part.nics} NICs x {part.nic_w:g} W + fans {part.fans_w:g} W + board "
                    f"{part.board_w:g} W, over a {part.psu_efficiency:.0%} efficient supply (each assumed)")
    return [
        Prediction("Power", setup, "compute power (IT)", compute_mw, "MW",
                   f"{nodes:,} nodes x {node_w:g} W (Table II: average while training)"),
        Prediction("Power", setup, "storage power (IT)", storage_mw, "MW", storage_mech),
        Prediction("Power", setup, "network power (IT)", network_mw, "MW",
                   f"{switches} switches x {switch_w:g} W (a 40-port HDR switch with its optics, assumed)"),
        Prediction("Power", setup, "cluster power (IT, no cooling)", it_mw, "MW",
                   "compute + storage + network; IT load only, no cooling or PUE"),
        Prediction("Power", setup, f"cluster power at an assumed PUE of {ASSUMED_PUE:g}", it_mw * ASSUMED_PUE, "MW",
                   f"IT load x {ASSUMED_PUE:g} (assumed PUE: a new air-cooled facility of the period; not a "
                   f"paper figure)"),
    ]

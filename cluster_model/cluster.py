"""A whole cluster assembled from one description (the reference file, or it with a what-if laid over)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster_model.collectives import Collective
from cluster_model.config import ConfigError, deep_merge, load_toml, reference_path, require_int, require_number
from cluster_model.cost import ClusterCost, CostModel
from cluster_model.fabric import Fabric
from cluster_model.failures import FailureModel
from cluster_model.node import Node
from cluster_model.storage import StorageSystem
from cluster_model.topology import Topology, multi_plane, three_layer_fat_tree, two_zone

__all__ = ["DEFAULT_CROSS_ZONE_LINKS", "Cluster", "load_cluster"]

#: Assumption: the paper says only that few links join the zones; one spine's worth (20).
DEFAULT_CROSS_ZONE_LINKS = 20
_REFERENCE_NODES = 1250  # Table III prices a 10,000-GPU cluster: 1,250 eight-GPU servers


@dataclass(frozen=True)
class Cluster:
    """Every part of one design, and the description (merged TOML) it was built from."""

    name: str
    config: dict[str, Any]
    node: Node
    nodes: dict[str, Node]
    compute_nodes: int
    network: Topology
    storage: StorageSystem
    cost_model: CostModel
    failures: FailureModel

    @property
    def gpus(self) -> int:
        return self.compute_nodes * self.node.gpus

    @property
    def fabric(self) -> Fabric:
        """Where jobs' nodes sit on the two-zone network, for laying allreduce trees onto it.

        Zones with no links between them cannot share a job, so such a design is one zone to the
        fabric (each job stays inside its zone); designs other than two-zone trees of one compute
        NIC per node hang their nodes off one non-blocking switch.
        """
        net = self.config["network"]
        if self.node.compute_nics != 1 or net.get("topology", "two-zone") != "two-zone":
            return Fabric(nodes_per_leaf=self.compute_nodes, leaves_per_zone=1)
        links = self.network.cross_zone_links
        zones = self.network.zones if links else 1
        per_zone_nodes = -(-self.compute_nodes // self.network.zones)
        return Fabric.two_zone(self.network.switch_radix, per_zone_nodes * zones, 1, zones,
                               links if zones > 1 else 0)

    @property
    def collective(self) -> Collective:
        return Collective(self.node, self.fabric)

    def cost(self, precision: str = "tf32") -> ClusterCost:
        return self.cost_model.cluster(self.name, self.node, self.compute_nodes, self.network, precision)

    def dgx_equivalent(self, access_points: int | None = None) -> tuple[Topology, ClusterCost]:
        """The same GPU count built from DGX-A100 nodes on one three-layer fat-tree of ``access_points``.

        The default is one access point per compute NIC (eight per DGX node, 10,000 for 10,000 GPUs),
        as Table III's DGX design is set up; the ninth (storage) NIC and the storage nodes are then
        on a storage network of their own, outside the comparison.
        """
        dgx = self.nodes["dgx_a100"]
        nodes = -(-self.gpus // dgx.gpus)
        if access_points is None:
            access_points = nodes * dgx.compute_nics
        topology = three_layer_fat_tree(self.network.switch_radix, self.network.port_gbps, access_points,
                                        name="three-layer fat-tree (DGX)")
        return topology, self.cost_model.cluster("DGX-A100", dgx, nodes, topology)

    @property
    def checkpoint_write_gbs_per_node(self) -> float:
        """What one node writes to 3FS when checkpointing (Sec. VII-A: 10 GiB/s), in GB/s."""
        table = self.config.get("checkpoint", {})
        return require_number(table, "write_gibs_per_node", "checkpoint", default=10) * (1 << 30) / 1e9

    @property
    def cross_zone_gbs(self) -> float:
        return self.network.cross_zone_gbps / 8


def _network(cfg: dict[str, Any], node: Node, storage: StorageSystem) -> Topology:
    net = cfg.get("network")
    if not isinstance(net, dict):
        raise ConfigError("network", "missing table")
    field = "network"
    radix = require_int(net, "switch_ports", field, minimum=1)
    port = require_number(net, "port_gbps", field)
    compute = require_int(net, "compute_nodes", field)
    storage_nodes = require_int(net, "storage_nodes", field, minimum=0, default=storage.storage_nodes)
    if storage_nodes != storage.storage_nodes:
        raise ConfigError("network.storage_nodes", f"{storage_nodes} differs from storage_3fs.storage_nodes "
                                                   f"({storage.storage_nodes})")
    node_nics = node.compute_nics + node.storage_nics
    kind = net.get("topology", "two-zone")
    if kind == "two-zone":
        return two_zone(radix, port, compute, node.compute_nics, storage.storage_nodes,
                        require_int(net, "storage_nics_per_node", field, default=storage.nics_per_node),
                        require_int(net, "cross_zone_links", field, minimum=0, default=DEFAULT_CROSS_ZONE_LINKS),
                        zones=require_int(net, "zones", field, default=2))
    if kind == "three-layer":
        endpoints = compute * node_nics + storage.storage_nodes * storage.nics_per_node
        return three_layer_fat_tree(radix, port, endpoints)
    if kind == "multi-plane":
        planes = require_int(net, "planes", field)
        endpoints = compute * node_nics + storage.storage_nodes * storage.nics_per_node
        return multi_plane(radix, port, planes, -(-endpoints // planes))
    raise ConfigError("network.topology", f"must be two-zone, three-layer or multi-plane, not {kind!r}")


def load_cluster(whatif: str | Path | dict[str, Any] | None = None, reference: str | Path | None = None) -> Cluster:
    """The reference cluster, or it with ``whatif`` (a TOML path or a dict) laid over it."""
    base = load_toml(reference or reference_path())
    override: dict[str, Any] = {}
    if isinstance(whatif, dict):
        override = whatif
    elif whatif is not None:
        override = load_toml(whatif)
    cfg = deep_merge(base, override)
    cluster_cfg = cfg.get("cluster", {})
    gemm = cfg.get("gemm_tflops_per_gpu", {})
    node_tables = cfg.get("node")
    if not isinstance(node_tables, dict) or not node_tables:
        raise ConfigError("node", "no node designs")
    nodes = {name: Node.from_table(name, table, gemm) for name, table in node_tables.items()}
    node_name = cluster_cfg.get("node", "pcie_a100")
    if node_name not in nodes:
        raise ConfigError("cluster.node", f"no [node.{node_name}] table")
    node = nodes[node_name]
    storage = StorageSystem.from_table(cfg.get("storage_3fs", {}))
    network = _network(cfg, node, storage)
    # Unit prices always come from the paper's own two-zone cluster, so a what-if is priced alike.
    ref_storage = StorageSystem.from_table(base.get("storage_3fs", {}))
    ref_network = _network(base, Node.from_table("pcie_a100", base["node"]["pcie_a100"], base.get(
        "gemm_tflops_per_gpu", {})), ref_storage)
    prices = dict(cfg.get("price_relative", {}))
    cost_model = CostModel.from_reference(prices, _REFERENCE_NODES, ref_network)
    if "switch" in prices:  # another switch (a 128-port 400 Gbps one) has its own price
        cost_model = CostModel(cost_model.node_price, require_number(prices, "switch", "price_relative"),
                               require_number(prices, "switch_power_w", "price_relative",
                                              default=cost_model.switch_power_w))
    if node_name not in cost_model.node_price:
        price = cluster_cfg.get("node_price")
        if price is None:
            raise ConfigError("cluster.node_price", f"node {node_name} needs a price (relative unit)")
        cost_model = CostModel({**cost_model.node_price, node_name: float(price)}, cost_model.switch_price)
    compute_nodes = require_int(cfg["network"], "compute_nodes", "network")
    failures_cfg = cfg.get("failures", {}).get("xid_year", {})
    failures = FailureModel.from_table(failures_cfg, gpus=_REFERENCE_NODES * nodes["pcie_a100"].gpus)
    return Cluster(str(cluster_cfg.get("name", "Fire-Flyer 2")), cfg, node, nodes, compute_nodes, network, storage,
                   cost_model, failures)

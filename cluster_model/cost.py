"""Price and power of a cluster: servers plus the network its topology needs.

Prices are in the paper's relative unit (Table III does not state one). A server's price is the
paper's servers line over its node count (10,000 GPUs / 8 = 1,250 nodes); a switch's price —
cables and transceivers included — is the two-zone network's line over the switches that
network has, so every other network is priced by its switch count. Power is the nodes' measured
average (Table II) plus the switches' (an assumption, below); a storage node's power, which the
paper does not give, is built from its parts (:class:`StorageNodePower`), each part's figure an
assumption stated with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster_model.config import ConfigError
from cluster_model.node import Node
from cluster_model.topology import Topology

__all__ = ["SWITCH_POWER_W", "ClusterCost", "CostModel", "StorageNodePower"]

SWITCH_POWER_W = 300.0  # assumption: a 40-port HDR switch (QM8700) with its optics, typical load


@dataclass(frozen=True)
class StorageNodePower:
    """A 3FS storage node's draw at the wall, from its parts (W). Every default is an assumption.

    The paper gives the compute node's measured average (Table II) but no storage node figure, so
    the node is built up: SSDs, CPUs, memory and NICs at their active draw, fans and board, and the
    power supply's loss on top of the sum.
    """

    ssds: int
    nics: int
    ssd_active_w: float = 20.0       # a PCIe 4.0 15.36 TB U.2 enterprise NVMe reading at full rate:
    #                                  datasheet active maxima of the class are 18-25 W (U.2's 25 W slot)
    cpu_sockets: int = 2             # the compute node's two-socket EPYC platform, reused
    cpu_w: float = 180.0             # per socket, at TDP (32-core EPYC Rome): RDMA completions, CRC
    #                                  and chunk-engine work keep the cores busy at ~44 GB/s per node
    dimms: int = 16                  # one DDR4-3200 RDIMM per channel, as the compute node
    dimm_w: float = 4.0              # a 32 GB DDR4 RDIMM under load
    nic_w: float = 20.0              # a ConnectX-6 200 Gb/s HDR adapter with its cable, typical
    fans_w: float = 60.0             # fans moving the heat of 16 drives and two CPUs in a 2U chassis
    board_w: float = 30.0            # BMC, chipset, drive backplane and PCIe retimers
    psu_efficiency: float = 0.94     # an 80 PLUS Platinum supply near half load

    def __post_init__(self) -> None:
        for name in ("ssds", "nics", "cpu_sockets", "dimms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"storage_power.{name}", f"must be a non-negative whole number, not {value!r}")
        for name in ("ssd_active_w", "cpu_w", "dimm_w", "nic_w", "fans_w", "board_w"):
            if getattr(self, name) < 0:
                raise ConfigError(f"storage_power.{name}", f"must not be negative, not {getattr(self, name)}")
        if not 0 < self.psu_efficiency <= 1:
            raise ConfigError("storage_power.psu_efficiency", f"must be in (0, 1], not {self.psu_efficiency}")

    def parts_w(self) -> dict[str, float]:
        """Each part's DC draw, and the supply's loss on their sum."""
        parts = {"SSDs": self.ssds * self.ssd_active_w, "CPUs": self.cpu_sockets * self.cpu_w,
                 "memory": self.dimms * self.dimm_w, "NICs": self.nics * self.nic_w,
                 "fans": self.fans_w, "board": self.board_w}
        dc_w = sum(parts.values())
        parts["PSU loss"] = dc_w / self.psu_efficiency - dc_w
        return parts

    @property
    def power_w(self) -> float:
        """Draw at the wall."""
        return sum(self.parts_w().values())


@dataclass(frozen=True)
class ClusterCost:
    """Price, power and GEMM rate of one cluster design."""

    name: str
    nodes: int
    gpus: int
    server_price: float
    network_price: float
    power_kw: float
    tflops: float                   # the cluster's GEMM rate (dense, per the precision asked)

    @property
    def price(self) -> float:
        return self.server_price + self.network_price

    @property
    def tflops_per_price(self) -> float:
        return self.tflops / self.price

    @property
    def tflops_per_kw(self) -> float:
        return self.tflops / self.power_kw


@dataclass(frozen=True)
class CostModel:
    """Unit prices (per node design, per switch) and switch power, to price any cluster."""

    node_price: dict[str, float]        # per node, relative unit
    switch_price: float                 # per switch, relative unit, cabling included
    switch_power_w: float = SWITCH_POWER_W

    def __post_init__(self) -> None:
        for name, price in self.node_price.items():
            if price <= 0:
                raise ConfigError(f"price_relative.{name}", f"must be positive, not {price}")
        if self.switch_price <= 0:
            raise ConfigError("price_relative.pcie_network_two_zone", f"must be positive, not {self.switch_price}")

    @classmethod
    def from_reference(cls, prices: dict[str, float], reference_nodes: int, reference_network: Topology) -> CostModel:
        """Unit prices from Table III's lines: servers over ``reference_nodes``, network over its switches."""
        for key in ("pcie_servers_10k", "dgx_servers_10k", "pcie_network_two_zone"):
            value = prices.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"price_relative.{key}", f"must be a positive number, not {value!r}")
        if reference_nodes <= 0:
            raise ConfigError("network.compute_nodes", f"must be positive, not {reference_nodes}")
        return cls({"pcie_a100": prices["pcie_servers_10k"] / reference_nodes,
                    "dgx_a100": prices["dgx_servers_10k"] / reference_nodes},
                   prices["pcie_network_two_zone"] / reference_network.switches)

    def cluster(self, name: str, node: Node, nodes: int, network: Topology, precision: str = "tf32") -> ClusterCost:
        if nodes <= 0:
            raise ConfigError("nodes", f"must be positive, not {nodes}")
        if node.name not in self.node_price:
            raise ConfigError(f"price_relative.{node.name}", "no price for this node design")
        per_gpu = node.tf32_tflops if precision == "tf32" else node.fp16_tflops
        power_kw = (nodes * node.power_w + network.switches * self.switch_power_w) / 1000
        return ClusterCost(name, nodes, nodes * node.gpus, nodes * self.node_price[node.name],
                           network.switches * self.switch_price, power_kw, nodes * node.gpus * per_gpu)

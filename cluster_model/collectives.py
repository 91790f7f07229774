"""Allreduce cost models: NCCL (ring, double binary tree) and HFReduce, on a given node design.

Bandwidths are *algorithm bandwidth* — message bytes over allreduce time, GB/s — the quantity
the paper plots as "inter-node bandwidth" for a fixed message (Fig. 7a: 186 MiB).

NCCL moves gradients GPU to GPU. Across nodes every byte crosses the NIC by GPUDirect RDMA, so
on the PCIe node it is held to the GPU↔NIC peer-to-peer ceiling (EPYC Rome has no chained write),
with one NIC for eight GPUs. A ring sends ``2(n-1)/n`` bytes per byte through each node's NIC;
a double binary tree two (each node is inside one tree and a leaf of the other), at the 92% of
the link that NCCL's own tuning model allows a tree.

HFReduce moves gradients through host memory: each GPU copies to the host (D2H), the CPU sums
the eight buffers, nodes allreduce the sum over a double binary tree with the host NIC (no
peer-to-peer), and the result is copied back (H2D). The paper's bound is host memory traffic:
24 bytes per byte (D2H 8 writes; reduce 8 reads + 1 write; network 2 reads + 2 writes + 1 read;
H2D 2 reads) against 320 GB/s, 13.3 GB/s. This model assumes, in addition, that one chunk's
D2H, CPU reduce and H2D run back to back (the GPU buffer is reused only after its result came
back), while the inter-node tree overlaps them; the slowest GPU sets the copy rate, and GPU5 and
GPU6 share one root port. With NVLink, bridged pairs first reduce over NVLink, so each GPU copies
half a buffer each way and the CPU sums four buffers instead of eight.

Pipelines fill once per tree level (reduce up, broadcast down), one chunk at a time. Given a
:class:`~cluster_model.fabric.Fabric`, the inter-node tree is laid onto the switches: its depth, the
switches on its deepest path and the busiest link it shares come from :mod:`fabric` (placement,
destination routing, cross-zone links); without one, the nodes hang off one non-blocking switch.
NCCL's tree also runs through a chain of the node's GPUs before it reaches the NIC, so its pipeline
is ``GPUs - 1`` steps deeper than HFReduce's, in chunks of NCCL's own size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster_model.config import ConfigError
from cluster_model.fabric import Fabric, TreeTraffic
from cluster_model.node import Node

__all__ = ["HOST_MEMORY_OPS_PER_BYTE", "NCCL_TREE_EFFICIENCY", "AllreduceResult", "Collective"]

HOST_MEMORY_OPS_PER_BYTE = 24  # the paper's count for HFReduce on an 8-GPU PCIe node (with GDRCopy)
#: NCCL's own performance model derates the tree's bus bandwidth to 92% (``busBw * .92`` for
#: NCCL_ALGO_TREE in src/graph/tuning.cc): the cost of pipelining chunks up and down two trees.
NCCL_TREE_EFFICIENCY = 0.92
_MIB = 1 << 20
#: NCCL's Simple protocol moves a tree in chunks of about 256 KiB (the chunk its own latency model is
#: written for: "Tree/Simple is the latency a 256kB chunk" in src/graph/tuning.cc).
NCCL_TREE_CHUNK_BYTES = 256 * 1024

#: The paper's count for the copy back to the GPUs with GDRCopy (H2D 2r), taken as the paper states it.
_GDRCOPY_H2D_READS = 2.0
#: Memory bytes per byte a socket moves on one side: copied between the user buffer and the kernel's.
_SOCKET_SIDE_BYTES = 2.0


def host_memory_bytes_per_byte(buffers: float, nodes: int, *, ranks_in_host_memory: bool = False,
                               nodes_share_memory: bool = False, socket_network: bool = False) -> float:
    """Host-memory bytes read plus written per byte of an HFReduce allreduce: the paper's 24, generalised.

    Per node whose CPU sums ``buffers`` host buffers:

    * copy-in: a GPU's DMA writes its buffer (1 each). A rank in host memory: the chunk's owner reads
      its own in place, each other rank reads its tensor and writes the shared buffer (2 each, buffers - 1);
    * reduce: ``buffers`` read, 1 written;
    * copy-out: GPUs with GDRCopy, the paper's 2 reads. Ranks in host memory: each reads the result and
      writes its tensor (2 each);
    * network (``nodes`` > 1): each tree of the double binary tree carries half the bytes up and half down
      each of its N - 1 edges; a node reads what its children sent to add it (the paper counts that read,
      not its own partial's). A NIC's DMA reads a byte sent and writes a byte received once; a socket
      copies it through the kernel, read and written, on each side (2).

    Separate machines are held to their busiest node — interior in one tree (two children, a parent), a
    leaf in the other: 2 bytes sent, 2 received, 1 read. Nodes sharing one memory system add up: over the
    job 2(N - 1) sent, 2(N - 1) received, N - 1 read. The paper's node, eight GPUs across nodes:
    8 + (8 + 1) + (2 + 2 + 1) + 2 = 24.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes <= 0:
        raise ConfigError("nodes", f"must be a positive whole number, not {nodes!r}")
    minimum = 1 if ranks_in_host_memory else 0
    if isinstance(buffers, bool) or not isinstance(buffers, (int, float)) or buffers <= 0 or buffers < minimum:
        raise ConfigError("buffers", f"must be positive (at least one rank in host memory), not {buffers!r}")
    if ranks_in_host_memory:
        local = 2 * (buffers - 1) + (buffers + 1) + 2 * buffers
    else:
        local = buffers + (buffers + 1) + _GDRCOPY_H2D_READS
    per_byte_moved = _SOCKET_SIDE_BYTES if socket_network else 1.0
    if nodes == 1:
        return local
    if nodes_share_memory:
        edges = nodes - 1
        return nodes * local + per_byte_moved * (2 * edges + 2 * edges) + edges
    return local + per_byte_moved * (2 + 2) + 1


def host_rank_chain_s_per_byte(node: Node, buffers: float, nodes: int) -> float:
    """Seconds per byte of one chunk's copy-in, reduce and copy-out back to back when the ranks are
    processes in host memory (``node.ranks_in_host_memory``): the paper's "intra-node copy and reduce"
    chain, run by the CPU cores instead of copy engines.

    Each stage runs on as many cores as processes take part in it, at most ``node.cores``; a core moves
    its even share of the measured all-core bandwidth (copy bandwidth for copies, memory bandwidth for
    the reduction). Nodes that share the machine run their stages at once on the same cores. When the
    network is a socket on the same machine, its copies are made by those cores too, so they join the
    chain instead of overlapping it (run by the node leaders).
    """
    cores, copy_gbs = node.cores, node.copy_bw_gbs
    if cores is None or copy_gbs is None or not node.ranks_in_host_memory:
        raise ConfigError(f"node.{node.name}", "host-rank chain needs ranks in host memory, cores and copy_bw_gbs")
    sharing = nodes if node.nodes_share_memory else 1

    def stage(traffic_bytes: float, workers: float, bandwidth_gbs: float) -> float:
        if traffic_bytes <= 0:
            return 0.0
        return traffic_bytes / (bandwidth_gbs * min(workers, cores) / cores)

    seconds_per_gb = (stage(sharing * 2 * (buffers - 1), sharing * (buffers - 1), copy_gbs)
                      + stage(sharing * (buffers + 1), sharing * buffers, node.memory_bw_gbs)
                      + stage(sharing * 2 * buffers, sharing * buffers, copy_gbs))
    if nodes > 1 and node.socket_network and node.nodes_share_memory:
        total = host_memory_bytes_per_byte(buffers, nodes, ranks_in_host_memory=True, nodes_share_memory=True,
                                           socket_network=True)
        local = host_memory_bytes_per_byte(buffers, 1, ranks_in_host_memory=True)
        seconds_per_gb += stage(total - nodes * local, nodes, copy_gbs)
    return seconds_per_gb / 1e9


@dataclass(frozen=True)
class AllreduceResult:
    """One allreduce: its time, and which resource set its steady-state rate."""

    algorithm: str
    gpus: int
    message_bytes: int
    time_s: float
    bound: str                      # the resource that sets the steady-state rate
    traffic: TreeTraffic | None = None   # the inter-node tree on the fabric (None inside one node)
    fill_s: float = 0.0                  # of ``time_s``, filling and draining the pipeline
    bound_gbs: float = 0.0               # the steady-state rate the bound alone allows (0: not given)

    @property
    def algbw_gbs(self) -> float:
        return self.message_bytes / self.time_s / 1e9


@dataclass(frozen=True)
class Collective:
    """Allreduce on ``node``-type servers. ``cross_zone_gbs``: bandwidth between zones (None: one zone)."""

    node: Node
    fabric: Fabric | None = None              # where a job's nodes sit (None: one non-blocking switch)
    placement: str = "packed"                 # how a job's nodes are laid on the leaves (Fabric.place)
    pipeline_chunk_bytes: int = 1 * _MIB      # assumption: HFReduce's pipeline granularity
    hop_latency_s: float = 5e-6               # assumption: one step of a pipeline (NIC, software, handshake)
    nccl_chunk_bytes: int = NCCL_TREE_CHUNK_BYTES

    def __post_init__(self) -> None:
        for name in ("pipeline_chunk_bytes", "nccl_chunk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"collective.{name}", f"must be a positive whole number of bytes, not {value!r}")
        hop = self.hop_latency_s
        if isinstance(hop, bool) or not isinstance(hop, (int, float)) or not 0 <= hop < math.inf:
            raise ConfigError("collective.hop_latency_s", f"must be a finite number >= 0, not {hop!r}")
        if self.placement not in ("packed", "scattered"):
            raise ConfigError("placement", f"must be packed or scattered, not {self.placement!r}")

    @staticmethod
    def _check_gpus(gpus: int) -> None:
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus <= 0:
            raise ConfigError("gpus", f"must be a positive whole number, not {gpus!r}")

    def _check_fits(self, nodes: int) -> None:
        """A job bigger than the fabric is refused, whatever the algorithm (the ring consults no tree)."""
        if self.fabric is not None:
            capacity = self.fabric.nodes_per_leaf * self.fabric.leaves_per_zone * self.fabric.zones
            if nodes > capacity:
                raise ConfigError("gpus", f"{nodes} nodes do not fit the fabric's {capacity}")

    def _nodes(self, gpus: int) -> int:
        self._check_gpus(gpus)
        if gpus % self.node.gpus and gpus > self.node.gpus:
            raise ConfigError("gpus", f"{gpus} GPUs is not a whole number of {self.node.gpus}-GPU nodes")
        nodes = max(1, gpus // self.node.gpus)
        self._check_fits(nodes)
        return nodes

    @staticmethod
    def _check_message(message_bytes: int) -> None:
        if isinstance(message_bytes, bool) or not isinstance(message_bytes, int) or message_bytes <= 0:
            raise ConfigError("message_bytes", f"must be a positive whole number of bytes, not {message_bytes!r}")

    def traffic(self, nodes: int, zones: int = 1) -> TreeTraffic:
        """The inter-node double binary tree of a ``nodes``-node job laid onto the fabric."""
        fabric = self.fabric or Fabric(nodes_per_leaf=nodes, leaves_per_zone=1)
        return fabric.tree_traffic(nodes, zones, self.placement)

    def _tree_fill_s(self, traffic: TreeTraffic, chunk_bytes: int, link_gbs: float) -> float:
        """Filling and draining the tree: one chunk per level up and down its deepest path, each
        level one link's transfer of a chunk plus a step's latency, and the switches on the way."""
        if traffic.nodes <= 1:
            return 0.0
        switch_s = self.fabric.switch_latency_s if self.fabric else 0.0
        per_level = chunk_bytes / (link_gbs * 1e9) + self.hop_latency_s
        return 2 * (traffic.deepest_path_edges * per_level + traffic.deepest_path_switches * switch_s)

    def _link_gbs(self) -> float:
        """One switch-to-switch link, GB/s (the fabric's ports run at the NIC's line rate)."""
        return self.node.nic_gbs

    def _cross_zone_s_per_byte(self, cross_zone_gbs: float | None, per_node_bytes: float) -> float:
        if cross_zone_gbs is None:
            return 0.0
        if isinstance(cross_zone_gbs, bool) or not isinstance(cross_zone_gbs, (int, float)) \
                or not 0 < cross_zone_gbs < math.inf:
            raise ConfigError("cross_zone_gbs", f"must be a positive finite number, not {cross_zone_gbs!r}")
        # The cut between zones carries what one node boundary carries, once in each direction.
        return per_node_bytes / (cross_zone_gbs * 1e9)

    # -- NCCL --------------------------------------------------------------------------------------

    def nccl_ring(self, gpus: int, message_bytes: int, cross_zone_gbs: float | None = None) -> AllreduceResult:
        nodes = self._nodes(gpus)
        self._check_message(message_bytes)
        factor = 2 * (gpus - 1) / gpus
        candidates = {"intra-node": factor / self._intra_node_gbs() / 1e9}
        if nodes > 1:
            nic_gbs = self.node.compute_nics * self.node.gpu_nic_gbs
            candidates["GPU-NIC path"] = factor / nic_gbs / 1e9
            candidates["cross-zone links"] = self._cross_zone_s_per_byte(cross_zone_gbs, factor)
        bound, per_byte = max(candidates.items(), key=lambda kv: kv[1])
        steps = 2 * (gpus - 1)
        time = message_bytes * per_byte + steps * self.hop_latency_s
        return AllreduceResult("NCCL ring", gpus, message_bytes, time, bound, bound_gbs=1 / per_byte / 1e9)

    def nccl_tree(self, gpus: int, message_bytes: int, cross_zone_gbs: float | None = None,
                  zones: int = 1) -> AllreduceResult:
        nodes = self._nodes(gpus)
        self._check_message(message_bytes)
        if nodes == 1:
            return self.nccl_ring(gpus, message_bytes)
        traffic = self.traffic(nodes, zones)
        nic_path_gbs = self.node.compute_nics * self.node.gpu_nic_gbs * NCCL_TREE_EFFICIENCY
        link_gbs = self._link_gbs() * NCCL_TREE_EFFICIENCY
        intra_gbs = self._intra_node_gbs() * NCCL_TREE_EFFICIENCY
        # Listed first, so that where the two peer-to-peer paths tie the NIC's is named.
        candidates = {
            # An interior node's NIC carries 2 bytes per byte, through the GPU<->NIC path.
            "GPU-NIC path": traffic.nic_load / nic_path_gbs / 1e9,
            # The chain inside a node carries the whole message up (reduce) and down (broadcast) at
            # once, so each GPU's link sends 2 bytes per byte: one up the chain, one down it.
            "intra-node": 2 / intra_gbs / 1e9,
            "shared switch links": traffic.network_load / link_gbs / 1e9,
            "cross-zone links": self._cross_zone_s_per_byte(cross_zone_gbs, 1.0),
        }
        bound, per_byte = max(candidates.items(), key=lambda kv: kv[1])
        chain = self.node.gpus - 1
        chunk = min(self.nccl_chunk_bytes, message_bytes)  # a message smaller than a chunk is one chunk
        chain_fill = 2 * chain * (chunk / (intra_gbs * 1e9) + self.hop_latency_s)
        fill = self._tree_fill_s(traffic, chunk, min(nic_path_gbs, link_gbs)) + chain_fill
        # The fill is the first chunk's whole passage; the steady state moves the other chunks.
        time = (message_bytes - chunk) * per_byte + fill
        return AllreduceResult("NCCL double binary tree", gpus, message_bytes, time, bound, traffic, fill,
                               1 / per_byte / 1e9)

    def nccl(self, gpus: int, message_bytes: int, cross_zone_gbs: float | None = None,
             algorithm: str = "double binary tree", zones: int = 1) -> AllreduceResult:
        """NCCL with the algorithm the cluster runs (Fire-Flyer 2: double binary tree across nodes)."""
        if algorithm == "ring":
            return self.nccl_ring(gpus, message_bytes, cross_zone_gbs)
        if algorithm == "double binary tree":
            return self.nccl_tree(gpus, message_bytes, cross_zone_gbs, zones)
        raise ConfigError("network.collective_algorithm", f"must be ring or double binary tree, not {algorithm!r}")

    def _intra_node_gbs(self) -> float:
        """Per-GPU link bandwidth of the ring inside a node (each GPU sends and receives on it)."""
        if self.node.nvswitch:
            return self.node.nvlink_gbs / 2          # NVSwitch: per direction
        # PCIe peer-to-peer between GPUs goes through the root complex like GPU<->NIC traffic.
        p2p = self.node.gpu_nic_p2p_gbs or self.node.pcie_gpu_to_cpu_gbs
        return min(p2p, self.node.slowest_d2h_gbs)

    # -- HFReduce ----------------------------------------------------------------------------------

    def hfreduce(self, gpus: int, message_bytes: int, nvlink: bool = False,
                 cross_zone_gbs: float | None = None, gpus_per_node: int | None = None,
                 zones: int = 1) -> AllreduceResult:
        """``gpus_per_node``: how many of each node's GPUs take part (default: all of them); ``zones``:
        how many zones the job's nodes are spread over (they need a fabric with that many)."""
        node = self.node
        self._check_gpus(gpus)
        local_gpus = min(gpus, node.gpus) if gpus_per_node is None else gpus_per_node
        if isinstance(local_gpus, bool) or not isinstance(local_gpus, int) or not 0 < local_gpus <= node.gpus \
                or gpus % local_gpus:
            raise ConfigError("gpus_per_node", f"{local_gpus!r} GPUs per node cannot make {gpus} GPUs")
        nodes = max(1, gpus // local_gpus)
        self._check_fits(nodes)
        self._check_message(message_bytes)
        if nvlink and not node.has_nvlink:
            raise ConfigError("nvlink", f"node {node.name} has no NVLink")
        # With NVLink a bridged pair first reduces over the bridge and each copies half a buffer; a GPU
        # whose partner is not in the job (an odd count on a node) copies its whole buffer, and the
        # slowest GPU sets the copy rate.
        paired = local_gpus - local_gpus % 2 if nvlink else 0
        unpaired = local_gpus - paired
        share = 1.0 if unpaired else 0.5               # bytes the busiest GPU copies per message byte
        buffers = paired * 0.5 + unpaired              # host buffers the CPU sums
        d2h = share / node.slowest_d2h_gbs
        reduce = (buffers + 1) / node.memory_bw_gbs
        h2d = share / node.slowest_d2h_gbs
        memory_ops = host_memory_bytes_per_byte(buffers, nodes, ranks_in_host_memory=node.ranks_in_host_memory,
                                                nodes_share_memory=node.nodes_share_memory,
                                                socket_network=node.socket_network)
        candidates = {
            "intra-node copy and reduce": (host_rank_chain_s_per_byte(node, buffers, nodes)
                                           if node.ranks_in_host_memory else (d2h + reduce + h2d) / 1e9),
            "host memory bandwidth": memory_ops / node.memory_bw_gbs / 1e9,
        }
        traffic = self.traffic(nodes, zones)
        nic_gbs = node.compute_nics * node.nic_gbs
        if nodes > 1:
            candidates["NIC"] = traffic.nic_load / nic_gbs / 1e9
            candidates["shared switch links"] = traffic.network_load / self._link_gbs() / 1e9
            candidates["cross-zone links"] = self._cross_zone_s_per_byte(cross_zone_gbs, 1.0)
        bound, per_byte = max(candidates.items(), key=lambda kv: kv[1])
        # The first chunk is copied in and reduced before the tree starts; the last is copied out after.
        # A message smaller than a chunk is one chunk; the fill is the first chunk's whole passage and
        # the steady state moves the other chunks (counting it in both would count it twice).
        chunk = min(self.pipeline_chunk_bytes, message_bytes) if nodes > 1 else 0
        ends = chunk * (d2h + reduce + h2d) / 1e9
        fill = self._tree_fill_s(traffic, chunk, min(nic_gbs, self._link_gbs())) + ends
        time = (message_bytes - chunk) * per_byte + fill
        return AllreduceResult("HFReduce with NVLink" if nvlink else "HFReduce", gpus, message_bytes, time, bound,
                               traffic, fill, 1 / per_byte / 1e9)

    def hfreduce_bound_gbs(self) -> float:
        """The paper's host-memory bound: practical memory bandwidth over 24 bytes per byte."""
        return self.node.memory_bw_gbs / HOST_MEMORY_OPS_PER_BYTE

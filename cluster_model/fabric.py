"""A job's allreduce tree laid onto the fat-tree: which links its flows share, and how many switches it crosses.

:mod:`collectives` knows what each node sends per byte reduced; this module knows where the nodes sit
and how InfiniBand routes between them, which is what changes as a job grows past one leaf switch and
past one zone:

* **Placement.** The scheduler gives a job whole nodes, packed onto as few leaves as hold them and
  dealt evenly over those (compute leaves hold ``k/2`` nodes; the storage nodes' NICs are on leaves of
  their own): a 32-node job gets two leaves of 16, consecutive ranks side by side. A job spread over
  two zones keeps that layout and gives each zone a run of whole leaves (a one-leaf job is cut in
  half). ``scattered`` deals the nodes round-robin over every leaf of the zone instead, as a job gets
  them from a fragmented cluster.
* **Routing.** Fat-tree routing (OpenSM's ``ftree``, the default for these fabrics) is by destination:
  every flow to the node on leaf port ``p`` climbs to spine ``p`` and comes down from there. A spine's
  down-link to a leaf therefore carries only flows to one node, but a leaf's up-link to spine ``p``
  carries every flow from that leaf to *any* port-``p`` node elsewhere — two of them share it. Between
  zones, a flow to port ``p`` crosses on link ``p mod L`` of the ``L`` links that join the zones' spines.
* **Trees.** Both libraries allreduce across nodes over NCCL's double binary tree (tree A in-order over
  the node ranks, tree B mirrored or shifted by one), each tree carrying half of the bytes, every edge
  used in both directions (reduce up, broadcast down) at once once the pipeline is full. So every
  directed tree edge is a flow of half a byte per byte reduced, and a link carrying ``f`` of them moves
  ``f/2`` bytes per byte: an interior node's NIC carries four (2 bytes per byte), which is the figure
  without any sharing.

The result is a :class:`TreeTraffic`: the worst load on each class of link (bytes per byte reduced), the
tree depth, and the number of switches on the deepest path, from which :mod:`collectives` takes the
network's bound and the pipeline's fill time. It is pure arithmetic on the topology: no randomness and
no per-figure constant.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from cluster_model.config import ConfigError

__all__ = ["MAX_TREE_NODES", "SWITCH_LATENCY_S", "Fabric", "Location", "TreeTraffic", "double_binary_tree"]

#: A QM8700 (HDR InfiniBand) forwards port to port in about 130 ns (the vendor's figure for the
#: switch family; an assumption of this model, as the paper gives none).
SWITCH_LATENCY_S = 130e-9

_BYTES_PER_FLOW = 0.5  # each of the two trees carries half of the bytes, each edge once per direction
#: The most nodes a tree is laid out for: 65,536 nodes (half a million GPUs) is beyond any cluster of
#: this class, and keeps the per-edge walk under a second and a few hundred MB; larger is refused.
MAX_TREE_NODES = 1 << 16


def _check_nodes(nodes: object) -> int:
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes <= 0:
        raise ConfigError("nodes", f"must be a positive whole number, not {nodes!r}")
    if nodes > MAX_TREE_NODES:
        raise ConfigError("nodes", f"{nodes} nodes exceed the {MAX_TREE_NODES} a tree is laid out for")
    return nodes


@dataclass(frozen=True, order=True)
class Location:
    """Where one node of a job sits: zone, compute leaf within the zone, port on that leaf."""

    zone: int
    leaf: int
    port: int


def _binary_tree(count: int, rank: int) -> tuple[int | None, tuple[int, ...]]:
    """(parent, children) of ``rank`` in the in-order binary tree over ``count`` ranks (NCCL's ``btree``)."""
    bit = 1
    while bit < count and not bit & rank:
        bit <<= 1
    if rank == 0:
        return None, ((bit >> 1,) if count > 1 else ())
    parent = (rank ^ bit) | (bit << 1)
    if parent >= count:
        parent = rank ^ bit
    low = bit >> 1
    if low == 0:
        return parent, ()
    children = [rank - low]
    down = rank + low
    while down >= count and low:
        low >>= 1
        down = rank + low
    if low and down < count:
        children.append(down)
    return parent, tuple(children)


def double_binary_tree(count: int) -> tuple[list[int | None], list[int | None]]:
    """Parent of every rank in each of the two trees (None at a root), as NCCL builds them.

    Tree A is the in-order binary tree (root 0); tree B is A mirrored when ``count`` is even and A
    shifted by one rank when it is odd, so that a rank interior in one tree is a leaf in the other.
    """
    _check_nodes(count)
    tree_a = [_binary_tree(count, rank)[0] for rank in range(count)]
    tree_b: list[int | None] = []
    for rank in range(count):
        if count % 2:
            parent = _binary_tree(count, (rank - 1) % count)[0]
            tree_b.append(None if parent is None else (parent + 1) % count)
        else:
            parent = _binary_tree(count, count - 1 - rank)[0]
            tree_b.append(None if parent is None else count - 1 - parent)
    return tree_a, tree_b


def _depth(parents: list[int | None], rank: int) -> int:
    depth = 0
    while (parent := parents[rank]) is not None:
        rank = parent
        depth += 1
        if depth > len(parents):  # a cycle would be a bug in the construction, not a deep tree
            raise AssertionError("tree has a cycle")
    return depth


@dataclass(frozen=True)
class TreeTraffic:
    """A job's double binary tree on the fabric. Loads are bytes per byte reduced, per direction."""

    nodes: int
    leaves: int                     # compute leaves the job occupies
    zones: int                      # zones it occupies
    depth: int                      # edges on the longest root-to-leaf path of either tree
    nic_load: float                 # the busiest node's NIC (2.0 for any interior node)
    uplink_load: float              # the busiest leaf-to-spine link (0 when the job fits one leaf)
    cross_zone_load: float          # the busiest link between zones (0 inside one zone)
    deepest_path_switches: int      # switches crossed along that longest path
    deepest_path_edges: int

    @property
    def network_load(self) -> float:
        """The busiest switch-to-switch link's load (what sharing adds over a NIC's own)."""
        return max(self.uplink_load, self.cross_zone_load)


@dataclass(frozen=True)
class Fabric:
    """Compute leaves of ``nodes_per_leaf`` nodes, ``leaves_per_zone`` of them in each of ``zones`` zones."""

    nodes_per_leaf: int
    leaves_per_zone: int
    zones: int = 1
    cross_zone_links: int = 0
    switch_latency_s: float = SWITCH_LATENCY_S

    def __post_init__(self) -> None:
        for name in ("nodes_per_leaf", "leaves_per_zone", "zones"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"fabric.{name}", f"must be a positive whole number, not {value!r}")
        if isinstance(self.cross_zone_links, bool) or not isinstance(self.cross_zone_links, int) \
                or self.cross_zone_links < 0:
            raise ConfigError("fabric.cross_zone_links", f"must be a whole number >= 0, not {self.cross_zone_links!r}")
        if self.zones > 1 and self.cross_zone_links == 0:
            raise ConfigError("fabric.cross_zone_links", "zones with no links between them cannot share a job")
        if isinstance(self.switch_latency_s, bool) or not isinstance(self.switch_latency_s, (int, float)) \
                or not 0 <= self.switch_latency_s < math.inf:
            raise ConfigError("fabric.switch_latency_s", f"must be >= 0, not {self.switch_latency_s}")

    @classmethod
    def two_zone(cls, radix: int, compute_nodes: int, compute_nics_per_node: int, zones: int,
                 cross_zone_links: int) -> Fabric:
        """Fire-Flyer 2's zones: leaves of ``k/2`` compute NICs, as many as a zone's share of nodes needs."""
        if compute_nics_per_node != 1:
            raise ConfigError("node.nics", "the tree placement models one compute NIC per node")
        if isinstance(radix, bool) or not isinstance(radix, int) or radix < 4 or radix % 2:
            raise ConfigError("network.switch_ports", f"a fat-tree needs an even switch radix of at least 4, "
                                                      f"not {radix!r}")
        for value, name in ((compute_nodes, "network.compute_nodes"), (zones, "network.zones")):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(name, f"must be a positive whole number, not {value!r}")
        per_leaf = radix // 2
        per_zone = math.ceil(compute_nodes / zones)
        return cls(per_leaf, math.ceil(per_zone / per_leaf), zones, cross_zone_links)

    def place(self, nodes: int, zones: int = 1, placement: str = "packed") -> list[Location]:
        """Where each of a job's ``nodes`` nodes sits.

        ``packed``: on as few leaves as hold them, dealt evenly over those; ``scattered``: round-robin
        over every leaf of the zone (what a job gets from a fragmented cluster: neighbouring ranks on
        different leaves). A job over several ``zones`` keeps that layout and gives each zone a run of
        whole leaves (a leaf is the unit a zone hands out); a one-leaf job is cut in halves instead.
        Because the leaves and ports stay those of the one-zone layout, crossing zones can only add
        switches and shared links to a job, never take them away.
        """
        if placement not in ("packed", "scattered"):
            raise ConfigError("placement", f"must be packed or scattered, not {placement!r}")
        _check_nodes(nodes)
        if isinstance(zones, bool) or not isinstance(zones, int) or not 1 <= zones <= self.zones:
            raise ConfigError("zones", f"a job can span 1 to {self.zones} zone(s), not {zones!r}")
        if zones > nodes:
            raise ConfigError("zones", f"{nodes} node(s) cannot span {zones} zones")
        capacity = self.nodes_per_leaf * self.leaves_per_zone
        if nodes > capacity * zones:
            raise ConfigError("nodes", f"{nodes} nodes do not fit {zones} zone(s) of {capacity}")
        if placement == "packed":
            used = math.ceil(nodes / self.nodes_per_leaf)
            per_leaf = math.ceil(nodes / used)
            layout = [divmod(index, per_leaf) for index in range(nodes)]
        else:
            spread = self.leaves_per_zone * math.ceil(nodes / capacity)
            used = min(spread, nodes)
            layout = [(index % spread, index // spread) for index in range(nodes)]
        placed = []
        for index, (leaf, port) in enumerate(layout):
            if used >= zones:
                zone = leaf * zones // used
                first = -(-zone * used // zones)          # the zone's first leaf: ceil(zone * used / zones)
                placed.append(Location(zone, leaf - first, port))
            else:
                placed.append(Location(index * zones // nodes, leaf, port))
        if max(p.leaf for p in placed) >= self.leaves_per_zone:
            raise ConfigError("nodes", f"{nodes} nodes need more than the {self.leaves_per_zone} leaves of a zone")
        return placed

    def _route(self, src: Location, dst: Location) -> tuple[list[tuple[object, ...]], int]:
        """The switch-to-switch links a flow from ``src`` to ``dst`` uses, and the switches it crosses."""
        if (src.zone, src.leaf) == (dst.zone, dst.leaf):
            return [], 1
        spine = dst.port  # destination-based: port p's traffic comes down from spine p
        links: list[tuple[object, ...]] = [("up", src.zone, src.leaf, spine)]
        if src.zone == dst.zone:
            return links, 3
        links.append(("cross", src.zone, dst.zone, spine % self.cross_zone_links))
        return links, 4

    def tree_traffic(self, nodes: int, zones: int = 1, placement: str = "packed") -> TreeTraffic:
        """Loads and depth of a double binary tree over a job of ``nodes`` nodes on ``zones`` zones."""
        placed = self.place(nodes, zones, placement)
        nic: Counter[int] = Counter()
        links: Counter[tuple[object, ...]] = Counter()
        edge_switches: dict[tuple[int, int], int] = {}
        trees = double_binary_tree(nodes)
        for parents in trees:
            for child, parent in enumerate(parents):
                if parent is None:
                    continue
                for src, dst in ((child, parent), (parent, child)):  # reduce up, broadcast down
                    nic[src] += 1
                    route, switches = self._route(placed[src], placed[dst])
                    edge_switches[(src, dst)] = switches
                    links.update(route)
        uplink = max((count for key, count in links.items() if key[0] == "up"), default=0)
        cross = max((count for key, count in links.items() if key[0] == "cross"), default=0)
        depth, path_switches = 0, 0
        for parents in trees:
            for rank in range(nodes):
                edges = _depth(parents, rank)
                switches, node = 0, rank
                while (parent := parents[node]) is not None:
                    switches += edge_switches[(node, parent)]
                    node = parent
                if (edges, switches) > (depth, path_switches):
                    depth, path_switches = edges, switches
        return TreeTraffic(nodes, len({(p.zone, p.leaf) for p in placed}), len({p.zone for p in placed}), depth,
                           _BYTES_PER_FLOW * max(nic.values(), default=0), _BYTES_PER_FLOW * uplink,
                           _BYTES_PER_FLOW * cross, path_switches, depth)

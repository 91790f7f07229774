"""Fat-tree networks built from switch radix: counts, bandwidth and where nodes go.

A two-layer fat-tree of radix-``k`` switches gives each leaf ``k/2`` ports down and ``k/2`` up,
one link to each of ``k/2`` spines; a spine's ``k`` ports reach at most ``k`` leaves, so one tree
serves ``k²/2`` endpoints with ``k + k/2`` switches, non-blocking (Fire-Flyer 2's zone: 40 leaves,
20 spines, 800 ports with 40-port QM8700 switches). More endpoints need a third layer: pods of
``k/2`` leaves and ``k/2`` aggregation switches (``k²/4`` endpoints each) joined by ``k²/4`` core
switches — ``k³/4`` endpoints and ``5k²/4`` switches when full. Fire-Flyer 2 instead builds two
two-layer zones and dual-homes its storage nodes (one NIC in each zone), so every compute node
reaches storage without a third layer; jobs stay inside one zone except at most one, which
crosses over the few links between the zones. The next generation stacks ``planes`` independent
two-layer trees of 128-port 400 Gbps switches, each node putting one NIC in every plane.

A zone asked to hold more endpoints than its non-blocking size takes the extra ports from the
leaves' uplinks, and reports the oversubscription that results rather than refusing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cluster_model.config import ConfigError

__all__ = ["Topology", "multi_plane", "spread_placement", "three_layer_fat_tree", "two_layer_fat_tree", "two_zone"]


@dataclass(frozen=True)
class Topology:
    """Switch and link counts of one network. Bandwidths in Gbit/s."""

    name: str
    switch_radix: int
    port_gbps: float
    layers: int
    planes: int
    zones: int
    leaf_switches: int
    spine_switches: int
    core_switches: int
    endpoints: int                 # endpoint ports in use
    endpoint_capacity: int         # endpoint ports at the non-blocking design point
    switch_links: int              # switch-to-switch cables
    cross_zone_links: int
    oversubscription: float        # leaf down ports over up ports (1.0: non-blocking)
    notes: tuple[str, ...] = field(default=())

    @property
    def switches(self) -> int:
        return self.leaf_switches + self.spine_switches + self.core_switches

    @property
    def links(self) -> int:
        """Every cable: endpoint to leaf, and switch to switch (cross-zone links included)."""
        return self.endpoints + self.switch_links

    @property
    def zone_bisection_gbps(self) -> float:
        """Bandwidth across the worst cut in half of one zone's endpoints, all planes together."""
        per_tree = self.endpoints / self.zones / self.planes / 2 * self.port_gbps / self.oversubscription
        return per_tree * self.planes

    @property
    def bisection_gbps(self) -> float:
        """Bandwidth across the worst cut of the whole network into halves: with several zones,
        the cut between them (the cross-zone links), which is why jobs stay inside a zone."""
        if self.zones > 1:
            return min(self.cross_zone_gbps, self.zone_bisection_gbps)
        return self.zone_bisection_gbps

    @property
    def cross_zone_gbps(self) -> float:
        return self.cross_zone_links * self.port_gbps


def _check_radix(radix: int, field_name: str = "network.switch_ports") -> None:
    if isinstance(radix, bool) or not isinstance(radix, int) or radix < 4 or radix % 2:
        raise ConfigError(field_name, f"a fat-tree needs an even switch radix of at least 4, not {radix!r}")


def _check_port(port_gbps: float, field_name: str = "network.port_gbps") -> None:
    if isinstance(port_gbps, bool) or not isinstance(port_gbps, (int, float)) or port_gbps <= 0:
        raise ConfigError(field_name, f"port bandwidth must be positive, not {port_gbps!r}")


def _tree_counts(radix: int, endpoints: int) -> tuple[int, int, int, float]:
    """(leaves, spines, switch links, oversubscription) of one two-layer tree holding ``endpoints``."""
    half = radix // 2
    capacity = radix * half
    if endpoints <= capacity:
        leaves = max(1, math.ceil(endpoints / half))
        # Each leaf sends its k/2 uplinks to the spines; a spine takes k of them.
        spines = max(1, math.ceil(leaves * half / radix)) if leaves > 1 else 0
        return leaves, spines, leaves * half if spines else 0, 1.0
    # Over the design point: every leaf exists, and some trade an uplink for an endpoint port.
    base, extra = divmod(endpoints, radix)
    busiest = base + (1 if extra else 0)
    if busiest >= radix:
        raise ConfigError("endpoints", f"{endpoints} endpoints do not fit a two-layer tree of radix {radix}")
    uplinks = extra * (radix - base - 1) + (radix - extra) * (radix - base)
    return radix, half, uplinks, busiest / (radix - busiest)


def two_layer_fat_tree(radix: int, port_gbps: float, endpoints: int | None = None,
                       name: str = "two-layer fat-tree") -> Topology:
    """One two-layer tree holding ``endpoints`` ports (default: its non-blocking size, ``k²/2``)."""
    _check_radix(radix)
    _check_port(port_gbps)
    capacity = radix * radix // 2
    endpoints = capacity if endpoints is None else endpoints
    if endpoints <= 0:
        raise ConfigError("endpoints", f"must be positive, not {endpoints}")
    leaves, spines, links, over = _tree_counts(radix, endpoints)
    return Topology(name, radix, port_gbps, 2, 1, 1, leaves, spines, 0, endpoints, capacity, links, 0, over)


def three_layer_fat_tree(radix: int, port_gbps: float, endpoints: int | None = None,
                         name: str = "three-layer fat-tree") -> Topology:
    """Pods of ``k/2`` leaves and ``k/2`` aggregation switches, joined by core switches.

    Partial trees keep whole pods (a pod is the unit that is cabled) and size the core to the
    pods' uplinks; leaves are only as many as the endpoints need.
    """
    _check_radix(radix)
    _check_port(port_gbps)
    half = radix // 2
    capacity = radix * half * half
    endpoints = capacity if endpoints is None else endpoints
    if endpoints <= 0:
        raise ConfigError("endpoints", f"must be positive, not {endpoints}")
    if endpoints > capacity:
        raise ConfigError("endpoints", f"{endpoints} endpoints exceed a three-layer tree of radix {radix} "
                                       f"({capacity})")
    leaves = math.ceil(endpoints / half)
    pods = math.ceil(leaves / half)
    aggregation = pods * half
    core = math.ceil(aggregation * half / radix)
    links = leaves * half + aggregation * half
    return Topology(name, radix, port_gbps, 3, 1, 1, leaves, aggregation, core, endpoints, capacity, links, 0, 1.0)


def two_zone(radix: int, port_gbps: float, compute_nodes: int, compute_nics_per_node: int, storage_nodes: int,
             storage_nics_per_node: int, cross_zone_links: int, zones: int = 2) -> Topology:
    """Fire-Flyer 2's network: ``zones`` two-layer trees; compute nodes split evenly between them,
    storage nodes dual-homed (``storage_nics_per_node`` NICs spread over the zones)."""
    _check_radix(radix)
    _check_port(port_gbps)
    for value, name in ((compute_nodes, "network.compute_nodes"), (zones, "network.zones"),
                        (compute_nics_per_node, "node.nics")):
        if value <= 0:
            raise ConfigError(name, f"must be positive, not {value}")
    if storage_nodes < 0:
        raise ConfigError("network.storage_nodes", f"must not be negative, not {storage_nodes}")
    if cross_zone_links < 0:
        raise ConfigError("network.cross_zone_links", f"must not be negative, not {cross_zone_links}")
    if storage_nodes and storage_nics_per_node % zones:
        raise ConfigError("network.storage_nics_per_node",
                          f"{storage_nics_per_node} NICs cannot be spread evenly over {zones} zones")
    per_zone_compute = math.ceil(compute_nodes / zones) * compute_nics_per_node
    per_zone = per_zone_compute + storage_nodes * (storage_nics_per_node // zones)
    leaves, spines, links, over = _tree_counts(radix, per_zone)
    notes: list[str] = []
    if over > 1.0:
        notes.append(f"each zone needs {per_zone} endpoint ports of {radix * radix // 2}: leaves give up uplinks, "
                     f"oversubscription {over:.3f}")
    total_endpoints = compute_nodes * compute_nics_per_node + storage_nodes * storage_nics_per_node
    return Topology("two-zone fat-tree", radix, port_gbps, 2, 1, zones, leaves * zones, spines * zones, 0,
                    total_endpoints, radix * radix // 2 * zones, links * zones + cross_zone_links, cross_zone_links,
                    over, tuple(notes))


def multi_plane(radix: int, port_gbps: float, planes: int, endpoints_per_plane: int | None = None) -> Topology:
    """``planes`` independent two-layer trees; a node has one NIC in each."""
    if isinstance(planes, bool) or not isinstance(planes, int) or planes <= 0:
        raise ConfigError("network.planes", f"must be a positive whole number, not {planes!r}")
    plane = two_layer_fat_tree(radix, port_gbps, endpoints_per_plane)
    return Topology(f"{planes}-plane two-layer fat-tree", radix, port_gbps, 2, planes, 1, plane.leaf_switches * planes,
                    plane.spine_switches * planes, 0, plane.endpoints * planes, plane.endpoint_capacity * planes,
                    plane.switch_links * planes, 0, plane.oversubscription)


def spread_placement(nodes: int, leaves: int) -> list[int]:
    """Leaf of each node, dealt round-robin so that consecutive nodes land on different leaves.

    A job's nodes then spread over many leaves: its traffic goes up to the spines (which the
    fat-tree provisions) instead of piling onto one leaf's uplinks.
    """
    if leaves <= 0:
        raise ConfigError("leaves", f"must be positive, not {leaves}")
    return [node % leaves for node in range(nodes)]

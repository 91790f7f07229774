"""Fat-tree networks built from switch radix: counts, bandwidth and where nodes go.

A two-layer fat-tree of radix-``k`` switches gives each leaf ``k/2`` ports down and ``k/2`` up,
one link to each of ``k/2`` spines; a spine's ``k`` ports reach at most ``k`` leaves, so one tree
serves ``k²/2`` endpoints with ``k + k/2`` switches, non-blocking (Fire-Flyer 2's zone: 40 leaves,
20 spines, 800 ports with 40-port QM8700 switches). More endpoints need a third layer: pods of
``k/2`` leaves and ``k/2`` aggregation switches (``k²/4`` endpoints each) joined by ``k²/4`` core
switches — ``k³/4`` endpoints and ``5k²/4`` switches when full. A partial tree is sized as a
vendor quotes one for exactly ``n`` access points: ``ceil(n/(k/2))`` leaves, aggregation switches
per pod to take its leaves' uplinks, and core switches to take theirs — never the whole radix-``k``
tree. Fire-Flyer 2 instead builds two two-layer zones and dual-homes its storage nodes (one NIC in
each zone), so every compute node
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

__all__ = [
    "MAX_ACCESS_POINTS",
    "PodSizing",
    "ThreeLayerSizing",
    "Topology",
    "multi_plane",
    "spread_placement",
    "three_layer_fat_tree",
    "three_layer_sizing",
    "two_layer_fat_tree",
    "two_zone",
]


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


@dataclass(frozen=True)
class PodSizing:
    """One pod of a three-layer tree: its leaves (endpoints on each) and its aggregation switches.

    Every leaf cables all ``k/2`` uplinks (a leaf is bought and cabled whole, so adding access points
    later needs no recabling); the pod's aggregation switches take those uplinks on their ``k/2``
    down ports, with parallel links where the pod has fewer than ``k/2`` leaves, and send as many
    links up to the core as they take from below.
    """

    leaf_endpoints: tuple[int, ...]
    leaf_uplinks: int              # per leaf
    aggregation: int
    aggregation_uplinks: int       # the pod's links to the core

    @property
    def endpoints(self) -> int:
        return sum(self.leaf_endpoints)

    @property
    def leaves(self) -> int:
        return len(self.leaf_endpoints)


@dataclass(frozen=True)
class ThreeLayerSizing:
    """A three-layer fat-tree sized for exactly ``endpoints`` access points: its pods and its core."""

    radix: int
    endpoints: int
    pods: tuple[PodSizing, ...]
    core: int

    @property
    def leaves(self) -> int:
        return sum(pod.leaves for pod in self.pods)

    @property
    def aggregation(self) -> int:
        return sum(pod.aggregation for pod in self.pods)

    @property
    def switches(self) -> int:
        return self.leaves + self.aggregation + self.core

    @property
    def leaf_aggregation_links(self) -> int:
        return sum(pod.leaves * pod.leaf_uplinks for pod in self.pods)

    @property
    def aggregation_core_links(self) -> int:
        return sum(pod.aggregation_uplinks for pod in self.pods)

    def ports_used_max(self) -> dict[str, int]:
        """The busiest switch's used ports in each layer (links spread as evenly as ports allow)."""
        leaf = max(e + pod.leaf_uplinks for pod in self.pods for e in pod.leaf_endpoints)
        aggregation = max(-(-pod.leaves * pod.leaf_uplinks // pod.aggregation)
                          + -(-pod.aggregation_uplinks // pod.aggregation) for pod in self.pods)
        core = -(-self.aggregation_core_links // self.core) if self.core else 0
        return {"leaf": leaf, "aggregation": aggregation, "core": core}

    def up_ratio(self) -> float:
        """The least, over leaves and pods, of links up over endpoints below: at least 1 means every
        access point can send at its line rate to the core at once (full bisection)."""
        ratios = [pod.leaf_uplinks / e for pod in self.pods for e in pod.leaf_endpoints if e]
        ratios += [pod.aggregation_uplinks / pod.endpoints for pod in self.pods if pod.endpoints]
        return min(ratios)

    def bisection_ports(self) -> float:
        """Ports' worth of bandwidth across the worst cut of the access points into halves: with every
        access point able to reach the core at line rate, each of one half's ``n/2`` ports can."""
        return self.endpoints / 2 * min(1.0, self.up_ratio())

    def violations(self) -> list[str]:
        """What makes this sizing unbuildable or blocking (empty when it is sound)."""
        found = [f"{layer} switch uses {used} ports of {self.radix}"
                 for layer, used in self.ports_used_max().items() if used > self.radix]
        if self.up_ratio() < 1.0:
            found.append(f"links up over endpoints below fall to {self.up_ratio():.3f}: not full bisection")
        if self.core * self.radix < self.aggregation_core_links:
            found.append(f"{self.core} core switches cannot take {self.aggregation_core_links} uplinks")
        return found


#: The most access points a three-layer tree is sized for, leaf by leaf: a billion (a hundred times any
#: cluster of the period) keeps the sizing under a few seconds; more is refused, not walked.
MAX_ACCESS_POINTS = 10**9


def three_layer_sizing(radix: int, endpoints: int) -> ThreeLayerSizing:
    """A three-layer tree for exactly ``endpoints`` access points, sized as a vendor quotes one.

    Leaves ``ceil(n / (k/2))``, each ``k/2`` down and ``k/2`` up; pods of up to ``k/2`` leaves, each
    pod with as many aggregation switches as take its leaves' uplinks (a partial last pod needs
    fewer; parallel links between a leaf and an aggregation switch are allowed); core switches
    ``ceil(aggregation uplinks / k)``. Never a full radix-``k`` tree: a pod or a core switch is
    bought only when ports need it. Full bisection holds, since every layer sends up what it takes
    from below.
    """
    _check_radix(radix)
    half = radix // 2
    capacity = radix * half * half
    if isinstance(endpoints, bool) or not isinstance(endpoints, int):
        raise ConfigError("endpoints", f"must be a whole number, not {endpoints!r}")
    if endpoints <= 0:
        raise ConfigError("endpoints", f"must be positive, not {endpoints}")
    if endpoints > capacity:
        raise ConfigError("endpoints", f"{endpoints} endpoints exceed a three-layer tree of radix {radix} "
                                       f"({capacity})")
    if endpoints > MAX_ACCESS_POINTS:
        raise ConfigError("endpoints", f"{endpoints} endpoints exceed the {MAX_ACCESS_POINTS:,} a tree is sized for")
    full_leaves, last_leaf = divmod(endpoints, half)
    leaf_endpoints = [half] * full_leaves + ([last_leaf] if last_leaf else [])
    pods: list[PodSizing] = []
    for first in range(0, len(leaf_endpoints), half):
        leaves = tuple(leaf_endpoints[first:first + half])
        uplinks = len(leaves) * half
        aggregation = -(-uplinks // half)       # each takes k/2 leaf uplinks on its down ports
        pods.append(PodSizing(leaves, half, aggregation, uplinks))
    core = -(-sum(pod.aggregation_uplinks for pod in pods) // radix)
    sizing = ThreeLayerSizing(radix, endpoints, tuple(pods), core)
    problems = sizing.violations()
    if problems:  # an invariant of the construction, kept on under python -O
        raise AssertionError(f"three-layer sizing for {endpoints} endpoints of radix {radix}: {problems}")
    return sizing


def three_layer_fat_tree(radix: int, port_gbps: float, endpoints: int | None = None,
                         name: str = "three-layer fat-tree") -> Topology:
    """A non-blocking three-layer tree for ``endpoints`` access points (default: the full ``k³/4``).

    Sized by :func:`three_layer_sizing` (pods, aggregation and core only as ports need them), not
    as a whole radix-``k`` tree with empty pods.
    """
    _check_radix(radix)
    _check_port(port_gbps)
    half = radix // 2
    capacity = radix * half * half
    sizing = three_layer_sizing(radix, capacity if endpoints is None else endpoints)
    over = 1.0 / min(1.0, sizing.up_ratio())
    return Topology(name, radix, port_gbps, 3, 1, 1, sizing.leaves, sizing.aggregation, sizing.core,
                    sizing.endpoints, capacity, sizing.leaf_aggregation_links + sizing.aggregation_core_links, 0,
                    over)


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

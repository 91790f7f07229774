"""The double binary tree that joins the node leaders (pure: no I/O, no clock, no randomness).

HFReduce reduces a node's ranks in shared memory and then allreduces the per-node partial sums across
nodes. A single binary tree leaves half the nodes as leaves whose uplink idles while the interior
nodes both receive and send; the *double* binary tree (the construction NCCL uses, which the paper's
inter-node stage follows) runs two trees at once, each carrying half of the chunks, built so that a
node that is interior in one tree is a leaf in the other. Every link then carries about the same
traffic in both directions and the pipeline's bandwidth is about that of one link, whatever N is.

Tree A is the in-order binary tree over node indices (node 0 is its root's only parent-less node,
with one child); tree B is A mirrored (N even) or shifted by one (N odd).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TreePosition", "binary_tree", "double_binary_tree", "tree_for_chunk"]


@dataclass(frozen=True, slots=True)
class TreePosition:
    """One node's place in one tree: its parent (None at the root) and its children, in order."""

    parent: int | None
    children: tuple[int, ...]

    @property
    def is_root(self) -> bool:
        return self.parent is None


def binary_tree(node_count: int, node: int) -> TreePosition:
    """Node ``node``'s position in the in-order binary tree over ``node_count`` nodes.

    The lowest set bit of a node's index gives its height: odd nodes are leaves, node 4 has children
    2 and 6, and so on; node 0 is the root with the single child ``2**k`` (the largest power of two
    below ``node_count``). Children are listed lower index first: that order is also the fixed order
    in which their partial sums are added, which makes results independent of arrival times.
    """
    if node_count < 1:
        raise ValueError(f"a tree needs at least one node, not {node_count}")
    if not 0 <= node < node_count:
        raise ValueError(f"node {node} is outside 0..{node_count - 1}")
    bit = 1
    while bit < node_count and not bit & node:
        bit <<= 1
    if node == 0:
        return TreePosition(None, (bit >> 1,) if node_count > 1 else ())
    parent = (node ^ bit) | (bit << 1)
    if parent >= node_count:
        parent = node ^ bit
    low_bit = bit >> 1
    children: list[int] = []
    if low_bit:
        children.append(node - low_bit)
        while low_bit and node + low_bit >= node_count:
            low_bit >>= 1
        if low_bit:
            children.append(node + low_bit)
    return TreePosition(parent, tuple(children))


def double_binary_tree(node_count: int, node: int) -> tuple[TreePosition, TreePosition]:
    """Node ``node``'s positions in trees A and B of the double binary tree."""
    first = binary_tree(node_count, node)
    if node_count % 2:
        # Shift by one: tree B is tree A over the indices rotated by one.
        shifted = binary_tree(node_count, (node - 1) % node_count)
        parent = None if shifted.parent is None else (shifted.parent + 1) % node_count
        children = tuple(sorted((child + 1) % node_count for child in shifted.children))
    else:
        # Mirror: tree B is tree A over the indices read backwards.
        mirrored = binary_tree(node_count, node_count - 1 - node)
        parent = None if mirrored.parent is None else node_count - 1 - mirrored.parent
        children = tuple(sorted(node_count - 1 - child for child in mirrored.children))
    return first, TreePosition(parent, children)


def tree_for_chunk(global_chunk: int) -> int:
    """Which tree (0 = A, 1 = B) carries a chunk: they alternate, so each carries half the bytes."""
    return global_chunk % 2

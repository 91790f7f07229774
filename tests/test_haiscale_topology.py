"""The DP x PP layout: every rank has one place, groups partition the job, and the staggered
placement puts a node's ranks into different data-parallel groups as described."""

from __future__ import annotations

import pytest

from haiscale.topology import ParallelLayout


@pytest.mark.parametrize("world,pipeline", [(1, 1), (4, 1), (4, 2), (4, 4), (8, 2), (16, 4), (12, 3)])
@pytest.mark.parametrize("placement", ["contiguous", "staggered"])
def test_groups_partition_the_job_and_coordinates_invert(world: int, pipeline: int, placement: str) -> None:
    layout = ParallelLayout(world, pipeline, placement)  # type: ignore[arg-type]
    seen = sorted(rank for group in layout.dp_groups() for rank in group)
    assert seen == list(range(world))
    assert sorted(rank for pipe in layout.pipelines() for rank in pipe) == list(range(world))
    for rank in range(world):
        stage, dp_rank = layout.coordinates(rank)
        assert layout.rank_of(stage, dp_rank) == rank
        assert layout.dp_group(stage)[dp_rank] == rank
        assert layout.pipeline(dp_rank)[stage] == rank
        previous, following = layout.previous_rank(rank), layout.next_rank(rank)
        assert (previous is None) == (stage == 0) and (following is None) == (stage == pipeline - 1)
        if following is not None:
            assert layout.coordinates(following) == (stage + 1, dp_rank)


def test_contiguous_and_staggered_assign_ranks_as_documented() -> None:
    # 8 ranks, 4 per node, 2 stages.
    contiguous = ParallelLayout(8, 2, "contiguous")
    assert contiguous.dp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert contiguous.pipelines() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    staggered = ParallelLayout(8, 2, "staggered")
    assert staggered.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert staggered.pipelines() == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("ranks_per_node,pipeline", [(2, 2), (4, 4), (2, 4), (8, 8), (4, 8)])
def test_staggered_puts_a_nodes_ranks_in_different_dp_groups(ranks_per_node: int, pipeline: int) -> None:
    """The paper's property: with at most as many ranks per node as stages, no two ranks of a node
    share a data-parallel group, and every pipeline send between a node's ranks' neighbours pairs
    them with different ranks; the contiguous layout puts a node's ranks in one group."""
    world = 4 * max(ranks_per_node, pipeline)
    for placement, distinct in (("staggered", True), ("contiguous", False)):
        layout = ParallelLayout(world, pipeline, placement)  # type: ignore[arg-type]
        for node in range(world // ranks_per_node):
            ranks = range(node * ranks_per_node, (node + 1) * ranks_per_node)
            stages = [layout.stage_of(rank) for rank in ranks]
            assert (len(set(stages)) == len(stages)) is distinct, (placement, node, stages)
            if distinct and ranks_per_node == pipeline:
                # A node holds one whole pipeline: activations never leave it.
                assert all(layout.next_rank(rank) in (None, *ranks) for rank in ranks)


@pytest.mark.parametrize("args,message", [
    ((0, 1, "contiguous"), "world_size must be at least 1"),
    ((4, 0, "contiguous"), "pipeline_size must be at least 1"),
    ((6, 4, "contiguous"), "not a multiple"),
    ((4, 2, "diagonal"), "placement must be one of"),
])
def test_bad_layouts_are_refused(args: tuple[int, int, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelLayout(*args)  # type: ignore[arg-type]
    layout = ParallelLayout(4, 2)
    for bad in (lambda: layout.coordinates(4), lambda: layout.rank_of(2, 0), lambda: layout.rank_of(0, -1)):
        with pytest.raises(ValueError, match="outside"):
            bad()

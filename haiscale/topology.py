"""Where each rank sits in a data-parallel x pipeline-parallel job: pure arithmetic, no torch.

A job of ``world_size`` ranks runs ``pipeline_size`` stages; each stage is replicated
``data_size = world_size / pipeline_size`` times. Ranks that hold the same stage form a **data-parallel
group** (they allreduce that stage's gradients); ranks that hold the stages of one replica form a
**pipeline** (activations flow along it). Launchers number ranks node by node (``local_rank`` within
a node), so how stages are mapped onto rank numbers decides which traffic shares a node's NIC:

``"contiguous"`` (the usual layout, Megatron's): ``rank = stage * data_size + dp_rank``. A node's
ranks hold the *same* stage: they are in one data-parallel group, and when their pipeline sends
leave the node they all leave through its one NIC at the same moment.

``"staggered"`` (the Fire-Flyer paper's HaiScale placement, §VII-A): ``rank = dp_rank * pipeline_size
+ stage``. Consecutive ranks — a node's ranks — hold *different* stages, so they belong to different
data-parallel groups: a node with as many ranks as stages holds a whole pipeline (its activations
never touch the NIC), and with fewer ranks its sends go to different neighbours at different points
of the schedule instead of meeting on the NIC together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["PLACEMENTS", "ParallelLayout", "Placement"]

Placement = Literal["contiguous", "staggered"]
PLACEMENTS: tuple[Placement, ...] = ("contiguous", "staggered")


@dataclass(frozen=True)
class ParallelLayout:
    """The DP x PP grid of a job and the rank numbering ``placement`` gives it."""

    world_size: int
    pipeline_size: int = 1
    placement: Placement = "contiguous"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, not {self.world_size}")
        if self.pipeline_size < 1:
            raise ValueError(f"pipeline_size must be at least 1, not {self.pipeline_size}")
        if self.world_size % self.pipeline_size:
            raise ValueError(f"world_size {self.world_size} is not a multiple of pipeline_size {self.pipeline_size}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, not {self.placement!r}")

    @property
    def data_size(self) -> int:
        """How many replicas of each stage (the size of every data-parallel group)."""
        return self.world_size // self.pipeline_size

    def rank_of(self, stage: int, dp_rank: int) -> int:
        """The global rank that holds ``stage`` of replica ``dp_rank``."""
        if not 0 <= stage < self.pipeline_size:
            raise ValueError(f"stage {stage} is outside 0..{self.pipeline_size - 1}")
        if not 0 <= dp_rank < self.data_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{self.data_size - 1}")
        if self.placement == "contiguous":
            return stage * self.data_size + dp_rank
        return dp_rank * self.pipeline_size + stage

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(stage, dp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        if self.placement == "contiguous":
            return divmod(rank, self.data_size)
        dp_rank, stage = divmod(rank, self.pipeline_size)
        return stage, dp_rank

    def stage_of(self, rank: int) -> int:
        return self.coordinates(rank)[0]

    def dp_rank_of(self, rank: int) -> int:
        return self.coordinates(rank)[1]

    def dp_group(self, stage: int) -> list[int]:
        """The global ranks holding ``stage``, in data-parallel rank order."""
        return [self.rank_of(stage, dp) for dp in range(self.data_size)]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group, stage by stage (the order every rank creates them in)."""
        return [self.dp_group(stage) for stage in range(self.pipeline_size)]

    def pipeline(self, dp_rank: int) -> list[int]:
        """The global ranks of replica ``dp_rank``'s stages, first stage first."""
        return [self.rank_of(stage, dp_rank) for stage in range(self.pipeline_size)]

    def pipelines(self) -> list[list[int]]:
        return [self.pipeline(dp) for dp in range(self.data_size)]

    def previous_rank(self, rank: int) -> int | None:
        """The rank this one receives activations from (``None`` on the first stage)."""
        stage, dp_rank = self.coordinates(rank)
        return self.rank_of(stage - 1, dp_rank) if stage > 0 else None

    def next_rank(self, rank: int) -> int | None:
        """The rank this one sends activations to (``None`` on the last stage)."""
        stage, dp_rank = self.coordinates(rank)
        return self.rank_of(stage + 1, dp_rank) if stage < self.pipeline_size - 1 else None

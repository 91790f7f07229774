"""How a rank holds a piece of a tensor: FSDP's shards and the checkpoints that save and reshard them.

A sharded tensor is flattened and cut into contiguous element ranges, one per rank. A :class:`Shard`
is one rank's range; any set of shards whose ranges cover ``[0, numel)`` rebuilds the tensor, whatever
world size wrote them, which is what lets a checkpoint saved by N ranks load on M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Shard", "shard_range"]


@dataclass(frozen=True)
class Shard:
    """``local`` holds elements ``[flat_offset, flat_offset + local.numel())`` of the flattened tensor
    of ``global_shape``."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    flat_offset: int

    def __post_init__(self) -> None:
        if self.local.dim() != 1:
            raise ValueError(f"a shard's local tensor is 1-D, not of shape {tuple(self.local.shape)}")
        if self.flat_offset < 0 or self.flat_offset + self.local.numel() > self.numel:
            raise ValueError(f"shard [{self.flat_offset}, {self.flat_offset + self.local.numel()}) lies outside "
                             f"a tensor of {self.numel} elements")

    @property
    def numel(self) -> int:
        """Elements of the whole (global) tensor."""
        return math.prod(self.global_shape)

    @property
    def flat_end(self) -> int:
        return self.flat_offset + self.local.numel()


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s element range of a tensor of ``numel`` elements cut into ``world_size`` pieces of
    ``ceil(numel / world_size)`` (the last ones shorter or empty)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}")
    per_rank = -(-numel // world_size)
    start = min(numel, rank * per_rank)
    return start, min(numel, start + per_rank)

"""Checkpoints to fs3 (or a local directory) that never tear.

    from haiscale.checkpoint import CheckpointManager
    ckpt = CheckpointManager("fs3:///ckpt/run1", keep=3, every_steps=100, rank=ctx.rank,
                             world_size=ctx.world_size, replica_of=...)   # see CheckpointManager
    loaded = ckpt.load_latest(model, optimizer)          # None, or .step and .extra; RNG restored
    for step in range(loaded.step + 1 if loaded else 0, steps):
        ...
        ckpt.maybe_save(step, model, optimizer, extra={"sampler": sampler.state_dict()})
    ckpt.close()

``save`` stalls the training thread only for a copy of every tensor into reused host buffers; a
background thread writes the files, and rank 0 publishes the step by one atomic directory rename
once every rank's files are durable. See :mod:`haiscale.checkpoint.manager` for the protocol and
:mod:`haiscale.checkpoint.format` for the layout.

A module or optimizer whose state is sharded across ranks (FSDP) implements :class:`ShardedModule`;
its shards are saved with their place in the whole tensor and load into any other split (another
world size, other ranges): a loading rank reads only the byte ranges it needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from haiscale.checkpoint.format import CheckpointCorrupt
from haiscale.checkpoint.manager import CheckpointError, CheckpointManager, Loaded
from haiscale.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = ["CheckpointCorrupt", "CheckpointError", "CheckpointManager", "Loaded", "ShardedModule",
           "capture_rng_state", "restore_rng_state"]


@runtime_checkable
class ShardedModule(Protocol):
    """What the checkpoint manager asks of a module or optimizer whose state is sharded (used instead
    of ``state_dict``/``load_state_dict`` whenever an object has both methods).

    ``sharded_state_dict()`` returns ``{name: Shard | Tensor | JSON value}``: a
    :class:`~haiscale.sharding.Shard` for each tensor this rank holds a flat range of, a plain tensor
    for replicated ones, and JSON-able values (an optimizer's hyperparameters and counters) as they
    are. Names are
    the same on every rank (they join the shards of one tensor). At save the manager copies each
    ``Shard.local``; at load it calls ``sharded_state_dict()`` again to learn the ranges this rank
    wants now, reads exactly those elements from whichever saved shards hold them, and calls
    ``load_sharded_state_dict(state)`` with the same names mapped to new Shards (same
    ``global_shape`` and ``flat_offset`` as asked, ``local`` filled; the module copies them in), whole
    tensors for the plain entries and the saved values of the JSON ones.
    """

    def sharded_state_dict(self) -> Mapping[str, Any]: ...

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None: ...

"""Which records each data-parallel rank reads, epoch by epoch, resumable mid-epoch.

Every rank draws the same permutation of the data set for an epoch (seeded by the seed and the
epoch, so nothing is communicated) and takes every ``num_replicas``-th index of it, starting at its
rank: the ranks' parts are disjoint and together cover the epoch. A checkpoint stores
:meth:`DistributedRecordSampler.state_dict` — the epoch and how far into it the job got — and a
restarted job continues with exactly the next sample instead of repeating or skipping part of an
epoch. The position is kept globally (samples of all ranks), so a job may resume on another number
of ranks and still read each remaining sample of the epoch once.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.utils.data

__all__ = ["DistributedRecordSampler"]

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, epoch) pairs apart: seed 1 epoch 0 is not seed 0 epoch 1
_STATE_VERSION = 1


class DistributedRecordSampler(torch.utils.data.Sampler[int]):
    """This rank's indices of an epoch: ``sampler.set_epoch(e)`` then iterate (or hand it to a
    ``DataLoader``/``BatchSampler``).

    ``drop_last=True`` drops the epoch's last ``len % num_replicas`` samples so every rank gets the
    same number; ``False`` pads the epoch by repeating its first samples instead.
    """

    def __init__(self, dataset_or_length: Sized | int, *, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True) -> None:
        length = dataset_or_length if isinstance(dataset_or_length, int) else len(dataset_or_length)
        if length < 0:
            raise ValueError(f"a data set has a length of at least 0, not {length}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, not {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.length = length
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._start = 0  # samples of the epoch (all ranks) consumed before the next iteration starts
        self._handed_out = 0  # indices this rank's current iteration has yielded
        self._done = False  # an iteration ran to the end of the epoch

    def __repr__(self) -> str:
        return (f"DistributedRecordSampler(length={self.length}, rank={self.rank}/{self.num_replicas}, "
                f"epoch={self.epoch}, seed={self.seed})")

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (unless it is the epoch a loaded state is in)."""
        if epoch != self.epoch:
            self._start, self._done = 0, False
        self.epoch = epoch
        self._handed_out = 0

    def _epoch_order(self) -> list[int]:
        """The epoch's permutation of the whole data set."""
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator()
        generator.manual_seed((self.seed * _SEED_MIX + self.epoch) % (1 << 63))
        order: list[int] = torch.randperm(self.length, generator=generator).tolist()
        return order

    def _padding(self, order: list[int], count: int) -> list[int]:
        """The epoch's first samples, repeated, that make ``count`` a multiple of ``num_replicas``."""
        missing = -count % self.num_replicas
        if not order or not missing:
            return []
        return (order * (missing // len(order) + 1))[:missing]

    def _remaining(self) -> tuple[list[int], int]:
        """This rank's indices from the current position on, and where the epoch ends.

        The position counts samples of all ranks along the epoch's sequence (the permutation, padded
        with its first samples unless ``drop_last``), so with the same ranks a resumed iteration is
        exactly the rest of the interrupted one, and with another number of ranks the rest is still
        read once (cut, or padded again, to the new number)."""
        order = self._epoch_order()
        sequence = order if self.drop_last else order + self._padding(order, len(order))
        rest = sequence[self._start:]
        if self.drop_last:
            rest = rest[:len(rest) - len(rest) % self.num_replicas]
        else:
            rest += self._padding(order, len(rest))
        return rest[self.rank::self.num_replicas], len(sequence)

    def __iter__(self) -> Iterator[int]:
        if self._done:  # iterating again without set_epoch: the same epoch, from its beginning
            self._start, self._done = 0, False
        mine, epoch_length = self._remaining()
        self._handed_out = 0
        for index in mine:
            self._handed_out += 1
            yield index
        # The epoch is done: a checkpoint now says so (a resumed job goes on with the next epoch).
        self._start, self._handed_out, self._done = epoch_length, 0, True

    def __len__(self) -> int:
        """What the next iteration yields (worked out, not drawn: no permutation of the data set)."""
        start = 0 if self._done else self._start
        sequence = self.length + (0 if self.drop_last else -self.length % self.num_replicas)
        rest = max(sequence - start, 0)
        rest = rest - rest % self.num_replicas if self.drop_last else rest + -rest % self.num_replicas
        return rest // self.num_replicas

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is in the epoch, for a checkpoint. ``consumed``: the samples this rank
        trained on since the current iteration started; by default the indices it has yielded — exact
        when the sampler is iterated directly, but a DataLoader with workers reads ahead, so pass
        ``steps_done * batch_size`` there."""
        done = self._handed_out if consumed is None else consumed
        if done < 0:
            raise ValueError(f"consumed samples cannot be negative: {done}")
        return {"version": _STATE_VERSION, "epoch": self.epoch, "seed": self.seed, "length": self.length,
                "shuffle": self.shuffle, "position": self._start + done * self.num_replicas,
                "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off: the next iteration yields the epoch's remaining samples."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            version = state.get("version") if isinstance(state, dict) else None
            raise ValueError(f"sampler state version {version!r} is not {_STATE_VERSION}")
        missing = [key for key in ("seed", "length", "shuffle", "epoch", "position") if key not in state]
        if missing:
            raise ValueError(f"the sampler state lacks {', '.join(missing)}")
        for key in ("seed", "length", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the sampler state is for {key}={state[key]!r}, this sampler has "
                                 f"{key}={getattr(self, key)!r}: resuming would read another order")
        numbers: dict[str, int] = {}
        for key in ("epoch", "position"):
            try:
                numbers[key] = -1 if isinstance(state[key], bool) else operator.index(state[key])
            except TypeError:
                numbers[key] = -1
            if numbers[key] < 0:
                raise ValueError(f"the sampler state's {key} {state[key]!r:.40} is not a non-negative integer")
        position = numbers["position"]
        # Without drop_last the saving ranks' epoch was padded to a multiple of *their* number: a
        # finished epoch's position is up to that many past the length (a state without the number
        # is judged by this sampler's).
        saved_replicas = state.get("num_replicas", self.num_replicas)
        if isinstance(saved_replicas, bool) or not isinstance(saved_replicas, int) or saved_replicas < 1:
            raise ValueError(f"sampler state num_replicas {saved_replicas!r} is not a positive integer")
        if not 0 <= position <= self.length + max(saved_replicas, self.num_replicas):
            raise ValueError(f"sampler state position {position} is outside an epoch of {self.length} samples")
        self.epoch = numbers["epoch"]
        self._start, self._handed_out, self._done = position, 0, False

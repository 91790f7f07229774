"""File layouts: which chain holds chunk *i* of a file. Pure: no I/O, no global randomness.

Shared by the metadata engines, which choose a new file's layout, and the clients, which place
its chunks: both must compute the same answer, so the arithmetic lives once, below both.

A file's layout names ``stripe`` chains drawn from a chain table by a seeded permutation, so
files spread over the whole table while each file's order is fixed forever. The permutation
uses the project's own generator (SplitMix64) and Fisher-Yates shuffle, never ``random``:
the same seed must give the same chains on every Python version and every machine, because
clients recompute nothing — but an operator rebuilding a layout by hand (or a tool in another
language) must get the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from fs3 import meta_pb2 as mpb
from fs3.common.errors import InvalidArgument
from fs3.common.ids import chunk_id, validate_chunk_size

__all__ = [
    "DEFAULT_CHUNK_SIZE_BYTES",
    "FILE_SIZE_MAX_BYTES",
    "STRIPE_MAX",
    "SplitMix64",
    "chunk_location",
    "file_layout",
    "max_file_size",
    "seeded_shuffle",
    "validate_dir_layout",
]

DEFAULT_CHUNK_SIZE_BYTES = 4 * 1024 * 1024
STRIPE_MAX = 256
_MASK64 = (1 << 64) - 1


class SplitMix64:
    """Steele, Lea and Flood's SplitMix64: tiny, fast, and identical everywhere."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, bound: int) -> int:
        """Uniform in ``[0, bound)`` (rejection sampling: no modulo bias)."""
        if bound <= 0:
            raise ValueError("bound must be positive")
        limit = _MASK64 - (_MASK64 % bound)
        while True:
            value = self.next_u64()
            if value < limit:
                return value % bound


def seeded_shuffle(items: Sequence[int], seed: int) -> list[int]:
    """Fisher-Yates with :class:`SplitMix64`: a permutation of ``items`` fixed by ``seed``."""
    out = list(items)
    rng = SplitMix64(seed)
    for i in range(len(out) - 1, 0, -1):
        j = rng.below(i + 1)
        out[i], out[j] = out[j], out[i]
    return out


def validate_dir_layout(layout: mpb.Layout, known_tables: dict[int, list[int]] | None = None) -> None:
    """A directory's default layout: a known table, a power-of-two chunk size, a sane stripe."""
    validate_chunk_size(layout.chunk_size)
    if layout.stripe > STRIPE_MAX:
        raise InvalidArgument(f"stripe {layout.stripe} exceeds {STRIPE_MAX}")
    if known_tables is not None:
        chains = known_tables.get(layout.table_id)
        if not chains:
            raise InvalidArgument(f"chain table {layout.table_id} does not exist or has no chains")
        if layout.stripe > len(chains):
            raise InvalidArgument(f"stripe {layout.stripe} exceeds the {len(chains)} chains of table "
                                  f"{layout.table_id}")


def file_layout(dir_layout: mpb.Layout, table_chains: Sequence[int], seed: int, stripe_default: int) -> mpb.Layout:
    """The layout of a new file: the directory's settings and ``stripe`` chains of the permuted table."""
    if not table_chains:
        raise InvalidArgument(f"chain table {dir_layout.table_id} has no chains")
    stripe = dir_layout.stripe or min(stripe_default, len(table_chains))
    stripe = max(1, min(stripe, len(table_chains)))
    chains = seeded_shuffle(sorted(table_chains), seed)[:stripe]
    return mpb.Layout(table_id=dir_layout.table_id, chunk_size=dir_layout.chunk_size, stripe=stripe,
                      chains=chains, seed=seed)


FILE_SIZE_MAX_BYTES = 1 << 60


def max_file_size(layout: mpb.Layout) -> int:
    """The largest length a file with this layout can have (chunk indexes are 32-bit)."""
    return min(FILE_SIZE_MAX_BYTES, layout.chunk_size << 32)


def chunk_location(layout: mpb.Layout, inode_id: int, chunk_index: int) -> tuple[int, bytes]:
    """``(chain_id, chunk_id)`` of chunk ``chunk_index`` of a file."""
    if not layout.chains:
        raise InvalidArgument(f"inode {inode_id} has no chains in its layout")
    return layout.chains[chunk_index % len(layout.chains)], chunk_id(inode_id, chunk_index)

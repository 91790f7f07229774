"""Operation histories of the simulator and their linearizability check, one chunk at a time.

Each chunk is cut into slots; a write stores a unique write id in every slot it covers (the id
repeated, so a torn slot is visible), a truncate zeroes the slots past the new length, a remove
resets the chunk. ``History.check`` runs the search of ``fs3.sim.linearizability`` per chunk: the
slots of a chunk are not independent objects, since a remove, a truncate or a read touches them all
at once.
"""

from __future__ import annotations

import struct

from fs3.sim.linearizability import DEFAULT_BUDGET, INF, CheckResult, Op, check_chunk

__all__ = ["INF", "CheckResult", "History", "Op", "check_chunk", "decode_slots", "encode_slot"]


def encode_slot(write_id: int, slot_bytes: int) -> bytes:
    return struct.pack("<Q", write_id) * (slot_bytes // 8)


def decode_slots(data: bytes, slots: int, slot_bytes: int) -> list[int | None]:
    """The write id in each slot; 0 for zeros/absent, None for a torn (mixed) slot."""
    values: list[int | None] = []
    for i in range(slots):
        raw = data[i * slot_bytes : (i + 1) * slot_bytes]
        if len(raw) < slot_bytes:
            raw = raw + bytes(slot_bytes - len(raw))
        first = raw[:8]
        if raw != first * (slot_bytes // 8):
            values.append(None)
        else:
            values.append(struct.unpack("<Q", first)[0])
    return values


class History:
    """The ops of a run, over any number of chunks.

    ``slots`` and ``slot_bytes`` describe the chunk layout; both may be omitted for histories with
    neither truncates nor observed lengths (the slot count is then inferred per chunk).
    """

    def __init__(self, slots: int | None = None, slot_bytes: int | None = None,
                 budget: int = DEFAULT_BUDGET) -> None:
        self.ops: list[Op] = []
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.budget = budget

    def add(self, op: Op) -> Op:
        self.ops.append(op)
        return op

    def check_chunks(self, budget: int | None = None) -> dict[int, CheckResult]:
        """The verdict for every chunk, each searched with its own budget of steps."""
        by_chunk: dict[int, list[Op]] = {}
        for op in self.ops:
            by_chunk.setdefault(op.chunk, []).append(op)
        return {chunk: check_chunk(ops, slots=self.slots, slot_bytes=self.slot_bytes,
                                   budget=self.budget if budget is None else budget)
                for chunk, ops in sorted(by_chunk.items())}

    def check(self, budget: int | None = None) -> list[str]:
        """Every problem found, one string each; empty means every chunk is linearizable.

        A chunk whose search ran out of budget is a problem too (it was not shown linearizable); its
        string starts with "inconclusive:" so callers can tell it from a violation.
        """
        problems: list[str] = []
        for chunk, result in self.check_chunks(budget).items():
            prefix = "inconclusive: " if result.status == "inconclusive" else ""
            problems.extend(f"{prefix}chunk {chunk}: {p}" for p in result.problems)
        return problems

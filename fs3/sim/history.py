"""Operation histories and the per-slot linearizability check.

Each chunk is cut into slots; a write stores a unique write id in every slot it covers (the id
repeated, so a torn slot is visible), a remove resets every slot of a chunk to 0. A slot is
then a register with (almost) unique values, and a read's value is legal only if some write of
that value could be linearized inside the read: it started before the read ended, and no other
value-setting operation happened strictly between it and the read (real-time order).
Likewise two reads in real-time order never see values in the opposite order. Failed or
unanswered operations may have taken effect at any later time; they never complete.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

__all__ = ["History", "Op", "decode_slots", "encode_slot"]

INF = math.inf


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


@dataclass
class Op:
    kind: str  # "write", "remove", "read"
    chunk: int
    slots: tuple[int, ...]
    invoke: float
    complete: float = INF  # INF until acknowledged; stays INF when failed or unanswered
    value: int = 0  # write id (writes), 0 for remove
    observed: dict[int, int | None] = field(default_factory=dict)  # reads: slot -> value
    ok: bool = False


class History:
    def __init__(self) -> None:
        self.ops: list[Op] = []

    def add(self, op: Op) -> Op:
        self.ops.append(op)
        return op

    def check(self) -> list[str]:
        """Every violation found; empty means the history is linearizable per slot."""
        problems: list[str] = []
        setters: dict[tuple[int, int], list[Op]] = {}
        reads: dict[tuple[int, int], list[tuple[Op, int | None]]] = {}
        for op in self.ops:
            for slot in op.slots:
                key = (op.chunk, slot)
                if op.kind in ("write", "remove"):
                    setters.setdefault(key, []).append(op)
                elif op.ok:
                    reads.setdefault(key, []).append((op, op.observed.get(slot)))
        for key, key_reads in reads.items():
            writes = setters.get(key, [])
            initial = Op("remove", key[0], (key[1],), invoke=-INF, complete=-INF, value=0, ok=True)
            for read, value in key_reads:
                if value is None:
                    problems.append(f"torn slot {key} read at t={read.invoke:.4f}")
                    continue
                candidates = [w for w in [initial, *writes] if w.value == value and w.invoke < read.complete]
                if not candidates:
                    problems.append(f"slot {key}: read at t={read.invoke:.4f} returned {value}, never written before")
                    continue
                if not any(self._could_be_latest(c, read, writes) for c in candidates):
                    problems.append(f"slot {key}: read [{read.invoke:.4f}, {read.complete:.4f}] returned stale "
                                    f"value {value}")
            # Read-read order: a later read must not return a value overwritten before an earlier read's value.
            ordered = sorted(key_reads, key=lambda item: item[0].complete)
            for i, (r1, v1) in enumerate(ordered):
                for r2, v2 in ordered[i + 1 :]:
                    if r1.complete >= r2.invoke or v1 is None or v2 is None or v1 == v2:
                        continue
                    w1 = [w for w in [initial, *writes] if w.value == v1]
                    w2 = [w for w in [initial, *writes] if w.value == v2]
                    # r2's value must not be strictly older than r1's: every setter of v2 completed
                    # before every setter of v1 started means v2 was overwritten before r1 saw v1.
                    if w1 and w2 and all(b.complete < a.invoke for a in w1 for b in w2):
                        problems.append(f"slot {key}: read at t={r2.invoke:.4f} saw {v2} after an earlier read "
                                        f"saw newer {v1}")
        return problems

    @staticmethod
    def _could_be_latest(candidate: Op, read: Op, writes: list[Op]) -> bool:
        for other in writes:
            if other is candidate or other.value == candidate.value:
                continue
            if candidate.complete < other.invoke and other.complete < read.invoke:
                return False
        return True

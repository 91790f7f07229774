"""Linearizability of one chunk's history: a Wing-Gong / Lowe search with memoisation.

The object is one chunk, cut into equal slots. Its state is ``(length in bytes, value of every
slot)``; writes store a (unique) write id in the slots they cover and may extend the length,
truncates zero the slots at or past the new length and set it, removes reset everything, and reads
observe the slot values and possibly the length. A history is linearizable when every completed
operation can be given a point inside its interval, and every unknown-outcome operation (failed
or never answered, so it may or may not have taken effect) either a point after its invoke or no
point at all, such that applying them in that order explains every completed read.

Slots cannot be checked one at a time (P-compositionality does not hold) once an operation touches
several of them at once: a remove or truncate resets all slots atomically, a read snapshots them
together. The checker therefore searches the chunk as a whole, and only splits a chunk into groups
of slots that no operation links.

The search is the one Porcupine and Knossos use: a depth-first walk over sequences of operations
where the next operation must be *minimal* (no unlinearized completed operation returned before it
was invoked), with every explored ``(set of linearized operations, model state)`` remembered so that
two orders reaching the same place are explored once. A handful of reductions keep it fast on
histories with many concurrent and failed operations; each only removes orders that cannot
succeed, so none of them turns a violation into "ok":

* a read that is minimal and matches the current state is linearized at once, without branching:
  if any linearization exists, one with that read moved to the current point exists too, because a
  read does not change the state and a minimal op may precede every unlinearized one;
* an unknown-outcome write whose value no completed read ever observes (in the slots it covers) is
  dropped: every read after it would have to find its slots overwritten anyway, which makes the write
  invisible (if a read observes the length, it must also observe all of the write's slots, because a
  write can extend the length);
* an unknown-outcome write whose (nonzero) value is unique and is observed by some completed read
  must precede that read, so it is treated as completed when the first such read completed;
* a read that saw write w's unique value in slot s orders more than real time does: whatever changes
  s and must precede the read must precede w, and whatever changes s and must follow w must follow the
  read (see ``_prerequisites``);
* a branch dies as soon as a read that could run next differs from the state in a way no op still
  unplaced (and invoked early enough) could repair.

What remains optional is the unknown-outcome removes and truncates (and writes whose value is not
unique); they are tried after the completed ops, since leaving them out is the likelier guess.

Histories are not split at quiescent points: an unknown-outcome op stays in flight forever, so a
point is quiescent only once every earlier optional op is known to be irrelevant, and the memo already
explores each state reachable at such a point once. Every search step is counted; a search that runs
out of its budget answers "inconclusive", never "ok".
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["DEFAULT_BUDGET", "INF", "CheckResult", "Op", "Status", "check_chunk"]

INF = math.inf

#: Search steps (distinct explored positions) allowed per chunk before answering "inconclusive".
DEFAULT_BUDGET = 100_000

Status = Literal["ok", "violation", "inconclusive"]
State = tuple[int, tuple[int, ...]]  # (length in bytes, 0 when not tracked; slot values)

_READ, _WRITE, _TRUNCATE, _REMOVE = 0, 1, 2, 3
_KINDS = {"read": _READ, "write": _WRITE, "truncate": _TRUNCATE, "remove": _REMOVE}
_SHOWN_STATES = 4  # distinct states remembered per read, to explain why it could not be placed
_SHOWN_PREFIX = 6  # ops of the longest linearizable prefix named in an explanation


@dataclass
class Op:
    """One call against one chunk, as a client saw it.

    ``complete`` stays ``INF`` when the call failed or was never answered; such a mutation may take
    effect at any time after ``invoke`` or never, and such a read observed nothing. ``length`` is the
    new length of a truncate, and the length a read observed (``None``: not observed).
    """

    kind: str  # "write", "truncate", "remove", "read"
    chunk: int
    slots: tuple[int, ...]
    invoke: float
    complete: float = INF  # INF until acknowledged; stays INF when failed or unanswered
    value: int = 0  # write id (writes), 0 otherwise
    observed: dict[int, int | None] = field(default_factory=dict)  # reads: slot -> value (None: torn)
    ok: bool = False
    length: int | None = None  # truncate: new length in bytes; read: observed length in bytes, or None

    @property
    def completed(self) -> bool:
        """Acknowledged, so its effect (or observation) lies inside [invoke, complete]."""
        return self.ok and self.complete != INF

    def describe(self) -> str:
        end = f"{self.complete:.4f}" if self.completed else ("failed" if math.isfinite(self.complete) else "?")
        where = f"{self.kind} chunk {self.chunk} [{self.invoke:.4f}, {end}]"
        if self.kind == "write":
            return f"{where} slots {_span(self.slots)} := {self.value}"
        if self.kind == "truncate":
            return f"{where} length {self.length}"
        if self.kind == "read":
            seen = ", ".join("torn" if v is None else str(v) for _, v in sorted(self.observed.items()))
            length = "" if self.length is None else f"length {self.length}, "
            return f"{where} saw {length}slots {_span(tuple(sorted(self.observed)))} = [{seen}]"
        return where


@dataclass(frozen=True)
class CheckResult:
    """The verdict on one chunk.

    ``problems`` holds one self-contained explanation per problem found (empty when ok). For a
    violation ``prefix`` is the longest linearizable prefix found and ``blocked`` the op that could
    not be placed after it; for "ok" ``prefix`` is a witness linearization of the completed ops (and
    of the unknown-outcome ones that took effect).
    """

    status: Status
    chunk: int | None
    problems: tuple[str, ...] = ()
    steps: int = 0
    ops: int = 0
    prefix: tuple[Op, ...] = ()
    blocked: Op | None = None
    possible: tuple[State, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def explanation(self) -> str:
        return "\n".join(self.problems) if self.problems else "linearizable"


def check_chunk(ops: Iterable[Op], *, slots: int | None = None, slot_bytes: int | None = None,
                budget: int = DEFAULT_BUDGET) -> CheckResult:
    """Whether the ops of one chunk are linearizable against the chunk model.

    ``slots`` is the number of slots (inferred from the ops when omitted); ``slot_bytes`` is needed
    only when an op carries a length (a truncate, or a read that observed one). ``budget`` bounds the
    search steps for the whole chunk.
    """
    ops = list(ops)
    chunks = {op.chunk for op in ops}
    if len(chunks) > 1:
        raise ValueError(f"check_chunk got ops of several chunks: {sorted(chunks)}")
    chunk = next(iter(chunks)) if chunks else None
    nslots = _slot_count(ops, slots)
    problems: list[str] = []
    # Reads that observed nothing certain are dropped; torn slots are violations on their own.
    reads = [op for op in ops if op.kind == "read" and op.completed]
    for read in reads:
        torn = [s for s, v in sorted(read.observed.items()) if v is None]
        if torn:
            problems.append(f"torn slot{'s' if len(torn) > 1 else ''} {_span(tuple(torn))}: {read.describe()}")
    phantom = _phantoms(ops, reads)
    if phantom:
        return CheckResult("violation", chunk, (*problems, *phantom), ops=len(ops))
    mutations = [op for op in ops if op.kind != "read"]
    for op in mutations:
        if op.kind not in _KINDS:
            raise ValueError(f"unknown op kind {op.kind!r}")
    used = [*mutations, *reads]
    groups = _independent_groups(used, nslots)
    steps = 0
    outcome: CheckResult | None = None
    witness: list[Op] = []
    for group in groups:
        group_ops = [op for op in used if _touches(op, group)]
        search = _Search(group_ops, group, nslots, slot_bytes, budget - steps)
        result = search.run()
        steps += result.steps
        witness.extend(result.prefix)
        if result.status != "ok":
            outcome = result
            break
    if outcome is None:
        if problems:
            return CheckResult("violation", chunk, tuple(problems), steps, len(ops))
        return CheckResult("ok", chunk, (), steps, len(ops), tuple(witness))
    return CheckResult(outcome.status, chunk, (*problems, *outcome.problems), steps, len(ops), outcome.prefix,
                       outcome.blocked, outcome.possible)


def _span(slots: Sequence[int]) -> str:
    if not slots:
        return "none"
    if list(slots) == list(range(slots[0], slots[-1] + 1)):
        return str(slots[0]) if len(slots) == 1 else f"{slots[0]}-{slots[-1]}"
    return ",".join(map(str, slots))


def _slot_count(ops: Sequence[Op], slots: int | None) -> int:
    used = [s for op in ops for s in (*op.slots, *op.observed)]
    if slots is None:
        return max(used, default=-1) + 1
    if any(s < 0 or s >= slots for s in used):
        raise ValueError(f"an op names a slot outside 0..{slots - 1}")
    return slots


def _phantoms(ops: Sequence[Op], reads: Sequence[Op]) -> list[str]:
    """Reads of a value no write could have put in that slot yet: cheap, and a precise message."""
    writers: dict[tuple[int, int], float] = {}  # (slot, value) -> earliest invoke
    for op in ops:
        if op.kind == "write":
            for s in op.slots:
                key = (s, op.value)
                writers[key] = min(writers.get(key, INF), op.invoke)
    found: list[str] = []
    for read in reads:
        for s, v in sorted(read.observed.items()):
            if v is not None and v != 0 and writers.get((s, v), INF) > read.complete:
                found.append(f"slot {s} holds {v}, which was never written there before the read ended: "
                             f"{read.describe()}")
    return found


def _touches(op: Op, group: frozenset[int]) -> bool:
    """Whether the op involves a slot of the group (removes, truncates and length reads involve all)."""
    if op.kind in ("remove", "truncate") or (op.kind == "read" and op.length is not None):
        return True
    if op.kind == "read":
        return any(s in group for s, v in op.observed.items() if v is not None)
    return any(s in group for s in op.slots)


def _independent_groups(ops: Sequence[Op], nslots: int) -> list[frozenset[int]]:
    """Groups of slots that no op links: each is an independent object (locality of linearizability).

    A remove, a truncate or a length-observing read links every slot, and so does a write when the
    length is observed anywhere (a write extends it). Simulator histories read all slots at once,
    so they form one group; per-slot workloads split into one group per slot.
    """
    parent = list(range(nslots))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def link(slots: Iterable[int]) -> None:
        it = iter(slots)
        first = next(it, None)
        if first is None:
            return
        root = find(first)
        for s in it:
            other = find(s)
            if other != root:
                parent[other] = root

    lengths = any(op.kind == "read" and op.length is not None for op in ops)
    for op in ops:
        if op.kind in ("remove", "truncate") or (op.kind == "read" and op.length is not None) or \
                (op.kind == "write" and lengths):
            link(range(nslots))
        elif op.kind == "read":
            link(s for s, v in op.observed.items() if v is not None)
        else:
            link(op.slots)
    groups: dict[int, set[int]] = {}
    for s in range(nslots):
        groups.setdefault(find(s), set()).add(s)
    return [frozenset(g) for g in groups.values()] or [frozenset()]


class _Search:
    """The memoised depth-first search over one group of ops (usually a whole chunk)."""

    def __init__(self, ops: Sequence[Op], group: frozenset[int], nslots: int, slot_bytes: int | None,
                 budget: int) -> None:
        self.nslots = nslots
        self.budget = budget
        self.track_length = any(op.kind == "read" and op.length is not None for op in ops)
        needs_bytes = self.track_length or any(op.kind == "truncate" for op in ops)
        if needs_bytes and not slot_bytes:
            raise ValueError("slot_bytes is needed to check truncates or observed lengths")
        self.slot_bytes = slot_bytes or 1
        self.zeros = (0,) * nslots
        reads = [op for op in ops if op.kind == "read"]
        seen = self._first_seen(reads)
        kept = [op for op in ops if op.kind == "read" or op.completed or not self._invisible(op, reads, seen)]
        self.deadlines = self._deadlines(kept, seen)
        kept.sort(key=lambda op: (op.invoke, self.deadlines[id(op)]))
        self.ops = kept
        self.invokes = [op.invoke for op in kept]
        self.deadline = [self.deadlines[id(op)] for op in kept]
        self.kind = [_KINDS[op.kind] for op in kept]
        self.read_mask = 0
        self.optional_mask = 0
        for i, op in enumerate(kept):
            if op.kind == "read":
                self.read_mask |= 1 << i
            if self.deadline[i] == INF:
                self.optional_mask |= 1 << i
        # Ops that must be linearized, by deadline: the earliest unlinearized one bounds the candidates.
        self.required = sorted((i for i in range(len(kept)) if self.deadline[i] != INF),
                               key=lambda i: (self.deadline[i], i))
        self.expect: list[tuple[int | None, tuple[int, ...] | None, tuple[tuple[int, int], ...]]] = []
        for op in kept:
            checks = tuple((s, v) for s, v in sorted(op.observed.items()) if v is not None and s in group)
            full = tuple(v for _, v in checks) if len(checks) == nslots else None
            self.expect.append((op.length if self.track_length else None, full, checks))
        self.producers = self._all_producers()
        # (later op, earlier op) -> (read, slot, write) that forced the order, to explain violations.
        self.reasons: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.prereq = self._prerequisites()
        self.tried: dict[int, list[State]] = {}

    def _modifies(self, j: int, s: int) -> bool:
        op = self.ops[j]
        kind = self.kind[j]
        return (kind == _WRITE and s in op.slots) or kind == _REMOVE or (kind == _TRUNCATE and self._cut(op) <= s)

    def _prerequisites(self) -> list[int]:
        """Orders every valid linearization obeys beyond real time, as a mask of ops to place first.

        When a read saw value v in slot s and only write w ever wrote v (writes ids are unique), then
        w precedes the read and nothing that changes slot s lies between them. So an op changing s
        that must precede the read (due before the read began) must precede w too; and one that must
        follow w (invoked after w was due) must follow the read as well. Without these, a write seen
        long after it was issued would be tried at every point in between, and each wrong guess
        refuted only when the read comes up."""
        n = len(self.ops)
        prereq = [0] * n
        writers: dict[int, list[int]] = {}
        for j in range(n):
            if self.kind[j] == _WRITE:
                writers.setdefault(self.ops[j].value, []).append(j)
        modifiers: dict[int, list[int]] = {}
        for s in range(self.nslots):
            modifiers[s] = [j for j in range(n) if self.kind[j] != _READ and self._modifies(j, s)]
        by_deadline = {s: sorted(js, key=lambda j: self.deadline[j]) for s, js in modifiers.items()}
        deadlines = {s: [self.deadline[j] for j in js] for s, js in by_deadline.items()}
        invokes = {s: [self.invokes[j] for j in js] for s, js in modifiers.items()}
        for i in range(n):
            if self.kind[i] != _READ:
                continue
            read = self.ops[i]
            for s, v in self.expect[i][2]:
                found = writers.get(v, [])
                if v == 0 or len(found) != 1 or s not in self.ops[found[0]].slots:
                    continue
                w = found[0]
                # Changes of s due before the read began come before w ...
                lo = bisect_right(deadlines[s], self.invokes[w])
                hi = bisect_left(deadlines[s], read.invoke)
                for j in by_deadline[s][lo:hi]:
                    if j != w and not prereq[w] >> j & 1:
                        prereq[w] |= 1 << j
                        self.reasons[(w, j)] = (i, s, w)
                # ... and changes of s invoked after w was due come after the read.
                lo = bisect_right(invokes[s], self.deadline[w])
                hi = bisect_left(invokes[s], read.complete)
                for j in modifiers[s][lo:hi]:
                    if not prereq[j] >> i & 1:
                        prereq[j] |= 1 << i
                        self.reasons[(j, i)] = (i, s, w)
        return prereq

    def _all_producers(self) -> list[tuple[int, tuple[tuple[int, int, int], ...]]]:
        """For each read: which ops could give the length and each observed slot the value it saw, as
        bitmasks (ops invoked too late to precede the read do not count)."""
        n = len(self.ops)
        by_value: dict[tuple[int, int], list[int]] = {}  # (slot, value) -> ops that can set it
        by_length: dict[int, list[int]] = {}
        for j in range(n):
            op, kind = self.ops[j], self.kind[j]
            if kind == _WRITE:
                for s in op.slots:
                    by_value.setdefault((s, op.value), []).append(j)
                by_length.setdefault((max(op.slots) + 1) * self.slot_bytes, []).append(j)
            elif kind in (_TRUNCATE, _REMOVE):
                cut = self._cut(op) if kind == _TRUNCATE else 0
                for s in range(cut, self.nslots):
                    by_value.setdefault((s, 0), []).append(j)
                by_length.setdefault(op.length if kind == _TRUNCATE and op.length is not None else 0, []).append(j)
        prefixes: dict[object, tuple[list[float], list[int]]] = {}

        def upto(key: object, found: list[int], deadline: float) -> int:
            """The mask of ``found`` (in invoke order) invoked by ``deadline``."""
            if key not in prefixes:
                masks, mask = [], 0
                for j in found:
                    mask |= 1 << j
                    masks.append(mask)
                prefixes[key] = ([self.invokes[j] for j in found], masks)
            times, masks = prefixes[key]
            k = bisect_right(times, deadline)
            return masks[k - 1] if k else 0

        result: list[tuple[int, tuple[tuple[int, int, int], ...]]] = []
        for i in range(n):
            length, _, checks = self.expect[i]
            if self.kind[i] != _READ:
                result.append((0, ()))
                continue
            deadline = self.deadline[i]
            length_mask = 0 if length is None else upto(("length", length), by_length.get(length, []), deadline)
            result.append((length_mask, tuple((s, v, upto((s, v), by_value.get((s, v), []), deadline))
                                              for s, v in checks)))
        return result

    def _cut(self, op: Op) -> int:
        """The first slot a truncate zeroes."""
        assert op.length is not None
        return -(-op.length // self.slot_bytes)

    def feasible(self, i: int, bitmask: int, state: State) -> bool:
        """Whether read ``i`` can still match: every way it differs from ``state`` has an unlinearized
        op that could still make up the difference. A cheap necessary condition that prunes a dead
        branch at once instead of after every ordering of the ops still in flight."""
        length_mask, slots = self.producers[i]
        expected = self.expect[i][0]
        if expected is not None and state[0] != expected and not length_mask & ~bitmask:
            return False
        values = state[1]
        return all(values[s] == v or mask & ~bitmask for s, v, mask in slots)

    @staticmethod
    def _first_seen(reads: Sequence[Op]) -> dict[tuple[int, int], float]:
        """(slot, value) -> when the first read that saw it there completed."""
        seen: dict[tuple[int, int], float] = {}
        for read in reads:
            for s, v in read.observed.items():
                if v is not None and read.complete < seen.get((s, v), INF):
                    seen[(s, v)] = read.complete
        return seen

    def _invisible(self, op: Op, reads: Sequence[Op], seen: dict[tuple[int, int], float]) -> bool:
        """An unknown-outcome write no read can tell apart from "never happened" (see the module doc)."""
        if op.kind != "write" or any((s, op.value) in seen for s in op.slots):
            return False
        if not self.track_length:
            return True
        # A write can extend the length: every read of the length must also see all of its slots.
        return all(read.observed.get(s) is not None for read in reads if read.length is not None for s in op.slots)

    @staticmethod
    def _deadlines(ops: Sequence[Op], seen: dict[tuple[int, int], float]) -> dict[int, float]:
        """When each op must be linearized by: its completion, INF for optional ones, or the first read
        that observed an unknown-outcome write's unique value."""
        writers: dict[int, int] = {}
        for op in ops:
            if op.kind == "write":
                writers[op.value] = writers.get(op.value, 0) + 1
        deadlines: dict[int, float] = {}
        for op in ops:
            if op.completed:
                deadlines[id(op)] = op.complete
            elif op.kind == "write" and op.value != 0 and writers[op.value] == 1:
                deadlines[id(op)] = min((seen.get((s, op.value), INF) for s in op.slots), default=INF)
            else:
                deadlines[id(op)] = INF
        return deadlines

    # The model.

    def matches(self, i: int, state: State) -> bool:
        length, full, checks = self.expect[i]
        if length is not None and state[0] != length:
            return False
        values = state[1]
        if full is not None:
            return values == full
        return all(values[s] == v for s, v in checks)

    def apply(self, i: int, state: State) -> State:
        op = self.ops[i]
        kind = self.kind[i]
        length, values = state
        if kind == _WRITE:
            updated = list(values)
            for s in op.slots:
                updated[s] = op.value
            if self.track_length:
                length = max(length, (max(op.slots) + 1) * self.slot_bytes)
            return length, tuple(updated)
        if kind == _TRUNCATE:
            assert op.length is not None
            cut = self._cut(op)
            return (op.length if self.track_length else 0), values[:cut] + self.zeros[cut:]
        return 0, self.zeros

    # The search.

    def _close(self, bitmask: int, state: State, ptr: int, path: list[int]) -> tuple[int, int, int, bool]:
        """Advance past linearized required ops and linearize every minimal read matching ``state``.

        Returns (bitmask, ptr, window of candidate ops, done: every required op is linearized)."""
        required, deadline = self.required, self.deadline
        while True:
            while ptr < len(required) and bitmask >> required[ptr] & 1:
                ptr += 1
            if ptr == len(required):
                return bitmask, ptr, 0, True
            hi = bisect_right(self.invokes, deadline[required[ptr]])
            window = ((1 << hi) - 1) & ~bitmask
            pending = window & self.read_mask
            progressed = False
            while pending:
                low = pending & -pending
                pending ^= low
                i = low.bit_length() - 1
                if not self.prereq[i] & ~bitmask and self.matches(i, state):
                    bitmask |= low
                    path.append(i)
                    progressed = True
            if not progressed:
                return bitmask, ptr, window, False

    def run(self) -> CheckResult:
        state: State = (0, self.zeros)
        path: list[int] = []
        best: list[int] = []
        best_node: tuple[int, State, int, int] = (0, state, 0, 0)
        memo: set[tuple[int, State]] = set()
        steps = 0
        # A frame: [bitmask, state, ptr, children, next child, ops it added to the path].
        stack: list[tuple[int, State, int, list[int], list[int], int]] = []

        def enter(bitmask: int, node_state: State, ptr: int, added: int) -> bool:
            nonlocal steps, best, best_node
            before = len(path)
            bitmask, ptr, window, done = self._close(bitmask, node_state, ptr, path)
            added += len(path) - before
            if done:
                return True
            key = (bitmask, node_state)
            if key in memo:
                del path[len(path) - added:]
                return False
            memo.add(key)
            steps += 1
            if len(path) > len(best):
                best = path.copy()
                best_node = (bitmask, node_state, ptr, window)
            waiting = window & self.read_mask
            dead = False
            while waiting:
                low = waiting & -waiting
                waiting ^= low
                i = low.bit_length() - 1
                if not self.prereq[i] & ~bitmask:
                    tried = self.tried.setdefault(i, [])
                    if len(tried) < _SHOWN_STATES and node_state not in tried:
                        tried.append(node_state)
                dead = dead or not self.feasible(i, bitmask, node_state)
            if dead:
                return False
            prereq = self.prereq
            children = [i for i in _bits(window & ~self.read_mask) if not prereq[i] & ~bitmask]
            # Completed mutations first: leaving an optional op out is the cheap guess, tried first.
            first = [i for i in children if not self.optional_mask >> i & 1]
            later = [i for i in children if self.optional_mask >> i & 1]
            stack.append((bitmask, node_state, ptr, first + later, [0], added))
            return False

        if enter(0, state, 0, 0):
            return self._ok(path, steps)
        while stack:
            if steps >= self.budget:
                return self._inconclusive(best, best_node, steps)
            bitmask, node_state, ptr, children, cursor, added = stack[-1]
            if cursor[0] == len(children):
                stack.pop()
                del path[len(path) - added:]
                continue
            i = children[cursor[0]]
            cursor[0] += 1
            path.append(i)
            if enter(bitmask | 1 << i, self.apply(i, node_state), ptr, 1):
                return self._ok(path, steps)
        return self._violation(best, best_node, steps)

    # Verdicts.

    def _ok(self, path: list[int], steps: int) -> CheckResult:
        return CheckResult("ok", None, (), steps, len(self.ops), tuple(self.ops[i] for i in path))

    def _blame(self, node: tuple[int, State, int, int]) -> tuple[int | None, list[str]]:
        """The op to blame at the deepest position, and why it cannot be placed there.

        That is the earliest-due unlinearized op: a read that matches no reachable state, or an op
        held back by an order some read forced (then the read is to blame), or else the earliest-due
        read that could run there but did not match."""
        bitmask, _, ptr, window = node
        if ptr >= len(self.required):
            return None, []
        due = self.required[ptr]
        missing = self.prereq[due] & ~bitmask
        if missing:
            before = next(_bits(missing))
            read, slot, write = self.reasons[(due, before)]
            seen = self.ops[write].value
            if due == write:
                late = " (it began only after that write was due)" if self.invokes[before] > self.deadline[due] else ""
                why = [f"  it saw {seen} in slot {slot}, written by: {self.ops[write].describe()}",
                       f"  but this op changes slot {slot} and was due before the read began, so it must precede "
                       f"that write, and cannot{late}: {self.ops[before].describe()}",
                       "  so the read saw a stale value (overwritten before it began)"]
            else:
                why = [f"  it saw {seen} in slot {slot}, written by: {self.ops[write].describe()}",
                       f"  so this op, which changes slot {slot} and began after that write was due, must follow "
                       f"the read, yet it is due before the read can be placed: {self.ops[due].describe()}"]
            return read, why
        if self.kind[due] != _READ:
            reads = [i for i in _bits(window & self.read_mask) if not self.prereq[i] & ~bitmask]
            if not reads:
                return due, []
            due = min(reads, key=lambda i: (self.deadline[i], i))
        return due, []

    def _inconclusive(self, best: list[int], best_node: tuple[int, State, int, int], steps: int) -> CheckResult:
        optional = bin(self.optional_mask).count("1")
        text = (f"search budget of {self.budget} steps ran out after placing at most {len(best)} of "
                f"{len(self.ops)} ops ({optional} of them may or may not have taken effect)")
        blocked, _ = self._blame(best_node)
        if blocked is not None:
            text += f"; the deepest point waited on: {self.ops[blocked].describe()}"
        return CheckResult("inconclusive", None, (text,), steps, len(self.ops), tuple(self.ops[i] for i in best))

    def _violation(self, best: list[int], best_node: tuple[int, State, int, int], steps: int) -> CheckResult:
        blocked, why = self._blame(best_node)
        lines = [f"not linearizable: the longest linearizable prefix places {len(best)} of {len(self.ops)} ops, "
                 f"then nothing fits ({steps} search steps)"]
        possible: tuple[State, ...] = ()
        op = self.ops[blocked] if blocked is not None else None
        if op is not None:
            lines.append(f"  cannot place: {op.describe()}")
            lines.extend(why)
            if op.kind == "read" and not why:
                possible = tuple(self.tried.get(blocked, [best_node[1]])) if blocked is not None else ()
                lines.append("  states it could have seen: " + "; ".join(self._show(s) for s in possible))
                lines.extend(f"  {reason}" for reason in self._why(op, possible, best_node[0]))
        if best:
            tail = best[-_SHOWN_PREFIX:]
            skipped = f", the last {len(tail)} of {len(best)}" if len(best) > len(tail) else ""
            lines.append(f"  end of that prefix{skipped}:")
            lines.extend(f"    {self.ops[i].describe()}" for i in tail)
            lines.append(f"  state after it: {self._show(best_node[1])}")
        window = best_node[3]
        concurrent = [self.ops[i].describe() for i in _bits(window & ~self.read_mask)]
        if concurrent:
            lines.append("  mutations that could still be placed there:")
            lines.extend(f"    {text}" for text in concurrent[:_SHOWN_PREFIX])
        return CheckResult("violation", None, ("\n".join(lines),), steps, len(self.ops),
                           tuple(self.ops[i] for i in best), op, possible)

    def _show(self, state: State) -> str:
        values = "[" + ", ".join(map(str, state[1])) + "]"
        return f"length {state[0]} slots {values}" if self.track_length else f"slots {values}"

    def _why(self, read: Op, possible: Sequence[State], bitmask: int) -> list[str]:
        """Per observed slot that matches none of the possible states: what kind of anomaly it is, and
        which forced order kept the op that would have explained it out of reach."""
        reasons: list[str] = []
        if self.track_length and read.length is not None and all(s[0] != read.length for s in possible):
            reasons.append(f"length {read.length} matches none of the possible lengths "
                           f"{sorted({s[0] for s in possible})}")
        for s, v in sorted(read.observed.items()):
            if v is None or any(state[1][s] == v for state in possible):
                continue
            there = sorted({state[1][s] for state in possible})
            if v == 0:
                what = "zero: an acknowledged write lost, or a remove/truncate taking effect again"
            else:
                what = "a stale or out-of-order value: no order that fits the other ops leaves it there"
            reasons.append(f"slot {s}: saw {v} but could only hold {there}; {what}")
            writers = [j for j in range(len(self.ops)) if self.kind[j] == _WRITE and self.ops[j].value == v
                       and s in self.ops[j].slots and not bitmask >> j & 1]
            for j in writers[:1]:
                blockers = list(_bits(self.prereq[j] & ~bitmask))
                if not blockers:
                    continue
                later_read, slot, write = self.reasons[(j, blockers[0])]
                if j == write:
                    reasons.append(f"  its write must follow {self.ops[blockers[0]].describe()}, since "
                                   f"{self.ops[later_read].describe()} saw its value in slot {slot}")
                else:
                    reasons.append(f"  its write must follow {self.ops[later_read].describe()}, which saw "
                                   f"{self.ops[write].value} in slot {slot} written before this write began")
        return reasons


def _bits(mask: int) -> Iterator[int]:
    """The indices of the set bits, lowest first."""
    while mask:
        low = mask & -mask
        mask ^= low
        yield low.bit_length() - 1

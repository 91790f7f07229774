"""Linearizability of a history against any sequential model: the Wing-Gong / Lowe search.

:mod:`fs3.sim.linearizability` checks chunk histories with a search specialised to slots. This
module is the same search with the model left open: a model says what the initial state is, what
an operation does to a state and answers there, and whether an observed answer agrees with that.
The metadata simulator (:mod:`fs3.sim.meta`) and its tests check namespace histories with it
against :class:`fs3.sim.namespace.NamespaceModel`.

A history is a list of :class:`Call`. A *completed* call has an answer and must take effect at
one point between its invoke and its completion. A call with no answer (its reply was lost, its
client gave up) may take effect at one point between its invoke and its ``deadline`` — the last
moment the server could still have been running it — or not at all. The search is the classic
one: a depth-first walk over orders of the calls where the next call must be *minimal* (no call
still unplaced completed before it was invoked), remembering every explored ``(set of placed or
dropped calls, model state)`` so that two orders reaching the same place are explored once.
Two reductions keep it fast, and neither can turn a violation into "ok":

* a completed call whose answer says it changed nothing (a read, an error), is minimal, and
  agrees with the current state is placed at once without branching: a call that changes nothing
  and may come before every unplaced call can be moved to the current point of any linearization
  that exists (unless an unanswered call whose deadline passed before it was invoked is still
  unplaced: moving the read would drop that call, so it is then branched on like any other);
* an unanswered call whose deadline passed before the call just placed was invoked can no longer
  take effect: it is dropped, which keeps the sets of calls still open small.

Every explored position is counted; a search that runs out of its budget answers
"inconclusive", never "ok". :func:`shrink` weakens a violating history (drops answers that are not
needed to show the violation) to the few calls a reader needs.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, Protocol, TypeVar

__all__ = ["DEFAULT_BUDGET", "INF", "Call", "Model", "Status", "Verdict", "check_calls", "shrink"]

INF = math.inf

#: Search steps (distinct explored positions) allowed before answering "inconclusive".
DEFAULT_BUDGET = 200_000

Status = Literal["ok", "violation", "inconclusive"]
S = TypeVar("S", bound=Hashable)
_SHOWN_PREFIX = 8  # calls of the longest linearizable prefix named in an explanation
_SHOWN_CONCURRENT = 8


@dataclass
class Call:
    """One operation as a client saw it.

    ``result`` is the answer (a hashable value the model compares), ``None`` while there is none;
    ``complete`` is when it arrived. An unanswered call may take effect up to ``deadline``.
    """

    kind: str
    args: tuple[Any, ...]
    invoke: float
    complete: float = INF
    result: Hashable | None = None
    deadline: float = INF
    client: int = 0
    index: int = -1  # position in the history, set by whoever builds it
    note: str = ""  # shown in explanations (for instance the request id)

    @property
    def completed(self) -> bool:
        return self.result is not None and math.isfinite(self.complete)

    def describe(self) -> str:
        if self.completed:
            when = f"[{self.invoke:.4f}, {self.complete:.4f}] -> {self.result!r}"
        else:
            end = "never answered" if not math.isfinite(self.deadline) else f"could act until {self.deadline:.4f}"
            when = f"[{self.invoke:.4f}, ?] ({end})"
        args = ", ".join(repr(a) for a in self.args)
        note = f" {self.note}" if self.note else ""
        return f"#{self.index} client {self.client} {self.kind}({args}) {when}{note}"


class Model(Protocol[S]):
    """A sequential specification."""

    def initial(self) -> S: ...

    def step(self, state: S, call: Call) -> tuple[S, Hashable]:
        """The state after ``call`` and the answer the specification gives there."""
        ...

    def agrees(self, call: Call, answer: Hashable) -> bool:
        """Whether the observed ``call.result`` is an acceptable form of the specified ``answer``."""
        ...

    def inert(self, call: Call) -> bool:
        """Whether ``call``'s observed answer says it changed nothing (a read, an error)."""
        ...

    def show(self, state: S) -> str: ...


@dataclass(frozen=True)
class Verdict(Generic[S]):
    """The outcome of one search. For "ok" ``witness`` is a linearization of the calls that took
    effect; for a violation, the longest linearizable prefix found and the call that fits nowhere
    after it."""

    status: Status
    problems: tuple[str, ...] = ()
    steps: int = 0
    calls: int = 0
    witness: tuple[Call, ...] = ()
    blocked: Call | None = None
    state: S | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class _Node:
    done: int
    state: Any
    window: int = 0


class _Search(Generic[S]):
    def __init__(self, calls: Sequence[Call], model: Model[S], budget: int) -> None:
        self.model = model
        self.budget = budget
        # An unanswered call whose deadline precedes its invoke never reached the server.
        kept = [c for c in calls if c.completed or c.deadline >= c.invoke]
        kept.sort(key=lambda c: (c.invoke, c.complete if c.completed else INF))
        self.calls = kept
        self.invokes = [c.invoke for c in kept]
        self.required = sorted((i for i, c in enumerate(kept) if c.completed), key=lambda i: (kept[i].complete, i))
        self.inert_mask = 0
        for i, c in enumerate(kept):
            if c.completed and model.inert(c):
                self.inert_mask |= 1 << i
        # Unanswered calls by deadline: the ones whose deadline is before t form a prefix.
        optional = sorted((c.deadline, i) for i, c in enumerate(kept) if not c.completed)
        self.opt_deadlines = [d for d, _ in optional]
        self.opt_prefix = [0]
        for _, i in optional:
            self.opt_prefix.append(self.opt_prefix[-1] | 1 << i)
        self.steps = 0

    def expired(self, t: float) -> int:
        """The unanswered calls whose deadline is before ``t``."""
        return self.opt_prefix[bisect_left(self.opt_deadlines, t)]

    def frontier(self, done: int) -> float | None:
        """The earliest completion among unplaced completed calls (None: all are placed)."""
        for i in self.required:
            if not done >> i & 1:
                return self.calls[i].complete
        return None

    def window(self, done: int, frontier: float) -> int:
        """Unplaced calls invoked no later than ``frontier``: the ones that may come next."""
        hi = bisect_right(self.invokes, frontier)
        return ((1 << hi) - 1) & ~done

    def place(self, done: int, i: int) -> int:
        return done | 1 << i | (self.expired(self.invokes[i]) & ~done)

    def settle(self, node: _Node, path: list[int]) -> bool:
        """Place every inert completed call that fits now; True once every completed call is placed."""
        while True:
            frontier = self.frontier(node.done)
            if frontier is None:
                return True
            node.window = self.window(node.done, frontier)
            progressed = False
            for i in _bits(node.window & self.inert_mask):
                if self.expired(self.invokes[i]) & ~node.done:
                    continue
                call = self.calls[i]
                state, answer = self.model.step(node.state, call)
                if state == node.state and self.model.agrees(call, answer):
                    node.done |= 1 << i
                    path.append(i)
                    progressed = True
            if not progressed:
                return False

    def run(self) -> Verdict[S]:
        path: list[int] = []
        best: list[int] = []
        best_node = _Node(0, self.model.initial())
        memo: set[tuple[int, Hashable]] = set()
        # A frame: (node, children, next child index, calls it added to the path).
        stack: list[tuple[_Node, list[int], list[int], int]] = []

        def enter(node: _Node, added: int) -> bool:
            nonlocal best, best_node
            before = len(path)
            if self.settle(node, path):
                return True
            added += len(path) - before
            key = (node.done, node.state)
            if key in memo:
                del path[len(path) - added:]
                return False
            memo.add(key)
            self.steps += 1
            if len(path) > len(best) or not best:
                best = path.copy()
                best_node = _Node(node.done, node.state, node.window)
            children = list(_bits(node.window))
            # Completed calls first: leaving an unanswered one out is the likelier guess.
            children.sort(key=lambda i: (not self.calls[i].completed, i))
            stack.append((node, children, [0], added))
            return False

        if enter(_Node(0, self.model.initial()), 0):
            return self.ok(path)
        while stack:
            if self.steps >= self.budget:
                return self.inconclusive(best, best_node)
            node, children, cursor, added = stack[-1]
            if cursor[0] == len(children):
                stack.pop()
                del path[len(path) - added:]
                continue
            i = children[cursor[0]]
            cursor[0] += 1
            call = self.calls[i]
            state, answer = self.model.step(node.state, call)
            if call.completed and not self.model.agrees(call, answer):
                continue
            path.append(i)
            if enter(_Node(self.place(node.done, i), state), 1):
                return self.ok(path)
        return self.violation(best, best_node)

    # Verdicts.

    def ok(self, path: list[int]) -> Verdict[S]:
        return Verdict("ok", (), self.steps, len(self.calls), tuple(self.calls[i] for i in path))

    def _blocked(self, node: _Node) -> int | None:
        for i in self.required:
            if not node.done >> i & 1:
                return i
        return None

    def _tail(self, best: list[int], node: _Node) -> list[str]:
        lines: list[str] = []
        if best:
            tail = best[-_SHOWN_PREFIX:]
            skipped = f", the last {len(tail)} of {len(best)}" if len(best) > len(tail) else ""
            lines.append(f"  end of that prefix{skipped}:")
            lines.extend(f"    {self.calls[i].describe()}" for i in tail)
        lines.append(f"  state after it: {self.model.show(node.state)}")
        return lines

    def inconclusive(self, best: list[int], node: _Node) -> Verdict[S]:
        optional = sum(1 for c in self.calls if not c.completed)
        text = (f"search budget of {self.budget} steps ran out after placing at most {len(best)} of "
                f"{len(self.calls)} calls ({optional} of them unanswered)")
        blocked = self._blocked(node)
        if blocked is not None:
            text += f"; the deepest point waited on: {self.calls[blocked].describe()}"
        return Verdict("inconclusive", (text,), self.steps, len(self.calls), tuple(self.calls[i] for i in best),
                       state=node.state)

    def violation(self, best: list[int], node: _Node) -> Verdict[S]:
        lines = [f"not linearizable: the longest linearizable prefix places {len(best)} of {len(self.calls)} "
                 f"calls, then nothing fits ({self.steps} search steps)"]
        blocked = self._blocked(node)
        call = self.calls[blocked] if blocked is not None else None
        if call is not None:
            _, answer = self.model.step(node.state, call)
            lines.append(f"  cannot place: {call.describe()}")
            lines.append(f"  the model answers {answer!r} there")
        lines.extend(self._tail(best, node))
        concurrent = [self.calls[i].describe() for i in _bits(node.window) if i != blocked]
        if concurrent:
            lines.append("  other calls that could still be placed there:")
            lines.extend(f"    {text}" for text in concurrent[:_SHOWN_CONCURRENT])
            if len(concurrent) > _SHOWN_CONCURRENT:
                lines.append(f"    ... and {len(concurrent) - _SHOWN_CONCURRENT} more")
        return Verdict("violation", ("\n".join(lines),), self.steps, len(self.calls),
                       tuple(self.calls[i] for i in best), call, node.state)


def check_calls(calls: Sequence[Call], model: Model[S], budget: int = DEFAULT_BUDGET) -> Verdict[S]:
    """Whether ``calls`` are linearizable against ``model``, searching at most ``budget`` positions."""
    if budget <= 0:
        raise ValueError("the search budget must be positive")
    return _Search(calls, model, budget).run()


def shrink(calls: Sequence[Call], model: Model[S], budget: int = 5_000, total: int = 300_000,
           related: Callable[[Call, Call], bool] | None = None) -> list[Call]:
    """A small history that still shows the violation of ``calls`` (for a report, not a proof).

    Only weakenings are tried, so every history it keeps is implied by the original: calls invoked
    after the blocked call was answered are cut off, then a completed call whose answer changed
    nothing (a read, an error) is dropped, and a completed call that changed something loses its
    answer (it may then have taken effect or not) — in halves, then quarters, down to single calls (delta debugging),
    each step kept only if the search still finds a violation within ``budget`` steps, until
    ``total`` steps are spent. Returned: the completed calls left,
    plus the unanswered calls ``related`` to one of them (by default: sharing an argument) whose
    time overlaps theirs, in history order.
    """
    verdict = check_calls(calls, model, DEFAULT_BUDGET)
    if verdict.status != "violation":
        return list(calls)
    spent = verdict.steps

    def fails(candidate: list[Call]) -> bool:
        nonlocal spent
        result = check_calls(candidate, model, budget)
        spent += result.steps
        return result.status == "violation"

    current = list(calls)
    if verdict.blocked is not None:
        end = verdict.blocked.complete
        cut = [c for c in current if c.invoke <= end]
        if len(cut) < len(current) and fails(cut):
            current = cut
    for inert in (True, False):
        # Halves first, then quarters, down to single calls (delta debugging): most calls are noise.
        targets = sorted((c for c in current if c.completed and model.inert(c) == inert), key=lambda c: -c.invoke)
        size = max(1, len(targets) // 2)
        while targets and spent < total:
            kept: list[Call] = []
            for start in range(0, len(targets), size):
                if spent >= total:
                    kept.extend(targets[start:])
                    break
                group = {id(c) for c in targets[start:start + size]}
                weaker = [_weaken(c) if id(c) in group and not inert else c
                          for c in current if not (id(c) in group and inert)]
                if fails(weaker):
                    current = weaker
                else:
                    kept.extend(targets[start:start + size])
            if size == 1:
                break
            targets, size = kept, max(1, size // 2)
    answered = [c for c in current if c.completed]
    if not answered:
        return current
    related = related or _share_arguments
    first = min(c.invoke for c in answered)
    last = max(c.complete for c in answered)
    kept = [c for c in current if c.completed or (c.invoke <= last and c.deadline >= first
                                                  and any(related(c, a) for a in answered))]
    return sorted(kept, key=lambda c: (c.invoke, c.index))


def _weaken(call: Call) -> Call:
    """The call with its answer forgotten: it may have taken effect before its completion, or not."""
    return replace(call, result=None, deadline=call.complete, note=f"{call.note} (answer dropped)".strip())


def _share_arguments(a: Call, b: Call) -> bool:
    return bool(set(map(repr, a.args)) & set(map(repr, b.args)))


def _bits(mask: int) -> Iterator[int]:
    """The indices of the set bits, lowest first."""
    while mask:
        low = mask & -mask
        mask ^= low
        yield low.bit_length() - 1

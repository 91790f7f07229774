"""The target state machine of the 3FS design notes, as one table and two pure functions.

A storage target has a *public* state (what clients and chain peers may do with it) and a
*local* state (what its storage node reports). mgmtd periodically feeds every chain's local
states through :func:`update_chain`, which applies :data:`TRANSITIONS` to each target and
rebuilds the chain order: serving targets first (the write path), then syncing, waiting,
lastsrv and offline. The chain version bumps whenever the order or any public state changes.

Reading of the table's "predecessor" column (see docs/decisions.md):

* online rows: the predecessor is the target just before this one on the new write path; a
  waiting target starts syncing only behind a serving one, which is what keeps at most one
  syncing target per chain.
* the offline row of a serving target: "has no predecessor" means no other target of the chain
  stays serving, i.e. this was the last serving replica. If several serving targets fail at
  once, the one furthest down the chain (it committed first) becomes lastsrv.

This module imports no transport, clock or randomness.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fs3.common.invariant import ensure
from fs3.common.target_state import LocalState, PublicState

__all__ = [
    "TRANSITIONS",
    "ChainUpdate",
    "Predecessor",
    "next_public_state",
    "transition_table_markdown",
    "update_chain",
]


class Predecessor(enum.Enum):
    """The condition column of the transition table."""

    ANY = "(any)"
    SERVING = "serving"
    NOT_SERVING = "not serving"
    NONE = "has no predecessor"
    SOME = "has predecessor"


P, L, C = PublicState, LocalState, Predecessor

# (local state, current public state) -> [(predecessor condition, next public state)], in the
# order of the design notes. Exactly one condition matches any predecessor.
TRANSITIONS: dict[tuple[LocalState, PublicState], tuple[tuple[Predecessor, PublicState], ...]] = {
    (L.UP_TO_DATE, P.SERVING): ((C.ANY, P.SERVING),),
    (L.UP_TO_DATE, P.SYNCING): ((C.ANY, P.SERVING),),
    (L.UP_TO_DATE, P.WAITING): ((C.ANY, P.WAITING),),
    (L.UP_TO_DATE, P.LASTSRV): ((C.ANY, P.SERVING),),
    (L.UP_TO_DATE, P.OFFLINE): ((C.ANY, P.WAITING),),
    (L.ONLINE, P.SERVING): ((C.ANY, P.SERVING),),
    (L.ONLINE, P.SYNCING): ((C.SERVING, P.SYNCING), (C.NOT_SERVING, P.WAITING)),
    (L.ONLINE, P.WAITING): ((C.SERVING, P.SYNCING), (C.NOT_SERVING, P.WAITING)),
    (L.ONLINE, P.LASTSRV): ((C.ANY, P.SERVING),),
    (L.ONLINE, P.OFFLINE): ((C.ANY, P.WAITING),),
    (L.OFFLINE, P.SERVING): ((C.NONE, P.LASTSRV), (C.SOME, P.OFFLINE)),
    (L.OFFLINE, P.SYNCING): ((C.ANY, P.OFFLINE),),
    (L.OFFLINE, P.WAITING): ((C.ANY, P.OFFLINE),),
    (L.OFFLINE, P.LASTSRV): ((C.ANY, P.LASTSRV),),
    (L.OFFLINE, P.OFFLINE): ((C.ANY, P.OFFLINE),),
}


def _matches(condition: Predecessor, predecessor: PublicState | None) -> bool:
    if condition is C.ANY:
        return True
    if condition is C.SERVING:
        return predecessor is P.SERVING
    if condition is C.NOT_SERVING:
        return predecessor is not P.SERVING
    if condition is C.NONE:
        return predecessor is None
    return predecessor is not None


def next_public_state(local: LocalState, current: PublicState, predecessor: PublicState | None) -> PublicState:
    """One row of the table. ``predecessor`` is the predecessor's public state, None if it has none."""
    rows = TRANSITIONS[(local, current)]
    matched = [nxt for condition, nxt in rows if _matches(condition, predecessor)]
    ensure(len(matched) == 1, f"transition table ambiguous for {local.name}/{current.name}/{predecessor}")
    return matched[0]


_ORDER = {P.SERVING: 0, P.SYNCING: 1, P.WAITING: 2, P.LASTSRV: 3, P.OFFLINE: 4}


@dataclass(frozen=True)
class ChainUpdate:
    """The result of one scan of a chain."""

    target_ids: tuple[int, ...]
    states: Mapping[int, PublicState]
    chain_version: int
    changed: bool


def update_chain(
    target_ids: Sequence[int],
    states: Mapping[int, PublicState],
    local_states: Mapping[int, LocalState],
    chain_version: int,
) -> ChainUpdate:
    """Apply the transition table to every target of a chain and rebuild its order.

    ``target_ids`` is the current order (head first). Returns the new order, states and version.
    """
    ensure(len(set(target_ids)) == len(target_ids), "a chain lists a target twice")
    new: dict[int, PublicState] = {}
    # Pass 1: rows that do not depend on the write path. A failing serving target provisionally
    # "has a predecessor"; the lastsrv rule below fixes the chain's last serving one.
    failed_serving: list[int] = []
    for tid in target_ids:
        local, current = local_states[tid], states[tid]
        if local is L.ONLINE and current in (P.SYNCING, P.WAITING):
            continue  # decided in pass 2, once the write path is known
        if local is L.OFFLINE and current is P.SERVING:
            failed_serving.append(tid)
            new[tid] = next_public_state(local, current, P.SERVING)
        else:
            new[tid] = next_public_state(local, current, None)  # every remaining row reads "(any)"
    if failed_serving and not any(s is P.SERVING for s in new.values()):
        last = failed_serving[-1]
        new[last] = next_public_state(L.OFFLINE, P.SERVING, None)
    # Pass 2: syncing/waiting targets that are online, in chain order, behind the write path.
    path = [tid for tid in target_ids if new.get(tid) is P.SERVING]
    for tid in target_ids:
        if tid in new:
            continue
        predecessor = new[path[-1]] if path else None
        nxt = next_public_state(local_states[tid], states[tid], predecessor)
        new[tid] = nxt
        if nxt is P.SYNCING:
            path.append(tid)
    order = tuple(sorted(target_ids, key=lambda t: _ORDER[new[t]]))  # stable: keeps relative order
    ensure(sum(1 for s in new.values() if s is P.SYNCING) <= 1, "more than one syncing target in a chain")
    changed = order != tuple(target_ids) or any(new[t] is not states[t] for t in target_ids)
    return ChainUpdate(order, new, chain_version + 1 if changed else chain_version, changed)


def transition_table_markdown() -> str:
    """The table as Markdown, generated from :data:`TRANSITIONS` for docs/architecture.md."""
    lines = ["| Local state | Current public state | Predecessor | Next public state |", "|---|---|---|---|"]
    names = {L.UP_TO_DATE: "up-to-date", L.ONLINE: "online", L.OFFLINE: "offline"}
    for (local, current), rows in TRANSITIONS.items():
        for condition, nxt in rows:
            lines.append(f"| {names[local]} | {current.name.lower()} | {condition.value} | {nxt.name.lower()} |")
    return "\n".join(lines)

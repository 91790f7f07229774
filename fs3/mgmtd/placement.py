"""Replica moves (drain, rebalance, replacing a failed target) as pure decisions.

A *move* takes one replica of a chain from a source target to a destination target on another
node, always in this order: the destination joins the chain (waiting, then syncing behind the
serving targets, as a restarted target does), it becomes serving, and only then is the source
fenced and taken out. So a chain never has fewer serving replicas than it had targets when the
move was planned (``Move.replicas``) because of a move — unless the operator forced it, or no
other node can take the replica (then the drain is refused, or waits).

An *add-only* move (``source`` 0, reason ``regrow``) gives a chain back the replica a forced
drain took away: the destination joins and syncs, and once it serves the move is done — nothing
is fenced or removed. The count a chain regrows to is the one the forced drain recorded
(:attr:`MoveBook.short_chains`: ``Move.replicas`` of the forced move), not the chain table's
(tables may hold explicit chains of different lengths, and store no count of their own).

mgmtd (:mod:`fs3.mgmtd.state`) feeds a :class:`Cluster` snapshot and each move to :func:`step`
on every scan and carries out the :class:`Action` it returns; the plans (:func:`plan_drain`,
:func:`plan_rebalance`) and the replacement rule (:func:`pick_replacement`) are functions of the
snapshot alone. The project has no failure domains above the node, so "failure-domain aware"
here means: never two replicas of a chain on one node.

This module imports no transport, clock or randomness (see ``pure-cores`` in docs/architecture.md).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from fs3.common.target_state import PublicState

__all__ = [
    "MOVE_ATTEMPTS_MAX",
    "REBALANCE_MOVES_MAX",
    "Action",
    "ActionKind",
    "Cluster",
    "DrainPlan",
    "Move",
    "MoveBook",
    "Phase",
    "cancel",
    "chain_serving",
    "decode_book",
    "encode_book",
    "node_load",
    "pick_replacement",
    "plan_drain",
    "plan_rebalance",
    "removal_allowed",
    "step",
]

# Replacements tried for one move before it is reported failed (each one a node that died or
# whose target failed while syncing).
MOVE_ATTEMPTS_MAX = 5
# The most moves one rebalance plans (bounded work per call; run it again for more).
REBALANCE_MOVES_MAX = 10_000


class Phase(enum.Enum):
    PENDING = "pending"      # no destination in the chain yet
    SYNCING = "syncing"      # the destination is in the chain, not serving yet
    REMOVING = "removing"    # the destination serves; the source is being fenced and taken out
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Move:
    """One replica move; persisted by mgmtd as it advances."""

    chain_id: int
    source: int                   # 0: an add-only move (regrow a short chain): nothing leaves
    dest: int = 0                 # 0: none chosen yet
    replicas: int = 0             # the chain's target count when planned: the floor of serving replicas
    reason: str = "drain"         # drain, rebalance, undrain, regrow
    phase: Phase = Phase.PENDING
    attempts: int = 0             # destinations tried
    avoid_nodes: tuple[int, ...] = ()  # nodes whose destination failed
    force: bool = False
    note: str = ""

    @property
    def active(self) -> bool:
        return self.phase not in (Phase.DONE, Phase.FAILED)


@dataclass(frozen=True)
class Cluster:
    """What the decisions read: liveness, placement and public states."""

    nodes: Mapping[int, bool]                   # storage node id -> alive
    targets: Mapping[int, int]                  # target id -> its node id
    chains: Mapping[int, tuple[int, ...]]       # chain id -> its targets, in chain order
    states: Mapping[int, PublicState]           # a chained target's public state
    draining_nodes: frozenset[int] = frozenset()
    draining_targets: frozenset[int] = frozenset()
    # Targets their node reports offline (a failed disk), or has not reported since mgmtd started:
    # never chosen as a destination.
    unready: frozenset[int] = frozenset()

    def chain_of(self) -> dict[int, int]:
        return {t: c for c, ids in self.chains.items() for t in ids}

    def state(self, target_id: int) -> PublicState:
        return self.states.get(target_id, PublicState.OFFLINE)

    def alive(self, target_id: int) -> bool:
        return self.nodes.get(self.targets.get(target_id, 0), False)

    def draining(self, target_id: int) -> bool:
        return target_id in self.draining_targets or self.targets.get(target_id) in self.draining_nodes


class ActionKind(enum.Enum):
    WAIT = "wait"            # nothing to do this scan
    ADD = "add"              # put ``target`` into the chain (waiting), as the move's destination
    DROP_DEST = "drop-dest"  # take the destination ``target`` back out (it failed or was cancelled)
    FENCE = "fence"          # fence ``target`` (the source): its node stops serving it
    REMOVE = "remove"        # take ``target`` (the source, now off the write path) out of the chain
    UPDATE = "update"        # only the move changed (a destination chosen, a note, done, failed)


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    move: Move                # the move as it stands after the action
    target: int = 0


@dataclass(frozen=True)
class DrainPlan:
    moves: tuple[Move, ...] = ()
    refusals: tuple[str, ...] = ()


def chain_serving(cluster: Cluster, chain_id: int, without: int = 0) -> int:
    """The chain's serving targets, not counting ``without``."""
    return sum(1 for t in cluster.chains.get(chain_id, ()) if t != without and cluster.state(t) is PublicState.SERVING)


def removal_allowed(cluster: Cluster, move: Move) -> bool:
    """The invariant: the source may stop serving only if the chain keeps ``move.replicas`` serving
    targets without it, or, for a forced move, at least one: force gives up a replica, never the
    last good copy."""
    return chain_serving(cluster, move.chain_id, without=move.source) >= (1 if move.force else move.replicas)


def node_load(cluster: Cluster) -> dict[int, int]:
    """Chain replicas per storage node (every node, 0 for one that holds none)."""
    load = dict.fromkeys(cluster.nodes, 0)
    for ids in cluster.chains.values():
        for t in ids:
            node = cluster.targets.get(t)
            if node is not None:
                load[node] = load.get(node, 0) + 1
    return load


def _free_targets(cluster: Cluster, reserved: Iterable[int] = ()) -> list[int]:
    chained = cluster.chain_of()
    taken = set(reserved)
    return sorted(t for t in cluster.targets if t not in chained and t not in taken and cluster.alive(t)
                  and not cluster.draining(t) and t not in cluster.unready)


def pick_replacement(cluster: Cluster, chain_id: int, avoid_nodes: Iterable[int] = (),
                     reserved: Iterable[int] = (), load: Mapping[int, int] | None = None) -> int | None:
    """The target that takes a replica of ``chain_id``: a free target on a live, undrained node
    that holds no replica of the chain and is not in ``avoid_nodes``, on the least loaded such
    node (ties: lowest node id, then lowest target id). None when there is none."""
    load = node_load(cluster) if load is None else load
    members = {cluster.targets.get(t) for t in cluster.chains.get(chain_id, ())}
    avoid = set(avoid_nodes) | members
    candidates = [t for t in _free_targets(cluster, reserved) if cluster.targets[t] not in avoid]
    if not candidates:
        return None
    return min(candidates, key=lambda t: (load.get(cluster.targets[t], 0), cluster.targets[t], t))


def plan_drain(cluster: Cluster, node_ids: Iterable[int] = (), target_ids: Iterable[int] = (),
               force: bool = False, busy_chains: Iterable[int] = ()) -> DrainPlan:
    """The moves that empty ``node_ids`` and ``target_ids`` (the cluster already marks them draining).

    Each chained target gets a destination chosen now, counting the ones already chosen; a target
    none can replace is a refusal, or (``force``) a move with no destination that takes the
    replica away. Chains in ``busy_chains`` (a move already runs there) are refused too.
    """
    refusals: list[str] = []
    for node in node_ids:
        if node not in cluster.nodes:
            refusals.append(f"node {node} is not a registered storage node")
    for target in target_ids:
        if target not in cluster.targets:
            refusals.append(f"target {target} is not registered")
    if refusals:
        return DrainPlan(refusals=tuple(refusals))
    nodes = set(node_ids)
    leaving = sorted({t for t, n in cluster.targets.items() if n in nodes} | set(target_ids))
    chain_of = cluster.chain_of()
    busy = set(busy_chains)
    load = node_load(cluster)
    reserved: list[int] = []
    moves: list[Move] = []
    for target in leaving:
        chain_id = chain_of.get(target)
        if chain_id is None:
            continue  # holds no replica: nothing to move
        if chain_id in busy:
            refusals.append(f"chain {chain_id} already has a replica move in progress; retry when it is done")
            continue
        replicas = len(cluster.chains[chain_id])
        dest = pick_replacement(cluster, chain_id, reserved=reserved, load=load)
        if dest is None and force and replicas < 2:
            refusals.append(f"target {target} holds the only replica of chain {chain_id} and no node can take "
                            f"it: --force would lose the chain's data (add a storage node)")
            continue
        if dest is None and not force:
            refusals.append(f"no node can take the replica of chain {chain_id} on target {target}: every live, "
                            f"undrained node with a free target already holds one of its {replicas} replicas "
                            f"(add a storage node, or --force to leave the chain with {replicas - 1})")
            continue
        if dest is not None:
            reserved.append(dest)
            load[cluster.targets[dest]] = load.get(cluster.targets[dest], 0) + 1
        busy.add(chain_id)
        moves.append(Move(chain_id, target, dest or 0, replicas, "drain", force=dest is None and force))
    return DrainPlan(tuple(moves), tuple(refusals))


def plan_rebalance(cluster: Cluster, max_moves: int = 0, busy_chains: Iterable[int] = (),
                   short_chains: Mapping[int, int] | None = None) -> list[Move]:
    """Add-only moves for the chains short of their count, then moves from the most to the least
    loaded nodes until their loads differ by at most one.

    ``short_chains`` maps a chain to the target count it should have (what a forced drain left it
    short of); each such chain with fewer targets, not busy and with a serving target to sync from,
    gets one add-only move whose destination is :func:`pick_replacement`'s. Only chains whose every
    target serves are moved (one move per chain); a node is a destination only while it has a free
    target. At most ``max_moves`` in all (0: up to :data:`REBALANCE_MOVES_MAX`).
    """
    limit = min(max_moves or REBALANCE_MOVES_MAX, REBALANCE_MOVES_MAX)
    chains = {c: list(ids) for c, ids in cluster.chains.items()}
    load = node_load(cluster)
    busy = set(busy_chains)
    reserved: list[int] = []
    moves: list[Move] = []
    for chain_id, count in sorted((short_chains or {}).items()):
        ids = chains.get(chain_id)
        if len(moves) >= limit or ids is None or len(ids) >= count or chain_id in busy \
                or chain_serving(cluster, chain_id) == 0:
            continue
        dest = pick_replacement(cluster, chain_id, reserved=reserved, load=load)
        if dest is None:
            continue  # no node can take it yet: a later rebalance, after capacity is added
        moves.append(Move(chain_id, 0, dest, len(ids), "regrow"))
        busy.add(chain_id)
        reserved.append(dest)
        chains[chain_id].append(dest)
        load[cluster.targets[dest]] = load.get(cluster.targets[dest], 0) + 1
    while len(moves) < limit:
        view = replace(cluster, chains={c: tuple(ids) for c, ids in chains.items()})
        free = _free_targets(view, reserved)
        free_nodes = {cluster.targets[t] for t in free}
        sources = [n for n in sorted(load, key=lambda n: (-load[n], n))
                   if cluster.nodes.get(n) and n not in cluster.draining_nodes]
        chosen: Move | None = None
        for dest_node in sorted(free_nodes, key=lambda n: (load[n], n)):
            for src_node in sources:
                if load[src_node] - load[dest_node] <= 1:
                    break
                for chain_id in sorted(chains):
                    ids = chains[chain_id]
                    if chain_id in busy or any(cluster.targets.get(t) == dest_node for t in ids):
                        continue
                    if any(view.state(t) is not PublicState.SERVING for t in ids):
                        continue
                    src = next((t for t in ids if cluster.targets.get(t) == src_node), None)
                    if src is None or cluster.draining(src):
                        continue
                    dest = min(t for t in free if cluster.targets[t] == dest_node)
                    chosen = Move(chain_id, src, dest, len(ids), "rebalance")
                    break
                if chosen:
                    break
            if chosen:
                break
        if chosen is None:
            return moves
        moves.append(chosen)
        busy.add(chosen.chain_id)
        reserved.append(chosen.dest)
        chains[chosen.chain_id] = [chosen.dest if t == chosen.source else t for t in chains[chosen.chain_id]]
        load[cluster.targets[chosen.source]] -= 1
        load[cluster.targets[chosen.dest]] += 1
    return moves


def _retry(cluster: Cluster, move: Move, why: str) -> Action:
    """The destination failed: take it back out; the next scan picks another one."""
    attempts = move.attempts + 1
    avoid = tuple(sorted(set(move.avoid_nodes) | {cluster.targets.get(move.dest, 0)}))
    if attempts >= MOVE_ATTEMPTS_MAX:
        moved = replace(move, dest=0, phase=Phase.FAILED, attempts=attempts, avoid_nodes=avoid,
                        note=f"{why}; gave up after {attempts} destinations")
    else:
        moved = replace(move, dest=0, phase=Phase.PENDING, attempts=attempts, avoid_nodes=avoid,
                        note=f"{why}; choosing another destination")
    return Action(ActionKind.DROP_DEST, moved, move.dest)


def step(cluster: Cluster, move: Move) -> Action:
    """The next thing to do for ``move`` given the cluster now (one action per call)."""
    if not move.active:
        return Action(ActionKind.WAIT, move)
    chain = cluster.chains.get(move.chain_id)
    if chain is None:
        return Action(ActionKind.UPDATE, replace(move, phase=Phase.FAILED, note=f"chain {move.chain_id} is gone"))
    if move.source == 0:
        return _step_add(cluster, move, chain)
    if move.source not in chain:
        if move.dest and move.dest in chain and cluster.state(move.dest) is not PublicState.SERVING:
            # The source left by other means (an operator); the destination still syncs: keep it.
            return Action(ActionKind.WAIT, replace(move, phase=Phase.SYNCING, note="source already out"))
        return Action(ActionKind.UPDATE, replace(move, phase=Phase.DONE, note=""))
    if move.dest == 0:
        if move.force:
            return _remove_source(cluster, move)
        dest = pick_replacement(cluster, move.chain_id, avoid_nodes=move.avoid_nodes)
        if dest is None:
            dest = pick_replacement(cluster, move.chain_id)  # an avoided node may be back
        if dest is None:
            note = f"no live node without a replica of chain {move.chain_id} has a free target"
            return Action(ActionKind.WAIT if move.note == note else ActionKind.UPDATE, replace(move, note=note))
        return Action(ActionKind.UPDATE, replace(move, dest=dest, note=""))
    if move.dest not in chain:
        if move.phase is not Phase.PENDING:  # it was in the chain and was taken out by other means
            return _retry(cluster, move, f"target {move.dest} left the chain while syncing")
        if not cluster.alive(move.dest) or move.dest in cluster.chain_of() or cluster.draining(move.dest) \
                or move.dest in cluster.unready:
            return Action(ActionKind.UPDATE, replace(move, dest=0, note=f"target {move.dest} is no longer free"))
        return Action(ActionKind.ADD, replace(move, phase=Phase.SYNCING, note=""), move.dest)
    dest_state = cluster.state(move.dest)
    if dest_state is PublicState.SERVING:
        return _remove_source(cluster, replace(move, phase=Phase.REMOVING))
    if move.phase is Phase.REMOVING:
        # The destination failed after the source was fenced: the chain waits for either to come back.
        if not cluster.state(move.source).writable and removal_allowed(cluster, move):
            return Action(ActionKind.REMOVE, move, move.source)
        if cluster.state(move.source).writable \
                and (dest_state in (PublicState.OFFLINE, PublicState.LASTSRV) or not cluster.alive(move.dest)):
            # The source serves again (its fence ended before it could leave): the chain has its
            # count without the destination, so a dead one is replaced rather than waited for.
            return _retry(cluster, move, f"target {move.dest} failed after the source was fenced")
        return Action(ActionKind.WAIT, replace(move, note=f"target {move.dest} stopped serving"))
    if dest_state in (PublicState.OFFLINE, PublicState.LASTSRV) or not cluster.alive(move.dest):
        return _retry(cluster, move, f"target {move.dest} failed while syncing")
    return Action(ActionKind.WAIT, replace(move, phase=Phase.SYNCING))


def _step_add(cluster: Cluster, move: Move, chain: tuple[int, ...]) -> Action:
    """An add-only move: the destination joins and syncs; serving, it is done (nothing leaves)."""
    if move.dest and move.dest in chain:
        dest_state = cluster.state(move.dest)
        if dest_state is PublicState.SERVING:
            return Action(ActionKind.UPDATE, replace(move, phase=Phase.DONE, note=""))
        if dest_state in (PublicState.OFFLINE, PublicState.LASTSRV) or not cluster.alive(move.dest):
            return _retry(cluster, move, f"target {move.dest} failed while syncing")
        return Action(ActionKind.WAIT, replace(move, phase=Phase.SYNCING))
    if move.phase is not Phase.PENDING:  # it was in the chain and was taken out by other means
        return _retry(cluster, move, f"target {move.dest} left the chain while syncing")
    if len(chain) > move.replicas:
        return Action(ActionKind.UPDATE, replace(move, dest=0, phase=Phase.DONE,
                                                 note=f"chain {move.chain_id} already has {len(chain)} targets"))
    if move.dest == 0 or not cluster.alive(move.dest) or move.dest in cluster.chain_of() \
            or cluster.draining(move.dest) or move.dest in cluster.unready:
        dest = pick_replacement(cluster, move.chain_id, avoid_nodes=move.avoid_nodes)
        if dest is None:
            dest = pick_replacement(cluster, move.chain_id)  # an avoided node may be back
        if dest is None:
            note = f"no live node without a replica of chain {move.chain_id} has a free target"
            return Action(ActionKind.WAIT if move.note == note else ActionKind.UPDATE,
                          replace(move, dest=0, note=note))
        return Action(ActionKind.UPDATE, replace(move, dest=dest, note=""))
    return Action(ActionKind.ADD, replace(move, phase=Phase.SYNCING, note=""), move.dest)


def _remove_source(cluster: Cluster, move: Move) -> Action:
    if not removal_allowed(cluster, move):
        note = (f"chain {move.chain_id} would keep {chain_serving(cluster, move.chain_id, move.source)} serving "
                f"replicas without target {move.source}, fewer than {move.replicas}")
        return Action(ActionKind.WAIT, replace(move, note=note))
    if cluster.state(move.source).writable and cluster.alive(move.source):
        return Action(ActionKind.FENCE, replace(move, phase=Phase.REMOVING), move.source)
    return Action(ActionKind.REMOVE, replace(move, phase=Phase.REMOVING), move.source)


def cancel(cluster: Cluster, move: Move) -> tuple[Action, Move | None]:
    """Undo a move that has not taken its source out: the destination leaves, the source stays.

    Returns the action now and the move that continues (a destination that already serves is
    taken out by the same fence-then-remove as a source, so the chain stays at its count), or None.
    """
    chain = cluster.chains.get(move.chain_id, ())
    if not move.active or move.phase is Phase.REMOVING or move.source not in chain:
        return Action(ActionKind.WAIT, move), None  # past the point of return: it finishes
    stopped = replace(move, phase=Phase.DONE, note="cancelled")
    if move.dest == 0 or move.dest not in chain:
        return Action(ActionKind.UPDATE, stopped), None
    if cluster.state(move.dest) is not PublicState.SERVING:
        return Action(ActionKind.DROP_DEST, stopped, move.dest), None
    back = Move(move.chain_id, move.dest, move.source, move.replicas, "undrain", Phase.SYNCING)
    return Action(ActionKind.UPDATE, stopped), back


@dataclass
class MoveBook:
    """The moves mgmtd keeps (active ones and the last finished ones), with the draining sets."""

    moves: list[Move] = field(default_factory=list)
    draining_nodes: set[int] = field(default_factory=set)
    draining_targets: set[int] = field(default_factory=set)
    resync_rate_bytes_per_s: int = 0
    # chain id -> the target count a forced drain left it short of: rebalance regrows it.
    short_chains: dict[int, int] = field(default_factory=dict)

    def busy_chains(self) -> set[int]:
        return {m.chain_id for m in self.moves if m.active}


# The stored form's version: a reader refuses a book written in a format it does not know.
BOOK_FORMAT = 1


def encode_book(book: MoveBook) -> bytes:
    """The book as mgmtd stores it (JSON: a handful of moves, rewritten whole when one changes)."""
    moves = [{"chain": m.chain_id, "source": m.source, "dest": m.dest, "replicas": m.replicas, "reason": m.reason,
              "phase": m.phase.value, "attempts": m.attempts, "avoid": list(m.avoid_nodes), "force": m.force,
              "note": m.note} for m in book.moves]
    return json.dumps({"format": BOOK_FORMAT, "moves": moves, "draining_nodes": sorted(book.draining_nodes),
                       "draining_targets": sorted(book.draining_targets),
                       "resync_rate_bytes_per_s": book.resync_rate_bytes_per_s,
                       "short_chains": {str(c): n for c, n in sorted(book.short_chains.items())}},
                      sort_keys=True).encode()


def decode_book(raw: bytes) -> MoveBook:
    doc = json.loads(raw)
    if doc.get("format") != BOOK_FORMAT:
        raise ValueError(f"replica-move record format {doc.get('format')!r}; this mgmtd reads {BOOK_FORMAT}")
    moves = [Move(int(m["chain"]), int(m["source"]), int(m["dest"]), int(m["replicas"]), str(m["reason"]),
                  Phase(m["phase"]), int(m["attempts"]), tuple(int(n) for n in m["avoid"]), bool(m["force"]),
                  str(m["note"])) for m in doc["moves"]]
    # (A book written before short chains were recorded has none.)
    short = {int(c): int(n) for c, n in doc.get("short_chains", {}).items()}
    return MoveBook(moves, {int(n) for n in doc["draining_nodes"]}, {int(t) for t in doc["draining_targets"]},
                    int(doc["resync_rate_bytes_per_s"]), short)

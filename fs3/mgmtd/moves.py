"""mgmtd's replica moves (drain, undrain, rebalance): the shell around :mod:`fs3.mgmtd.placement`.

The decisions are placement's; this module builds its :class:`~fs3.mgmtd.placement.Cluster`
snapshot from :class:`~fs3.mgmtd.state.MgmtdState`, carries out the action each move asks for
on every scan (a destination joins its chain as waiting, a source is fenced, then removed), and
keeps the moves and the draining sets in mgmtd's store (``moves/book``), so a restarted mgmtd
resumes where it stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3.common.errors import InvalidArgument, NotFound
from fs3.common.target_state import LocalState, PublicState
from fs3.mgmtd.limits import CHAIN_REPLICAS_MAX
from fs3.mgmtd.placement import (
    ActionKind,
    Cluster,
    Move,
    MoveBook,
    cancel,
    decode_book,
    encode_book,
    plan_drain,
    plan_rebalance,
    step,
)

if TYPE_CHECKING:
    from fs3.mgmtd.state import MgmtdState

__all__ = ["MoveDriver"]

log = logging.getLogger(__name__)

# Finished moves kept for `fs3 admin drain status` (the oldest go first).
_FINISHED_KEPT = 256
# Actions one move may take in one scan (a fence, then nothing until its node answers).
_STEPS_PER_SCAN = 4


class MoveDriver:
    """The moves mgmtd is carrying out, and what is being drained."""

    def __init__(self) -> None:
        self.book = MoveBook()
        self.dirty = False  # the book changed since it was last persisted

    # -- persistence -------------------------------------------------------------------------

    def install(self, raws: list[bytes]) -> None:
        if raws:
            try:
                self.book = decode_book(raws[-1])
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidArgument(f"mgmtd cannot read its stored replica moves: {exc}") from exc
            log.info("replica moves resumed: %d active, draining nodes %s, targets %s",
                     len(self.book.busy_chains()), sorted(self.book.draining_nodes),
                     sorted(self.book.draining_targets))

    def encode(self) -> bytes:
        return encode_book(self.book)

    # -- the snapshot ------------------------------------------------------------------------

    def cluster(self, state: MgmtdState) -> Cluster:
        storage = {n: r.alive for n, r in state.nodes.items() if r.info.node_type == cpb.NODE_STORAGE}
        storage.update({t.info.node_id: state.nodes[t.info.node_id].alive for t in state.targets.values()
                        if t.info.node_id in state.nodes})
        return Cluster(
            nodes=storage,
            targets={tid: t.info.node_id for tid, t in state.targets.items()},
            chains={cid: tuple(c.target_ids) for cid, c in state.chains.items()},
            states={tid: t.public_state for tid, t in state.targets.items() if t.info.chain_id},
            draining_nodes=frozenset(self.book.draining_nodes),
            draining_targets=frozenset(self.book.draining_targets),
            unready=frozenset(tid for tid, t in state.targets.items() if t.local_state is LocalState.OFFLINE),
        )

    # -- operator requests -------------------------------------------------------------------

    def drain(self, state: MgmtdState, node_ids: Iterable[int], target_ids: Iterable[int], force: bool) -> str:
        nodes, targets = sorted(set(node_ids)), sorted(set(target_ids))
        if not nodes and not targets:
            raise InvalidArgument("name a node or a target to drain")
        cluster = self.cluster(state)
        for node in nodes:
            if node not in cluster.nodes:
                raise NotFound(f"node {node} is not a registered storage node")
        for target in targets:
            if target not in cluster.targets:
                raise NotFound(f"target {target} is not registered")
        cluster = replace(cluster, draining_nodes=cluster.draining_nodes | set(nodes),
                          draining_targets=cluster.draining_targets | set(targets))
        plan = plan_drain(cluster, nodes, targets, force, self.book.busy_chains())
        if plan.refusals:
            raise InvalidArgument("drain refused, nothing changed: " + "; ".join(plan.refusals))
        self._prune()
        self.book.draining_nodes.update(nodes)
        self.book.draining_targets.update(targets)
        self.book.moves.extend(plan.moves)
        forced = [m for m in plan.moves if m.dest == 0]
        for m in forced:  # the count a later rebalance gives the chain back (add-only moves)
            self.book.short_chains[m.chain_id] = max(m.replicas, self.book.short_chains.get(m.chain_id, 0))
        self.dirty = True
        log.warning("drain of nodes %s, targets %s: %d replica moves%s", nodes, targets, len(plan.moves),
                    f" ({len(forced)} forced without a replacement)" if forced else "")
        message = f"{len(plan.moves)} replica move(s) planned"
        if forced:
            message += (f"; --force: {len(forced)} chain(s) lose a replica with no replacement "
                        f"({', '.join(str(m.chain_id) for m in forced)})")
        return message

    def undrain(self, state: MgmtdState, node_ids: Iterable[int], target_ids: Iterable[int]) -> str:
        nodes, targets = set(node_ids), set(target_ids)
        every = not nodes and not targets
        cluster = self.cluster(state)
        kept: list[Move] = []
        stopped = running = 0
        for move in self.book.moves:
            source_node = cluster.targets.get(move.source)
            mine = every or move.source in targets or source_node in nodes
            if not mine or move.reason != "drain" or not move.active:
                kept.append(move)
                continue
            action, back = cancel(cluster, move)
            if action.kind is ActionKind.WAIT:
                running += 1  # past its point of return
                kept.append(move)
                continue
            self._apply(state, action.kind, action.target, action.move)
            kept.append(action.move)
            if back is not None:
                kept.append(back)
            stopped += 1
        self.book.moves = kept
        if every:
            self.book.draining_nodes.clear()
            self.book.draining_targets.clear()
        else:
            self.book.draining_nodes -= nodes
            self.book.draining_targets -= targets
        self.dirty = True
        return f"{stopped} move(s) cancelled" + (f"; {running} already removing their source finish" if running else "")

    def rebalance(self, state: MgmtdState, max_moves: int, rate_bytes_per_s: int, dry_run: bool) -> list[Move]:
        """Regrow the chains a forced drain left short (add-only moves), then balance the nodes."""
        # A record is dropped once its chain is gone or back to its count with no move under way (a
        # busy chain's target count includes a destination still syncing, or a source leaving).
        busy = self.book.busy_chains()
        short = {c: n for c, n in self.book.short_chains.items()
                 if c in state.chains and (c in busy or len(state.chains[c].target_ids) < n)}
        moves = plan_rebalance(self.cluster(state), max_moves, busy, short)
        if not dry_run:
            if short != self.book.short_chains:
                self.book.short_chains = short  # regrown (or gone) since: forget them
            self._prune()
            self.book.moves.extend(moves)
            self.book.resync_rate_bytes_per_s = rate_bytes_per_s
            self.dirty = True
            log.warning("rebalance: %d replica moves, resync rate %s", len(moves),
                        f"{rate_bytes_per_s} B/s" if rate_bytes_per_s else "unlimited")
        return moves

    def _prune(self) -> None:
        finished = [m for m in self.book.moves if not m.active]
        if len(finished) > _FINISHED_KEPT:
            drop = set(map(id, finished[:len(finished) - _FINISHED_KEPT]))
            self.book.moves = [m for m in self.book.moves if id(m) not in drop]

    # -- every scan --------------------------------------------------------------------------

    def advance(self, state: MgmtdState) -> tuple[list[int], list[int]]:
        """Take each active move as far as it goes now; returns the chains and targets changed."""
        chains: list[int] = []
        targets: list[int] = []
        cluster: Cluster | None = None  # rebuilt only after an action changed the chains
        for index, original in enumerate(self.book.moves):
            move = original
            for _ in range(_STEPS_PER_SCAN):
                if not move.active:
                    break
                if cluster is None:
                    cluster = self.cluster(state)
                action = step(cluster, move)
                if action.kind is ActionKind.FENCE and state.targets[action.target].info.fenced:
                    move = action.move  # fenced already: waiting for its node to confirm
                    break
                if action.kind is not ActionKind.WAIT and action.kind is not ActionKind.UPDATE:
                    log.info("chain %d: move %d -> %d (%s): %s target %d", move.chain_id, move.source,
                             move.dest, move.reason, action.kind.value, action.target)
                    if not self._apply(state, action.kind, action.target, action.move):
                        note = f"chain {move.chain_id} already has {CHAIN_REPLICAS_MAX} targets"
                        move = replace(move, note=note)
                        break
                    cluster = None
                    chains.append(move.chain_id)
                    targets.append(action.target)
                move = action.move
                if action.kind in (ActionKind.WAIT, ActionKind.FENCE):
                    break
            if move != original:
                # Marked dirty after the actions: their own writes (touch) may have stored the book
                # as it was before this move advanced.
                self.book.moves[index] = move
                self.dirty = True
        return chains, targets

    def _apply(self, state: MgmtdState, kind: ActionKind, target_id: int, move: Move) -> bool:
        """Carry one action out on the state; False when it cannot be (a chain at its size limit)."""
        chain = state.chains[move.chain_id]
        target = state.targets[target_id] if target_id else None
        if kind is ActionKind.ADD and target is not None:
            if len(chain.target_ids) >= CHAIN_REPLICAS_MAX:
                return False
            chain.target_ids.append(target_id)
            target.info.chain_id = chain.chain_id
            target.info.public_state = cast(cpb.PublicState, int(PublicState.WAITING))
        elif kind in (ActionKind.DROP_DEST, ActionKind.REMOVE) and target is not None:
            if target_id in chain.target_ids:
                chain.target_ids.remove(target_id)
            target.info.chain_id = 0
            target.info.fenced = False
            target.info.public_state = cast(cpb.PublicState, int(PublicState.OFFLINE))
        elif kind is ActionKind.FENCE and target is not None:
            if target.info.fenced:
                return True
            log.warning("target %d (node %d): fenced to leave chain %d", target_id, target.info.node_id,
                        chain.chain_id)
            target.info.fenced = True
            state.touch(targets=[target_id])
            return True
        else:
            return True
        chain.chain_version += 1
        state.touch(targets=[target_id], chains=[chain.chain_id])
        return True

    # -- status ------------------------------------------------------------------------------

    def status(self, message: str = "", moves: Iterable[Move] | None = None) -> mpb.MovesRsp:
        rsp = mpb.MovesRsp(draining_node_ids=sorted(self.book.draining_nodes),
                           draining_target_ids=sorted(self.book.draining_targets),
                           resync_rate_bytes_per_s=self.book.resync_rate_bytes_per_s, message=message)
        for m in self.book.moves if moves is None else moves:
            rsp.moves.add(chain_id=m.chain_id, from_target_id=m.source, to_target_id=m.dest, phase=m.phase.value,
                          reason=m.reason, attempts=m.attempts, note=m.note)
        return rsp


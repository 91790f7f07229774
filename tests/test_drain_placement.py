"""Replica moves without a network: placement's rules, and mgmtd's move driver against a model cluster.

The exerciser runs mgmtd's real state (:class:`MgmtdState`: heartbeats, scans, the chain state
machine, fences, the move driver) against simulated storage nodes that behave as the real ones
do towards mgmtd (a fenced target reports itself offline; a target put into a chain resyncs for a
few heartbeats, then reports itself up to date), under seeded random sequences of node additions,
drains (some forced), undrains, rebalances, failures and recoveries. After every call it checks,
against a model kept here, that no chain lost a serving replica to a move below the floor that
move keeps (one for a forced move), and at the end that every drain finished and, once capacity
is added and a rebalance run, every chain is back to its replicas on distinct nodes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import cast

import pytest

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3.common.errors import InvalidArgument, NotFound
from fs3.common.target_state import LocalState, PublicState
from fs3.kv.store import MemKVStore
from fs3.mgmtd import schema
from fs3.mgmtd.placement import (
    ActionKind,
    Cluster,
    Move,
    MoveBook,
    Phase,
    decode_book,
    encode_book,
    pick_replacement,
    plan_drain,
    plan_rebalance,
    step,
)
from fs3.mgmtd.state import MgmtdState

S = PublicState
REPLICAS = 3
TICK_MS = 100
TIMEOUT_MS = 500


def _cluster(nodes: int, per_node: int, chains: Mapping[int, tuple[int, ...]],
             dead: set[int] | None = None, states: dict[int, PublicState] | None = None) -> Cluster:
    targets = {n * 100 + i: n for n in range(1, nodes + 1) for i in range(1, per_node + 1)}
    chained = {t for ids in chains.values() for t in ids}
    return Cluster(nodes={n: n not in (dead or set()) for n in range(1, nodes + 1)}, targets=targets,
                   chains=chains, states={t: (states or {}).get(t, S.SERVING) for t in chained})


# -- placement's rules --------------------------------------------------------------------------------


def test_replacement_is_on_a_node_outside_the_chain_least_loaded_first() -> None:
    cluster = _cluster(5, 2, {1: (101, 201, 301), 2: (401, 102, 202)})
    # Node 4 holds one replica, node 5 none: the free target of node 5 takes chain 1's.
    assert pick_replacement(cluster, 1) == 501
    assert pick_replacement(cluster, 1, avoid_nodes=[5]) == 402
    # Chain 2 is on nodes 4, 1 and 2: node 3 (load 1) and node 5 (load 0) qualify.
    assert pick_replacement(cluster, 2) == 501
    dead = _cluster(5, 2, {1: (101, 201, 301)}, dead={4, 5})
    assert pick_replacement(dead, 1) is None


def test_a_target_its_node_reports_offline_is_never_a_destination() -> None:
    from dataclasses import replace

    cluster = replace(_cluster(5, 1, {1: (101, 201, 301)}), unready=frozenset({401}))
    assert pick_replacement(cluster, 1) == 501
    assert pick_replacement(replace(cluster, unready=frozenset({401, 501})), 1) is None


def test_drain_plan_refuses_when_no_node_can_take_a_replica() -> None:
    cluster = _cluster(3, 2, {1: (101, 201, 301)})
    plan = plan_drain(cluster, [1])
    assert not plan.moves and "no node can take the replica of chain 1" in plan.refusals[0]
    forced = plan_drain(cluster, [1], force=True)
    assert forced.moves == (Move(1, 101, 0, 3, "drain", force=True),)
    assert "not a registered storage node" in plan_drain(cluster, [9]).refusals[0]


def test_drain_plan_spreads_replacements_over_nodes() -> None:
    cluster = _cluster(5, 2, {1: (101, 201, 301), 2: (102, 202, 302)})
    plan = plan_drain(cluster, [1])
    assert not plan.refusals
    assert sorted(cluster.targets[m.dest] for m in plan.moves) == [4, 5]


def test_move_steps_add_then_fence_then_remove() -> None:
    chains = {1: (101, 201, 301)}
    move = Move(1, 101, 401, 3)
    action = step(_cluster(4, 1, chains), move)
    assert (action.kind, action.target, action.move.phase) == (ActionKind.ADD, 401, Phase.SYNCING)
    syncing = _cluster(4, 1, {1: (101, 201, 301, 401)}, states={401: S.SYNCING})
    assert step(syncing, action.move).kind is ActionKind.WAIT
    serving = _cluster(4, 1, {1: (101, 201, 301, 401)})
    fence = step(serving, action.move)
    assert (fence.kind, fence.target) == (ActionKind.FENCE, 101)
    fenced = _cluster(4, 1, {1: (101, 201, 301, 401)}, states={101: S.OFFLINE})
    remove = step(fenced, fence.move)
    assert (remove.kind, remove.target) == (ActionKind.REMOVE, 101)
    done = step(_cluster(4, 1, {1: (201, 301, 401)}), remove.move)
    assert done.move.phase is Phase.DONE


def test_source_stays_while_the_chain_would_drop_below_its_replicas() -> None:
    # The destination serves but another replica failed: taking the source would leave 2.
    cluster = _cluster(4, 1, {1: (101, 201, 301, 401)}, states={301: S.OFFLINE})
    action = step(cluster, Move(1, 101, 401, 3, phase=Phase.SYNCING))
    assert action.kind is ActionKind.WAIT and "fewer than 3" in action.move.note


def test_failed_destination_is_dropped_and_another_chosen() -> None:
    cluster = _cluster(5, 1, {1: (101, 201, 301, 401)}, dead={4}, states={401: S.OFFLINE})
    action = step(cluster, Move(1, 101, 401, 3, phase=Phase.SYNCING))
    assert (action.kind, action.target) == (ActionKind.DROP_DEST, 401)
    assert action.move.avoid_nodes == (4,) and action.move.dest == 0
    again = step(_cluster(5, 1, {1: (101, 201, 301)}, dead={4}), action.move)
    assert again.move.dest == 501


def test_rebalance_moves_towards_the_new_node_and_respects_max_moves() -> None:
    chains = {c: tuple(n * 100 + c for n in (1, 2, 3)) for c in range(1, 5)}
    cluster = _cluster(4, 4, chains)
    moves = plan_rebalance(cluster)
    assert len(moves) == 3 and all(cluster.targets[m.dest] == 4 for m in moves)
    assert len({m.chain_id for m in moves}) == 3
    assert len(plan_rebalance(cluster, max_moves=2)) == 2
    balanced = _cluster(3, 4, chains)
    assert plan_rebalance(balanced) == []


def test_book_round_trips_and_refuses_an_unknown_format() -> None:
    book = MoveBook([Move(1, 101, 401, 3, phase=Phase.SYNCING, avoid_nodes=(5,), note="x")], {1}, {202}, 1000)
    assert decode_book(encode_book(book)) == book
    short = MoveBook([Move(2, 0, 401, 2, "regrow")], short_chains={2: 3})
    assert decode_book(encode_book(short)) == short
    older = b'{"format": 1, "moves": [], "draining_nodes": [], "draining_targets": [], "resync_rate_bytes_per_s": 0}'
    assert decode_book(older).short_chains == {}  # a book from before short chains were recorded
    with pytest.raises(ValueError, match="format"):
        decode_book(b'{"format": 99}')


def test_rebalance_first_regrows_short_chains_with_add_only_moves() -> None:
    # Chain 1 lost a replica to a forced drain (count 3); node 4 is new and empty.
    chains = {1: (101, 201), 2: (102, 202, 302), 3: (103, 203, 303)}
    cluster = _cluster(4, 3, chains)
    moves = plan_rebalance(cluster, short_chains={1: 3})
    assert moves[0] == Move(1, 0, 401, 2, "regrow")  # pick_replacement's node: least loaded, outside the chain
    assert all(m.source for m in moves[1:]) and 1 not in {m.chain_id for m in moves[1:]}
    assert plan_rebalance(cluster, max_moves=1, short_chains={1: 3}) == moves[:1]
    assert plan_rebalance(cluster, busy_chains=[1], short_chains={1: 3})[0].reason == "rebalance"
    assert plan_rebalance(cluster, short_chains={1: 2, 2: 3})[0].reason == "rebalance"  # none short
    # No node outside the chain has a free target: no add-only move (a later rebalance, after capacity).
    full = _cluster(2, 1, {1: (101, 201)})
    assert plan_rebalance(full, short_chains={1: 3}) == []


def test_an_add_only_move_joins_syncs_and_finishes_without_removing_anything() -> None:
    move = Move(1, 0, 401, 2, "regrow")
    short = _cluster(4, 1, {1: (101, 201)})
    action = step(short, move)
    assert action.kind is ActionKind.ADD and action.target == 401 and action.move.phase is Phase.SYNCING
    syncing = _cluster(4, 1, {1: (101, 201, 401)}, states={401: S.SYNCING})
    assert step(syncing, action.move).kind is ActionKind.WAIT
    serving = _cluster(4, 1, {1: (101, 201, 401)})
    done = step(serving, action.move)
    assert done.kind is ActionKind.UPDATE and done.move.phase is Phase.DONE
    failed = _cluster(4, 1, {1: (101, 201, 401)}, states={401: S.OFFLINE})
    retry = step(failed, action.move)
    assert retry.kind is ActionKind.DROP_DEST and retry.target == 401 and retry.move.dest == 0
    again = step(short, retry.move)  # node 4 avoided; node 3 takes it
    assert again.kind is ActionKind.UPDATE and again.move.dest == 301
    regrown = _cluster(4, 1, {1: (101, 201, 301)})  # back to its count by other means
    assert step(regrown, move).move.phase is Phase.DONE


# -- the exerciser ------------------------------------------------------------------------------------


@dataclass
class SimNode:
    """A storage node as mgmtd sees it through heartbeats."""

    node_id: int
    targets: list[int]
    alive: bool = True
    local: dict[int, LocalState] = field(default_factory=dict)
    fenced: set[int] = field(default_factory=set)
    sync_left: dict[int, int] = field(default_factory=dict)

    def report(self, state: MgmtdState, rng: random.Random) -> mpb.HeartbeatReq:
        req = mpb.HeartbeatReq(node_id=self.node_id, node_type=cpb.NODE_STORAGE, framed_address=f"n{self.node_id}")
        for tid in self.targets:
            record = state.targets.get(tid)
            local = self.local.get(tid, LocalState.UP_TO_DATE)
            if record is not None:
                public = record.public_state
                if tid in self.fenced:
                    if not record.info.fenced and not public.writable:
                        self.fenced.discard(tid)
                        local = LocalState.ONLINE  # the fence lifts: it resyncs before serving
                    else:
                        local = LocalState.OFFLINE
                elif record.info.fenced:
                    self.fenced.add(tid)
                    local = LocalState.OFFLINE
                elif record.info.chain_id:
                    if public is S.SERVING:
                        local = LocalState.UP_TO_DATE
                    elif public is S.SYNCING:
                        left = self.sync_left.setdefault(tid, rng.randint(0, 3))
                        if left == 0:
                            local = LocalState.UP_TO_DATE
                            self.sync_left.pop(tid)
                        else:
                            self.sync_left[tid] = left - 1
                    elif local is not LocalState.ONLINE:
                        local = LocalState.ONLINE
            self.local[tid] = local
            req.targets.add(target_id=tid, local_state=cast(cpb.LocalState, int(local)))
        return req

    def restart(self) -> None:
        self.alive = True
        self.fenced.clear()
        self.sync_left.clear()
        self.local = dict.fromkeys(self.targets, LocalState.ONLINE)


class Exerciser:
    def __init__(self, seed: int, failures: bool) -> None:
        self.rng = random.Random(seed)
        self.failures = failures
        self.state = MgmtdState(MemKVStore(), heartbeat_timeout_ms=TIMEOUT_MS)
        self.now_ms = 0
        self.nodes: dict[int, SimNode] = {}
        self.ever_dead: set[int] = set()
        self.refusals = 0
        self.restarts = 0
        for _ in range(4):
            self.add_node()
        self.tick()
        self.state.create_chain_table(mpb.CreateChainTableReq(table_id=1, replicas=REPLICAS))
        for _ in range(3):
            self.tick()

    def add_node(self) -> None:
        node_id = max(self.nodes, default=0) + 1
        self.nodes[node_id] = SimNode(node_id, [node_id * 100 + i for i in (1, 2, 3)])

    def serving(self) -> dict[int, set[int]]:
        return {c: {t for t in chain.target_ids if self.state.targets[t].public_state is S.SERVING}
                for c, chain in self.state.chains.items()}

    def call(self, fn: object, *args: object) -> None:
        """Run one mgmtd entry point and check what it did to the chains' serving replicas."""
        before = self.serving()
        members_before = {c: list(chain.target_ids) for c, chain in self.state.chains.items()}
        moves_before = [m for m in self.state.moves.book.moves if m.active]
        assert callable(fn)
        fn(*args)
        after = self.serving()
        involved = moves_before + [m for m in self.state.moves.book.moves if m.active]
        for chain_id, was in before.items():
            mine = [m for m in involved if m.chain_id == chain_id]
            # The floor a move keeps: its chain's count when planned, one for a forced move; a chain
            # a forced drain left short has fewer (until a rebalance regrows it).
            floor = min([1 if m.force else m.replicas for m in mine] + [REPLICAS])
            lost = {t for t in was - after[chain_id] if not self._node_failed(t)}
            if lost:
                # Only a move takes a live replica off the write path, and only while the chain
                # keeps its floor without it; a node that failed after the source was fenced
                # (the fence cannot be taken back once its node acted on it) explains the rest.
                failed = sum(1 for t in members_before[chain_id] if self._node_failed(t))
                assert len(after[chain_id]) + failed >= floor, (chain_id, sorted(was), sorted(after[chain_id]))
                assert any(m.source in lost for m in mine), f"chain {chain_id} lost {lost} to no move"
            if not self.failures:
                assert len(after[chain_id]) >= min(floor, len(was)), (chain_id, sorted(after[chain_id]))
            members = [self.state.targets[t].info.node_id for t in self.state.chains[chain_id].target_ids]
            assert len(members) == len(set(members)), f"chain {chain_id} has two replicas on one node"

    def request(self, fn: Callable[..., object], *args: object) -> None:
        """An operator request as the service runs it: the driver's method, then a scan (which persists)."""
        fn(self.state, *args)
        self.state.scan(self.now_ms)

    def _node_failed(self, target_id: int) -> bool:
        return self.state.targets[target_id].info.node_id in self.ever_dead

    def tick(self) -> None:
        self.now_ms += TICK_MS
        for node in self.nodes.values():
            if node.alive:
                self.call(self.state.heartbeat, node.report(self.state, self.rng), self.now_ms)
        self.call(self.state.scan, self.now_ms)

    def random_op(self) -> None:
        rng, moves = self.rng, self.state.moves
        ops = ["tick"] * 6 + ["add", "drain", "force-drain", "undrain", "rebalance", "restart-mgmtd"]
        ops += ["fail", "recover"] if self.failures else []
        op = rng.choice(ops)
        live = [n for n, node in self.nodes.items() if node.alive]
        try:
            if op == "add" and len(self.nodes) < 9:
                self.add_node()
            elif op == "drain":
                self.call(self.request, moves.drain, [rng.choice([*list(self.nodes), 99])], [], False)
            elif op == "force-drain":
                self.call(self.request, moves.drain, [rng.choice(list(self.nodes))], [], True)
            elif op == "undrain":
                self.call(self.request, moves.undrain, [rng.choice(list(self.nodes))], [])
            elif op == "rebalance":
                self.call(self.request, moves.rebalance, rng.randint(0, 3), 0, False)
            elif op == "fail" and len(live) > 4 and not any(not n.alive for n in self.nodes.values()):
                victim = rng.choice(live)
                self.nodes[victim].alive = False
                self.ever_dead.add(victim)
            elif op == "restart-mgmtd":  # a new mgmtd on the same store resumes the moves
                restarted = MgmtdState(self.state.kv, heartbeat_timeout_ms=TIMEOUT_MS)
                restarted.load(self.now_ms)
                assert restarted.moves.book == self.state.moves.book
                self.state = restarted
                self.restarts += 1
            elif op == "recover":
                for node in self.nodes.values():
                    if not node.alive:
                        node.restart()
            else:
                self.tick()
        except (InvalidArgument, NotFound):
            self.refusals += 1

    def settle(self) -> None:
        for node in self.nodes.values():
            if not node.alive:
                node.restart()
        for _ in range(400):
            self.tick()
            active = [m for m in self.state.moves.book.moves if m.active]
            if not active and all(len(s) == len(self.state.chains[c].target_ids) for c, s in self.serving().items()):
                return
        raise AssertionError(f"moves did not finish: {[m for m in self.state.moves.book.moves if m.active]}")

    def regrow(self) -> None:
        """Add capacity enough for every short chain, rebalance, and let the moves finish."""
        for _ in range(REPLICAS):
            self.add_node()
        self.settle()  # the new nodes register
        for _ in range(REPLICAS):  # one move per chain at a time: a chain short by two takes two rounds
            self.call(self.request, self.state.moves.rebalance, 0, 0, False)
            self.settle()


@pytest.mark.parametrize("failures", [False, True], ids=["no-failures", "failures"])
def test_random_moves_keep_replicas_and_finish(failures: bool) -> None:
    finished = restarts = regrown = 0
    for seed in range(20):
        ex = Exerciser(seed, failures)
        for _ in range(120):
            ex.random_op()
        ex.settle()
        short = {c for c, chain in ex.state.chains.items() if len(chain.target_ids) < REPLICAS}
        regrown += len(short)
        if short:
            ex.regrow()
        book = ex.state.moves.book
        assert not any(m.phase is Phase.FAILED for m in book.moves) or failures
        draining = book.draining_nodes
        for tid, target in ex.state.targets.items():
            if target.info.node_id in draining:
                assert not target.info.chain_id, f"seed {seed}: drained node still holds target {tid}"
        for chain in ex.state.chains.values():
            nodes = {ex.state.targets[t].info.node_id for t in chain.target_ids}
            assert len(chain.target_ids) == REPLICAS == len(nodes), f"seed {seed}: chain {chain}"
        finished += sum(1 for m in book.moves if m.phase is Phase.DONE)
        restarts += ex.restarts
        # A restarted mgmtd reads the same moves and draining sets back.
        reloaded = MgmtdState(ex.state.kv, heartbeat_timeout_ms=TIMEOUT_MS)
        reloaded.load(ex.now_ms)
        assert reloaded.moves.book == book
    assert finished > 20 and restarts > 20  # the sequences did move replicas, across restarts
    assert regrown > 0  # forced drains left chains short, and rebalances regrew them


def test_a_new_primary_installs_the_moves_from_the_shared_records() -> None:
    """With several mgmtd the book travels in the records the primary commits (``moves/`` prefix)."""
    state = MgmtdState(None, heartbeat_timeout_ms=TIMEOUT_MS)
    for node_id in range(1, 5):
        req = mpb.HeartbeatReq(node_id=node_id, node_type=cpb.NODE_STORAGE, framed_address=f"n{node_id}")
        for tid in (node_id * 100 + 1, node_id * 100 + 2):
            req.targets.add(target_id=tid, local_state=cpb.UP_TO_DATE)
        state.heartbeat(req, 0)
    state.create_chain_table(mpb.CreateChainTableReq(table_id=1, replicas=REPLICAS))
    state.moves.drain(state, [1], [], False)
    state.scan(0)
    pending = state.take_pending()
    assert schema.MOVE_BOOK in pending
    records: dict[bytes, list[bytes]] = {}
    for prefix in (schema.NODE, schema.TARGET, schema.CHAIN, schema.TABLE, schema.MOVES):
        records[prefix] = [v for k, v in sorted(pending.items()) if k.startswith(prefix)]
    primary = MgmtdState(None, heartbeat_timeout_ms=TIMEOUT_MS)
    primary.install(records, None, 0, epoch=2)
    assert primary.moves.book == state.moves.book
    assert primary.moves.book.draining_nodes == {1} and primary.moves.book.busy_chains()


def test_rebalance_regrows_chains_a_forced_drain_left_short_once_a_node_is_added() -> None:
    ex = Exerciser(0, failures=False)  # 4 nodes of 3 targets: every target in one of 4 chains of 3
    ex.call(ex.request, ex.state.moves.drain, [4], [], True)  # no free target anywhere: forced
    ex.settle()
    short = {c for c, chain in ex.state.chains.items() if len(chain.target_ids) < REPLICAS}
    assert len(short) == 3
    ex.call(ex.request, ex.state.moves.rebalance, 0, 0, False)
    assert not ex.state.moves.book.busy_chains()  # no capacity yet: nothing to do, the record stays
    ex.add_node()
    ex.settle()
    plan = ex.state.moves.rebalance(ex.state, 0, 0, True)  # --dry-run
    assert {m.chain_id for m in plan} == short and all(m.source == 0 and m.dest // 100 == 5 for m in plan)
    ex.call(ex.request, ex.state.moves.rebalance, 0, 0, False)
    ex.settle()
    for chain_id, serving in ex.serving().items():
        nodes = {ex.state.targets[t].info.node_id for t in ex.state.chains[chain_id].target_ids}
        assert len(serving) == REPLICAS == len(nodes) and 4 not in nodes, chain_id
    assert ex.state.moves.book.short_chains == {c: REPLICAS for c in short}  # dropped at the next rebalance
    ex.call(ex.request, ex.state.moves.rebalance, 0, 0, False)
    assert ex.state.moves.book.short_chains == {}


def test_a_forced_move_never_removes_the_last_serving_replica() -> None:
    # A forced drain leaves a chain one replica short, never with none that serves: while the
    # source is the only serving target (the others syncing or offline), it stays.
    forced = Move(1, 101, 0, 3, "drain", force=True)
    alone = _cluster(3, 1, {1: (101, 201, 301)}, states={201: S.SYNCING, 301: S.OFFLINE})
    action = step(alone, forced)
    assert action.kind is ActionKind.WAIT and "fewer than" in action.move.note
    single = _cluster(1, 1, {1: (101,)})
    assert step(single, Move(1, 101, 0, 1, "drain", force=True)).kind is ActionKind.WAIT
    plan = plan_drain(single, [1], force=True)
    assert not plan.moves and "only replica" in plan.refusals[0]
    other_serves = _cluster(3, 1, {1: (101, 201, 301)}, states={301: S.OFFLINE})
    assert step(other_serves, forced).kind is ActionKind.FENCE


def test_a_new_resync_rate_applies_at_once_after_one_set_far_too_low() -> None:
    # An operator's `rebalance --rate 1` by mistake, then a sane rate: the chunk waiting at the old
    # rate (about 12 days for 1 MiB) goes, and the next is paced by the new rate, not the old debt.
    import asyncio

    from fs3.sim.loop import VirtualTimeLoop
    from fs3.storage.resync import ResyncPacer

    loop = VirtualTimeLoop()
    pacer = ResyncPacer(1)

    async def scenario() -> tuple[float, float]:
        waiting = asyncio.ensure_future(pacer.spend(1 << 20))
        await asyncio.sleep(5)
        pacer.rate_bytes_per_s = 1 << 20
        await waiting
        released_s = loop.time()
        await pacer.spend(4 << 20)
        return released_s, loop.time()

    try:
        released_s, done_s = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert released_s <= 6.0
    assert done_s - released_s <= 4.0  # 4 MiB at 1 MiB/s, less the one-second burst
    assert done_s - released_s >= 2.0  # and still paced


def test_a_destination_lost_after_the_fence_is_replaced_once_the_source_serves_again() -> None:
    # The source was fenced, but another replica failed before it could leave (so it stayed), and
    # then the destination's node died: the source, resynced and serving again, keeps the chain at
    # its count, and the move picks another destination instead of waiting for the dead one.
    cluster = _cluster(5, 1, {1: (101, 201, 301, 401)}, dead={4}, states={401: S.OFFLINE})
    action = step(cluster, Move(1, 101, 401, 3, phase=Phase.REMOVING))
    assert (action.kind, action.target) == (ActionKind.DROP_DEST, 401)
    assert action.move.phase is Phase.PENDING and action.move.avoid_nodes == (4,)
    # While the source is still off the write path (and may not leave: 301 failed too), the move
    # waits for either to come back.
    fenced = _cluster(5, 1, {1: (101, 201, 301, 401)}, dead={4},
                      states={101: S.OFFLINE, 301: S.OFFLINE, 401: S.OFFLINE})
    assert step(fenced, Move(1, 101, 401, 3, phase=Phase.REMOVING)).kind is ActionKind.WAIT


def test_the_listings_show_an_add_only_move(capsys: pytest.CaptureFixture[str]) -> None:
    """`rebalance --dry-run` says "add a replica of chain C on target T"; `fs3 admin chains` and
    `targets` show the joining target (an add-only move has no source)."""
    import argparse
    import asyncio

    from fs3.cli.moves import chain_move_notes, run_move_command, target_move_notes
    from fs3.mgmtd.moves import MoveDriver

    rsp = MoveDriver().status("would move 1 replica(s)", [Move(7, 0, 401, 2, "regrow")])

    class Admin:
        async def rebalance(self, max_moves: int, rate: int, dry_run: bool) -> mpb.MovesRsp:
            assert dry_run
            return rsp

    args = argparse.Namespace(command="rebalance", json=False, max_moves=0, rate=0, dry_run=True, wait=False)
    assert asyncio.run(run_move_command(Admin(), args)) == 0
    assert "chain 7: add a replica of chain 7 on target 401 [regrow] pending" in capsys.readouterr().out
    assert chain_move_notes(rsp) == {7: "add 401 pending (regrow)"}
    targets = [cpb.TargetInfo(target_id=401, node_id=4), cpb.TargetInfo(target_id=101, node_id=1, chain_id=7)]
    assert target_move_notes(rsp, targets) == {401: "regrow pending"}

"""One simulated run: boot a cluster, run clients and faults, check invariants, heal, verify."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

from fs3.common.checksum import crc32c
from fs3.common.errors import FS3Error
from fs3.common.ids import chunk_id as make_chunk_id
from fs3.common.target_state import PublicState
from fs3.sim.cluster import ClusterShape, SimCluster
from fs3.sim.history import INF, History, Op, decode_slots, encode_slot
from fs3.sim.loop import SimProcess, VirtualTimeLoop
from fs3.sim.meta import MetaShape, run_meta_scenario
from fs3.storage.chunk_engine import ChunkState

__all__ = ["SimResult", "run_seed", "serving_replica_violations"]

log = logging.getLogger(__name__)


@dataclass
class SimResult:
    seed: int
    shape: ClusterShape
    violations: list[str] = field(default_factory=list)
    ops: int = 0
    acked_writes: int = 0
    failed_ops: int = 0
    faults: list[str] = field(default_factory=list)
    virtual_seconds: float = 0.0
    messages: int = 0
    meta: MetaShape | None = None  # the meta mix's shape (None for the storage mixes)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        status = "ok" if self.ok else f"FAILED ({len(self.violations)} violations)"
        if self.meta is not None:
            return (f"seed {self.seed}: {status}; {self.ops} calls, {self.acked_writes} answered changes, "
                    f"{self.failed_ops} unanswered, {len(self.faults)} faults, {self.messages} messages, "
                    f"{self.virtual_seconds:.1f}s virtual; shape {self.shape}; meta {self.meta}")
        return (f"seed {self.seed}: {status}; {self.ops} ops, {self.acked_writes} acked writes, "
                f"{self.failed_ops} failed, {len(self.faults)} faults, {self.messages} messages, "
                f"{self.virtual_seconds:.1f}s virtual; shape {self.shape}")


def serving_replica_violations(chain_id: int, snapshots: list[tuple[int, dict[bytes, ChunkState]]],
                               unstaged: set[bytes] | frozenset[bytes]) -> list[str]:
    """What is wrong between the serving replicas of one chain (``(target id, chunk states)`` each).

    Serving replicas are at most one write apart: the one in flight, committed from the tail up, so
    two committed versions are allowed only while some replica holds the newer one pending, or while
    a pipelined forward has it unstaged (dirty in memory, no pending version yet) on some replica;
    a removal in flight may already have dropped the chunk behind it. Replicas that committed the
    same version hold the same bytes (checksum and length).
    """
    violations: list[str] = []
    ids: set[bytes] = set()
    for _, states in snapshots:
        ids.update(states)
    for cid in sorted(ids):
        versions: list[tuple[int, int, ChunkState | None]] = []
        for t, states in snapshots:
            found = states.get(cid)
            versions.append((t, found.commit_version if found else 0, found))
        removing = any(s is not None and s.pending_remove for _, _, s in versions)
        committed = {v for _, v, s in versions if not (removing and s is None)}
        if len(committed) > 2 or (len(committed) == 2 and cid not in unstaged and not any(
                s is not None and s.pending_version == max(committed) for _, _, s in versions)):
            violations.append(f"chain {chain_id} chunk {cid.hex()}: serving replicas committed "
                              f"{[(t, v) for t, v, _ in versions]}")
        by_version: dict[int, tuple[int, int]] = {}
        for t, v, found in versions:
            if found is None or not v:
                continue
            seen = by_version.setdefault(v, (found.checksum, found.length))
            if seen != (found.checksum, found.length):
                violations.append(f"chain {chain_id} chunk {cid.hex()} v{v}: replicas differ (target {t})")
    return violations


class _Invariants:
    """Checked after every event-loop iteration."""

    def __init__(self, cluster: SimCluster, result: SimResult) -> None:
        self.cluster = cluster
        self.result = result
        self.iterations = 0

    def __call__(self) -> None:
        self.iterations += 1
        if self.result.violations:
            return
        cluster = self.cluster
        for slot in cluster.storage.values():
            if slot.node is None:
                continue
            for tid, engine in slot.node.engines.items():
                for cid, state in engine.states().items():
                    if state.pending_version and state.pending_version <= state.commit_version:
                        self._fail(f"target {tid} chunk {cid.hex()}: pending v{state.pending_version} on "
                                   f"committed v{state.commit_version}")
        if cluster.mgmtd is None:
            return
        for chain_id, target_ids in cluster.chain_targets().items():
            serving = [t for t in target_ids
                       if cluster.mgmtd.state.targets[t].public_state is PublicState.SERVING
                       and self._serves(t, chain_id)]
            engines = [(t, e) for t in serving if (e := cluster.engine(t)) is not None]
            snapshots = [(t, engine.states()) for t, engine in engines]
            # A pipelined forward leaves a chunk dirty without a pending version while it is staged.
            unstaged = set().union(*(cluster.unstaged(t) for t, _ in engines))
            for message in serving_replica_violations(chain_id, snapshots, unstaged):
                self._fail(message)

    def _serves(self, target_id: int, chain_id: int) -> bool:
        """Serving in the node's own view too (a restarted node is silent until mgmtd notices)."""
        node = self.cluster.storage[target_id // 100].node
        if node is None:
            return False
        view = node.view(chain_id, target_id)
        return view is not None and view.my_state is PublicState.SERVING

    def _fail(self, message: str) -> None:
        if message not in self.result.violations:
            self.result.violations.append(f"t={asyncio.get_event_loop().time():.4f} {message}")


async def _client_loop(cluster: SimCluster, history: History, rng: random.Random, chains: list[int],
                       chunks: int, slots: int, ops: int, next_id: list[int], mix: str) -> None:
    client = cluster.new_client(random.Random(rng.random()))
    loop = asyncio.get_running_loop()
    slot_bytes = cluster.shape.chunk_size // slots
    for _ in range(ops):
        chunk = rng.randrange(chunks)
        chain_id = chains[chunk % len(chains)]
        cid = make_chunk_id(1, chunk)
        roll = rng.random()
        if roll < 0.5:
            first = rng.randrange(slots)
            last = rng.randrange(first, min(slots, first + 3))
            next_id[0] += 1
            write_id = next_id[0]
            data = b"".join(encode_slot(write_id, slot_bytes) for _ in range(first, last + 1))
            op = history.add(Op("write", chunk, tuple(range(first, last + 1)), loop.time(), value=write_id))
            try:
                await client.write(chain_id, cid, first * slot_bytes, data, cluster.shape.chunk_size)
                op.complete, op.ok = loop.time(), True
            except FS3Error:
                pass
        elif roll < 0.53:
            op = history.add(Op("remove", chunk, tuple(range(slots)), loop.time(), value=0))
            try:
                await client.remove(chain_id, cid, cluster.shape.chunk_size)
                op.complete, op.ok = loop.time(), True
            except FS3Error:
                pass
        elif mix != "legacy" and roll < 0.6:
            length = rng.randint(0, slots) * slot_bytes
            op = history.add(Op("truncate", chunk, tuple(range(slots)), loop.time(), length=length))
            try:
                await client.truncate(chain_id, cid, length, cluster.shape.chunk_size)
                op.complete, op.ok = loop.time(), True
            except FS3Error:
                pass
        else:
            op = history.add(Op("read", chunk, tuple(range(slots)), loop.time()))
            try:
                data, _ = await client.read(chain_id, cid, 0, cluster.shape.chunk_size)
                op.complete, op.ok = loop.time(), True
                op.observed = dict(enumerate(decode_slots(data, slots, slot_bytes)))
                if mix != "legacy":
                    op.length = len(data)
            except FS3Error:
                pass
        await asyncio.sleep(rng.uniform(0, 0.3))


async def _faults(cluster: SimCluster, rng: random.Random, result: SimResult, duration_s: float,
                  intensity: float, mix: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s
    tolerance = cluster.shape.replicas - 1
    while loop.time() < end:
        await asyncio.sleep(rng.uniform(0.2, 1.5) / max(intensity, 0.01))
        if loop.time() >= end:
            break
        roll = rng.random()
        if mix != "legacy":
            roll *= 1.1  # [1.0, 1.1): an admin marks a serving target offline
        down = [n for n in cluster.storage if not cluster.storage_alive(n)]
        if down and roll < 0.4:
            node = rng.choice(down)
            cluster.start_storage(node)
            result.faults.append(f"t={loop.time():.2f} restart storage-{node}")
        elif roll < 0.7:
            if cluster.mgmtd is None or len(cluster.unhealthy_nodes()) >= tolerance:
                continue
            candidates = [n for n in cluster.storage if cluster.storage_alive(n)]
            node = rng.choice(candidates)
            cluster.kill_storage(node)
            result.faults.append(f"t={loop.time():.2f} kill storage-{node}")
        elif roll < 0.8:
            cluster.network.faults.drop_probability = rng.choice((0.0, 0.01, 0.05))
            result.faults.append(f"t={loop.time():.2f} drop probability {cluster.network.faults.drop_probability}")
        elif roll < 0.9 and mix != "legacy" and rng.random() < 0.3:
            node = rng.choice(list(cluster.storage))
            seconds = rng.uniform(0.5, 4.0)
            cluster.stall_disks(node, seconds)
            result.faults.append(f"t={loop.time():.2f} disks of storage-{node} stall for {seconds:.1f}s")
        elif roll < 0.9:
            if cluster.mgmtd is not None:
                cluster.kill_mgmtd()
                result.faults.append(f"t={loop.time():.2f} kill mgmtd")
                await asyncio.sleep(rng.uniform(0.1, 1.0))
                cluster.start_mgmtd()
                result.faults.append(f"t={loop.time():.2f} restart mgmtd")
        elif roll >= 1.0:
            await _mark_offline(cluster, rng, result, tolerance)
        else:
            if cluster.mgmtd is None or len(cluster.unhealthy_nodes()) >= tolerance:
                continue
            node = rng.choice(list(cluster.storage))
            if not cluster.storage_alive(node):
                continue
            address = cluster.storage[node].address
            cluster.network.partition(address, "mgmtd")
            result.faults.append(f"t={loop.time():.2f} partition storage-{node} from mgmtd")
            await asyncio.sleep(rng.uniform(0.2, 2.0) * cluster.shape.heartbeat_timeout_ms / 1000)
            cluster.network.heal()
            result.faults.append(f"t={loop.time():.2f} heal partition")
    cluster.network.faults.drop_probability = 0.0
    cluster.network.heal()


async def _mark_offline(cluster: SimCluster, rng: random.Random, result: SimResult, tolerance: int) -> None:
    """``fs3 admin mark-offline`` on a random serving target of a live node, through the admin RPC.

    The target is fenced, leaves its chain, resyncs and comes back; the histories check that it
    never serves a read older than a write the chain acknowledged without it.
    """
    if cluster.mgmtd is None or len(cluster.unhealthy_nodes()) >= tolerance:
        return
    serving = sorted(tid for tid, state in cluster.public_states().items()
                     if state is PublicState.SERVING and cluster.storage_alive(tid // 100))
    if not serving:
        return
    target = rng.choice(serving)
    loop = asyncio.get_running_loop()
    result.faults.append(f"t={loop.time():.2f} admin marks target {target} offline")
    try:
        await cluster.admin().mark_target_offline(target)
    except FS3Error as exc:  # lost messages, or mgmtd restarted meanwhile
        result.faults.append(f"t={loop.time():.2f} mark-offline of target {target} failed: {exc.code.name}")


async def _scenario(cluster: SimCluster, result: SimResult, clients: int, ops_per_client: int,
                    fault_intensity: float, mix: str) -> None:
    rng = cluster.rng
    chains = await cluster.boot()
    slots = rng.choice((4, 8))
    history = History(slots=slots, slot_bytes=cluster.shape.chunk_size // slots)
    chunks = rng.randint(2, 6)
    next_id = [0]
    driver = SimProcess("driver")
    loop = asyncio.get_running_loop()
    start = loop.time()
    client_tasks = [driver.run(_client_loop(cluster, history, random.Random(rng.random()), chains, chunks, slots,
                                            ops_per_client, next_id, mix)) for _ in range(clients)]
    fault_task = driver.run(_faults(cluster, random.Random(rng.random()), result, 1e9, fault_intensity, mix)) \
        if fault_intensity > 0 else None
    await asyncio.gather(*client_tasks)
    if fault_task is not None:
        fault_task.cancel()
        await asyncio.gather(fault_task, return_exceptions=True)
    # Heal everything and let the cluster converge.
    cluster.network.faults.drop_probability = 0.0
    cluster.network.heal()
    if cluster.mgmtd is None:
        cluster.start_mgmtd()
    for node in cluster.storage:
        if not cluster.storage_alive(node):
            cluster.start_storage(node)
    await cluster.wait_all_serving(120_000)
    # Final reads: every slot of every chunk, then the replicas must be identical.
    client = cluster.new_client()
    slot_bytes = cluster.shape.chunk_size // slots
    for chunk in range(chunks):
        op = history.add(Op("read", chunk, tuple(range(slots)), loop.time()))
        data, _ = await client.read(chains[chunk % len(chains)], make_chunk_id(1, chunk), 0, cluster.shape.chunk_size)
        op.complete, op.ok = loop.time(), True
        op.observed = dict(enumerate(decode_slots(data, slots, slot_bytes)))
        if mix != "legacy":
            op.length = len(data)
    # Abandoned pending versions are completed in the background by the heads; wait for that.
    for _ in range(600):
        if not any(cluster.engine(t) and cluster.engine(t).pending_chunks()  # type: ignore[union-attr]
                   for ids in cluster.chain_targets().values() for t in ids):
            break
        await asyncio.sleep(0.1)
    else:
        result.violations.append("pending versions were never completed after the faults stopped")
    _verify_replicas(cluster, result)
    result.violations.extend(history.check())
    result.ops = len(history.ops)
    result.acked_writes = sum(1 for op in history.ops if op.kind == "write" and op.ok)
    result.failed_ops = sum(1 for op in history.ops if not op.ok or op.complete == INF)
    result.virtual_seconds = loop.time() - start


def _verify_replicas(cluster: SimCluster, result: SimResult) -> None:
    """Every replica of every chain holds the same chunks with the same bytes, and each chunk's bytes
    match the checksum its metadata records (compared as data, not as metadata about data)."""
    for chain_id, target_ids in cluster.chain_targets().items():
        contents: dict[int, dict[bytes, tuple[int, bytes]]] = {}
        for tid in target_ids:
            engine = cluster.engine(tid)
            assert engine is not None
            mine: dict[bytes, tuple[int, bytes]] = {}
            for cid, state in engine.states().items():
                if not state.commit_version:
                    continue
                data = engine.read(cid, state.commit_version, 0, state.length)
                if len(data) != state.length or crc32c(data) != state.checksum:
                    result.violations.append(f"chain {chain_id} target {tid} chunk {cid.hex()} "
                                             f"v{state.commit_version}: bytes do not match the recorded checksum")
                mine[cid] = (state.commit_version, data)
            contents[tid] = mine
        reference_tid = target_ids[0]
        reference = contents[reference_tid]
        for tid in target_ids[1:]:
            mine = contents[tid]
            for cid in sorted(set(mine) | set(reference)):
                if mine.get(cid) != reference.get(cid):
                    result.violations.append(f"chain {chain_id} chunk {cid.hex()}: replica {tid} "
                                             f"({_describe(mine.get(cid))}) differs from replica {reference_tid} "
                                             f"({_describe(reference.get(cid))})")


def _describe(copy: tuple[int, bytes] | None) -> str:
    return f"v{copy[0]}, {len(copy[1])} bytes" if copy is not None else "missing"


async def _meta_scenario(cluster: SimCluster, result: SimResult, clients: int, ops_per_client: int,
                         fault_intensity: float) -> None:
    """The meta mix (:mod:`fs3.sim.meta`): namespace calls of several clients, checked against the model."""
    assert result.meta is not None
    loop = asyncio.get_running_loop()
    start = loop.time()
    run, problems = await run_meta_scenario(cluster, result.meta, clients, ops_per_client, fault_intensity,
                                            SimProcess("driver"))
    result.violations.extend(problems)
    result.faults.extend(run.faults)
    result.ops = len(run.calls)
    result.acked_writes = sum(1 for c in run.calls if c.completed and c.kind not in ("stat", "readdir")
                              and isinstance(c.result, tuple) and c.result[0] == "ok")
    result.failed_ops = sum(1 for c in run.calls if not c.completed)
    result.virtual_seconds = loop.time() - start


MIXES = ("default", "legacy", "meta")


def run_seed(seed: int, clients: int = 3, ops_per_client: int = 60, fault_intensity: float = 1.0,
             shape: ClusterShape | None = None, mix: str = "default",
             meta_shape: MetaShape | None = None) -> SimResult:
    """Run one seed to completion; deterministic for a given argument list.

    ``mix``: ``default`` — writes, removes, truncates and reads (with the chunk length they saw);
    clusters with inline and file versions, an I/O pool whose work outlives cancelled requests,
    handlers cancelled by timeouts, stalled disks. ``legacy`` — the first simulator's operations,
    cluster shapes and faults, drawn in the same order, so that old seeds replay their schedules.
    ``meta`` — the metadata service beside storage: several clients' namespace calls with lost
    replies, meta restarts and lease lapses, checked for linearizability against the namespace
    model (:mod:`fs3.sim.meta`); ``meta_shape`` fixes its lease, retry and sync settings (drawn
    from the seed when omitted). The storage mixes draw exactly what they drew before it existed.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r} (known: {', '.join(MIXES)})")
    cluster = SimCluster(seed, shape, mix)
    result = SimResult(seed, cluster.shape)
    if mix == "meta":
        result.meta = meta_shape or MetaShape.random(cluster.rng, random.Random(seed ^ 0x7E5_7A1E))
        scenario = _meta_scenario(cluster, result, clients, ops_per_client, fault_intensity)
    else:
        scenario = _scenario(cluster, result, clients, ops_per_client, fault_intensity, mix)
    loop = VirtualTimeLoop()
    invariants = _Invariants(cluster, result)
    # The replica invariants watch chunk data, which the meta mix never writes (and they would
    # cost it more than the rest of the run).
    loop.on_iteration = invariants if mix != "meta" else None
    try:
        loop.run_until_complete(scenario)
    except AssertionError as exc:
        result.violations.append(f"liveness: {exc}")
    finally:
        result.messages = cluster.network.messages
        loop.on_iteration = None
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    return result

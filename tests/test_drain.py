"""Drain, rebalance and replace storage on an in-process cluster (real transport, real resyncs).

Each test samples the chains' serving replicas while the moves run (never below 3), keeps a
client writing and reading through them, and checks where the replicas end up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from pathlib import Path

import pytest

from fs3 import mgmtd_pb2 as mpb
from fs3.cli.moves import run_move_command
from fs3.cluster.services import build_storage_node
from fs3.cluster.topology import Topology
from fs3.common.errors import InvalidArgument, NotFound
from fs3.common.ids import chunk_id
from fs3.common.metrics import ServiceMetrics
from fs3.common.target_state import PublicState
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.server import ServiceRuntime
from fs3.storage.node import StorageNode, StorageNodeConfig
from fs3.storage.server import StorageConfig, TargetConfig, open_engines
from tests.conftest import wait_until
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow

CHUNK = 64 * 1024
REPLICAS = 3


async def add_node(cluster: InProcessCluster, node_id: int, targets: int, rate_bytes_per_s: int = 0) -> StorageNode:
    """A new storage node with ``targets`` empty targets, registered with mgmtd (in no chain)."""
    config = StorageConfig(node_id=node_id, targets=[
        TargetConfig(Topology.target_id(node_id, j), str(cluster.root / f"n{node_id}" / f"t{j}"))
        for j in range(1, targets + 1)])
    channels = RealChannelFactory(cluster.token, cluster.transport)  # type: ignore[arg-type]
    metrics = ServiceMetrics("storage")
    parts = build_storage_node(
        StorageNodeConfig(node_id=node_id, mgmtd_address=cluster.mgmtd_address, heartbeat_interval_ms=100,
                          rpc_timeout_ms=2_000, replica=cluster.replica_config,
                          resync_rate_bytes_per_s=rate_bytes_per_s),
        open_engines(config), channels, token=cluster.token, metrics=metrics)
    runtime = ServiceRuntime(f"storage-{node_id}", parts.dispatcher, metrics)
    bound = await runtime.start("127.0.0.1", 0, 0, -1)
    parts.node.config.framed_address, parts.node.config.grpc_address = bound.framed, bound.grpc
    await parts.node.start()
    cluster.runtimes.append(runtime)
    cluster.nodes[node_id] = parts.node
    assert cluster.mgmtd is not None
    state = cluster.mgmtd.state

    async def registered() -> bool:
        return all(t in state.targets for t in (tc.target_id for tc in config.targets))
    await wait_until(registered, what=f"node {node_id} registered")
    return parts.node


async def kill_node(cluster: InProcessCluster, node_id: int) -> None:
    """Stop a storage node as a crash would look to mgmtd: no more heartbeats, no more answers."""
    node = cluster.nodes.pop(node_id)
    index = next(i for i, r in enumerate(cluster.runtimes) if r.name == f"storage-{node_id}")
    runtime = cluster.runtimes.pop(index)
    await node.stop()
    runtime.stopping.set()
    await runtime.run_until_stopped()
    await node.channels.close()
    for engine in node.engines.values():
        engine.close()


class Watch:
    """Samples every chain's serving replicas and keeps a client writing and reading meanwhile."""

    def __init__(self, cluster: InProcessCluster) -> None:
        self.cluster = cluster
        self.client = cluster.client(b"drain-io", retry_total_ms=20_000)
        self.min_serving = REPLICAS
        self.samples = 0
        self.data: dict[tuple[int, bytes], bytes] = {}
        self.io_rounds = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    async def seed(self, chunks: int) -> None:
        for chain in self.cluster.chain_ids:
            for i in range(chunks):
                await self.write(chain, chunk_id(chain, i))

    async def write(self, chain: int, cid: bytes) -> None:
        data = os.urandom(CHUNK)
        await self.client.write(chain, cid, 0, data, CHUNK)
        self.data[(chain, cid)] = data

    async def _sample(self) -> None:
        assert self.cluster.mgmtd is not None
        while True:
            state = self.cluster.mgmtd.state
            for chain in state.chains.values():
                serving = sum(1 for t in chain.target_ids if state.targets[t].public_state is PublicState.SERVING)
                self.min_serving = min(self.min_serving, serving)
            self.samples += 1
            await asyncio.sleep(0.005)

    async def _io(self) -> None:
        while not self._stopping:  # overwrites of a few chunks: a resync's work stays bounded
            for chain in self.cluster.chain_ids:
                cid = chunk_id(chain, 10_000 + self.io_rounds % 4)
                await self.write(chain, cid)
                got, _ = await self.client.read(chain, cid, 0, CHUNK)
                assert got == self.data[(chain, cid)]
            self.io_rounds += 1

    def __enter__(self) -> Watch:
        self._tasks = [asyncio.create_task(self._sample()), asyncio.create_task(self._io())]
        return self

    def __exit__(self, *exc: object) -> None:
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise AssertionError("foreground I/O failed during the moves") from task.exception()
            task.cancel()

    async def stop(self) -> None:
        """Let the I/O round in flight finish (a cancelled write's outcome is unknown), then stop."""
        self._stopping = True
        sampler, io = self._tasks
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        try:
            await io
        except Exception as exc:
            raise AssertionError("foreground I/O failed during the moves") from exc

    async def check_all_readable(self) -> None:
        for (chain, cid), data in self.data.items():
            for _ in range(REPLICAS):  # reads rotate over the serving replicas
                got, _ = await self.client.read(chain, cid, 0, CHUNK)
                assert got == data, f"chain {chain} chunk {cid.hex()}"


async def moves_finished(cluster: InProcessCluster) -> bool:
    rsp = await cluster.admin().moves()
    return all(m.phase in ("done", "failed") for m in rsp.moves)


async def all_serving(cluster: InProcessCluster) -> bool:
    return await cluster.all_serving()


def chains_of_node(cluster: InProcessCluster, node_id: int) -> list[int]:
    assert cluster.mgmtd is not None
    state = cluster.mgmtd.state
    return [t.info.chain_id for t in state.targets.values() if t.info.node_id == node_id and t.info.chain_id]


def test_drain_keeps_three_serving_replicas_and_data_available(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_nodes=3, targets_per_node=2) as cluster:
            await add_node(cluster, 4, 2)
            watch = Watch(cluster)
            await watch.seed(8)
            assert len(chains_of_node(cluster, 1)) == 2
            with watch:
                rsp = await cluster.admin().drain([1], [])
                assert len(rsp.moves) == 2 and list(rsp.draining_node_ids) == [1]
                await wait_until(lambda: moves_finished(cluster), what="drain finished")
                await wait_until(lambda: all_serving(cluster), what="chains serving")
                await watch.stop()
            assert watch.samples > 10 and watch.io_rounds > 0
            assert watch.min_serving >= REPLICAS
            status = await cluster.admin().moves()
            assert [m.phase for m in status.moves] == ["done", "done"]
            assert chains_of_node(cluster, 1) == []
            assert sorted(chains_of_node(cluster, 4)) == sorted(cluster.chain_ids)
            await watch.check_all_readable()
            assert (await cluster.admin().verify()).ok
            # A drained node receives no replica again until undrained.
            with pytest.raises(InvalidArgument, match="no node can take"):
                await cluster.admin().drain([2], [])
            await cluster.admin().undrain([1], [])
            assert not (await cluster.admin().moves()).draining_node_ids

    asyncio.run(body())


def test_drain_retries_on_another_node_when_the_receiver_dies_mid_sync(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_nodes=3, targets_per_node=2) as cluster:
            slow = 384 * 1024  # bytes/s: the resync of 10 chunks takes over a second
            for node in cluster.nodes.values():
                node.config.resync_rate_bytes_per_s = slow
            await add_node(cluster, 4, 2, slow)
            await add_node(cluster, 5, 2, slow)
            watch = Watch(cluster)
            await watch.seed(8)
            rsp = await cluster.admin().drain([1], [])
            receivers = {m.chain_id: Topology.node_of(m.to_target_id) for m in rsp.moves}
            assert sorted(receivers.values()) == [4, 5]
            chain = next(c for c, n in receivers.items() if n == 4)
            assert cluster.mgmtd is not None
            state = cluster.mgmtd.state
            dest = next(m.to_target_id for m in rsp.moves if m.chain_id == chain)

            async def syncing() -> bool:
                return state.targets[dest].public_state is PublicState.SYNCING
            with watch:
                await wait_until(syncing, what=f"target {dest} syncing")
                await kill_node(cluster, 4)
                await wait_until(lambda: moves_finished(cluster), what="drain finished", timeout_s=40)
                await wait_until(lambda: all_serving(cluster), what="chains serving")
                await watch.stop()
            assert watch.min_serving >= REPLICAS
            move = next(m for m in (await cluster.admin().moves()).moves if m.chain_id == chain)
            assert move.phase == "done" and move.attempts == 1
            assert Topology.node_of(move.to_target_id) == 5
            assert chains_of_node(cluster, 1) == [] and chains_of_node(cluster, 4) == []
            await watch.check_all_readable()

    asyncio.run(body())


def test_rebalance_moves_replicas_onto_a_new_node_within_max_moves(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_nodes=3, targets_per_node=4) as cluster:
            await add_node(cluster, 4, 4)
            admin = cluster.admin()
            watch = Watch(cluster)
            await watch.seed(2)
            plan = await admin.rebalance(dry_run=True)
            assert len(plan.moves) == 3 and all(Topology.node_of(m.to_target_id) == 4 for m in plan.moves)
            assert len((await admin.rebalance(max_moves=2, dry_run=True)).moves) == 2
            assert not (await admin.moves()).moves  # a dry run moves nothing
            with watch:
                rsp = await admin.rebalance(max_moves=2, rate_bytes_per_s=10 * 1024 * 1024)
                assert len(rsp.moves) == 2 and rsp.resync_rate_bytes_per_s == 10 * 1024 * 1024
                await wait_until(lambda: moves_finished(cluster), what="rebalance finished")
                await wait_until(lambda: all_serving(cluster), what="chains serving")
                await watch.stop()
            assert watch.min_serving >= REPLICAS
            assert len(chains_of_node(cluster, 4)) == 2
            # The CLI's view of the same moves.
            args = argparse.Namespace(command="drain", nodes=["status"], json=False)
            assert await run_move_command(admin, args) == 0
            shown = capsys.readouterr().out
            assert shown.count("[rebalance] done") == 2 and "resync rate 10485760 B/s" in shown
            with pytest.raises(InvalidArgument, match="node ids"):
                await run_move_command(admin, argparse.Namespace(command="drain", nodes=["x"], target=[], json=False))
            assert all(n.resync_pacer.rate_bytes_per_s == 10 * 1024 * 1024 for n in cluster.nodes.values())
            await watch.check_all_readable()

    asyncio.run(body())


def test_refused_drains_and_undrain(tmp_path: Path) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_nodes=3, targets_per_node=2) as cluster:
            admin = cluster.admin()
            with pytest.raises(NotFound, match="node 9 is not a registered storage node"):
                await admin.drain([9], [])
            with pytest.raises(InvalidArgument, match="no node can take the replica"):
                await admin.drain([1], [])
            assert not (await admin.moves()).draining_node_ids  # a refused drain changes nothing
            # A node with room but a slow resync: the drain starts, undrain takes the destinations back out.
            await add_node(cluster, 4, 2, rate_bytes_per_s=64 * 1024)
            watch = Watch(cluster)
            await watch.seed(8)
            for node in cluster.nodes.values():
                node.config.resync_rate_bytes_per_s = 64 * 1024
            rsp = await admin.drain([1], [])
            assert len(rsp.moves) == 2
            with pytest.raises(InvalidArgument, match="already has a replica move"):
                await admin.drain([2], [])
            undone = await admin.undrain([1], [])
            assert "2 move(s) cancelled" in undone.message
            assert cluster.mgmtd is not None
            state = cluster.mgmtd.state
            assert all(len(c.target_ids) == REPLICAS for c in state.chains.values())
            assert sorted(chains_of_node(cluster, 1)) == sorted(cluster.chain_ids)
            assert chains_of_node(cluster, 4) == []
            await wait_until(lambda: all_serving(cluster), what="chains serving")
            await watch.check_all_readable()

    asyncio.run(body())


def test_failed_disk_is_replaced_by_a_target_on_another_node(tmp_path: Path) -> None:
    """A node's disk (here the whole node) is gone: draining its target brings a new replica in
    from the chain's serving ones; the dead target leaves once the new one serves."""
    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_nodes=3, targets_per_node=1) as cluster:
            await add_node(cluster, 4, 1)
            watch = Watch(cluster)
            await watch.seed(4)
            await kill_node(cluster, 3)
            assert cluster.mgmtd is not None
            state = cluster.mgmtd.state

            async def offline() -> bool:
                return state.targets[301].public_state is PublicState.OFFLINE
            await wait_until(offline, what="target 301 offline")
            rsp = await cluster.admin().drain([], [301])
            assert [(m.from_target_id, m.to_target_id) for m in rsp.moves] == [(301, 401)]
            await wait_until(lambda: moves_finished(cluster), what="replacement finished")
            chain = state.chains[cluster.chain_ids[0]]
            assert sorted(chain.target_ids) == [101, 201, 401]
            await wait_until(lambda: all_serving(cluster), what="chains serving")
            await watch.check_all_readable()

    asyncio.run(body())


def test_moves_rsp_lists_phases() -> None:
    rsp = mpb.MovesRsp()
    rsp.moves.add(chain_id=1, from_target_id=101, to_target_id=401, phase="syncing", reason="drain")
    assert rsp.moves[0].phase == "syncing"


def test_targets_and_chains_listings_show_a_drain_under_way(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`fs3 admin targets` marks the drained node's targets (draining, -> T syncing) and their
    replacements (<- F syncing); `fs3 admin chains` lists the chain's move; both say nothing once done."""
    from fs3.cli.main import main

    def listing(cluster: InProcessCluster, what: str) -> dict[str, str]:
        """The rows of a listing by their first column, as the command printed them."""
        assert main(["admin", "--mgmtd", cluster.mgmtd_address, "--token", cluster.token, what]) == 0
        lines = capsys.readouterr().out.splitlines()
        return {line.split()[0]: line for line in lines[1:] if line.strip() and not line.startswith("-")}

    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_nodes=3, targets_per_node=1) as cluster:
            slow = 96 * 1024  # bytes/s: the resync of 4 chunks takes seconds
            for node in cluster.nodes.values():
                node.config.resync_rate_bytes_per_s = slow
            await add_node(cluster, 4, 1, slow)
            watch = Watch(cluster)
            await watch.seed(4)
            rsp = await cluster.admin().drain([1], [])
            (move,) = rsp.moves
            assert cluster.mgmtd is not None
            state = cluster.mgmtd.state

            async def syncing() -> bool:
                return state.targets[move.to_target_id].public_state is PublicState.SYNCING
            await wait_until(syncing, what="the replacement syncing")
            targets = await asyncio.to_thread(listing, cluster, "targets")
            source, dest = targets[str(move.from_target_id)], targets[str(move.to_target_id)]
            assert "draining" in source and f"-> {move.to_target_id} syncing" in source, source
            assert f"<- {move.from_target_id} syncing" in dest, dest
            assert all(" draining" not in row and "<-" not in row for t, row in targets.items()
                       if t not in (str(move.from_target_id), str(move.to_target_id)))
            chains = await asyncio.to_thread(listing, cluster, "chains")
            row = chains[str(move.chain_id)]
            assert f"{move.from_target_id} -> {move.to_target_id} syncing (drain)" in row, row
            await wait_until(lambda: moves_finished(cluster), what="drain finished", timeout_s=60)
            chains = await asyncio.to_thread(listing, cluster, "chains")
            assert "(drain)" not in chains[str(move.chain_id)]
            targets = await asyncio.to_thread(listing, cluster, "targets")
            assert "syncing" not in targets[str(move.to_target_id)]
            # The drained target has left its chain: it says so, not that it is still draining.
            source = targets[str(move.from_target_id)]
            assert "drained" in source and "draining" not in source, source

    asyncio.run(body())


def test_move_notes_with_no_moves_and_with_many() -> None:
    """The listings' move columns: nothing without moves (or with finished ones only); every
    unfinished move of a chain, and each target's part in them, with many under way."""
    from fs3 import common_pb2 as cpb
    from fs3.cli.moves import chain_move_notes, target_move_notes

    targets = [cpb.TargetInfo(target_id=100 + i, node_id=1 + i // 2, chain_id=1 + i % 3) for i in range(6)]
    assert target_move_notes(mpb.MovesRsp(), targets) == {} and chain_move_notes(mpb.MovesRsp()) == {}
    rsp = mpb.MovesRsp(draining_node_ids=[3])
    rsp.moves.add(chain_id=1, from_target_id=100, to_target_id=200, phase="done", reason="drain")
    rsp.moves.add(chain_id=1, from_target_id=103, to_target_id=201, phase="syncing", reason="rebalance")
    rsp.moves.add(chain_id=1, from_target_id=100, to_target_id=0, phase="pending", reason="rebalance")
    rsp.moves.add(chain_id=2, from_target_id=101, to_target_id=202, phase="failed", reason="drain")
    assert chain_move_notes(rsp) == {1: "103 -> 201 syncing (rebalance), 100 -> ? pending (rebalance)"}
    notes = target_move_notes(rsp, targets)
    assert notes[100] == "-> ? pending" and notes[103] == "-> 201 syncing" and notes[201] == "<- 103 syncing"
    assert notes[104] == notes[105] == "draining" and 101 not in notes and 202 not in notes

"""`make drain-demo`: add storage, rebalance onto it under foreground I/O, drain a node with its
receiver killed mid-sync, and report the foreground throughput during each against an idle
baseline measured in the same run.

Runs an in-process cluster (tests/inproc.py: every service in this process, real sockets), so
the copy work of a resync and the foreground I/O share one interpreter: the ratios show what the
resync byte-rate limit (``fs3 admin rebalance --rate``) leaves to foreground I/O. Throughput
numbers are this machine's, not a benchmark; the ratios are the result.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fs3.cluster.topology import Topology
from fs3.common.ids import chunk_id
from fs3.common.target_state import PublicState
from tests.inproc import InProcessCluster
from tests.test_drain import add_node, kill_node

CHUNK = 256 * 1024
SEED_CHUNKS = int(os.environ.get("FS3_DRAIN_DEMO_CHUNKS", "40"))  # per chain
WORKERS = 4
BASELINE_S = 3.0
RATE = int(os.environ.get("FS3_DRAIN_DEMO_RATE", str(1024 * 1024)))  # resync bytes/s per node
MOVES_TIMEOUT_S = 120.0


async def foreground(cluster: InProcessCluster, stop: asyncio.Event, min_s: float) -> float:
    """Bytes/s of write-then-read rounds by WORKERS clients until ``stop`` is set and ``min_s`` passed."""
    # A client of its own each time: a client name is its exactly-once identity, one per instance.
    client = cluster.client(b"demo-fg-%d" % time.monotonic_ns(), retry_total_ms=30_000)
    moved = 0
    started = time.monotonic()
    payload = os.urandom(CHUNK)

    async def worker(w: int) -> None:
        nonlocal moved
        i = 0
        while not stop.is_set() or time.monotonic() - started < min_s:
            chain = cluster.chain_ids[(w + i) % len(cluster.chain_ids)]
            cid = chunk_id(900 + w, i % 16)
            await client.write(chain, cid, 0, payload, CHUNK)
            got, _ = await client.read(chain, cid, 0, CHUNK)
            assert got == payload
            moved += 2 * CHUNK
            i += 1

    await asyncio.gather(*(worker(w) for w in range(WORKERS)))
    return moved / (time.monotonic() - started)


def serving_min(cluster: InProcessCluster) -> int:
    assert cluster.mgmtd is not None
    state = cluster.mgmtd.state
    return min(sum(1 for t in c.target_ids if state.targets[t].public_state is PublicState.SERVING)
               for c in state.chains.values())


async def follow(cluster: InProcessCluster, stop: asyncio.Event, label: str) -> tuple[float, int]:
    """Print progress until every move finished; returns (seconds, fewest serving replicas seen)."""
    admin = cluster.admin()
    started = time.monotonic()
    fewest, last = 3, ""
    while time.monotonic() - started < MOVES_TIMEOUT_S:
        fewest = min(fewest, serving_min(cluster))
        rsp = await admin.moves()
        phases = [m.phase for m in rsp.moves if m.reason != "undrain"]
        line = ", ".join(f"{p} {phases.count(p)}" for p in ("pending", "syncing", "removing", "done", "failed")
                         if p in phases)
        if line != last:
            print(f"  [{time.monotonic() - started:5.1f} s] {label}: {line}", flush=True)
            last = line
        if all(m.phase in ("done", "failed") for m in rsp.moves):
            stop.set()
            return time.monotonic() - started, fewest
        await asyncio.sleep(0.05)
    stop.set()
    raise SystemExit(f"{label}: moves did not finish within {MOVES_TIMEOUT_S:.0f} s")


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fs3-drain-demo-") as root:
        async with InProcessCluster(Path(root), storage_nodes=3, targets_per_node=4, io_threads=4) as cluster:
            admin = cluster.admin()
            seeder = cluster.client(b"demo-seed")
            for chain in cluster.chain_ids:
                for i in range(SEED_CHUNKS):
                    await seeder.write(chain, chunk_id(chain, i), 0, os.urandom(CHUNK), CHUNK)
            total_mib = len(cluster.chain_ids) * SEED_CHUNKS * CHUNK / 2**20
            print(f"cluster: 3 nodes x 4 targets, {len(cluster.chain_ids)} chains of 3, {total_mib:.0f} MiB per "
                  f"replica set")

            idle_done = asyncio.Event()
            idle_done.set()  # no moves to wait for: just the minimum time
            idle = await foreground(cluster, idle_done, BASELINE_S)
            print(f"idle foreground: {idle / 2**20:.1f} MiB/s ({WORKERS} clients, {CHUNK // 1024} KiB write+read)")

            await add_node(cluster, 4, 4)
            await add_node(cluster, 5, 4)
            plan = await admin.rebalance(dry_run=True)
            print(f"added nodes 4 and 5; rebalance plan: {len(plan.moves)} moves")
            rsp = await admin.rebalance(rate_bytes_per_s=RATE)
            stop = asyncio.Event()
            during, (took, fewest) = await asyncio.gather(foreground(cluster, stop, 1.0),
                                                           follow(cluster, stop, "rebalance"))
            ratio = during / idle
            print(f"rebalance: {len(rsp.moves)} moves in {took:.1f} s at --rate {RATE / 2**20:g} MiB/s; fewest serving "
                  f"replicas seen {fewest}")
            print(f"foreground during rebalance: {during / 2**20:.1f} MiB/s = {ratio:.2f} of idle")

            # A fresh node 6 (the least loaded: it receives first); drain node 1 at the same rate
            # and kill node 6 while it syncs: the moves fall back and retry on nodes 4 and 5.
            assert cluster.mgmtd is not None
            state = cluster.mgmtd.state
            await add_node(cluster, 6, 4)
            rsp = await admin.drain([1], [])
            drains = [m for m in rsp.moves if m.reason == "drain" and m.phase not in ("done", "failed")]
            print(f"drain node 1: {len(drains)} moves, to targets {[m.to_target_id for m in drains]}")
            victim_target = drains[0].to_target_id
            victim = Topology.node_of(victim_target)
            for _ in range(400):
                if state.targets[victim_target].public_state is PublicState.SYNCING:
                    break
                await asyncio.sleep(0.02)
            await kill_node(cluster, victim)
            print(f"  killed node {victim} while target {victim_target} was syncing")
            stop = asyncio.Event()
            during_drain, (took, fewest) = await asyncio.gather(foreground(cluster, stop, 1.0),
                                                                 follow(cluster, stop, "drain"))
            final = await admin.moves()
            retried = [m for m in final.moves if m.reason == "drain" and m.attempts]
            for m in final.moves:
                if m.reason == "drain":
                    print(f"  chain {m.chain_id}: {m.from_target_id} -> {m.to_target_id} {m.phase}, "
                          f"{m.attempts} failed destination(s)")
            left = [tid for tid, t in state.targets.items() if t.info.node_id == 1 and t.info.chain_id]
            print(f"drain: done in {took:.1f} s; {len(retried)} move(s) retried on another node; node 1 holds "
                  f"{len(left)} replicas; fewest serving replicas seen {fewest}")
            print(f"foreground during drain (a node killed): {during_drain / 2**20:.1f} MiB/s = "
                  f"{during_drain / idle:.2f} of idle")
            verify = await admin.verify()
            print(f"verify: {'ok' if verify.ok else 'MISMATCH'}")
            if not verify.ok or left or fewest < 3:
                raise SystemExit("drain demo FAILED")
            print(f"RESULT foreground throughput during rebalance / idle = {ratio:.2f}")


if __name__ == "__main__":
    asyncio.run(main())

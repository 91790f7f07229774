"""Chunk write/read throughput through 1- and 3-replica chains, next to a raw socket baseline.

Everything is measured in one run on this machine, and reported as ratios to the baseline:

* raw baseline: a uvloop asyncio TCP server in its own process; the client sends N-byte
  requests and gets a small answer (the write shape), or sends a small request and gets N bytes
  back (the read shape), with the same number of requests in flight as the fs3 runs.
* fs3: mgmtd + 3 storage processes (`fs3 storage`), one 3-replica chain and one 1-replica chain,
  the Python client with the same concurrency, over the framed transport and over gRPC.
* ``framed+cap``: the framed runs again as a client that is not a service (a user token), so
  storage checks a data-path capability (HMAC-SHA256) on every request. The cost of data-path
  authorization is measured A/B: rounds of the framed workloads as a service (a cluster token: no
  check) and as a user, alternating, each ratio the median over the rounds (this machine's speed
  drifts within a run far more than the check costs).

Usage: ``python bench/chunk_bench.py [--seconds 3] [--inflight 8] [--fsync]``.
Writes ``bench/results/chunk-<timestamp>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing
import os
import random
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fs3.client.admin import AdminClient  # noqa: E402
from fs3.client.routing import RoutingCache  # noqa: E402
from fs3.client.storage_client import StorageClient, StorageClientConfig  # noqa: E402
from fs3.common.capability import Access, Capability, check_chunk_access, derive_key, sign  # noqa: E402
from fs3.common.ids import chunk_id  # noqa: E402
from fs3.common.target_state import PublicState  # noqa: E402
from fs3.rpc.channel import RealChannelFactory  # noqa: E402
from tests.harness import ProcessCluster, free_port  # noqa: E402

MIB = 1024 * 1024
_LEN = struct.Struct("<II")  # request bytes, wanted response bytes
_USER_TOKEN = "fs3u.0000000000000bec." + "b" * 43


# -- raw baseline ----------------------------------------------------------------------------

def _raw_server(port: int) -> None:
    import uvloop

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        blob = bytes(4 * MIB)
        try:
            while True:
                size, want = _LEN.unpack(await reader.readexactly(_LEN.size))
                if size:
                    await reader.readexactly(size)
                writer.write(_LEN.pack(want, 0))
                if want:
                    writer.write(memoryview(blob)[:want])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, limit=8 * MIB)
        async with server:
            await server.serve_forever()

    uvloop.run(main())


async def _raw_client(port: int, inflight: int, send: int, want: int, seconds: float) -> tuple[int, float]:
    payload = bytes(send)
    count = 0
    stop_at = time.perf_counter() + seconds

    async def conn() -> None:
        nonlocal count
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=8 * MIB)
        while time.perf_counter() < stop_at:
            writer.write(_LEN.pack(send, want))
            if send:
                writer.write(payload)
            await writer.drain()
            size, _ = _LEN.unpack(await reader.readexactly(_LEN.size))
            if size:
                await reader.readexactly(size)
            count += 1
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(conn() for _ in range(inflight)))
    return count, time.perf_counter() - start


# -- fs3 -------------------------------------------------------------------------------------

async def _run_for(seconds: float, inflight: int, op: Callable[[int], Awaitable[None]]) -> tuple[int, float]:
    count = 0
    stop_at = time.perf_counter() + seconds

    async def worker(wid: int) -> None:
        nonlocal count
        i = wid
        while time.perf_counter() < stop_at:
            await op(i)
            count += 1
            i += inflight

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(inflight)))
    return count, time.perf_counter() - start


class _HeldCapability:
    """A capability signed here as meta would (the bench holds the cluster token), valid for the run."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def current(self) -> bytes:
        return self.raw

    async def renew(self, refused: bytes) -> bytes:
        return self.raw


def _capability(cluster: ProcessCluster, inode_id: int, chain: int) -> _HeldCapability:
    expires_ms = time.time_ns() // 1_000_000 + 3_600_000
    return _HeldCapability(sign(Capability(inode_id, Access.READ | Access.WRITE, (chain,), expires_ms),
                                derive_key(cluster.token)))


async def _fs3_runs(cluster: ProcessCluster, transport: str, seconds: float, inflight: int,
                    chains: dict[int, int], capabilities: bool = False) -> dict[str, float]:
    """The workloads over ``transport``; ``capabilities``: as a user (storage checks a capability
    on every request) instead of as a service."""
    channels = RealChannelFactory(_USER_TOKEN if capabilities else cluster.token, transport)  # type: ignore[arg-type]
    routing = RoutingCache([cluster.address("mgmtd", transport)], channels)
    client = StorageClient(routing, channels, f"bench-{transport}{'-cap' if capabilities else ''}".encode(),
                           StorageClientConfig(channels_max=max(64, inflight * 2)))
    results: dict[str, float] = {}
    big = os.urandom(MIB)
    rng = random.Random(7)
    for replicas, chain in sorted(chains.items()):
        prefix = 1000 + replicas * 10 + (1 if transport == "grpc" else 0) + (2 if capabilities else 0)
        held = _capability(cluster, prefix, chain) if capabilities else None
        written: list[int] = []

        async def write(i: int, chain: int = chain, prefix: int = prefix, written: list[int] = written,
                        held: _HeldCapability | None = held) -> None:
            await client.write(chain, chunk_id(prefix, i), 0, big, MIB, capability=held)
            written.append(i)

        n, elapsed = await _run_for(seconds, inflight, write)
        results[f"write_1m_r{replicas}_MiBps"] = n / elapsed
        ids = sorted(written)

        async def read(i: int, chain: int = chain, prefix: int = prefix, ids: list[int] = ids,
                       held: _HeldCapability | None = held) -> None:
            data, _ = await client.read(chain, chunk_id(prefix, ids[i % len(ids)]), 0, MIB, capability=held)
            assert len(data) == MIB

        n, elapsed = await _run_for(seconds, inflight, read)
        results[f"read_1m_r{replicas}_MiBps"] = n / elapsed

        async def read_small(i: int, chain: int = chain, prefix: int = prefix, ids: list[int] = ids,
                             held: _HeldCapability | None = held) -> None:
            offset = rng.randrange(0, MIB // 4096) * 4096
            data, _ = await client.read(chain, chunk_id(prefix, ids[i % len(ids)]), offset, 4096, capability=held)
            assert len(data) == 4096

        n, elapsed = await _run_for(seconds, inflight, read_small)
        results[f"read_4k_r{replicas}_ops"] = n / elapsed
    await channels.close()
    return results


def _check_cost_us(rounds: int = 20_000) -> float:
    """Microseconds storage spends checking one capability (one HMAC-SHA256 over ~30 bytes)."""
    key = derive_key("bench-token")
    raw = sign(Capability(7, Access.READ | Access.WRITE, (1, 2, 3), 1 << 62), key)
    start = time.perf_counter()
    for i in range(rounds):
        check_chunk_access(raw, (key,), need=Access.WRITE, inode_id=7, chunk_index=i, chain_id=i % 3 + 1,
                           now_ms=0, skew_ms=0)
    return (time.perf_counter() - start) / rounds * 1e6


async def _setup(cluster: ProcessCluster) -> dict[int, int]:
    channels = RealChannelFactory(cluster.token, "framed")
    admin = AdminClient(cluster.mgmtd_address, channels)
    for _ in range(200):
        if len(await admin.targets()) >= 6:
            break
        await asyncio.sleep(0.05)
    await admin.create_chain_table(1, chains=[(1, [101, 201, 301]), (2, [102])])
    for _ in range(400):
        rsp = await admin.chains()
        if rsp.chains and all(t.public_state == int(PublicState.SERVING) for t in rsp.targets if t.chain_id):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # let every node see the final routing
    await channels.close()
    return {3: 1, 1: 2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--fsync", action="store_true", help="fsync chunk data and metadata on commit")
    parser.add_argument("--cap-rounds", type=int, default=3,
                        help="A/B rounds of framed runs without and with capability checks")
    parser.add_argument("--data-dir", help="where the storage targets live (default: a temporary directory; "
                                           "/dev/shm isolates protocol cost from the disk)")
    args = parser.parse_args()

    import uvloop

    def measure_baseline() -> dict[str, float]:
        port = free_port()
        raw = multiprocessing.get_context("spawn").Process(target=_raw_server, args=(port,), daemon=True)
        raw.start()
        # The server process imports this module first (spawn): on a busy machine that takes a while.
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        values: dict[str, float] = {}

        async def run() -> None:
            n, elapsed = await _raw_client(port, args.inflight, MIB, 0, args.seconds)
            values["raw_send_1m_MiBps"] = n / elapsed
            n, elapsed = await _raw_client(port, args.inflight, 0, MIB, args.seconds)
            values["raw_recv_1m_MiBps"] = n / elapsed
            n, elapsed = await _raw_client(port, args.inflight, 0, 4096, args.seconds)
            values["raw_recv_4k_ops"] = n / elapsed

        try:
            uvloop.run(run())
        finally:
            raw.terminate()
            raw.join(5)
        return values

    # The baseline runs before and after fs3 and the two are averaged: this machine's speed drifts.
    before = measure_baseline()
    results: dict[str, dict[str, float]] = {}
    ab_rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="fs3-bench-", dir=args.data_dir) as tmp:
        cluster = ProcessCluster(Path(tmp), storage_nodes=3, targets_per_node=2, fsync=args.fsync)
        cluster.env["FS3_LOG_LEVEL"] = "WARNING"
        try:
            cluster.start_all()
            chains = uvloop.run(_setup(cluster))
            for label, transport, capabilities in (("framed", "framed", False), ("framed+cap", "framed", True),
                                                   ("grpc", "grpc", False)):
                results[label] = uvloop.run(_fs3_runs(cluster, transport, args.seconds, args.inflight, chains,
                                                      capabilities))
            ab_seconds = max(1.0, args.seconds / 2)
            for _ in range(args.cap_rounds):
                plain = uvloop.run(_fs3_runs(cluster, "framed", ab_seconds, args.inflight, chains))
                checked = uvloop.run(_fs3_runs(cluster, "framed", ab_seconds, args.inflight, chains, True))
                ab_rounds.append({"service": plain, "user": checked})
        finally:
            cluster.stop_all()

    after = measure_baseline()
    baseline = {key: (before[key] + after[key]) / 2 for key in before}
    rows = []
    for transport, values in results.items():
        for key, value in values.items():
            base_key = ("raw_send_1m_MiBps" if key.startswith("write_1m") else
                        "raw_recv_1m_MiBps" if key.startswith("read_1m") else "raw_recv_4k_ops")
            rows.append((transport, key, value, value / baseline[base_key]))
    print(f"raw baseline ({args.inflight} in flight): " + ", ".join(f"{k} {v:,.0f}" for k, v in baseline.items()))
    print(f"{'transport':<10} {'workload':<22} {'value':>12} {'ratio to raw':>13}")
    for transport, key, value, ratio in rows:
        print(f"{transport:<10} {key:<22} {value:>12,.1f} {ratio:>12.1%}")
    # Data-path authorization: the same framed workloads as a user (capability checked) over as a service.
    capability_ratios = {key: statistics.median(r["user"][key] / r["service"][key] for r in ab_rounds)
                         for key in results["framed"]} if ab_rounds else {}
    check_us = _check_cost_us()
    print(f"capability check: {check_us:.1f} us each; with / without checks (framed, median of "
          f"{len(ab_rounds)} A/B rounds): " + ", ".join(f"{k} {v:.1%}" for k, v in capability_ratios.items()))
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    record = {"kind": "chunk", "timestamp": stamp, "seconds": args.seconds, "inflight": args.inflight,
              "fsync": args.fsync, "data_dir": args.data_dir or tempfile.gettempdir(),
              "cpus": os.cpu_count(), "baseline": baseline, "baseline_before": before, "baseline_after": after,
              "fs3": results,
              "ratios": {f"{t}/{k}": r for t, k, _, r in rows},
              "capability_ratios": capability_ratios, "capability_check_us": check_us,
              "capability_ab_rounds": ab_rounds}
    path = out_dir / f"chunk-{stamp}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

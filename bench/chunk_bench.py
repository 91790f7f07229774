"""Chunk write/read throughput through 1- and 3-replica chains, next to a raw socket baseline.

Everything is measured in one run on this machine, and reported as ratios to the baseline:

* raw baseline: a uvloop asyncio TCP server in its own process; the client sends N-byte
  requests and gets a small answer (the write shape), or sends a small request and gets N bytes
  back (the read shape), with the same number of requests in flight as the fs3 runs.
* fs3: mgmtd + 3 storage processes (`fs3 storage`), one 3-replica chain and one 1-replica chain,
  the Python client with the same concurrency, over the framed transport and over gRPC.
* the cost of mutual TLS: a second, identical cluster with TLS on every connection (client to
  storage and storage forwarding along the chain), measured right after the clear one for each
  transport; reported as the TLS/clear ratio (``--no-tls`` skips it).

Usage: ``python bench/chunk_bench.py [--seconds 3] [--inflight 8] [--fsync] [--no-tls]``.
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
from fs3.common.ids import chunk_id  # noqa: E402
from fs3.common.target_state import PublicState  # noqa: E402
from fs3.rpc.channel import RealChannelFactory  # noqa: E402
from tests.harness import ProcessCluster, free_port  # noqa: E402

MIB = 1024 * 1024
_LEN = struct.Struct("<II")  # request bytes, wanted response bytes


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


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    """Until the baseline server accepts connections (its process may take a while to start on a
    loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


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


async def _fs3_runs(cluster: ProcessCluster, transport: str, seconds: float, inflight: int,
                    chains: dict[int, int]) -> dict[str, float]:
    channels = RealChannelFactory(cluster.token, transport, cluster.client_tls)  # type: ignore[arg-type]
    routing = RoutingCache([cluster.address("mgmtd", transport)], channels)
    client = StorageClient(routing, channels, f"bench-{transport}".encode(),
                           StorageClientConfig(channels_max=max(64, inflight * 2)))
    results: dict[str, float] = {}
    big = os.urandom(MIB)
    rng = random.Random(7)
    for replicas, chain in sorted(chains.items()):
        prefix = 1000 + replicas * 10 + (1 if transport == "grpc" else 0)
        written: list[int] = []

        async def write(i: int, chain: int = chain, prefix: int = prefix, written: list[int] = written) -> None:
            await client.write(chain, chunk_id(prefix, i), 0, big, MIB)
            written.append(i)

        n, elapsed = await _run_for(seconds, inflight, write)
        results[f"write_1m_r{replicas}_MiBps"] = n / elapsed
        ids = sorted(written)

        async def read(i: int, chain: int = chain, prefix: int = prefix, ids: list[int] = ids) -> None:
            data, _ = await client.read(chain, chunk_id(prefix, ids[i % len(ids)]), 0, MIB)
            assert len(data) == MIB

        n, elapsed = await _run_for(seconds, inflight, read)
        results[f"read_1m_r{replicas}_MiBps"] = n / elapsed

        async def read_small(i: int, chain: int = chain, prefix: int = prefix, ids: list[int] = ids) -> None:
            offset = rng.randrange(0, MIB // 4096) * 4096
            data, _ = await client.read(chain, chunk_id(prefix, ids[i % len(ids)]), offset, 4096)
            assert len(data) == 4096

        n, elapsed = await _run_for(seconds, inflight, read_small)
        results[f"read_4k_r{replicas}_ops"] = n / elapsed
    await channels.close()
    return results


async def _setup(cluster: ProcessCluster) -> dict[int, int]:
    channels = RealChannelFactory(cluster.token, "framed", cluster.client_tls)
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
    parser.add_argument("--no-tls", action="store_true", help="skip the run with mutual TLS")
    parser.add_argument("--data-dir", help="where the storage targets live (default: a temporary directory; "
                                           "/dev/shm isolates protocol cost from the disk)")
    args = parser.parse_args()

    import uvloop

    def measure_baseline() -> dict[str, float]:
        port = free_port()
        raw = multiprocessing.get_context("spawn").Process(target=_raw_server, args=(port,), daemon=True)
        raw.start()
        _wait_listening(port)
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
    with tempfile.TemporaryDirectory(prefix="fs3-bench-", dir=args.data_dir) as tmp:
        # The clear and the TLS cluster run side by side; each transport is measured on one right
        # after the other, so that the ratio of the two sees the same machine.
        clusters = {"": ProcessCluster(Path(tmp) / "clear", storage_nodes=3, targets_per_node=2, fsync=args.fsync)}
        if not args.no_tls:
            clusters["+tls"] = ProcessCluster(Path(tmp) / "tls", storage_nodes=3, targets_per_node=2,
                                              fsync=args.fsync, tls=True)
        try:
            chains = {}
            for suffix, cluster in clusters.items():
                cluster.env["FS3_LOG_LEVEL"] = "WARNING"
                cluster.start_all()
                chains[suffix] = uvloop.run(_setup(cluster))
            for transport in ("framed", "grpc"):
                for suffix, cluster in clusters.items():
                    results[transport + suffix] = uvloop.run(
                        _fs3_runs(cluster, transport, args.seconds, args.inflight, chains[suffix]))
        finally:
            for cluster in clusters.values():
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
    tls_vs_clear = {f"{transport}/{key}": value / results[transport.removesuffix("+tls")][key]
                    for transport, key, value, _ in rows if transport.endswith("+tls")}
    print(f"{'transport':<12} {'workload':<22} {'value':>12} {'ratio to raw':>13} {'TLS/clear':>10}")
    for transport, key, value, ratio in rows:
        versus = tls_vs_clear.get(f"{transport}/{key}")
        print(f"{transport:<12} {key:<22} {value:>12,.1f} {ratio:>12.1%} "
              f"{f'{versus:.1%}' if versus is not None else '':>10}")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    record = {"kind": "chunk", "timestamp": stamp, "seconds": args.seconds, "inflight": args.inflight,
              "fsync": args.fsync, "data_dir": args.data_dir or tempfile.gettempdir(),
              "cpus": os.cpu_count(), "baseline": baseline, "baseline_before": before, "baseline_after": after,
              "fs3": results,
              "ratios": {f"{t}/{k}": r for t, k, _, r in rows}, "tls_vs_clear": tls_vs_clear}
    path = out_dir / f"chunk-{stamp}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

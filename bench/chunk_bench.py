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
* data-path capabilities: the framed workloads run by two clients side by side, each with half the
  requests in flight: one as a service (a cluster token: storage checks nothing) and one as a user
  (a user token: storage checks a capability, one HMAC-SHA256, on every request). Side by side,
  both see the same machine, whose speed drifts within a run by far more than the check costs; the
  ratio of their rates, the median over ``--cap-rounds`` rounds, is the cost of the check.

* pipelined forwarding against the local disk: 1 MiB writes through a 3-replica chain on two
  more clusters side by side, one forwarding each update while it stages it (the default) and one
  staging first (``pipeline_forward = false``), and the local disk's write rate — ``inflight``
  threads writing new 1 MiB files into the same file system, as a target writes chunk files. The
  three are measured one after the other, ``--pipeline-rounds`` times, in alternating order;
  reported as the median ratio of each chain's rate to the disk's. A chain of three writes every
  byte three times to this one disk, so 1/3 is the most it can reach. ``--only-pipeline`` runs
  just this part.

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
from concurrent.futures import ThreadPoolExecutor
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
from tests.capabilities import FixedCapability, sign_as_meta  # noqa: E402
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

async def _run_for(seconds: float, inflight: int, op: Callable[[int, int], Awaitable[None]],
                   streams: int = 1) -> tuple[list[int], float]:
    """``inflight`` workers calling ``op(stream, i)`` for ``seconds``, worker ``w`` in stream
    ``w % streams``; the calls each stream completed, and the time taken."""
    counts = [0] * streams
    stop_at = time.perf_counter() + seconds

    async def worker(wid: int) -> None:
        stream = wid % streams
        i = wid
        while time.perf_counter() < stop_at:
            await op(stream, i)
            counts[stream] += 1
            i += inflight

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(inflight)))
    return counts, time.perf_counter() - start


def _capability(cluster: ProcessCluster, inode_id: int, chain: int) -> FixedCapability:
    """A capability signed here as meta would (the bench holds the cluster token), valid for the run."""
    expires_ms = time.time_ns() // 1_000_000 + 3_600_000
    return FixedCapability(sign_as_meta(cluster.token, inode_id, (chain,), expires_ms))


async def _fs3_runs(cluster: ProcessCluster, transport: str, seconds: float, inflight: int,
                    chains: dict[int, int], as_user: tuple[bool, ...] = (False,)) -> list[dict[str, float]]:
    """The workloads over ``transport``, one result per stream of ``as_user``: a stream as a user
    (a user token; storage checks a capability on every request) or as a service (a cluster token:
    no check). Streams run side by side, sharing the requests in flight, so they see the same
    machine: their ratio is what the check costs, however this machine's speed drifts."""
    factories = [RealChannelFactory(_USER_TOKEN if user else cluster.token, transport,  # type: ignore[arg-type]
                                    cluster.client_tls)
                 for user in as_user]
    # A new client id per run: a storage node remembers each id's exactly-once sequence numbers.
    clients = [StorageClient(RoutingCache([cluster.address("mgmtd", transport)], channels), channels,
                             f"bench-{transport}-{os.urandom(6).hex()}".encode(),
                             StorageClientConfig(channels_max=max(64, inflight * 2))) for channels in factories]
    results: list[dict[str, float]] = [{} for _ in as_user]
    big = os.urandom(MIB)
    rng = random.Random(7)
    streams = len(as_user)
    for replicas, chain in sorted(chains.items()):
        prefixes = [1000 + replicas * 10 + (1 if transport == "grpc" else 0) + 2 * s + (4 if user else 0)
                    for s, user in enumerate(as_user)]
        held = [_capability(cluster, prefix, chain) if user else None
                for prefix, user in zip(prefixes, as_user, strict=True)]
        written: list[list[int]] = [[] for _ in as_user]

        def record(key: str, counts: list[int], elapsed: float) -> None:
            for stream, count in enumerate(counts):
                results[stream][key] = count / elapsed

        async def write(s: int, i: int, chain: int = chain, prefixes: list[int] = prefixes,
                        held: list[FixedCapability | None] = held, written: list[list[int]] = written) -> None:
            await clients[s].write(chain, chunk_id(prefixes[s], i), 0, big, MIB, capability=held[s])
            written[s].append(i)

        record(f"write_1m_r{replicas}_MiBps", *await _run_for(seconds, inflight, write, streams))
        ids = [sorted(w) for w in written]

        async def read(s: int, i: int, chain: int = chain, prefixes: list[int] = prefixes,
                       held: list[FixedCapability | None] = held, ids: list[list[int]] = ids) -> None:
            data, _ = await clients[s].read(chain, chunk_id(prefixes[s], ids[s][i % len(ids[s])]), 0, MIB,
                                            capability=held[s])
            assert len(data) == MIB

        record(f"read_1m_r{replicas}_MiBps", *await _run_for(seconds, inflight, read, streams))

        async def read_small(s: int, i: int, chain: int = chain, prefixes: list[int] = prefixes,
                             held: list[FixedCapability | None] = held, ids: list[list[int]] = ids) -> None:
            offset = rng.randrange(0, MIB // 4096) * 4096
            data, _ = await clients[s].read(chain, chunk_id(prefixes[s], ids[s][i % len(ids[s])]), offset, 4096,
                                            capability=held[s])
            assert len(data) == 4096

        record(f"read_4k_r{replicas}_ops", *await _run_for(seconds, inflight, read_small, streams))
    for channels in factories:
        await channels.close()
    return results


def _disk_write_rate(directory: Path, seconds: float, inflight: int, fsync: bool) -> float:
    """MiB/s of ``inflight`` threads writing new 1 MiB files into ``directory`` (each file removed
    after the run), as a storage target writes a chunk file per new version."""
    payload = os.urandom(MIB)
    directory.mkdir(parents=True, exist_ok=True)
    stop_at = time.perf_counter() + seconds

    def worker(wid: int) -> int:
        count = 0
        while time.perf_counter() < stop_at:
            fd = os.open(directory / f"{wid}-{count}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, payload)
                if fsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            count += 1
        return count

    start = time.perf_counter()
    with ThreadPoolExecutor(inflight) as pool:
        total = sum(pool.map(worker, range(inflight)))
    elapsed = time.perf_counter() - start
    for name in os.listdir(directory):
        os.unlink(directory / name)
    return total / elapsed


async def _chain_write_rate(cluster: ProcessCluster, chain: int, prefix: int, seconds: float,
                            inflight: int) -> float:
    """MiB/s of 1 MiB chunk writes through ``chain`` (new chunks under ``prefix``)."""
    channels = RealChannelFactory(cluster.token, "framed", cluster.client_tls)
    client = StorageClient(RoutingCache([cluster.address("mgmtd", "framed")], channels), channels,
                           f"bench-pipe-{os.urandom(6).hex()}".encode(),
                           StorageClientConfig(channels_max=max(64, inflight * 2)))
    big = os.urandom(MIB)

    async def write(_s: int, i: int) -> None:
        await client.write(chain, chunk_id(prefix, i), 0, big, MIB)

    try:
        counts, elapsed = await _run_for(seconds, inflight, write)
    finally:
        await channels.close()
    return counts[0] / elapsed


def _pipeline_rounds(root: Path, args: argparse.Namespace) -> dict[str, object]:
    """The 3-replica write rate with and without pipelined forwarding, next to the local disk's
    write rate, in ``args.pipeline_rounds`` interleaved rounds (see the module docstring)."""
    import uvloop

    clusters = {mode: ProcessCluster(root / mode, storage_nodes=3, targets_per_node=2, fsync=args.fsync)
                for mode in ("pipelined", "serial")}
    clusters["serial"].env["FS3_STORAGE_REPLICA_PIPELINE_FORWARD"] = "false"
    rounds: list[dict[str, float]] = []
    try:
        chains = {}
        for cluster in clusters.values():
            cluster.env["FS3_LOG_LEVEL"] = "WARNING"
            cluster.start_all()
            chains[id(cluster)] = uvloop.run(_setup(cluster))[3]
        for n in range(args.pipeline_rounds):
            order = ["disk", "pipelined", "serial"]
            if n % 2:
                order.reverse()
            rates: dict[str, float] = {}
            for what in order:
                if what == "disk":
                    rates[what] = _disk_write_rate(root / "disk", args.seconds, args.inflight, args.fsync)
                else:
                    cluster = clusters[what]
                    rates[what] = uvloop.run(_chain_write_rate(cluster, chains[id(cluster)], 3000 + n,
                                                               args.seconds, args.inflight))
            rounds.append(rates)
    finally:
        for cluster in clusters.values():
            cluster.stop_all()
    summary = {f"{mode}_vs_disk": statistics.median(r[mode] / r["disk"] for r in rounds)
               for mode in ("pipelined", "serial")}
    summary["pipelined_vs_serial"] = statistics.median(r["pipelined"] / r["serial"] for r in rounds)
    print(f"3-replica 1 MiB writes against the local disk ({args.inflight} in flight, median of "
          f"{len(rounds)} interleaved rounds)")
    print(f"{'round':<6} {'disk MiB/s':>11} {'pipelined':>10} {'serial':>10} {'pipe/disk':>10} {'serial/disk':>12}")
    for n, r in enumerate(rounds):
        print(f"{n:<6} {r['disk']:>11,.1f} {r['pipelined']:>10,.1f} {r['serial']:>10,.1f} "
              f"{r['pipelined'] / r['disk']:>10.3f} {r['serial'] / r['disk']:>12.3f}")
    print(f"median: pipelined/disk {summary['pipelined_vs_disk']:.3f}, serial/disk {summary['serial_vs_disk']:.3f}, "
          f"pipelined/serial {summary['pipelined_vs_serial']:.3f}")
    return {"rounds": rounds, **summary}


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
    parser.add_argument("--cap-rounds", type=int, default=3,
                        help="rounds of the framed workloads with and without capability checks side by side")
    parser.add_argument("--data-dir", help="where the storage targets live (default: a temporary directory; "
                                           "/dev/shm isolates protocol cost from the disk)")
    parser.add_argument("--pipeline-rounds", type=int, default=3,
                        help="interleaved rounds of 3-replica writes with and without pipelined forwarding "
                             "next to the local disk's write rate (0 skips them)")
    parser.add_argument("--only-pipeline", action="store_true",
                        help="run only the pipelined-forwarding rounds")
    args = parser.parse_args()
    if args.seconds <= 0 or args.inflight < 1 or args.pipeline_rounds < 0 or args.cap_rounds < 0:
        parser.error("--seconds must be positive, --inflight at least 1, the round counts at least 0")

    import uvloop

    if args.only_pipeline:
        with tempfile.TemporaryDirectory(prefix="fs3-bench-", dir=args.data_dir) as tmp:
            pipeline = _pipeline_rounds(Path(tmp), args)
        _save({"kind": "chunk-pipeline", "seconds": args.seconds, "inflight": args.inflight, "fsync": args.fsync,
               "data_dir": args.data_dir or tempfile.gettempdir(), "cpus": os.cpu_count(), "pipeline": pipeline})
        return 0

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
    ab_rounds: list[dict[str, dict[str, float]]] = []
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
                        _fs3_runs(cluster, transport, args.seconds, args.inflight, chains[suffix]))[0]
            for _ in range(args.cap_rounds):
                as_service, as_user = uvloop.run(_fs3_runs(clusters[""], "framed", args.seconds, args.inflight,
                                                           chains[""], (False, True)))
                ab_rounds.append({"service": as_service, "user": as_user})
        finally:
            for cluster in clusters.values():
                cluster.stop_all()
        pipeline = _pipeline_rounds(Path(tmp) / "pipeline", args) if args.pipeline_rounds else {}

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
    # Data-path authorization: a user's rate (every request's capability checked) over a service's.
    capability_ratios = {key: statistics.median(r["user"][key] / r["service"][key] for r in ab_rounds)
                         for key in results["framed"]} if ab_rounds else {}
    check_us = _check_cost_us()
    print(f"data-path capabilities (framed; a user's and a service's requests side by side, each half of "
          f"the {args.inflight} in flight; median of {len(ab_rounds)} rounds); one check takes {check_us:.1f} us")
    print(f"{'workload':<22} {'service':>10} {'user':>10} {'user/service':>13}")
    for key, ratio in capability_ratios.items():
        service = statistics.median(r["service"][key] for r in ab_rounds)
        user = statistics.median(r["user"][key] for r in ab_rounds)
        print(f"{key:<22} {service:>10,.1f} {user:>10,.1f} {ratio:>12.1%}")
    _save({"kind": "chunk", "seconds": args.seconds, "inflight": args.inflight,
              "fsync": args.fsync, "data_dir": args.data_dir or tempfile.gettempdir(),
              "cpus": os.cpu_count(), "baseline": baseline, "baseline_before": before, "baseline_after": after,
              "fs3": results,
              "ratios": {f"{t}/{k}": r for t, k, _, r in rows}, "tls_vs_clear": tls_vs_clear,
              "capability_ratios": capability_ratios, "capability_check_us": check_us,
              "capability_ab_rounds": ab_rounds, "pipeline": pipeline})
    return 0


def _save(record: dict[str, object]) -> None:
    """Write ``record`` (stamped) to ``bench/results/chunk-<timestamp>.json``."""
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"chunk-{stamp}.json"
    path.write_text(json.dumps({"timestamp": stamp, **record}, indent=2))
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())

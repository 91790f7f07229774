"""Chunk reads and commit syncs on the storage event loop or on the I/O pool, in one run.

One storage target (RocksDB + chunk files, fsync on, as ``fs3 storage`` opens it) behind its
replica, the only member of its chain, driven in process: reader tasks read ranges of committed
1 MiB chunks while writer tasks write 4 KiB into other chunks (each write is a patch: its commit rewrites
the file in place and fdatasyncs it). A ticker task measures how late the event loop runs a 1 ms
sleep (loop lag). Two modes, alternated so that drift of the shared machine hits both:

* ``on_loop``: every chunk read and every commit's blob work runs on the event loop;
* ``pool``: the defaults — reads of at least ``offload_read_min_bytes`` and the blob work of
  commits of chunks of at least ``offload_write_min_bytes`` run on the node's I/O pool;
* ``pool_all``: as ``pool``, and reads of any size go to the pool too.

Reported as ratios pool / on_loop (throughput) and on_loop / pool (lag p99).

Usage: ``python bench/loop_io_bench.py [--seconds 3] [--rounds 2] [--read-kib 256]``.
Writes ``bench/results/loopio-<timestamp>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import save_result  # noqa: E402
from fs3 import storage_pb2 as spb  # noqa: E402
from fs3.common.checksum import crc32c  # noqa: E402
from fs3.common.errors import FS3Error  # noqa: E402
from fs3.common.ids import chunk_id  # noqa: E402
from fs3.common.target_state import PublicState  # noqa: E402
from fs3.common.tasks import finish_despite_cancel  # noqa: E402
from fs3.storage.chain_view import ChainMember, ChainView  # noqa: E402
from fs3.storage.replica import ReplicaConfig, TargetReplica  # noqa: E402
from fs3.storage.server import StorageConfig, TargetConfig, open_engines  # noqa: E402

T = TypeVar("T")
MIB = 1 << 20
CHUNK_SIZE = MIB
TARGET = 101
CHAIN = 1


class Host:
    """The storage node around a replica, reduced to a one-target chain and an I/O pool with the
    node's rule: ``run_blocking`` never returns before the thread has finished."""

    def __init__(self, io_threads: int) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="bench-io")
        self._view = ChainView(CHAIN, 1, 1, TARGET, (ChainMember(TARGET, 1, PublicState.SERVING, "local"),))

    def view(self, chain_id: int, target_id: int) -> ChainView | None:
        return self._view

    def lease_valid(self) -> bool:
        return True

    def now_ms(self) -> int:
        return int(time.monotonic() * 1000)

    async def wait_routing_change(self, known_routing_version: int, timeout_ms: int) -> None:
        await asyncio.sleep(timeout_ms / 1000)

    def request_routing_refresh(self) -> None:
        pass

    async def forward(self, member: ChainMember, req: spb.ForwardReq, payload: Any,
                      timeout_ms: int) -> spb.UpdateRsp:
        raise AssertionError("a one-target chain forwards nothing")

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await finish_despite_cancel(asyncio.get_running_loop().run_in_executor(self.pool, fn, *args))

    async def query_committed(self, member: ChainMember, req: spb.QueryCommittedReq,
                              timeout_ms: int) -> spb.QueryCommittedRsp:
        raise AssertionError("a one-target chain is its own tail")

    def update_finished(self, target_id: int, error: BaseException | None) -> None:
        pass

    def fail_target(self, target_id: int, exc: FS3Error) -> None:
        raise AssertionError(f"target {target_id} failed: {exc}")


def _write_req(cid: bytes, offset: int, data: bytes) -> spb.UpdateReq:
    return spb.UpdateReq(chain_id=CHAIN, chunk_id=cid, chain_version=1, type=spb.WRITE, offset=offset,
                         length=len(data), chunk_size=CHUNK_SIZE, checksum=crc32c(data))


async def _run_mode(root: Path, config: ReplicaConfig, seconds: float, readers: int, writers: int, chunks: int,
                    read_bytes: int, io_threads: int) -> dict[str, float]:
    engines = open_engines(StorageConfig(node_id=1, fsync=True, targets=[TargetConfig(TARGET, str(root))]))
    engine = engines[TARGET]
    host = Host(io_threads)
    replica = TargetReplica(TARGET, engine, host, config)
    ids = [chunk_id(7, i) for i in range(chunks)]
    for cid in ids:
        body = random.randbytes(CHUNK_SIZE)
        await replica.update(_write_req(cid, 0, body), body)
    # Readers and writers meet only on the event loop and the disk, not on a chunk (a dirty chunk
    # at the tail answers "try again", which would measure the retry, not the I/O).
    read_ids, write_ids = ids[: chunks // 2], ids[chunks // 2 :]
    stop = time.monotonic() + seconds
    reads = writes = 0
    lags: list[float] = []

    async def reader(rng: random.Random) -> None:
        nonlocal reads
        while time.monotonic() < stop:
            offset = rng.randrange(0, CHUNK_SIZE - read_bytes + 1, 4096)
            req = spb.ReadReq(chain_id=CHAIN, chunk_id=rng.choice(read_ids), offset=offset, length=read_bytes)
            rsp, data = await replica.read(req)
            assert len(data) == read_bytes, rsp
            reads += 1
            await asyncio.sleep(0)  # the next request arrives through the loop, as from a socket

    async def writer(index: int, rng: random.Random) -> None:
        nonlocal writes
        mine = write_ids[index::writers]  # each writer its own chunks
        while time.monotonic() < stop:
            data = rng.randbytes(4096)
            await replica.update(_write_req(rng.choice(mine), rng.randrange(0, CHUNK_SIZE, 4096), data), data)
            writes += 1

    async def ticker() -> None:
        while time.monotonic() < stop:
            began = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(max(0.0, time.perf_counter() - began - 0.001))

    started = time.monotonic()
    await asyncio.gather(ticker(), *(reader(random.Random(i)) for i in range(readers)),
                         *(writer(i, random.Random(100 + i)) for i in range(writers)))
    elapsed = time.monotonic() - started
    await replica.stop()
    host.pool.shutdown(wait=True)
    engine.close()
    lags.sort()
    return {
        "reads_per_s": reads / elapsed,
        "writes_per_s": writes / elapsed,
        "lag_p50_ms": 1000 * statistics.median(lags),
        "lag_p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))],
        "lag_max_ms": 1000 * lags[-1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--read-kib", type=int, default=256)
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="where the target lives (default: a temp dir)")
    args = parser.parse_args()
    never = 1 << 62
    modes = {
        "on_loop": ReplicaConfig(offload_read_min_bytes=never, offload_write_min_bytes=never),
        "pool": ReplicaConfig(),
        "pool_all": ReplicaConfig(offload_read_min_bytes=0),
    }
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for round_index in range(args.rounds):
        order = list(modes) if round_index % 2 == 0 else list(reversed(modes))
        for mode in order:
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                runs[mode].append(asyncio.run(_run_mode(
                    Path(tmp) / "t", modes[mode], args.seconds, args.readers, args.writers, args.chunks,
                    args.read_kib * 1024, args.io_threads)))
    summary = {mode: {key: statistics.mean(run[key] for run in values) for key in values[0]}
               for mode, values in runs.items()}
    on = summary["on_loop"]
    ratios = {}
    for mode in ("pool", "pool_all"):
        pool = summary[mode]
        ratios.update({
            f"reads_{mode}_over_on_loop": pool["reads_per_s"] / max(on["reads_per_s"], 1e-6),
            f"writes_{mode}_over_on_loop": pool["writes_per_s"] / max(on["writes_per_s"], 1e-6),
            f"lag_p99_on_loop_over_{mode}": on["lag_p99_ms"] / max(pool["lag_p99_ms"], 1e-6),
        })
    print(f"{'mode':8} {'reads/s':>10} {'writes/s':>10} {'lag p50 ms':>11} {'lag p99 ms':>11} {'lag max ms':>11}")
    for mode, values in summary.items():
        print(f"{mode:8} {values['reads_per_s']:10.0f} {values['writes_per_s']:10.0f} {values['lag_p50_ms']:11.2f} "
              f"{values['lag_p99_ms']:11.2f} {values['lag_max_ms']:11.2f}")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    path = save_result("loopio", {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                  "summary": summary, "ratios": ratios})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

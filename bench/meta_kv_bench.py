"""The metadata service on its two transaction engines, in one process: operations per second,
database round trips per operation, and where the CPU time goes.

Engines, at the same durability (every acknowledged commit on disk): the embedded RocksDB engine
(``OptimisticTxnEngine``, group-synced WAL) and PostgreSQL (``PostgresTxnEngine`` on a private
server started here with fsync, full_page_writes and synchronous_commit on). Each runs one
in-process ``MetaService`` (no RPC, no storage: what is measured is the service and its engine),
driven by ``--clients`` concurrent clients (asyncio tasks, each its own client id and request ids).

Per engine and repeat, in a fresh directory (one for all clients, as mdtest; ``--dir-per-client``:
one each, so that only the engine's own conflicts remain): create (open O_CREAT|O_EXCL), close, stat (lookup by
path, two levels deep), rename, remove. The engines alternate (their order flips each repeat) and
the report gives, per operation, the median over ``--repeats`` of the ratio PostgreSQL / RocksDB,
the round trips per operation (PostgreSQL's counter; the same every repeat), and the CPU seconds
of this process (meta and the driver) and of the PostgreSQL server processes.

Usage: ``python bench/meta_kv_bench.py [--files 2000] [--clients 16] [--repeats 3] [--dir-per-client]``.
Writes ``bench/results/meta-kv-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import save_result  # noqa: E402
from fs3 import common_pb2 as cpb  # noqa: E402
from fs3 import meta_pb2 as mpb  # noqa: E402
from fs3.client.routing import RoutingCache  # noqa: E402
from fs3.client.storage_client import StorageClient  # noqa: E402
from fs3.common.posix import O_CREAT, O_EXCL, O_WRONLY  # noqa: E402
from fs3.kv.api import TxnEngine  # noqa: E402
from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine  # noqa: E402
from fs3.kv.store import RocksKVStore  # noqa: E402
from fs3.kv.txn import OptimisticTxnEngine  # noqa: E402
from fs3.meta.service import MetaService, MetaServiceConfig  # noqa: E402
from fs3.rpc.channel import RealChannelFactory  # noqa: E402
from tests.postgres import PostgresServer, find_bin_dir, start_postgres  # noqa: E402

OPS = ("create", "close", "stat", "rename", "remove")
ENGINES = ("rocksdb", "postgres")


class Client:
    """One client of the service: its id, its request ids, the handlers called as RPC would."""

    def __init__(self, service: MetaService, number: int) -> None:
        self.service = service
        self.client_id = f"bench{number:011d}".encode()  # 16 bytes, unique per client
        self.request_id = 0

    def ctx(self) -> mpb.ReqCtx:
        self.request_id += 1
        return mpb.ReqCtx(user=mpb.User(uid=0, gid=0), client_id=self.client_id, request_id=self.request_id)

    async def call(self, name: str, req: Any) -> Any:
        rsp, _ = await getattr(self.service, name)(req, memoryview(b""))
        return rsp


def _ref(path: str) -> mpb.PathRef:
    return mpb.PathRef(path=path.encode())


async def _service(engine: TxnEngine) -> MetaService:
    channels = RealChannelFactory()
    routing = RoutingCache(["127.0.0.1:1"], channels)
    routing._install(cpb.RoutingInfo(chain_tables=[cpb.ChainTable(table_id=1, chain_ids=[11, 12, 13])]))
    service = MetaService(engine, routing, StorageClient(routing, channels, b"b" * 16),
                          MetaServiceConfig(root_mode=0o777))
    await service.start(background=False)
    return service


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes, and of their children that exited."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return total / tick


def _server_pids(server: PostgresServer) -> list[int]:
    postmaster = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    pids = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return pids


async def _phases(service: MetaService, clients: list[Client], base: str, files: int, engine: TxnEngine,
                  cpu_db: Callable[[], float], dir_per_client: bool) -> dict[str, dict[str, float]]:
    dirs = [f"{base}/d{c}" if dir_per_client else base for c in range(len(clients))]
    for path in [base, *sorted(set(dirs) - {base})]:
        await clients[0].call("make_node", mpb.MakeNodeReq(ctx=clients[0].ctx(), target=_ref(path),
                                                           type=mpb.DIRECTORY, mode=0o777))
    per_client = files // len(clients)
    names = [[f"{dirs[c]}/c{c}-{i}" for i in range(per_client)] for c in range(len(clients))]
    opened: list[list[mpb.OpenRsp]] = [[] for _ in clients]

    async def create(c: int, path: str) -> None:
        client = clients[c]
        rsp = await client.call("open", mpb.OpenReq(ctx=client.ctx(), target=_ref(path),
                                                   flags=O_CREAT | O_EXCL | O_WRONLY, mode=0o644))
        opened[c].append(rsp)

    async def close(c: int, path: str) -> None:
        client = clients[c]
        rsp = opened[c].pop()
        await client.call("close", mpb.CloseReq(ctx=client.ctx(), inode_id=rsp.inode.inode_id,
                                                session_id=rsp.session_id))

    async def stat(c: int, path: str) -> None:
        client = clients[c]
        await client.call("lookup", mpb.LookupReq(ctx=client.ctx(), target=_ref(path)))

    async def rename(c: int, path: str) -> None:
        client = clients[c]
        await client.call("rename", mpb.RenameReq(ctx=client.ctx(), source=_ref(path), destination=_ref(path + ".r")))

    async def remove(c: int, path: str) -> None:
        client = clients[c]
        await client.call("remove", mpb.RemoveReq(ctx=client.ctx(), target=_ref(path + ".r")))

    ops: dict[str, Callable[[int, str], Awaitable[None]]] = {
        "create": create, "close": close, "stat": stat, "rename": rename, "remove": remove}
    out: dict[str, dict[str, float]] = {}
    for name in OPS:
        op = ops[name]

        async def run_client(c: int, op: Callable[[int, str], Awaitable[None]] = op) -> None:
            for path in names[c]:
                await op(c, path)

        trips = getattr(engine, "round_trips", 0)
        conflicts = getattr(engine, "conflicts", 0)
        cpu_meta, cpu_server = time.process_time(), cpu_db()
        start = time.perf_counter()
        await asyncio.gather(*(run_client(c) for c in range(len(clients))))
        wall_s = time.perf_counter() - start
        count = per_client * len(clients)
        out[name] = {"ops_per_s": count / wall_s,
                     "round_trips_per_op": (getattr(engine, "round_trips", 0) - trips) / count,
                     "conflicts_per_op": (getattr(engine, "conflicts", 0) - conflicts) / count,
                     "meta_cpu_s": time.process_time() - cpu_meta, "db_cpu_s": cpu_db() - cpu_server,
                     "wall_s": wall_s}
    return out


async def _run(args: argparse.Namespace, server: PostgresServer, tmp: Path) -> dict[str, Any]:
    rocks = OptimisticTxnEngine(RocksKVStore(tmp / "rocks"), sync=True)
    pg = await PostgresTxnEngine.open(PostgresConfig(server.create_database("bench"), sync=True,
                                                     pool_size_max=args.clients))
    engines: dict[str, TxnEngine] = {"rocksdb": rocks, "postgres": pg}
    services = {name: await _service(engine) for name, engine in engines.items()}
    clients = {name: [Client(services[name], c) for c in range(args.clients)] for name in ENGINES}
    cpu_db = {"rocksdb": lambda: 0.0, "postgres": lambda: _cpu_s(_server_pids(server))}
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        order = ENGINES if repeat % 2 == 0 else tuple(reversed(ENGINES))
        run: dict[str, Any] = {}
        for name in order:
            run[name] = await _phases(services[name], clients[name], f"/r{repeat}", args.files, engines[name],
                                      cpu_db[name], args.dir_per_client)
        runs.append(run)
        print(f"repeat {repeat}: " + ", ".join(
            f"{op} pg/rocks {run['postgres'][op]['ops_per_s'] / run['rocksdb'][op]['ops_per_s']:.2f}"
            for op in OPS), flush=True)
    pg.terminate()
    rocks.store.close()
    summary = {}
    for op in OPS:
        summary[op] = {
            "rocksdb_ops_per_s": statistics.median(r["rocksdb"][op]["ops_per_s"] for r in runs),
            "postgres_ops_per_s": statistics.median(r["postgres"][op]["ops_per_s"] for r in runs),
            "ratio_postgres_over_rocksdb": statistics.median(
                r["postgres"][op]["ops_per_s"] / r["rocksdb"][op]["ops_per_s"] for r in runs),
            "postgres_round_trips_per_op": statistics.median(r["postgres"][op]["round_trips_per_op"] for r in runs),
            "postgres_conflicts_per_op": statistics.median(r["postgres"][op]["conflicts_per_op"] for r in runs),
            "postgres_meta_cpu_share": statistics.median(
                r["postgres"][op]["meta_cpu_s"] / max(1e-9, r["postgres"][op]["meta_cpu_s"]
                                                      + r["postgres"][op]["db_cpu_s"]) for r in runs),
        }
    return {"summary": summary, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2_000, help="files per engine and repeat (split across clients)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir-per-client", action="store_true",
                        help="each client in a directory of its own (default: all in one, as mdtest)")
    args = parser.parse_args()
    bin_dir = find_bin_dir()
    if bin_dir is None:
        print("PostgreSQL server binaries not found (scripts/bootstrap.sh installs them)", file=sys.stderr)
        return 2
    server = start_postgres(bin_dir, durable=True)
    try:
        with tempfile.TemporaryDirectory(prefix="fs3-meta-kv-bench-") as tmp:
            result = asyncio.run(_run(args, server, Path(tmp)))
    finally:
        server.stop()
    print(f"{'op':8} {'rocksdb/s':>10} {'postgres/s':>11} {'pg/rocks':>9} {'trips/op':>9} {'confl/op':>9} "
          f"{'meta cpu':>9}")
    for op, row in result["summary"].items():
        print(f"{op:8} {row['rocksdb_ops_per_s']:10.0f} {row['postgres_ops_per_s']:11.0f} "
              f"{row['ratio_postgres_over_rocksdb']:9.2f} {row['postgres_round_trips_per_op']:9.2f} "
              f"{row['postgres_conflicts_per_op']:9.2f} {row['postgres_meta_cpu_share']:9.0%}")
    path = save_result("meta-kv", {"files": args.files, "clients": args.clients, "repeats": args.repeats,
                                   "dir_per_client": args.dir_per_client,
                                   "postgres_version": server.version, **result})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

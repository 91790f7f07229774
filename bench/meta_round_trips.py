"""Database round trips per metadata operation on PostgreSQL, cold and warm, at two path depths.

One client, one operation at a time, on an in-process ``MetaService`` over ``PostgresTxnEngine``
(a private server started here): the counts are the engine's, exact and the same every run, not
timings. Per depth (a file ``depth`` components below the root: ``/t/f`` is depth 2) and per
operation (create = open O_CREAT|O_EXCL, close, stat = lookup by path, rename within the
directory, remove), two counts:

* ``cold``: the service's path hints cleared just before the operation (a server that never saw
  the path: just started, or the path was made through another meta server);
* ``warm``: the same operation again on a sibling (create, rename, remove) or the same path
  (stat), after the service saw the directories.

Each count is ``on the caller's path + rollbacks``: a read-only request's transaction is rolled
back after its answer, off its caller's path (one round trip the caller does not wait for).

Usage: ``python bench/meta_round_trips.py [--no-hints]`` (``--no-hints``: ``path_hints_max = 0``).
Writes ``bench/results/meta-round-trips-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.meta_kv_bench import Client, _ref  # noqa: E402
from bench.results_io import save_result  # noqa: E402
from fs3 import common_pb2 as cpb  # noqa: E402
from fs3 import meta_pb2 as mpb  # noqa: E402
from fs3.client.routing import RoutingCache  # noqa: E402
from fs3.client.storage_client import StorageClient  # noqa: E402
from fs3.common.posix import O_CREAT, O_EXCL, O_WRONLY  # noqa: E402
from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine  # noqa: E402
from fs3.meta.service import MetaService, MetaServiceConfig  # noqa: E402
from fs3.rpc.channel import RealChannelFactory  # noqa: E402
from tests.postgres import find_bin_dir, start_postgres  # noqa: E402

OPS = ("create", "close", "stat", "rename", "remove")
DEPTHS = (2, 4)


async def _service(engine: PostgresTxnEngine, hints: bool) -> MetaService:
    channels = RealChannelFactory()
    routing = RoutingCache(["127.0.0.1:1"], channels)
    routing._install(cpb.RoutingInfo(chain_tables=[cpb.ChainTable(table_id=1, chain_ids=[11, 12, 13])]))
    settings: dict[str, Any] = {"root_mode": 0o777}
    if not hints and "path_hints_max" in {f.name for f in fields(MetaServiceConfig)}:
        settings["path_hints_max"] = 0
    service = MetaService(engine, routing, StorageClient(routing, channels, b"t" * 16), MetaServiceConfig(**settings))
    await service.start(background=False)
    return service


def _forget(service: MetaService) -> None:
    hints = getattr(service, "path_hints", None)
    if hints is not None:
        hints.clear()


async def _count(engine: PostgresTxnEngine, step: Callable[[], Awaitable[Any]]) -> tuple[int, int]:
    """(round trips on the caller's path, rollbacks after it) of one operation."""
    settle = getattr(engine, "settle", None)

    async def quiet() -> None:
        if settle is not None:
            await settle()
        else:
            for _ in range(20):
                await asyncio.sleep(0.005)

    await quiet()
    start = engine.round_trips
    await step()
    on_path = engine.round_trips - start
    await quiet()
    return on_path, engine.round_trips - start - on_path


async def _depth(service: MetaService, engine: PostgresTxnEngine, depth: int) -> dict[str, dict[str, str]]:
    client = Client(service, depth)
    base = f"/t{depth}"
    dirs = [base + "".join(f"/d{i}" for i in range(1, level)) for level in range(1, depth)]
    for path in dirs:
        await client.call("make_node", mpb.MakeNodeReq(ctx=client.ctx(), target=_ref(path), type=mpb.DIRECTORY,
                                                       mode=0o777))
    parent = dirs[-1]
    handles: dict[str, mpb.OpenRsp] = {}

    async def create(name: str) -> None:
        handles[name] = await client.call("open", mpb.OpenReq(ctx=client.ctx(), target=_ref(f"{parent}/{name}"),
                                                              flags=O_CREAT | O_EXCL | O_WRONLY, mode=0o644))

    async def close(name: str) -> None:
        rsp = handles.pop(name)
        await client.call("close", mpb.CloseReq(ctx=client.ctx(), inode_id=rsp.inode.inode_id,
                                                session_id=rsp.session_id))

    async def stat(name: str) -> None:
        await client.call("lookup", mpb.LookupReq(ctx=client.ctx(), target=_ref(f"{parent}/{name}")))

    async def rename(name: str) -> None:
        await client.call("rename", mpb.RenameReq(ctx=client.ctx(), source=_ref(f"{parent}/{name}"),
                                                  destination=_ref(f"{parent}/{name}.r")))

    async def remove(name: str) -> None:
        await client.call("remove", mpb.RemoveReq(ctx=client.ctx(), target=_ref(f"{parent}/{name}.r")))

    steps: dict[str, Callable[[str], Awaitable[None]]] = {
        "create": create, "close": close, "stat": stat, "rename": rename, "remove": remove}
    out: dict[str, dict[str, str]] = {op: {} for op in OPS}
    for mode, name in (("cold", "a"), ("warm", "b")):
        for op in OPS:
            if mode == "cold":
                _forget(service)
            on_path, after = await _count(engine, partial(steps[op], name))
            out[op][mode] = f"{on_path}" + (f" (+{after})" if after else "")
    return out


async def _run(url: str, hints: bool) -> dict[str, Any]:
    engine = await PostgresTxnEngine.open(PostgresConfig(url, sync=False, pool_size_max=4))
    try:
        service = await _service(engine, hints)
        return {str(depth): await _depth(service, engine, depth) for depth in DEPTHS}
    finally:
        engine.terminate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-hints", action="store_true", help="path_hints_max = 0 (no guessed keys)")
    args = parser.parse_args()
    bin_dir = find_bin_dir()
    if bin_dir is None:
        print("PostgreSQL server binaries not found (scripts/bootstrap.sh installs them)", file=sys.stderr)
        return 2
    server = start_postgres(bin_dir, durable=False)
    try:
        result = asyncio.run(_run(server.create_database("trips"), not args.no_hints))
    finally:
        server.stop()
    print(f"{'op':8} " + " ".join(f"{f'depth {d} {m}':>14}" for d in DEPTHS for m in ("cold", "warm")))
    for op in OPS:
        print(f"{op:8} " + " ".join(f"{result[str(d)][op][m]:>14}" for d in DEPTHS for m in ("cold", "warm")))
    path = save_result("meta-round-trips", {"hints": not args.no_hints, "round_trips": result})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Operator commands: a cluster at a glance, a file's whereabouts, space, live rates, bulk work.

    fs3 status [--sessions]         nodes, targets and their states, chains, capacity, sessions
    fs3 info PATH                   inode, type, size, layout, its chunks and the targets holding them
    fs3 df                          capacity, used and free per target, and in total
    fs3 stats [--interval-s S]      requests per second by service and method, from /metrics
    fs3 warmup PATH [-p N]          read every file below PATH (each chunk read back and checked)
    fs3 rmr PATH [-p N] [--force]   remove PATH and everything below it

Each takes the cluster options of ``fs3 admin`` (``--dir``, ``--mgmtd``, ``--token-file``,
``--transport``, TLS) and ``--json``. Data and namespace work goes through the ordinary client,
so it is checked like any client's: permissions, capabilities, chunk checksums.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import posixpath
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.cli.cluster import client_tls, number_in, resolve_cluster
from fs3.cli.output import human_bytes, print_json, progress, state_name, table
from fs3.client.meta import path_ref
from fs3.common.errors import FS3Error, InvalidArgument

__all__ = ["OPERATOR_COMMANDS", "add_operator_commands", "parse_rpc_counters", "rmr_command", "run_operator"]

OPERATOR_COMMANDS = ("status", "info", "df", "stats", "warmup", "rmr")
#: Chunks ``fs3 info`` lists by default (a file of many GiB has thousands).
INFO_CHUNKS_DEFAULT = 32
_SCRAPE_TIMEOUT_S = 5.0
_READ_BLOCK_BYTES = 4 << 20


_concurrency = number_in(int, 1, 256, "a whole number")
_interval = number_in(float, 0.1, 300.0, "a number of seconds")


def add_operator_commands(sub: Any, cluster: argparse.ArgumentParser) -> None:
    """The operator commands, each with the cluster options of ``cluster`` (a parent parser)."""
    status = sub.add_parser("status", parents=[cluster], help="the cluster at a glance: nodes, targets, chains, "
                            "capacity (like juicefs status)")
    status.add_argument("--sessions", action="store_true",
                        help="also count open file sessions (meta walks the whole namespace for it)")
    info = sub.add_parser("info", parents=[cluster], help="a path's inode, layout, chunks and where they live")
    info.add_argument("path", help="a path in fs3, e.g. /data/a.bin")
    info.add_argument("--chunks", type=int, default=INFO_CHUNKS_DEFAULT,
                      help=f"list at most this many chunks (default {INFO_CHUNKS_DEFAULT}; 0: none)")
    sub.add_parser("df", parents=[cluster], help="capacity, used and free space per target and in total")
    stats = sub.add_parser("stats", parents=[cluster], help="live request rates by service and method (from each "
                           "service's /metrics, scraped twice)")
    stats.add_argument("--interval-s", type=_interval, default=1.0, help="seconds between the two scrapes")
    warmup = sub.add_parser("warmup", parents=[cluster], help="read every file below PATH, so each chunk is read "
                            "back from storage and checked")
    warmup.add_argument("path")
    warmup.add_argument("--threads", "-p", type=_concurrency, default=8, help="files read at once (default 8)")
    rmr = sub.add_parser("rmr", parents=[cluster], help="remove PATH and everything below it, many entries at once")
    rmr.add_argument("path")
    rmr.add_argument("--threads", "-p", type=_concurrency, default=16, help="removals at once (default 16)")
    rmr.add_argument("--force", action="store_true", help="needed to empty the root, /")


async def run_operator(args: argparse.Namespace) -> int:
    """One operator command on the running loop: its exit status."""
    from fs3.client.admin import AdminClient
    from fs3.rpc.channel import RealChannelFactory

    resolve_cluster(args)
    if args.service in ("status", "df", "stats"):
        channels = RealChannelFactory(args.token, args.transport, client_tls(args))
        admin = AdminClient(args.mgmtd, channels, timeout_ms=args.timeout_ms)
        try:
            command = {"status": _status, "df": _df, "stats": _stats}[args.service]
            return await command(admin, args)
        finally:
            await channels.close()
    if args.service == "rmr" and _is_root(args.path) and not args.force:
        raise InvalidArgument("refusing to remove everything under / without --force")
    from fs3.client.fs import ClientConfig, connect

    config = ClientConfig(transport=args.transport, tls=client_tls(args), rpc_timeout_ms=args.timeout_ms)
    fs = await connect(args.mgmtd, args.token, config)
    try:
        fs_command = {"info": _info, "warmup": warmup_command, "rmr": rmr_command}[args.service]
        return await fs_command(fs, args)
    finally:
        await fs.close()


def _absolute(path: str) -> str:
    """``path`` as fs3 resolves it: absolute, ``.``, ``..`` and repeated slashes folded (``//``,
    ``/a/..`` and ``/./`` are all the root). Spaces are part of a name, never trimmed: ``"/d/x "``
    is not ``/d/x``, which ``rmr`` would otherwise remove in its place."""
    return posixpath.normpath("/" + path.lstrip("/"))


def _is_root(path: str) -> bool:
    return _absolute(path) == "/"


# -- status, df ------------------------------------------------------------------------------------


async def _status(admin: Any, args: argparse.Namespace) -> int:
    nodes = await admin.nodes()
    chains_rsp = await admin.chains()
    targets = list(chains_rsp.targets) or await admin.targets()
    states = {t.target_id: t.public_state for t in targets}
    serving = [c for c in chains_rsp.chains if all(states.get(t) == cpb.SERVING for t in c.target_ids)]
    capacity = sum(t.capacity_bytes for t in targets)
    used = sum(t.used_bytes for t in targets)
    free = sum(t.free_bytes for t in targets)
    sessions: int | None = None
    if args.sessions:
        meta = await admin.metadata()
        sessions = int((await meta.fsck(False)).sessions)
    by_state: dict[str, int] = {}
    for t in targets:
        name = state_name(cpb.PublicState, t.public_state)
        by_state[name] = by_state.get(name, 0) + 1
    summary = {
        "mgmtd": args.mgmtd,
        "nodes": [{"node_id": n.node_id, "type": state_name(cpb.NodeType, n.node_type), "alive": n.alive,
                   "framed_address": n.framed_address, "grpc_address": n.grpc_address,
                   "metrics_address": n.metrics_address, "hostname": n.hostname, "pid": n.pid} for n in nodes],
        "targets": [_target_dict(t) for t in targets],
        "targets_by_state": by_state,
        "chains": [{"chain_id": c.chain_id, "chain_version": c.chain_version, "table_id": c.table_id,
                    "target_ids": list(c.target_ids),
                    "serving": c in serving} for c in chains_rsp.chains],
        "chains_serving": len(serving),
        "capacity_bytes": capacity, "used_bytes": used, "free_bytes": free,
        "open_sessions": sessions,
    }
    if args.json:
        print_json(summary)
        return 0
    alive = sum(n.alive for n in nodes)
    print(f"cluster   mgmtd {args.mgmtd}")
    print(f"nodes     {len(nodes)} ({alive} up" + (f", {len(nodes) - alive} DOWN)" if alive < len(nodes) else ")"))
    print(f"targets   {len(targets)} (" + ", ".join(f"{n} {s}" for s, n in sorted(by_state.items())) + ")")
    print(f"chains    {len(chains_rsp.chains)} ({len(serving)} fully serving)")
    print(f"space     {human_bytes(used)} used of {human_bytes(capacity)}, {human_bytes(free)} free")
    if sessions is not None:
        print(f"sessions  {sessions} open file sessions")
    print()
    print(table([[str(n.node_id), state_name(cpb.NodeType, n.node_type), "up" if n.alive else "DOWN",
                  n.framed_address, n.metrics_address or "-", n.hostname, str(n.pid)] for n in nodes],
                ["node", "type", "status", "framed", "metrics", "host", "pid"]))
    print()
    print(table([[str(c.chain_id), str(c.chain_version), "yes" if c in serving else "NO",
                  " -> ".join(f"{t}({state_name(cpb.PublicState, states.get(t, 0))})" for t in c.target_ids)]
                 for c in chains_rsp.chains], ["chain", "version", "serving", "targets (head first)"]))
    return 0 if len(serving) == len(chains_rsp.chains) and alive == len(nodes) else 2


def _target_dict(t: cpb.TargetInfo) -> dict[str, Any]:
    return {"target_id": t.target_id, "node_id": t.node_id, "chain_id": t.chain_id,
            "public_state": state_name(cpb.PublicState, t.public_state),
            "local_state": state_name(cpb.LocalState, t.local_state), "capacity_bytes": t.capacity_bytes,
            "used_bytes": t.used_bytes, "free_bytes": t.free_bytes, "chunk_count": t.chunk_count}


async def _df(admin: Any, args: argparse.Namespace) -> int:
    targets = sorted(await admin.targets(), key=lambda t: t.target_id)
    total = {"capacity_bytes": sum(t.capacity_bytes for t in targets), "used_bytes": sum(t.used_bytes for t in targets),
             "free_bytes": sum(t.free_bytes for t in targets)}
    if args.json:
        print_json({"targets": [_target_dict(t) for t in targets], "total": total})
        return 0

    def pct(used: int, capacity: int) -> str:
        return f"{100 * used / capacity:.0f}%" if capacity else "-"

    rows = [[str(t.target_id), str(t.node_id), str(t.chain_id or "-"), human_bytes(t.capacity_bytes),
             human_bytes(t.used_bytes), human_bytes(t.free_bytes), pct(t.used_bytes, t.capacity_bytes),
             state_name(cpb.PublicState, t.public_state)] for t in targets]
    rows.append(["total", "", "", human_bytes(total["capacity_bytes"]), human_bytes(total["used_bytes"]),
                 human_bytes(total["free_bytes"]), pct(total["used_bytes"], total["capacity_bytes"]), ""])
    print(table(rows, ["target", "node", "chain", "size", "used", "free", "use%", "state"]))
    return 0


# -- stats -----------------------------------------------------------------------------------------


def parse_rpc_counters(text: str) -> dict[tuple[str, str], float]:
    """``(service, method) -> requests`` from a Prometheus text exposition: every counter sample
    with a ``method`` label (whatever the counter is called: ``fs3_rpc_requests_total`` or a later
    name), summed over its other labels (status, transport). ``service`` is the sample's
    ``service`` label, else the counter's name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("counter", "unknown"):  # unknown: an exposition without TYPE lines
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total") or "method" not in sample.labels:
                continue  # _created: when the series began, not a count
            if "bytes" in sample.name:
                continue  # payload byte counters: a rate of bytes, not of requests
            key = (sample.labels.get("service", family.name), sample.labels["method"])
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=_SCRAPE_TIMEOUT_S) as rsp:
        return bytes(rsp.read()).decode("utf-8", "replace")


async def _stats(admin: Any, args: argparse.Namespace) -> int:
    endpoints = {f"{state_name(cpb.NodeType, n.node_type)}-{n.node_id}": n.metrics_address
                 for n in await admin.nodes() if n.alive and n.metrics_address}
    if args.dir:  # mgmtd is in no node list: a local cluster's cluster.json says where it serves metrics
        from fs3.common.secret_files import read_secret_file

        info = json.loads(read_secret_file(Path(args.dir) / "cluster.json"))
        address = (info.get("processes", {}).get("mgmtd") or {}).get("metrics")
        if address:
            endpoints = {"mgmtd": address, **endpoints}
    if not endpoints:
        raise InvalidArgument("no service reports a metrics address")

    async def scrape_all() -> dict[str, dict[tuple[str, str], float]]:
        texts = await asyncio.gather(*(asyncio.to_thread(_scrape, a) for a in endpoints.values()),
                                     return_exceptions=True)
        found: dict[str, dict[tuple[str, str], float]] = {}
        for name, text in zip(endpoints, texts, strict=True):
            if isinstance(text, BaseException):
                if not isinstance(text, OSError):
                    raise text
                print(f"fs3: warning: cannot scrape {name} at {endpoints[name]}: {text}", file=sys.stderr)
                continue
            found[name] = parse_rpc_counters(text)
        return found

    first = await scrape_all()
    started = time.monotonic()
    await asyncio.sleep(args.interval_s)
    second = await scrape_all()
    elapsed_s = time.monotonic() - started
    rates: list[dict[str, Any]] = []
    for node, counters in second.items():
        before = first.get(node, {})
        for (service, method), value in sorted(counters.items()):
            delta = value - before.get((service, method), 0.0)
            if delta > 0 or args.json:
                rates.append({"node": node, "service": service, "method": method,
                              "per_second": round(max(delta, 0.0) / elapsed_s, 3)})
    if args.json:
        print_json({"interval_s": round(elapsed_s, 3), "rates": rates})
        return 0
    print(f"requests per second over {elapsed_s:.1f}s ({len(second)} services scraped)")
    print(table([[r["node"], r["service"], r["method"], f"{r['per_second']:.1f}"] for r in rates],
                ["node", "counter", "method", "req/s"]) if rates else "  no requests in the interval")
    return 0


# -- info ------------------------------------------------------------------------------------------


async def _info(fs: Any, args: argparse.Namespace) -> int:
    from fs3.common.layout import chunk_location
    from fs3.rpc.storage_calls import dump_chunks

    inode: mpb.Inode = await fs.metadata.lookup(path_ref(os.fsencode(args.path)))
    layout = inode.layout
    kind = state_name(mpb.InodeType, inode.type)
    out: dict[str, Any] = {
        "path": args.path, "inode_id": inode.inode_id, "type": kind, "size": inode.size,
        "mode": f"{inode.mode:04o}", "uid": inode.uid, "gid": inode.gid, "nlink": inode.nlink,
        "layout": {"table_id": layout.table_id, "chunk_size": layout.chunk_size, "stripe": layout.stripe,
                   "chains": list(layout.chains), "seed": layout.seed},
    }
    chunks: list[dict[str, Any]] = []
    if inode.type == mpb.FILE and layout.chunk_size and layout.chains:
        total = -(-inode.size // layout.chunk_size)
        out["chunks_total"] = total
        routing = await fs.routing.refresh()
        targets = {t.target_id: t for t in routing.targets}
        nodes = {n.node_id: n for n in routing.nodes}
        chain_targets = {c.chain_id: list(c.target_ids) for c in routing.chains}
        wanted: dict[int, list[bytes]] = {}
        for index in range(min(total, max(args.chunks, 0))):
            chain_id, cid = chunk_location(layout, inode.inode_id, index)
            chunks.append({"index": index, "chain_id": chain_id, "chunk_id": cid.hex(), "replicas": []})
            wanted.setdefault(chain_id, []).append(cid)
        held: dict[tuple[int, bytes], dict[int, Any]] = {}
        for chain_id, ids in wanted.items():
            for tid in chain_targets.get(chain_id, []):
                target = targets[tid]
                node = nodes.get(target.node_id)
                if node is None:
                    continue
                address = fs.channels.node_address(node.framed_address, node.grpc_address)
                try:
                    dump = await dump_chunks(fs.channels.get(address), chain_id, tid, timeout_ms=args.timeout_ms,
                                             chunk_ids=ids)
                except FS3Error as exc:
                    for cid in ids:
                        held.setdefault((chain_id, cid), {})[tid] = str(exc)
                    continue
                for cid in ids:
                    held.setdefault((chain_id, cid), {})[tid] = dump.chunks.get(cid)
        for chunk in chunks:
            cid = bytes.fromhex(chunk["chunk_id"])
            for tid in chain_targets.get(chunk["chain_id"], []):
                seen = held.get((chunk["chain_id"], cid), {}).get(tid)
                replica: dict[str, Any] = {"target_id": tid, "node_id": targets[tid].node_id,
                                           "public_state": state_name(cpb.PublicState, targets[tid].public_state),
                                           "holds": seen is not None and not isinstance(seen, str)}
                if isinstance(seen, str):
                    replica["error"] = seen
                elif seen is not None:
                    replica.update(version=seen.commit_version, length=seen.length, checksum=f"{seen.checksum:08x}")
                chunk["replicas"].append(replica)
        out["chunks"] = chunks
    if args.json:
        print_json(out)
        return 0
    print(f"{args.path}: inode {inode.inode_id}, {kind}, {inode.size} bytes, mode {inode.mode:04o}, "
          f"uid {inode.uid} gid {inode.gid}, {inode.nlink} links")
    if inode.type == mpb.FILE:
        print(f"  layout: chain table {layout.table_id}, {layout.chunk_size} byte chunks, "
              f"chains {', '.join(map(str, layout.chains)) or '-'} (seed {layout.seed})")
        print(f"  chunks: {out.get('chunks_total', 0)}" +
              (f" (first {len(chunks)} shown; --chunks N for more)" if len(chunks) < out.get("chunks_total", 0)
               else ""))
        rows = [[str(c["index"]), str(c["chain_id"]), c["chunk_id"],
                 ", ".join(f"{r['target_id']}" + (f" v{r['version']} {r['length']}B" if r["holds"] else
                                                  f" ({r.get('error') or 'missing'})") for r in c["replicas"])]
                for c in chunks]
        if rows:
            print(table(rows, ["index", "chain", "chunk id", "replicas (target, version, length)"]))
    elif layout.chunk_size:
        print(f"  new files: chain table {layout.table_id}, {layout.chunk_size} byte chunks, "
              f"stripe {layout.stripe or 'all chains'}")
    return 0


# -- warmup, rmr -----------------------------------------------------------------------------------


async def _bounded(limit: int, job: Callable[[str], Awaitable[None]], items: list[str]) -> None:
    """``job(item)`` for every item, at most ``limit`` at a time (a fixed set of workers, so no
    more than ``limit`` coroutines exist however many items there are)."""
    queue = iter(items)

    async def worker() -> None:
        for item in queue:
            await job(item)

    await asyncio.gather(*(worker() for _ in range(min(limit, len(items)))))


_FAILURES_LISTED = 100


async def warmup_command(fs: Any, args: argparse.Namespace) -> int:
    """Read every file under the path, ``--threads`` at a time. The walk feeds a bounded queue, so
    memory stays bounded by the queue and one directory page however many files the tree holds;
    the progress total is what the walk has found so far."""
    paths: asyncio.Queue[str | None] = asyncio.Queue(maxsize=4 * args.threads)
    done = {"files": 0, "bytes": 0, "found": 0, "failed": 0}
    failed: list[str] = []
    with progress(f"warming {args.path}", enabled=not args.json) as update:
        async def read(path: str) -> None:
            try:
                if not await fs.isfile(path):
                    return  # a symlink or device: no chunks
                f = await fs.open(path, "rb")
                try:
                    while block := await f.read(_READ_BLOCK_BYTES):
                        done["bytes"] += len(block)
                finally:
                    await f.close()
            except OSError as exc:
                done["failed"] += 1
                if len(failed) < _FAILURES_LISTED:
                    failed.append(f"{path}: {exc}")
            done["files"] += 1
            update(done["files"], done["found"])

        async def worker() -> None:
            while (path := await paths.get()) is not None:
                await read(path)

        async def walk() -> None:
            try:
                if await fs.isdir(args.path):
                    async for top, _dirs, names in fs.walk(args.path):
                        for name in names:
                            done["found"] += 1
                            await paths.put(f"{top.rstrip('/')}/{name}")
                else:
                    done["found"] += 1
                    await paths.put(args.path)
            finally:
                for _ in range(args.threads):
                    await paths.put(None)

        await asyncio.gather(walk(), *(worker() for _ in range(args.threads)))
    if args.json:
        print_json({"path": args.path, "files": done["files"], "bytes": done["bytes"],
                    "failed_count": done["failed"], "failed": failed})
    else:
        print(f"warmed {done['files']} files, {human_bytes(done['bytes'])} read" +
              (f"; {done['failed']} failed" if done["failed"] else ""))
        for line in failed:
            print(f"  FAILED: {line}")
        if done["failed"] > len(failed):
            print(f"  ... and {done['failed'] - len(failed)} more")
    return 2 if done["failed"] else 0


async def rmr_command(fs: Any, args: argparse.Namespace) -> int:
    """``fs3 rmr PATH``: remove a tree through the client, a bounded number of removals at once;
    symlinks are removed, never followed; the root only with ``--force``."""
    root = _absolute(args.path)
    removed = {"files": 0, "directories": 0}

    async def remove_tree(directory: str) -> None:
        """Empty ``directory`` page by page (each page's entries removed ``--threads`` at a time,
        subdirectories one after another, so memory stays bounded by the depth and a page)."""
        while True:
            page: list[mpb.DirEntry] = []
            async for entry in fs.iter_entries(directory, with_attrs=False):
                page.append(entry)
                if len(page) >= 1000:
                    break
            if not page:
                return
            subdirs = [e for e in page if e.type == mpb.DIRECTORY]
            others = [e for e in page if e.type != mpb.DIRECTORY]

            async def unlink(name: str) -> None:
                await fs.remove(f"{directory.rstrip('/')}/{name}")
                removed["files"] += 1

            await _bounded(args.threads, unlink, [os.fsdecode(e.name) for e in others])
            for entry in subdirs:
                path = f"{directory.rstrip('/')}/{os.fsdecode(entry.name)}"
                await remove_tree(path)
                await fs.rmdir(path)
                removed["directories"] += 1

    inode = await fs.metadata.lookup(path_ref(os.fsencode(root)))
    if inode.type == mpb.DIRECTORY:
        await remove_tree(root)
        if root != "/":
            await fs.rmdir(root)
            removed["directories"] += 1
    else:
        await fs.remove(root)
        removed["files"] += 1
    if args.json:
        print_json({"path": root, **removed})
    else:
        print(f"removed {root}: {removed['files']} files, {removed['directories']} directories")
    return 0

"""``fs3``: run services and administer a cluster.

    fs3 mgmtd   [--config FILE] [--ready-file FILE] [overrides]
    fs3 storage [--config FILE] [--ready-file FILE]
    fs3 meta    [--config FILE] [--ready-file FILE]
    fs3 mount   (MGMTD | --dir DIR) MOUNTPOINT [--token-file FILE] [--foreground] [--nonempty] [--metrics-port N]
    fs3 umount  MOUNTPOINT
    fs3 admin   (--mgmtd HOST:PORT [--token-file FILE] | --dir DIR) [--json]
                nodes|targets|chains|metrics-targets|create-chain-table|mark-offline|verify|fsck|set-layout
                user add|list|remove|rotate;  scrub status
    fs3 admin   dump [--out FILE|-] | load FILE | backup --backup-dir D [--keep K] [--every-s S]
                [--meta-config FILE | --dir DIR]  (straight from meta's store: docs/operations.md)
    fs3 admin   token rotate --dir DIR [--finish]
    fs3 admin   certs init --dir DIR (--hosts H1,H2,... | --node NAME=HOST,...)
    fs3 admin   upgrade --config SERVICE.toml [--service mgmtd|storage|meta] [--check]
    fs3 local   up|status|down|kill|start [--dir DIR]
    fs3 trash   list | restore ID [--to PATH] | purge (ID|--all|--expired) [cluster options] [--json]
    fs3 quota   set PATH [--bytes N[K|M|G|T]] [--inodes N] | get PATH | list | unset PATH | check [--repair]
    fs3 status|df|stats [cluster options] [--json];  fs3 info|warmup|rmr PATH [cluster options] [--json]
    fs3 --version
    fs3 bench   PATH | --native [--dir DIR | --mgmtd HOST:PORT] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fs3 import common_pb2 as cpb
from fs3.cli.cluster import (
    add_tls_arguments,
    check_address,
    client_tls,
    number_in,
    resolve_cluster,
    resolve_token,
    warn_token_in_argv,
)
from fs3.cli.meta_backup import add_meta_backup_commands
from fs3.cli.moves import MOVE_COMMANDS, add_move_commands, chain_move_notes, run_move_command, target_move_notes
from fs3.cli.ops import OPERATOR_COMMANDS, add_operator_commands, run_operator
from fs3.cli.output import human_bytes as _human_bytes
from fs3.cli.output import message_dict, print_json, progress
from fs3.cli.output import state_name as _state_name
from fs3.cli.output import table as _table
from fs3.cli.quota import add_quota_command, run_quota
from fs3.cli.trash import add_trash_command, run_trash
from fs3.cli.upgrade import add_upgrade_command, upgrade_command
from fs3.common.config import load_config
from fs3.common.errors import FS3Error, InvalidArgument
from fs3.common.secret_files import check_config_file, set_private_umask, write_token_file
from fs3.meta.trash import TRASH_DAYS_MAX
from fs3.rpc.versions import advertised_range, apply_config_pin

__all__ = ["PEER_ROLE", "build_parser", "main", "node_entries", "run_admin"]


_metrics_port = number_in(int, -1, 65535, "a port number")  # 0: any free one, -1: none
_cache_seconds = number_in(float, 0.0, 3600.0, "a number of seconds")
_readahead_kb = number_in(int, 0, 1 << 20, "a size in KiB")
_workers = number_in(int, 1, 64, "a number of processes")
_worker_timeout_s = number_in(float, 0.0, 3600.0, "a number of seconds")
_id_number = number_in(int, 0, 2**32 - 2, "a uid or gid")


def _parse_chain_spec(spec: str) -> tuple[int, list[int]]:
    """``ID:T1,T2,T3`` (or ``T1,T2,T3`` to let mgmtd number it)."""
    try:
        if ":" in spec:
            chain, targets = spec.split(":", 1)
            return int(chain), [int(t) for t in targets.split(",") if t]
        return 0, [int(t) for t in spec.split(",") if t]
    except ValueError:
        raise InvalidArgument(f"bad chain spec {spec!r}: expected CHAIN_ID:TARGET,TARGET,...") from None


# The role column of meta and storage nodes: each serves on its own, none leads the others.
PEER_ROLE = "peer"


def node_entries(listing: Any) -> list[dict[str, Any]]:
    """``fs3 admin nodes``' entries: every mgmtd instance (type ``mgmtd``, node id 0, its name,
    its role ``primary``/``standby``/``stale``, alive unless stale, the lease epoch), then every
    meta and storage node (role ``peer``); every entry has the same keys, so a reader may filter
    on ``node_type``. ``protocol_version`` and ``release`` say what each runs (a node that reports
    no protocol speaks protocol 1, and reports no release either; an mgmtd instance other than the
    one that answered: 0, unknown), so a mixed cluster shows mid-upgrade."""
    from fs3 import mgmtd_pb2 as mpb

    entries: list[dict[str, Any]] = []
    for instance in listing.mgmtd_instances:
        role = _state_name(mpb.MgmtdRole, instance.role).removeprefix("mgmtd_role_")
        info = cpb.NodeInfo(node_type=cpb.NODE_MGMTD, framed_address=instance.address,
                            alive=instance.role != mpb.MGMTD_ROLE_STALE)
        if instance.name == listing.answered_by or len(listing.mgmtd_instances) == 1:
            info.protocol_version, info.release = listing.protocol_version or 1, listing.release
        entries.append({**message_dict(info), "name": instance.name, "role": role, "presence": instance.presence,
                        "lease_epoch": listing.lease_epoch})
    for node in listing.nodes:
        entries.append({**message_dict(node), "name": "", "role": PEER_ROLE, "presence": 0,
                        "lease_epoch": listing.lease_epoch, "protocol_version": node.protocol_version or 1})
    return entries


async def run_admin(args: argparse.Namespace) -> int:
    """``fs3 admin ...`` on the running event loop: its exit status (public so it can run beside a
    cluster served by the same loop)."""
    from fs3.cli.meta_backup import META_BACKUP_COMMANDS, run_meta_backup_command
    from fs3.client.admin import AdminClient
    from fs3.rpc.channel import RealChannelFactory

    if args.command in META_BACKUP_COMMANDS:  # straight from meta's store, no cluster connection
        return await run_meta_backup_command(args)
    resolve_cluster(args)
    channels = RealChannelFactory(args.token, args.transport, client_tls(args))
    admin = AdminClient(args.mgmtd, channels, timeout_ms=args.timeout_ms)
    try:
        return await _admin_command(admin, args)
    finally:
        await channels.close()


async def _admin_command(admin: Any, args: argparse.Namespace) -> int:
    out_json = args.json
    if args.command in MOVE_COMMANDS:
        return await run_move_command(admin, args)
    if args.command == "nodes":
        listing = await admin.node_listing()
        entries = node_entries(listing)
        if out_json:
            print_json(entries)
        else:
            print(_table([[str(e["name"] or e["node_id"]), e["node_type"], e["role"], "up" if e["alive"] else "DOWN",
                           e["framed_address"], e["grpc_address"] or "-", e["hostname"] or "-", str(e["pid"] or "-"),
                           e.get("release") or "-", str(e.get("protocol_version") or "?")]
                          for e in entries], ["node", "type", "role", "status", "framed", "grpc", "host", "pid",
                                              "release", "protocol"]))
            print(f"mgmtd lease epoch {listing.lease_epoch} (0: a single mgmtd); answered by {listing.answered_by}")
        return 0
    if args.command == "metrics-targets":
        text = json.dumps(await admin.metrics_targets(), indent=2) + "\n"
        if args.output:
            # Atomically: Prometheus re-reads the file when it changes and must never see half of it.
            tmp = Path(args.output).with_name(Path(args.output).name + ".tmp")
            tmp.write_text(text)
            tmp.replace(args.output)
        else:
            print(text, end="")
        return 0
    if args.command == "targets":
        targets = await admin.targets()
        if out_json:
            print_json(targets)
        else:
            moving = target_move_notes(await admin.moves(), targets)  # drains and rebalances under way
            print(_table([[str(t.target_id), str(t.node_id), str(t.chain_id or "-"),
                           _state_name(cpb.PublicState, t.public_state) + (" (fenced)" if t.fenced else ""),
                           _state_name(cpb.LocalState, t.local_state), moving.get(t.target_id, "-"),
                           str(t.chunk_count), _human_bytes(t.used_bytes), _human_bytes(t.free_bytes), t.path]
                          for t in targets],
                         ["target", "node", "chain", "public", "local", "move", "chunks", "used", "free", "path"]))
        return 0
    if args.command == "chains":
        rsp = await admin.chains()
        if out_json:
            print_json(rsp)
        else:
            states = {t.target_id: _state_name(cpb.PublicState, t.public_state) for t in rsp.targets}
            moving = chain_move_notes(await admin.moves())
            print(_table([[str(c.chain_id), str(c.chain_version), str(c.table_id),
                           " -> ".join(f"{t}({states.get(t, '?')})" for t in c.target_ids),
                           moving.get(c.chain_id, "-")] for c in rsp.chains],
                         ["chain", "version", "table", "targets (head first)", "moves"]))
        return 0
    if args.command == "create-chain-table":
        chains = [_parse_chain_spec(s) for s in args.chain or []]
        if not chains and not args.replicas:
            raise InvalidArgument("give --replicas N or one --chain per chain")
        rsp = await admin.create_chain_table(args.table_id, args.replicas or 0, chains)
        if out_json:
            print_json(rsp)
        else:
            print(f"chain table {rsp.table.table_id}: {len(rsp.chains)} chains")
            for c in rsp.chains:
                print(f"  chain {c.chain_id}: {' -> '.join(str(t) for t in c.target_ids)}")
        return 0
    if args.command == "mark-offline":
        # Returns once the target is out of its chain (a live node stops serving it first).
        offline = await admin.mark_target_offline(args.target_id)
        state = _state_name(cpb.PublicState, offline.public_state)
        if out_json:
            print(json.dumps({"target_id": args.target_id, "routing_version": offline.routing_version,
                              "public_state": state, "fenced": offline.fenced}))
        else:
            how = "its node stopped serving it first; " if offline.fenced else ""
            print(f"target {args.target_id} is out of its chain ({state}, routing v{offline.routing_version}); "
                  f"{how}it resyncs and comes back serving")
        return 0
    if args.command == "verify":
        with progress("verifying chains", enabled=not out_json) as update:
            report = await admin.verify(update, data=not args.metadata_only, rechecks=args.rechecks)
        if out_json:
            print(json.dumps(report.as_dict(), indent=2))
        else:
            what = (f"read {_human_bytes(report.bytes_read)} of chunk data" if report.data
                    else "metadata only, no data read")
            print(f"checked {report.chains_checked} chains, {report.chunks_checked} chunks ({what})")
            for line in report.not_serving:
                print(f"  not serving: {line}")
            for line in report.unreachable:
                print(f"  UNREACHABLE: {line}")
            for line in report.mismatches:
                print(f"  MISMATCH: {line}")
            for line in report.busy:
                print(f"  busy (being written, not compared): {line}")
            print("all replicas identical" if report.ok else "replicas DIFFER")
        return 0 if report.ok else 2
    if args.command == "scrub":
        return await _scrub_status(admin, out_json)
    if args.command in ("fsck", "set-layout"):
        return await _meta_admin(admin, args)
    if args.command == "user":
        return await _user_admin(admin, args)
    raise InvalidArgument(f"unknown admin command {args.command}")


async def _meta_admin(admin: Any, args: argparse.Namespace) -> int:
    """Admin commands answered by the metadata service (found through mgmtd's routing)."""
    from fs3 import meta_pb2
    from fs3.client.meta import Meta, path_ref

    meta: Meta = await admin.metadata()
    if args.command == "fsck":
        what = "checking the namespace" + (" and every chunk on storage" if args.chunks else "")
        if not sys.stderr.isatty():
            print(f"fs3: {what}...", file=sys.stderr, flush=True)
        # One call that meta answers when done: the bar shows that it runs and for how long.
        with progress(what, enabled=not args.json):
            rsp = await meta.fsck(args.chunks)
        if args.json:
            print_json(rsp)
        else:
            print(f"checked {rsp.inodes} inodes, {rsp.dentries} entries, {rsp.sessions} open sessions, "
                  f"{rsp.chunks} chunks; {rsp.gc_pending} files awaiting chunk removal")
            for problem in rsp.problems:
                print(f"  PROBLEM: {problem}")
            print("namespace clean" if not rsp.problems else f"{len(rsp.problems)} problems found")
        return 0 if not rsp.problems else 2
    layout = meta_pb2.Layout(table_id=args.table_id, chunk_size=args.chunk_size, stripe=args.stripe)
    updated = await meta.set_layout(path_ref(os.fsencode(args.path)), layout)
    shown = updated.layout
    print(json.dumps(message_dict(shown)) if args.json else
          f"{args.path}: new files use chain table {shown.table_id}, {shown.chunk_size} byte chunks, "
          f"stripe {shown.stripe or 'all chains'}")
    return 0


def _groups(text: str) -> list[int]:
    try:
        return [int(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"groups are comma-separated numbers, not {text!r}") from None


async def _user_admin(admin: Any, args: argparse.Namespace) -> int:
    """``fs3 admin user ...``: meta's table of per-user tokens. A token is shown once, when made
    (``add``, ``rotate``): on stdout, or only in ``--token-file`` (0600); never in ``--json``."""
    from fs3.client.meta import Meta

    def as_dict(info: Any) -> dict[str, Any]:
        return message_dict(info)

    output: str = getattr(args, "user_token_file", None) or ""
    if args.user_command in ("add", "rotate") and args.json and not output:
        raise InvalidArgument("--json never shows a token: give --token-file FILE to keep it")
    meta: Meta = await admin.metadata()
    if args.user_command == "list":
        found: list[Any] = []
        start_after, more = "", True
        while more:
            page, more = await meta.list_users(start_after=start_after)
            found.extend(page)
            start_after = page[-1].token_id if page else ""
            more = more and bool(page)
        if args.json:
            print(json.dumps([as_dict(u) for u in found], indent=2))
        else:
            print(_table([[u.token_id, u.name, str(u.uid), str(u.gid), ",".join(map(str, u.groups)) or "-",
                           u.comment] for u in found], ["id", "name", "uid", "gid", "groups", "comment"]))
        return 0
    if args.user_command == "remove":
        info = await meta.remove_user(args.token_id)
        print(json.dumps(as_dict(info)) if args.json else
              f"removed user token {info.token_id} ({info.name}, uid {info.uid}): refused from now on")
        return 0
    if args.user_command == "add":
        rsp = await meta.add_user(args.name, args.uid, args.gid, args.groups or [], args.comment)
    else:
        rsp = await meta.rotate_user(args.token_id)
    info = rsp.user
    if output:
        write_token_file(output, [rsp.token])
    if args.json:
        print(json.dumps({**as_dict(info), "token_file": os.path.abspath(output)}))
        return 0
    done = "added" if args.user_command == "add" else "new secret for"
    print(f"{done} user token {info.token_id} ({info.name}, uid {info.uid} gid {info.gid})")
    if output:
        print(f"token written to {os.path.abspath(output)} (mode 0600)")
    else:
        print(f"token (shown this once; meta keeps only its hash): {rsp.token}")
    return 0


def certs_command(args: argparse.Namespace) -> int:
    """``fs3 admin certs init``: a CA and a certificate per node and for clients (files, no cluster)."""
    from fs3.cluster.certs import init_certs, parse_node_specs

    nodes = parse_node_specs(args.hosts, args.node or [], args.san or [])
    made = init_certs(Path(args.certs_dir), nodes, days=args.days)
    if args.json:
        print(json.dumps([{"name": c.name, "cert": str(c.cert), "key": str(c.key), "created": c.created,
                           "reissued": c.reissued} for c in made], indent=2))
    else:
        for c in made:
            state = "made" if c.created else "reissued" if c.reissued else "kept"
            print(f"  {c.name:<12} {state:<8}  {c.cert}  (key {c.key})")
        print(f"services: [tls] ca_file = {made[0].cert}, cert_file/key_file = their NAME.pem/NAME.key; "
              f"clients: --tls-ca-file/--tls-cert-file/--tls-key-file with client.pem/client.key")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, every subcommand and option (``main`` parses with it)."""
    parser = argparse.ArgumentParser(prog="fs3", description="fs3: a Python implementation of 3FS.")
    parser.add_argument("--version", action="version", version=f"fs3 {_version()}")
    sub = parser.add_subparsers(dest="service", required=True)

    mgmtd = sub.add_parser("mgmtd", help="run the cluster manager")
    mgmtd.add_argument("--config", help="TOML config file")
    mgmtd.add_argument("--ready-file", help="write the bound addresses here as JSON once serving")
    mgmtd.add_argument("--data-dir")
    mgmtd.add_argument("--listen-host")
    mgmtd.add_argument("--framed-port", type=int)
    mgmtd.add_argument("--grpc-port", type=int)
    mgmtd.add_argument("--metrics-port", type=int)
    mgmtd.add_argument("--heartbeat-timeout-ms", type=int)
    mgmtd.add_argument("--token", help="cluster token (visible in ps: prefer token_file in the config, "
                       "--token-file or $FS3_MGMTD_TOKEN)")
    mgmtd.add_argument("--token-file", help="file of cluster tokens, one a line (read again on SIGHUP)")
    mgmtd.add_argument("--kv-engine", choices=("rocksdb", "mem", "postgres"),
                       help="rocksdb/mem: a single mgmtd on a local store; postgres: one of several on a shared "
                            "database, one of them primary")
    mgmtd.add_argument("--pg-url", help="the shared database (kv_engine postgres; prefer pg_url in the config "
                                        "or $FS3_MGMTD_PG_URL: a password here is visible in ps)")
    mgmtd.add_argument("--instance-name", help="this instance's name among the cluster's mgmtd (default: HOST:PORT)")
    mgmtd.add_argument("--advertise-address", help="HOST:PORT standbys send clients to while this one is primary "
                                                   "(default: the framed listen address)")

    storage = sub.add_parser("storage", help="run a storage node")
    storage.add_argument("--config", help="TOML config file (or only FS3_STORAGE_* environment variables)")
    storage.add_argument("--ready-file", help="write the bound addresses here as JSON once serving")

    meta = sub.add_parser("meta", help="run a metadata server")
    meta.add_argument("--config", help="TOML config file")
    meta.add_argument("--ready-file", help="write the bound addresses here as JSON once serving")

    mount = sub.add_parser("mount", help="mount fs3 with FUSE")
    mount.add_argument("mgmtd", nargs="?", help="mgmtd host:port (or --dir)")
    mount.add_argument("mountpoint")
    mount.add_argument("--dir", help="a local cluster's directory (fs3 local): its mgmtd, token and TLS files")
    mount.add_argument("--nonempty", action="store_true", help="mount over a directory that holds files (they "
                       "are hidden while mounted)")
    mount.add_argument("--token", default=None, help="token (visible in ps: prefer --token-file or $FS3_TOKEN)")
    mount.add_argument("--token-file", help="file whose first line is the token (read again on SIGHUP, so a "
                       "rotated token reaches the mount without unmounting)")
    mount.add_argument("--foreground", action="store_true", help="serve in this process until unmounted")
    mount.add_argument("--transport", choices=("framed", "grpc"), default="framed")
    mount.add_argument("--allow-other", dest="allow_other", action="store_true", default=None,
                       help="let other users use the mount (default: when run as root)")
    mount.add_argument("--no-allow-other", dest="allow_other", action="store_false")
    mount.add_argument("--log", help="daemon log file (background mounts)")
    mount.add_argument("--log-level", default="INFO")
    mount.add_argument("--readahead-kb", type=_readahead_kb, default=0,
                       help="kernel read-ahead for the mount in KiB (root only; default 0: the kernel's 128 KiB)")
    mount.add_argument("--entry-timeout-s", type=_cache_seconds, default=1.0,
                       help="how long the kernel may use a name -> file answer without asking (default 1)")
    mount.add_argument("--created-entry-timeout-s", type=_cache_seconds, default=30.0,
                       help="the same for a file this mount created (default 30; an open still checks the "
                       "name with meta, and a file removed elsewhere is looked up again)")
    mount.add_argument("--no-batched-closes", dest="batched_closes", action="store_false",
                       help="end each released file's session with a call of its own (default: a released "
                       "file whose length is published ends its session in a batch with others)")
    mount.add_argument("--attr-timeout-s", type=_cache_seconds, default=1.0,
                       help="how long the kernel and the mount may keep a file's attributes (default 1)")
    mount.add_argument("--metrics-port", type=_metrics_port, default=-1,
                       help="serve the mount's Prometheus /metrics on this port (0: any free port; "
                       "default -1: none)")
    mount.add_argument("--metrics-host", default="127.0.0.1", help="address the /metrics endpoint binds")
    mount.add_argument("--no-usrbio", dest="usrbio", action="store_false",
                       help="serve no fs3.usrbio rings (shared-memory batched I/O for local processes)")
    mount.add_argument("--usrbio-dir", help="where the usrbio socket goes (default: /run/fs3 as root, else "
                       "/tmp/fs3-usrbio-UID)")
    mount.add_argument("--workers", type=_workers, default=1,
                       help="processes serving the mount (default 1; N > 1: the FUSE session in one, open "
                       "files in N data workers)")
    mount.add_argument("--worker-timeout-s", type=_worker_timeout_s, default=30.0,
                       help="with --workers: a data worker that has not answered for this long (stopped, "
                       "wedged) is killed and replaced; its open files answer EIO (default 30; 0: never)")
    mount.add_argument("--ready-file", help=argparse.SUPPRESS)
    add_tls_arguments(mount)
    umount = sub.add_parser("umount", help="unmount a fs3 mount (also the remains of a crashed daemon)")
    umount.add_argument("mountpoint")

    local = sub.add_parser("local", help="a whole cluster on this machine")
    local_sub = local.add_subparsers(dest="action", required=True)
    up = local_sub.add_parser("up", help="start (or restart) the local cluster")
    up.add_argument("--storage-nodes", type=int, default=3)
    up.add_argument("--targets-per-node", type=int, default=2)
    up.add_argument("--replicas", type=int, default=3)
    up.add_argument("--mount-workers", type=_workers, default=1, help="the mount's --workers (with --mount)")
    up.add_argument("--detach", action="store_true", help="return once healthy, leave it running")
    up.add_argument("--mount", metavar="MNT", help="also mount the cluster here with FUSE")
    up.add_argument("--no-scrub", action="store_true", help="no background scrubbing of the storage targets "
                    "(default: on, gently: 4 MiB/s per target; docs/operations.md, Scrubbing)")
    up.add_argument("--trash-days", type=number_in(float, 0.0, TRASH_DAYS_MAX, "a number of days"), metavar="DAYS",
                    help="keep removed files in the trash this many days before their space is freed (default: "
                         "as the cluster was made, 0 = no trash; docs/operations.md, Trash)")
    up.add_argument("--tls", action="store_true", default=None,
                    help="make certificates under DIR/certs and run every service and the mount with mutual TLS "
                         "(first start only; later starts keep what the cluster was made with)")
    up.add_argument("--meta-engine", choices=("rocksdb", "postgres"),
                    help="where meta and mgmtd keep their state: rocksdb (embedded; the default) or postgres "
                         "(a private PostgreSQL under DIR/postgres, or --pg-url); first start only")
    up.add_argument("--meta-servers", type=int, metavar="N", help="meta servers (postgres engine; default 1)")
    up.add_argument("--mgmtd-replicas", type=int, metavar="N",
                    help="mgmtd instances, one of them primary (postgres engine; default 1)")
    up.add_argument("--pg-url", metavar="URL",
                    help="the meta database on a PostgreSQL server of yours (mgmtd uses DATABASE_mgmtd there; "
                         "both must exist): no private server is started. Kept in the 0600 configs only")
    up.add_argument("--profile", metavar="NAME",
                    help="also write client profile NAME for this cluster (mgmtd, token file, TLS) to $FS3_CONFIG or "
                         "~/.config/fs3/config.toml: then fs3.connect(profile=NAME) and fs3://NAME@/path")
    for action in ("status", "down"):
        local_sub.add_parser(action)
    for action in ("kill", "start"):
        drill = local_sub.add_parser(action, help=f"{action} one service (fault drills)")
        drill.add_argument("name", help="mgmtd, meta, storage-N, and with postgres mgmtd-N, meta-N, postgres")
    for parser_ in local_sub.choices.values():
        parser_.add_argument("--dir", default=".fs3", help="cluster directory (default .fs3)")

    bench = sub.add_parser("bench", help="measure a mount (or the native client) with the juicefs-bench flow")
    bench.add_argument("path", nargs="?", help="a directory to benchmark (any file system); with --native, a "
                       "directory inside fs3 (default /)")
    bench.add_argument("--native", action="store_true", help="use fs3's Python client instead of a mount")
    bench.add_argument("--mgmtd", default=os.environ.get("FS3_MGMTD", "127.0.0.1:9000"), help="mgmtd (--native)")
    bench.add_argument("--dir", help="a local cluster's directory (--native): its mgmtd and token")
    bench.add_argument("--token", default=None, help="token (visible in ps: prefer --token-file or $FS3_TOKEN)")
    bench.add_argument("--token-file", help="file whose first line is the token")
    bench.add_argument("--threads", "-p", type=int, default=1, help="parallel threads (default 1)")
    bench.add_argument("--big-file-size", default="1G", help="size of each thread's big file (default 1G)")
    bench.add_argument("--small-file-size", default="128K", help="size of each small file (default 128K)")
    bench.add_argument("--small-file-count", type=int, default=100, help="small files per thread (default 100)")
    bench.add_argument("--block-size", default="1M", help="I/O size for the big file (default 1M)")
    bench.add_argument("--no-drop-caches", action="store_true", help="keep page caches between phases")
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    add_tls_arguments(bench)

    cluster = argparse.ArgumentParser(add_help=False)
    cluster.add_argument("--mgmtd", default=os.environ.get("FS3_MGMTD", "127.0.0.1:9000"), help="mgmtd host:port")
    cluster.add_argument("--dir", help="a local cluster's directory (fs3 local): its mgmtd and token")
    cluster.add_argument("--token", default=None, help="token (visible in ps: prefer --token-file or $FS3_TOKEN)")
    cluster.add_argument("--token-file", help="file whose first line is the token")
    cluster.add_argument("--transport", choices=("framed", "grpc"), default="framed")
    cluster.add_argument("--timeout-ms", type=int, default=10_000)
    cluster.add_argument("--json", action="store_true", help="machine-readable output")
    add_tls_arguments(cluster)
    admin = sub.add_parser("admin", help="administer a cluster", parents=[cluster])
    admin_sub = admin.add_subparsers(dest="command", required=True)
    add_operator_commands(sub, cluster)
    add_trash_command(sub, cluster)
    add_quota_command(sub, cluster)
    admin_sub.add_parser("nodes", help="list nodes")
    add_meta_backup_commands(admin_sub)
    add_move_commands(admin_sub)
    admin_sub.add_parser("targets", help="list storage targets")
    metrics_targets = admin_sub.add_parser(
        "metrics-targets", help="Prometheus file_sd JSON: every process's /metrics endpoint (labels service, node_id)")
    metrics_targets.add_argument("-o", "--output", help="write the file atomically (for file_sd_configs) "
                                 "instead of printing it")
    admin_sub.add_parser("chains", help="list chains")
    create = admin_sub.add_parser("create-chain-table", help="create a chain table")
    create.add_argument("--table-id", type=int, default=1)
    create.add_argument("--replicas", type=int, help="build chains of N replicas from every free target")
    create.add_argument("--chain", action="append", help="CHAIN_ID:TARGET,TARGET,... (repeatable)")
    offline = admin_sub.add_parser("mark-offline", help="take a target out of its chain, waiting until it is out "
                                   "(its node stops serving it first); it then resyncs and comes back")
    offline.add_argument("target_id", type=int)
    verify = admin_sub.add_parser("verify", help="compare replicas chunk by chunk, bytes included "
                                                 "(exit 2 when they differ)")
    verify.add_argument("--metadata-only", action="store_true",
                        help="compare only the recorded version, length and CRC (fast; reads no chunk data)")
    verify.add_argument("--rechecks", type=int, default=3,
                        help="times a differing chunk is looked at again before it counts (chunks being "
                             "written differ for a moment); 0: report at once")
    scrub = admin_sub.add_parser("scrub", help="the background scrubbers of the storage targets")
    scrub.add_subparsers(dest="scrub_command", required=True).add_parser(
        "status", help="per target: the current pass's progress, passes completed, findings (exit 2 on "
                       "unrecoverable chunks)")
    fsck = admin_sub.add_parser("fsck", help="check the namespace invariants (exit 2 on problems)")
    fsck.add_argument("--no-chunks", dest="chunks", action="store_false",
                      help="skip listing every chunk on storage (orphan check)")
    set_layout = admin_sub.add_parser("set-layout", help="set a directory's default layout for new files")
    set_layout.add_argument("path", help="directory path in fs3, e.g. /datasets")
    set_layout.add_argument("--chunk-size", type=int, default=4 * 1024 * 1024, help="bytes, a power of two")
    set_layout.add_argument("--stripe", type=int, default=0, help="chains per file (0: the service default)")
    set_layout.add_argument("--table-id", type=int, default=1)
    user = admin_sub.add_parser("user", help="per-user tokens: each binds its holder to one uid and its groups")
    user_sub = user.add_subparsers(dest="user_command", required=True)
    add = user_sub.add_parser("add", help="make a token for a user (shown once)")
    add.add_argument("name", help="who holds it (for operators)")
    add.add_argument("--uid", type=_id_number, required=True)
    add.add_argument("--gid", type=_id_number, required=True)
    add.add_argument("--groups", type=_groups, help="supplementary groups, comma-separated")
    add.add_argument("--comment", default="")
    user_sub.add_parser("list", help="the user table (never a secret)")
    remove = user_sub.add_parser("remove", help="revoke a token, at once")
    remove.add_argument("token_id", help="the token's id (fs3u.<id>.<secret>)")
    rotate = user_sub.add_parser("rotate", help="a new secret for a token; the old one is refused at once")
    rotate.add_argument("token_id")
    for made in (add, rotate):
        # Its own dest: `fs3 admin --token-file` (the cluster token the command presents) must not
        # be overridden by, or read as, the file the new user token is written to.
        made.add_argument("--token-file", dest="user_token_file",
                          help="write the token here (mode 0600) instead of printing it")
    token = admin_sub.add_parser("token", help="cluster tokens")
    token_sub = token.add_subparsers(dest="token_action", required=True)
    rotate = token_sub.add_parser("rotate", help="rotate a local cluster's token without a restart: a new token "
                                  "is presented and the old one still accepted, until --finish drops it")
    rotate.add_argument("--dir", dest="rotate_dir", help="the local cluster's directory (fs3 local)")
    rotate.add_argument("--finish", action="store_true", help="drop the old token (once every client moved over)")
    certs = admin_sub.add_parser("certs", help="certificates for mutual TLS (needs no running cluster)")
    certs_sub = certs.add_subparsers(dest="certs_action", required=True)
    init = certs_sub.add_parser("init", help="make a CA (or reuse DIR's) and a certificate and key per node and "
                                             "one for clients; files that exist are kept")
    init.add_argument("--dir", dest="certs_dir", required=True, help="where the certificates go (made 0700)")
    init.add_argument("--hosts", help="H1,H2,...: one node per host name or IP, named after it")
    init.add_argument("--node", action="append", metavar="NAME=HOST,...",
                      help="a node NAME whose certificate names these hosts/IPs (repeatable)")
    init.add_argument("--san", action="append", metavar="HOST,...",
                      help="hosts/IPs every node's certificate names too, e.g. one public host all nodes are "
                           "reached by (repeatable; empty entries are skipped); an existing certificate "
                           "lacking one is issued again for the same key")
    init.add_argument("--days", type=int, default=825, help="lifetime of the node and client certificates")
    add_upgrade_command(admin_sub)
    _json_after_every_subcommand(admin_sub, cluster)
    return parser


async def _scrub_status(admin: Any, out_json: bool) -> int:
    """``fs3 admin scrub status``: every target's scrubber (``admin``: an AdminClient)."""
    targets, unreachable = await admin.scrub_status()
    if out_json:
        print(json.dumps({"targets": [message_dict(t) for t in targets],
                          "unreachable": unreachable}, indent=2))
    else:
        rows = []
        for t in targets:
            progress = f"{t.pass_chunks}/{t.chunk_count}" if t.enabled else "off"
            last = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t.last_pass_end_ms / 1000)) \
                if t.last_pass_end_ms else "-"
            rows.append([str(t.target_id), str(t.chain_id), str(t.pass_number), progress, str(t.passes_completed),
                         last, _human_bytes(t.bytes_scanned), str(t.corruptions), str(t.repaired),
                         str(t.unrecoverable)])
        print(_table(rows, ["target", "chain", "pass", "progress", "passes", "last pass end", "read", "corrupt",
                            "repaired", "unrecoverable"]))
        for t in targets:
            for f in t.findings:
                print(f"  target {t.target_id}: chunk {f.chunk_id.hex()} v{f.version}: {f.kind.upper()}: {f.detail}")
        for line in unreachable:
            print(f"  UNREACHABLE: {line}")
    return 2 if any(t.unrecoverable for t in targets) or unreachable else 0


def _json_after_every_subcommand(subparsers: Any, cluster: argparse.ArgumentParser | None = None) -> None:
    """``--json`` after every command below ``fs3 admin`` too (``fs3 admin nodes --json``), as well
    as before it; and, with ``cluster``, its cluster options (``fs3 admin nodes --dir .fs3``, as the
    top-level operator commands take them), where a command does not spell one its own way and is
    not one that works without a cluster (``upgrade``, ``certs``, ``token``). Their defaults are
    SUPPRESS: a subcommand's parser must not reset what ``fs3 admin --json --dir D nodes`` set."""
    import copy

    offline = {"upgrade", "certs", "token"}
    for name, parser_ in subparsers.choices.items():
        nested = [a for a in parser_._actions if isinstance(a, argparse._SubParsersAction)]
        for n in nested:
            _json_after_every_subcommand(n, None if name in offline else cluster)
        if nested:
            continue
        if "--json" not in parser_._option_string_actions:
            parser_.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                                 help="machine-readable output")
        if cluster is None or name in offline:
            continue
        for action in cluster._actions:
            if not action.option_strings or any(o in parser_._option_string_actions for o in action.option_strings):
                continue  # -h, --json, or an option the command already has (its own meaning)
            option = copy.copy(action)
            option.default = argparse.SUPPRESS
            parser_._add_action(option)


def _version() -> str:
    """This code's version (not an installed copy's: ``fs3 --version`` names what runs)."""
    import fs3

    return str(fs3.__version__)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`fs3 admin nodes | head -1`): no traceback, and none at exit when
        # Python flushes stdout again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # as a shell reports a process ended by SIGPIPE


def _check_mountpoint(mountpoint: str, nonempty: bool) -> None:
    """Refuse to hide files: a mount over a directory that holds some makes them unreachable until
    it is unmounted (``--nonempty`` says that is meant). A directory that cannot be listed (the
    remains of a crashed mount) is left for the mount to judge."""
    try:
        entries = os.listdir(mountpoint)
    except OSError:
        return
    if entries and not nonempty:
        raise InvalidArgument(f"{mountpoint} is not empty ({len(entries)} entries would be hidden while mounted): "
                              f"mount on an empty directory, or give --nonempty")


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.service in ("mgmtd", "storage", "meta", "mount", "local"):
        set_private_umask()  # data, logs and ready files: for this user only
    if args.service in ("mgmtd", "storage", "meta"):
        # SIGHUP reloads the token file once the service serves; a rotation that signals it while
        # it starts must not kill it (the default action), and it reads the file as it starts anyway.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        # A bad $FS3_PROTOCOL_VERSION_MAX stops every command here, in one line, rather than at the
        # first connection (a mount's, a heartbeat's) with a traceback.
        advertised_range()
        if args.service in ("mgmtd", "storage", "meta"):
            check_config_file(args.config)  # a config holding a token must be private
        if args.service == "mgmtd":
            from fs3.mgmtd.server import run_mgmtd
            from fs3.mgmtd.service import MgmtdConfig

            warn_token_in_argv(args)
            overrides = {k: getattr(args, k) for k in ("data_dir", "listen_host", "framed_port", "grpc_port",
                                                       "metrics_port", "heartbeat_timeout_ms", "token",
                                                       "token_file", "kv_engine", "pg_url", "instance_name",
                                                       "advertise_address")}
            config = load_config(MgmtdConfig, args.config, env_prefix="FS3_MGMTD", overrides=overrides)
            apply_config_pin(config.protocol_version_max)
            run_mgmtd(config, args.ready_file)
            return 0
        if args.service == "storage":
            from fs3.storage.server import StorageConfig, run_storage

            storage_config = load_config(StorageConfig, args.config, env_prefix="FS3_STORAGE")
            apply_config_pin(storage_config.protocol_version_max)
            run_storage(storage_config, args.ready_file)
            return 0
        if args.service == "meta":
            from fs3.meta.server import MetaConfig, run_meta

            meta_config = load_config(MetaConfig, args.config, env_prefix="FS3_META")
            apply_config_pin(meta_config.protocol_version_max)
            run_meta(meta_config, args.ready_file)
            return 0
        if args.service in ("mount", "umount"):
            from fs3.fuse.mount import MountOptions, mount_background, run_foreground, umount

            if args.service == "umount":
                umount(args.mountpoint)
                print(f"fs3: {args.mountpoint} unmounted")
                return 0
            if args.dir:
                resolve_cluster(args)
            elif not args.mgmtd:
                raise InvalidArgument("fs3 mount needs MGMTD (host:port) or --dir DIR (a local cluster's)")
            else:
                check_address(args.mgmtd)
            _check_mountpoint(args.mountpoint, args.nonempty)
            options = MountOptions(token=None if args.token_file else resolve_token(args),
                                   token_file=args.token_file, transport=args.transport,
                                   tls=client_tls(args),
                                   allow_other=args.allow_other, log_level=args.log_level,
                                   readahead_kb=args.readahead_kb, entry_timeout_s=args.entry_timeout_s,
                                   created_entry_timeout_s=args.created_entry_timeout_s,
                                   batched_closes=args.batched_closes,
                                   attr_timeout_s=args.attr_timeout_s, metrics_port=args.metrics_port,
                                   metrics_host=args.metrics_host, usrbio=args.usrbio,
                                   usrbio_dir=args.usrbio_dir, workers=args.workers,
                                   worker_timeout_s=args.worker_timeout_s)
            if args.foreground:
                return run_foreground(args.mgmtd, args.mountpoint, options, args.ready_file)
            pid = mount_background(args.mgmtd, args.mountpoint, options, args.log)
            print(f"fs3: mounted at {args.mountpoint} (daemon pid {pid}); unmount with: fs3 umount {args.mountpoint}")
            return 0
        if args.service == "bench":
            from fs3.cli.bench import bench_command

            return bench_command(args)
        if args.service == "local":
            from fs3.cli.local import local_command

            return local_command(args)
        if args.service in OPERATOR_COMMANDS:
            return asyncio.run(run_operator(args))
        if args.service == "trash":
            return asyncio.run(run_trash(args))
        if args.service == "quota":
            return asyncio.run(run_quota(args))
        if args.command == "token":
            from fs3.cli.local import rotate_command

            return rotate_command(args)
        if args.command == "certs":
            return certs_command(args)
        if args.command == "upgrade":
            return upgrade_command(args)
        return asyncio.run(run_admin(args))
    except BrokenPipeError:
        raise  # not an error of the command's: main() ends quietly
    except (FS3Error, OSError) as exc:  # OSError: the client API's errors (connect, a mount's start)
        print(f"fs3: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

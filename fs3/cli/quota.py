"""``fs3 quota``: limits on the bytes and the entries below a directory, as ``juicefs quota``.

    fs3 quota set PATH [--bytes N[K|M|G|T|P]] [--inodes N]   set or change (root)
    fs3 quota get PATH                                       limits and usage
    fs3 quota list [--json]                                  every quota, by path
    fs3 quota unset PATH                                     remove (root)
    fs3 quota check [--repair]                               recount every tree (root)

Bytes are logical file lengths (``st_size``), inodes the directory entries below the directory
(see :mod:`fs3.meta.quota`). Each takes the cluster options of ``fs3 admin``; the requests run as
the client's identity (root with the cluster token).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from fs3 import meta_pb2 as mpb
from fs3.cli.cluster import run_with_metadata
from fs3.cli.output import human_bytes, table
from fs3.client.meta import Meta, path_ref
from fs3.common.errors import InvalidArgument
from fs3.meta.quota import parse_size

__all__ = ["add_quota_command", "quota_command", "quota_dict", "run_quota"]


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _count(text: str) -> int:
    if not text.isdigit() or int(text) >= 1 << 64:
        raise argparse.ArgumentTypeError(f"inode count {text!r} is not a whole number below 2**64")
    return int(text)


def add_quota_command(sub: Any, cluster: argparse.ArgumentParser) -> None:
    """``fs3 quota`` and its subcommands, each with the cluster options of ``cluster``."""
    quota = sub.add_parser("quota", help="per-directory limits on bytes and inodes")
    quota_sub = quota.add_subparsers(dest="quota_command", required=True)
    set_ = quota_sub.add_parser("set", parents=[cluster], help="set or change a directory's quota (root)")
    set_.add_argument("path", help="a directory in fs3, from its root (e.g. /data/team-a)")
    set_.add_argument("--bytes", type=_size, default=0, help="logical bytes below it (K, M, G, T, P: powers of 1024)")
    set_.add_argument("--inodes", type=_count, default=0, help="directory entries below it")
    get = quota_sub.add_parser("get", parents=[cluster], help="a directory's limits and usage")
    get.add_argument("path", help="a directory in fs3 with a quota")
    quota_sub.add_parser("list", parents=[cluster], help="every quota")
    unset = quota_sub.add_parser("unset", parents=[cluster], help="remove a directory's quota (root)")
    unset.add_argument("path", help="a directory in fs3 with a quota")
    check = quota_sub.add_parser("check", parents=[cluster], help="recount every quota's tree (root)")
    check.add_argument("--repair", action="store_true", help="write the recount where usage is wrong")


def quota_dict(quota: mpb.Quota) -> dict[str, Any]:
    return {"inode_id": quota.inode_id, "path": bytes(quota.path).decode(errors="replace"),
            "bytes_limit": quota.bytes_limit, "bytes_used": quota.bytes_used,
            "inodes_limit": quota.inodes_limit, "inodes_used": quota.inodes_used}


def _row(quota: mpb.Quota) -> list[str]:
    return [bytes(quota.path).decode(errors="replace") or f"<dir {quota.inode_id}>",
            human_bytes(quota.bytes_used), human_bytes(quota.bytes_limit) if quota.bytes_limit else "-",
            str(quota.inodes_used), str(quota.inodes_limit) if quota.inodes_limit else "-"]


_HEADER = ["directory", "bytes used", "bytes limit", "inodes used", "inodes limit"]


async def run_quota(args: argparse.Namespace) -> int:
    """``fs3 quota ...`` against the cluster of the cluster options: its exit status."""
    return await run_with_metadata(args, quota_command)


def _target(path: str) -> mpb.PathRef:
    if not path.startswith("/"):
        raise InvalidArgument(f"{path!r}: give the directory's path in fs3, from its root (/...)")
    return path_ref(os.fsencode(path))


async def quota_command(meta: Meta, args: argparse.Namespace) -> int:
    """One ``fs3 quota`` subcommand through ``meta``."""
    out_json = bool(getattr(args, "json", False))
    command = args.quota_command
    if command == "list":
        quotas = await meta.quota_list()
        print(json.dumps([quota_dict(q) for q in quotas], indent=2) if out_json
              else table([_row(q) for q in quotas], _HEADER))
        return 0
    if command == "check":
        rsp = await meta.quota_check(repair=args.repair)
        if out_json:
            print(json.dumps({"problems": list(rsp.problems), "repaired": rsp.repaired,
                              "quotas": [quota_dict(q) for q in rsp.recomputed]}, indent=2))
        else:
            for line in rsp.problems:
                print(line)
            print(f"{len(rsp.recomputed)} quotas recounted, {len(rsp.problems)} wrong"
                  + (", repaired" if rsp.repaired else ""))
        return 1 if rsp.problems and not rsp.repaired else 0
    target = _target(args.path)
    if command == "set":
        quota = await meta.quota_set(target, bytes_limit=args.bytes, inodes_limit=args.inodes)
    elif command == "get":
        quota = await meta.quota_get(target)
    elif command == "unset":
        quota = await meta.quota_unset(target)
    else:
        raise InvalidArgument(f"unknown quota command {command}")
    print(json.dumps(quota_dict(quota), indent=2) if out_json else table([_row(quota)], _HEADER))
    return 0

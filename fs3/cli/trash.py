"""``fs3 trash``: removed files kept by meta's trash (``trash_days`` > 0), as JuiceFS's trash.

    fs3 trash list [--json]                  the caller's entries (root: everyone's)
    fs3 trash restore ID [--to PATH]         give the file its old name back, or PATH
    fs3 trash purge (ID | --all | --expired) free the space now

Each takes the cluster options of ``fs3 admin``. The requests run as the client's identity (a
user token's uid, or root with the cluster token): a user sees and touches only the entries of
files it removed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from fs3 import meta_pb2 as mpb
from fs3.cli.cluster import run_with_metadata
from fs3.cli.output import human_bytes, table
from fs3.client.meta import Meta, path_ref
from fs3.common.errors import InvalidArgument
from fs3.meta.trash import shown_path

__all__ = ["add_trash_command", "entry_dict", "run_trash", "trash_command"]


def add_trash_command(sub: Any, cluster: argparse.ArgumentParser) -> None:
    """``fs3 trash`` and its subcommands, each with the cluster options of ``cluster``."""
    trash = sub.add_parser("trash", help="removed files kept by meta's trash (trash_days)")
    trash_sub = trash.add_subparsers(dest="trash_command", required=True)
    trash_sub.add_parser("list", parents=[cluster], help="entries: id, original path, size, removed, expires")
    restore = trash_sub.add_parser("restore", parents=[cluster], help="give a trashed file its name back")
    restore.add_argument("id", type=int, help="the entry's id (the first column of fs3 trash list)")
    restore.add_argument("--to", help="restore under this path instead (never over an existing name)")
    purge = trash_sub.add_parser("purge", parents=[cluster], help="free trashed files' space now")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("id", type=int, nargs="?", help="one entry's id (fs3 trash list)")
    which.add_argument("--all", action="store_true", help="every entry of yours (root: everyone's)")
    which.add_argument("--expired", action="store_true", help="the entries past their expiry")


def entry_dict(entry: mpb.TrashEntry) -> dict[str, Any]:
    return {"id": entry.id, "path": shown_path(entry), "size": entry.size, "uid": entry.uid,
            "removed_at_ns": entry.removed_at_ns, "expires_at_ns": entry.expires_at_ns}


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


async def run_trash(args: argparse.Namespace) -> int:
    """``fs3 trash ...`` against the cluster of the cluster options: its exit status."""
    return await run_with_metadata(args, trash_command)


async def trash_command(meta: Meta, args: argparse.Namespace) -> int:
    """One ``fs3 trash`` subcommand through ``meta``."""
    out_json = bool(getattr(args, "json", False))
    if args.trash_command == "list":
        entries: list[mpb.TrashEntry] = []
        after, more = 0, True
        while more:
            page = await meta.trash_list(start_after=after)
            entries.extend(page.entries)
            after, more = page.next_after, page.more
        if out_json:
            print(json.dumps([entry_dict(e) for e in entries], indent=2))
        else:
            print(table([[str(e.id), shown_path(e), human_bytes(e.size), str(e.uid), _when(e.removed_at_ns),
                          _when(e.expires_at_ns)] for e in entries],
                        ["id", "original path", "size", "uid", "removed at", "expires at"]))
        return 0
    if args.trash_command == "restore":
        to = path_ref(os.fsencode(args.to)) if args.to else None
        inode = await meta.trash_restore(args.id, to)
        print(json.dumps({"id": args.id, "inode_id": inode.inode_id}) if out_json else
              f"restored trash entry {args.id}" + (f" to {args.to}" if args.to else " to its original place"))
        return 0
    if args.trash_command != "purge":
        raise InvalidArgument(f"unknown trash command {args.trash_command}")
    if args.id:
        purged = (await meta.trash_purge(args.id)).purged
    else:
        purged, after, more = 0, 0, True
        while more:
            rsp = await meta.trash_purge(all_entries=args.all, expired=args.expired, start_after=after)
            purged += rsp.purged
            after, more = rsp.next_after, rsp.more
    noun = "entry" if purged == 1 else "entries"
    print(json.dumps({"purged": purged}) if out_json else f"purged {purged} trash {noun}: their space is freed")
    return 0

"""``fs3 admin drain | undrain | rebalance | moves``: replica moves carried out by mgmtd.

mgmtd plans and drives every move (``fs3/mgmtd/moves.py``); these commands start, cancel and
show them, and with ``--wait`` follow them until they finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterable
from typing import Any

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3.common.errors import InvalidArgument, Timeout

__all__ = ["MOVE_COMMANDS", "add_move_commands", "chain_move_notes", "run_move_command", "target_move_notes"]

MOVE_COMMANDS = frozenset({"drain", "undrain", "rebalance", "moves"})
_POLL_S = 0.5
_FINISHED = ("done", "failed")


def add_move_commands(admin_sub: Any) -> None:
    """The subcommands, on ``fs3 admin``'s subparsers."""
    wait = argparse.ArgumentParser(add_help=False)
    wait.add_argument("--wait", action="store_true", help="follow the moves until they finish")
    wait.add_argument("--wait-timeout-s", type=float, default=3600.0, help="give up waiting after this long")
    drain = admin_sub.add_parser("drain", parents=[wait], help="move every replica off nodes or targets, each "
                                 "leaving only after its replacement has synced ('drain status': progress)")
    drain.add_argument("nodes", nargs="*", help="storage node ids, or 'status'")
    drain.add_argument("--target", type=int, action="append", default=[], help="a target id (repeatable)")
    drain.add_argument("--force", action="store_true", help="drain even where no other node can take the "
                       "replica: those chains keep one replica fewer")
    undrain = admin_sub.add_parser("undrain", help="cancel a drain (no node or target: every drain)")
    undrain.add_argument("nodes", nargs="*", type=int, help="storage node ids")
    undrain.add_argument("--target", type=int, action="append", default=[], help="a target id (repeatable)")
    rebalance = admin_sub.add_parser("rebalance", parents=[wait],
                                     help="regrow chains a forced drain left short, then move chain replicas onto the "
                                          "least loaded nodes (new storage)")
    rebalance.add_argument("--max-moves", type=int, default=0, help="at most this many moves (0: all the plan finds)")
    rebalance.add_argument("--rate", type=int, default=0, metavar="BYTES/S",
                           help="resync copy rate of every storage node while moves run (0: each node's own "
                                "resync_rate_bytes_per_s, default unlimited)")
    rebalance.add_argument("--dry-run", action="store_true", help="show the plan, move nothing")
    admin_sub.add_parser("moves", help="replica moves in progress and lately finished")


def target_move_notes(rsp: mpb.MovesRsp, targets: Iterable[cpb.TargetInfo]) -> dict[int, str]:
    """What the moves do to each target, for the ``move`` column of ``fs3 admin targets``:
    ``draining`` (its node or itself is being drained and it still holds a replica), ``drained``
    (it has left its chain: the node stays marked until undrained), ``-> T syncing`` (its replica
    moves to T), ``<- F syncing`` (it takes over F's replica). Finished moves say nothing."""
    draining_nodes, draining_targets = set(rsp.draining_node_ids), set(rsp.draining_target_ids)
    notes: dict[int, list[str]] = {}
    for t in targets:
        if t.target_id in draining_targets or t.node_id in draining_nodes:
            notes.setdefault(t.target_id, []).append("draining" if t.chain_id else "drained")
    for m in rsp.moves:
        if m.phase in _FINISHED:
            continue
        to = str(m.to_target_id) if m.to_target_id else "?"
        if m.from_target_id:
            notes.setdefault(m.from_target_id, []).append(f"-> {to} {m.phase}")
        if m.to_target_id:
            came = f"<- {m.from_target_id}" if m.from_target_id else "regrow"
            notes.setdefault(m.to_target_id, []).append(f"{came} {m.phase}")
    return {target: ", ".join(parts) for target, parts in notes.items()}


def chain_move_notes(rsp: mpb.MovesRsp) -> dict[int, str]:
    """The unfinished moves of each chain, for the ``moves`` column of ``fs3 admin chains``."""
    notes: dict[int, list[str]] = {}
    for m in rsp.moves:
        if m.phase not in _FINISHED:
            to = str(m.to_target_id) if m.to_target_id else "?"
            what = f"{m.from_target_id} -> {to}" if m.from_target_id else f"add {to}"
            notes.setdefault(m.chain_id, []).append(f"{what} {m.phase} ({m.reason})")
    return {chain: ", ".join(parts) for chain, parts in notes.items()}


def _print(rsp: mpb.MovesRsp, out_json: bool, show_rate: bool = True) -> None:
    """The moves as text (or JSON); ``show_rate`` False where the rate was already printed (the
    last listing of ``--wait``)."""
    if out_json:
        from google.protobuf.json_format import MessageToDict
        print(json.dumps(MessageToDict(rsp, preserving_proto_field_name=True), sort_keys=True))
        return
    if rsp.message:
        print(rsp.message)
    elif not rsp.moves:
        print("no replica moves")
    for m in rsp.moves:
        to = str(m.to_target_id) if m.to_target_id else "-"
        tries = f" (try {m.attempts + 1})" if m.attempts else ""
        note = f": {m.note}" if m.note else ""
        if m.from_target_id == 0:  # an add-only move: a short chain regrows
            print(f"  chain {m.chain_id}: add a replica of chain {m.chain_id} on target {to} [{m.reason}] "
                  f"{m.phase}{tries}{note}")
        else:
            print(f"  chain {m.chain_id}: {m.from_target_id} -> {to} [{m.reason}] {m.phase}{tries}{note}")
    draining = [f"{what} {', '.join(map(str, ids))}" for what, ids in
                (("nodes", sorted(rsp.draining_node_ids)), ("targets", sorted(rsp.draining_target_ids))) if ids]
    if draining:
        print(f"draining (until undrain): {'; '.join(draining)}")
    if show_rate and rsp.resync_rate_bytes_per_s:
        print(f"resync rate {rsp.resync_rate_bytes_per_s} B/s")


async def _follow(admin: Any, chains: set[int], timeout_s: float, out_json: bool) -> int:
    """Poll until every move of ``chains`` has finished; exit 1 if one failed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = ""
    while True:
        rsp = await admin.moves()
        mine = [m for m in rsp.moves if m.chain_id in chains]
        summary = ", ".join(f"{p} {sum(1 for m in mine if m.phase == p)}"
                            for p in ("pending", "syncing", "removing", "done", "failed")
                            if any(m.phase == p for m in mine))
        if summary != last and not out_json:
            print(summary, flush=True)
            last = summary
        active = [m for m in mine if m.phase not in _FINISHED]
        if not active:
            _print(rsp, out_json, show_rate=False)
            return 1 if any(m.phase == "failed" for m in mine) else 0
        if loop.time() > deadline:
            raise Timeout(f"{len(active)} move(s) still running after {timeout_s:.0f} s (they go on; "
                          f"'fs3 admin drain status' shows them)")
        await asyncio.sleep(_POLL_S)


async def run_move_command(admin: Any, args: argparse.Namespace) -> int:
    out_json = args.json
    if args.command == "moves" or (args.command == "drain" and args.nodes == ["status"]):
        _print(await admin.moves(), out_json)
        return 0
    if args.command == "drain":
        try:
            nodes = [int(n) for n in args.nodes]
        except ValueError:
            raise InvalidArgument(f"drain takes node ids (or 'status'), got {' '.join(args.nodes)}") from None
        rsp = await admin.drain(nodes, args.target, args.force)
    elif args.command == "undrain":
        rsp = await admin.undrain(list(args.nodes), args.target)
    else:
        if args.max_moves < 0 or args.rate < 0:
            raise InvalidArgument("--max-moves and --rate must not be negative")
        rsp = await admin.rebalance(args.max_moves, args.rate, args.dry_run)
    if getattr(args, "wait", False) and not getattr(args, "dry_run", False):
        started = {m.chain_id for m in rsp.moves if m.phase not in _FINISHED}
        if not out_json or not started:
            _print(rsp, out_json)
        if not started:
            return 0  # nothing to follow: the listing above is all there is
        return await _follow(admin, started, args.wait_timeout_s, out_json)
    _print(rsp, out_json)
    return 0

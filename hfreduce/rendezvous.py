"""Who is where: ranks meet through the store, learn each other's node and agree on the layout.

Every rank publishes its node key, pid and address; every rank reads all of them and computes the same
:class:`Layout` (pure: :func:`group_ranks`). A node is what shares ``/dev/shm`` *and* a network
namespace with the rank: by default the key is host name, network namespace and boot id, so network
namespaces on one machine (the test harness's hosts) are separate nodes though they share the host
name and ``/dev/shm``. ``node=`` overrides it (ranks that pass the same value share a node).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from hfreduce.errors import HFReduceError, InvalidArgument
from hfreduce.store import KeyValueStore

__all__ = ["Layout", "RankInfo", "default_node_key", "exchange", "group_ranks"]


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    node_key: str
    pid: int
    address: str


@dataclass(frozen=True, slots=True)
class Layout:
    """The job's ranks grouped into nodes: ``nodes[i]`` lists node i's ranks, ascending.

    Nodes are numbered by their lowest rank, local ranks by rank order within the node; local rank 0
    is the node's leader (it runs the reducer and the network threads).
    """

    world_size: int
    nodes: tuple[tuple[int, ...], ...]

    def node_of(self, rank: int) -> int:
        for index, ranks in enumerate(self.nodes):
            if rank in ranks:
                return index
        raise KeyError(rank)

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def leader(self, node: int) -> int:
        return self.nodes[node][0]


def group_ranks(infos: list[RankInfo]) -> Layout:
    world_size = len(infos)
    if sorted(info.rank for info in infos) != list(range(world_size)):
        raise HFReduceError(f"ranks {sorted(info.rank for info in infos)} are not 0..{world_size - 1}")
    by_key: dict[str, list[int]] = {}
    for info in sorted(infos, key=lambda item: item.rank):
        by_key.setdefault(info.node_key, []).append(info.rank)
    nodes = tuple(sorted((tuple(ranks) for ranks in by_key.values()), key=lambda ranks: ranks[0]))
    return Layout(world_size, nodes)


def default_node_key() -> str:
    """Host name, network namespace and boot: what makes ranks one node (shared memory, one NIC)."""
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        namespace = 0
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|net:{namespace}|boot:{boot}"


def exchange(store: KeyValueStore, prefix: str, me: RankInfo, world_size: int, timeout_s: float) -> list[RankInfo]:
    """Publish this rank's info and read every rank's (all ranks get the same list)."""
    store.set(f"{prefix}/rank/{me.rank}", json.dumps([me.rank, me.node_key, me.pid, me.address]).encode())
    infos: list[RankInfo] = []
    for rank in range(world_size):
        raw = store.get(f"{prefix}/rank/{rank}", timeout_s)
        try:
            got_rank, node_key, pid, address = json.loads(raw)
            info = RankInfo(int(got_rank), str(node_key), int(pid), str(address))
        except (ValueError, TypeError) as exc:
            raise HFReduceError(f"rendezvous: rank {rank} published an unreadable record") from exc
        if info.rank != rank:
            raise HFReduceError(f"rendezvous: two processes claim rank {rank}")
        infos.append(info)
    return infos


def check_local_environment(layout: Layout, rank: int, local_rank: int | None, local_world_size: int | None) -> None:
    """A launcher's LOCAL_RANK/LOCAL_WORLD_SIZE must match what the rendezvous found, or data would be wrong."""
    node = layout.node_of(rank)
    found_rank, found_size = layout.local_rank(rank), len(layout.nodes[node])
    if local_world_size is not None and local_world_size != found_size:
        raise InvalidArgument(f"LOCAL_WORLD_SIZE is {local_world_size} but {found_size} ranks share this "
                              f"node ({list(layout.nodes[node])}); pass node= to group ranks explicitly")
    if local_rank is not None and local_rank != found_rank:
        raise InvalidArgument(f"LOCAL_RANK is {local_rank} but rank {rank} is local rank {found_rank} of its "
                              f"node ({list(layout.nodes[node])})")

"""Every key mgmtd stores, built in one place.

Key table (ids are zero-padded decimal ASCII, so keys sort numerically; ``+`` is concatenation):

==========================================  ===============================================
key                                         value
==========================================  ===============================================
``node/`` + node_id(8 digits)               :class:`~fs3.common_pb2.NodeInfo`
``target/`` + target_id(20 digits)          :class:`~fs3.common_pb2.TargetInfo`
``chain/`` + chain_id(8 digits)             :class:`~fs3.common_pb2.ChainInfo`
``table/`` + table_id(8 digits)             :class:`~fs3.common_pb2.ChainTable`
``meta/routing_version``                    the routing version, decimal ASCII
``moves/book``                              replica moves and draining sets (JSON, :mod:`~fs3.mgmtd.placement`)
==========================================  ===============================================

Every record is rewritten whole when it changes; a restart reads every table back in full (the
cluster's topology is small), then bumps the routing version so every cached routing is refreshed.
"""

from __future__ import annotations

from fs3.kv.api import prefix_end

__all__ = [
    "CHAIN",
    "MOVES",
    "MOVE_BOOK",
    "NODE",
    "ROUTING_VERSION",
    "TABLE",
    "TARGET",
    "chain_key",
    "node_key",
    "prefix_range",
    "table_key",
    "target_key",
]

NODE = b"node/"
TARGET = b"target/"
CHAIN = b"chain/"
TABLE = b"table/"
ROUTING_VERSION = b"meta/routing_version"
MOVES = b"moves/"
MOVE_BOOK = MOVES + b"book"


def node_key(node_id: int) -> bytes:
    return NODE + b"%08d" % node_id


def target_key(target_id: int) -> bytes:
    return TARGET + b"%020d" % target_id


def chain_key(chain_id: int) -> bytes:
    return CHAIN + b"%08d" % chain_id


def table_key(table_id: int) -> bytes:
    return TABLE + b"%08d" % table_id


def prefix_range(prefix: bytes) -> tuple[bytes, bytes | None]:
    """The ``[start, end)`` scan bounds of every key under ``prefix``."""
    return prefix, prefix_end(prefix)

"""Every bound mgmtd enforces on its input, in one place (TigerBeetle-style limits).

mgmtd holds the whole cluster map in memory and sends all of it in every routing answer, so what
one heartbeat or one admin request may add is bounded; a request past a bound is refused with
INVALID_ARGUMENT naming it, before anything changes.
"""

from __future__ import annotations

__all__ = ["CHAINS_PER_TABLE_MAX", "CHAIN_REPLICAS_MAX", "TARGETS_PER_NODE_MAX"]

# Storage targets one node may report. A 3FS storage node has 16 SSDs with a handful of targets
# on each; 256 leaves room while bounding what one (possibly misconfigured) node adds to every
# routing answer and every scan.
TARGETS_PER_NODE_MAX = 256

# Targets in one chain. Chains are 2-3 replicas in practice; a CRAQ write crosses every target in
# turn, so a long chain only adds latency. 16 is far past any useful length.
CHAIN_REPLICAS_MAX = 16

# Chains one chain table may hold (one CreateChainTable request). The routing answer lists every
# chain (about 50 bytes each): 65,536 chains keep it a few MiB, well inside a frame.
CHAINS_PER_TABLE_MAX = 65_536

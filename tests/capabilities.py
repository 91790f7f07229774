"""Data-path capabilities made outside meta, for tests and benchmarks that call storage directly.

A client gets its capabilities from meta when it opens a file (:mod:`fs3.client.capability`). Code
that talks to storage without opening a file — an attack replaying or forging one, a benchmark
driving chunks straight through :class:`~fs3.client.storage_client.StorageClient` — signs its own
with the cluster token, exactly as meta does, and hands storage a source that never renews.
"""

from __future__ import annotations

from collections.abc import Sequence

from fs3.common.capability import Access, Capability, derive_key, sign

__all__ = ["FixedCapability", "sign_as_meta"]


def sign_as_meta(cluster_token: str, inode_id: int, chains: Sequence[int], expires_ms: int,
                 access: Access = Access.READ | Access.WRITE) -> bytes:
    """The capability meta would sign, with the key of ``cluster_token``, for ``access`` to the
    chunks of ``inode_id`` on ``chains`` (the file's layout order) until ``expires_ms`` (wall clock)."""
    return sign(Capability(inode_id, access, tuple(chains), expires_ms), derive_key(cluster_token))


class FixedCapability:
    """A capability source (:class:`~fs3.client.storage_client.CapabilitySource`) that always shows
    the same bytes: what an attacker replays, or what a benchmark signed for its whole run. A
    refusal is final — there is no meta behind it to ask for a fresh one."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def current(self) -> bytes:
        return self.raw

    async def renew(self, refused: bytes) -> bytes:
        return self.raw

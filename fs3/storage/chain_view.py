"""A storage target's view of its chain, derived from the routing information."""

from __future__ import annotations

from dataclasses import dataclass

from fs3.common.target_state import PublicState

__all__ = ["ChainMember", "ChainView"]


@dataclass(frozen=True, slots=True)
class ChainMember:
    target_id: int
    node_id: int
    state: PublicState
    address: str


@dataclass(frozen=True, slots=True)
class ChainView:
    """Chain ``chain_id`` at ``chain_version`` as seen by target ``target_id``.

    ``members`` is the chain order; the write path is its serving and syncing members, in order.
    """

    chain_id: int
    chain_version: int
    routing_version: int
    target_id: int
    members: tuple[ChainMember, ...]

    @property
    def me(self) -> ChainMember | None:
        for m in self.members:
            if m.target_id == self.target_id:
                return m
        return None

    @property
    def my_state(self) -> PublicState:
        me = self.me
        return me.state if me is not None else PublicState.OFFLINE

    @property
    def write_path(self) -> tuple[ChainMember, ...]:
        return tuple(m for m in self.members if m.state.writable)

    @property
    def serving(self) -> tuple[ChainMember, ...]:
        return tuple(m for m in self.members if m.state is PublicState.SERVING)

    @property
    def is_head(self) -> bool:
        path = self.write_path
        return bool(path) and path[0].target_id == self.target_id and path[0].state is PublicState.SERVING

    def _index(self) -> int | None:
        for i, m in enumerate(self.write_path):
            if m.target_id == self.target_id:
                return i
        return None

    def successor(self) -> ChainMember | None:
        path, i = self.write_path, self._index()
        if i is None or i + 1 >= len(path):
            return None
        return path[i + 1]

    def predecessor(self) -> ChainMember | None:
        path, i = self.write_path, self._index()
        if i is None or i == 0:
            return None
        return path[i - 1]

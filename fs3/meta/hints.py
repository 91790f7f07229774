"""Path hints: what a meta server saw of the tree, used only to guess which keys a request will read.

On a networked engine (PostgreSQL) each read that is not known in advance costs a round trip,
and a path walk learns each key from the one before it (an entry names the inode, the inode is
the next directory): ``2 * depth + 1`` round trips for a stat. :class:`PathHints` remembers, per
server process, which inode each ``(parent, name)`` led to, so that a request's first read can
carry every key its walk will read *if nothing changed* (``Transaction.prefetch``): the walk then
reads each key as before, inside the transaction, and finds it in the transaction's read cache.

The hints decide nothing: a wrong or stale hint (another meta server renamed a directory away)
only means the walk reads a key nobody fetched, one round trip more, and it learns the truth
there. So there is no invalidation between servers, and no clock. The table is a bounded LRU.

Pure: no transport, clock, randomness or engine (the ``pure-cores`` import contract).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from fs3 import meta_pb2 as mpb
from fs3.common.errors import FS3Error, InvalidArgument
from fs3.meta import schema
from fs3.meta.ops import split_path

__all__ = ["PATH_HINTS_MAX_DEFAULT", "PathHints"]

# Entries one meta server remembers: about 150 bytes each (key tuple, name, value), so ~10 MB.
PATH_HINTS_MAX_DEFAULT = 65_536


class PathHints:
    """A bounded LRU of ``(parent inode id, name) -> (child inode id, child type)``.

    ``learn`` takes what a transaction saw (:attr:`fs3.meta.ops.Namespace.entries_seen`: entries
    read, written or deleted); ``keys`` turns a path into the keys its walk will read.
    """

    def __init__(self, entries_max: int = PATH_HINTS_MAX_DEFAULT) -> None:
        if entries_max < 1:
            raise InvalidArgument("path hint entries_max must be positive")
        self.entries_max = entries_max
        self._entries: OrderedDict[tuple[int, bytes], tuple[int, int]] = OrderedDict()
        self.hits = 0  # components whose child was guessed (for tests and metrics)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget everything (a server that never saw the tree: tests and the benchmark)."""
        self._entries.clear()

    def child(self, parent: int, name: bytes) -> tuple[int, int] | None:
        """The hinted ``(inode id, type)`` of ``name`` in ``parent`` (not a promise)."""
        return self._entries.get((parent, name))

    def learn(self, seen: Iterable[tuple[tuple[int, bytes], tuple[int, int] | None]]) -> None:
        """Record what a transaction found: an entry (``(inode id, type)``) or its absence (None)."""
        entries = self._entries
        for key, found in seen:
            if found is None:
                entries.pop(key, None)
                continue
            entries[key] = found
            entries.move_to_end(key)
        while len(entries) > self.entries_max:
            entries.popitem(last=False)

    def keys(self, ref: mpb.PathRef, out: list[bytes]) -> tuple[int, int]:
        """Append to ``out`` the keys resolving ``ref`` will read if the hints are right: the start
        inode, then per component its entry and (when hinted) the inode it leads to, until a
        component is not hinted, is not a directory, or is ``..``. The final component's entry is
        included whether or not it exists (a create reads it too), and its hinted inode.

        Returns the ``(inode id, type)`` the whole path is hinted to lead to (``(0, 0)``: not
        known, or the type not), for what an operation reads about its target (an open: the
        file's truncate and size generation; a remove: its sessions and attributes)."""
        if ref.inode_id:
            out.append(schema.inode_key(ref.inode_id))
            if not ref.path:
                return ref.inode_id, 0
        try:
            absolute, parts = split_path(bytes(ref.path))
        except FS3Error:
            return 0, 0  # the operation itself refuses the path
        current = schema.ROOT_INODE if absolute or ref.parent == 0 else ref.parent
        out.append(schema.inode_key(current))
        entries = self._entries
        last = len(parts) - 1
        for at, name in enumerate(parts):
            if name == b"..":
                return 0, 0
            out.append(schema.dentry_key(current, name))
            hint = entries.get((current, name))
            if hint is None:
                return 0, 0
            entries.move_to_end((current, name))
            self.hits += 1
            child, kind = hint
            out.append(schema.inode_key(child))
            if at == last:
                return hint
            if kind != mpb.DIRECTORY:
                return 0, 0
            current = child
        return current, mpb.DIRECTORY

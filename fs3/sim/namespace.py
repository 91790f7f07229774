"""A sequential model of the metadata service's namespace, for checking histories against.

The model is what :class:`fs3.meta.ops.Namespace` promises to a client that works as root on a
handful of names: directories and files, open sessions, file sizes published at close, truncates,
renames (replacing files and empty directories), removals, lookups and listings — with the errors
Linux gives and in the order the service checks them. It is pure and small, so that the
linearizability search (:mod:`fs3.sim.wgl`) can explore it, and a stateful test can run it beside
the service step by step.

Identity: every ``mkdir`` and ``create`` carries a *tag* that the client sets as the new inode's
permission bits (:func:`tag_mode`), so an observer can tell which operation made the inode it sees
without knowing inode ids, which the service picks. Tags use only the bits that root's requests
keep as given (``S_ISGID`` is left out: a set-group-id directory passes it on to new
subdirectories).

Sizes: the simulated clients write no data, so a length a client publishes at close is believed
as is unless the file's size was changed (``truncate``, ``O_TRUNC``) while its handle was open —
then meta checks storage, which holds nothing, and the size stays as it is. That is the rule the
service documents for handles whose file was truncated under them (meta compares the inode's size
generation with the one the session opened under).

Truncates in two steps: meta resolves the path and records the truncate (from then on the file's
handles count as truncated), and applies the new size only once storage holds nothing past it —
before it answers, or, when storage failed the request, later (another request on the file, or
meta's maintenance). A rename or a lookup may come in between and see the old size, as on Linux,
where ``truncate(path)`` resolves the path before it locks the file. A truncate that carries a
label (``truncate`` with three arguments, a ``create`` whose ``deferred`` is set) records the new
size as pending, and a ``resize`` call with that label applies it. Meanwhile the file takes no
other truncate, open, or writer's length (meta finishes the pending truncate first): the model
answers :data:`BLOCKED` to those, which no observed answer matches, so the search places the
``resize`` first. Without a label the truncate is applied at once.

State (hashable): ``(entries, inodes, sessions)`` with

* ``entries``: sorted ``(parent tag, name, child tag)``; the root's tag is 0;
* ``inodes``: sorted ``(tag, kind, size, linked)``, ``kind`` ``"d"`` or ``"f"``; an unlinked file
  lives on while a session holds it;
* ``sessions``: sorted ``(label, tag, client, writes, truncated)``; ``label`` names the open that
  made the session (any hashable: a history index, a session id);
* ``pending``: sorted ``(label, tag, size)``: truncates recorded, their size not yet applied.

Calls (``Call.kind`` and ``args``) and their answers:

===============  ===================================  ===============================================
kind             args                                 answer
===============  ===================================  ===============================================
``mkdir``        ``(path, tag)``                      ``("ok", tag)``
``create``       ``(path, tag, excl, trunc, label,    ``("ok", created, tag, size)``: opens to write
                 [deferred])``
``open``         ``(path, label)``                    ``("ok", kind, tag, size)``: opens to read
``close``        ``(label, length)``                  ``("ok", size)``
``rename``       ``(src, dst)``                       ``("ok", tag)``
``unlink``       ``(path,)``                          ``("ok",)``
``rmdir``        ``(path,)``                          ``("ok",)``
``truncate``     ``(path, size[, label])``            ``("ok",)``
``resize``       ``(label,)``                         ``("ok",)``: the pending truncate's size applied
``stat``         ``(path,)``                          ``("ok", kind, tag, size)``
``readdir``      ``(path,)``                          ``("ok", ((name, tag), ...))``
``expire``       ``(label,)``                         none: meta closing a lapsed client's session
===============  ===================================  ===============================================

Errors answer ``("err", code)`` with a :class:`~fs3.common.errors.StatusCode` name. A handle that
no longer exists answers :data:`STALE`, which any of :data:`STALE_CODES` satisfies.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from fs3.sim.wgl import Call

__all__ = ["BLOCKED", "NAMESPACE_ERRORS", "ROOT", "STALE", "STALE_CODES", "NamespaceModel", "NsState", "Tree",
           "tag_mode", "tags"]

ROOT = 0
STALE = ("err", "STALE_HANDLE")
#: The answer to an operation meta holds back until a pending truncate of its file is applied.
BLOCKED = ("err", "TRUNCATE_PENDING")
_NOT_PENDING = ("err", "NO_TRUNCATE_PENDING")
#: What a client may be told about a handle meta no longer has: the handle is gone, its lease
#: lapsed, or an I/O error — anything loud, never a success.
STALE_CODES = frozenset({"BAD_HANDLE", "LEASE_EXPIRED", "STALE_CLIENT", "IO_ERROR", "STALE_HANDLE"})
#: Errors that are answers about the namespace (as opposed to "try again" or "you are fenced").
NAMESPACE_ERRORS = frozenset({"NOT_FOUND", "ALREADY_EXISTS", "NOT_A_DIRECTORY", "IS_A_DIRECTORY",
                              "DIRECTORY_NOT_EMPTY", "INVALID_ARGUMENT"})
_INERT_KINDS = frozenset({"stat", "readdir"})

Entries = tuple[tuple[int, str, int], ...]
Inodes = tuple[tuple[int, str, int, bool], ...]
Sessions = tuple[tuple[Hashable, int, Hashable, bool, bool], ...]
Pending = tuple[tuple[Hashable, int, int], ...]
NsState = tuple[Entries, Inodes, Sessions, Pending]

_TAG_MAX = 2047


def tag_mode(n: int) -> int:
    """The ``n``-th tag (1..2047) as permission bits: 0o777, then the sticky and set-user-id bits."""
    if not 1 <= n <= _TAG_MAX:
        raise ValueError(f"tag number {n} outside 1..{_TAG_MAX}")
    return (n & 0o777) | (0o1000 if n & 0o1000 else 0) | (0o4000 if n & 0o2000 else 0)


def tags() -> range:
    """The tag numbers :func:`tag_mode` accepts."""
    return range(1, _TAG_MAX + 1)


class _Fail(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class Tree:
    """A mutable copy of a state, for one step (and for tests that build states by hand)."""

    def __init__(self, state: NsState | None = None) -> None:
        entries, inodes, sessions, pending = state or ((), ((ROOT, "d", 0, True),), (), ())
        self.entries: dict[tuple[int, str], int] = {(p, n): c for p, n, c in entries}
        self.inodes: dict[int, list[Any]] = {t: [k, s, linked] for t, k, s, linked in inodes}
        self.sessions: dict[Hashable, list[Any]] = {label: [t, c, w, tr] for label, t, c, w, tr in sessions}
        self.pending: dict[Hashable, tuple[int, int]] = {label: (t, size) for label, t, size in pending}

    def freeze(self) -> NsState:
        return (tuple(sorted((p, n, c) for (p, n), c in self.entries.items())),
                tuple(sorted((t, v[0], v[1], v[2]) for t, v in self.inodes.items())),
                tuple(sorted(((label, *v) for label, v in self.sessions.items()), key=repr)),
                tuple(sorted(((label, *v) for label, v in self.pending.items()), key=repr)))

    # -- lookups ---------------------------------------------------------------------------------

    def kind(self, tag: int) -> str:
        return str(self.inodes[tag][0])

    def walk(self, parts: list[str]) -> int:
        """Resolve components from the root, failing the way :meth:`Namespace._walk` does."""
        current = ROOT
        for name in parts:
            if self.kind(current) != "d":
                raise _Fail("NOT_A_DIRECTORY")
            child = self.entries.get((current, name))
            if child is None:
                raise _Fail("NOT_FOUND")
            current = child
        return current

    def parent_of(self, path: str) -> tuple[int, str]:
        parts = _split(path)
        if not parts:
            raise _Fail("INVALID_ARGUMENT")
        parent = self.walk(parts[:-1])
        if self.kind(parent) != "d":
            raise _Fail("NOT_A_DIRECTORY")
        return parent, parts[-1]

    def children(self, tag: int) -> list[tuple[str, int]]:
        return sorted((n, c) for (p, n), c in self.entries.items() if p == tag)

    def parent_dir(self, tag: int) -> int:
        """The directory holding a directory (the root holds itself)."""
        if tag == ROOT:
            return ROOT
        return next(p for (p, _), c in self.entries.items() if c == tag)

    def is_ancestor(self, ancestor: int, directory: int) -> bool:
        current = directory
        while True:
            if current == ancestor:
                return True
            if current == ROOT:
                return False
            current = self.parent_dir(current)

    def has_sessions(self, tag: int) -> bool:
        return any(s[0] == tag for s in self.sessions.values())

    def check_not_pending(self, tag: int) -> None:
        """Meta finishes a file's pending truncate before it opens, truncates or sizes it again."""
        if any(t == tag for t, _ in self.pending.values()):
            raise _Fail(BLOCKED[1])

    def truncate(self, tag: int, size: int, label: Hashable | None) -> None:
        """Record a truncate (its handles count as truncated from now on); apply it at once
        without a label, else when ``resize(label)`` comes."""
        self.check_not_pending(tag)
        self.mark_writers_truncated(tag)
        if label is None:
            self.inodes[tag][1] = size
        else:
            self.pending[label] = (tag, size)

    # -- changes ---------------------------------------------------------------------------------

    def mark_writers_truncated(self, tag: int) -> None:
        for session in self.sessions.values():
            if session[0] == tag and session[2]:
                session[3] = True

    def drop_link(self, tag: int) -> None:
        if self.kind(tag) == "d":
            del self.inodes[tag]
            return
        self.inodes[tag][2] = False
        if not self.has_sessions(tag):
            del self.inodes[tag]

    def end_session(self, label: Hashable, length: int) -> int:
        tag, _, writes, truncated = self.sessions[label]
        if length > 0 and writes:
            self.check_not_pending(tag)
        del self.sessions[label]
        inode = self.inodes[tag]
        if length > 0 and writes and not truncated:
            inode[1] = max(inode[1], length)
        size = int(inode[1])
        if not inode[2] and not self.has_sessions(tag):
            del self.inodes[tag]
        return size


def _split(path: str) -> list[str]:
    return [p for p in path.split("/") if p and p != "."]


class NamespaceModel:
    """The sequential specification (see the module docstring); implements :class:`fs3.sim.wgl.Model`."""

    def initial(self) -> NsState:
        return Tree().freeze()

    def step(self, state: NsState, call: Call) -> tuple[NsState, Hashable]:
        tree = Tree(state)
        try:
            answer = self._apply(tree, call)
        except _Fail as failure:
            return state, ("err", failure.code)
        return tree.freeze(), answer

    def agrees(self, call: Call, answer: Hashable) -> bool:
        observed = call.result
        if answer == STALE:
            return isinstance(observed, tuple) and len(observed) == 2 and observed[0] == "err" \
                and observed[1] in STALE_CODES
        return observed == answer

    def inert(self, call: Call) -> bool:
        result = call.result
        if isinstance(result, tuple) and result and result[0] == "err":
            return True
        if call.kind in _INERT_KINDS:
            return True
        # Opening a directory to read it makes no session.
        return call.kind == "open" and isinstance(result, tuple) and len(result) > 1 and result[1] == "d"

    def show(self, state: NsState) -> str:
        tree = Tree(state)
        names: list[str] = []

        def visit(tag: int, prefix: str) -> None:
            for name, child in tree.children(tag):
                kind, size, _ = tree.inodes[child]
                names.append(f"{prefix}/{name}={'dir' if kind == 'd' else 'file'}#{child:o}"
                             + (f"({size})" if kind == "f" else ""))
                if kind == "d":
                    visit(child, f"{prefix}/{name}")

        visit(ROOT, "")
        unlinked = [f"#{t:o}({v[1]})" for t, v in sorted(tree.inodes.items()) if not v[2]]
        sessions = [f"{label}->#{v[0]:o}{'w' if v[2] else 'r'}{'T' if v[3] else ''}"
                    for label, v in sorted(tree.sessions.items(), key=lambda kv: repr(kv[0]))]
        pending = [f"{label}->#{tag:o}({size})"
                   for label, (tag, size) in sorted(tree.pending.items(), key=lambda kv: repr(kv[0]))]
        return ("{" + ", ".join(names) + "}" + (f" unlinked {unlinked}" if unlinked else "")
                + (f" sessions {sessions}" if sessions else "") + (f" truncating {pending}" if pending else ""))

    # -- the operations --------------------------------------------------------------------------

    def _apply(self, tree: Tree, call: Call) -> Hashable:
        handler = getattr(self, f"_{call.kind}", None)
        if handler is None:
            raise ValueError(f"the namespace model has no operation {call.kind!r}")
        answer: Hashable = handler(tree, call, *call.args)
        return answer

    def _mkdir(self, tree: Tree, call: Call, path: str, tag: int) -> Hashable:
        parent, name = tree.parent_of(path)
        if (parent, name) in tree.entries:
            raise _Fail("ALREADY_EXISTS")
        tree.entries[(parent, name)] = tag
        tree.inodes[tag] = ["d", 0, True]
        return ("ok", tag)

    def _create(self, tree: Tree, call: Call, path: str, tag: int, excl: bool, trunc: bool,
                label: Hashable, deferred: bool = False) -> Hashable:
        parent, name = tree.parent_of(path)
        found = tree.entries.get((parent, name))
        created = found is None
        if found is None:
            target = tag
            tree.entries[(parent, name)] = tag
            tree.inodes[tag] = ["f", 0, True]
        else:
            if excl:
                raise _Fail("ALREADY_EXISTS")
            target = found
            if tree.kind(target) == "d":
                raise _Fail("IS_A_DIRECTORY")
            tree.check_not_pending(target)
            if trunc:
                tree.truncate(target, 0, label if deferred else None)
        tree.sessions[label] = [target, call.client, True, False]
        return ("ok", created, target, 0 if trunc else int(tree.inodes[target][1]))

    def _open(self, tree: Tree, call: Call, path: str, label: Hashable) -> Hashable:
        target = tree.walk(_split(path))
        kind, size, _ = tree.inodes[target]
        if kind == "f":
            tree.check_not_pending(target)
            tree.sessions[label] = [target, call.client, False, False]
        return ("ok", kind, target, int(size))

    def _close(self, tree: Tree, call: Call, label: Hashable, length: int) -> Hashable:
        if label not in tree.sessions:
            raise _Fail(STALE[1])
        return ("ok", tree.end_session(label, length))

    def _expire(self, tree: Tree, call: Call, label: Hashable) -> Hashable:
        if label in tree.sessions:
            tree.end_session(label, 0)
        return None

    def _rename(self, tree: Tree, call: Call, src: str, dst: str) -> Hashable:
        src_parent, src_name = tree.parent_of(src)
        dst_parent, dst_name = tree.parent_of(dst)
        inode = tree.entries.get((src_parent, src_name))
        if inode is None:
            raise _Fail("NOT_FOUND")
        target = tree.entries.get((dst_parent, dst_name))
        if target == inode:
            return ("ok", inode)  # two names of one inode: nothing to do
        moving = src_parent != dst_parent
        if target is not None and tree.kind(target) == "d" and moving and tree.is_ancestor(target, src_parent):
            raise _Fail("DIRECTORY_NOT_EMPTY")
        if tree.kind(inode) == "d" and moving and tree.is_ancestor(inode, dst_parent):
            raise _Fail("INVALID_ARGUMENT")
        if target is not None:
            if tree.kind(inode) == "d":
                if tree.kind(target) != "d":
                    raise _Fail("NOT_A_DIRECTORY")
                if tree.children(target):
                    raise _Fail("DIRECTORY_NOT_EMPTY")
            elif tree.kind(target) == "d":
                raise _Fail("IS_A_DIRECTORY")
            tree.drop_link(target)
        del tree.entries[(src_parent, src_name)]
        tree.entries[(dst_parent, dst_name)] = inode
        return ("ok", inode)

    def _unlink(self, tree: Tree, call: Call, path: str) -> Hashable:
        parent, name = tree.parent_of(path)
        inode = tree.entries.get((parent, name))
        if inode is None:
            raise _Fail("NOT_FOUND")
        if tree.kind(inode) == "d":
            raise _Fail("IS_A_DIRECTORY")
        del tree.entries[(parent, name)]
        tree.drop_link(inode)
        return ("ok",)

    def _rmdir(self, tree: Tree, call: Call, path: str) -> Hashable:
        parent, name = tree.parent_of(path)
        inode = tree.entries.get((parent, name))
        if inode is None:
            raise _Fail("NOT_FOUND")
        if tree.kind(inode) != "d":
            raise _Fail("NOT_A_DIRECTORY")
        if tree.children(inode):
            raise _Fail("DIRECTORY_NOT_EMPTY")
        del tree.entries[(parent, name)]
        tree.drop_link(inode)
        return ("ok",)

    def _truncate(self, tree: Tree, call: Call, path: str, size: int, label: Hashable | None = None) -> Hashable:
        target = tree.walk(_split(path))
        if tree.kind(target) == "d":
            raise _Fail("IS_A_DIRECTORY")
        tree.truncate(target, size, label)
        return ("ok",)

    def _resize(self, tree: Tree, call: Call, label: Hashable) -> Hashable:
        if label not in tree.pending:
            raise _Fail(_NOT_PENDING[1])
        tag, size = tree.pending.pop(label)
        if tag in tree.inodes:  # else the file is gone, and meta dropped the truncate with it
            tree.inodes[tag][1] = size
        return ("ok",)

    def _stat(self, tree: Tree, call: Call, path: str) -> Hashable:
        target = tree.walk(_split(path))
        kind, size, _ = tree.inodes[target]
        return ("ok", kind, target, int(size))

    def _readdir(self, tree: Tree, call: Call, path: str) -> Hashable:
        target = tree.walk(_split(path))
        if tree.kind(target) != "d":
            raise _Fail("NOT_A_DIRECTORY")
        return ("ok", tuple(tree.children(target)))

"""The CRAQ update of one chunk on one target, as a pure state machine: events in, effects out.

One :class:`UpdateMachine` carries one update through one target while the caller holds the chunk
lock. The head (a client's update, or the completion of a version a failed head left pending) and
every successor (a forwarded update) run the same machine; only the start differs:

* **start** — decide from the chunk's versions what to do: answer at once (the update is already
  applied here), refuse (it does not apply to this replica), complete an abandoned pending version
  first (head), install a full copy directly (the end of the write path during a resync or a
  repair), or stage the update as a pending version;
* **staged** — forward to the successor (a full copy to a syncing one), or commit at the tail;
* **staged and forwarded** — with pipelining on, an update that goes on to a successor as itself
  (not as a full copy) is staged here and forwarded at the same time: the forward carries the
  request, not what this target builds from it. The machine hears both outcomes together. A stage
  that failed while the successor may hold the version (it committed it, or its answer never
  came) leaves this target behind its successor: it stages again once the chain changed or after
  the routing wait, forwarding again (a successor that committed the version answers at once),
  within the retry budget; past it the target fails with a disk error, which takes it out of the
  chain to be resynced. Once behind, it never answers with a refusal. A stage that failed while
  the successor proved it did not apply the update (and no earlier forward may have reached one)
  fails the update as a serial stage would: nobody holds the version;
* **forwarded** — commit after the successor committed; drop the pending version when the
  successor proved it did not apply it (no space, checksum, bad request); otherwise wait for the
  chain to change and forward again, until the retry budget is spent — then keep the pending
  version (some successor may have committed it) for the head to complete later;
* **committed** — answer.

A target acts on an update only while it still holds its place: a head's update (a client's, or a
completion) only while the target is still the chain's serving head — one that left the chain and
came back as a syncing tail must not commit and answer alone — and anyone's only while it is still
on the write path with a lease. A successor's "committed" covers the successor it came from: if the
chain has given this target another successor meanwhile, the update is forwarded to that one too.

The machine never touches a disk, a socket, a clock or a random number: the shell
(:class:`fs3.storage.replica.TargetReplica`) feeds it facts (the chunk's versions, the chain as this
target sees it, the time) and carries out the effects it returns. ``tests/craq/*.txt`` drive it
with text scripts.

Version rules (see :mod:`fs3.storage.chunk_engine`): a head gives every new version a number never
used on its target, so along a chunk's history versions only grow. A forwarded update names the
committed version it was built on (``base``); a successor applies it only on top of that version
(0: the chunk does not exist), answers at once when it already committed it, and refuses anything
else. A full copy (repair, syncing successor) replaces whatever older version a successor holds.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from fs3.common.errors import (
    FS3Error,
    IoError,
    LeaseExpired,
    StaleUpdate,
    StatusCode,
    TargetNotServing,
    Unavailable,
)
from fs3.common.invariant import ensure

__all__ = [
    "Abort",
    "AwaitRouting",
    "ChunkFacts",
    "Commit",
    "CompletePending",
    "Effect",
    "Fail",
    "Forward",
    "Install",
    "Kind",
    "Outcome",
    "PathFacts",
    "Reply",
    "Source",
    "Stage",
    "StageAndForward",
    "UpdateMachine",
    "UpdateRequest",
    "classify",
]


class Source(enum.Enum):
    CLIENT = "client"  # a client's update, at the head
    FORWARD = "forward"  # an update forwarded by the predecessor
    REPAIR = "repair"  # the head completing a pending version a failed write left behind
    SYNC = "sync"  # a resync transfer: the predecessor's committed copy, installed as is


class Kind(enum.Enum):
    WRITE = "write"
    TRUNCATE = "truncate"
    REMOVE = "remove"
    REPLACE = "replace"  # the payload is the whole chunk (or, with ``remove``, its absence)


class Outcome(enum.Enum):
    OK = "ok"
    RETRY = "retry"  # the chain may have changed, or the outcome is unknown: forward again later
    REFUSED = "refused"  # the successor proved it did not apply the update
    DIVERGED = "diverged"  # the successor's copy is not the one the update was built on


@dataclass(frozen=True)
class UpdateRequest:
    source: Source
    kind: Kind
    offset: int = 0
    length: int = 0  # WRITE: payload bytes; TRUNCATE: new chunk length
    version: int = 0  # the version being applied (a client's update: chosen at start)
    base: int = 0  # FORWARD: the committed version the update was built on (0: no chunk)
    remove: bool = False  # REPLACE: the chunk no longer exists


@dataclass(frozen=True)
class ChunkFacts:
    committed: int = 0  # 0: the chunk does not exist here
    pending: int = 0  # 0: no pending version
    length: int = 0  # of the committed version


@dataclass(frozen=True)
class PathFacts:
    writable: bool = True  # this target is on the chain's write path (serving or syncing)
    head: bool = True  # this target is the serving head of the chain
    lease_valid: bool = True
    successor: int = 0  # target id of the next target on the write path (0: this is the end)
    successor_syncing: bool = False
    routing_version: int = 0


@dataclass(frozen=True)
class CompletePending:
    """Head: push the chunk's abandoned pending version down the chain first, then start again."""

    version: int


@dataclass(frozen=True)
class Stage:
    """Store the update as pending ``version`` on top of committed ``base``. ``how``: ``patch`` (a
    small write applied in place at commit), ``whole`` (the new content built from the committed
    one), ``replace`` (the payload is the content), ``remove``."""

    version: int
    base: int
    how: str


@dataclass(frozen=True)
class Install:
    """Commit the payload (a full copy) as ``version`` at once; no pending version, no forward."""

    version: int


@dataclass(frozen=True)
class Forward:
    successor: int
    version: int
    base: int
    full: bool  # send the whole new content instead of the update


@dataclass(frozen=True)
class StageAndForward:
    """``stage`` and ``forward`` at once; the machine hears both outcomes together
    (:meth:`UpdateMachine.staged_and_forwarded`), each only once it has ended."""

    stage: Stage
    forward: Forward


@dataclass(frozen=True)
class AwaitRouting:
    """Wait for routing newer than ``routing_version`` (or a short timeout), then report the path."""

    routing_version: int


@dataclass(frozen=True)
class Commit:
    version: int


@dataclass(frozen=True)
class Abort:
    version: int


@dataclass(frozen=True)
class Reply:
    """Answer with the chunk as it now is on this target."""


@dataclass(frozen=True)
class Fail:
    error: FS3Error
    # A pending version stays behind that some successor may have committed: a head must complete
    # it later (it is never dropped, and never overwritten by a different update).
    pending_kept: bool = False
    # The update's stage failed here while a successor may hold the version: this target holds
    # neither it nor a pending version that marks the chunk dirty. Its copy of the chunk must not be
    # served as current (the shell keeps it dirty) until a later update or a resync replaces it.
    behind: bool = False


Effect = CompletePending | Stage | StageAndForward | Install | Forward | AwaitRouting | Commit | Abort | Reply | Fail

# Refusals that prove the successor did not apply the update: its pending version can be dropped.
_REFUSED = frozenset({StatusCode.NO_SPACE, StatusCode.CHECKSUM_MISMATCH, StatusCode.INVALID_ARGUMENT})


def classify(error: FS3Error) -> Outcome:
    """How a failed forward is handled.

    Everything but a proof of refusal or divergence is "outcome unknown, forward again once the
    chain changed": a timeout, a chain that moved, a successor that left it — and an I/O error from
    the successor, which is its disk's, not ours (it takes itself out of the chain and the write goes
    on without it). So a forward retries more than the shared table of retryable codes
    (``fs3.common.errors.RETRYABLE``): giving up on a forward whose outcome is unknown would leave a
    pending version nobody completes. Its retries are bounded by time (``retry_total_ms``).
    """
    if error.code == StatusCode.STALE_UPDATE:
        return Outcome.DIVERGED
    if error.code in _REFUSED:
        return Outcome.REFUSED
    return Outcome.RETRY


class UpdateMachine:
    """One update on one target (see the module docstring). Feed it events; do what it returns."""

    def __init__(self, request: UpdateRequest, *, patch_max_bytes: int, retry_total_ms: int,
                 pipeline: bool = False) -> None:
        """``pipeline``: stage and forward an update at the same time where the forward does not
        need what the stage builds (see the module docstring)."""
        self.request = request
        self.pipeline = pipeline
        self.patch_max_bytes = patch_max_bytes
        self.retry_total_ms = retry_total_ms
        self.version = request.version
        self.base = request.base
        self.full = request.kind is Kind.REPLACE or request.source is Source.REPAIR
        self._deadline_ms = 0
        self._sent_to = 0  # the successor the last forward went to
        self._stage: Stage | None = None  # the stage to do again when a pipelined stage failed
        self._staged = False
        self._behind = False  # a stage failed while a successor may hold the version

    # -- events ------------------------------------------------------------------------------

    def start(self, chunk: ChunkFacts, path: PathFacts, now_ms: int,
              new_version: Callable[[], int] | None = None) -> list[Effect]:
        """``new_version``: for a client's update, hands out a version number never used on this
        target (the chunk engine's counter, injected like the time)."""
        self._deadline_ms = now_ms + self.retry_total_ms
        request = self.request
        displaced = self._displaced(path)
        if displaced is not None:
            return [Fail(displaced)]
        if request.source is Source.CLIENT:
            if chunk.pending:
                return [CompletePending(chunk.pending)]
            ensure(new_version is not None, "a client's update needs a version counter")
            assert new_version is not None
            self.version, self.base = new_version(), chunk.committed
            return self._stage_step(Stage(self.version, self.base, self._how(chunk)), path)
        if request.source is Source.REPAIR:
            self.version, self.base = chunk.pending, chunk.committed
            return self._next(path)
        if request.source is Source.SYNC or (self.full and not path.successor):
            # The end of the write path (a syncing target; the tail during a repair): install.
            if request.source is not Source.SYNC and chunk.committed == self.version:
                return [Reply()]
            if request.source is not Source.SYNC and chunk.committed > self.version:
                return [Fail(StaleUpdate(f"v{self.version} is older than committed v{chunk.committed}"))]
            return [Install(self.version), Reply()]
        if chunk.committed == self.version:
            return [Reply()]  # committed here already, hence downstream too: a forward sent again
        removal = request.kind is Kind.REMOVE or (request.kind is Kind.REPLACE and request.remove)
        if removal and not chunk.committed and self.base:
            return [Reply()]  # removed here already (a forward sent again)
        if self.full:
            if chunk.committed > self.version:
                return [Fail(StaleUpdate(f"v{self.version} is older than committed v{chunk.committed}"))]
        elif chunk.committed != self.base:
            return [Fail(StaleUpdate(f"update v{self.version} on v{self.base}, but v{chunk.committed} is "
                                     f"committed here"))]
        return self._stage_step(Stage(self.version, chunk.committed, self._how(chunk)), path)

    def staged(self, path: PathFacts) -> list[Effect]:
        self._staged = True
        return self._next(path)

    def staged_and_forwarded(self, stage_error: FS3Error | None, outcome: Outcome, error: FS3Error | None,
                             path: PathFacts, now_ms: int) -> list[Effect]:
        """Both halves of a :class:`StageAndForward` ended (``stage_error``: how the stage failed)."""
        if stage_error is None:
            self._staged = True
            return self.forwarded(outcome, error, path, now_ms)
        if outcome in (Outcome.REFUSED, Outcome.DIVERGED) and not self._behind:
            # The successor proved it did not apply the update, and this target holds nothing:
            # the stage's failure is the answer, as if the two had run one after the other.
            return [Fail(stage_error)]
        self._behind = True
        return self.stage_failed(stage_error, path, now_ms)

    def stage_failed(self, error: FS3Error, path: PathFacts, now_ms: int) -> list[Effect]:
        """A stage failed (``error``). Before any forward left, the failure is the answer. Once a
        successor may hold the version, this target is behind it: stage again later, or fail so
        that the target leaves the chain — never answer with a refusal, which would make the
        predecessor drop a version the successors hold."""
        if not self._behind:
            return [Fail(error)]
        if error.code == StatusCode.IO_ERROR:
            return [Fail(error, behind=True)]  # a failed disk: the target leaves the chain
        displaced = self._displaced(path)
        if displaced is not None:
            return [Fail(displaced, behind=True)]
        if now_ms >= self._deadline_ms:
            return [Fail(IoError(f"v{self.version} could not be staged here for {self.retry_total_ms} ms while "
                                 f"the successor may hold it: {error}"), behind=True)]
        return [AwaitRouting(path.routing_version)]

    def forwarded(self, outcome: Outcome, error: FS3Error | None, path: PathFacts, now_ms: int) -> list[Effect]:
        if outcome is Outcome.OK:
            if path.successor and path.successor != self._sent_to:
                # The chain changed while the forward was out: the new successor needs it too.
                return self._next(path)
            displaced = self._displaced(path)
            if displaced is not None:
                return [Fail(displaced, pending_kept=True)]
            return [Commit(self.version)]
        assert error is not None
        if outcome is Outcome.REFUSED:
            if self.request.source is Source.REPAIR:
                return [Fail(error, pending_kept=True)]  # someone downstream may hold it committed
            return [Abort(self.version), Fail(error)]
        if outcome is Outcome.DIVERGED:
            # A full copy pushed by the head mends it: keep the version for the head to complete.
            return [Fail(Unavailable(f"the successor's copy diverged ({error}); the head repairs it"),
                         pending_kept=True)]
        if now_ms >= self._deadline_ms:
            return [Fail(Unavailable(f"forwarding to the successor failed for {self.retry_total_ms} ms: {error}"),
                         pending_kept=True)]
        return [AwaitRouting(path.routing_version)]

    def routing_changed(self, path: PathFacts, now_ms: int) -> list[Effect]:
        if not self._staged and self._stage is not None:
            # A pipelined stage failed: stage again, forwarding again with it (see the module docstring).
            displaced = self._displaced(path)
            if displaced is not None:
                return [Fail(displaced, behind=True)]
            return self._stage_step(self._stage, path)
        return self._next(path)

    def committed(self) -> list[Effect]:
        return [Reply()]

    # -- rules -------------------------------------------------------------------------------

    def _displaced(self, path: PathFacts) -> FS3Error | None:
        """Why this target may no longer act on the update (None: it still holds its place)."""
        if not path.lease_valid:
            return LeaseExpired("no contact with mgmtd within the lease")
        if not path.writable:
            return TargetNotServing("this target left the chain's write path")
        if self.request.source in (Source.CLIENT, Source.REPAIR) and not path.head:
            return TargetNotServing("this target is no longer the chain's serving head")
        return None

    def _next(self, path: PathFacts) -> list[Effect]:
        """The update is staged here: forward it to the successor, or commit at the tail."""
        displaced = self._displaced(path)
        if displaced is not None:
            return [Fail(displaced, pending_kept=True)]
        if not path.successor:
            return [Commit(self.version)]
        self._sent_to = path.successor
        return [Forward(path.successor, self.version, self.base, self.full or path.successor_syncing)]

    def _stage_step(self, stage: Stage, path: PathFacts) -> list[Effect]:
        """Stage, and with pipelining forward at the same time when the forward is the update
        itself (a full copy is built by the stage, so it waits for it)."""
        self._stage = stage
        if not self.pipeline or not path.successor or self.full or path.successor_syncing:
            return [stage]
        self._sent_to = path.successor
        return [StageAndForward(stage, Forward(path.successor, self.version, self.base, False))]

    def _how(self, chunk: ChunkFacts) -> str:
        request = self.request
        if request.kind is Kind.REMOVE or (request.kind is Kind.REPLACE and request.remove):
            return "remove"
        if request.kind is Kind.REPLACE:
            return "replace"
        if request.kind is Kind.WRITE and self._patchable(chunk):
            return "patch"
        return "whole"

    def _patchable(self, chunk: ChunkFacts) -> bool:
        """A small write inside a committed chunk at least twice its size is staged as a patch of
        the committed version instead of a copy of the whole chunk."""
        request = self.request
        return (chunk.committed > 0 and not chunk.pending and 0 < request.length <= self.patch_max_bytes
                and request.offset + request.length <= chunk.length and 2 * request.length <= chunk.length)

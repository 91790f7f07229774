"""The node's pipeline: every rank deposits chunks into shared memory, each chunk is reduced by one of
the node's ranks in turn, the node leaders allreduce the partials over a double binary tree, and
every rank copies the result out.

Chunks are numbered over the job's life (``g``), so every rank and node names a chunk the same way.
Local rank ``g % L`` *owns* chunk ``g``: it reduces it, reading the other ranks' deposits from their
input slots and its own contribution straight from its tensor (so the owner never copies its own
chunk in). The reduction work is spread over all the node's processes — each one's worker thread is
a reducer — and no thread hands a chunk to another thread of its own process.

:class:`RankWorker` — one thread per rank, working through its queue of collectives. For each it
posts a descriptor and waits until every local rank has posted theirs (a disagreement fails the node
with a message naming both), then loops until every chunk is collected:

* deposit chunk ``g`` (not its own) into input slot ``g % slots`` once that slot's previous chunk,
  ``g - slots``, was reduced;
* reduce its own chunk ``g`` once every other rank deposited it and every rank has copied out chunk
  ``g - slots`` (whose result slot ``g`` reuses): the inputs are added in local-rank order into the
  result slot;
* copy out chunk ``g`` once it is final: reduced, on one node; on several, when the tree's result
  came back (the shared ``ready`` counter).

:class:`Network` — in the leader's process, with several nodes: per tree, a combiner adds the
children's partials of its chunks (in child order) to the node's own and sends the sum to the
parent; the root's sum is final and goes down the tree; a receiver per peer link reads frames into
preallocated buffers (children's partials) or straight into the result slot (the final, from the
parent) and forwards finals to the children. Even chunks ride tree A, odd chunks tree B.

Shared counters only grow: per local rank ``deposited``, ``reduced`` and ``collected`` (each written
by its own rank), and the leader's ``ready``. Every waiter sleeps on one doorbell (a futex) that
every change rings. The order of additions is fixed by local rank and by the tree, never by arrival,
so a job rerun on the same layout gives bit-identical results.

Failure: any thread that sees a dead peer, a disagreement or no progress within the timeout poisons
the node (the shared error word and message) and every linked node (an ABORT frame), and every rank's
pending and later operations raise :class:`~hfreduce.errors.HFReduceError`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hfreduce.errors import HFReduceError, HFReduceTimeout
from hfreduce.futex import Doorbell
from hfreduce.kernels import Arithmetic, DType, ReduceOp
from hfreduce.shm import DESCRIPTOR_WORDS, NodeSegment, process_start_time
from hfreduce.tree import TreePosition, tree_for_chunk

log = logging.getLogger(__name__)

__all__ = ["Network", "NodeState", "OpKind", "PeerLink", "RankOp", "RankWorker", "Work"]

# How long one wait sleeps before it re-checks liveness and its deadline.
_WAIT_SLICE_S = 0.05
_MAX_QUEUED_OPS = 4096

# Frame header on the leaders' links: kind, dtype (or flags), op, pad, op sequence, the collective's
# element count, global chunk, the chunk's elements, bytes.
_FRAME = struct.Struct("!BBBxQQQQQ")
_UP, _DOWN, _ABORT, _BYE = 1, 2, 3, 4
_MAX_ABORT_MESSAGE = 4096
# How long an aborting node waits for its peers to close their ends after the abort frame.
_DRAIN_S = 2.0
# Doorbell signaller ids: local ranks use their local rank; the leader's network threads these.
# A process's poison and departure rings: 120 + its local rank (local ranks stay below 120), so no
# two processes ring under one id.
_SIGNALLER_POISON = 120
MAX_LOCAL_WORLD_SIZE = 120
_SIGNALLER_NETWORK = 240
# Descriptor words every local rank must agree on (sequence + 1 first; the shared-buffer place after).
_AGREED_WORDS = 8


class OpKind:
    ALLREDUCE = 1
    REDUCE_SCATTER = 2
    ALL_GATHER = 3
    BROADCAST = 4


class Work:
    """A pending collective: ``wait()`` blocks until it is done and raises what made it fail."""

    def __init__(self, description: str) -> None:
        self.description = description
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Work], None]] = []
        self._lock = threading.Lock()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the operation ends; True when it succeeded (raises its error otherwise).

        With ``timeout_s`` it returns False if the operation is still running then.
        """
        if not self._done.wait(timeout_s):
            return False
        if self._error is not None:
            raise self._error
        return True

    def exception(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def add_done_callback(self, callback: Callable[[Work], None]) -> None:
        """Run ``callback(work)`` when done (at once if it already is), in the thread that finished it."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def _finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # a callback's failure must not stop the pipeline thread
                log.exception("hfreduce: a completion callback of %s failed", self.description)


@dataclass(slots=True)
class RankOp:
    """One rank's side of a collective over ``count`` elements of ``arith``'s dtype.

    ``contribution(start, end, scratch)`` is this rank's part of elements ``[start, end)`` in the
    storage dtype: a view of the caller's buffer when there is one, else written into ``scratch`` (a
    rank-private buffer of the same length); ``collect(start, end, result)`` takes the final values
    (accumulator dtype) it wants.
    """

    kind: int
    arith: Arithmetic
    count: int
    root: int
    contribution: Callable[[int, int, np.ndarray], np.ndarray]
    collect: Callable[[int, int, np.ndarray], None]
    work: Work
    keepalive: tuple[object, ...] = ()
    finish: Callable[[], None] | None = None
    divisor: int = 1
    # (registered buffer, byte offset) when the caller's buffer is a shared one, with every local
    # rank's array at that place (see Communicator.shared_array).
    shared: tuple[int, int] | None = None
    peer_arrays: list[np.ndarray] | None = None
    sequence: int = -1
    first_chunk: int = 0

    def chunk_count(self, chunk_elements: int) -> int:
        # An empty operation still takes one (empty) chunk, so that ranks still check they agree.
        return max(1, -(-self.count // chunk_elements))


def chunk_elements(arith: Arithmetic, chunk_size_bytes: int) -> int:
    return chunk_size_bytes // arith.accumulator_itemsize


def _describe(words: np.ndarray) -> str:
    dtype, op, count, kind = int(words[1]), int(words[2]), int(words[3]), int(words[4])
    names = {OpKind.ALLREDUCE: "allreduce", OpKind.REDUCE_SCATTER: "reduce_scatter",
             OpKind.ALL_GATHER: "all_gather", OpKind.BROADCAST: "broadcast"}
    try:
        type_name = DType(dtype).name.lower()
        op_name = ReduceOp(op).name
    except ValueError:
        type_name, op_name = f"dtype {dtype}", f"op {op}"
    return f"{names.get(kind, f'kind {kind}')}({op_name}) of {count} {type_name} elements, root {int(words[5])}"


def process_alive(pid: int, start_time: int) -> bool:
    """True while the process that registered as (pid, start time) runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return False
    fields = text[text.rindex(")") + 2:].split()
    return fields[0] != "Z" and int(fields[19]) == start_time


class NodeState:
    """What every thread of one process shares about its node: segment, doorbell, poison, liveness."""

    def __init__(self, segment: NodeSegment, local_rank: int, timeout_s: float, describe_rank: Callable[[int], str]):
        self.segment = segment
        self.local_rank = local_rank
        self.timeout_s = timeout_s
        self.describe_rank = describe_rank
        self.slots = segment.shape.slots
        self.chunk_size_bytes = segment.shape.chunk_size_bytes
        self.local_world_size = segment.shape.local_world_size
        self.control = segment.control
        ranks = range(self.local_world_size)
        self.deposited_words = np.array([segment.deposited_at(r) for r in ranks])
        self.reduced_words = np.array([segment.reduced_at(r) for r in ranks])
        self.collected_words = np.array([segment.collected_at(r) for r in ranks])
        self.stopping = False
        self.multi_node = False
        self._poison_bell = self.bell(_SIGNALLER_POISON + local_rank)
        self._next_liveness_check = 0.0
        self._poison_hooks: list[Callable[[str], None]] = []
        self._poison_lock = threading.Lock()

    def bell(self, signaller_id: int) -> Doorbell:
        """The node's doorbell as one signaller (one per thread that rings it)."""
        return Doorbell(self.segment.bell_word, signaller_id)

    # -- chunk state (shared counters) --------------------------------------------------------------

    def owner(self, g: int) -> int:
        return g % self.local_world_size

    def is_reduced(self, g: int) -> bool:
        return int(self.control[self.reduced_words[g % self.local_world_size]]) > g

    def is_final(self, g: int) -> bool:
        if self.multi_node:
            return int(self.control[self.segment.ready_at]) > g
        return self.is_reduced(g)

    # -- failure ------------------------------------------------------------------------------------

    def on_poison(self, hook: Callable[[str], None]) -> None:
        self._poison_hooks.append(hook)

    def error(self) -> str | None:
        return self.segment.error()

    def poison(self, message: str) -> None:
        """Fail the node: every local rank's operations raise ``message`` (the first error wins)."""
        with self._poison_lock:
            first = self.segment.error() is None
            self.segment.set_error(message)
            self._poison_bell.ring()
        if first:
            log.error("hfreduce: %s", message)
            for hook in self._poison_hooks:
                hook(message)

    def raise_if_failed(self) -> None:
        message = self.error()
        if message is not None:
            if "no progress" in message:
                raise HFReduceTimeout(message)
            raise HFReduceError(message)
        if self.stopping:
            raise HFReduceError("the communicator was shut down")

    def registered(self, local_rank: int) -> tuple[int, int]:
        word = int(self.control[self.segment.pid_at(local_rank)])
        return word & 0xFFFFFFFF, word >> 32

    def departed(self, local_rank: int) -> int | None:
        """How many collectives a rank that shut down had completed (None while it takes part)."""
        word = int(self.control[self.segment.departed_at(local_rank)])
        return word - 1 if word else None

    def depart(self, completed: int) -> None:
        """This rank leaves after ``completed`` collectives: node-mates still finish those, and fail
        at once on a later one (instead of waiting for it until the timeout)."""
        self.control[self.segment.departed_at(self.local_rank)] = completed + 1
        self._poison_bell.ring()

    def check_departed(self, sequence: int) -> None:
        """Fail collective ``sequence`` if a local rank it needs has shut down."""
        for local_rank in range(self.local_world_size):
            completed = self.departed(local_rank)
            if completed is not None and completed <= sequence and local_rank != self.local_rank:
                self.poison(f"{self.describe_rank(local_rank)} shut down its communicator after {completed} "
                            f"collectives; collective #{sequence} needs it")
                self.raise_if_failed()

    def check_alive(self) -> None:
        """Poison the node if another local rank's process is gone (at most every wait slice: it
        reads /proc). A rank that shut down first is not a failure."""
        now = time.monotonic()
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + _WAIT_SLICE_S
        for local_rank in range(self.local_world_size):
            if local_rank == self.local_rank or self.departed(local_rank) is not None:
                continue
            pid, start = self.registered(local_rank)
            if pid and not process_alive(pid, start):
                self.poison(f"{self.describe_rank(local_rank)} (pid {pid}) exited")
                self.raise_if_failed()

    def register_self(self) -> None:
        pid = os.getpid()
        start = process_start_time(pid) or 0
        self.control[self.segment.pid_at(self.local_rank)] = (start << 32) | pid


@dataclass(slots=True)
class ChunkInfo:
    """What the leader's network threads need to know about one global chunk."""

    arith: Arithmetic
    elements: int
    sequence: int
    # The whole collective's element count: two nodes whose sizes differ only after the first chunk
    # agree on that chunk's elements, not on this.
    count: int


class RankWorker:
    """This rank's queue of collectives, worked through in order by one thread (see module doc)."""

    def __init__(self, node: NodeState, on_start: Callable[[RankOp, int], None] | None = None) -> None:
        self.node = node
        self.on_start = on_start  # the leader's network learns each collective's chunks
        self.bell = node.bell(node.local_rank)
        self._queue: queue.Queue[RankOp | None] = queue.Queue(_MAX_QUEUED_OPS)
        self._next_chunk = 0
        self._sequence = 0
        # Where a contribution that is not a view of the caller's buffer is built (all-gather's
        # zeros around this rank's block), and the reducer's bf16 widening buffer.
        self._contribution_scratch = np.empty(node.chunk_size_bytes, dtype=np.uint8)
        self._widening_scratch = np.empty(node.chunk_size_bytes // 4, dtype=np.float32)
        self._thread = threading.Thread(target=self._run, name="hfreduce-rank", daemon=True)
        self._thread.start()

    def submit(self, op: RankOp) -> None:
        self._queue.put(op)

    def stop(self) -> None:
        self.node.stopping = True
        self.bell.ring()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        failure: BaseException | None = None
        while True:
            op = self._queue.get()
            if op is None:
                break
            if failure is None:
                try:
                    self.node.raise_if_failed()
                    self._execute(op)
                    if op.finish is not None:
                        op.finish()
                    op.work._finish()
                    continue
                except HFReduceError as exc:
                    failure = exc
                except Exception as exc:  # a bug or a bad buffer: the node cannot stay consistent
                    self.node.poison(f"{self.node.describe_rank(self.node.local_rank)}: {exc!r}")
                    failure = HFReduceError(str(self.node.error()))
                    failure.__cause__ = exc
            op.work._finish(failure)
        # Fail whatever is still queued.
        while True:
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                return
            if op is not None:
                op.work._finish(failure or HFReduceError("the communicator was shut down"))

    @property
    def completed(self) -> int:
        """Collectives this rank completed (its worker runs them in order)."""
        return self._sequence

    def _wait(self, seen: int, waiting_for: Callable[[], str], since: float) -> None:
        """Sleep on the doorbell (after a pass that made no progress), failing on errors, departed
        node-mates and timeouts."""
        node = self.node
        node.raise_if_failed()
        node.check_departed(self._sequence)
        if time.monotonic() - since > node.timeout_s:
            node.poison(f"{node.describe_rank(node.local_rank)}: no progress for {node.timeout_s:g} s: "
                        f"{waiting_for()} (a rank or node stopped taking part, or hangs)")
            node.raise_if_failed()
        node.check_alive()
        self.bell.wait(seen, _WAIT_SLICE_S)

    def _start(self, op: RankOp, chunks: int) -> bool:
        """Post this rank's descriptor of the collective and check every local rank's against it.

        True when every local rank's buffer is the same place of the same registered buffer: then
        nothing is copied in or out (the owner of a chunk reads and writes every rank's buffer).
        """
        node, segment = self.node, self.node.segment
        me, sequence = node.local_rank, self._sequence
        ring = segment.shape.descriptor_ring
        descriptor = segment.descriptors[me, sequence % ring]
        region, offset = op.shared if op.shared is not None else (-1, 0)
        descriptor[1:DESCRIPTOR_WORDS] = (op.arith.dtype, op.arith.op, op.count, op.kind, op.root, op.first_chunk,
                                          chunks, region, offset)
        descriptor[0] = sequence + 1
        self.bell.ring()
        column = segment.descriptors[:, sequence % ring]
        since = time.monotonic()
        while True:
            seen = self.bell.read()
            late = [r for r in range(node.local_world_size) if int(column[r, 0]) != sequence + 1]
            if not late:
                break
            self._wait(seen, functools.partial(_not_started, node, sequence, late), since)
        for r in range(node.local_world_size):
            if not np.array_equal(column[r, 1:_AGREED_WORDS], descriptor[1:_AGREED_WORDS]):
                node.poison(f"collective #{sequence} differs across ranks: {node.describe_rank(me)} called "
                            f"{_describe(descriptor)}, {node.describe_rank(r)} called {_describe(column[r])}")
                node.raise_if_failed()
        return region >= 0 and all(int(column[r, 8]) == region and int(column[r, 9]) == offset
                                   for r in range(node.local_world_size))

    def _execute(self, op: RankOp) -> None:
        node, control, segment = self.node, self.node.control, self.node.segment
        me, local_world_size, slots = node.local_rank, node.local_world_size, node.slots
        per_chunk = chunk_elements(op.arith, node.chunk_size_bytes)
        chunks = op.chunk_count(per_chunk)
        first = self._next_chunk
        op.sequence, op.first_chunk = self._sequence, first
        shared = self._start(op, chunks)
        peers = op.peer_arrays if shared else None
        # Zero copy on one node: the owner writes every rank's result; nobody copies out.
        owner_writes_all = peers is not None and not node.multi_node
        if self.on_start is not None:
            self.on_start(op, chunks)
        storage, accumulator = op.arith.storage, op.arith.accumulator
        scratch = self._contribution_scratch[:per_chunk * storage.itemsize].view(storage)
        inputs, results = segment.inputs, segment.results
        deposited_words, collected_words = node.deposited_words, node.collected_words
        # This rank's next chunk (an index into the collective) to deposit, reduce and collect.
        deposit = collect = 0
        reduce = (me - first) % local_world_size
        since = time.monotonic()
        while collect < chunks:
            seen = self.bell.read()
            progressed = False
            while deposit < chunks and (first + deposit < slots or node.is_reduced(first + deposit - slots)):
                g = first + deposit
                if node.owner(g) != me and peers is None:
                    start = deposit * per_chunk
                    end = min(start + per_chunk, op.count)
                    slot = inputs[me, g % slots, :(end - start) * storage.itemsize].view(storage)
                    source = op.contribution(start, end, slot)
                    if source is not slot:
                        np.copyto(slot, source)
                deposit += 1
                control[deposited_words[me]] = g + 1
                progressed = True
            while reduce < chunks:
                g = first + reduce
                if (int(control[deposited_words].min()) <= g
                        or int(control[collected_words].min()) < g - slots + 1):
                    break
                start = reduce * per_chunk
                end = min(start + per_chunk, op.count)
                count = end - start
                if peers is not None:
                    sources = [peer[start:end] for peer in peers]
                else:
                    mine = op.contribution(start, end, scratch[:count])
                    sources = [mine if r == me else inputs[r, g % slots, :count * storage.itemsize].view(storage)
                               for r in range(local_world_size)]
                out = results[g % slots, :count * accumulator.itemsize].view(accumulator)
                op.arith.reduce(sources, out, self._widening_scratch)
                if owner_writes_all:
                    assert peers is not None
                    for peer in peers:
                        op.arith.collect(out, peer[start:end], op.divisor)
                reduce += local_world_size
                control[node.reduced_words[me]] = g + 1
                progressed = True
            while collect < deposit and node.is_final(first + collect):
                g = first + collect
                if not owner_writes_all:
                    start = collect * per_chunk
                    end = min(start + per_chunk, op.count)
                    op.collect(start, end, results[g % slots, :(end - start) * accumulator.itemsize].view(accumulator))
                collect += 1
                control[collected_words[me]] = g + 1
                progressed = True
            if progressed:
                self.bell.ring()
                since = time.monotonic()
                continue
            self._wait(seen, functools.partial(_lagging, node, first + collect, first + deposit,
                                               first + reduce if reduce < chunks else None), since)
        self._next_chunk = first + chunks
        self._sequence += 1


def _not_started(node: NodeState, sequence: int, late: list[int]) -> str:
    return f"collective #{sequence}: waiting for {', '.join(node.describe_rank(r) for r in late)} to start it"


def _lagging(node: NodeState, collect: int, deposit: int, reduce: int | None) -> str:
    """Who the rank waits for, in words (only called for the timeout message)."""
    control = node.control
    ranks = range(node.local_world_size)
    if reduce is not None:
        late = [node.describe_rank(r) for r in ranks if r != node.local_rank
                and int(control[node.deposited_words[r]]) <= reduce]
        if late:
            return f"chunk {reduce}: waiting for {', '.join(late)} to deposit it"
    if deposit - node.slots >= 0 and not node.is_reduced(deposit - node.slots):
        return (f"chunk {deposit}: waiting for {node.describe_rank(node.owner(deposit - node.slots))} to reduce "
                f"chunk {deposit - node.slots}")
    if node.multi_node and not node.is_final(collect):
        return f"chunk {collect}: waiting for the other nodes' sums"
    late = [node.describe_rank(r) for r in ranks if int(control[node.collected_words[r]]) < collect - node.slots]
    return f"chunk {collect}: waiting for {', '.join(late) or 'the node'}"


class PeerLink:
    """One TCP connection between two node leaders; frames from several threads, one at a time."""

    def __init__(self, peer_node: int, sock: socket.socket, describe: str) -> None:
        self.peer_node = peer_node
        self.sock = sock
        self.describe = describe
        self.send_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0

    def send(self, kind: int, info: ChunkInfo | None, g: int, payload: memoryview | bytes) -> None:
        dtype = op = 0
        sequence = count = elements = 0
        if info is not None:
            dtype, op, elements, sequence = info.arith.dtype, info.arith.op, info.elements, info.sequence
            count = info.count
        header = _FRAME.pack(kind, dtype, op, sequence, count, g, elements, len(payload))
        with self.send_lock:
            self.sock.sendall(header, socket.MSG_MORE if len(payload) else 0)
            if len(payload):
                self.sock.sendall(payload)
            self.bytes_sent += len(header) + len(payload)

    def recv_into(self, view: memoryview) -> None:
        got = 0
        total = len(view)
        while got < total:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("connection closed")
            got += n
        self.bytes_received += total


@dataclass(slots=True)
class _ChildRing:
    """Preallocated receive slots for one child's partials in one tree (no allocation per chunk)."""

    buffers: np.ndarray
    owner: list[int | None] = field(default_factory=list)
    headers: list[tuple[int, int, int, int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _OpRecord:
    """One collective's chunk range, as the leader's network threads need it."""

    first: int
    chunks: int
    arith: Arithmetic
    count: int
    per_chunk: int
    sequence: int

    def info(self, g: int) -> ChunkInfo:
        index = g - self.first
        return ChunkInfo(self.arith, max(0, min(self.per_chunk, self.count - index * self.per_chunk)), self.sequence,
                         self.count)


class Network:
    """The leader's inter-node stage over the double binary tree (see module doc)."""

    def __init__(self, node: NodeState, node_index: int, trees: tuple[TreePosition, TreePosition],
                 links: dict[int, PeerLink], describe_node: Callable[[int], str]) -> None:
        self.node = node
        self.node_index = node_index
        self.trees = trees
        self.links = links
        self.describe_node = describe_node
        slots = node.slots
        self._lock = threading.Lock()
        self._ops: list[_OpRecord] = []  # collectives not yet final, oldest first (bounded by the slots)
        self._finished: set[int] = set()
        self._ready = 0
        self._rings: dict[tuple[int, int], _ChildRing] = {}
        for tree_index, position in enumerate(trees):
            for child in position.children:
                self._rings[(tree_index, child)] = _ChildRing(
                    np.zeros((slots, node.chunk_size_bytes), dtype=np.uint8), [None] * slots, [(0, 0, 0, 0, 0)] * slots)
        self._aborted = False
        self._abort_thread: threading.Thread | None = None
        # Peers that said goodbye, with how many collectives they completed first.
        self._departed: dict[int, int] = {}
        node.on_poison(self._abort_peers)
        self._threads = [threading.Thread(target=self._guard, args=(self._combine, tree_index),
                                          name=f"hfreduce-tree{tree_index}", daemon=True) for tree_index in (0, 1)]
        self._threads += [threading.Thread(target=self._guard, args=(self._receive, peer),
                                           name=f"hfreduce-recv{peer}", daemon=True) for peer in links]
        for thread in self._threads:
            thread.start()

    # -- from the leader's rank worker ------------------------------------------------------------------

    def on_start(self, op: RankOp, chunks: int) -> None:
        """A collective started on this node (every local rank posted it): remember its chunks."""
        record = _OpRecord(op.first_chunk, chunks, op.arith, op.count,
                           chunk_elements(op.arith, self.node.chunk_size_bytes), op.sequence)
        with self._lock:
            self._ops.append(record)
        self._check_departed()

    def _check_departed(self) -> None:
        """Fail a started collective that needs a node that has shut down (it completed fewer)."""
        with self._lock:
            if not self._departed or not self._ops:
                return
            pending = self._ops[-1].sequence
            gone = [(peer, completed) for peer, completed in self._departed.items() if completed <= pending]
        if gone:
            peer, completed = gone[0]
            self.node.poison(f"{self.describe_node(peer)} shut down its communicator after {completed} collectives; "
                             f"collective #{pending} needs it")
            self.node.raise_if_failed()

    def _info(self, g: int) -> ChunkInfo | None:
        with self._lock:
            for record in self._ops:
                if record.first <= g < record.first + record.chunks:
                    return record.info(g)
        return None

    # -- bookkeeping ----------------------------------------------------------------------------------

    def _mark_ready(self, g: int, bell: Doorbell) -> None:
        with self._lock:
            self._finished.add(g)
            while self._ready in self._finished:
                self._finished.discard(self._ready)
                self._ready += 1
            ready = self._ready
            while self._ops and self._ops[0].first + self._ops[0].chunks <= ready:
                self._ops.pop(0)
            # Stored under the lock: the two trees' threads mark chunks concurrently, and a store made
            # after the lock would let an older, smaller count overwrite a newer one (the ranks would
            # then wait for a chunk that is already final, until the timeout).
            self.node.control[self.node.segment.ready_at] = ready
        bell.ring()

    def _guard(self, target: Callable[[int], None], argument: int) -> None:
        try:
            target(argument)
        except HFReduceError:
            # Poisoned from elsewhere on this node (another local rank's process): tell the other nodes.
            message = self.node.error()
            if message is not None:
                self._abort_peers(message)
        except (OSError, ConnectionError) as exc:
            if not self.node.stopping and self.node.error() is None:
                peer = argument if target == self._receive else None
                where = f"the link to {self.describe_node(peer)}" if peer is not None else "a tree link"
                self.node.poison(f"{self.describe_node(self.node_index)} lost {where}: {exc} (a process on that "
                                 f"node exited, or the network failed)")
        except Exception as exc:
            self.node.poison(f"the network thread of {self.describe_node(self.node_index)} failed: {exc!r}")

    def _wait(self, bell: Doorbell, ready: Callable[[], bool], waiting_for: Callable[[], str],
              idle: Callable[[], bool] | None = None) -> None:
        """Sleep on the node's doorbell until ``ready()``, with the node's timeout.

        The timeout runs only while ``idle()`` is false: a tree thread waiting for a chunk of a
        collective this node has not started is waiting for the caller, not for a late peer (a job
        may pause between collectives for longer than the timeout).
        """
        since = time.monotonic()
        while True:
            seen = bell.read()
            if ready():
                return
            if self.node.stopping:
                raise HFReduceError("stopping")
            self.node.raise_if_failed()
            self.node.check_alive()
            self._check_departed()
            if idle is not None and idle():
                since = time.monotonic()
            elif time.monotonic() - since > self.node.timeout_s:
                self.node.poison(f"no progress for {self.node.timeout_s:g} s: {waiting_for()}")
                self.node.raise_if_failed()
            bell.wait(seen, _WAIT_SLICE_S)

    # -- combining (one thread per tree) ------------------------------------------------------------

    def _combine(self, tree_index: int) -> None:
        position = self.trees[tree_index]
        segment, slots = self.node.segment, self.node.slots
        bell = self.node.bell(_SIGNALLER_NETWORK + tree_index)
        children = [self._rings[(tree_index, child)] for child in position.children]
        g = tree_index
        while True:
            self._wait(bell, functools.partial(self._can_combine, g, children),
                       functools.partial(self._waiting_for_children, tree_index, g),
                       idle=functools.partial(self._not_started, g))
            info = self._info(g)
            assert info is not None
            acc = info.arith.accumulator
            nbytes = info.elements * acc.itemsize
            mine = segment.results[g % slots, :nbytes].view(acc)
            for child, ring in zip(position.children, children, strict=True):
                sequence, dtype, op, count, elements = ring.headers[g % slots]
                if (sequence, dtype, op, count, elements) != (info.sequence, info.arith.dtype, info.arith.op,
                                                              info.count, info.elements):
                    self.node.poison(
                        f"collective #{info.sequence} differs across nodes: {self.describe_node(self.node_index)} "
                        f"has {info.count} {info.arith.dtype.name.lower()} elements ({info.arith.op.name}), "
                        f"{info.elements} in chunk {g}; {self.describe_node(child)} sent {count} "
                        f"{_dtype_name(dtype)} elements ({_op_name(op)}), {elements} in that chunk, of "
                        f"collective #{sequence}")
                    self.node.raise_if_failed()
                info.arith.combine(mine, ring.buffers[g % slots, :nbytes].view(acc))
                ring.owner[g % slots] = None
                bell.ring()
            payload = segment.results[g % slots, :nbytes].data
            if position.parent is None:
                for child in position.children:
                    self.links[child].send(_DOWN, info, g, payload)
                self._mark_ready(g, bell)
            else:
                self.links[position.parent].send(_UP, info, g, payload)
            g += 2

    def _can_combine(self, g: int, children: list[_ChildRing]) -> bool:
        slot = g % self.node.slots
        return (self.node.is_reduced(g) and all(ring.owner[slot] == g for ring in children)
                and self._info(g) is not None)

    def _not_started(self, g: int) -> bool:
        """True while no collective that this node started covers chunk ``g`` (the node is idle)."""
        return self._info(g) is None

    def _slot_free(self, ring: _ChildRing, g: int) -> bool:
        return ring.owner[g % self.node.slots] is None

    def _slot_busy(self, peer: int, g: int) -> str:
        return (f"chunk {g - self.node.slots}: its partial from {self.describe_node(peer)} is still waiting "
                f"to be added")

    def _waiting_for_children(self, tree_index: int, g: int) -> str:
        if not self.node.is_reduced(g):
            return f"chunk {g}: waiting for {self.node.describe_rank(self.node.owner(g))} to reduce it"
        slots = self.node.slots
        late = [self.describe_node(child) for child in self.trees[tree_index].children
                if self._rings[(tree_index, child)].owner[g % slots] != g]
        return f"chunk {g}: waiting for the partial sums of {', '.join(late)}"

    # -- receiving (one thread per link) --------------------------------------------------------------

    def _receive(self, peer: int) -> None:
        link = self.links[peer]
        header = bytearray(_FRAME.size)
        slots = self.node.slots
        segment = self.node.segment
        # Ids 242.. by the peer's place among this leader's neighbours (at most 6 in two trees):
        # two threads ringing under one id could repeat a token a waiter already read.
        bell = self.node.bell(_SIGNALLER_NETWORK + 2 + sorted(self.links).index(peer))
        while True:
            link.recv_into(memoryview(header))
            kind, dtype, op, sequence, count, g, elements, nbytes = _FRAME.unpack(header)
            if kind == _BYE:
                # The peer shut down after `sequence` collectives: those still complete here (it
                # sent everything they need before); a later one that needs it fails at once.
                with self._lock:
                    self._departed[peer] = sequence
                bell.ring()
                self._check_departed()
                return
            if kind == _ABORT:
                if nbytes > _MAX_ABORT_MESSAGE:
                    raise ConnectionError(f"an abort message of {nbytes} bytes")
                message = bytearray(nbytes)
                link.recv_into(memoryview(message))
                self.node.poison(message.decode("utf-8", "replace"))
                return
            if nbytes > self.node.chunk_size_bytes:
                raise ConnectionError(f"a frame of {nbytes} bytes (chunks are at most {self.node.chunk_size_bytes})")
            tree_index = tree_for_chunk(g)
            position = self.trees[tree_index]
            if kind == _UP and peer in position.children:
                ring = self._rings[(tree_index, peer)]
                self._wait(bell, functools.partial(self._slot_free, ring, g),
                           functools.partial(self._slot_busy, peer, g))
                link.recv_into(ring.buffers[g % slots, :nbytes].data)
                ring.headers[g % slots] = (sequence, dtype, op, count, elements)
                ring.owner[g % slots] = g
                bell.ring()
            elif kind == _DOWN and peer == position.parent:
                info = self._info(g)
                if info is None or nbytes != info.elements * info.arith.accumulator_itemsize:
                    raise ConnectionError(f"an unexpected result for chunk {g} ({nbytes} bytes)")
                view = segment.results[g % slots, :nbytes].data
                link.recv_into(view)
                for child in position.children:
                    self.links[child].send(_DOWN, info, g, view)
                self._mark_ready(g, bell)
            else:
                raise ConnectionError(f"an unexpected frame (kind {kind}, chunk {g}) from {self.describe_node(peer)}")

    # -- failure ------------------------------------------------------------------------------------

    def _abort_peers(self, message: str) -> None:
        """Tell every linked node (they tell theirs), then close the links so no thread stays blocked."""
        encoded = message.encode("utf-8", "replace")[:_MAX_ABORT_MESSAGE]
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            # Made under the lock: close() must find the thread whose frames it waits for.
            self._abort_thread = threading.Thread(target=self._send_aborts, args=(encoded,),
                                                  name="hfreduce-abort", daemon=True)
            self._abort_thread.start()

    def _send_aborts(self, encoded: bytes) -> None:
        for link in self.links.values():
            if link.send_lock.acquire(timeout=1.0):
                try:
                    link.sock.settimeout(2.0)
                    link.sock.sendall(_FRAME.pack(_ABORT, 0, 0, 0, 0, 0, 0, len(encoded)) + encoded)
                except OSError:
                    pass
                finally:
                    link.send_lock.release()
        # Close gracefully: FIN after the abort, then read (and drop) what the peer still sends until it
        # closes too. Closing with unread bytes would send a reset, which can destroy the abort frame
        # before the peer reads it — it would then only see "connection reset".
        for link in self.links.values():
            with contextlib.suppress(OSError):
                link.sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + _DRAIN_S
        for link in self.links.values():
            with contextlib.suppress(OSError):
                while (remaining := deadline - time.monotonic()) > 0:
                    link.sock.settimeout(remaining)
                    if not link.sock.recv(1 << 16):
                        break
        self._close_links()

    def say_goodbye(self, completed: int) -> None:
        """An orderly shutdown after ``completed`` collectives. If the node failed, the peers learn
        why (the poisoning thread may not have told them yet); otherwise each gets a goodbye and
        keeps serving the collectives this node completed — it sent everything those need."""
        message = self.node.error()
        if message is not None:
            self._abort_peers(message)
            return
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        for link in self.links.values():
            if link.send_lock.acquire(timeout=1.0):
                try:
                    link.sock.settimeout(2.0)
                    link.sock.sendall(_FRAME.pack(_BYE, 0, 0, completed, 0, 0, 0, 0))
                except OSError:
                    pass
                finally:
                    link.send_lock.release()

    def close(self) -> None:
        """Close every link — after a pending abort has told the peers why (or they would only see EOF)."""
        with self._lock:
            sender = self._abort_thread
        if sender is not None and sender is not threading.current_thread():
            sender.join(timeout=_DRAIN_S + 3)
        self._close_links()

    def _close_links(self) -> None:
        for link in self.links.values():
            with contextlib.suppress(OSError):
                link.sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                link.sock.close()

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=10)

    def stats(self) -> dict[int, tuple[int, int]]:
        return {peer: (link.bytes_sent, link.bytes_received) for peer, link in self.links.items()}


def _dtype_name(code: int) -> str:
    try:
        return DType(code).name.lower()
    except ValueError:
        return f"dtype {code}"


def _op_name(code: int) -> str:
    try:
        return ReduceOp(code).name
    except ValueError:
        return f"op {code}"


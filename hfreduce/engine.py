"""The node's pipeline: ranks deposit chunks into shared memory, the leader reduces them, the leaders
allreduce the partials over a double binary tree, and every rank copies the result out.

Three kinds of threads, each moving chunks in global order (``g`` counts chunks over the job's life, so
every rank and node names a chunk the same way):

* :class:`RankWorker` — one per rank, in every rank's process. For each queued operation it posts a
  descriptor, deposits chunk ``g`` into its input slot ``g % slots`` once the reducer has emptied that
  slot, and copies chunk ``g`` out of result slot ``g % slots`` once the result is ready. It never
  waits for a whole tensor: copy-in of later chunks overlaps reduction and copy-out of earlier ones.
* :class:`Reducer` — in the leader's process. When every local rank has deposited chunk ``g`` (and
  has copied out chunk ``g - slots``, whose result slot ``g`` reuses), it reduces the inputs in
  local-rank order into the result slot. With one node that is the result; otherwise the partial goes
  to the network.
* :class:`Network` — in the leader's process: per tree, a combiner adds the children's partials of
  its chunks (in child order) to the node's own and sends the sum to the parent; the root's sum is
  final and goes down the tree; a receiver per peer link reads frames into preallocated buffers
  (children's partials) or straight into the result slot (the final, from the parent) and forwards
  finals to the children. Even chunks ride tree A, odd chunks tree B.

Shared-memory counters only grow: ``deposited[r]`` and ``collected[r]`` (per local rank), ``reduced``
and ``ready`` (the leader's). A doorbell per direction wakes the other side.

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
from hfreduce.kernels import Arithmetic, DType, ReduceOp, arithmetic
from hfreduce.shm import DESCRIPTOR_WORDS, NodeSegment, process_start_time
from hfreduce.tree import TreePosition, tree_for_chunk

log = logging.getLogger(__name__)

__all__ = ["Network", "OpKind", "PeerLink", "RankOp", "RankWorker", "Reducer", "Work"]

# How long one wait sleeps before it re-checks liveness and its deadline.
_WAIT_SLICE_S = 0.05
_MAX_QUEUED_OPS = 4096

# Frame header on the leaders' links: kind, dtype, op, pad, op sequence, global chunk, elements, bytes.
_FRAME = struct.Struct("!BBBxQQQQ")
_UP, _DOWN, _ABORT = 1, 2, 3
_MAX_ABORT_MESSAGE = 4096
# How long an aborting node waits for its peers to close their ends after the abort frame.
_DRAIN_S = 2.0


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

    ``deposit(start, end, slot)`` fills ``slot`` (storage dtype, ``end - start`` long) with this rank's
    contribution; ``collect(start, end, result)`` takes the final values (accumulator dtype) it wants.
    """

    kind: int
    arith: Arithmetic
    count: int
    root: int
    deposit: Callable[[int, int, np.ndarray], None]
    collect: Callable[[int, int, np.ndarray], None]
    work: Work
    keepalive: tuple[object, ...] = ()
    finish: Callable[[], None] | None = None
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
    """What every thread of one process shares about its node: segment, doorbells, poison."""

    def __init__(self, segment: NodeSegment, local_rank: int, timeout_s: float, describe_rank: Callable[[int], str]):
        self.segment = segment
        self.local_rank = local_rank
        self.timeout_s = timeout_s
        self.describe_rank = describe_rank
        self.slots = segment.shape.slots
        self.chunk_size_bytes = segment.shape.chunk_size_bytes
        self.local_world_size = segment.shape.local_world_size
        self.control = segment.control
        # Signaller ids: local ranks 0..L-1 from their rank workers, 200 and 201 from the leader's threads.
        self.leader_bell = Doorbell(segment.leader_bell_word, local_rank)
        self.ranks_bell = Doorbell(segment.ranks_bell_word, local_rank)
        self.stopping = False
        self._next_liveness_check = 0.0
        self._poison_hooks: list[Callable[[str, bool], None]] = []
        self._poison_lock = threading.Lock()

    def on_poison(self, hook: Callable[[str, bool], None]) -> None:
        self._poison_hooks.append(hook)

    def error(self) -> str | None:
        return self.segment.error()

    def poison(self, message: str, *, expected: bool = False) -> None:
        """Fail the node: every local rank's operations raise ``message`` (the first error wins).

        ``expected`` marks an orderly end (a peer shut down), which is not logged as an error.
        """
        with self._poison_lock:
            first = self.segment.error() is None
            self.segment.set_error(message, expected)
        self.leader_bell.ring()
        self.ranks_bell.ring()
        if first:
            log.log(logging.INFO if expected else logging.ERROR, "hfreduce: %s", message)
            for hook in self._poison_hooks:
                hook(message, expected)

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

    def check_alive(self, local_ranks: list[int]) -> None:
        """Poison the node if a local rank's process is gone (at most every wait slice: it reads /proc)."""
        now = time.monotonic()
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + _WAIT_SLICE_S
        for local_rank in local_ranks:
            pid, start = self.registered(local_rank)
            if pid and not process_alive(pid, start):
                self.poison(f"{self.describe_rank(local_rank)} (pid {pid}) exited")
                self.raise_if_failed()

    def register_self(self) -> None:
        pid = os.getpid()
        start = process_start_time(pid) or 0
        self.control[self.segment.pid_at(self.local_rank)] = (start << 32) | pid


class RankWorker:
    """This rank's queue of collectives, worked through in order by one thread (see module doc)."""

    def __init__(self, node: NodeState) -> None:
        self.node = node
        self._queue: queue.Queue[RankOp | None] = queue.Queue(_MAX_QUEUED_OPS)
        self._next_chunk = 0
        self._sequence = 0
        self._thread = threading.Thread(target=self._run, name="hfreduce-rank", daemon=True)
        self._thread.start()

    def submit(self, op: RankOp) -> None:
        self._queue.put(op)

    def stop(self) -> None:
        self.node.stopping = True
        self.node.ranks_bell.ring()
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

    def _execute(self, op: RankOp) -> None:
        node, control, segment = self.node, self.node.control, self.node.segment
        me = node.local_rank
        per_chunk = chunk_elements(op.arith, node.chunk_size_bytes)
        chunks = op.chunk_count(per_chunk)
        first = self._next_chunk
        op.sequence, op.first_chunk = self._sequence, first
        ring = segment.shape.descriptor_ring
        descriptor = segment.descriptors[me, self._sequence % ring]
        descriptor[1:DESCRIPTOR_WORDS] = (op.arith.dtype, op.arith.op, op.count, op.kind, op.root, first, 0)
        descriptor[0] = self._sequence + 1
        node.leader_bell.ring()
        deposited = collected = 0
        slots = node.slots
        storage, accumulator = op.arith.storage, op.arith.accumulator
        last_progress = time.monotonic()
        while collected < chunks:
            seen = node.ranks_bell.read()
            progressed = False
            while deposited < chunks and int(control[segment.reduced_at]) >= first + deposited - slots + 1:
                g = first + deposited
                start = deposited * per_chunk
                end = min(start + per_chunk, op.count)
                slot = segment.inputs[me, g % slots, :(end - start) * storage.itemsize].view(storage)
                op.deposit(start, end, slot)
                deposited += 1
                control[segment.deposited_at(me)] = g + 1
                progressed = True
            while collected < deposited and int(control[segment.ready_at]) >= first + collected + 1:
                g = first + collected
                start = collected * per_chunk
                end = min(start + per_chunk, op.count)
                result = segment.results[g % slots, :(end - start) * accumulator.itemsize].view(accumulator)
                op.collect(start, end, result)
                collected += 1
                control[segment.collected_at(me)] = g + 1
                progressed = True
            if progressed:
                node.leader_bell.ring()
                last_progress = time.monotonic()
                continue
            node.raise_if_failed()
            if time.monotonic() - last_progress > node.timeout_s:
                node.poison(f"{node.describe_rank(me)}: no progress for {node.timeout_s:g} s in collective "
                            f"#{self._sequence} (chunk {first + deposited if deposited < chunks else first + collected}"
                            f"): a rank or node stopped taking part or hangs")
                node.raise_if_failed()
            node.check_alive([0] if me else [])
            node.ranks_bell.wait(seen, _WAIT_SLICE_S)
        self._next_chunk = first + chunks
        self._sequence += 1


@dataclass(slots=True)
class ChunkInfo:
    """What the leader's threads need to know about one global chunk after it was reduced locally."""

    arith: Arithmetic
    elements: int
    sequence: int


class Reducer:
    """The leader's thread that reduces local ranks' deposits (see module doc)."""

    def __init__(self, node: NodeState, on_reduced: Callable[[int, ChunkInfo], None] | None) -> None:
        self.node = node
        self.on_reduced = on_reduced  # None: a single-node job, the local sum is the result
        self.bell = Doorbell(node.segment.leader_bell_word, 200)
        self.ranks_bell = Doorbell(node.segment.ranks_bell_word, 200)
        self._scratch = np.empty(node.chunk_size_bytes // 4, dtype=np.float32)
        self._thread = threading.Thread(target=self._run, name="hfreduce-reducer", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            self._loop()
        except HFReduceError:
            pass
        except Exception as exc:
            self.node.poison(f"the reducer of {self.node.describe_rank(0)} failed: {exc!r}")

    def _wait(self, ready: Callable[[], bool], waiting_for: Callable[[], str], pending: Callable[[], bool]) -> None:
        """Sleep on the leader doorbell until ``ready()``; time out only while work is ``pending()``."""
        node = self.node
        since = time.monotonic()
        everyone = list(range(1, node.local_world_size))
        while True:
            seen = self.bell.read()
            if ready():
                return
            if node.stopping:
                raise HFReduceError("stopping")
            node.raise_if_failed()
            node.check_alive(everyone)
            if not pending():
                since = time.monotonic()
            elif time.monotonic() - since > node.timeout_s:
                node.poison(f"no progress for {node.timeout_s:g} s: {waiting_for()}")
                node.raise_if_failed()
            self.bell.wait(seen, _WAIT_SLICE_S)

    def _posted(self, sequence: int) -> list[int]:
        """Local ranks that have started collective ``sequence`` (posted its descriptor)."""
        column = self.node.segment.descriptors[:, sequence % self.node.segment.shape.descriptor_ring, 0]
        return [r for r in range(self.node.local_world_size) if int(column[r]) == sequence + 1]

    def _all_posted(self, sequence: int) -> bool:
        return len(self._posted(sequence)) == self.node.local_world_size

    def _any_posted(self, sequence: int) -> bool:
        return bool(self._posted(sequence))

    def _not_started(self, sequence: int) -> str:
        posted = self._posted(sequence)
        late = [self.node.describe_rank(r) for r in range(self.node.local_world_size) if r not in posted]
        return f"collective #{sequence}: waiting for {', '.join(late)} to start it"

    def _chunk_can_start(self, g: int) -> bool:
        """Every local rank deposited chunk g, and copied out chunk g - slots (its result slot)."""
        control = self.node.control
        return (int(control[self._deposited].min()) > g
                and int(control[self._collected].min()) >= g - self.node.slots + 1)

    def _chunk_lagging(self, g: int) -> str:
        node, control = self.node, self.node.control
        ranks = range(node.local_world_size)
        late = [node.describe_rank(r) for r in ranks if int(control[self._deposited[r]]) <= g]
        if late:
            return f"chunk {g}: waiting for {', '.join(late)} to deposit it"
        late = [node.describe_rank(r) for r in ranks if int(control[self._collected[r]]) < g - node.slots + 1]
        return f"chunk {g}: waiting for {', '.join(late)} to copy out chunk {g - node.slots}"

    def _loop(self) -> None:
        node, control, segment = self.node, self.node.control, self.node.segment
        ranks = range(node.local_world_size)
        self._deposited = np.array([segment.deposited_at(r) for r in ranks])
        self._collected = np.array([segment.collected_at(r) for r in ranks])
        ring = segment.shape.descriptor_ring
        slots = node.slots
        sequence = 0
        g = 0
        while True:
            self._wait(functools.partial(self._all_posted, sequence), functools.partial(self._not_started, sequence),
                       functools.partial(self._any_posted, sequence))
            descriptors = segment.descriptors[:, sequence % ring]
            words = descriptors[0].copy()
            for r in ranks:
                if not np.array_equal(descriptors[r, 1:], words[1:]):
                    node.poison(f"collective #{sequence} differs across ranks: {node.describe_rank(0)} called "
                                f"{_describe(words)}, {node.describe_rank(r)} called {_describe(descriptors[r])}")
                    node.raise_if_failed()
            arith = arithmetic(DType(int(words[1])), ReduceOp(int(words[2])))
            count = int(words[3])
            per_chunk = chunk_elements(arith, node.chunk_size_bytes)
            chunks = max(1, -(-count // per_chunk))
            storage, accumulator = arith.storage, arith.accumulator
            for index in range(chunks):
                elements = max(0, min(per_chunk, count - index * per_chunk))
                self._wait(functools.partial(self._chunk_can_start, g), functools.partial(self._chunk_lagging, g),
                           _always)
                inputs = [segment.inputs[r, g % slots, :elements * storage.itemsize].view(storage) for r in ranks]
                out = segment.results[g % slots, :elements * accumulator.itemsize].view(accumulator)
                arith.reduce(inputs, out, self._scratch)
                control[segment.reduced_at] = g + 1
                if self.on_reduced is None:
                    control[segment.ready_at] = g + 1
                else:
                    self.on_reduced(g, ChunkInfo(arith, elements, sequence))
                self.ranks_bell.ring()
                g += 1
            sequence += 1


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
        sequence = elements = 0
        if info is not None:
            dtype, op, elements, sequence = info.arith.dtype, info.arith.op, info.elements, info.sequence
        header = _FRAME.pack(kind, dtype, op, sequence, g, elements, len(payload))
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
    headers: list[tuple[int, int, int, int]] = field(default_factory=list)


class Network:
    """The leader's inter-node stage over the double binary tree (see module doc)."""

    def __init__(self, node: NodeState, node_index: int, trees: tuple[TreePosition, TreePosition],
                 links: dict[int, PeerLink], describe_node: Callable[[int], str]) -> None:
        self.node = node
        self.node_index = node_index
        self.trees = trees
        self.links = links
        self.describe_node = describe_node
        self.ranks_bell = Doorbell(node.segment.ranks_bell_word, 201)
        slots = node.slots
        self._cond = threading.Condition()
        self._infos: dict[int, ChunkInfo] = {}
        self._local_done = -1  # highest chunk reduced locally (they arrive in order)
        self._finished: set[int] = set()
        self._ready = 0
        self._rings: dict[tuple[int, int], _ChildRing] = {}
        for tree_index, position in enumerate(trees):
            for child in position.children:
                self._rings[(tree_index, child)] = _ChildRing(
                    np.zeros((slots, node.chunk_size_bytes), dtype=np.uint8), [None] * slots, [(0, 0, 0, 0)] * slots)
        self._aborted = False
        self._abort_thread: threading.Thread | None = None
        node.on_poison(self._abort_peers)
        self._threads = [threading.Thread(target=self._guard, args=(self._combine, tree_index),
                                          name=f"hfreduce-tree{tree_index}", daemon=True) for tree_index in (0, 1)]
        self._threads += [threading.Thread(target=self._guard, args=(self._receive, peer),
                                           name=f"hfreduce-recv{peer}", daemon=True) for peer in links]
        for thread in self._threads:
            thread.start()

    # -- from the reducer ---------------------------------------------------------------------------

    def on_reduced(self, g: int, info: ChunkInfo) -> None:
        with self._cond:
            self._infos[g] = info
            self._local_done = g
            self._cond.notify_all()

    # -- bookkeeping ----------------------------------------------------------------------------------

    def _mark_ready(self, g: int) -> None:
        with self._cond:
            self._finished.add(g)
            self._infos.pop(g, None)
            while self._ready in self._finished:
                self._finished.discard(self._ready)
                self._ready += 1
            ready = self._ready
        self.node.control[self.node.segment.ready_at] = ready
        self.ranks_bell.ring()

    def _guard(self, target: Callable[[int], None], argument: int) -> None:
        try:
            target(argument)
        except HFReduceError:
            # Poisoned from elsewhere on this node (another local rank's process): tell the other nodes.
            message = self.node.error()
            if message is not None:
                self._abort_peers(message, self.node.segment.error_expected())
        except (OSError, ConnectionError) as exc:
            if not self.node.stopping and self.node.error() is None:
                peer = argument if target == self._receive else None
                where = f"the link to {self.describe_node(peer)}" if peer is not None else "a tree link"
                self.node.poison(f"{self.describe_node(self.node_index)} lost {where}: {exc} (a process on that "
                                 f"node exited, or the network failed)")
        except Exception as exc:
            self.node.poison(f"the network thread of {self.describe_node(self.node_index)} failed: {exc!r}")

    def _wait(self, ready: Callable[[], bool], waiting_for: Callable[[], str]) -> None:
        """Wait on the condition (held by the caller) until ``ready()``, with the node's timeout."""
        since = time.monotonic()
        while not ready():
            if self.node.stopping:
                raise HFReduceError("stopping")
            self.node.raise_if_failed()
            if time.monotonic() - since > self.node.timeout_s:
                message = f"no progress for {self.node.timeout_s:g} s: {waiting_for()}"
                self._cond.release()
                try:
                    self.node.poison(message)
                finally:
                    self._cond.acquire()
                self.node.raise_if_failed()
            self._cond.wait(_WAIT_SLICE_S)

    # -- combining (one thread per tree) ------------------------------------------------------------

    def _combine(self, tree_index: int) -> None:
        position = self.trees[tree_index]
        segment, slots = self.node.segment, self.node.slots
        g = tree_index
        while True:
            children = [self._rings[(tree_index, child)] for child in position.children]
            with self._cond:
                self._wait(functools.partial(self._can_combine, g, children),
                           functools.partial(self._waiting_for_children, tree_index, g))
                info = self._infos[g]
            acc = info.arith.accumulator
            nbytes = info.elements * acc.itemsize
            mine = segment.results[g % slots, :nbytes].view(acc)
            for child, ring in zip(position.children, children, strict=True):
                sequence, dtype, op, elements = ring.headers[g % slots]
                if (sequence, dtype, op, elements) != (info.sequence, info.arith.dtype, info.arith.op, info.elements):
                    self.node.poison(
                        f"collective #{info.sequence} differs across nodes: {self.describe_node(self.node_index)} "
                        f"has {info.elements} {info.arith.dtype.name.lower()} elements ({info.arith.op.name}) in "
                        f"chunk {g}, {self.describe_node(child)} sent {elements} "
                        f"{_dtype_name(dtype)} elements ({_op_name(op)}) of collective #{sequence}")
                    self.node.raise_if_failed()
                info.arith.combine(mine, ring.buffers[g % slots, :nbytes].view(acc))
                with self._cond:
                    ring.owner[g % slots] = None
                    self._cond.notify_all()
            payload = segment.results[g % slots, :nbytes].data
            if position.parent is None:
                for child in position.children:
                    self.links[child].send(_DOWN, info, g, payload)
                self._mark_ready(g)
            else:
                self.links[position.parent].send(_UP, info, g, payload)
            g += 2

    def _can_combine(self, g: int, children: list[_ChildRing]) -> bool:
        slot = g % self.node.slots
        return self._local_done >= g and all(ring.owner[slot] == g for ring in children)

    def _slot_free(self, ring: _ChildRing, g: int) -> bool:
        return ring.owner[g % self.node.slots] is None

    def _slot_busy(self, peer: int, g: int) -> str:
        return (f"chunk {g - self.node.slots}: its partial from {self.describe_node(peer)} is still waiting "
                f"to be added")

    def _waiting_for_children(self, tree_index: int, g: int) -> str:
        if self._local_done < g:
            return f"chunk {g}: waiting for this node's ranks"
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
        while True:
            link.recv_into(memoryview(header))
            kind, dtype, op, sequence, g, elements, nbytes = _FRAME.unpack(header)
            if kind == _ABORT:
                if nbytes > _MAX_ABORT_MESSAGE:
                    raise ConnectionError(f"an abort message of {nbytes} bytes")
                message = bytearray(nbytes)
                link.recv_into(memoryview(message))
                self.node.poison(message.decode("utf-8", "replace"), expected=bool(dtype))
                return
            if nbytes > self.node.chunk_size_bytes:
                raise ConnectionError(f"a frame of {nbytes} bytes (chunks are at most {self.node.chunk_size_bytes})")
            tree_index = tree_for_chunk(g)
            position = self.trees[tree_index]
            if kind == _UP and peer in position.children:
                ring = self._rings[(tree_index, peer)]
                with self._cond:
                    self._wait(functools.partial(self._slot_free, ring, g), functools.partial(self._slot_busy, peer, g))
                link.recv_into(ring.buffers[g % slots, :nbytes].data)
                with self._cond:
                    ring.headers[g % slots] = (sequence, dtype, op, elements)
                    ring.owner[g % slots] = g
                    self._cond.notify_all()
            elif kind == _DOWN and peer == position.parent:
                with self._cond:
                    info = self._infos.get(g)
                if info is None or nbytes != info.elements * info.arith.accumulator_itemsize:
                    raise ConnectionError(f"an unexpected result for chunk {g} ({nbytes} bytes)")
                view = segment.results[g % slots, :nbytes].data
                link.recv_into(view)
                for child in position.children:
                    self.links[child].send(_DOWN, info, g, view)
                self._mark_ready(g)
            else:
                raise ConnectionError(f"an unexpected frame (kind {kind}, chunk {g}) from {self.describe_node(peer)}")

    # -- failure ------------------------------------------------------------------------------------

    def _abort_peers(self, message: str, expected: bool = False) -> None:
        """Tell every linked node (they tell theirs), then close the links so no thread stays blocked."""
        encoded = message.encode("utf-8", "replace")[:_MAX_ABORT_MESSAGE]
        with self._cond:
            if self._aborted:
                return
            self._aborted = True
            # Made under the lock: close() must find the thread whose frames it waits for.
            self._abort_thread = threading.Thread(target=self._send_aborts, args=(encoded, expected),
                                                  name="hfreduce-abort", daemon=True)
            self._abort_thread.start()

    def _send_aborts(self, encoded: bytes, expected: bool) -> None:
        for link in self.links.values():
            if link.send_lock.acquire(timeout=1.0):
                try:
                    link.sock.settimeout(2.0)
                    link.sock.sendall(_FRAME.pack(_ABORT, int(expected), 0, 0, 0, 0, len(encoded)) + encoded)
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

    def say_goodbye(self) -> None:
        """Tell the peers this node is leaving and why: the node's error if it failed (the poisoning
        thread may not have told them yet), else an orderly shutdown."""
        message = self.node.error()
        if message is None:
            message = f"{self.describe_node(self.node_index)} shut down its communicator"
            self._abort_peers(message, True)
        else:
            self._abort_peers(message, self.node.segment.error_expected())

    def close(self) -> None:
        """Close every link — after a pending abort has told the peers why (or they would only see EOF)."""
        with self._cond:
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
        with self._cond:
            self._cond.notify_all()

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=10)

    def stats(self) -> dict[int, tuple[int, int]]:
        return {peer: (link.bytes_sent, link.bytes_received) for peer, link in self.links.items()}


def _always() -> bool:
    return True


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


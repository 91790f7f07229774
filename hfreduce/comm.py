"""The communicator: rendezvous, shared memory, links between node leaders, and the collectives.

``Communicator(...)`` is what ``hfreduce.init`` makes; every collective goes through the rank's
:class:`~hfreduce.engine.RankWorker` and returns a :class:`~hfreduce.engine.Work`. Collectives must be
called in the same order with matching arguments on every rank (as with any collective library);
a disagreement is detected and fails every rank with a message naming both sides.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import selectors
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hfreduce.buffers import FlatBuffer, as_buffer
from hfreduce.engine import MAX_LOCAL_WORLD_SIZE, Network, NodeState, OpKind, PeerLink, RankOp, RankWorker, Work
from hfreduce.errors import HFReduceError, HFReduceTimeout, InvalidArgument
from hfreduce.kernels import Arithmetic, ReduceOp, arithmetic, bits_dtype
from hfreduce.rendezvous import Layout, RankInfo, check_local_environment, default_node_key, exchange, group_ranks
from hfreduce.shm import NodeSegment, SegmentShape, SharedBuffer, buffer_name, remove_stale_segments, segment_name
from hfreduce.store import KeyValueStore, StoreClient, StoreServer
from hfreduce.tree import double_binary_tree

__all__ = ["Communicator"]

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_CHUNK_SIZE_BYTES = 1 << 20
DEFAULT_SLOTS = 8
_MIN_CHUNK_BYTES = 4096
_MAX_CHUNK_BYTES = 256 << 20
_MAX_SLOTS = 64
_HELLO = struct.Struct("!12sI")
_MAX_SHARED_BYTES = 64 << 30
# Connections to a leader's link port whose hello is not complete yet (strangers included).
_MAX_PENDING_HELLOS = 64

_live: weakref.WeakSet[Communicator] = weakref.WeakSet()


def _env_int(name: str, given: int | None, required: bool) -> int | None:
    if given is not None:
        return given
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if required:
            raise InvalidArgument(f"{name} is not set: pass it as an argument or set the environment variable "
                                  f"(torch's launcher conventions)")
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(f"{name}={raw!r} is not an integer") from None


def _route_address(host: str, port: int) -> str:
    """The local address the kernel would use to reach ``host`` (a connected UDP socket sends nothing)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as exc:
        raise InvalidArgument(f"MASTER_ADDR {host!r} does not resolve: {exc.strerror}") from exc
    with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
        probe.connect(family[4])
        return str(probe.getsockname()[0])


class Communicator:
    """A group of ``world_size`` ranks doing collectives together (see the module doc)."""

    def __init__(self, *, rank: int | None = None, world_size: int | None = None, master_addr: str | None = None,
                 master_port: int | None = None, node: str | None = None, local_rank: int | None = None,
                 local_world_size: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES, slots: int = DEFAULT_SLOTS,
                 store: KeyValueStore | None = None, prefix: str = "hfreduce", launcher_env: bool = True) -> None:
        """``launcher_env=False``: ignore LOCAL_RANK/LOCAL_WORLD_SIZE (a subgroup of the launched job:
        the launcher numbered the job's ranks per node, not the subgroup's)."""
        self.rank = _env_int("RANK", rank, True) or 0
        self.world_size = _env_int("WORLD_SIZE", world_size, True) or 0
        if self.world_size < 1:
            raise InvalidArgument(f"world size must be at least 1, not {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgument(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be positive, not {timeout_s}")
        if not _MIN_CHUNK_BYTES <= chunk_size_bytes <= _MAX_CHUNK_BYTES or chunk_size_bytes % 64:
            raise InvalidArgument(f"chunk_size_bytes must be a multiple of 64 in {_MIN_CHUNK_BYTES}.."
                                  f"{_MAX_CHUNK_BYTES}, not {chunk_size_bytes}")
        if not 2 <= slots <= _MAX_SLOTS or slots % 2:
            raise InvalidArgument(f"slots must be even, in 2..{_MAX_SLOTS}, not {slots}")
        env_local_rank = _env_int("LOCAL_RANK", local_rank, False) if launcher_env else local_rank
        env_local_size = _env_int("LOCAL_WORLD_SIZE", local_world_size, False) if launcher_env else local_world_size
        self.timeout_s = float(timeout_s)
        self.chunk_size_bytes = chunk_size_bytes
        self.slots = slots
        self._closed = False
        self._lock = threading.Lock()
        self._server: StoreServer | None = None
        self._client: StoreClient | None = None
        self.network: Network | None = None
        self.segment: NodeSegment | None = None
        self._regions: list[_Region] = []
        try:
            if store is None:
                host = master_addr or os.environ.get("MASTER_ADDR") or ""
                if not host:
                    raise InvalidArgument("MASTER_ADDR is not set: pass master_addr= or set the environment variable")
                port = _env_int("MASTER_PORT", master_port, True) or 0
                if not 0 < port < 65536:
                    raise InvalidArgument(f"MASTER_PORT {port} is not a TCP port")
                if self.rank == 0:
                    self._server = StoreServer(host, port)
                self._client = StoreClient(host, port, self.timeout_s)
                store = self._client
                address = self._client.local_address()
            else:
                host = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
                address = _route_address(host, int(os.environ.get("MASTER_PORT") or 29500))
            self._store = store
            self._setup(store, prefix, node or default_node_key(), address, env_local_rank, env_local_size)
        except BaseException:
            self._teardown()
            raise
        _live.add(self)

    # -- start ----------------------------------------------------------------------------------------

    def _setup(self, store: KeyValueStore, prefix: str, node_key: str, address: str, env_local_rank: int | None,
               env_local_size: int | None) -> None:
        timeout_s = self.timeout_s
        # A store can outlive a communicator (torch reuses group names after destroy_process_group):
        # each start counts its joins, so the W ranks of one start read that start's keys, never a
        # previous one's.
        incarnation = (store.add(f"{prefix}/joins", 1) - 1) // self.world_size
        prefix = f"{prefix}/{incarnation}"
        if self.rank == 0:
            store.set(f"{prefix}/job", secrets.token_hex(6).encode())
        self.job_id = store.get(f"{prefix}/job", timeout_s).decode()
        prefix = f"{prefix}/{self.job_id}"
        settings = f"{self.world_size}:{self.chunk_size_bytes}:{self.slots}"
        me = RankInfo(self.rank, f"{node_key}#{settings}", os.getpid(), address)
        infos = exchange(store, prefix, me, self.world_size, timeout_s)
        for info in infos:
            if not info.node_key.endswith(f"#{settings}"):
                theirs = info.node_key.rsplit("#", 1)[-1]
                raise InvalidArgument(f"rank {info.rank} started with world size, chunk size and slots {theirs}, "
                                      f"this rank with {settings}: every rank must pass the same")
        self.layout: Layout = group_ranks(infos)
        check_local_environment(self.layout, self.rank, env_local_rank, env_local_size)
        self.infos = infos
        self.node_index = self.layout.node_of(self.rank)
        self.node_count = len(self.layout.nodes)
        self.local_rank = self.layout.local_rank(self.rank)
        self.local_world_size = len(self.layout.nodes[self.node_index])
        if self.local_world_size > MAX_LOCAL_WORLD_SIZE:
            raise InvalidArgument(f"{self.local_world_size} ranks on one node (at most {MAX_LOCAL_WORLD_SIZE})")
        shape = SegmentShape(self.local_world_size, self.slots, self.chunk_size_bytes, self.slots + 2)
        node_prefix = f"{prefix}/node/{self.node_index}"
        listener: socket.socket | None = None
        try:
            if self.local_rank == 0:
                remove_stale_segments()
                self.segment = NodeSegment.create(segment_name(self.job_id, self.node_index, os.getpid()), shape)
                if self.node_count > 1:
                    listener = socket.create_server((address, 0), backlog=64)
                port = listener.getsockname()[1] if listener is not None else 0
                store.set(node_prefix, json.dumps([self.segment.name, port]).encode())
                if self.local_world_size > 1:
                    store.get(f"{node_prefix}/attached", timeout_s)
                self.segment.unlink()  # every local rank maps it: nothing is left behind after any exit
            else:
                name, _ = json.loads(store.get(node_prefix, timeout_s))
                self.segment = NodeSegment.attach(str(name), shape)
                if store.add(f"{node_prefix}/attach-count", 1) == self.local_world_size - 1:
                    store.set(f"{node_prefix}/attached", b"1")
            self.node = NodeState(self.segment, self.local_rank, timeout_s, self._describe_rank)
            self.node.register_self()
            links: dict[int, PeerLink] = {}
            if self.local_rank == 0 and self.node_count > 1:
                assert listener is not None
                links = self._connect(store, prefix, listener)
            self._barrier(store, f"{prefix}/ready")
        finally:
            if listener is not None:
                listener.close()
        self.node.multi_node = self.node_count > 1
        if self.local_rank == 0 and self.node_count > 1:
            trees = double_binary_tree(self.node_count, self.node_index)
            self.network = Network(self.node, self.node_index, trees, links, self._describe_node)
        self.worker = RankWorker(self.node, self.network.on_start if self.network is not None else None)
        if self._client is not None:
            # The store serves only the start; rank 0 keeps listening until shutdown so that no rank
            # still reading its last reply loses it.
            self._client.close()
            self._client = None

    def _barrier(self, store: KeyValueStore, key: str) -> None:
        if store.add(f"{key}/count", 1) == self.world_size:
            store.set(key, b"1")
        store.get(key, self.timeout_s)

    def _connect(self, store: KeyValueStore, prefix: str, listener: socket.socket) -> dict[int, PeerLink]:
        """Link this leader with its tree neighbours: the lower node index dials the higher."""
        first, second = double_binary_tree(self.node_count, self.node_index)
        neighbours = {peer for position in (first, second)
                      for peer in ((position.parent,) if position.parent is not None else ()) + position.children}
        links: dict[int, PeerLink] = {}
        job = bytes.fromhex(self.job_id).ljust(12, b"\0")
        for peer in sorted(p for p in neighbours if p > self.node_index):
            _, port = json.loads(store.get(f"{prefix}/node/{peer}", self.timeout_s))
            host = self.infos[self.layout.leader(peer)].address
            try:
                sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            except OSError as exc:
                raise HFReduceError(f"cannot reach {self._describe_node(peer)} at {host}:{port}: "
                                    f"{exc.strerror or exc}") from exc
            sock.sendall(_HELLO.pack(job, self.node_index))
            links[peer] = self._link(peer, sock)
        expected = {p for p in neighbours if p < self.node_index}
        self._accept_peers(listener, job, expected, links)
        return links

    def _accept_peers(self, listener: socket.socket, job: bytes, expected: set[int],
                      links: dict[int, PeerLink]) -> None:
        """Accept the lower-indexed neighbours, reading every connection's hello at once.

        One connection at a time would let a stranger that connects and sends a few bytes (a port
        scanner) hold the loop for the whole timeout while the real peers wait and give up; here a
        stranger holds only its own place among at most ``_MAX_PENDING_HELLOS`` unfinished hellos
        (the oldest is dropped for a newcomer).
        """
        deadline = time.monotonic() + self.timeout_s
        pending: dict[socket.socket, bytearray] = {}
        listener.setblocking(False)
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            try:
                while expected - links.keys():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        missing = ", ".join(self._describe_node(p) for p in sorted(expected - links.keys()))
                        raise HFReduceTimeout(f"{missing} did not connect within {self.timeout_s:g} s")
                    for key, _ in selector.select(remaining):
                        if key.fileobj is listener:
                            try:
                                sock, _ = listener.accept()
                            except (BlockingIOError, InterruptedError):
                                continue
                            if len(pending) >= _MAX_PENDING_HELLOS:
                                oldest = next(iter(pending))
                                selector.unregister(oldest)
                                del pending[oldest]
                                oldest.close()
                            sock.setblocking(False)
                            pending[sock] = bytearray()
                            selector.register(sock, selectors.EVENT_READ)
                            continue
                        sock = key.fileobj  # type: ignore[assignment]
                        received = pending[sock]
                        try:
                            data = sock.recv(_HELLO.size - len(received))
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError:
                            data = b""
                        received += data
                        if data and len(received) < _HELLO.size:
                            continue
                        selector.unregister(sock)
                        del pending[sock]
                        if not data:
                            sock.close()
                            continue
                        got_job, peer = _HELLO.unpack(bytes(received))
                        if got_job != job or peer not in expected or peer in links:
                            sock.close()  # a stray or stale connection: not one of ours
                            continue
                        sock.setblocking(True)
                        links[peer] = self._link(peer, sock)
            finally:
                for sock in pending:
                    sock.close()

    def _link(self, peer: int, sock: socket.socket) -> PeerLink:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)
        return PeerLink(peer, sock, self._describe_node(peer))

    def _describe_rank(self, local_rank: int) -> str:
        rank = self.layout.nodes[self.node_index][local_rank]
        return f"rank {rank} (node {self.node_index}, local rank {local_rank})"

    def _describe_node(self, node: int) -> str:
        ranks = self.layout.nodes[node]
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}..{ranks[-1]}"
        return f"node {node} ({span}, {self.infos[ranks[0]].address})"

    # -- collectives ----------------------------------------------------------------------------------

    def _submit(self, op: RankOp, async_op: bool) -> Work:
        with self._lock:
            if self._closed:
                raise HFReduceError("the communicator was shut down")
            self.worker.submit(op)
        if not async_op:
            op.work.wait()
        return op.work

    def allreduce(self, tensor: Any, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Work:
        """Reduce ``tensor`` over all ranks in place (SUM, AVG, MAX, MIN)."""
        buffer = as_buffer(tensor, writable=True, what="allreduce")
        arith = arithmetic(buffer.dtype, _public_op(op))
        flat = buffer.array

        def contribution(start: int, end: int, scratch: np.ndarray) -> np.ndarray:
            return flat[start:end]

        def collect(start: int, end: int, result: np.ndarray) -> None:
            arith.collect(result, flat[start:end], self.world_size)

        rank_op = self._op(OpKind.ALLREDUCE, arith, buffer.count, 0, contribution, collect, buffer,
                           f"allreduce({arith.op.name})", buffer)
        located = self._locate(flat) if buffer.finish is None else None
        if located is not None:
            region, offset, views = located
            rank_op.shared = (region, offset)
            rank_op.peer_arrays = [view.view(flat.dtype) for view in views]
        return self._submit(rank_op, async_op)

    def reduce_scatter(self, output: Any, input: Any, op: ReduceOp = ReduceOp.SUM,
                       async_op: bool = False) -> Work:
        """Reduce ``input`` (world_size * n elements) over all ranks; rank r receives block r in ``output``."""
        out = as_buffer(output, writable=True, what="reduce_scatter output")
        inp = as_buffer(input, writable=False, what="reduce_scatter input")
        if out.dtype is not inp.dtype:
            raise InvalidArgument(f"reduce_scatter: output is {out.dtype.name.lower()}, input "
                                  f"{inp.dtype.name.lower()}")
        if inp.count != out.count * self.world_size:
            raise InvalidArgument(f"reduce_scatter: input has {inp.count} elements, expected world size "
                                  f"{self.world_size} x output's {out.count}")
        arith = arithmetic(inp.dtype, _public_op(op))
        mine_start, mine_end = self.rank * out.count, (self.rank + 1) * out.count
        source, target = inp.array, out.array

        def contribution(start: int, end: int, scratch: np.ndarray) -> np.ndarray:
            return source[start:end]

        def collect(start: int, end: int, result: np.ndarray) -> None:
            low, high = max(start, mine_start), min(end, mine_end)
            if low < high:
                arith.collect(result[low - start:high - start], target[low - mine_start:high - mine_start],
                              self.world_size)

        return self._submit(self._op(OpKind.REDUCE_SCATTER, arith, inp.count, 0, contribution, collect, (out, inp),
                                     f"reduce_scatter({arith.op.name})", out), async_op)

    def all_gather(self, output: Any, input: Any, async_op: bool = False) -> Work:
        """Every rank's ``input`` (n elements), concatenated in rank order into every rank's ``output``."""
        out = as_buffer(output, writable=True, what="all_gather output")
        inp = as_buffer(input, writable=False, what="all_gather input")
        if out.dtype is not inp.dtype:
            raise InvalidArgument(f"all_gather: output is {out.dtype.name.lower()}, input {inp.dtype.name.lower()}")
        if out.count != inp.count * self.world_size:
            raise InvalidArgument(f"all_gather: output has {out.count} elements, expected world size "
                                  f"{self.world_size} x input's {inp.count}")
        bits = bits_dtype(out.array.dtype.itemsize)
        arith = arithmetic(bits, ReduceOp.BOR)
        source = inp.array.view(arith.storage)
        target = out.array.view(arith.storage)
        mine_start, mine_end = self.rank * inp.count, (self.rank + 1) * inp.count

        def contribution(start: int, end: int, scratch: np.ndarray) -> np.ndarray:
            low, high = max(start, mine_start), min(end, mine_end)
            if low >= high:
                scratch.fill(0)
                return scratch
            scratch[:low - start].fill(0)
            np.copyto(scratch[low - start:high - start], source[low - mine_start:high - mine_start])
            scratch[high - start:].fill(0)
            return scratch

        def collect(start: int, end: int, result: np.ndarray) -> None:
            np.copyto(target[start:end], result)

        return self._submit(self._op(OpKind.ALL_GATHER, arith, out.count, 0, contribution, collect, (out, inp),
                                     "all_gather", out), async_op)

    def broadcast(self, tensor: Any, src: int = 0, async_op: bool = False) -> Work:
        """Rank ``src``'s ``tensor`` into every rank's, bit for bit."""
        if not 0 <= src < self.world_size:
            raise InvalidArgument(f"broadcast: src {src} is outside 0..{self.world_size - 1}")
        buffer = as_buffer(tensor, writable=True, what="broadcast")
        arith = arithmetic(bits_dtype(buffer.array.dtype.itemsize), ReduceOp.BOR)
        flat = buffer.array.view(arith.storage)
        is_source = self.rank == src

        def contribution(start: int, end: int, scratch: np.ndarray) -> np.ndarray:
            if is_source:
                return flat[start:end]
            scratch.fill(0)
            return scratch

        def collect(start: int, end: int, result: np.ndarray) -> None:
            if not is_source:
                np.copyto(flat[start:end], result)

        return self._submit(self._op(OpKind.BROADCAST, arith, buffer.count, src, contribution, collect, buffer,
                                     f"broadcast(src={src})", buffer), async_op)

    # -- registered buffers -------------------------------------------------------------------------

    def shared_array(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """A zeroed array in memory this rank's node-mates map too (collective: every rank calls it
        with the same shape and dtype, in the same order).

        An allreduce of such an array (or of the same slice of it on every rank) skips copying in and
        out: the rank that reduces a chunk reads every node-mate's array in place and writes the
        result straight into all of them — the paper's registered host buffers. Kept until shutdown.
        """
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        if count < 0 or dtype not in (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint16):
            raise InvalidArgument(f"shared_array: shape {shape} of {dtype} is not supported")
        region = self._register(count * dtype.itemsize)
        array: np.ndarray = region.views[self.local_rank][:count * dtype.itemsize].view(dtype).reshape(shape)
        return array

    def shared_tensor(self, shape: int | tuple[int, ...], dtype: Any = None) -> Any:
        """:meth:`shared_array` as a torch tensor (any dtype hfreduce reduces, bfloat16 included)."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        count = int(np.prod(shape))
        region = self._register(count * itemsize)
        raw = torch.from_numpy(region.views[self.local_rank][:count * itemsize])
        return raw.view(dtype).reshape(shape)

    def _register(self, nbytes: int) -> _Region:
        """Make this rank's buffer, map every node-mate's (names follow from their registered pids)."""
        if nbytes > _MAX_SHARED_BYTES:
            raise InvalidArgument(f"a shared buffer of {nbytes} bytes (at most {_MAX_SHARED_BYTES})")
        with self._lock:
            if self._closed:
                raise HFReduceError("the communicator was shut down")
            index = len(self._regions)
        node = self.node
        pid, start = node.registered(self.local_rank)
        own = SharedBuffer.create(buffer_name(self.job_id, self.node_index, self.local_rank, index, pid, start),
                                  nbytes)
        buffers: list[SharedBuffer] = []
        try:
            # Every rank's buffer exists before anyone opens a node-mate's; every rank has opened them
            # all before the names go (the memory lives while any rank maps it).
            # The largest and (negated) smallest size: every rank sees a disagreement the same way.
            sizes = np.array([nbytes, -nbytes], dtype=np.int64)
            self.allreduce(sizes, op=ReduceOp.MAX)
            if int(sizes[0]) != nbytes or -int(sizes[1]) != nbytes:
                raise InvalidArgument(f"shared buffer #{index}: ranks asked for different sizes "
                                      f"({nbytes} bytes here; {-int(sizes[1])} to {int(sizes[0])} over all ranks)")
            for local_rank in range(self.local_world_size):
                if local_rank == self.local_rank:
                    buffers.append(own)
                    continue
                peer_pid, peer_start = node.registered(local_rank)
                buffers.append(SharedBuffer.attach(
                    buffer_name(self.job_id, self.node_index, local_rank, index, peer_pid, peer_start), nbytes))
            self.barrier()
        finally:
            own.unlink()
        region = _Region(index, nbytes, buffers)
        with self._lock:
            self._regions.append(region)
        return region

    def _locate(self, array: np.ndarray) -> tuple[int, int, list[np.ndarray]] | None:
        """(region, byte offset, every local rank's same bytes) if ``array`` lies in a shared buffer."""
        if not self._regions:
            return None
        address = array.__array_interface__["data"][0]
        nbytes = array.nbytes
        for region in self._regions:
            base = region.views[self.local_rank].__array_interface__["data"][0]
            if base <= address and address + nbytes <= base + region.nbytes:
                offset = address - base
                return region.index, offset, [view[offset:offset + nbytes] for view in region.views]
        return None

    def barrier(self, timeout_s: float | None = None) -> None:
        """Return once every rank has called ``barrier`` (an allreduce of one integer).

        With ``timeout_s``, raise :class:`HFReduceTimeout` if some rank has not arrived by then (the
        barrier stays queued, in order: it completes when the others arrive).
        """
        work = self.allreduce(np.zeros(1, dtype=np.int32), async_op=True)
        if not work.wait(timeout_s):
            raise HFReduceTimeout(f"barrier: not every rank arrived within {timeout_s:g} s")

    def _op(self, kind: int, arith: Arithmetic, count: int, root: int,
            contribution: Callable[[int, int, np.ndarray], np.ndarray],
            collect: Callable[[int, int, np.ndarray], None], keep: object, description: str,
            output: FlatBuffer) -> RankOp:
        """The rank's side of one collective; ``output.finish`` (CUDA) runs before the work completes."""
        return RankOp(kind, arith, count, root, contribution, collect, Work(description), (keep,),
                      finish=output.finish, divisor=self.world_size)

    # -- state ----------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Where this rank sits and, on a leader, the bytes each inter-node link carried (frames included)."""
        links = self.network.stats() if self.network is not None else {}
        return {"rank": self.rank, "world_size": self.world_size, "node": self.node_index,
                "node_count": self.node_count, "local_rank": self.local_rank,
                "local_world_size": self.local_world_size,
                "links": {peer: {"bytes_sent": sent, "bytes_received": received}
                          for peer, (sent, received) in links.items()}}

    def shutdown(self) -> None:
        """Stop this rank: pending collectives fail, peers learn it left, threads and memory are released."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        node = getattr(self, "node", None)
        if node is not None:
            node.stopping = True
        worker = getattr(self, "worker", None)
        if worker is not None and node is not None:
            worker.stop()
            # Node-mates finish what this rank completed, and fail at once on anything later.
            node.depart(worker.completed)
        if self.network is not None:
            self.network.say_goodbye(worker.completed if worker is not None else 0)
            self.network.close()
            self.network.join()
        for closer in (self._client, self._server):
            if closer is not None:
                closer.close()
        if self.segment is not None:
            self.segment.unlink()
            self.segment.close()
        # A node-mate that died between creating a name and its unlink (its registered buffer, or the
        # node's segment during the start) left it in /dev/shm: whoever outlives it removes it now
        # rather than at the next start on this machine.
        with contextlib.suppress(OSError):
            remove_stale_segments()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


@dataclass(frozen=True, slots=True)
class _Region:
    """A registered buffer: its index (the same on every rank) and every local rank's mapping of it."""

    index: int
    nbytes: int
    buffers: list[SharedBuffer]

    @property
    def views(self) -> list[np.ndarray]:
        return [buffer.bytes for buffer in self.buffers]


def _public_op(op: ReduceOp) -> ReduceOp:
    if op is ReduceOp.BOR or not isinstance(op, ReduceOp):
        raise InvalidArgument(f"op must be ReduceOp.SUM, AVG, MAX or MIN, not {op!r}")
    return op


@atexit.register
def _shutdown_all() -> None:
    for communicator in list(_live):
        with contextlib.suppress(Exception):
            communicator.shutdown()


"""The checkpoint manager: snapshot on the training thread, write in the background, publish atomically.

``save`` copies every tensor of the model, the optimizer, ``extra`` and the RNG states into host
buffers it keeps from save to save (one memcpy per tensor: the only stall the training loop sees),
and hands the buffers to a background thread, which writes the rank's data files (several in
parallel), its index and its ``.done`` marker under ``DIR/.step-N.RUN.tmp/``, each made durable
before the next. Rank 0's background thread then waits, through the file system alone, for every
rank's marker, writes ``manifest.json`` and renames the directory to ``DIR/step-N``: one atomic
rename in fs3's meta, so a reader sees the whole checkpoint or none of it. No collective runs in
the background (it would race the training thread's own); the only collectives are on the training
thread, at construction (agreeing on a run id) and in ``maybe_save`` with ``every_s`` (agreeing on
rank 0's clock).

One save is in flight at a time: a save called while the previous one is still writing waits for it
(a checkpoint is never skipped silently), and an error of the background write is raised by the next
``save``, ``wait`` or ``close``.

Loading picks the highest published step whose manifest is valid, verifies every rank's index
against the manifest and every block it reads against its CRC32C, and reads everything before it
changes anything: a damaged checkpoint is logged and the previous one is tried, and the model is
never left half-loaded.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

import torch

from haiscale.checkpoint import format as fmt
from haiscale.checkpoint.format import CheckpointCorrupt, Entry, RankIndex, TensorRef
from haiscale.checkpoint.rng import capture_rng_state, restore_rng_state
from haiscale.checkpoint.store import FS3Store, LocalStore, Store
from haiscale.sharding import Shard

__all__ = ["CheckpointError", "CheckpointManager", "Loaded"]

log = logging.getLogger(__name__)

_MANIFEST = "manifest.json"
_WRITE_PIECE_BYTES = 32 << 20
"""Bytes per write call (whole CRC blocks of a tensor): large enough that each call queues many
chunk writes, small enough that checksumming the next piece overlaps sending this one."""
_READ_PIECE_BYTES = 64 << 20
"""A loader's reads are cut into pieces of at most this many bytes (whole CRC blocks), run in
parallel: a large tensor is read by several threads at once."""
_POLL_MIN_S = 0.01
_POLL_MAX_S = 0.2
_RUN_ID = re.compile(r"[0-9a-f]{1,32}")


class CheckpointError(Exception):
    """No checkpoint could be loaded (each one's reason is in the message), or a save failed."""


@dataclass(frozen=True)
class Loaded:
    """What :meth:`CheckpointManager.load_latest` restored."""

    step: int
    extra: Any
    path: str


@dataclass
class _Snapshot:
    step: int
    entries: list[Entry]  # crcs empty until the background computes them
    trees: dict[str, Any]
    buffers: dict[str, torch.Tensor]  # file name -> its bytes (a view of a reused host buffer)
    durable: bool


def _stateful(obj: Any) -> tuple[bool, Any]:
    """``(sharded, state)`` of a module or optimizer: its ``sharded_state_dict()`` when it has one
    (see :class:`haiscale.checkpoint.ShardedModule`), else its ``state_dict()``."""
    if hasattr(obj, "sharded_state_dict") and hasattr(obj, "load_sharded_state_dict"):
        return True, dict(obj.sharded_state_dict())
    return False, obj.state_dict()


class CheckpointManager:
    """Checkpoints of one training run in one directory (see the module doc and the package doc).

    ``location``: ``fs3://[HOST:PORT|NAME@]/dir`` (the cluster and token from the URL, a profile or
    the environment, as :mod:`fs3.client.fsspec_impl` resolves them) or a local directory; or pass
    ``fs`` (an ``fs3.connect`` file system, not closed by the manager) and ``directory``.

    ``replica_of``: the rank that writes the replicated tensors (the plain, non-:class:`Shard`
    tensors of the model and optimizer) this rank also holds; this rank then writes none of them
    and loads them from that rank's files. Leave it ``None`` on the rank that writes them (for DDP:
    ``None`` on data-parallel rank 0, that rank's global rank on the others). Shards, ``extra`` and
    the RNG states are always this rank's own.

    ``run_id`` names this run's temporary directories so that a crashed run's leftovers never mix
    into a save of the same step; left out, rank 0 draws one and broadcasts it over torch's default
    process group (so with ``world_size > 1`` either pass it, the same on every rank, or initialise
    ``torch.distributed`` first).

    ``keep``: published checkpoints kept (at or below the step just saved; None keeps all).
    ``every_steps``/``every_s``: when :meth:`maybe_save` saves. ``files_per_rank``: data files a
    rank's bytes are striped over (each at least 16 MiB), written by ``io_threads`` threads at once
    (and the loader's ranged reads run on the same threads). ``publish_timeout_s``: how long rank 0
    waits for the other ranks' markers (and another rank, in :meth:`on_suspend`, for the publish).

    ``observer(phase, step)`` is called from the background writer as a save progresses
    (``rank_files_written``, ``marker_written``, and on rank 0 ``manifest_written``, ``published``):
    for progress logs and metrics.
    """

    def __init__(self, location: str | os.PathLike[str] | None = None, *, fs: Any = None,
                 directory: str | None = None, keep: int | None = 3, every_steps: int | None = None,
                 every_s: float | None = None, rank: int = 0, world_size: int = 1, replica_of: int | None = None,
                 run_id: str | None = None, files_per_rank: int = 4, io_threads: int = 4,
                 publish_timeout_s: float = 600.0,
                 observer: Callable[[str, int], None] | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world size {world_size}")
        if replica_of is not None and not (0 <= replica_of < world_size and replica_of != rank):
            raise ValueError(f"replica_of {replica_of} is not another rank of the {world_size}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep {keep}: keep at least one checkpoint (or None for all)")
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"every_steps {every_steps} is not positive")
        if every_s is not None and every_s <= 0:
            raise ValueError(f"every_s {every_s} is not positive")
        if files_per_rank < 1 or io_threads < 1 or publish_timeout_s <= 0:
            raise ValueError("files_per_rank, io_threads and publish_timeout_s must be positive")
        multi = world_size > 1
        if multi and every_s is not None and not _dist_ready():
            raise ValueError("every_s with several ranks needs torch.distributed initialised: the ranks agree on "
                             "rank 0's clock at every maybe_save")
        self.store: Store
        if fs is not None:
            if directory is None:
                raise ValueError("pass directory= with fs=")
            self.store, self.directory = FS3Store(fs, owned=False), directory
        elif location is not None and str(location).startswith("fs3://"):
            import fs3
            from fs3.client.fsspec_impl import FS3FileSystem

            url = str(location)
            where = FS3FileSystem._get_kwargs_from_urls(url)
            self.store = FS3Store(fs3.connect(where.get("mgmtd"), profile=where.get("profile")), owned=True)
            self.directory = FS3FileSystem._strip_protocol(url)
        elif location is not None:
            self.store, self.directory = LocalStore(), os.path.abspath(os.fspath(location))
        else:
            raise ValueError("give a location (fs3:// URL or local directory) or fs= and directory=")
        self.rank = rank
        self.world_size = world_size
        self.replica_of = replica_of
        self.keep = keep
        self.every_steps = every_steps
        self.every_s = every_s
        self.files_per_rank = files_per_rank
        self.publish_timeout_s = publish_timeout_s
        self.observer = observer
        self.run_id = self._agree_run_id(run_id)
        self._buffers: list[torch.Tensor] = []
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="haiscale-ckpt-writer")
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="haiscale-ckpt-io")
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._last_saved_step: int | None = None  # saved or loaded: maybe_save does not save it again
        self._saved_step: int | None = None  # saved by this manager
        self._last_save_mono = time.monotonic()
        self.last_stall_s = 0.0
        """Seconds the last ``save`` held the training thread (waiting for the previous save included)."""
        self.store.makedirs(self.directory)

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r} on {self.store!r}, rank {self.rank}/{self.world_size}, "
                f"keep={self.keep})")

    def _agree_run_id(self, run_id: str | None) -> str:
        if run_id is not None:
            if not _RUN_ID.fullmatch(run_id):
                raise ValueError(f"run_id {run_id!r} is not 1-32 lowercase hex digits")
            return run_id
        drawn = secrets.token_hex(8)
        if self.world_size == 1:
            return drawn
        if not _dist_ready():
            raise ValueError("with several ranks pass run_id= (the same on every rank) or initialise "
                             "torch.distributed so rank 0 can broadcast one")
        import torch.distributed as dist

        box: list[Any] = [drawn]
        dist.broadcast_object_list(box, src=0)
        return str(box[0])

    # -- saving ------------------------------------------------------------------------------------

    def save(self, step: int, model: Any = None, optimizer: Any = None, extra: Any = None) -> None:
        """Snapshot the state of ``step`` and write it in the background; returns once the snapshot is
        taken (after the previous save finished: its error, if any, is raised here instead)."""
        self._save(step, model, optimizer, extra, durable=False)

    def on_suspend(self, step: int, model: Any = None, optimizer: Any = None, extra: Any = None) -> None:
        """Save now and return only once the checkpoint is published (every rank's files durable, the
        step directory renamed into place): the hook a scheduler calls before it suspends the job.
        If this manager's last save was of ``step`` already, that save is the one waited for."""
        if step == self._saved_step:
            self.wait()
            if self.rank != 0:
                self._await_published(step)
            return
        self._save(step, model, optimizer, extra, durable=True)
        self.wait()

    def maybe_save(self, step: int, model: Any = None, optimizer: Any = None, extra: Any = None) -> bool:
        """Save if ``every_steps`` divides ``step`` or ``every_s`` passed since the last save; with
        ``every_s`` and several ranks, rank 0's clock decides for all (a broadcast on torch's default
        group), so that every rank saves the same steps."""
        due = self.every_steps is not None and step % self.every_steps == 0 and step != self._last_saved_step
        if self.every_s is not None:
            due = due or time.monotonic() - self._last_save_mono >= self.every_s
            if self.world_size > 1:
                import torch.distributed as dist

                flag = torch.tensor([int(due)], dtype=torch.int64)
                dist.broadcast(flag, src=0)
                due = bool(flag.item())
        if due:
            self.save(step, model, optimizer, extra)
        return due

    def wait(self) -> None:
        """Block until the save in flight is written (and, on rank 0, published); raise its error."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finish the save in flight (raising its error) and release the threads and the client."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)
            self._io.shutdown(wait=True)
            self.store.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _save(self, step: int, model: Any, optimizer: Any, extra: Any, durable: bool) -> None:
        if self._closed:
            raise ValueError("the checkpoint manager is closed")
        if not isinstance(step, int) or step < 0 or step >= 10**12:
            raise ValueError(f"step {step!r} is not an integer in [0, 10**12)")
        started = time.perf_counter()
        self.wait()
        tensors: dict[str, torch.Tensor | Shard] = {}
        trees: dict[str, Any] = {}
        skip: set[str] = set()
        for key, obj in (("model", model), ("optim", optimizer)):
            if obj is None:
                continue
            _sharded, state = _stateful(obj)
            found: dict[str, torch.Tensor | Shard] = {}
            trees[key] = fmt.encode_tree(state, key, found)
            if self.replica_of is not None:
                skip.update(name for name, t in found.items() if not isinstance(t, Shard))
            tensors.update(found)
        if extra is not None:
            trees["extra"] = fmt.encode_tree(extra, "extra", tensors)
        trees["rng"] = fmt.encode_tree(capture_rng_state(), "rng", tensors)
        written = [(name, t) for name, t in tensors.items() if name not in skip]
        trees_bytes = len(json.dumps(trees, separators=(",", ":")))
        if trees_bytes > fmt.MAX_INDEX_BYTES:
            raise ValueError(f"the state's JSON part is {trees_bytes} bytes: a rank's index holds at most "
                             f"{fmt.MAX_INDEX_BYTES} (keep large values in tensors)")
        self.last_stall_s = 0.0
        snapshot = self._snapshot(step, written, trees, durable)
        with self._lock:
            self._pending = self._writer.submit(self._write, snapshot)
        self._last_saved_step = self._saved_step = step
        self._last_save_mono = time.monotonic()
        self.last_stall_s = time.perf_counter() - started

    def _snapshot(self, step: int, tensors: list[tuple[str, torch.Tensor | Shard]], trees: dict[str, Any],
                  durable: bool) -> _Snapshot:
        """Copy every tensor into the reused host buffers (the training thread's only real cost)."""
        locals_ = [t.local if isinstance(t, Shard) else t for _, t in tensors]
        sizes = [(name, t.numel() * t.element_size()) for (name, _), t in zip(tensors, locals_, strict=True)]
        places, file_bytes = fmt.plan_layout(self.rank, sizes, self.files_per_rank)
        while len(self._buffers) < len(file_bytes):
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        for part, need in enumerate(file_bytes):
            if self._buffers[part].numel() < need:
                self._buffers[part] = torch.empty(need, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        buffers = {fmt.data_file_name(self.rank, part): self._buffers[part][:need]
                   for part, need in enumerate(file_bytes)}
        entries = []
        for (name, held), local, (file, offset), (_, nbytes) in zip(tensors, locals_, places, sizes, strict=True):
            dst = buffers[file][offset:offset + nbytes].view(local.dtype).view(local.shape)
            dst.copy_(local.detach())
            global_shape = tuple(held.global_shape) if isinstance(held, Shard) else None
            flat_offset = held.flat_offset if isinstance(held, Shard) else 0
            entries.append(Entry(name, file, offset, nbytes, fmt.dtype_name(local.dtype), tuple(local.shape), (),
                                 global_shape, flat_offset))
        return _Snapshot(step, entries, trees, buffers, durable)

    # -- the background writer ---------------------------------------------------------------------

    def _phase(self, phase: str, step: int) -> None:
        if self.observer is not None:
            self.observer(phase, step)

    def _tmp(self, step: int) -> str:
        return self.store.join(self.directory, fmt.tmp_dir_name(step, self.run_id))

    def _write(self, snap: _Snapshot) -> None:
        tmp = self._tmp(snap.step)
        try:
            self._write_rank_files(snap, tmp)
        except BaseException:
            # Nothing of this rank's is in the checkpoint yet (its marker is not written): its partial
            # files only take space — on a full disk, the space the next save needs, which would
            # fail too, as every save after it, until a save succeeded and cleaned up.
            self._remove_rank_files(tmp)
            raise
        self._phase("marker_written", snap.step)
        if self.rank == 0:
            self._publish(snap.step, tmp)
        elif snap.durable:
            self._await_published(snap.step)

    def _remove_rank_files(self, tmp: str) -> None:
        """Remove this rank's files of a failed save from ``tmp`` (and ``tmp`` once it is empty); best
        effort, as the save's own error is what the caller is told."""
        mine = f"rank-{self.rank:05d}."
        try:
            names = self.store.listdir(tmp)
        except OSError:
            return
        if fmt.marker_file_name(self.rank) in names:
            return  # the marker is out: rank 0 may be publishing these files
        for name in names:
            if name.startswith(mine):
                try:
                    self.store.remove(self.store.join(tmp, name))
                except OSError as exc:
                    log.warning("removing %s of a failed save failed: %s", name, exc)
        with contextlib.suppress(OSError):
            self.store.rmdir(tmp)

    def _write_rank_files(self, snap: _Snapshot, tmp: str) -> None:
        """This rank's data files, index and marker, each durable before the next is written."""
        self.store.makedirs(tmp)
        by_file: dict[str, list[Entry]] = {name: [] for name in snap.buffers}
        for entry in snap.entries:
            by_file[entry.file].append(entry)
        jobs = [self._io.submit(self._write_data, tmp, name, snap.buffers[name], by_file[name])
                for name in snap.buffers]
        crcs: dict[str, tuple[int, ...]] = {}
        futures_wait(jobs)  # all of them, failed or not: none may still be writing when a failure is cleaned up
        for job in jobs:
            crcs.update(job.result())
        entries = {e.name: Entry(e.name, e.file, e.offset, e.nbytes, e.dtype, e.shape, crcs[e.name], e.global_shape,
                                 e.flat_offset) for e in snap.entries}
        index = RankIndex(self.rank, self.world_size, snap.step, self.run_id,
                          {name: buf.numel() for name, buf in snap.buffers.items()}, entries, snap.trees)
        data = fmt.render_index(index)
        if len(data) > fmt.MAX_INDEX_BYTES:  # the trees fitted; their tensors' entries did not
            raise ValueError(f"rank {self.rank}'s index is {len(data)} bytes, more than the {fmt.MAX_INDEX_BYTES} "
                             "a loader reads")
        self.store.write_file(self.store.join(tmp, fmt.index_file_name(self.rank)), [data])
        self._phase("rank_files_written", snap.step)
        marker = fmt.Marker(self.rank, self.run_id, len(data), fmt.crc32c(data))
        # Written under another name and renamed: rank 0 lists the directory for markers, and must
        # never find one that is still being written.
        done = self.store.join(tmp, fmt.marker_file_name(self.rank))
        self.store.write_file(done + ".part", [fmt.render_marker(marker)])
        self.store.rename(done + ".part", done)

    def _write_data(self, tmp: str, name: str, buffer: torch.Tensor,
                    entries: list[Entry]) -> dict[str, tuple[int, ...]]:
        crcs: dict[str, tuple[int, ...]] = {}
        self.store.write_file(self.store.join(tmp, name), _checksummed_pieces(_bytes_of(buffer), entries, crcs))
        return crcs

    def _publish(self, step: int, tmp: str) -> None:
        """Rank 0: wait for every rank's marker, write the manifest, rename into place, clean up."""
        deadline = time.monotonic() + self.publish_timeout_s
        delay = _POLL_MIN_S
        wanted = {fmt.marker_file_name(r): r for r in range(self.world_size)}
        while True:
            missing = set(wanted) - set(self.store.listdir(tmp))
            if not missing:
                break
            if time.monotonic() > deadline:
                ranks = sorted(wanted[m] for m in missing)
                raise CheckpointError(f"step {step} not published: rank(s) {ranks[:16]} did not finish writing "
                                      f"within {self.publish_timeout_s} s")
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        markers = []
        for name, rank in sorted(wanted.items(), key=lambda item: item[1]):
            where = self.store.join(tmp, name)
            marker = fmt.parse_marker(self.store.read_bytes(where, fmt.MAX_MARKER_BYTES), where)
            if marker.rank != rank or marker.run_id != self.run_id:
                raise CheckpointError(f"{where} is rank {marker.rank}'s of run {marker.run_id}, not rank {rank}'s "
                                      f"of run {self.run_id}")
            markers.append(marker)
        manifest = fmt.Manifest(step, self.world_size, self.run_id, tuple(markers))
        self.store.write_file(self.store.join(tmp, _MANIFEST), [fmt.render_manifest(manifest)])
        self._phase("manifest_written", step)
        final = self.store.join(self.directory, fmt.step_dir_name(step))
        if self.store.exists(final):
            # A checkpoint of this step published before (the run resumed from an earlier one): set
            # aside first — between the two renames the previous step is the latest, never a mix.
            aside = self.store.join(self.directory, fmt.tmp_dir_name(step, self.run_id) + ".old")
            self.store.rename(final, aside)
            try:
                self.store.rename(tmp, final)
            except BaseException:
                # The new one cannot take its place (its directory is gone, the store failed): the
                # published one goes back, or the step would be lost with neither in place.
                try:
                    self.store.rename(aside, final)
                except OSError as exc:
                    log.error("step %d could not be put back from %s: %s", step, aside, exc)
                raise
            self.store.rmtree(aside)
        else:
            self.store.rename(tmp, final)
        self._phase("published", step)
        self._clean_up(step)

    def _clean_up(self, step: int) -> None:
        """Remove published steps below ``step`` beyond ``keep`` and temporary directories of steps
        this run has passed (or of other, crashed runs at this step). Steps above ``step`` (another
        run's) are never touched."""
        names = self.store.listdir(self.directory)
        published = sorted(s for s in (fmt.parse_step_dir(n) for n in names) if s is not None and s <= step)
        doomed = [] if self.keep is None else published[:-self.keep]
        for old in doomed:
            path = self.store.join(self.directory, fmt.step_dir_name(old))
            aside = self.store.join(self.directory, fmt.tmp_dir_name(old, self.run_id))
            try:
                self.store.rename(path, aside)  # atomic: a reader never sees it half removed
                self.store.rmtree(aside)
            except OSError as exc:
                log.warning("removing old checkpoint %s failed: %s", path, exc)
        for name in names:
            found = fmt.parse_tmp_dir(name.removesuffix(".old"))
            if found is None:
                continue
            tmp_step, run = found
            if tmp_step < step or (tmp_step == step and run != self.run_id):
                try:
                    self.store.rmtree(self.store.join(self.directory, name))
                except OSError as exc:
                    log.warning("removing stale %s failed: %s", name, exc)

    def _await_published(self, step: int) -> None:
        """Another rank than 0: wait until rank 0 published this run's ``step``."""
        where = self.store.join(self.directory, fmt.step_dir_name(step), _MANIFEST)
        deadline = time.monotonic() + self.publish_timeout_s
        delay = _POLL_MIN_S
        while True:
            try:
                manifest = fmt.parse_manifest(self.store.read_bytes(where, fmt.MAX_MANIFEST_BYTES), where, step)
                if manifest.run_id == self.run_id:
                    return
            except (FileNotFoundError, CheckpointCorrupt):
                pass
            if time.monotonic() > deadline:
                raise CheckpointError(f"step {step} was not published by rank 0 within {self.publish_timeout_s} s")
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    # -- loading -----------------------------------------------------------------------------------

    def published_steps(self) -> list[int]:
        """Steps with a published directory, highest first (not yet verified)."""
        try:
            names = self.store.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted((s for s in (fmt.parse_step_dir(n) for n in names) if s is not None), reverse=True)

    def load_latest(self, model: Any = None, optimizer: Any = None) -> Loaded | None:
        """Restore the newest loadable checkpoint into ``model`` and ``optimizer`` and this rank's RNG
        states; None when there is none at all. A damaged one is logged and the one before tried;
        :class:`CheckpointError` only when checkpoints exist but none loads."""
        self.wait()
        steps = self.published_steps()
        reasons = []
        for step in steps:
            path = self.store.join(self.directory, fmt.step_dir_name(step))
            try:
                return self._load(step, path, model, optimizer)
            except CheckpointCorrupt as exc:
                log.warning("checkpoint %s cannot be loaded, trying the one before: %s", path, exc)
                reasons.append(f"{fmt.step_dir_name(step)}: {exc}")
        if not steps:
            return None
        raise CheckpointError(f"no loadable checkpoint in {self.directory}: " + "; ".join(reasons[:8]))

    def _load(self, step: int, path: str, model: Any, optimizer: Any) -> Loaded:
        try:
            reader = _Reader(self, step, path)
            src = self.rank if self.rank < reader.world_size else 0
            states: dict[str, tuple[bool, Any]] = {}
            for key, obj in (("model", model), ("optim", optimizer)):
                if obj is None:
                    continue
                if hasattr(obj, "sharded_state_dict") and hasattr(obj, "load_sharded_state_dict"):
                    states[key] = (True, reader.sharded(key, dict(obj.sharded_state_dict()), src))
                else:
                    states[key] = (False, reader.tree(key, src))
            extra = reader.tree("extra", src) if "extra" in reader.index(src).trees else None
            rng = reader.tree("rng", self.rank) if self.rank < reader.world_size else None
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, EOFError) as exc:
            # A step directory that is a file, or a manifest that is a directory, is as damaged as a
            # missing one: the checkpoint before it is tried.
            raise CheckpointCorrupt(f"{type(exc).__name__}: {exc}") from None
        except OSError as exc:
            if exc.errno != errno.EFBIG:
                raise
            raise CheckpointCorrupt(str(exc)) from None
        # Everything is read and verified: only now does anything change. The generators go first
        # (only setting them proves a state good) and are put back if anything after them fails,
        # so a refused load leaves the process as it was.
        before = capture_rng_state()
        if rng is not None:
            try:
                restore_rng_state(rng)
            except (ValueError, TypeError, RuntimeError, IndexError, KeyError) as exc:
                restore_rng_state(before)
                raise CheckpointCorrupt(f"its RNG state cannot be restored: {exc}") from None
        else:
            log.info("checkpoint %s has no RNG state for rank %d (saved by %d ranks)", path, self.rank,
                     reader.world_size)
        try:
            for key, obj in (("model", model), ("optim", optimizer)):
                if key not in states:
                    continue
                sharded, state = states[key]
                if sharded:
                    obj.load_sharded_state_dict(state)
                else:
                    obj.load_state_dict(state)
        except BaseException:
            restore_rng_state(before)
            raise
        self._last_saved_step = step
        return Loaded(step, extra, path)


class _Reader:
    """One published checkpoint, opened for loading: its manifest and rank indexes, verified."""

    def __init__(self, manager: CheckpointManager, step: int, path: str) -> None:
        self.m = manager
        self.store = manager.store
        self.path = path
        where = self.store.join(path, _MANIFEST)
        self.manifest = fmt.parse_manifest(self.store.read_bytes(where, fmt.MAX_MANIFEST_BYTES), where, step)
        self.world_size = self.manifest.world_size
        self.step = step
        # Every rank's index, read and checked up front: a rank missing or damaged is found now,
        # whichever tensors this rank turns out to need.
        self._indexes = [self._read_index(marker) for marker in self.manifest.ranks]

    def index(self, rank: int) -> RankIndex:
        return self._indexes[rank]

    def _read_index(self, marker: fmt.Marker) -> RankIndex:
        where = self.store.join(self.path, fmt.index_file_name(marker.rank))
        data = self.store.read_bytes(where, fmt.MAX_INDEX_BYTES)
        if len(data) != marker.index_nbytes or fmt.crc32c(data) != marker.index_crc32c:
            raise CheckpointCorrupt(f"{where} does not match the manifest's size and CRC32C")
        index = fmt.parse_index(data, where, rank=marker.rank, step=self.step)
        if index.world_size != self.world_size or index.run_id != self.manifest.run_id:
            raise CheckpointCorrupt(f"{where} belongs to another save (world size {index.world_size}, "
                                    f"run {index.run_id})")
        for name, declared in index.files.items():
            actual = self.store.size(self.store.join(self.path, name))
            if actual != declared:
                raise CheckpointCorrupt(f"{self.store.join(self.path, name)} holds {actual} bytes, its index "
                                        f"says {declared}")
        return index

    def _pieces(self, name: str, plain_from: list[int]) -> list[tuple[int, Entry]]:
        """Every saved piece of tensor ``name`` this rank may use, preferred ones first: plain copies
        only from ``plain_from`` (this rank's source, then its replica's), shards from any rank."""
        order = list(dict.fromkeys([*plain_from, *range(self.world_size)]))
        found = []
        for rank in order:
            entry = self._indexes[rank].entries.get(name)
            if entry is not None and (entry.global_shape is not None or rank in plain_from):
                found.append((rank, entry))
        if not found:
            raise CheckpointCorrupt(f"tensor {name!r} was saved by no rank")
        shape, dtype = found[0][1].whole_shape, found[0][1].dtype
        for rank, entry in found:
            if entry.whole_shape != shape or entry.dtype != dtype:
                raise CheckpointCorrupt(f"ranks disagree on tensor {name!r}: rank {rank} has {entry.dtype} "
                                        f"{list(entry.whole_shape)}, another {dtype} {list(shape)}")
        return found

    def _plain_from(self, src: int) -> list[int]:
        replica = self.m.replica_of
        return [src] + ([replica] if replica is not None and replica < self.world_size else [])

    def fetch(self, name: str, start: int | None, end: int | None, src: int) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Elements ``[start, end)`` of the flattened tensor ``name`` (all when None), read from
        whichever pieces cover them and verified block by block; and the tensor's whole shape."""
        pieces = self._pieces(name, self._plain_from(src))
        whole_shape = pieces[0][1].whole_shape
        dtype = fmt.DTYPES[pieces[0][1].dtype]
        numel = math.prod(whole_shape)
        start = 0 if start is None else start
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise ValueError(f"elements [{start}, {end}) of {name!r}, a tensor of {numel}")
        # What covers the range is worked out before the output is allocated: a shard's whole shape
        # is bounded by no file, so only elements the saved pieces hold (bounded by their files'
        # sizes) may size an allocation.
        uncovered = [(start, end)] if end > start else []
        segments: list[tuple[int, Entry, int, int]] = []
        for rank, entry in pieces:
            if not uncovered:
                break
            lo, hi = entry.flat_offset, entry.flat_offset + entry.numel
            remaining = []
            for a, b in uncovered:
                s, e = max(a, lo), min(b, hi)
                if s >= e:
                    remaining.append((a, b))
                    continue
                segments.append((rank, entry, s, e))
                if a < s:
                    remaining.append((a, s))
                if e < b:
                    remaining.append((e, b))
            uncovered = remaining
        if uncovered:
            raise CheckpointCorrupt(f"elements {uncovered[:4]} of tensor {name!r} were saved by no rank")
        out = torch.empty(end - start, dtype=dtype)
        out_bytes = out.view(torch.uint8) if out.numel() else torch.empty(0, dtype=torch.uint8)
        jobs = [job for rank, entry, s, e in segments for job in self._read_jobs(rank, entry, s, e, out_bytes, start)]
        for job in [self.m._io.submit(fn) for fn in jobs]:
            job.result()
        return out, whole_shape

    def _read_jobs(self, rank: int, entry: Entry, s: int, e: int, out_bytes: torch.Tensor,
                   out_start: int) -> list[Callable[[], None]]:
        """Reads of elements ``[s, e)`` of ``entry`` into ``out_bytes`` (which starts at element
        ``out_start``), each whole CRC blocks of at most :data:`_READ_PIECE_BYTES`."""
        size = entry.itemsize
        first = (s - entry.flat_offset) * size
        last = (e - entry.flat_offset) * size
        block = fmt.CRC_BLOCK_BYTES
        per_job = max(1, _READ_PIECE_BYTES // block)
        k0, k1 = first // block, -(-last // block)
        jobs = []
        for kb in range(k0, k1, per_job):
            ke = min(k1, kb + per_job)
            b0, b1 = kb * block, min(ke * block, entry.nbytes)
            want0, want1 = max(b0, first), min(b1, last)
            dst = out_bytes[(s - out_start) * size + (want0 - first):(s - out_start) * size + (want1 - first)]
            jobs.append(self._read_job(rank, entry, kb, ke, b0, b1, want0, want1, dst))
        return jobs

    def _read_job(self, rank: int, entry: Entry, kb: int, ke: int, b0: int, b1: int, want0: int, want1: int,
                  dst: torch.Tensor) -> Callable[[], None]:
        path = self.store.join(self.path, entry.file)

        def run() -> None:
            direct = (want0, want1) == (b0, b1)
            buf = dst if direct else torch.empty(b1 - b0, dtype=torch.uint8)
            view = _bytes_of(buf)
            self.store.read_into(path, entry.offset + b0, view)
            for k in range(kb, ke):
                lo = k * fmt.CRC_BLOCK_BYTES - b0
                if fmt.crc32c(view[lo:lo + fmt.CRC_BLOCK_BYTES]) != entry.crcs[k]:
                    raise CheckpointCorrupt(f"{path}: tensor {entry.name!r} block {k} (rank {rank}) fails its CRC32C")
            if not direct:
                dst.copy_(buf[want0 - b0:want1 - b0])
        return run

    def _resolve(self, src: int) -> Callable[[TensorRef], torch.Tensor]:
        def resolve(ref: TensorRef) -> torch.Tensor:
            flat, shape = self.fetch(ref.name, None, None, src)
            return flat.view(shape)
        return resolve

    def tree(self, key: str, src: int) -> Any:
        tree = self._indexes[src].trees.get(key)
        if tree is None:
            raise CheckpointCorrupt(f"rank {src} saved no {key!r} state")
        return fmt.decode_tree(tree, self._resolve(src))

    def sharded(self, key: str, dest: Mapping[str, Any], src: int) -> dict[str, Any]:
        """The state of a sharded module or optimizer for its current layout: each Shard of ``dest``
        filled with the elements it covers, whatever layout saved them; plain tensors whole; other
        (JSON) values as this rank's source saved them."""
        out: dict[str, Any] = {}
        saved = self._indexes[src].trees.get(key)
        items = saved.get("__dict__") if isinstance(saved, dict) else None
        saved_items = {item[0]: item[1] for item in items if isinstance(item, list) and len(item) == 2} \
            if isinstance(items, list) else {}
        for name, want in dest.items():
            full = f"{key}/{name}"
            if not isinstance(want, Shard | torch.Tensor):
                # A JSON value (a hyperparameter, a counter): this rank's source's saved value.
                if name not in saved_items:
                    raise CheckpointCorrupt(f"rank {src} saved no {full!r}")
                out[name] = fmt.decode_tree(saved_items[name], self._resolve(src))
                continue
            if isinstance(want, Shard):
                flat, shape = self.fetch(full, want.flat_offset, want.flat_end, src)
                if shape != tuple(want.global_shape):
                    raise ValueError(f"{full}: the checkpoint's tensor is {list(shape)}, the module's "
                                     f"{list(want.global_shape)}")
                out[name] = Shard(flat.to(want.local.dtype), tuple(want.global_shape), want.flat_offset)
            else:
                flat, shape = self.fetch(full, None, None, src)
                out[name] = flat.view(shape)
        return out


def _checksummed_pieces(view: memoryview, entries: list[Entry],
                        crcs: dict[str, tuple[int, ...]]) -> Iterator[memoryview]:
    """``view`` in pieces of about :data:`_WRITE_PIECE_BYTES`, each entry's block CRCs put in ``crcs``
    as its bytes go by: a piece is checksummed while the client still sends the one before (a write
    returns once its chunks are queued), instead of a pass over every byte before the first write."""
    pending = 0
    for entry in sorted(entries, key=lambda e: e.offset):
        sums: list[int] = []
        done = 0
        while done < entry.nbytes:
            size = min(_WRITE_PIECE_BYTES, entry.nbytes - done)
            sums.extend(fmt.block_crcs(view[entry.offset + done:entry.offset + done + size]))
            done += size
            end = entry.offset + done
            if end - pending >= _WRITE_PIECE_BYTES:
                yield view[pending:end]
                pending = end
        crcs[entry.name] = tuple(sums)
    if pending < len(view):
        yield view[pending:]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous uint8 CPU tensor (no copy)."""
    array: Any = tensor.numpy()
    return memoryview(array).cast("B")


def _dist_ready() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())

"""A node's shared-memory segment: the control words, each local rank's input slots and the result slots.

Layout (every counter on its own 64-byte cache line so that ranks writing their own counters never
contend for a line)::

    control   int64 words: static header, the doorbell, the node's counters (ready, error), per
              local rank: deposited, reduced, collected, pid, departed, and a ring of op descriptors; then
              the error message
    inputs    [local rank][slot][chunk_size_bytes]   what each rank deposited (its own dtype)
    results   [slot][chunk_size_bytes]               the reduced chunk (accumulator dtype)

The segment is created by the node's leader (local rank 0) under a name that carries the job id, the
node index and the leader's pid and start time; once every local rank has mapped it the name is
unlinked, so the memory goes away with the last process whatever way it exits, SIGKILL included.
A crash *before* the unlink leaves a name behind: :func:`remove_stale_segments` (run by every leader at
start) removes names whose creating process no longer exists.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hfreduce.errors import HFReduceError

__all__ = ["DESCRIPTOR_WORDS", "NodeSegment", "SegmentShape", "SharedBuffer", "buffer_name", "process_start_time",
           "remove_stale_segments", "segment_name"]

SHM_DIR = Path("/dev/shm")
_PREFIX = "hfreduce-"
_NAME = re.compile(r"^hfreduce-[0-9a-f]+-n\d+(-l\d+-b\d+)?-p(?P<pid>\d+)-(?P<start>\d+)$")
_MAGIC = 0x4846_5244_5543_4533  # "HFREDUCE3"
_LINE_WORDS = 8  # 64-byte lines of int64 words
_ERROR_MESSAGE_BYTES = 4096
_PAGE = 4096
DESCRIPTOR_WORDS = 10

# Line numbers of the shared words.
_HEADER, _BELL, _READY, _ERROR, _FIRST_RANK_LINE = range(5)
_RANK_LINES = 5  # deposited, reduced, collected, pid, departed


@dataclass(frozen=True, slots=True)
class SegmentShape:
    local_world_size: int
    slots: int
    chunk_size_bytes: int
    descriptor_ring: int

    def control_words(self) -> int:
        rank_lines = _FIRST_RANK_LINE + _RANK_LINES * self.local_world_size
        descriptors = self.local_world_size * self.descriptor_ring * DESCRIPTOR_WORDS
        return rank_lines * _LINE_WORDS + descriptors

    def offsets(self) -> tuple[int, int, int, int]:
        """(error message, inputs, results, total) byte offsets."""
        message = self.control_words() * 8
        inputs = _round_up(message + _ERROR_MESSAGE_BYTES, _PAGE)
        results = inputs + self.local_world_size * self.slots * self.chunk_size_bytes
        total = _round_up(results + self.slots * self.chunk_size_bytes, _PAGE)
        return message, inputs, results, total


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def process_start_time(pid: int, *, running: bool = False) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if it does not exist
    (with ``running``, also if it has exited and waits to be reaped: a zombie).

    A pid alone can be reused; pid plus start time names one process for the machine's uptime.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    if running and fields[0] == "Z":
        return None
    return int(fields[19])


def segment_name(job_id: str, node_index: int, pid: int) -> str:
    start = process_start_time(pid)
    if start is None:
        raise HFReduceError(f"process {pid} has no /proc entry")
    return f"{_PREFIX}{job_id}-n{node_index}-p{pid}-{start}"


def buffer_name(job_id: str, node_index: int, local_rank: int, index: int, pid: int, start: int) -> str:
    """The name of local rank ``local_rank``'s shared buffer number ``index`` (every rank can compute
    a node-mate's from the pid and start time it registered)."""
    return f"{_PREFIX}{job_id}-n{node_index}-l{local_rank}-b{index}-p{pid}-{start}"


class SharedBuffer:
    """One rank's registered buffer: memory its node-mates map too, so collectives read it in place."""

    def __init__(self, name: str, mapping: mmap.mmap, nbytes: int, shm_dir: Path) -> None:
        self.name = name
        self.nbytes = nbytes
        self._mapping = mapping
        self._path = shm_dir / name
        self.bytes = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)

    @classmethod
    def create(cls, name: str, nbytes: int, shm_dir: Path = SHM_DIR) -> SharedBuffer:
        size = max(_PAGE, _round_up(nbytes, _PAGE))
        path = shm_dir / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise HFReduceError(f"cannot create a {size}-byte shared buffer in {shm_dir}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        return cls(name, mapping, nbytes, shm_dir)

    @classmethod
    def attach(cls, name: str, nbytes: int, shm_dir: Path = SHM_DIR) -> SharedBuffer:
        try:
            fd = os.open(shm_dir / name, os.O_RDWR)
        except OSError as exc:
            raise HFReduceError(f"cannot open a node-mate's shared buffer {name}: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise HFReduceError(f"shared buffer {name} has {size} bytes, this rank asked for {nbytes}: ranks "
                                    f"of one node allocated different sizes")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mapping, nbytes, shm_dir)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink segments left by leaders that died before unlinking them; returns their names."""
    removed: list[str] = []
    try:
        names = [entry.name for entry in os.scandir(shm_dir) if entry.name.startswith(_PREFIX)]
    except FileNotFoundError:
        return removed
    for name in names:
        match = _NAME.match(name)
        if match is None:
            continue
        pid, start = int(match["pid"]), int(match["start"])
        if process_start_time(pid, running=True) == start:
            continue  # its creator still runs: a live job's segment during its start
        with contextlib.suppress(FileNotFoundError):
            (shm_dir / name).unlink()
            removed.append(name)
    return removed


class NodeSegment:
    """Typed views over one mapping of a node's segment."""

    def __init__(self, mapping: mmap.mmap, shape: SegmentShape, name: str, shm_dir: Path) -> None:
        self._mapping = mapping
        self.shape = shape
        self.name = name
        self._path = shm_dir / name
        message, inputs, results, _ = shape.offsets()
        self.control = np.frombuffer(mapping, dtype=np.int64, count=shape.control_words())
        self.bell_word = np.frombuffer(mapping, dtype=np.uint32, count=1, offset=_BELL * 64)
        self.error_message = np.frombuffer(mapping, dtype=np.uint8, count=_ERROR_MESSAGE_BYTES, offset=message)
        self.inputs = np.frombuffer(mapping, dtype=np.uint8, count=shape.local_world_size * shape.slots
                                    * shape.chunk_size_bytes, offset=inputs).reshape(
            shape.local_world_size, shape.slots, shape.chunk_size_bytes)
        self.results = np.frombuffer(mapping, dtype=np.uint8, count=shape.slots * shape.chunk_size_bytes,
                                     offset=results).reshape(shape.slots, shape.chunk_size_bytes)
        descriptors_at = (_FIRST_RANK_LINE + _RANK_LINES * shape.local_world_size) * _LINE_WORDS
        self.descriptors = self.control[descriptors_at:].reshape(
            shape.local_world_size, shape.descriptor_ring, DESCRIPTOR_WORDS)

    # -- creation -----------------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, shape: SegmentShape, shm_dir: Path = SHM_DIR) -> NodeSegment:
        size = shape.offsets()[3]
        path = shm_dir / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as exc:
            raise HFReduceError(f"shared-memory segment {name} already exists") from exc
        try:
            # Reserve every page now: a full /dev/shm is a clear ENOSPC here, not a SIGBUS mid-job.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise HFReduceError(f"cannot create a {size}-byte segment in {shm_dir}: {exc.strerror}") from exc
        os.close(fd)
        segment = cls(mapping, shape, name, shm_dir)
        header = segment.control[_HEADER * _LINE_WORDS:(_HEADER + 1) * _LINE_WORDS]
        header[:5] = (_MAGIC, shape.local_world_size, shape.slots, shape.chunk_size_bytes, shape.descriptor_ring)
        return segment

    @classmethod
    def attach(cls, name: str, shape: SegmentShape, shm_dir: Path = SHM_DIR) -> NodeSegment:
        path = shm_dir / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise HFReduceError(f"cannot open shared-memory segment {name}: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != shape.offsets()[3]:
                raise HFReduceError(f"segment {name} has {size} bytes, expected {shape.offsets()[3]}: "
                                    f"ranks of one node disagree on chunk size or slots")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        segment = cls(mapping, shape, name, shm_dir)
        header = segment.control[_HEADER * _LINE_WORDS:_HEADER * _LINE_WORDS + 5]
        expected = (_MAGIC, shape.local_world_size, shape.slots, shape.chunk_size_bytes, shape.descriptor_ring)
        if tuple(int(word) for word in header) != expected:
            raise HFReduceError(f"segment {name} was made for another layout: ranks of one node disagree on "
                                f"local world size, chunk size or slots")
        return segment

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()

    def close(self) -> None:
        """Drop this process's views and mapping (the memory lives while another process maps it)."""
        for attribute in ("control", "bell_word", "error_message", "inputs", "results", "descriptors"):
            self.__dict__.pop(attribute, None)
        with contextlib.suppress(BufferError):
            self._mapping.close()

    # -- counters -----------------------------------------------------------------------------------

    def _word(self, line: int) -> int:
        return line * _LINE_WORDS

    @property
    def ready_at(self) -> int:
        return self._word(_READY)

    @property
    def error_at(self) -> int:
        return self._word(_ERROR)

    def deposited_at(self, local_rank: int) -> int:
        return self._word(_FIRST_RANK_LINE + _RANK_LINES * local_rank)

    def reduced_at(self, local_rank: int) -> int:
        return self._word(_FIRST_RANK_LINE + _RANK_LINES * local_rank + 1)

    def collected_at(self, local_rank: int) -> int:
        return self._word(_FIRST_RANK_LINE + _RANK_LINES * local_rank + 2)

    def pid_at(self, local_rank: int) -> int:
        return self._word(_FIRST_RANK_LINE + _RANK_LINES * local_rank + 3)

    def departed_at(self, local_rank: int) -> int:
        """1 + the collectives the rank completed before it shut down (0 while it takes part)."""
        return self._word(_FIRST_RANK_LINE + _RANK_LINES * local_rank + 4)

    def set_error(self, message: str) -> None:
        """Poison the node: the first error's message stays; every rank reads it."""
        if int(self.control[self.error_at]):
            return
        encoded = message.encode("utf-8", "replace")[:_ERROR_MESSAGE_BYTES - 1]
        self.error_message[:len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
        self.error_message[len(encoded)] = 0
        self.control[self.error_at] = 1

    def error(self) -> str | None:
        if not int(self.control[self.error_at]):
            return None
        raw = bytes(self.error_message)
        return raw[:raw.index(0)].decode("utf-8", "replace") if 0 in raw else raw.decode("utf-8", "replace")

"""``fs3 bench``: the flow of ``juicefs bench``, on any mounted path or through fs3's native client.

Each of N threads writes one big file with fixed-size blocks and reads it back, then writes, reads
and stats a set of small files. Page caches are dropped (as root) between write and read phases so
reads come from the file system, not from this machine's memory. The same flow measures fs3's FUSE
mount, fs3's Python client (``--native``), other file systems' mounts and a local directory, which
is what ``bench/compare.py`` does with it.

Throughput is bytes moved over the phase's wall time; "cost" is what juicefs reports: wall time x
threads / operations, the average time one thread spent per block or file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from fs3.common.errors import InvalidArgument

__all__ = ["BenchConfig", "NativeBackend", "PathBackend", "PhaseResult", "parse_size", "run_bench"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str, what: str) -> int:
    """``"128K"`` → 131072; binary units, as ``juicefs bench`` and fio read them."""
    raw = text.strip().upper()
    digits = raw.rstrip("BKMGI")
    unit = raw[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        raise InvalidArgument(f"{what}: {text!r} is not a size (examples: 4096, 128K, 1M, 1G)") from None
    if unit not in _UNITS or value < 0:
        raise InvalidArgument(f"{what}: {text!r} is not a size (examples: 4096, 128K, 1M, 1G)")
    return int(value * _UNITS[unit])


@dataclass(frozen=True)
class BenchConfig:
    big_file_size_bytes: int = 1 << 30
    small_file_size_bytes: int = 128 << 10
    small_file_count: int = 100
    block_size_bytes: int = 1 << 20
    threads: int = 1
    drop_caches: bool = True

    def validate(self) -> None:
        for name in ("big_file_size_bytes", "small_file_size_bytes", "small_file_count", "block_size_bytes"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must not be negative (got {getattr(self, name)})")
        if self.block_size_bytes == 0:
            raise InvalidArgument("block_size_bytes must be positive")
        if not 1 <= self.threads <= 256:
            raise InvalidArgument(f"threads must be between 1 and 256 (got {self.threads})")


@dataclass
class PhaseResult:
    name: str
    operations: int  # blocks or files, all threads together
    bytes_moved: int
    seconds: float
    threads: int
    unit: str  # what one operation is: "block" or "file"

    @property
    def mib_per_s(self) -> float:
        return self.bytes_moved / (1 << 20) / self.seconds if self.seconds > 0 else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.operations / self.seconds if self.seconds > 0 else 0.0

    @property
    def cost_ms(self) -> float:
        """Average time one thread spent per operation (juicefs' "cost")."""
        return self.seconds * self.threads / self.operations * 1000 if self.operations else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mib_per_s": self.mib_per_s, "ops_per_s": self.ops_per_s, "cost_ms": self.cost_ms}


class Backend(Protocol):
    """Where the benchmark's files live: a directory (any mount) or fs3's native client."""

    name: str

    def makedirs(self, path: str) -> None: ...

    def open_write(self, path: str) -> IO[bytes]: ...

    def open_read(self, path: str) -> IO[bytes]: ...

    def stat(self, path: str) -> None: ...

    def rmtree(self, path: str) -> None: ...

    def drop_caches(self) -> None: ...


def drop_page_cache() -> None:
    """Flush dirty pages and drop clean ones (root only; otherwise reads may come from memory)."""
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


@dataclass
class PathBackend:
    """A directory: a FUSE mount (fs3's or another file system's) or a local one."""

    root: Path
    name: str = "path"

    def _p(self, path: str) -> Path:
        return self.root / path

    def makedirs(self, path: str) -> None:
        self._p(path).mkdir(parents=True, exist_ok=True)

    def open_write(self, path: str) -> IO[bytes]:
        return open(self._p(path), "wb", buffering=0)

    def open_read(self, path: str) -> IO[bytes]:
        return open(self._p(path), "rb", buffering=0)

    def stat(self, path: str) -> None:
        os.stat(self._p(path))

    def rmtree(self, path: str) -> None:
        shutil.rmtree(self._p(path), ignore_errors=True)

    def drop_caches(self) -> None:
        drop_page_cache()


@dataclass
class NativeBackend:
    """fs3's blocking Python client (``fs3.connect``): no FUSE, no kernel on the data path."""

    fs: Any  # fs3.client.sync_api.FileSystem
    root: str = "/"
    name: str = "native"

    def _p(self, path: str) -> str:
        return f"{self.root.rstrip('/')}/{path}"

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(self._p(path), exist_ok=True)

    def open_write(self, path: str) -> IO[bytes]:
        return self.fs.open(self._p(path), "wb", buffering=0)  # type: ignore[no-any-return]

    def open_read(self, path: str) -> IO[bytes]:
        return self.fs.open(self._p(path), "rb", buffering=0)  # type: ignore[no-any-return]

    def stat(self, path: str) -> None:
        self.fs.stat(self._p(path))

    def rmtree(self, path: str) -> None:
        full = self._p(path)
        if not self.fs.exists(full):
            return
        for top, dirs, files in list(self.fs.walk(full, topdown=False)):
            for name in files:
                self.fs.remove(f"{top}/{name}")
            for name in dirs:
                self.fs.rmdir(f"{top}/{name}")
        self.fs.rmdir(full)

    def drop_caches(self) -> None:
        """The native client keeps no cache across opens; storage nodes' page caches are dropped."""
        drop_page_cache()


@dataclass
class Progress:
    """Operations done in the current phase; read by a progress bar, written by the worker threads."""

    phase: str = ""
    done: int = 0
    total: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, phase: str, total: int) -> None:
        with self.lock:
            self.phase, self.done, self.total = phase, 0, total

    def step(self, n: int = 1) -> None:
        with self.lock:
            self.done += n


def _write_file(backend: Backend, path: str, size_bytes: int, block: memoryview, progress: Progress | None,
                per_block: bool) -> int:
    blocks = 0
    with backend.open_write(path) as f:
        left = size_bytes
        while left > 0:
            piece = block[: min(left, len(block))]
            written = 0
            while written < len(piece):
                written += f.write(piece[written:]) or 0
            left -= len(piece)
            blocks += 1
            if per_block and progress is not None:
                progress.step()
    return blocks


def _read_file(backend: Backend, path: str, buffer: memoryview, progress: Progress | None, per_block: bool) -> int:
    total = 0
    with backend.open_read(path) as f:
        while True:
            n = f.readinto(buffer)  # type: ignore[attr-defined]
            if not n:
                break
            total += n
            if per_block and progress is not None:
                progress.step()
    return total


def _in_threads(threads: int, work: Callable[[int], object]) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fs3-bench") as pool:
        for future in [pool.submit(work, t) for t in range(threads)]:
            future.result()
    return time.perf_counter() - started


def run_bench(backend: Backend, config: BenchConfig, progress: Progress | None = None,
              workdir: str | None = None) -> list[PhaseResult]:
    """Run every phase in a fresh directory under the backend's root, then remove it."""
    config.validate()
    base = workdir or f"__fs3_bench_{uuid.uuid4().hex[:8]}"
    block = memoryview(os.urandom(config.block_size_bytes))
    results: list[PhaseResult] = []
    threads = config.threads
    blocks_per_big = -(-config.big_file_size_bytes // config.block_size_bytes)
    backend.makedirs(base)
    try:
        for t in range(threads):
            backend.makedirs(f"{base}/small-{t}")
        if config.big_file_size_bytes:
            if progress:
                progress.start("write big file", blocks_per_big * threads)
            seconds = _in_threads(threads, lambda t: _write_file(
                backend, f"{base}/big-{t}", config.big_file_size_bytes, block, progress, True))
            results.append(PhaseResult("write big file", blocks_per_big * threads,
                                       config.big_file_size_bytes * threads, seconds, threads, "block"))
            if config.drop_caches:
                backend.drop_caches()
            if progress:
                progress.start("read big file", blocks_per_big * threads)
            buffers = [memoryview(bytearray(config.block_size_bytes)) for _ in range(threads)]
            moved = [0] * threads

            def read_big(t: int) -> None:
                moved[t] = _read_file(backend, f"{base}/big-{t}", buffers[t], progress, True)

            seconds = _in_threads(threads, read_big)
            if sum(moved) != config.big_file_size_bytes * threads:
                raise RuntimeError(f"read {sum(moved)} bytes of big files, wrote "
                                   f"{config.big_file_size_bytes * threads}")
            results.append(PhaseResult("read big file", blocks_per_big * threads, sum(moved), seconds, threads,
                                       "block"))
        count = config.small_file_count
        if count:
            small = block if config.small_file_size_bytes <= len(block) else \
                memoryview(os.urandom(config.small_file_size_bytes))
            if progress:
                progress.start("write small files", count * threads)

            def write_small(t: int) -> None:
                for i in range(count):
                    _write_file(backend, f"{base}/small-{t}/{i}", config.small_file_size_bytes, small, None, False)
                    if progress:
                        progress.step()

            seconds = _in_threads(threads, write_small)
            results.append(PhaseResult("write small files", count * threads,
                                       config.small_file_size_bytes * count * threads, seconds, threads, "file"))
            if config.drop_caches:
                backend.drop_caches()
            if progress:
                progress.start("read small files", count * threads)
            small_buffers = [memoryview(bytearray(max(config.small_file_size_bytes, 1))) for _ in range(threads)]

            def read_small(t: int) -> None:
                for i in range(count):
                    _read_file(backend, f"{base}/small-{t}/{i}", small_buffers[t], None, False)
                    if progress:
                        progress.step()

            seconds = _in_threads(threads, read_small)
            results.append(PhaseResult("read small files", count * threads,
                                       config.small_file_size_bytes * count * threads, seconds, threads, "file"))
            if progress:
                progress.start("stat small files", count * threads)

            def stat_small(t: int) -> None:
                for i in range(count):
                    backend.stat(f"{base}/small-{t}/{i}")
                    if progress:
                        progress.step()

            seconds = _in_threads(threads, stat_small)
            results.append(PhaseResult("stat small files", count * threads, 0, seconds, threads, "file"))
    finally:
        backend.rmtree(base)
    return results


# -- the command ---------------------------------------------------------------------------------

# (green at or better than, yellow at or better than): MiB/s for big files, files/s for small ones.
_GOOD = {"write big file": (500.0, 100.0), "read big file": (500.0, 100.0), "write small files": (500.0, 100.0),
         "read small files": (1000.0, 200.0), "stat small files": (5000.0, 1000.0)}


def _colour(text: str, phase: PhaseResult, enabled: bool) -> str:
    if not enabled:
        return text
    green, yellow = _GOOD.get(phase.name, (0.0, 0.0))
    value = phase.mib_per_s if phase.unit == "block" else phase.ops_per_s
    code = "32" if value >= green else "33" if value >= yellow else "31"
    return f"\033[{code}m{text}\033[0m"


def summary_table(results: list[PhaseResult], colour: bool) -> str:
    rows = [("phase", "throughput", "cost per op", "operations")]
    for phase in results:
        throughput = f"{phase.mib_per_s:.1f} MiB/s" if phase.unit == "block" else f"{phase.ops_per_s:.1f} files/s"
        rows.append((phase.name, throughput, f"{phase.cost_ms:.2f} ms/{phase.unit}", str(phase.operations)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for index, row in enumerate(rows):
        cells = [row[0].ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True))]
        line = "  ".join(cells)
        lines.append(line if index == 0 else _colour(line, results[index - 1], colour))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


@contextlib.contextmanager
def progress_bar(progress: Progress, stream: Any, enabled: bool) -> Iterator[None]:
    """Redraw one line a few times a second while the benchmark runs (only on a terminal)."""
    stop = threading.Event()

    def draw() -> None:
        while not stop.wait(0.2):
            with progress.lock:
                phase, done, total = progress.phase, progress.done, progress.total
            width = 30
            filled = width * done // total if total else 0
            stream.write(f"\r{phase:<18} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}\033[K")
            stream.flush()

    thread = threading.Thread(target=draw, daemon=True) if enabled else None
    if thread:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread:
            thread.join()
            stream.write("\r\033[K")
            stream.flush()


def bench_command(args: Any) -> int:
    """``fs3 bench PATH | --native``: run the flow, print the summary (or JSON)."""
    import json

    config = BenchConfig(big_file_size_bytes=parse_size(args.big_file_size, "--big-file-size"),
                         small_file_size_bytes=parse_size(args.small_file_size, "--small-file-size"),
                         small_file_count=args.small_file_count,
                         block_size_bytes=parse_size(args.block_size, "--block-size"), threads=args.threads,
                         drop_caches=not args.no_drop_caches)
    config.validate()
    fs = None
    backend: Backend
    if args.native:
        from fs3.cli.cluster import client_tls, resolve_cluster
        from fs3.client.sync_api import connect

        mgmtd, token = resolve_cluster(args)
        fs = connect(mgmtd, token=token, tls=client_tls(args))
        backend = NativeBackend(fs, args.path or "/")
        where = f"fs3 native client, {mgmtd}:{args.path or '/'}"
    else:
        if not args.path:
            raise InvalidArgument("give a PATH to benchmark, or --native for fs3's Python client")
        root = Path(args.path)
        if not root.is_dir():
            raise InvalidArgument(f"{root} is not a directory")
        backend = PathBackend(root)
        where = str(root)
    tty = sys.stdout.isatty() and not args.json
    colour = tty and "NO_COLOR" not in os.environ
    if not args.json:
        print(f"fs3 bench: {where}; {config.threads} thread(s), big file {config.big_file_size_bytes >> 20} MiB "
              f"in {config.block_size_bytes >> 10} KiB blocks, {config.small_file_count} small files of "
              f"{config.small_file_size_bytes >> 10} KiB per thread")
    progress = Progress()
    try:
        with progress_bar(progress, sys.stderr, sys.stderr.isatty() and not args.json):
            results = run_bench(backend, config, progress)
    finally:
        if fs is not None:
            fs.close()
    if args.json:
        print(json.dumps({"where": where, "config": asdict(config), "phases": [r.as_dict() for r in results]},
                         indent=2))
    else:
        print(summary_table(results, colour))
    return 0

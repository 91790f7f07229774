"""Mounting and unmounting: ``fs3 mount MGMTD MNT`` and ``fs3 umount MNT``.

The daemon runs pyfuse3 in asyncio mode on the same event loop as the client library. In the
foreground it unmounts on SIGINT/SIGTERM and on any exit; in the background (the default) the
command starts the daemon as its own session, waits until the mount answers, and returns. A
daemon that died (SIGKILL, crash) leaves a mount point that answers ENOTCONN: ``fs3 umount``
detaches it (lazily if need be), and ``fs3 mount`` cleans such a leftover up before mounting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fs3.common.errors import FS3Error, InvalidArgument, Unavailable
from fs3.common.metrics import MountMetrics
from fs3.common.secret_files import read_token_file
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.tls import TlsConfig

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from fs3.fuse.usrbio_server import UsrbioServer
    from fs3.vfs import Vfs

__all__ = ["MountOptions", "is_mounted", "mount_background", "mount_device", "run_foreground", "set_readahead",
           "umount"]

log = logging.getLogger(__name__)


@dataclass
class MountOptions:
    token: str | None = field(default=None, repr=False)
    # A token file (its first line is presented): read again on SIGHUP, so that a rotated token
    # reaches a running mount. Without one, SIGHUP unmounts like SIGTERM.
    token_file: str | None = None
    transport: str = "framed"
    tls: TlsConfig | None = None        # mutual TLS to the cluster (CA, this daemon's certificate and key)
    allow_other: bool | None = None     # None: when running as root (others need /etc/fuse.conf)
    attr_timeout_s: float = 1.0
    entry_timeout_s: float = 1.0
    created_entry_timeout_s: float = 30.0   # the entry timeout of a file this mount created (VfsConfig)
    # Released handles with nothing left to publish end their sessions in batches (VfsConfig).
    batched_closes: bool = True
    inflight_per_file: int = 8
    log_level: str = "INFO"
    # The kernel's read-ahead for the mount in KiB (root only; 0 keeps the kernel's 128 KiB). A
    # larger window keeps several FUSE reads in flight for a sequential reader (one reader, 1 MiB:
    # 1.2-1.7x), but once all readers together ask for more than a few MiB ahead, reads slow down
    # (four fio jobs at 1 MiB each: 0.7x), so it is a tunable, not the default.
    readahead_kb: int = 0
    # The daemon's /metrics endpoint (FUSE operations, bytes, caches, process): a port (0: any
    # free one, written to the ready file); -1: none.
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    # fs3.usrbio: shared-memory rings for processes on this machine (a Unix socket under
    # usrbio_dir, default /run/fs3 for root); off: only FUSE serves the mount.
    usrbio: bool = True
    usrbio_dir: str | None = None
    # Processes serving the mount: 1 serves everything in this process; N > 1 keeps the FUSE
    # session and the namespace here and moves open files (chunk I/O, buffers, read-ahead) to N
    # data-worker processes, each with its own client (fs3.vfs.workers; decisions.md for numbers).
    workers: int = 1
    # With workers: one that has not answered a ping for this long (stopped, wedged) is killed and
    # replaced, so its open files answer EIO rather than hang their callers.
    worker_timeout_s: float = 30.0


def mount_device(mountpoint: Path) -> str | None:
    """``major:minor`` of the file system mounted at ``mountpoint``, from /proc/self/mountinfo.

    (A stat of the mount point would be a FUSE request to this very daemon before it serves.)
    """
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    device = None
    for line in lines:
        fields = line.split()
        if len(fields) > 4 and fields[4].encode().decode("unicode_escape") == str(mountpoint):
            device = fields[2]  # the last mount on that path is the one in force
    return device


def set_readahead(mountpoint: Path, readahead_kb: int) -> bool:
    """Set the kernel's read-ahead for the mount; False when it could not (not root, no sysfs)."""
    if readahead_kb <= 0:
        return False
    device = mount_device(mountpoint)
    if device is None:
        log.info("read-ahead of %s left at the kernel's default: not in /proc/self/mountinfo", mountpoint)
        return False
    try:
        Path(f"/sys/class/bdi/{device}/read_ahead_kb").write_text(f"{readahead_kb}\n")
    except OSError as exc:
        log.info("read-ahead of %s left at the kernel's default: %s", mountpoint, exc)
        return False
    log.info("read-ahead of %s set to %d KiB", mountpoint, readahead_kb)
    return True


def _mount_entries() -> list[str]:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    return [line.split()[4].encode().decode("unicode_escape") for line in lines if len(line.split()) > 4]


def is_mounted(mountpoint: str | Path) -> bool:
    return str(Path(mountpoint).resolve()) in _mount_entries() or os.path.ismount(mountpoint)


def _is_dead_mount(mountpoint: str | Path) -> bool:
    try:
        os.stat(mountpoint)
        return False
    except OSError as exc:
        return exc.errno == errno.ENOTCONN


def umount(mountpoint: str | Path, lazy_if_busy: bool = True) -> None:
    """Unmount a fs3 mount (a live one, or the remains of a daemon that died)."""
    path = str(Path(mountpoint).absolute())
    if not is_mounted(path) and not _is_dead_mount(path):
        raise InvalidArgument(f"{path} is not mounted")
    tool = "fusermount3" if _which("fusermount3") else "fusermount"
    result = subprocess.run([tool, "-u", path], capture_output=True, text=True)
    if result.returncode != 0 and lazy_if_busy:
        result = subprocess.run([tool, "-uz", path], capture_output=True, text=True)
    if result.returncode != 0:
        raise Unavailable(f"cannot unmount {path}: {result.stderr.strip()}")


def _which(name: str) -> bool:
    return any(os.access(os.path.join(d, name), os.X_OK) for d in os.environ.get("PATH", "").split(":"))


def run_foreground(mgmtd: str, mountpoint: str, options: MountOptions, ready_file: str | None = None) -> int:
    """Mount and serve until unmounted or signalled; always unmounts on the way out."""
    import pyfuse3
    import pyfuse3.asyncio as pyfuse3_asyncio

    from fs3.common.logging import setup_logging

    setup_logging("mount", options.log_level)
    # Resolved before mounting: once mounted, touching the mount point from this process would
    # wait for this process to answer FUSE's first request — a deadlock.
    target = Path(mountpoint).resolve()
    if _is_dead_mount(target):
        log.warning("cleaning up a dead fs3 mount at %s", target)
        umount(target)
    if not target.is_dir():
        raise InvalidArgument(f"mount point {target} is not a directory")
    pyfuse3_asyncio.enable()

    async def main() -> None:
        import fs3.aio
        from fs3.fuse.ops import FS3Operations
        from fs3.vfs import Vfs, VfsConfig

        token = read_token_file(options.token_file)[0] if options.token_file else options.token
        fs = await fs3.aio.connect(mgmtd, token=token, transport=options.transport, tls=options.tls,
                                   metrics_port=options.metrics_port, metrics_host=options.metrics_host)
        config = VfsConfig(attr_timeout_s=options.attr_timeout_s, entry_timeout_s=options.entry_timeout_s,
                           created_entry_timeout_s=options.created_entry_timeout_s,
                           gather_session_ends=options.batched_closes,
                           inflight_per_file=options.inflight_per_file)

        def drop_entry(parent: int, name: bytes) -> None:
            # From a worker thread: the kernel may hold the directory while a request runs.
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)

        pool = None
        if options.workers > 1:
            from fs3.vfs.workers import DataWorkers, WorkerSettings, WorkerVfs

            tls = dataclasses.asdict(options.tls) if options.tls is not None else None
            pool = await DataWorkers.start(options.workers, WorkerSettings(
                mgmtd, token, options.transport, tls, options.log_level, options.inflight_per_file,
                options.worker_timeout_s))
            vfs: Vfs = WorkerVfs(fs, pool, config, drop_entry)
        else:
            vfs = Vfs(fs, config, drop_entry)
        fuse_options = set(pyfuse3.default_options) | {"fsname=fs3", "subtype=fs3"}
        allow_other = os.geteuid() == 0 if options.allow_other is None else options.allow_other
        if allow_other:
            fuse_options.add("allow_other")
        operations = FS3Operations(vfs, after_init=lambda: set_readahead(target, options.readahead_kb),
                                   metrics=MountMetrics(fs.metrics.registry))
        pyfuse3.init(operations, str(target), fuse_options)
        usrbio = _start_usrbio(vfs, target, options, fs.metrics.registry) if options.usrbio else None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, pyfuse3.terminate)
        if options.token_file:
            loop.add_signal_handler(signal.SIGHUP, lambda: _reload_token(fs.channels, options.token_file or ""))
        if ready_file:
            # Atomically, as the servers do: a supervisor polling for the file never reads half of it.
            tmp = Path(ready_file).with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "mountpoint": str(target), "mgmtd": mgmtd,
                                       "metrics": fs.metrics_address, "workers": pool.pids if pool else []}))
            tmp.replace(ready_file)
        log.info("fs3 mounted at %s (mgmtd %s, metrics %s)", target, mgmtd, fs.metrics_address or "off")
        try:
            await pyfuse3.main()
        finally:
            if usrbio is not None:
                with contextlib.suppress(Exception):
                    await usrbio.close()
            with contextlib.suppress(Exception):
                await vfs.close()
            pyfuse3.close(unmount=True)
            if pool is not None:
                await pool.close()
            await fs.close()
            log.info("fs3 unmounted from %s", target)

    try:
        import uvloop

        uvloop.run(main())
    except KeyboardInterrupt:
        pass
    return 0


def _start_usrbio(vfs: Vfs, target: Path, options: MountOptions, registry: CollectorRegistry) -> UsrbioServer | None:
    """Serve fs3.usrbio rings for the mount; a mount without them still serves FUSE (logged)."""
    import pyfuse3

    from fs3.fuse.usrbio_server import UsrbioServer

    device = mount_device(target)
    if device is None:
        log.warning("usrbio off: %s is not in /proc/self/mountinfo", target)
        return None
    def drop_kernel_cache(inode_id: int) -> None:
        try:
            pyfuse3.invalidate_inode(inode_id, attr_only=False)
        except OSError as exc:  # ENOENT: the kernel holds nothing of it
            log.debug("invalidating inode %d: %s", inode_id, exc)

    server = UsrbioServer(vfs, device, str(target), Path(options.usrbio_dir) if options.usrbio_dir else None,
                          registry=registry, drop_kernel_cache=drop_kernel_cache)
    try:
        server.start()
    except OSError as exc:
        log.warning("usrbio off: %s", exc)
        return None
    return server


def _reload_token(channels: RealChannelFactory, token_file: str) -> None:
    """SIGHUP with a token file: present its first token from now on (a rotation)."""
    try:
        channels.set_token(read_token_file(token_file)[0])
    except FS3Error as exc:
        log.error("SIGHUP: keeping the current token: %s", exc)
        return
    log.info("SIGHUP: token reloaded from %s", token_file)


def mount_background(mgmtd: str, mountpoint: str, options: MountOptions, log_file: str | None = None,
                     timeout_s: float = 30) -> int:
    """Start the daemon in its own session and return once the mount answers; returns its pid."""
    target = Path(mountpoint).resolve()
    if is_mounted(target) and not _is_dead_mount(target):
        raise InvalidArgument(f"{target} is already mounted")
    log_path = Path(log_file) if log_file else Path(f"/tmp/fs3-mount-{abs(hash(str(target))) % 10**8}.log")
    ready = log_path.with_suffix(".ready.json")
    ready.unlink(missing_ok=True)
    # -P: never import from the current directory (a stray ./fs3 there must not shadow the package).
    # --nonempty: the command that started this daemon has judged the mount point already.
    args = [sys.executable, "-P", "-m", "fs3.cli.main", "mount", mgmtd, str(target), "--foreground", "--nonempty",
            "--ready-file", str(ready), "--transport", options.transport, "--log-level", options.log_level,
            "--readahead-kb", str(options.readahead_kb), "--entry-timeout-s", str(options.entry_timeout_s),
            "--attr-timeout-s", str(options.attr_timeout_s), "--metrics-port", str(options.metrics_port),
            "--metrics-host", options.metrics_host, "--created-entry-timeout-s",
            str(options.created_entry_timeout_s), "--workers", str(options.workers),
            "--worker-timeout-s", str(options.worker_timeout_s)]
    if not options.usrbio:
        args.append("--no-usrbio")
    if options.usrbio_dir:
        args += ["--usrbio-dir", options.usrbio_dir]
    if options.allow_other is not None:
        args.append("--allow-other" if options.allow_other else "--no-allow-other")
    if not options.batched_closes:
        args.append("--no-batched-closes")
    if options.tls is not None:  # file names only: the key stays in its file
        for key in ("ca_file", "cert_file", "key_file", "server_name"):
            if getattr(options.tls, key):
                args += [f"--tls-{key.replace('_', '-')}", getattr(options.tls, key)]
    env = dict(os.environ)
    if options.token_file:
        args += ["--token-file", str(Path(options.token_file).resolve())]
    elif options.token:
        env["FS3_TOKEN"] = options.token  # never in the arguments: ps shows those to every user
    with log_path.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise Unavailable(f"the mount daemon exited ({proc.returncode}):\n{tail}")
        if ready.exists() and is_mounted(target):
            return proc.pid
        time.sleep(0.05)
    proc.terminate()
    raise Unavailable(f"{target} was not mounted within {timeout_s}s (log: {log_path})")

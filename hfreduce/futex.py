"""Sleeping on a 32-bit word of shared memory until another process changes it (Linux futexes).

The ranks of a node talk only through shared memory: no sockets, no pipes. A waiter reads a
*doorbell* word, checks its condition, and sleeps in ``FUTEX_WAIT`` while the word still holds what it
read; a signaller publishes its counters first and then writes a new value to the doorbell and calls
``FUTEX_WAKE``. The futex is the shared (not ``_PRIVATE``) kind, keyed by the physical page, so it
works across processes that map the same segment. The ``ctypes`` call releases the GIL, so a sleeping
waiter costs its process nothing.

Doorbell values are *tokens*, not counts: each signaller writes ``(signaller id << 24) | its own
sequence``. Incrementing a shared word from several processes without an atomic instruction could
write back a value a waiter had already read (and sleep through the signal); a token from signaller X
differs from every earlier value of the word that X did not write, and from X's own earlier ones.

Ordering: the counters a waiter checks are plain stores to shared memory made *before* the doorbell
store by the same thread. x86-64 keeps stores in order (TSO) and the wake is a system call (a full
barrier), which is what this relies on (docs/decisions.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform

import numpy as np

__all__ = ["Doorbell"]

_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_SYSCALL_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libc() -> ctypes.CDLL:
    name = ctypes.util.find_library("c") or "libc.so.6"
    return ctypes.CDLL(name, use_errno=True)


_LIBC = _load_libc()
_SYSCALL = _LIBC.syscall
_SYSCALL.restype = ctypes.c_long
_SYS_FUTEX = _SYSCALL_FUTEX.get(platform.machine().lower())


class Doorbell:
    """One 32-bit word in a shared mapping that waiters sleep on and signallers ring."""

    def __init__(self, word: np.ndarray, signaller_id: int) -> None:
        if word.dtype != np.uint32 or word.shape != (1,):
            raise ValueError("a doorbell is one uint32 word")
        if not 0 <= signaller_id < 256:
            raise ValueError(f"signaller id {signaller_id} is outside 0..255")
        if _SYS_FUTEX is None:
            raise OSError(errno.ENOSYS, f"futexes on {platform.machine()} are not supported")
        self._word = word
        self._address = ctypes.c_void_p(word.ctypes.data)
        self._token_base = signaller_id << 24
        self._sequence = 0

    def read(self) -> int:
        """The value to pass to :meth:`wait` (read it *before* checking the condition)."""
        return int(self._word[0])

    def ring(self) -> None:
        """Announce that counters changed: a fresh token, then wake every sleeper."""
        self._sequence = (self._sequence + 1) & 0xFFFFFF
        self._word[0] = self._token_base | self._sequence
        _SYSCALL(_SYS_FUTEX, self._address, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def wait(self, seen: int, timeout_s: float) -> None:
        """Sleep while the word still holds ``seen``, at most ``timeout_s`` (a spurious return is fine)."""
        whole = int(timeout_s)
        timeout = _Timespec(whole, int((timeout_s - whole) * 1e9))
        result = _SYSCALL(_SYS_FUTEX, self._address, _FUTEX_WAIT, ctypes.c_uint32(seen), ctypes.byref(timeout),
                          None, 0)
        if result == -1:
            code = ctypes.get_errno()
            if code not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
                raise OSError(code, os.strerror(code))

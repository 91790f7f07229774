"""Claims: which meta server works on a shared thing, recorded in the database they all share.

Several meta servers serve one namespace over one transactional store. Most of what they do is
a transaction and needs no coordination: two servers running the same operation conflict, and
one of them retries. The exceptions are jobs whose work happens *outside* the store, on storage:
an inode's truncate job (trim a chunk, remove the chunks past the new end), the GC of a deleted
file's chunks, a length probe, the clean-up after an expired client. Two servers running one of
those at once can undo each other's work or a client's: a truncate job that read its record
before another server finished the same job goes on removing chunks a client has written since.
Inside one process an ``asyncio.Lock`` per inode prevents that; across processes a **claim**
does: a record ``CLAM<name>`` saying which server holds the thing, and an ``epoch`` its holder
bumps while it works.

Time. Nothing compares one server's clock with another's, and no wall clock is read: a claim is
timed the way client leases are (:meth:`fs3.meta.jobs.MetaJobs.prune_clients_once`), by epochs.

* The holder bumps the epoch every ``ttl / 4`` while it works, and trusts its claim only until
  ``ttl / 2`` after it *began* the last transaction that bumped it, on its own monotonic clock
  (:meth:`Held.check`): work between two pages of storage calls stops once that has passed.
* Another server takes a claim over only once it has seen the same ``(owner, epoch)`` for
  ``ttl`` of its own monotonic clock, counted from a read that came after the bump it saw.

The holder's trust starts before its bump commits, the other's count after it was read, so the
holder stops trusting its claim ``ttl / 2`` before anyone may take it over, with room for the
two clocks' rates to differ by almost a factor of two. A server that dies (or is cut off from
the database) stops bumping, and its claims are taken over a ``ttl`` later.

A claim's owner is the server's id: its mgmtd node id for a meta process, so that a server
restarted after a crash takes back at once the claims its previous life held (that life is
dead) instead of waiting a ttl for them. Two live servers must never share an id.

A store that only one server can open (the embedded RocksDB: its lock keeps a second process out)
needs no claims: the table is then ``exclusive`` and a claim is granted at once, with no
transaction — the per-inode lock in the process is all the coordination there is to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fs3.common.clock import Clock
from fs3.common.errors import FS3Error, InvalidArgument, Unavailable
from fs3.kv.api import Transaction, TxnEngine
from fs3.kv.txn import run_transaction

__all__ = ["CLAIM", "ClaimRecord", "ClaimTable", "Held", "claim_key", "client_claim", "inode_claim"]

log = logging.getLogger(__name__)

CLAIM = b"CLAM"
# Waiting for another server's claim polls the record: from this often, growing to the cap.
_POLL_MS = 5
_POLL_MAX_MS = 200
# Others' claims remembered at most (observations older than two ttls are dropped first).
_SEEN_MAX = 10_000


def claim_key(name: bytes) -> bytes:
    return CLAIM + name


def inode_claim(inode_id: int) -> bytes:
    """The claim on an inode's storage side: its truncate job, GC and length probes."""
    return b"I" + inode_id.to_bytes(8, "big")


def client_claim(client_id: bytes) -> bytes:
    """The claim on an expired client's clean-up (its sessions closed, its answers dropped)."""
    return b"C" + client_id


@dataclass(frozen=True)
class ClaimRecord:
    owner: bytes
    epoch: int

    _FMT = struct.Struct(">Q")

    def encode(self) -> bytes:
        return self._FMT.pack(self.epoch) + self.owner

    @classmethod
    def decode(cls, raw: bytes) -> ClaimRecord:
        (epoch,) = cls._FMT.unpack_from(raw)
        return cls(bytes(raw[cls._FMT.size:]), int(epoch))


@dataclass
class Held:
    """A claim this server holds: the epoch it last wrote and when it began writing it."""

    name: bytes
    epoch: int
    trusted_from_ms: int
    table: ClaimTable
    lost: bool = False

    def valid(self) -> bool:
        if self.table.exclusive:
            return not self.lost
        return (not self.lost and self.table.clock.now_ms() - self.trusted_from_ms < self.table.ttl_ms // 2
                and self.table.owner_is_mine())

    def check(self) -> None:
        """Raise before work that another server could be doing too: the claim is no longer
        surely this server's (it could not renew it in time, or it was taken over)."""
        if not self.valid():
            raise Unavailable(f"this meta server's claim on {self.name.hex()} lapsed: the work is left to "
                              "the server that takes it over")


class ClaimTable:
    """The claims of one meta server (see the module's docstring)."""

    def __init__(self, engine: TxnEngine, owner: bytes, clock: Clock, ttl_ms: int, exclusive: bool = False) -> None:
        if ttl_ms < 40:
            raise InvalidArgument("a claim's ttl must be at least 40 ms")
        if not owner:
            raise InvalidArgument("a claim owner id must not be empty")
        self.engine = engine
        self.owner = owner
        self.clock = clock
        self.ttl_ms = ttl_ms
        # Others' claims: name -> (owner, epoch, when this server first saw that pair).
        self._seen: dict[bytes, tuple[bytes, int, int]] = {}
        self.held: dict[bytes, Held] = {}
        self.taken_over = 0  # claims of other servers this one took over (for tests and logs)
        self.exclusive = exclusive  # no other server can open the store: claims cost nothing
        # Whether the owner id is surely this process's now (a meta server on a shared store: its
        # node id's registration, fs3.meta.registration). A claim recorded under the id is taken
        # at once, so a server that may have lost its id to another process takes no claim,
        # renews none and trusts none it holds: the other one may hold them too. None: always.
        self.owner_trusted: Callable[[], bool] | None = None

    def owner_is_mine(self) -> bool:
        """Whether this table may act under its owner id now (see ``owner_trusted``)."""
        return self.owner_trusted is None or self.owner_trusted()

    async def try_claim(self, name: bytes) -> Held | None:
        """Claim ``name`` if it is free, this server's, or another's that lapsed; None if another
        server holds it. The caller makes sure one task of this process claims a name at a time."""
        if self.exclusive:
            held = Held(name, 0, self.clock.now_ms(), self)
            self.held[name] = held
            return held
        if not self.owner_is_mine():
            return None  # another process may act under this id: its claims look like this one's
        key = claim_key(name)
        began_ms = self.clock.now_ms()
        lapsed: list[ClaimRecord] = []  # the other server's claim this one takes over

        async def claim(txn: Transaction) -> int | None:
            lapsed.clear()
            raw = await txn.get(key)
            if raw is None:
                # A fresh claim starts at a random epoch: one that restarted at 1 after a release
                # would look, to a server that saw (owner, 1) before, unchanged since then — lapsed.
                epoch = _fresh_epoch()
                txn.put(key, ClaimRecord(self.owner, epoch).encode())
                return epoch
            record = ClaimRecord.decode(raw)
            if record.owner != self.owner:
                if not self._lapsed(name, record, self.clock.now_ms()):
                    return None
                lapsed.append(record)
            txn.put(key, ClaimRecord(self.owner, record.epoch + 1).encode())
            return record.epoch + 1

        epoch = await run_transaction(self.engine, claim)
        if epoch is None:
            return None
        self._seen.pop(name, None)
        if lapsed:
            self.taken_over += 1
            log.info("took over claim %s of meta server %s (epoch %d unchanged for a ttl)", name.hex(),
                     lapsed[0].owner.hex(), lapsed[0].epoch)
        held = Held(name, epoch, began_ms, self)
        self.held[name] = held
        return held

    def _lapsed(self, name: bytes, record: ClaimRecord, now_ms: int) -> bool:
        seen = self._seen.get(name)
        if seen is None or seen[:2] != (record.owner, record.epoch):
            if len(self._seen) >= _SEEN_MAX:
                self._forget_old(now_ms)
            self._seen[name] = (record.owner, record.epoch, now_ms)
            return False
        return now_ms - seen[2] > self.ttl_ms

    def _forget_old(self, now_ms: int) -> None:
        for name, (_, _, first_ms) in list(self._seen.items()):
            if now_ms - first_ms > 2 * self.ttl_ms:
                del self._seen[name]
        while len(self._seen) >= _SEEN_MAX:
            del self._seen[next(iter(self._seen))]

    async def claim(self, name: bytes, wait_ms: int) -> Held:
        """Claim ``name``, waiting while another server holds it: until it releases the claim, or
        its claim lapses (a ``ttl`` without a renewal), for at most ``wait_ms``."""
        start = self.clock.now_ms()
        poll_ms = _POLL_MS
        while True:
            held = await self.try_claim(name)
            if held is not None:
                return held
            if self.clock.now_ms() - start > wait_ms:
                raise Unavailable(f"another meta server holds the claim on {name.hex()}; try again")
            await asyncio.sleep(poll_ms / 1000)
            poll_ms = min(poll_ms * 2, _POLL_MAX_MS)

    async def renew(self, held: Held) -> bool:
        """Bump the epoch of a claim this server holds; False (and ``held.lost``) if it was taken."""
        if self.exclusive:
            return not held.lost
        if not self.owner_is_mine():
            raise Unavailable(f"not renewing claim {held.name.hex()}: this server's id is not surely its own now")
        key = claim_key(held.name)
        began_ms = self.clock.now_ms()

        async def bump(txn: Transaction) -> bool:
            raw = await txn.get(key)
            if raw is not None and ClaimRecord.decode(raw) == ClaimRecord(self.owner, held.epoch + 1):
                return True  # an earlier try of this bump landed (its commit was "maybe committed")
            if raw is None or ClaimRecord.decode(raw) != ClaimRecord(self.owner, held.epoch):
                return False
            txn.put(key, ClaimRecord(self.owner, held.epoch + 1).encode())
            return True

        if not await run_transaction(self.engine, bump):
            held.lost = True
            return False
        held.epoch += 1
        held.trusted_from_ms = began_ms
        return True

    async def release(self, held: Held) -> None:
        """Drop the claim if it is still this server's (a lost one belongs to whoever took it)."""
        key = claim_key(held.name)
        self.held.pop(held.name, None)
        if held.lost or self.exclusive:
            held.lost = True
            return

        async def drop(txn: Transaction) -> None:
            raw = await txn.get(key)
            if raw is not None and ClaimRecord.decode(raw) == ClaimRecord(self.owner, held.epoch):
                txn.delete(key)

        held.lost = True
        await run_transaction(self.engine, drop)

    async def _keep_renewed(self, held: Held) -> None:
        while not held.lost:
            await asyncio.sleep(self.ttl_ms / 4 / 1000)
            try:
                if not await self.renew(held):
                    log.warning("claim %s was taken over by another meta server", held.name.hex())
                    return
            except FS3Error as exc:
                log.warning("renewing claim %s failed: %s", held.name.hex(), exc)

    @contextlib.asynccontextmanager
    async def holding(self, held: Held) -> AsyncIterator[Held]:
        """Keep ``held`` renewed while the body runs, then release it (a release that cannot be
        made lets the claim lapse instead: another server takes it over a ``ttl`` later)."""
        if self.exclusive:
            try:
                yield held
            finally:
                await self.release(held)
            return
        renewer = asyncio.create_task(self._keep_renewed(held), name=f"claim-{held.name.hex()}")
        try:
            yield held
        finally:
            renewer.cancel()
            cancelled_meanwhile = False
            try:
                await renewer
            except asyncio.CancelledError:
                # The renewer's own cancel, or (while this waited for it) one of this task: that
                # one must not be lost, or a job being stopped would go on — raised after release.
                task = asyncio.current_task()
                cancelled_meanwhile = task is not None and task.cancelling() > 0
            except Exception:  # a renewal's failure was logged; the claim is released below
                pass
            try:
                await self.release(held)
            except (FS3Error, asyncio.CancelledError) as exc:
                self.held.pop(held.name, None)
                log.warning("releasing claim %s failed (it lapses instead): %r", held.name.hex(), exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
            if cancelled_meanwhile:
                raise asyncio.CancelledError


def _fresh_epoch() -> int:
    """A claim's first epoch: random (48 bits), so an (owner, epoch) pair is never seen twice."""
    return int.from_bytes(os.urandom(6), "big") + 1

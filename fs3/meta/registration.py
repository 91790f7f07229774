"""One live meta server per node id on a shared database.

Several meta servers may share one database, each with its own node id (``MetaConfig.node_id``).
The id is more than a name in mgmtd's list: it is the owner of the server's claims
(:mod:`fs3.meta.claims`), so that a server restarted after a crash takes back at once what its
previous life held. Two *live* servers with one id would therefore each take the other's claims
as their own, and run one truncate job twice. So a meta server on a shared database holds its
node id as a claim of its own (``CLAM`` + ``N`` + the id), whose owner is this *process* (host,
pid, and random bytes: never the same twice), timed like every claim, by epochs, never by clocks:

* **Start.** The server reads the record. Free (or released by a clean stop): it takes it. Held
  by another process: it watches the record; if the holder bumps it (a live server renews every
  ``ttl / 4``), the start is refused at once with :class:`~fs3.common.errors.AlreadyExists`
  naming the id and the holder; if the record stands still for a whole ``ttl`` of this server's
  monotonic clock (the holder died: a crash, a kill), it takes it over, in a transaction that
  commits only if the record still reads the same. Nothing is written before that, so a refused
  server leaves the database as it found it, and a restarted one waits one ``ttl`` at most.
* **Life.** The holder bumps the record every ``ttl / 4`` (:meth:`ClaimTable.renew`). Should it
  find the record taken (it was cut off from the database, or paused, for a whole ``ttl``, and
  another process with its id started meanwhile), it has lost its id: :meth:`NodeRegistration.keep`
  returns and the server stops. Its claims' trust had run out by then (``ttl / 2`` after their
  last bump, and the claims' ttl is this one), so the newcomer taking them back does not overlap
  work the old one still trusted.
* **Stop.** A clean stop deletes the record (if still its own), so a restart is immediate.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass

from fs3.common.clock import Clock
from fs3.common.errors import AlreadyExists, FS3Error, InvalidArgument
from fs3.kv.api import Transaction, TxnEngine
from fs3.kv.txn import run_transaction
from fs3.meta.claims import ClaimRecord, ClaimTable, Held, claim_key

__all__ = ["NodeRegistration", "node_id_claim"]

log = logging.getLogger(__name__)

# How often a starting server reads a record held by another process, in parts of the ttl: the
# holder bumps it every ttl / 4, so a live holder is seen within about a third of the ttl.
_WATCH_PARTS = 8


def node_id_claim(node_id: int) -> bytes:
    """The claim name of a meta node id (under the claims' ``CLAM`` prefix)."""
    if not 0 < node_id < 1 << 32:
        raise InvalidArgument(f"meta node id {node_id} outside [1, 2^32)")
    return b"N" + node_id.to_bytes(4, "big")


def _process_owner() -> bytes:
    """This process as a claim owner: readable (host and pid, for the refusal's message) and unique
    (random bytes: a pid reused on the same host is another owner)."""
    return f"{socket.gethostname()}/pid {os.getpid()}/{os.urandom(6).hex()}".encode()


@dataclass
class _Watched:
    record: ClaimRecord
    since_ms: int  # when this server first read it so, on its own clock


class NodeRegistration:
    """Holds one meta node id on a shared engine for this process's life (see the module's docstring)."""

    def __init__(self, engine: TxnEngine, node_id: int, clock: Clock, ttl_ms: int, owner: bytes | None = None) -> None:
        self.node_id = node_id
        self.name = node_id_claim(node_id)
        self.table = ClaimTable(engine, owner or _process_owner(), clock, ttl_ms)
        self.held: Held | None = None

    @property
    def owner(self) -> bytes:
        return self.table.owner

    async def acquire(self) -> None:
        """Take the node id, waiting at most about one ttl for a holder that stopped renewing;
        :class:`AlreadyExists` naming the id if a live server holds it. Writes only when it takes it."""
        clock, ttl_ms = self.table.clock, self.table.ttl_ms
        watched: _Watched | None = None
        key = claim_key(self.name)
        while True:
            began_ms = clock.now_ms()
            raw = await run_transaction(self.table.engine, lambda txn: txn.get(key))
            record = ClaimRecord.decode(raw) if raw is not None else None
            now_ms = clock.now_ms()
            if record is not None and record.owner != self.owner:
                if watched is not None and watched.record != record:
                    raise self._in_use(record, "its registration was renewed while this server watched it")
                if watched is None:
                    watched = _Watched(record, now_ms)
                elif now_ms - watched.since_ms > ttl_ms:
                    if await self._take(record, began_ms):
                        log.warning("meta node id %d: took over the registration of %s, unchanged for %d ms "
                                    "(that server died)", self.node_id, record.owner.decode(errors="replace"),
                                    now_ms - watched.since_ms)
                        return
                    continue  # changed under the take: the next read tells by whom
                await asyncio.sleep(ttl_ms / _WATCH_PARTS / 1000)
                continue
            if await self._take(record, began_ms):
                return

    def _in_use(self, record: ClaimRecord, why: str) -> AlreadyExists:
        return AlreadyExists(f"meta node id {self.node_id} is in use by a live meta server "
                             f"({record.owner.decode(errors='replace')}): {why}; give every meta server on one "
                             f"database its own node_id (nothing was written)")

    async def _take(self, expected: ClaimRecord | None, began_ms: int) -> bool:
        """Write this process's record if the record still reads ``expected``; whether it did."""
        key = claim_key(self.name)
        epoch = (expected.epoch + 1) if expected is not None else int.from_bytes(os.urandom(6), "big") + 1
        mine = ClaimRecord(self.owner, epoch)

        async def take(txn: Transaction) -> bool:
            raw = await txn.get(key)
            now = ClaimRecord.decode(raw) if raw is not None else None
            if now == mine:
                return True  # an earlier try of this take landed (its commit was "maybe committed")
            if now != expected:
                return False
            txn.put(key, mine.encode())
            return True

        if not await run_transaction(self.table.engine, take):
            return False
        self.held = Held(self.name, epoch, began_ms, self.table)
        self.table.held[self.name] = self.held
        return True

    async def keep(self) -> None:
        """Renew the registration every ttl / 4 while it is this process's; returns once another
        process took it over (this server must stop: two live servers must not share an id)."""
        held = self.held
        if held is None:
            raise InvalidArgument("keep() before acquire()")
        while True:
            await asyncio.sleep(self.table.ttl_ms / 4 / 1000)
            try:
                if not await self.table.renew(held):
                    log.error("meta node id %d was taken over by another meta server: this one stops",
                              self.node_id)
                    return
            except FS3Error as exc:
                log.warning("renewing the registration of meta node id %d failed: %s", self.node_id, exc)

    async def release(self) -> None:
        """Delete the registration if it is still this process's: a restart takes it at once."""
        held, self.held = self.held, None
        if held is not None:
            await self.table.release(held)

"""Serializable transactions on PostgreSQL: the :class:`~fs3.kv.api.TxnEngine` for several meta servers.

The namespace lives in one ordered table, ``fs3_kv (k bytea PRIMARY KEY, v bytea)``: a get is a
primary-key lookup, a scan an index range scan in ``bytea`` order (byte-wise, the order the
embedded engine keeps). Every transaction runs at ``SERIALIZABLE``: PostgreSQL's serializable
snapshot isolation detects the conflicts that :class:`~fs3.kv.txn.OptimisticTxnEngine` detects by
itself, and reports them as SQLSTATE 40001/40P01, which become :class:`TxnConflict`.

Round trips are what a networked engine costs, so each transaction spends as few as it can, and
the engine counts them (``round_trips``):

* ``BEGIN ISOLATION LEVEL SERIALIZABLE`` travels with the transaction's first read (libpq pipeline
  mode: several statements, one flush, one wait), so a read costs one round trip, the first too.
* Writes are buffered here, as the optimistic engine buffers them, and the transaction's own reads
  see them (scans merge them in key order). ``commit`` sends them all with the ``COMMIT``: one
  upsert of every put (``unnest`` of two arrays), one delete of every deleted key (``= ANY``), and
  the ``COMMIT``, pipelined: one round trip. A transaction that only wrote adds its ``BEGIN`` to
  that same flush.
* Keys and ranges announced before they are read (``prefetch``, ``prefetch_scan``: meta's path
  hints guess a whole path walk) ride with the next read, and a key is fetched once per
  transaction (a read cache: one snapshot, the answer cannot change).
* A transaction that read and wrote nothing costs nothing; one that only read commits with one
  round trip (SERIALIZABLE data is only final once the reader's commit succeeded: a reader that
  rolls back is forgotten by SSI, and what it saw may fit no serial order; ``reads_commit`` tells
  meta to commit its read-only requests). A transaction dropped without a commit gives its
  connection back to the pool, which sends the ``ROLLBACK`` off its caller's path.

Point reads lock hash buckets: SERIALIZABLE's predicate lock on a btree is its leaf page, whether
the key read is there or not, and a page holds the neighbours that other clients insert (the next
inode ids, sessions, saved answers, the entries of adjacent directories), so through the primary
key concurrent creates in different directories abort one another. Point reads and deletes go
through a hash index on ``k || ''`` (``fs3_kv_point``; an expression the btree cannot serve, so no
plan falls back to it), whose lock is one bucket; range scans keep the btree (their lock covers
the range, as it must). A hash index gets its bucket count from its table's estimated size when it
is built, so it is built over placeholder rows deleted in the same transaction; sessions plan no
sequential scans (a lock on the whole table). docs/decisions.md has the measurements.

Failures: a serialization failure or deadlock (and a unique violation, which concurrent upserts
can raise under SERIALIZABLE) is :class:`TxnConflict`; a connection lost while the ``COMMIT`` was
in flight is :class:`MaybeCommitted` (the meta operations are idempotent for it, and
:func:`~fs3.kv.txn.run_transaction` retries both); a connection lost before the commit is a
conflict too (nothing was written, running the transaction again is the cure); a statement that
ran past ``statement_timeout_ms`` is :class:`Timeout`. A pooled connection found dead before a
transaction used it (the server restarted) is replaced without the caller seeing it. A round trip
that gets no answer within ``round_trip_timeout_ms`` (a server cut off by the network: TCP alone
would wait for minutes, holding the pooled connection) closes its connection and is
:class:`Unavailable`, or :class:`MaybeCommitted` when the ``COMMIT`` was in it; so is a caller's
cancel, which re-raises after the connection is closed (its protocol state is unknown mid-flush).

Durability: with ``sync`` the sessions run ``synchronous_commit = on``, so a ``COMMIT`` that
returned is durable (and replicated, if the server is configured to wait for standbys):
``wait_durable`` has nothing to wait for. Without ``sync``, ``synchronous_commit = off``.

At start (:meth:`PostgresTxnEngine.open`) the schema is checked in one transaction: an empty
database gets the tables and the ``fs3_info`` rows (schema version, cluster id); a database of
another schema version or of another cluster is refused with a clear error and nothing written.

An engine belongs to the event loop that opened it (its connections are that loop's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import select
import socket
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus

from fs3.common.errors import FS3Error, InvalidArgument, MaybeCommitted, Timeout, TxnConflict, Unavailable
from fs3.common.retry import Backoff, RetryPolicy
from fs3.kv.gate import ContentionGate
from fs3.kv.txn import TxnFaults

__all__ = ["SCHEMA_VERSION", "PostgresConfig", "PostgresTxnEngine", "redact_message", "redact_url"]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_TABLE = "fs3_kv"
_INFO = "fs3_info"
_BEGIN = b"BEGIN ISOLATION LEVEL SERIALIZABLE"
# Point reads and deletes go through a hash index on ``k || ''`` (an expression the primary key's
# btree cannot serve, so the planner cannot pick the btree): see "Point reads lock hash buckets" in
# the module's docstring.
_POINT_INDEX = "fs3_kv_point"
_POINT_INDEX_DDL = (b"CREATE INDEX IF NOT EXISTS fs3_kv_point ON fs3_kv USING hash ((k || ''::bytea)) "
                    b"WITH (fillfactor = 10)")
# A hash index starts with as many buckets as its table is estimated to hold rows when it is built,
# and a bucket is what a point read locks: the index is built over this many placeholder rows
# (keys no fs3 key can equal, deleted in the same transaction, never seen by anyone), so that a
# new, small namespace starts with thousands of buckets rather than a few dozen.
# The estimate is pages times the rows a page holds by the columns' typical widths, so wide rows
# (just below the size PostgreSQL compresses or moves out of line) make it cheaply: 4,000 rows of
# 1,900 bytes (1,000 pages) give 2,048 buckets in about a tenth of a second.
_POINT_BUCKETS_ROWS = 4_000
_SCHEMA_TIMEOUT_MS = 120_000
_PLACEHOLDERS = (b"INSERT INTO fs3_kv (k, v) SELECT '\\xfffe'::bytea || int4send(g), "
                 b"convert_to(repeat('x', 1900), 'UTF8') FROM generate_series(1, %s) AS g")
_DROP_PLACEHOLDERS = b"DELETE FROM fs3_kv WHERE k >= '\\xfffe'::bytea AND k < '\\xffff'::bytea"
_GET = b"SELECT v FROM fs3_kv WHERE (k || ''::bytea) = %s"
# Several keys: a bitmap scan of the hash index (hash indexes take no arrays in a plain index scan;
# the bitmap heap scan locks the tuples it returns, as an index scan does). A join with ``unnest``
# plans nested index scans too, at a third more server CPU per statement (measured).
_GET_MANY = b"SELECT k, v FROM fs3_kv WHERE (k || ''::bytea) = ANY(%s::bytea[])"
_SCAN = {  # (has end, has limit) -> statement
    (False, False): b"SELECT k, v FROM fs3_kv WHERE k >= %s ORDER BY k",
    (True, False): b"SELECT k, v FROM fs3_kv WHERE k >= %s AND k < %s ORDER BY k",
    (False, True): b"SELECT k, v FROM fs3_kv WHERE k >= %s ORDER BY k LIMIT %s",
    (True, True): b"SELECT k, v FROM fs3_kv WHERE k >= %s AND k < %s ORDER BY k LIMIT %s",
}
_UPSERT = (b"INSERT INTO fs3_kv (k, v) SELECT * FROM unnest(%s::bytea[], %s::bytea[]) "
           b"ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v")
_DELETE = b"DELETE FROM fs3_kv WHERE (k || ''::bytea) = ANY(%s::bytea[])"
_SCHEMA_LOCK = 0x66733353434845  # "fs3SCHE": the advisory lock of the schema check
_CONFLICT_STATES = frozenset({"40001", "40P01", "23505"})
_DELETED = object()


def redact_url(url: str) -> str:
    """The URL with its password replaced, for messages and logs: in the user part and in a
    ``password=`` parameter; a URL that does not parse is not shown at all."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<a URL that does not parse>"
    if "://" not in url:
        return "<not a URL>"
    if password is not None:
        # The user ends at the userinfo's first colon: a password may hold colons of its own.
        netloc = parts.netloc.rsplit("@", 1)
        parts = parts._replace(netloc=netloc[0].partition(":")[0] + ":***@" + netloc[1])
    if parts.query:
        parts = parts._replace(query=re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", parts.query))
    return urlunsplit(parts)


def redact_message(message: str, url: str) -> str:
    """``message`` (a driver's error about ``url``) with the URL's password replaced: libpq quotes
    the part of a URL it cannot parse (a bad percent escape), the password included."""
    secrets: set[str] = set()
    with contextlib.suppress(ValueError):
        parts = urlsplit(url)
        userinfo = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
        if ":" in userinfo:
            secrets.add(userinfo.partition(":")[2])
        secrets.update(re.findall(r"(?i)(?:^|&)password=([^&]*)", parts.query))
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        message = message.replace(secret, "***")
        with contextlib.suppress(ValueError):
            plain = unquote(secret, errors="strict")
            if plain:
                message = message.replace(plain, "***")
    return message


def _conninfo(url: str) -> str:
    """A libpq URI from ``postgresql://``, ``postgres://`` or a SQLAlchemy ``postgresql+driver://`` URL."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.split("+", 1)[0] not in ("postgresql", "postgres"):
        raise InvalidArgument(f"pg_url {redact_url(url)!r}: expected postgresql://user:password@host:port/database")
    return "postgresql://" + rest


@dataclass(frozen=True)
class PostgresConfig:
    """How the engine talks to the server. ``pool_size_max`` bounds the connections (one per
    transaction in flight); ``acquire_timeout_ms`` bounds the wait for one when all are busy."""

    url: str = field(repr=False)  # may carry a password
    cluster_id: str = "fs3"
    sync: bool = True
    pool_size_max: int = 16
    statement_timeout_ms: int = 5_000
    # The client's own deadline on one flush (0: statement_timeout_ms + 2 s): a statement the
    # server cancels at statement_timeout answers before it; past it, the server or the path to it is gone.
    round_trip_timeout_ms: int = 0
    connect_timeout_ms: int = 10_000
    acquire_timeout_ms: int = 10_000
    # A transaction left open (a caller that never committed nor dropped it) is ended by the server.
    idle_in_transaction_timeout_ms: int = 60_000

    def validate(self) -> None:
        _conninfo(self.url)
        if not 1 <= self.pool_size_max <= 1_000:
            raise InvalidArgument("pool_size_max must be within [1, 1000]")
        for name in ("statement_timeout_ms", "connect_timeout_ms", "acquire_timeout_ms",
                     "idle_in_transaction_timeout_ms"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be positive")
        if not self.cluster_id:
            raise InvalidArgument("cluster_id must not be empty")
        if self.round_trip_timeout_ms and self.round_trip_timeout_ms <= self.statement_timeout_ms:
            raise InvalidArgument("round_trip_timeout_ms must exceed statement_timeout_ms (the server cancels first)")

    @property
    def round_trip_deadline_ms(self) -> int:
        """How long one flush may wait for its answers."""
        return self.round_trip_timeout_ms or self.statement_timeout_ms + 2_000


class _Conn:
    """A pooled connection; ``dirty``: a transaction may be open on it (ROLLBACK before reuse)."""

    __slots__ = ("dirty", "pg")

    def __init__(self, pg: psycopg.AsyncConnection[Any]) -> None:
        self.pg = pg
        self.dirty = False

    def stale(self) -> bool:
        """Whether the server has closed (or written to) this idle connection: an idle connection
        with something to read holds an error or end-of-file (a restarted or terminated server)."""
        if self.pg.closed or self.pg.broken:
            return True
        try:
            readable, _, _ = select.select([self.pg.fileno()], [], [], 0)
        except (OSError, ValueError, psycopg.Error):
            return True
        return bool(readable)


class _Pool:
    """A bounded LIFO pool (the most recently used connection is warm in the server's caches).
    Futures, not asyncio locks, queue the waiters: nothing here is bound to one event loop."""

    def __init__(self, config: PostgresConfig) -> None:
        self.config = config
        self._conninfo = _conninfo(config.url)
        self._idle: list[_Conn] = []
        self._open = 0
        self._waiters: deque[asyncio.Future[_Conn | None]] = deque()
        self._closed = False
        self._rolling_back: set[asyncio.Task[None]] = set()
        self.rollbacks = 0

    async def connect(self) -> psycopg.AsyncConnection[Any]:
        """A new session. No server-side prepared statements: a pipeline that fails part-way
        leaves psycopg's cache believing in statements the server never prepared (error 26000
        on their next use); the statements here are small, their parse is cheap."""
        cfg = self.config
        options = (f"-c statement_timeout={cfg.statement_timeout_ms} "
                   f"-c idle_in_transaction_session_timeout={cfg.idle_in_transaction_timeout_ms} "
                   f"-c synchronous_commit={'on' if cfg.sync else 'off'} "
                   # A sequential scan would lock the whole table against every writer (the
                   # docstring's "Point reads lock hash buckets"); the indexes serve every statement.
                   f"-c enable_seqscan=off")
        try:
            return await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, connect_timeout=max(1, cfg.connect_timeout_ms // 1000),
                options=options, application_name="fs3-meta", prepare_threshold=None,
                # A dead peer on an idle pooled connection is found by the kernel within a minute.
                keepalives=1, keepalives_idle=20, keepalives_interval=5, keepalives_count=4)
        except psycopg.OperationalError as exc:
            raise Unavailable(f"cannot connect to PostgreSQL at {redact_url(cfg.url)}: "
                              f"{redact_message(_first_line(exc), cfg.url)}") from None

    async def acquire(self) -> _Conn:
        if self._closed:
            raise Unavailable("the PostgreSQL engine is closed")
        while self._idle:
            conn = self._idle.pop()
            if not conn.stale():
                return conn
            self._discard(conn)
        if self._open < self.config.pool_size_max:
            self._open += 1
            try:
                return _Conn(await self.connect())
            except BaseException:
                self._open -= 1
                self._wake()
                raise
        waiter: asyncio.Future[_Conn | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that arrives as
            # the connection is handed over, and on 3.12 it drops the handed connection.
            async with asyncio.timeout(self.config.acquire_timeout_ms / 1000):
                handed = await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                # Handed a connection (or a free slot) just as the wait ended: pass it on.
                given = waiter.result()
                if given is not None:
                    self.release(given)
                else:
                    self._wake()
            if isinstance(exc, TimeoutError):
                raise Unavailable(f"no PostgreSQL connection free within {self.config.acquire_timeout_ms} ms "
                                  f"(pool_size_max {self.config.pool_size_max})") from None
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
        return handed if handed is not None else await self.acquire()

    def release(self, conn: _Conn) -> None:
        """Give a connection back (a broken one is closed; its slot goes to a waiter)."""
        if self._closed or conn.pg.closed or conn.pg.broken:
            self._discard(conn)
            return
        if not conn.dirty and conn.pg.info.transaction_status != TransactionStatus.IDLE:
            conn.dirty = True
        if conn.dirty and conn.pg.info.transaction_status == TransactionStatus.INTRANS:
            # A transaction left open (dropped uncommitted: meta's reads) would keep its snapshot
            # and its predicate locks until the connection's next use, and the writers that
            # overlap it would be aborted as pivots: end it now, off its caller's path.
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                task = loop.create_task(self._roll_back(conn))
                self._rolling_back.add(task)
                task.add_done_callback(self._rolling_back.discard)
                return
        self._hand_over(conn)

    async def settle(self) -> None:
        """Wait for the rollbacks in flight (a dropped transaction's finalizer starts one)."""
        await asyncio.sleep(0)
        while self._rolling_back:
            await asyncio.gather(*self._rolling_back, return_exceptions=True)

    async def _roll_back(self, conn: _Conn) -> None:
        # A round trip like any other, with its deadline: a server cut off by the network would
        # otherwise hold this connection, and its slot, for as long as TCP retransmits (minutes).
        cut = asyncio.get_running_loop().call_later(self.config.round_trip_deadline_ms / 1000, _shut_down, conn)
        try:
            await conn.pg.execute(b"ROLLBACK")
        except psycopg.Error:
            self._discard(conn)
            return
        except asyncio.CancelledError:  # the loop is ending: the slot goes back, the connection with it
            self._discard(conn)
            raise
        finally:
            cut.cancel()
            self.rollbacks += 1
        conn.dirty = False
        self.release(conn)

    def _hand_over(self, conn: _Conn) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append(conn)

    def _discard(self, conn: _Conn) -> None:
        self._open -= 1
        with contextlib.suppress(Exception):
            conn.pg.pgconn.finish()
        self._wake()

    def _wake(self) -> None:
        """A slot came free: let one waiter open a connection of its own."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def terminate(self) -> None:
        """Close every idle connection at once (no event loop needed); busy ones close on release."""
        self._closed = True
        for conn in self._idle:
            with contextlib.suppress(Exception):
                conn.pg.pgconn.finish()
        self._open -= len(self._idle)
        self._idle.clear()
        self._wake()


def _shut_down(conn: _Conn) -> None:
    """End ``conn``'s TCP session in both directions without closing its descriptor (the event loop
    may still watch it): every wait on it then ends with a lost connection."""
    with contextlib.suppress(Exception):
        fd = os.dup(conn.pg.pgconn.socket)
        with socket.socket(fileno=fd) as sock:
            sock.shutdown(socket.SHUT_RDWR)


async def _create_point_index(pg: psycopg.AsyncConnection[Any]) -> None:
    """The point-read index, its buckets sized by placeholder rows (``_POINT_BUCKETS_ROWS``, see
    there), inside the caller's transaction (whose statement timeout is ``_SCHEMA_TIMEOUT_MS``)."""
    await pg.execute(_PLACEHOLDERS, (_POINT_BUCKETS_ROWS,))
    await pg.execute(_POINT_INDEX_DDL)
    await pg.execute(_DROP_PLACEHOLDERS)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _lost(exc: BaseException) -> bool:
    return isinstance(exc, psycopg.OperationalError) and not isinstance(exc, pg_errors.QueryCanceled) \
        and getattr(exc, "sqlstate", None) not in _CONFLICT_STATES


class _Slot:
    """The connection a transaction holds: apart from the transaction, so that a transaction
    dropped without a commit can give it back (a weakref finalizer may not hold the transaction)."""

    __slots__ = ("conn",)

    def __init__(self) -> None:
        self.conn: _Conn | None = None


def _reclaim(pool: _Pool, slot: _Slot) -> None:
    if slot.conn is not None:
        conn, slot.conn = slot.conn, None
        conn.dirty = True
        pool.release(conn)


class _PgTxn:
    def __init__(self, engine: PostgresTxnEngine) -> None:
        self._engine = engine
        self._slot = _Slot()
        self._writes: dict[bytes, object] = {}
        self._cache: dict[bytes, bytes | None] = {}  # point reads (snapshot values), absent ones too
        self._prefetch: list[bytes] = []
        # Scans announced (prefetch_scan) and their stored rows, by (start, end, rows fetched).
        self._scan_prefetch: list[tuple[bytes, bytes | None, int | None]] = []
        self._scans: dict[tuple[bytes, bytes | None, int | None], list[tuple[bytes, bytes]]] = {}
        self._done = False
        weakref.finalize(self, _reclaim, engine._pool, self._slot)

    def _check_open(self) -> None:
        if self._done:
            raise InvalidArgument("transaction already committed or abandoned")

    @property
    def backend_pid(self) -> int | None:
        """The server process serving this transaction (None before its first read)."""
        conn = self._slot.conn
        return None if conn is None else conn.pg.info.backend_pid

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Keys this transaction is about to read: they ride with its next read (one round trip
        for all), and their values are kept for when they are asked for."""
        self._check_open()
        self._prefetch.extend(k for k in keys if k not in self._writes and k not in self._cache)

    async def get(self, key: bytes) -> bytes | None:
        self._check_open()
        if key in self._writes:
            value = self._writes[key]
            return None if value is _DELETED else value  # type: ignore[return-value]
        if key in self._cache:  # one snapshot for the whole transaction: what it read stays true
            return self._cache[key]
        self._prefetch.append(key)
        await self._round_trip([])  # the key goes with the prefetched ones
        return self._cache[key]

    def prefetch_scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> None:
        """A scan this transaction is about to make: it rides with the next read, and its stored
        rows answer the scan when it comes with the same arguments (and as many own deletes in
        the range: they decide how many rows are fetched)."""
        self._check_open()
        if limit is not None and limit <= 0:
            raise InvalidArgument("scan limit must be positive")
        shape = (start, end, self._fetch(start, end, limit))
        if shape not in self._scans:
            self._scan_prefetch.append(shape)

    def _fetch(self, start: bytes, end: bytes | None, limit: int | None) -> int | None:
        """Stored rows a scan needs: each own delete in the range can hide one."""
        if limit is None:
            return None
        return limit + sum(1 for key, value in self._writes.items()
                           if value is _DELETED and key >= start and (end is None or key < end))

    async def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        self._check_open()
        if limit is not None and limit <= 0:
            raise InvalidArgument("scan limit must be positive")
        in_range = [(key, value) for key, value in self._writes.items()
                    if key >= start and (end is None or key < end)]
        fetch = self._fetch(start, end, limit)
        rows = self._scans.pop((start, end, fetch), None)  # announced: fetched with an earlier read
        if rows is None:
            params: list[object] = [start]
            if end is not None:
                params.append(end)
            if fetch is not None:
                params.append(fetch)
            (raw,) = await self._round_trip([(_SCAN[(end is not None, fetch is not None)], params)])
            rows = [(bytes(k), bytes(v)) for k, v in raw]
        merged: dict[bytes, bytes] = dict(rows)
        for key, value in in_range:
            if value is _DELETED:
                merged.pop(key, None)
            else:
                merged[key] = value  # type: ignore[assignment]
        keys = sorted(merged)
        if limit is not None:
            keys = keys[:limit]
        return [(k, merged[k]) for k in keys]

    def put(self, key: bytes, value: bytes) -> None:
        self._check_open()
        self._writes[key] = value

    def delete(self, key: bytes) -> None:
        self._check_open()
        self._writes[key] = _DELETED

    async def _round_trip(self, statements: list[tuple[bytes, Sequence[object]]]) -> list[list[tuple[Any, ...]]]:
        """Run ``statements``, the pending point reads (``prefetch``) and announced scans
        (``prefetch_scan``) in one flush; the point reads fill the cache, the scans' rows wait for
        their scan (one snapshot for the whole transaction: they stay true), the answer holds the
        statements' rows."""
        points = list(dict.fromkeys(k for k in self._prefetch if k not in self._cache and k not in self._writes))
        self._prefetch.clear()
        scans = list(dict.fromkeys(s for s in self._scan_prefetch if s not in self._scans))
        self._scan_prefetch.clear()
        work = list(statements)
        for start, end, fetch in scans:
            params: list[object] = [start]
            if end is not None:
                params.append(end)
            if fetch is not None:
                params.append(fetch)
            work.append((_SCAN[(end is not None, fetch is not None)], params))
        if len(points) == 1:
            work.append((_GET, (points[0],)))
        elif points:
            work.append((_GET_MANY, (points,)))
        results = await self._send(work)
        if len(points) == 1:
            rows = results.pop()
            self._cache[points[0]] = bytes(rows[0][0]) if rows else None
        elif points:
            found = {bytes(k): bytes(v) for k, v in results.pop()}
            for key in points:
                self._cache[key] = found.get(key)
        for shape in reversed(scans):
            self._scans[shape] = [(bytes(k), bytes(v)) for k, v in results.pop()]
        return results

    async def _send(self, work: list[tuple[bytes, Sequence[object]]]) -> list[list[tuple[Any, ...]]]:
        """One round trip. The transaction's first adds BEGIN (and the ROLLBACK its connection's
        previous user left to it) to the same flush, on a pooled connection; a connection that
        turns out dead then is replaced once (nothing had happened on it yet)."""
        engine = self._engine
        conn = self._slot.conn
        if conn is not None:
            try:
                async with self._on_the_wire(committing=False):
                    if len(work) == 1:
                        cursors = [await conn.pg.execute(work[0][0], work[0][1], binary=True)]
                    else:
                        async with conn.pg.pipeline():
                            cursors = [await conn.pg.execute(sql, params, binary=True) for sql, params in work]
                    engine._round_trips += 1
                    return [await cur.fetchall() for cur in cursors]
            except psycopg.Error as exc:
                raise self._failed(exc, committing=False) from None
        for attempt in (1, 2):
            conn = await engine._pool.acquire()
            self._slot.conn = conn
            try:
                async with self._on_the_wire(committing=False):
                    async with conn.pg.pipeline():
                        if conn.dirty:
                            await conn.pg.execute(b"ROLLBACK")
                        await conn.pg.execute(_BEGIN)
                        cursors = [await conn.pg.execute(sql, params, binary=True) for sql, params in work]
                    engine._round_trips += 1
                    conn.dirty = False
                    return [await cur.fetchall() for cur in cursors]
            except psycopg.Error as exc:
                if attempt == 1 and _lost(exc):
                    self._slot.conn = None
                    engine._pool.release(conn)
                    continue
                raise self._failed(exc, committing=False) from None
        raise AssertionError("unreachable")

    async def commit(self) -> None:
        self._check_open()
        engine = self._engine
        faults = engine.faults
        if faults.take("conflict"):
            self._finish()
            engine.conflicts += 1
            raise TxnConflict("a key this transaction read was changed by another one (injected)")
        conn = self._slot.conn
        if conn is None and not self._writes:
            self._finish()
            engine.commits += 1
            return
        if conn is None:
            conn = self._slot.conn = await engine._pool.acquire()
            fresh = True
        else:
            fresh = False
        puts = [(k, v) for k, v in sorted(self._writes.items()) if v is not _DELETED]
        deletes = sorted(k for k, v in self._writes.items() if v is _DELETED)
        try:
            async with self._on_the_wire(committing=True):
                async with conn.pg.pipeline():
                    if fresh:
                        if conn.dirty:
                            await conn.pg.execute(b"ROLLBACK")
                        await conn.pg.execute(_BEGIN)
                    if puts:
                        await conn.pg.execute(_UPSERT, ([k for k, _ in puts], [v for _, v in puts]))
                    if deletes:
                        await conn.pg.execute(_DELETE, (deletes,))
                    await conn.pg.execute(b"COMMIT")
                engine._round_trips += 1
                conn.dirty = False
        except psycopg.Error as exc:
            raise self._failed(exc, committing=True) from None
        self._finish()
        engine.commits += 1
        if faults.take("maybe_committed"):
            raise MaybeCommitted("the commit's outcome is unknown (injected)")

    @contextlib.asynccontextmanager
    async def _on_the_wire(self, committing: bool) -> AsyncIterator[None]:
        """One flush and its answers, within ``round_trip_timeout_ms``. At the deadline the
        connection's socket is shut down, so the driver's wait ends at once with a lost connection
        (cancelling the wait instead would make the driver try to cancel the query over the same
        dead path, for up to ten more seconds); the connection is closed, never pooled again, and
        the transaction ends Unavailable, or MaybeCommitted with the ``COMMIT`` in flight. A
        caller's cancel closes the connection too (its protocol state is unknown mid-flush)."""
        timeout_ms = self._engine.config.round_trip_deadline_ms
        conn = self._slot.conn
        fired: list[bool] = []

        def deadline() -> None:
            fired.append(True)
            if conn is not None:
                _shut_down(conn)

        cut = asyncio.get_running_loop().call_later(timeout_ms / 1000, deadline)
        try:
            yield
        except psycopg.Error:
            if not fired:
                raise
            self._abandon()
            if committing:
                self._engine.maybe_committed += 1
                raise MaybeCommitted(f"no answer from PostgreSQL to a commit within {timeout_ms} ms "
                                     f"(the connection was closed)") from None
            raise Unavailable(f"no answer from PostgreSQL within {timeout_ms} ms (the connection was closed)") from None
        except asyncio.CancelledError:
            self._abandon()
            raise
        finally:
            cut.cancel()

    def _abandon(self) -> None:
        """End the transaction and close its connection, which is then never pooled again."""
        self._done = True
        conn, self._slot.conn = self._slot.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.pg.pgconn.finish()
            self._engine._pool.release(conn)  # closed: discarded, its slot goes to a waiter

    async def commit_reads(self) -> None:
        """Drop what this transaction wrote and commit what it read: for an answer computed from
        its reads that is not a change (an error such as "not found" or "already exists"), which is
        serializable only once the transaction committed; a conflict is :class:`TxnConflict`.

        A transaction that a failure already ended (a statement timeout, a round trip past its
        deadline: ``_failed``, ``_abandon``) has nothing to commit, and the error passing through is
        that failure, not an answer: it stays the caller's (refusing here would turn a retryable
        Timeout or Unavailable into "already committed or abandoned")."""
        if self._done:
            return
        self._writes.clear()
        await self.commit()

    def abandon(self) -> None:
        """End the transaction without committing and give its connection back now (the pool
        rolls it back off the caller's path); what it wrote is dropped. Called by
        :func:`~fs3.kv.txn.run_transaction` when its function raised."""
        if not self._done:
            self._finish()

    def _finish(self) -> None:
        """End the transaction here and give its connection back (an open transaction on it is
        rolled back by the connection's next user, in the same flush as its BEGIN)."""
        self._done = True
        conn, self._slot.conn = self._slot.conn, None
        if conn is not None:
            self._engine._pool.release(conn)

    def _failed(self, exc: psycopg.Error, committing: bool) -> FS3Error:
        """End the transaction and map the driver's error to fs3's (one place for all of them)."""
        engine = self._engine
        engine._round_trips += 1
        self._done = True
        conn, self._slot.conn = self._slot.conn, None
        if conn is not None:
            conn.dirty = True
            engine._pool.release(conn)
        state = getattr(exc, "sqlstate", None)
        if state in _CONFLICT_STATES:
            engine.conflicts += 1
            return TxnConflict(f"serialization failure ({state}): {_first_line(exc)}")
        if isinstance(exc, pg_errors.QueryCanceled):
            return Timeout(f"a PostgreSQL statement ran past statement_timeout: {_first_line(exc)}")
        if _lost(exc):
            if committing:
                engine.maybe_committed += 1
                return MaybeCommitted(f"the PostgreSQL connection was lost during commit: {_first_line(exc)}")
            engine.conflicts += 1
            return TxnConflict(f"the PostgreSQL connection was lost before commit (nothing written): "
                               f"{_first_line(exc)}")
        return Unavailable(f"PostgreSQL error {state or ''}: {_first_line(exc)}")


# A snapshot's reader may wait on its own output between pages (a dump written to a slow pipe):
# its session stays idle in its transaction for up to this long before the server ends it.
_SNAPSHOT_IDLE_MS = 600_000


class _PgSnapshot:
    """A :class:`~fs3.kv.api.SnapshotReader`: one ``REPEATABLE READ READ ONLY`` transaction on a
    session of its own (not the pool's: it lasts as long as the reader pages), so every scan reads
    the snapshot its first statement took. Read-only, it takes no predicate locks and can neither
    fail with a serialization error nor make a writer fail."""

    def __init__(self, pg: psycopg.AsyncConnection[Any], url: str) -> None:
        self._pg: psycopg.AsyncConnection[Any] | None = pg
        self._url = url

    async def scan(self, start: bytes, end: bytes | None = None, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        if self._pg is None:
            raise InvalidArgument("snapshot already closed")
        if limit is not None and limit <= 0:
            raise InvalidArgument("scan limit must be positive")
        params: list[object] = [start]
        if end is not None:
            params.append(end)
        if limit is not None:
            params.append(limit)
        try:
            cur = await self._pg.execute(_SCAN[(end is not None, limit is not None)], params)
            return [(bytes(k), bytes(v)) for k, v in await cur.fetchall()]
        except psycopg.Error as exc:
            raise Unavailable(f"snapshot read from {redact_url(self._url)}: "
                              f"{redact_message(_first_line(exc), self._url)}") from None

    async def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(psycopg.Error):
                await pg.close()


class PostgresTxnEngine:
    """Serializable transactions on a PostgreSQL table; open with :meth:`open`.

    Counters (read by the meta metrics and the benchmark): ``round_trips`` (each flush that waited
    for the server), ``commits``, ``conflicts`` (serialization failures and lost connections before
    commit), ``maybe_committed``.
    """

    # Transactions fetch announced keys with their next read (``prefetch``): meta guesses them.
    prefetches = True

    #: Read by meta's read-only requests: a transaction here is serializable only once it committed
    #: (SSI forgets a rolled-back reader, and a writer may then commit a cycle through what it read),
    #: so they commit before they answer (tests/test_pg_read_only.py shows the anomaly otherwise).
    reads_commit = True

    def __init__(self, config: PostgresConfig, faults: TxnFaults | None = None) -> None:
        config.validate()
        self.config = config
        self.faults = faults or TxnFaults()
        self._pool = _Pool(config)
        # Read by run_transaction: retries run alone in this process (fs3.kv.gate explains why).
        self.contention_gate = ContentionGate()
        self._round_trips = 0
        self.commits = 0
        self.conflicts = 0
        self.maybe_committed = 0

    @classmethod
    async def open(cls, config: PostgresConfig, faults: TxnFaults | None = None) -> PostgresTxnEngine:
        """Connect, check (or, on an empty database, create) the schema; errors are clear and
        leave the database as it was."""
        if not psycopg.Pipeline.is_supported():
            raise Unavailable(f"psycopg's libpq {psycopg.pq.version()} has no pipeline mode (libpq 14 or newer "
                              f"needed): install psycopg[binary], which brings its own")
        engine = cls(config, faults)
        await engine._check_schema()
        return engine

    @property
    def round_trips(self) -> int:
        """Round trips to the server so far: transactions' and the pool's rollbacks of dropped ones."""
        return self._round_trips + self._pool.rollbacks

    @property
    def rollbacks(self) -> int:
        """The pool's rollbacks of dropped transactions (part of ``round_trips``, off their callers' paths)."""
        return self._pool.rollbacks

    async def settle(self) -> None:
        """Wait for the rollbacks of dropped transactions now in flight (tests and benchmarks count
        round trips after it; a transaction dropped by an earlier statement is collected first)."""
        await self._pool.settle()

    def begin(self) -> _PgTxn:
        return _PgTxn(self)

    async def snapshot(self) -> _PgSnapshot:
        """A point-in-time view of the whole table (:class:`~fs3.kv.api.SnapshotReader`), taken now."""
        pg = await self._pool.connect()
        try:
            await pg.execute(b"SET idle_in_transaction_session_timeout = %s" % str(_SNAPSHOT_IDLE_MS).encode())
            await pg.execute(b"BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            # The snapshot is taken by the transaction's first statement, not by BEGIN: take it now.
            await pg.execute(b"SELECT 1")
        except psycopg.Error as exc:
            await pg.close()
            raise Unavailable(f"snapshot of {redact_url(self.config.url)}: "
                              f"{redact_message(_first_line(exc), self.config.url)}") from None
        return _PgSnapshot(pg, self.config.url)

    def conflict_retry(self, retry_max: int, backoff_ms: float) -> RetryPolicy:
        """How :func:`~fs3.kv.txn.run_transaction` retries on this engine: exponential waits, up to
        64 times ``backoff_ms``, each drawn at random below its cap. Transactions here overlap for
        several round trips, so those that conflicted together (creates in one directory all
        stamp its inode) and retry after equal waits conflict together again, until their budget
        is gone; random waits spread them (measured: bench/meta_kv_bench.py, docs/decisions.md)."""
        return RetryPolicy(backoff_base_ms=backoff_ms, backoff_max_ms=backoff_ms * 64, backoff=Backoff.EXPONENTIAL,
                           attempts_max=retry_max + 1, jitter=1.0)

    async def wait_durable(self) -> None:
        """Nothing to wait for: with ``sync`` a commit returns once durable (``synchronous_commit``),
        and a read sees only committed data; without it, nothing is waited for either."""

    async def close(self) -> None:
        self.terminate()

    def terminate(self) -> None:
        """Close the connections (works without an event loop, e.g. after one has ended)."""
        self._pool.terminate()

    def stats(self) -> dict[str, int]:
        return {"round_trips": self.round_trips, "commits": self.commits, "conflicts": self.conflicts,
                "maybe_committed": self.maybe_committed}

    async def _check_schema(self) -> None:
        url = redact_url(self.config.url)
        try:
            pg = await self._pool.connect()
        except Unavailable as exc:
            raise Unavailable(f"{exc} (is the server running, the URL, user and password right?)") from None
        try:
            async with pg.transaction():
                # Seconds, not a request's statement timeout: the index build reads the whole table
                # (after the writers in flight), and servers starting together wait for it at the lock.
                await pg.execute(b"SET LOCAL statement_timeout = %s" % str(_SCHEMA_TIMEOUT_MS).encode())
                # Meta servers starting together: one creates the schema, the others then check it.
                await pg.execute(b"SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                cur = await pg.execute(b"SELECT to_regclass('fs3_info') IS NOT NULL, to_regclass('fs3_kv') IS NOT NULL")
                row = await cur.fetchone()
                assert row is not None
                has_info, has_kv = row
                if not has_info and not has_kv:
                    await self._create_schema(pg)
                    log.info("created the fs3 schema (version %d, cluster %r) in %s", SCHEMA_VERSION,
                             self.config.cluster_id, url)
                    return
                if not has_info or not has_kv:
                    raise InvalidArgument(f"{url}: a partial fs3 schema (fs3_info {'present' if has_info else 'absent'}"
                                          f", fs3_kv {'present' if has_kv else 'absent'}): not an fs3 database")
                cur = await pg.execute(b"SELECT name, value FROM fs3_info")
                info = {str(name): str(value) for name, value in await cur.fetchall()}
                version = info.get("schema_version")
                if version != str(SCHEMA_VERSION):
                    raise InvalidArgument(f"{url} holds fs3 schema version {version}; this fs3 needs version "
                                          f"{SCHEMA_VERSION} (nothing was changed)")
                if info.get("cluster_id") != self.config.cluster_id:
                    raise InvalidArgument(f"{url} belongs to cluster {info.get('cluster_id')!r}, not "
                                          f"{self.config.cluster_id!r} (nothing was changed)")
                # A database made before the point index existed gets it (same data, same version).
                cur = await pg.execute(b"SELECT to_regclass(%s) IS NOT NULL", (_POINT_INDEX,))
                row = await cur.fetchone()
                if row is None or not row[0]:
                    await _create_point_index(pg)
                    log.info("created the point-read index %s in %s", _POINT_INDEX, url)
        except psycopg.Error as exc:
            raise Unavailable(f"checking the fs3 schema in {url}: {redact_message(_first_line(exc), self.config.url)}"
                              ) from None
        finally:
            await pg.close()

    async def _create_schema(self, pg: psycopg.AsyncConnection[Any]) -> None:
        await pg.execute(f"CREATE TABLE {_TABLE} (k bytea PRIMARY KEY, v bytea NOT NULL)".encode())
        await _create_point_index(pg)
        await pg.execute(f"CREATE TABLE {_INFO} (name text PRIMARY KEY, value text NOT NULL)".encode())
        await pg.execute(f"INSERT INTO {_INFO} (name, value) VALUES ('schema_version', %s), ('cluster_id', %s), "
                         f"('created_at', %s)".encode(),
                         (str(SCHEMA_VERSION), self.config.cluster_id, time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                     time.gmtime())))

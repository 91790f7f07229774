"""Metadata operations: POSIX rules, permissions, layouts, idempotency, bad input.

Every test runs on both transaction engines (``engine_kind``, tests/txn_engines.py): the
optimistic engine over memory, and PostgreSQL (a database of the test's own on the private server).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import pytest

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient
from fs3.common.errors import (
    AlreadyExists,
    BadHandle,
    DirectoryNotEmpty,
    FileTooLarge,
    FS3Error,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NotADirectory,
    NotFound,
    NotPermitted,
    NoXattr,
    PermissionDenied,
    SymlinkLoop,
)
from fs3.common.layout import SplitMix64, chunk_location, file_layout, seeded_shuffle
from fs3.common.posix import O_CREAT, O_EXCL, O_RDONLY, O_RDWR, O_TRUNC, O_WRONLY, Caller
from fs3.kv.api import Transaction, TxnEngine
from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine, TxnFaults, run_transaction
from fs3.meta import schema
from fs3.meta.fsck import run_fsck
from fs3.meta.ops import (
    LengthProbeStale,
    LengthReport,
    Namespace,
    OpEnv,
    TruncatePending,
    TruncateUnclaimed,
)
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.channel import RealChannelFactory

ROOT = Caller(0, 0)
ALICE = Caller(1000, 1000, frozenset({1000, 50}))
BOB = Caller(1001, 1001)
CLIENT = b"c" * 16
T = TypeVar("T")


def ref(path: str) -> mpb.PathRef:
    return mpb.PathRef(path=path.encode())


# The engine this run of each test uses: a PostgreSQL URL, or None for the in-memory engine.
_ENGINE: dict[str, str | None] = {"pg_url": None}
_OPENED: list[Engine] = []


@pytest.fixture(autouse=True)
def _engine_under_test(request: pytest.FixtureRequest, engine_kind: str) -> Iterator[None]:
    _ENGINE["pg_url"] = request.getfixturevalue("postgres_url") if engine_kind == "postgres" else None
    try:
        yield
    finally:
        _ENGINE["pg_url"] = None  # the modules that borrow these helpers run on the in-memory engine
        for engine in _OPENED:
            engine.close()
        _OPENED.clear()


class Engine:
    """This test's engine and the event loop it lives in (a PostgreSQL engine's connections
    belong to one loop), with ``get``/``scan`` of the committed state for assertions."""

    def __init__(self, faults: TxnFaults | None = None) -> None:
        self.runner = asyncio.Runner()  # its loop is made on first use: PostgreSQL only
        url = _ENGINE["pg_url"]
        self.engine: TxnEngine
        self.mem: MemKVStore | None = None
        if url is None:
            self.mem = MemKVStore()
            self.engine = OptimisticTxnEngine(self.mem, faults=faults)
        else:
            self.engine = self.runner.run(PostgresTxnEngine.open(PostgresConfig(url), faults=faults))
            _OPENED.append(self)  # closed after the test

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.mem is not None:
            return asyncio.run(coro)  # a loop per call, as the modules borrowing Meta expect
        return self.runner.run(coro)

    def get(self, key: bytes) -> bytes | None:
        if self.mem is not None:  # read directly: callable from inside a running loop too
            return self.mem.get(key)
        return self.run(self.engine.begin().get(key))

    def scan(self, start: bytes, end: bytes | None = None) -> list[tuple[bytes, bytes]]:
        if self.mem is not None:
            return list(self.mem.scan(start, end))
        return self.run(self.engine.begin().scan(start, end))

    def close(self) -> None:
        if isinstance(self.engine, PostgresTxnEngine):
            self.engine.terminate()
        self.runner.close()


class Meta:
    """Namespace operations on one in-memory engine, one transaction per call."""

    def __init__(self, faults: TxnFaults | None = None, root_mode: int = 0o755) -> None:
        self.store = Engine(faults)
        self.engine = self.store.engine
        self.now_ns = 1_700_000_000_000_000_000
        self.next_id = 100
        self.request = 0
        layout = mpb.Layout(table_id=1, chunk_size=65536)
        self.run(lambda ns: ns.ensure_root(0, 0, root_mode, layout))

    def run(self, fn: Callable[[Namespace], Awaitable[T]], caller: Caller = ROOT) -> T:
        self.now_ns += 1_000

        async def body(txn: Transaction) -> T:
            env = OpEnv(now_ns=self.now_ns, caller=caller, chain_tables={1: [11, 12, 13, 14]}, stripe_default=3)
            return await fn(Namespace(txn, env))

        return self.store.run(run_transaction(self.engine, body))

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def mkdir(self, path: str, mode: int = 0o755, caller: Caller = ROOT) -> mpb.Inode:
        new = self.new_id()
        return self.run(lambda ns: ns.make_node(ref(path), mpb.DIRECTORY, mode, 0, b"", new), caller)

    def create(self, path: str, mode: int = 0o644, caller: Caller = ROOT, flags: int = O_CREAT | O_WRONLY,
               ) -> mpb.OpenRsp:
        new = self.new_id()
        self.request += 1
        session = schema.session_id_for(CLIENT, self.request)
        return self.run(lambda ns: ns.open(ref(path), flags, mode, new, session, CLIENT, 0), caller)

    def touch(self, path: str, caller: Caller = ROOT, mode: int = 0o644) -> mpb.Inode:
        rsp = self.create(path, mode, caller)
        self.close(rsp)
        return rsp.inode

    def close(self, rsp: mpb.OpenRsp, hint: int = 0) -> Any:
        return self.run(lambda ns: ns.close(rsp.inode.inode_id, rsp.session_id, LengthReport(hint, hint > 0)))

    def stat(self, path: str, follow: bool = True) -> mpb.Inode:
        return self.run(lambda ns: ns.lookup(ref(path), follow))

    def names(self, path: str) -> list[str]:
        rsp = self.run(lambda ns: ns.readdir(ref(path), b"", 1000, False))
        return [e.name.decode() for e in rsp.entries]

    def fsck(self) -> list[str]:
        return list(self.store.run(run_fsck(self.engine.begin())).problems)


# -- layouts ---------------------------------------------------------------------------------------


def test_splitmix64_matches_the_reference_sequence() -> None:
    rng = SplitMix64(0)
    assert [rng.next_u64() for _ in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_seeded_shuffle_is_a_stable_permutation() -> None:
    items = list(range(1, 11))
    first = seeded_shuffle(items, 42)
    assert sorted(first) == items and first != items
    assert seeded_shuffle(items, 42) == first
    # A golden value: file layouts depend on it, so it must never change across Python versions or releases.
    assert first == [1, 10, 6, 9, 7, 5, 8, 3, 2, 4]
    assert seeded_shuffle(items, 43) != first


def test_file_layout_stripes_chunks_over_distinct_chains() -> None:
    layout = file_layout(mpb.Layout(table_id=1, chunk_size=65536, stripe=3), [5, 6, 7, 8, 9], seed=7,
                         stripe_default=16)
    assert layout.stripe == 3 and len(set(layout.chains)) == 3 and set(layout.chains) <= {5, 6, 7, 8, 9}
    chains = [chunk_location(layout, 7, i)[0] for i in range(6)]
    assert chains[:3] == list(layout.chains) and chains[3:] == list(layout.chains)
    assert chunk_location(layout, 7, 4)[1] == (7).to_bytes(8, "big") + (4).to_bytes(4, "big")


def test_files_inherit_the_directory_layout() -> None:
    meta = Meta()
    meta.mkdir("/d")
    meta.run(lambda ns: ns.set_layout(ref("/d"), mpb.Layout(table_id=1, chunk_size=1 << 20, stripe=2)))
    inode = meta.touch("/d/f")
    assert inode.layout.chunk_size == 1 << 20 and inode.layout.stripe == 2 and len(inode.layout.chains) == 2
    assert meta.mkdir("/d/sub").layout.chunk_size == 1 << 20


@pytest.mark.parametrize("layout", [
    mpb.Layout(table_id=1, chunk_size=65536 + 1, stripe=1),
    mpb.Layout(table_id=1, chunk_size=1024, stripe=1),
    mpb.Layout(table_id=9, chunk_size=65536, stripe=1),
    mpb.Layout(table_id=1, chunk_size=65536, stripe=5),
])
def test_bad_layouts_are_rejected_and_change_nothing(layout: mpb.Layout) -> None:
    meta = Meta()
    meta.mkdir("/d")
    before = meta.stat("/d")
    with pytest.raises(InvalidArgument):
        meta.run(lambda ns: ns.set_layout(ref("/d"), layout))
    assert meta.stat("/d") == before


# -- namespace ------------------------------------------------------------------------------------


def test_create_lookup_readdir_and_nlink() -> None:
    meta = Meta()
    meta.mkdir("/a")
    meta.mkdir("/a/b")
    meta.touch("/a/f")
    assert meta.names("/a") == ["b", "f"]
    assert meta.stat("/a").nlink == 3 and meta.stat("/").nlink == 3 and meta.stat("/a/f").nlink == 1
    assert meta.stat("/a/b/..").inode_id == meta.stat("/a").inode_id
    with pytest.raises(AlreadyExists):
        meta.mkdir("/a/b")
    with pytest.raises(AlreadyExists):
        meta.create("/a/f", flags=O_CREAT | O_EXCL | O_WRONLY)
    with pytest.raises(NotADirectory):
        meta.stat("/a/f/x")
    with pytest.raises(NotFound):
        meta.stat("/nope")
    assert meta.fsck() == []


def test_readdir_pages_stay_correct_while_the_directory_changes() -> None:
    meta = Meta()
    meta.mkdir("/d")
    for i in range(0, 50, 2):
        meta.touch(f"/d/f{i:03d}")
    seen: list[str] = []
    start = b""
    added = 1

    def page(start: bytes) -> Callable[[Namespace], Awaitable[mpb.ReadDirRsp]]:
        return lambda ns: ns.readdir(ref("/d"), start, 7, True)

    def remove(name: str) -> Callable[[Namespace], Awaitable[int]]:
        return lambda ns: ns.remove(ref(f"/d/{name}"), False)

    while True:
        rsp = meta.run(page(start))
        seen += [e.name.decode() for e in rsp.entries]
        assert all(e.attrs.inode_id == e.inode_id for e in rsp.entries)
        # Between pages: remove an entry already returned and add one ahead and one behind.
        meta.run(remove(seen[-1]))
        meta.touch(f"/d/f{added:03d}")  # odd names, some behind the cursor
        added += 2
        if not rsp.more:
            break
        start = rsp.entries[-1].name
    assert seen == sorted(seen) and len(seen) == len(set(seen))
    assert {f"f{i:03d}" for i in range(0, 50, 2)} <= set(seen)


def test_symlinks_resolve_and_loops_are_detected() -> None:
    meta = Meta()
    meta.mkdir("/real")
    meta.touch("/real/f")
    meta.run(lambda ns: ns.make_node(ref("/link"), mpb.SYMLINK, 0, 0, b"real", meta.new_id()))
    meta.run(lambda ns: ns.make_node(ref("/abs"), mpb.SYMLINK, 0, 0, b"/real/f", meta.new_id()))
    assert meta.stat("/link/f").inode_id == meta.stat("/real/f").inode_id
    assert meta.stat("/abs").type == mpb.FILE and meta.stat("/abs", follow=False).type == mpb.SYMLINK
    assert meta.run(lambda ns: ns.readlink(ref("/abs"))) == b"/real/f"
    meta.run(lambda ns: ns.make_node(ref("/l1"), mpb.SYMLINK, 0, 0, b"l2", meta.new_id()))
    meta.run(lambda ns: ns.make_node(ref("/l2"), mpb.SYMLINK, 0, 0, b"l1", meta.new_id()))
    with pytest.raises(SymlinkLoop):
        meta.stat("/l1")
    with pytest.raises(InvalidArgument):
        meta.run(lambda ns: ns.readlink(ref("/real")))


def test_rename_rules() -> None:
    meta = Meta()
    for d in ("/a", "/a/sub", "/b", "/empty", "/full"):
        meta.mkdir(d)
    meta.touch("/full/x")
    meta.touch("/f")
    meta.touch("/g")

    def rename(s: str, d: str, flags: int = 0) -> None:
        meta.run(lambda ns: ns.rename(ref(s), ref(d), flags))

    with pytest.raises(InvalidArgument):
        rename("/a", "/a/sub/inside")
    with pytest.raises(IsADirectory):
        rename("/f", "/empty")
    with pytest.raises(NotADirectory):
        rename("/a", "/g")
    with pytest.raises(DirectoryNotEmpty):
        rename("/a", "/full")
    with pytest.raises(DirectoryNotEmpty):  # onto an ancestor of the source: Linux says ENOTEMPTY first
        rename("/full/x", "/full")
    with pytest.raises(AlreadyExists):
        rename("/f", "/g", mpb.RENAME_NOREPLACE)
    with pytest.raises(NotFound):
        rename("/f", "/none", mpb.RENAME_EXCHANGE)
    with pytest.raises(InvalidArgument):
        rename("/f", "/g", mpb.RENAME_EXCHANGE | mpb.RENAME_NOREPLACE)
    g = meta.stat("/g").inode_id
    rename("/f", "/g")  # replaces /g, whose inode goes to GC
    assert "f" not in meta.names("/") and meta.stat("/g").inode_id != g
    rename("/a/sub", "/b/moved")
    assert meta.stat("/a").nlink == 2 and meta.stat("/b").nlink == 3
    assert meta.stat("/b/moved/..").inode_id == meta.stat("/b").inode_id
    rename("/a", "/empty")  # an empty directory may be replaced
    assert "a" not in meta.names("/")
    meta.touch("/h")
    rename("/h", "/b", mpb.RENAME_EXCHANGE)
    assert meta.stat("/b").type == mpb.FILE and meta.stat("/h").type == mpb.DIRECTORY
    assert meta.stat("/h/moved/..").inode_id == meta.stat("/h").inode_id
    assert meta.fsck() == []


def test_hard_links_and_unlink_of_an_open_file() -> None:
    meta = Meta()
    meta.touch("/f")
    meta.run(lambda ns: ns.link(ref("/f"), ref("/g")))
    assert meta.stat("/f").nlink == 2
    meta.mkdir("/d")
    with pytest.raises(NotPermitted):
        meta.run(lambda ns: ns.link(ref("/d"), ref("/d2")))
    opened = meta.create("/f", flags=O_RDONLY)
    meta.run(lambda ns: ns.remove(ref("/f"), False))
    meta.run(lambda ns: ns.remove(ref("/g"), False))
    inode_id = opened.inode.inode_id
    # Unlinked but open: the inode lives (nlink 0) and nothing is queued for GC yet.
    orphan = meta.run(lambda ns: ns.inode(inode_id))
    assert orphan.nlink == 0 and meta.store.get(schema.gc_key(inode_id)) is None
    assert meta.fsck() == []
    meta.close(opened)
    assert meta.run(lambda ns: ns.find_inode(inode_id)) is None
    assert meta.store.get(schema.gc_key(inode_id)) is not None
    with pytest.raises(BadHandle):
        meta.close(opened)
    assert meta.fsck() == []


def test_rmdir_and_unlink_errors() -> None:
    meta = Meta()
    meta.mkdir("/d")
    meta.touch("/d/f")
    with pytest.raises(DirectoryNotEmpty):
        meta.run(lambda ns: ns.remove(ref("/d"), True))
    with pytest.raises(IsADirectory):
        meta.run(lambda ns: ns.remove(ref("/d"), False))
    with pytest.raises(NotADirectory):
        meta.run(lambda ns: ns.remove(ref("/d/f"), True))
    with pytest.raises(NotFound):
        meta.run(lambda ns: ns.remove(ref("/d/none"), False))


def test_truncate_records_a_job_and_applies_the_size_when_it_completes() -> None:
    meta = Meta()
    rsp = meta.create("/f")
    meta.close(rsp, hint=200_000)
    inode_id = rsp.inode.inode_id

    def truncate(size: int, claimed: int = inode_id) -> mpb.Inode:
        return meta.run(lambda ns: ns.setattr(mpb.SetAttrReq(target=ref("/f"), mask=mpb.SET_SIZE, size=size),
                                              claimed))

    def job() -> schema.TruncateJob:
        return schema.TruncateJob.decode(meta.store.get(schema.truncate_key(inode_id)) or b"")

    with pytest.raises(TruncateUnclaimed):  # the service claims the inode, then runs it again
        truncate(70_000, claimed=0)
    with pytest.raises(FileTooLarge):  # bad input is refused before anything else, and changes nothing
        truncate(1 << 61, claimed=0)
    assert meta.store.get(schema.truncate_key(inode_id)) is None
    assert truncate(70_000).size == 70_000  # the answer shows the new size...
    assert meta.stat("/f").size == 200_000  # ...applied once storage holds nothing past it
    assert (job().size, job().clear_from, job().first_chunk, job().size_gen) == (70_000, 70_000, 2, 1)
    with pytest.raises(TruncatePending):  # no open while chunks are still to be removed
        meta.create("/f", flags=O_RDONLY)
    with pytest.raises(TruncatePending):  # nor another size change: it would narrow the job
        truncate(0)
    assert meta.run(lambda ns: ns.complete_truncate(inode_id, 1))
    assert meta.stat("/f").size == 70_000 and meta.store.get(schema.truncate_key(inode_id)) is None
    assert not meta.run(lambda ns: ns.complete_truncate(inode_id, 1))  # done once
    # A closed file grows: storage is cleared from the old end (the extension reads as zeros).
    truncate(300_000)
    assert (job().size, job().clear_from, job().size_gen) == (300_000, 70_000, 2)
    meta.run(lambda ns: ns.complete_truncate(inode_id, 2))
    # An open file grows: only past the new end (a writer's unpublished bytes below it stay).
    handle = meta.create("/f", flags=O_WRONLY)
    truncate(400_000)
    assert (job().clear_from, job().size_gen) == (400_000, 3)
    meta.run(lambda ns: ns.complete_truncate(inode_id, 3))
    meta.close(handle)
    # O_TRUNC: the opener's own handle is not "truncated since open".
    again = meta.run(lambda ns: ns.open(ref("/f"), O_WRONLY | O_TRUNC, 0, 0, schema.session_id_for(CLIENT, 999),
                                        CLIENT, 0, inode_id))
    assert again.inode.size == 0 and meta.stat("/f").size == 400_000
    raw = meta.store.get(schema.session_key(inode_id, again.session_id))
    assert raw is not None and schema.Session.decode(raw).size_gen == 4 == job().size_gen
    # Unlinking drops the unfinished job: the GC job removes every chunk there is.
    meta.run(lambda ns: ns.remove(ref("/f"), False))
    meta.close(again)
    assert meta.store.get(schema.truncate_key(inode_id)) is None
    assert meta.store.get(schema.size_gen_key(inode_id)) is None
    assert schema.GcJob.decode(meta.store.get(schema.gc_key(inode_id)) or b"").first_chunk == 0


def test_job_records_of_an_older_release_are_read() -> None:
    layout = mpb.Layout(table_id=1, chunk_size=65536, stripe=1, chains=[11])
    old_truncate = struct.pack(">QQQ", 2, 200_000, 4_464) + layout.SerializeToString()
    job = schema.TruncateJob.decode(old_truncate)
    assert (job.size, job.clear_from, job.first_chunk) == (None, 70_000, 2)
    assert schema.TruncateJob.decode(struct.pack(">QQQ", 3, 200_000, 0) + layout.SerializeToString()).clear_from \
        == 3 * 65536
    old_session = CLIENT + struct.pack(">?Q", True, 5)
    assert schema.Session.decode(old_session + b"\x01").size_gen == schema.SIZE_GEN_UNKNOWN
    assert schema.Session.decode(old_session).size_gen == 0
    new = schema.TruncateJob(layout, 70_000, 70_000, 3)
    assert schema.TruncateJob.decode(new.encode()) == new
    assert schema.TruncateJob.decode(replace(new, size=None).encode()).size is None


def test_an_acknowledged_length_is_taken_unless_the_file_was_truncated_since_open() -> None:
    """A handle's acknowledged length needs no storage probe, until a truncate may have removed
    some of what it wrote; from then on its lengths must come from storage, probed under the
    inode's current size generation."""
    meta = Meta()
    first = meta.create("/f")
    inode_id, session_id = first.inode.inode_id, first.session_id

    def sync(hint: int, exact: int | None = None, probed_gen: int | None = None, session: bytes = session_id,
             final: bool = False, acked: bool = True) -> mpb.Inode:
        return meta.run(lambda ns: ns.sync(inode_id, session, LengthReport(hint, True, acked, exact, probed_gen,
                                                                           final)))

    def truncate(size: int) -> None:
        meta.run(lambda ns: ns.setattr(mpb.SetAttrReq(target=ref("/f"), mask=mpb.SET_SIZE, size=size), inode_id))
        gen = schema.decode_u64(meta.store.get(schema.size_gen_key(inode_id)))
        assert meta.run(lambda ns: ns.complete_truncate(inode_id, gen))

    assert sync(100_000).size == 100_000
    assert sync(50_000).size == 100_000  # a hint never shrinks a file
    truncate(10)
    with pytest.raises(LengthProbeStale):
        sync(100_000)
    assert meta.stat("/f").size == 10
    with pytest.raises(LengthProbeStale):  # probed before the truncate: refused as well
        sync(100_000, exact=70_000, probed_gen=0)
    assert sync(100_000, exact=4_000, probed_gen=1).size == 4_000
    later = meta.create("/f", flags=O_WRONLY)  # opened after the truncate: its hints are believed
    assert meta.run(lambda ns: ns.close(inode_id, later.session_id, LengthReport(9_000, True, acked=True,
                                                                                 final=False))).inode.size == 9_000
    # A truncate to the same size between a probe and its transaction: the size says nothing
    # changed, the generation says the probe is stale.
    truncate(9_000)
    with pytest.raises(LengthProbeStale):
        sync(100_000, exact=50_000, probed_gen=1)
    # The last resort (no probe to be had) never takes a truncated handle's hint: it could cover
    # what the truncate removed.
    assert sync(100_000, exact=50_000, probed_gen=1, final=True).size == 9_000
    meta.run(lambda ns: ns.close(inode_id, session_id, LengthReport(100_000, True, acked=True, final=True)))
    assert meta.stat("/f").size == 9_000
    # An untruncated handle's unacknowledged hint is the last resort's answer.
    fresh = meta.create("/f", flags=O_WRONLY)
    assert sync(12_000, session=fresh.session_id, acked=False, final=True).size == 12_000


# -- permissions and times --------------------------------------------------------------------------


def test_permission_bits_owner_group_other_and_root() -> None:
    meta = Meta(root_mode=0o755)
    with pytest.raises(PermissionDenied):
        meta.touch("/x", caller=ALICE)
    meta.mkdir("/shared", 0o770)
    meta.run(lambda ns: ns.setattr(mpb.SetAttrReq(target=ref("/shared"), mask=mpb.SET_GID, gid=50)))
    meta.touch("/shared/by-alice", caller=ALICE)  # group member
    with pytest.raises(PermissionDenied):  # no search permission on /shared for others
        meta.run(lambda ns: ns.lookup(ref("/shared/by-alice"), True), caller=BOB)
    secret = meta.create("/secret", mode=0o600)
    meta.close(secret)
    with pytest.raises(PermissionDenied):
        meta.create("/secret", caller=ALICE, flags=O_RDONLY)
    meta.create("/secret", caller=ROOT, flags=O_RDWR)  # root reads and writes anything
    with pytest.raises(NotPermitted):
        meta.run(lambda ns: ns.setattr(mpb.SetAttrReq(target=ref("/secret"), mask=mpb.SET_MODE, mode=0o777)),
                 caller=ALICE)
    with pytest.raises(NotPermitted):
        meta.run(lambda ns: ns.setattr(mpb.SetAttrReq(target=ref("/shared/by-alice"), mask=mpb.SET_UID, uid=0)),
                 caller=ALICE)
    # The owner may give a file to one of its own groups, not to anyone else's.
    meta.run(lambda ns: ns.setattr(mpb.SetAttrReq(target=ref("/shared/by-alice"), mask=mpb.SET_GID, gid=50)),
             caller=ALICE)
    with pytest.raises(NotPermitted):
        meta.run(lambda ns: ns.setattr(mpb.SetAttrReq(target=ref("/shared/by-alice"), mask=mpb.SET_GID,
                                                      gid=1001)), caller=ALICE)


def test_sticky_directory_protects_other_users_files() -> None:
    meta = Meta()
    meta.mkdir("/tmp", 0o1777)
    meta.touch("/tmp/alice", caller=ALICE)
    with pytest.raises(NotPermitted):
        meta.run(lambda ns: ns.remove(ref("/tmp/alice"), False), caller=BOB)
    with pytest.raises(NotPermitted):
        meta.run(lambda ns: ns.rename(ref("/tmp/alice"), ref("/tmp/bob"), 0), caller=BOB)
    meta.run(lambda ns: ns.remove(ref("/tmp/alice"), False), caller=ALICE)


def test_setgid_directory_passes_its_group_on() -> None:
    meta = Meta()
    meta.mkdir("/proj", 0o2777)
    meta.run(lambda ns: ns.setattr(mpb.SetAttrReq(target=ref("/proj"), mask=mpb.SET_GID, gid=77)))
    f = meta.touch("/proj/f", caller=ALICE)
    d = meta.mkdir("/proj/d", 0o755, caller=ALICE)
    assert f.gid == 77 and d.gid == 77 and d.mode & 0o2000 and not f.mode & 0o2000


def test_times_follow_posix() -> None:
    meta = Meta()
    meta.mkdir("/d")
    before = meta.stat("/d")
    f = meta.touch("/d/f")
    after = meta.stat("/d")
    assert after.mtime_ns > before.mtime_ns and after.ctime_ns > before.ctime_ns
    assert f.atime_ns == f.mtime_ns == f.ctime_ns
    meta.run(lambda ns: ns.setattr(mpb.SetAttrReq(target=ref("/d/f"), mask=mpb.SET_MODE, mode=0o600)))
    chmodded = meta.stat("/d/f")
    assert chmodded.ctime_ns > f.ctime_ns and chmodded.mtime_ns == f.mtime_ns
    meta.run(lambda ns: ns.link(ref("/d/f"), ref("/d/g")))
    assert meta.stat("/d/f").ctime_ns > chmodded.ctime_ns
    meta.run(lambda ns: ns.setattr(mpb.SetAttrReq(target=ref("/d/f"), mask=mpb.SET_ATIME | mpb.SET_MTIME,
                                                  atime_ns=5, mtime_ns=7)))
    assert (meta.stat("/d/f").atime_ns, meta.stat("/d/f").mtime_ns) == (5, 7)
    meta.create("/d/f", flags=O_RDONLY)  # relatime: atime older than mtime moves on open
    assert meta.stat("/d/f").atime_ns > 7


def test_xattrs() -> None:
    meta = Meta()
    meta.touch("/f")

    def setx(name: bytes, value: bytes, flags: int = 0, caller: Caller = ROOT) -> None:
        meta.run(lambda ns: ns.set_xattr(ref("/f"), True, name, value, flags), caller)

    setx(b"user.a", b"1")
    with pytest.raises(AlreadyExists):
        setx(b"user.a", b"2", mpb.XATTR_CREATE)
    with pytest.raises(NoXattr):
        setx(b"user.b", b"2", mpb.XATTR_REPLACE)
    setx(b"user.a", b"3", mpb.XATTR_REPLACE)
    assert meta.run(lambda ns: ns.get_xattr(ref("/f"), True, b"user.a")) == b"3"
    assert meta.run(lambda ns: ns.list_xattr(ref("/f"), True)) == [b"user.a"]
    with pytest.raises(PermissionDenied):
        setx(b"user.c", b"1", caller=ALICE)
    with pytest.raises(NotPermitted):
        setx(b"trusted.x", b"1", caller=ALICE)
    meta.run(lambda ns: ns.remove_xattr(ref("/f"), True, b"user.a"))
    with pytest.raises(NoXattr):
        meta.run(lambda ns: ns.get_xattr(ref("/f"), True, b"user.a"))


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "error"), [
    ("/a\x00b", InvalidArgument),
    ("/" + "x" * 256, NameTooLong),
    ("/" + "/".join(["d" * 200] * 21), NameTooLong),
    ("", NotFound),
    ("/", InvalidArgument),
    ("/..", InvalidArgument),
    ("/missing/f", NotFound),
])
def test_bad_names_get_typed_errors_and_change_nothing(path: str, error: type[FS3Error]) -> None:
    meta = Meta()
    before = sorted(meta.store.scan(b""))
    with pytest.raises(error):
        meta.mkdir(path)
    with pytest.raises(error):
        meta.create(path)
    assert sorted(meta.store.scan(b"")) == before


def test_unknown_inode_and_bad_flags() -> None:
    meta = Meta()
    with pytest.raises(NotFound):
        meta.run(lambda ns: ns.lookup(mpb.PathRef(inode_id=999_999), True))
    with pytest.raises(InvalidArgument):
        meta.create("/f", flags=O_CREAT | 3)
    with pytest.raises(InvalidArgument):
        meta.run(lambda ns: ns.setattr(mpb.SetAttrReq(target=ref("/"), mask=1 << 20)))
    with pytest.raises(InvalidArgument):
        meta.run(lambda ns: ns.make_node(ref("/x"), 99, 0, 0, b"", 5))  # type: ignore[arg-type]
    with pytest.raises(BadHandle):
        meta.run(lambda ns: ns.close(1, b"x" * 24))


# -- conflicts and ambiguous commits ----------------------------------------------------------------


def _service(faults: TxnFaults | None = None) -> tuple[MetaService, MemKVStore]:
    """A service on the in-memory engine, whatever this test's engine (for the modules that
    borrow it and read its store directly)."""
    store = MemKVStore()
    channels = RealChannelFactory()
    routing = RoutingCache(["127.0.0.1:1"], channels)
    routing._install(cpb.RoutingInfo(chain_tables=[cpb.ChainTable(table_id=1, chain_ids=[11, 12, 13])]))
    service = MetaService(OptimisticTxnEngine(store, faults=faults), routing, StorageClient(routing, channels, CLIENT),
                          MetaServiceConfig(root_mode=0o777))
    asyncio.run(service.start(background=False))
    return service, store


def _engine_service(faults: TxnFaults | None = None) -> tuple[MetaService, Engine]:
    """A service on this test's engine."""
    store = Engine(faults)
    channels = RealChannelFactory()
    routing = RoutingCache(["127.0.0.1:1"], channels)
    routing._install(cpb.RoutingInfo(chain_tables=[cpb.ChainTable(table_id=1, chain_ids=[11, 12, 13])]))
    service = MetaService(store.engine, routing, StorageClient(routing, channels, CLIENT),
                          MetaServiceConfig(root_mode=0o777))
    store.run(service.start(background=False))
    return service, store


class Calls:
    """Meta handlers called the way the RPC layer calls them, with explicit request ids."""

    def __init__(self, service: MetaService, engine: Engine) -> None:
        self.service = service
        self.engine = engine
        self.request_id = 0

    def ctx(self, request_id: int | None = None) -> mpb.ReqCtx:
        if request_id is None:
            self.request_id += 1
            request_id = self.request_id
        return mpb.ReqCtx(user=mpb.User(uid=0, gid=0), client_id=CLIENT, request_id=request_id)

    def __call__(self, name: str, req: Any) -> Any:
        rsp, _ = self.engine.run(getattr(self.service, name)(req, memoryview(b"")))
        return rsp


def test_operations_are_exact_under_injected_conflicts_and_ambiguous_commits() -> None:
    """Every commit may conflict or be "maybe committed"; each operation still happens exactly once."""
    faults = TxnFaults(conflict_probability=0.3, maybe_committed_probability=0.3)
    service, engine = _engine_service(faults)
    call = Calls(service, engine)
    call("make_node", mpb.MakeNodeReq(ctx=call.ctx(), target=ref("/d"), type=mpb.DIRECTORY, mode=0o755))
    for i in range(20):
        rsp = call("open", mpb.OpenReq(ctx=call.ctx(), target=ref(f"/d/f{i}"), flags=O_CREAT | O_EXCL | O_WRONLY,
                                       mode=0o644))
        assert rsp.created
        call("close", mpb.CloseReq(ctx=call.ctx(), inode_id=rsp.inode.inode_id, session_id=rsp.session_id))
    for i in range(0, 20, 2):
        call("rename", mpb.RenameReq(ctx=call.ctx(), source=ref(f"/d/f{i}"), destination=ref(f"/d/g{i}")))
    for i in range(1, 20, 4):
        call("remove", mpb.RemoveReq(ctx=call.ctx(), target=ref(f"/d/f{i}")))
    assert getattr(service.engine, "conflicts", 0) > 0
    listing = call("read_dir", mpb.ReadDirReq(ctx=call.ctx(), dir=ref("/d")))
    expected = {f"g{i}" for i in range(0, 20, 2)} | {f"f{i}" for i in range(1, 20, 2) if (i - 1) % 4}
    assert {e.name.decode() for e in listing.entries} == expected
    assert not call("fsck", mpb.FsckReq()).problems


def test_a_retried_request_returns_the_original_answer() -> None:
    service, store = _engine_service()
    call = Calls(service, store)
    create = mpb.OpenReq(ctx=call.ctx(), target=ref("/f"), flags=O_CREAT | O_EXCL | O_WRONLY, mode=0o600)
    first = call("open", create)
    again = call("open", create)  # the reply was lost; the client sends the same request again
    assert again == first and again.created
    with pytest.raises(AlreadyExists):  # a new request is a new exclusive create
        call("open", mpb.OpenReq(ctx=call.ctx(), target=ref("/f"), flags=O_CREAT | O_EXCL | O_WRONLY))
    remove = mpb.RemoveReq(ctx=call.ctx(), target=ref("/f"))
    assert call("remove", remove) == call("remove", remove)
    # Answers are forgotten once the client says it will not ask again.
    idem = [k for k, _ in store.scan(schema.idem_prefix(), b"IDEN")]
    assert idem
    call("renew_client", mpb.RenewClientReq(client_id=CLIENT, completed_below=call.request_id + 1))
    assert [k for k, _ in store.scan(schema.idem_prefix(), b"IDEN")] == []


def test_mutations_without_identity_are_refused() -> None:
    service, engine = _engine_service()
    call = Calls(service, engine)
    with pytest.raises(InvalidArgument):
        call("make_node", mpb.MakeNodeReq(ctx=mpb.ReqCtx(client_id=CLIENT), target=ref("/d"), type=mpb.DIRECTORY))
    with pytest.raises(InvalidArgument):
        call("make_node", mpb.MakeNodeReq(ctx=mpb.ReqCtx(client_id=b"short", request_id=1), target=ref("/d"),
                                          type=mpb.DIRECTORY))

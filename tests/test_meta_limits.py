"""Meta's explicit limits (``fs3/meta/limits.py``), each at its edge: at the limit a request is
served, one past it is refused with a clear error and nothing changes; and the clean-up of a
client's saved answers runs in bounded transactions that a crash between leaves resumable."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fs3 import meta_pb2 as mpb
from fs3.common.errors import InvalidArgument, NameTooLong, Unavailable, XattrTooLarge
from fs3.common.posix import XATTR_NAME_MAX_BYTES, XATTR_VALUE_MAX_BYTES
from fs3.kv.api import prefix_end
from fs3.kv.store import MemKVStore, WriteBatch
from fs3.meta import ops, schema
from fs3.meta.limits import ANSWER_DELETE_PAGE, BATCH_STAT_MAX, CHUNK_PAGE_MAX
from fs3.meta.ops import LengthReport
from fs3.meta.service import MetaService, MetaServiceConfig
from tests.test_meta_edges import Requests
from tests.test_meta_ops import CLIENT, _service, ref


def test_batch_stat_serves_the_largest_batch_and_refuses_one_more() -> None:
    service, _ = _service()
    calls = Requests(service)

    async def main() -> None:
        ids = [schema.ROOT_INODE] * BATCH_STAT_MAX
        rsp = await calls("batch_stat", mpb.BatchStatReq(ctx=calls.ctx(), inode_ids=ids))
        assert isinstance(rsp, mpb.BatchStatRsp) and len(rsp.inodes) == BATCH_STAT_MAX
        with pytest.raises(InvalidArgument, match=f"at most {BATCH_STAT_MAX}"):
            await calls("batch_stat", mpb.BatchStatReq(ctx=calls.ctx(), inode_ids=[*ids, schema.ROOT_INODE]))

    asyncio.run(main())


def test_chunk_page_is_bounded_on_both_sides() -> None:
    MetaServiceConfig(chunk_page=CHUNK_PAGE_MAX).validate()
    MetaServiceConfig(chunk_page=1).validate()
    for wrong in (0, CHUNK_PAGE_MAX + 1):
        with pytest.raises(InvalidArgument, match="chunk_page"):
            MetaServiceConfig(chunk_page=wrong).validate()


def test_xattr_name_and_value_at_their_limits_and_one_past() -> None:
    service, _ = _service()
    calls = Requests(service)

    async def names() -> list[bytes]:
        rsp = await calls("list_xattr", mpb.ListXattrReq(ctx=calls.ctx(), target=ref("/f"), follow=True))
        assert isinstance(rsp, mpb.ListXattrRsp)
        return list(rsp.names)

    async def main() -> None:
        await calls("make_node", mpb.MakeNodeReq(ctx=calls.ctx(), target=ref("/f"), type=mpb.FILE, mode=0o644))
        longest = b"user." + b"n" * (XATTR_NAME_MAX_BYTES - 5)
        await calls("set_xattr", mpb.SetXattrReq(ctx=calls.ctx(), target=ref("/f"), name=longest,
                                                 value=b"v" * XATTR_VALUE_MAX_BYTES))
        assert await names() == [longest]
        with pytest.raises(NameTooLong, match=str(XATTR_NAME_MAX_BYTES)):
            await calls("set_xattr", mpb.SetXattrReq(ctx=calls.ctx(), target=ref("/f"), name=longest + b"x",
                                                     value=b"v"))
        with pytest.raises(XattrTooLarge, match=str(XATTR_VALUE_MAX_BYTES)):
            await calls("set_xattr", mpb.SetXattrReq(ctx=calls.ctx(), target=ref("/f"), name=b"user.b",
                                                     value=b"v" * (XATTR_VALUE_MAX_BYTES + 1)))
        assert await names() == [longest]  # nothing changed

    asyncio.run(main())


def test_a_readdir_page_past_the_limit_is_clamped_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "READDIR_LIMIT_MAX", 3)
    service, _ = _service()
    calls = Requests(service)

    async def main() -> None:
        for name in "abcde":
            await calls.mkdir(schema.ROOT_INODE, name.encode())
        for limit in (3, 4):
            rsp = await calls("read_dir", mpb.ReadDirReq(ctx=calls.ctx(), dir=ref("/"), limit=limit))
            assert isinstance(rsp, mpb.ReadDirRsp)
            assert [e.name for e in rsp.entries] == [b"a", b"b", b"c"]

    asyncio.run(main())


def test_the_length_report_is_frozen_and_probing_keeps_the_writer_part() -> None:
    report = LengthReport(hint=4096, wrote=True, acked=True)
    probed = report.probed(8192, 3, final=False)
    assert (probed.hint, probed.wrote, probed.acked) == (4096, True, True)
    assert (probed.exact, probed.probed_gen, probed.final) == (8192, 3, False)
    with pytest.raises(AttributeError):
        report.hint = 0  # type: ignore[misc]


def _saved_answers(store: MemKVStore, client_id: bytes, count: int) -> None:
    """``count`` saved answers of the client, requests 1 to ``count``, written straight to the store."""
    batch = WriteBatch()
    record = schema.IdemRecord(1, mpb.InodeRsp().SerializeToString()).encode()
    for request_id in range(1, count + 1):
        batch.put(schema.idem_key(client_id, request_id), record)
    store.write(batch)


def _answers_left(store: MemKVStore, client_id: bytes) -> int:
    start = schema.idem_key(client_id, 0)
    return sum(1 for _ in store.scan(start, prefix_end(start[:-8])))


class CommitLog:
    """Counts the writes of every commit; ``fail_at`` makes that commit (1-based) fail, as a crash
    between two transactions would leave things."""

    def __init__(self, service: MetaService, fail_at: int = 0) -> None:
        self.writes: list[int] = []
        self.fail_at = fail_at
        original = service.engine.commit  # type: ignore[attr-defined]

        async def commit(txn: Any) -> None:
            if len(self.writes) + 1 == self.fail_at:
                self.writes.append(0)
                raise Unavailable("the meta server went away")
            self.writes.append(len(txn.writes))
            await original(txn)

        service.engine.commit = commit  # type: ignore[attr-defined]


def test_an_expired_client_s_many_saved_answers_go_in_bounded_resumable_transactions() -> None:
    count = 2 * ANSWER_DELETE_PAGE + 500
    service, store = _service()
    _saved_answers(store, CLIENT, count)
    expired_key = schema.expired_client_key(CLIENT)
    marked = WriteBatch()
    marked.put(expired_key, schema.ExpiredClient(1).encode())
    store.write(marked)
    crashing = CommitLog(service, fail_at=2)
    with pytest.raises(Unavailable):
        asyncio.run(service._expire_client(CLIENT, expired_key))
    assert _answers_left(store, CLIENT) == count - ANSWER_DELETE_PAGE  # the first page went for good
    log = CommitLog(service)
    asyncio.run(service._expire_client(CLIENT, expired_key))
    assert _answers_left(store, CLIENT) == 0
    assert max(log.writes) <= ANSWER_DELETE_PAGE and len(log.writes) >= 3, log.writes
    assert schema.ExpiredClient.decode(store.get(expired_key) or b"").cleaned
    assert crashing.writes[0] == ANSWER_DELETE_PAGE


def test_a_renewal_forgets_many_completed_answers_in_bounded_transactions() -> None:
    count = ANSWER_DELETE_PAGE + 10
    service, store = _service()
    calls = Requests(service)

    async def main() -> None:
        await calls("renew_client", mpb.RenewClientReq(client_id=CLIENT))
        _saved_answers(store, CLIENT, count + 5)
        log = CommitLog(service)
        await calls("renew_client", mpb.RenewClientReq(client_id=CLIENT, renewals=1, completed_below=count + 1))
        assert _answers_left(store, CLIENT) == 5  # those still in flight stay
        assert max(log.writes) <= ANSWER_DELETE_PAGE and len(log.writes) >= 3, log.writes

    asyncio.run(main())


def test_the_gc_scan_pages_through_the_whole_queue() -> None:
    """A scan reads the queue a page at a time and goes on to the end: jobs past the first page
    are not left for a later round (nor starved by jobs that keep failing at its head)."""
    service, store = _service()
    jobs = WriteBatch()
    for inode_id in (1001, 1002, 1003):  # inodes without chunks (no chains): only their records go
        jobs.put(schema.gc_key(inode_id), schema.GcJob(mpb.Layout(), 0, 0).encode())
    store.write(jobs)
    assert asyncio.run(service.run_gc_once(limit=1)) == 3
    assert not list(store.scan(schema.gc_prefix(), prefix_end(schema.gc_prefix())))

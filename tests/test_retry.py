"""The one retry policy and the one table of retryable codes."""

from __future__ import annotations

import asyncio

import pytest

from fs3.client.storage_client import StorageClientConfig
from fs3.common.clock import ManualClock
from fs3.common.errors import (
    RETRYABLE,
    MaybeCommitted,
    NotFound,
    RetryCause,
    StatusCode,
    TxnConflict,
    is_retryable,
    may_have_run,
)
from fs3.common.retry import Attempts, Backoff, RetryPolicy
from fs3.kv.api import Transaction
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine, run_transaction, transaction_retry
from fs3.storage.replica import ReplicaConfig


def test_exponential_backoff_doubles_up_to_its_cap() -> None:
    policy = RetryPolicy(backoff_base_ms=100, backoff_max_ms=2_000)
    assert [policy.backoff_ms(n) for n in range(1, 8)] == [100, 200, 400, 800, 1_600, 2_000, 2_000]
    assert policy.backoff_ms(10_000) == 2_000  # no overflow however long it retries


def test_linear_and_constant_backoff() -> None:
    linear = RetryPolicy(backoff_base_ms=50, backoff_max_ms=1_000, backoff=Backoff.LINEAR)
    assert [linear.backoff_ms(n) for n in (1, 2, 3, 20, 21)] == [50, 100, 150, 1_000, 1_000]
    constant = RetryPolicy(backoff_base_ms=200, backoff_max_ms=200, backoff=Backoff.CONSTANT)
    assert {constant.backoff_ms(n) for n in range(1, 10)} == {200}


def test_jitter_stays_within_its_share_of_the_wait() -> None:
    policy = RetryPolicy(backoff_base_ms=100, backoff_max_ms=1_000, jitter=0.5)
    assert policy.backoff_ms(1, random=lambda: 0.0) == 100
    assert policy.backoff_ms(1, random=lambda: 0.999) == pytest.approx(50.05)
    for n in range(1, 12):
        assert 0.5 * min(100 * 2 ** (n - 1), 1_000) <= policy.backoff_ms(n, random=lambda: 0.7) <= 1_000
    with pytest.raises(ValueError, match="random source"):
        policy.backoff_ms(1)


@pytest.mark.parametrize("kwargs", [dict(backoff_base_ms=10, backoff_max_ms=5),
                                    dict(backoff_base_ms=-1, backoff_max_ms=5),
                                    dict(backoff_base_ms=1, backoff_max_ms=5, jitter=1.5),
                                    dict(backoff_base_ms=1, backoff_max_ms=5, attempts_max=-1)])
def test_nonsense_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_the_deadline_is_respected() -> None:
    clock = ManualClock(1_000)
    attempts = Attempts(RetryPolicy(backoff_base_ms=10, backoff_max_ms=10, deadline_ms=500), clock)
    assert not attempts.exhausted()
    clock.advance(499)
    assert not attempts.exhausted()
    clock.advance(1)
    assert attempts.expired() and attempts.exhausted()
    cut = Attempts(RetryPolicy(backoff_base_ms=10, backoff_max_ms=10, deadline_ms=500), clock, budget_ms=100)
    clock.advance(100)
    assert cut.exhausted()  # a caller's budget overrides the policy's deadline
    none_left = Attempts(RetryPolicy(backoff_base_ms=10, backoff_max_ms=10, deadline_ms=0), clock)
    assert none_left.exhausted()  # a budget of zero allows no retry (it is not "no limit")
    with pytest.raises(ValueError, match="clock"):
        Attempts(RetryPolicy(backoff_base_ms=10, backoff_max_ms=10, deadline_ms=500))


def test_attempts_are_counted_and_waited_for() -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    attempts = Attempts(RetryPolicy(backoff_base_ms=100, backoff_max_ms=300, attempts_max=4), sleep=sleep)

    async def run() -> int:
        tries = 1
        while not attempts.exhausted():
            await attempts.backoff()
            tries += 1
        return tries

    assert asyncio.run(run()) == 4
    assert waits == [0.1, 0.2, 0.3]


def test_the_table_says_what_each_caller_may_retry() -> None:
    assert not is_retryable(StatusCode.NOT_FOUND) and not NotFound().retryable
    assert TxnConflict().retryable and MaybeCommitted().retryable
    service = {RetryCause.TRANSPORT, RetryCause.OVERLOAD, RetryCause.COMMIT}
    assert {code for code in RETRYABLE if is_retryable(code, service)} == {
        StatusCode.UNAVAILABLE, StatusCode.TIMEOUT, StatusCode.TXN_CONFLICT, StatusCode.RESOURCE_EXHAUSTED,
        StatusCode.MAYBE_COMMITTED}
    assert {code for code in RETRYABLE if may_have_run(code)} == {
        StatusCode.UNAVAILABLE, StatusCode.TIMEOUT, StatusCode.MAYBE_COMMITTED}
    assert not is_retryable(StatusCode.CHUNK_NOT_COMMITTED, service)


def test_a_transaction_raises_a_non_retryable_error_at_once_and_retries_conflicts() -> None:
    engine = OptimisticTxnEngine(MemKVStore(), sync=False)
    calls: list[int] = []

    async def missing(txn: Transaction) -> None:
        calls.append(1)
        raise NotFound("no such key")

    async def conflicting(txn: Transaction) -> None:
        calls.append(1)
        raise TxnConflict("always")

    async def run() -> None:
        with pytest.raises(NotFound):
            await run_transaction(engine, missing, retry_max=5, backoff_ms=0)
        assert len(calls) == 1
        calls.clear()
        with pytest.raises(TxnConflict, match="gave up after 3 retries"):
            await run_transaction(engine, conflicting, retry_max=3, backoff_ms=0)
        assert len(calls) == 4

    asyncio.run(run())


def test_the_default_policies_are_the_former_loops() -> None:
    txn = transaction_retry()
    assert txn.attempts_max == 21 and [txn.backoff_ms(n) for n in (1, 20, 25)] == [1.0, 20.0, 20.0]
    storage = StorageClientConfig().retry  # formerly min(50 x 2^n, 1000) ms, for 60 s
    assert [storage.backoff_ms(n) for n in range(1, 7)] == [100, 200, 400, 800, 1_000, 1_000]
    assert storage.deadline_ms == 60_000 and storage.attempts_max == 0
    assert transaction_retry().deadline_ms is None
    replica = ReplicaConfig()
    assert replica.forward_retry.deadline_ms == replica.forward_retry_total_ms
    assert [replica.repair_retry.backoff_ms(n) for n in range(1, 7)] == [200, 400, 800, 1_600, 3_200, 5_000]

"""Both transaction engines behind one fixture, so an engine-agnostic test runs on each.

``make_engine`` is parametrized over ``mem`` (:class:`~fs3.kv.txn.OptimisticTxnEngine` on a
:class:`~fs3.kv.store.MemKVStore`) and ``postgres`` (:class:`~fs3.kv.postgres.PostgresTxnEngine`
on an empty database of the private server, tests/postgres.py): an async factory
``await make_engine(faults)`` called inside the test's event loop (a PostgreSQL engine's
connections belong to the loop that opened them). Every engine made on PostgreSQL shares the
test's one database, as several meta servers would; their connections are closed afterwards.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from fs3.kv.api import TxnEngine
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine, TxnFaults

__all__ = ["ENGINES", "EngineFactory", "engine_kind", "make_engine"]

ENGINES = ("mem", "postgres")
EngineFactory = Callable[..., Awaitable[Any]]


@pytest.fixture(params=ENGINES)
def engine_kind(request: pytest.FixtureRequest) -> str:
    """Which engine this run of the test uses."""
    kind: str = request.param
    return kind


@pytest.fixture
def make_engine(request: pytest.FixtureRequest, engine_kind: str) -> Iterator[EngineFactory]:
    """``await make_engine(faults=None, **postgres_options)``: a new engine of this run's kind."""
    made: list[Any] = []
    url = request.getfixturevalue("postgres_url") if engine_kind == "postgres" else ""

    async def make(faults: TxnFaults | None = None, **options: Any) -> TxnEngine:
        if engine_kind == "mem":
            engine: Any = OptimisticTxnEngine(MemKVStore(), faults=faults)
        else:
            from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine

            engine = await PostgresTxnEngine.open(PostgresConfig(url, **options), faults=faults)
        made.append(engine)
        return engine  # type: ignore[no-any-return]

    try:
        yield make
    finally:
        for engine in made:
            if hasattr(engine, "terminate"):
                engine.terminate()

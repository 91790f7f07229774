"""Several meta servers registered with mgmtd: clients spread over them and carry on when one stops.

An in-process cluster with three meta servers on one transaction engine (the database they would
share). Several clients work at once (directories, files written and closed, renames, removals);
one meta server is stopped mid-workload, a new one started in its place later. Every operation a
client saw acknowledged must be in the namespace at the end, with its data, and fsck must be clean.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import fs3.aio
from fs3.client.fs import AsyncFileSystem
from fs3.meta.service import MetaService, MetaServiceConfig
from tests.conftest import wait_until
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # in-process clusters

CHUNK = 65536
CLIENTS = 6
ROUNDS = 12


class Workload:
    """One client's files: what it saw acknowledged (path -> content; None: removed)."""

    def __init__(self, index: int, fs: AsyncFileSystem) -> None:
        self.index = index
        self.fs = fs
        self.rng = random.Random(index)
        self.acked: dict[str, bytes] = {}
        self.done = 0

    async def run(self, rounds: int, pause: asyncio.Event) -> None:
        top = f"/w{self.index}"
        await self.fs.mkdir(top)
        for n in range(rounds):
            await pause.wait()
            path = f"{top}/f{n}"
            data = self.rng.randbytes(self.rng.randrange(1, 2 * CHUNK))
            await self.fs.write_bytes(path, data)
            self.acked[path] = data
            if n % 3 == 1:
                moved = f"{top}/moved{n}"
                await self.fs.rename(path, moved)
                self.acked[moved] = self.acked.pop(path)
            if n % 4 == 3:
                victim = sorted(self.acked)[0]
                await self.fs.remove(victim)
                del self.acked[victim]
            self.done += 1


def test_clients_spread_over_meta_servers_and_fail_over_when_one_stops(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    served: Counter[bytes] = Counter()
    original = MetaService._mutate
    dying: list[MetaService] = []  # a server that commits its next request and then never answers
    hung = asyncio.Event()

    async def counted(self: MetaService, *args: Any, **kwargs: Any) -> Any:
        served[self.server_id] += 1
        rsp = await original(self, *args, **kwargs)
        if self in dying:
            hung.set()
            await asyncio.Event().wait()  # committed, never answered: the client retries elsewhere
        return rsp

    monkeypatch.setattr(MetaService, "_mutate", counted)

    async def main() -> None:
        config = MetaServiceConfig(root_mode=0o777, prune_interval_ms=100, gc_interval_ms=100, claim_ttl_ms=1_000)
        async with InProcessCluster(tmp_path, targets_per_node=2, with_meta=True, meta_servers=3,
                                    meta_config=config) as cluster:
            clients = [await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token) for _ in range(CLIENTS)]
            try:
                await clients[0].set_layout("/", chunk_size=CHUNK, stripe=2)
                pause = asyncio.Event()
                pause.set()
                loads = [Workload(i, fs) for i, fs in enumerate(clients)]
                tasks = [asyncio.create_task(w.run(ROUNDS, pause)) for w in loads]
                await wait_until(lambda: _at_least(loads, 3), timeout_s=60, what="the workload under way")
                assert len([s for s in served if served[s]]) >= 2, f"requests all went to one server: {served}"
                # The busiest server commits one more request, then dies without answering it:
                # the client sends it again (same request id) to another server, which answers
                # from the saved answer; the server's other clients move over too.
                index, victim = max(cluster.metas.items(), key=lambda item: served[item[1].server_id])
                dying.append(victim)
                await asyncio.wait_for(hung.wait(), 30)
                await asyncio.wait_for(cluster.stop_meta_server(index), 30)
                before = served[victim.server_id]
                await wait_until(lambda: _at_least(loads, 8), timeout_s=60, what="the workload past the stop")
                assert served[victim.server_id] == before
                await cluster.start_meta_server(index)  # a new server joins (the same node id)
                await asyncio.wait_for(asyncio.gather(*tasks), 120)
                assert all(w.done == ROUNDS for w in loads)
                reader = clients[0]
                for load in loads:
                    top = f"/w{load.index}"
                    assert sorted(await reader.listdir(top)) == sorted(p.rsplit("/", 1)[1] for p in load.acked)
                    for path, data in load.acked.items():
                        assert await reader.read_bytes(path) == data, path
                servers = [m for m in cluster.metas.values()]

                async def collected() -> bool:
                    return (await reader.fsck()).gc_pending == 0

                await wait_until(collected, timeout_s=30, what="removed files collected")
                report = await reader.fsck()
                assert not report.problems, report.problems
                assert all(not m.claims.held for m in servers)
            finally:
                for fs in clients:
                    await fs.close()

    asyncio.run(main())


async def _at_least(loads: list[Workload], rounds: int) -> bool:
    return all(w.done >= rounds for w in loads)

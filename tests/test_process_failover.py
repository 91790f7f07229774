"""Real processes on loopback: mgmtd + 3 storage nodes, 3-replica chains, SIGKILL head, middle, tail.

While a client streams writes, each fault must lose no acknowledged write, writes must continue
after failover, the killed node must come back through syncing to serving, and at the end every
replica of every chunk must be byte-identical (checked with the admin verify command).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys

import pytest

from fs3 import common_pb2 as cpb
from fs3.client.admin import AdminClient
from fs3.common.errors import FS3Error
from fs3.common.ids import chunk_id
from tests.conftest import make_client, wait_until
from tests.harness import ProcessCluster

CHUNK_SIZE = 64 * 1024
CHUNKS = 12

pytestmark = pytest.mark.slow


def _payload(seq: int) -> bytes:
    block = hashlib.sha256(seq.to_bytes(8, "little")).digest()
    return (block * (CHUNK_SIZE // len(block) + 1))[: CHUNK_SIZE - (seq % 7) * 512]


async def _all_serving(admin: AdminClient) -> bool:
    rsp = await admin.chains()
    states = {t.target_id: t.public_state for t in rsp.targets}
    return bool(rsp.chains) and all(states[t] == cpb.SERVING for c in rsp.chains for t in c.target_ids)


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_failover_head_middle_tail(process_cluster: ProcessCluster, transport: str) -> None:
    asyncio.run(_failover(process_cluster, transport))


async def _failover(cluster: ProcessCluster, transport: str) -> None:
    client, channels = make_client(cluster, transport)
    admin = AdminClient(cluster.address("mgmtd", transport), channels)
    await wait_until(lambda: _registered(admin, 6), what="6 targets registered")
    table = await admin.create_chain_table(1, replicas=3)
    assert len(table.chains) == 2
    await wait_until(lambda: _all_serving(admin), what="all targets serving")
    chain_ids = [c.chain_id for c in table.chains]

    # Per chunk, every update in the order the (only) writer sent it, and whether it was acknowledged.
    ledger: dict[int, list[tuple[str, bytes | int, bool]]] = {}
    counts = {"acked": 0, "failed": 0}
    stop = asyncio.Event()

    async def writer() -> None:
        seq = 0
        while not stop.is_set():
            seq += 1
            index = seq % CHUNKS
            data = _payload(seq)
            ops = ledger.setdefault(index, [])
            try:
                # Then truncate, so that a shorter payload leaves no older tail behind.
                try:
                    await client.write(chain_ids[index % 2], chunk_id(7, index), 0, data, CHUNK_SIZE)
                    ops.append(("write", data, True))
                except FS3Error:
                    ops.append(("write", data, False))
                    raise
                try:
                    await client.truncate(chain_ids[index % 2], chunk_id(7, index), len(data), CHUNK_SIZE)
                    ops.append(("truncate", len(data), True))
                except FS3Error:
                    ops.append(("truncate", len(data), False))
                    raise
                counts["acked"] += 1
            except FS3Error:
                counts["failed"] += 1
            await asyncio.sleep(0.005)

    task = asyncio.create_task(writer())
    await wait_until(lambda: _ge(counts, 20), what="initial writes")

    # Over gRPC the head alone: the client's transport meets a failover where its writes go, at the
    # head (a dead connection, a new routing table, a new head). The middle and the tail are reached
    # by the storage nodes' own forwarding, the same whichever transport the client speaks, and the
    # framed run kills all three (about 9 s of make test saved by not repeating them).
    roles = ("head", "middle", "tail") if transport == "framed" else ("head",)
    for role in roles:
        chains = await admin.chains()
        chain = next(c for c in chains.chains if c.chain_id == chain_ids[0])
        victim_target = {"head": chain.target_ids[0], "middle": chain.target_ids[1], "tail": chain.target_ids[2]}[role]
        victim = f"storage-{victim_target // 100}"
        before = counts["acked"]
        cluster.kill(victim)

        async def victim_offline(victim_target: int = victim_target) -> bool:
            targets = {t.target_id: t for t in await admin.targets()}
            return targets[victim_target].public_state in (cpb.OFFLINE, cpb.LASTSRV)

        await wait_until(victim_offline, what=f"{role} {victim} marked offline")
        await wait_until(lambda before=before: _ge(counts, before + 20), what=f"writes after losing the {role}")
        cluster.start(victim)
        await wait_until(lambda: _all_serving(admin), timeout_s=60, what=f"{victim} back to serving")

    stop.set()
    await task
    assert counts["acked"] > 20 + 20 * len(roles)

    # Each chunk holds exactly what its updates make of it: every acknowledged one applied once, in
    # order; one whose outcome the writer never learned applied or not (a head completes or drops
    # such an update before the next one on the chunk). Byte for byte, nothing else.
    for index in range(CHUNKS):
        data, _ = await client.read(chain_ids[index % 2], chunk_id(7, index), 0, CHUNK_SIZE)
        allowed = _possible_contents(ledger.get(index, []))
        assert data in allowed, f"chunk {index}: {len(data)} bytes match none of {len(allowed)} possible contents"
    report = await admin.verify()
    assert report.ok, report.as_dict()
    assert report.chunks_checked >= CHUNKS
    await channels.close()

    # The same check through the command line, as an operator would run it.
    out = subprocess.run([sys.executable, "-m", "fs3.cli.main", "admin", "--mgmtd",
                          cluster.address("mgmtd", transport), "--transport", transport, "--token", cluster.token,
                          "--json", "verify"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"] is True


def _possible_contents(ops: list[tuple[str, bytes | int, bool]]) -> set[bytes]:
    states = {b""}
    for kind, arg, acked in ops:
        applied = {_apply(kind, arg, state) for state in states}
        states = applied if acked else states | applied
    return states


def _apply(kind: str, arg: bytes | int, state: bytes) -> bytes:
    if kind == "write":
        assert isinstance(arg, bytes)
        return arg + state[len(arg):]
    assert isinstance(arg, int)
    return state[:arg] + bytes(max(0, arg - len(state)))


def test_the_exact_check_rejects_a_wrong_chunk() -> None:
    """The ledger check itself: acknowledged updates must all be there, unacknowledged ones may be."""
    ops: list[tuple[str, bytes | int, bool]] = [("write", b"aaaa", True), ("truncate", 4, True),
                                                ("write", b"bb", False), ("truncate", 2, False)]
    allowed = _possible_contents(ops)
    assert allowed == {b"aaaa", b"bbaa", b"bb", b"aa"}
    assert b"aaa" not in allowed and b"bbaab" not in allowed and b"" not in allowed


async def _registered(admin: AdminClient, count: int) -> bool:
    return len(await admin.targets()) >= count


async def _ge(counts: dict[str, int], n: int) -> bool:
    return counts["acked"] >= n


def test_mgmtd_restart_disturbs_no_serving_chain(process_cluster: ProcessCluster) -> None:
    asyncio.run(_mgmtd_restart(process_cluster))


async def _mgmtd_restart(cluster: ProcessCluster) -> None:
    client, channels = make_client(cluster)
    admin = AdminClient(cluster.mgmtd_address, channels)
    await wait_until(lambda: _registered(admin, 6), what="6 targets registered")
    table = await admin.create_chain_table(1, replicas=3)
    await wait_until(lambda: _all_serving(admin), what="all targets serving")
    before = {c.chain_id: (c.chain_version, list(c.target_ids)) for c in (await admin.chains()).chains}
    chain = table.chains[0].chain_id
    await client.write(chain, chunk_id(8, 0), 0, b"before", CHUNK_SIZE)
    cluster.kill("mgmtd")
    # Storage keeps serving reads from its cached routing while mgmtd is away (within the lease).
    data, _ = await client.read(chain, chunk_id(8, 0), 0, 6)
    assert data == b"before"
    cluster.start("mgmtd")
    await wait_until(lambda: _all_serving(admin), what="serving after the restart")
    await client.write(chain, chunk_id(8, 1), 0, b"after", CHUNK_SIZE)
    after = {c.chain_id: (c.chain_version, list(c.target_ids)) for c in (await admin.chains()).chains}
    assert after == before, "a mgmtd restart must not change any chain"
    report = await admin.verify()
    assert report.ok and report.chunks_checked == 2, report.as_dict()
    await channels.close()

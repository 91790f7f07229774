"""Random small records through the native client: ``read_many`` against one read per record.

A data loader's access pattern: records of 4 KiB at random offsets of a few large files, read
through the same client (``fs3.aio``) on a 3-node, 3-replica process cluster, three ways in one run:

* ``read_many``: batches of ``--batch`` records, one call each (one BatchRead per storage node);
* ``pread``: one ``pread`` per record, one after another (what a loader reading record by record does);
* ``pread_gather``: the same ``pread`` calls, a batch of them at once (concurrency without batching).

Every way reads the same records and is checked against the files' bytes. Prints one JSON line
(records/s of each, and the ratios to ``pread``) and writes ``bench/results/read-many-<stamp>.json``.

Usage: ``python bench/read_many_bench.py [--records 10000] [--batch 256] [--files 4] [--file-mib 16]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import save_result  # noqa: E402
from tests.harness import ProcessCluster  # noqa: E402

MIB = 1024 * 1024
RECORD = 4096


async def _measure(address: str, token: str, args: argparse.Namespace) -> dict[str, Any]:
    import fs3.aio

    rng = random.Random(args.seed)
    fs = await fs3.aio.connect(address, token=token)
    try:
        await fs.mkdir("/bench")
        contents: dict[str, bytes] = {}
        for n in range(args.files):
            path = f"/bench/shard-{n:05d}.rec"
            contents[path] = rng.randbytes(args.file_mib * MIB)
            await fs.write_bytes(path, contents[path])
        handles = {path: await fs.open(path, "rb") for path in contents}
        paths = sorted(contents)
        records = [(path, rng.randrange(0, len(contents[path]) - RECORD)) for path in
                   (rng.choice(paths) for _ in range(args.records))]
        batches = [records[i:i + args.batch] for i in range(0, len(records), args.batch)]
        buffer = bytearray(args.batch * RECORD)

        def check(path: str, offset: int, data: Any) -> None:
            if bytes(data) != contents[path][offset:offset + RECORD]:
                raise AssertionError(f"wrong bytes for {path}@{offset}")

        async def by_read_many() -> None:
            for batch in batches:
                views = await fs.read_many([(handles[p], o, RECORD) for p, o in batch], buffer)
                for (path, offset), view in zip(batch, views, strict=True):
                    check(path, offset, view)

        async def by_pread() -> None:
            for path, offset in records:
                check(path, offset, await handles[path].pread(offset, RECORD, readahead=False))

        async def by_pread_gather() -> None:
            for batch in batches:
                got = await asyncio.gather(*(handles[p].pread(o, RECORD, readahead=False) for p, o in batch))
                for (path, offset), data in zip(batch, got, strict=True):
                    check(path, offset, data)

        # Warm up connections and caches of every kind, untimed.
        await fs.read_many([(handles[p], o, RECORD) for p, o in records[:args.batch]])
        for path, offset in records[:64]:
            await handles[path].pread(offset, RECORD, readahead=False)
        rpcs_before = fs.batch_read_metrics.rpcs._value.get()
        rates: dict[str, float] = {}
        for name, way in (("read_many", by_read_many), ("pread", by_pread), ("pread_gather", by_pread_gather)):
            start = time.perf_counter()
            await way()
            rates[name] = len(records) / (time.perf_counter() - start)
            if name == "read_many":
                rpcs = fs.batch_read_metrics.rpcs._value.get() - rpcs_before
        for f in handles.values():
            await f.close()
        return {"records": len(records), "record_bytes": RECORD, "batch": args.batch, "files": args.files,
                "file_mib": args.file_mib, "records_per_s": rates,
                "batch_read_rpcs_per_batch": rpcs / len(batches),
                "ratios": {"read_many_vs_pread": rates["read_many"] / rates["pread"],
                           "read_many_vs_pread_gather": rates["read_many"] / rates["pread_gather"]}}
    finally:
        await fs.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--file-mib", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    import uvloop

    with tempfile.TemporaryDirectory(prefix="fs3-read-many-bench-") as tmp:
        cluster = ProcessCluster(Path(tmp) / "cluster", storage_nodes=3, targets_per_node=2)
        try:
            cluster.start_all()
            asyncio.run(cluster.ensure_chains(3))
            result = uvloop.run(_measure(cluster.mgmtd_address, cluster.token, args))
        finally:
            cluster.stop_all()
    path = save_result("read-many", result)
    print(json.dumps(result))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

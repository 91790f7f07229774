"""haiscale.data read throughput: one data set read three ways, in one run.

The same record shards are read by :class:`haiscale.data.RecordDataset` through a ``DataLoader``
with 4 workers (shuffled, batches of 64, each batch one ``read_many`` call):

* fs3: the native client (``fs3.connect``), the batch's ranges fetched concurrently from the chains;
* FUSE: the same files on the cluster's FUSE mount (``fs3 local``'s ``mount``), read with ``preadv``
  through the kernel, range after range (``LocalFileSystem`` given explicitly);
* usrbio: the same mount path given as a path: ``RecordDataset`` reads it through
  :mod:`fs3.usrbio` (one submit per batch to the mount daemon, shared memory);
* local: a copy on the local disk (the page cache dropped first when root).

fs3 runs as a local cluster of separate processes (mgmtd, meta, 3 storage nodes with 2 targets each,
chains of 3 replicas) on this machine, so all three share its CPUs: the figures compare the paths,
not a deployment. Usage: ``python bench/haiscale_data_bench.py [--records 8192] [--record-bytes 4096]``.
Prints one JSON line (samples/s each way and the ratios) and writes ``bench/results/haiscale-data-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils.data

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fs3  # noqa: E402
from bench.results_io import save_result  # noqa: E402
from fs3.cli.local import LocalCluster  # noqa: E402
from haiscale.data import DistributedRecordSampler, LocalFileSystem, RecordDataset, RecordFS, write_shards  # noqa: E402


def _drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:  # not root: the local figures flatter the disk
        return False
    return True


def _records(count: int, size: int) -> list[bytes]:
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (count, size), dtype=torch.uint8, generator=generator).numpy()
    return [row.tobytes() for row in data]


def _samples_per_s(dataset: RecordDataset, batch_size: int, workers: int) -> dict[str, float]:
    """One shuffled epoch through a DataLoader; the first batch (workers starting) is not timed."""
    sampler = DistributedRecordSampler(dataset, num_replicas=1, rank=0, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                                         multiprocessing_context=multiprocessing.get_context("fork"), timeout=300)
    batches = iter(loader)
    next(batches)
    samples, start = 0, time.perf_counter()
    for batch in batches:
        samples += len(batch)
    elapsed = time.perf_counter() - start
    return {"samples_per_s": samples / elapsed, "seconds": elapsed, "samples": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=8192)
    parser.add_argument("--record-bytes", type=int, default=4096)
    parser.add_argument("--records-per-file", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    records = _records(args.records, args.record_bytes)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="haiscale-data-bench-") as tmp:
        local_dir = str(Path(tmp) / "local")
        write_shards(LocalFileSystem(), local_dir, records, args.records_per_file)
        cluster = LocalCluster(Path(tmp) / "cluster", storage_nodes=3, targets_per_node=2)
        client: Any = None
        try:
            cluster.start_all()
            asyncio.run(cluster.ensure_chains(3))
            cluster.set_mount(Path(tmp) / "mnt")
            cluster.start("mount")
            client = fs3.connect(cluster.mgmtd_address, token_file=str(cluster.token_file))
            if not hasattr(client, "read_many"):
                print("this fs3 client has no read_many: the dataset reads batches with it", file=sys.stderr)
                return 1
            fs: RecordFS = client
            write_shards(fs, "/bench-records", records, args.records_per_file)
            dropped = _drop_caches()  # every way reads cold data (the storage nodes' files too)
            with RecordDataset((fs, "/bench-records")) as ds:
                results["fs3"] = _samples_per_s(ds, args.batch_size, args.workers)
            _drop_caches()
            mounted = str(Path(tmp) / "mnt" / "bench-records")
            with RecordDataset((LocalFileSystem(), mounted)) as ds:  # plain reads through FUSE
                results["fuse"] = _samples_per_s(ds, args.batch_size, args.workers)
            _drop_caches()
            with RecordDataset(mounted) as ds:  # a path on an fs3 mount: read through fs3.usrbio
                results["usrbio"] = _samples_per_s(ds, args.batch_size, args.workers)
            _drop_caches()
            with RecordDataset(local_dir) as ds:
                assert ds[len(ds) - 1] == records[-1]
                results["local"] = _samples_per_s(ds, args.batch_size, args.workers)
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
            cluster.stop_all()
            shutil.rmtree(local_dir, ignore_errors=True)
    rate = {name: values["samples_per_s"] for name, values in results.items()}
    record = {"bench": "haiscale_data", "records": args.records, "record_bytes": args.record_bytes,
              "batch_size": args.batch_size, "workers": args.workers, "page_cache_dropped": dropped,
              "samples_per_s": rate, "fs3_over_local": rate["fs3"] / rate["local"],
              "fuse_over_local": rate["fuse"] / rate["local"], "fs3_over_fuse": rate["fs3"] / rate["fuse"],
              "usrbio_over_fuse": rate["usrbio"] / rate["fuse"], "usrbio_over_fs3": rate["usrbio"] / rate["fs3"],
              "runs": results}
    path = save_result("haiscale-data", record)
    print(json.dumps({key: value for key, value in record.items() if key != "runs"}))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

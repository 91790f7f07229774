"""Training data on fs3: packed record shards, a dataset that reads a batch in one scattered read,
and a resumable distributed sampler (the role FFRecord plays for 3FS in the Fire-Flyer paper).

    from haiscale.data import RecordDataset, DistributedRecordSampler, write_shards
    write_shards(fs3.connect(), "/datasets/corpus", records, records_per_file=4096)
    ds = RecordDataset("fs3:///datasets/corpus")
    sampler = DistributedRecordSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank)
    loader = torch.utils.data.DataLoader(ds, batch_size=32, sampler=sampler, num_workers=4)

``python -m haiscale.data convert|info|verify`` converts a directory or a text corpus into shards,
and inspects and checks them.
"""

from __future__ import annotations

from haiscale.data.dataset import RecordDataset, TensorBatches, list_shards, open_location
from haiscale.data.records import (
    FORMAT_VERSION,
    LocalFileSystem,
    RecordFormatError,
    RecordFS,
    RecordWriter,
    ShardIndex,
    read_index,
    write_shards,
)
from haiscale.data.sampler import DistributedRecordSampler

__all__ = [
    "FORMAT_VERSION",
    "DistributedRecordSampler",
    "LocalFileSystem",
    "RecordDataset",
    "RecordFS",
    "RecordFormatError",
    "RecordWriter",
    "ShardIndex",
    "TensorBatches",
    "list_shards",
    "open_location",
    "read_index",
    "write_shards",
]

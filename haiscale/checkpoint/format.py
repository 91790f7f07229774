"""What a checkpoint looks like on disk, and the checks that refuse a bad one (a pure core: no I/O,
no clock, no randomness).

A published checkpoint is one directory, ``DIR/step-00000100/``:

* ``rank-NNNNN.bin`` (and ``rank-NNNNN.K.bin`` when a rank stripes its bytes over several files):
  the rank's tensors back to back, each starting on an :data:`ALIGN_BYTES` boundary;
* ``rank-NNNNN.json``: the rank's index — every tensor's file, offset, byte count, dtype, shape, one
  CRC32C per :data:`CRC_BLOCK_BYTES` block (so a ranged read can be verified without reading the
  whole tensor) and, for a shard, the whole tensor's shape and the shard's flat offset; and the
  rank's state trees (model, optimizer, ``extra``, RNG) as JSON with tensors replaced by references;
* ``rank-NNNNN.done``: the rank's marker, written after its other files were made durable, naming
  its index's size and CRC32C;
* ``manifest.json``: written last, by rank 0, from every rank's marker.

Everything is JSON or raw tensor bytes: nothing is ever unpickled, so a checkpoint directory
someone else could write cannot run code in the loader. Every number an index or manifest claims is
checked against hard bounds and against the sizes the file system reports before anything is
allocated or read, so a hostile index claiming a huge tensor is refused, not obeyed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c
import torch

from haiscale.sharding import Shard

__all__ = [
    "ALIGN_BYTES", "CRC_BLOCK_BYTES", "FORMAT_VERSION", "MAX_INDEX_BYTES", "MAX_MANIFEST_BYTES",
    "CheckpointCorrupt", "Entry", "Manifest", "Marker", "RankIndex", "TensorRef", "block_crcs", "crc32c",
    "data_file_name", "decode_tree", "encode_tree", "index_file_name", "marker_file_name", "parse_index",
    "parse_manifest", "parse_marker", "parse_step_dir", "parse_tmp_dir", "plan_layout", "render_index",
    "render_manifest", "render_marker", "step_dir_name", "tmp_dir_name",
]

FORMAT_VERSION = 1
ALIGN_BYTES = 4096
"""Every tensor starts on a page boundary of its data file: the host buffer's views of it are
aligned for every dtype, and a loader's ranged reads start on chunk-friendly offsets."""
CRC_BLOCK_BYTES = 1 << 20
"""One CRC32C per MiB of a tensor: a reshard reads (and verifies) only the blocks it needs."""
MAX_INDEX_BYTES = 64 << 20
MAX_MANIFEST_BYTES = 16 << 20
MAX_MARKER_BYTES = 64 << 10
MAX_WORLD_SIZE = 1 << 16
MAX_FILES_PER_RANK = 256
MIN_FILE_BYTES = 16 << 20
MAX_NDIM = 32
MAX_NAME_CHARS = 4096
MAX_TREE_DEPTH = 64

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "bool")
}

_STEP_DIR = re.compile(r"step-(\d{8,12})")
_TMP_DIR = re.compile(r"\.step-(\d{8,12})\.([0-9a-f]{1,32})\.tmp")
_DATA_FILE = re.compile(r"rank-(\d{5})(\.\d{1,3})?\.bin")


class CheckpointCorrupt(Exception):
    """A checkpoint that cannot be loaded as written: a file missing or short, a checksum that does
    not match, a rank that never finished, an index that claims what its files do not hold. The
    loader logs why and falls back to the previous checkpoint."""


def crc32c(data: Any) -> int:
    return int(_crc32c.crc32c(data))


def block_crcs(data: memoryview) -> list[int]:
    """CRC32C of each :data:`CRC_BLOCK_BYTES` block of ``data`` (the last one shorter)."""
    return [crc32c(data[start:start + CRC_BLOCK_BYTES]) for start in range(0, len(data), CRC_BLOCK_BYTES)]


# -- names ----------------------------------------------------------------------------------------

def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_dir_name(step: int, run_id: str) -> str:
    """Where a save of ``step`` by run ``run_id`` is written before it is published. The run id keeps
    a crashed run's leftovers (markers included) out of a later run's save of the same step."""
    return f".step-{step:08d}.{run_id}.tmp"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def parse_tmp_dir(name: str) -> tuple[int, str] | None:
    match = _TMP_DIR.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def data_file_name(rank: int, part: int) -> str:
    return f"rank-{rank:05d}.bin" if part == 0 else f"rank-{rank:05d}.{part}.bin"


def index_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def marker_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.done"


# -- state trees ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorRef:
    """A tensor (or shard) of a state tree, by the name its index entry has."""

    name: str
    shard: bool


def encode_tree(obj: Any, prefix: str, out: dict[str, torch.Tensor | Shard], depth: int = 0) -> Any:
    """``obj`` (dicts with str or int keys, lists, tuples, tensors, Shards, JSON scalars) as JSON, its
    tensors put in ``out`` under path-like names (``optim/state/3/exp_avg``) and referenced by name.

    Dicts are written as key/value lists so that integer keys (an optimizer's parameter ids) come
    back as integers, and tuples stay tuples; anything else is refused with its path, before a byte
    is written — as is what the loader would refuse (nesting deeper than :data:`MAX_TREE_DEPTH`, a
    tensor name longer than :data:`MAX_NAME_CHARS`): a checkpoint that cannot be loaded must fail
    its save, not be published (and have ``keep`` remove the good ones before it).
    """
    if depth > MAX_TREE_DEPTH:
        raise ValueError(f"{prefix[:200]}: the state is nested deeper than {MAX_TREE_DEPTH} levels")
    if isinstance(obj, Shard | torch.Tensor):
        if len(prefix) > MAX_NAME_CHARS:
            raise ValueError(f"{prefix[:200]}...: a tensor's name (its path in the state) is longer than "
                             f"{MAX_NAME_CHARS} characters")
        if prefix in out:
            raise ValueError(f"two tensors of the state are both named {prefix!r}")
        out[prefix] = obj
        return {"__shard__" if isinstance(obj, Shard) else "__tensor__": prefix}
    if isinstance(obj, Mapping):
        items = []
        for key, value in obj.items():
            if isinstance(key, bool) or not isinstance(key, str | int):
                raise TypeError(f"{prefix}: key {key!r} is not a str or an int")
            items.append([key, encode_tree(value, f"{prefix}/{key}", out, depth + 1)])
        return {"__dict__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_tree(v, f"{prefix}/{i}", out, depth + 1) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_tree(v, f"{prefix}/{i}", out, depth + 1) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"{prefix}: a {type(obj).__name__} is neither a tensor nor JSON-able; checkpoints hold "
                    "tensors, dicts, lists, tuples, str, int, float, bool and None (never pickles)")


def tree_refs(tree: Any, depth: int = 0) -> Iterator[TensorRef]:
    """The tensor references of an encoded tree."""
    if depth > MAX_TREE_DEPTH:
        raise CheckpointCorrupt(f"a state tree nested deeper than {MAX_TREE_DEPTH}")
    if isinstance(tree, dict):
        if "__tensor__" in tree or "__shard__" in tree:
            yield _ref(tree)
        elif "__dict__" in tree:
            for item in _dict_items(tree["__dict__"]):
                yield from tree_refs(item[1], depth + 1)
        elif "__tuple__" in tree:
            values = tree["__tuple__"]
            if not isinstance(values, list):
                raise CheckpointCorrupt(f"a malformed tuple {values!r:.80} in a state tree")
            for value in values:
                yield from tree_refs(value, depth + 1)
        else:
            raise CheckpointCorrupt(f"an unknown node {tree!r:.80} in a state tree")
    elif isinstance(tree, list):
        for value in tree:
            yield from tree_refs(value, depth + 1)


def _dict_items(items: Any) -> list[list[Any]]:
    """An encoded dict's ``[key, value]`` items, each checked (a key is a str or an int, never a bool:
    :func:`encode_tree` writes no other); :class:`CheckpointCorrupt` for anything else, so that a
    damaged or hostile index falls back like any other corrupt checkpoint."""
    if not isinstance(items, list):
        raise CheckpointCorrupt(f"a malformed dict {items!r:.80} in a state tree")
    for item in items:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str | int)
                and not isinstance(item[0], bool)):
            raise CheckpointCorrupt(f"a malformed dict item {item!r:.80}")
    return items


def _ref(node: dict[str, Any]) -> TensorRef:
    shard = "__shard__" in node
    name = node["__shard__" if shard else "__tensor__"]
    if not isinstance(name, str):
        raise CheckpointCorrupt(f"a tensor reference {node!r} names no tensor")
    return TensorRef(name, shard)


def decode_tree(tree: Any, resolve: Callable[[TensorRef], Any], depth: int = 0) -> Any:
    """The object :func:`encode_tree` encoded, each reference replaced by ``resolve(ref)``."""
    if depth > MAX_TREE_DEPTH:
        raise CheckpointCorrupt(f"a state tree nested deeper than {MAX_TREE_DEPTH}")
    if isinstance(tree, dict):
        if "__tensor__" in tree or "__shard__" in tree:
            return resolve(_ref(tree))
        if "__dict__" in tree:
            out: dict[Any, Any] = {}
            for item in _dict_items(tree["__dict__"]):
                out[item[0]] = decode_tree(item[1], resolve, depth + 1)
            return out
        if isinstance(tree.get("__tuple__"), list):
            return tuple(decode_tree(v, resolve, depth + 1) for v in tree["__tuple__"])
        raise CheckpointCorrupt(f"an unknown node {tree!r:.80} in a state tree")
    if isinstance(tree, list):
        return [decode_tree(v, resolve, depth + 1) for v in tree]
    return tree


# -- layout -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One tensor (or shard) in a data file."""

    name: str
    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    crcs: tuple[int, ...]
    global_shape: tuple[int, ...] | None = None
    """Set for a shard: the whole tensor's shape (``shape`` is then the 1-D local one)."""
    flat_offset: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def whole_shape(self) -> tuple[int, ...]:
        return self.shape if self.global_shape is None else self.global_shape

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "file": self.file, "offset": self.offset, "nbytes": self.nbytes,
                               "dtype": self.dtype, "shape": list(self.shape), "crcs": list(self.crcs)}
        if self.global_shape is not None:
            out["global_shape"] = list(self.global_shape)
            out["flat_offset"] = self.flat_offset
        return out


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"tensors of dtype {dtype} cannot be checkpointed (supported: {', '.join(DTYPES)})")
    return name


def _align(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def plan_layout(rank: int, sizes: Sequence[tuple[str, int]], files: int) -> tuple[list[tuple[str, int]], list[int]]:
    """Where each ``(name, nbytes)`` goes: ``([(file, offset)] in order, [bytes of each file])``.

    Tensors stay in order and are cut into ``files`` runs of about equal bytes (a tensor is never
    split), so each file is one large sequential write and the files can be written in parallel; a
    small state stays in fewer files (at least :data:`MIN_FILE_BYTES` each).
    """
    total = sum(_align(n) for _, n in sizes)
    files = max(1, min(files, MAX_FILES_PER_RANK, len(sizes) or 1, -(-total // MIN_FILE_BYTES)))
    target = -(-total // files)
    places: list[tuple[str, int]] = []
    file_bytes = [0] * files
    part = 0
    for _name, nbytes in sizes:
        if file_bytes[part] and file_bytes[part] + nbytes > target and part + 1 < files:
            part += 1
        offset = file_bytes[part]
        places.append((data_file_name(rank, part), offset))
        file_bytes[part] = _align(offset + nbytes)
    return places, [n for n in file_bytes if n] or [0]


# -- the rank index ---------------------------------------------------------------------------------

@dataclass
class RankIndex:
    rank: int
    world_size: int
    step: int
    run_id: str
    files: dict[str, int]
    """Each data file's name and byte count."""
    entries: dict[str, Entry]
    trees: dict[str, Any]
    """The encoded state trees: ``model``, ``optim``, ``extra``, ``rng`` (absent when not saved)."""


def render_index(index: RankIndex) -> bytes:
    body = {"format": FORMAT_VERSION, "rank": index.rank, "world_size": index.world_size, "step": index.step,
            "run_id": index.run_id, "crc_block_bytes": CRC_BLOCK_BYTES, "align_bytes": ALIGN_BYTES,
            "files": [{"name": name, "nbytes": n} for name, n in index.files.items()],
            "tensors": [e.to_json() for e in index.entries.values()], "trees": index.trees}
    return json.dumps(body, separators=(",", ":")).encode()


def _load_json(data: bytes, what: str, limit: int) -> Any:
    if len(data) > limit:
        raise CheckpointCorrupt(f"{what} is {len(data)} bytes, more than the {limit} allowed")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{what} is not valid JSON: {exc}") from None


def _int(value: Any, what: str, low: int = 0, high: int = 1 << 62) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CheckpointCorrupt(f"{what} is {value!r:.40}, not an integer in [{low}, {high}]")
    return value


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise CheckpointCorrupt(f"{what} is not a list of at most {MAX_NDIM} sizes")
    return tuple(_int(v, what) for v in value)


def _entry(raw: Any, files: Mapping[str, int], where: str) -> Entry:
    if not isinstance(raw, dict):
        raise CheckpointCorrupt(f"{where}: a tensor entry is not an object")
    name = raw.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise CheckpointCorrupt(f"{where}: a tensor entry has no valid name")
    what = f"{where}: tensor {name!r}"
    file = raw.get("file")
    if not isinstance(file, str) or file not in files:
        raise CheckpointCorrupt(f"{what} is in {file!r:.60}, not one of the rank's data files")
    dtype = raw.get("dtype")
    if dtype not in DTYPES:
        raise CheckpointCorrupt(f"{what} has dtype {dtype!r:.40}, not one of {', '.join(DTYPES)}")
    shape = _shape(raw.get("shape"), f"{what} shape")
    offset = _int(raw.get("offset"), f"{what} offset")
    nbytes = _int(raw.get("nbytes"), f"{what} nbytes")
    if nbytes != math.prod(shape) * DTYPES[dtype].itemsize:
        raise CheckpointCorrupt(f"{what} claims {nbytes} bytes for shape {list(shape)} of {dtype}")
    if offset + nbytes > files[file]:
        raise CheckpointCorrupt(f"{what} claims bytes [{offset}, {offset + nbytes}) of {file}, which holds "
                                f"{files[file]}")
    crcs = raw.get("crcs")
    if not isinstance(crcs, list) or len(crcs) != -(-nbytes // CRC_BLOCK_BYTES):
        raise CheckpointCorrupt(f"{what} has no CRC32C list of one per {CRC_BLOCK_BYTES}-byte block")
    checked = tuple(_int(c, f"{what} CRC32C", 0, 0xFFFFFFFF) for c in crcs)
    global_shape = None
    flat_offset = 0
    if "global_shape" in raw:
        global_shape = _shape(raw["global_shape"], f"{what} global_shape")
        flat_offset = _int(raw.get("flat_offset"), f"{what} flat_offset")
        if len(shape) != 1 or flat_offset + shape[0] > math.prod(global_shape):
            raise CheckpointCorrupt(f"{what}: a shard of {shape} at {flat_offset} lies outside {list(global_shape)}")
    return Entry(name, file, offset, nbytes, dtype, shape, checked, global_shape, flat_offset)


def parse_index(data: bytes, where: str, *, rank: int, step: int) -> RankIndex:
    """A rank's index, every field checked (sizes against the data files' declared sizes, which the
    loader checks against the file system); :class:`CheckpointCorrupt` says what is wrong."""
    body = _load_json(data, where, MAX_INDEX_BYTES)
    if not isinstance(body, dict) or body.get("format") != FORMAT_VERSION:
        raise CheckpointCorrupt(f"{where} is not a version {FORMAT_VERSION} index")
    if body.get("crc_block_bytes") != CRC_BLOCK_BYTES or body.get("align_bytes") != ALIGN_BYTES:
        raise CheckpointCorrupt(f"{where} uses another block size or alignment")
    if _int(body.get("rank"), f"{where} rank") != rank or _int(body.get("step"), f"{where} step") != step:
        raise CheckpointCorrupt(f"{where} is the index of rank {body.get('rank')} step {body.get('step')}, "
                                f"not of rank {rank} step {step}")
    world_size = _int(body.get("world_size"), f"{where} world_size", 1, MAX_WORLD_SIZE)
    run_id = body.get("run_id")
    raw_files = body.get("files")
    if not isinstance(raw_files, list) or not 0 < len(raw_files) <= MAX_FILES_PER_RANK:
        raise CheckpointCorrupt(f"{where} names no data files")
    files: dict[str, int] = {}
    for raw in raw_files:
        name = raw.get("name") if isinstance(raw, dict) else None
        match = _DATA_FILE.fullmatch(name) if isinstance(name, str) else None
        if match is None or int(match.group(1)) != rank:
            raise CheckpointCorrupt(f"{where} names a data file {name!r:.60} that is not one of rank {rank}'s")
        files[name] = _int(raw.get("nbytes"), f"{where} {name} nbytes")  # type: ignore[index]
    raw_entries = body.get("tensors")
    trees = body.get("trees")
    if not isinstance(raw_entries, list) or not isinstance(trees, dict) or not isinstance(run_id, str):
        raise CheckpointCorrupt(f"{where} lacks its tensors, trees or run id")
    entries: dict[str, Entry] = {}
    for raw in raw_entries:
        entry = _entry(raw, files, where)
        if entry.name in entries:
            raise CheckpointCorrupt(f"{where} names tensor {entry.name!r} twice")
        entries[entry.name] = entry
    for tree in trees.values():
        for ref in tree_refs(tree):
            entry_or_none = entries.get(ref.name)
            if entry_or_none is not None and (entry_or_none.global_shape is not None) != ref.shard:
                raise CheckpointCorrupt(f"{where}: {ref.name!r} is referenced as a "
                                        f"{'shard' if ref.shard else 'tensor'} but is not one")
    return RankIndex(rank, world_size, step, run_id, files, entries, trees)


# -- markers and the manifest -----------------------------------------------------------------------

@dataclass(frozen=True)
class Marker:
    """What a rank says when its files are durable: its index's size and checksum."""

    rank: int
    run_id: str
    index_nbytes: int
    index_crc32c: int


def render_marker(marker: Marker) -> bytes:
    return json.dumps({"rank": marker.rank, "run_id": marker.run_id, "index_nbytes": marker.index_nbytes,
                       "index_crc32c": marker.index_crc32c}).encode()


def parse_marker(data: bytes, where: str) -> Marker:
    body = _load_json(data, where, MAX_MARKER_BYTES)
    if not isinstance(body, dict) or not isinstance(body.get("run_id"), str):
        raise CheckpointCorrupt(f"{where} is not a rank marker")
    return Marker(_int(body.get("rank"), f"{where} rank", 0, MAX_WORLD_SIZE), body["run_id"],
                  _int(body.get("index_nbytes"), f"{where} index_nbytes", 1, MAX_INDEX_BYTES),
                  _int(body.get("index_crc32c"), f"{where} index_crc32c", 0, 0xFFFFFFFF))


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    run_id: str
    ranks: tuple[Marker, ...]


def render_manifest(manifest: Manifest) -> bytes:
    body = {"format": FORMAT_VERSION, "step": manifest.step, "world_size": manifest.world_size,
            "run_id": manifest.run_id,
            "ranks": [{"rank": m.rank, "index_nbytes": m.index_nbytes, "index_crc32c": m.index_crc32c}
                      for m in manifest.ranks]}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({"body": body, "crc32c": crc32c(text.encode())}, sort_keys=True).encode()


def parse_manifest(data: bytes, where: str, step: int) -> Manifest:
    """The manifest of the checkpoint of ``step``: its own checksum, then every field checked."""
    outer = _load_json(data, where, MAX_MANIFEST_BYTES)
    if not isinstance(outer, dict) or not isinstance(outer.get("body"), dict):
        raise CheckpointCorrupt(f"{where} is not a manifest")
    body = outer["body"]
    if crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()) != outer.get("crc32c"):
        raise CheckpointCorrupt(f"{where} fails its checksum")
    if body.get("format") != FORMAT_VERSION:
        raise CheckpointCorrupt(f"{where} is not a version {FORMAT_VERSION} manifest")
    if _int(body.get("step"), f"{where} step") != step:
        raise CheckpointCorrupt(f"{where} is the manifest of step {body.get('step')}, not of step {step}")
    world_size = _int(body.get("world_size"), f"{where} world_size", 1, MAX_WORLD_SIZE)
    run_id = body.get("run_id")
    raw_ranks = body.get("ranks")
    if not isinstance(run_id, str) or not isinstance(raw_ranks, list) or len(raw_ranks) != world_size:
        raise CheckpointCorrupt(f"{where} does not list every one of its {world_size} ranks")
    ranks = []
    for expected, raw in enumerate(raw_ranks):
        if not isinstance(raw, dict) or raw.get("rank") != expected:
            raise CheckpointCorrupt(f"{where}: rank {expected} is missing")
        ranks.append(Marker(expected, run_id,
                            _int(raw.get("index_nbytes"), f"{where} index_nbytes", 1, MAX_INDEX_BYTES),
                            _int(raw.get("index_crc32c"), f"{where} index_crc32c", 0, 0xFFFFFFFF)))
    return Manifest(step, world_size, run_id, tuple(ranks))

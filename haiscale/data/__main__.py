"""``python -m haiscale.data``: convert data into record shards, and inspect and check shards.

    python -m haiscale.data convert SRC DEST --records-per-file N            # each file of SRC a record
    python -m haiscale.data convert SRC DEST --records-per-file N --text --record-bytes B [--stride S]
    python -m haiscale.data info PATH                                        # records per shard
    python -m haiscale.data verify PATH                                      # every record's CRC32C

DEST and PATH are local paths or ``fs3://`` URLs (``fs3:///path`` from the environment or the
default profile, ``fs3://PROFILE@/path``, ``fs3://HOST:PORT/path``); the token comes from the profile
or ``$FS3_TOKEN_FILE``, never from the command line. Exit status: 0 done, 1 a shard is corrupt or an
I/O error stopped the work, 2 the command was wrong (a missing source, an empty corpus, a bad
number). A conversion that fails leaves no shard of its own behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import suppress
from typing import Any

from haiscale.data.dataset import list_shards, open_location
from haiscale.data.records import (
    MAX_RECORD_BYTES,
    RecordFormatError,
    RecordFS,
    ShardIndex,
    read_index,
    write_shards,
)

__all__ = ["main"]

_READ_PIECE_BYTES = 1 << 20  # corpus reads
_VERIFY_BATCH_BYTES = 64 << 20  # what verify reads at a time (memory bounded whatever the shard)
_VERIFY_BATCH_RECORDS = 4096
_MAX_REPORTED = 20  # bad records named one by one; past that, only counted


class UsageError(Exception):
    """The command cannot be carried out as given (exit status 2)."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _source_files(src: str) -> list[str]:
    """Regular files under ``src`` (or ``src`` itself), recursively, sorted by path; symbolic links
    are not followed (a link loop or a link out of the tree would otherwise be read)."""
    if os.path.isfile(src):
        return [src]
    found: list[str] = []
    for top, dirs, files in os.walk(src):
        dirs.sort()
        found += [os.path.join(top, name) for name in files if os.path.isfile(os.path.join(top, name))
                  and not os.path.islink(os.path.join(top, name))]
    return sorted(found, key=lambda path: os.path.relpath(path, src).split(os.sep))


def _file_records(files: Sequence[str]) -> Iterator[bytes]:
    for path in files:
        with open(path, "rb") as f:
            record = f.read(MAX_RECORD_BYTES + 1)  # bounded even if the file grew since it was listed
        if len(record) > MAX_RECORD_BYTES:
            raise UsageError(f"{path}: grew past the {MAX_RECORD_BYTES} bytes a record may hold while it was read")
        yield record


def _text_records(files: Sequence[str], record_bytes: int, stride: int) -> Iterator[bytes]:
    """Records ``corpus[i * stride : i * stride + record_bytes]`` of the files concatenated, whole
    records only; read in pieces, so the corpus may be larger than memory."""
    window = bytearray()
    skip = 0  # bytes still to drop before the next record starts (stride > record_bytes)
    for path in files:
        with open(path, "rb") as f:
            while piece := f.read(_READ_PIECE_BYTES):
                window += piece
                if skip:
                    dropped = min(skip, len(window))
                    del window[:dropped]
                    skip -= dropped
                while not skip and len(window) >= record_bytes:
                    yield bytes(window[:record_bytes])
                    dropped = min(stride, len(window))
                    del window[:dropped]
                    skip = stride - dropped


def _count_text_records(total_bytes: int, record_bytes: int, stride: int) -> int:
    return 0 if total_bytes < record_bytes else (total_bytes - record_bytes) // stride + 1


def _convert(args: argparse.Namespace) -> dict[str, Any]:
    src = args.src
    if not os.path.exists(src):
        raise UsageError(f"{src}: no such file or directory")
    if args.text:
        if args.record_bytes is None:
            raise UsageError("--text needs --record-bytes B (the GPT's block_size + 1)")
        if args.record_bytes > MAX_RECORD_BYTES:
            raise UsageError(f"--record-bytes {args.record_bytes} is larger than the {MAX_RECORD_BYTES} a record "
                             f"may hold")
        stride = args.stride or args.record_bytes
        files = _source_files(src)
        total = sum(os.path.getsize(path) for path in files)
        expected = _count_text_records(total, args.record_bytes, stride)
        if expected == 0:
            raise UsageError(f"{src}: the corpus holds {total} bytes, not enough for one record of "
                             f"{args.record_bytes} bytes")
        records: Iterator[bytes] = _text_records(files, args.record_bytes, stride)
    else:
        if args.record_bytes is not None or args.stride is not None:
            raise UsageError("--record-bytes and --stride go with --text")
        if not os.path.isdir(src):
            raise UsageError(f"{src}: not a directory (give --text to cut a file into records)")
        files = _source_files(src)
        if not files:
            raise UsageError(f"{src}: no files to convert")
        too_big = next((path for path in files if os.path.getsize(path) > MAX_RECORD_BYTES), None)
        if too_big is not None:  # each file is read whole as one record: refused before anything is written
            raise UsageError(f"{too_big}: {os.path.getsize(too_big)} bytes, larger than the {MAX_RECORD_BYTES} a "
                             f"record may hold (cut it with --text)")
        expected = len(files)
        records = _file_records(files)
    fs, path, owned = open_location(args.dest)
    try:
        if fs.isdir(path) and any(name.endswith(".rec") and not name.startswith(".") for name in fs.listdir(path)):
            raise UsageError(f"{args.dest}: already holds record shards: remove them or choose another directory")
        paths = write_shards(fs, path, records, args.records_per_file)
        indexes = [read_index(fs, shard) for shard in paths]
        count = sum(index.count for index in indexes)
        if count != expected:  # a source file changed while it was read: what was written goes again
            for shard in paths:
                with suppress(OSError):
                    fs.remove(shard)
            raise RecordFormatError(f"{src}: expected {expected} records, read {count}: the source changed "
                                    "while it was converted (nothing was kept)")
    finally:
        if owned:
            fs.close()
    return {"records": count, "shards": len(paths), "record_bytes": sum(index.data_bytes for index in indexes),
            "file_bytes": sum(index.size for index in indexes), "dest": args.dest}


def _with_shards(location: str) -> tuple[RecordFS, list[str], bool]:
    fs, path, owned = open_location(location)
    try:
        return fs, list_shards(fs, path), owned
    except BaseException:
        if owned:
            fs.close()
        raise


def _info(args: argparse.Namespace) -> dict[str, Any]:
    fs, paths, owned = _with_shards(args.path)
    try:
        indexes = [read_index(fs, path) for path in paths]
    finally:
        if owned:
            fs.close()
    return {"shards": [{"path": index.path, "records": index.count, "record_bytes": index.data_bytes,
                        "file_bytes": index.size} for index in indexes],
            "records": sum(index.count for index in indexes), "file_bytes": sum(index.size for index in indexes)}


def _verify_shard(fs: RecordFS, index: ShardIndex, errors: list[str]) -> int:
    """Check every record of one shard, reading batches of bounded size; bad records' messages go to
    ``errors``. How many records failed."""
    bad = 0
    with fs.open(index.path, "rb", buffering=0) as file:
        start = 0
        while start < index.count:
            end, batch_bytes = start, 0
            while end < index.count and end - start < _VERIFY_BATCH_RECORDS and (
                    end == start or batch_bytes + index.record_range(end)[1] <= _VERIFY_BATCH_BYTES):
                batch_bytes += index.record_range(end)[1]
                end += 1
            views = fs.read_many([(file, *index.record_range(i)) for i in range(start, end)])
            for i, view in zip(range(start, end), views, strict=True):
                try:
                    index.check(i, view)
                except RecordFormatError as exc:
                    bad += 1
                    if len(errors) < _MAX_REPORTED:
                        errors.append(str(exc))
            start = end
    return bad


def _verify(args: argparse.Namespace) -> dict[str, Any]:
    fs, paths, owned = _with_shards(args.path)
    errors: list[str] = []
    records = bad = 0
    try:
        for path in paths:
            try:
                index = read_index(fs, path)
            except RecordFormatError as exc:
                bad += 1
                errors.append(str(exc))
                continue
            records += index.count
            bad += _verify_shard(fs, index, errors)
    finally:
        if owned:
            fs.close()
    return {"shards": len(paths), "records": records, "bad": bad, "errors": errors}


def _print(command: str, result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    elif command == "convert":
        print(f"wrote {result['records']} records in {result['shards']} shards to {result['dest']} "
              f"({result['record_bytes']} bytes of records, {result['file_bytes']} bytes in all)")
    elif command == "info":
        for shard in result["shards"]:
            print(f"{shard['path']}: {shard['records']} records, {shard['record_bytes']} bytes")
        print(f"{len(result['shards'])} shards, {result['records']} records, {result['file_bytes']} bytes")
    else:
        for error in result["errors"]:
            print(error)
        verdict = "ok" if not result["bad"] else f"{result['bad']} bad"
        print(f"{verdict}: {result['records']} records in {result['shards']} shards checked")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m haiscale.data", description="Record shards for training on fs3.")
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="pack a directory's files, or a text corpus, into record shards")
    convert.add_argument("src", help="a local directory (each file a record) or, with --text, a file or directory")
    convert.add_argument("dest", help="a local directory or an fs3:// URL")
    convert.add_argument("--records-per-file", type=_positive, required=True, help="records per shard")
    convert.add_argument("--text", action="store_true", help="cut the concatenated corpus into fixed-size records")
    convert.add_argument("--record-bytes", type=_positive, help="bytes per record with --text")
    convert.add_argument("--stride", type=_positive, help="bytes between record starts with --text (default B)")
    for name, what in (("info", "records per shard"), ("verify", "check every record's checksum")):
        command = sub.add_parser(name, help=what)
        command.add_argument("path", help="a shard or a directory of shards: local or fs3://")
    for command in sub.choices.values():
        command.add_argument("--json", action="store_true", help="one JSON line instead of text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run = {"convert": _convert, "info": _info, "verify": _verify}[args.command]
    try:
        result = run(args)
    except (RecordFormatError, OSError) as exc:  # a corrupt shard, an I/O failure
        print(f"haiscale.data {args.command}: {exc}", file=sys.stderr)
        return 1
    except (UsageError, ValueError) as exc:  # what was asked cannot be done (a bad URL among them)
        print(f"haiscale.data {args.command}: {exc}", file=sys.stderr)
        return 2
    _print(args.command, result, args.json)
    return 1 if result.get("bad") else 0


if __name__ == "__main__":
    sys.exit(main())

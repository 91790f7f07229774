"""The HFReduce benchmark: its traffic model, its argument checks, its results file and a smoke run."""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.hfreduce_bench import (
    FORMAT_VERSION,
    Layout,
    ResultsError,
    load_results,
    parse_layouts,
    parse_sizes,
    traffic_bytes_per_byte,
    validate_results,
)

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def _record() -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "machine": {"cores": 2, "memory_bandwidth_bytes_per_s": 1.3e10},
            "cells": [{"layout": "2x2", "nodes": 2, "ranks_per_node": 2, "size_bytes": MIB,
                       "hfreduce_algbw_bytes_per_s": 2e8, "gloo_algbw_bytes_per_s": 1e8, "ratio": 2.0,
                       "traffic_bytes_per_byte": 21.0, "ceiling_algbw_bytes_per_s": 6.2e8,
                       "fraction_of_ceiling": 0.32, "registered_algbw_bytes_per_s": 3e8, "registered_ratio": 3.0,
                       "registered_traffic_bytes_per_byte": 17.0, "registered_ceiling_algbw_bytes_per_s": 7.6e8,
                       "registered_fraction_of_ceiling": 0.39}]}


def test_traffic_model_counts_copies_reduction_and_tree_adds() -> None:
    # One node: 2 for each of the L - 1 ranks that copy in, L + 1 for the owner's reduction, 2 per rank out.
    assert traffic_bytes_per_byte(Layout(1, 2)) == 9
    assert traffic_bytes_per_byte(Layout(1, 4)) == 19
    # A registered buffer skips the copy-in: 3L + 1.
    assert traffic_bytes_per_byte(Layout(1, 2), registered=True) == 7
    assert traffic_bytes_per_byte(Layout(1, 4), registered=True) == 13
    # Two nodes: each is the root of one tree with one child, adding half the bytes (1 + 1 read, 1 written);
    # 2 bytes sent per byte (half up and down each tree), each copied into and out of a socket.
    assert traffic_bytes_per_byte(Layout(2, 2)) == 2 * 9 + 2 * 0.5 * 3 + 4 * 2
    # Three nodes: two nodes with one child in each tree; 4 bytes sent per byte.
    assert traffic_bytes_per_byte(Layout(3, 2)) == 3 * 9 + 4 * 0.5 * 3 + 4 * 4


@pytest.mark.parametrize("text", ["2", "x2", "2x", "0x2", "1x1", "2xtwo", "1x2,,2x2"])
def test_bad_layouts_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_layouts(text)


@pytest.mark.parametrize("text", ["", "one", "0", "-1", "nan", "inf"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_sizes(text)


def test_layouts_and_sizes_parse() -> None:
    assert parse_layouts("1x2, 3x2,1x2") == [Layout(1, 2), Layout(3, 2)]
    assert parse_sizes("16,1,0.25") == [MIB // 4, MIB, 16 * MIB]


def test_a_good_record_validates() -> None:
    record = _record()
    assert validate_results(record) is record


@pytest.mark.parametrize("where, value", [
    (("format_version",), 2),
    (("machine",), None),
    (("machine", "memory_bandwidth_bytes_per_s"), 0),
    (("machine", "cores"), True),
    (("cells",), {}),
    (("cells", 0, "gloo_algbw_bytes_per_s"), None),
    (("cells", 0, "hfreduce_algbw_bytes_per_s"), float("nan")),
    (("cells", 0, "ratio"), -1.0),
    (("cells", 0, "nodes"), 0),
    (("cells", 0, "layout"), "1x2"),
])
def test_bad_records_are_refused_naming_the_field(where: tuple[Any, ...], value: object) -> None:
    record = copy.deepcopy(_record())
    target: Any = record
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    with pytest.raises(ResultsError, match=str(where[-1])):
        validate_results(record)


def test_load_results_refuses_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ResultsError, match="no such file"):
        load_results(tmp_path / "absent.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ResultsError, match="not a readable JSON"):
        load_results(broken)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_record()))
    assert load_results(good)["cells"][0]["layout"] == "2x2"


@pytest.mark.slow
def test_quick_run_measures_both_libraries(tmp_path: Path) -> None:
    """One layout, one size: both libraries give a bandwidth and the named file holds the cell."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "hfreduce_bench.py"), "--quick", "--layouts", "1x2",
                           "--sizes", "1", "--repeats", "1", "--out", str(tmp_path)],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = load_results(tmp_path / "hfreduce-quick.json")
    assert not (tmp_path / "hfreduce.json").exists()  # a smoke run never replaces a full run's figures
    assert record["quick"] is True and record["skipped"] == {}
    (cell,) = record["cells"]
    assert (cell["layout"], cell["nodes"], cell["ranks_per_node"], cell["size_bytes"]) == ("1x2", 1, 2, MIB)
    assert cell["hfreduce_algbw_bytes_per_s"] > 0 and cell["gloo_algbw_bytes_per_s"] > 0
    assert cell["ratio"] == pytest.approx(cell["hfreduce_algbw_bytes_per_s"] / cell["gloo_algbw_bytes_per_s"])
    assert cell["traffic_bytes_per_byte"] == 9 and cell["registered_traffic_bytes_per_byte"] == 7
    assert cell["ceiling_algbw_bytes_per_s"] == pytest.approx(
        record["machine"]["memory_bandwidth_bytes_per_s"] / 9)
    assert cell["registered_algbw_bytes_per_s"] > 0
    (table,) = tmp_path.glob("hfreduce-2*.md")
    assert "| 1x2 | 1 MiB |" in table.read_text()
    assert len(list(tmp_path.glob("hfreduce-2*.png"))) == 1

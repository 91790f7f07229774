"""The peer benchmark's arithmetic: medians over interleaved rounds, and its argument checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.compare import markdown_table, median_of_rounds

ROOT = Path(__file__).resolve().parents[1]


def test_each_figure_is_the_median_of_the_rounds_that_measured_it() -> None:
    rounds = [
        {"fs3": {"read": 100.0, "write": 10.0}, "moosefs": {"read": 50.0}},
        {"fs3": {"read": 300.0, "write": 30.0}, "moosefs": {"read": 70.0}},
        {"fs3": {"read": 200.0, "write": 20.0}},  # moosefs failed in the last round
    ]
    medians = median_of_rounds(rounds)
    assert medians == {"fs3": {"read": 200.0, "write": 20.0}, "moosefs": {"read": 60.0}}
    # One outlier round does not move the median (a mean would be 1,100).
    assert median_of_rounds([{"fs3": {"x": 1.0}}, {"fs3": {"x": 3000.0}}, {"fs3": {"x": 2.0}}]) == {"fs3": {"x": 2.0}}
    assert median_of_rounds([]) == {}


def test_the_table_divides_fs3_by_each_peer() -> None:
    table = markdown_table({"fs3": {"read (MiB/s)": 300.0}, "moosefs": {"read (MiB/s)": 200.0}})
    assert "| read (MiB/s) | 300.0 | 200.0 | 1.50 |" in table


def test_a_run_count_out_of_range_is_refused_before_anything_starts() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "compare.py"), "--runs", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "--runs must be 1 to 9" in out.stderr or "needs root" in out.stderr


def test_usrbio_is_set_against_every_systems_fio_random_read_row() -> None:
    from bench.compare import FIO_RAND_READ, USRBIO_RAND_READ, usrbio_summary

    results = {"fs3": {FIO_RAND_READ: 1000.0}, "fs3-usrbio": {USRBIO_RAND_READ: 4000.0},
               "moosefs": {FIO_RAND_READ: 2500.0}, "glusterfs": {"other": 1.0}}
    (line,) = usrbio_summary(results)
    assert "fs3 (FUSE) fio 4.00x" in line and "MooseFS fio 1.60x" in line and "GlusterFS" not in line
    assert usrbio_summary({"fs3": {FIO_RAND_READ: 1000.0}}) == []  # no usrbio row, no line
    table = markdown_table(results)
    assert "| usrbio rand read 4K, 4 procs, batches of 64 (IOPS) | - | 4,000.0 |" in table

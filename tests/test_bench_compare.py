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

"""The multi-rank benchmarks' launcher: ranks' outputs in rank order, and a wrong or failed run refused.

The rank program here is a few lines of Python (no torch, no collectives), so a run takes well
under a second: what is under test is the launcher's own bookkeeping.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from bench.ranks import Layout, parse_layouts, run_layout, slowest_rank_median

# A rank program: reads its spec (the last argument), reports where it thinks it ran. ``mode`` in the
# spec makes rank 1 misplace itself, fail, or hang.
_PROGRAM = r"""
import json, os, sys, time
spec = json.load(open(sys.argv[-1]))
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
per_node = spec["ranks_per_node"]
node, local = divmod(rank, per_node)
if rank == 1 and spec["mode"] == "misplaced":
    node, local = node + 1, local
if rank == 1 and spec["mode"] == "fail":
    print("rank 1 gives up on purpose", flush=True)
    sys.exit(3)
if rank == 1 and spec["mode"] == "hang":
    time.sleep(60)
json.dump({"rank": rank, "node": node, "local_rank": local, "world": world,
           "local_env": [os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")],
           "extra": os.environ.get("BENCH_RANKS_EXTRA")}, open(spec["out"], "w"))
"""


def _run(tmp_path: Path, mode: str, *, local_ranks: bool = True, budget_s: float = 30.0) -> list[dict[str, object]]:
    program = tmp_path / "rank.py"
    program.write_text(_PROGRAM)
    logged: list[str] = []
    try:
        return run_layout(Layout(1, 3), [sys.executable, str(program)], {"mode": mode, "ranks_per_node": 3},
                          tmp_path / "work", budget_s, logged.append, local_ranks=local_ranks,
                          env={"BENCH_RANKS_EXTRA": "yes"})
    finally:
        assert logged == ["  1x3: ranks stopped"]  # stopped whatever happened


def test_ranks_report_in_rank_order_with_their_environment(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "good")
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert all(r["world"] == 3 and r["extra"] == "yes" for r in ranks)
    assert [r["local_env"] for r in ranks] == [["0", "3"], ["1", "3"], ["2", "3"]]


def test_without_local_ranks_the_launcher_variables_are_removed(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A benchmark started from inside a launched job must not hand its own LOCAL_RANK to its ranks.
    monkeypatch.setenv("LOCAL_RANK", "7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    ranks = _run(tmp_path, "good", local_ranks=False)
    assert all(r["local_env"] == [None, None] for r in ranks)


def test_a_rank_placed_on_another_node_fails_the_layout(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="rank 1 ran as node 1 local rank 1, not as layout 1x3 places it"):
        _run(tmp_path, "misplaced")


def test_a_failed_rank_fails_the_layout_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="rank 1 exited with status 3: rank 1 gives up on purpose"):
        _run(tmp_path, "fail")


def test_a_rank_past_the_budget_fails_the_layout(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="rank 1 did not finish within 2 s"):
        _run(tmp_path, "hang", budget_s=2.0)


def test_slowest_rank_median_and_layouts() -> None:
    # Per repetition the slowest rank: 0.2, 0.3, 0.1; their median 0.2.
    assert slowest_rank_median([[0.1, 0.3, 0.1], [0.2, 0.1, 0.1]]) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        slowest_rank_median([[0.1, 0.2], [0.1]])  # ranks that timed different numbers of repetitions
    assert parse_layouts("2x2,1x3,2x2") == [Layout(2, 2), Layout(1, 3)]
    for bad in ("2by2", "1x1", "0x4"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_layouts(bad)

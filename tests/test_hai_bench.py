"""The HAI scheduler bench, on tiny traces: its replays conserve jobs and nodes, the real rules put
HIGH ahead of LOW where the trace makes them compete, and the checker rejects a double-booking replay."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench import hai_bench
from bench.hai_bench import ReplayError, TraceJob
from hai.rules import Priority


@pytest.fixture(scope="module")
def small_trace() -> list[TraceJob]:
    return hai_bench.make_trace(40, seed=7, nodes=8, interarrival_s=400.0)


def per_step(replay: hai_bench.Replay) -> list[tuple[int, int]]:
    """For each time step between two consecutive event times: (nodes held, most holders of any one
    node). An independent recount, step by step, of what the checker's sweep sees."""
    times = sorted({t for s in replay.segments for t in (s.start_s, s.end_s)})
    out = []
    for start_s, end_s in itertools.pairwise(times):
        middle_s = (start_s + end_s) / 2
        holders = Counter(n for s in replay.segments if s.start_s < middle_s < s.end_s for n in s.nodes)
        out.append((sum(holders.values()), max(holders.values(), default=0)))
    return out


def test_both_replays_conserve_jobs_and_nodes(small_trace: list[TraceJob]) -> None:
    for replay in (hai_bench.replay_rules(small_trace, 8), hai_bench.replay_fifo(small_trace, 8)):
        hai_bench.check_replay(replay, small_trace)
        assert sorted(replay.finished_s) == sorted(j.job_id for j in small_trace)
        assert all(len(ends) == 1 for ends in replay.finished_s.values())
        assert 0.0 < hai_bench.occupancy(replay) <= 1.0
        steps = per_step(replay)
        assert max(held for held, _ in steps) <= 8 and max(most for _, most in steps) == 1
    assert hai_bench.replay_fifo(small_trace, 8).suspensions == 0


def test_the_trace_is_seeded_and_bounded() -> None:
    assert hai_bench.make_trace(20, 3, 8, 300.0) == hai_bench.make_trace(20, 3, 8, 300.0)
    assert hai_bench.make_trace(20, 3, 8, 300.0) != hai_bench.make_trace(20, 4, 8, 300.0)
    assert all(1 <= j.nodes <= 2 for j in hai_bench.make_trace(50, 3, 2, 300.0))  # sizes capped at the cluster
    for bad in (0, hai_bench.MAX_JOBS + 1):
        with pytest.raises(ValueError, match="jobs"):
            hai_bench.make_trace(bad, 1, 8, 300.0)
    with pytest.raises(SystemExit):
        hai_bench.main(["--jobs", str(hai_bench.MAX_JOBS + 1)])


def contended_trace() -> list[TraceJob]:
    """Four nodes filled by long LOW jobs, then HIGH and LOW jobs arriving alternately: under FIFO
    each waits its turn; under the rules a HIGH job suspends a LOW one and starts at once."""
    jobs = [TraceJob(f"base{i}", f"u{i}", 2, Priority.LOW, float(i), 20_000.0) for i in range(2)]
    for i in range(4):  # two HIGH jobs: one LOW job to suspend for each
        priority = Priority.HIGH if i % 2 == 0 else Priority.LOW
        jobs.append(TraceJob(f"j{i}", f"v{i}", 2, priority, 100.0 + 50.0 * i, 3_000.0))
    return jobs


def test_high_waits_less_than_low_under_the_rules() -> None:
    trace = contended_trace()
    replay = hai_bench.replay_rules(trace, 4)
    hai_bench.check_replay(replay, trace)
    figures = hai_bench.summary(replay, trace)["per_priority"]
    assert figures["HIGH"]["wait_p95_s"] < figures["LOW"]["wait_p95_s"]
    assert figures["HIGH"]["wait_mean_s"] <= hai_bench.SUSPEND_ACK_S  # only the suspend's grace
    assert replay.suspensions >= 1
    fifo = hai_bench.summary(hai_bench.replay_fifo(trace, 4), trace)["per_priority"]
    assert figures["HIGH"]["wait_mean_s"] < fifo["HIGH"]["wait_mean_s"]


def test_a_double_booking_scheduler_is_rejected(small_trace: list[TraceJob]) -> None:
    def first_nodes(free: Sequence[str], every: Sequence[str], need: int) -> tuple[str, ...]:
        return tuple(every[:need])  # ignores what is busy

    broken = hai_bench.replay_fifo(small_trace, 8, pick=first_nodes)
    assert max(most for _, most in per_step(broken)) > 1  # the recount sees it too
    with pytest.raises(ReplayError, match="double-booked"):
        hai_bench.check_replay(broken, small_trace)


def test_a_lost_or_repeated_job_is_rejected(small_trace: list[TraceJob]) -> None:
    replay = hai_bench.replay_fifo(small_trace, 8)
    lost = hai_bench.Replay("fifo", 8, segments=replay.segments,
                            finished_s={k: v for k, v in replay.finished_s.items() if k != small_trace[0].job_id})
    with pytest.raises(ReplayError, match="not finished"):
        hai_bench.check_replay(lost, small_trace)
    twice = hai_bench.Replay("fifo", 8, segments=replay.segments,
                             finished_s={**replay.finished_s, small_trace[0].job_id: [1e9, 2e9]})
    with pytest.raises(ReplayError, match="more than once"):
        hai_bench.check_replay(twice, small_trace)


def test_main_writes_a_result_and_a_picture(tmp_path: Path) -> None:
    # The real-process part starts a whole platform: make bench-hai runs it, not the unit tests.
    assert hai_bench.main(["--jobs", "30", "--nodes", "8", "--out", str(tmp_path), "--no-real"]) == 0
    [result] = tmp_path.glob("hai-*.json")
    record = json.loads(result.read_text())
    assert "real_suspend" not in record
    page = result.with_suffix(".md").read_text()
    assert "rules" in page and "fifo" in page and "Suspend on real processes" not in page
    assert record["kind"] == "hai" and record["trace"]["jobs"] == 30
    assert set(record["schedulers"]) == {"rules", "fifo"}
    assert record["ratios_rules_over_fifo"]["occupancy"] > 0.0
    if record["png"] is not None:
        assert (tmp_path / record["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![occupancy]({record['png']})" in page


def test_the_page_shows_the_real_suspend_ratios(tmp_path: Path) -> None:
    record, _ = hai_bench.run(20, 4, 1, 400.0)
    real = {"ack_grace_s": 2.0, "finish_grace_s": 2.0, "grace_s": 4.0, "heartbeat_s": 0.5, "netns": False,
            "acknowledging": {"suspend_to_free_s": 0.4, "ratio_to_grace": 0.1, "outcome": "suspended"},
            "ignoring": {"suspend_to_free_s": 4.2, "ratio_to_grace": 1.05, "outcome": "suspended"}}
    page = hai_bench.markdown({"when": "T", **record, "png": None, "real_suspend": real})
    assert "| acknowledging | 0.40 | 0.10 | suspended |" in page
    assert "| ignoring | 4.20 | 1.05 | suspended |" in page and "plain processes" in page

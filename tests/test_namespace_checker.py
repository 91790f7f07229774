"""The namespace model and the model-agnostic linearizability checker: hand-made histories.

Each known-bad history is a failure the metadata simulator must be able to see (a rename applied
twice, an acknowledged change a crash took back, a session closed without its lease lapsing); the
known-good ones are concurrent schedules the checker must not reject.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace

import pytest

from fs3.sim.meta import expiry_calls, lease_windows, narrow, resize_calls
from fs3.sim.namespace import STALE_CODES, NamespaceModel, Tree, tag_mode
from fs3.sim.wgl import INF, Call, check_calls, shrink

MODEL = NamespaceModel()
A, B, C = tag_mode(1), tag_mode(2), tag_mode(3)


def history(*calls: Call) -> list[Call]:
    for i, call in enumerate(calls):
        call.index = i
    return list(calls)


def run(state_calls: list[Call]) -> list[object]:
    """Apply calls in order to the model; their answers."""
    state = MODEL.initial()
    answers = []
    for call in state_calls:
        state, answer = MODEL.step(state, call)
        answers.append(answer)
    return answers


def c(kind: str, *args: object, client: int = 0) -> Call:
    return Call(kind, args, 0, client=client)


# -- the model ------------------------------------------------------------------------------------


def test_the_model_answers_in_the_services_order() -> None:
    answers = run([
        c("mkdir", "/a", A), c("create", "/b", B, False, False, "s"),
        c("rename", "/x", "/b/y"),     # the destination's parent is a file: checked before the source
        c("rename", "/x", "/a/y"),     # then the source
        c("mkdir", "/a/x", C),
        c("rename", "/a", "/a/x/y"),   # a directory into itself
        c("rename", "/a/x", "/a"),     # onto its own ancestor
        c("rename", "/b", "/a"),       # a file over a directory
        c("rename", "/a", "/b"),       # a directory over a file
        c("rmdir", "/a"), c("unlink", "/a"), c("truncate", "/a", 5), c("readdir", "/b"),
        c("create", "/a", C, True, False, "t"), c("create", "/a", C, False, False, "t"),
    ])
    assert answers == [
        ("ok", A), ("ok", True, B, 0),
        ("err", "NOT_A_DIRECTORY"), ("err", "NOT_FOUND"), ("ok", C),
        ("err", "INVALID_ARGUMENT"), ("err", "DIRECTORY_NOT_EMPTY"), ("err", "IS_A_DIRECTORY"),
        ("err", "NOT_A_DIRECTORY"),
        ("err", "DIRECTORY_NOT_EMPTY"), ("err", "IS_A_DIRECTORY"), ("err", "IS_A_DIRECTORY"),
        ("err", "NOT_A_DIRECTORY"),
        ("err", "ALREADY_EXISTS"), ("err", "IS_A_DIRECTORY"),
    ]


def test_an_unlinked_file_lives_while_open_and_a_truncate_fixes_the_writers_length() -> None:
    answers = run([
        c("create", "/f", A, False, False, "w"), c("open", "/f", "r"),
        c("truncate", "/f", 10),         # the writer's handle now reports lengths storage must confirm
        c("close", "w", 500),            # storage holds nothing: the size stays 10
        c("unlink", "/f"), c("stat", "/f"),
        c("close", "r", 0), c("close", "r", 0),
    ])
    assert answers[3] == ("ok", 10)
    assert answers[5:] == [("err", "NOT_FOUND"), ("ok", 10), ("err", "STALE_HANDLE")]
    state = MODEL.initial()
    for call in [c("create", "/f", A, False, False, "w"), c("unlink", "/f")]:
        state, _ = MODEL.step(state, call)
    assert Tree(state).inodes[A] == ["f", 0, False]  # unlinked, held by its session
    state, _ = MODEL.step(state, c("expire", "w"))
    assert A not in Tree(state).inodes  # the last session gone: so is the file


def test_tags_are_permission_bits_the_service_keeps() -> None:
    modes = [tag_mode(n) for n in range(1, 2048)]
    assert len(set(modes)) == 2047 and all(m & 0o2000 == 0 and 0 < m <= 0o7777 for m in modes)
    with pytest.raises(ValueError):
        tag_mode(2048)
    with pytest.raises(ValueError):
        tag_mode(0)
    with pytest.raises(ValueError):
        MODEL.step(MODEL.initial(), c("chmod", "/a"))


# -- the checker: good histories ------------------------------------------------------------------


def test_concurrent_calls_may_take_effect_in_either_order() -> None:
    for seen in (("ok", "d", A, 0), ("err", "NOT_FOUND")):
        calls = history(Call("mkdir", ("/a", A), 0, 2, ("ok", A)),
                        Call("stat", ("/a",), 1, 3, seen, client=1),
                        Call("readdir", ("/",), 4, 5, ("ok", (("a", A),)), client=1))
        assert check_calls(calls, MODEL).ok


def test_an_unanswered_call_may_take_effect_any_time_before_its_deadline_or_never() -> None:
    calls = history(Call("mkdir", ("/a", A), 0, deadline=10),
                    Call("stat", ("/a",), 1, 2, ("err", "NOT_FOUND"), client=1),
                    Call("stat", ("/a",), 3, 4, ("ok", "d", A, 0), client=1))
    verdict = check_calls(calls, MODEL)
    assert verdict.ok and [w.kind for w in verdict.witness] == ["stat", "mkdir", "stat"]
    never = history(Call("mkdir", ("/a", A), 0, deadline=10),
                    Call("stat", ("/a",), 11, 12, ("err", "NOT_FOUND"), client=1))
    assert check_calls(never, MODEL).ok


def test_a_lapsed_lease_explains_a_handle_that_failed_loudly() -> None:
    opened = Call("create", ("/f", A, False, False, 0), 0, 1, ("ok", True, A, 0))
    for code in sorted(STALE_CODES):
        closed = Call("close", (0, 100), 5, 6, ("err", code))
        assert check_calls(history(opened, closed, Call("expire", (0,), 2, deadline=4)), MODEL).ok
    # Meta may also have kept the session (a window allows a lapse, it does not demand one) ...
    assert check_calls(history(opened, Call("close", (0, 100), 5, 6, ("ok", 100)),
                               Call("expire", (0,), 2, deadline=4)), MODEL).ok
    # ... but a handle that fails with an answer about the namespace is not explained.
    assert not check_calls(history(opened, Call("close", (0, 100), 5, 6, ("err", "NOT_FOUND")),
                                   Call("expire", (0,), 2, deadline=4)), MODEL).ok


# -- the checker: bad histories --------------------------------------------------------------------


def test_it_rejects_a_stale_read_after_an_acknowledged_rename() -> None:
    calls = history(Call("create", ("/a", A, False, False, 0), 0, 1, ("ok", True, A, 0)),
                    Call("rename", ("/a", "/b"), 2, 3, ("ok", A)),
                    Call("stat", ("/a",), 4, 5, ("ok", "f", A, 0), client=1))
    verdict = check_calls(calls, MODEL)
    assert verdict.status == "violation"
    assert verdict.blocked is calls[2]
    assert "cannot place: #2 client 1 stat('/a')" in verdict.problems[0]
    assert "the model answers ('err', 'NOT_FOUND') there" in verdict.problems[0]


def test_it_rejects_a_retried_rename_that_ran_twice() -> None:
    """Client 0's rename reply was lost; its retry, after meta forgot the answer, moved client 1's
    new /a over /b as well: /b now holds the file created after the rename."""
    calls = history(
        Call("create", ("/a", A, False, False, 0), 0, 1, ("ok", True, A, 0)),
        Call("rename", ("/a", "/b"), 2, 20, ("ok", B)),            # the second run's answer
        Call("stat", ("/b",), 3, 4, ("ok", "f", A, 0), client=1),  # the first run took effect
        Call("create", ("/a", B, False, False, 5), 6, 7, ("ok", True, B, 0), client=1),
        Call("stat", ("/b",), 21, 22, ("ok", "f", B, 0), client=1),
    )
    assert check_calls(calls, MODEL).status == "violation"


def test_it_rejects_an_error_given_from_a_change_a_crash_took_back() -> None:
    """EEXIST because of a mkdir that was never acknowledged and then vanished (answers before
    durability)."""
    calls = history(Call("mkdir", ("/a", A), 0, deadline=2),
                    Call("mkdir", ("/a", B), 1, 1.5, ("err", "ALREADY_EXISTS"), client=1),
                    Call("stat", ("/a",), 3, 4, ("err", "NOT_FOUND"), client=1))
    assert check_calls(calls, MODEL).status == "violation"


def test_it_rejects_an_unanswered_call_acting_after_its_deadline() -> None:
    calls = history(Call("mkdir", ("/a", A), 0, deadline=2),
                    Call("stat", ("/a",), 3, 4, ("err", "NOT_FOUND"), client=1),
                    Call("stat", ("/a",), 5, 6, ("ok", "d", A, 0), client=1))
    assert check_calls(calls, MODEL).status == "violation"


def test_it_rejects_a_session_closed_without_a_lapsed_lease() -> None:
    calls = history(Call("create", ("/f", A, False, False, 0), 0, 1, ("ok", True, A, 0)),
                    Call("close", (0, 100), 5, 6, ("err", "BAD_HANDLE")))
    assert check_calls(calls, MODEL).status == "violation"


def test_a_search_out_of_budget_is_inconclusive_not_ok() -> None:
    calls = history(*[Call("mkdir", (f"/{n}", tag_mode(i + 1)), 0, deadline=10, client=i)
                      for i, n in enumerate("abc")],
                    Call("readdir", ("/",), 11, 12, ("ok", (("a", A), ("c", C))), client=3))
    assert check_calls(calls, MODEL).ok
    verdict = check_calls(calls, MODEL, budget=1)
    assert verdict.status == "inconclusive" and "budget of 1 steps ran out" in verdict.problems[0]
    with pytest.raises(ValueError):
        check_calls(calls, MODEL, budget=0)


def test_shrink_keeps_what_the_violation_needs() -> None:
    noise = [Call("stat", ("/c",), 0.1 * i, 0.1 * i + 0.05, ("err", "NOT_FOUND"), client=2) for i in range(10)]
    calls = history(Call("create", ("/a", A, False, False, 0), 0, 1, ("ok", True, A, 0)), *noise,
                    Call("rename", ("/a", "/b"), 2, 3, ("ok", A)),
                    Call("stat", ("/a",), 4, 5, ("ok", "f", A, 0), client=1))
    small = shrink(calls, MODEL)
    assert check_calls(small, MODEL).status == "violation"
    answered = [call for call in small if call.completed]
    assert [call.kind for call in answered] == ["create", "stat"] or len(answered) <= 3
    assert not any(call.args == ("/c",) for call in small)
    good = history(Call("mkdir", ("/a", A), 0, 1, ("ok", A)))
    assert shrink(good, MODEL) == good


# -- what the simulator derives from the server's side --------------------------------------------


def test_lease_windows_come_from_the_answered_renewals() -> None:
    # Renewals every second, answered at once, then one that took 7 s: meta may have seen it at 2 s.
    renewals = [(0.0, 0.1, True), (1.0, 1.1, True), (2.0, 9.0, True), (9.5, 9.6, False)]
    windows = lease_windows(renewals, 3.0)
    assert len(windows) == 1 and windows[0][0] == pytest.approx(3.998) and windows[0][1] == INF
    steady = [(float(t), t + 0.05, True) for t in range(10)]
    [window] = lease_windows(steady, 3.0)
    assert window == pytest.approx((11.998, INF))
    gap = [(0.0, 0.1, True), (1.0, 1.1, True), (8.0, 8.1, True), (9.0, 9.1, True)]
    assert lease_windows(gap, 3.0)[0] == pytest.approx((3.998, 8.1))
    assert lease_windows([], 3.0) == []


def test_calls_are_confined_to_their_handlers_and_sessions_get_expiry_calls() -> None:
    answered = Call("create", ("/f", A, False, False, 0), 1.0, 5.0, ("ok", True, A, 0), index=0)
    lost = Call("mkdir", ("/a", B), 1.5, index=1)
    reached = Call("mkdir", ("/b", C), 2.0, index=2)
    requests = {0: [(b"c", 1)], 1: [(b"c", 2)], 2: [(b"c", 3)]}
    windows = {(b"c", 1): [[1.2, 1.3], [4.0, 4.1]], (b"c", 3): [[2.5, 2.6]]}
    narrowed = narrow([answered, lost, reached], requests, windows)
    assert [(n.index, n.invoke) for n in narrowed] == [(0, 1.2), (2, 2.5)]
    assert narrowed[0].complete == pytest.approx(4.1) and narrowed[1].deadline == 2.6
    extra = expiry_calls(narrowed, {0: [(3.0, 6.0), (10.0, INF)]})
    assert [(e.args, e.invoke, e.deadline) for e in extra] == [((0,), 3.0, 6.0), ((0,), 10.0, INF)]


def test_a_request_sent_again_under_a_new_id_spans_both() -> None:
    """A request refused as from a lapsed lease is sent again under the client's new id: it may have
    acted while either ran."""
    resent = Call("mkdir", ("/a", A), 1.0, index=0)
    requests = {0: [(b"old", 1), (b"new", 2)]}
    windows = {(b"old", 1): [[1.5, 1.6]], (b"new", 2): [[3.0, 3.1]]}
    (narrowed,) = narrow([resent], requests, windows)
    assert (narrowed.invoke, narrowed.deadline) == (1.5, 3.1)


def test_a_truncate_with_a_label_gets_a_resize_within_its_answer_or_any_time_later() -> None:
    answered = Call("truncate", ("/f", 5, 0), 1.0, 2.0, ("ok",), index=0)
    lost = Call("truncate", ("/f", 5, 1), 3.0, deadline=3.5, index=1)
    failed = Call("truncate", ("/f", 5, 2), 4.0, 4.5, ("err", "NOT_FOUND"), index=2)
    o_trunc = Call("create", ("/f", B, False, True, 3, True), 5.0, 6.0, ("ok", False, A, 0), index=3)
    created = Call("create", ("/g", C, False, True, 4, True), 5.0, 6.0, ("ok", True, C, 0), index=4)
    atomic = Call("truncate", ("/f", 5), 1.0, 2.0, ("ok",), index=5)
    extra = resize_calls([answered, lost, failed, o_trunc, created, atomic], first_index=10)
    assert [(e.args, e.invoke, e.complete, e.result, e.index) for e in extra] == [
        ((0,), 1.0, 2.0, ("ok",), 10), ((1,), 3.0, INF, None, 11), ((3,), 5.0, 6.0, ("ok",), 12)]
    assert extra[1].deadline == INF


def test_a_truncate_is_recorded_at_its_path_and_sized_later() -> None:
    """Meta records a truncate where it resolved the path and applies the size once storage is
    cleared: a rename and a lookup in between see the old size (seed 1623), as on Linux."""
    calls = history(
        Call("create", ("/a", A, False, False, "s"), 0.0, 0.1, ("ok", True, A, 0)),
        Call("close", ("s", 9), 0.2, 0.3, ("ok", 9)),
        Call("truncate", ("/a", 5, "t"), 1.0, 3.0, ("ok",)),
        Call("rename", ("/a", "/b"), 1.5, 1.6, ("ok", A)),
        Call("stat", ("/b",), 1.7, 1.8, ("ok", "f", A, 9)),
        Call("stat", ("/b",), 3.5, 3.6, ("ok", "f", A, 5)))
    assert not check_calls(calls, MODEL).ok  # one point for the truncate fits nowhere
    assert check_calls(calls + resize_calls(calls, first_index=len(calls)), MODEL).ok
    # Known bad: the size never applied by the answer.
    never = history(*calls[:3], Call("stat", ("/a",), 3.5, 3.6, ("ok", "f", A, 9)))
    assert not check_calls(never + resize_calls(never, first_index=len(never)), MODEL).ok


def test_a_pending_truncate_is_applied_before_the_next_one() -> None:
    """Meta finishes a file's pending truncate before another truncate, an open or a writer's length:
    an unanswered truncate to 5 cannot land after an answered truncate to 7 (the narrowed job the
    review found), though its own resize may come at any time after it."""
    base = [Call("create", ("/f", A, False, False, "s"), 0.0, 0.1, ("ok", True, A, 0)),
            Call("close", ("s", 9), 0.2, 0.3, ("ok", 9)),
            Call("truncate", ("/f", 5, "t1"), 1.0, deadline=1.5),
            Call("truncate", ("/f", 7, "t2"), 2.0, 3.0, ("ok",))]
    for final, ok in ((7, True), (5, False)):
        calls = history(*[replace(c) for c in base], Call("stat", ("/f",), 4.0, 4.1, ("ok", "f", A, final)))
        assert check_calls(calls + resize_calls(calls, first_index=len(calls)), MODEL).ok is ok, final
    # A writer's length waits for the pending truncate too: recorded before the rename, the truncate
    # is applied before the close, which then answers the truncated size, not the old one.
    calls = history(Call("create", ("/f", A, False, False, "s"), 0.0, 0.1, ("ok", True, A, 0)),
                    Call("close", ("s", 9), 0.2, 0.3, ("ok", 9)),
                    Call("create", ("/f", B, False, False, "w"), 0.4, 0.5, ("ok", False, A, 9)),
                    Call("truncate", ("/f", 5, "t"), 1.0, 3.0, ("ok",)),
                    Call("rename", ("/f", "/g"), 1.2, 1.3, ("ok", A)),
                    Call("close", ("w", 12), 1.5, 1.6, ("ok", 9)))
    assert not check_calls(calls + resize_calls(calls, first_index=len(calls)), MODEL).ok
    calls[-1].result = ("ok", 5)
    assert check_calls(calls + resize_calls(calls, first_index=len(calls)), MODEL).ok


def test_sessions_expire_only_in_the_windows_of_the_id_that_opened_them() -> None:
    """A client whose lease lapsed renews under a new id; that says nothing about the old id's
    sessions, which meta may close whenever the old lease may have lapsed — and the new id's
    sessions only in the new lease's windows."""
    old = Call("open", ("/f", 0), 1.0, 1.5, ("ok", "f", A, 0), index=0)
    new = Call("open", ("/f", 1), 20.0, 20.5, ("ok", "f", A, 0), index=1)
    requests = {0: [(b"old", 1)], 1: [(b"new", 2)]}
    windows: dict[Hashable, list[tuple[float, float]]] = {b"old": [(5.0, INF)], b"new": [(30.0, 31.0)]}
    extra = expiry_calls([old, new], windows, owners=lambda c: {k for k, _ in requests[c.index]})
    assert [(e.args, e.invoke, e.deadline) for e in extra] == [((0,), 5.0, INF), ((1,), 30.0, 31.0)]
    # A close answered as a stale handle needs the session's lease to have lapsed before it.
    calls = history(Call("mkdir", ("/d", B), 0.0, 0.5, ("ok", B)),
                    Call("create", ("/f", A, False, False, "s"), 1.0, 1.5, ("ok", True, A, 0)),
                    Call("close", ("s", 10), 25.0, 25.5, ("err", "STALE_CLIENT")))
    calls[1].client = 0
    late = expiry_calls(calls, {0: [(5.0, INF)]})
    assert check_calls(calls + [replace(e, index=len(calls) + i) for i, e in enumerate(late)], MODEL).ok
    assert not check_calls(calls, MODEL).ok

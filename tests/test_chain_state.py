"""The target state machine against the 3FS design-notes table, over every combination."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from fs3.common.target_state import LocalState, PublicState
from fs3.mgmtd.chain_state import (
    TRANSITIONS,
    next_public_state,
    transition_table_markdown,
    update_chain,
)

P, L = PublicState, LocalState

# The table exactly as the design notes print it (local, current, predecessor condition, next).
SPEC = """
up-to-date serving   any          serving
up-to-date syncing   any          serving
up-to-date waiting   any          waiting
up-to-date lastsrv   any          serving
up-to-date offline   any          waiting
online     serving   any          serving
online     syncing   serving      syncing
online     syncing   not-serving  waiting
online     waiting   serving      syncing
online     waiting   not-serving  waiting
online     lastsrv   any          serving
online     offline   any          waiting
offline    serving   none         lastsrv
offline    serving   some         offline
offline    syncing   any          offline
offline    waiting   any          offline
offline    lastsrv   any          lastsrv
offline    offline   any          offline
"""

_LOCAL = {"up-to-date": L.UP_TO_DATE, "online": L.ONLINE, "offline": L.OFFLINE}
_PREDECESSORS: list[PublicState | None] = [None, *PublicState]


def _spec_matches(condition: str, predecessor: PublicState | None) -> bool:
    return {
        "any": True,
        "serving": predecessor is P.SERVING,
        "not-serving": predecessor is not P.SERVING,
        "none": predecessor is None,
        "some": predecessor is not None,
    }[condition]


def test_every_combination_matches_the_design_notes() -> None:
    rows = [line.split() for line in SPEC.strip().splitlines()]
    checked = 0
    for local in LocalState:
        for current in PublicState:
            for predecessor in _PREDECESSORS:
                expected = [P[nxt.upper()] for lo, cur, cond, nxt in rows
                            if _LOCAL[lo] is local and P[cur.upper()] is current and _spec_matches(cond, predecessor)]
                assert len(expected) == 1, (local, current, predecessor)
                assert next_public_state(local, current, predecessor) is expected[0], (local, current, predecessor)
                checked += 1
    assert checked == len(LocalState) * len(PublicState) * len(_PREDECESSORS)
    assert len(TRANSITIONS) == len(LocalState) * len(PublicState)


def test_docs_table_is_generated_from_the_code() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    assert transition_table_markdown() in docs


def test_failed_head_moves_to_the_end_and_version_bumps() -> None:
    result = update_chain([1, 2, 3], dict.fromkeys((1, 2, 3), P.SERVING),
                          {1: L.OFFLINE, 2: L.UP_TO_DATE, 3: L.UP_TO_DATE}, 7)
    assert result.target_ids == (2, 3, 1)
    assert result.states == {1: P.OFFLINE, 2: P.SERVING, 3: P.SERVING}
    assert result.chain_version == 8 and result.changed


def test_last_serving_target_becomes_lastsrv() -> None:
    result = update_chain([1, 2, 3], dict.fromkeys((1, 2, 3), P.SERVING), dict.fromkeys((1, 2, 3), L.OFFLINE), 1)
    # The tail committed first: it is the one that keeps the chain's data.
    assert result.states == {1: P.OFFLINE, 2: P.OFFLINE, 3: P.LASTSRV}
    back = update_chain(list(result.target_ids), dict(result.states),
                        {1: L.ONLINE, 2: L.ONLINE, 3: L.ONLINE}, result.chain_version)
    assert back.states[3] is P.SERVING
    assert back.target_ids[0] == 3


def test_returning_target_waits_then_syncs_then_serves() -> None:
    states = {1: P.SERVING, 2: P.SERVING, 3: P.OFFLINE}
    step1 = update_chain([1, 2, 3], states, {1: L.UP_TO_DATE, 2: L.UP_TO_DATE, 3: L.ONLINE}, 5)
    assert step1.states[3] is P.WAITING
    step2 = update_chain(list(step1.target_ids), dict(step1.states), {1: L.UP_TO_DATE, 2: L.UP_TO_DATE, 3: L.ONLINE},
                         step1.chain_version)
    assert step2.states[3] is P.SYNCING
    step3 = update_chain(list(step2.target_ids), dict(step2.states),
                         {1: L.UP_TO_DATE, 2: L.UP_TO_DATE, 3: L.UP_TO_DATE}, step2.chain_version)
    assert step3.states[3] is P.SERVING and step3.target_ids == (1, 2, 3)
    unchanged = update_chain(list(step3.target_ids), dict(step3.states),
                             dict.fromkeys((1, 2, 3), L.UP_TO_DATE), step3.chain_version)
    assert not unchanged.changed and unchanged.chain_version == step3.chain_version


def test_only_one_target_syncs_at_a_time() -> None:
    states = {1: P.SERVING, 2: P.WAITING, 3: P.WAITING}
    result = update_chain([1, 2, 3], states, {1: L.UP_TO_DATE, 2: L.ONLINE, 3: L.ONLINE}, 1)
    assert [result.states[t] for t in (1, 2, 3)] == [P.SERVING, P.SYNCING, P.WAITING]


_ORDER = {P.SERVING: 0, P.SYNCING: 1, P.WAITING: 2, P.LASTSRV: 3, P.OFFLINE: 4}


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(PublicState)), st.sampled_from(list(LocalState))),
                min_size=1, max_size=5))
def test_update_chain_invariants(targets: list[tuple[PublicState, LocalState]]) -> None:
    ids = list(range(1, len(targets) + 1))
    states = {i: s for i, (s, _) in zip(ids, targets, strict=True)}
    local = {i: lo for i, (_, lo) in zip(ids, targets, strict=True)}
    result = update_chain(ids, states, local, 10)
    assert sorted(result.target_ids) == ids
    new = [result.states[t] for t in result.target_ids]
    assert [_ORDER[s] for s in new] == sorted(_ORDER[s] for s in new), "chain order is by state class"
    assert sum(1 for s in new if s is P.SYNCING) <= 1
    assert result.changed == (result.target_ids != tuple(ids) or any(result.states[t] is not states[t] for t in ids))
    assert result.chain_version == (11 if result.changed else 10)
    # An offline local state never leaves a target readable or writable.
    for t in ids:
        if local[t] is L.OFFLINE:
            assert result.states[t] in (P.OFFLINE, P.LASTSRV)
    # A syncing target sits right behind the last serving one.
    if P.SYNCING in new:
        position = new.index(P.SYNCING)
        assert position > 0 and new[position - 1] is P.SERVING

"""The linearizability checker itself: it must catch what it claims to catch, and accept the rest."""

from __future__ import annotations

import random

import pytest

from fs3.sim.history import INF, History, Op, check_chunk, decode_slots, encode_slot

SB = 64  # bytes per slot in these histories
SLOTS = 4


def _write(value: int, start: float, end: float, slots: tuple[int, ...] = (0,), chunk: int = 0) -> Op:
    return Op("write", chunk, slots, start, end, value=value, ok=end != INF)


def _read(value: int | None, start: float, end: float, chunk: int = 0) -> Op:
    return Op("read", chunk, (0,), start, end, observed={0: value}, ok=True)


def _remove(start: float, end: float) -> Op:
    return Op("remove", 0, tuple(range(SLOTS)), start, end, ok=end != INF)


def _truncate(length: int, start: float, end: float) -> Op:
    return Op("truncate", 0, tuple(range(SLOTS)), start, end, ok=end != INF, length=length)


def _snap(values: list[int | None], start: float, end: float, length: int | None = None) -> Op:
    """A read of the whole chunk, observing every slot (and the length, when given)."""
    return Op("read", 0, tuple(range(SLOTS)), start, end, observed=dict(enumerate(values)), ok=True, length=length)


def _history(*ops: Op, slots: int | None = None) -> History:
    history = History(slots=slots, slot_bytes=SB)
    for op in ops:
        history.add(op)
    return history


def _verdict(*ops: Op, budget: int = 100_000) -> str:
    return check_chunk(ops, slots=SLOTS, slot_bytes=SB, budget=budget).status


# Histories that are linearizable.


def test_sequential_history_is_fine() -> None:
    history = _history(_write(1, 0, 1), _read(1, 2, 3), _write(2, 4, 5), _read(2, 6, 7))
    assert history.check() == []


def test_concurrent_write_may_be_seen_or_not() -> None:
    history = _history(_write(1, 0, 1), _write(2, 2, 10), _read(1, 3, 4), _read(2, 5, 6))
    assert history.check() == []


@pytest.mark.parametrize("order", [(1, 2), (2, 1)])
def test_concurrent_writes_seen_in_either_order(order: tuple[int, int]) -> None:
    first, second = order
    assert _verdict(_write(1, 0, 5), _write(2, 1, 6), _read(first, 2, 3), _read(second, 7, 8)) == "ok"


def test_unacknowledged_write_may_appear_later() -> None:
    history = _history(_write(1, 0, 1), _write(2, 2, INF), _read(1, 3, 4), _read(2, 9, 10))
    assert history.check() == []


def test_unacknowledged_write_may_never_appear() -> None:
    assert _verdict(_write(1, 0, 1), _write(2, 2, INF), _read(1, 3, 4), _read(1, 9, 10)) == "ok"


def test_unacknowledged_remove_may_apply_late() -> None:
    assert _verdict(_write(1, 0, 1), _remove(2, INF), _read(1, 3, 4), _write(2, 5, 6), _read(2, 7, 8),
                    _read(0, 9, 10)) == "ok"


def test_truncate_extend_then_write() -> None:
    assert _verdict(_truncate(4 * SB, 0, 1), _snap([0, 0, 0, 0], 2, 3, length=4 * SB), _write(7, 4, 5, (1,)),
                    _snap([0, 7, 0, 0], 6, 7, length=4 * SB)) == "ok"


def test_truncate_shrink_zeroes_the_tail() -> None:
    assert _verdict(_write(1, 0, 1, (0, 1, 2, 3)), _truncate(SB, 2, 3), _snap([1, 0, 0, 0], 4, 5, length=SB),
                    _write(2, 6, 7, (2,)), _snap([1, 0, 2, 0], 8, 9, length=3 * SB)) == "ok"


@pytest.mark.parametrize("seen", [[1, 1, 1, 2], [1, 2, 2, 2]])
def test_partial_overlapping_writes_in_either_order(seen: list[int | None]) -> None:
    writes = (_write(1, 0, 10, (0, 1, 2)), _write(2, 1, 9, (1, 2, 3)))
    assert _verdict(*writes, _snap(seen, 11, 12, length=4 * SB)) == "ok"


def test_write_past_the_end_extends_the_length() -> None:
    assert _verdict(_write(3, 0, 1, (2,)), _snap([0, 0, 3, 0], 2, 3, length=3 * SB)) == "ok"


def test_reads_without_a_length_still_work() -> None:
    history = History()  # neither slot count nor slot size: old-style histories
    for op in (_write(1, 0, 1, (0, 1)), _remove(2, 3), Op("read", 0, (0, 1), 4, 5, observed={0: 0, 1: 0}, ok=True)):
        history.add(op)
    assert history.check() == []


def test_failed_reads_are_ignored() -> None:
    assert _verdict(_write(1, 0, 1), Op("read", 0, (0,), 2, INF, observed={0: 99}), _read(1, 3, 4)) == "ok"


def test_ok_result_carries_a_witness() -> None:
    result = check_chunk([_write(1, 0, 5), _write(2, 1, 6), _read(2, 2, 3), _read(1, 7, 8)], slots=1)
    assert result.ok
    assert [op.value or op.observed[0] for op in result.prefix] == [2, 2, 1, 1]


# Histories that are not.


def test_stale_read_is_caught() -> None:
    history = _history(_write(1, 0, 1), _write(2, 2, 3), _read(1, 4, 5))
    assert any("stale" in p for p in history.check())


def test_new_then_old_inversion_is_caught() -> None:
    history = _history(_write(1, 0, 1), _write(2, 2, 10), _read(2, 3, 4), _read(1, 5, 6))
    assert history.check(), "a read saw the old value after another read saw the new one"


def test_lost_acknowledged_write_is_caught() -> None:
    history = _history(_write(1, 0, 1), _write(2, 2, 3), _read(0, 10, 11))
    problems = history.check()
    assert problems and "lost" in problems[0]


def test_phantom_and_torn_values_are_caught() -> None:
    history = _history(_read(77, 0, 1), _read(None, 2, 3))
    problems = history.check()
    assert any("never written" in p for p in problems) and any("torn" in p for p in problems)


def test_torn_slot_alone_is_a_violation() -> None:
    result = check_chunk([_write(1, 0, 1), _read(None, 2, 3)], slots=1)
    assert result.status == "violation" and "torn" in result.explanation


def test_value_that_comes_back_is_caught() -> None:
    """X's single write spans everything, yet reads see X, then Y, then X again."""
    ops = (_write(1, 0, 100), _write(2, 1, 5.5), _read(1, 3, 4), _read(2, 5, 6), _read(1, 7, 8))
    assert _verdict(*ops) == "violation"
    assert _verdict(*ops[:4]) == "ok"


def test_remove_applied_twice_is_caught() -> None:
    """One remove, but its effect is seen twice: before and after an acknowledged write."""
    ops = (_write(1, 0, 1), _remove(2, 100), _read(0, 3, 4), _write(2, 5, 6), _read(2, 7, 8), _read(0, 9, 10))
    result = check_chunk(ops, slots=SLOTS, slot_bytes=SB)
    assert result.status == "violation"
    assert result.blocked is ops[-1]
    assert result.possible == ((0, (2, 0, 0, 0)),)
    assert [op.kind for op in result.prefix] == ["write", "remove", "read", "write", "read"]
    assert "remove/truncate taking effect again" in result.explanation


def test_write_applied_twice_is_caught() -> None:
    """A slow write (seen early) overwritten by an acknowledged one, then seen again: it landed twice."""
    for end in (20, INF):
        ops = (_write(1, 0, end), _read(1, 1, 2), _write(2, 3, 4), _read(2, 5, 6), _read(1, 7, 8))
        result = check_chunk(ops, slots=1)
        assert result.status == "violation", end
        assert "longest linearizable prefix" in result.explanation and "stale" in result.explanation


def test_unacknowledged_write_seen_before_it_began_is_caught() -> None:
    assert _verdict(_read(5, 0, 1), _write(5, 2, INF)) == "violation"


def test_remove_applied_twice_even_when_unacknowledged_is_caught() -> None:
    ops = (_write(1, 0, 1), _remove(2, INF), _read(0, 3, 4), _write(2, 5, 6), _read(2, 7, 8), _read(0, 9, 10))
    assert _verdict(*ops) == "violation"


def test_truncate_undone_is_caught() -> None:
    ops: tuple[Op, ...] = (_write(1, 0, 1, (0, 1, 2, 3)), _truncate(SB, 2, 3),
                           _snap([1, 0, 0, 0], 4, 5, length=SB), _snap([1, 1, 1, 1], 6, 7, length=4 * SB))
    assert _verdict(*ops) == "violation"
    # Even without looking at the length the old bytes must not come back.
    ops = (_write(1, 0, 1, (0, 1, 2, 3)), _truncate(SB, 2, 3), _snap([1, 1, 1, 1], 6, 7))
    assert _verdict(*ops) == "violation"


def test_length_going_backwards_is_caught() -> None:
    ops = (_write(1, 0, 1, (0, 1, 2, 3)), _snap([1, 1, 1, 1], 2, 3, length=4 * SB),
           _snap([1, 1, 1, 1], 4, 5, length=2 * SB))
    result = check_chunk(ops, slots=SLOTS, slot_bytes=SB)
    assert result.status == "violation" and "length 128" in result.explanation
    # A concurrent truncate explains a shorter length only with the slots past it zeroed.
    assert _verdict(*ops[:2], _truncate(2 * SB, 0, 10), ops[2]) == "violation"
    assert _verdict(*ops[:2], _truncate(2 * SB, 0, 10), _snap([1, 1, 0, 0], 4, 5, length=2 * SB)) == "ok"


def test_length_of_a_removed_chunk_is_zero() -> None:
    assert _verdict(_write(1, 0, 1, (0,)), _remove(2, 3), _snap([0, 0, 0, 0], 4, 5, length=SB)) == "violation"


def test_interleaved_partial_writes_cannot_mix() -> None:
    writes = (_write(1, 0, 10, (0, 1, 2)), _write(2, 1, 9, (1, 2, 3)))
    assert _verdict(*writes, _snap([1, 2, 1, 2], 11, 12)) == "violation"


def test_read_read_inversion_across_slots_is_caught() -> None:
    """Each read alone is fine, but one saw the second write without the first one's later overwrite."""
    ops = (_write(1, 0, 1, (0, 1)), _write(2, 2, 20, (0,)), _write(3, 3, 20, (1,)),
           _snap([2, 1, 0, 0], 4, 5), _snap([1, 3, 0, 0], 6, 7))
    assert _verdict(*ops) == "violation"


def test_checks_are_per_chunk() -> None:
    history = _history(_write(1, 0, 1, chunk=0), _write(2, 0, 1, chunk=1), _read(2, 2, 3, chunk=1),
                       _read(2, 2, 3, chunk=0))
    problems = history.check()
    assert len(problems) == 1 and problems[0].startswith("chunk 0:")


def test_independent_slots_are_split() -> None:
    """Single-slot ops on many slots: each slot is its own object, and a bad one is still found."""
    ops: list[Op] = []
    for slot in range(SLOTS):
        for k in range(20):
            ops.append(Op("write", 0, (slot,), k, k + 1.5, value=100 * slot + k + 1, ok=True))
            seen = 100 * slot + k if k else 0
            ops.append(Op("read", 0, (slot,), k + 0.5, k + 1.0, observed={slot: seen}, ok=True))
    result = check_chunk(ops, slots=SLOTS)
    assert result.ok, result.explanation
    ops.append(Op("read", 0, (2,), 30, 31, observed={2: 205}, ok=True))
    assert check_chunk(ops, slots=SLOTS).status == "violation"


# The search budget.


def _ambiguous(n: int) -> list[Op]:
    """Many concurrent single-slot writes and two unknown-outcome removes; a read after all of them
    sees the writes applied in invoke order. Linearizable, but many orders reach that read."""
    ops: list[Op] = [_write(k + 1, k * 0.01, 50 + k * 0.01, (k % SLOTS,)) for k in range(n)]
    ops += [_remove(0.5 + k * 0.01, INF) for k in range(2)]
    ops.append(_snap([max(k + 1 for k in range(n) if k % SLOTS == s) for s in range(SLOTS)], 60, 61))
    return ops


def test_tiny_budget_is_inconclusive_not_ok() -> None:
    ops = [*_ambiguous(16), _snap([1, 2, 3, 4], 70, 71)]  # the first writes come back: a violation
    result = check_chunk(ops, slots=SLOTS, slot_bytes=SB, budget=20)
    assert result.status == "inconclusive"
    assert result.steps <= 21
    history = _history(*ops)
    problems = history.check(budget=20)
    assert problems and all(p.startswith("inconclusive: chunk 0:") for p in problems)


def test_tiny_budget_never_passes_a_linearizable_history_it_did_not_finish() -> None:
    ops = _ambiguous(16)
    assert check_chunk(ops, slots=SLOTS, slot_bytes=SB, budget=3).status == "inconclusive"
    assert check_chunk(ops, slots=SLOTS, slot_bytes=SB).status == "ok"


def test_missing_slot_size_is_an_error() -> None:
    with pytest.raises(ValueError):
        check_chunk([_truncate(SB, 0, 1)], slots=SLOTS)


def test_slot_encoding_round_trip() -> None:
    data = encode_slot(5, 64) + bytes(64) + encode_slot(6, 64)[:-1] + b"\x01"
    assert decode_slots(data, 3, 64) == [5, 0, None]
    assert decode_slots(b"", 2, 64) == [0, 0]


# Generated histories: ops of an atomic chunk, each taking effect at a random point of its interval.


def generate(seed: int, ops: int = 300, clients: int = 5, slots: int = 8, failures: float = 0.1,
             lengths: bool = True) -> list[Op]:
    """A linearizable history by construction: each op takes effect at a random instant inside its
    interval (failed mutations at a random instant, or never); reads report the state there."""
    rng = random.Random(seed)
    timed: list[tuple[float, Op]] = []
    clock = [rng.uniform(0, 0.1) for _ in range(clients)]
    for n in range(ops):
        client = n % clients
        start = clock[client]
        slow = rng.random() < 0.1
        end = start + (rng.uniform(0.5, 3.0) if slow else rng.uniform(0.01, 0.1))
        clock[client] = end + rng.uniform(0, 0.05)
        failed = rng.random() < failures
        roll = rng.random()
        if roll < 0.55:
            first = rng.randrange(slots)
            last = rng.randrange(first, min(slots, first + 3))
            op = Op("write", 0, tuple(range(first, last + 1)), start, end, value=n + 1)
        elif roll < 0.6:
            op = Op("truncate", 0, tuple(range(slots)), start, end, length=rng.randrange(slots + 1) * SB)
        elif roll < 0.63:
            op = Op("remove", 0, tuple(range(slots)), start, end)
        else:
            op = Op("read", 0, tuple(range(slots)), start, end)
        op.ok = not failed
        if not failed:
            at = rng.uniform(start, end)
        elif op.kind == "read" or rng.random() < 0.5:
            at = INF  # never takes effect
        else:
            at = rng.uniform(start, end + 5.0)  # may land long after the client gave up
        if failed:
            op.complete = INF
        timed.append((at, op))
    length, values = 0, [0] * slots
    for at, op in sorted(timed, key=lambda item: item[0]):
        if at == INF:
            continue
        if op.kind == "write":
            for s in op.slots:
                values[s] = op.value
            length = max(length, (op.slots[-1] + 1) * SB)
        elif op.kind == "truncate":
            assert op.length is not None
            values[op.length // SB :] = [0] * (slots - op.length // SB)
            length = op.length
        elif op.kind == "remove":
            length, values = 0, [0] * slots
        else:
            op.observed = dict(enumerate(values))
            op.length = length if lengths else None
    return [op for _, op in timed]


@pytest.mark.parametrize("seed", range(40))
def test_generated_linearizable_histories_pass(seed: int) -> None:
    ops = generate(seed, ops=120, clients=3 + seed % 4, lengths=seed % 2 == 0)
    result = check_chunk(ops, slots=8, slot_bytes=SB)
    assert result.ok, result.explanation


@pytest.mark.parametrize("seed", range(20))
def test_generated_histories_with_a_stale_read_fail(seed: int) -> None:
    """Replay an earlier snapshot in a late read: a value that comes back, almost always a violation."""
    ops = generate(seed, ops=120, clients=4)
    reads = [op for op in ops if op.kind == "read" and op.ok]
    early = next(r for r in reads if any(r.observed.values()))
    late = next(r for r in reversed(reads) if r.observed != early.observed)
    writes_between = [w for w in ops if w.kind != "read" and w.ok and early.complete < w.invoke
                      and w.complete < late.invoke]
    if not writes_between:
        pytest.skip("nothing was overwritten between the two reads")
    late.observed, late.length = dict(early.observed), early.length
    assert check_chunk(ops, slots=8, slot_bytes=SB).status == "violation"


# Small random histories against a brute-force reference: every order of every subset, no shortcuts.


def _brute_force(ops: list[Op], slots: int) -> bool:
    mutations = [op for op in ops if op.kind != "read"]
    reads = [op for op in ops if op.kind == "read" and op.ok and op.complete != INF]
    required = [op for op in mutations if op.ok and op.complete != INF] + reads
    optional = [op for op in mutations if not (op.ok and op.complete != INF)]

    def end(op: Op) -> float:
        return op.complete if op.ok else INF

    must = {id(op) for op in required}

    def explore(placed: list[Op], rest: list[Op], length: int, values: tuple[int, ...]) -> bool:
        if not any(id(op) in must for op in rest):
            return True
        for op in rest:
            if any(end(other) < op.invoke for other in rest if other is not op):
                continue  # something still unplaced had returned before this op began
            new_length, new_values = length, values
            if op.kind == "read":
                if op.length is not None and op.length != length:
                    continue
                if any(values[s] != v for s, v in op.observed.items()):
                    continue
            elif op.kind == "write":
                new_values = tuple(op.value if s in op.slots else v for s, v in enumerate(values))
                new_length = max(length, (max(op.slots) + 1) * SB)
            elif op.kind == "truncate":
                assert op.length is not None
                new_values = tuple(v if s < op.length // SB else 0 for s, v in enumerate(values))
                new_length = op.length
            else:
                new_length, new_values = 0, (0,) * slots
            remaining = [other for other in rest if other is not op]
            if explore([*placed, op], remaining, new_length, new_values):
                return True
        return False

    for mask in range(1 << len(optional)):  # optional ops may never happen
        chosen = [op for k, op in enumerate(optional) if mask >> k & 1]
        if explore([], required + chosen, 0, (0,) * slots):
            return True
    return False


def _small(seed: int, most: int = 7) -> tuple[list[Op], int]:
    rng = random.Random(seed)
    slots = rng.choice((2, 3))
    ops: list[Op] = []
    written = [0]
    truth: list[tuple[float, Op]] = []
    for n in range(rng.randrange(4, most + 1)):
        start = rng.uniform(0, 10)
        end = start + rng.uniform(0.1, 4)
        ok = rng.random() < 0.8
        roll = rng.random()
        if roll < 0.45:
            first = rng.randrange(slots)
            op = Op("write", 0, tuple(range(first, rng.randrange(first, slots) + 1)), start, end, value=n + 1)
            written.append(n + 1)
        elif roll < 0.55:
            op = Op("truncate", 0, tuple(range(slots)), start, end, length=rng.randrange(slots + 1) * SB)
        elif roll < 0.62:
            op = Op("remove", 0, tuple(range(slots)), start, end)
        else:
            op = Op("read", 0, tuple(range(slots)), start, end)
        op.ok = ok or op.kind == "read"
        if not op.ok:
            op.complete = INF
        ops.append(op)
        if op.ok or rng.random() < 0.5:
            truth.append((rng.uniform(start, end if op.ok else end + 3), op))
    length, values = 0, [0] * slots
    for _, op in sorted(truth, key=lambda item: item[0]):
        if op.kind == "write":
            for s in op.slots:
                values[s] = op.value
            length = max(length, (op.slots[-1] + 1) * SB)
        elif op.kind == "truncate":
            assert op.length is not None
            cut = op.length // SB
            values[cut:] = [0] * (slots - cut)
            length = op.length
        elif op.kind == "remove":
            length, values = 0, [0] * slots
        elif rng.random() < 0.6:  # the truth
            op.observed, op.length = dict(enumerate(values)), length
        else:  # something plausible
            op.observed = {s: rng.choice(written) for s in range(slots)}
            op.length = rng.randrange(slots + 1) * SB if rng.random() < 0.7 else None
    for op in ops:
        if op.kind == "read" and not op.observed:
            op.observed = {s: rng.choice(written) for s in range(slots)}
    return ops, slots


def test_small_histories_agree_with_brute_force() -> None:
    verdicts = {True: 0, False: 0}
    for seed in range(1500):
        ops, slots = _small(seed)
        expected = _brute_force(ops, slots)
        result = check_chunk(ops, slots=slots, slot_bytes=SB)
        assert result.status == ("ok" if expected else "violation"), (seed, result.explanation)
        verdicts[expected] += 1
    assert min(verdicts.values()) > 300, verdicts  # both kinds well represented

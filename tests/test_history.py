"""The linearizability checker itself: it must catch what it claims to catch."""

from __future__ import annotations

from fs3.sim.history import INF, History, Op, decode_slots, encode_slot


def _write(value: int, start: float, end: float, slots: tuple[int, ...] = (0,)) -> Op:
    return Op("write", 0, slots, start, end, value=value, ok=end != INF)


def _read(value: int | None, start: float, end: float) -> Op:
    return Op("read", 0, (0,), start, end, observed={0: value}, ok=True)


def test_sequential_history_is_fine() -> None:
    history = History()
    for op in (_write(1, 0, 1), _read(1, 2, 3), _write(2, 4, 5), _read(2, 6, 7)):
        history.add(op)
    assert history.check() == []


def test_stale_read_is_caught() -> None:
    history = History()
    for op in (_write(1, 0, 1), _write(2, 2, 3), _read(1, 4, 5)):
        history.add(op)
    assert any("stale" in p for p in history.check())


def test_concurrent_write_may_be_seen_or_not() -> None:
    history = History()
    for op in (_write(1, 0, 1), _write(2, 2, 10), _read(1, 3, 4), _read(2, 5, 6)):
        history.add(op)
    assert history.check() == []


def test_new_then_old_inversion_is_caught() -> None:
    history = History()
    for op in (_write(1, 0, 1), _write(2, 2, 10), _read(2, 3, 4), _read(1, 5, 6)):
        history.add(op)
    assert history.check(), "a read saw the old value after another read saw the new one"


def test_unacknowledged_write_may_appear_later() -> None:
    history = History()
    for op in (_write(1, 0, 1), _write(2, 2, INF), _read(1, 3, 4), _read(2, 9, 10)):
        history.add(op)
    assert history.check() == []


def test_lost_acknowledged_write_is_caught() -> None:
    history = History()
    for op in (_write(1, 0, 1), _write(2, 2, 3), _read(0, 10, 11)):
        history.add(op)
    assert history.check()


def test_phantom_and_torn_values_are_caught() -> None:
    history = History()
    history.add(_read(77, 0, 1))
    history.add(_read(None, 2, 3))
    problems = history.check()
    assert any("never written" in p for p in problems) and any("torn" in p for p in problems)


def test_slot_encoding_round_trip() -> None:
    data = encode_slot(5, 64) + bytes(64) + encode_slot(6, 64)[:-1] + b"\x01"
    assert decode_slots(data, 3, 64) == [5, 0, None]
    assert decode_slots(b"", 2, 64) == [0, 0]

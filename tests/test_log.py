"""Tests of the in-memory log: positions, appends, reads, truncation and
compaction, and the errors for a gap or a truncation below the base."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qserver.errors import InvariantError
from qserver.state.entries import Confirm, Consume, Noop, Produce, Record
from qserver.state.log import Log


def entry(n: int):
    """A distinct entry per n, of every kind in turn."""
    kinds = [
        lambda: Produce(targets=(("q", n),), data=f"d{n}", ready_ms=n, ttl_ms=n + 1, retry_ms=0),
        lambda: Consume(queue="q", msg_id=n, retry_at_ms=0),
        lambda: Confirm(queue="q", msg_id=n),
        lambda: Noop(),
    ]
    return kinds[n % 4]()


def filled(n: int, vote_id: int = 1) -> Log:
    log = Log()
    for i in range(1, n + 1):
        log.append_entry(entry(i), vote_id)
    return log


def trans_ids(records) -> list[int]:
    return [r.trans_id for r in records]


# -- empty logs and positions ------------------------------------------------------


def test_empty_log():
    log = Log()
    assert len(log) == 0
    assert log.first_trans_id == 1
    assert log.last_trans_id == 0
    assert log.last_position() == (0, 0)
    assert log.get(0) is None and log.get(1) is None
    assert log.vote_id_at(0) == 0
    assert log.vote_id_at(1) is None
    assert log.slice(1, 10) == []


def test_log_restored_at_a_base():
    log = Log(base_trans_id=10, base_vote_id=3)
    assert (log.first_trans_id, log.last_trans_id, len(log)) == (11, 10, 0)
    assert log.last_position() == (3, 10)
    assert log.vote_id_at(10) == 3
    assert log.get(10) is None
    with pytest.raises(InvariantError):
        log.append(Record(trans_id=12, vote_id=3, entry=Noop()))
    with pytest.raises(InvariantError):
        log.append(Record(trans_id=10, vote_id=3, entry=Noop()))
    log.append(Record(trans_id=11, vote_id=4, entry=Noop()))
    assert log.append_entry(Noop(), 4).trans_id == 12
    assert log.last_position() == (4, 12)


# -- appends -------------------------------------------------------------------------


def test_append_entry_numbers_from_one_and_tags_the_vote_id():
    log = Log()
    r1 = log.append_entry(entry(1), 1)
    r2 = log.append_entry(entry(2), 1)
    r3 = log.append_entry(entry(3), 2)
    assert (r1.trans_id, r2.trans_id, r3.trans_id) == (1, 2, 3)
    assert (r1.vote_id, r2.vote_id, r3.vote_id) == (1, 1, 2)
    assert r2.entry == entry(2)
    assert log.get(2) is r2
    assert log.last_position() == (2, 3)
    assert len(log) == 3
    assert [log.vote_id_at(t) for t in (0, 1, 2, 3, 4)] == [0, 1, 1, 2, None]


def test_append_accepts_only_the_next_trans_id():
    log = filled(3)
    before = list(log.records)
    for bad in (1, 3, 5, 100, 0):
        with pytest.raises(InvariantError):
            log.append(Record(trans_id=bad, vote_id=1, entry=Noop()))
        assert list(log.records) == before
    rec = Record(trans_id=4, vote_id=2, entry=entry(4))
    log.append(rec)
    assert log.get(4) is rec
    assert log.append_entry(entry(5), 2).trans_id == 5


def test_extend_appends_a_run_that_follows_on():
    log = filled(3)
    run = [Record(trans_id=t, vote_id=2, entry=entry(t)) for t in (4, 5, 6)]
    log.extend(run)
    assert trans_ids(log.records) == [1, 2, 3, 4, 5, 6]
    assert log.get(5) is run[1]
    assert log.last_position() == (2, 6)
    log.extend([])  # nothing to append
    assert log.last_trans_id == 6


@pytest.mark.parametrize("ids", [(6, 7), (8, 9), (7, 9), (7, 8, 8), (5,)])
def test_extend_refuses_a_run_that_does_not_start_next_or_end_where_it_should(ids):
    log = filled(6)
    before = list(log.records)
    with pytest.raises(InvariantError):
        log.extend([Record(trans_id=t, vote_id=1, entry=Noop()) for t in ids])
    assert log.records == before


def test_extend_after_compaction_numbers_from_the_base():
    log = filled(4)
    assert log.compact(0, 4) == 4
    log.extend([Record(trans_id=5, vote_id=1, entry=Noop())])
    assert log.get(5) is not None and log.first_trans_id == 5


def test_get_out_of_range_is_none():
    log = filled(5)
    assert [log.get(t) is not None for t in range(-1, 8)] == [
        False, False, True, True, True, True, True, False, False]


# -- slice ----------------------------------------------------------------------------


def test_slice():
    log = filled(10)
    assert trans_ids(log.slice(1, 3)) == [1, 2, 3]
    assert trans_ids(log.slice(4, 100)) == list(range(4, 11))
    assert trans_ids(log.slice(10, 5)) == [10]
    assert log.slice(11, 5) == []
    assert log.slice(50, 5) == []
    assert log.slice(3, 0) == []
    assert log.slice(1, 10) == list(log.records)


def test_slice_after_compaction():
    log = filled(10)
    log.compact(4, 10)
    assert trans_ids(log.slice(7, 2)) == [7, 8]
    assert trans_ids(log.slice(log.first_trans_id, 100)) == [7, 8, 9, 10]
    # compacted records are never skipped silently
    with pytest.raises(InvariantError):
        log.slice(6, 2)


# -- truncate_after --------------------------------------------------------------------


def test_truncate_after_drops_the_tail():
    log = filled(6)
    assert log.truncate_after(4) == 2
    assert log.last_trans_id == 4
    assert log.get(5) is None
    assert log.last_position() == (1, 4)
    # The new master's entries follow on from there.
    assert log.append_entry(Noop(), 2).trans_id == 5
    assert log.last_position() == (2, 5)


def test_truncate_after_last_or_beyond_is_nothing():
    log = filled(3)
    assert log.truncate_after(3) == 0
    assert log.truncate_after(99) == 0
    assert log.last_trans_id == 3


def test_truncate_after_to_the_base():
    log = filled(6)
    log.compact(3, 6)  # base is 3
    assert log.truncate_after(3) == 3
    assert len(log) == 0
    assert log.last_position() == (1, 3)
    assert log.append_entry(Noop(), 2).trans_id == 4


def test_truncate_below_the_base_raises():
    log = filled(6)
    log.compact(3, 6)
    before = list(log.records)
    for bad in (2, 0):
        with pytest.raises(InvariantError):
            log.truncate_after(bad)
    assert list(log.records) == before
    restored = Log(base_trans_id=5, base_vote_id=2)
    with pytest.raises(InvariantError):
        restored.truncate_after(4)
    assert restored.truncate_after(5) == 0


# -- compact ----------------------------------------------------------------------------


def test_compact_keeps_the_newest_and_moves_the_base():
    log = Log()
    for i in range(1, 11):
        log.append_entry(entry(i), 1 if i <= 6 else 2)
    assert log.compact(4, 10) == 6
    assert (log.first_trans_id, log.last_trans_id, len(log)) == (7, 10, 4)
    assert (log.base_trans_id, log.base_vote_id) == (6, 1)
    assert log.get(6) is None and log.get(7).trans_id == 7
    assert log.vote_id_at(6) == 1  # the base still answers
    assert log.vote_id_at(5) is None  # compacted away
    assert log.vote_id_at(7) == 2
    assert log.compact(4, 10) == 0
    assert log.compact(10, 10) == 0


def test_compact_never_past_what_is_applied():
    log = filled(10)
    assert log.compact(2, 5) == 5  # wants 8 gone, only 5 applied
    assert log.first_trans_id == 6
    assert log.compact(2, 5) == 0
    assert log.compact(2, 0) == 0
    assert log.compact(2, 9) == 3
    assert trans_ids(log.records) == [9, 10]


def test_compact_everything():
    log = Log()
    for i in range(1, 4):
        log.append_entry(entry(i), i)
    assert log.compact(0, 3) == 3
    assert len(log) == 0
    assert log.last_position() == (3, 3)
    assert log.last_trans_id == 3
    assert log.vote_id_at(3) == 3
    with pytest.raises(InvariantError):
        log.append(Record(trans_id=3, vote_id=3, entry=Noop()))
    log.append(Record(trans_id=4, vote_id=3, entry=Noop()))
    assert log.last_position() == (3, 4)


# -- a random walk against a plain list ----------------------------------------------------

ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 5)),
    st.tuples(st.just("extend"), st.integers(1, 5), st.integers(0, 4)),
    st.tuples(st.just("truncate"), st.integers(0, 40)),
    st.tuples(st.just("compact"), st.integers(0, 10), st.integers(0, 40)),
), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_log_matches_a_plain_list(operations):
    log = Log()
    model: list[tuple[int, int]] = [(0, 0)]  # (trans_id, vote_id) from the base on
    base = 0  # index in model of the base
    for op in operations:
        if op[0] == "append":
            rec = log.append_entry(entry(len(model)), op[1])
            assert rec.trans_id == model[-1][0] + 1
            model.append((rec.trans_id, op[1]))
        elif op[0] == "extend":
            first = model[-1][0] + 1
            log.extend([Record(trans_id=first + i, vote_id=op[1], entry=Noop())
                        for i in range(op[2])])
            model += [(first + i, op[1]) for i in range(op[2])]
        elif op[0] == "truncate":
            t = op[1]
            if t < model[base][0]:
                with pytest.raises(InvariantError):
                    log.truncate_after(t)
            else:
                dropped = max(0, model[-1][0] - t)
                assert log.truncate_after(t) == dropped
                del model[len(model) - dropped:]
        else:
            keep, upto = op[1], op[2]
            live = len(model) - 1 - base
            want = max(0, live - keep)
            can = max(0, min(want, upto - model[base][0]))
            assert log.compact(keep, upto) == can
            base += can
        assert len(log) == len(model) - 1 - base
        assert log.last_position() == (model[-1][1], model[-1][0])
        assert (log.base_trans_id, log.base_vote_id) == model[base]
        assert [(r.trans_id, r.vote_id) for r in log.records] == model[base + 1:]
        for t, v in model[base:]:
            assert log.vote_id_at(t) == v
        assert log.vote_id_at(model[base][0] - 1) is None

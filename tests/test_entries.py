"""Entries and records: wire round trips for every kind, and validation of
what comes from a peer or a disk (anything malformed is a ValueError)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qserver.state.entries import (
    FINAL_EXPIRED,
    FINAL_MAX_DELIVERIES,
    FINAL_NONE,
    Configure,
    Confirm,
    Consume,
    ConsumeMany,
    DeadLetter,
    Kind,
    Nack,
    Noop,
    Produce,
    Record,
    Touch,
    entry_from_wire,
    entry_to_wire,
    record_from_wire,
    record_to_wire,
)
from qserver.wire.requests import MAX_DELIVERIES

ms = st.integers(0, 2**63 - 1)
ids = st.integers(1, 2**63 - 1)
names = st.text(min_size=1, max_size=20)

produces = st.builds(
    Produce,
    targets=st.lists(st.tuples(names, ids), min_size=1, max_size=4,
                     unique_by=lambda t: t[0]).map(tuple),
    data=st.text(max_size=50),
    ready_ms=ms, ttl_ms=ms, retry_ms=ms,
)
finals = st.sampled_from([FINAL_NONE, FINAL_MAX_DELIVERIES, FINAL_EXPIRED])
consumes = st.builds(Consume, queue=names, msg_id=ids, retry_at_ms=ms, epoch=ms, final=finals)
confirms = st.builds(Confirm, queue=names, msg_id=ids)
consume_manys = st.builds(
    ConsumeMany,
    items=st.lists(st.tuples(names, ids, ms, finals), min_size=1, max_size=4,
                   unique_by=lambda t: (t[0], t[1])).map(tuple),
    epoch=ms)
nacks = st.builds(Nack, queue=names, msg_id=ids, ready_ms=ms)
touches = st.builds(Touch, queue=names, msg_id=ids, retry_at_ms=ids, final=finals)
dead_letters = st.builds(
    DeadLetter, queue=names, msg_id=ids,
    reason=st.sampled_from([FINAL_MAX_DELIVERIES, FINAL_EXPIRED]),
    targets=st.lists(st.tuples(names, ids), max_size=3, unique_by=lambda t: t[0]).map(tuple),
    ready_ms=ms, ttl_ms=ms)
configures = st.builds(
    Configure, queue=names,
    settings=st.lists(st.one_of(
        st.tuples(st.just("max_deliveries"), st.integers(0, MAX_DELIVERIES)),
        st.tuples(st.just("dead_letter"), st.text(max_size=255))), max_size=2).map(tuple))
entries = st.one_of(produces, consumes, confirms, st.just(Noop()), consume_manys, nacks,
                    touches, dead_letters, configures)
records = st.builds(Record, trans_id=ids, vote_id=ms, entry=entries)


def through_msgpack(obj, use_list=True):
    return msgpack.unpackb(msgpack.packb(obj), use_list=use_list)


@given(entries)
def test_entry_round_trip(entry):
    wire = entry_to_wire(entry)
    assert type(wire) is list
    assert entry_from_wire(wire) == entry
    assert entry_from_wire(through_msgpack(wire)) == entry
    assert entry_from_wire(through_msgpack(wire, use_list=False)) == entry


@given(records)
def test_record_round_trip(record):
    wire = record_to_wire(record)
    assert record_from_wire(wire) == record
    assert record_from_wire(through_msgpack(wire)) == record
    assert record_from_wire(through_msgpack(wire, use_list=False)) == record


def test_wire_forms_are_tagged_by_kind():
    assert entry_to_wire(Noop()) == [Kind.NOOP]
    assert entry_to_wire(Confirm(queue="q", msg_id=3)) == [Kind.CONFIRM, "q", 3]
    assert entry_to_wire(Consume(queue="q", msg_id=3, retry_at_ms=7)) == [Kind.CONSUME, "q", 3, 7]
    assert entry_to_wire(Produce(targets=(("a", 1), ("b", 2)), data="x", ready_ms=1,
                                 ttl_ms=2, retry_ms=3)) == [Kind.PRODUCE, [["a", 1], ["b", 2]],
                                                            "x", 1, 2, 3]
    assert record_to_wire(Record(trans_id=5, vote_id=2, entry=Noop())) == [5, 2, [Kind.NOOP]]
    # A consume with a receipt or a final delivery has 6 elements; without,
    # the 4 it always had (a log written before receipts reads the same).
    assert entry_to_wire(Consume("q", 3, 7, 0, FINAL_NONE)) == [Kind.CONSUME, "q", 3, 7]
    assert entry_to_wire(Consume("q", 3, 7, 5, FINAL_NONE)) == [Kind.CONSUME, "q", 3, 7, 5, 0]
    assert entry_to_wire(Consume("q", 3, 7, 0, FINAL_EXPIRED)) == [Kind.CONSUME, "q", 3, 7, 0, 2]
    assert entry_from_wire([Kind.CONSUME, "q", 3, 7]) == Consume("q", 3, 7, 0, FINAL_NONE)
    assert entry_from_wire([2, "q", 3, 7, 0, 0]) == Consume("q", 3, 7, 0, FINAL_NONE)
    assert entry_to_wire(ConsumeMany((("a", 1, 9, 0), ("b", 2, 0, 0)), 4)) == [
        Kind.CONSUME_MANY, [["a", 1, 9, 0], ["b", 2, 0, 0]], 4]
    assert entry_to_wire(Nack("q", 3, 100)) == [Kind.NACK, "q", 3, 100]
    assert entry_to_wire(Touch("q", 3, 100, FINAL_EXPIRED)) == [Kind.TOUCH, "q", 3, 100, 2]
    assert entry_to_wire(DeadLetter("q", 3, FINAL_MAX_DELIVERIES, (("d", 1),), 10, 20)) == [
        Kind.DEAD_LETTER, "q", 3, 1, [["d", 1]], 10, 20]
    assert entry_to_wire(DeadLetter("q", 3, FINAL_EXPIRED, (), 10, 20)) == [
        Kind.DEAD_LETTER, "q", 3, 2, [], 10, 20]
    assert entry_to_wire(Configure("q", (("dead_letter", "d"), ("max_deliveries", 3)))) == [
        Kind.CONFIGURE, "q", [["dead_letter", "d"], ["max_deliveries", 3]]]
    # Plain ints on the wire after msgpack, as a peer sends them.
    assert through_msgpack(entry_to_wire(Noop())) == [0]


def test_entries_are_frozen_values():
    e = Consume(queue="q", msg_id=1, retry_at_ms=0)
    with pytest.raises(AttributeError):
        e.msg_id = 2  # type: ignore[misc]
    assert hash(e) == hash(Consume(queue="q", msg_id=1, retry_at_ms=0))


def test_entry_to_wire_rejects_a_non_entry():
    with pytest.raises(TypeError):
        entry_to_wire(["not", "an", "entry"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        entry_to_wire(Record(trans_id=1, vote_id=1, entry=Noop()))  # type: ignore[arg-type]


# -- malformed input ------------------------------------------------------------------

GOOD_PRODUCE = [1, [["a", 1]], "data", 10, 20, 0]
GOOD_CONSUME = [2, "q", 1, 0]
GOOD_CONFIRM = [3, "q", 1]
GOOD_CONSUME6 = [2, "q", 1, 5, 7, 1]
GOOD_MANY = [4, [["q", 1, 5, 0], ["r", 1, 0, 0]], 7]
GOOD_NACK = [5, "q", 1, 10]
GOOD_TOUCH = [6, "q", 1, 10, 0]
GOOD_DEAD_LETTER = [7, "q", 1, 1, [["d", 1]], 10, 20]
GOOD_CONFIGURE = [8, "q", [["max_deliveries", 3], ["dead_letter", "d"]]]


def _with(base: list, index: int, value) -> list:
    out = list(base)
    out[index] = value
    return out


# Values that are wrong in any int field: negative, bool (an int subclass,
# but never what an encoder of ints writes), float, str, None.
BAD_INTS = [-1, True, False, 1.0, "1", None, [1]]

MALFORMED = [
    # not a non-empty list
    None, {}, "x", b"\x01", 1, [], (),
    # unknown or mistyped kinds
    [-1], [9], [99], ["1", "q", 1], [None], [[1]],
    [True, [["a", 1]], "data", 10, 20, 0],  # True == 1: must not pass as PRODUCE
    [False],  # False == 0: must not pass as NOOP
    [1.0, [["a", 1]], "data", 10, 20, 0],
    [2.0, "q", 1, 0], [0.0],
    # wrong lengths, for every kind
    [0, 1], GOOD_PRODUCE[:5], GOOD_PRODUCE + [0], GOOD_CONSUME[:3], GOOD_CONSUME + [0],
    GOOD_CONFIRM[:2], GOOD_CONFIRM + [0], [1], [2], [3],
    # produce targets
    _with(GOOD_PRODUCE, 1, []), _with(GOOD_PRODUCE, 1, None), _with(GOOD_PRODUCE, 1, "a"),
    _with(GOOD_PRODUCE, 1, ["a", 1]), _with(GOOD_PRODUCE, 1, [["a"]]),
    _with(GOOD_PRODUCE, 1, [["a", 1, 2]]), _with(GOOD_PRODUCE, 1, [[1, 1]]),
    _with(GOOD_PRODUCE, 1, [["a", 0]]),  # msg_ids start at 1
    _with(GOOD_PRODUCE, 1, [["a", 1], ["a", 2]]),  # one queue twice: not all-or-nothing
    # non-str strings
    _with(GOOD_PRODUCE, 2, None), _with(GOOD_PRODUCE, 2, b"data"), _with(GOOD_PRODUCE, 2, 5),
    _with(GOOD_CONSUME, 1, None), _with(GOOD_CONSUME, 1, 7), _with(GOOD_CONSUME, 1, b"q"),
    _with(GOOD_CONFIRM, 1, ["q"]),
    # msg_id 0
    _with(GOOD_CONSUME, 2, 0), _with(GOOD_CONFIRM, 2, 0),
    # the new kinds: wrong lengths (a consume has 4 or 6 elements, not 5)
    GOOD_CONSUME6[:5], GOOD_CONSUME6 + [0], GOOD_MANY[:2], GOOD_MANY + [0], GOOD_NACK[:3],
    GOOD_NACK + [0], GOOD_TOUCH[:4], GOOD_TOUCH + [0], GOOD_DEAD_LETTER[:6],
    GOOD_DEAD_LETTER + [0], GOOD_CONFIGURE[:2], GOOD_CONFIGURE + [0], [4], [5], [6], [7], [8],
    # final / reason outside 0-2 (a dead letter needs a reason: not 0)
    _with(GOOD_CONSUME6, 5, 3), _with(GOOD_TOUCH, 4, 3), _with(GOOD_DEAD_LETTER, 3, 0),
    _with(GOOD_DEAD_LETTER, 3, 3),
    # consume items
    _with(GOOD_MANY, 1, []), _with(GOOD_MANY, 1, None), _with(GOOD_MANY, 1, ["q", 1, 5, 0]),
    _with(GOOD_MANY, 1, [["q", 1, 5]]), _with(GOOD_MANY, 1, [["q", 1, 5, 0, 0]]),
    _with(GOOD_MANY, 1, [["q", 1, 5, 0], ["q", 1, 6, 0]]),  # one message twice
    _with(GOOD_MANY, 1, [[1, 1, 5, 0]]), _with(GOOD_MANY, 1, [["q", 0, 5, 0]]),
    _with(GOOD_MANY, 1, [["q", 1, 5, 3]]), _with(GOOD_MANY, 1, [["q", 1, -1, 0]]),
    # a touch's new lease ends at a real time (0 would mean "not in flight")
    _with(GOOD_TOUCH, 3, 0),
    # dead-letter targets (may be empty: deleted)
    _with(GOOD_DEAD_LETTER, 4, None), _with(GOOD_DEAD_LETTER, 4, "d"),
    _with(GOOD_DEAD_LETTER, 4, [["d"]]), _with(GOOD_DEAD_LETTER, 4, [["d", 0]]),
    _with(GOOD_DEAD_LETTER, 4, [["d", 1], ["d", 2]]), _with(GOOD_DEAD_LETTER, 4, [[1, 1]]),
    # settings
    _with(GOOD_CONFIGURE, 2, None), _with(GOOD_CONFIGURE, 2, {"max_deliveries": 3}),
    _with(GOOD_CONFIGURE, 2, [["max_deliveries"]]), _with(GOOD_CONFIGURE, 2, [["colour", 1]]),
    _with(GOOD_CONFIGURE, 2, [[1, 1]]), _with(GOOD_CONFIGURE, 2, [["max_deliveries", -1]]),
    _with(GOOD_CONFIGURE, 2, [["max_deliveries", MAX_DELIVERIES + 1]]),
    _with(GOOD_CONFIGURE, 2, [["max_deliveries", True]]),
    _with(GOOD_CONFIGURE, 2, [["max_deliveries", "3"]]),
    _with(GOOD_CONFIGURE, 2, [["dead_letter", None]]),
    _with(GOOD_CONFIGURE, 2, [["dead_letter", 5]]),
    _with(GOOD_CONFIGURE, 2, [["dead_letter", "d" * 256]]),
    # queue names
    _with(GOOD_NACK, 1, None), _with(GOOD_TOUCH, 1, 5), _with(GOOD_DEAD_LETTER, 1, b"q"),
    _with(GOOD_CONFIGURE, 1, None),
]
for _base, _fields in ((GOOD_PRODUCE, (3, 4, 5)), (GOOD_CONSUME, (2, 3)), (GOOD_CONFIRM, (2,)),
                       (GOOD_CONSUME6, (2, 3, 4, 5)), (GOOD_MANY, (2,)), (GOOD_NACK, (2, 3)),
                       (GOOD_TOUCH, (2, 3, 4)), (GOOD_DEAD_LETTER, (2, 3, 5, 6))):
    for _i in _fields:
        MALFORMED.extend(_with(_base, _i, bad) for bad in BAD_INTS)
MALFORMED.extend(_with(GOOD_PRODUCE, 1, [["a", bad]]) for bad in BAD_INTS)
MALFORMED.extend(_with(GOOD_MANY, 1, [["q", 1, bad, 0]]) for bad in BAD_INTS)
MALFORMED.extend(_with(GOOD_MANY, 1, [["q", 1, 5, bad]]) for bad in BAD_INTS)
MALFORMED.extend(_with(GOOD_DEAD_LETTER, 4, [["d", bad]]) for bad in BAD_INTS)


def test_the_good_inputs_are_good():
    assert type(entry_from_wire(GOOD_PRODUCE)) is Produce
    assert type(entry_from_wire(GOOD_CONSUME)) is Consume
    assert type(entry_from_wire(GOOD_CONFIRM)) is Confirm
    assert entry_from_wire([0]) == Noop()
    assert entry_from_wire((Kind.CONFIRM, "q", 1)) == Confirm(queue="q", msg_id=1)
    assert entry_from_wire(GOOD_CONSUME6) == Consume("q", 1, 5, 7, FINAL_MAX_DELIVERIES)
    assert entry_from_wire(GOOD_MANY) == ConsumeMany((("q", 1, 5, 0), ("r", 1, 0, 0)), 7)
    assert entry_from_wire(GOOD_NACK) == Nack("q", 1, 10)
    assert entry_from_wire(GOOD_TOUCH) == Touch("q", 1, 10, FINAL_NONE)
    assert entry_from_wire(GOOD_DEAD_LETTER) == DeadLetter("q", 1, FINAL_MAX_DELIVERIES,
                                                           (("d", 1),), 10, 20)
    assert entry_from_wire(_with(GOOD_DEAD_LETTER, 4, [])).targets == ()
    assert entry_from_wire(GOOD_CONFIGURE) == Configure(
        "q", (("max_deliveries", 3), ("dead_letter", "d")))
    assert entry_from_wire([8, "q", [["dead_letter", ""]]]) == Configure(
        "q", (("dead_letter", ""),))


@pytest.mark.parametrize("obj", MALFORMED, ids=repr)
def test_entry_from_wire_rejects_malformed(obj):
    with pytest.raises(ValueError):
        entry_from_wire(obj)


@pytest.mark.parametrize("obj", [
    None, [], [1, 1], [1, 1, [0], 4], "abc", {"trans_id": 1},
    [0, 1, [0]],  # trans_ids start at 1
    [-1, 1, [0]], [1, -1, [0]], [True, 1, [0]], [1, True, [0]], [1.0, 1, [0]], [1, 1.0, [0]],
    [1, 1, [7]], [1, 1, []], [1, 1, None], [1, 1, [True]],
], ids=repr)
def test_record_from_wire_rejects_malformed(obj):
    with pytest.raises(ValueError):
        record_from_wire(obj)


@pytest.mark.parametrize("obj", MALFORMED, ids=repr)
def test_record_from_wire_rejects_a_malformed_entry(obj):
    """record_from_wire decodes a produce to one queue inline (its fast
    path): every malformed entry is refused there too."""
    with pytest.raises(ValueError):
        record_from_wire([5, 1, obj])


@pytest.mark.parametrize("trans_id, vote_id", [
    (0, 1), (-1, 1), (True, 1), (1.0, 1), ("1", 1), (None, 1),
    (1, -1), (1, True), (1, 1.0), (1, None)], ids=repr)
def test_record_from_wire_rejects_a_produce_in_a_malformed_record(trans_id, vote_id):
    with pytest.raises(ValueError):
        record_from_wire([trans_id, vote_id, GOOD_PRODUCE])
    assert record_from_wire([1, 0, GOOD_PRODUCE]) == Record(1, 0, entry_from_wire(GOOD_PRODUCE))


wire_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=False),
              st.text(max_size=3), st.binary(max_size=3)),
    lambda children: st.lists(children, max_size=7) | st.dictionaries(st.text(max_size=2), children,
                                                                      max_size=3),
    max_leaves=20,
)


@given(st.one_of(wire_values, st.lists(wire_values, max_size=7).map(
    lambda rest: [1, [["q", 1]]] + rest)))
def test_fuzz_entry_from_wire_decodes_or_raises_value_error(obj):
    try:
        entry = entry_from_wire(obj)
    except ValueError:
        return
    # Whatever decodes is a well-formed entry that encodes back to itself.
    assert entry_from_wire(entry_to_wire(entry)) == entry


@given(st.one_of(st.lists(wire_values, max_size=4), st.lists(wire_values, max_size=7).map(
    lambda rest: [1, 1, [1, [["q", 1]]] + rest]), st.tuples(wire_values, wire_values).map(
    lambda pair: [pair[0], pair[1], [1, [["q", 1]], "d", 1, 2, 0]])))
def test_fuzz_record_from_wire_decodes_or_raises_value_error(obj):
    try:
        record = record_from_wire(obj)
    except ValueError:
        return
    assert record_from_wire(record_to_wire(record)) == record

"""Node-to-node messages: every message survives its wire form, and what a
peer sends is validated where it enters (engines.messages)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qserver.engines.messages import (
    FEATURES,
    Features,
    Forward,
    ForwardBatch,
    ForwardCancel,
    ForwardReplies,
    ForwardReply,
    Hello,
    Ping,
    Pull,
    Push,
    PushReply,
    SnapshotAck,
    SnapshotChunk,
    VoteReply,
    VoteRequest,
    message_from_peer,
    message_from_wire,
    message_to_wire,
)
from qserver.state.entries import Produce, Record, record_to_wire
from qserver.wire.codec import MAX_DEPTH, encode_response
from test_entries import records as any_records

RECORD = Record(trans_id=5, vote_id=2, entry=Produce(
    targets=(("q", 1),), data="x", ready_ms=1, ttl_ms=2, retry_ms=0))

MESSAGES = [
    Hello(vote_id=1, node_id=2, client_host="127.0.0.1", client_port=1111),
    Ping(vote_id=1, node_id=2, leader_id=3, last_vote_id=1, last_trans_id=9),
    VoteRequest(vote_id=4, node_id=2, last_vote_id=1, last_trans_id=9, pre=True),
    VoteReply(vote_id=4, node_id=2, granted=False, pre=False),
    Push(vote_id=2, node_id=1, prev_vote_id=2, prev_trans_id=4, records=(RECORD,),
         commit_id=4, last_trans_id=5, read_round=7),
    PushReply(vote_id=2, node_id=3, match_id=5, read_round=7),
    Pull(vote_id=2, node_id=3, trans_id=4, log_vote_id=1),
    Forward(vote_id=2, node_id=3, request_id=8, request={"action": 1, "queue": "q",
                                                         "data": "x", "tags": [1, 2.5, None]}),
    ForwardReply(vote_id=2, node_id=1, request_id=8, response={"code": 0, "msg_id": 3,
                                                               "nested": {"a": [True]}}),
    SnapshotChunk(vote_id=2, node_id=1, trans_id=9, log_vote_id=2, offset=0, data=b"ab",
                  last=True),
    SnapshotAck(vote_id=2, node_id=3, trans_id=9, offset=2),
    ForwardCancel(vote_id=2, node_id=3, request_id=8),
    # a forwarded long poll and the master's answer with the new fields
    Forward(vote_id=2, node_id=3, request_id=9, request={"action": 2, "queues": ["a", "b"],
                                                         "count": 10, "wait": 2.5}),
    ForwardReply(vote_id=2, node_id=1, request_id=9, response={
        "code": 0, "messages": [{"queue": "a", "msg_id": 1, "data": "x", "deliveries": 2,
                                 "receipt": "2.1.2"}]}),
    Features(vote_id=2, node_id=3, features=FEATURES),
    ForwardBatch(vote_id=2, node_id=3, first_id=10, requests=(
        {"action": 1, "queue": "q", "data": "x"}, {"action": 3, "queue": "q", "msg_id": 4})),
    ForwardReplies(vote_id=2, node_id=1, replies=(
        (11, {"code": 0, "found": True}), (10, {"code": 0, "msg_id": 7, "l": [1, None]}))),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_wire_form(msg):
    wire = msgpack.unpackb(msgpack.packb(message_to_wire(msg), use_bin_type=True), raw=False)
    assert message_from_wire(wire) == msg


@settings(max_examples=200, deadline=None)
@given(st.lists(any_records, max_size=6))
def test_a_push_is_the_bytes_of_its_records_as_record_to_wire_says(records):
    """message_to_wire lays a produce record out itself (its hot path): a
    push of records of any kind must be, byte for byte, the push whose
    records are record_to_wire's lists, and read back the same."""
    records = tuple(Record(10 + i, r.vote_id, r.entry) for i, r in enumerate(records))
    push = Push(vote_id=3, node_id=1, prev_vote_id=2, prev_trans_id=9, records=records,
                commit_id=8, last_trans_id=9 + len(records), read_round=4)
    general = [5, 3, 1, 2, 9, [record_to_wire(r) for r in records], 8, 9 + len(records), 4]
    body = msgpack.packb(message_to_wire(push))
    assert body == msgpack.packb(general)
    assert message_from_wire(msgpack.unpackb(body)) == push


def test_push_and_reply_of_the_release_before_read_rounds_are_accepted():
    push = message_to_wire(MESSAGES[4])[:-1]
    reply = message_to_wire(MESSAGES[5])[:-1]
    assert message_from_wire(push).read_round == 0
    assert message_from_wire(reply).read_round == 0


@pytest.mark.parametrize("trans_ids", [(11, 12), (10, 12), (10, 11, 13), (10, 10), (10, 9)])
def test_a_push_whose_records_do_not_follow_on_is_refused(trans_ids):
    """Every record of a push must follow the one before it, the first
    prev_trans_id (9): the slave appends a push after its last record as
    one run, checking only its ends (Log.extend)."""
    produce = [1, [["q", 1]], "d", 0, 0, 0]
    wire = [5, 3, 1, 2, 9, [[t, 3, produce] for t in trans_ids], 8, 12, 0]
    with pytest.raises(ValueError, match="not consecutive"):
        message_from_wire(wire)
    assert isinstance(message_from_peer(1, wire), str)


@pytest.mark.parametrize("bad, problem", [
    ({"action": 1, "data": b"raw bytes"}, "holds a bytes"),
    ({1: "int key"}, "key that is not a string"),
    ({"x": [{"y": msgpack.ExtType(1, b"z")}]}, "holds a ExtType"),
    ("not a map", "must be a map"),
])
def test_forwarded_maps_must_be_json(bad, problem):
    # An answer that JSON cannot carry drops the message (it is the master's
    # own, and nothing could be relayed of it).
    with pytest.raises(ValueError, match=f"forwarded response.*{problem}|forwarded response "
                                         f"{problem}"):
        message_from_wire([9, 1, 2, 5, bad])
    assert isinstance(message_from_peer(2, [9, 1, 2, 5, bad]), str)
    # A request that JSON cannot carry is refused on its own, with its
    # reason, so that the master answers it (and the rest of its batch).
    single = message_from_wire([8, 1, 2, 5, bad])
    assert isinstance(single, Forward) and isinstance(single.request, str)
    assert problem in single.request and "forwarded request" in single.request
    batch = message_from_wire([16, 1, 2, 5, [{"a": 1}, bad, {"b": 2}]])
    assert isinstance(batch, ForwardBatch) and batch.first_id == 5
    assert batch.requests[0] == {"a": 1} and batch.requests[2] == {"b": 2}
    assert isinstance(batch.requests[1], str) and problem in batch.requests[1]


def _nested(depth: int, inner: object) -> dict:
    """A map with `depth` maps or lists nested inside it, `inner` at the bottom."""
    deep: dict = {}
    node: Any = deep
    for i in range(depth):
        child: Any = {} if i % 2 else []
        if type(node) is dict:
            node["a"] = child
        else:
            node.append(child)
        node = child
    if type(node) is dict:
        node["z"] = inner
    else:
        node.append(inner)
    return deep


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, MAX_DEPTH + 2, 5000])
def test_forwarded_maps_may_not_nest_without_bound(depth):
    with pytest.raises(ValueError, match="nests deeper"):
        message_from_wire([9, 1, 2, 5, _nested(depth, 1)])


def test_the_nesting_bound_is_what_a_relayed_answer_can_be_encoded_with():
    # As deep as the bound allows: accepted, and the client's encoding of it
    # works (the check exists so that relaying an answer cannot fail there).
    ok = _nested(MAX_DEPTH, "x")
    assert message_from_wire([9, 1, 2, 5, ok]).response is ok
    assert encode_response(ok).endswith(b"\n")
    # A bad value deep inside is still named, not just "cannot be encoded".
    with pytest.raises(ValueError, match="holds a bytes"):
        message_from_wire([9, 1, 2, 5, _nested(40, b"raw")])


def test_forward_cancel_wire_form():
    assert message_to_wire(ForwardCancel(vote_id=2, node_id=3, request_id=8)) == [13, 2, 3, 8]


@pytest.mark.parametrize("wire", [
    [13, 2, 3], [13, 2, 3, 8, 0],  # wrong lengths
    [13, 2, 3, -1], [13, 2, 3, True], [13, 2, 3, 1.0], [13, 2, 3, "8"], [13, 2, 3, None],
])
def test_malformed_forward_cancel_is_refused(wire):
    with pytest.raises(ValueError):
        message_from_wire(wire)
    assert isinstance(message_from_peer(3, wire), str)


def test_forward_cancel_in_another_nodes_name_is_dropped():
    reason = message_from_peer(2, [13, 2, 3, 8])
    assert isinstance(reason, str) and "dropped" in reason


def test_features_of_a_later_release_keep_what_this_one_knows():
    assert message_from_wire([15, 2, 3, 1, "more", 9]) == Features(vote_id=2, node_id=3,
                                                                  features=1)


@pytest.mark.parametrize("wire, problem", [
    ([15, 2, 3], "unknown message"), ([15, 2, 3, -1], "features"),
    ([15, 2, 3, "1"], "features"),
    ([16, 2, 3, 1, []], "non-empty list"), ([16, 2, 3, 1, {"a": 1}], "non-empty list"),
    ([16, 2, 3, -1, [{}]], "first_id"),
    ([16, 2, 3, 1, [{}], 0], "unknown message"),
    ([17, 2, 3, []], "pairs"), ([17, 2, 3, [1]], "pairs"), ([17, 2, 3, [1, {}, 2]], "pairs"),
    ([17, 2, 3, [-1, {}]], "request_id"), ([17, 2, 3, [1, "x"]], "forwarded response"),
    ([17, 2, 3, [1, {1: 2}]], "forwarded response has a key"), ([17, 2, 3, {1: {}}], "pairs"),
])
def test_malformed_batches_and_features_are_refused(wire, problem):
    with pytest.raises(ValueError, match=problem):
        message_from_wire(wire)
    assert isinstance(message_from_peer(3, wire), str)

"""Messages between nodes of the native engine, and their wire form.

Every message names the sender (`node_id`) and the sender's election epoch
(`vote_id`). A message is a frozen dataclass inside the node; on the wire it
is a msgpack list `[tag, field, ...]`. `message_from_wire` validates
everything a peer sends: a malformed message is a peer fault (ValueError),
never applied.

This module does no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from ..state.entries import (
    PRODUCE_WIRE_HEAD,
    Produce,
    Record,
    record_from_wire,
    record_to_wire,
)
from ..wire.codec import MAX_DEPTH

if TYPE_CHECKING:
    from ..state.store import SnapshotLoader

__all__ = [
    "Hello", "Ping", "VoteRequest", "VoteReply", "Push", "PushReply", "Pull", "Snapshot",
    "SnapshotChunk", "SnapshotAck", "Forward", "ForwardReply", "ForwardCancel", "TimeoutNow",
    "Features", "ForwardBatch", "ForwardReplies", "FEATURE_FORWARD_BATCH", "FEATURES",
    "Message",
    "message_to_wire", "message_from_wire", "message_from_peer",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """Sent when a link comes up: where clients reach the sender."""

    vote_id: int
    node_id: int
    client_host: str
    client_port: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    """A non-master's liveness beat: keeps the majority count honest and
    tells peers whom the sender follows and how far its log goes."""

    vote_id: int
    node_id: int
    leader_id: int  # 0 = none known
    last_vote_id: int
    last_trans_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class VoteRequest:
    """A candidate's ballot: (last_vote_id, last_trans_id), vote_id, node_id.

    `pre`: a pre-vote, asking "would you vote for me at `vote_id`?" without
    changing anyone's state, so that a node cut off from the master cannot
    push the epoch up and depose a healthy master when it comes back.

    `transfer`: the election a `TimeoutNow` started (leader transfer): a
    voter answers it even while it hears from a live master (the master
    asked for it). On the wire only when true (a seventh field), so that
    nodes of the previous release, which know six fields, read every other
    vote request as before; a transfer's they drop (and log) as malformed,
    and do not vote in it.
    """

    vote_id: int
    node_id: int
    last_vote_id: int
    last_trans_id: int
    pre: bool
    transfer: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class VoteReply:
    vote_id: int
    node_id: int
    granted: bool
    pre: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """The master's state machine at its commit position, for a slave whose
    log ends before the master's retained log begins."""

    vote_id: int
    node_id: int
    trans_id: int  # the state covers every entry up to here
    log_vote_id: int  # vote_id of the entry at trans_id
    # Store.to_wire(); from a streamed snapshot file, the loader it was
    # decoded into (engines/native/snapshots.py)
    state: Sequence[Any] | SnapshotLoader


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotChunk:
    """A piece of the master's newest snapshot file, streamed to a slave
    whose log ends before the master's retained log begins: `data` holds
    the file's bytes from `offset` on; `last` marks the final piece. The
    file (storage.format) carries its own crc, checked once it is whole."""

    vote_id: int
    node_id: int
    trans_id: int  # the snapshot covers every entry up to here
    log_vote_id: int  # vote_id of the entry at trans_id
    offset: int
    data: bytes
    last: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotAck:
    """A slave has stored the snapshot at trans_id up to `offset` bytes: the
    master's flow control (it keeps a few chunks in flight, no more)."""

    vote_id: int
    node_id: int
    trans_id: int
    offset: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Push:
    """Records from the master, continuing the log after (prev_vote_id,
    prev_trans_id). With no records it is the master's heartbeat."""

    vote_id: int
    node_id: int
    prev_vote_id: int
    prev_trans_id: int
    records: tuple[Record, ...]
    commit_id: int  # the master's commit position
    # What the slave should hold: the end of what it was sent if the rest
    # follows by push, else the master's last trans_id (a slave behind it
    # pulls; NativeCore._send_push).
    last_trans_id: int
    # The master's read round when it sent this (NativeCore.read_index): the
    # slave echoes it, and a majority echoing a round sent after a read was
    # asked for proves the master still led then. Absent on the wire from
    # nodes of the previous release: 0.
    read_round: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PushReply:
    """A slave's answer to a continuous Push: its log matches the master's
    up to `match_id`."""

    vote_id: int
    node_id: int
    match_id: int
    read_round: int = 0  # the read_round of the Push this answers


@dataclass(frozen=True, slots=True, kw_only=True)
class Pull:
    """A slave asks for the records after its entry (log_vote_id, trans_id),
    because a Push did not continue its log."""

    vote_id: int
    node_id: int
    trans_id: int
    log_vote_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Forward:
    """A client request relayed by a slave to the master."""

    vote_id: int
    node_id: int
    request_id: int  # the slave's handle for the answer
    # the client's JSON object; a str: why it was refused as it came in
    # (not a map JSON can carry), which the master answers with code -1
    request: dict[str, Any] | str


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardReply:
    vote_id: int
    node_id: int
    request_id: int
    response: dict[str, Any]  # the master's JSON answer


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardCancel:
    """The slave's client left before its forwarded request was answered
    (a parked consume): the master drops it, so that no message is taken
    for a consumer that is gone."""

    vote_id: int
    node_id: int
    request_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeoutNow:
    """Leader transfer (Raft's TimeoutNow): the master of `vote_id` asks
    the receiving slave to start an election at once, without pre-vote and
    without waiting for its timeout. The master sends it once the slave's
    log holds everything up to (last_vote_id, last_trans_id), its own last
    entry, and appends nothing meanwhile; the slave acts on it only if it
    follows that master in that epoch and its log is at least there.
    New in the release that added leader transfer: a node of the previous
    release drops it as an unknown message (and logs it), and the transfer
    times out."""

    vote_id: int
    node_id: int
    last_vote_id: int
    last_trans_id: int


# Features: what this release understands beyond the first release's
# messages, as bits of `Features.features`.
FEATURE_FORWARD_BATCH = 1  # ForwardBatch, answered by ForwardReplies
FEATURES = FEATURE_FORWARD_BATCH


@dataclass(frozen=True, slots=True, kw_only=True)
class Features:
    """Sent when a link comes up, by the release that added it: what the
    sender understands beyond the first release's messages (FEATURE_* bits),
    so that its peer sends it those only. A node of an earlier release
    drops it as an unknown message (and logs it), never sends one, and so
    is never sent anything it does not know."""

    vote_id: int
    node_id: int
    features: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardBatch:
    """The client requests a slave relays to the master in one loop turn,
    as one message (to a master whose Features include
    FEATURE_FORWARD_BATCH): requests[i] has request_id first_id + i. The
    master answers them with ForwardReplies."""

    vote_id: int
    node_id: int
    first_id: int
    # the clients' JSON objects; a str as in Forward.request: a request
    # refused on its own, so that one bad request costs none of the others
    requests: tuple[dict[str, Any] | str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardReplies:
    """The master's answers, in one message, to the requests of a slave's
    ForwardBatch answered in one loop turn: (request_id, response) pairs."""

    vote_id: int
    node_id: int
    replies: tuple[tuple[int, dict[str, Any]], ...]


Message = (Hello | Ping | VoteRequest | VoteReply | Push | PushReply | Pull | Snapshot
           | SnapshotChunk | SnapshotAck | Forward | ForwardReply | ForwardCancel | TimeoutNow
           | Features | ForwardBatch | ForwardReplies)




def message_to_wire(msg: Message) -> list[Any]:
    """Encode a message as a msgpack-friendly list."""
    # `type(msg) is C` rather than isinstance: one identity test per kind,
    # Push (the bulk of the traffic) first; mypy narrows on it too.
    if type(msg) is Push:
        # A produce record (the bulk of a push) as record_to_wire's list,
        # built as tuples with the entry's fields in place: msgpack writes
        # tuples as the arrays record_to_wire makes, so the bytes are the
        # same (a test holds it), for half the CPU.
        head = PRODUCE_WIRE_HEAD
        return [5, msg.vote_id, msg.node_id, msg.prev_vote_id, msg.prev_trans_id,
                [(r[0], r[1], head + r[2]) if type(r[2]) is Produce else record_to_wire(r)
                 for r in msg.records],
                msg.commit_id, msg.last_trans_id, msg.read_round]
    if type(msg) is Hello:
        return [1, msg.vote_id, msg.node_id, msg.client_host, msg.client_port]
    if type(msg) is Ping:
        return [2, msg.vote_id, msg.node_id, msg.leader_id, msg.last_vote_id, msg.last_trans_id]
    if type(msg) is VoteRequest:
        if msg.transfer:  # 7 fields: only nodes that know leader transfer read it
            return [3, msg.vote_id, msg.node_id, msg.last_vote_id, msg.last_trans_id, msg.pre,
                    True]
        return [3, msg.vote_id, msg.node_id, msg.last_vote_id, msg.last_trans_id, msg.pre]
    if type(msg) is VoteReply:
        return [4, msg.vote_id, msg.node_id, msg.granted, msg.pre]
    if type(msg) is Snapshot:
        return [10, msg.vote_id, msg.node_id, msg.trans_id, msg.log_vote_id, msg.state]
    if type(msg) is PushReply:
        return [6, msg.vote_id, msg.node_id, msg.match_id, msg.read_round]
    if type(msg) is Pull:
        return [7, msg.vote_id, msg.node_id, msg.trans_id, msg.log_vote_id]
    if type(msg) is Forward:
        return [8, msg.vote_id, msg.node_id, msg.request_id, msg.request]
    if type(msg) is ForwardReply:
        return [9, msg.vote_id, msg.node_id, msg.request_id, msg.response]
    if type(msg) is ForwardBatch:
        return [16, msg.vote_id, msg.node_id, msg.first_id, list(msg.requests)]
    if type(msg) is ForwardReplies:  # flat: request_id, response, request_id, ...
        return [17, msg.vote_id, msg.node_id,
                [x for pair in msg.replies for x in pair]]
    if type(msg) is Features:
        return [15, msg.vote_id, msg.node_id, msg.features]
    if type(msg) is SnapshotChunk:
        return [11, msg.vote_id, msg.node_id, msg.trans_id, msg.log_vote_id, msg.offset,
                msg.data, msg.last]
    if type(msg) is SnapshotAck:
        return [12, msg.vote_id, msg.node_id, msg.trans_id, msg.offset]
    if type(msg) is ForwardCancel:
        return [13, msg.vote_id, msg.node_id, msg.request_id]
    if type(msg) is TimeoutNow:
        return [14, msg.vote_id, msg.node_id, msg.last_vote_id, msg.last_trans_id]
    raise TypeError(f"not a message: {msg!r}")


def _n(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} must be a non-negative integer")
    return value


def _bool(value: object, what: str) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{what} must be a bool")
    return value


# A forwarded request or answer nests no deeper than a client's request may
# (wire.codec.MAX_DEPTH: what orjson encodes); the walk below goes without
# recursion, so a peer's deep map costs no stack.
_dumps = orjson.dumps

_JSON_SCALARS = (str, int, float, bool, type(None))


def _json_map(value: object, what: str) -> dict[str, Any]:
    """A forwarded request or answer: a map that JSON can carry (string
    keys; strings, numbers, booleans, null, lists and maps of them, nested
    no deeper than orjson encodes), so that relaying it to a client cannot
    fail; msgpack also has bytes, integer keys and extension types. The
    test is orjson's own encoding, native code (a walk in Python cost
    twice as much per relayed request); the walk only words its reason."""
    if type(value) is not dict:
        raise ValueError(f"{what} must be a map")
    try:
        _dumps(value)
    except orjson.JSONEncodeError as exc:
        _json_walk(value, what)  # raises with the reason it finds
        raise ValueError(f"{what} cannot be encoded as JSON: {exc}") from None
    return value


def _json_walk(value: dict[str, Any], what: str) -> None:
    """Raise the reason why `value` is not a map that JSON can carry, if
    it finds one."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"{what} nests deeper than {MAX_DEPTH}")
        if type(item) is dict:
            for key, v in item.items():
                if type(key) is not str:
                    raise ValueError(f"{what} has a key that is not a string")
                if type(v) not in _JSON_SCALARS:
                    stack.append((v, depth + 1))
        elif type(item) is list:
            for v in item:
                if type(v) not in _JSON_SCALARS:
                    stack.append((v, depth + 1))
        elif type(item) not in _JSON_SCALARS:
            raise ValueError(f"{what} holds a {type(item).__name__}, which JSON cannot carry")


def _forwarded(value: object) -> dict[str, Any] | str:
    """A forwarded request, or why it cannot be served (see Forward)."""
    try:
        return _json_map(value, "forwarded request")
    except ValueError as exc:
        return str(exc)


def message_from_wire(obj: object) -> Message:
    """Decode and validate a peer's message; raises ValueError."""
    if not isinstance(obj, (list, tuple)) or len(obj) < 3:
        raise ValueError("message must be a list [tag, vote_id, node_id, ...]")
    tag, vote_id, node_id = obj[0], _n(obj[1], "vote_id"), _n(obj[2], "node_id")
    n = len(obj)
    if tag == 5 and (n == 8 or n == 9):  # 8: a node of the release before read rounds
        if not isinstance(obj[5], (list, tuple)):
            raise ValueError("push records must be a list")
        prev = _n(obj[4], "prev_trans_id")
        decoded: list[Record] = []
        append = decoded.append
        expect = prev + 1
        for r in obj[5]:  # decoded and checked in one pass: this runs per record
            record = record_from_wire(r)
            if record[0] != expect:  # (its trans_id)
                raise ValueError("push records are not consecutive")
            append(record)
            expect += 1
        records = tuple(decoded)
        return Push(vote_id=vote_id, node_id=node_id, prev_vote_id=_n(obj[3], "prev_vote_id"),
                    prev_trans_id=prev, records=records, commit_id=_n(obj[6], "commit_id"),
                    last_trans_id=_n(obj[7], "last_trans_id"),
                    read_round=_n(obj[8], "read_round") if n == 9 else 0)
    if tag == 1 and n == 5:
        if type(obj[3]) is not str:
            raise ValueError("client_host must be a string")
        return Hello(vote_id=vote_id, node_id=node_id, client_host=obj[3],
                     client_port=_n(obj[4], "client_port"))
    if tag == 2 and n == 6:
        return Ping(vote_id=vote_id, node_id=node_id, leader_id=_n(obj[3], "leader_id"),
                    last_vote_id=_n(obj[4], "last_vote_id"),
                    last_trans_id=_n(obj[5], "last_trans_id"))
    if tag == 3 and (n == 6 or n == 7):  # 7: a leader transfer's election
        return VoteRequest(vote_id=vote_id, node_id=node_id,
                           last_vote_id=_n(obj[3], "last_vote_id"),
                           last_trans_id=_n(obj[4], "last_trans_id"), pre=_bool(obj[5], "pre"),
                           transfer=_bool(obj[6], "transfer") if n == 7 else False)
    if tag == 4 and n == 5:
        return VoteReply(vote_id=vote_id, node_id=node_id, granted=_bool(obj[3], "granted"),
                         pre=_bool(obj[4], "pre"))
    if tag == 10 and n == 6:
        if not isinstance(obj[5], (list, tuple)):
            raise ValueError("snapshot state must be a list")
        return Snapshot(vote_id=vote_id, node_id=node_id, trans_id=_n(obj[3], "trans_id"),
                        log_vote_id=_n(obj[4], "log_vote_id"), state=obj[5])
    if tag == 6 and (n == 4 or n == 5):
        return PushReply(vote_id=vote_id, node_id=node_id, match_id=_n(obj[3], "match_id"),
                         read_round=_n(obj[4], "read_round") if n == 5 else 0)
    if tag == 7 and n == 5:
        return Pull(vote_id=vote_id, node_id=node_id, trans_id=_n(obj[3], "trans_id"),
                    log_vote_id=_n(obj[4], "log_vote_id"))
    if tag == 8 and n == 5:
        return Forward(vote_id=vote_id, node_id=node_id, request_id=_n(obj[3], "request_id"),
                       request=_forwarded(obj[4]))
    if tag == 9 and n == 5:
        return ForwardReply(vote_id=vote_id, node_id=node_id, request_id=_n(obj[3], "request_id"),
                            response=_json_map(obj[4], "forwarded response"))
    if tag == 16 and n == 5:
        requests = obj[4]
        if not isinstance(requests, (list, tuple)) or not requests:
            raise ValueError("forward batch requests must be a non-empty list")
        return ForwardBatch(vote_id=vote_id, node_id=node_id, first_id=_n(obj[3], "first_id"),
                            requests=tuple(_forwarded(r) for r in requests))
    if tag == 17 and n == 4:
        flat = obj[3]
        if not isinstance(flat, (list, tuple)) or not flat or len(flat) % 2:
            raise ValueError("forward replies must be a non-empty list of id, answer pairs")
        it = iter(flat)
        return ForwardReplies(vote_id=vote_id, node_id=node_id, replies=tuple(
            (_n(request_id, "request_id"), _json_map(response, "forwarded response"))
            for request_id, response in zip(it, it)))
    if tag == 15 and n >= 4:  # more fields: a later release's, ignored
        return Features(vote_id=vote_id, node_id=node_id, features=_n(obj[3], "features"))
    if tag == 11 and n == 8:
        if type(obj[6]) is not bytes:
            raise ValueError("snapshot chunk data must be bytes")
        return SnapshotChunk(vote_id=vote_id, node_id=node_id, trans_id=_n(obj[3], "trans_id"),
                             log_vote_id=_n(obj[4], "log_vote_id"), offset=_n(obj[5], "offset"),
                             data=obj[6], last=_bool(obj[7], "last"))
    if tag == 12 and n == 5:
        return SnapshotAck(vote_id=vote_id, node_id=node_id, trans_id=_n(obj[3], "trans_id"),
                           offset=_n(obj[4], "offset"))
    if tag == 13 and n == 4:
        return ForwardCancel(vote_id=vote_id, node_id=node_id,
                             request_id=_n(obj[3], "request_id"))
    if tag == 14 and n == 5:
        return TimeoutNow(vote_id=vote_id, node_id=node_id,
                          last_vote_id=_n(obj[3], "last_vote_id"),
                          last_trans_id=_n(obj[4], "last_trans_id"))
    raise ValueError(f"unknown message tag {tag!r} with {n} fields")


def message_from_peer(peer_id: int, obj: object) -> Message | str:
    """A message as received from the authenticated peer `peer_id`: the
    decoded message, or the reason to drop it (malformed, or sent in
    another node's name)."""
    try:
        msg = message_from_wire(obj)
    except ValueError as exc:
        return f"bad message from node {peer_id}: {exc}"
    if msg.node_id != peer_id:
        return f"node {peer_id} sent a message as node {msg.node_id}; dropped"
    return msg

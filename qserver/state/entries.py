"""Log entries: the decisions the master made, in a form any node can apply.

Theory of operation
-------------------
A client request is turned into an entry by `Store.decide()` on the master.
The entry records every decision that depended on the master's clock or on
its choice: the msg_id of a new message, the absolute ready time and ttl in
milliseconds, which message a consume delivered and when it comes back.
Applying an entry (`Store.apply()`) therefore never reads a clock or a
random source, so every node that applies the same entries in the same order
ends with the same state.

Each entry travels and is stored inside a `Record` that carries its global
position (`trans_id`, gap-free from 1) and the election epoch (`vote_id`)
under which the master wrote it.

Rules
- Entries are immutable values; nothing mutates one after `decide()`.
  They are NamedTuples rather than the house style's frozen dataclasses, on
  purpose: a produce creates an entry and a record on the hot path, and
  tuples of plain values are both cheaper to build and untracked by the
  cyclic garbage collector, whose full passes over 100,000 retained log
  records otherwise cost more than the rest of a produce (bench/).
- The wire/disk form is a plain list (msgpack friendly), tagged by `Kind`.
  `entry_from_wire` validates a list that came from a peer or a disk and
  raises `ValueError` on anything malformed; it never returns a half entry.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

__all__ = [
    "Kind",
    "Noop",
    "Produce",
    "Consume",
    "Confirm",
    "Entry",
    "Record",
    "entry_to_wire",
    "entry_from_wire",
    "record_to_wire",
    "record_from_wire",
]


class Kind(enum.IntEnum):
    NOOP = 0
    PRODUCE = 1
    CONSUME = 2
    CONFIRM = 3


class Noop(NamedTuple):
    """An entry that changes nothing; a new master writes one to commit the
    entries of earlier epochs (the replication issue uses it)."""


class Produce(NamedTuple):
    """New message(s): one per real queue, all or nothing.

    `targets` holds (queue, msg_id) pairs; a plain queue has one, a virtual
    queue one per real queue, in the configured order.
    """

    targets: tuple[tuple[str, int], ...]
    data: str
    ready_ms: int  # absolute unix ms at which the message may be delivered
    ttl_ms: int  # absolute unix ms; a delivery whose next retry reaches it is the last
    retry_ms: int  # 0 = at-most-once; > 0 = redelivered this long after a consume


class Consume(NamedTuple):
    """Delivery of `msg_id` from `queue`.

    `retry_at_ms` is the absolute time at which the message becomes
    deliverable again unless confirmed; 0 means the message is deleted by
    this delivery (at-most-once, or its last delivery before the ttl).
    """

    queue: str
    msg_id: int
    retry_at_ms: int


class Confirm(NamedTuple):
    """Deletion of a delivered (or still pending) message by its consumer."""

    queue: str
    msg_id: int


Entry = Noop | Produce | Consume | Confirm


class Record(NamedTuple):
    """An entry at its place in the log."""

    trans_id: int  # global position, gap-free, starting at 1
    vote_id: int  # election epoch of the master that wrote it
    entry: Entry


def entry_to_wire(entry: Entry) -> list[Any]:
    """Encode an entry as a msgpack-friendly list."""
    if type(entry) is Produce:
        return [Kind.PRODUCE, [list(t) for t in entry.targets], entry.data,
                entry.ready_ms, entry.ttl_ms, entry.retry_ms]
    if type(entry) is Consume:
        return [Kind.CONSUME, entry.queue, entry.msg_id, entry.retry_at_ms]
    if type(entry) is Confirm:
        return [Kind.CONFIRM, entry.queue, entry.msg_id]
    if type(entry) is Noop:
        return [Kind.NOOP]
    raise TypeError(f"not an entry: {entry!r}")


def _int(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _id(value: object, what: str) -> int:
    # msg_ids and trans_ids start at 1: a 0 is malformed, and must be refused
    # here (a peer's fault) rather than fail later in apply (our fault).
    if type(value) is not int or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _str(value: object, what: str) -> str:
    if type(value) is not str:
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    return value


def entry_from_wire(obj: object) -> Entry:
    """Decode and validate an entry; raises ValueError when malformed."""
    if not isinstance(obj, (list, tuple)) or not obj:
        raise ValueError("entry must be a non-empty list")
    kind = obj[0]
    # Not `kind == Kind.X` alone: True == 1 and 1.0 == 1 would pass it.
    if type(kind) is not int and type(kind) is not Kind:
        raise ValueError(f"entry kind must be an integer, got {kind!r}")
    if kind == Kind.PRODUCE and len(obj) == 6:
        raw_targets = obj[1]
        if not isinstance(raw_targets, (list, tuple)) or not raw_targets:
            raise ValueError("produce targets must be a non-empty list")
        targets = []
        for t in raw_targets:
            if not isinstance(t, (list, tuple)) or len(t) != 2:
                raise ValueError("produce target must be [queue, msg_id]")
            targets.append((_str(t[0], "queue"), _id(t[1], "msg_id")))
        if len({name for name, _ in targets}) != len(targets):
            raise ValueError("produce targets name a queue twice")
        return Produce(targets=tuple(targets), data=_str(obj[2], "data"),
                       ready_ms=_int(obj[3], "ready_ms"), ttl_ms=_int(obj[4], "ttl_ms"),
                       retry_ms=_int(obj[5], "retry_ms"))
    if kind == Kind.CONSUME and len(obj) == 4:
        return Consume(queue=_str(obj[1], "queue"), msg_id=_id(obj[2], "msg_id"),
                       retry_at_ms=_int(obj[3], "retry_at_ms"))
    if kind == Kind.CONFIRM and len(obj) == 3:
        return Confirm(queue=_str(obj[1], "queue"), msg_id=_id(obj[2], "msg_id"))
    if kind == Kind.NOOP and len(obj) == 1:
        return Noop()
    raise ValueError(f"unknown entry kind {kind!r} with {len(obj)} fields")


def record_to_wire(record: Record) -> list[Any]:
    """Encode a record as [trans_id, vote_id, entry]."""
    return [record.trans_id, record.vote_id, entry_to_wire(record.entry)]


def record_from_wire(obj: object) -> Record:
    """Decode and validate a record; raises ValueError when malformed."""
    if not isinstance(obj, (list, tuple)) or len(obj) != 3:
        raise ValueError("record must be [trans_id, vote_id, entry]")
    return Record(trans_id=_id(obj[0], "trans_id"), vote_id=_int(obj[1], "vote_id"),
                  entry=entry_from_wire(obj[2]))
